"""mrv2-rows: Model Runner V2's row layout, the probe and the rows put back in the scheduler's order
on real tensors (skipped without torch)."""

from __future__ import annotations

import importlib

import pytest

from speculators_compat.errors import IncompatibleVllmError
from speculators_compat.core.registry import Shape


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "mrv2-rows": (
        "vLLM 0.34 has no CPU build: the extraction ran on an H200 (docs/gpu.md: without mrv2-rows 9,257 "
        "of 9,263 rows wrong)"
    ),
}

mrv2 = importlib.import_module("speculators_compat.patches.vllm_api.mrv2_rows")


def test_mrv2_rows_probe_not_needed_while_the_v1_runner_exists(monkeypatch):
    monkeypatch.delenv(mrv2.VAR, raising=False)
    assert mrv2._judge(True, None).shape is Shape.OLD
    assert mrv2._judge(False, None).shape is Shape.UNKNOWN
    assert mrv2._judge(False, "InputBatch(req_ids=req_ids, query_start_loc_np=q)").shape is Shape.UNKNOWN
    full = "InputBatch(req_ids=req_ids, query_start_loc_np=q, num_computed_tokens_np=c)"
    assert mrv2._judge(False, full).shape is Shape.NEW


def test_mrv2_rows_puts_each_request_back_in_the_schedulers_order():
    torch = pytest.importorskip("torch")
    # the scheduler scheduled a (3 tokens), b (1), c (2); MRv2 ran them sorted by length: b, c, a,
    # plus 2 padding rows
    step = mrv2.StepRows(["b", "c", "a"], [0, 1, 3, 6], [0, 0, 0], ["a", "b", "c"], padded=8)
    rows = torch.tensor([[10.0], [20.0], [21.0], [30.0], [31.0], [32.0], [-1.0], [-1.0]])
    assert step.stock_order(rows).flatten().tolist() == [30.0, 31.0, 32.0, 10.0, 20.0, 21.0]
    assert step.rows["a"] == (3, 3, 0) and step.total == 6 and not step.in_order


def test_mrv2_rows_in_order_is_a_view_without_padding():
    torch = pytest.importorskip("torch")
    step = mrv2.StepRows(["a", "b"], [0, 2, 5], [0, 0], ["a", "b"], padded=6)
    rows = torch.arange(6.0).reshape(6, 1)
    out = step.stock_order(rows)
    assert step.in_order and out.data_ptr() == rows.data_ptr() and out.shape[0] == 5


def test_mrv2_rows_refuses_rows_it_cannot_place():
    torch = pytest.importorskip("torch")
    step = mrv2.StepRows(["a", "b"], [0, 2, 5], [0, 0], ["a", "b"], padded=5)
    with pytest.raises(IncompatibleVllmError, match="cannot be placed"):
        step.stock_order(torch.zeros(4, 1))
    with pytest.raises(IncompatibleVllmError, match="cannot be placed by request"):
        mrv2.StepRows(["a", "x"], [0, 2, 5], [0, 0], ["a", "b"], padded=5)
    with pytest.raises(IncompatibleVllmError, match="cannot be placed by request"):  # a scheduled one missing
        mrv2.StepRows(["a"], [0, 2], [0], ["a", "b"], padded=2)


@pytest.mark.parametrize("value, v1_runs", [(None, True), ("0", True), ("false", True), ("1", False),
                                            ("True", False)])
def test_mrv2_rows_where_both_runners_exist_follows_the_variable(monkeypatch, value, v1_runs):
    """vLLM 0.22 - 0.33 ship both runners: the V1 one runs unless VLLM_USE_V2_MODEL_RUNNER asks
    for MRv2, and then the rows need placing (judged on MRv2's InputBatch fields, as on 0.34)."""

    class Vllm:
        @staticmethod
        def module_file(name):
            return f"/site/{name}.py"

        @staticmethod
        def source(module, cls, name):
            assert (module, cls, name) == (mrv2.MRV2, "GPUModelRunner", "prepare_inputs")
            return "InputBatch(req_ids=req_ids, query_start_loc_np=q, num_computed_tokens_np=c)"

    class View:
        vllm = Vllm

    if value is None:
        monkeypatch.delenv(mrv2.VAR, raising=False)
    else:
        monkeypatch.setenv(mrv2.VAR, value)
    assert mrv2.asked_for() is not v1_runs
    assert mrv2.static_probe(View).shape is (Shape.OLD if v1_runs else Shape.NEW)
    if not v1_runs:  # vLLM 0.22 - 0.25: MRv2's InputBatch has no num_computed_tokens_np yet
        got = mrv2._judge(True, "InputBatch(req_ids=req_ids, query_start_loc_np=q)")
        assert got.shape is Shape.UNKNOWN and got.evidence.startswith(f"{mrv2.VAR} asks for Model Runner V2 (without it the V1 runner runs), and ")
