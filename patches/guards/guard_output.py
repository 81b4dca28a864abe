"""guard-output -- refuse to return captured states that break the contract.

Problem: not a vLLM delta, the check that catches what no patch knows yet (a future vLLM
change that reorders, drops or mixes rows).

How: ``VllmHiddenStatesGenerator.generate`` is wrapped; before it returns it verifies: one
result per input sequence, ``input_ids`` equal to the (truncated) input in input order, one
tensor per requested layer (distinct layer ids, ascending, as the stock capture orders
them), each of shape ``[len(input_ids), hidden_size]``, on the CPU, with finite values (a block
that ``results-in-place`` filled is not scanned on the host when the worker's sums of its
layer were finite: a single inf or nan makes that sum non-finite).
A violation raises :class:`~speculators_compat.errors.CaptureContractError` naming the
sequence and the layer.

Detection: the generator class defines the methods it wraps (``WRAPPERS``).

For speculators 0.3.x and 0.4.x. Remove: never, it is the library's own guard.
"""

from __future__ import annotations

from speculators_compat.patching import CaptureContractError, declare

from .._probes import generator_patch
from ..features.datapath._runtime.reply import transfer_of


def check(generator, inputs, results) -> None:
    import torch

    if not isinstance(results, list) or len(results) != len(inputs):
        got = len(results) if isinstance(results, list) else type(results).__name__
        raise CaptureContractError(f"generate() produced {got} results for {len(inputs)} sequences")
    config = generator.vllm_config.model_config
    max_len = config.max_model_len - 1
    hidden = config.get_hidden_size()
    layers = sorted(set(generator.layer_ids))
    transfer = transfer_of(generator)  # this call's (None: its rows did not go through the segments)
    for i, (ids, result) in enumerate(zip(inputs, results)):
        n = min(len(ids), max_len)
        got_ids = result["input_ids"]
        if got_ids.shape != (n,) or not _same_ids(torch, got_ids, ids[:n]):
            raise CaptureContractError(f"sequence {i}: input_ids do not match the input (order or length changed)")
        states = result["hidden_states"]
        if len(states) != len(layers):
            raise CaptureContractError(f"sequence {i}: {len(states)} hidden-state tensors for layers {layers}")
        for layer, t in zip(layers, states):
            if tuple(t.shape) != (n, hidden):
                raise CaptureContractError(
                    f"sequence {i}, layer {layer}: shape {tuple(t.shape)}, expected ({n}, {hidden})"
                )
            if t.device.type != "cpu":
                raise CaptureContractError(f"sequence {i}, layer {layer}: tensor on {t.device}, expected cpu")
            if not (transfer is not None and transfer.certified(t)) and not bool(torch.isfinite(t).all()):
                raise CaptureContractError(f"sequence {i}, layer {layer}: non-finite values")


def _same_ids(torch, got, want) -> bool:
    """``got`` (a 1-D tensor) holds the token ids ``want`` (a 1-D tensor or a list of ints)."""
    if isinstance(want, torch.Tensor):
        if got.dtype == want.dtype and got.data_ptr() == want.data_ptr() and got.shape == want.shape:
            return True  # the same memory (the stock code's input_ids is the tensor guard-input gave it)
        return torch.equal(got, want.to(device=got.device, dtype=got.dtype))
    return got.tolist() == want  # a list compared at C speed, no tensor built from it


def _generate(wrapped, instance, args, kwargs):
    token_ids = kwargs["token_ids"] if "token_ids" in kwargs else args[0]
    results = wrapped(*args, **kwargs)
    # each sequence as given (a 1-D tensor, or a list), never iterated element by element
    inputs = token_ids.tolist() if hasattr(token_ids, "tolist") else [
        s if isinstance(s, list) or hasattr(s, "dim") else list(s) for s in token_ids]
    check(instance, inputs, results)
    return results


#: method of VllmHiddenStatesGenerator -> its wrapper (the probes require exactly these)
WRAPPERS = {"generate": _generate}

probe, static_probe, apply = generator_patch("guard", WRAPPERS)


PATCH = declare(
    title="output contract",
    delta="wrong, missing or reordered rows returned silently -> CaptureContractError",
    api="VllmHiddenStatesGenerator.generate",
    after=("s04-result-order", "results-in-place"),  # checks what the repaired generate() returns
    remove_when="never: this is the library's own guard",
)
