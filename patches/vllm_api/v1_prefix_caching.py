"""v1-prefix-caching -- prefix caching must be off for extraction.

Delta (vLLM 0.12.0): ``CacheConfig.enable_prefix_caching`` defaults to ``True`` (was
``None``). Stock speculators 0.3.0 builds ``Request`` objects without a ``block_hasher``,
so the first ``schedule()`` of a 16+ token prompt fails with
``AssertionError: len(request.block_hashes) >= num_full_blocks``. Giving requests a block
hasher would be worse: prompts sharing a prefix would skip the cached tokens and their
hidden states would never be computed (silently fewer rows, attributed to the wrong
sequences).

How: the ``CacheConfig`` name in the generator module is wrapped to pass
``enable_prefix_caching=False``.

Detection: the default of ``CacheConfig(enable_prefix_caching=)``: ``True`` -> applies,
``None``/``False`` -> not needed, parameter missing -> refused.

Remove when speculators 0.3.x is no longer supported (0.4.0 sets it itself).
"""

from __future__ import annotations

from speculators_compat.patching import Probe, declare, render

from .._probes import keyword_patch


def _judge(p) -> Probe:
    if "enable_prefix_caching" not in p:
        return Probe.unknown(f"no enable_prefix_caching parameter in CacheConfig{render(p)}")
    default = p["enable_prefix_caching"].default
    if default is True:
        return Probe.new("CacheConfig.enable_prefix_caching defaults to True")
    return Probe.old(f"CacheConfig.enable_prefix_caching defaults to {default!r}")


probe, static_probe, apply, CALLS = keyword_patch("CacheConfig", "enable_prefix_caching", False, _judge)


PATCH = declare(
    title="prefix caching off (vLLM 0.12 turned it on; shared prefixes lose rows)",
    delta="CacheConfig.enable_prefix_caching default None -> True",
    api="vllm.config.CacheConfig(enable_prefix_caching=)",
    vllm=">=0.12",
    calls=CALLS,
    upstream="speculators 0.4.0 disables prefix caching in its CacheConfig",
)
