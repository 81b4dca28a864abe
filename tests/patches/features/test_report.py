"""report: the per-call log line's totals and the run summary, on a stand-in generator (no vLLM)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

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
