"""Captured states from a worker to the driver through shared memory, not pickle.

The stock generator brings a call's captured states from the worker with
``collective_rpc("_get_captured_states")``: vLLM pickles every tensor into its message queue
and the driver unpickles them, a copy on each side at well under 1 GB/s (measured on an H200
host: 0.34 GB/s for 1 GiB, 3.7 s of a 6.5 s call). Here the worker writes the states once
into a file under ``/dev/shm`` and replies with a :class:`SharedStates` handle; unpickling the
handle in the driver *maps* that file and returns the same list of tensors the stock reply
holds (no copy; the file is unlinked at once, its pages live as long as the tensors do).

Only the ``shm-transport`` patch creates handles. The second half of this module is the path
``results-in-place`` and ``shm-transport`` take together: the rows are copied once, into blocks
the driver hands out (below). Nothing here imports torch or vLLM at import time.
"""

from __future__ import annotations

import functools
import gc
import glob
import itertools
import logging
import os

__all__ = ["SharedStates", "open_states", "write_states", "folder", "PREFIX", "remove_stale"]

log = logging.getLogger("speculators_compat")

PREFIX = "speculators_compat-states"
#: free space to leave in the shared-memory folder (vLLM's own queues live there too)
MARGIN = 256 << 20
_counter = itertools.count()


def folder() -> str:
    return os.environ.get("SPECULATORS_COMPAT_SHM_DIR", "/dev/shm")


@functools.lru_cache(maxsize=None)
def _dtype(name: str):
    import torch

    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"not a torch dtype: {name!r}")
    return dtype


def typed_view(buf, offset: int, dtype, shape):
    """The bytes of ``buf`` (a uint8 tensor) at ``offset`` as a tensor of ``dtype`` (a torch dtype
    or its name) and ``shape``, no copy."""
    import math

    dt = _dtype(dtype) if isinstance(dtype, str) else dtype
    nbytes = math.prod(shape) * _itemsize(dt)
    return buf[offset:offset + nbytes].view(dt).view(*shape)


def open_states(path: str, nbytes: int, layout: list) -> list:
    """Map ``path`` (written by :func:`write_states`), unlink it, return the tensors it holds.

    Called by the unpickler in the driver. The mapping is private: the tensors can be
    written without touching the file; its pages are freed with the last tensor."""
    import torch

    try:
        buf = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    out = []
    for dtype, shape, offset, size in layout:
        out.append(buf[offset:offset + size].view(_dtype(dtype)).view(shape))
    return out


class SharedStates:
    """A worker's reply: the path of a shared-memory file and where each tensor lies in it.

    Pickled, it is a call of :func:`open_states`, so the driver's unpickler hands the stock
    code the list of tensors it expects."""

    __slots__ = ("path", "nbytes", "layout")

    def __init__(self, path: str, nbytes: int, layout: list) -> None:
        self.path, self.nbytes, self.layout = path, nbytes, layout

    def __reduce__(self):
        return open_states, (self.path, self.nbytes, self.layout)


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def write_states(parts_per_layer: list, owner_pid: int) -> SharedStates | None:
    """Concatenate each layer's parts (tensors of equal trailing shape, on any device) into one
    new shared-memory file and return its handle; ``None`` (the caller replies as stock) when
    the folder lacks the space. ``owner_pid``: the driver's pid, in the name, so a file a dead
    driver never opened can be recognised and removed (:func:`remove_stale`)."""
    import torch

    layout = []
    offset = 0
    for parts in parts_per_layer:
        first = parts[0]
        rows = sum(int(p.shape[0]) for p in parts)
        shape = [rows, *first.shape[1:]]
        size = int(torch.Size(shape).numel()) * first.element_size()
        layout.append([str(first.dtype).replace("torch.", ""), shape, offset, size])
        offset = _align(offset + size)
    nbytes = max(offset, 1)
    where = folder()
    try:
        stat = os.statvfs(where)
    except OSError:
        return None
    if stat.f_bavail * stat.f_frsize < nbytes + MARGIN:
        log.debug("shm-transport: %s has %d bytes free, the states need %d: pickled as stock",
                  where, stat.f_bavail * stat.f_frsize, nbytes)
        return None
    path = os.path.join(where, f"{PREFIX}-{owner_pid}-{os.getpid()}-{next(_counter)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            # reserve the pages now: a full tmpfs is an error here, not a SIGBUS while copying
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            log.debug("shm-transport: cannot reserve %d bytes in %s (%s): pickled as stock", nbytes, where, exc)
            os.close(fd)
            fd = -1
            os.unlink(path)
            return None
        os.close(fd)
        fd = -1
        buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        for parts, (dtype, shape, off, size) in zip(parts_per_layer, layout):
            view = buf[off:off + size].view(_dtype(dtype)).view(shape)
            row = 0
            for p in parts:
                n = int(p.shape[0])
                view[row:row + n].copy_(p)
                row += n
        del buf
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    return SharedStates(path, nbytes, layout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove state files whose driver process is gone (a run killed between a worker's reply
    and the driver's read). Returns the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(folder(), f"{PREFIX}-*")):
        try:
            owner = int(os.path.basename(path)[len(PREFIX) + 1:].split("-")[0])
        except ValueError:
            continue
        if not _alive(owner):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    if removed:
        log.info("shm-transport: removed %d state file(s) a killed run left in %s", len(removed), folder())
    return removed


# -- states written in place: a pool of shared-memory segments the worker copies into ----------
#
# The driver owns a pool of shared-memory segments. Before a call it lays the call's result
# tensors out in one segment -- one block per (sequence, layer), ``rows x hidden`` -- and sends
# the layout (a :class:`Plan`) to the workers. The capturing worker maps the segment once (on a
# CUDA device it registers it with ``cudaHostRegister`` at the first step that copies into it,
# while the device runs that step's forward, so the copies from the device are asynchronous DMA
# straight into it) and copies each step's rows into their blocks. The driver hands every block
# out as its own tensor (its storage is exactly the block's bytes: ``torch.save`` writes that
# sample, not the segment). When every block of a segment has been freed by the caller, the
# segment is reused: steady state has no page faults and no registration cost. On CUDA the next
# call's segment is made ahead of need, in a thread, while the device works (``Pool(spares=True)``).
# Segment files are unlinked as soon as the worker has mapped them (a spare no call took, at
# exit; a killed run's, by the next run): nothing stays in /dev/shm.

import bisect
import mmap
import threading
import time
import weakref

#: alignment of every block in a segment (bytes)
BLOCK_ALIGN = 64
#: segments are sized in multiples of this (bytes)
SEGMENT_QUANTUM = 16 << 20
#: free segments kept for reuse beyond the one a call holds
MAX_IDLE = 2
#: ``SPECULATORS_COMPAT_HELD_RESULTS``: how many calls' worth of results may be held (not yet
#: freed by the caller, e.g. not yet saved) before ``generate()`` waits; 0 = never wait
HELD_RESULTS_ENV = "SPECULATORS_COMPAT_HELD_RESULTS"
HELD_RESULTS_DEFAULT = 4
#: ``generate()`` does not wait for held results when none was freed for this long
STALL_S = 20.0


class Plan:
    """Where a call's captured rows go: sent to the workers before the call (small, picklable).

    ``lengths``: rows per sequence in input order; ``offsets[layer][seq]``: byte offset of that
    block in the segment; every block is ``lengths[seq] x hidden`` of ``dtype``."""

    __slots__ = ("id", "segment", "path", "size", "lengths", "hidden", "dtype", "offsets", "retire")

    def __init__(self, id, segment, path, size, lengths, hidden, dtype, offsets, retire=()):
        self.id, self.segment, self.path, self.size = id, segment, path, size
        self.lengths, self.hidden, self.dtype, self.offsets = lengths, hidden, dtype, offsets
        self.retire = tuple(retire)

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)

    @property
    def rows(self) -> int:
        return sum(self.lengths)


def layout(lengths: list[int], layers: int, hidden: int, itemsize: int) -> tuple[list[list[int]], int]:
    """Byte offsets ``[layer][seq]`` of each block, layer-major, and the bytes they span."""
    offsets, at = [], 0
    for _ in range(layers):
        row = []
        for n in lengths:
            row.append(at)
            at = _align(at + n * hidden * itemsize, BLOCK_ALIGN)
        offsets.append(row)
    return offsets, max(at, 1)


class _Segment:
    __slots__ = ("id", "path", "size", "mm", "base", "live", "busy", "known", "spare", "__weakref__")

    def __init__(self, id, path, size, mm):
        import numpy as np

        self.id, self.path, self.size, self.mm = id, path, size, mm
        self.base = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data  # the mapping's address
        self.live = 0  # blocks handed out and not yet freed
        self.busy = False  # a call is writing into it
        self.known = False  # the workers have mapped it (and the file is unlinked)
        self.spare = False  # made ahead of need, no call took it yet


#: per process: stale files of killed runs were looked for
_SWEPT: list = []
#: plan ids, unique in the driver process (every generator's calls share the reply registry)
_plan_ids = itertools.count(1)

#: attribute of the generator holding its :class:`Pool`
POOL_ATTR = "_speculators_compat_pool"


def pool_of(generator) -> "Pool | None":
    return generator.__dict__.get(POOL_ATTR)


class Pool:
    """The driver's shared-memory segments (one pool per generator).

    ``spares``: when a call takes the last free segment and the held-results limit leaves room
    for another call, a thread makes the next call's segment ahead of time (reserved and mapped
    while the device works), so that no call waits for a new segment's pages. For workers that
    copy asynchronously (CUDA); on the CPU the pages would compete with the model for cores."""

    def __init__(self, spares: bool = False) -> None:
        self._segments: dict[int, _Segment] = {}
        self._blocks: dict = {}  # id -> (a weak reference to a block handed out, its segment's id)
        self._spares = spares
        self._making: threading.Thread | None = None  # the thread making a spare segment
        self._closed = False
        #: segment files not yet unlinked (a spare no call took yet): removed at exit
        self._files: set[str] = set()
        weakref.finalize(self, _unlink_files, self._files, os.getpid())
        #: segments made ahead of need, and how many of them a call took
        self.spares_made = 0
        self.spares_taken = 0
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

    # -- accounting -------------------------------------------------------------------------

    def held_bytes(self) -> int:
        with self._cond:
            return self._held()

    def _held(self) -> int:
        return sum(s.size for s in self._segments.values() if s.live or s.busy)

    def _free_block(self, seg_id: int) -> None:
        with self._cond:
            seg = self._segments.get(seg_id)
            if seg is not None:
                seg.live -= 1
            self._last_free = time.monotonic()
            self._cond.notify_all()

    # -- a call's segment -------------------------------------------------------------------

    def acquire(self, nbytes: int, limit: int | None) -> _Segment | None:
        """A free segment of at least ``nbytes``, marked busy; ``None`` when the shared-memory
        folder lacks the room (the caller falls back to the stock path).

        With ``limit`` (bytes): while the segments still held by the caller's results plus this
        call would exceed it, wait -- as long as the caller is freeing results (saving them):
        a caller that keeps its results, or frees none for ``STALL_S``, is not waited for."""
        with self._cond:
            self.largest_call = max(self.largest_call, _align(nbytes, SEGMENT_QUANTUM))
            if limit:
                start = time.monotonic()
                collected = False
                while self._held() and self._held() + _align(nbytes, SEGMENT_QUANTUM) > limit:
                    if self._last_free is None:
                        break  # nothing was ever freed: the caller keeps its results
                    if not collected:  # results the caller dropped in a reference cycle wait for the collector
                        collected = True
                        gc.collect()
                        continue
                    idle = time.monotonic() - self._last_free
                    if idle >= STALL_S:
                        if not self._stalled:
                            self._stalled = True
                            log.info("shm-transport: %.1f GiB of results held and none freed for %.0f s: "
                                     "going on without waiting", self._held() / 2**30, STALL_S)
                        break
                    self._cond.wait(timeout=min(1.0, STALL_S - idle))
                self.waited_s += time.monotonic() - start
            seg = self._free_fit(nbytes)
            if seg is None and self._making is not None:
                while self._making is not None:  # a spare is on its way: sooner than a new one
                    self._cond.wait()
                seg = self._free_fit(nbytes)
            if seg is None:
                seg = self._create(nbytes)
                if seg is None:
                    return None
            elif seg.spare:
                seg.spare = False
                self.spares_taken += 1
            seg.busy = True
            self._retire_idle()
            self.peak_bytes = max(self.peak_bytes, self._held())
            self._start_spare(limit)
            return seg

    def _free_fit(self, nbytes: int) -> _Segment | None:
        fits = [s for s in self._segments.values() if not (s.live or s.busy) and s.size >= nbytes]
        return min(fits, key=lambda s: s.size) if fits else None

    def _start_spare(self, limit: int | None) -> None:
        """(Lock held.) Make the next call's segment in a thread when none is free for it and the
        limit would let the next call run without waiting."""
        size = self.largest_call
        if (not self._spares or self._closed or self._making is not None or not size
                or self._free_fit(size) is not None or (limit and self._held() + size > limit)):
            return
        self._making = threading.Thread(target=self._make_spare, args=(size,), daemon=True,
                                        name="speculators-compat-spare-segment")
        self._making.start()

    def _make_spare(self, size: int) -> None:
        seg = None
        try:
            seg = self._new_segment(size, populate=True)
        except OSError as exc:
            log.debug("shm-transport: no spare segment (%s)", exc)
        finally:
            with self._cond:
                if seg is not None and self._closed:
                    _unlink(seg.path)
                    self._files.discard(seg.path)
                    seg.mm.close()
                elif seg is not None:
                    seg.spare = True
                    self._segments[seg.id] = seg
                    self.spares_made += 1
                self._making = None
                self._cond.notify_all()

    def _create(self, nbytes: int) -> _Segment | None:
        size = _align(nbytes, SEGMENT_QUANTUM)
        where = folder()
        if not _SWEPT:  # files a killed run created and had not unlinked yet
            _SWEPT.append(True)
            remove_stale()
        try:
            stat = os.statvfs(where)
        except OSError:
            return None
        if stat.f_bavail * stat.f_frsize < size + MARGIN and any(
                not (s.live or s.busy) for s in self._segments.values()):
            self._retire_idle(keep=0)  # idle segments give their room back
        seg = self._new_segment(size)
        if seg is not None:
            self._segments[seg.id] = seg
        return seg

    def _new_segment(self, size: int, populate: bool = False) -> _Segment | None:
        """A new segment file of ``size`` bytes, reserved and mapped (``populate``: its pages
        mapped in now, not at the caller's first touch); ``None`` without the room."""
        where = folder()
        try:
            stat = os.statvfs(where)
        except OSError:
            return None
        if stat.f_bavail * stat.f_frsize < size + MARGIN:
            log.debug("shm-transport: %s lacks %d bytes for a segment", where, size)
            return None
        seg_id = next(self._ids)
        path = os.path.join(where, f"{PREFIX}-{os.getpid()}-{os.getpid()}-seg{seg_id}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._files.add(path)
        try:
            os.posix_fallocate(fd, 0, size)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            log.debug("shm-transport: cannot reserve %d bytes in %s (%s)", size, where, exc)
            _unlink(path)
            self._files.discard(path)
            return None
        finally:
            os.close(fd)
        return _Segment(seg_id, path, size, mm)

    def _retire_idle(self, keep: int = MAX_IDLE) -> None:
        idle = sorted((s for s in self._segments.values() if not (s.live or s.busy)), key=lambda s: s.size)
        for seg in idle[:max(0, len(idle) - keep)]:
            del self._segments[seg.id]
            _unlink(seg.path)
            self._files.discard(seg.path)
            try:
                seg.mm.close()
            except BufferError:  # a view is still exported (cannot happen once live == 0)
                self._segments[seg.id] = seg
                continue
            if seg.known:
                self._retired.append(seg.id)

    def plan(self, seg: _Segment, lengths: list[int], layers: int, hidden: int, dtype: str,
             itemsize: int) -> Plan:
        offsets, _ = layout(lengths, layers, hidden, itemsize)
        with self._cond:
            retire, self._retired = self._retired, []
        return Plan(next(_plan_ids), seg.id, seg.path, seg.size, list(lengths), hidden, dtype, offsets, retire)

    def mapped(self, seg: _Segment) -> None:
        """The workers have mapped ``seg``: its file is unlinked (nothing left in /dev/shm)."""
        if not seg.known:
            seg.known = True
            _unlink(seg.path)
            self._files.discard(seg.path)

    def locate(self, tensor) -> tuple[int, int] | None:
        """``(segment id, byte offset)`` of a contiguous tensor lying in a segment the workers
        have mapped (a block handed out by this pool), else ``None``."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._cond:
            for seg in self._segments.values():
                if seg.known and seg.base <= ptr and ptr + nbytes <= seg.base + seg.size:
                    return seg.id, ptr - seg.base
        return None

    def release(self, seg: _Segment) -> None:
        """The call is over (its blocks, if any were handed out, keep the segment held)."""
        with self._cond:
            seg.busy = False
            self._cond.notify_all()

    def blocks(self, seg: _Segment, plan: Plan) -> list[list]:
        """Every block of ``plan`` as its own tensor ``[layer][seq]``; each keeps ``seg`` held
        until it is freed."""
        import numpy as np
        import torch

        dtype = _dtype(plan.dtype)
        itemsize = _itemsize(dtype)
        # the segment's bytes as numpy integers of the dtype's size (numpy has no bfloat16): each
        # block is a slice of it, shaped ``rows x hidden``, and its tensor owns exactly those bytes
        whole = np.frombuffer(seg.mm, dtype=np.dtype(f"<i{itemsize}"))
        refs, freed = self._blocks, self._block_freed
        out = []
        with self._cond:
            seg.live += len(plan.offsets) * len(plan.lengths)
        for row in plan.offsets:
            layer = []
            for n, off in zip(plan.lengths, row):
                start = off // itemsize
                arr = whole[start:start + n * plan.hidden].reshape(n, plan.hidden)
                ref = weakref.ref(arr, freed)  # the segment is held until the block is freed
                refs[id(ref)] = (ref, seg.id)
                layer.append(torch.from_numpy(arr).view(dtype))
            out.append(layer)
        return out

    def _block_freed(self, ref) -> None:
        entry = self._blocks.pop(id(ref), None)
        if entry is not None:
            self._free_block(entry[1])

    def close(self) -> None:
        """Forget every segment (their mappings go with the last block tensor)."""
        with self._cond:
            self._closed = True
            for seg in self._segments.values():
                _unlink(seg.path)
            self._segments.clear()
            _unlink_files(self._files, os.getpid())


def _itemsize(dtype) -> int:
    return dtype.itemsize


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_files(paths: set, pid: int) -> None:
    """Unlink ``paths`` (segment files no worker mapped yet), in the process that made them only."""
    if os.getpid() == pid:
        for path in list(paths):
            _unlink(path)
        paths.clear()


def held_results_limit(call_bytes: int) -> int | None:
    """The byte limit on held results for a call of ``call_bytes`` (``None``: no limit)."""
    raw = os.environ.get(HELD_RESULTS_ENV, "").strip()
    try:
        calls = float(raw) if raw else HELD_RESULTS_DEFAULT
    except ValueError:
        from .errors import InvalidInputError

        raise InvalidInputError(f"{HELD_RESULTS_ENV}={raw!r}: expected a number of calls (0 = no limit)") from None
    return int(calls * _align(call_bytes, SEGMENT_QUANTUM)) if calls > 0 else None


# -- the driver's view of a call's reply ----------------------------------------------------

#: plan id -> (the blocks [layer][seq], the call's state); filled before the call, taken by the reply
_PENDING: dict[int, "Call"] = {}
_pending_lock = threading.Lock()


class Call:
    """One call's blocks on the driver side, and what the worker reported about them."""

    def __init__(self, plan: Plan, blocks: list[list]) -> None:
        self.plan, self.blocks = plan, blocks
        self.rows: int | None = None  # rows the worker copied (None: no reply yet)
        self.finite: list[bool] | None = None  # per layer: no inf/nan in any row
        self.error: str | None = None

    def finite_blocks(self) -> dict[int, tuple]:
        """``{data_ptr: shape}`` of the blocks whose layer the worker found finite."""
        if not self.finite:
            return {}
        return {t.data_ptr(): tuple(t.shape) for layer, ok in zip(self.blocks, self.finite) if ok for t in layer}


#: the blocks of the last call the worker found finite (``{data_ptr: shape}``), for guard-output
_certified: dict[int, tuple] = {}


def certify(blocks: dict[int, tuple]) -> None:
    """Set the blocks the output guard need not scan for inf/nan (replaces the last call's)."""
    global _certified
    _certified = dict(blocks)


def take_certified() -> dict[int, tuple]:
    """The blocks of the call that just ended whose layer the worker found finite
    (``{data_ptr: shape}``); the certificate is used once."""
    global _certified
    out, _certified = _certified, {}
    return out


def register_call(call: Call) -> None:
    with _pending_lock:
        _PENDING[call.plan.id] = call


def forget_call(plan_id: int) -> None:
    with _pending_lock:
        _PENDING.pop(plan_id, None)


class LayerStates:
    """One layer of a call's reply, as the stock generator uses it: ``h[a:b].clone().cpu()``
    gives the block of the sequence whose rows are ``a:b`` (its own tensor, no copy)."""

    def __init__(self, call: Call, layer: int) -> None:
        self._call, self._layer = call, layer
        self._starts = list(itertools.accumulate([0] + call.plan.lengths[:-1]))
        self._cat = None

    def __len__(self) -> int:
        return self._call.plan.rows

    def __bool__(self) -> bool:
        # as the tensor it stands for: more than one value is ambiguous (a caller that takes
        # a layer for the list of layers fails here, as it does on a plain reply)
        return bool(self._whole())

    @property
    def shape(self):
        import torch

        return torch.Size([self._call.plan.rows, self._call.plan.hidden])

    def _whole(self):
        """The layer's rows concatenated (one copy, made once per layer)."""
        import torch

        if self._cat is None and self._call.blocks[self._layer]:
            self._cat = torch.cat(self._call.blocks[self._layer])
        return self._cat

    def __getitem__(self, key):
        call = self._call
        if call.error:
            from .errors import CaptureContractError

            raise CaptureContractError(call.error)
        if isinstance(key, slice) and key.step in (None, 1):
            start, stop = key.start or 0, key.stop
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start and stop == start + call.plan.lengths[i]:
                return _Block(call.blocks[self._layer][i])
        return self._whole()[key]

    def __getattr__(self, name):
        # anything else the caller does with a layer: on the concatenated rows (a copy)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._whole(), name)


class _Block:
    """A sequence's rows of one layer; ``clone()`` hands out the block tensor itself (it owns
    exactly its bytes), a second ``clone()`` a real copy."""

    __slots__ = ("_t", "_taken")

    def __init__(self, tensor) -> None:
        self._t, self._taken = tensor, False

    def clone(self, *args, **kwargs):
        if self._taken or args or kwargs:
            return self._t.clone(*args, **kwargs)
        self._taken = True
        return self._t

    def cpu(self, *args, **kwargs):
        return self._t

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._t, name)


def claim(plan_id: int, rows: int, finite: list[bool] | None, error: str | None = None) -> list:
    """Called by the driver's unpickler with a worker's :class:`Written` reply: the call's layers
    as the stock code expects them (a list, one :class:`LayerStates` per layer)."""
    with _pending_lock:
        call = _PENDING.get(plan_id)
    if call is None:
        # not this process's call (cannot happen for the generator's own reply)
        from .errors import CaptureContractError

        raise CaptureContractError(f"shm-transport: a reply for an unknown call {plan_id}")
    call.rows, call.finite = rows, finite
    if error is None and rows != call.plan.rows:
        error = f"the worker captured {rows} rows per layer for {call.plan.rows} input tokens"
    call.error = error
    return [LayerStates(call, j) for j in range(len(call.blocks))]


class Written:
    """A worker's reply when a plan was active: the rows are already in the driver's segment."""

    __slots__ = ("plan_id", "rows", "finite", "error")

    def __init__(self, plan_id: int, rows: int, finite, error=None) -> None:
        self.plan_id, self.rows, self.finite, self.error = plan_id, rows, finite, error

    def __reduce__(self):
        return claim, (self.plan_id, self.rows, self.finite, self.error)


# -- the worker's side ----------------------------------------------------------------------

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
        if any(s.dtype != _dtype(plan.dtype) for s in states):
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
    import math

    state = extension.__dict__.get(WORKER_STATE)
    entry = state.segments.get(segment) if state is not None else None
    if entry is None or offset < 0 or offset + math.prod(shape) * _itemsize(_dtype(dtype)) > entry[0].numel():
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
