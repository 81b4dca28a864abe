"""pipelined-steps on a stand-in executor (the ordering logic; the real one runs end to end)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"pipelined-steps": "a feature (same data, less time): this file, benchmarks/gpu.py"}

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


class Request:
    def __init__(self, rid, tokens):
        self.request_id, self.num_prompt_tokens = rid, tokens


class Scheduler:
    """Schedules whole prompts from the front of its queue up to the budget, as vLLM's does with
    chunked prefill off; records what the stock loop and the early step do to it."""

    max_num_scheduled_tokens, max_num_running_reqs = 100, 3

    def __init__(self, events):
        self.events, self.waiting = events, []

    def add_request(self, request):
        self.events.append(("add", request.request_id))
        self.waiting.append(request)

    def schedule(self):
        out, budget = Output(0), self.max_num_scheduled_tokens
        out.num_scheduled_tokens = {}
        while self.waiting and len(out.num_scheduled_tokens) < self.max_num_running_reqs:
            if self.waiting[0].num_prompt_tokens > budget:
                break
            req = self.waiting.pop(0)
            budget -= req.num_prompt_tokens
            out.num_scheduled_tokens[req.request_id] = req.num_prompt_tokens
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        self.events.append(("schedule", list(out.num_scheduled_tokens)))
        return out

    def finish_requests(self, ids, status):
        self.events.append(("finish", list(ids)))


def done():
    fut = Future()
    fut.set_result(None)
    return fut


class Generator:
    def __init__(self, events):
        self.scheduler = Scheduler(events)
        real = Executor()
        real.collective_rpc = lambda method, *a, **k: events.append(("rpc", method)) or [method]
        real.execute_model = lambda out, non_block=False: events.append(("step", list(out.num_scheduled_tokens))) or done()
        real.sample_tokens = lambda grammar, non_block=False: done()
        self.executor = pipelined_steps.PipelinedExecutor(real)


def stock_call(gen, lengths):
    """The stock loop (STOCK_LOOP) with plain stand-ins."""
    for i, n in enumerate(lengths):
        gen.scheduler.add_request(Request(f"r{i}", n))
    gen.executor.collective_rpc("_reset_capture")
    while (out := gen.scheduler.schedule()).total_num_scheduled_tokens > 0:
        gen.executor.execute_model(out)
        for rid in out.num_scheduled_tokens:
            gen.scheduler.finish_requests([rid], None)
    gen.executor.collective_rpc("_get_captured_states")


def run_call(lengths, early):
    import types

    events = []
    gen = Generator(events)
    scheduler = gen.scheduler
    if early:
        gen.vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(enable_chunked_prefill=False),
                                                cache_config=types.SimpleNamespace(enable_prefix_caching=False))
        gen.scheduler = pipelined_steps._first_step(gen)
        assert gen.scheduler is not None
    stock_call(gen, lengths)
    gen.scheduler = scheduler
    return events, gen


@pytest.mark.parametrize("lengths", [[40, 40, 40, 40, 10], [30, 30, 30, 30, 30], [10] * 8, [100, 1, 1], [20, 20]])
def test_the_early_first_step_is_the_stock_one_sent_before_the_rest_is_added(lengths, monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "vllm.v1.request", types.SimpleNamespace(RequestStatus=types.SimpleNamespace(
        FINISHED_ABORTED=None)))
    stock, _ = run_call(lengths, early=False)
    early, gen = run_call(lengths, early=True)
    steps = [e for e in stock if e[0] == "step"]
    # the same steps, the same requests finished, the capture reset once, before the first step
    assert [e for e in early if e[0] == "step"] == steps
    assert [e for e in early if e[0] == "finish"] == [e for e in stock if e[0] == "finish"]
    assert [e for e in early if e[0] == "rpc"] == [("rpc", "_reset_capture"), ("rpc", "_get_captured_states")]
    assert early.index(("rpc", "_reset_capture")) < early.index(steps[0])
    sent_before_last_add = early.index(steps[0]) < early.index(("add", f"r{len(lengths) - 1}"))
    fills_a_step = sum(lengths[:-1]) >= 100 or len(lengths) - 1 > 3
    assert sent_before_last_add == fills_a_step, early
    assert pipelined_steps.early_first_steps(gen) == (1 if sum(lengths) >= 100 or len(lengths) > 3 else 0)


def test_no_early_first_step_with_chunked_prefill_or_prefix_caching_on():
    import types

    gen = Generator([])
    for chunked, prefix in ((True, False), (False, True), (None, False)):
        gen.vllm_config = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(enable_chunked_prefill=chunked),
                                                cache_config=types.SimpleNamespace(enable_prefix_caching=prefix))
        assert pipelined_steps._first_step(gen) is None
    gen.vllm_config.scheduler_config.enable_chunked_prefill = False
    gen.vllm_config.cache_config.enable_prefix_caching = False
    assert pipelined_steps._first_step(gen) is not None
    gen.executor = gen.executor.__wrapped__  # no pipelined executor among the generator's views
    assert pipelined_steps._first_step(gen) is None


def test_the_stock_loop_is_recognised_and_another_is_not():
    def stock(self, token_ids):
        for i, ids in enumerate(token_ids):
            self.scheduler.add_request(req)  # noqa: F821
        self._request_counter += 1
        self.executor.collective_rpc("_reset_capture")
        while (
            scheduler_output := self.scheduler.schedule()
        ).total_num_scheduled_tokens > 0:
            self.executor.execute_model(scheduler_output)
            for req_id in scheduler_output.num_scheduled_tokens:
                self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)  # noqa: F821

    def other(self, token_ids):
        for i, ids in enumerate(token_ids):
            self.scheduler.add_request(req)  # noqa: F821
        self.executor.collective_rpc("_reset_capture")
        while (scheduler_output := self.scheduler.schedule()).total_num_scheduled_tokens > 0:
            self.executor.execute_model(scheduler_output)

    assert pipelined_steps.stock_loop(stock) and not pipelined_steps.stock_loop(other)
    assert not pipelined_steps.stock_loop(len)
