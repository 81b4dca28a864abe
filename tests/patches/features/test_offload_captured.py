"""offload-captured: the per-step copy to host memory.

No accelerator here: the copy logic is shown with stand-in tensors that report a device and
a stand-in for torch's CUDA stream API that records what was called, in order. The real CUDA
path runs in tests/gpu (test_offload_pinned_async_on_cuda and the offload figures of the GPU
runner); on the CPU the patch is not needed and the end-to-end tests show it off.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from speculators_compat.patches.features.datapath import offload_captured
from speculators_compat.core.registry import Patcher, Shape


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"offload-captured": "not needed on the CPU; its copy is unit-tested here"}


class DeviceTensor:
    def __init__(self, name, device, log=None):
        self.name, self.device, self.log = name, SimpleNamespace(type=device), log
        self.shape, self.dtype = (3, 4), "bf16"

    def to(self, device):
        assert device == "cpu"
        return DeviceTensor(self.name + "@host", "cpu")

    def record_stream(self, stream):
        self.log.append(("record_stream", self.name, stream.name))


class HostBuffer:
    def __init__(self, log, shape, dtype, pin_memory):
        self.log, self.device, self.name = log, SimpleNamespace(type="cpu"), None
        log.append(("empty", shape, dtype, pin_memory))

    def copy_(self, src, non_blocking=False):
        self.name = src.name + "@pinned"
        self.log.append(("copy_", src.name, non_blocking, FakeTorch.active[-1]))


class FakeStream:
    def __init__(self, log, name, device=None):
        self.log, self.name, self.device = log, name, device

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def synchronize(self):
        self.log.append(("synchronize", self.name))


class FakeTorch:
    """The part of torch's API the CUDA path uses, recording every call."""

    active = ["compute"]

    def __init__(self):
        self.log = []
        fake = self

        class Cuda:
            @staticmethod
            def Stream(device=None):
                fake.log.append(("new_stream", device))
                return FakeStream(fake.log, "side", device)

            @staticmethod
            def current_stream(device=None):
                return FakeStream(fake.log, "compute", device)

            @staticmethod
            @contextlib.contextmanager
            def stream(s):
                FakeTorch.active.append(s.name)
                try:
                    yield
                finally:
                    FakeTorch.active.pop()

        self.cuda = Cuda

    def empty(self, shape, dtype=None, pin_memory=False):
        return HostBuffer(self.log, shape, dtype, pin_memory)


class Extension:
    def __init__(self):
        self.stored = []

    def _store_captured_states(self, aux_hidden_states):
        self.stored.append([t.name for t in aux_hidden_states])

    def _get_captured_states(self):
        return "states"


def test_other_accelerators_copy_synchronously():
    patcher = Patcher()
    offload_captured.apply(SimpleNamespace(HiddenStatesWorkerExtension=Extension), patcher)
    try:
        ext = Extension()
        ext._store_captured_states([DeviceTensor("l2", "xpu"), DeviceTensor("l5", "cpu")])
        ext._store_captured_states(aux_hidden_states=[DeviceTensor("l2", "xpu")])
        assert ext.stored == [["l2@host", "l5"], ["l2@host"]]
        assert ext._get_captured_states() == "states"  # nothing queued: nothing to wait for
    finally:
        patcher.undo()
    ext = Extension()
    ext._store_captured_states([DeviceTensor("l2", "xpu")])
    assert ext.stored == [["l2"]]  # reverted: stock again


def test_cuda_copies_go_to_pinned_buffers_on_a_side_stream_without_waiting():
    torch = FakeTorch()
    holder = {}
    states = [DeviceTensor("l2", "cuda", torch.log), DeviceTensor("l5", "cpu", torch.log)]
    out = offload_captured.to_pinned_async(states, torch, holder)
    assert [t.name for t in out] == ["l2@pinned", "l5"]
    assert torch.log == [
        ("new_stream", states[0].device),
        ("wait_stream", "side", "compute"),  # the copy starts after the state is computed
        ("empty", (3, 4), "bf16", True),  # pinned host buffer (caching host allocator)
        ("copy_", "l2", True, "side"),  # non-blocking, queued on the side stream
        ("record_stream", "l2", "side"),  # the source's memory is not reused before the copy
    ]
    torch.log.clear()
    nxt = DeviceTensor("l2", "cuda", torch.log)
    nxt.device = states[0].device  # same device: the side stream is reused
    offload_captured.to_pinned_async([nxt], torch, holder)
    assert not any(e[0] == "new_stream" for e in torch.log)
    assert not any(e[0] == "synchronize" for e in torch.log)  # never waits per step
    offload_captured.wait_copies(holder)
    assert torch.log[-1] == ("synchronize", "side")


def test_the_stock_getter_runs_after_one_synchronisation():
    patcher = Patcher()
    offload_captured.apply(SimpleNamespace(HiddenStatesWorkerExtension=Extension), patcher)
    try:
        ext = Extension()
        log = []
        ext.__dict__[offload_captured.STREAM] = FakeStream(log, "side")
        assert ext._get_captured_states() == "states"
        assert log == [("synchronize", "side")]
    finally:
        patcher.undo()


def test_needed_only_off_the_cpu():
    class Src:
        def members(self, module, cls):
            return {"_store_captured_states", "_get_captured_states"}

    assert offload_captured.static_probe(SimpleNamespace(cpu=True, speculators=Src())).shape is Shape.OLD
    assert offload_captured.static_probe(SimpleNamespace(cpu=False, speculators=Src())).shape is Shape.NEW

    class Bare:
        def members(self, module, cls):
            return {"_store_captured_states"}

    assert offload_captured.static_probe(SimpleNamespace(cpu=False, speculators=Bare())).shape is Shape.UNKNOWN
