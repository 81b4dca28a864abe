"""Watching a run of tests/gpu/multi.py: its processes (across the sessions it starts), the /dev/shm
segments they map, and the GPUs through nvidia-smi (no CUDA context in the watching process).
Standard library only."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SHM_PREFIX = "speculators_compat-"  # transport.PREFIX is "speculators_compat-states"


# -- processes, sessions, shared memory ---------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, sid) of a live process, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[3])


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def tree(root: int, sessions: set[int]) -> list[int]:
    """Live processes descending from ``root`` or in one of ``sessions`` (the shards start their
    own sessions; vLLM's engine core and workers stay in their runner's)."""
    info = {p: s for p in all_pids() if (s := _stat(p)) is not None}
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in info.items():
        kids.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in found or pid not in info:
            continue
        found.add(pid)
        todo += kids.get(pid, [])
    found |= {p for p, (_, sid) in info.items() if sid in sessions}
    return sorted(found)


def shm_names(pids) -> set[str]:
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for m in re.finditer(r"/dev/shm/(\S+)(?: \(deleted\))?$", maps, re.M):
            if not m.group(0).endswith("(deleted)"):
                names.add(m.group(1))
    return names


def shm_ours_since(t0: float) -> list[str]:
    """``speculators_compat-*`` files in /dev/shm modified since ``t0``."""
    out = []
    for path in glob.glob(f"/dev/shm/{SHM_PREFIX}*"):
        try:
            if os.stat(path).st_mtime >= t0 - 1:
                out.append(os.path.basename(path))
        except OSError:
            continue
    return sorted(out)


# -- GPUs (nvidia-smi only: no CUDA context in this process) -----------------------------------


def _smi(*query: str) -> list[list[str]] | None:
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def gpu_memory() -> dict[str, int] | None:
    """memory.used (MiB) per GPU index; None without nvidia-smi."""
    rows = _smi("--query-gpu=index,memory.used")
    return None if rows is None else {r[0]: int(r[1]) for r in rows}


def gpu_apps() -> list[dict] | None:
    """Compute processes: pid, GPU index, MiB."""
    gpus = _smi("--query-gpu=index,uuid")
    apps = _smi("--query-compute-apps=pid,gpu_uuid,used_memory")
    if gpus is None or apps is None:
        return None
    index = {uuid: idx for idx, uuid in gpus}
    out = []
    for row in apps:
        if len(row) >= 3 and row[0].isdigit():
            out.append({"pid": int(row[0]), "gpu": index.get(row[1], row[1]),
                        "mib": int(row[2]) if row[2].isdigit() else row[2]})
    return out


def visible_gpus() -> list[str]:
    from speculators_compat.run import parallel

    return parallel.visible_gpus()


# -- a watched run ------------------------------------------------------------------------------


#: every Run started, for :func:`stop_all` (each runs in its own session: a `timeout` or a device
#: call's end would not reach it)
RUNS: list = []


def stop_all(signum=None, frame=None):
    """SIGTERM / SIGINT of this script: SIGKILL every run's sessions, then exit."""
    for run in RUNS:
        run.kill_all()
    if signum is not None:
        sys.exit(128 + signum)


class Logged:
    """A process (``proc``) whose output goes to the file ``log`` (open) at ``log_path``, read back
    while it runs."""

    log_path: Path

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if re.search(pattern, self.text()):
                return True
            time.sleep(0.1)
        return bool(re.search(pattern, self.text()))


class Run(Logged):
    """A command in its own session; samples its process tree (and the sessions in it), the
    /dev/shm names they map and, on CUDA, which GPU each session's processes hold."""

    def __init__(self, cmd, env, cwd, log: Path, gpu: bool):
        RUNS.append(self)
        self.log_path = log
        self.log = open(log, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.sessions: set[int] = {self.proc.pid}
        self.pids: set[int] = set()
        self.shm: set[str] = set()
        self.shm_first: dict[str, float] = {}
        self.gpu_of_session: dict[int, set[str]] = {}
        self.gpu_peak: dict[str, int] = {}
        self._gpu = gpu
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        n = 0
        while not self._stop.is_set():
            live = tree(self.proc.pid, self.sessions)
            for pid in live:
                st = _stat(pid)
                if st:
                    self.sessions.add(st[1])
            self.pids.update(live)
            for name in shm_names(live) - self.shm:
                self.shm.add(name)
                self.shm_first[name] = time.monotonic()
            if self._gpu and n % 5 == 0:  # every second
                sid_of = {p: (_stat(p) or (0, 0))[1] for p in live}
                for app in gpu_apps() or []:
                    if app["pid"] in sid_of:
                        self.gpu_of_session.setdefault(sid_of[app["pid"]], set()).add(app["gpu"])
                for idx, used in (gpu_memory() or {}).items():
                    self.gpu_peak[idx] = max(self.gpu_peak.get(idx, 0), used)
            n += 1
            self._stop.wait(0.2)

    def finish(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            rc = self.proc.wait()
            self.log.write(f"\n[multi.py] killed after {timeout} s\n")
        self.seconds = round(time.monotonic() - self.t0, 1)
        self._stop.set()
        self._thread.join()
        self.log.close()
        return rc

    def alive(self) -> list[int]:
        return tree(self.proc.pid, self.sessions) if self.proc.poll() is None else \
            [p for p in all_pids() if (st := _stat(p)) and st[1] in self.sessions]

    def kill_all(self) -> None:
        for sid in list(self.sessions):
            try:
                os.killpg(sid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def leftovers(self, grace: float = 10.0) -> dict:
        """Processes of the run still alive after ``grace`` s, and the /dev/shm names it mapped
        that still exist."""
        end = time.monotonic() + grace
        while self.alive() and time.monotonic() < end:
            time.sleep(0.2)
        procs = [f"{p} {cmdline(p)}" for p in self.alive()]
        shm = sorted(n for n in self.shm if os.path.exists(f"/dev/shm/{n}"))
        # seen: what the run had (the checks above are over these)
        return {"processes": procs, "shm": shm, "processes_seen": len(self.pids), "shm_seen": len(self.shm)}
