"""Atomic file writes: a file under its final name is complete, or absent (stdlib only).

:func:`atomic_path` writes to a temporary file in the destination's folder
(``.<final name>.<random>.tmp``, created with the permissions a plain ``open()`` gives), fsyncs it
and renames it over the final name; :func:`atomic_file` does the same through an open file
descriptor (one writer, no second ``open()``). The output folder of ``speculators-compat run``
(:mod:`speculators_compat.run.resume`), its shared-memory record (:mod:`speculators_compat.services.leftovers`)
and the test matrix's validation records all write through it.

:func:`protect` registers a folder whose writes must be atomic even when the writer is not ours:
the ``atomic-save`` patch routes every ``torch.save`` / ``Path.write_text`` / ``Path.write_bytes``
whose destination :func:`protected` names through :func:`atomic_path` or :func:`atomic_file`.

:func:`atomic_path` / :func:`atomic_file` with ``defer=True`` (the ``atomic-save`` patch's
``torch.save`` into a protected folder, unless ``SPECULATORS_COMPAT_SAVE_SYNC=file``) returns once
the temporary file is written and its write-back started: one committer thread makes the files
handed to it durable a batch at a time
(on Linux 5.8 and later one ``syncfs`` of their local filesystem a batch, elsewhere an fsync a file) and
renames each over its final name only then (then fsyncs the folder), so a file is still never seen
under its final name incomplete. At most :data:`MAX_PENDING` files wait in its queue (with
those waiting for a :class:`Hold`, see below): a writer
handing over one more waits, so the temporary files hold at most that many files of the disk, plus
the batch being committed and one a writer.
:func:`flush` waits until every such file is renamed (a plain :func:`atomic_path`, the runner at the
end of a run and an ``atexit`` handler call it); a failed fsync or rename is recorded as below.

:func:`hold` makes a :class:`Hold`: the deferred files saved from the objects it names (found by
:func:`hold_of`) are renamed only once it is released, and removed if it is refused. The thread
that made it decides it (the ``self-check`` patch: its verdict on a call's rows, taken at the
next ``generate()``), at the latest when that thread next waits for the committer
(:func:`flush`, a full queue); an error it refused with that no caller was given is raised by
:func:`flush` and :func:`raise_refused` (the ``atomic-save`` patch: before ``data_config.json``).

A write into a protected folder that fails (a full disk, a permission) is remembered
(:func:`record_failure`): the stock script awaits its save futures only after its last batch, so the
``atomic-save`` patch calls :func:`raise_if_failed` at the start of every ``generate()`` and the run
stops at its next call with :class:`SaveFailedError` (an ``OSError`` with the original's ``errno``,
``strerror`` and file name; the original is its ``__cause__``).
"""

from __future__ import annotations

import atexit
import errno
import os
import random
import re
import threading
from contextlib import contextmanager
from pathlib import Path

from . import holds
from .holds import Hold, hold_of

__all__ = ["atomic_path", "atomic_file", "flush", "SYNC_ENV", "deferred_sync", "write_text", "is_temporary", "protect",
           "unprotect", "protected", "TEMP_RE", "SaveFailedError", "record_failure", "raise_if_failed", "clear_failures",
           "MAX_PENDING", "SYNCFS_FILESYSTEMS", "filesystem_type", "Hold", "hold", "hold_of", "settle", "raise_refused"]

#: the temporary files of :func:`atomic_path`: ``.<final name>.<random>.tmp``
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"
TEMP_RE = re.compile(r"^\.(?P<final>.+)\.[^.]+\.tmp$")

_protected: set[str] = set()
#: the temporary files' random parts (no system call: a saving thread does not wait for the GIL)
_names = random.Random()
_NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"
_guard = threading.Lock()
#: the first write into a protected folder that failed: (final path, the error)
_failed: list[tuple[Path, OSError]] = []

#: ``SPECULATORS_COMPAT_SAVE_SYNC=file``: every deferred write fsynced and renamed by its own writer
SYNC_ENV = "SPECULATORS_COMPAT_SAVE_SYNC"
#: errors of holds refused where no caller was given them (raised by :func:`flush`)
_refused: list[BaseException] = []
#: the committer's queue: (temporary path, final path, hold or None), and whether a batch is being committed
_pending: list[tuple[str, Path]] = []
_commit = threading.Condition(threading.Lock())
_committing: list[bool] = [False]
#: handed over, their hold not decided yet: committed in a later batch, once it is
_waiting: list[tuple[str, Path, Hold]] = []
_committer: list[threading.Thread] = []
#: files handed over and not yet renamed, at most (a writer handing over one more waits)
MAX_PENDING = 64
_SYNC_FILE_RANGE_WRITE = 2
_libc: list = []
_syncfs: list = []
#: filesystems whose ``syncfs`` writes every file's data and waits for it (local ones; on others,
#: e.g. FUSE and network filesystems, the committer fsyncs each file)
SYNCFS_FILESYSTEMS = frozenset({"ext4", "xfs", "btrfs", "f2fs", "overlay", "tmpfs"})
_filesystems: dict[str, str | None] = {}


class SaveFailedError(OSError):
    """A write into the run's output folder failed (raised at the next ``generate()``). An
    ``OSError`` with the failed write's ``errno``, ``strerror`` and ``filename`` (its final name);
    the original error is its ``__cause__``."""


def hold(objects, decide) -> Hold | None:
    """A :class:`~speculators_compat.services.holds.Hold` over ``objects`` (e.g. a call's result
    tensors): a deferred ``torch.save`` into a protected folder of an object holding one of them
    (:func:`hold_of`) is renamed once the hold is released, removed if it is refused. ``None``
    where no deferred write can wait for it (no protected folder,
    ``SPECULATORS_COMPAT_SAVE_SYNC=file``): the caller decides at once."""
    if not _protected or not deferred_sync():
        return None
    return holds.cover(objects, Hold(decide))


def settle() -> None:
    """Decide the holds this thread made (before it waits for the committer, which may wait for
    them; before a generator's executor stops): the errors of those refused are raised by :func:`flush`."""
    errors = holds.settle_own()
    if errors:
        with _guard:
            _refused.extend(errors)


def is_temporary(name: str) -> bool:
    """Whether a file name is one of :func:`atomic_path`'s temporary files."""
    return TEMP_RE.match(name) is not None


def deferred_sync() -> bool:
    """Whether ``defer=True`` writes go to the committer (``SPECULATORS_COMPAT_SAVE_SYNC``, read at
    each write: ``file`` turns it off)."""
    return os.environ.get(SYNC_ENV, "").strip().lower() != "file"


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to the disk without waiting (Linux ``sync_file_range``),
    so that the disk is kept busy while the committer waits for earlier files; nothing elsewhere."""
    if not _libc:
        import ctypes

        _libc.append(_libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]))
    if _libc[0] is not None:
        _libc[0](fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # an error here is found by the fsync


def _libc_function(name: str, argtypes: list):
    """``name`` from the C library (ctypes releases the GIL around the call), or ``None``."""
    import ctypes

    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


def _kernel_at_least(major: int, minor: int) -> bool:
    import platform

    parts = re.match(r"(\d+)\.(\d+)", platform.release()) if platform.system() == "Linux" else None
    return bool(parts) and (int(parts[1]), int(parts[2])) >= (major, minor)


def filesystem_type(folder: str | os.PathLike, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the filesystem holding ``folder`` (``ext4``, ``fuse.gcsfuse``, ...), read from
    ``mountinfo``; ``None`` where it cannot be read."""
    path = os.path.realpath(folder)
    best, kind = "", None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) < 5 or not rest:
                    continue
                mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, rest[0]
    except OSError:
        return None
    return kind


def _sync_filesystem(folder: Path) -> bool:
    """Write every dirty page of ``folder``'s filesystem to the disk and wait (Linux ``syncfs``):
    ``True`` once done. ``False`` where that cannot be relied on -- no ``syncfs``, a kernel before
    5.8 (its ``syncfs`` reports no write-back error), a filesystem not in
    :data:`SYNCFS_FILESYSTEMS`, an error -- and the caller fsyncs each file (which names the file
    that failed)."""
    if not _syncfs:
        import ctypes

        _syncfs.append(_libc_function("syncfs", [ctypes.c_int]) if _kernel_at_least(5, 8) else None)
    if _syncfs[0] is None:
        return False
    key = str(folder)
    if key not in _filesystems:
        _filesystems[key] = filesystem_type(folder)
    if _filesystems[key] not in SYNCFS_FILESYSTEMS:
        return False
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        return _syncfs[0](fd) == 0
    finally:
        os.close(fd)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temporary(final: Path) -> tuple[int, str]:
    """A new temporary file next to ``final``, open for writing: its descriptor and path. Created
    with the mode a plain ``open()`` gives (0o666 less the umask, default ACLs applied)."""
    for _ in range(100):
        random_part = "".join(_names.choices(_NAME_CHARS, k=8))
        tmp = os.path.join(final.parent, f"{TEMP_PREFIX}{final.name}.{random_part}{TEMP_SUFFIX}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(final))


def _unlink(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


@contextmanager
def _temporary(final: str | os.PathLike, defer: bool, held: Hold | None = None):
    """What :func:`atomic_path` and :func:`atomic_file` share: yield ``(fd, tmp)``, a new
    temporary file next to ``final`` and a descriptor open on it for writing, kept open across the
    body; once the body has written the file (through ``fd`` or through ``tmp``: the same file),
    it is fsynced through ``fd`` (``defer``: its write-back started, the committer does the rest),
    ``fd`` is closed, and the file is renamed over ``final``. On an error the temporary file is
    removed and ``final`` is untouched. ``held``: see :func:`hold`."""
    final = Path(final)
    defer = defer and deferred_sync()
    if not defer:
        flush(raise_failed=False)  # e.g. data_config.json: after every sample before it
    fd, tmp = _create_temporary(final)
    try:
        try:
            yield fd, tmp
            if defer:
                _start_writeback(fd)
            else:
                os.fsync(fd)
        finally:
            os.close(fd)
        _finish(tmp, final, defer, held)
    except BaseException:
        _unlink(tmp)
        raise


@contextmanager
def atomic_path(final: str | os.PathLike, defer: bool = False, held: Hold | None = None):
    """Yield a temporary path next to ``final`` (a new empty file with the permissions a plain
    ``open()`` gives); once the body has written it, it is fsynced and renamed over ``final``. On
    an error the temporary file is removed and ``final`` is untouched. The body writes the file
    in place (it must not replace it by another: the sync is on the file created here).

    ``defer``: (unless :func:`deferred_sync` says no) return once the file's write-back has
    started; the committer thread fsyncs and renames it (a failure is recorded with
    :func:`record_failure`). A write without ``defer`` first waits for the files handed over.
    ``held``: the file is renamed once that :class:`Hold` is released (removed if refused)."""
    with _temporary(final, defer, held) as (_fd, tmp):
        yield tmp


@contextmanager
def atomic_file(final: str | os.PathLike, defer: bool = False, held: Hold | None = None):
    """:func:`atomic_path` for a writer that takes a file descriptor: yield one open for writing
    (at offset 0) on a new temporary file next to ``final``; once the body has written it, it is
    fsynced (``defer``: its write-back started, the committer does the rest) and renamed over
    ``final``. The descriptor is closed here; on an error the temporary file is removed. Three
    system calls a file besides the body's (create, start the write-back, close), then the
    committer's rename. ``held``: as for :func:`atomic_path`."""
    with _temporary(final, defer, held) as (fd, _tmp):
        yield fd


def _finish(tmp: str, final: Path, defer: bool, held: Hold | None = None) -> None:
    """A written temporary file: to the committer (``defer``), or renamed over its final name
    (once ``held`` is released)."""
    if defer:
        _hand_over(tmp, final, held)
        return
    error = held.wait() if held is not None else None
    if error is not None:
        raise error
    os.replace(tmp, final)


def _hand_over(tmp: str, final: Path, held: Hold | None = None) -> None:
    with _commit:
        full = len(_pending) + len(_waiting) >= MAX_PENDING
    if full:
        settle()  # the room may be taken by files waiting for this thread's decision
    with _commit:
        while len(_pending) + len(_waiting) >= MAX_PENDING and _committer and _committer[0].is_alive():
            _commit.wait(1.0)  # the committer takes the whole queue at the start of each batch
        _pending.append((tmp, final, held))
        if not _committer or not _committer[0].is_alive():
            _committer[:] = [threading.Thread(target=_commit_loop, name="speculators-compat-commit", daemon=True)]
            _committer[0].start()
        _commit.notify_all()


def _commit_loop() -> None:
    """Commit what was handed over, a batch at a time: sync their filesystem (or fsync each file),
    rename the ones on the disk, fsync their folders."""
    while True:
        with _commit:
            while not _pending and not any(held.decided for _, _, held in _waiting):
                _commit.wait()
            handed = [f for f in _waiting if f[2].decided] + _pending
            _waiting[:] = [f for f in _waiting if not f[2].decided]
            _pending.clear()
            batch = [f for f in handed if f[2] is None or f[2].decided]
            _waiting.extend(f for f in handed if not (f[2] is None or f[2].decided))
            _committing[0] = True
            _commit.notify_all()  # writers waiting for room
        try:
            _commit_batch(batch)
        except Exception as error:  # a bug, not the disk: the batch's samples failed, the run stops
            for _, final, _ in batch:
                record_failure(final, OSError(errno.EIO, f"the commit of the saved samples failed: {error!r}"))
        finally:
            with _commit:
                _committing[0] = False
                _commit.notify_all()


def _commit_batch(batch: list[tuple[str, Path, Hold | None]]) -> None:
    refused = [tmp for tmp, _, held in batch if held is not None and held.error is not None]
    for tmp in refused:
        _unlink(tmp)  # its error is the maker's to report
    batch = [f for f in batch if f[0] not in refused]
    synced = {folder for folder in {final.parent for _, final, _ in batch} if _sync_filesystem(folder)}
    folders = set()
    for tmp, final, _ in batch:
        try:
            if final.parent not in synced:
                _fsync_path(tmp)
            os.replace(tmp, final)
            folders.add(final.parent)
        except OSError as error:
            _unlink(tmp)
            record_failure(final, error)
    for folder in folders:
        try:
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass  # a folder that cannot be fsynced (some filesystems): the files are


def flush(raise_failed: bool = True) -> None:
    """Wait until every file handed to the committer is on the disk and renamed (or failed, or
    refused: the holds this thread made are decided first); ``raise_failed``: then raise
    :class:`SaveFailedError` if a write into a protected folder failed, or a hold's error."""
    settle()
    with _commit:
        while _pending or _committing[0] or _waiting:
            if not _committer or not _committer[0].is_alive():
                break  # no committer (a fork): nothing will move
            _commit.wait(1.0)
    if raise_failed:
        raise_if_failed()
        raise_refused()


def raise_refused() -> None:
    """Raise the first error a hold was refused with where no caller was given it (see :func:`settle`)."""
    with _guard:
        error = _refused[0] if _refused else None
    if error is not None:
        raise error


def _wake() -> None:
    with _commit:
        _commit.notify_all()


holds.on_decided(_wake)  # a decided hold lets its waiting files be committed
atexit.register(flush, False)


def write_text(final: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``final`` atomically."""
    with atomic_path(final) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def protect(folder: str | os.PathLike) -> None:
    """Make every ``torch.save``/``Path.write_text``/``Path.write_bytes`` into ``folder``
    atomic (through the ``atomic-save`` patch)."""
    with _guard:
        _protected.add(os.path.realpath(folder))


def unprotect(folder: str | os.PathLike | None = None) -> None:
    with _guard:
        if folder is None:
            _protected.clear()
        else:
            _protected.discard(os.path.realpath(folder))


def protected(target) -> Path | None:
    """The final path if ``target`` (a ``str`` or path-like) names a file directly inside a
    protected folder, and is not itself a temporary file; else ``None``."""
    if not _protected or not isinstance(target, (str, os.PathLike)):
        return None
    try:
        path = Path(os.fspath(target))
    except TypeError:
        return None
    if is_temporary(path.name):
        return None
    if os.path.realpath(path.parent) not in _protected:
        return None
    return path


def record_failure(final: str | os.PathLike, error: OSError) -> None:
    """Remember that the write of ``final`` into a protected folder failed with ``error`` (the
    first failure is kept; the writer re-raises it as before)."""
    with _guard:
        if not _failed:
            _failed.append((Path(final), error))


def raise_if_failed() -> None:
    """Raise :class:`SaveFailedError` if a write into a protected folder has failed; the failure
    stays recorded, so every later call raises it too."""
    with _guard:
        if not _failed:
            return
        final, error = _failed[0]
    message = (f"saving {final.name} into {final.parent} failed: {error.strerror or error}; "
               "stopping before the next batch (the samples already saved are complete)")
    raise SaveFailedError(error.errno, message, str(final)) from error


def clear_failures() -> None:
    """Forget recorded failures and refusals (a new run in the same process, tests)."""
    with _guard:
        _failed.clear()
        _refused.clear()
