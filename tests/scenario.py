"""One real extraction scenario, run in a fresh process; prints a JSON report.

Used by the end-to-end tests (``tests/test_e2e.py``) with different environments: all
patches, each patch disabled alone (``SPECULATORS_COMPAT_DISABLE=<id>``), none at all, and
tensor parallel 2 with spawned workers. ``speculators_compat`` is imported inside
``main()`` only, so with ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` the workers get the
patches solely through the ``vllm.general_plugins`` entry point.

Steps (each reported ok / failed with its error; later steps still run when possible):
  start    construct the stock generator (dtype from SPECULATORS_COMPAT_DTYPE)
  mixed    40+ sequences of 1..300 tokens: rows == tokens, every layer == HF fp32
  repeat   the same batch again (second and third calls) == the first
  chunked  5 x 2000 tokens (> max_num_batched_tokens 8192) == HF fp32
  leak     the worker request cache is empty after the calls
  badinput empty batch / empty sequence / out-of-vocab token / float token raise clearly; a
           constructor given a missing path, a folder without config.json, an out-of-range or a
           duplicate layer id raises before anything loads; the next call still returns correct data
  overlong a sequence over max_model_len - 1 is truncated as stock does, with a warning
           naming the sequence and both lengths
  layers   bad layer ids (out of range, negative, not ints, empty, duplicate) raise before any
           engine starts
  prefix   sequences sharing a 300-token prefix (and exact duplicates) == HF fp32: no token is
           skipped by prefix caching
  soak     100 more calls: the worker request cache, the captured-state buffer, the
           scheduler's requests and its free KV blocks are the same after as before
  longseq  (with --max-num-batched-tokens, speculators 0.4) a single sequence longer than
           max_num_batched_tokens, chunked across steps, == HF fp32
  selfcheck  (with the self-check applied) every sequence checked: correct rows pass, and each
           fault injected through the test-only switch (rows of two sequences swapped, shifted by
           one, the last row dropped, the last layer captured after the norm or without the
           residual) raises SelfCheckError naming a faulted sequence; again with 2 positions of
           each sequence compared; then with the last layer not among the captured ones (the
           workers capture it for the check)

The generator is then deleted (its ``__del__`` shuts the executor down), or with
``--exit-shutdown`` left alive to the interpreter's exit, as a module-level generator is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

LAYERS: list[int] = []  # set in main(): first, third, fourth-last and last layer
TOLERANCE = [1e-4]  # set in main() from --tol
KEPT: list = []  # --exit-shutdown: the generator, alive until the interpreter exits


def compare(path, batch, results):
    from speculators_compat.testing import tiny

    worst = 0.0
    if len(results) != len(batch):
        raise AssertionError(f"{len(results)} results for {len(batch)} sequences")
    for i, (ids, res) in enumerate(zip(batch, results)):
        ref = tiny.hf_reference(path, ids, LAYERS)
        if len(res["hidden_states"]) != len(ref):
            raise AssertionError(f"sequence {i}: {len(res['hidden_states'])} layers, expected {len(ref)}")
        if res["input_ids"].tolist() != list(ids):
            raise AssertionError(f"sequence {i}: input_ids differ from the input")
        for layer, got, want in zip(LAYERS, res["hidden_states"], ref):
            if tuple(got.shape) != tuple(want.shape):
                raise AssertionError(f"sequence {i} layer {layer}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            worst = max(worst, (got.float() - want).abs().max().item())
    if worst > TOLERANCE[0]:
        raise AssertionError(f"max abs diff against HF fp32 {worst:.3g} > {TOLERANCE[0]}")
    return worst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", default="layers,start,mixed,repeat,chunked,leak,badinput,overlong,prefix,soak")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--tol", type=float, default=1e-4, help="max abs diff against HF fp32")
    ap.add_argument("--default-layers", action="store_true",
                    help="construct with layer_ids=None: the stock default [2, L // 2, L - 3, L - 1]")
    ap.add_argument("--exit-shutdown", action="store_true",
                    help="leave the generator alive to interpreter exit (a module-level generator in a "
                         "script); the report is written after the at-exit shutdown")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    steps = args.steps.split(",")
    TOLERANCE[0] = args.tol
    with open(os.path.join(args.model, "config.json")) as fh:
        config = json.load(fh)
    # a multimodal wrapper (Kimi-K2.5) keeps the layer count in its text config
    num_layers = config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"]
    if args.default_layers:
        LAYERS[:] = sorted({2, num_layers // 2, num_layers - 3, num_layers - 1})
    else:
        LAYERS[:] = sorted({0, min(2, num_layers - 1), max(num_layers - 3, 1), num_layers - 1})

    from speculators_compat.testing import tiny

    tiny.cpu_environment(args.tp)
    import speculators_compat  # noqa: F401  (only here: workers must get it via the plugin)

    report: dict = {"steps": {}, "layers": LAYERS, "log": []}

    import logging

    class Keep(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith(("generate()", "executor")):
                report["log"].append(message)

    compat_log = logging.getLogger("speculators_compat")
    compat_log.addHandler(Keep(level=logging.INFO))
    compat_log.setLevel(logging.INFO)

    def run(name, fn):
        if name not in steps:
            return None
        t = time.time()
        try:
            value = fn()
            report["steps"][name] = {"ok": True, "value": value, "seconds": round(time.time() - t, 2)}
        except BaseException as exc:  # noqa: BLE001 - the report must record any failure
            report["steps"][name] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "trace": traceback.format_exc()[-4000:],
                "seconds": round(time.time() - t, 2),
            }
            if isinstance(exc, KeyboardInterrupt):
                raise
        return report["steps"][name]

    holder = {}

    def start():
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        extra = {}
        if args.max_num_batched_tokens:
            extra["max_num_batched_tokens"] = args.max_num_batched_tokens
        holder["gen"] = VllmHiddenStatesGenerator(
            args.model, layer_ids=None if args.default_layers else LAYERS, max_model_len=2048,
            tensor_parallel_size=args.tp, **extra
        )
        workers = holder["gen"].executor.collective_rpc(lambda self: __import__("speculators_compat").applied_ids())
        return {"applied": speculators_compat.applied_ids(), "workers": workers,
                "layer_ids": list(holder["gen"].layer_ids)}

    rng = random.Random(1234)
    lengths = [1, 2, 3, 17, 299, 300] + [rng.randint(1, 300) for _ in range(36)]
    mixed = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    chunked = [[rng.randrange(3, 500) for _ in range(2000)] for _ in range(5)]

    def step_mixed():
        holder["first"] = holder["gen"].generate(mixed)
        return compare(args.model, mixed, holder["first"])

    def step_repeat():
        import torch

        for _ in range(2):
            again = holder["gen"].generate(mixed)
            for a, b in zip(holder["first"], again):
                for x, y in zip(a["hidden_states"], b["hidden_states"]):
                    if not torch.equal(x, y):
                        raise AssertionError("a repeated call returned different states")
        return "identical"

    def step_chunked():
        return compare(args.model, chunked, holder["gen"].generate(chunked))

    def step_leak():
        sizes = holder["gen"].executor.collective_rpc(lambda self: len(self.model_runner.requests))
        if any(sizes):
            raise AssertionError(f"worker request caches hold {sizes} requests")
        from speculators_compat.patches.features import pipelined_steps

        # calls so far whose first step pipelined-steps sent while the stock code added the rest
        early = pipelined_steps.early_first_steps(holder["gen"])
        return {"requests": sizes, "in_place": in_place(holder["gen"], holder["first"]), "early_first_steps": early}

    def in_place(gen, results):
        """With results-in-place: each result tensor owns exactly its bytes, the segments of the
        calls so far were reused (at most 4 for 4 calls, one of them still held), and no segment
        file is left in the shared-memory folder."""
        import glob

        from speculators_compat.core import hooks
        from speculators_compat.patches.features.datapath._runtime import pool as pools, segments

        if "results-in-place" not in hooks.applied_ids():
            return "not applied"
        pool = pools.pool_of(gen)
        if pool is None:
            raise AssertionError("results-in-place applied, but the generator has no pool")
        for i, r in enumerate(results):
            for t in r["hidden_states"]:
                if t.untyped_storage().nbytes() != t.numel() * t.element_size():
                    raise AssertionError(f"sequence {i}: a {t.untyped_storage().nbytes()}-byte storage for "
                                         f"{t.numel() * t.element_size()} bytes of states")
        files = glob.glob(f"{segments.folder()}/{segments.PREFIX}-{os.getpid()}-*")
        if files:
            raise AssertionError(f"segment files left: {files}")
        if not 1 <= len(pool._segments) <= 4:
            raise AssertionError(f"{len(pool._segments)} segments after 4 calls")
        return {"segments": len(pool._segments), "held_bytes": pool.held_bytes()}

    def step_badinput():
        gen = holder["gen"]
        outcomes = {}
        for name, bad in {
            "empty batch": [],
            "empty sequence": [[5, 6, 7], []],
            "out of vocab": [[5, 6, 10**6]],
            "float token": [[5, 6.5, 7]],
        }.items():
            try:
                gen.generate(bad)
            except (ValueError, TypeError) as exc:
                outcomes[name] = f"{type(exc).__name__}: {exc}"
            else:
                raise AssertionError(f"{name}: no error raised")
        # without guard-input a duplicate layer id would start a whole engine: the stock code takes it
        guarded = "guard-input" in speculators_compat.applied_ids()
        outcomes["constructor"] = bad_constructs() if guarded else "guard-input not applied"
        compare(args.model, mixed[:8], gen.generate(mixed[:8]))
        return outcomes

    def bad_constructs():
        """A missing local path, a folder without config.json and bad layer ids: the error names
        what is wrong, before the stock constructor logs its first line (before the tokenizer,
        the config or the engine load), and no process is left behind. A hub-id-shaped name that
        does not exist is left to transformers."""
        import logging
        import multiprocessing
        import tempfile

        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        no_config = tempfile.mkdtemp(prefix="no-config-", dir=os.getcwd())  # the test's tmp_path
        with open(os.path.join(no_config, "tokenizer.json"), "w") as fh:
            fh.write("{}")
        stock_lines = []

        class Grab(logging.Handler):
            def emit(self, record):
                stock_lines.append(record.getMessage())

        stock_log = logging.getLogger(VllmHiddenStatesGenerator.__module__)
        level, handler = stock_log.level, Grab(level=logging.INFO)
        stock_log.setLevel(logging.INFO)
        stock_log.addHandler(handler)
        children = len(multiprocessing.active_children())
        outcomes = {}
        try:
            for name, (path, ids) in {
                "missing path": ("/nonexistent/model", None),
                "no config.json": (no_config, None),
                "layer out of range": (args.model, [0, num_layers]),
                "duplicate layer": (args.model, [LAYERS[1], LAYERS[0], LAYERS[1]]),
                "hub id": ("speculators-compat-test/no-such-model", None),
            }.items():
                del stock_lines[:]
                t = time.time()
                try:
                    VllmHiddenStatesGenerator(path, layer_ids=ids, max_model_len=2048)
                except Exception as exc:  # noqa: BLE001 - the report records whichever error it was
                    outcomes[name] = {"error": f"{type(exc).__name__}: {exc}"[:600],
                                      "seconds": round(time.time() - t, 3), "stock_started": bool(stock_lines)}
                else:
                    raise AssertionError(f"{name}: no error raised")
        finally:
            stock_log.removeHandler(handler)
            stock_log.setLevel(level)
        if len(multiprocessing.active_children()) != children:
            raise AssertionError(f"a failed constructor left processes: {multiprocessing.active_children()}")
        return outcomes

    def step_layers():
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator

        outcomes = {}
        cases = {"out of range": [0, num_layers], "negative": [-1], "not ints": ["2"], "empty": []}
        if "guard-input" in speculators_compat.applied_ids():  # the stock code takes a duplicate id
            cases["duplicate"] = [LAYERS[0], LAYERS[0]]
        for name, bad in cases.items():
            try:
                VllmHiddenStatesGenerator(args.model, layer_ids=bad, max_model_len=2048)
            except (ValueError, TypeError) as exc:
                outcomes[name] = f"{type(exc).__name__}: {exc}"
            else:
                raise AssertionError(f"layer_ids {bad!r}: no error raised")
        return outcomes

    def step_overlong():
        import logging

        seen = []

        class Grab(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())

        handler = Grab(level=logging.WARNING)
        logging.getLogger().addHandler(handler)
        try:
            seq = [rng.randrange(3, 500) for _ in range(2100)]
            res = holder["gen"].generate([mixed[3], seq])
        finally:
            logging.getLogger().removeHandler(handler)
        rows = [r["hidden_states"][0].shape[0] for r in res]
        if rows != [len(mixed[3]), 2047]:
            raise AssertionError(f"rows {rows}, expected [{len(mixed[3])}, 2047]")
        compare(args.model, [mixed[3], seq[:2047]], res)
        warned = [m for m in seen if "2100" in m and "2047" in m and "sequence 1" in m]
        if not warned:
            raise AssertionError(f"no truncation warning naming sequence 1, 2100 and 2047 tokens: {seen}")
        return warned[0]

    def step_prefix():
        shared = [rng.randrange(3, 500) for _ in range(300)]
        batch = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 16, 33, 50)]
        batch += [list(batch[1]), list(shared), shared[:17]] + [list(batch[3]) for _ in range(4)]
        return compare(args.model, batch, holder["gen"].generate(batch))

    def worker_state(gen):
        return gen.executor.collective_rpc(
            lambda self: (len(self.model_runner.requests), getattr(self, "_captured_states", None) is None)
        )

    def step_soak():
        gen = holder["gen"]
        pool = gen.scheduler.kv_cache_manager.block_pool
        before = {"free_blocks": pool.get_num_free_blocks(), "workers": worker_state(gen)}
        for call in range(100):
            batch = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 80))] for _ in range(rng.randint(1, 6))]
            res = gen.generate(batch)
            if [r["hidden_states"][0].shape[0] for r in res] != [len(b) for b in batch]:
                raise AssertionError(f"call {call}: rows differ from tokens")
        after = {"free_blocks": pool.get_num_free_blocks(), "workers": worker_state(gen)}
        if gen.scheduler.requests:
            raise AssertionError(f"the scheduler still holds {len(gen.scheduler.requests)} requests")
        if after != before or any(n for n, _ in after["workers"]):
            raise AssertionError(f"state grew over 100 calls: before {before}, after {after}")
        return after

    def step_longseq():
        batch = [[rng.randrange(3, 500) for _ in range(2000)], mixed[4], [rng.randrange(3, 500) for _ in range(1500)]]
        return compare(args.model, batch, holder["gen"].generate(batch))

    def step_selfcheck():
        from speculators_compat.core import hooks
        from speculators_compat.errors import SelfCheckError
        from speculators_compat.patches.features.datapath._runtime import checking as selfcheck
        import selfcheck_faults as faults  # tests/faults_site, on PYTHONPATH with the faults armed

        if "self-check" not in hooks.applied_ids():
            return "not applied"
        import wrapt

        from speculators_compat.patches.features.datapath import self_check

        gen = holder["gen"]
        calls_before = selfcheck.totals_of(gen).calls
        early = []  # comparisons sent as soon as the rows were in place (not after the call)

        def count_early(wrapped, instance, args, kwargs):
            early.append(True)
            return wrapped(*args, **kwargs)

        sent = wrapt.FunctionWrapper(self_check.Comparison.send, count_early)
        self_check.Comparison.send, unwrapped = sent, self_check.Comparison.send
        batch = mixed[:12]
        long = [i for i, ids in enumerate(batch) if len(ids) >= 2]
        hit = {"swap": long[:2], "shift": long[:1], "drop": [0]}
        saved = {k: os.environ.get(k) for k in (selfcheck.SELF_CHECK_ENV, selfcheck.POSITIONS_ENV, faults.ENV)}
        os.environ[selfcheck.SELF_CHECK_ENV] = "all"
        out: dict = {}

        def run(key, fault, faulted):
            os.environ[faults.ENV] = fault
            try:
                gen.generate(batch)
            except SelfCheckError as exc:
                error = str(exc)
            else:
                error = None
            last = selfcheck.totals_of(gen).last
            seqs = [r for r in last if r["sequence"] in faulted]
            out[key] = {"error": error, "faulted": faulted, "compared": [r.get("compared") for r in last],
                        "rows": [r["rows"] for r in last],
                        "correct_worst": max((r["worst"] for r in last if r["sequence"] not in faulted), default=0.0),
                        "faulted_worst": [r["worst"] for r in seqs]}
            if fault == "none" and error:
                raise AssertionError(f"correct rows failed the self-check: {error}")
            if fault != "none" and not (error and any(f"sequence {i}" in error for i in faulted)):
                raise AssertionError(f"fault {fault!r} in sequences {faulted}: not caught ({error})")

        try:
            everyone = list(range(len(batch)))
            run("none", "none", [])
            for fault in faults.DRIVER_FAULTS:
                run(fault, fault, hit[fault])
            for fault in faults.WORKER_FAULTS:
                run(fault, fault, everyone)
            # two positions of each sequence compared (one spread, the last): every fault still caught
            os.environ[selfcheck.POSITIONS_ENV] = "2"
            run("sampled:none", "none", [])
            for fault in (*faults.DRIVER_FAULTS, *faults.WORKER_FAULTS):
                run(f"sampled:{fault}", fault, hit.get(fault, everyone))
            os.environ.pop(selfcheck.POSITIONS_ENV)
            # the last layer not captured: the workers capture it for the checked sequences only
            layers = list(gen.layer_ids)
            gen.layer_ids = [i for i in layers if i != num_layers - 1]
            gen._setup_capture()
            try:
                run("own:none", "none", [])
                for fault in faults.WORKER_FAULTS:
                    run(f"own:{fault}", fault, everyone)
                os.environ[faults.ENV] = "none"
                if len(gen.generate(batch)[0]["hidden_states"]) != len(gen.layer_ids):
                    raise AssertionError("the results hold the layer captured for the check")
            finally:
                gen.layer_ids = layers
                gen._setup_capture()
        finally:
            self_check.Comparison.send = unwrapped
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out["totals"] = selfcheck.summary(gen)
        out["compared"] = {"calls": selfcheck.totals_of(gen).calls - calls_before, "sent_early": len(early),
                           "results_in_place": "results-in-place" in hooks.applied_ids()}
        return out

    def write():
        report["log"] = report["log"][:3] + report["log"][-2:]
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1, default=str)

    if args.exit_shutdown:
        import atexit

        # registered before speculators_compat's at-exit handler (at the first generate()): atexit
        # runs the last registered first, so this one runs after the shutdown
        atexit.register(write)
    run("layers", step_layers)
    run("start", start)
    if "gen" in holder:
        run("mixed", step_mixed)
        if "first" in holder:
            run("repeat", step_repeat)
        run("chunked", step_chunked)
        run("leak", step_leak)
        run("badinput", step_badinput)
        run("overlong", step_overlong)
        run("prefix", step_prefix)
        run("selfcheck", step_selfcheck)
        run("soak", step_soak)
        run("longseq", step_longseq)
    gen = holder.pop("gen", None)
    if args.exit_shutdown:
        KEPT.append(gen)  # the report is written at exit, after the generator's at-exit shutdown
        return 0
    if gen is not None:
        import gc

        del gen  # the generator's __del__ shuts the executor down
        gc.collect()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
