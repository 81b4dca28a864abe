"""cpu-moe-silu-instance: the probe reads the SiLU entry of vLLM's CPU MoE activation table."""

from __future__ import annotations

import pytest


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "cpu-moe-silu-instance": "tests/test_e2e.py test_deepseek_v3_on_cpu_needs_the_moe_silu_patch (vLLM 0.20.0-0.24.0)",
}


@pytest.mark.parametrize("entry, shape", [
    ("lambda x: SiluAndMul(compile_native=False).forward_native(x)", "new"),  # vLLM 0.20.0-0.24.0
    ("SiluAndMul.forward_native", "old"),  # 0.15-0.19, 0.25+
    ("lambda x: x.sigmoid() * x", "unknown"),
    (None, "old"),  # no table at all
])
def test_cpu_moe_silu_probe_reads_the_silu_entry_of_the_table(entry, shape):
    import ast

    from speculators_compat.patches.cpu_platform import cpu_moe_silu_instance as patch

    key = "MoEActivation.SILU" if "compile_native" in (entry or "") else '"silu"'
    source = "x = 1\n" if entry is None else (
        "_CPU_MOE_ACT_FN: dict = {\n"
        f"    {key}: {entry},\n"
        '    "swigluoai": _swigluoai_forward_native,\n}\n')
    assert patch._judge(ast.parse(source)).shape.value == shape
