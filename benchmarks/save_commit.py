"""How fast the run's output folder takes samples, by how they are made durable (CPU only, stdlib).

    python benchmarks/save_commit.py [--sample-mib 16] [--gib 1] [--rounds 3] [--busy] [--folder DIR]
                                     [--switch-interval S]

Four threads (the stock script's saving threads) each write samples of ``--sample-mib`` MiB with
``os.pwrite`` (the GIL released, as the direct writer does) through
``speculators_compat.services.atomic.atomic_path(defer=True)`` -- the path ``atomic-save`` gives
``torch.save`` under ``speculators-compat run`` -- until ``--gib`` GiB are written, then wait for
the last rename. Three ways, alternated ``--rounds`` times in a rotated order, medians in MB/s:

- ``file``: each saving thread fsyncs and renames its own sample (``SPECULATORS_COMPAT_SAVE_SYNC=file``);
- ``fsync``: the library's committer thread fsyncs each sample, then renames it (where ``syncfs``
  is not trusted: FUSE, NFS, Linux before 5.8);
- ``syncfs``: the committer syncs the batch's filesystem once, then renames (the default on a
  local filesystem, Linux 5.8+).

``--busy``: the main thread runs Python the whole time, as vLLM's driver does beside the saving
threads; each thread then waits for the GIL after each of its system calls. (A stand-in: the real
driver is busy for part of the time only.) ``--switch-interval``: ``sys.setswitchinterval`` for the
run (Python's default 0.005 s: how long a thread back from a system call may wait for the GIL before
the busy thread is made to hand it over).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculators_compat.services import atomic  # noqa: E402

WAYS = ("file", "fsync", "syncfs")


def one_round(folder: Path, way: str, blob: memoryview, count: int, busy: bool) -> float:
    """MB/s of writing ``count`` samples into a fresh ``folder`` the ``way`` given."""
    out = folder / way
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    os.environ[atomic.SYNC_ENV] = "file" if way == "file" else "batch"
    atomic._syncfs[:] = [] if way == "syncfs" else [None]  # [] : found again; [None]: an fsync a file

    def save(i: int) -> None:
        with atomic.atomic_path(out / f"data_{i}.pt", defer=True) as tmp:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                os.pwrite(fd, blob, 0)
            finally:
                os.close(fd)

    os.sync()
    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        saves = [pool.submit(save, i) for i in range(count)]
        while busy and not all(f.done() for f in saves):
            sum(range(200_000))
        for f in saves:
            f.result()
    atomic.flush()
    seconds = time.perf_counter() - start
    done = sum(1 for p in out.iterdir() if p.name.endswith(".pt"))
    shutil.rmtree(out)
    return done * len(blob) / seconds / 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample-mib", type=float, default=16)
    parser.add_argument("--gib", type=float, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", action="store_true")
    parser.add_argument("--folder", default=None, help="where to write (default: a folder in the system's temp dir)")
    parser.add_argument("--switch-interval", type=float, default=None)
    args = parser.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    blob = memoryview(os.urandom(int(args.sample_mib * 2**20)))
    count = max(4, int(args.gib * 2**30 // len(blob)))
    folder = Path(args.folder or Path(os.environ.get("TMPDIR", "/tmp")) / f"save-commit-{os.getpid()}")
    got: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for r in range(args.rounds):
            for way in WAYS[r % 3:] + WAYS[:r % 3]:
                got[way].append(one_round(folder, way, blob, count, args.busy))
    finally:
        os.environ.pop(atomic.SYNC_ENV, None)
        atomic._syncfs[:] = []
        shutil.rmtree(folder, ignore_errors=True)
    report = {"sample_mib": args.sample_mib, "samples": count, "busy": args.busy,
              "switch_interval_s": sys.getswitchinterval(),
              "filesystem": atomic.filesystem_type(folder.parent),
              "mb_s": {way: round(statistics.median(v)) for way, v in got.items()},
              "rounds_mb_s": {way: [round(x) for x in v] for way, v in got.items()}}
    print(report)
    return report


if __name__ == "__main__":
    main()
