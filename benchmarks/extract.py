"""Extraction speed on a GPU: the stock generator through the shim against vLLM's own eager prefill
(and, with ``--vllm-extract``, vLLM's own extraction), every engine in one process
(``python benchmarks/gpu.py bench``; ``benchmarks/gpu.py`` says what is measured)."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

from anchor import ANCHOR_MODULE_ENV, CPU_NOTE, Anchor, anchor_config
from common import FEATURES, MODELS, TARGETS, _sched, _sync, _runner_v2, prompts, rss_gib, _proc_status_gib

# -- run in the workers through collective_rpc ----------------------------------------------

#: attribute of the worker holding the cProfile of :func:`w_cprofile`
PROFILE_ATTR = "_bench_cprofile"


def w_stats(worker):
    """The capturing worker's peak device memory (then reset) and its copy waits."""
    import torch

    from speculators_compat.patches.features.datapath._runtime import worker as transport

    ext = getattr(worker, "worker", None) or worker
    out = {}
    if torch.cuda.is_available():
        out["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    state = ext.__dict__.get(transport.WORKER_STATE)
    if state is not None:
        out["wait_copies_s"] = round(state.wait_s, 4)
        state.wait_s = 0.0
    out["peak_rss_gib"] = round(_proc_status_gib("VmHWM:"), 2)
    return out


def w_cprofile(worker, start: bool, top: int = 25):
    """The worker's own thread under cProfile from one call of this (``start``) to the next
    (``start`` False: its functions, as :func:`_top` lists them): where a worker's time goes in a
    call -- the capture's hooks and copies, the self-check's reference and comparison, vLLM's own
    step -- with the waits for the device inside the function that waited."""
    import cProfile

    ext = getattr(worker, "worker", None) or worker
    if start:
        prof = ext.__dict__[PROFILE_ATTR] = cProfile.Profile()
        prof.enable()
        return None
    prof = ext.__dict__.pop(PROFILE_ATTR, None)
    if prof is None:
        return None
    prof.disable()
    return _top(prof, top)


def w_applied(worker):
    """The patches that applied in the worker."""
    import speculators_compat

    return speculators_compat.applied_ids()


def w_hooks(worker, on: bool, layer_ids):
    """The capture hooks off (the steps alone) or on again, in the capturing worker."""
    from speculators_compat.patches.vllm_api import v3 as v3_worker_capture

    ext = getattr(worker, "worker", None) or worker
    if on:
        ext._setup_hidden_states_capture(layer_ids)
    else:
        v3_worker_capture.remove_hooks(ext)
    return True


class Marks:
    """When the first step of a call was scheduled (the generator's ``scheduler.schedule``
    returned), when the worker's reply arrived in the driver (``reply.Transfer.take``), how long
    the output guard took, and how long the driver's garbage collections took, per extraction call."""

    def __init__(self):
        import gc

        from speculators_compat.patches.features.datapath._runtime import reply
        from speculators_compat.patches.guards import guard_output

        self.reply = None
        self.first_step = None
        self.guard_s = 0.0
        self.gc_s, self._gc_t = 0.0, None
        self.on_first_step = None  # called once when a call's first step is scheduled
        gc.callbacks.append(self._gc)
        take, check = reply.Transfer.take, guard_output.check

        def timed_take(*a, **k):
            self.reply = time.perf_counter()
            return take(*a, **k)

        def timed_check(*a, **k):
            t = time.perf_counter()
            try:
                return check(*a, **k)
            finally:
                self.guard_s += time.perf_counter() - t

        reply.Transfer.take, guard_output.check = timed_take, timed_check

    def watch(self, gen) -> None:
        """Mark the first ``schedule()`` of each call of ``gen`` (an instance attribute)."""
        schedule = gen.scheduler.schedule

        def timed_schedule(*a, **k):
            out = schedule(*a, **k)
            if self.first_step is None:
                self.first_step = time.perf_counter()
                if self.on_first_step is not None:
                    self.on_first_step()
            return out

        gen.scheduler.schedule = timed_schedule

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self._gc_t is not None:
            self.gc_s += time.perf_counter() - self._gc_t
            self._gc_t = None

    def start(self) -> float:
        self.reply, self.first_step, self.guard_s, self.gc_s = None, None, 0.0, 0.0
        return time.perf_counter()

    def split(self, t0: float, t1: float) -> dict:
        """A call's parts, seconds (None where a mark is missing)."""
        r, f = self.reply, self.first_step
        return {"before_steps_s": (f - t0) if f else None, "steps_s": (r - f) if r and f else None,
                "reply_s": (r - t0) if r else None, "after_reply_s": (t1 - r) if r else None,
                "guard_s": self.guard_s, "gc_s": round(self.gc_s, 4)}


def bench(model: str, out: Path, rounds: int, n: int, length: int, util: float, dtype: str = "auto",
          vllm_extract: bool = False, vllm_extract_dir: str | None = None, vllm_extract_util: float | None = None,
          tp: int = 1, vllm_extract_alone: bool = False, vllm_extract_len: int | None = None) -> dict:
    """The ``bench`` command (the module's docstring says what it measures): the engines built in
    one process, each mode warmed up then timed in rotated rounds, the report written to ``out``
    as it grows and summed up in one printed JSON line. The process then ends (``os._exit``).
    ``vllm_extract_alone``: no generator in this process, vLLM's own extraction against the prefill
    only, at ``vllm_extract_len`` (default: the model's own ``max_model_len``)."""
    run = _Bench(model, out, rounds, n, length, util, dtype, tp)
    run.start_prefill(record_runner=vllm_extract or vllm_extract_alone)
    if not vllm_extract_alone:
        run.start_generator()
    if vllm_extract or vllm_extract_alone:
        run.add_vllm_extract(vllm_extract_dir, vllm_extract_util, vllm_extract_len)
    run.warm_up()
    run.measure()
    run.after_rounds()
    run.summarize()
    run.print_line()
    run.shutdown()
    os._exit(0)  # do not wait for the rest of the teardown


class _Bench:
    """One ``bench`` run: its engines, the modes it times (``modes``: name -> a call returning the
    call's parts) and the report."""

    def __init__(self, model: str, out: Path, rounds: int, n: int, length: int, util: float, dtype: str,
                 tp: int = 1):
        cfg = json.loads((Path(model) / "config.json").read_text())
        layers_n = cfg["num_hidden_layers"]
        self.model, self.out, self.rounds, self.util, self.dtype = model, out, rounds, util, dtype
        self.tp = tp
        self.cfg = cfg
        self.layer_ids = [2, layers_n // 2, layers_n - 3, layers_n - 1]
        self.batch = prompts(n, length, cfg["vocab_size"], seed=7)
        self.tokens = n * length
        self.report: dict = {"model": model, "config": {k: cfg[k] for k in MODELS["llama-1b"]}, "prompts": n,
                             "length": length, "layers": self.layer_ids, "rounds": rounds,
                             "target": TARGETS.get(Path(model).name),
                             "record_dir": os.environ.get("SPECULATORS_COMPAT_RECORD") or None, "calls": {},
                             "tp": tp}
        self.modes: dict = {}
        self.sent: dict = {}  # the last results of each generator, held until its next call
        self.llm = self.gen = self.anchor = None
        self.marks = None
        self.peak_rss = 0.0

    def save(self) -> None:
        self.out.write_text(json.dumps(self.report, indent=1))

    # -- the engines and their modes --------------------------------------------------------

    def start_prefill(self, record_runner: bool) -> None:
        """vLLM's own eager prefill (``prefill``), started before the generator."""
        from vllm import LLM

        t = time.time()
        self.llm = LLM(model=self.model, enforce_eager=True, gpu_memory_utilization=self.util,
                       enable_prefix_caching=False, dtype=self.dtype, tensor_parallel_size=self.tp)
        if self.dtype != "auto":
            os.environ["SPECULATORS_COMPAT_DTYPE"] = self.dtype  # the generator's, through the dtype patch
        report = self.report
        report["llm_init_s"] = round(time.time() - t, 1)
        report["prefill_engine"] = _sched(getattr(self.llm.llm_engine, "vllm_config", None))
        if record_runner and report["prefill_engine"]:  # started before runner-v1 sets VLLM_USE_V2_MODEL_RUNNER=0
            report["prefill_engine"]["model_runner_v2"] = _runner_v2(getattr(self.llm.llm_engine, "vllm_config", None))
        self.modes["prefill"] = lambda: self.prefill() or {}

    def prefill(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in self.batch], SamplingParams(max_tokens=1),
                          use_tqdm=False)

    def start_generator(self) -> None:
        """The stock generator through the shim, as installed (``extract``, ``extract_nocheck``,
        ``steps_nohooks``); which performance patches applied."""
        import torch

        import speculators_compat
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
        from speculators_compat.patches.features.datapath._runtime import checking as selfcheck

        self._selfcheck = selfcheck
        report = self.report
        t = time.time()
        self.gen = VllmHiddenStatesGenerator(self.model, layer_ids=self.layer_ids, max_model_len=2048,
                                             gpu_memory_utilization=self.util, tensor_parallel_size=self.tp)
        report["generator_init_s"] = round(time.time() - t, 1)
        report["generator_engine"] = _sched(self.gen.vllm_config)
        report["applied_driver"] = speculators_compat.applied_ids()
        report["applied_worker"] = self.gen.executor.collective_rpc(w_applied)[0]
        report["features"] = {side: {p: p in report[f"applied_{side}"] for p in ids} for side, ids in FEATURES.items()}
        # offload-captured is CUDA only; elsewhere its absence is expected
        report["missing_features"] = [p for side, got in report["features"].items() for p, on in got.items()
                                      if not on and not (p == "offload-captured" and not torch.cuda.is_available())]
        if report["missing_features"]:
            print(f"WARNING: not applied: {report['missing_features']} -- these figures are not the library's "
                  "(an unvalidated release? RECORD=1 makes a validation run)", flush=True)
        self.marks = Marks()
        self.marks.watch(self.gen)
        self.modes.update(extract=self.extract_checked, extract_nocheck=self.extract_nocheck,
                          steps_nohooks=self.nohooks)

    def extract(self) -> dict:
        """One call of the generator, its parts."""
        t0 = self.marks.start()
        res = self.gen.generate(self.batch)
        _sync()
        t1 = time.perf_counter()
        self.sent["results"] = res  # held like the stock script's `results` until the next call
        return self.marks.split(t0, t1)

    def nohooks(self) -> dict:
        """The generator's steps alone: the capture hooks off in the worker for one call."""
        self.gen.executor.collective_rpc(w_hooks, args=(False, self.layer_ids))
        t0 = self.marks.start()
        try:
            self.gen.generate(self.batch)  # no states: the call fails at its end, after the steps
        except Exception as exc:  # noqa: BLE001 - expected: nothing was captured
            self.sent["nohooks_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        finally:
            self.gen.executor.collective_rpc(w_hooks, args=(True, self.layer_ids))
        return {"before_steps_s": (self.marks.first_step - t0) if self.marks.first_step else None}

    def extract_nocheck(self) -> dict:
        os.environ[self._selfcheck.SELF_CHECK_ENV] = "0"
        try:
            return self.extract()
        finally:
            os.environ.pop(self._selfcheck.SELF_CHECK_ENV, None)

    def extract_checked(self) -> dict:
        totals = self._selfcheck.totals_of(self.gen)
        before = totals.seconds
        out = self.extract()
        out["self_check_s"] = totals.seconds - before
        return out

    def add_vllm_extract(self, folder: str | None, util: float | None, length: int | None = None) -> None:
        """vLLM's own extraction on the same model, prompts and layers (``vllm_extract``; its
        figures fail soft), at ``length`` tokens a request; by default the generator's (the same
        requests fit), or without a generator in the process the model's own."""
        base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        folder = folder or f"{base}/gpu-extract-anchor-{os.getpid()}"
        if length is None and self.gen is not None:
            length = self.gen.vllm_config.model_config.max_model_len
        self.report["vllm_extract"] = {"engine_args": anchor_config(self.layer_ids, folder, length)}
        try:
            self.anchor = Anchor(self.model, self.batch, self.layer_ids, util or self.util, self.dtype, folder,
                                 self.tp, length)
            self.report["vllm_extract"] = self.anchor.describe()
            self.report["vllm_extract"]["alone"] = self.gen is None
            self.modes["vllm_extract"] = self.anchor
        except Exception as exc:  # noqa: BLE001 - recorded; the other modes are still measured
            self.report["vllm_extract"]["error"] = f"engine: {type(exc).__name__}: {str(exc)[:1500]}"
        self.save()

    # -- timing -----------------------------------------------------------------------------

    def call(self, mode: str):
        """One call of ``mode``, timed between synchronisations: (seconds, its parts); None where
        vLLM's own extraction failed (recorded, and left out from then on)."""
        import torch

        _sync()
        t = time.perf_counter()
        try:
            extra = self.modes[mode]()
        except Exception as exc:  # noqa: BLE001 - only vllm_extract fails soft
            if mode != "vllm_extract":
                raise
            x = self.report["vllm_extract"]
            x["error"] = f"call: {type(exc).__name__}: {str(exc)[:1500]}"
            if not torch.cuda.is_available() and not os.environ.get(ANCHOR_MODULE_ENV):
                x["note"] = CPU_NOTE
            print(f"vllm_extract failed, left out: {x['error']}", flush=True)
            del self.modes[mode]
            self.anchor.shutdown()
            self.save()
            return None
        _sync()
        return time.perf_counter() - t, extra

    def warm_up(self) -> None:
        """Each mode twice (segments created and registered here); the first is its ``first_call``.
        The generator's very first call runs with its driver's and its capturing worker's threads
        under cProfile (``first_call_profile``: where a first call's extra time goes; the profilers
        add about 1 % to that call)."""
        first = self.report["first_call"] = {}  # each mode's first full-size call (the first of its warm-up)
        for mode in list(self.modes):
            got = self.profile_first_call(mode) if mode == "extract" else self.call(mode)
            if got is None:
                continue
            first[mode] = {"s": round(got[0], 4), "tokens_s": round(self.tokens / got[0]),
                           **{k: round(v, 4) for k, v in got[1].items() if v is not None}}
            if self.call(mode) is None or self.gen is None:
                continue
            self.gen.executor.collective_rpc(w_stats)

    def measure(self) -> None:
        """``rounds`` rounds over the modes, each round's order rotated by one; every call recorded."""
        order = list(self.modes)
        for r in range(self.rounds):
            for mode in order[r % len(order):] + order[:r % len(order)]:
                if mode not in self.modes:
                    continue
                got = self.call(mode)
                if got is None:
                    continue
                dt, extra = got
                worker = self.gen.executor.collective_rpc(w_stats)[0] if mode == "extract" else {}
                self.peak_rss = max(self.peak_rss, rss_gib())
                self.report["calls"].setdefault(mode, []).append(
                    {"s": round(dt, 4), "tokens_s": round(self.tokens / dt),
                     **{k: round(v, 4) for k, v in extra.items() if v is not None}, **worker})
                self.save()

    def after_rounds(self) -> None:
        """vLLM's rows against the generator's, and where the driver's own time goes."""
        report = self.report
        if self.gen is None:  # vLLM's own extraction alone: nothing of the generator's to compare or profile
            return
        if "vllm_extract" in self.modes:  # the same rows? vLLM's last call against the generator's last results
            try:
                report["vllm_extract"]["check"] = self.anchor.compare(self.sent["results"])
            except Exception as exc:  # noqa: BLE001 - recorded
                report["vllm_extract"]["check"] = {"error": f"{type(exc).__name__}: {exc}"}
            self.save()
        report["driver_profile"] = _profile(lambda: self.extract_checked())  # where the driver's own time goes
        report["driver_profile_before_steps"] = self.profile_before_steps()
        report["worker_profile"] = {mode: self.profile_worker(fn) for mode, fn in
                                    (("extract", self.extract_checked), ("extract_nocheck", self.extract_nocheck))}
        report["nohooks_error"] = self.sent.get("nohooks_error")

    @contextlib.contextmanager
    def worker_profiled(self):
        """The capturing worker's (rank 0) thread under cProfile for the block; yields a dict whose
        ``worker`` is its functions (as :func:`_top` lists them) once the block has ended."""
        self.gen.executor.collective_rpc(w_cprofile, args=(True,))
        out: dict = {}
        try:
            yield out
        finally:
            out["worker"] = self.gen.executor.collective_rpc(w_cprofile, args=(False,))[0]

    def profile_worker(self, fn, calls: int = 3) -> dict:
        """``calls`` more calls of ``fn`` with the capturing worker's thread under cProfile (rank 0)."""
        t0 = time.perf_counter()
        with self.worker_profiled() as got:
            for _ in range(calls):
                fn()
        return {"calls": calls, "driver_s": round(time.perf_counter() - t0, 3), "worker": got["worker"]}

    def profile_first_call(self, mode: str):
        """:meth:`call` of ``mode`` with the driver's and the capturing worker's (rank 0) threads
        under cProfile, their functions in ``first_call_profile``."""
        import cProfile

        prof = cProfile.Profile()
        with self.worker_profiled() as profiled:
            prof.enable()
            try:
                got = self.call(mode)
            finally:
                prof.disable()
        self.report["first_call_profile"] = {"mode": mode, "driver": _top(prof, 30), "worker": profiled["worker"]}
        return got

    def profile_before_steps(self, top: int = 30) -> dict:
        """One more extraction call, its driver's thread under cProfile from the call to its first
        step (the input guard, the requests, the messages to the workers, the first schedule)."""
        import cProfile

        prof = cProfile.Profile()
        marks = self.marks
        marks.on_first_step = prof.disable
        t0 = time.perf_counter()
        prof.enable()
        try:
            self.extract_checked()
        finally:
            prof.disable()
            marks.on_first_step = None
        out = _top(prof, top)
        return {"before_steps_ms": round((marks.first_step - t0) * 1e3, 2) if marks.first_step else None,
                "cumulative": out["cumulative"], "own": out["own"]}

    # -- the report -------------------------------------------------------------------------

    def summarize(self) -> None:
        """Medians, ratios to the prefill, the spread, where a call's time went, the bar, memory."""
        report = self.report
        calls_by_mode = report["calls"]
        med = {m: statistics.median(c["tokens_s"] for c in calls) for m, calls in calls_by_mode.items()}
        report["median_tokens_s"] = med
        report["ratio"] = {m: round(v / med["prefill"], 3) for m, v in med.items()}
        report["spread_tokens_s"] = {m: [min(c["tokens_s"] for c in calls), max(c["tokens_s"] for c in calls)]
                                     for m, calls in calls_by_mode.items()}
        if "vllm_extract" in med and "extract" in med:
            report["vllm_extract"]["extract_over_vllm_extract"] = round(med["extract"] / med["vllm_extract"], 3)
        report["breakdown_median_s"] = {
            m: {k: round(statistics.median(c[k] for c in calls if k in c), 4)
                for k in ("s", "before_steps_s", "steps_s", "reply_s", "after_reply_s", "guard_s", "wait_copies_s",
                          "self_check_s", "gc_s", "generate_s", "load_s", "cleanup_s")
                if any(k in c for c in calls)}
            for m, calls in calls_by_mode.items() if m != "prefill"}
        report["ratio_as_installed"] = report["ratio"].get("extract")
        if report["target"] is not None and self.gen is not None:
            report["meets_target"] = report["ratio_as_installed"] >= report["target"] and not report["missing_features"]
        if "extract_nocheck" in med:
            report["self_check_cost"] = round(med["extract_nocheck"] / med["extract"] - 1, 4)  # 0.02 = 2 %
            report["self_check"] = self._selfcheck.summary(self.gen)
        report["peak_rss_gib"] = round(self.peak_rss, 2)  # the driver: every engine of the benchmark in one process
        worker_calls = calls_by_mode.get("extract", [])
        report["worker_peak_device_gib"] = max((c.get("peak_device_gib", 0.0) for c in worker_calls), default=None)
        report["worker_peak_rss_gib"] = max((c.get("peak_rss_gib", 0.0) for c in worker_calls), default=None)
        report["state_gib_per_call"] = round(self.tokens * len(self.layer_ids) * self.cfg["hidden_size"] * 2 / 2**30, 3)
        self.save()

    def print_line(self) -> None:
        """The report's headline figures as one JSON line (run.sh keeps its first 1,500 characters)."""
        report = self.report
        line = {k: report.get(k) for k in ("model", "median_tokens_s", "ratio", "ratio_as_installed", "target")}
        if "vllm_extract" in report:  # early in the line: run.sh keeps its first 1,500 characters
            x = report["vllm_extract"]
            line["vllm_extract"] = {"error": x.get("error"), "extract_over_vllm_extract": x.get("extract_over_vllm_extract"),
                                    "max_rel_l2_per_layer": (x.get("check") or {}).get("max_rel_l2_per_layer"),
                                    "check_error": (x.get("check") or {}).get("error")}
        line.update({k: report.get(k) for k in ("meets_target", "missing_features", "breakdown_median_s",
                                                "peak_rss_gib", "worker_peak_device_gib", "worker_peak_rss_gib",
                                                "nohooks_error", "self_check_cost")})
        print(json.dumps(line), flush=True)

    def shutdown(self) -> None:
        """The generator, vLLM's own extraction and the prefill engine (their engine processes,
        which ``os._exit`` would leave behind)."""
        if self.gen is not None:
            self.gen.executor.shutdown()
        if "vllm_extract" in self.modes:
            self.anchor.shutdown()
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()


def _profile(fn, top: int = 25) -> list:
    """One call of ``fn`` under cProfile (the driver's thread): the functions that took the most
    time of their own, as ``[function, calls, own ms, cumulative ms]``."""
    import cProfile

    prof = cProfile.Profile()
    prof.runcall(fn)
    return _top(prof, top)["own"]


def _top(prof, top: int) -> dict:
    """A cProfile's functions as ``[function, calls, own ms, cumulative ms]``: ``own``, the ``top``
    that took the most time of their own; ``library``, this library's by cumulative time."""
    import pstats

    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own, cumulative, callers)}

    def rows(items):
        return [[f"{Path(f).name}:{line}({name})", calls, round(own * 1e3, 2), round(cum * 1e3, 2)]
                for (f, line, name), (_, calls, own, cum, _) in items]

    ours = [kv for kv in stats.items() if "speculators_compat" in kv[0][0]]
    return {"own": rows(sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]),
            "cumulative": rows(sorted(stats.items(), key=lambda kv: -kv[1][3])[:top]),
            "library": rows(sorted(ours, key=lambda kv: -kv[1][3])[:top])}


