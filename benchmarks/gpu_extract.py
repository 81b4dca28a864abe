"""Extraction speed on a GPU: the stock generator through the shim against vLLM's own prefill.

    python benchmarks/gpu_extract.py build ROOT                 # the random bf16 Llamas (no vLLM needed)
    python benchmarks/gpu_extract.py bench ROOT/llama-1b --out FILE [--async] [--rounds 3] [--prompts 64] [--len 1024]
    python benchmarks/gpu_extract.py stock ROOT/llama-8b --out FILE [--calls 50] [--batch 16] [--disk DIR]
    python benchmarks/gpu_extract.py selfcheck MODEL --out FILE [--tp N] [--prompts 32] [--len 1024]

``bench``: one process, every engine alive on the same GPU, built once: vLLM's own eager prefill
(``LLM(enforce_eager=True, enable_prefix_caching=False, gpu_memory_utilization=0.3)``,
``generate(SamplingParams(max_tokens=1))``), and the stock ``VllmHiddenStatesGenerator`` through
the shim, as installed (``extract``), with ``results-in-place`` and ``pipelined-steps`` off
(``extract_before``: how every call ran before those patches), and with the capture hooks removed
in the worker (``steps_nohooks``: the generator's steps alone; the call then fails at its end, as
nothing was captured). ``--async``: ``extract`` runs its steps synchronously
(``SPECULATORS_COMPAT_ASYNC_STEPS=0``) and a second generator, as installed, runs
``extract_async``, whose rows are compared bit for bit with ``extract``'s. After a warm-up the modes
alternate in a rotated order, ``--rounds`` times; ``extract_nocheck`` is ``extract`` with the
self-check off (``SPECULATORS_COMPAT_SELF_CHECK=0``: its cost is the ratio of the two, its own
seconds per call are in ``self_check_s``); each call is timed between CUDA
synchronisations. Reported: tokens/s per call and their medians, the ratios to the prefill, where
an extraction call's time went (until the worker's reply; the rest: results and guards; the
worker waiting for its copies), the worker's peak device memory and the driver's peak RSS.

``stock``: the stock data script's loop (``tests/stock_datagen.py``: 4 saving threads, their
futures awaited at the end) through ``speculators-compat run`` on ``--calls`` batches, saving to
``--disk``; before it, that disk's own write bandwidth (``--disk-gib`` of data written and fsynced
in 64 MiB blocks). Reported: samples/s and bytes/s saved, the ratio to the disk's bandwidth and to
the prefill rate, and the driver's RSS sampled every 0.2 s (bounded: the held results wait).

``selfcheck``: the self-check's separation on MODEL (any checkpoint: the GPU tests' Llama,
DeepSeek-V3 MLA and Kimi-shaped INT4 models, ``tests/gpu/models.py``), with the stock default
layers: every sequence checked, with no threshold, on correct rows and with each test-only fault
(two sequences' rows swapped, rows shifted by one, the last row dropped, the last layer captured
after the norm or without the residual), then with the last layer not among the captured ones
(the workers capture it for the check). Reported per case: the largest difference of the correct
sequences and the smallest worst difference of the faulted ones (relative; nats beside), and
their ratio to the default threshold.

Ratios only, measured in one process: absolute figures vary with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_k, _v)

MODELS = {
    # the shapes of the 2026-12-02 measurements (``docs/gpu.md``)
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    # the CPU benchmark's model (benchmarks/run.py), for an A/B of the modes on a CPU build
    "llama-cpu": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=2048),
    # a CPU dry run of the script itself
    "llama-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=4096),
}
TURNED_OFF = ("results-in-place", "pipelined-steps")


def build(root: Path, names) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculators_compat.testing import tiny

    out = {}
    for name in names:
        path = root / name
        if (path / "config.json").exists():
            out[name] = "present"
            continue
        t = time.time()
        config = LlamaConfig(max_position_embeddings=32768, bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=False, torch_dtype="bfloat16", **MODELS[name])
        torch.manual_seed(0)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        tiny.randomize_final_norm(model)  # as a trained model's: a row normed twice differs (self-check)
        model.save_pretrained(str(path), safe_serialization=True)
        tiny.build_tokenizer(path, vocab_size=384)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        out[name] = f"built in {time.time() - t:.1f} s"
        print(name, out[name], flush=True)
    return out


# -- run in the workers through collective_rpc ----------------------------------------------


def w_stats(worker):
    """The capturing worker's peak device memory (then reset) and its copy waits."""
    import torch

    from speculators_compat import transport

    ext = getattr(worker, "worker", None) or worker
    out = {}
    if torch.cuda.is_available():
        out["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    state = ext.__dict__.get(transport.WORKER_STATE)
    if state is not None:
        out["wait_copies_s"] = round(state.wait_s, 4)
        state.wait_s = 0.0
    return out


def w_hooks(worker, on: bool, layer_ids):
    """The capture hooks off (the steps alone) or on again, in the capturing worker."""
    from speculators_compat.patches.vllm_api import v3 as v3_worker_capture

    ext = getattr(worker, "worker", None) or worker
    if on:
        ext._setup_hidden_states_capture(layer_ids)
    else:
        v3_worker_capture.remove_hooks(ext)
    return True


# -- timing ---------------------------------------------------------------------------------


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 1) for _ in range(length)] for _ in range(n)]


class Marks:
    """When the worker's reply arrived in the driver (``transport.claim``), and how long the
    output guard took, per extraction call."""

    def __init__(self):
        from speculators_compat import transport
        from speculators_compat.patches.guards import guard_output

        self.reply = None
        self.guard_s = 0.0
        claim, check = transport.claim, guard_output.check

        def timed_claim(*a, **k):
            self.reply = time.perf_counter()
            return claim(*a, **k)

        def timed_check(*a, **k):
            t = time.perf_counter()
            try:
                return check(*a, **k)
            finally:
                self.guard_s += time.perf_counter() - t

        transport.claim, guard_output.check = timed_claim, timed_check


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def bench(model: str, out: Path, rounds: int, n: int, length: int, util: float, dtype: str = "auto",
          async_too: bool = False) -> dict:
    import torch

    cfg = json.loads((Path(model) / "config.json").read_text())
    layers_n = cfg["num_hidden_layers"]
    layer_ids = [2, layers_n // 2, layers_n - 3, layers_n - 1]
    batch = prompts(n, length, cfg["vocab_size"], seed=7)
    tokens = n * length
    report: dict = {"model": model, "config": {k: cfg[k] for k in MODELS["llama-1b"]}, "prompts": n,
                    "length": length, "layers": layer_ids, "rounds": rounds, "calls": {}}

    def save():
        out.write_text(json.dumps(report, indent=1))

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.time()
    llm = LLM(model=model, enforce_eager=True, gpu_memory_utilization=util, enable_prefix_caching=False, dtype=dtype)
    if dtype != "auto":
        os.environ["SPECULATORS_COMPAT_DTYPE"] = dtype  # the generator's, through the dtype patch
    report["llm_init_s"] = round(time.time() - t, 1)

    def prefill():
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], SamplingParams(max_tokens=1),
                     use_tqdm=False)

    import speculators_compat
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    from speculators_compat.patches.features import pipelined_steps

    t = time.time()
    if async_too:  # ``extract`` then runs the steps synchronously, ``extract_async`` as installed
        os.environ["SPECULATORS_COMPAT_ASYNC_STEPS"] = "0"
    gen = VllmHiddenStatesGenerator(model, layer_ids=layer_ids, max_model_len=2048, gpu_memory_utilization=util)
    os.environ.pop("SPECULATORS_COMPAT_ASYNC_STEPS", None)
    report["generator_init_s"] = round(time.time() - t, 1)
    report["applied_driver"] = speculators_compat.applied_ids()
    marks = Marks()
    sent = {}

    def extract(before: bool):
        if before:
            speculators_compat.revert(["results-in-place"])
            pipelined_steps.PipelinedExecutor.execute_model = _blocking_execute
            pipelined_steps.PipelinedExecutor.sample_tokens = _blocking_sample
        try:
            marks.reply, marks.guard_s = None, 0.0
            t0 = time.perf_counter()
            res = gen.generate(batch)
            _sync()
            t1 = time.perf_counter()
            sent["results"] = res  # held like the stock script's `results` until the next call
            return {"reply_s": (marks.reply - t0) if marks.reply else None, "after_reply_s": (t1 - marks.reply)
                    if marks.reply else None, "guard_s": marks.guard_s}
        finally:
            if before:
                pipelined_steps.PipelinedExecutor.execute_model = _ORIG["execute_model"]
                pipelined_steps.PipelinedExecutor.sample_tokens = _ORIG["sample_tokens"]
                speculators_compat.reset()
                speculators_compat.apply()

    def nohooks():
        gen.executor.collective_rpc(w_hooks, args=(False, layer_ids))
        try:
            gen.generate(batch)  # no states: the call fails at its end, after the steps
        except Exception as exc:  # noqa: BLE001 - expected: nothing was captured
            sent["nohooks_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        finally:
            gen.executor.collective_rpc(w_hooks, args=(True, layer_ids))
        return {}

    from speculators_compat import selfcheck

    def extract_nocheck():
        os.environ[selfcheck.SELF_CHECK_ENV] = "0"
        try:
            return extract(False)
        finally:
            os.environ.pop(selfcheck.SELF_CHECK_ENV, None)

    def extract_checked():
        totals = selfcheck.totals_of(gen)
        before = totals.seconds
        out = extract(False)
        out["self_check_s"] = totals.seconds - before
        return out

    modes = {"prefill": lambda: prefill() or {}, "extract": extract_checked, "extract_nocheck": extract_nocheck,
             "extract_before": lambda: extract(True), "steps_nohooks": nohooks}
    if async_too:
        t = time.time()
        gen_async = VllmHiddenStatesGenerator(model, layer_ids=layer_ids, max_model_len=2048,
                                              gpu_memory_utilization=util)
        report["generator_async_init_s"] = round(time.time() - t, 1)
        report["async_scheduling"] = bool(gen_async.vllm_config.scheduler_config.async_scheduling)

        def extract_async():
            marks.reply, marks.guard_s = None, 0.0
            t0 = time.perf_counter()
            res = gen_async.generate(batch)
            _sync()
            sent["results_async"] = res
            return {"reply_s": (marks.reply - t0) if marks.reply else None,
                    "after_reply_s": (time.perf_counter() - marks.reply) if marks.reply else None,
                    "guard_s": marks.guard_s}

        def check_async():
            # the same rows as the synchronous generator (bitwise: same kernels, same batches)
            a, b = sent.get("results"), sent.get("results_async")
            if a and b:
                report["async_equal"] = all(torch.equal(x, y) for ra, rb in zip(a, b)
                                            for x, y in zip(ra["hidden_states"], rb["hidden_states"]))
        modes["extract_async"] = extract_async
    for name, fn in modes.items():  # warm-up: each mode twice (segments created and registered here)
        fn(), fn()
        gen.executor.collective_rpc(w_stats)
    peak_rss = 0.0
    order = list(modes)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            _sync()
            t = time.perf_counter()
            extra = modes[name]()
            _sync()
            dt = time.perf_counter() - t
            worker = gen.executor.collective_rpc(w_stats)[0] if name in ("extract", "extract_before") else {}
            peak_rss = max(peak_rss, rss_gib())
            report["calls"].setdefault(name, []).append({"s": round(dt, 4), "tokens_s": round(tokens / dt),
                                                         **{k: round(v, 4) for k, v in extra.items() if v is not None},
                                                         **worker})
            save()
    if async_too:
        modes["extract"](), modes["extract_async"]()
        check_async()
    report["nohooks_error"] = sent.get("nohooks_error")
    med = {m: statistics.median(c["tokens_s"] for c in calls) for m, calls in report["calls"].items()}
    report["median_tokens_s"] = med
    report["ratio"] = {m: round(v / med["prefill"], 3) for m, v in med.items()}
    report["breakdown_median_s"] = {
        m: {k: round(statistics.median(c[k] for c in calls if k in c), 4)
            for k in ("s", "reply_s", "after_reply_s", "guard_s", "wait_copies_s", "self_check_s")
            if any(k in c for c in calls)}
        for m, calls in report["calls"].items() if m != "prefill"}
    if "extract_nocheck" in med:
        report["self_check_cost"] = round(med["extract_nocheck"] / med["extract"] - 1, 4)  # 0.02 = 2 %
        report["self_check"] = selfcheck.summary(gen)
    report["peak_rss_gib"] = round(peak_rss, 2)
    report["state_gib_per_call"] = round(tokens * len(layer_ids) * cfg["hidden_size"] * 2 / 2**30, 3)
    save()
    print(json.dumps({k: report.get(k) for k in ("median_tokens_s", "ratio", "breakdown_median_s", "peak_rss_gib",
                                                 "async_scheduling", "async_equal", "nohooks_error",
                                                 "self_check_cost")}),
          flush=True)
    for g in (gen, locals().get("gen_async")):
        if g is not None:
            g.executor.shutdown()
    llm.llm_engine.engine_core.shutdown()  # its engine process, which os._exit would leave behind
    os._exit(0)  # do not wait for the rest of the teardown


def _blocking_execute(self, scheduler_output, *a, **k):
    self.wait_steps()
    return self.__wrapped__.execute_model(scheduler_output, *a, **k)


def _blocking_sample(self, grammar_output, *a, **k):
    self.wait_steps()
    return self.__wrapped__.sample_tokens(grammar_output, *a, **k)


_ORIG: dict = {}


def disk_bandwidth(folder: Path, gib: float) -> float:
    """Bytes/s of writing ``gib`` GiB to a new file in ``folder`` (64 MiB writes, then fsync)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".bandwidth"
    block = os.urandom(1 << 20) * 64
    n = max(1, int(gib * 16))
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return n * len(block) / dt


def stock(model: str, out: Path, calls: int, batch: int, length: int, disk: Path, disk_gib: float,
          util: float) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    layers_n = cfg["num_hidden_layers"]
    report: dict = {"model": model, "calls": calls, "batch": batch, "length": length}
    report["disk_bytes_s"] = round(disk_bandwidth(disk, disk_gib))
    data = disk / "train.jsonl"
    rows = prompts(calls * batch, length, cfg["vocab_size"], seed=11)
    with open(data, "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n")
    outdir = disk / "out"
    subprocess.run(["rm", "-rf", str(outdir)], check=True)
    script = Path(__file__).resolve().parent.parent / "tests" / "stock_datagen.py"
    cmd = [sys.executable, "-m", "speculators_compat", "run", str(script), "--target-model-path", model,
           "--train-data-path", str(data), "--output-dir", str(outdir), "--max-model-len", str(length + 1),
           "--batch-size", str(batch), "--gpu-memory-utilization", str(util),
           "--layer-ids", *map(str, [2, layers_n // 2, layers_n - 3, layers_n - 1])]
    rss: list[float] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    first_file = None
    t = time.perf_counter()
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss.extend(int(line.split()[1]) / 2**20 for line in f if line.startswith("VmRSS:"))
        except OSError:
            pass
        if first_file is None and outdir.exists() and any(outdir.glob("data_*.pt")):
            first_file = time.perf_counter()
        time.sleep(0.2)
    end = time.perf_counter()
    reader.join(timeout=5)
    report["rc"] = proc.returncode
    report["log_tail"] = [line.rstrip() for line in lines if any(k in line for k in ("generate():", "run:", "saved", "Error"))][-8:]
    files = sorted(outdir.glob("data_*.pt"))
    nbytes = sum(f.stat().st_size for f in files)
    span = end - (first_file or t)
    report.update(files=len(files), bytes=nbytes, run_s=round(end - t, 1), saving_s=round(span, 1),
                  samples_s=round(len(files) / span, 1), bytes_s=round(nbytes / span),
                  ratio_to_disk=round(nbytes / span / report["disk_bytes_s"], 3),
                  rss_gib_max=round(max(rss or [0]), 2), rss_gib_samples=[round(x, 2) for x in rss[:: max(1, len(rss) // 60)]])
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss_gib_samples",)}), flush=True)
    return report


def separation(model: str, out: Path, tp: int, n: int, length: int, util: float, dtype: str) -> dict:
    """The self-check's differences on correct rows and with each test-only fault (see the docstring)."""
    import random

    from speculators_compat import selfcheck

    os.environ.update({selfcheck.TEST_FAULT_ENV: "none", selfcheck.SELF_CHECK_ENV: "all",
                       selfcheck.TOLERANCE_ENV: "inf"})
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
        os.environ[selfcheck.TEST_FAULT_ENV] = fault
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
    for fault in ("none", *selfcheck.DRIVER_FAULTS, *selfcheck.WORKER_FAULTS):
        case(fault, fault)
    layers = list(gen.layer_ids)
    gen.layer_ids = [i for i in layers if i != layers_n - 1]
    gen._setup_capture()
    for fault in ("none", *selfcheck.WORKER_FAULTS):
        case(f"own:{fault}", fault)
    report["self_check_s"] = round(selfcheck.totals_of(gen).seconds, 2)
    out.write_text(json.dumps(report, indent=1))
    gen.executor.shutdown()
    os._exit(0)


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("root")
    b.add_argument("names", nargs="*", default=["llama-1b", "llama-8b"])
    p = sub.add_parser("bench")
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--len", type=int, default=1024)
    p.add_argument("--util", type=float, default=0.3)
    p.add_argument("--async", dest="async_too", action="store_true",
                   help="extract with SPECULATORS_COMPAT_ASYNC_STEPS=0, and a second generator as installed (extract_async)")
    p.add_argument("--dtype", default="auto", help="float32 for a CPU dry run (vLLM's CPU attention lacks bf16 on some CPUs)")
    s = sub.add_parser("stock")
    s.add_argument("model")
    s.add_argument("--out", required=True)
    s.add_argument("--calls", type=int, default=50)
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--len", type=int, default=1024)
    s.add_argument("--disk", default="/tmp/stock")
    s.add_argument("--disk-gib", type=float, default=4.0)
    s.add_argument("--util", type=float, default=0.5)
    c = sub.add_parser("selfcheck")
    c.add_argument("model")
    c.add_argument("--out", required=True)
    c.add_argument("--tp", type=int, default=1)
    c.add_argument("--prompts", type=int, default=32)
    c.add_argument("--len", type=int, default=1024)
    c.add_argument("--util", type=float, default=0.5)
    c.add_argument("--dtype", default="auto", help="float32 or bfloat16 for a CPU dry run")
    args = ap.parse_args(argv)
    if args.cmd == "selfcheck":
        separation(args.model, Path(args.out), args.tp, args.prompts, args.len, args.util, args.dtype)
    elif args.cmd == "build":
        print(json.dumps(build(Path(args.root), args.names)))
    elif args.cmd == "bench":
        from speculators_compat.patches.features import pipelined_steps

        _ORIG.update(execute_model=pipelined_steps.PipelinedExecutor.execute_model,
                     sample_tokens=pipelined_steps.PipelinedExecutor.sample_tokens)
        bench(args.model, Path(args.out), args.rounds, args.prompts, args.len, args.util, args.dtype, args.async_too)
    else:
        stock(args.model, Path(args.out), args.calls, args.batch, args.len, Path(args.disk), args.disk_gib, args.util)


if __name__ == "__main__":
    main()
