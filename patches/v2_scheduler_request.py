"""v2 -- ``Scheduler`` and ``Request`` constructors.

Delta (vLLM 0.11.1): ``Scheduler(vllm_config, kv_cache_config, structured_output_manager,
block_size, ...)`` gained a required ``block_size``; stock speculators 0.3.0 does not
pass it: TypeError.

``Request`` still accepts the stock arguments (``request_id``, ``prompt_token_ids``,
``sampling_params``, ``pooling_params``, ``eos_token_id``, ``arrival_time``) through 0.16;
the probe binds them to the installed signature, so a release that drops one (0.17.0
removed ``eos_token_id``) is refused up front instead of failing inside ``generate()``.

How: the ``Scheduler`` name in the generator module is wrapped; ``block_size`` is given the
value vLLM's own ``EngineCore`` uses: ``cache_config.block_size`` times the decode and
prefill context-parallel sizes.

Detection: ``block_size`` is a required parameter of ``Scheduler`` (new) or absent (old);
the stock ``Request`` keyword arguments must bind.

Covers: vLLM 0.11.1 - 0.16.x with speculators 0.3.x.
Remove when speculators 0.3.x is no longer supported (0.4.0 passes ``block_size``).
"""

from __future__ import annotations


from speculators_compat.registry import Patch, Probe

from speculators_compat.sources import render

from ._common import (
    GENERATOR,
    REQUEST,
    SCHEDULER,
    SPECULATORS_03,
    VALIDATED_RANGE,
    binds,
    params,
    required,
    static_params,
)

STOCK_REQUEST_KWARGS = (
    "request_id",
    "prompt_token_ids",
    "sampling_params",
    "pooling_params",
    "eos_token_id",
    "arrival_time",
)


def _judge(request, sched) -> Probe:
    why = binds(request, STOCK_REQUEST_KWARGS)
    if why:
        return Probe.unknown(f"the stock Request(...) call does not bind ({why}); found vllm.v1.request.Request{render(request)}")
    if "block_size" in sched and required(sched["block_size"]):
        return Probe.new("Scheduler requires block_size; stock Request arguments bind")
    if "block_size" not in sched:
        return Probe.old("Scheduler takes no block_size; stock Request arguments bind")
    return Probe.unknown(f"unexpected Scheduler signature Scheduler{render(sched)}")


def probe(module) -> Probe:
    return _judge(params(module.Request), params(module.Scheduler))


def static_probe(view) -> Probe:
    return _judge(static_params(view, REQUEST, "Request"), static_params(view, SCHEDULER, "Scheduler"))


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


def apply(module, patcher) -> None:
    patcher.wrap(module, "Scheduler", _scheduler)


PATCH = Patch(
    id="v2",
    title="Scheduler and Request constructors",
    delta="Scheduler(+block_size required); Request(stock kwargs must bind)",
    api="vllm.v1.core.sched.scheduler.Scheduler / vllm.v1.request.Request",
    side="driver",
    target=GENERATOR,
    vllm=VALIDATED_RANGE,
    speculators=SPECULATORS_03,
    probe=probe,
    static_probe=static_probe,
    apply=apply,
    upstream="speculators 0.4.0 passes block_size",
    remove_when="speculators 0.3.x is no longer supported",
)
