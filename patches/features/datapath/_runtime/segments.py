"""Shared-memory files of the data path: typed views, the no-plan reply file, stale cleanup.

Without a call's layout (``results-in-place`` off), ``shm-transport``'s worker concatenates each
layer's parts into one new file under ``/dev/shm`` (:func:`write_states`) and replies with a
:class:`SharedStates` handle; unpickling the handle in the driver *maps* that file and returns
the same list of tensors the stock reply holds (no copy; the file is unlinked at once, its pages
live as long as the tensors do). Stock pickling through ``collective_rpc`` runs at well under
1 GB/s (measured on an H200 host: 0.34 GB/s for 1 GiB, 3.7 s of a 6.5 s call).

Every file here is named ``PREFIX-<driver pid>-<writer pid>-<n>``: a file whose driver is gone is
removed by the next run (:func:`remove_stale`). Nothing here imports torch at import time.
"""

from __future__ import annotations

import functools
import glob
import itertools
import logging
import math
import mmap
import os

from speculators_compat.patching import Option

__all__ = ["SharedStates", "open_states", "write_states", "folder", "PREFIX", "remove_stale", "typed_view"]

log = logging.getLogger("speculators_compat")

PREFIX = "speculators_compat-states"
#: free space to leave in the shared-memory folder (vLLM's own queues live there too)
MARGIN = 256 << 20
_counter = itertools.count()
SHM_DIR = Option("SPECULATORS_COMPAT_SHM_DIR",
                 "the shared-memory folder the captured states travel through (default ``/dev/shm``)")


def folder() -> str:
    """The shared-memory folder (``SPECULATORS_COMPAT_SHM_DIR``, default ``/dev/shm``)."""
    return SHM_DIR.raw() or "/dev/shm"


@functools.lru_cache(maxsize=None)
def dtype_of(name: str):
    import torch

    dtype = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"not a torch dtype: {name!r}")
    return dtype


def typed_view(buf, offset: int, dtype, shape):
    """The bytes of ``buf`` (a uint8 tensor) at ``offset`` as a tensor of ``dtype`` (a torch dtype
    or its name) and ``shape``, no copy."""
    dt = dtype_of(dtype) if isinstance(dtype, str) else dtype
    nbytes = math.prod(shape) * itemsize(dt)
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
        out.append(buf[offset:offset + size].view(dtype_of(dtype)).view(shape))
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
        offset = align(offset + size)
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
            view = buf[off:off + size].view(dtype_of(dtype)).view(shape)
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


#: per process: stale files of killed runs were looked for
_SWEPT: list = []


def remove_stale_once() -> None:
    """:func:`remove_stale`, the first time this process asks (the driver's pool, a worker's reply)."""
    if not _SWEPT:
        _SWEPT.append(True)
        remove_stale()


def align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def itemsize(dtype) -> int:
    return dtype.itemsize


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


#: per process: the shared-memory folder's lack of room was said (once)
_told: list = []


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def say_no_room(nbytes: int) -> bool:
    """Once per process, a warning that the shared-memory folder has no room for a call's
    ``nbytes`` of results (plus :data:`MARGIN`), which then travel pickled, as stock: its size,
    what the call needs and the fix (a container's ``--shm-size`` / ``--ipc=host``, or
    ``SPECULATORS_COMPAT_SHM_DIR``). True when it was said now."""
    if _told:
        return False
    _told.append(True)
    where = folder()
    try:
        stat = os.statvfs(where)
        has = f"{_size(stat.f_bavail * stat.f_frsize)} free of {_size(stat.f_blocks * stat.f_frsize)}"
    except OSError as exc:
        has = f"cannot be read ({exc.strerror or exc})"
    need = nbytes + MARGIN
    gib = max(1, -(-2 * need // (1 << 30)))  # room for a call being written and one being saved
    log.warning("shm-transport: the shared-memory folder %s has %s; a call's results need %s (%s of states "
                "and %s kept free): they travel pickled through vLLM's message queue instead, as in stock "
                "speculators -- the same rows, slower. For the fast path: in Docker `--shm-size=%dg` (or "
                "`--ipc=host`), in Kubernetes an emptyDir of medium Memory at /dev/shm, or "
                "SPECULATORS_COMPAT_SHM_DIR=DIR on a tmpfs with room. (Said once.)",
                where, has, _size(need), _size(nbytes), _size(MARGIN), gib)
    return True


def room(nbytes: int) -> bool:
    """Whether the shared-memory folder has ``nbytes`` free beyond :data:`MARGIN`."""
    try:
        stat = os.statvfs(folder())
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= nbytes + MARGIN


# -- the driver's segments (see the pool) ------------------------------------------------------


class Segment:
    """One shared-memory file of the driver, mapped."""

    __slots__ = ("id", "path", "size", "mm", "base", "live", "busy", "known", "spare", "__weakref__")

    def __init__(self, id, path, size, mm):
        import numpy as np

        self.id, self.path, self.size, self.mm = id, path, size, mm
        self.base = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data  # the mapping's address
        self.live = 0  # tensors handed out and not yet freed
        self.busy = False  # a call is writing into it
        self.known = False  # the workers have mapped it (and the file is unlinked)
        self.spare = False  # made ahead of need, no call took it yet

    @property
    def held(self) -> bool:
        return bool(self.live or self.busy)


def new_segment(seg_id: int, size: int, files: set, populate: bool = False) -> Segment | None:
    """A new segment file of ``size`` bytes, reserved and mapped (``populate``: its pages mapped
    in now, not at the caller's first touch); ``None`` without the room. Its path is in ``files``
    until the workers have mapped it."""
    where = folder()
    if not room(size):
        log.debug("shm-transport: %s lacks %d bytes for a segment", where, size)
        return None
    path = os.path.join(where, f"{PREFIX}-{os.getpid()}-{os.getpid()}-seg{seg_id}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    files.add(path)
    try:
        os.posix_fallocate(fd, 0, size)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        log.debug("shm-transport: cannot reserve %d bytes in %s (%s)", size, where, exc)
        unlink(path)
        files.discard(path)
        return None
    finally:
        os.close(fd)
    return Segment(seg_id, path, size, mm)


def unlink_files(paths: set, pid: int) -> None:
    """Unlink ``paths`` (segment files no worker mapped yet), in the process that made them only."""
    if os.getpid() == pid:
        for path in list(paths):
            unlink(path)
        paths.clear()
