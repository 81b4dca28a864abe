"""self-check-reference -- the workers' side of ``self-check``: vLLM's own states, and the comparison.

Problem: see ``self-check``; the weights that turn a row into log-probs live in the workers,
and so does the only state no capture code touched: the final hidden state vLLM computes its
own next-token (and prompt) log-probs from.

How: ``HiddenStatesWorkerExtension._setup_hidden_states_capture`` is wrapped; after ``v3``'s
capture hooks it puts a forward hook on the base model's final norm (the base model's output; its
compiled ``__call__`` runs no hooks), which, while the driver has armed a call, copies each
checked request's rows of that output, found where vLLM's
``_get_prompt_logprobs_dict`` finds them (``input_batch.req_id_to_index``,
``query_start_loc.np``, the request's ``num_computed_tokens``), and one on the last decoder
layer (ahead of the capture's), which records that layer's rows of the checked sequences only
where the caller did not ask for the last layer, cut as the stock code cuts the call's rows. The
driver's ``collective_rpc`` then hands every rank the caller's rows; each puts them through the
final norm, then them and vLLM's own (normed) rows through the model's ``compute_logits`` (the
same on every rank: the logits are gathered over vLLM's TP group) and the gathering rank replies with a
few numbers per sequence (:mod:`._runtime.compare`). Nothing is recorded, and every
hook returns at once, while no call is armed.

Under Model Runner V2 (vLLM 0.34: the only runner; 0.26 - 0.33 with ``VLLM_USE_V2_MODEL_RUNNER=1``)
the rows are found as MRv2's prompt log-probs code finds them: by request id in the step's
``InputBatch`` (``req_ids``, ``query_start_loc_np``, ``num_computed_tokens_np``, as noted by
``mrv2-rows``), and the last layer's rows of the checked sequences are cut after ``mrv2-rows`` put
them in input order.

Detection: vLLM's ``GPUModelRunner._get_prompt_logprobs_dict`` (the CPU runner inherits it)
finds a request's rows with ``input_batch.req_id_to_index`` and ``query_start_loc.np`` and
computes them with ``self.model.compute_logits``; or, where MRv2 runs (no V1 runner, or
``VLLM_USE_V2_MODEL_RUNNER`` asks for it), MRv2's ``PromptLogprobsWorker.compute_prompt_logprobs``
finds them at ``input_batch.query_start_loc_np`` of ``input_batch.req_ids`` and the runner passes
it ``self.model.compute_logits``; otherwise not needed (the self-check is off, and the driver says
so once).

A feature: left off where no validation run recorded it. Remove with ``self-check``.
"""

from __future__ import annotations

import logging

from speculators_compat.patching import WORKER, Kind, Probe, applied_ids, declare

from ..._probes import wrapping
from ...vllm_api._runners import asked_for
from ...vllm_api.mrv2_rows import MRV2, step_rows
from ...vllm_api.mrv2_rows import PATCH as MRV2_ROWS
from ...vllm_api.v3 import find_base_model
from ._runtime import compare

log = logging.getLogger("speculators_compat")

RUNNER = "vllm.v1.worker.gpu_model_runner"
#: what vLLM's own prompt-logprobs code does that the reference hook does the same way
USES = ("self.input_batch.req_id_to_index[req_id]", "self.query_start_loc.np[req_idx]",
        "request.num_computed_tokens", "self.model.compute_logits(")


#: Model Runner V2: its prompt log-probs code, and what it and the runner's call of it use
MRV2_PROMPT = "vllm.v1.worker.gpu.sample.prompt_logprob"
MRV2_USES = ("input_batch.query_start_loc_np", "input_batch.req_ids")


def _judge_mrv2(prompt: str | None, runner: str | None) -> Probe:
    missing = [u for u in MRV2_USES if u not in (prompt or "")]
    if missing or "self.model.compute_logits" not in (runner or ""):
        what = f"does not use {missing[0]!r}" if missing else "is not given self.model.compute_logits"
        return Probe.old(f"Model Runner V2's prompt log-probs code {what}: the self-check is off")
    return Probe.new("Model Runner V2 finds a request's prompt rows at input_batch.query_start_loc_np of its "
                     "req_ids and computes their logits with compute_logits")


def _judge(source: str | None) -> Probe:
    if not source:
        return Probe.old("GPUModelRunner has no _get_prompt_logprobs_dict: the self-check is off")
    missing = [u for u in USES if u not in source]
    if missing:
        return Probe.old(f"GPUModelRunner._get_prompt_logprobs_dict does not use {missing[0]!r}: the self-check is off")
    return Probe.new("vLLM finds a request's prompt rows at query_start_loc and computes their logits with compute_logits")


def probe(module) -> Probe:
    import importlib
    import importlib.util
    import inspect

    if importlib.util.find_spec(RUNNER) is None or asked_for():  # Model Runner V2 runs
        prompt = importlib.import_module(MRV2_PROMPT).PromptLogprobsWorker.compute_prompt_logprobs
        runner = importlib.import_module(MRV2).GPUModelRunner
        return _judge_mrv2(inspect.getsource(prompt), inspect.getsource(runner))
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    method = getattr(GPUModelRunner, "_get_prompt_logprobs_dict", None)
    return _judge(inspect.getsource(method) if method is not None else None)


def static_probe(view) -> Probe:
    if view.vllm.module_file(RUNNER) is None or asked_for():
        return _judge_mrv2(view.vllm.source(MRV2_PROMPT, "PromptLogprobsWorker", "compute_prompt_logprobs"),
                           view.vllm.text(MRV2))
    return _judge(view.vllm.source(RUNNER, "GPUModelRunner", "_get_prompt_logprobs_dict"))


def _setup(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    runner = instance.model_runner
    base, _ = find_base_model(runner.model)
    if not hasattr(runner, "input_batch") and MRV2_ROWS.id not in applied_ids():
        # Model Runner V2 keeps no persistent batch: its rows are found through mrv2-rows' layout
        why = f"{type(runner).__module__}.{type(runner).__name__} has no input_batch and mrv2-rows is off"
    else:
        why = compare.install_worker(instance, base, step_rows=step_rows)
    if why:
        say_off(why, _tp_rank())
    return result


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tp_group

        return get_tp_group().rank_in_group
    except Exception:  # noqa: BLE001 - no TP group (yet): the line is said, as by rank 0
        return 0


def say_off(why: str, rank: int) -> None:
    """The self-check is off in the workers (the same model, the same reason, on every rank): TP
    rank 0 says so once for the run; the other ranks at DEBUG, each with its rank."""
    if rank:
        log.debug("self-check: off in this worker (tp rank %d): %s", rank, why)
    else:
        log.warning("self-check: off in the workers (said by tp rank 0 for every rank): %s", why)


apply = wrapping({"HiddenStatesWorkerExtension._setup_hidden_states_capture": _setup})


PATCH = declare(
    title="vLLM's own final states of the checked requests, and the log-prob comparison (workers)",
    delta="no state independent of the capture to check its rows against -> vLLM's own, where its "
    "prompt log-probs come from",
    api="vLLM GPUModelRunner (input_batch.req_id_to_index, query_start_loc.np, model.compute_logits; "
    "Model Runner V2: InputBatch.req_ids, query_start_loc_np)",
    kind=Kind.FEATURE,
    optional=True,  # without it the rows are unchecked, not changed
    after=("v3", "mrv2-rows"),  # hooks after v3's capture hooks; uses mrv2-rows' step layout
    target=WORKER,
    upstream="not in speculators 0.3.x",
)
