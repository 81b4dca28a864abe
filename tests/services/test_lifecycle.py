"""Unit tests of ``speculators_compat/services/lifecycle.py``: the generators alive at exit, and the
runner's workers leaving Ctrl-C to it."""

from __future__ import annotations

import os

import pytest

from speculators_compat.services import lifecycle


def test_a_generator_alive_at_exit_is_shut_down_once_by_its_own_process(monkeypatch):
    registered, calls = [], []
    monkeypatch.setattr(lifecycle, "_at_exit", [])
    monkeypatch.setattr(lifecycle, "_live", type(lifecycle._live)())
    monkeypatch.setattr(lifecycle.atexit, "register", registered.append)

    class Generator:
        pass

    first, second = Generator(), Generator()
    lifecycle.track(first, at_exit=calls.append)
    lifecycle.track(second, at_exit=calls.append)
    assert registered == [lifecycle._shutdown_at_exit]  # one handler for all generators
    del second  # gone before the exit: nothing to shut down
    lifecycle._shutdown_at_exit()
    assert calls == [first]
    monkeypatch.setattr(lifecycle.os, "getpid", lambda: -1)  # a forked child: its parent's executor
    lifecycle._shutdown_at_exit()
    assert calls == [first]


def _disposition_after_leaving(runner: str, queue) -> None:
    import signal

    # Python's own handler, as in a process started from a terminal (a shell's background job
    # inherits SIGINT ignored, which would pass for "left to the runner")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ["SPECULATORS_COMPAT_RUNNER"] = runner
    left = lifecycle.leave_ctrl_c_to_the_runner()
    queue.put((left, signal.getsignal(signal.SIGINT) == signal.SIG_IGN))


@pytest.mark.parametrize("parent_is_runner", [True, False])
def test_a_worker_of_the_runner_leaves_ctrl_c_to_it(parent_is_runner):
    """A process the runner started (a vLLM worker) ignores SIGINT; any other keeps its handler,
    and so does the runner itself."""
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    runner = str(os.getpid()) if parent_is_runner else str(os.getpid() + 100000)
    proc = ctx.Process(target=_disposition_after_leaving, args=(runner, queue))
    proc.start()
    got = queue.get(timeout=60)
    proc.join(timeout=30)
    assert got == (parent_is_runner, parent_is_runner)
    before = signal.getsignal(signal.SIGINT)
    os.environ["SPECULATORS_COMPAT_RUNNER"] = str(os.getpid())
    try:
        assert lifecycle.leave_ctrl_c_to_the_runner() is False  # the runner's own process
    finally:
        del os.environ["SPECULATORS_COMPAT_RUNNER"]
    assert signal.getsignal(signal.SIGINT) is before
