"""The self-check's separation on a GPU: how far correct rows and each test-only fault land from its threshold.

    python tools/gpu/selfcheck.py MODEL --out FILE [--tp N] [--prompts 32] [--len 1024] [--dtype auto]

MODEL: any checkpoint (the GPU tests' Llama, DeepSeek-V3 MLA and Kimi-shaped INT4 models,
``tests/gpu/models.py``), with the stock default layers: every sequence checked, with no threshold,
on correct rows and with each test-only fault (two sequences' rows swapped, rows shifted by one, the
last row dropped, the last layer captured after the norm or without the residual), then with the
last layer not among the captured ones (the workers capture it for the check). Reported per case:
the largest difference of the correct sequences and the smallest worst difference of the faulted
ones (relative; nats beside), and their ratio to the default threshold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)


def separation(model: str, out: Path, tp: int, n: int, length: int, util: float, dtype: str) -> dict:
    """The self-check's differences on correct rows and with each test-only fault (the module's docstring)."""
    import random

    from speculators_compat.patches.features.datapath._runtime import checking as selfcheck

    faults_site = str(Path(__file__).resolve().parents[2] / "tests" / "faults_site")
    sys.path.insert(0, faults_site)
    import selfcheck_faults  # the tests' fault tooling: here, and in spawned workers via PYTHONPATH

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (faults_site, os.environ.get("PYTHONPATH")) if p)
    os.environ.update({selfcheck_faults.ENV: "none", selfcheck.SELF_CHECK_ENV: "all",
                       selfcheck.TOLERANCE_ENV: "inf"})
    selfcheck_faults.install()
    if dtype != "auto":
        os.environ["SPECULATORS_COMPAT_DTYPE"] = dtype
    import speculators_compat
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    cfg = json.loads((Path(model) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    layers_n = text["num_hidden_layers"]
    rng = random.Random(3)
    lengths = [1, 2, 3] + [rng.randint(length // 8, length) for _ in range(max(0, n - 3))]
    batch = [[rng.randrange(3, min(text["vocab_size"], 400) - 1) for _ in range(k)] for k in lengths]
    t = time.time()
    gen = VllmHiddenStatesGenerator(model, layer_ids=None, max_model_len=length + 1, tensor_parallel_size=tp,
                                    gpu_memory_utilization=util)
    report: dict = {"model": model, "tp": tp, "dtype": dtype, "layers": list(gen.layer_ids), "prompts": len(batch),
                    "tokens": sum(lengths), "generator_init_s": round(time.time() - t, 1),
                    "applied_driver": speculators_compat.applied_ids(), "tolerance": selfcheck.DEFAULT_TOLERANCE,
                    "cases": {}}
    if "self-check" not in report["applied_driver"]:
        raise SystemExit("self-check does not apply here (a release whose validation record does not list it: "
                         "run with SPECULATORS_COMPAT_RECORD=<a scratch folder>)")
    long = [i for i, ids in enumerate(batch) if len(ids) >= 2]
    faulted = {"swap": long[:2], "shift": long[:1], "drop": [0]}

    def case(key, fault):
        os.environ[selfcheck_faults.ENV] = fault
        t = time.perf_counter()
        gen.generate(batch)
        dt = time.perf_counter() - t
        last = selfcheck.totals_of(gen).last
        hit = faulted.get(fault, [r["sequence"] for r in last] if fault != "none" else [])
        good = [r for r in last if r["sequence"] not in hit]
        bad = [r for r in last if r["sequence"] in hit]
        row = {"s": round(dt, 3),
               "correct_max": max((r["worst"] for r in good), default=None),
               "correct_max_nats": max((r["nats"] for r in good), default=None),
               "faulted_min": min((r["worst"] for r in bad), default=None),
               "faulted_min_nats": min((r["nats"] for r in bad), default=None)}
        if row["faulted_min"] is not None:
            row["faulted_min_over_threshold"] = round(row["faulted_min"] / selfcheck.DEFAULT_TOLERANCE, 2)
        if row["correct_max"]:
            row["threshold_over_correct_max"] = round(selfcheck.DEFAULT_TOLERANCE / row["correct_max"], 1)
        report["cases"][key] = row
        out.write_text(json.dumps(report, indent=1))
        print(key, json.dumps(row), flush=True)

    case("warm-up", "none")
    for fault in ("none", *selfcheck_faults.DRIVER_FAULTS, *selfcheck_faults.WORKER_FAULTS):
        case(fault, fault)
    layers = list(gen.layer_ids)
    gen.layer_ids = [i for i in layers if i != layers_n - 1]
    gen._setup_capture()
    for fault in ("none", *selfcheck_faults.WORKER_FAULTS):
        case(f"own:{fault}", fault)
    report["self_check_s"] = round(selfcheck.totals_of(gen).seconds, 2)
    out.write_text(json.dumps(report, indent=1))
    gen.executor.shutdown()
    os._exit(0)


def main(argv=None):
    ap = argparse.ArgumentParser(description="the self-check's separation (see the module's docstring)")
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--util", type=float, default=0.5)
    ap.add_argument("--dtype", default="auto", help="float32 or bfloat16 for a CPU dry run")
    args = ap.parse_args(argv)
    separation(args.model, Path(args.out), args.tp, args.prompts, args.len, args.util, args.dtype)


if __name__ == "__main__":
    main()
