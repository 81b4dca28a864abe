"""``speculators-compat run --data-parallel K SCRIPT [ARGS...]``: K shards of one run on one node.

The visible GPUs (``CUDA_VISIBLE_DEVICES``, else what ``nvidia-smi`` lists) are split into K
groups of the run's tensor-parallel size (``--tensor-parallel-size`` among the script's
arguments; without it, an equal share each), and K runners are started, each
``speculators-compat run --shard J/K SCRIPT [ARGS...]`` with ``CUDA_VISIBLE_DEVICES`` set to its
group (no GPU is assigned where none is visible: K processes on the CPU). Launched as shard I of N
itself (``--shard``, ``RANK``, ``SLURM_PROCID``), the K runners are shards ``I*K .. I*K+K-1`` of
``N*K``: one process per node under Slurm or torchrun, K GPU groups in each.

Each runner is its own process group; its output lines are prefixed ``[shard J/K]``. Ctrl-C
(SIGINT) or SIGTERM is passed on to every group, as a terminal passes Ctrl-C to a run's processes:
each shard stops as a single run does (pending saves finish, its vLLM workers are shut down). A
shard that ends with an error stops the others (SIGTERM; SIGKILL after
:data:`STOP_GRACE` seconds, or at a second Ctrl-C). The last line names every shard that did not
finish with its exit code; the exit code is the failed shard's (130 / 143 after Ctrl-C / SIGTERM).
The runners die with this process (``PR_SET_PDEATHSIG``). Every shard resumes on its own: the
same command again continues the run.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from . import shards

__all__ = ["visible_gpus", "tensor_parallel_size", "gpu_groups", "narrow_to_local_rank", "main"]

#: seconds a stopped shard gets to finish its saves and shut its workers down before SIGKILL
STOP_GRACE = 120.0
_SIGNAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


def _log() -> logging.Logger:
    return logging.getLogger("speculators_compat.run")


def visible_gpus(env=None) -> list[str]:
    """The CUDA devices this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else the indices
    ``nvidia-smi`` lists; ``[]`` without any (a CPU machine)."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        devices = [d.strip() for d in listed.split(",") if d.strip()]
        return [] if devices[:1] == ["-1"] else devices
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def tensor_parallel_size(argv: list[str]) -> int | None:
    """``--tensor-parallel-size`` among the script's arguments (the last one, as argparse reads it)."""
    found = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name != "--tensor-parallel-size":
            continue
        value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        found = int(value) if value.strip().isdigit() else found
    return found


def gpu_groups(gpus: list[str], k: int, tp: int | None) -> list[list[str]]:
    """K disjoint groups of ``tp`` GPUs (``tp=None``: ``len(gpus) // k`` each), in order."""
    size = tp if tp else len(gpus) // k
    if size < 1 or size * k > len(gpus):
        raise shards.ShardError(
            f"{k} shards of {size or 1} GPU(s) each need {k * max(size, 1)} GPUs; {len(gpus)} visible "
            f"({','.join(gpus) or 'none'}). Lower --data-parallel or --tensor-parallel-size."
        )
    return [gpus[j * size:(j + 1) * size] for j in range(k)]


def narrow_to_local_rank(env=None) -> str | None:
    """Under a launcher that starts several processes per node on the same GPUs (torchrun's
    ``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``), give this process its share of them, as
    ``--data-parallel`` gives each of its shards: returns the ``CUDA_VISIBLE_DEVICES`` it set."""
    env = os.environ if env is None else env
    local, count = env.get("LOCAL_RANK", ""), env.get("LOCAL_WORLD_SIZE", "")
    if not (local.isdigit() and count.isdigit()) or int(count) < 2:
        return None
    gpus = visible_gpus(env)
    if not gpus:
        return None
    group = gpu_groups(gpus, int(count), None)[int(local)]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(group)
    return env["CUDA_VISIBLE_DEVICES"]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Prefixer(threading.Thread):
    """Copies one pipe of a shard to ours, each line (``\\n`` or a progress bar's ``\\r``) prefixed."""

    def __init__(self, pipe, out, prefix: bytes, lock: threading.Lock) -> None:
        super().__init__(daemon=True)
        self.pipe, self.out, self.prefix, self.lock = pipe, out, prefix, lock

    def run(self) -> None:
        fd = self.pipe.fileno()
        at_start = True
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            parts = []
            for piece in chunk.splitlines(keepends=True):
                parts.append((self.prefix if at_start else b"") + piece)
                at_start = piece.endswith((b"\n", b"\r"))
            with self.lock:
                try:
                    self.out.write(b"".join(parts))
                    self.out.flush()
                except (OSError, ValueError):
                    pass
        self.pipe.close()


class _Shard:
    def __init__(self, shard: shards.Shard, gpus: list[str] | None) -> None:
        self.shard = shard
        self.gpus = gpus
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None

    @property
    def name(self) -> str:
        where = f", CUDA_VISIBLE_DEVICES={','.join(self.gpus)}" if self.gpus else ""
        return f"shard {self.shard.label} (pid {self.proc.pid if self.proc else '-'}{where})"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.code is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _ending(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def main(k: int, base: shards.Shard | None, argv: list[str]) -> int:
    """Run ``argv`` (``SCRIPT [ARGS...]``) as ``k`` shards; returns the exit code."""
    base = base or shards.Shard(0, 1, "one node")
    plan = shards.split(base, k)
    gpus = visible_gpus()
    groups = gpu_groups(gpus, k, tensor_parallel_size(argv)) if gpus else [None] * k
    children = [_Shard(s, g) for s, g in zip(plan, groups)]
    where = "on the CPU (no GPU visible)" if not gpus else "on GPUs " + "; ".join(",".join(g) for g in groups)
    _log().info("data parallel: %d shards (%s of %d), %s", k, ", ".join(s.label for s in plan), plan[0].count, where)
    stopping: dict[str, object] = {"signal": None, "failed": None, "since": None, "killed": False}

    def on_signal(signum, frame):
        if stopping["signal"] is not None or stopping["failed"] is not None:
            for child in children:  # a second Ctrl-C: no more waiting
                child.signal(signal.SIGKILL)
            stopping["killed"] = True
            return
        stopping["signal"], stopping["since"] = signum, time.monotonic()
        for child in children:
            child.signal(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    lock_out, lock_err = threading.Lock(), threading.Lock()
    readers: list[threading.Thread] = []
    try:
        for child in children:
            if stopping["signal"] is not None:  # interrupted while starting: start no more
                child.code = 128 + int(stopping["signal"])
                continue
            env = dict(os.environ)
            if child.gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(child.gpus)
            cmd = [sys.executable, "-m", "speculators_compat.run", "--shard", child.shard.label, *argv]
            child.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          start_new_session=True, preexec_fn=_die_with_parent)
        for child in (c for c in children if c.proc is not None):
            prefix = f"[shard {child.shard.label}] ".encode()
            readers += [_Prefixer(child.proc.stdout, sys.stdout.buffer, prefix, lock_out),
                        _Prefixer(child.proc.stderr, sys.stderr.buffer, prefix, lock_err)]
        for reader in readers:
            reader.start()
        while any(child.code is None for child in children):
            for child in children:
                if child.code is None and (code := child.proc.poll()) is not None:
                    child.code = code
                    if code != 0 and stopping["failed"] is None and stopping["signal"] is None:
                        stopping["failed"], stopping["since"] = child, time.monotonic()
                        for other in children:
                            other.signal(signal.SIGTERM)
            since = stopping["since"]
            if since is not None and not stopping["killed"] and time.monotonic() - since > STOP_GRACE:
                for child in children:
                    child.signal(signal.SIGKILL)
                stopping["killed"] = True
            time.sleep(0.1)
    finally:
        for child in children:
            if child.proc is not None and child.code is None:
                child.signal(signal.SIGKILL)
                child.code = child.proc.wait()
        for reader in readers:
            reader.join(timeout=10)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _report(children, stopping)


def _report(children: list[_Shard], stopping: dict) -> int:
    others = "; ".join(f"{c.name} {_ending(c.code)}" for c in children if c is not stopping["failed"])
    if stopping["signal"] is not None:
        code = 128 + int(stopping["signal"])
        _log().warning("data parallel: interrupted by %s: %s; exit code %d. Run the same command again to resume.",
                       _SIGNAMES.get(stopping["signal"], stopping["signal"]), others, code)
        return code
    failed = stopping["failed"]
    if failed is not None:
        code = _exit_code(failed.code)
        _log().error("data parallel: %s %s; stopped the other shards: %s; exit code %d. "
                     "Run the same command again to resume.", failed.name, _ending(failed.code), others or "none", code)
        return code
    _log().info("data parallel: all %d shards finished", len(children))
    return 0
