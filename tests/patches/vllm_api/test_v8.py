"""v8: the kv-cache helpers vLLM 0.33 moved to ``kv_cache_planning``: the probe's judgement on small
source trees written here, and the binding of the moved helpers."""

from __future__ import annotations

import importlib

from speculators_compat.core.registry import Shape
from speculators_compat.check.sources import Sources


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "v8": (
        "vLLM 0.33 has no CPU build: its delta is read from the real wheel (tests/test_check_root.py, tox"
        " check0330) and the extraction ran on an H200 (docs/gpu.md)"
    ),
}

v8 = importlib.import_module("speculators_compat.patches.vllm_api.v8")


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
