"""cpu-ipex-moe-routing: the probe judges the IPEX fused-MoE path (x86, IPEX installed, the build and
call sites) from their sources."""

from __future__ import annotations


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "cpu-ipex-moe-routing": "tests/test_e2e.py test_deepseek_v3_on_cpu_needs_the_ipex_moe_routing_patch (vLLM 0.11.1/0.11.2)",
}


def test_cpu_ipex_moe_routing_judges_the_moe_path():
    from speculators_compat.patches.cpu_platform.cpu_ipex_moe_routing import CALL, SELECT, _judge

    build = "layer.cpu_fused_moe = cpu_fused_moe.IPEXFusedMOE(layer)"
    call = "return layer.ipex_fusion(x, use_grouped_topk, top_k, router_logits, renormalize, custom_routing_function)"
    args = (build, call, CALL, SELECT)
    assert _judge(True, True, True, *args).shape.value == "new"
    assert _judge(True, True, False, "", "", (), ()).shape.value == "old"  # 0.12+: no IPEXFusedMOE
    assert _judge(True, True, True, "cpu_fused_moe.CPUFusedMOE(layer)", call, CALL, SELECT).shape.value == "old"
    assert _judge(False, True, True, *args).shape.value == "old"  # not x86: vLLM's CPUFusedMOE
    assert _judge(True, False, True, *args).shape.value == "old"  # no IPEX: vLLM cannot build it
    assert _judge(True, True, True, build, call, CALL[:-1], SELECT).shape.value == "unknown"
    assert _judge(True, True, True, build, call, CALL, SELECT[1:]).shape.value == "unknown"
    assert _judge(True, True, True, build, "return layer.ipex_fusion(x, top_k)", CALL, SELECT).shape.value == "unknown"
