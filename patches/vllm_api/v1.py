"""v1 -- vLLM 0.12 engine configuration calls: ``SchedulerConfig`` InitVars, ``get_kv_cache_config_from_groups``.

Delta (vLLM 0.12.0):
  * ``SchedulerConfig``: ``max_model_len`` and ``is_encoder_decoder`` became ``InitVar``
    fields without defaults; stock speculators 0.3.0 passes only ``max_model_len`` and
    pydantic fails with "is_encoder_decoder Field required".
  * ``get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, kv_cache_specs,
    available_memory)`` lost ``kv_cache_specs``: TypeError.

How: the names ``SchedulerConfig`` and ``get_kv_cache_config_from_groups`` in the
generator module are wrapped; the first gets ``is_encoder_decoder=False`` (the generator
extracts from decoder-only models), the second drops ``kv_cache_specs``.

Detection: signature probes on both callables as the generator module sees them; each
half applies only where its own delta is present.

Upstream: fixed in speculators 0.4.0 (vllm-project/speculators, generator rewritten for
vLLM 0.12+). Remove when speculators 0.3.x support is dropped.
"""

from __future__ import annotations

from speculators_compat.patching import Edit, Probe, Shape, declare, render, required

from .._probes import params, static_params


def _parts(sched, kv) -> dict[str, Shape]:
    """The shape of each half: the scheduler config's InitVar, the KV-cache config helper."""
    encoder_decoder = sched.get("is_encoder_decoder")
    parts = {"scheduler_config": Shape.NEW if encoder_decoder is not None and required(encoder_decoder) else Shape.OLD}
    if list(kv)[:3] == ["vllm_config", "kv_cache_groups", "available_memory"]:
        parts["kv_cache_config"] = Shape.NEW
    elif "kv_cache_specs" in kv:
        parts["kv_cache_config"] = Shape.OLD
    else:
        parts["kv_cache_config"] = Shape.UNKNOWN
    return parts


def _judge(sched, kv) -> Probe:
    parts = _parts(sched, kv)
    if Shape.UNKNOWN in parts.values():
        return Probe.unknown(
            "expected get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, "
            f"[kv_cache_specs,] available_memory), found get_kv_cache_config_from_groups{render(kv)}"
        )
    text = ", ".join(f"{k}: {v.value}" for k, v in parts.items())
    if all(v is Shape.OLD for v in parts.values()):
        return Probe.old(text)
    return Probe.new(text)


def probe(module) -> Probe:
    return _judge(params(module.SchedulerConfig), params(module.get_kv_cache_config_from_groups))


def static_probe(view) -> Probe:
    return _judge(static_params(view, "SchedulerConfig"), static_params(view, "get_kv_cache_config_from_groups"))


def _scheduler_config(wrapped, instance, args, kwargs):
    kwargs.setdefault("is_encoder_decoder", False)
    return wrapped(*args, **kwargs)


def _kv_cache_config(wrapped, instance, args, kwargs):
    kwargs.pop("kv_cache_specs", None)
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    parts = _parts(params(module.SchedulerConfig), params(module.get_kv_cache_config_from_groups))
    if parts["scheduler_config"] is Shape.NEW:
        patcher.wrap(module, "SchedulerConfig", _scheduler_config)
    if parts["kv_cache_config"] is Shape.NEW:
        patcher.wrap(module, "get_kv_cache_config_from_groups", _kv_cache_config)


PATCH = declare(
    title="vLLM 0.12's config calls: SchedulerConfig(is_encoder_decoder=), no kv_cache_specs",
    delta="SchedulerConfig(InitVar is_encoder_decoder required); "
    "get_kv_cache_config_from_groups(-kv_cache_specs)",
    api="vllm.config.SchedulerConfig / vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
    vllm=">=0.12",
    calls={
        "SchedulerConfig": Edit(add=("is_encoder_decoder",)),
        "get_kv_cache_config_from_groups": Edit(drop=("kv_cache_specs",)),
    },
    upstream="speculators 0.4.0 builds its configs for vLLM 0.12+",
)
