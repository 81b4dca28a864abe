"""v2 -- ``Scheduler(block_size=)`` became required.

Delta (vLLM 0.11.1): ``Scheduler(vllm_config, kv_cache_config, structured_output_manager,
block_size, ...)`` gained a required ``block_size``; stock speculators 0.3.0 does not pass it:
TypeError when the generator builds its scheduler (after the model has loaded).

How: the ``Scheduler`` name in the generator module is wrapped; ``block_size`` is given the
value vLLM's own ``EngineCore`` uses: ``cache_config.block_size`` times the decode and prefill
context-parallel sizes.

Detection: ``block_size`` is a required parameter of ``Scheduler`` (new) or absent (old); any
other shape is refused. That the whole edited call binds (``hash_block_size`` and whatever comes
next) is checked by ``stock-calls``.

Remove when speculators 0.3.x is no longer supported (0.4.0 passes ``block_size``).
"""

from __future__ import annotations

from speculators_compat.patching import Edit, Probe, declare, render, required

from .._probes import params, static_params, wrapping


def _judge(sched) -> Probe:
    if "block_size" in sched and required(sched["block_size"]):
        return Probe.new("Scheduler requires block_size")
    if "block_size" not in sched:
        return Probe.old("Scheduler takes no block_size")
    return Probe.unknown(f"unexpected Scheduler signature Scheduler{render(sched)}")


def probe(module) -> Probe:
    return _judge(params(module.Scheduler))


def static_probe(view) -> Probe:
    return _judge(static_params(view, "Scheduler"))


def _scheduler(wrapped, instance, args, kwargs):
    if "block_size" not in kwargs:
        config = kwargs.get("vllm_config", args[0] if args else None)
        parallel = config.parallel_config
        kwargs["block_size"] = (
            config.cache_config.block_size
            * getattr(parallel, "decode_context_parallel_size", 1)
            * getattr(parallel, "prefill_context_parallel_size", 1)
        )
    return wrapped(*args, **kwargs)


apply = wrapping({"Scheduler": _scheduler})


PATCH = declare(
    title="Scheduler gets the block_size vLLM 0.11.1 made required",
    delta="Scheduler(+block_size required)",
    api="vllm.v1.core.sched.scheduler.Scheduler",
    calls={"Scheduler": Edit(add=("block_size",))},
    upstream="speculators 0.4.0 passes block_size",
)
