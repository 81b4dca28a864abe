"""guard-input's validation of the token ids, without vLLM or torch (the unit environment has neither)."""

from __future__ import annotations

import enum
import sys

import pytest

from speculators_compat.errors import InvalidInputError
from speculators_compat.patches.guards import guard_input


class Token(enum.IntEnum):
    A = 3


def test_plain_ints_come_back_as_new_lists():
    seqs = [[1, 2, 3], (4, 5)]
    out = guard_input.normalize(seqs, 10, 100)
    assert out == [[1, 2, 3], [4, 5]]
    assert all(type(s) is list for s in out) and out[0] is not seqs[0]
    assert all(type(t) is int for s in out for t in s)


def test_int_subclasses_are_taken_as_ints():
    out = guard_input.normalize([[Token.A, 1]], 10, 100)
    assert out == [[3, 1]] and all(type(t) is int for t in out[0])


@pytest.mark.parametrize("bad, message", [
    ([], "empty batch"),
    ([[1], []], "sequence 1 is empty"),
    ([[1, 2.5]], "token 2.5 (float) is not an integer"),
    ([[1, True]], "token True (bool) is not an integer"),
    ([[1, "2"]], "token '2' (str) is not an integer"),
    ([[1, 10]], "token id 10 outside the vocabulary [0, 9]"),
    ([[-1, 2]], "token id -1 outside the vocabulary"),
    ("12", "must be a list of sequences"),
    ([5], "sequence 0: expected a list of token ids, got int"),
])
def test_bad_input_is_named(bad, message):
    with pytest.raises(InvalidInputError) as err:
        guard_input.normalize(bad, 10, 100)
    assert message in str(err.value)


def test_a_large_batch_is_checked_whole():
    batch = [[(i * 7 + j) % 31000 for j in range(1024)] for i in range(64)]
    batch[63][1000] = 31000
    with pytest.raises(InvalidInputError, match="sequence 63: token id 31000 outside"):
        guard_input.normalize(batch, 31000, 2047)
    batch[63][1000] = 1.0
    with pytest.raises(InvalidInputError, match=r"sequence 63: token 1\.0 \(float\)"):
        guard_input.normalize(batch, 31000, 2047)


def test_no_torch_needed_for_lists():
    if "torch" in sys.modules:
        pytest.skip("torch is imported in this process")
    guard_input.normalize([[1, 2]], 10, 100)
    assert "torch" not in sys.modules
