"""guard-output: every result checked against its input (count, ids, layers, shapes, device,
finite values); a result that breaks the contract raises CaptureContractError naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculators_compat.errors import CaptureContractError

torch = pytest.importorskip("torch")

from speculators_compat.patches.guards import guard_output  # noqa: E402


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"guard-output": "with v1-chunked-prefill: tests/patches/vllm_api/test_v1_chunked_prefill.py NEEDED"}


def _generator(max_len=6, hidden=4, layers=(2, 1)):
    config = SimpleNamespace(max_model_len=max_len, get_hidden_size=lambda: hidden)
    return SimpleNamespace(vllm_config=SimpleNamespace(model_config=config), layer_ids=list(layers))


def _result(ids, hidden=4, layers=2):
    return {"input_ids": torch.tensor(ids), "hidden_states": [torch.zeros(len(ids), hidden) for _ in range(layers)]}


def test_the_stock_contract_passes_and_each_break_is_named():
    gen = _generator()
    inputs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]  # the second is cut at max_model_len - 1
    good = [_result([1, 2, 3]), _result([4, 5, 6, 7, 8])]
    guard_output.check(gen, inputs, good)
    with pytest.raises(CaptureContractError, match="produced 1 results for 2 sequences"):
        guard_output.check(gen, inputs, good[:1])
    with pytest.raises(CaptureContractError, match="sequence 1: input_ids do not match"):
        guard_output.check(gen, inputs, [good[0], _result([5, 4, 6, 7, 8])])
    with pytest.raises(CaptureContractError, match="sequence 0: 1 hidden-state tensors"):
        guard_output.check(gen, inputs, [_result([1, 2, 3], layers=1), good[1]])
    with pytest.raises(CaptureContractError, match=r"sequence 0, layer 1: shape \(3, 5\)"):
        guard_output.check(gen, inputs, [_result([1, 2, 3], hidden=5), good[1]])
    bad = _result([1, 2, 3])
    bad["hidden_states"][1][0, 0] = float("nan")
    with pytest.raises(CaptureContractError, match="sequence 0, layer 2: non-finite values"):
        guard_output.check(gen, inputs, [bad, good[1]])


def test_the_output_guard_compares_ids_as_given_and_names_a_reordered_sequence():
    torch = pytest.importorskip("torch")
    import types

    from speculators_compat.errors import CaptureContractError
    from speculators_compat.patches.guards import guard_output

    class Ids(torch.Tensor):
        def __iter__(self):
            raise AssertionError("the guard walked a token tensor element by element")

    config = types.SimpleNamespace(max_model_len=6, get_hidden_size=lambda: 4)
    generator = types.SimpleNamespace(vllm_config=types.SimpleNamespace(model_config=config), layer_ids=[1, 3])
    seqs = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]  # the second one truncated to max_model_len - 1

    def results():
        return [{"input_ids": torch.tensor(s[:5]), "hidden_states": [torch.zeros(len(s[:5]), 4)] * 2} for s in seqs]

    for given in (seqs, [torch.tensor(s).as_subclass(Ids) for s in seqs]):
        got = guard_output._generate(lambda *a: results(), generator, (given,), {})
        assert [r["input_ids"].tolist() for r in got] == [s[:5] for s in seqs]
        swapped = results()[::-1]
        with pytest.raises(CaptureContractError, match="sequence 0: input_ids do not match"):
            guard_output._generate(lambda *a: swapped, generator, (given,), {})
