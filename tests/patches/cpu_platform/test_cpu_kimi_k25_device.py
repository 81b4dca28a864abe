"""cpu-kimi-k25-device: the probe on source variants of Kimi-K2.5's constructor and the gating of its
wrappers, with stand-in classes (the end-to-end tests run it on the real ones: tests/test_e2e.py,
test_kimi_k25_*)."""

from __future__ import annotations

from types import SimpleNamespace

from speculators_compat.core.registry import Patcher, Shape
from speculators_compat.patches.cpu_platform import cpu_kimi_k25_device


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"cpu-kimi-k25-device": "tests/test_e2e.py test_kimi_k25_on_cpu_needs_the_device_patch (vLLM 0.15.x)"}


KIMI_015 = '''def __init__(self, vllm_config, prefix=""):
        self.device = torch.cuda.current_device()
'''


def test_cpu_kimi_k25_device_probe():
    assert cpu_kimi_k25_device._judge(True, KIMI_015).shape is Shape.NEW
    fixed = KIMI_015.replace("torch.cuda.current_device()", "current_platform.current_device()")
    assert cpu_kimi_k25_device._judge(True, fixed).shape is Shape.OLD
    assert cpu_kimi_k25_device._judge(True, "").shape is Shape.OLD  # no Kimi-K2.5 in this vLLM
    assert cpu_kimi_k25_device._judge(False, KIMI_015).shape is Shape.OLD  # a GPU has a CUDA device


def test_cpu_kimi_k25_device_answers_only_inside_the_constructor():
    calls = []

    def current_device():
        calls.append("cuda")
        raise RuntimeError("Found no NVIDIA driver on your system")

    cuda = SimpleNamespace(current_device=current_device)

    class Kimi:
        def __init__(self):
            self.device = cuda.current_device()

    patcher = Patcher()
    patcher.wrap(cuda, "current_device", cpu_kimi_k25_device._current_device)
    patcher.wrap(Kimi, "__init__", cpu_kimi_k25_device._init)
    try:
        assert Kimi().device == "cpu"
        assert calls == []
        try:
            cuda.current_device()
        except RuntimeError as exc:
            assert "NVIDIA" in str(exc)
        else:
            raise AssertionError("outside the constructor the CUDA call must run as it is")
    finally:
        patcher.undo()
