"""pipelined-steps on a stand-in executor (the ordering logic; the real one runs end to end)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

pytest.importorskip("wrapt")

from speculators_compat.patches.features import pipelined_steps  # noqa: E402


class Output:
    def __init__(self, tokens):
        self.total_num_scheduled_tokens = tokens


class Executor:
    """Records what reaches the workers; non-blocking calls return futures the test resolves."""

    def __init__(self):
        self.sent, self.futures = [], []

    def _call(self, name, arg, non_block=False):
        self.sent.append((name, arg, non_block))
        if not non_block:
            return f"{name} reply"
        fut = Future()
        self.futures.append(fut)
        return fut

    def execute_model(self, out, non_block=False):
        return self._call("execute_model", out, non_block)

    def sample_tokens(self, grammar, non_block=False):
        return self._call("sample_tokens", grammar, non_block)

    def collective_rpc(self, method, *args, **kwargs):
        self.sent.append(("collective_rpc", method, False))
        return [method]


def test_steps_are_sent_without_waiting_and_awaited_before_any_other_call():
    real = Executor()
    ex = pipelined_steps.PipelinedExecutor(real)
    for step in range(2):
        assert ex.execute_model(Output(8)) is None
        assert ex.sample_tokens(None) is None
    assert [s[2] for s in real.sent] == [True] * 4
    for f in real.futures:
        f.set_result(None)
    assert ex.collective_rpc("_get_captured_states") == ["_get_captured_states"]
    assert not ex._self_pending


def test_no_more_than_in_flight_replies_are_left_outstanding():
    real = Executor()
    ex = pipelined_steps.PipelinedExecutor(real)
    for _ in range(pipelined_steps.IN_FLIGHT):
        ex.execute_model(Output(8))
    real.futures[0].set_result(None)  # the oldest must be awaited before the next is sent
    ex.execute_model(Output(8))
    assert len(ex._self_pending) == pipelined_steps.IN_FLIGHT
    assert real.futures[0] not in ex._self_pending


def test_a_step_error_is_raised_before_the_next_call_reaches_the_workers():
    real = Executor()
    ex = pipelined_steps.PipelinedExecutor(real)
    ex.execute_model(Output(8))
    ex.sample_tokens(None)
    real.futures[0].set_exception(RuntimeError("worker failed"))
    real.futures[1].set_result(None)
    with pytest.raises(RuntimeError, match="worker failed"):
        ex.collective_rpc("_get_captured_states")
    assert real.sent[-1][0] == "sample_tokens"  # the rpc itself was not sent
    assert not ex._self_pending  # every reply was taken off the queue


def test_an_idle_step_is_sent_without_waiting_and_awaited_by_the_next_call():
    """The finished ids after a call (a step with no tokens): sent like a step, in order after
    the steps; generate() does not wait for it, the next message to the workers does."""
    real = Executor()
    ex = pipelined_steps.PipelinedExecutor(real)
    ex.execute_model(Output(8))
    assert ex.execute_model(Output(0)) is None
    assert [(s[0], s[1].total_num_scheduled_tokens, s[2]) for s in real.sent] == [
        ("execute_model", 8, True), ("execute_model", 0, True)]
    assert len(ex._self_pending) == 2
    for f in real.futures:
        f.set_result(None)
    assert ex.collective_rpc("arm") == ["arm"]
    assert not ex._self_pending
