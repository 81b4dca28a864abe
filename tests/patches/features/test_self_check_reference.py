"""self-check-reference: the worker side of the self-check without vLLM -- the reference of vLLM's own
final states, its stock-layout capture of the last layer and the comparison, on a stand-in model.

End to end on the real vLLM, with faults injected: the scenario's ``selfcheck`` step (tests/test_e2e.py)."""

from __future__ import annotations

import types

import pytest

from speculators_compat.patches.features.datapath._runtime import checking as selfcheck
from speculators_compat.patches.features.datapath._runtime import compare


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {"self-check-reference": "the scenario's selfcheck step (every injected fault caught)"}


class Stand:
    """A stand-in for a vLLM model with ``layers``, a final ``norm`` and ``compute_logits``; and
    its runner's layout of one step (what ``_get_prompt_logprobs_dict`` reads)."""

    def __init__(self, torch, hidden=16, vocab=40, layers=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.torch = torch
        w = torch.rand(hidden, generator=g) + 0.5
        norm = torch.nn.Module()
        norm.weight = torch.nn.Parameter(w, requires_grad=False)

        def forward(x, residual=None):
            if residual is not None:
                x = x + residual
                out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
                return out, x
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight

        norm.forward = forward
        self.base = torch.nn.Module()
        self.base.norm = norm
        self.base.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(layers)])
        head = torch.randn(vocab, hidden, generator=g)
        self.model = types.SimpleNamespace(compute_logits=lambda h: h @ head.T)
        self.runner = types.SimpleNamespace(
            model=self.model, input_batch=types.SimpleNamespace(req_id_to_index={}),
            query_start_loc=types.SimpleNamespace(np=None), requests={},
            model_config=types.SimpleNamespace(get_vocab_size=lambda: vocab))
        self.hidden = hidden

    def step(self, state, reqs, g):
        """One forward of ``reqs`` (req id -> (tokens, computed)) laid out in the given order; the
        last layer's (hidden, residual) and the final norm's output go through the hooks."""
        torch = self.torch
        import numpy as np

        n = sum(t for t, _ in reqs.values())
        hidden = torch.randn(n, self.hidden, generator=g)
        residual = torch.randn(n, self.hidden, generator=g)
        self.runner.input_batch.req_id_to_index = {r: i for i, r in enumerate(reqs)}
        self.runner.query_start_loc.np = np.cumsum([0] + [t for t, _ in reqs.values()])
        self.runner.requests = {r: types.SimpleNamespace(num_computed_tokens=c) for r, (_, c) in reqs.items()}
        state.on_last_layer(None, (), (hidden, residual))
        out, _ = self.base.norm(hidden, residual)
        state.on_output(None, (hidden, residual), (out, None))
        return hidden + residual


def test_worker_compares_the_callers_rows_with_vllms_own_and_catches_faults():
    torch = pytest.importorskip("torch")
    m = Stand(torch)
    state = compare.WorkerCheck(m.runner, m.model, m.base, last=2, internal=False)
    g = torch.Generator().manual_seed(1)
    tokens = {"req_0_0": list(range(5)), "req_0_1": list(range(7)), "req_0_2": list(range(3))}
    plan = selfcheck.Plan({r: (i, len(t), 0) for i, (r, t) in enumerate(tokens.items()) if i != 2})
    state.arm(plan)
    # vLLM lays the step out in its own order (not the input order)
    rows = m.step(state, {"req_0_1": (7, 0), "req_0_2": (3, 0), "req_0_0": (5, 0)}, g)
    mine = {"req_0_1": rows[0:7], "req_0_2": rows[7:10], "req_0_0": rows[10:15]}
    good = [mine["req_0_0"].clone(), mine["req_0_1"].clone()]
    got = state.compare(good)
    assert [r["sequence"] for r in got] == [0, 1]
    assert all(r["worst"] < 1e-5 and r["missing"] == 0 and r["rows"] == r["tokens"] for r in got)
    assert selfcheck.verdict(got, 0.03) is None
    assert state.plan is None and state.refs == {}

    def run(candidates):
        state.arm(selfcheck.Plan({r: (i, len(t), 0) for i, (r, t) in enumerate(tokens.items()) if i != 2}))
        m.step(state, {"req_0_1": (7, 0), "req_0_2": (3, 0), "req_0_0": (5, 0)}, torch.Generator().manual_seed(1))
        return state.compare(candidates)

    shifted = good[1].clone()
    shifted[:-1] = good[1][1:]
    dropped = good[0].clone()
    dropped[-1] = good[1][0]
    normed = m.base.norm(good[0])
    for name, cands, seq in [("swap", [good[1][:5], good[0].new_zeros(0, 16)], 0), ("shift", [good[0], shifted], 1),
                             ("drop", [dropped, good[1]], 0), ("norm", [normed, good[1]], 0)]:
        msg = selfcheck.verdict(run(cands), 0.03)
        assert msg and f"sequence {seq}" in msg, name
    assert "position 4" in selfcheck.verdict(run([dropped, good[1]]), 0.03)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_measure_is_the_definition_in_fp32_chunk_by_chunk(dtype):
    """``|d - mean(d)| / |r - mean(r)|`` per position, its worst position over every chunk, and
    the largest log-prob difference there, as computed in fp32 from the same logits."""
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(5)
    head = torch.randn(300, 16, generator=g).to(dt)
    model = types.SimpleNamespace(compute_logits=lambda h: h @ head.T)
    ref = torch.randn(23, 16, generator=g).to(dt)
    cand = ref + 0.01 * torch.randn(23, 16, generator=g).to(dt)
    cand[17] = ref[3]  # one row of another position: the worst
    got = compare._differences(model, lambda x: x, cand, ref, chunk=5)
    zc, zr = (cand @ head.T).float(), (ref @ head.T).float()
    d = zc - zr
    rel = (d - d.mean(-1, keepdim=True)).norm(dim=-1) / (zr - zr.mean(-1, keepdim=True)).norm(dim=-1)
    assert got["position"] == 17 == int(rel.argmax())
    assert got["worst"] == pytest.approx(float(rel.max()), rel=1e-2 if dtype == "bfloat16" else 1e-5)
    nats = (torch.log_softmax(zc[17], -1) - torch.log_softmax(zr[17], -1)).abs().max()
    assert got["nats"] == pytest.approx(float(nats), rel=1e-5)
    # a sample of positions: the same measure at those positions, named by the sequence's position
    got_at = compare._differences(model, lambda x: x, cand, ref, chunk=5, at=[0, 17, 22])
    assert got_at["position"] == 17 and got_at["worst"] == pytest.approx(got["worst"], rel=1e-5)
    missed = compare._differences(model, lambda x: x, cand, ref, chunk=5, at=[0, 16, 22])
    assert missed["position"] in (0, 16, 22) and missed["worst"] < got["worst"] / 5
    assert compare._differences(model, lambda x: x, ref, ref, chunk=5)["worst"] < 1e-5
    assert compare._differences(model, lambda x: x, ref[:0], ref[:0], chunk=5)["position"] is None


def test_worker_capture_of_the_last_layer_follows_the_stock_layout():
    torch = pytest.importorskip("torch")
    m = Stand(torch)
    state = compare.WorkerCheck(m.runner, m.model, m.base, last=2, internal=True)
    tokens = [list(range(4)), list(range(6)), list(range(2))]
    starts = [0, 4, 10]
    plan = selfcheck.Plan({f"req_0_{i}": (i, len(t), starts[i]) for i, t in enumerate(tokens) if i in (1, 2)})
    state.arm(plan)
    g = torch.Generator().manual_seed(3)
    # two steps, each in input order (what the stock slicing assumes and v1-chunked-prefill keeps)
    m.step(state, {"req_0_0": (4, 0), "req_0_1": (6, 0)}, g)
    m.step(state, {"req_0_2": (2, 0)}, g)
    got = state.compare(None)
    assert [(r["sequence"], r["rows"], r["missing"]) for r in got] == [(1, 6, 0), (2, 2, 0)]
    assert max(r["worst"] for r in got) < 1e-5
    # the same steps laid out by vLLM in another order than the stock cut assumes: caught
    state.arm(plan)
    g = torch.Generator().manual_seed(3)
    m.step(state, {"req_0_1": (6, 0), "req_0_0": (4, 0)}, g)
    m.step(state, {"req_0_2": (2, 0)}, g)
    msg = selfcheck.verdict(state.compare(None), 0.03)
    assert msg and "sequence 1" in msg


def test_worker_reference_of_a_request_split_over_steps_and_missing_positions():
    torch = pytest.importorskip("torch")
    m = Stand(torch)
    state = compare.WorkerCheck(m.runner, m.model, m.base, last=2, internal=True)
    t = list(range(9))
    state.arm(selfcheck.Plan({"req_1_0": (0, 9, 0)}))
    g = torch.Generator().manual_seed(5)
    m.step(state, {"req_1_0": (5, 0)}, g)  # chunked: positions 0-4, then 5-8
    m.step(state, {"req_1_0": (4, 5)}, g)
    got = state.compare(None)
    assert got[0]["missing"] == 0 and got[0]["worst"] < 1e-5
    state.arm(selfcheck.Plan({"req_1_0": (0, 9, 0)}))
    m.step(state, {"req_1_0": (6, 3)}, torch.Generator().manual_seed(5))  # 3 positions from a cache
    got = state.compare(None)
    assert (got[0]["missing"], got[0]["first_missing"]) == (3, 0)
    assert "no state for 3 of its 9 positions" in selfcheck.verdict(got, 0.03)


def test_self_check_off_in_the_workers_is_said_once_for_the_run_not_once_per_rank(caplog):
    """Every TP rank sets up the same model and finds the same reason: rank 0 warns, the others'
    lines (naming their rank) are DEBUG -- not TP identical warnings."""
    from speculators_compat.patches.features.datapath import self_check_reference as ref

    with caplog.at_level("DEBUG", logger="speculators_compat"):
        for rank in range(4):
            ref.say_off("X has no final norm or compute_logits", rank)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["self-check: off in the workers (said by tp rank 0 for every rank): X has no final norm "
                      "or compute_logits"], warned
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG"]
    assert [m.split(":")[1] for m in debug] == [" off in this worker (tp rank 1)", " off in this worker (tp rank 2)",
                                                " off in this worker (tp rank 3)"], debug
