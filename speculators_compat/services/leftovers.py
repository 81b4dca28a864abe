"""Shared-memory segments a killed run leaves in /dev/shm, removed by the next run.

vLLM's ``MultiprocExecutor`` talks to its workers through ring buffers in POSIX shared memory
(``multiprocessing.shared_memory``, ``/dev/shm/psm_<hex>``): one the driver broadcasts on,
one per worker for its replies, and the workers' own group buffers. A clean shutdown (or
Python's resource tracker, when the driver exits) unlinks them; a SIGKILL of the whole job
kills the tracker too, and the segments stay in /dev/shm -- that is, in RAM -- until someone
removes them (measured on vLLM 0.16, TP=1: two segments, 240 MB and 160 MB virtual, 36 MB
resident for the broadcast buffer).

While ``speculators-compat run`` runs the stock data-generation script, :class:`Recorder`
notes every ``psm_*`` segment mapped by the runner's process or its descendants (read from
``/proc/<pid>/maps`` every half second) in ``<output-dir>/.speculators-compat-shm`` (a name
the trainer ignores). The runner removes the file when it ends in any way it can see; a file
found at the start of the next run therefore lists what a killed run left, and
:func:`clean` unlinks those segments that still exist. The names are random and created
with ``O_EXCL``, so an existing one can only be the killed run's; unlinking a segment a
straggler still maps is harmless to it (the mapping stays valid).
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

from . import atomic

__all__ = ["RECORD", "Recorder", "clean", "mapped", "descendants", "unlink_untracked", "ANY"]

RECORD = ".speculators-compat-shm"
_NAME = re.compile(r"/dev/shm/(psm_[0-9a-f]+)$")
#: any /dev/shm segment (vLLM's CPU builds also name their own: ``vllm_dist_<id>-...-cpushm_<rank>``)
ANY = re.compile(r"/dev/shm/([^/]+)$")


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (from ``/proc/<pid>/task/*/children``)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in out:
                    out.append(kid)
                    todo.append(kid)
    return out


def mapped(pids, pattern: re.Pattern = _NAME) -> set[str]:
    """The ``psm_*`` shared-memory names the processes map (not yet unlinked); with
    ``pattern=ANY``, every /dev/shm name they map."""
    names: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    line = line.rstrip("\n")
                    match = pattern.search(line)
                    if match and not line.endswith("(deleted)"):
                        names.add(match.group(1))
        except OSError:
            continue
    return names


def unlink_untracked(names) -> list[str]:
    """Unlink the named /dev/shm segments that still exist, except ``psm_*`` ones (Python's
    ``multiprocessing.shared_memory``: their owners or the resource tracker unlink them).
    For the segments the workers of a stopped executor created themselves (vLLM's CPU
    communicator), which a worker stopped by SIGTERM/SIGKILL never unlinks."""
    removed = []
    for name in sorted(names):
        if name.startswith("psm_") or "/" in name or name in (".", ".."):
            continue
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            continue
        removed.append(name)
    return removed


class Recorder:
    """Keeps ``<folder>/.speculators-compat-shm`` listing the segments this run maps (a shard of a
    sharded run keeps its own record, ``record``: the shards run at once)."""

    def __init__(self, folder: str | os.PathLike, interval: float = 0.5, record: str = RECORD) -> None:
        self.path = Path(folder) / record
        self.interval = interval
        self.names: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="speculators-compat-shm-record")

    def start(self) -> "Recorder":
        self._thread.start()
        return self

    def poll(self) -> None:
        me = os.getpid()
        found = mapped([me, *descendants(me)])
        if found - self.names:
            self.names |= found
            atomic.write_text(self.path, json.dumps(sorted(self.names)))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except OSError:
                continue  # the folder went away, /proc raced: try again next time

    def stop(self) -> None:
        """The run ended in a way this process saw: its segments are unlinked by their owners
        (or by the resource tracker when this process exits)."""
        self._stop.set()
        self._thread.join(timeout=2)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def clean(folder: str | os.PathLike, record: str = RECORD) -> list[str]:
    """Unlink the segments a killed run recorded in ``folder`` (in ``record``); returns their names."""
    path = Path(folder) / record
    try:
        names = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, ValueError):
        names = []
    removed = []
    for name in names if isinstance(names, list) else []:
        if not isinstance(name, str) or not re.fullmatch(r"psm_[0-9a-f]+", name):
            continue
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            continue
        except OSError:
            continue
        removed.append(name)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    return removed
