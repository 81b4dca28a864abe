"""mrv2-rows -- each step's captured rows mapped to their requests under Model Runner V2.

Delta: Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``) runs a step's
requests in its own order (``sort_batch_req_ids``: decodes first, then by scheduled token
count), not in the scheduler's. The stock worker stores each step's rows as the forward laid
them out, and the stock generator cuts the call's rows in input order: prompts of different
lengths would come back with each other's rows -- right shapes, finite values, no error. MRv2
is the only runner from vLLM 0.34.0 (the V1 runner is gone); on 0.22 - 0.33 it runs where the
user sets ``VLLM_USE_V2_MODEL_RUNNER=1`` (``runner-v1`` keeps the V1 runner otherwise, and lets
MRv2 run only on a release where this patch was validated).

How: ``GPUModelRunner.prepare_inputs`` is wrapped to note, per step, where MRv2 put each
request's rows (``InputBatch.req_ids`` and ``query_start_loc_np``, by request id) and the
scheduler's order of the step's requests (``scheduler_output.num_scheduled_tokens``: the input
order, since each step holds whole prompts, see ``v1-chunked-prefill``); the stock
``_store_captured_states`` is wrapped to hand on each layer's rows in that order (a view where
MRv2 kept it, else one gather per layer on the device; padding rows dropped). Every consumer
of the step's rows (the stock store, ``offload-captured``, ``shm-transport``) then sees them as
the V1 runner laid them out. A step whose rows do not match its noted layout raises
``IncompatibleVllmError`` in the worker: never rows of another request.

Detection: the V1 runner module ``vllm.v1.worker.gpu_model_runner`` exists and
``VLLM_USE_V2_MODEL_RUNNER`` is not true: not needed (the V1 runner runs). Otherwise MRv2's
``prepare_inputs`` builds its ``InputBatch`` with ``req_ids``, ``query_start_loc_np`` and
``num_computed_tokens_np`` (0.26+): new. Otherwise: unknown, refused.

Remove when speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

import logging

from speculators_compat.patching import WORKER, IncompatibleVllmError, Probe, declare

from .._probes import source_of
from ._runners import MRV2, V1_RUNNER, VAR, asked_for

log = logging.getLogger("speculators_compat")

#: what MRv2's ``prepare_inputs`` must put into its ``InputBatch`` for the rows to be found
USES = ("req_ids=req_ids", "query_start_loc_np=", "num_computed_tokens_np=")
#: the runner attribute holding the last step's :class:`StepRows`
STEP = "_speculators_compat_step_rows"


def _judge(v1_present: bool, prepare: str | None) -> Probe:
    """``v1_present``: the V1 runner exists (0.33 and before); ``prepare``: MRv2's ``prepare_inputs``."""
    if v1_present and not asked_for():
        return Probe.old(f"{V1_RUNNER} exists and {VAR} does not ask for Model Runner V2: the V1 runner lays "
                         "rows out in the scheduler's order")
    which = f"{VAR} asks for Model Runner V2 (without it the V1 runner runs)" if v1_present else "Model Runner V2 only"
    if not prepare:
        return Probe.unknown(f"{which}, and {MRV2}.GPUModelRunner.prepare_inputs is not found")
    missing = [u for u in USES if u not in prepare]
    if missing:
        return Probe.unknown(f"{which}, and {MRV2}.GPUModelRunner.prepare_inputs does not build its InputBatch "
                             f"with {missing[0]!r}")
    return Probe.new(f"{which}: a step's rows are found by request id (InputBatch.req_ids, query_start_loc_np) "
                     "and put in the scheduler's order")


def probe(module) -> Probe:
    import importlib
    import importlib.util

    v1_present = importlib.util.find_spec(V1_RUNNER) is not None
    if v1_present and not asked_for():
        return _judge(True, None)
    runner = getattr(importlib.import_module(MRV2), "GPUModelRunner", None)
    method = getattr(runner, "prepare_inputs", None)
    return _judge(v1_present, source_of(method) if method is not None else None)


def static_probe(view) -> Probe:
    v1_present = view.vllm.module_file(V1_RUNNER) is not None
    if v1_present and not asked_for():
        return _judge(True, None)
    return _judge(v1_present, view.vllm.source(MRV2, "GPUModelRunner", "prepare_inputs"))


class StepRows:
    """Where one step's forward put each request's rows, and the order they are handed on in."""

    __slots__ = ("rows", "blocks", "total", "padded", "in_order")

    def __init__(self, req_ids: list, starts, positions, order: list, padded: int) -> None:
        #: request id -> (first row in the forward's output, rows, position in its sequence)
        self.rows = {r: (int(starts[i]), int(starts[i + 1]) - int(starts[i]), int(positions[i]))
                     for i, r in enumerate(req_ids)}
        #: (first row, rows) of each request, in the scheduler's order
        self.blocks = [self.rows[r][:2] for r in order if r in self.rows]
        self.total = sum(n for _, n in self.blocks)
        self.padded = padded
        at, self.in_order = 0, True
        for start, n in self.blocks:
            self.in_order &= start == at
            at += n
        if set(order) != set(self.rows):
            raise IncompatibleVllmError(
                f"[mrv2-rows] Model Runner V2 ran requests {sorted(self.rows)} in a step the scheduler scheduled "
                f"{sorted(order)} for (vLLM {MRV2}); the rows cannot be placed by request. What to do: report it "
                "with your vLLM version, or pin vLLM to a validated release.")

    def stock_order(self, rows):
        """``rows`` (this step's ``[tokens, ...]`` output) in the scheduler's order, padding dropped."""
        if int(rows.shape[0]) != self.padded:
            raise IncompatibleVllmError(
                f"[mrv2-rows] a captured layer has {int(rows.shape[0])} rows in a step that Model Runner V2 laid "
                f"out as {self.padded} ({self.total} tokens); the rows cannot be placed by request. What to do: "
                "report it with your vLLM version, or pin vLLM to a validated release.")
        if self.in_order:
            return rows if self.total == self.padded else rows[:self.total]
        import torch

        return torch.cat([rows[start:start + n] for start, n in self.blocks])


def step_rows(runner) -> StepRows | None:
    """The layout of the step ``runner`` last prepared (``None``: not Model Runner V2)."""
    return runner.__dict__.get(STEP)


def _prepare_inputs(wrapped, instance, args, kwargs):
    batch = wrapped(*args, **kwargs)
    scheduler_output = args[0] if args else kwargs["scheduler_output"]
    n = batch.num_reqs
    instance.__dict__[STEP] = StepRows(list(batch.req_ids[:n]), batch.query_start_loc_np[:n + 1],
                                       batch.num_computed_tokens_np[:n], list(scheduler_output.num_scheduled_tokens),
                                       int(batch.num_tokens_after_padding))
    return batch


def _store(wrapped, instance, args, kwargs):
    step = step_rows(instance.model_runner)
    if step is not None and args:
        args = ([step.stock_order(s) for s in args[0]],) + tuple(args[1:])
    return wrapped(*args, **kwargs)


def apply(module, patcher) -> None:
    import importlib

    patcher.wrap(importlib.import_module(MRV2).GPUModelRunner, "prepare_inputs", _prepare_inputs)
    patcher.wrap(module.HiddenStatesWorkerExtension, "_store_captured_states", _store)


PATCH = declare(
    title="captured rows placed by request id under Model Runner V2 (vLLM 0.34: the only runner)",
    delta="Model Runner V2 (0.34: the only runner; 0.22 - 0.33: with VLLM_USE_V2_MODEL_RUNNER=1) orders a "
    "step's requests by token count -> rows handed on in the scheduler's (input) order",
    api=f"{MRV2}.GPUModelRunner.prepare_inputs (InputBatch.req_ids, query_start_loc_np)",
    vllm=">=0.22",
    after=("offload-captured", "shm-transport"),  # wraps _store_captured_states outside them: they get input order
    target=WORKER,
    upstream="vLLM 0.34.0 removed the V1 model runner (0.22 chose MRv2 on its own); speculators 0.3.x cuts rows "
    "in input order",
)
