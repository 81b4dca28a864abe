"""results-in-place -- each sequence's states are copied once, from the device into the tensor the caller gets.

Problem (speculators 0.3.x, every vLLM release): the captured states cross the host several
times after the device: the worker concatenates every step's states into a reply, the driver
slices it per sequence and ``.clone()``s every row, and the output guard scans every row for
inf/nan. On an H200 (1.2B Llama, 1 GiB of states per call) those passes took 2 s of a call
whose prefill took 0.2 s.

How: ``VllmHiddenStatesGenerator.generate`` is wrapped. Before the stock code runs, the call's
results are laid out in a shared-memory segment of the driver (one block per sequence and
layer) and the layout is sent to the capturing worker, whose ``shm-transport`` copies each
step's rows straight into their blocks (on CUDA: asynchronous copies into the segment,
registered with ``cudaHostRegister`` once). For the call the stock code sees the generator's
executor through a view (:class:`.reply.CallExecutor`) that turns the worker's reply (the rows
it copied) into the stock list of layers, each a tensor over its rows in the segment; the stock
``h[offset : offset + seq_len].clone().cpu()`` then receives each block as a tensor of its own
(its storage is exactly its bytes, so ``torch.save`` writes only that sample), with no copy. The
call's :class:`.reply.Transfer` stays on the generator until the next call starts.
The worker sums each step's rows on the device; the output guard scans on the host only a
layer whose sums are not finite. Segments are reused once the caller has freed every tensor of
a call, and the segment files are unlinked as soon as the worker has mapped them. On an
accelerator the next call's segment is made in a thread while the device works, whenever a call
takes the last free one and the held-results limit leaves room (a call that needs a new segment
does not wait for its pages: about 0.3 s for 0.5 GiB on an H200 host).

Held results: when the caller holds more than ``SPECULATORS_COMPAT_HELD_RESULTS`` calls' worth
of results (default 4; e.g. the stock script's saves fall behind the extraction), ``generate()``
waits until some are freed, so host memory stays bounded; it stops waiting if nothing is freed
for a while (a caller that keeps every result). The time waited is in the per-call log line.

Detection: the stock ``generate`` builds its results with the slicing above (speculators
0.3.x; otherwise unknown), and vLLM's ``collective_rpc`` sends functions to the workers
(otherwise not needed). Where the worker does not take the layout (``shm-transport`` off, or
no room in ``/dev/shm``), the call runs as without this patch.

Performance only (the same tensors, bit for bit): left off where no validation run applied it on
the release that covers the installed vLLM. Remove when speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

import logging

from speculators_compat.patching import Kind, Probe, declare

from ..._probes import generate_probes, vllm_module
from ..._ranges import SPECULATORS_03
from ._runtime import pool as pools
from ._runtime import segments
from ._runtime.plan import call_lengths
from ._runtime.reply import TRANSFER_ATTR, CallExecutor, Transfer, take_written
from ._runtime.segments import itemsize as itemsize_of
from ._runtime.worker import accept_plan

log = logging.getLogger("speculators_compat")

#: what the stock ``generate`` must contain for the blocks to stand in for its slices
STOCK = "h[offset : offset + seq_len].clone().cpu() for h in aux_hidden_states"


#: how ``MultiprocExecutor.collective_rpc`` sends a function (the layout reaches the workers so)
CALLABLE = "cloudpickle.dumps(method"


def _judge(source: str, rpc_source: str | None) -> Probe:
    if STOCK not in " ".join(source.split()):
        return Probe.unknown(f"VllmHiddenStatesGenerator.generate does not build its results with {STOCK!r}")
    if not rpc_source or CALLABLE not in rpc_source:
        return Probe.old("MultiprocExecutor.collective_rpc sends no functions: the states travel as without this patch")
    return Probe.new("generate() clones each sequence's slice of the reply: blocks stand in for the slices")


def _rpc_source(module) -> str | None:
    import inspect

    try:
        return inspect.getsource(getattr(module.MultiprocExecutor.collective_rpc, "__wrapped__",
                                         module.MultiprocExecutor.collective_rpc))
    except (OSError, TypeError, AttributeError):
        return None


def generate_and_rpc_probes(judge):
    """``(probe, static_probe)`` that give ``judge`` the source of the stock ``generate`` and that of
    vLLM's ``MultiprocExecutor.collective_rpc`` (imported, or read from the installed sources)."""
    generate_probe, generate_static = generate_probes(lambda source: source)

    def probe(module) -> Probe:
        return judge(generate_probe(module), _rpc_source(module))

    def static_probe(view) -> Probe:
        return judge(generate_static(view), view.vllm.source(vllm_module(view, "MultiprocExecutor"),
                                                             "MultiprocExecutor", "collective_rpc"))

    return probe, static_probe


probe, static_probe = generate_and_rpc_probes(_judge)


def _generate(wrapped, instance, args, kwargs):
    instance.__dict__.pop(TRANSFER_ATTR, None)  # the previous call's: never read for this one
    on_written = take_written(instance)  # this call's, whatever happens to it
    token_ids = kwargs["token_ids"] if "token_ids" in kwargs else (args[0] if args else None)
    lengths = call_lengths(instance, token_ids)
    executor = getattr(instance, "executor", None)
    if lengths is None or executor is None:
        return wrapped(*args, **kwargs)
    config = instance.vllm_config.model_config
    layers = len(set(instance.layer_ids))
    hidden = int(config.get_hidden_size())
    dtype = config.dtype
    itemsize = itemsize_of(dtype)
    _, nbytes = pools.layout(lengths, layers, hidden, itemsize)
    pool = pools.pool_of(instance)
    if pool is None:
        # on an accelerator, the next call's segment is made while the device works
        device = getattr(getattr(instance.vllm_config, "device_config", None), "device_type", "cpu")
        pool = instance.__dict__[pools.POOL_ATTR] = pools.Pool(spares=device != "cpu")
    seg = pool.acquire(nbytes, pools.held_results_limit(max(nbytes, pool.largest_call)))
    if seg is None:
        segments.say_no_room(nbytes)  # once: the results travel pickled, as stock
        executor.collective_rpc(accept_plan, args=(None,))
        return wrapped(*args, **kwargs)
    transfer = None
    try:
        plan = pool.plan(seg, lengths, layers, hidden, str(dtype).replace("torch.", ""), itemsize)
        taken = executor.collective_rpc(accept_plan, args=(plan,))
        if not (isinstance(taken, list) and taken and taken[0] is True):
            return wrapped(*args, **kwargs)
        pool.mapped(seg)
        # the tensors over the segment are made when the driver is about to wait for the reply
        transfer = instance.__dict__[TRANSFER_ATTR] = Transfer.deferred(plan, lambda: pool.tensors(seg, plan), on_written)
        instance.executor = CallExecutor(executor, transfer)  # the stock code's executor for this call
        try:
            results = wrapped(*args, **kwargs)
        finally:
            instance.executor = executor
        if transfer.rows is None:
            log.debug("results-in-place: the worker's reply did not come through the layout")
        return results
    except BaseException:
        instance.__dict__.pop(TRANSFER_ATTR, None)
        raise
    finally:
        if transfer is not None:
            transfer.close()
        pool.release(seg)


def apply(module, patcher) -> None:
    patcher.wrap(module.VllmHiddenStatesGenerator, "generate", _generate)


PATCH = declare(
    id="results-in-place",
    title="each sequence's states copied once, from the device into the caller's tensor",
    delta="the states cross the host 3-4 times after the device (concatenate, pickle or map, clone, scan) "
    "-> one copy into the result tensors",
    api="VllmHiddenStatesGenerator.generate (its per-sequence slicing of the worker's reply)",
    kind=Kind.PERFORMANCE,
    after=("v5",),  # lays the call out before the repaired generate() runs
    vllm=">=0.11.1",
    speculators=SPECULATORS_03,
)
