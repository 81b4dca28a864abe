"""offload-captured: the per-step copy to host memory (no accelerator here, so the copy is
shown with stand-in tensors that report a CUDA device; on the CPU the patch is not needed
and the end-to-end tests show it off)."""

from __future__ import annotations

from types import SimpleNamespace

from speculators_compat.patches import offload_captured
from speculators_compat.registry import Patcher, Shape


class DeviceTensor:
    def __init__(self, name, device):
        self.name, self.device = name, SimpleNamespace(type=device)

    def to(self, device):
        assert device == "cpu"
        return DeviceTensor(self.name + "@host", "cpu")


class Extension:
    def __init__(self):
        self.stored = []

    def _store_captured_states(self, aux_hidden_states):
        self.stored.append([t.name for t in aux_hidden_states])


def test_every_step_is_stored_in_host_memory():
    patcher = Patcher()
    offload_captured.apply(SimpleNamespace(HiddenStatesWorkerExtension=Extension), patcher)
    try:
        ext = Extension()
        ext._store_captured_states([DeviceTensor("l2", "cuda"), DeviceTensor("l5", "cpu")])
        ext._store_captured_states(aux_hidden_states=[DeviceTensor("l2", "cuda")])
        assert ext.stored == [["l2@host", "l5"], ["l2@host"]]
    finally:
        patcher.undo()
    ext = Extension()
    ext._store_captured_states([DeviceTensor("l2", "cuda")])
    assert ext.stored == [["l2"]]  # reverted: stock again


def test_needed_only_off_the_cpu():
    class Src:
        def members(self, module, cls):
            return {"_store_captured_states"}

    assert offload_captured.static_probe(SimpleNamespace(cpu=True, speculators=Src())).shape is Shape.OLD
    assert offload_captured.static_probe(SimpleNamespace(cpu=False, speculators=Src())).shape is Shape.NEW

    class Bare:
        def members(self, module, cls):
            return set()

    assert offload_captured.static_probe(SimpleNamespace(cpu=False, speculators=Bare())).shape is Shape.UNKNOWN
