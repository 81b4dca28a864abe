"""report -- one log line per ``generate()``, one when the executor shuts down.

Problem: not a vLLM delta; the run's own account, so that a clean end is not read as a crash.
vLLM's workers log "Parent process exited, terminating worker" and "WorkerProc shutting
down" from every rank when the generator goes away; before those lines this patch logs
whether the executor shut down cleanly (or what failed).

How: ``VllmHiddenStatesGenerator.generate`` is wrapped to log, at INFO on the
``speculators_compat`` logger, the sequences, tokens, layers, hidden size, dtype and
seconds of each call (and, at the end, the run's totals: the time inside ``generate()`` and
between the calls -- the caller's own work, e.g. the stock script queueing its saves -- and what
``self-check`` checked);
``__del__`` is wrapped to shut the executor down itself and log the
outcome (the stock ``__del__`` swallows any error into a vague warning); after vLLM shut the
executor down because a worker died, the line says so and names the worker. A generator that
has been called is registered with :mod:`speculators_compat.services.lifecycle`, so that
``speculators-compat run`` can stop its workers on Ctrl-C / SIGTERM, and so that one still alive
when the interpreter exits is shut down (with its line) by an ``atexit`` handler, not left to a
``__del__`` during the interpreter's teardown. Under ``speculators-compat run`` the first call
also takes the generator's facts for the run manifest (:mod:`speculators_compat.services.manifest`).
``SPECULATORS_COMPAT_VERBOSE=1`` also shows which patch applied where.

Detection: the generator class defines the methods it wraps (``WRAPPERS``).

Remove: never, it is the library's own report.
"""

from __future__ import annotations

import logging
import time

from speculators_compat.patching import Kind, atomic, declare, lifecycle, manifest

from .._probes import generator_patch
from .datapath._runtime import checking
from .datapath._runtime.pool import pool_of

log = logging.getLogger("speculators_compat")
#: attribute of the generator holding its run totals
TOTALS = "_speculators_compat_totals"


def _generate(wrapped, instance, args, kwargs):
    # `speculators-compat run` stops its workers on Ctrl-C / SIGTERM; one alive at exit is shut down then
    lifecycle.track(instance, at_exit=shutdown)
    if manifest.armed():  # under `speculators-compat run`: the run manifest's facts
        manifest.note_generator(instance, self_check=checking.totals_of(instance))
    pool = pool_of(instance)
    waited = pool.waited_s if pool is not None else 0.0
    start = time.perf_counter()
    results = wrapped(*args, **kwargs)
    seconds = time.perf_counter() - start
    if results:
        states = results[0]["hidden_states"]
        tokens = sum(len(r["input_ids"]) for r in results)
        pool = pool_of(instance)
        waited = (pool.waited_s - waited) if pool is not None else 0.0
        totals = instance.__dict__.setdefault(TOTALS, {"calls": 0, "tokens": 0, "seconds": 0.0, "between": 0.0,
                                                       "end": None})
        totals["calls"] += 1
        totals["tokens"] += tokens
        totals["seconds"] += seconds
        if totals["end"] is not None:  # the caller's own time since the previous call returned
            totals["between"] += start - totals["end"]
        totals["end"] = start + seconds
        log.info(
            "generate(): %d sequences, %d tokens, layers %s, hidden %d, %s, %.2f s%s",
            len(results),
            tokens,
            sorted(set(instance.layer_ids)),
            states[0].shape[-1] if states else 0,
            str(states[0].dtype).replace("torch.", "") if states else "-",
            seconds,
            f" (%.2f s of it waiting for held results to be freed)" % waited if waited >= 0.01 else "",
        )
    return results


def run_summary(generator) -> str | None:
    """The generator's calls, tokens and time, and what waiting for held results cost."""
    totals = generator.__dict__.get(TOTALS)
    if not totals:
        return None
    pool = pool_of(generator)
    text = (f"{totals['calls']} generate() calls, {totals['tokens']} tokens, {totals['seconds']:.1f} s "
            f"({totals['tokens'] / max(totals['seconds'], 1e-9):.0f} tokens/s)")
    if totals["calls"] > 1:
        text += f"; {totals['between']:.1f} s between the calls (the caller's own work)"
    if pool is not None:
        text += (f"; {pool.waited_s:.1f} s waiting for held results to be freed (saved), "
                 f"at most {pool.peak_bytes / 2**30:.2f} GiB of results in shared memory")
    checked = checking.summary_text(generator)
    return text + (f"; {checked}" if checked else "")


def shutdown(generator) -> None:
    executor = generator.__dict__.get("executor")
    if executor is None:
        return
    atomic.settle()  # a verdict its last samples wait for is taken while the workers are there
    generator.__dict__.pop("executor", None)
    summary = run_summary(generator)
    if summary:
        log.info("run: %s", summary)
    failed = bool(getattr(executor, "is_failed", False))
    try:
        removed = lifecycle.stop_executor(executor)  # also when the generator goes as a run is interrupted
    except Exception as exc:  # report, never raise from a finalizer
        log.error("executor shutdown failed: %s: %s", type(exc).__name__, exc)
    else:
        lifecycle.note_shutdown()  # the runner's interrupt line counts it
        if failed:  # vLLM's worker monitor had already shut it down
            log.error(
                "executor was shut down by vLLM after a worker died: %s", lifecycle.dead_workers(executor) or "unknown worker"
            )
            return
        log.info(
            "executor shut down cleanly%s; the workers' 'Parent process exited, terminating "
            "worker' lines that may follow are expected",
            f" (their shared memory {', '.join(removed)} removed)" if removed else "",
        )


def _del(wrapped, instance, args, kwargs):
    shutdown(instance)


#: method of VllmHiddenStatesGenerator -> its wrapper (the probes require exactly these)
WRAPPERS = {"generate": _generate, "__del__": _del}

probe, static_probe, apply = generator_patch("report", WRAPPERS)


PATCH = declare(
    title="end-of-call and end-of-run log lines",
    delta="a clean shutdown looks like a crash in vLLM's worker logs -> one clear line",
    api="VllmHiddenStatesGenerator.generate/__del__",
    kind=Kind.FEATURE,
    depends_on=(),
    after=("guard-input",),  # wraps generate() outside guard-input: times the whole call
    remove_when="never: this is the library's own report",
)
