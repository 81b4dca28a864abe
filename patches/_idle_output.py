"""The scheduler's last idle output: the one carrying the finished request ids, which the stock
loop stops on and never sends. ``v5`` (speculators 0.3) and ``s04-scheduler-loop`` (speculators 0.4)
keep it on the scheduler and send it after ``generate()``; ``guard-input``'s recovery drops it."""

from __future__ import annotations

import logging
from typing import Any

#: attribute on the scheduler holding the last idle output that carries finished request ids
PENDING = "_speculators_compat_idle_output"


def remember_idle(scheduler, out):
    """Keep an output with no tokens but finished request ids: the stock loop stops on it unsent."""
    if out.total_num_scheduled_tokens == 0 and out.finished_req_ids:
        setattr(scheduler, PENDING, out)
    return out


def flush_finished(generator) -> None:
    """Send the scheduler's last idle output (finished request ids) to the workers."""
    pending = generator.scheduler.__dict__.pop(PENDING, None)
    if pending is not None:
        generator.executor.execute_model(pending)


def call_then_flush(wrapped, args, kwargs, flush) -> Any:
    """``generate()`` then ``flush()``: after a normal return, and after an error (so the
    generator stays usable; an error of the flush itself is logged, the call's own error is what
    the caller gets). Not after Ctrl-C / SIGTERM (``KeyboardInterrupt`` and other non-``Exception``
    exits): a worker that got the same signal may be gone, and the flush's error would replace
    the interrupt that ``speculators-compat run`` turns into exit code 130 / 143."""
    try:
        results = wrapped(*args, **kwargs)
    except Exception:
        try:
            flush()
        except Exception as flush_error:
            logging.getLogger("speculators_compat").debug("flush after a failed generate(): %s", flush_error)
        raise
    flush()
    return results


def forget_idle(scheduler) -> None:
    scheduler.__dict__.pop(PENDING, None)
