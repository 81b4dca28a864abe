"""Benchmarks: what the shim costs. Ratios against baselines run in the same command.

    python benchmarks/run.py [--repeats 5] [--out docs/results/benchmark-latest.json] [--startup-only]

(or ``tox -e bench``). Builds a random-weight Llama big enough that the forward dominates on
a CPU (hidden 512, 8 layers), then, alternating A/B runs and reporting medians:

1. extraction throughput (tokens/s) of the stock generator with the shim, against vLLM's own
   prefill ``LLM.generate(prompts, SamplingParams(max_tokens=1))`` on the same prompts;
2. the same against HF transformers ``output_hidden_states=True`` (one sequence at a time);
3. the shim's own work per ``generate()``: input validation and the output guard, timed on
   the real inputs and results, as a share of the call;
4. ``import speculators_compat`` added import time (torch/vLLM not imported) and
   ``python -m speculators_compat.check`` wall time (static, and ``--deep``) against
   ``python -c "import vllm"`` (``--startup-only`` measures just this and updates the file);
5. driver and worker resident memory after 1 and after 100 ``generate()`` calls.

Nothing here asserts a time: the figures go to the JSON file and the README table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wall(cmd: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=tempfile.gettempdir())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def startup(repeats: int) -> dict:
    """Import and check wall times (medians), alternating nothing: each is its own process."""
    py = sys.executable
    imp = {
        "python_baseline_s": wall([py, "-c", "pass"], repeats * 2),
        "import_speculators_compat_s": wall([py, "-c", "import speculators_compat"], repeats * 2),
        "import_vllm_s": wall([py, "-c", "import vllm"], 3),
        "check_s": wall([py, "-m", "speculators_compat.check"], repeats),
        "check_deep_s": wall([py, "-m", "speculators_compat.check", "--deep"], 3),
    }
    imp["added_import_ms"] = round(1000 * (imp["import_speculators_compat_s"] - imp["python_baseline_s"]), 1)
    imp["check_over_import_vllm"] = round(imp["check_s"] / imp["import_vllm_s"], 3)
    imp["check_deep_over_import_vllm"] = round(imp["check_deep_s"] / imp["import_vllm_s"], 3)
    return imp


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent.parent / "docs" / "results" / "benchmark-latest.json"))
    ap.add_argument("--startup-only", action="store_true", help="only the import and check times")
    return ap.parse_args(argv)


def startup_only(args: argparse.Namespace) -> int:
    """``--startup-only``: the import and check times, into the results file as it is."""
    path = Path(args.out)
    out = json.loads(path.read_text()) if path.exists() else {}
    out["import"] = startup(args.repeats)
    out["machine"] = machine()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out["import"], indent=2))
    return 0


def engines(path: str, layers: list[int], prompts: list[list[int]]):
    """The stock generator through the shim, vLLM's own prefill and HF transformers on the model at
    ``path``, the first two warmed up: ``(gen, llm, sampling_params, llm_prompts, hf)``."""
    import torch
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

    gen = VllmHiddenStatesGenerator(path, layer_ids=layers, max_model_len=1024)
    gen.generate(prompts[:2])  # warm-up

    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=path, dtype="float32", max_model_len=1024, enforce_eager=True,
              enable_prefix_caching=False, max_num_seqs=32, gpu_memory_utilization=0.5)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(llm_prompts[:2], sp, use_tqdm=False)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return gen, llm, sp, llm_prompts, hf


def alternate(gen, llm, sp, llm_prompts, hf, prompts: list[list[int]], repeats: int) -> dict:
    """``repeats`` rounds of: the shim, vLLM's prefill, HF, then the shim's own checks (input
    validation and the output guard on the round's results); seconds of each, per round."""
    import torch

    from speculators_compat.patches.guards import guard_input, guard_output

    shim_s, vllm_s, hf_s, guard_s = [], [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        results = gen.generate(prompts)
        shim_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate(llm_prompts, sp, use_tqdm=False)
        vllm_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            for p in prompts:
                hf(torch.tensor([p]), output_hidden_states=True)
        hf_s.append(time.perf_counter() - t)
        config = gen.vllm_config.model_config
        t = time.perf_counter()
        ids = guard_input.normalize(prompts, config.get_vocab_size(), config.max_model_len - 1)
        guard_output.check(gen, ids, results)
        guard_s.append(time.perf_counter() - t)
    return {"shim": shim_s, "vllm_prefill": vllm_s, "hf": hf_s, "guard": guard_s}


def figures(times: dict, n_tokens: int, sequences: int) -> tuple[dict, dict]:
    """Throughput and the shim's own work, from :func:`alternate`'s seconds (medians)."""
    med = statistics.median
    shim_s, vllm_s, hf_s, guard_s = times["shim"], times["vllm_prefill"], times["hf"], times["guard"]
    throughput = {
        "tokens_per_call": n_tokens,
        "sequences": sequences,
        "shim_tokens_per_s": round(n_tokens / med(shim_s), 1),
        "vllm_prefill_tokens_per_s": round(n_tokens / med(vllm_s), 1),
        "hf_tokens_per_s": round(n_tokens / med(hf_s), 1),
        "shim_over_vllm_prefill": round(med(vllm_s) / med(shim_s), 3),
        "shim_over_hf": round(med(hf_s) / med(shim_s), 3),
        "raw_seconds": {"shim": shim_s, "vllm_prefill": vllm_s, "hf": hf_s},
    }
    own = {
        "guard_and_validation_ms": round(1000 * med(guard_s), 2),
        "share_of_generate": round(med(guard_s) / med(shim_s), 4),
    }
    return throughput, own


def memory_growth(gen, small: list[list[int]]) -> dict:
    """The driver's and the worker's resident memory after 1 and after 100 calls on ``small``."""
    worker_pid = gen.executor.collective_rpc(lambda self: os.getpid())[0]
    gen.generate(small)
    mem = {"after_1": {"driver_mb": rss_mb(os.getpid()), "worker_mb": rss_mb(worker_pid)}}
    for _ in range(99):
        gen.generate(small)
    mem["after_100"] = {"driver_mb": rss_mb(os.getpid()), "worker_mb": rss_mb(worker_pid)}
    return mem


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.startup_only:
        return startup_only(args)

    from speculators_compat.testing import tiny

    tiny.cpu_environment()
    os.environ.setdefault("SPECULATORS_COMPAT_DTYPE", "float32")
    import speculators_compat

    out: dict = {"machine": machine(), "repeats": args.repeats}
    out["import"] = startup(args.repeats)

    tmp = tempfile.mkdtemp(prefix="speculators-compat-bench-")
    path = str(tiny.build_llama(tmp, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                                intermediate_size=1536, vocab_size=2048))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(200, 500))] for _ in range(args.sequences)]
    gen, llm, sp, llm_prompts, hf = engines(path, [2, 4, 5, 7], prompts)
    times = alternate(gen, llm, sp, llm_prompts, hf, prompts, args.repeats)
    out["throughput"], out["shim_own_work"] = figures(times, sum(map(len, prompts)), len(prompts))
    del llm, hf

    out["memory"] = memory_growth(gen, prompts[:4])
    out["patches_applied"] = speculators_compat.applied_ids()
    del gen

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k != "throughput"} | {
        "throughput": {k: v for k, v in out["throughput"].items() if k != "raw_seconds"}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
