"""The generators alive in this process, so that the runner can stop their vLLM workers.

``speculators-compat run`` catches Ctrl-C (SIGINT) and SIGTERM around the stock script; it
then shuts down the executor of every generator still alive here (stopping its worker
processes) before it logs its one line and exits 130 / 143. The ``report`` patch
registers each generator at its first ``generate()``, on every release. Nothing here imports
torch or vLLM.

The first worker of an executor to die is recorded here too (:func:`watch_workers`, armed by the
``worker-death`` patch when the executor starts), so that ``worker-death``'s error and
``report``'s shutdown line can name it (:func:`dead_workers`).

The vLLM workers a ``speculators-compat run`` driver starts leave Ctrl-C to it
(:func:`leave_ctrl_c_to_the_runner`, from the ``vllm.general_plugins`` entry point): a terminal
sends SIGINT to the whole foreground process group, and a worker that stops on it inside vLLM's
message queue prints "BufferError: cannot close exported pointers exist" at exit, while the
runner's shutdown of the executor stops it cleanly.

A generator still alive when the interpreter exits (a module-level one in a script or a
notebook) is shut down by an ``atexit`` handler, while imports and logging still work. Left to
its ``__del__`` during the interpreter's teardown, the shutdown either failed (``ImportError:
sys.meta_path is None``) or never ran: on vLLM 0.32.0 the workers only found their parent gone.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref

from . import leftovers

__all__ = ["track", "live", "shutdown_all", "stop_executor", "watch_workers", "dead_workers", "real_executor",
           "leave_ctrl_c_to_the_runner"]

_live: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_at_exit: list = []  # [(pid, shutdown)] once the handler is registered


def track(generator, at_exit=None) -> None:
    """Register ``generator``. The first ``at_exit`` given (``report``'s shutdown) is called at
    interpreter exit with each generator still alive then; later ones are not kept."""
    with _lock:
        _live.add(generator)
        if at_exit is not None and not _at_exit:
            _at_exit.append((os.getpid(), at_exit))
            atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    pid, shutdown = _at_exit[0]
    if os.getpid() != pid:  # a forked child inherited the handler: the executor is its parent's
        return
    for generator in live():
        shutdown(generator)


def leave_ctrl_c_to_the_runner() -> bool:
    """In a process the runner's own process started (a vLLM worker of its generator), ignore
    SIGINT: the runner stops the workers itself. Returns whether it did (never in the runner,
    outside a run, or off the main thread)."""
    import signal

    from ..core import _env

    runner = os.environ.get(_env.RUNNER)
    if not runner or str(os.getppid()) != runner or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return True


_shutdowns = [0]  # executors of generators shut down by their finalizer (the report patch), this process


def note_shutdown() -> None:
    """A generator's executor was shut down by its finalizer (``report``: its ``__del__``)."""
    with _lock:
        _shutdowns[0] += 1


def shutdowns() -> int:
    """How many executors :func:`note_shutdown` counted so far."""
    with _lock:
        return _shutdowns[0]


def live() -> list:
    with _lock:
        return list(_live)


def stop_executor(executor) -> list[str]:
    """Shut ``executor`` down, then remove the shared-memory segments its workers had mapped and
    made for themselves (vLLM's CPU communicator: a worker stopped by a signal never unlinks
    them); the names removed. Raises what the executor's ``shutdown()`` raises."""
    procs = [getattr(w, "proc", None) for w in getattr(executor, "workers", None) or ()]
    segments = leftovers.mapped([p.pid for p in procs if p is not None and p.pid], leftovers.ANY)
    executor.shutdown()
    return leftovers.unlink_untracked(segments)


def shutdown_all() -> list[str]:
    """Shut down the executor of every live generator; one description per executor.

    The executor is taken off the generator first, so its ``__del__`` (stock, or the
    ``report`` patch's) has nothing left to do. A decision the last samples wait for (the
    self-check's verdict) is taken first, while the workers are there."""
    from . import atomic

    atomic.settle()
    done = []
    for generator in live():
        executor = generator.__dict__.pop("executor", None)
        if executor is None:
            continue
        workers = len(getattr(executor, "workers", None) or ())
        try:
            removed = stop_executor(executor)
        except Exception as exc:  # report every executor, never raise while shutting down
            done.append(f"executor shutdown failed ({type(exc).__name__}: {exc})")
        else:
            done.append(f"executor shut down, {workers} worker process(es) stopped"
                        + (f", their shared memory {', '.join(removed)} removed" if removed else ""))
    return done


# -- the first vLLM worker to die: recorded by worker-death, named by worker-death and report ----

#: real executor -> the worker handles whose processes exited first (in the order seen)
_FIRST_EXITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_exits_lock = threading.Lock()


def real_executor(executor):
    """The executor behind any wrapper proxies (``v4`` wraps the generator's executor)."""
    while hasattr(executor, "__wrapped__"):
        executor = executor.__wrapped__
    return executor


def watch_workers(executor) -> None:
    """Record the first worker(s) of ``executor`` to exit, from a daemon thread: before vLLM's
    worker monitor stops the others, after which every worker is dead and the culprit can no
    longer be told apart."""
    real = real_executor(executor)
    workers = list(getattr(real, "workers", None) or ())
    if not workers:
        return
    with _exits_lock:
        _FIRST_EXITS[real] = []

    def wait() -> None:
        import multiprocessing.connection

        by_sentinel = {w.proc.sentinel: w for w in workers}
        try:
            ready = multiprocessing.connection.wait(list(by_sentinel))
        except OSError:  # the sentinels were closed: the executor is gone
            return
        with _exits_lock:
            exits = _FIRST_EXITS.get(real)
            if exits is not None and not exits:
                exits.extend(by_sentinel[s] for s in ready)

    threading.Thread(target=wait, daemon=True, name="speculators-compat-worker-watch").start()


def _how(code) -> str:
    import signal

    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        extra = " (if nobody sent it, the kernel's OOM killer may have: see dmesg)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{extra}"
    return f"exited with code {code}"


def _failed(real, workers, settle: float) -> bool:
    """vLLM's ``is_failed``; where a worker has exited and nobody is shutting the executor down,
    awaited for up to ``settle`` s (its monitor sets the flag as soon as it sees the exit, but an
    error relayed by a surviving rank may reach the caller first)."""
    if getattr(real, "is_failed", False):
        return True
    if settle <= 0 or getattr(real, "shutting_down", False):
        return False
    with _exits_lock:
        seen = bool(_FIRST_EXITS.get(real))
    if not seen and all(w.proc.exitcode is None for w in workers):
        return False
    end = time.monotonic() + settle
    while time.monotonic() < end:
        if getattr(real, "is_failed", False):
            return True
        time.sleep(0.02)
    return bool(getattr(real, "is_failed", False))


def dead_workers(executor, settle: float = 0.0) -> str | None:
    """Which worker died, if the executor failed because one did; else ``None``. ``settle``:
    how long to wait for vLLM to mark the executor failed once a worker has exited."""
    real = real_executor(executor)
    workers = list(getattr(real, "workers", None) or ())
    if not workers or not _failed(real, workers, settle):
        return None
    with _exits_lock:
        first = list(_FIRST_EXITS.get(real) or ())
    dead = first or [w for w in workers if w.proc.exitcode is not None]
    if not dead:
        return "a vLLM worker process died"
    parts = []
    for w in dead:
        w.proc.join(timeout=1)  # reaped by now; join only settles exitcode
        parts.append(f"vLLM worker {w.proc.name} (pid {w.proc.pid}, rank {w.rank} of {len(workers)}) {_how(w.proc.exitcode)}")
    return "; ".join(parts)
