"""spawn-workers: needed off the CPU build; the generator's __init__ runs with
``VLLM_WORKER_MULTIPROC_METHOD=spawn`` unless the user set it, and the variable is put back."""

from __future__ import annotations

import os
from types import SimpleNamespace

from speculators_compat.patches.vllm_api import spawn_workers as patch


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"spawn-workers": "CUDA only (docs/gpu.md: on an H200 forked workers failed at start, spawned ran)"}


def test_the_static_probe_follows_the_build():
    assert patch.static_probe(SimpleNamespace(cpu=True)).shape.value == "old"
    assert patch.static_probe(SimpleNamespace(cpu=False)).shape.value == "new"


def test_workers_are_spawned_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv(patch.VAR, raising=False)
    assert patch._init(lambda: os.environ.get(patch.VAR), None, (), {}) == "spawn"
    assert patch.VAR not in os.environ  # put back after the executor started
    monkeypatch.setenv(patch.VAR, "fork")
    assert patch._init(lambda: os.environ.get(patch.VAR), None, (), {}) == "fork"
    assert os.environ[patch.VAR] == "fork"
