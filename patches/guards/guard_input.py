"""guard-input -- clear errors for bad input, and a generator that stays usable.

Problem: not a vLLM delta. Bad input reaches vLLM as it is (a bad token id crashes a worker,
an empty sequence wedges the stock scheduler), and a failed call leaves requests behind.

How: the generator's ``__init__`` and ``generate`` are wrapped:

* Constructor: ``layer_ids`` must be ``None`` or a non-empty list of ints (the stock code
  checks the range only).
* ``generate(token_ids)``: an empty batch, an empty sequence, a non-integer token, a token
  outside the vocabulary or a tensor that is not a 2-D integer tensor raise
  :class:`~speculators_compat.errors.InvalidInputError` naming the sequence, before any
  request reaches vLLM (a bad token id would otherwise crash a worker). A sequence longer
  than ``max_model_len - 1`` is truncated as the stock code does, with a warning that names
  the sequence and both lengths.
* If the stock ``generate`` fails half-way, every request it left in the scheduler is
  aborted, the workers are told, and the capture buffer is reset, so the next call starts
  clean; the original error is re-raised.

Detection: the generator class defines the methods it wraps (``WRAPPERS``).

For speculators 0.3.x and 0.4.x. Remove: never, it is the library's own guard.
"""

from __future__ import annotations

import logging
import numbers

from speculators_compat.errors import InvalidInputError
from speculators_compat.registry import Kind, Patch, Side
from speculators_compat.targets import GENERATOR

from .._idle_output import forget_idle
from .._probes import generator_patch
from .._ranges import SPECULATORS_ALL

log = logging.getLogger("speculators_compat")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _sequence(i, seq):
    import torch

    if isinstance(seq, torch.Tensor):
        if seq.ndim != 1 or seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
            raise InvalidInputError(f"sequence {i}: expected a 1-D integer tensor, got {seq.dtype} of shape {tuple(seq.shape)}")
        return seq.tolist()
    if hasattr(seq, "tolist") and hasattr(seq, "dtype"):  # numpy arrays
        if getattr(seq.dtype, "kind", "") not in "iu" or getattr(seq, "ndim", 1) != 1:
            raise InvalidInputError(f"sequence {i}: expected a 1-D integer array, got dtype {seq.dtype}")
        return seq.tolist()
    if not isinstance(seq, (list, tuple)):
        raise InvalidInputError(f"sequence {i}: expected a list of token ids, got {type(seq).__name__}")
    if not all(_is_int(t) for t in seq):
        bad = next(t for t in seq if not _is_int(t))
        raise InvalidInputError(f"sequence {i}: token {bad!r} ({type(bad).__name__}) is not an integer token id")
    return [int(t) for t in seq]


def normalize(token_ids, vocab_size: int, max_len: int) -> list[list[int]]:
    """Validate ``token_ids`` and return them as a list of lists of ints."""
    import torch

    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 2:
            raise InvalidInputError(f"token_ids tensor must be 2-D [batch, seq_len], got shape {tuple(token_ids.shape)}")
        token_ids = list(token_ids)
    elif not isinstance(token_ids, (list, tuple)):
        raise InvalidInputError(f"token_ids must be a list of sequences or a 2-D tensor, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise InvalidInputError("token_ids is an empty batch: give at least one sequence")
    out = []
    for i, seq in enumerate(token_ids):
        ids = _sequence(i, seq)
        if not ids:
            raise InvalidInputError(f"sequence {i} is empty: every sequence needs at least one token")
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise InvalidInputError(f"sequence {i}: token id {bad} outside the vocabulary [0, {vocab_size - 1}]")
        if len(ids) > max_len:
            log.warning(
                "sequence %d has %d tokens, more than max_model_len - 1 = %d: truncated to %d tokens",
                i, len(ids), max_len, max_len,
            )
        out.append(ids)
    return out


def _init(wrapped, instance, args, kwargs):
    layer_ids = kwargs.get("layer_ids", args[1] if len(args) > 1 else None)
    if layer_ids is not None:
        if isinstance(layer_ids, (str, bytes)) or not hasattr(layer_ids, "__iter__"):
            raise InvalidInputError(f"layer_ids must be a list of ints, got {type(layer_ids).__name__}")
        layer_ids = list(layer_ids)
        bad = [x for x in layer_ids if not _is_int(x)]
        if bad or not layer_ids:
            raise InvalidInputError(f"layer_ids must be a non-empty list of ints, got {layer_ids!r}")
        if "layer_ids" in kwargs:
            kwargs["layer_ids"] = [int(x) for x in layer_ids]
        else:
            args = (args[0], [int(x) for x in layer_ids], *args[2:])
    return wrapped(*args, **kwargs)


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


def _generate(wrapped, instance, args, kwargs):
    if "token_ids" in kwargs:
        token_ids, rest = kwargs.pop("token_ids"), args
    else:
        token_ids, rest = args[0], args[1:]
    config = instance.vllm_config.model_config
    ids = normalize(token_ids, config.get_vocab_size(), config.max_model_len - 1)
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

probe, static_probe, apply = generator_patch("guard", WRAPPERS)


PATCH = Patch(
    id="guard-input",
    title="input validation and recovery",
    delta="bad input reaches vLLM (worker crash, unusable generator) -> clear error, generator stays usable",
    api="VllmHiddenStatesGenerator.__init__/generate",
    side=Side.DRIVER,
    kind=Kind.GUARD,
    depends_on=(),
    after=("driver-threads", "guard-output", "self-check"),  # wraps __init__, the output check and the self-check
    target=GENERATOR,
    vllm=">=0.11.1",
    speculators=SPECULATORS_ALL,
    probe=probe,
    static_probe=static_probe,
    apply=apply,
    remove_when="never: this is the library's own guard",
)
