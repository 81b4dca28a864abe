"""A full disk, said as the cause and the cure: the runner's last line when a run ends for lack of space.

A run whose output folder fills up ends in whatever the failed write raised: ``OSError: [Errno 28]
No space left on device`` from a plain write, or -- from ``torch.save`` -- ``RuntimeError: [enforce
fail at inline_container.cc] . unexpected pos N vs M`` (PyTorch's zip writer, whose ``ENOSPC`` only
shows in an earlier warning). :func:`diagnose` recognises both (the ``OSError`` in the exception,
its cause or context chain, or its text; torch's error when a ``No space left`` warning was logged
by the library or the output folder's device has under :data:`LOW` free) and returns the line the
runner prints last: which device is full (the output folder's, the shared memory ``/dev/shm`` or
``SPECULATORS_COMPAT_SHM_DIR`` the states travel through, or the scratch folder), how much is
free, how many samples are complete, and that the same command resumes at ``data_N.pt``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile

__all__ = ["diagnose", "Watcher", "LOW"]

#: under this many bytes free, torch's write failure on the output folder's device is a full disk
LOW = 64 << 20
#: errnos of a full device (``EDQUOT``: a quota)
FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
NO_SPACE = ("No space left on device", "Disk quota exceeded", f"[Errno {errno.ENOSPC}]")
#: torch's zip writer, when a write came up short
TORCH_WRITE = ("unexpected pos", "PytorchStreamWriter failed writing", "file write failed")
_PATH = re.compile(r"'(/[^']+)'")


class Watcher(logging.Handler):
    """Notes a ``No space left on device`` in a warning of the library's loggers (its path, if named)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str | None] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except (TypeError, ValueError):
            return
        if record.exc_info and record.exc_info[1] is not None:
            text += f" {record.exc_info[1]}"
        if any(s in text for s in NO_SPACE):
            found = _PATH.search(text)
            self.seen.append(found.group(1) if found else None)


_watcher = Watcher()


def watch() -> Watcher:
    """Start noting the library's full-disk warnings (idempotent). Only on the ``speculators_compat``
    logger: a handler on the root logger would make the script's ``logging.basicConfig`` a no-op."""
    logger = logging.getLogger("speculators_compat")
    if _watcher not in logger.handlers:
        logger.addHandler(_watcher)
    return _watcher


def unwatch() -> None:
    logging.getLogger("speculators_compat").removeHandler(_watcher)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _full_error(exc: BaseException) -> tuple[bool, str | None]:
    """(the chain holds a full-device error, its path if named)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in FULL:
            return True, (os.fspath(e.filename) if isinstance(e.filename, (str, os.PathLike)) else None)
        text = str(e)
        if any(s in text for s in NO_SPACE):
            found = _PATH.search(text)
            return True, found.group(1) if found else None
    return False, None


def _torch_write_failure(exc: BaseException) -> bool:
    return any(isinstance(e, RuntimeError) and any(s in str(e) for s in TORCH_WRITE) for e in _chain(exc))


def _existing(path: str) -> str | None:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        up = os.path.dirname(path)
        if up == path:
            return None
        path = up
    return path


def _mount(path: str) -> str:
    path = os.path.realpath(path)
    dev = os.stat(path).st_dev
    while True:
        up = os.path.dirname(path)
        if up == path or os.stat(up).st_dev != dev:
            return path
        path = up


def _free(path: str) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _candidates(folder: str | None) -> list[tuple[str, str, str]]:
    """(path, what it is, the cure's hint) for each place a run writes to."""
    out = []
    if folder:
        out.append((folder, f"the output folder {os.path.abspath(folder)}", ""))
    # the shm-transport's folder (its option, read here as the patch reads it)
    shm = os.environ.get("SPECULATORS_COMPAT_SHM_DIR", "").strip() or "/dev/shm"
    out.append((shm, f"the shared memory {shm} the captured states travel through",
                " (in a container: --shm-size, or --ipc=host; or SPECULATORS_COMPAT_SHM_DIR=DIR on a roomier tmpfs)"))
    tmp = tempfile.gettempdir()
    out.append((tmp, f"the scratch folder {tmp}", " (or TMPDIR=DIR elsewhere)"))
    return out


def _progress(folder: str | None, sharded: bool) -> str:
    if not folder or sharded or not os.path.isdir(folder):
        return "Free space there and run the same command: it resumes where it stopped."
    from . import resume

    try:
        plan = resume.scan(folder)
    except OSError:
        return "Free space there and run the same command: it resumes where it stopped."
    n = plan.resume_at
    done = (f"{n} sample{'s' if n != 1 else ''} {'are' if n != 1 else 'is'} complete"
            + (f" (data_0.pt - data_{n - 1}.pt)" if n > 1 else " (data_0.pt)" if n == 1 else ""))
    return f"{done}. Free space there and run the same command: it resumes at data_{n}.pt."


def diagnose(exc: BaseException, folder: str | None = None, sharded: bool = False,
             watcher: Watcher | None = None) -> str | None:
    """The runner's last line for a run that ``exc`` ended for lack of space (``None``: not that)."""
    watcher = _watcher if watcher is None else watcher
    full, path = _full_error(exc)
    if not full and _torch_write_failure(exc):
        if watcher.seen:
            full, path = True, next((p for p in reversed(watcher.seen) if p), None)
        elif folder and _existing(folder) and _free(_existing(folder))[0] < LOW:
            full, path = True, folder
    if not full:
        return None
    places = [(p, what, hint) for p, what, hint in _candidates(folder) if _existing(p)]
    if not places:
        return "no space left on the device: free space and run the same command."
    chosen = None
    if path and _existing(path):
        dev = os.stat(_existing(path)).st_dev
        chosen = next((c for c in places if os.stat(_existing(c[0])).st_dev == dev), None)
        if chosen is None:
            chosen = (path, f"{path}", "")
    if chosen is None:  # no path named: the fullest of the places the run writes to
        chosen = min(places, key=lambda c: _free(_existing(c[0]))[0])
    where, what, hint = chosen
    existing = _existing(where)
    free, total = _free(existing)
    mount = _mount(existing)
    return (f"no space left on the device holding {what} (mounted at {mount}: {size(free)} free of "
            f"{size(total)}){hint}. {_progress(folder, sharded)}")
