"""guard-input -- clear errors for bad input, and a generator that stays usable.

Problem: not a vLLM delta. Bad input reaches vLLM as it is (a bad token id crashes a worker,
an empty sequence wedges the stock scheduler), a failed call leaves requests behind, and a
local model folder that is missing reaches transformers as a hub repo id
(``HFValidationError: Repo id must be in the form 'repo_name' or 'namespace/repo_name'``).

How: the generator's ``__init__`` and ``generate`` are wrapped:

* Constructor, before anything loads (tokenizer, config, engine):
  ``tensor_parallel_size`` must be an int >= 1, except that 0 on a machine without an
  accelerator (speculators' offline script defaults it to ``torch.accelerator.device_count()``)
  is taken as 1 with a warning; ``layer_ids`` must be ``None`` or a non-empty list of ints; a ``model_path`` that is local
  -- absolute, ``./``, ``../``, ``~`` (expanded: neither transformers nor vLLM expand it), an
  existing file or folder, or not of a hub repo id's form (``name`` / ``org/name``) -- must be
  a readable folder with a readable, valid ``config.json``, else
  :class:`~speculators_compat.errors.InvalidInputError` names the path and what is missing;
  a hub-id-shaped path that does not exist locally is tried as a hub id, with one line
  saying so for ``org/name``: offline (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``) it must be
  in the hub cache, online one request asks the hub (``inputs.check_hub_id``): a model the hub
  does not have, or no hub reachable and the model not cached, is ``InvalidInputError`` at once
  (instead of transformers' minute of retries).
  Given ``layer_ids`` must be distinct and in ``[0, L - 1]`` (negative ids are rejected, as
  the stock code does: they do not count from the end), else ``InvalidInputError`` names the
  model's layer count ``L``: read from the local ``config.json`` (``num_hidden_layers``, or
  ``text_config.num_hidden_layers``); for a hub id (or a config that spells it otherwise) from
  the config the stock constructor loads itself (``AutoConfig.from_pretrained``, wrapped while
  the constructor runs), right after that load and before the engine starts. The stock code
  checks the range only and, with a duplicate, returns fewer tensors per sequence than ids.
* ``generate(token_ids)``: an empty batch, an empty sequence, a non-integer token, a token
  outside the vocabulary or a tensor that is not a 2-D integer tensor raise
  ``InvalidInputError`` naming the sequence, before any request reaches vLLM (a bad token id
  would otherwise crash a worker). A sequence longer than ``max_model_len - 1`` is truncated as
  the stock code does, with one warning per generator that counts the call's sequences cut and
  names the first of them with both lengths (later calls: DEBUG; the stock script cuts every
  full-length sample by one token, once per batch). The stock code
  gets each sequence as a new 1-D int64 tensor (``TENSORS``: it takes a tensor's list for the
  request, and its ``torch.as_tensor`` of the result's ``input_ids`` is then the tensor itself,
  not a conversion of 1,000s of Python ints per sequence), else as a new list of ints.
* If the stock ``generate`` fails half-way, every request it left in the scheduler is
  aborted, the workers are told, and the capture buffer is reset, so the next call starts
  clean; the original error is re-raised.

Detection: the generator class defines the methods it wraps (``WRAPPERS``), and its
``__init__`` loads the model config with ``AutoConfig.from_pretrained`` (the layer count).

For speculators 0.3.x and 0.4.x. Remove: never, it is the library's own guard.
"""

from __future__ import annotations

import contextvars
import logging
import os
import weakref

from speculators_compat.patching import GENERATOR, InvalidInputError, Probe, declare, inputs

# the model path's checks, shared with the runner (it checks the stock script's arguments): guard-input's names, as before
HUB_ID, HUB_ID_MAX, OFFLINE_VARS = inputs.HUB_ID, inputs.HUB_ID_MAX, inputs.OFFLINE_VARS
_nearest_existing, check_hub_id, check_model_path = inputs._nearest_existing, inputs.check_hub_id, inputs.check_model_path
hub_cached, hub_id_shaped, is_local, offline = inputs.hub_cached, inputs.hub_id_shaped, inputs.is_local, inputs.offline

from .._idle_output import forget_idle
from .._probes import generator_members, generator_methods, source_of
from ._token_ids import TENSORS, normalize, takes_tensors  # noqa: F401 (TENSORS: guard-input's own)
from ._token_ids import is_int as _is_int

log = logging.getLogger("speculators_compat")


# -- the constructor: model path and layer ids -------------------------------------------------

#: the stock constructor's config load, where the layer count of a hub model is read
CONFIG_CALL = "AutoConfig.from_pretrained("

#: while a constructor runs: [model path, layer ids] still to be checked against the config it loads
_pending: contextvars.ContextVar[list | None] = contextvars.ContextVar("speculators_compat_layer_ids", default=None)


def layer_count(config) -> int | None:
    """The decoder layer count as the stock constructor reads it (``num_hidden_layers``, else
    ``text_config.num_hidden_layers``), from a parsed config.json (dict) or a config object."""
    get = (lambda c, k: c.get(k) if isinstance(c, dict) else getattr(c, k, None))
    count = get(config, "num_hidden_layers")
    if count is None:
        text = get(config, "text_config")
        count = get(text, "num_hidden_layers") if text is not None else None
    return count if _is_int(count) else None


def check_layer_ids(layer_ids: list[int], count: int, where: str) -> None:
    """Every id in ``[0, count - 1]`` and none twice, else :class:`InvalidInputError` naming the count."""
    layers = f"the model has {count} decoder layers ({where}), ids 0 - {count - 1}"
    bad = [x for x in layer_ids if not 0 <= x < count]
    if bad:
        negative = " (negative ids do not count from the end: the stock generator rejects them too)" if bad[0] < 0 else ""
        raise InvalidInputError(f"layer_ids {layer_ids}: layer id {bad[0]} out of bounds [0, {count - 1}]: "
                                f"{layers}{negative}")
    twice = sorted({x for x in layer_ids if layer_ids.count(x) > 1})
    if twice:
        raise InvalidInputError(f"layer_ids {layer_ids}: layer id(s) {', '.join(map(str, twice))} given more than "
                                f"once; each result holds one tensor per distinct layer, so they would not line up "
                                f"with the ids ({layers})")


TP = "tensor_parallel_size"


def accelerators() -> int:
    """How many accelerators torch sees (0 on a CPU-only machine)."""
    import torch

    counter = getattr(getattr(torch, "accelerator", None), "device_count", None)
    return int(counter()) if counter is not None else int(torch.cuda.device_count())


def check_tensor_parallel_size(value, count) -> int:
    """The tensor-parallel size to use. 0 on a machine with no accelerator (``count()`` is 0) is
    taken as 1, with a warning: speculators' offline script defaults ``--tensor-parallel-size`` to
    ``torch.accelerator.device_count()``, 0 on a CPU, which vLLM would divide by. Anything else
    that is not an int >= 1 is an :class:`InvalidInputError` naming it."""
    if not _is_int(value):
        raise InvalidInputError(f"tensor_parallel_size {value!r} ({type(value).__name__}): expected an int >= 1, "
                                "the number of devices to split the model over")
    if value == 0:
        found = count()
        if found == 0:
            log.warning("tensor_parallel_size 0 (speculators' default, torch.accelerator.device_count(), on a "
                        "machine without an accelerator): running with 1")
            return 1
        raise InvalidInputError(f"tensor_parallel_size 0: expected an int >= 1 (this machine has {found} "
                                f"accelerator(s); e.g. --tensor-parallel-size {found})")
    if value < 0:
        raise InvalidInputError(f"tensor_parallel_size {value}: expected an int >= 1, the number of devices to "
                                "split the model over")
    return int(value)


def _tensor_parallel(wrapped, args, kwargs):
    """``args, kwargs`` with the tensor-parallel size checked (and 0 taken as 1 on a CPU)."""
    import inspect

    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except (TypeError, ValueError):  # the stock call fails the same way itself
        return args, kwargs
    if TP not in bound.arguments:
        return args, kwargs
    value = bound.arguments[TP]
    checked = check_tensor_parallel_size(value, accelerators)
    if checked is not value:
        bound.arguments[TP] = checked
        return bound.args, bound.kwargs
    return args, kwargs


def _init(wrapped, instance, args, kwargs):
    args, kwargs = _tensor_parallel(wrapped, args, kwargs)
    layer_ids = kwargs.get("layer_ids", args[1] if len(args) > 1 else None)
    if layer_ids is not None:
        if isinstance(layer_ids, (str, bytes)) or not hasattr(layer_ids, "__iter__"):
            raise InvalidInputError(f"layer_ids must be a list of ints, got {type(layer_ids).__name__}")
        layer_ids = list(layer_ids)
        bad = [x for x in layer_ids if not _is_int(x)]
        if bad or not layer_ids:
            raise InvalidInputError(f"layer_ids must be a non-empty list of ints, got {layer_ids!r}")
        layer_ids = [int(x) for x in layer_ids]
        if "layer_ids" in kwargs:
            kwargs["layer_ids"] = layer_ids
        else:
            args = (args[0], layer_ids, *args[2:])
    in_kwargs = "model_path" in kwargs
    model_path = kwargs["model_path"] if in_kwargs else (args[0] if args else None)
    pending = None
    if isinstance(model_path, (str, os.PathLike)):  # anything else is the stock code's to refuse
        path, config = check_model_path(model_path)
        if path is not model_path:
            if in_kwargs:
                kwargs["model_path"] = path
            else:
                args = (path, *args[1:])
        count = layer_count(config) if config is not None else None
        if layer_ids is not None:
            if count is not None:
                check_layer_ids(layer_ids, count, "config.json")
            else:  # a hub id, or a config that names its layer count otherwise: the stock load tells
                pending = [str(path), layer_ids]
    token = _pending.set(pending)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _pending.reset(token)


def _config_loaded(wrapped, instance, args, kwargs):
    """``AutoConfig.from_pretrained``: the first load of the constructing generator's own model
    checks its layer ids against the layer count of the config it returns."""
    config = wrapped(*args, **kwargs)
    pending = _pending.get()
    name = kwargs.get("pretrained_model_name_or_path", args[0] if args else None)
    if pending is not None and name is not None and str(name) == pending[0]:
        _pending.set(None)  # once: vLLM loads the same config again later
        count = layer_count(config)
        if count is not None:
            check_layer_ids(pending[1], count, f"its config, {type(config).__name__}")
    return config


def recover(generator) -> None:
    """Abort what a failed call left behind and tell the workers."""
    from vllm.v1.request import RequestStatus

    if getattr(generator.executor, "is_failed", False):
        return  # a worker died and vLLM shut the executor down: nothing left to recover
    scheduler = generator.scheduler
    left = list(scheduler.requests)
    if left:
        scheduler.finish_requests(left, RequestStatus.FINISHED_ABORTED)
    out = scheduler.schedule()
    forget_idle(scheduler)
    if out.total_num_scheduled_tokens == 0 and out.finished_req_ids:
        generator.executor.execute_model(out)
    generator.executor.collective_rpc("_reset_capture")
    log.info("recovered after a failed generate(): aborted %d request(s)", len(left))


#: generator class -> whether its stock ``generate`` takes tensors (read once per class)
_takes_tensors: dict = {}
#: generator -> [True] once a truncation was said (one warning per generator)
_truncation_said: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _generate(wrapped, instance, args, kwargs):
    if "token_ids" in kwargs:
        token_ids, rest = kwargs.pop("token_ids"), args
    else:
        token_ids, rest = args[0], args[1:]
    cls = type(instance)
    tensors = _takes_tensors.get(cls)
    if tensors is None:
        tensors = _takes_tensors[cls] = takes_tensors(cls.generate)
    config = instance.vllm_config.model_config
    try:
        said = _truncation_said.setdefault(instance, [])
    except TypeError:  # a generator that cannot be weakly referenced: one warning per call
        said = None
    ids = normalize(token_ids, config.get_vocab_size(), config.max_model_len - 1, tensors, said)
    try:
        return wrapped(ids, *rest, **kwargs)
    except Exception:
        try:
            recover(instance)
        except Exception as exc:  # the executor itself may be gone; the first error matters
            log.warning("could not recover the generator after a failed call: %s", exc)
        raise


#: method of VllmHiddenStatesGenerator -> its wrapper (the probes require exactly these)
WRAPPERS = {"__init__": _init, "generate": _generate}


def _judge(members: set[str], init_source: str) -> Probe:
    found = generator_methods("guard", tuple(WRAPPERS), members)
    if found.shape.value != "new":
        return found
    if CONFIG_CALL not in init_source:
        return Probe.unknown("VllmHiddenStatesGenerator.__init__ does not load its config with "
                             "AutoConfig.from_pretrained (where the layer count of a hub model is read)")
    return Probe.new("guard around VllmHiddenStatesGenerator.__init__/generate; layer ids checked against the "
                     "config the constructor loads (AutoConfig.from_pretrained)")


def probe(module) -> Probe:
    cls = module.VllmHiddenStatesGenerator
    init = source_of(cls.__init__) if "__init__" in vars(cls) and hasattr(module, "AutoConfig") else ""
    return _judge(set(vars(cls)), init)


def static_probe(view) -> Probe:
    return _judge(generator_members(view), view.speculators.source(GENERATOR, "VllmHiddenStatesGenerator", "__init__"))


def apply(module, patcher) -> None:
    patcher.wrap(module.AutoConfig, "from_pretrained", _config_loaded)
    for method, wrapper in WRAPPERS.items():
        patcher.wrap(module.VllmHiddenStatesGenerator, method, wrapper)


PATCH = declare(
    title="input validation and recovery",
    delta="bad input reaches vLLM (worker crash, unusable generator) -> clear error, generator stays usable",
    api="VllmHiddenStatesGenerator.__init__/generate",
    after=("driver-threads", "guard-output", "self-check"),  # wraps __init__, the output check and the self-check
    remove_when="never: this is the library's own guard",
)
