"""v3 -- worker-side capture through decoder-layer hooks (no replaced forward).

Delta (vLLM 0.11.1 and later):
  * the base-model embedding method ``get_input_embeddings`` was renamed
    ``embed_input_ids``; the stock replacement forward calls the old name and fails with
    AttributeError during worker warm-up, i.e. inside executor start-up;
  * the base model is not always ``model.model`` (``KimiK25ForConditionalGeneration``:
    ``language_model.model`` in 0.16, a bare ``language_model`` in 0.15.x);
  * decoder layers take model-specific arguments that vLLM's own forward passes
    (``llama_4_scaling`` on DeepSeek-V2/V3 since 0.12) and the stock forward drops.

How: ``HiddenStatesWorkerExtension._setup_hidden_states_capture`` is wrapped and no longer
replaces ``base_model.forward``. vLLM's own forward runs unchanged; on TP rank 0 a forward
hook on each requested decoder layer records ``hidden_states + residual`` (the layer's two
outputs, full hidden size after the layer's all-reduce) -- exactly what the stock forward
captured -- and the hook of the highest requested layer hands the step's states to the
stock ``_store_captured_states``. ``_reset_capture`` and ``_get_captured_states`` stay
stock. Calling setup again replaces the hooks (idempotent). Pipeline parallelism (never
configured by the stock generator) is refused with a clear error.

Detection: vLLM's reference dense base model ``LlamaModel`` has ``embed_input_ids`` and no
``get_input_embeddings`` (new), or still has ``get_input_embeddings`` (old).

Applied in every worker process (reached through the ``vllm.general_plugins`` entry point,
see ``speculators_compat.plugin``). Remove when speculators 0.3.x is no longer supported.
"""

from __future__ import annotations

import functools
import logging

from speculators_compat.patching import WORKER, IncompatibleVllmError, InvalidInputError, Probe, declare

from .._probes import vllm_module, wrapping

log = logging.getLogger("speculators_compat")

HOOKS = "_speculators_compat_hooks"
BASE_MODEL_PATHS = ("model", "language_model.model", "language_model")


def probe(module) -> Probe:
    from vllm.model_executor.models.llama import LlamaModel

    return _judge(set(dir(LlamaModel)))


def static_probe(view) -> Probe:
    module = vllm_module(view, "LlamaModel")
    if not view.vllm.mro(module, "LlamaModel"):
        raise LookupError(f"cannot read {module}.LlamaModel from the installed sources")
    return _judge(view.vllm.members(module, "LlamaModel"))


def _judge(names) -> Probe:
    if "embed_input_ids" in names and "get_input_embeddings" not in names:
        return Probe.new("LlamaModel has embed_input_ids, not get_input_embeddings")
    if "get_input_embeddings" in names:
        return Probe.old("LlamaModel has get_input_embeddings")
    return Probe.unknown("LlamaModel has neither embed_input_ids nor get_input_embeddings")


def find_base_model(model):
    """The module holding the decoder layers, and the attribute path that reached it."""
    for path in BASE_MODEL_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "layers"):
            return obj, path
    raise IncompatibleVllmError(
        f"{type(model).__name__}: no base model with decoder layers at any of "
        f"{', '.join(BASE_MODEL_PATHS)}; this model class is not known to speculators_compat"
    )


def _on_layer(extension, idx, first, last, step, module, inputs, output):
    if not (isinstance(output, tuple) and len(output) == 2):
        raise IncompatibleVllmError(
            f"decoder layer {idx} ({type(module).__name__}) returned {type(output).__name__}; "
            "expected (hidden_states, residual)"
        )
    hidden, residual = output
    if idx == first:
        step.clear()
    step[idx] = hidden + residual if residual is not None else hidden.clone()
    if idx == last:
        states = [step.pop(i) for i in sorted(step)]
        extension._store_captured_states(states)


def remove_hooks(extension) -> None:
    for handle in extension.__dict__.pop(HOOKS, ()):
        handle.remove()


def _setup(wrapped, instance, args, kwargs):
    from vllm.distributed import get_pp_group, get_tp_group

    layer_ids = args[0] if args else kwargs["layer_ids"]
    remove_hooks(instance)
    instance._layer_ids = frozenset(layer_ids)
    instance._captured_states = None
    model = instance.model_runner.model
    base, path = find_base_model(model)
    if get_pp_group().world_size > 1:
        raise IncompatibleVllmError(
            "pipeline parallel capture is not supported by speculators_compat (the stock "
            "generator never configures it); use tensor parallelism"
        )
    start = getattr(base, "start_layer", 0)
    end = getattr(base, "end_layer", len(base.layers))
    wanted = sorted(set(layer_ids))
    bad = [i for i in wanted if not start <= i < end]
    if bad or not wanted:
        raise InvalidInputError(f"layer ids {bad or layer_ids} outside the model's layers [{start}, {end - 1}]")
    handles = []
    if get_tp_group().rank_in_group == 0:
        step: dict[int, object] = {}
        for idx in wanted:
            hook = functools.partial(_on_layer, instance, idx, wanted[0], wanted[-1], step)
            handles.append(base.layers[idx].register_forward_hook(hook))
    instance.__dict__[HOOKS] = handles
    log.info(
        "capture hooks on %s.%s layers %s (%s, tp rank %d)",
        type(model).__name__,
        path,
        wanted,
        "recording" if handles else "not recording",
        get_tp_group().rank_in_group,
    )


apply = wrapping({"HiddenStatesWorkerExtension._setup_hidden_states_capture": _setup})


PATCH = declare(
    title="capture through decoder-layer hooks, vLLM's own forward unchanged",
    delta="base model get_input_embeddings -> embed_input_ids; base model path; decoder-layer arguments",
    api="speculators HiddenStatesWorkerExtension._setup_hidden_states_capture on vllm VllmModel",
    family="capture",
    target=WORKER,
    upstream="speculators 0.4.0 calls embed_input_ids (still replaces the forward)",
)
