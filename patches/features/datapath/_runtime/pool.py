"""The driver's side of the data path: shared-memory segments the capturing worker writes into.

The driver owns a pool of segments. Before a call it lays the call's results out in one segment
(one region per layer, ``rows x hidden``, each sequence's block a slice of it) and sends the layout
(a :class:`Plan`) to the workers (:mod:`.worker`). The driver hands every block out as its own
tensor (its storage is exactly the block's bytes: ``torch.save`` writes that sample, not the
segment). When every block of a segment has been freed by the caller, the segment is reused:
steady state has no page faults and no registration cost. On CUDA the next call's segment is
made ahead of need, in a thread, while the device works (``Pool(spares=True)``). Segment files
are unlinked as soon as the worker has mapped them (a spare no call took, at exit; a killed
run's, by the next run): nothing stays in /dev/shm. Nothing here imports torch at import time.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
import time
import weakref

from speculators_compat.patching import InvalidInputError, Option

from . import segments
from .plan import Plan, layout
from .segments import Segment, align, dtype_of, itemsize, new_segment, unlink, unlink_files

log = logging.getLogger("speculators_compat")

#: segments are sized in multiples of this (bytes)
SEGMENT_QUANTUM = 16 << 20
#: free segments kept for reuse beyond the one a call holds
MAX_IDLE = 2
#: ``generate()`` does not wait for held results when none was freed for this long
STALL_S = 20.0
#: ``generate()`` waiting for held results collects garbage (results dropped in a reference cycle)
#: only when none was freed for this long: a full collection in a process with vLLM loaded holds the
#: GIL for a good part of a second, during which the caller's saving threads wait
COLLECT_AFTER_S = 1.0
#: attribute of the generator holding its :class:`Pool`
POOL_ATTR = "_speculators_compat_pool"
HELD_RESULTS = Option("SPECULATORS_COMPAT_HELD_RESULTS",
                      "how many calls' worth of results the caller may hold (not yet freed, e.g. not yet saved) "
                      "before ``generate()`` waits (default 4; ``0``: never wait)")
#: calls' worth of results held before ``generate()`` waits, by default
HELD_RESULTS_DEFAULT = 4.0


def held_results_limit(call_bytes: int) -> int | None:
    """The byte limit on held results for a call of ``call_bytes`` (``None``: no limit)."""
    raw = HELD_RESULTS.raw()
    try:
        calls = float(raw) if raw else HELD_RESULTS_DEFAULT
    except ValueError:
        raise InvalidInputError(f"{HELD_RESULTS}={raw!r}: expected a number of calls (0 = no limit)") from None
    return int(calls * align(call_bytes, SEGMENT_QUANTUM)) if calls > 0 else None


def pool_of(generator) -> "Pool | None":
    return generator.__dict__.get(POOL_ATTR)


#: plan ids, unique in the driver process
_plan_ids = itertools.count(1)


class Pool:
    """The driver's shared-memory segments (one pool per generator): which are free, held or
    being written, the held-results limit (:meth:`acquire`), and the tensors over them
    (:meth:`tensors`).

    ``spares``: when a call takes the last free segment and the held-results limit leaves room
    for another call, a thread makes the next call's segment ahead of time (:class:`_Spares`).
    For workers that copy asynchronously (CUDA); on the CPU the pages would compete with the
    model for cores."""

    def __init__(self, spares: bool = False) -> None:
        self._segments: dict[int, Segment] = {}
        self._tensors: dict = {}  # id -> (a weak reference to an array handed out, its segment's id)
        self._spares = _Spares(self) if spares else None
        self._closed = False
        #: segment files not yet unlinked (a spare no call took yet): removed at exit
        self._files: set[str] = set()
        weakref.finalize(self, unlink_files, self._files, os.getpid())
        self._retired: list[int] = []
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._last_free: float | None = None  # when the caller last freed a block
        self._stalled = False
        #: seconds ``acquire`` waited for held results to be freed, over the pool's life
        self.waited_s = 0.0
        #: the most bytes of segments held at once (results not yet freed + the call's)
        self.peak_bytes = 0
        #: the largest call's segment so far: the held-results limit is counted in such calls, so
        #: results of a large call still held do not make every smaller call after it wait
        self.largest_call = 0

    @property
    def spares_made(self) -> int:
        return self._spares.made if self._spares else 0

    @property
    def spares_taken(self) -> int:
        return self._spares.taken if self._spares else 0

    @property
    def _making(self):
        return self._spares.thread if self._spares else None

    def held_bytes(self) -> int:
        with self._cond:
            return self._held()

    def _held(self) -> int:
        return sum(s.size for s in self._segments.values() if s.held)

    def _free_fit(self, nbytes: int) -> Segment | None:
        fits = [s for s in self._segments.values() if not s.held and s.size >= nbytes]
        return min(fits, key=lambda s: s.size) if fits else None

    def acquire(self, nbytes: int, limit: int | None) -> Segment | None:
        """A free segment of at least ``nbytes``, marked busy; ``None`` when the shared-memory
        folder lacks the room (the caller falls back to the stock path). With ``limit`` (bytes),
        first waits for held results to be freed (:meth:`_wait_for_room`)."""
        with self._cond:
            self.largest_call = max(self.largest_call, align(nbytes, SEGMENT_QUANTUM))
            if limit:
                self._wait_for_room(nbytes, limit)
            seg = self._free_fit(nbytes)
            if seg is None and self._spares is not None and self._spares.wait():
                seg = self._free_fit(nbytes)  # a spare was on its way: sooner than a new one
            if seg is None:
                seg = self._create(nbytes)
                if seg is None:
                    return None
            elif seg.spare:
                seg.spare = False
                self._spares.taken += 1
            seg.busy = True
            self._retire_idle()
            self.peak_bytes = max(self.peak_bytes, self._held())
            if self._spares is not None and not self._closed:
                self._spares.start(limit)
            return seg

    def _wait_for_room(self, nbytes: int, limit: int) -> None:
        """(Lock held.) While the segments still held by the caller's results plus this call would
        exceed ``limit``, wait -- as long as the caller is freeing results (saving them): a caller
        that keeps its results, or frees none for ``STALL_S``, is not waited for."""
        start = time.monotonic()
        collected = False
        while self._held() and self._held() + align(nbytes, SEGMENT_QUANTUM) > limit:
            if self._last_free is None:
                break  # nothing was ever freed: the caller keeps its results
            if not collected and time.monotonic() - max(start, self._last_free) >= COLLECT_AFTER_S:
                # results the caller dropped in a reference cycle wait for the collector: only when
                # none was freed for a while (a full collection holds the GIL, the savers wait)
                collected = True
                self._cond.release()  # its finalizers free blocks, which takes this lock (other threads too)
                try:
                    gc.collect()
                finally:
                    self._cond.acquire()
                continue
            idle = time.monotonic() - self._last_free
            if idle >= STALL_S:
                if not self._stalled:
                    self._stalled = True
                    log.info("shm-transport: %.1f GiB of results held and none freed for %.0f s: "
                             "going on without waiting", self._held() / 2**30, STALL_S)
                break
            self._cond.wait(timeout=min(COLLECT_AFTER_S if not collected else 1.0, STALL_S - idle))
        self.waited_s += time.monotonic() - start

    def _create(self, nbytes: int) -> Segment | None:
        size = align(nbytes, SEGMENT_QUANTUM)
        segments.remove_stale_once()  # files a killed run created and had not unlinked yet
        if not segments.room(size) and any(not s.held for s in self._segments.values()):
            self._retire_idle(keep=0)  # idle segments give their room back
        seg = new_segment(next(self._ids), size, self._files)
        if seg is not None:
            self._segments[seg.id] = seg
        return seg

    def _retire_idle(self, keep: int = MAX_IDLE) -> None:
        idle = sorted((s for s in self._segments.values() if not s.held), key=lambda s: s.size)
        for seg in idle[:max(0, len(idle) - keep)]:
            del self._segments[seg.id]
            unlink(seg.path)
            self._files.discard(seg.path)
            try:
                seg.mm.close()
            except BufferError:  # a view is still exported (cannot happen once live == 0)
                self._segments[seg.id] = seg
                continue
            if seg.known:
                self._retired.append(seg.id)

    def plan(self, seg: Segment, lengths: list[int], layers: int, hidden: int, dtype: str, size: int) -> Plan:
        offsets, _ = layout(lengths, layers, hidden, size)
        with self._cond:
            retire, self._retired = self._retired, []
        return Plan(next(_plan_ids), seg.id, seg.path, seg.size, list(lengths), hidden, dtype, offsets, retire)

    def mapped(self, seg: Segment) -> None:
        """The workers have mapped ``seg``: its file is unlinked (nothing left in /dev/shm)."""
        if not seg.known:
            seg.known = True
            unlink(seg.path)
            self._files.discard(seg.path)

    def release(self, seg: Segment) -> None:
        """The call is over (its tensors, if any were handed out, keep the segment held)."""
        with self._cond:
            seg.busy = False
            self._cond.notify_all()

    def tensors(self, seg: Segment, plan: Plan) -> tuple[list, list[list]]:
        """``(layers, blocks)``: every layer of ``plan`` as one ``rows x hidden`` tensor and every
        block ``[layer][seq]`` as its own tensor (each owning exactly its bytes), all views of
        ``seg``; each keeps ``seg`` held until it is freed."""
        import numpy as np
        import torch

        dtype = dtype_of(plan.dtype)
        size = itemsize(dtype)
        # the segment's bytes as numpy integers of the dtype's size (numpy has no bfloat16): each
        # block is a slice of it, shaped ``rows x hidden``, and its tensor owns exactly those bytes
        whole = np.frombuffer(seg.mm, dtype=np.dtype(f"<i{size}"))
        arrays, layers, blocks = [], [], []
        for row in plan.offsets:
            start = row[0] // size if row else 0
            arrays.append(whole[start:start + plan.rows * plan.hidden].reshape(plan.rows, plan.hidden))
            layers.append(torch.from_numpy(arrays[-1]).view(dtype))
            layer = []
            for n, off in zip(plan.lengths, row):
                arrays.append(whole[off // size:off // size + n * plan.hidden].reshape(n, plan.hidden))
                layer.append(torch.from_numpy(arrays[-1]).view(dtype))
            blocks.append(layer)
        with self._cond:
            seg.live += len(arrays)
        for k, arr in enumerate(arrays):
            ref = weakref.ref(arr, self._freed)  # the segment is held until the array is freed
            # a layer (the stock code's, dropped when the call returns) is not a result the caller freed
            self._tensors[id(ref)] = (ref, seg.id, k % (len(plan.lengths) + 1) != 0)
        return layers, blocks

    def _freed(self, ref) -> None:
        entry = self._tensors.pop(id(ref), None)
        if entry is None:
            return
        with self._cond:
            seg = self._segments.get(entry[1])
            if seg is not None:
                seg.live -= 1
            if entry[2]:
                self._last_free = time.monotonic()
            self._cond.notify_all()

    def close(self) -> None:
        """Forget every segment (their mappings go with the last tensor over them)."""
        with self._cond:
            self._closed = True
            for seg in self._segments.values():
                unlink(seg.path)
            self._segments.clear()
            unlink_files(self._files, os.getpid())


class _Spares:
    """Segments made ahead of need, in a thread, for the pool's next call."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.thread: threading.Thread | None = None
        #: segments made ahead of need, and how many of them a call took
        self.made = 0
        self.taken = 0

    def wait(self) -> bool:
        """(Pool lock held.) Wait for a spare on its way; whether there was one."""
        if self.thread is None:
            return False
        while self.thread is not None:
            self.pool._cond.wait()
        return True

    def start(self, limit: int | None) -> None:
        """(Pool lock held.) Make the next call's segment in a thread when none is free for it and
        the limit would let the next call run without waiting."""
        pool, size = self.pool, self.pool.largest_call
        if (self.thread is not None or not size or pool._free_fit(size) is not None
                or (limit and pool._held() + size > limit)):
            return
        self.thread = threading.Thread(target=self._make, args=(size,), daemon=True,
                                       name="speculators-compat-spare-segment")
        self.thread.start()

    def _make(self, size: int) -> None:
        pool = self.pool
        seg = None
        try:
            seg = new_segment(next(pool._ids), size, pool._files, populate=True)
        except OSError as exc:
            log.debug("shm-transport: no spare segment (%s)", exc)
        finally:
            with pool._cond:
                if seg is not None and pool._closed:
                    unlink(seg.path)
                    pool._files.discard(seg.path)
                    seg.mm.close()
                elif seg is not None:
                    seg.spare = True
                    pool._segments[seg.id] = seg
                    self.made += 1
                self.thread = None
                pool._cond.notify_all()
