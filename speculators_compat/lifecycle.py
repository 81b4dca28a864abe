"""The generators alive in this process, so that the runner can stop their vLLM workers.

``speculators-compat run`` catches Ctrl-C (SIGINT) and SIGTERM around the stock script; it
then shuts down the executor of every generator still alive here (stopping its worker
processes) before it logs its one line and exits 130 / 143. The ``report`` patch
registers each generator at its first ``generate()`` (on every release; ``worker-death``, which
did it before, covers vLLM 0.11.1-0.17.x only). Nothing here imports torch or vLLM.

A generator still alive when the interpreter exits (a module-level one in a script or a
notebook) is shut down by an ``atexit`` handler, while imports and logging still work. Left to
its ``__del__`` during the interpreter's teardown, the shutdown either failed (``ImportError:
sys.meta_path is None``) or never ran: on vLLM 0.32.0 the workers only found their parent gone.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref

from . import leftovers

__all__ = ["track", "live", "shutdown_all"]

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


def live() -> list:
    with _lock:
        return list(_live)


def shutdown_all() -> list[str]:
    """Shut down the executor of every live generator; one description per executor.

    The executor is taken off the generator first, so its ``__del__`` (stock, or the
    ``report`` patch's) has nothing left to do."""
    done = []
    for generator in live():
        executor = generator.__dict__.pop("executor", None)
        if executor is None:
            continue
        procs = [getattr(w, "proc", None) for w in getattr(executor, "workers", None) or ()]
        segments = leftovers.mapped([p.pid for p in procs if p is not None and p.pid], leftovers.ANY)
        try:
            executor.shutdown()
        except Exception as exc:  # report every executor, never raise while shutting down
            done.append(f"executor shutdown failed ({type(exc).__name__}: {exc})")
        else:
            removed = leftovers.unlink_untracked(segments)
            done.append(f"executor shut down, {len(procs)} worker process(es) stopped"
                        + (f", their shared memory {', '.join(removed)} removed" if removed else ""))
    return done
