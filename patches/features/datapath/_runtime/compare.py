"""The self-check's measure and its workers' side: a call's last-layer rows proven against the model's own next-token log-probs.

The captured row of the last decoder layer (``hidden_states + residual``, before the final norm)
is what vLLM turns into its next-token log-probs: final norm, then ``compute_logits`` (the
vocabulary-parallel ``lm_head``, gathered over vLLM's tensor-parallel group). For a sample of a
call's sequences the workers, which hold the weights, do exactly that with the rows the caller
got, and compare the result, position by position, with the log-probs of vLLM's own final hidden
state for the same request and position -- read where vLLM's prompt-logprobs code reads it (the
request's ``query_start_loc`` in the step, its ``num_computed_tokens``), so it shares nothing
with the capture's layout. A row of another sequence or position, a shifted, truncated or
dropped row, or one captured at another point (after the norm, without the residual) gives
other log-probs; fp32 or bf16 rounding barely moves them.

The measure, per position: the relative difference of the two log-prob vectors (each centred
on its mean, so equal to the relative difference of the logits): ``|d - mean(d)| / |r -
mean(r)|`` with ``d`` the difference and ``r`` the reference. It does not depend on the
logits' scale (a random tiny model and a trained 1T one alike). The largest absolute
difference of a log-prob (nats) at the worst position is reported beside it. The driver gets a few numbers per
checked sequence, never a vocabulary-sized tensor.

Worker side (``self-check-reference``): the hooks recording vLLM's own rows, and the comparison
(the driver's side: :mod:`.checking`). Nothing here imports torch or vLLM at import time.
"""

from __future__ import annotations

import logging
import math

from .checking import Plan, SegmentRows, SharedRows, positions

log = logging.getLogger("speculators_compat")

#: attribute of the worker extension holding its :class:`WorkerCheck`
WORKER_STATE = "_speculators_compat_self_check"
#: positions per chunk of the comparison: chunk x vocabulary logits stay under this
CHUNK_VALUES = 1 << 25


def _open_rows(rows, extension=None) -> list:
    if isinstance(rows, SegmentRows):
        from .worker import worker_rows

        out = [worker_rows(extension, *ref) if extension is not None else None for ref in rows.refs]
        if any(t is None for t in out):
            from speculators_compat.patching import SelfCheckError

            raise SelfCheckError("self-check: the caller's rows lie in a shared-memory segment this worker has "
                                 "not mapped")
        return out
    if not isinstance(rows, SharedRows):
        return list(rows)
    import torch

    from .segments import typed_view

    buf = torch.from_file(rows.path, shared=False, size=rows.size, dtype=torch.uint8)
    return [typed_view(buf, off, dtype, shape) for dtype, shape, off in rows.layout]


# -- worker: the reference and the comparison ------------------------------------------------


class WorkerCheck:
    """One worker's self-check state: the armed plan, vLLM's own rows of the checked requests
    (and, where the caller does not capture the last layer, its rows in the stock layout)."""

    def __init__(self, runner, model, base, last: int, internal: bool, step_rows=None) -> None:
        self.runner, self.model, self.base, self.last, self.internal = runner, model, base, last, internal
        #: ``step_rows(runner)``: the layout of the step being run where the runner does not keep
        #: vLLM's V1 persistent batch (an object with ``rows``: request id -> (first row, rows,
        #: position), and ``stock_order(rows)``), or ``None`` for the V1 layout
        self.step_rows = step_rows
        self.plan: Plan | None = None
        self.refs: dict = {}  # sequence -> [tokens, hidden] (vLLM's final hidden states)
        self.filled: dict = {}  # sequence -> [tokens] bool
        self.own: dict = {}  # sequence -> [tokens, hidden] (the last layer, stock layout)
        self.cursor = 0  # rows the call's steps produced so far (stock layout)
        self.handles: list = []
        self.norming = False  # the norm runs for the check itself, not for vLLM's forward

    def norm(self, rows):
        """The model's final norm of ``rows``, unseen by :meth:`on_output`."""
        self.norming = True
        try:
            return self.base.norm(rows)
        finally:
            self.norming = False

    def warm_up(self) -> None:
        """One comparison of two rows of zeros, so that the first call's does not load its kernels."""
        import torch

        weight = getattr(self.base.norm, "weight", None)
        if weight is None:
            return
        rows = torch.zeros((2, weight.shape[-1]), dtype=weight.dtype, device=weight.device)
        with torch.inference_mode():
            _differences(self.model, self.norm, rows, self.norm(rows), 2, [0, 1])

    def arm(self, plan: Plan | None) -> None:
        self.plan, self.refs, self.filled, self.own, self.cursor = plan, {}, {}, {}, 0

    def on_output(self, module, inputs, output) -> None:
        """Forward hook of the base model's final norm (whose output the base model returns; its
        compiled ``__call__`` skips forward hooks): vLLM's final hidden states of the checked
        requests, where vLLM's prompt-logprobs code finds them."""
        plan = self.plan
        if plan is None or self.norming:
            return
        hidden = output[0] if isinstance(output, tuple) else output
        locate = self._locator()
        for req_id, (seq, n, _) in plan.requests.items():
            found = locate(req_id)
            if found is None:
                continue
            a, rows, pos = found
            take = max(0, min(rows, n - pos))
            if take == 0:
                continue
            ref = self.refs.get(seq)
            if ref is None:
                import torch

                ref = self.refs[seq] = hidden.new_zeros((n, hidden.shape[-1]))
                self.filled[seq] = torch.zeros(n, dtype=torch.bool)
            ref[pos:pos + take] = hidden[a:a + take]
            self.filled[seq][pos:pos + take] = True

    def _locator(self):
        """``req_id -> (first row, rows, position in its sequence)`` of this step's output, found
        where vLLM's own prompt-logprobs code finds them (``None``: not in this step)."""
        runner = self.runner
        step = self.step_rows(runner) if self.step_rows is not None else None
        if step is not None:
            return step.rows.get
        index = runner.input_batch.req_id_to_index
        starts = runner.query_start_loc.np

        def locate(req_id):
            i = index.get(req_id)
            if i is None:
                return None
            a = int(starts[i])
            return a, int(starts[i + 1]) - a, int(runner.requests[req_id].num_computed_tokens)

        return locate

    def on_last_layer(self, module, inputs, output) -> None:
        """Forward hook of the last decoder layer (runs before the capture's): its rows of the
        checked sequences, cut from the step's rows as the stock code cuts the call's rows."""
        plan = self.plan
        if plan is None:
            return
        hidden, residual = output if isinstance(output, tuple) and len(output) == 2 else (output, None)
        if not self.internal:
            return
        rows = hidden + residual if residual is not None else hidden.clone()
        step = self.step_rows(self.runner) if self.step_rows is not None else None
        if step is not None:
            rows = step.stock_order(rows)
        at, end = self.cursor, self.cursor + rows.shape[0]
        for seq, n, first in plan.requests.values():
            lo, hi = max(at, first), min(end, first + n)
            if lo < hi:
                own = self.own.get(seq)
                if own is None:
                    own = self.own[seq] = rows.new_zeros((n, rows.shape[-1]))
                own[lo - first:hi - first] = rows[lo - at:hi - at]
        self.cursor = end

    def compare(self, rows, extension=None) -> list[dict] | None:
        """Every checked sequence's difference (on the rank that gathers the logits; ``None`` on the others)."""
        import torch

        plan, self.plan = self.plan, None
        if plan is None:
            return []
        given = _open_rows(rows, extension) if rows is not None else None
        vocab = int(self.runner.model_config.get_vocab_size())
        chunk = max(1, CHUNK_VALUES // max(vocab, 1))
        out, gathered = [], True
        with torch.inference_mode():
            for k, (seq, n, _) in enumerate(sorted(plan.requests.values())):
                ref = self.refs.get(seq)
                filled = self.filled.get(seq)
                cand = given[k] if given is not None else self.own.get(seq)
                missing = n if filled is None else int((~filled).sum())
                result = {"sequence": seq, "tokens": n, "rows": 0 if cand is None else int(cand.shape[0]),
                          "missing": missing, "first_missing": None, "worst": 0.0, "nats": 0.0, "position": None,
                          "compared": 0}
                if missing:
                    result["first_missing"] = 0 if filled is None else int((~filled).nonzero()[0])
                if ref is not None and cand is not None:
                    # pinned where the rows lie in a results-in-place block: an asynchronous copy
                    cand = cand.to(device=ref.device, dtype=ref.dtype, non_blocking=True)
                    both = min(int(cand.shape[0]), int(ref.shape[0]))
                    at = positions(both, plan.most, plan.call)
                    result["compared"] = both if at is None else len(at)
                    got = _differences(self.model, self.norm, cand, ref, chunk, at)
                    if got is None:
                        gathered = False
                    else:
                        result.update(got)
                out.append(result)
        self.refs, self.filled, self.own = {}, {}, {}
        return out if gathered else None


def _differences(model, norm, cand, ref, chunk, at: list[int] | None = None) -> dict | None:
    """The worst position of ``cand`` (rows before the final norm) against ``ref`` (vLLM's final
    hidden states): both through the model's own ``compute_logits``, in one call per chunk; the
    relative difference of the centred logits (= of the centred log-probs), and the log-probs'
    largest difference at that position. Two reading passes over a chunk's logits, in their own
    dtype (the reductions accumulate in fp32); the worst row of each chunk in fp32. One
    synchronisation at the end; ``None`` on a rank the logits are not gathered to. ``at``: the
    positions compared (``None``: every one; the reported position is the sequence's)."""
    import torch

    if at is not None:
        index = torch.tensor(at, dtype=torch.long, device=ref.device)
        cand, ref = cand.index_select(0, index), ref.index_select(0, index)
        got = _differences(model, norm, cand, ref, chunk)
        if got is not None and got["position"] is not None:
            got["position"] = at[got["position"]]
        return got
    n = min(int(cand.shape[0]), int(ref.shape[0]))
    rel_max, rel_arg, nats = [], [], []
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        z = model.compute_logits(torch.cat([norm(cand[a:b]), ref[a:b]]))  # both in one pass
        if z is None:
            continue
        zc, zr = z[:b - a], z[b - a:]
        # |d - mean(d)| / |r - mean(r)| = sqrt(var(d) / var(r)), d the difference, r the reference
        # (log_softmax shifts each row by a constant, which the centring removes)
        var_d = torch.var_mean(zc - zr, dim=-1, correction=0)[0].float()
        var_r = torch.var_mean(zr, dim=-1, correction=0)[0].float().clamp_min(1e-30)
        rel = torch.nan_to_num((var_d / var_r).sqrt(), nan=math.inf)
        top = rel.max(dim=0)
        rel_max.append(top.values)
        rel_arg.append(top.indices + a)
        row = top.indices.view(1)
        lc, lr = zc.index_select(0, row).float(), zr.index_select(0, row).float()  # the chunk's worst row
        lc, lr = lc - torch.logsumexp(lc, -1, keepdim=True), lr - torch.logsumexp(lr, -1, keepdim=True)
        nats.append(torch.nan_to_num((lc - lr).abs(), nan=math.inf).amax())
    if not n:
        return {"worst": 0.0, "position": None, "nats": 0.0}
    if not rel_max:
        return None
    rel_max, rel_arg, nats = torch.stack(rel_max), torch.stack(rel_arg), torch.stack(nats)
    k = int(rel_max.argmax())
    return {"worst": float(rel_max[k]), "position": int(rel_arg[k]), "nats": float(nats[k])}


# -- worker entry points (sent by the driver through collective_rpc) --------------------------


def _extension(worker):
    return getattr(worker, "worker", None) or worker  # vLLM's WorkerWrapperBase wraps the worker


def arm(worker, plan: Plan | None):
    """Every worker: record the rows of ``plan``'s requests during the call (``None``: stop).
    Replies whether this worker can check, and whether the caller's rows hold the last layer."""
    state = _extension(worker).__dict__.get(WORKER_STATE)
    if state is None:
        return None
    state.arm(plan)
    return {"internal": state.internal, "last": state.last}


def check(worker, rows):
    """Every worker: compare the armed call's rows (``rows``: the caller's last-layer rows of the
    checked sequences, in plan order; ``None``: the rows recorded here)."""
    extension = _extension(worker)
    state = extension.__dict__.get(WORKER_STATE)
    if state is None:
        return None
    return state.compare(rows, extension)


def install_worker(extension, base, step_rows=None) -> str | None:
    """Install the self-check's hooks on a worker whose capture was just set up; returns why not, or
    ``None``. ``step_rows``: see :class:`WorkerCheck` (a runner without V1's persistent batch)."""
    old = extension.__dict__.pop(WORKER_STATE, None)
    if old is not None:
        for handle in old.handles:
            handle.remove()
    runner = extension.model_runner
    model = runner.model
    norm = getattr(base, "norm", None)
    if norm is None or not callable(getattr(model, "compute_logits", None)):
        return f"{type(model).__name__} has no final norm or compute_logits"
    end = getattr(base, "end_layer", len(base.layers))
    last = end - 1
    internal = last not in set(getattr(extension, "_layer_ids", ()))
    state = WorkerCheck(runner, model, base, last, internal, step_rows)
    state.handles.append(norm.register_forward_hook(state.on_output))
    state.handles.append(base.layers[last].register_forward_hook(state.on_last_layer, prepend=True))
    extension.__dict__[WORKER_STATE] = state
    try:
        state.warm_up()
    except Exception as exc:  # noqa: BLE001 - the first call's comparison then loads them itself
        log.debug("self-check: no warm-up of the comparison: %s: %s", type(exc).__name__, exc)
    return None
