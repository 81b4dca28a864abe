"""The patches for vLLM 0.33 and 0.34 on their own: the probes' judgements on small source trees
written here, and Model Runner V2's row layout (``mrv2-rows``) on real tensors. Their agreement
with the real 0.33.0 / 0.34.0 sources is tested in test_check_root.py (tox envs check0330 and
check0340), and the extraction itself on an H200 (tests/gpu/)."""

from __future__ import annotations

import importlib

import pytest

from speculators_compat.errors import IncompatibleVllmError
from speculators_compat.core.registry import Shape
from speculators_compat.check.sources import Sources

v7 = importlib.import_module("speculators_compat.patches.vllm_api.v7")
v8 = importlib.import_module("speculators_compat.patches.vllm_api.v8")
mrv2 = importlib.import_module("speculators_compat.patches.vllm_api.mrv2_rows")
death = importlib.import_module("speculators_compat.patches.guards.worker_death")

HELPERS = "def _get_kv_cache_groups_uniform_spec(kv_cache_specs):\n    pass\n\n" \
          "def get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory):\n    pass\n\n" \
          "def unify_hybrid_kv_cache_specs(kv_cache_spec):\n    pass\n"


def tree(tmp_path, files: dict) -> Sources:
    root = tmp_path / "vllm"
    for name, text in {"__init__.py": "", "v1/__init__.py": "", "v1/core/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return Sources("vllm", str(root))


def test_v8_old_where_the_helpers_live_in_kv_cache_utils(tmp_path):
    assert v8._judge(tree(tmp_path, {"v1/core/kv_cache_utils.py": HELPERS})).shape is Shape.OLD


def test_v8_new_where_they_moved_to_kv_cache_planning(tmp_path):
    src = tree(tmp_path, {"v1/core/kv_cache_utils.py": "X = 1\n", "v1/core/kv_cache_planning.py": HELPERS})
    probe = v8._judge(src)
    assert probe.shape is Shape.NEW and "moved" in probe.evidence


def test_v8_unknown_names_where_a_helper_went_instead(tmp_path):
    src = tree(tmp_path, {"v1/core/kv_cache_utils.py": "X = 1\n", "v1/core/kv_cache_planning.py": "Y = 2\n",
                          "v1/core/elsewhere.py": HELPERS})
    probe = v8._judge(src)
    assert probe.shape is Shape.UNKNOWN
    assert "moved: get_kv_cache_config_from_groups is defined in vllm.v1.core.elsewhere" in probe.evidence


def test_v8_binds_the_moved_helpers_and_undo_removes_them(monkeypatch):
    import sys
    import types

    from speculators_compat.core.registry import Patcher

    utils, planning = types.ModuleType(v8.UTILS), types.ModuleType(v8.PLANNING)
    for name in v8.NAMES:
        setattr(planning, name, lambda *a, _n=name: _n)
    monkeypatch.setitem(sys.modules, v8.UTILS, utils)
    monkeypatch.setitem(sys.modules, v8.PLANNING, planning)
    patcher = Patcher()
    v8.apply(None, patcher)
    assert all(getattr(utils, n) is getattr(planning, n) for n in v8.NAMES)
    patcher.undo()
    assert not any(hasattr(utils, n) for n in v8.NAMES)


def _param(name):
    import inspect

    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@pytest.mark.parametrize("names,shape", [
    (["layout_name"], Shape.NEW),
    (["layout_name", "cp_kv_cache_interleave_size"], Shape.NEW),
    (["layout_name", "something_else"], Shape.UNKNOWN),
])
def test_v7_accepts_the_two_set_kv_cache_layout_signatures_only(names, shape):
    resolve = {n: _param(n) for n in v7.RESOLVE_PARAMS}
    probe = v7._judge(True, resolve, set(v7.EXECUTOR_METHODS), {n: _param(n) for n in names})
    assert probe.shape is shape


def test_worker_death_reads_the_queue_check_where_0_33_moved_it():
    sources = {
        "start_worker_monitor": "self.is_failed = True\n self.shutdown()",
        "collective_rpc": "if self.is_failed: raise",
        "shutdown": "for mq in self.response_mqs: mq.shutdown()",
        "MessageQueue.acquire_read": "while True:\n if not self._wait_until_readable(meta, t): continue",
        "MessageQueue.shutdown": "self.shutting_down = True",
    }
    members = {"start_worker_monitor", "shutdown", "collective_rpc"}
    assert death._judge(members, sources, {"__init__", "generate"}).shape is Shape.UNKNOWN
    sources["MessageQueue._wait_until_readable"] = "if self.shutting_down:\n    raise RuntimeError('cancelled')"
    assert death._judge(members, sources, {"__init__", "generate"}).shape is Shape.NEW


# -- Model Runner V2's row layout ---------------------------------------------------------


def test_mrv2_rows_probe_not_needed_while_the_v1_runner_exists():
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
