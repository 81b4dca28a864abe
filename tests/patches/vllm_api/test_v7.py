"""v7: the probe accepts the two ``set_kv_cache_layout`` signatures (before and from vLLM 0.33) only."""

from __future__ import annotations

import importlib

import pytest

from speculators_compat.core.registry import Shape


#: end to end (tests/test_e2e.py, wherever the probe finds the delta): the step that fails when the
#: patch alone is disabled (with the stock-calls check off), and a fragment of the failure
NEEDED_WHERE = {
    # vLLM 0.29+: no engine core resolved the KV cache layout before the stock code sizes the cache
    "v7": ("start", "KV cache layout has not been resolved yet"),
}

v7 = importlib.import_module("speculators_compat.patches.vllm_api.v7")


def _param(name):
    import inspect

    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@pytest.mark.parametrize("names,shape", [
    (["layout_name"], Shape.NEW),
    (["layout_name", "cp_kv_cache_interleave_size"], Shape.NEW),
    (["layout_name", "something_else"], Shape.UNKNOWN),
])
def test_v7_accepts_the_two_set_kv_cache_layout_signatures_only(names, shape):
    resolve = {n: _param(n) for n in v7.RESOLVE_PARAMS}
    probe = v7._judge(True, resolve, set(v7.EXECUTOR_METHODS), {n: _param(n) for n in names})
    assert probe.shape is shape
