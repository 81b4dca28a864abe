"""Atomic file writes: a file under its final name is complete, or absent (stdlib only).

:func:`atomic_path` writes to a temporary file in the destination's folder
(``.<final name>.<random>.tmp``), fsyncs it, gives it the permissions a plain ``open()`` would
have given it and renames it over the final name. The output folder of ``speculators-compat run``
(:mod:`speculators_compat.run.resume`), its shared-memory record (:mod:`speculators_compat.services.leftovers`)
and the test matrix's validation records all write through it.

:func:`protect` registers a folder whose writes must be atomic even when the writer is not ours:
the ``atomic-save`` patch routes every ``torch.save`` / ``Path.write_text`` / ``Path.write_bytes``
whose destination :func:`protected` names through :func:`atomic_path`.

A write into a protected folder that fails (a full disk, a permission) is remembered
(:func:`record_failure`): the stock script awaits its save futures only after its last batch, so the
``atomic-save`` patch calls :func:`raise_if_failed` at the start of every ``generate()`` and the run
stops at its next call with :class:`SaveFailedError` (an ``OSError`` with the original's ``errno``,
``strerror`` and file name; the original is its ``__cause__``).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "write_text", "is_temporary", "protect", "unprotect", "protected", "TEMP_RE",
           "SaveFailedError", "record_failure", "raise_if_failed", "clear_failures"]

#: the temporary files of :func:`atomic_path`: ``.<final name>.<random>.tmp``
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"
TEMP_RE = re.compile(r"^\.(?P<final>.+)\.[^.]+\.tmp$")

_protected: set[str] = set()
_umask: list[int] = []
_guard = threading.Lock()
#: the first write into a protected folder that failed: (final path, the error)
_failed: list[tuple[Path, OSError]] = []


class SaveFailedError(OSError):
    """A write into the run's output folder failed (raised at the next ``generate()``). An
    ``OSError`` with the failed write's ``errno``, ``strerror`` and ``filename`` (its final name);
    the original error is its ``__cause__``."""


def is_temporary(name: str) -> bool:
    """Whether a file name is one of :func:`atomic_path`'s temporary files."""
    return TEMP_RE.match(name) is not None


def _remember_umask() -> None:
    """Read the process umask once (``os.umask`` can only be read by setting it): from the thread
    that protects a folder, never from the threads that save into it."""
    with _guard:
        if not _umask:
            current = os.umask(0o022)
            os.umask(current)
            _umask.append(current)


@contextmanager
def atomic_path(final: str | os.PathLike):
    """Yield a temporary path next to ``final``; once the body has written it, it is fsynced,
    given the permissions a plain ``open()`` would have, and renamed over ``final``. On an
    error the temporary file is removed and ``final`` is untouched."""
    final = Path(final)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{final.name}.", suffix=TEMP_SUFFIX, dir=final.parent)
    os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o666 & ~(_umask[0] if _umask else 0o022))
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text(final: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``final`` atomically."""
    with atomic_path(final) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def protect(folder: str | os.PathLike) -> None:
    """Make every ``torch.save``/``Path.write_text``/``Path.write_bytes`` into ``folder``
    atomic (through the ``atomic-save`` patch)."""
    _remember_umask()
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
    """Forget recorded failures (a new run in the same process, tests)."""
    with _guard:
        _failed.clear()
