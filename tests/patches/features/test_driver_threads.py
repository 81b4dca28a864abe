"""driver-threads: the driver's torch threads put back after vLLM set them to one, unless the user chose."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from speculators_compat.patches.features import driver_threads  # noqa: E402


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"driver-threads": "a feature (same data, less time): this file, tests/gpu perf"}


def test_driver_threads_are_put_back_unless_the_user_chose_them(monkeypatch):
    before = torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(2)
        before = 2
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        driver_threads._init(lambda: torch.set_num_threads(1), None, (), {})
        assert torch.get_num_threads() == before
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        driver_threads._init(lambda: torch.set_num_threads(1), None, (), {})
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
