"""Fixtures of the data-path patches' tests (``features/datapath``)."""

from __future__ import annotations

import pytest


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """``SPECULATORS_COMPAT_SHM_DIR`` in a fresh folder, no free-space margin."""
    from speculators_compat.patches.features.datapath._runtime import segments

    monkeypatch.setenv("SPECULATORS_COMPAT_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(segments, "MARGIN", 0)
    return tmp_path
