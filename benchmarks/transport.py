"""Benchmark: a worker's captured states to the driver, pickled (stock) vs through shm-transport.

    python benchmarks/transport.py [--mib 512] [--layers 4] [--hidden 2048] [--repeats 5]

Both ways run in this one command, alternating, on the same tensors (bf16, ``--layers`` x
[tokens, hidden] made of per-step parts as the worker holds them):

* ``pickle``: what ``collective_rpc`` does with the stock reply -- ``torch.cat`` per layer in
  the worker, ``pickle.dumps`` (protocol 5, as vLLM's message queue), ``pickle.loads`` in the
  driver (vLLM's shared-memory ring adds its own copies on top: not counted here, so the
  stock figure is optimistic);
* ``shm``: ``shm-transport``'s worker side (concatenation straight into a /dev/shm file) and
  the driver's unpickling of the handle (a mapping), then one read of every byte (what the
  stock slicing does next), so lazily mapped pages are paid for;
* ``inplace``: ``results-in-place`` with ``shm-transport``: the worker copies each step's parts
  into the driver's segment (reused from call to call), its reply is pickled, the driver's
  per-call transfer turns it into layers, the stock slicing ``h[a:b].clone().cpu()`` takes every
  block (``--sequences`` per call), and every byte is read once. ``inplace_copies`` counts the
  blocks the slicing copied (0: each caller's tensor is its block).

Prints one JSON line: medians in seconds and GB/s, and the ratios shm / pickle and inplace / pickle (time).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rotated_medians(ways: list, repeats: int) -> dict[str, float]:
    """Each way's median time over ``repeats`` rounds, the order rotated every round."""
    times: dict = {name: [] for name, _ in ways}
    for i in range(repeats):
        for name, fn in ways[i % len(ways):] + ways[:i % len(ways)]:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    import torch

    from speculators_compat.patches.features.datapath._runtime import pool as pools
    from speculators_compat.patches.features.datapath._runtime import reply, worker
    from speculators_compat.patches.features.datapath._runtime import segments as transport

    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sequences", type=int, default=64)
    args = ap.parse_args()
    tokens = args.mib * 2**20 // (args.layers * args.hidden * 2)
    per_step = tokens // args.steps
    parts = [[torch.randn(per_step, args.hidden).to(torch.bfloat16) for _ in range(args.steps)]
             for _ in range(args.layers)]
    nbytes = sum(p.numel() * 2 for layer in parts for p in layer)

    def stock():
        reply = [torch.cat(layer, dim=0) for layer in parts]
        got = pickle.loads(pickle.dumps(reply, protocol=5))
        return sum(float(g[-1, -1]) for g in got)

    def shm():
        handle = transport.write_states(parts, owner_pid=os.getpid())
        if handle is None:
            raise SystemExit(f"{transport.folder()} has no room for {nbytes} bytes")
        got = pickle.loads(pickle.dumps(handle, protocol=5))
        return sum(float(g.sum()) * 0 + float(g[-1, -1]) for g in got)  # g.sum() touches every page

    pool, state = pools.Pool(), worker.WorkerState()
    total = per_step * args.steps
    lengths = [total // args.sequences] * (args.sequences - 1)
    lengths.append(total - sum(lengths))
    copies = [0]

    def inplace():
        _, size = pools.layout(lengths, args.layers, args.hidden, 2)
        seg = pool.acquire(size, None)
        if seg is None:
            raise SystemExit(f"{transport.folder()} has no room for {size} bytes")
        plan = pool.plan(seg, lengths, args.layers, args.hidden, "bfloat16", 2)
        state.accept(plan)
        pool.mapped(seg)
        transfer = reply.Transfer(plan, *pool.tensors(seg, plan))
        for k in range(args.steps):
            state.store([layer[k] for layer in parts])
        written = pickle.loads(pickle.dumps(state.finish(), protocol=5))
        try:
            aux_hidden_states = transfer.take(written)
        finally:
            transfer.close()
            pool.release(seg)
        out, offset = 0.0, 0
        for seq_len in lengths:  # speculators 0.3.0's slicing
            blocks = [h[offset:offset + seq_len] for h in aux_hidden_states]
            got = [b.clone().cpu() for b in blocks]
            copies[0] += sum(g.data_ptr() != b.data_ptr() for g, b in zip(got, blocks))
            out += sum(float(g.sum()) * 0 + float(g[-1, -1]) for g in got)
            offset += seq_len
        return out

    stock(), shm(), inplace()  # warm-up
    copies[0] = 0
    med = _rotated_medians([("pickle", stock), ("shm", shm), ("inplace", inplace)], args.repeats)
    print(json.dumps({
        "bytes": nbytes, "torch_threads": torch.get_num_threads(), "repeats": args.repeats,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "gb_s": {k: round(nbytes / v / 1e9, 2) for k, v in med.items()},
        "shm_over_pickle_time": round(med["shm"] / med["pickle"], 3),
        "inplace_over_pickle_time": round(med["inplace"] / med["pickle"], 3),
        "inplace_copies": copies[0],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
