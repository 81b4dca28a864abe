"""results-in-place on real torch tensors (no vLLM process needed): the driver's pool, the worker's
copies into it, and the stock slicing of the reply."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from speculators_compat.patches.features.datapath._runtime import pool as pools  # noqa: E402
from speculators_compat.patches.features.datapath._runtime import reply, segments, worker  # noqa: E402


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "results-in-place": (
        "a feature (same data, less time): the scenario's \"leak\" step (blocks own their bytes, segments "
        "reused, no file left), this file, benchmarks/gpu.py"
    ),
}


class Ext:
    def __init__(self, layers):
        self._captured_states = layers


STOCK_SLICE = "h[offset : offset + seq_len].clone().cpu() for h in aux_hidden_states"


def stock_results(aux_hidden_states, lengths):
    """speculators 0.3.0's result building in VllmHiddenStatesGenerator.generate"""
    results, offset = [], 0
    for seq_len in lengths:
        results.append([h[offset : offset + seq_len].clone().cpu() for h in aux_hidden_states])
        offset += seq_len
    return results


def run_call(pool, lengths, steps, dtype=torch.bfloat16, hidden=24, n_layers=3, seed=0, corrupt=None, use=None,
             state=None, limit=None):
    """One call through the mechanism: plan, the worker's copies of ``steps`` (rows per step,
    cutting sequences anywhere), the pickled reply, the stock slicing (or ``use(reply, lengths)``).
    Returns (results, want, call)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    full = [torch.randn(total, hidden, generator=g).to(dtype) for _ in range(n_layers)]
    if corrupt is not None:
        full[corrupt][total // 2, 1] = float("nan")
    _, nbytes = pools.layout(lengths, n_layers, hidden, full[0].element_size())
    seg = pool.acquire(nbytes, limit)
    plan = pool.plan(seg, lengths, n_layers, hidden, str(dtype).replace("torch.", ""), full[0].element_size())
    state = state or worker.WorkerState()
    state.accept(plan)
    pool.mapped(seg)
    call = reply.Transfer.deferred(plan, lambda: pool.tensors(seg, plan))  # as results-in-place makes it
    at = 0
    for rows in steps:
        state.store([f[at:at + rows] for f in full])
        at += rows
    written = pickle.loads(pickle.dumps(state.finish()))
    assert isinstance(written, reply.Written)
    try:
        layers = reply.CallExecutor(Executor(written), call).collective_rpc(reply.METHOD)
        results = (use or stock_results)(layers, lengths)
    finally:
        call.close()
        pool.release(seg)
    return results, stock_results(full, lengths), call


class Executor:
    """The worker's reply to ``_get_captured_states``, as collective_rpc returns it."""

    def __init__(self, written):
        self.written = written

    def collective_rpc(self, method, *args, **kwargs):
        return self.written


def test_a_deferred_transfer_makes_its_tensors_once_when_the_reply_is_asked_for(shm):
    pool = pools.Pool()
    made = []

    def use(layers, lengths):
        assert len(made) == 1  # made by the collective_rpc of the reply, before it waited
        return stock_results(layers, lengths)

    real_tensors = pool.tensors
    pool.tensors = lambda seg, plan: made.append(plan.id) or real_tensors(seg, plan)
    results, want, call = run_call(pool, [3, 4], [7], use=use)
    assert made and len(made) == 1 and all(torch.equal(a, b) for r, w in zip(results, want) for a, b in zip(r, w))
    other = reply.Transfer.deferred(None, lambda: made.append("other") or ([], []))
    reply.CallExecutor(Executor(None), other).collective_rpc("_reset_capture")
    assert made[-1] != "other"  # another method: nothing made
    other.close()
    other.prepare()
    assert made[-1] != "other"  # a closed transfer makes nothing


def test_the_stock_slicing_gets_blocks_that_own_exactly_their_bytes(shm, tmp_path):
    pool = pools.Pool()
    lengths = [5, 1, 17, 3, 40]
    results, want, call = run_call(pool, lengths, steps=[7, 20, 39])  # steps cut sequences 0, 2 and 4
    assert os.listdir(shm) == []  # the segment file is unlinked once the worker mapped it
    for got_seq, want_seq, n in zip(results, want, lengths):
        for got, w in zip(got_seq, want_seq):
            assert torch.equal(got, w) and got.shape == (n, 24)
            assert got.untyped_storage().nbytes() == n * 24 * 2  # not the segment's
    torch.save(results[4][0], tmp_path / "one.pt")
    assert (tmp_path / "one.pt").stat().st_size < 40 * 24 * 2 + 2048
    assert call.finite == [True, True, True]
    assert all(call.certified(t) for seq in results for t in seq)
    assert not call.certified(results[0][0][:2])  # not a whole block
    assert not call.certified(want[0][0])  # not a block of the call


def test_a_block_is_located_where_the_worker_reads_the_very_bytes_the_caller_holds(shm):
    """The self-check hands the capturing worker the caller's rows by reference: the driver names a
    block's segment and offset, and the worker's view there is the same memory."""
    pool = pools.Pool()
    ext = Ext(None)
    state = ext.__dict__[worker.WORKER_STATE] = worker.WorkerState()
    lengths = [5, 17, 3]
    results, want, call = run_call(pool, lengths, steps=[25], state=state)
    block = results[1][2]  # sequence 1, last layer
    seg_id, offset = call.locate(block)
    view = worker.worker_rows(ext, seg_id, offset, "bfloat16", [17, 24])
    assert torch.equal(view, want[1][2])
    block[3, 4] = 7.0  # the caller's bytes are the worker's
    assert view[3, 4].item() == 7.0
    assert call.locate(block[:, :8]) is None  # not the block
    assert call.locate(block.clone()) is None  # not in a segment
    assert worker.worker_rows(ext, seg_id + 1, offset, "bfloat16", [17, 24]) is None  # not mapped there
    assert worker.worker_rows(ext, seg_id, 1 << 40, "bfloat16", [17, 24]) is None  # outside it


def test_a_non_finite_layer_is_not_certified(shm):
    results, _, call = run_call(pools.Pool(), [4, 9], steps=[13], corrupt=1)
    assert call.finite == [True, False, True]
    assert [call.certified(t) for t in results[0]] == [True, False, True]


def test_a_layer_is_a_real_tensor_over_the_segment(shm):
    """The stock generator without v4 indexes the reply with [0] and tests ``not layer``: a layer
    is a real tensor, so that fails as on a plain reply; any other use is a plain tensor's (rows,
    sums: views of the segment), and only exactly one sequence's rows give its block."""
    def misuse(layers, lengths):
        layer = layers[0]
        assert isinstance(layer, torch.Tensor) and layer.shape == (13, 24)
        with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
            bool(layer)
        rows = [layer[i] for i in range(len(layer))]
        assert type(rows[0]) is torch.Tensor and type(layer + 0) is torch.Tensor
        part = layer[1:6]  # not one sequence's rows: a plain view, clone() copies
        assert type(part) is torch.Tensor and part.clone().data_ptr() != part.data_ptr()
        block = layer[0:4]
        first, second = block.clone(), block.clone()
        assert first.data_ptr() == block.data_ptr() and second.data_ptr() != block.data_ptr()
        assert type(first) is torch.Tensor and torch.equal(first, second)
        return rows, layer

    (rows, layer), want, _ = run_call(pools.Pool(), [4, 9], steps=[13], use=misuse)
    assert torch.equal(torch.stack(rows), torch.cat([seq[0] for seq in want]))
    assert torch.equal(layer, torch.cat([seq[0] for seq in want]))


def test_a_reply_of_another_call_is_refused(shm):
    from speculators_compat.errors import CaptureContractError

    pool = pools.Pool()
    _, nbytes = pools.layout([4], 1, 24, 2)
    seg = pool.acquire(nbytes, None)
    plan = pool.plan(seg, [4], 1, 24, "bfloat16", 2)
    call = reply.Transfer(plan, *pool.tensors(seg, plan))
    with pytest.raises(CaptureContractError, match="a reply for call"):
        call.take(reply.Written(plan.id + 1, 4, [True]))
    pool.release(seg)


def test_a_worker_that_captured_too_few_rows_fails_the_call_clearly(shm):
    from speculators_compat.errors import CaptureContractError

    with pytest.raises(CaptureContractError, match="captured 10 rows per layer for 13 input tokens"):
        run_call(pools.Pool(), [4, 9], steps=[10])


def test_a_segment_is_reused_once_the_caller_freed_its_results(shm):
    import gc

    pool = pools.Pool()
    results, _, _ = run_call(pool, [8, 8], steps=[16])
    held, _, _ = run_call(pool, [8, 8], steps=[16])  # the first call's results are still held
    both = set(pool._segments)
    assert len(both) == 2 and pool.held_bytes() == 2 * pools.SEGMENT_QUANTUM
    del results
    gc.collect()
    assert pool.held_bytes() == pools.SEGMENT_QUANTUM
    again, _, _ = run_call(pool, [8, 8], steps=[16])
    assert set(pool._segments) == both  # the freed segment was reused, none created
    del held, again


def test_the_next_calls_segment_is_made_ahead_of_need_and_taken(shm, monkeypatch):
    """On an accelerator the pool makes the next call's segment in a thread while a call runs;
    a call that needs a segment while one is being made waits for it instead of making another."""
    import time

    made = []
    new_segment = pools.new_segment

    def slow(seg_id, size, files, populate=False):
        if populate:
            time.sleep(0.3)
        made.append(populate)
        return new_segment(seg_id, size, files, populate)

    monkeypatch.setattr(pools, "new_segment", slow)
    limit = 2 * pools.SEGMENT_QUANTUM
    pool = pools.Pool(spares=True)
    first, _, _ = run_call(pool, [8, 8], steps=[16], limit=limit)  # its acquire starts the spare
    assert pool._making is not None
    second, _, _ = run_call(pool, [8, 8], steps=[16], limit=limit)  # the first's results held: takes the spare
    assert made == [False, True] and pool.spares_made == pool.spares_taken == 1
    assert pool._making is None  # two calls' results held: at the limit, no third segment ahead
    assert os.listdir(shm) == []
    del first
    import gc

    gc.collect()
    third, _, _ = run_call(pool, [8, 8], steps=[16], limit=limit)  # reuses the freed segment
    assert made == [False, True] and len(pool._segments) == 2
    assert pools.Pool()._spares is None  # on the CPU: no segments ahead of need
    del second, third


def test_a_segment_no_worker_mapped_is_removed_at_close_and_at_exit(shm):
    pool = pools.Pool(spares=True)
    seg = pool.acquire(pools.SEGMENT_QUANTUM // 2, None)
    pool._making.join()
    assert len(os.listdir(shm)) == 2  # the call's (the workers did not map it) and the spare
    pool.release(seg)
    pool.close()
    assert os.listdir(shm) == []
    code = ("from speculators_compat.patches.features.datapath._runtime import pool as transport, segments\n"
            "pool = transport.Pool(spares=True)\n"
            "pool.acquire(transport.SEGMENT_QUANTUM // 2, None)\n"
            "pool._making.join()\n"
            "import os; assert len(os.listdir(segments.folder())) == 2\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "SPECULATORS_COMPAT_SHM_DIR": str(shm)})
    assert os.listdir(shm) == []


#: one small call's segment, and a held-results limit of two segments: three small calls' results exceed it
SMALL_CALL = pools.layout([8], 3, 24, 2)[1]
TWO_SEGMENTS = 2 * pools.SEGMENT_QUANTUM


def hold_three(pool, freed: int = 0) -> list:
    """Three small calls' results, held by the caller (a list); ``freed`` of them freed since (a
    caller that frees results: from then on the pool waits for those it holds)."""
    import gc

    held = [run_call(pool, [8], steps=[8])[0] for _ in range(3)]
    if freed:
        del held[-freed:]
        gc.collect()
    return held


def watch_waits(pool, order):
    """Note each wait of ``pool`` for held results in ``order`` (``"wait"``); the event returned is
    set at the first (a thread that frees results once the pool waits for them)."""
    import threading

    waiting = threading.Event()
    real = pool._cond.wait

    def wait(timeout=None):
        order.append("wait")
        waiting.set()
        return real(timeout)

    pool._cond.wait = wait
    return waiting


def test_generate_waits_while_the_caller_is_still_freeing_held_results(shm):
    import gc
    import threading

    pool = pools.Pool()
    order = []
    waiting = watch_waits(pool, order)
    held = hold_three(pool)
    nbytes, limit = SMALL_CALL, TWO_SEGMENTS
    # nothing was ever freed: a caller that keeps its results is not waited for
    seg = pool.acquire(nbytes, limit)
    assert order == []
    pool.release(seg)
    held.pop()
    gc.collect()  # one freed: the caller frees results (saves them); now a call over the limit waits

    def free_when_waited_for():
        waiting.wait(timeout=30)
        order.append("freed")
        held.pop(0)
        gc.collect()

    threading.Thread(target=free_when_waited_for).start()
    seg = pool.acquire(nbytes, limit)
    order.append("acquired")
    assert order[0] == "wait" and order.index("freed") < order.index("acquired")  # it waited for the free
    pool.release(seg)


def test_results_dropped_in_a_reference_cycle_are_collected_without_holding_the_pool(shm):
    """A caller that dropped its results in a reference cycle is not waited for long: once none was
    freed for ``COLLECT_AFTER_S``, the pool runs the collector once, with its lock released (the
    collector's finalizers free blocks; another thread that needs the pool meanwhile gets it)."""
    import gc
    import threading

    pools.COLLECT_AFTER_S, after = 0.1, pools.COLLECT_AFTER_S
    try:
        _cycle_case(gc, threading)
    finally:
        pools.COLLECT_AFTER_S = after


def _cycle_case(gc, threading):
    pool = pools.Pool()
    held = hold_three(pool, freed=1)
    nbytes, limit = SMALL_CALL, TWO_SEGMENTS
    cycle = [held.pop()]
    cycle.append(cycle)  # dropped, but only the collector frees it
    del cycle
    seen = {}
    order = []
    watch_waits(pool, order)
    real_collect = gc.collect

    def collect(*args):
        order.append("collect")
        other = threading.Thread(target=lambda: seen.setdefault("held", pool.held_bytes()))
        other.start()
        other.join(timeout=5)  # would time out if the pool's lock were held across the collection
        seen["joined"] = not other.is_alive()
        return real_collect(*args)

    gc.disable()
    try:
        import unittest.mock

        with unittest.mock.patch.object(pools.gc, "collect", collect):
            seg = pool.acquire(nbytes, limit)
    finally:
        gc.enable()
    assert seen.get("joined") is True and "held" in seen
    # it waited, collected once, and the collection freed the room: no wait after it
    assert order[0] == "wait" and order.count("collect") == 1 and order[-1] == "collect"
    assert pool.held_bytes() == 2 * pools.SEGMENT_QUANTUM  # one held, this call's
    pool.release(seg)
    del held


def test_a_caller_that_is_freeing_results_is_waited_for_without_a_collection(shm, monkeypatch):
    """While the caller frees held results (its threads save them), ``generate()`` waits for them
    without running the collector: a full collection in a process with vLLM loaded holds the GIL
    for a good part of a second, and the saving threads with it (the 1.2B stock run on an H100
    waited 25 s of 30 for held results that way). Fails on the code that collected at every wait."""
    import threading

    pool = pools.Pool()
    held = hold_three(pool, freed=1)
    nbytes, limit = SMALL_CALL, TWO_SEGMENTS
    collections = []
    monkeypatch.setattr(pools.gc, "collect", lambda *a: collections.append(a) or 0)
    monkeypatch.setattr(pools, "COLLECT_AFTER_S", 60.0)  # a slow thread start is no reason to collect here
    order = []
    waiting = watch_waits(pool, order)

    def save_one():
        waiting.wait(timeout=30)
        order.append("freed")
        held.pop(0)  # the saving thread drops the sample: its block is freed at once

    saver = threading.Thread(target=save_one)
    saver.start()
    seg = pool.acquire(nbytes, limit)
    order.append("acquired")
    saver.join()
    assert collections == [] and order[0] == "wait" and order.index("freed") < order.index("acquired")
    pool.release(seg)


def test_results_of_a_large_call_still_held_do_not_make_smaller_calls_wait(shm):
    """The held-results limit counts calls as large as the largest so far: a caller that keeps
    one large call's results and goes on with small calls (freed at once) never waits."""
    import gc

    pool = pools.Pool()
    # a large call: more states than the default limit of 4 small calls' segments
    big_lengths = [5 * pools.SEGMENT_QUANTUM // (3 * 24 * 2) + 8]
    kept = run_call(pool, big_lengths, steps=big_lengths)[0]
    small = pools.layout([8], 3, 24, 2)[1]
    for _ in range(3):
        run_call(pool, [8], steps=[8])
        gc.collect()
    assert pool.held_bytes() > pools.held_results_limit(small)  # counted in small calls, it would wait
    assert pool.largest_call > 5 * pools.SEGMENT_QUANTUM
    order = []
    watch_waits(pool, order)
    seg = pool.acquire(small, pools.held_results_limit(max(small, pool.largest_call)))
    assert order == [] and kept  # no wait, the large results still held
    pool.release(seg)


def test_the_stock_generate_still_slices_as_the_patch_expects():
    from speculators_compat.patches.features.datapath import results_in_place

    assert results_in_place.STOCK == STOCK_SLICE
