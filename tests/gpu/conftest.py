"""The ``gpu`` marker: tests that need a CUDA GPU (run by tests/gpu/runner.py on the device).

Without CUDA they are skipped at collection, so the CPU test environments (``pytest tests``)
pass over them cleanly. ``G016_ALLOW_CPU=1`` runs them anyway against a CPU build of vLLM
(the dry run: fp32, MLA off, a small perf model; see tests/gpu/runner.py --cpu).
``gpus(N)``: a test that also needs N CUDA devices (skipped with fewer; ``G016_ALLOW_CPU=1``
runs it on the CPU as well).
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu; run with tests/gpu/runner.py)")
    config.addinivalue_line("markers", "gpus(n): needs n CUDA GPUs (tests/gpu/test_multi.py)")


def _cuda() -> str | None:
    """None when CUDA is usable, else why not."""
    if os.environ.get("G016_ALLOW_CPU") == "1":
        return None
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    why = _cuda()
    if why is not None:
        skip = pytest.mark.skip(reason=f"gpu test: {why}")
        for item in gpu_items:
            item.add_marker(skip)
        return
    for item in gpu_items:
        need = item.get_closest_marker("gpus")
        if need is None or os.environ.get("G016_ALLOW_CPU") == "1":
            continue
        import torch

        if torch.cuda.device_count() < need.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {need.args[0]} CUDA GPUs, {torch.cuda.device_count()} visible"))
