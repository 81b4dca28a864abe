"""Shared fixtures, and the validation record a matrix run writes.

With ``SPECULATORS_COMPAT_RECORD=DIR`` (a validation run of the matrix, see tools/matrix.py), the
end-to-end tests feed ``recorder.RUN`` with what every full-shim scenario run applied (in the driver
and in the workers), on which model, at which tensor-parallel size and how close to HF fp32;
when the whole session passed, ``pytest_sessionfinish`` writes it into DIR as one validation run.
"""

from __future__ import annotations

import os
import sys

import pytest

# the maintainer tools (matrix, patchdoc, patchset, refresh) live in tools/, outside the tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from speculators_compat.core import _env, hooks


def pytest_sessionfinish(session, exitstatus):
    from recorder import RUN

    folder = _env.record_dir()
    if not folder or exitstatus != 0 or not RUN["applied"]:
        return
    import matrix

    from speculators_compat.core import versions

    env = matrix.current()
    transformers = versions.installed("transformers")
    torch = versions.installed("torch")
    path = matrix.write_run(folder, {
        "env": env.name if env else "",
        "vllm": str(versions.vllm().base),
        "vllm_version": str(versions.vllm().version),
        "speculators": str(versions.speculators().version),
        "transformers": str(transformers.version) if transformers else None,
        "transformers_line": env.transformers_line if env else "4",
        "torch": str(torch.version) if torch else None,
        "platform": "cpu",
        "applied": sorted(RUN["applied"]),
        "models": sorted(RUN["models"]),
        "tp": sorted(RUN["tp"]),
        "max_abs_diff": {m: float(f"{d:.3g}") for m, d in sorted(RUN["max_abs_diff"].items())},
        "steps": "comparison" if matrix.QUICK_VAR in os.environ else "all",
    })
    print(f"\nvalidation run written to {path}")


@pytest.fixture(autouse=True)
def _children_not_armed():
    """``import speculators_compat`` (here, and again at every ``install()``) puts its start-up hook on
    ``PYTHONPATH``: taken off for each test, so that the processes a test starts are armed only the
    way that test says (the scenario's spawned workers, say, get the patches through the vLLM plugin)."""
    from speculators_compat.core import children

    children.disarm()
    yield
    children.disarm()


@pytest.fixture
def fake_registry(monkeypatch, tmp_path):
    """Point the engine at a throw-away registry and target module (unit tests only)."""
    from speculators_compat.core import targets

    hooks.reset()
    state = {}
    hooks.install(state.setdefault("registry", []))
    monkeypatch.setattr(targets, "ENTRY_POINTS", state.setdefault("entry", {}))
    monkeypatch.syspath_prepend(str(tmp_path))
    state["dir"] = tmp_path
    yield state
    hooks.reset()
    hooks.revert()
    hooks.install(hooks.PATCH_SET)
