"""The patch modules, one per vLLM API delta (or guard), in the order they apply.

Each module documents the delta, the versions it covers, how it is detected and when it
can be removed. Within one target module, later patches wrap earlier ones: the guards come
last so they see the patched generator. Importing this package imports neither torch nor
vLLM.
"""

from __future__ import annotations

from ._common import GENERATOR, WORKER
from . import (
    api_inventory,
    cpu_mem_get_info,
    cpu_rotary_3d,
    dtype_option,
    guard_input,
    guard_output,
    offload_captured,
    report,
    s04_cpu_mem_get_info,
    s04_result_order,
    s04_scheduler_loop,
    v1_chunked_prefill,
    v1_engine_config,
    v1_prefix_caching,
    v2_scheduler_request,
    v3_worker_capture,
    v4_collective_rpc_reply,
    v5_two_phase_execution,
)

REGISTRY = [
    api_inventory.PATCH,
    v1_engine_config.PATCH,
    v1_prefix_caching.PATCH,
    v1_chunked_prefill.PATCH,
    v2_scheduler_request.PATCH,
    v4_collective_rpc_reply.PATCH,
    v5_two_phase_execution.PATCH,
    cpu_mem_get_info.PATCH,
    dtype_option.PATCH,
    s04_cpu_mem_get_info.PATCH,
    s04_scheduler_loop.PATCH,
    s04_result_order.PATCH,
    guard_output.PATCH,
    guard_input.PATCH,
    report.PATCH,
    v3_worker_capture.PATCH,
    cpu_rotary_3d.PATCH,
    offload_captured.PATCH,
]

#: where a refused patch stops its target before any heavy work: (class, method)
ENTRY_POINTS = {
    GENERATOR: ("VllmHiddenStatesGenerator", "__init__"),
    WORKER: ("HiddenStatesWorkerExtension", "_setup_hidden_states_capture"),
}

__all__ = ["REGISTRY", "ENTRY_POINTS", "GENERATOR", "WORKER"]
