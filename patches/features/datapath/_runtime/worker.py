"""The capturing worker's side of the data path: the driver's plan, the copies into its segment.

The capturing worker (TP rank 0) maps the driver's segment once (on a CUDA device it registers it
with ``cudaHostRegister`` at the first step that copies into it, while the device runs that step's
forward, so the copies from the device are asynchronous DMA straight into it), copies each step's
rows into their blocks and sums each layer's rows on the device. Its reply is a :class:`.reply.Written`:
a few numbers (rows copied, which layers' sums were finite). Nothing here imports torch at import time.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import time

from .plan import Plan
from .reply import Written
from .segments import dtype_of, itemsize, typed_view

log = logging.getLogger("speculators_compat")


#: attribute of the worker extension holding its :class:`WorkerState`
WORKER_STATE = "_speculators_compat_written"
#: True where the patch that carries the captured states applies (it sets it through its Patcher)
ACCEPTING = False


class WorkerState:
    """The capturing worker's mapped segments, the active plan and the copies in flight."""

    def __init__(self) -> None:
        # id -> [uint8 tensor over the mapping, registered with CUDA (None: not tried yet)]
        self.segments: dict[int, list] = {}
        self.plan: Plan | None = None
        self.cursor = 0
        self.sums: list = []  # per step: a [layers] float32 tensor of row sums (inf/nan propagate)
        self.views: dict = {}
        self.error: str | None = None
        self.stream = None
        #: seconds ``finish`` waited for the copies to land, over the worker's life
        self.wait_s = 0.0

    def accept(self, plan: Plan) -> None:
        self.drop()  # copies of an unfinished call must land before a segment is reused
        for seg_id in plan.retire:
            self.forget(seg_id)
        if plan.segment not in self.segments:
            self.segments[plan.segment] = _map(plan.path, plan.size)
        self.plan, self.cursor, self.sums, self.views, self.error = plan, 0, [], {}, None

    def forget(self, seg_id: int) -> None:
        entry = self.segments.pop(seg_id, None)
        if entry is not None and entry[1]:  # registered
            import torch

            torch.cuda.cudart().cudaHostUnregister(entry[0].data_ptr())

    def _view(self, layer: int, seq: int):
        key = (layer, seq)
        view = self.views.get(key)
        if view is None:
            plan = self.plan
            view = self.views[key] = typed_view(self.segments[plan.segment][0], plan.offsets[layer][seq], plan.dtype,
                                                (plan.lengths[seq], plan.hidden))
        return view

    def store(self, states: list) -> None:
        """Copy one step's rows (one ``[tokens, hidden]`` tensor per layer) into their blocks."""
        import torch

        plan = self.plan
        if self.error:
            return
        if len(states) != len(plan.offsets):
            self.error = f"the worker captured {len(states)} layers per step for a plan of {len(plan.offsets)}"
            return
        rows = int(states[0].shape[0])
        if any(s.dim() != 2 or int(s.shape[0]) != rows or int(s.shape[1]) != plan.hidden for s in states):
            self.error = (f"a step's captured layers have shapes {[tuple(s.shape) for s in states]}, "
                          f"expected [tokens, {plan.hidden}]")
            return
        if any(s.dtype != dtype_of(plan.dtype) for s in states):
            self.error = f"captured states of {states[0].dtype}, the call was laid out for {plan.dtype}"
            return
        if self.cursor + rows > plan.rows:
            self.error = f"the worker captured more than the {plan.rows} rows of the call's input tokens"
            return
        device = states[0].device
        cuda = device.type == "cuda"
        self.sums.append(torch.stack([s.sum(dtype=torch.float32) for s in states]))
        starts = self._starts()
        copies = []
        at, end = self.cursor, self.cursor + rows
        seq = bisect.bisect_right(starts, at) - 1
        while at < end:
            seq_start = starts[seq]
            take = min(end, seq_start + plan.lengths[seq]) - at
            if take > 0:
                copies.append((seq, at - seq_start, at - self.cursor, take))
            at += max(take, 0)
            seq += 1
        if cuda:
            entry = self.segments[plan.segment]
            if entry[1] is None:
                # registered at the first step that copies into it, while the device runs its forward
                entry[1] = _register(entry[0])
            stream = self.stream
            if stream is None or stream.device != device:
                stream = self.stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for j, s in enumerate(states):
                    for seq, dst_row, src_row, n in copies:
                        self._view(j, seq)[dst_row:dst_row + n].copy_(s[src_row:src_row + n], non_blocking=True)
                    s.record_stream(stream)
        else:
            for j, s in enumerate(states):
                s = s.to("cpu") if s.device.type != "cpu" else s
                for seq, dst_row, src_row, n in copies:
                    self._view(j, seq)[dst_row:dst_row + n].copy_(s[src_row:src_row + n])
        self.cursor = end

    def _starts(self) -> list[int]:
        starts = getattr(self, "_starts_cache", None)
        if starts is None or starts[1] is not self.plan:
            starts = (list(itertools.accumulate([0] + self.plan.lengths[:-1])), self.plan)
            self._starts_cache = starts
        return starts[0]

    def finish(self) -> Written:
        """Wait for the copies and give the reply; the plan is over."""
        import torch

        plan, self.plan = self.plan, None
        start = time.perf_counter()
        if self.stream is not None:
            self.stream.synchronize()
        self.wait_s += time.perf_counter() - start
        finite = None
        if self.sums:
            finite = torch.isfinite(torch.stack(self.sums)).all(dim=0).tolist()
        reply = Written(plan.id, self.cursor, finite, self.error)
        self.sums, self.views, self.error = [], {}, None
        return reply

    def drop(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.plan, self.sums, self.views, self.error = None, [], {}, None


def worker_rows(extension, segment: int, offset: int, dtype: str, shape: list):
    """In the capturing worker: the rows at ``offset`` of the driver's segment ``segment`` (the
    same memory the driver's block tensor has; pinned on CUDA), or ``None`` if not mapped here."""
    state = extension.__dict__.get(WORKER_STATE)
    entry = state.segments.get(segment) if state is not None else None
    if entry is None or offset < 0 or offset + math.prod(shape) * itemsize(dtype_of(dtype)) > entry[0].numel():
        return None
    return typed_view(entry[0], offset, dtype, shape)


def _map(path: str, size: int) -> list:
    """Map a driver's segment (shared); ``[buffer, registered]``, registered with CUDA later (at
    the first step that copies into it, see :func:`_register`)."""
    import torch

    return [torch.from_file(path, shared=True, size=size, dtype=torch.uint8), None]


def _register(buf) -> bool:
    """Register a mapped segment with CUDA (pinned: copies from the device into it are
    asynchronous DMA). Returns whether it is registered (a failure leaves the copies synchronous)."""
    import torch

    # 0 = cudaHostRegisterDefault
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(getattr(err, "value", err)) == 0:
        return True
    log.warning("shm-transport: cudaHostRegister of %d bytes failed (%s): copies from the "
                "device are synchronous", buf.numel(), err)
    return False


def accept_plan(worker, plan: Plan | None):
    """Run in every worker by ``collective_rpc``: the capturing worker (TP rank 0, with the
    ``shm-transport`` patch applied) takes ``plan`` (``None``: no plan for this call) and says
    ``True``; every other worker says ``False``."""
    ext = getattr(worker, "worker", None) or worker  # vLLM's WorkerWrapperBase wraps the worker
    if not ACCEPTING or not getattr(ext, "_layer_ids", None):
        return False
    try:
        from vllm.distributed import get_tp_group

        if get_tp_group().rank_in_group != 0:
            return False
    except (ImportError, AssertionError):
        pass
    state = ext.__dict__.get(WORKER_STATE)
    if state is None:
        state = ext.__dict__[WORKER_STATE] = WorkerState()
    if plan is None:
        state.drop()
        return True
    state.accept(plan)
    return True
