"""Multi-GPU tests (markers ``gpu`` and ``gpus(2)``; skipped with fewer than 2 CUDA GPUs): issue 36.

Each runs one scenario of ``tests/gpu/multi.py`` in a fresh process (outside the checkout root)
and asserts :func:`multi.problems` of its report, which goes to ``$G016_RESULTS/multi_<name>.json``
for ``tests/gpu/runner.py`` (``--phase multi``):

* ``test_data_parallel_2_equals_one_process``: ``speculators-compat run --data-parallel 2`` of the
  stock offline script, one GPU per shard, byte-equal to one process; shard 1 SIGKILLed mid-run,
  the same command resumes; ``verify`` exits 0; nothing left running, in /dev/shm or on the GPUs;
* ``test_worker_killed_mid_call_at_tp2``: a vLLM worker SIGKILLed during a call at TP=2 (NCCL):
  ``WorkerDiedError`` naming it within 30 s, exit code 1, no orphans, /dev/shm clean, GPU memory
  freed.

``G016_ALLOW_CPU=1`` runs both on a CPU build of vLLM (``--device cpu``): the dry run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import multi  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

CPU = os.environ.get("G016_ALLOW_CPU") == "1"
RESULTS = Path(os.environ.get("G016_RESULTS", str(common.ROOT / "results")))
LOGS = common.ROOT / "logs"


def scenario(name: str, args: list[str], timeout: float) -> dict:
    deadline = float(os.environ.get("G016_DEADLINE", "0") or 0)
    if deadline:
        left = deadline - time.time() - 15
        if left < 120:
            pytest.skip(f"no time left in this device call ({left:.0f} s)")
        timeout = min(timeout, left)
    out = common.ROOT / "work" / f"multi_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / "multi.py"), name, "--out", str(out), "--device", "cpu" if CPU else "cuda"]
    with open(LOGS / f"multi_{name}.log", "w") as log:
        proc = subprocess.Popen([*cmd, *args], cwd=str(out.parent), stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # multi.py then SIGKILLs its runs (each in its own session) and exits
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    report = json.loads(out.read_text()) if out.exists() else {"steps": {}, "problems": ["no report"]}
    report["rc"] = rc
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"multi_{name}.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def test_data_parallel_2_equals_one_process():
    report = scenario("dp", [], timeout=3000 if CPU else 540)
    assert report["steps"], (LOGS / "multi_dp.log").read_text()[-3000:]
    assert not multi.problems(report), multi.problems(report)


def test_worker_killed_mid_call_at_tp2():
    report = scenario("kill", ["--tp", "2"], timeout=1200 if CPU else 300)
    assert report["steps"], (LOGS / "multi_kill.log").read_text()[-3000:]
    assert not multi.problems(report), multi.problems(report)
