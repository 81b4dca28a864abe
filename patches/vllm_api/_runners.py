"""vLLM's two GPU model runners, as ``runner-v1`` (driver) and ``mrv2-rows`` (workers) both read them."""

from __future__ import annotations

import os

#: the V1 model runner (gone in vLLM 0.34) and Model Runner V2
V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
MRV2 = "vllm.v1.worker.gpu.model_runner"
#: vLLM's switch between them (read by ``VllmConfig.use_v2_model_runner``, 0.22 - 0.33)
VAR = "VLLM_USE_V2_MODEL_RUNNER"
#: the patch that places Model Runner V2's rows by request id
MRV2_ROWS = "mrv2-rows"


def asked_for(environ=None) -> bool:
    """Whether ``VLLM_USE_V2_MODEL_RUNNER`` asks for Model Runner V2 (as vLLM reads it)."""
    value = (os.environ if environ is None else environ).get(VAR)
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


__all__ = ["V1_RUNNER", "MRV2", "VAR", "MRV2_ROWS", "asked_for"]
