"""One extraction run of the stock generator with the shim; prints nothing, writes a JSON report.

    python tests/gpu/extract.py MODEL_NAME --tp N --out FILE [--sets mixed,chunked,long]
        [--save-rows FILE.pt | --compare-rows FILE.pt]

Run in a fresh process per (model, TP) from OUTSIDE the checkout root (the checkout's
speculators_compat/ would shadow the installed package). Models and HF references come from
``$G016_ROOT`` (default /tmp/g016; ``tests/gpu/models.py`` and ``common.compute_refs``).

Reported: the patches applied, the attention / MLA backend and MoE method vLLM picked (read
in the worker), the KV cache the stock driver sized, per prompt set the call's seconds and
tokens/s, rows == tokens, and per layer the worst relative L2 / max abs difference against
HF transformers fp32 (and HF's own bf16 floor from the reference step), a repeated call's
difference, and the worker's peak device memory. Steps that fail are recorded with their
error; the report is written in any case. ``--save-rows`` keeps the rows of every set (one run,
e.g. under the V1 runner) and ``--compare-rows`` reports another run's rows against them
(``vs_saved``: e.g. the same model under Model Runner V2).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

for _k, _v in {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(_k, _v)


def worker_info(worker):
    """Runs in each worker (collective_rpc): backends, MoE methods, device memory."""
    import torch

    model = worker.model_runner.model
    attn, moe, quant = set(), set(), set()
    for _, m in model.named_modules():
        backend = getattr(m, "attn_backend", None)
        if backend is not None:
            get_name = getattr(backend, "get_name", None)
            attn.add(f"{get_name() if callable(get_name) else backend.__name__} ({type(getattr(m, 'impl', None)).__name__})")
        qm = getattr(m, "quant_method", None)
        if qm is not None and type(m).__name__ in ("FusedMoE", "SharedFusedMoE"):
            kernel = None
            for attr in ("moe_kernel", "fused_experts", "kernel", "moe_mk"):
                obj = getattr(qm, attr, None) or getattr(m, attr, None)
                if obj is not None:
                    kernel = type(obj).__name__
                    inner = getattr(obj, "fused_experts", None)
                    if inner is not None:
                        kernel += f"/{type(inner).__name__}"
                    break
            moe.add(f"{type(m).__name__}: {type(qm).__name__}" + (f" [{kernel}]" if kernel else ""))
        elif qm is not None and "Unquantized" not in type(qm).__name__:
            quant.add(f"{type(m).__name__}: {type(qm).__name__}")
    info = {"attention": sorted(attn), "moe": sorted(moe), "quantized_linear": sorted(quant)}
    # which model runner this worker built (V1: vllm.v1.worker.gpu_model_runner; Model Runner V2:
    # vllm.v1.worker.gpu.model_runner; CPU: vllm.v1.worker.cpu_model_runner) and what decided it
    runner = worker.model_runner
    info["model_runner"] = f"{type(runner).__module__}.{type(runner).__qualname__}"
    info["use_v2_model_runner"] = getattr(worker, "use_v2_model_runner", None)
    info["env_VLLM_USE_V2_MODEL_RUNNER"] = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    try:
        import speculators_compat

        info["applied"] = speculators_compat.applied_ids()  # the worker-side patches
    except ImportError as exc:
        info["applied"] = f"speculators_compat not importable: {exc}"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        info.update(
            device=torch.cuda.get_device_name(),
            max_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
            reserved_gib=round(torch.cuda.memory_reserved() / 2**30, 3),
            used_gib=round((total - free) / 2**30, 3),
        )
    return info


def reset_peak(worker):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return True


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sets", default="mixed,chunked,long")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-rows", help="torch.save every set's rows here (to compare another run with)")
    ap.add_argument("--compare-rows", help="compare every set's rows with those a --save-rows run kept here")
    args = ap.parse_args()

    import common

    model_dir = str(common.MODELS / args.model)
    layer_ids = common.layers_for(common.num_layers(model_dir))
    prompts = common.prompt_sets()
    report: dict = {"model": args.model, "tp": args.tp, "layers": layer_ids, "steps": {}, "log": [],
                    "env": {k: os.environ.get(k) for k in ("VLLM_WORKER_MULTIPROC_METHOD", "SPECULATORS_COMPAT_DTYPE",
                                                           "SPECULATORS_COMPAT_DISABLE", "VLLM_MLA_DISABLE",
                                                           "CUDA_VISIBLE_DEVICES")}}
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(report, indent=1, default=str))

    def run(name, fn):
        t = time.time()
        try:
            report["steps"][name] = {"ok": True, "value": fn(), "seconds": round(time.time() - t, 2)}
        except BaseException as exc:  # noqa: BLE001 - the report records any failure
            report["steps"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000],
                                     "trace": traceback.format_exc()[-5000:], "seconds": round(time.time() - t, 2)}
            if isinstance(exc, KeyboardInterrupt):
                raise
        save()
        return report["steps"][name]["ok"]

    import speculators_compat  # noqa: F401  (workers get it through the vllm.general_plugins entry point)

    class Keep(logging.Handler):
        def emit(self, record):
            report["log"].append(record.getMessage()[:500])

    compat_log = logging.getLogger("speculators_compat")
    compat_log.addHandler(Keep(level=logging.INFO))
    compat_log.setLevel(logging.INFO)

    holder: dict = {}

    def start():
        import vllm
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        report["versions"] = {"vllm": vllm.__version__}
        t = time.time()
        gen = holder["gen"] = VllmHiddenStatesGenerator(
            model_dir, layer_ids=layer_ids, max_model_len=args.max_model_len, tensor_parallel_size=args.tp
        )
        value = {"start_s": round(time.time() - t, 1), "applied": speculators_compat.applied_ids()}
        sched = gen.scheduler
        kv = getattr(sched, "kv_cache_config", None)
        if kv is not None:
            block = gen.vllm_config.cache_config.block_size
            value["kv_cache"] = {
                "num_blocks": kv.num_blocks, "block_size": block, "tokens": kv.num_blocks * block,
                "bytes": sum(getattr(t, "size", 0) for t in getattr(kv, "kv_cache_tensors", [])),
            }
        sc = gen.vllm_config.scheduler_config
        value["scheduler"] = {"max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
                              "chunked_prefill": getattr(sc, "enable_chunked_prefill", None),
                              "async_scheduling": getattr(sc, "async_scheduling", None)}
        value["dtype"] = str(gen.vllm_config.model_config.dtype)
        # Model Runner V2 (vLLM >= 0.22): what the config resolved to, and whether this model would
        # have got MRv2 by default (what runner-v1 prevents), as far as this release tells
        value["env_VLLM_USE_V2_MODEL_RUNNER"] = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        for key, fn in (("use_v2_model_runner", lambda c: c.use_v2_model_runner),
                        ("default_v2_model", lambda c: c._is_default_v2_model_runner_model())):
            try:
                value[key] = fn(gen.vllm_config)
            except Exception as exc:  # noqa: BLE001 - absent before 0.22
                value[key] = f"n/a: {type(exc).__name__}"
        value["workers"] = gen.executor.collective_rpc(worker_info)
        return value

    def extract(name):
        def step():
            import torch

            gen = holder["gen"]
            batch = prompts[name]
            gen.executor.collective_rpc(reset_peak)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            from speculators_compat.patches.features import pipelined_steps

            early = pipelined_steps.early_first_steps(gen)
            t = time.time()
            res = gen.generate(batch)
            seconds = time.time() - t
            early = pipelined_steps.early_first_steps(gen) - early
            rows_ok = [r["hidden_states"][0].shape[0] for r in res] == [len(b) for b in batch]
            if not rows_ok:
                raise AssertionError(f"rows {[r['hidden_states'][0].shape[0] for r in res]} != tokens")
            refs = common.load_refs(args.model)
            got = [r["hidden_states"] for r in res]
            layers = common.per_layer(common.compare_rows(got, refs["sets"][name]), layer_ids)
            holder.setdefault("first", {})[name] = got
            tokens = sum(len(b) for b in batch)
            value = {
                "sequences": len(batch), "tokens": tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds), "rows_ok": rows_ok,
                "first_step_early": bool(early),  # pipelined-steps sent the call's first step before the last add
                "dtype": str(got[0][0].dtype), "device": str(got[0][0].device),
                "max_rel_l2": common.worst(layers), "pooled_rel_l2": common.worst(layers, "pooled_rel_l2"),
                "max_abs": common.worst(layers, "max_abs"),
                "outlier_rows": max(v["outlier_rows"] for v in layers.values()), "layers": layers,
                "peak": gen.executor.collective_rpc(worker_info)[0],
            }
            if args.compare_rows:
                value["vs_saved"] = vs_saved(name, got)
            return value
        return step

    def vs_saved(name, got):
        """This run's rows against those of the --save-rows run, per layer (identical: bit for bit)."""
        import torch

        if "saved" not in holder:
            holder["saved"] = torch.load(args.compare_rows)
        want = [[t.float() for t in seq] for seq in holder["saved"][name]]
        layers = common.per_layer(common.compare_rows(got, want), layer_ids)
        max_abs = common.worst(layers, "max_abs")
        return {"max_rel_l2": common.worst(layers), "max_abs": max_abs, "identical": max_abs == 0.0,
                "outlier_rows": max(v["outlier_rows"] for v in layers.values()),
                "per_layer": {k: {m: v[m] for m in ("max_rel_l2", "pooled_rel_l2", "outlier_rows")}
                              for k, v in layers.items()}}

    def repeat():
        gen = holder["gen"]
        again = gen.generate(prompts["mixed"])
        diff = 0.0
        for a, b in zip(holder["first"]["mixed"], again):
            for x, y in zip(a, [t for t in b["hidden_states"]]):
                diff = max(diff, (x.float() - y.float()).abs().max().item())
        return {"max_abs_vs_first_call": diff, "identical": diff == 0.0}

    if run("start", start):
        for name in args.sets.split(","):
            run(name, extract(name))
        if "mixed" in holder.get("first", {}):
            run("repeat", repeat)
        if args.save_rows and holder.get("first"):
            import torch

            os.makedirs(os.path.dirname(os.path.abspath(args.save_rows)), exist_ok=True)
            torch.save({k: [[t.cpu() for t in seq] for seq in v] for k, v in holder["first"].items()},
                       args.save_rows)
    gen = holder.pop("gen", None)
    if gen is not None:
        import gc

        t = time.time()
        del gen
        gc.collect()
        report["shutdown_s"] = round(time.time() - t, 1)
    if len(report["log"]) > 8:
        report["log"] = report["log"][:4] + ["..."] + report["log"][-3:]
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
