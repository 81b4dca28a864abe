"""cpu-moe-activation: the probe reads the CPU fused-MoE module's lazy activation dict; the wrapper
fills a missing key with a factory whose ``forward_native`` is static (no config needed)."""

from __future__ import annotations

from speculators_compat.patches.cpu_platform import cpu_moe_activation as patch


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "cpu-moe-activation": "tests/test_e2e.py test_deepseek_v3_on_cpu_needs_the_moe_activation_patch (vLLM 0.14.x)",
}


def test_the_judgement():
    use = f"    out = {patch.USE}x)\n"
    assert patch._judge(False, "", "").shape.value == "old"  # no lazy dict: nothing built at forward time
    assert patch._judge(True, "__missing__", use).shape.value == "new"
    assert patch._judge(True, "", use).shape.value == "unknown"  # a lazy dict without __missing__
    assert patch._judge(True, "__missing__", "out = act(x)").shape.value == "unknown"  # used another way


class _Static:
    @staticmethod
    def forward_native(x):
        return x


class _Bound:
    def forward_native(self, x):
        return x


class _Lazy(dict):
    _factories = {"silu": _Static, "gelu": _Bound}


def test_a_static_factory_is_used_as_is_and_another_left_to_vllm():
    lazy = _Lazy()
    assert patch._missing(lambda key: "built", lazy, ("silu",), {}) is _Static
    assert lazy["silu"] is _Static
    assert patch._missing(lambda key: "built", lazy, ("gelu",), {}) == "built"
    assert "gelu" not in lazy
    assert patch._missing(lambda key: "built", lazy, ("unknown",), {}) == "built"
