"""report: the per-call log line's totals and the run summary, on a stand-in generator (no vLLM)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from speculators_compat.patches.features import report


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "report": "the log lines asserted in tests/test_e2e.py test_stock_generator_runs_correctly_with_the_shim",
}


class _Shape:
    def __init__(self, *shape):
        self.shape = shape
        self.dtype = "torch.bfloat16"


class _Generator:
    def __init__(self):
        self.layer_ids = [3, 1, 3]


def test_each_call_adds_to_the_totals_and_the_summary(monkeypatch, caplog):
    monkeypatch.setattr(report.lifecycle, "track", lambda instance, at_exit: None)
    monkeypatch.setattr(report.manifest, "armed", lambda: False)
    gen = _Generator()
    assert report.run_summary(gen) is None  # no call yet
    results = [{"input_ids": [1, 2, 3], "hidden_states": [_Shape(3, 8), _Shape(3, 8)]},
               {"input_ids": [4, 5], "hidden_states": [_Shape(2, 8), _Shape(2, 8)]}]
    with caplog.at_level(logging.INFO, logger="speculators_compat"):
        assert report._generate(lambda: results, gen, (), {}) is results
        report._generate(lambda: results, gen, (), {})
    totals = gen.__dict__[report.TOTALS]
    assert (totals["calls"], totals["tokens"]) == (2, 10)
    assert "generate(): 2 sequences, 5 tokens, layers [1, 3], hidden 8, bfloat16" in caplog.text
    summary = report.run_summary(gen)
    assert summary.startswith("2 generate() calls, 10 tokens") and "between the calls" in summary


def test_an_empty_call_counts_nothing(monkeypatch):
    monkeypatch.setattr(report.lifecycle, "track", lambda instance, at_exit: None)
    monkeypatch.setattr(report.manifest, "armed", lambda: False)
    gen = SimpleNamespace(layer_ids=[1])
    assert report._generate(lambda: [], gen, (), {}) == []
    assert report.run_summary(gen) is None


def test_a_generator_deleted_as_a_run_is_interrupted_leaves_no_worker_shared_memory(tmp_path):
    """A generator that goes while the runner unwinds an interrupt (its ``__del__``, not the
    runner's shutdown) still removes the /dev/shm segments its workers made for themselves (vLLM's
    CPU communicator: a worker stopped by a signal never unlinks them)."""
    import os
    import signal
    import subprocess
    import sys
    import uuid

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    name = f"vllm_dist_{uuid.uuid4().hex}-tp:0-[0-1]-cpushm_0"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as fh:
        fh.write(b"\0" * 4096)
    worker = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"fh = open({path!r}, 'r+b'); m = mmap.mmap(fh.fileno(), 4096)\n"
        "print('mapped', flush=True); time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "mapped"

        class _Executor:  # a vLLM executor's shape: workers with their processes; shutdown stops them
            workers = [SimpleNamespace(proc=worker)]

            def shutdown(self):
                worker.send_signal(signal.SIGKILL)
                worker.wait(30)

        gen = _Generator()
        gen.executor = _Executor()
        report.shutdown(gen)
        assert not os.path.exists(path)
        assert "executor" not in gen.__dict__
    finally:
        worker.kill()
        worker.wait(30)
        if os.path.exists(path):
            os.unlink(path)
