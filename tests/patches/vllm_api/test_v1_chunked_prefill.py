"""v1-chunked-prefill: the probe reads the default of ``SchedulerConfig(enable_chunked_prefill=)``."""

from __future__ import annotations

import importlib

import pytest

from probe_inputs import P


@pytest.mark.parametrize(
    "module, default, shape",
    [("v1_chunked_prefill", True, "new"), ("v1_chunked_prefill", None, "old")],
)
def test_the_default_probes(module, default, shape):
    judge = importlib.import_module(f"speculators_compat.patches.vllm_api.{module}")._judge
    field = "enable_prefix_caching" if "prefix" in module else "enable_chunked_prefill"
    assert judge({field: P(field, default)}).shape.value == shape
    assert judge({}).shape.value == "unknown"
