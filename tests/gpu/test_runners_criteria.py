"""What ``tests/gpu/runners.py`` flags, on made-up reports (no GPU, no vLLM, < 1 s): the V1 runner
against Model Runner V2 on one release is judged by it, so each of its checks must be able to fail."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import runners  # noqa: E402


def report(runner: str, applied: list, rel: float, vs: dict | None = None) -> dict:
    value = {"max_rel_l2": rel, "pooled_rel_l2": rel / 2, "max_abs": 0.1, "tokens": 9263, "seconds": 1.0,
             "rows_ok": True}
    if vs is not None:
        value["vs_saved"] = vs
    return {"model": "llama", "versions": {"vllm": "0.26.0"}, "steps": {
        "start": {"ok": True, "value": {"workers": [{"model_runner": runner, "applied": applied}]}},
        "mixed": {"ok": True, "value": value},
        "repeat": {"ok": True, "value": {"identical": True}}}}


V1 = report("vllm.v1.worker.gpu_model_runner.GPUModelRunner", ["v3"], 0.0094)
SAME = {"max_rel_l2": 0.0, "max_abs": 0.0, "identical": True, "outlier_rows": 0}
MRV2 = report("vllm.v1.worker.gpu.model_runner.GPUModelRunner", ["v3", "mrv2-rows"], 0.0094, SAME)


def test_the_same_rows_under_both_runners_pass():
    merged = runners.merge(V1, MRV2)
    assert merged["problems"] == []
    assert merged["sets"]["mixed"]["mrv2_vs_v1"]["identical"] is True


def _broken(which: str, edit) -> list[str]:
    v1, mrv2 = copy.deepcopy(V1), copy.deepcopy(MRV2)
    edit(v1 if which == "v1" else mrv2)
    return runners.merge(v1, mrv2)["problems"]


@pytest.mark.parametrize("which, edit, expect", [
    # rows of other sequences: ~1.0 from V1's
    ("mrv2", lambda r: r["steps"]["mixed"]["value"]["vs_saved"].update(max_rel_l2=1.3, identical=False),
     "MRv2 vs V1 rel. L2 1.3"),
    ("mrv2", lambda r: r["steps"]["mixed"]["value"].update(max_rel_l2=0.05), "MRv2 vs HF 0.05"),
    ("mrv2", lambda r: r["steps"]["mixed"]["value"].pop("vs_saved"), "not compared"),
    ("mrv2", lambda r: r["steps"]["mixed"]["value"].update(rows_ok=False), "rows != tokens"),
    ("mrv2", lambda r: r["steps"]["start"]["value"]["workers"][0].update(
        model_runner="vllm.v1.worker.gpu_model_runner.GPUModelRunner"),
     "mrv2: worker 0 built vllm.v1.worker.gpu_model"),
    ("mrv2", lambda r: r["steps"]["start"]["value"]["workers"][0].update(applied=["v3"]), "mrv2-rows not applied"),
    ("mrv2", lambda r: r["steps"]["start"].update(ok=False, error="IncompatibleVllmError: [runner-v1] ..."),
     "mrv2: start failed: IncompatibleVllmError"),
    ("v1", lambda r: r["steps"]["start"]["value"]["workers"][0].update(
        model_runner="vllm.v1.worker.gpu.model_runner.GPUModelRunner"), "v1: worker 0 built vllm.v1.worker.gpu.model"),
    ("v1", lambda r: r["steps"]["mixed"].update(ok=False, error="boom"), "mixed: a run failed"),
])
def test_each_criterion_can_fail(which, edit, expect):
    problems = _broken(which, edit)
    assert any(expect in p for p in problems), problems
