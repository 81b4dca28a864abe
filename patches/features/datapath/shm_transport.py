"""shm-transport -- captured states reach the driver through shared memory, not pickle.

Problem (speculators 0.3.x, every vLLM release): ``generate()`` brings a call's captured
states from the worker with ``collective_rpc("_get_captured_states", unique_reply_rank=0)``.
vLLM pickles every tensor into its message queue, the driver unpickles them: a copy on each
side, single-threaded. Measured on an H200 host (vLLM 0.20.0, 1.2B Llama in bf16, 64 x 1024
tokens, 4 layers = 1 GiB of states per call): 3.7 s of a 6.5 s ``generate()`` went into that
call (0.34 GB/s), while the model's forward took 0.28 s.

How, with ``results-in-place`` (the driver sends each call's layout): ``_store_captured_states``
is wrapped to copy each step's rows straight into their blocks of the driver's shared-memory
segment (on CUDA: asynchronous copies on a side stream into the segment, registered with
``cudaHostRegister`` once per segment, at the first step that copies into it, while the device
runs that step's forward) and to sum each layer's rows on the device; the reply of
``_get_captured_states`` is a few numbers (rows copied, which layers' sums were finite).

Without a layout: ``HiddenStatesWorkerExtension._get_captured_states`` is wrapped. Where the
stock method would concatenate each layer's parts and return the list, the wrapper (after
waiting for offload-captured's copies, if any) concatenates them straight into one new file
under ``/dev/shm`` and returns a :class:`._runtime.segments.SharedStates` handle.
The handle pickles as a call of ``speculators_compat.patches.features.datapath._runtime.segments.open_states``: the driver's
unpickler maps the file (private mapping, no copy), unlinks it, and hands the stock code the
same list of ``[tokens, hidden]`` tensors, bit for bit. The file's space is reserved first
(``posix_fallocate``): if ``/dev/shm`` lacks room (a small container default), the wrapper
replies as stock. A file a killed driver never opened is removed by the next worker that
or driver that starts (its name carries the driver's pid).

Detection: the stock ``_get_captured_states`` returns the per-layer ``torch.cat`` of
``self._captured_states`` and ``_store_captured_states`` exists (speculators 0.3.x): new. speculators 0.4.x returns a dict by
request id: not for it. A ``/dev/shm`` that does not exist: not needed (the stock path runs).

Performance only (same data, less time): left off where no validation run applied it. Remove when
speculators moves captured states without pickling them (0.5 replaced the generator).
"""

from __future__ import annotations

import os

from speculators_compat.patching import WORKER, Kind, Probe, declare

from ..._probes import source_of
from ._runtime import segments, worker
from .offload_captured import wait_copies

METHOD = "_get_captured_states"
STORE = "_store_captured_states"
#: what the stock method's body must contain for the wrapper to stand in for it
STOCK = ("torch.cat(layer_tensors, dim=0) for layer_tensors in self._captured_states", "self._captured_states = None")


def _judge(source: str | None, has_store: bool = True) -> Probe:
    if not source:
        return Probe.unknown(f"HiddenStatesWorkerExtension has no {METHOD}")
    if not has_store:
        return Probe.unknown(f"HiddenStatesWorkerExtension has no {STORE}")
    missing = [s for s in STOCK if s not in source]
    if missing:
        return Probe.unknown(f"HiddenStatesWorkerExtension.{METHOD} does not do {missing[0]!r}")
    if not os.path.isdir(segments.folder()):
        return Probe.old(f"no shared-memory folder {segments.folder()}: the states are pickled as stock")
    return Probe.new(f"{METHOD} returns the concatenated states through collective_rpc (pickled)")


def probe(module) -> Probe:
    method = getattr(module.HiddenStatesWorkerExtension, METHOD, None)
    return _judge(source_of(method) if method is not None else None,
                  hasattr(module.HiddenStatesWorkerExtension, STORE))


def static_probe(view) -> Probe:
    return _judge(view.speculators.source(WORKER, "HiddenStatesWorkerExtension", METHOD),
                  STORE in view.speculators.members(WORKER, "HiddenStatesWorkerExtension"))


def _store(wrapped, instance, args, kwargs):
    state = instance.__dict__.get(worker.WORKER_STATE)
    if state is None or state.plan is None:
        return wrapped(*args, **kwargs)
    state.store(args[0] if args else kwargs["aux_hidden_states"])
    return None


def _get(wrapped, instance, args, kwargs):
    state = instance.__dict__.get(worker.WORKER_STATE)
    if state is not None and state.plan is not None and not (args or kwargs):
        instance._captured_states = None
        return state.finish()
    segments.remove_stale_once()
    layers = getattr(instance, "_captured_states", None)
    if args or kwargs or not layers or not all(isinstance(parts, list) and parts for parts in layers):
        return wrapped(*args, **kwargs)
    wait_copies(instance.__dict__)
    handle = segments.write_states(layers, owner_pid=os.getppid())
    if handle is None:
        return wrapped(*args, **kwargs)
    instance._captured_states = None
    return handle


def apply(module, patcher) -> None:
    patcher.wrap(module.HiddenStatesWorkerExtension, STORE, _store)
    patcher.wrap(module.HiddenStatesWorkerExtension, METHOD, _get)
    patcher.set_item(vars(worker), "ACCEPTING", True)  # the workers take the driver's plans


PATCH = declare(
    title="captured states through one shared-memory file (no pickling)",
    delta="collective_rpc pickles the call's captured states (GBs, < 1 GB/s) -> one /dev/shm file, mapped",
    api="speculators HiddenStatesWorkerExtension._get_captured_states",
    kind=Kind.PERFORMANCE,
    after=("offload-captured",),  # wraps _get_captured_states outside it, waits for its copies
    target=WORKER,
)
