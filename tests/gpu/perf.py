"""Throughput and memory: the stock generator with the shim against vLLM's own prefill.

    python tests/gpu/perf.py --out FILE [--rounds 5] [--prompts 64] [--len 1024]
                             [--long-prompts 64] [--long-len 2000] [--util 0.3] [--no-compiled]

One process, one model (``perf``: a ~1.2B random Llama in bf16, hidden 2048, 16 layers;
layers [2, 8, 13, 15], the stock default), three engines on the same GPU, built once:

* ``extract``        the stock ``VllmHiddenStatesGenerator`` through the shim (eager, as stock;
                     max_model_len 16384, so the stock max_num_batched_tokens is 16384 and
                     max_num_seqs 32) -- with ``offload-captured`` (default) and, toggled off in
                     the worker between calls (``speculators_compat.revert``), without it
                     (``extract_nooffload``: the stock behaviour, states kept on the device), and
                     with ``--threads`` torch threads in the driver and the worker instead of
                     the 1 vLLM sets (``extract_threads``);
* ``llm_eager``      ``LLM.generate(max_tokens=1)`` with the generator's scheduler limits, eager,
                     prefix caching off: vLLM's own prefill of the same prompts;
* ``llm_compiled``   the same with vLLM's default compilation and CUDA graphs (what a user's
                     plain prefill runs; optional).

The modes alternate, in a rotating order, ``--rounds`` times after a warm-up; each call is
timed between CUDA synchronisations. Reported per mode: every time, median and best
tokens/s; the ratios extract / llm_eager and extract / extract_nooffload (recorded: the
GPU test asserts only the memory); the host's copy / cat / pickle bandwidth at the
driver's thread count (``host``), and what collective_rpc alone costs to bring a reply of
that size from the worker (``transport``: pickle + IPC + unpickle); where an extraction
call's time goes (driver: vLLM
steps, the captured-state RPC, the rest = scheduler + slicing + guards; worker: waiting for
the copies + concatenation in ``_get_captured_states``); then one long call (64 x 2000
tokens) with and without offload: the worker's peak device memory, and the KV cache each
engine chose. The report is rewritten after every step, so a timeout still leaves figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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

OFFLOAD = "offload-captured"
SHM = "shm-transport"


# -- run in the worker through collective_rpc ------------------------------------------------


def w_shm(worker, on: bool):
    """shm-transport on/off in the worker (off: the states are pickled through collective_rpc, as stock)."""
    import speculators_compat

    if on:
        speculators_compat.reset()
        speculators_compat.apply()
    else:
        speculators_compat.revert([SHM])
    return SHM in speculators_compat.applied_ids()


def w_offload(worker, on: bool):
    import speculators_compat

    if on:
        speculators_compat.reset()
        speculators_compat.apply()
    else:
        speculators_compat.revert([OFFLOAD])
    return OFFLOAD in speculators_compat.applied_ids()


def _real(worker):
    """collective_rpc(callable) passes vLLM's WorkerWrapperBase; the extension is mixed into
    the worker it wraps."""
    return getattr(worker, "worker", None) or worker


def w_timer(worker):
    """Time the worker's _get_captured_states (an instance attribute of the real worker
    shadows its class's method; the wrapper forwards the RPC's getattr to it)."""
    worker = _real(worker)
    if "_g016_get" in worker.__dict__:
        return True
    worker.__dict__["_g016_get"] = True
    worker.__dict__["_g016_acc"] = {"get_s": 0.0, "calls": 0, "bytes": 0}

    def timed(*a, **k):
        import torch

        t = time.perf_counter()
        # looked up at each call: the class's method changes when offload is toggled
        out = type(worker)._get_captured_states(worker, *a, **k)
        listed = isinstance(out, list)
        if listed and torch.cuda.is_available() and any(x.is_cuda for x in out):
            torch.cuda.synchronize()
        acc = worker.__dict__["_g016_acc"]
        acc["get_s"] += time.perf_counter() - t
        acc["calls"] += 1
        # shm-transport replies with a handle to a shared-memory file (its size: nbytes)
        acc["bytes"] += sum(x.numel() * x.element_size() for x in out) if listed else getattr(out, "nbytes", 0)
        return out

    worker.__dict__["_get_captured_states"] = timed
    return True


def w_take_timer(worker):
    worker = _real(worker)
    acc = dict(worker.__dict__.get("_g016_acc", {}))
    worker.__dict__["_g016_acc"] = {"get_s": 0.0, "calls": 0, "bytes": 0}
    return acc


def w_reset_peak(worker):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return True


def w_set_threads(worker, n: int):
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    return old


def w_threads(worker):
    import torch

    return {"torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


def host_costs(rows: int, hidden: int, nlayers: int) -> dict:
    """What moving one call's captured states costs on this host, per pass (driver process,
    its current torch thread count): a clone (the stock driver's per-sequence .clone()),
    a torch.cat of 16 chunks (the worker's concatenation) and pickle dumps + loads (what
    collective_rpc does to the reply)."""
    import pickle

    import torch

    layers = [torch.randn(rows, hidden).to(torch.bfloat16) for _ in range(nlayers)]
    gb = sum(t.numel() * t.element_size() for t in layers) / 1e9
    out = {"gb": round(gb, 3), "torch_threads": torch.get_num_threads()}
    t = time.perf_counter()
    for x in layers:
        x.clone()
    out["clone_gb_s"] = round(gb / (time.perf_counter() - t), 2)
    chunks = [list(x.chunk(16)) for x in layers]
    t = time.perf_counter()
    for c in chunks:
        torch.cat(c)
    out["cat_gb_s"] = round(gb / (time.perf_counter() - t), 2)
    t = time.perf_counter()
    blob = pickle.dumps(layers, protocol=pickle.HIGHEST_PROTOCOL)
    t1 = time.perf_counter()
    pickle.loads(blob)
    t2 = time.perf_counter()
    out["pickle_dumps_gb_s"] = round(gb / (t1 - t), 2)
    out["pickle_loads_gb_s"] = round(gb / (t2 - t1), 2)
    return out


def w_make_states(worker, rows: int, hidden: int, nlayers: int):
    """A reply as big as one call's captured states, made in the worker (CPU tensors), to time
    what collective_rpc's transport alone costs (pickle + IPC + unpickle)."""
    import torch

    t = time.perf_counter()
    out = [torch.ones(rows, hidden, dtype=torch.bfloat16) for _ in range(nlayers)]
    worker.__dict__["_g016_make_s"] = time.perf_counter() - t
    return out


def w_make_s(worker):
    return worker.__dict__.get("_g016_make_s")


def w_memory(worker):
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {
        "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
        "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3),
        "device_used_gib": round((total - free) / 2**30, 3),
        "device_total_gib": round(total / 2**30, 3),
    }


# -- driver side ---------------------------------------------------------------------------


class Timing:
    """Wraps the generator's executor: time in execute_model and in each collective_rpc."""

    def __init__(self, executor):
        self._ex = executor
        self.acc = {}

    def _add(self, key, dt):
        self.acc[key] = self.acc.get(key, 0.0) + dt

    def execute_model(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._ex.execute_model(*a, **k)
        finally:
            self._add("execute_model_s", time.perf_counter() - t)

    def sample_tokens(self, *a, **k):
        t = time.perf_counter()
        try:
            return self._ex.sample_tokens(*a, **k)
        finally:
            self._add("sample_tokens_s", time.perf_counter() - t)

    def collective_rpc(self, method, *a, **k):
        t = time.perf_counter()
        try:
            return self._ex.collective_rpc(method, *a, **k)
        finally:
            name = method if isinstance(method, str) else "callable"
            self._add(f"rpc_{name}_s", time.perf_counter() - t)

    def take(self):
        acc, self.acc = self.acc, {}
        return acc

    def __getattr__(self, name):
        return getattr(self._ex, name)


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="perf")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--long-prompts", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--util", type=float, default=0.3, help="gpu_memory_utilization of each engine")
    ap.add_argument("--no-compiled", action="store_true")
    ap.add_argument("--threads", type=int, default=8, help="torch threads of the extract_threads mode")
    ap.add_argument("--steps", default="start,host,transport,llm,warmup,rounds,long")
    args = ap.parse_args()
    steps = args.steps.split(",")

    import random

    import common

    model_dir = str(common.MODELS / args.model)
    layer_ids = common.layers_for(common.num_layers(model_dir))
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    rng = random.Random(7)
    prompts = [[rng.randrange(5, vocab - 5) for _ in range(args.len)] for _ in range(args.prompts)]
    long = [[rng.randrange(5, vocab - 5) for _ in range(args.long_len)] for _ in range(args.long_prompts)]
    ntok = sum(map(len, prompts))
    report: dict = {"args": vars(args), "layers": layer_ids, "hidden": hidden, "tokens_per_call": ntok,
                    "captured_bytes_per_call": ntok * len(layer_ids) * hidden * 2, "steps": {}}
    out = Path(args.out)

    def save():
        out.write_text(json.dumps(report, indent=1, default=str))

    def run(name, fn):
        if name not in steps:
            return False
        t = time.time()
        try:
            report["steps"][name] = {"ok": True, "value": fn(), "seconds": round(time.time() - t, 1)}
        except BaseException as exc:  # noqa: BLE001
            report["steps"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000],
                                     "trace": traceback.format_exc()[-5000:], "seconds": round(time.time() - t, 1)}
            if isinstance(exc, KeyboardInterrupt):
                raise
        save()
        return report["steps"][name]["ok"]

    import speculators_compat

    h: dict = {}

    def start():
        import vllm
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        report["vllm"] = vllm.__version__
        t = time.time()
        gen = h["gen"] = VllmHiddenStatesGenerator(model_dir, layer_ids=layer_ids, max_model_len=args.max_model_len,
                                                   gpu_memory_utilization=args.util)
        init_s = time.time() - t
        gen.executor = h["timing"] = Timing(gen.executor)
        gen.executor.collective_rpc(w_timer)
        kv = gen.scheduler.kv_cache_config
        sc = gen.vllm_config.scheduler_config
        return {"init_s": round(init_s, 1), "applied": speculators_compat.applied_ids(),
                "kv_cache_tokens": kv.num_blocks * gen.vllm_config.cache_config.block_size,
                "kv_cache_gib": round(sum(getattr(t, "size", 0) for t in kv.kv_cache_tensors) / 2**30, 3),
                "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
                "worker_memory": gen.executor.collective_rpc(w_memory)[0],
                "threads": {"driver": w_threads(None), "worker": gen.executor.collective_rpc(w_threads)[0]}}

    def transport():
        gen = h["gen"]
        out = {"bytes": ntok * hidden * len(layer_ids) * 2, "runs": []}
        for _ in range(3):
            t = time.perf_counter()
            reply = gen.executor.collective_rpc(w_make_states, args=(ntok, hidden, len(layer_ids)), unique_reply_rank=0)
            dt = time.perf_counter() - t
            made = gen.executor.collective_rpc(w_make_s)[0]
            reply = reply[0] if isinstance(reply, list) and len(reply) == 1 and isinstance(reply[0], list) else reply
            assert len(reply) == len(layer_ids)
            del reply
            out["runs"].append({"rpc_s": round(dt, 4), "worker_make_s": round(made, 4),
                                "transport_gb_s": round(out["bytes"] / 1e9 / max(dt - made, 1e-9), 2)})
        return out

    def llm():
        from vllm import LLM

        sc = h["gen"].vllm_config.scheduler_config  # the same scheduler limits as the generator
        common_kw = dict(model=model_dir, skip_tokenizer_init=True, max_model_len=args.max_model_len,
                         max_num_batched_tokens=sc.max_num_batched_tokens, max_num_seqs=sc.max_num_seqs,
                         enable_prefix_caching=False, gpu_memory_utilization=args.util, seed=0)
        out = {}
        modes = [("llm_eager", True)] + ([] if args.no_compiled else [("llm_compiled", False)])
        for mode, eager in modes:
            t = time.time()
            engine = h[mode] = LLM(enforce_eager=eager, **common_kw)
            blocks = getattr(engine.llm_engine.vllm_config.cache_config, "num_gpu_blocks", None)
            out[mode] = {"init_s": round(time.time() - t, 1), "kv_cache_blocks": blocks,
                         "kv_cache_tokens": blocks * engine.llm_engine.vllm_config.cache_config.block_size
                         if blocks else None}
        return out

    def call(mode, batch):
        from vllm import SamplingParams

        if mode.startswith("extract"):
            h["gen"].executor.collective_rpc(w_take_timer)
            h["timing"].take()  # after the RPC above, so only the call's own time is counted
            sync()
            t = time.perf_counter()
            res = h["gen"].generate(batch)
            sync()
            dt = time.perf_counter() - t
            if [r["hidden_states"][0].shape[0] for r in res] != [len(b) for b in batch]:
                raise AssertionError("rows != tokens")
            parts = h["timing"].take()
            worker = h["gen"].executor.collective_rpc(w_take_timer)[0]
            del res
            parts = {k: round(v, 4) for k, v in parts.items()}
            parts["worker_get_captured_s"] = round(worker.get("get_s", 0.0), 4)
            parts["captured_bytes"] = worker.get("bytes", 0)
            return dt, parts
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine = h[mode]
        sync()
        t = time.perf_counter()
        engine.generate([{"prompt_token_ids": ids} for ids in batch], sp, use_tqdm=False)
        sync()
        return time.perf_counter() - t, {}

    def set_offload(on):
        return h["gen"].executor.collective_rpc(w_offload, args=(on,))

    def modes():
        return ["extract", "extract_nooffload", "extract_stock_transport", "extract_threads"] + [
            m for m in ("llm_eager", "llm_compiled") if m in h]

    def timed(mode, batch):
        import torch

        if mode == "extract_nooffload":
            set_offload(False)
            try:
                return call(mode, batch)
            finally:
                set_offload(True)
        if mode == "extract_stock_transport":  # the stock transport: pickled states, 1 driver thread
            old = torch.get_num_threads()
            torch.set_num_threads(1)
            h["gen"].executor.collective_rpc(w_shm, args=(False,))
            try:
                return call(mode, batch)
            finally:
                torch.set_num_threads(old)
                h["gen"].executor.collective_rpc(w_shm, args=(True,))
        if mode == "extract_threads":  # driver and worker with THREADS torch threads (vLLM sets 1)
            old = torch.get_num_threads()
            torch.set_num_threads(args.threads)
            old_w = h["gen"].executor.collective_rpc(w_set_threads, args=(args.threads,))[0]
            try:
                return call(mode, batch)
            finally:
                torch.set_num_threads(old)
                h["gen"].executor.collective_rpc(w_set_threads, args=(old_w,))
        return call(mode, batch)

    def warmup():
        out = {}
        for mode in modes():
            dt, _ = timed(mode, prompts[: max(8, args.prompts // 4)])
            out[mode] = round(dt, 3)
        return out

    def rounds():
        times = {m: [] for m in modes()}
        parts = {m: [] for m in modes() if m.startswith("extract")}
        order = modes()
        for r in range(args.rounds):
            for mode in order[r % len(order):] + order[: r % len(order)]:
                dt, p = timed(mode, prompts)
                times[mode].append(round(dt, 4))
                if mode in parts:
                    parts[mode].append(p)
            report["partial_times"] = times
            save()
        tps = {m: {"median": round(ntok / statistics.median(v)), "best": round(ntok / min(v)), "times": v}
               for m, v in times.items()}
        ratios = {}
        for a, b in (("extract", "llm_eager"), ("extract", "llm_compiled"), ("extract_nooffload", "llm_eager"),
                     ("extract_threads", "llm_eager"), ("extract", "extract_nooffload"),
                     ("extract_threads", "extract"), ("llm_eager", "llm_compiled"),
                     ("extract", "extract_stock_transport"), ("extract_stock_transport", "llm_eager")):
            if a in tps and b in tps:
                ratios[f"{a}/{b}"] = {"median": round(tps[a]["median"] / tps[b]["median"], 4),
                                      "best": round(tps[a]["best"] / tps[b]["best"], 4)}
        breakdown = {}
        for mode, plist in parts.items():
            keys = sorted({k for p in plist for k in p})
            med = {k: statistics.median([p.get(k, 0) for p in plist]) for k in keys}
            total = statistics.median(times[mode])
            known = sum(v for k, v in med.items() if k.endswith("_s") and not k.startswith("worker_"))
            med["driver_other_s"] = round(total - known, 4)
            med["total_s"] = total
            breakdown[mode] = med
        return {"tokens_per_s": tps, "ratios": ratios, "breakdown": breakdown}

    def long_call():
        out = {}
        ltok = sum(map(len, long))
        for on in (True, False):
            state = set_offload(on)
            h["gen"].executor.collective_rpc(w_reset_peak)
            sync()
            t = time.perf_counter()
            res = h["gen"].generate(long)
            sync()
            dt = time.perf_counter() - t
            rows_ok = [r["hidden_states"][0].shape[0] for r in res] == [len(b) for b in long]
            mem = h["gen"].executor.collective_rpc(w_memory)[0]
            del res
            out["offload" if on else "no_offload"] = {"applied_in_worker": state, "seconds": round(dt, 3),
                                                      "tokens_per_s": round(ltok / dt), "rows_ok": rows_ok,
                                                      "worker_memory": mem}
            save()
        set_offload(True)
        out["tokens"] = ltok
        out["captured_gib"] = round(ltok * len(layer_ids) * hidden * 2 / 2**30, 3)
        return out

    if run("start", start):
        run("host", lambda: host_costs(ntok, hidden, len(layer_ids)))
        run("transport", transport)
        run("llm", llm)
        if run("warmup", warmup):
            run("rounds", rounds)
        run("long", long_call)
    for key in ("gen", "llm_eager", "llm_compiled"):
        h.pop(key, None)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
