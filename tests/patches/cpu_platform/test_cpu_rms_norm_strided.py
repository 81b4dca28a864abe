"""cpu-rms-norm-strided: the probe reads whether RMSNorm.forward_cpu reaches the kernel, whether the
kernel's wrapper makes its input contiguous, and the kernels' signatures the wrappers rely on."""

from __future__ import annotations

from speculators_compat.patches.cpu_platform import cpu_rms_norm_strided as patch


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "cpu-rms-norm-strided": "tests/test_e2e.py test_qwen3_on_cpu_needs_the_rms_norm_patch (vLLM 0.12.0 / 0.13.0)",
}

KERNEL = "    def forward_cpu(self, x, residual=None):\n        return self.forward_cuda(x, residual)\n"
WRAPPER = "def rms_norm(out, input, weight, epsilon):\n    torch.ops._C.rms_norm(out, input, weight, epsilon)\n"


def test_the_judgement():
    shapes = dict(patch.SIGNATURES)
    assert patch._judge(KERNEL, WRAPPER, shapes).shape.value == "new"
    assert patch._judge("    return self.forward_native(x)\n", WRAPPER, shapes).shape.value == "old"
    fixed = WRAPPER.replace("input,", "input.contiguous(),")
    assert patch._judge(KERNEL, fixed, shapes).shape.value == "old"
    moved = {**shapes, "rms_norm": ("out", "x", "weight", "epsilon")}
    probe = patch._judge(KERNEL, WRAPPER, moved)
    assert probe.shape.value == "unknown" and "rms_norm('out', 'x', 'weight', 'epsilon')" in probe.evidence
