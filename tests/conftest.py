import pytest

from speculators_compat import hooks


@pytest.fixture
def fake_registry(monkeypatch, tmp_path):
    """Point the engine at a throw-away registry and target module (unit tests only)."""
    import speculators_compat.patches as patches

    hooks.reset()
    state = {}
    monkeypatch.setattr(patches, "REGISTRY", state.setdefault("registry", []))
    monkeypatch.setattr(patches, "ENTRY_POINTS", state.setdefault("entry", {}))
    monkeypatch.syspath_prepend(str(tmp_path))
    state["dir"] = tmp_path
    yield state
    hooks.reset()
    hooks.revert()
