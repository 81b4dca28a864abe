"""self-check: the driver side without vLLM -- options, sampling, verdicts, totals, and how the
caller's rows reach the workers.

End to end on the real vLLM, with faults injected: the scenario's ``selfcheck`` step (tests/test_e2e.py)."""

from __future__ import annotations

import types

import pytest

from speculators_compat.core import _env
from speculators_compat.patches.features.datapath._runtime import checking as selfcheck
from speculators_compat.patches.features.datapath._runtime import compare
from speculators_compat.errors import InvalidInputError, SelfCheckError


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"self-check": "the scenario's selfcheck step (every injected fault caught)"}


def test_options(monkeypatch):
    monkeypatch.delenv(selfcheck.SELF_CHECK_ENV, raising=False)
    monkeypatch.delenv(selfcheck.TOLERANCE_ENV, raising=False)
    assert selfcheck.sequences_per_call() == selfcheck.DEFAULT_SEQUENCES
    assert selfcheck.tolerance() == selfcheck.DEFAULT_TOLERANCE
    for raw, want in [("0", 0), ("3", 3), (" all ", selfcheck.ALL), ("ALL", selfcheck.ALL)]:
        monkeypatch.setenv(selfcheck.SELF_CHECK_ENV, raw)
        assert selfcheck.sequences_per_call() == want
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv(selfcheck.SELF_CHECK_ENV, bad)
        with pytest.raises(InvalidInputError, match="SPECULATORS_COMPAT_SELF_CHECK"):
            selfcheck.sequences_per_call()
    monkeypatch.setenv(selfcheck.TOLERANCE_ENV, "0.5")
    assert selfcheck.tolerance() == 0.5
    for bad in ("0", "-1", "x", "nan"):
        monkeypatch.setenv(selfcheck.TOLERANCE_ENV, bad)
        with pytest.raises(InvalidInputError, match="TOLERANCE"):
            selfcheck.tolerance()


def test_positions_option(monkeypatch):
    monkeypatch.delenv(selfcheck.POSITIONS_ENV, raising=False)
    assert selfcheck.positions_per_sequence() == selfcheck.DEFAULT_POSITIONS == 128
    for raw, want in [("all", 0), (" ALL ", 0), ("2", 2), ("500", 500)]:
        monkeypatch.setenv(selfcheck.POSITIONS_ENV, raw)
        assert selfcheck.positions_per_sequence() == want
    for bad in ("0", "1", "-3", "many", "1.5"):
        monkeypatch.setenv(selfcheck.POSITIONS_ENV, bad)
        with pytest.raises(InvalidInputError, match="SPECULATORS_COMPAT_SELF_CHECK_POSITIONS"):
            selfcheck.positions_per_sequence()


@pytest.mark.parametrize("n,most", [(1024, 128), (1000, 128), (129, 128), (300, 2), (5000, 7)])
def test_compared_positions_are_spread_hold_the_last_and_cover_every_position_over_calls(n, most):
    seen = set()
    for call in range(1000):
        at = selfcheck.positions(n, most, call)
        # at most `most`, the last always, at least one before it (a shift by one keeps the last row)
        assert at == sorted(set(at)) and 2 <= len(at) <= most and at[-1] == n - 1 and 0 <= at[0]
        assert len({b - a for a, b in zip(at, at[1:-1])}) <= 1  # evenly spread (the last position apart)
        assert len(at) >= min(most, n) // 2  # not far below the number asked for
        seen.update(at)
    assert seen == set(range(n))  # consecutive calls compare every position


def test_short_sequences_and_all_compare_every_position():
    assert selfcheck.positions(128, 128, 5) is None
    assert selfcheck.positions(3, 128, 0) is None
    assert selfcheck.positions(10_000, 0, 7) is None


def test_unvalidated_opt_in(monkeypatch):
    monkeypatch.delenv(_env.UNVALIDATED, raising=False)
    assert not _env.unvalidated_self_check() and selfcheck.full_calls() == 0
    monkeypatch.setenv(_env.UNVALIDATED, " Self-Check ")
    assert _env.unvalidated_self_check() and selfcheck.full_calls() == selfcheck.FULL_CALLS
    monkeypatch.setenv(_env.UNVALIDATED, "yes")
    assert _env.unvalidated() == "yes" and not _env.unvalidated_self_check()


def test_sampling_is_reproducible_and_covers_the_batch():
    assert selfcheck.sample(5, 0, 0) == []
    assert selfcheck.sample(5, 3, selfcheck.ALL) == [0, 1, 2, 3, 4]
    assert selfcheck.sample(3, 9, 7) == [0, 1, 2]
    assert selfcheck.sample(64, 2, 0, full=8) == list(range(64))  # the first calls of the opt-in: all
    picks = [selfcheck.sample(64, call, 1, full=8) for call in range(8, 400)]
    assert all(len(p) == 1 for p in picks)
    assert picks == [selfcheck.sample(64, call, 1, full=8) for call in range(8, 400)]
    assert len({p[0] for p in picks}) > 48  # every batch position gets its turn
    two = selfcheck.sample(64, 11, 2)
    assert len(set(two)) == 2 and two == sorted(two)


def result(**kw):
    base = {"sequence": 3, "tokens": 10, "rows": 10, "missing": 0, "first_missing": None,
            "worst": 1e-3, "nats": 0.01, "position": 4}
    return {**base, **kw}


def test_verdict_names_the_sequence_the_position_and_the_difference():
    assert selfcheck.verdict([result(), result(sequence=4)], 0.03) is None
    msg = selfcheck.verdict([result(), result(sequence=7, worst=0.42, nats=1.5, position=9)], 0.03)
    assert "sequence 7, position 9" in msg and "0.42" in msg and "1.5 nats" in msg and "0.03" in msg
    assert "9 last-layer rows for 10 tokens" in selfcheck.verdict([result(rows=9)], 0.03)
    assert "no state for 2 of its 10 positions (first: 8)" in selfcheck.verdict([result(missing=2, first_missing=8)], 0.03)
    assert selfcheck.verdict([result(worst=float("inf"))], 0.03)
    assert selfcheck.verdict([result(worst=float("nan"))], 0.03)


def test_totals_and_the_end_line(monkeypatch):
    monkeypatch.delenv(selfcheck.TOLERANCE_ENV, raising=False)
    gen = types.SimpleNamespace()
    assert selfcheck.summary(gen) is None and selfcheck.summary_text(gen) is None
    totals = selfcheck.totals_of(gen)
    totals.add([result(rows=10, worst=0.002), result(sequence=5, rows=7, worst=0.004, nats=0.02, position=6)], call=2)
    totals.add([result(rows=300, compared=128, worst=0.001)], call=5)
    s = selfcheck.summary(gen)
    assert (s["calls"], s["sequences"], s["rows"], s["positions"]) == (2, 3, 317, 145)
    assert s["worst_relative"] == 0.004 and s["worst_at"] == "call 2, sequence 5, position 6"
    assert s["worst_nats"] == 0.02 and s["failed"] is None
    assert selfcheck.summary_text(gen) == "self-check: 3 sequences, 317 rows (145 positions compared) in 2 calls, worst 0.004 (0.02 nats) against 0.03, 0.0 s"
    totals.deferred = 2
    assert selfcheck.summary_text(gen).endswith(", 0.0 s, 2 verdicts taken after their call")
    assert s["deferred"] == 0 and selfcheck.summary(gen)["deferred"] == 2
    totals.off = "the workers do not run self-check-reference"
    assert "self-check off (the workers" in selfcheck.summary_text(gen)


def test_shared_rows_reach_the_workers_bit_for_bit(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("SPECULATORS_COMPAT_SHM_DIR", str(tmp_path))
    rows = [torch.randn(5, 8).to(torch.bfloat16), torch.randn(1, 8).to(torch.bfloat16), torch.randn(300, 8)]
    handle = selfcheck.share_rows(rows)
    assert isinstance(handle, selfcheck.SharedRows) and len(list(tmp_path.iterdir())) == 1
    import pickle

    back = compare._open_rows(pickle.loads(pickle.dumps(handle)))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(rows, back))
    selfcheck.unshare(handle)
    assert list(tmp_path.iterdir()) == []


def test_rows_in_results_blocks_reach_a_single_worker_by_reference(tmp_path, monkeypatch):
    """With one worker, rows the caller holds in results-in-place blocks are named, not copied: the
    worker reads the very bytes (a change the caller makes is seen); with more workers, or rows
    outside the blocks, they travel in a shared-memory file."""
    torch = pytest.importorskip("torch")
    import pickle

    from speculators_compat.patches.features.datapath._runtime import pool as pools
    from speculators_compat.patches.features.datapath._runtime import reply, segments, worker

    monkeypatch.setenv("SPECULATORS_COMPAT_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(segments, "MARGIN", 0)
    pool = pools.Pool()
    lengths, hidden = [3, 6], 8
    _, nbytes = pools.layout(lengths, 2, hidden, 2)
    seg = pool.acquire(nbytes, None)
    plan = pool.plan(seg, lengths, 2, hidden, "bfloat16", 2)
    ext = types.SimpleNamespace()
    state = ext.__dict__[worker.WORKER_STATE] = worker.WorkerState()
    state.accept(plan)
    pool.mapped(seg)
    transfer = reply.Transfer(plan, *pool.tensors(seg, plan))
    layers = transfer.take(reply.Written(plan.id, plan.rows, [True, True]))
    blocks = [[layer[0:3].clone(), layer[3:9].clone()] for layer in layers]
    for layer in blocks:
        for b in layer:
            b.copy_(torch.randn(b.shape).to(torch.bfloat16))
    parallel = types.SimpleNamespace(world_size=1)
    generator = types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=parallel))
    generator.__dict__[reply.TRANSFER_ATTR] = transfer
    rows = [blocks[1][1], blocks[1][0]]
    handle = selfcheck.rows_for_workers(generator, rows)
    assert isinstance(handle, selfcheck.SegmentRows) and list(tmp_path.iterdir()) == []
    got = compare._open_rows(pickle.loads(pickle.dumps(handle)), ext)
    assert all(torch.equal(a, b) for a, b in zip(rows, got))
    rows[0][2, 5] = 3.0
    assert got[0][2, 5].item() == 3.0  # the same memory
    with pytest.raises(SelfCheckError, match="not mapped"):
        compare._open_rows(handle, types.SimpleNamespace())
    copied = selfcheck.rows_for_workers(generator, [rows[0].clone()])
    assert isinstance(copied, selfcheck.SharedRows)
    selfcheck.unshare(copied)
    parallel.world_size = 2  # other ranks have no mapping: a file for all
    shared = selfcheck.rows_for_workers(generator, rows)
    assert isinstance(shared, selfcheck.SharedRows)
    assert all(torch.equal(a, b) for a, b in zip(rows, compare._open_rows(shared)))
    selfcheck.unshare(shared)
    assert list(tmp_path.iterdir()) == []


def test_the_comparison_is_sent_when_the_rows_are_in_place_and_confirmed_to_be_the_callers(tmp_path, monkeypatch):
    """``when_written``: the callback runs once, when the worker's reply is taken, with the blocks
    the caller then gets (not for a later call); ``Comparison`` sends the comparison without waiting,
    naming those blocks, and refuses a call whose caller holds other tensors."""
    torch = pytest.importorskip("torch")
    from speculators_compat.patches.features.datapath._runtime import pool as pools
    from speculators_compat.patches.features.datapath import self_check
    from speculators_compat.patches.features.datapath._runtime import reply, segments, worker

    monkeypatch.setenv("SPECULATORS_COMPAT_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(segments, "MARGIN", 0)
    pool = pools.Pool()
    lengths, hidden = [3, 6, 2], 8
    _, nbytes = pools.layout(lengths, 2, hidden, 2)
    seg = pool.acquire(nbytes, None)
    plan = pool.plan(seg, lengths, 2, hidden, "bfloat16", 2)
    worker.WorkerState().accept(plan)
    pool.mapped(seg)
    parallel = types.SimpleNamespace(world_size=1)
    generator = types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=parallel))

    class Future:
        def result(self):
            return ["compared"]

    class Executor:
        sent = []

        def collective_rpc(self, method, args=(), non_block=False):
            self.sent.append((method, args, non_block))
            return Future()

    class Armed:  # vLLM's future of the workers' replies to arm (sent without waiting)
        def result(self):
            return [{"internal": False, "last": 1}]

    early = self_check.Comparison(generator, Executor(), [0, 2], Armed())
    reply.when_written(generator, early.send)
    transfer = reply.Transfer(plan, *pool.tensors(seg, plan), reply.take_written(generator))
    assert reply.take_written(generator) == []  # registered for one call
    generator.__dict__[reply.TRANSFER_ATTR] = transfer
    assert early.future is None
    layers = transfer.take(reply.Written(plan.id, plan.rows, [True, True]))
    assert isinstance(early.future, Future)
    ((method, (rows,), non_block),) = Executor.sent
    assert method is compare.check and non_block and isinstance(rows, selfcheck.SegmentRows)
    assert [ref[1] for ref in rows.refs] == [plan.offsets[1][0], plan.offsets[1][2]]
    starts = [0, 3, 9]
    results = [{"hidden_states": [layer[a:a + n].clone() for layer in layers]} for a, n in zip(starts, lengths)]
    early.confirm(results)  # the stock slicing hands out the very blocks
    assert early.result() == ["compared"]
    results[2]["hidden_states"][-1] = results[2]["hidden_states"][-1].clone()
    with pytest.raises(SelfCheckError, match="sequence 2: the caller's last-layer tensor is not"):
        early.confirm(results)
    early.close()
    # not sent early (the rows did not go through the blocks): the caller's own tensors, after the call
    after = self_check.Comparison(generator, Executor(), [2], [{"internal": False, "last": 1}])
    assert after.future is None
    after.confirm(results)
    assert after.result() == ["compared"]
    ((method, (rows,), non_block),) = Executor.sent[1:]
    assert method is compare.check and isinstance(rows, selfcheck.SharedRows)  # not a block: a shared file
    after.close()
    assert list(tmp_path.iterdir()) == []


def test_a_calls_lengths_are_the_stock_cut_of_each_sequence():
    """``plan.call_lengths`` (results-in-place's layout, the self-check's starts): rows per sequence
    cut at ``max_model_len - 1``, from a 2-D tensor's shape; ``None`` for anything the stock code
    is left alone with."""
    torch = pytest.importorskip("torch")
    from speculators_compat.patches.features.datapath._runtime.plan import call_lengths

    gen = types.SimpleNamespace(vllm_config=types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=6)))
    assert call_lengths(gen, [[1, 2], (3,), torch.arange(9)]) == [2, 1, 5]
    assert call_lengths(gen, torch.zeros(3, 8, dtype=torch.long)) == [5, 5, 5]
    for other in (None, [], [[1], []], torch.zeros(3, 0), torch.zeros(3), [5]):
        assert call_lengths(gen, other) is None


def test_a_verdict_taken_after_the_call(tmp_path, monkeypatch):
    """Under the runner a call's verdict is taken after it (``_verdict``, the hold its samples wait
    for): the workers' replies are judged and counted; a failure is the hold's error and the next
    call's (``_take_pending`` raises it once); an executor that stopped refuses without asking it."""
    from speculators_compat.patches.features.datapath import self_check
    from speculators_compat.services import atomic

    class Future:
        def __init__(self, replies):
            self.replies = replies

        def result(self):
            return self.replies

    def comparison(replies, **executor_state):
        c = self_check.Comparison(None, types.SimpleNamespace(**executor_state), [0], [{"internal": True}])
        c.future, closed = Future(replies), []
        c.close = lambda: closed.append(True)
        return c, closed

    good = {"sequence": 0, "tokens": 5, "rows": 5, "missing": 0, "first_missing": None, "worst": 0.001,
            "nats": 0.01, "position": 3, "compared": 5}
    totals = selfcheck.Totals()
    c, closed = comparison([None, [good]])  # a list of sequences from the rank that gathers the logits
    assert self_check._verdict(c, totals, 0) is None and closed == [True]
    assert (totals.calls, totals.deferred, totals.sequences) == (1, 1, 1)
    c, _ = comparison([[dict(good, worst=0.5)]])
    error = self_check._verdict(c, totals, 1)
    assert isinstance(error, SelfCheckError) and "call 1" in str(error) and totals.failed.startswith("call 1")
    c, closed = comparison([[good]], is_failed=True)
    error = self_check._verdict(c, totals, 2)
    assert "never came back" in str(error) and closed == [True] and totals.calls == 2  # not counted

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.delenv(atomic.SYNC_ENV, raising=False)
    atomic.protect(out)
    try:
        later = selfcheck.Totals()
        later.pending = atomic.hold([], lambda: SelfCheckError("call 4: sequence 0, position 2"))
        with pytest.raises(SelfCheckError, match="call 4"):
            self_check._take_pending(later)
        assert later.pending is None
        self_check._take_pending(later)  # raised once: the next call goes on
        decided = atomic.hold([], lambda: SelfCheckError("call 5"))
        decided.settle()
        later.pending = decided
        self_check._take_pending(later)  # decided (and reported) elsewhere: not raised again
    finally:
        atomic.unprotect()
        atomic.clear_failures()
