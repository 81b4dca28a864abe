"""cpu-rotary-3d: the probe reads whether RotaryEmbedding.forward_cpu reaches the CPU rotary kernel
(directly, or through forward_cuda on 0.11-0.13); the wrapper sends 3-D queries to forward_native."""

from __future__ import annotations

from types import SimpleNamespace

from speculators_compat.patches.cpu_platform import cpu_rotary_3d as patch


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"cpu-rotary-3d": "tests/test_e2e.py test_deepseek_v3_on_cpu_needs_the_rotary_patch"}


def test_the_judgement():
    kernel = "ops.rotary_embedding(positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style)"
    assert patch._judge(kernel, "").shape.value == "new"
    assert patch._judge("return self.forward_cuda(positions, query, key)", kernel).shape.value == "new"
    assert patch._judge("return self.forward_cuda(positions, query, key)", "return q").shape.value == "old"
    assert patch._judge("return self.forward_native(positions, query, key)", kernel).shape.value == "old"


class _Rotary:
    def forward_native(self, positions, query, key=None):
        return "native"


def _tensor(dim):
    return SimpleNamespace(dim=lambda: dim)


def test_three_dimensional_queries_or_keys_take_the_native_path():
    rotary = _Rotary()
    kernel = lambda *a, **k: "kernel"  # noqa: E731
    assert patch._forward_cpu(kernel, rotary, (None, _tensor(2), _tensor(2)), {}) == "kernel"
    assert patch._forward_cpu(kernel, rotary, (None, _tensor(3), _tensor(2)), {}) == "native"
    assert patch._forward_cpu(kernel, rotary, (None, _tensor(2)), {"key": _tensor(3)}) == "native"
    assert patch._forward_cpu(kernel, rotary, (None, _tensor(2)), {}) == "kernel"
