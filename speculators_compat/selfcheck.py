"""The self-check: a call's last-layer rows proven against the model's own next-token log-probs.

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

Driver side (the ``self-check`` patch): which sequences a call checks, the rows handed to the
workers (by reference to the ``results-in-place`` blocks where one worker holds the weights, else
one shared-memory file mapped by every rank), the verdict and the run's totals.
Worker side (``self-check-reference``): the hooks recording vLLM's own rows, and the
comparison. Nothing here imports torch or vLLM at import time.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random

from .core import _env

log = logging.getLogger("speculators_compat")

__all__ = ["SELF_CHECK_ENV", "TOLERANCE_ENV", "DEFAULT_SEQUENCES", "DEFAULT_TOLERANCE", "FULL_CALLS",
           "sequences_per_call", "tolerance", "sample", "summary", "summary_text"]

SELF_CHECK_ENV = _env.SELF_CHECK
TOLERANCE_ENV = _env.SELF_CHECK_TOLERANCE
#: sequences checked per call by default
DEFAULT_SEQUENCES = 1
#: a checked position fails above this relative difference of its log-probs; measured on the
#: CPU (docs/verification.md): correct rows <= 0.0064 (bf16; < 2.5e-7 in fp32), faulty rows >= 0.22
DEFAULT_TOLERANCE = 0.03
#: with ``SPECULATORS_COMPAT_UNVALIDATED=self-check``: the first calls check every sequence
FULL_CALLS = 8
#: positions per chunk of the comparison: chunk x vocabulary logits stay under this
CHUNK_VALUES = 1 << 25
#: test-only: a fault injected into the rows so that the tests see the check catch it; set by
#: the tests only, never an option (swap, shift, drop: driver; norm, residual: worker; ``fault@N``:
#: from the generator's call N on)
TEST_FAULT_ENV = "SPECULATORS_COMPAT_TESTING_SELF_CHECK_FAULT"
DRIVER_FAULTS = ("swap", "shift", "drop")
WORKER_FAULTS = ("norm", "residual")

#: attribute of the generator holding its :class:`Totals`
TOTALS_ATTR = "_speculators_compat_self_check"
#: attribute of the worker extension holding its :class:`WorkerCheck`
WORKER_STATE = "_speculators_compat_self_check"
ALL = -1


# -- options ---------------------------------------------------------------------------------


def sequences_per_call() -> int:
    """``SPECULATORS_COMPAT_SELF_CHECK``: sequences checked per call (0: off; ``all``: every one)."""
    raw = os.environ.get(SELF_CHECK_ENV, "").strip().lower()
    if not raw:
        return DEFAULT_SEQUENCES
    if raw == "all":
        return ALL
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if value < 0:
        from .errors import InvalidInputError

        raise InvalidInputError(f"{SELF_CHECK_ENV}={raw!r}: expected a number of sequences per call "
                                "(0 = off) or 'all'")
    return value


def tolerance() -> float:
    """``SPECULATORS_COMPAT_SELF_CHECK_TOLERANCE``: the largest relative difference a position may have."""
    raw = os.environ.get(TOLERANCE_ENV, "").strip()
    if not raw:
        return DEFAULT_TOLERANCE
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from .errors import InvalidInputError

        raise InvalidInputError(f"{TOLERANCE_ENV}={raw!r}: expected a positive number")
    return value


def full_calls() -> int:
    """How many first calls check every sequence (``SPECULATORS_COMPAT_UNVALIDATED=self-check``)."""
    return FULL_CALLS if _env.unvalidated_self_check() else 0


def sample(n: int, call: int, per_call: int, full: int = 0) -> list[int]:
    """The sequences (indices) call number ``call`` checks: all of them for the first ``full``
    calls or with ``per_call`` ``ALL``, else ``per_call`` of them, drawn with the call number as
    the seed (reproducible, and every batch position gets its turn)."""
    if call < full or per_call == ALL or per_call >= n:
        return list(range(n))
    if per_call <= 0:
        return []
    return sorted(random.Random(call).sample(range(n), per_call))


# -- driver: a call's plan, the rows, the verdict --------------------------------------------

_plan_ids = itertools.count(1)


class Plan:
    """What the workers record for one call: ``requests`` maps the stock request id of each
    checked sequence to ``(index, rows, its first row in the call's stock layout)``."""

    def __init__(self, requests: dict, fault: str = "") -> None:
        self.id = next(_plan_ids)
        self.requests = requests
        self.fault = fault


class Totals:
    """The generator's self-check so far."""

    def __init__(self) -> None:
        self.seen = 0  # generate() calls
        self.calls = 0  # calls checked
        self.sequences = 0
        self.rows = 0
        self.worst = 0.0  # relative
        self.worst_nats = 0.0
        self.where = ""
        self.seconds = 0.0  # the driver's time in the check (arming, rows out, comparison)
        self.failed: str | None = None
        self.off: str | None = None  # why the check cannot run here
        self.last: list[dict] = []  # the last checked call's per-sequence results

    def add(self, results: list[dict], call: int) -> None:
        self.calls += 1
        self.last = results
        for r in results:
            self.sequences += 1
            self.rows += r["rows"]
            self.worst_nats = max(self.worst_nats, r["nats"])
            if r["worst"] >= self.worst:
                self.worst, self.where = r["worst"], f"call {call}, sequence {r['sequence']}, position {r['position']}"

    def as_dict(self) -> dict:
        return {"calls": self.calls, "sequences": self.sequences, "rows": self.rows,
                "worst_relative": float(f"{self.worst:.3g}"), "worst_nats": float(f"{self.worst_nats:.3g}"),
                "worst_at": self.where or None, "tolerance": tolerance(), "seconds": round(self.seconds, 3),
                "failed": self.failed, "off": self.off}


def totals_of(generator) -> Totals:
    totals = generator.__dict__.get(TOTALS_ATTR)
    if totals is None:
        totals = generator.__dict__[TOTALS_ATTR] = Totals()
    return totals


def summary(generator) -> dict | None:
    """The generator's self-check as a dict (``None``: it never ran there)."""
    totals = generator.__dict__.get(TOTALS_ATTR)
    return totals.as_dict() if totals is not None else None


def summary_text(generator) -> str | None:
    """One phrase for the run's end line."""
    totals = generator.__dict__.get(TOTALS_ATTR)
    if totals is None:
        return None
    if totals.off:
        return f"self-check off ({totals.off})"
    text = (f"self-check: {totals.sequences} sequences, {totals.rows} rows in {totals.calls} calls, "
            f"worst {totals.worst:.2g} ({totals.worst_nats:.2g} nats) against {tolerance():.2g}, {totals.seconds:.1f} s")
    return text + (" -- FAILED" if totals.failed else "")


def verdict(results: list[dict], tol: float) -> str | None:
    """The error message for the first failing sequence of a call, or ``None``."""
    for r in results:
        if r["missing"]:
            return (f"self-check: sequence {r['sequence']}: vLLM computed no state for {r['missing']} of its "
                    f"{r['tokens']} positions (first: {r['first_missing']}); its rows cannot be what vLLM computed")
        if r["rows"] != r["tokens"]:
            return (f"self-check: sequence {r['sequence']}: {r['rows']} last-layer rows for {r['tokens']} tokens")
        if not r["worst"] <= tol:
            return (f"self-check: sequence {r['sequence']}, position {r['position']}: the next-token log-probs "
                    f"of its last-layer row differ from vLLM's own by {r['worst']:.3g} (relative; "
                    f"{r['nats']:.3g} nats at most), more than the {tol:.3g} a correct row stays within: "
                    "rows of another sequence or position, or captured at another point")
    return None


class SegmentRows:
    """Rows the caller holds in ``results-in-place`` blocks, named by where they lie in the
    driver's segments (``refs``: ``(segment, offset, dtype, shape)`` per tensor): the capturing
    worker, which has those segments mapped, reads the very bytes the caller got (no copy)."""

    def __init__(self, refs: list) -> None:
        self.refs = refs


def rows_for_workers(generator, rows: list):
    """The caller's rows as the workers get them: where one worker holds the weights and the rows
    lie in the generator's ``results-in-place`` blocks, by reference (:class:`SegmentRows`); else
    copied into one shared-memory file (:func:`share_rows`)."""
    from . import transport

    pool = transport.pool_of(generator)
    parallel = getattr(getattr(generator, "vllm_config", None), "parallel_config", None)
    world = getattr(parallel, "world_size", None)
    if pool is not None and world == 1:
        refs = []
        for t in rows:
            where = pool.locate(t)
            if where is None:
                break
            refs.append((where[0], where[1], str(t.dtype).replace("torch.", ""), list(t.shape)))
        else:
            return SegmentRows(refs)
    return share_rows(rows)


class SharedRows:
    """Rows for the workers in one shared-memory file (``layout``: ``(dtype, shape, offset)`` per
    tensor); every rank maps it, the driver removes it after the call."""

    def __init__(self, path: str, size: int, layout: list) -> None:
        self.path, self.size, self.layout = path, size, layout


_files = itertools.count(1)


def share_rows(rows: list):
    """``rows`` (CPU tensors) as a :class:`SharedRows`, or the list itself (pickled to the
    workers) where the shared-memory folder lacks the room."""
    import torch

    from . import transport

    layout, offset = [], 0
    for t in rows:
        layout.append((str(t.dtype).replace("torch.", ""), list(t.shape), offset))
        offset = transport._align(offset + t.numel() * t.element_size())
    size = max(offset, 1)
    where = transport.folder()
    try:
        stat = os.statvfs(where)
    except OSError:
        return rows
    if stat.f_bavail * stat.f_frsize < size + transport.MARGIN:
        return rows
    # named like the transport's files: a run killed before removing it is swept the same way
    path = os.path.join(where, f"{transport.PREFIX}-{os.getpid()}-{os.getpid()}-check{next(_files)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        transport._unlink(path)
        return rows
    os.close(fd)
    try:
        buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        for t, (dtype, shape, off) in zip(rows, layout):
            buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        del buf
    except BaseException:
        transport._unlink(path)
        raise
    return SharedRows(path, size, layout)


def unshare(rows) -> None:
    if isinstance(rows, SharedRows):
        from . import transport

        transport._unlink(rows.path)


def _open_rows(rows, extension=None) -> list:
    if isinstance(rows, SegmentRows):
        from .transport import worker_rows

        out = [worker_rows(extension, *ref) if extension is not None else None for ref in rows.refs]
        if any(t is None for t in out):
            from .errors import SelfCheckError

            raise SelfCheckError("self-check: the caller's rows lie in a shared-memory segment this worker has "
                                 "not mapped")
        return out
    if not isinstance(rows, SharedRows):
        return list(rows)
    import torch

    from .transport import typed_view

    buf = torch.from_file(rows.path, shared=False, size=rows.size, dtype=torch.uint8)
    return [typed_view(buf, off, dtype, shape) for dtype, shape, off in rows.layout]


def inject_driver_fault(fault: str, results: list, checked: list[int]) -> list[int]:
    """Test-only: corrupt the last-layer rows of checked sequences as a broken capture would.
    Returns the sequences it corrupted."""
    rows = [results[i]["hidden_states"][-1] for i in checked]
    long = [k for k, t in enumerate(rows) if t.shape[0] >= 2]
    if fault == "swap" and len(long) >= 2:
        (ka, kb) = long[:2]
        a, b = rows[ka], rows[kb]
        m = min(a.shape[0], b.shape[0])
        tmp = a[:m].clone()
        a[:m] = b[:m]
        b[:m] = tmp
        return [checked[ka], checked[kb]]
    if fault == "shift" and long:
        t = rows[long[0]]
        t[:-1] = t[1:].clone()  # row p holds position p + 1's state
        return [checked[long[0]]]
    if fault == "drop" and len(rows) >= 2:
        rows[0][-1] = rows[1][0]  # the last row missing: the next sequence's first row in its place
        return [checked[0]]
    return []


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
        self.step = None  # the last layer's hidden states in this step, without the residual (test faults)
        self.handles: list = []
        self.norming = False  # the norm runs for the check itself, not for vLLM's forward

    def norm(self, rows):
        """The model's final norm of ``rows``, unseen by :meth:`on_output`."""
        self.norming = True
        try:
            return self.base.norm(rows)
        finally:
            self.norming = False

    def arm(self, plan: Plan | None) -> None:
        self.plan, self.refs, self.filled, self.own, self.cursor, self.step = plan, {}, {}, {}, 0, None

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
        if plan.fault == "residual":
            self.step = hidden
        if not self.internal:
            return
        rows = hidden + residual if residual is not None else hidden.clone()
        step = self.step_rows(self.runner) if self.step_rows is not None else None
        if step is not None:
            rows = step.stock_order(rows)
        if plan.fault == "norm":
            rows = self.norm(rows)
        elif plan.fault == "residual":
            rows = hidden.clone()
        at, end = self.cursor, self.cursor + rows.shape[0]
        for seq, n, first in plan.requests.values():
            lo, hi = max(at, first), min(end, first + n)
            if lo < hi:
                own = self.own.get(seq)
                if own is None:
                    own = self.own[seq] = rows.new_zeros((n, rows.shape[-1]))
                own[lo - first:hi - first] = rows[lo - at:hi - at]
        self.cursor = end

    def fault_states(self, states: list) -> list:
        """Test-only: the capture's last-layer state of this step as a broken capture point gives it."""
        plan = self.plan
        if plan is None or self.internal or plan.fault not in WORKER_FAULTS:
            return states
        states = list(states)
        if plan.fault == "norm":
            states[-1] = self.norm(states[-1])
        elif self.step is not None:
            states[-1] = self.step.clone()
        return states

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
                          "missing": missing, "first_missing": None, "worst": 0.0, "nats": 0.0, "position": None}
                if missing:
                    result["first_missing"] = 0 if filled is None else int((~filled).nonzero()[0])
                if ref is not None and cand is not None:
                    # pinned where the rows lie in a results-in-place block: an asynchronous copy
                    cand = cand.to(device=ref.device, dtype=ref.dtype, non_blocking=True)
                    got = _differences(self.model, self.norm, cand, ref, chunk)
                    if got is None:
                        gathered = False
                    else:
                        result.update(got)
                out.append(result)
        self.refs, self.filled, self.own = {}, {}, {}
        return out if gathered else None


def _differences(model, norm, cand, ref, chunk) -> dict | None:
    """The worst position of ``cand`` (rows before the final norm) against ``ref`` (vLLM's final
    hidden states): both through the model's own ``compute_logits``, in one call per chunk; the
    relative difference of the centred logits (= of the centred log-probs), and the log-probs'
    largest difference at that position. Two reading passes over a chunk's logits, in their own
    dtype (the reductions accumulate in fp32); the worst row of each chunk in fp32. One
    synchronisation at the end; ``None`` on a rank the logits are not gathered to."""
    import torch

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
    return None
