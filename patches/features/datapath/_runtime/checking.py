"""The self-check's driver side: options, which sequences a call checks, the rows for the workers, the verdict.

The measure and the workers' side: :mod:`.compare`. Here (the ``self-check`` patch's runtime):
which sequences a call checks, the rows handed to the workers (by reference to the
``results-in-place`` blocks where one worker holds the weights, else one shared-memory file
mapped by every rank), the verdict and the run's totals. Nothing here imports torch at import time.
"""

from __future__ import annotations

import itertools
import logging
import os
import random

from speculators_compat.patching import InvalidInputError, Option, unvalidated_self_check

from . import reply, segments

log = logging.getLogger("speculators_compat")

__all__ = ["SELF_CHECK_ENV", "TOLERANCE_ENV", "POSITIONS_ENV", "DEFAULT_SEQUENCES", "DEFAULT_TOLERANCE",
           "DEFAULT_POSITIONS", "FULL_CALLS", "sequences_per_call", "tolerance", "positions_per_sequence", "positions",
           "sample", "summary", "summary_text"]

SELF_CHECK = Option("SPECULATORS_COMPAT_SELF_CHECK",
                    "sequences per ``generate()`` call whose last-layer rows are checked against the model's own "
                    "log-probs (default 1; ``0``: off; ``all``)")
TOLERANCE = Option("SPECULATORS_COMPAT_SELF_CHECK_TOLERANCE", "the relative difference a checked position may have")
POSITIONS = Option("SPECULATORS_COMPAT_SELF_CHECK_POSITIONS",
                   "positions compared per checked sequence (default 128, spread over the sequence, the last one "
                   "always; ``all``: every position)")
SELF_CHECK_ENV = SELF_CHECK.name
TOLERANCE_ENV = TOLERANCE.name
POSITIONS_ENV = POSITIONS.name
#: sequences checked per call by default
DEFAULT_SEQUENCES = 1
#: a checked position fails above this relative difference of its log-probs; measured on the
#: CPU (docs/verification.md): correct rows <= 0.0064 (bf16; < 2.5e-7 in fp32), faulty rows >= 0.22
DEFAULT_TOLERANCE = 0.03
#: positions compared per checked sequence by default: the comparison's cost (the vocabulary-sized
#: logits of each compared row) stays that of 128 rows however long the sequences are
DEFAULT_POSITIONS = 128
#: with ``SPECULATORS_COMPAT_UNVALIDATED=self-check``: the first calls check every sequence
FULL_CALLS = 8

#: attribute of the generator holding its :class:`Totals`
TOTALS_ATTR = "_speculators_compat_self_check"
ALL = -1


# -- options ---------------------------------------------------------------------------------


def sequences_per_call() -> int:
    """``SPECULATORS_COMPAT_SELF_CHECK``: sequences checked per call (0: off; :data:`ALL`: every one)."""
    return _count(SELF_CHECK, DEFAULT_SEQUENCES, ALL, 0, "a number of sequences per call (0 = off)")


def tolerance() -> float:
    """``SPECULATORS_COMPAT_SELF_CHECK_TOLERANCE``: the largest relative difference a position may have."""
    raw = TOLERANCE.raw()
    if not raw:
        return DEFAULT_TOLERANCE
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidInputError(f"{TOLERANCE_ENV}={raw!r}: expected a positive number")
    return value


def positions_per_sequence() -> int:
    """``SPECULATORS_COMPAT_SELF_CHECK_POSITIONS``: positions compared per checked sequence (``0``: every one)."""
    return _count(POSITIONS, DEFAULT_POSITIONS, 0, 2, "a number of positions per sequence (2 or more)")


def _count(option: Option, default: int, every: int, least: int, expected: str) -> int:
    """A count option: unset -> ``default``, ``all`` -> ``every``, else an integer of at least ``least``."""
    raw = option.raw().lower()
    if not raw:
        return default
    if raw == "all":
        return every
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise InvalidInputError(f"{option.name}={raw!r}: expected {expected} or 'all'")
    return value


def positions(n: int, most: int, call: int) -> list[int] | None:
    """The positions of a sequence of ``n`` rows that call number ``call`` compares (``None``: every
    one): at most ``most``, evenly spread, the last position always (a truncated or dropped tail),
    the others starting at an offset that moves with the call number, so that consecutive calls
    cover every position. A row of another sequence or position, or a shift, changes every
    position after it: any spread sample sees it."""
    if most <= 0 or n <= most:
        return None
    stride = -(-(n - 1) // (most - 1))  # at least one position before the last (a shift keeps the last row)
    return [*range(call % stride, n - 1, stride), n - 1]


def full_calls() -> int:
    """How many first calls check every sequence (``SPECULATORS_COMPAT_UNVALIDATED=self-check``)."""
    return FULL_CALLS if unvalidated_self_check() else 0


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
    checked sequence to ``(index, rows, its first row in the call's stock layout)``; ``most`` and
    ``call``: the positions compared (see :func:`positions`; ``most`` 0: every position)."""

    def __init__(self, requests: dict, most: int = 0, call: int = 0) -> None:
        self.id = next(_plan_ids)
        self.requests = requests
        self.most, self.call = most, call


class Totals:
    """The generator's self-check so far."""

    def __init__(self) -> None:
        self.seen = 0  # generate() calls
        self.calls = 0  # calls checked
        self.sequences = 0
        self.rows = 0
        self.positions = 0  # rows compared (all of a sequence's, or the sample of SELF_CHECK_POSITIONS)
        self.worst = 0.0  # relative
        self.worst_nats = 0.0
        self.where = ""
        self.seconds = 0.0  # the driver's time in the check (arming, rows out, comparison)
        self.failed: str | None = None
        self.off: str | None = None  # why the check cannot run here
        self.last: list[dict] = []  # the last checked call's per-sequence results
        self.pending = None  # the Hold of a call whose verdict is still to be taken (see self-check)
        self.deferred = 0  # calls whose verdict was taken after the call returned (their samples waited)

    def add(self, results: list[dict], call: int) -> None:
        self.calls += 1
        self.last = results
        for r in results:
            self.sequences += 1
            self.rows += r["rows"]
            self.positions += r.get("compared", r["rows"])
            self.worst_nats = max(self.worst_nats, r["nats"])
            if r["worst"] >= self.worst:
                self.worst, self.where = r["worst"], f"call {call}, sequence {r['sequence']}, position {r['position']}"

    def as_dict(self) -> dict:
        return {"calls": self.calls, "sequences": self.sequences, "rows": self.rows, "positions": self.positions,
                "worst_relative": float(f"{self.worst:.3g}"), "worst_nats": float(f"{self.worst_nats:.3g}"),
                "worst_at": self.where or None, "tolerance": tolerance(), "seconds": round(self.seconds, 3),
                "deferred": self.deferred, "failed": self.failed, "off": self.off}


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
    text = (f"self-check: {totals.sequences} sequences, {totals.rows} rows ({totals.positions} positions compared) "
            f"in {totals.calls} calls, "
            f"worst {totals.worst:.2g} ({totals.worst_nats:.2g} nats) against {tolerance():.2g}, {totals.seconds:.1f} s")
    if totals.deferred:
        text += f", {totals.deferred} verdicts taken after their call"
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
    are blocks of the call's ``results-in-place`` transfer, by reference (:class:`SegmentRows`);
    else copied into one shared-memory file (:func:`share_rows`)."""
    transfer = reply.transfer_of(generator)
    parallel = getattr(getattr(generator, "vllm_config", None), "parallel_config", None)
    world = getattr(parallel, "world_size", None)
    if transfer is not None and world == 1:
        refs = []
        for t in rows:
            where = transfer.locate(t)
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

    layout, offset = [], 0
    for t in rows:
        layout.append((str(t.dtype).replace("torch.", ""), list(t.shape), offset))
        offset = segments.align(offset + t.numel() * t.element_size())
    size = max(offset, 1)
    where = segments.folder()
    if not segments.room(size):
        return rows
    # named like the transport's files: a run killed before removing it is swept the same way
    path = os.path.join(where, f"{segments.PREFIX}-{os.getpid()}-{os.getpid()}-check{next(_files)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        segments.unlink(path)
        return rows
    os.close(fd)
    try:
        buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        for t, (dtype, shape, off) in zip(rows, layout):
            buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        del buf
    except BaseException:
        segments.unlink(path)
        raise
    return SharedRows(path, size, layout)


def unshare(rows) -> None:
    if isinstance(rows, SharedRows):
        segments.unlink(rows.path)
