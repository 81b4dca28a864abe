"""The GPU benchmark: extraction against vLLM's eager prefill, and the real job end to end.

    python benchmarks/gpu.py build ROOT [llama-1b llama-8b]     # the random bf16 Llamas (no vLLM needed)
    python benchmarks/gpu.py bench ROOT/llama-1b --out FILE [--rounds 3] [--prompts 64] [--len 1024]
                                                  [--vllm-extract [--vllm-extract-dir DIR]] [--tp N]
                                                  [--vllm-extract-alone [--vllm-extract-util U]]
    python benchmarks/gpu.py stock ROOT/llama-8b --out FILE [--calls 50] [--batch 16] [--disk DIR]
                                                  [--prefill-json BENCH_FILE] [--runs N] [--writer torch|direct]
                                                  [--sync file|batch] [--delete-saved]

``bench`` (``extract.py``): one process, every engine alive on the same GPU(s) (``--tp N``: each
tensor parallel over N), built once: vLLM's own eager prefill (``LLM(enforce_eager=True,
enable_prefix_caching=False)``, ``generate(SamplingParams(max_tokens=1))``: ``prefill``), the stock
``VllmHiddenStatesGenerator`` through the shim as installed (``extract``), the same without the
self-check (``extract_nocheck``) and with the capture hooks removed in the worker
(``steps_nohooks``: the generator's steps alone). ``--vllm-extract``: also vLLM's own hidden-state
extraction (``anchor.py``: the ``extract_hidden_states`` speculative method and its
``ExampleHiddenStatesConnector`` writing each request's states to DIR, default
``/dev/shm/gpu-extract-anchor-PID``, timed until every file is loaded; at the generator's
``max_model_len``; its rows compared with the generator's; it fails soft). ``--vllm-extract-alone``:
vLLM's own extraction at its best settings, in a process of its own beside the prefill only (no
generator), at the model's own ``max_model_len``; set the ratio of a generator run's ``extract``
against this run's ``vllm_extract``, each to its own process's prefill. After a warm-up (each
mode's first full-size call kept in ``first_call``) the modes alternate in a rotated order,
``--rounds`` times, each call timed between CUDA synchronisations. Reported: tokens/s per call,
medians, spread, ratios to the prefill and the model's bar (``TARGETS``), where a call's time went
(before the first step, the steps with the copies, after the reply), the worker's peak device
memory, the driver's resident memory, which performance patches applied (``missing_features``: then
the figures are not the library's), the driver's own time under cProfile for one more call, and the
capturing worker's under cProfile for three more calls with the self-check and three without
(``worker_profile``), and both under cProfile in the generator's first call (``first_call_profile``).

``stock`` (``stock.py``): the stock data script's loop (``tests/stock_datagen.py``: 4 saving threads,
their futures awaited at the end) through ``speculators-compat run`` on ``--calls`` batches of
``--batch`` x ``--len`` tokens saved to ``--disk``, ``--runs`` times; before them and after each, the
disk's own write bandwidth (64 MiB writes then fsync, one writer and ``--disk-writers``; the limit
takes the highest measured), and before them the save path's from memory. The figure, with
``--prefill-json`` (a ``bench`` report of the same model): ``ratio_to_limit``, the extraction phase
(first ``generate()`` to the last file complete) in tokens/s over the lower of the eager prefill and
the disk's best bandwidth over the bytes a token writes (bar 0.90), the wall-clock ratio beside it;
each call's seconds, the script's own time between calls, the held results, resident memory and
``/dev/shm`` use sampled every 0.2 s.

Ratios only, measured in one process: absolute figures vary with the machine. The self-check's
separation is ``tools/gpu/selfcheck.py``; the CPU benchmark ``benchmarks/run.py``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common  # noqa: F401 - the environment defaults, before vLLM is imported


def main(argv=None):
    ap = argparse.ArgumentParser(description="the GPU benchmark (see the module's docstring)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="the random bf16 Llamas")
    b.add_argument("root")
    b.add_argument("names", nargs="*", default=["llama-1b", "llama-8b"])
    p = sub.add_parser("bench", help="extraction against vLLM's eager prefill")
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--len", type=int, default=1024)
    p.add_argument("--util", type=float, default=0.3)
    p.add_argument("--dtype", default="auto", help="float32 for a CPU dry run (vLLM's CPU attention lacks bf16 on some CPUs)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of every engine (vLLM's and the generator)")
    p.add_argument("--vllm-extract", action="store_true",
                   help="also vLLM's own extraction (extract_hidden_states + ExampleHiddenStatesConnector; vllm_extract)")
    p.add_argument("--vllm-extract-dir", help="where its connector writes (default /dev/shm/gpu-extract-anchor-PID)")
    p.add_argument("--vllm-extract-util", type=float, help="its engine's gpu_memory_utilization (default --util)")
    p.add_argument("--vllm-extract-alone", action="store_true",
                   help="vLLM's own extraction against the prefill in a process without the generator, at the "
                        "model's own max_model_len (its best settings; compare the ratios of two processes)")
    p.add_argument("--vllm-extract-len", type=int,
                   help="its max_model_len (default: the generator's, or alone the model's own)")
    s = sub.add_parser("stock", help="the stock script through the runner, against its limit")
    s.add_argument("model")
    s.add_argument("--out", required=True)
    s.add_argument("--calls", type=int, default=50)
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--len", type=int, default=1024)
    s.add_argument("--disk", default="/tmp/stock")
    s.add_argument("--disk-gib", type=float, default=4.0)
    s.add_argument("--util", type=float, default=0.5)
    s.add_argument("--save-gib", type=float, default=2.0, help="the save path's own bandwidth on this much (0: skip)")
    s.add_argument("--prefill-json", help="a bench report of the same model: the run against its prefill")
    s.add_argument("--runs", type=int, default=1, help="runs of the stock script (medians and spread)")
    s.add_argument("--writer", choices=("torch", "direct"),
                   help="SPECULATORS_COMPAT_SAVE_WRITER for the runs (torch: the save path before the direct writer)")
    s.add_argument("--disk-writers", type=int, default=4, help="the disk's bandwidth with this many writers too")
    s.add_argument("--delete-saved", action="store_true",
                   help="delete each sample file once counted under its final name (runs longer than the disk holds)")
    s.add_argument("--sync", choices=("file", "batch"), help="SPECULATORS_COMPAT_SAVE_SYNC for the runs")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        print(json.dumps(common.build(Path(args.root), args.names)))
    elif args.cmd == "bench":
        import extract

        extract.bench(args.model, Path(args.out), args.rounds, args.prompts, args.len, args.util, args.dtype,
                      args.vllm_extract, args.vllm_extract_dir, args.vllm_extract_util, args.tp,
                      args.vllm_extract_alone, args.vllm_extract_len)
    else:
        import stock

        stock.stock(args.model, Path(args.out), args.calls, args.batch, args.len, Path(args.disk), args.disk_gib,
                    args.util, args.prefill_json, args.save_gib, args.runs, args.writer, args.disk_writers,
                    args.delete_saved, args.sync)


if __name__ == "__main__":
    main()
