"""``guard-input``'s token ids: the checks of a batch, and the form the stock ``generate()`` gets it in.

:func:`normalize` validates a batch (``InvalidInputError`` naming the sequence) and returns each
sequence as a new list of ints, or as a new 1-D int64 CPU tensor where the stock code takes tensors
(:func:`takes_tensors`). Nothing here imports torch: a tensor can only come from an imported torch.
"""

from __future__ import annotations

import logging
import numbers
import sys

from speculators_compat.patching import InvalidInputError

from .._probes import source_has

__all__ = ["TENSORS", "is_int", "normalize", "takes_tensors"]

log = logging.getLogger("speculators_compat")


def is_int(value) -> bool:
    """An integer that is not a bool (``numbers.Integral``: Python and numpy integers)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _torch():
    """torch if it is imported (a tensor can only come from an imported torch), else None."""
    return sys.modules.get("torch")


#: the type of a plain token id (``set(map(type, seq))`` of a valid list is this, or empty)
_PLAIN_INT = frozenset({int})


def _array_kind(i, seq, torch) -> bool:
    """``seq`` is a tensor or a numpy array (``InvalidInputError`` unless 1-D of integers), else False."""
    if torch is not None and isinstance(seq, torch.Tensor):
        if seq.ndim != 1 or seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
            raise InvalidInputError(f"sequence {i}: expected a 1-D integer tensor, got {seq.dtype} of shape {tuple(seq.shape)}")
        return True
    if hasattr(seq, "tolist") and hasattr(seq, "dtype"):  # numpy arrays
        if getattr(seq.dtype, "kind", "") not in "iu" or getattr(seq, "ndim", 1) != 1:
            raise InvalidInputError(f"sequence {i}: expected a 1-D integer array, got dtype {seq.dtype}")
        return True
    return False


def _sequence(i, seq, torch):
    if _array_kind(i, seq, torch):
        return seq.tolist()
    if not isinstance(seq, (list, tuple)):
        raise InvalidInputError(f"sequence {i}: expected a list of token ids, got {type(seq).__name__}")
    # the common case first, at C speed: every token exactly an int (a bool or a numpy integer
    # is a different type, and is judged one by one below)
    if set(map(type, seq)) <= _PLAIN_INT:
        return list(seq)
    if not all(is_int(t) for t in seq):
        bad = next(t for t in seq if not is_int(t))
        raise InvalidInputError(f"sequence {i}: token {bad!r} ({type(bad).__name__}) is not an integer token id")
    return [int(t) for t in seq]


def _as_tensor(i, seq, torch, max_len: int):
    """Sequence ``i`` as a new 1-D int64 CPU tensor of at most ``max_len`` ids (its own memory),
    with its lowest and highest id (``None``: empty) and its length before the cut."""
    if torch is not None and isinstance(seq, torch.Tensor) and _array_kind(i, seq, torch):
        whole = seq.detach().to(device="cpu", dtype=torch.int64)
        low_high = (int(whole.min()), int(whole.max())) if whole.numel() else None  # every id, as for a list
        return whole[:max_len].clone(), low_high, int(whole.shape[0])
    import numpy as np

    plain = isinstance(seq, (list, tuple)) and set(map(type, seq)) <= _PLAIN_INT
    ids = seq if plain or _array_kind(i, seq, torch) else _sequence(i, seq, torch)
    try:
        arr = np.array(ids, dtype=np.int64)
    except OverflowError:  # an id beyond int64: outside any vocabulary, named as for a list
        ids = _sequence(i, seq, torch)
        return None, (min(ids), max(ids)), len(ids)
    low_high = (int(arr.min()), int(arr.max())) if arr.size else None  # every id, as for a list
    return torch.from_numpy(arr[:max_len].copy() if arr.size > max_len else arr), low_high, len(ids)


#: sequences named in the truncation line (the count covers all of them)
TRUNCATED_NAMED = 3


def truncation_line(cut: list[tuple[int, int]], total: int, max_len: int) -> str:
    """One line for the sequences ``cut`` (``(index, length)``) of a call of ``total`` that were
    longer than ``max_len`` tokens."""
    if len(cut) == 1:
        i, n = cut[0]
        return (f"sequence {i} has {n} tokens, more than max_model_len - 1 = {max_len}: truncated to {max_len} "
                "tokens, as the stock code does")
    named = ", ".join(f"sequence {i} has {n}" for i, n in cut[:TRUNCATED_NAMED])
    more = ", ..." if len(cut) > TRUNCATED_NAMED else ""
    return (f"{len(cut)} of {total} sequences have more than max_model_len - 1 = {max_len} tokens ({named}{more}): "
            f"truncated to {max_len} tokens, as the stock code does")


def normalize(token_ids, vocab_size: int, max_len: int, tensors: bool = False, said: list | None = None) -> list:
    """Validate ``token_ids`` and return them as a list of lists of ints; with ``tensors`` (torch
    imported) as a list of new 1-D int64 CPU tensors, each cut to ``max_len``. Sequences cut are
    named in one warning per call; with ``said`` (a list kept per generator) in one warning per
    generator, the later calls' lines at DEBUG."""
    torch = _torch()
    if torch is not None and isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 2:
            raise InvalidInputError(f"token_ids tensor must be 2-D [batch, seq_len], got shape {tuple(token_ids.shape)}")
        token_ids = list(token_ids)
    elif not isinstance(token_ids, (list, tuple)):
        raise InvalidInputError(f"token_ids must be a list of sequences or a 2-D tensor, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise InvalidInputError("token_ids is an empty batch: give at least one sequence")
    tensors = tensors and torch is not None
    out, cut = [], []
    for i, seq in enumerate(token_ids):
        if tensors:
            ids, low_high, n = _as_tensor(i, seq, torch, max_len)
        else:
            ids = _sequence(i, seq, torch)
            low_high, n = ((min(ids), max(ids)) if ids else None), len(ids)
        if low_high is None:
            raise InvalidInputError(f"sequence {i} is empty: every sequence needs at least one token")
        low, high = low_high
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise InvalidInputError(f"sequence {i}: token id {bad} outside the vocabulary [0, {vocab_size - 1}]")
        if n > max_len:
            cut.append((i, n))
        out.append(ids)
    if cut:
        line = truncation_line(cut, len(out), max_len)
        if said is None:
            log.warning("%s", line)
        elif not said:
            said.append(True)
            log.warning("%s (said once per generator: later calls' truncations are logged at DEBUG, "
                        "SPECULATORS_COMPAT_VERBOSE=1)", line)
        else:
            log.debug("%s", line)
    return out


#: what the stock ``generate`` must do for int64 tensors to stand in for lists of token ids:
#: take a tensor's list for the request, and build each result's ``input_ids`` with
#: ``torch.as_tensor`` (which returns an int64 tensor itself)
TENSORS = ("ids.tolist() if isinstance(ids, torch.Tensor) else ids",
           "torch.as_tensor(input_ids_list[i], dtype=torch.long)")


def takes_tensors(generate) -> bool:
    """The stock ``generate`` turns each sequence into the forms above (:data:`TENSORS`)."""
    return source_has(generate, TENSORS)
