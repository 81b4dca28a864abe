"""cpu-kimi-k25-device -- vLLM 0.15's Kimi-K2.5 model asks CUDA for its device (CPU platform).

Problem (vLLM 0.15.x, CPU platform): ``KimiK25ForConditionalGeneration.__init__`` sets
``self.device = torch.cuda.current_device()`` and moves its vision tower and projector there.
On a machine with no GPU every worker fails while it builds the model -- "Found no NVIDIA driver
on your system" with PyPI's (CUDA) torch, "Torch not compiled with CUDA enabled" with a CPU
build -- before any weight loads. vLLM 0.16 asks ``current_platform.current_device()`` instead,
which on the CPU platform is ``torch.cpu.current_device()`` (``"cpu"``). A GPU node is not
affected; this patch is what lets the tests run the tiny Kimi-K2.5 on 0.15.x's CPU build.

How: while ``KimiK25ForConditionalGeneration.__init__`` runs in a worker on vLLM's CPU platform,
``torch.cuda.current_device()`` answers ``"cpu"`` (``torch.cpu.current_device()``), as vLLM 0.16 does; any
other call (another thread, outside that constructor) is untouched. The wrappers are installed
only where the probe finds the CUDA call, so the Kimi-K2.5 module is imported only there.

Detection (the installed source of the constructor, read without importing it): vLLM's current
platform is the CPU and ``KimiK25ForConditionalGeneration.__init__`` calls
``torch.cuda.current_device()`` (new); another platform, no Kimi-K2.5 model in this vLLM (before
0.15), or a constructor that no longer calls it (0.16) is old (not needed).

Covers: vLLM 0.15.x on the CPU platform, in every worker process.
Remove when vLLM 0.15.x is no longer supported.
"""

from __future__ import annotations

import contextvars

from speculators_compat.patching import Probe, declare


KIMI = "vllm.model_executor.models.kimi_k25"
CLASS = "KimiK25ForConditionalGeneration"
CUDA_CALL = "torch.cuda.current_device()"

_building: contextvars.ContextVar[bool] = contextvars.ContextVar("speculators_compat_kimi_device", default=False)


def _judge(cpu: bool, source: str | None) -> Probe:
    if not cpu:
        return Probe.old("not vLLM's CPU platform")
    if not source:
        return Probe.old(f"no {KIMI}.{CLASS} in this vLLM")
    if CUDA_CALL in source:
        return Probe.new(f"CPU platform; {CLASS}.__init__ calls {CUDA_CALL}")
    return Probe.old(f"{CLASS}.__init__ does not call {CUDA_CALL}")


def probe(module) -> Probe:
    from vllm.platforms import current_platform

    from speculators_compat.patching import Sources

    if not current_platform.is_cpu():
        return _judge(False, None)
    return _judge(True, Sources("vllm").source(KIMI, CLASS, "__init__"))


def static_probe(view) -> Probe:
    if not view.cpu:
        return _judge(False, None)
    return _judge(True, view.vllm.source(KIMI, CLASS, "__init__"))


def _init(wrapped, instance, args, kwargs):
    token = _building.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _building.reset(token)


def _current_device(wrapped, instance, args, kwargs):
    if _building.get():
        return "cpu"  # what torch.cpu.current_device() returns (vLLM 0.16's answer on the CPU platform)
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    import importlib

    import torch

    kimi = importlib.import_module(KIMI)
    patcher.wrap(torch.cuda, "current_device", _current_device)
    patcher.wrap(getattr(kimi, CLASS), "__init__", _init)


PATCH = declare(
    title="Kimi-K2.5's device on the CPU platform (vLLM 0.15)",
    delta="KimiK25ForConditionalGeneration: torch.cuda.current_device() -> current_platform.current_device() (0.16)",
    api=f"{KIMI}.{CLASS}.__init__",
    vllm=">=0.15,<0.16",
    upstream="fixed in vLLM 0.16.0 (current_platform.current_device())",
    remove_when="vLLM 0.15.x is no longer supported",
)
