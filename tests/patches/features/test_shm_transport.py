"""shm-transport on real torch tensors (no vLLM process needed): the worker writes the captured states
into one shared-memory file and the driver unpickles exactly the stock reply."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from speculators_compat.patches.features.datapath import shm_transport  # noqa: E402
from speculators_compat.patches.features.datapath._runtime import reply, segments  # noqa: E402


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"shm-transport": "a feature (same data, less time): this file, tests/gpu perf"}


def stock_get(instance):
    """speculators 0.3.0's HiddenStatesWorkerExtension._get_captured_states"""
    if instance._captured_states is None:
        return None
    result = [torch.cat(layer_tensors, dim=0) for layer_tensors in instance._captured_states]
    instance._captured_states = None
    return result


class Ext:
    def __init__(self, layers):
        self._captured_states = layers


def layers(dtype, steps=(3, 1, 17), hidden=24, n_layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(rows, hidden, generator=g).to(dtype) for rows in steps] for _ in range(n_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_driver_unpickles_exactly_the_stock_reply_and_the_file_is_gone(shm, dtype):
    parts = layers(dtype)
    want = stock_get(Ext([list(p) for p in parts]))
    ext = Ext(parts)
    handle = shm_transport._get(lambda: pytest.fail("the stock method ran"), ext, (), {})
    assert isinstance(handle, segments.SharedStates) and ext._captured_states is None
    assert os.listdir(shm) == [os.path.basename(handle.path)]
    payload = pickle.dumps(handle)
    assert len(payload) < 1000  # a path and a layout, not the states
    got = pickle.loads(payload)
    assert os.listdir(shm) == []  # unlinked once mapped
    assert [g.dtype for g in got] == [dtype] * 3 and [g.shape for g in got] == [w.shape for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    got[0][0, 0] = 123  # a private mapping: writable like the stock tensors
    assert got[0][0, 0].item() == 123


def test_no_room_in_the_folder_replies_as_stock(shm, monkeypatch):
    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(segments.os, "statvfs", lambda path: Full)
    parts = layers(torch.float32)
    want = stock_get(Ext([list(p) for p in parts]))
    got = shm_transport._get(lambda: stock_get(ext), ext := Ext(parts), (), {})
    assert isinstance(got, list) and all(torch.equal(g, w) for g, w in zip(got, want))
    assert os.listdir(shm) == []


def test_a_failed_reservation_leaves_no_file_and_replies_as_stock(shm, monkeypatch):
    def refuse(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(segments.os, "posix_fallocate", refuse)
    ext = Ext(layers(torch.float32))
    assert isinstance(shm_transport._get(lambda: stock_get(ext), ext, (), {}), list)
    assert os.listdir(shm) == []


def test_nothing_captured_is_the_stock_reply(shm):
    assert shm_transport._get(lambda: stock_get(ext), ext := Ext(None), (), {}) is None


def test_files_of_a_dead_driver_are_removed_and_a_live_ones_kept(shm):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = shm / f"{segments.PREFIX}-{dead}-1-0"
    live = shm / f"{segments.PREFIX}-{os.getpid()}-1-0"
    other = shm / "vllm-queue"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert segments.remove_stale() == [str(stale)]
    assert sorted(os.listdir(shm)) == sorted([live.name, other.name])
