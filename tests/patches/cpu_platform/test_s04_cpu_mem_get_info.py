"""s04-cpu-mem-get-info: speculators 0.4's own ``mem_get_info`` on a CPU build of vLLM; the
generator module must define it (else the probe cannot say what it wraps)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from speculators_compat.patches.cpu_platform import s04_cpu_mem_get_info as patch


#: end to end (tests/test_e2e.py, speculators 0.4.0.1): the step that fails when the patch alone is
#: disabled, and a fragment of the failure
NEEDED_04 = {"s04-cpu-mem-get-info": ("start", "NVIDIA driver")}


class _Spec:
    def __init__(self, defines):
        self._defines = defines

    def defines(self, module, name):
        return self._defines


def test_the_static_probe():
    assert patch.static_probe(SimpleNamespace(cpu=True, speculators=_Spec(True))).shape.value == "new"
    assert patch.static_probe(SimpleNamespace(cpu=False, speculators=_Spec(True))).shape.value == "old"
    assert patch.static_probe(SimpleNamespace(cpu=True, speculators=_Spec(False))).shape.value == "unknown"


def test_the_wrapper_answers_with_the_platform_memory_on_the_cpu(monkeypatch):
    platform = SimpleNamespace(is_cpu=lambda: True)
    platforms = SimpleNamespace(current_platform=platform)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(platforms=platforms))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(patch, "platform_memory", lambda: (5, 5))
    assert patch._mem_get_info(lambda: (0, 0), None, (), {}) == (5, 5)
    platform.is_cpu = lambda: False
    assert patch._mem_get_info(lambda: (0, 0), None, (), {}) == (0, 0)
