"""cpu-mem-get-info: needed on a CPU build of vLLM only; the wrapper answers with the platform's
memory only where torch has no CUDA device to ask."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from speculators_compat.patches.cpu_platform import cpu_mem_get_info as patch


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
