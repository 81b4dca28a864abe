"""v9 -- the KV cache is backed from the start: vLLM 0.34's extensible KV cache off.

Delta (vLLM 0.34.0): ``CacheConfig.enable_extensible_kv_cache`` (default ``None``: resolved on
where the driver supports virtual memory, i.e. on CUDA). With it on, the workers'
``initialize_from_config`` only reserves the KV cache's address range; pages are committed by
the engine's warm-up (``compile_or_warm_up_model``) and ``extend_kv_cache(num_blocks)``, both
of which vLLM's engine core calls and the stock generator does not: its steps would run on a KV
cache without the pages the scheduler's blocks need.

How: the ``CacheConfig`` name in the generator module is wrapped to pass
``enable_extensible_kv_cache=False`` (unless the caller passed it): the workers allocate the
whole KV cache in ``initialize_from_config``, as every release up to 0.33 does -- what vLLM
itself falls back to where the extensible cache is unsupported. The stock sizing
(``gpu_memory_utilization`` x 0.2 of free memory) is unchanged.

Detection: ``CacheConfig`` has an ``enable_extensible_kv_cache`` parameter: new; none: old.

Remove when speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

from speculators_compat.patching import Probe, declare

from .._probes import keyword_patch

FIELD = "enable_extensible_kv_cache"


def _judge(p) -> Probe:
    if FIELD in p:
        return Probe.new(f"CacheConfig takes {FIELD} (default {p[FIELD].default!r}: on where the driver "
                         "has virtual memory; pages committed by the engine's warm-up)")
    return Probe.old(f"CacheConfig has no {FIELD}: the KV cache is allocated whole")


probe, static_probe, apply, CALLS = keyword_patch("CacheConfig", FIELD, False, _judge, callers_choice=True)


PATCH = declare(
    title="the KV cache allocated whole (vLLM 0.34's extensible KV cache needs the engine's warm-up)",
    delta="CacheConfig.enable_extensible_kv_cache (on with CUDA VMM; pages committed by the engine core) -> off",
    api=f"vllm.config.CacheConfig({FIELD}=)",
    vllm=">=0.34",
    after=("v1-prefix-caching", "cpu-block-size"),  # all wrap the generator's CacheConfig name (other keywords)
    calls=CALLS,
    upstream="vLLM 0.34.0 (extensible KV cache on by default on CUDA); speculators 0.3.x builds its own CacheConfig",
)
