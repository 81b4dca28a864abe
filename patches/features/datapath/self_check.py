"""self-check -- each call's rows proven on the user's own model: the last layer against its own log-probs.

Problem (speculators 0.3.x, every vLLM release): wrong rows come back without an error --
another sequence's (speculators #279), shifted or truncated (vLLM #44485), captured at another
point (vLLM #48124) -- and the HF comparison of the test matrix cannot run on a 1T model, a
quantization or a kernel no test ran.

How: ``VllmHiddenStatesGenerator.generate`` is wrapped. For a sample of the call's sequences
(``SPECULATORS_COMPAT_SELF_CHECK``, default 1 per call; ``0``: off; ``all``) the workers are
armed with their stock request ids before the stock code runs; the workers'
``self-check-reference`` records vLLM's own final hidden states of those requests. The rows the
caller gets for the last decoder layer reach the workers: on one worker, where they lie in
``results-in-place`` blocks, by reference (the worker reads the very bytes the caller holds);
else through one shared-memory file. Where the rows go through those blocks, the comparison is
sent as soon as the worker's reply is in, without waiting for it (the workers compare while the
driver hands the results out), and after the call each checked sequence's tensor is confirmed to
be the block that was compared; else it is sent after the call. Each worker puts the rows
through the model's own final norm and ``compute_logits`` (vocabulary-parallel, gathered over
vLLM's TP group) and compares the next-token log-probs with those of vLLM's own states, position
by position (:mod:`._runtime.compare`: the measure, and what comes back -- a few numbers per
sequence). Of each checked sequence, ``SPECULATORS_COMPAT_SELF_CHECK_POSITIONS`` positions are
compared (default 128, spread evenly, the last one always, the others moving with the call
number; ``all``: every position), so the comparison costs the same for any sequence length.
Where the caller's layers lack the last one, the workers capture it for the checked sequences
only, cut as the stock code cuts the call's rows; the results are unchanged. A
position whose difference exceeds ``SPECULATORS_COMPAT_SELF_CHECK_TOLERANCE`` (default
:data:`._runtime.checking.DEFAULT_TOLERANCE`) raises
:class:`~speculators_compat.errors.SelfCheckError` naming the sequence, the position and the
difference: the stock script saves nothing of that batch. Where the call's samples can wait
for it -- under ``speculators-compat run``, whose output folder takes deferred saves, and where
vLLM takes replies in the order they were sent -- the call does not wait for the verdict: its
samples get their final names only once it is in (:func:`speculators_compat.services.atomic.hold`),
it is taken at the start of the next call (or when the run waits for its last samples), and a
mismatch raises there, the samples of the failed call removed. From the second call on the
workers are armed without waiting. The totals reach ``report``'s end line
and the run manifest. With ``SPECULATORS_COMPAT_UNVALIDATED=self-check`` the first calls check
every position of every sequence.

Detection: the stock ``generate`` names its requests ``req_<counter>_<i>`` and cuts one row
per token in input order (speculators 0.3.x; otherwise unknown), and vLLM's ``collective_rpc``
sends functions to the workers (otherwise not needed).

A feature: left off where no validation run recorded it. Remove when speculators 0.3.x is no
longer supported.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import time

from speculators_compat.patching import Kind, Probe, SelfCheckError, atomic, declare, lifecycle

from ..._probes import wrapping
from ._runtime import checking, compare, reply
from ._runtime.plan import call_lengths
from .results_in_place import CALLABLE, generate_and_rpc_probes

log = logging.getLogger("speculators_compat")

#: what the stock ``generate`` must do for the workers to know the checked requests and their rows
STOCK = ('request_id=f"req_{self._request_counter}_{i}"', "h[offset : offset + seq_len]")


def _judge(source: str, rpc_source: str | None) -> Probe:
    flat = " ".join(source.split())
    missing = [s for s in STOCK if s not in flat]
    if missing:
        return Probe.unknown(f"VllmHiddenStatesGenerator.generate does not do {missing[0]!r}")
    if not rpc_source or CALLABLE not in rpc_source:
        return Probe.old("MultiprocExecutor.collective_rpc sends no functions: the workers cannot be asked")
    return Probe.new("generate() names its requests req_<counter>_<i> and cuts one row per token in input order")


probe, static_probe = generate_and_rpc_probes(_judge)


class Comparison:
    """One call's comparison in the workers. Where the call's rows go through ``results-in-place``
    blocks it is sent, without waiting, as soon as the worker's rows are in them
    (:meth:`send`, run by :func:`._runtime.reply.when_written`): the workers compare while the driver hands
    the results out, and :meth:`confirm` proves that each checked sequence's tensor is the
    block that was compared. Otherwise :meth:`confirm` sends the caller's own tensors after the call.
    ``armed``: the workers' replies to :func:`._runtime.compare.arm`, or vLLM's future of them."""

    def __init__(self, generator, executor, checked: list[int], armed) -> None:
        self.generator, self.executor, self.checked, self._armed = generator, executor, checked, armed
        self._internal: bool | None = None
        self.future = None  # vLLM's future of the workers' comparison (None: not sent)
        self.rows = None  # what the workers were given (a shared-memory file is removed by close())
        self.compared: list[tuple] = []  # per checked sequence: (address, shape) of the tensor compared
        self.seconds = 0.0  # the driver's time in sending it early

    @property
    def internal(self) -> bool:
        """The workers capture the last layer themselves (the caller's layers lack it)."""
        if self._internal is None:
            replies = self._armed.result() if hasattr(self._armed, "result") else self._armed
            if not replies or any(r is None for r in replies):
                raise SelfCheckError("self-check: a worker no longer runs self-check-reference (its state is gone); "
                                     "the rows of this call cannot be checked")
            self._internal = bool(replies[0]["internal"])
        return self._internal

    def send(self, blocks: list[list]) -> None:
        """The rows are in place: ``blocks[layer][seq]``, the tensors the caller will hold."""
        t0 = time.perf_counter()
        self._send([blocks[-1][i] for i in self.checked])
        self.seconds += time.perf_counter() - t0

    def _send(self, last: list) -> None:
        self.compared = [(t.data_ptr(), tuple(t.shape)) for t in last]
        self.rows = None if self.internal else checking.rows_for_workers(self.generator, last)
        self.future = self.executor.collective_rpc(compare.check, args=(self.rows,), non_block=True)

    def confirm(self, results: list) -> None:
        """The comparison is of the rows the caller holds in ``results``: sent now if it was not."""
        if self.future is None:
            self._send([results[i]["hidden_states"][-1] for i in self.checked])
        elif not self.internal:  # the workers' own capture of the last layer needs no confirming
            for (ptr, shape), i in zip(self.compared, self.checked):
                got = results[i]["hidden_states"][-1]
                if got.data_ptr() != ptr or tuple(got.shape) != shape:
                    raise SelfCheckError(f"self-check: sequence {i}: the caller's last-layer tensor is not the "
                                         "results-in-place block the workers compared (the stock generate() "
                                         "handed out other tensors); nothing of this call should be saved")
        self.generator = None  # nothing more to send: a verdict left to come keeps no generator alive

    def result(self):
        """The workers' replies (awaited)."""
        return self.future.result()

    def close(self) -> None:
        checking.unshare(self.rows)
        self.rows = None


def _in_order(executor) -> bool:
    """vLLM takes the replies of messages sent without waiting in the order they were sent (its
    ``FutureWrapper`` queue), so one may stay outstanding while the next call runs."""
    return isinstance(getattr(lifecycle.real_executor(executor), "futures_queue", None), collections.deque)


def _judged(replies, totals, call: int) -> SelfCheckError | None:
    found = next((r for r in replies if r is not None), None) if replies else None
    if found is None:
        return SelfCheckError("self-check: no worker returned the comparison")
    totals.add(found, call)
    failure = checking.verdict(found, checking.tolerance())
    if failure:
        totals.failed = f"call {call}: {failure}"
        return SelfCheckError(f"{failure} (call {call} of this generator; nothing of this call is saved)")
    return None


def _verdict(comparison: Comparison, totals, call: int) -> SelfCheckError | None:
    """A call's verdict taken after the call (the ``Hold`` its samples wait for)."""
    real = lifecycle.real_executor(comparison.executor)
    try:
        if getattr(real, "is_failed", False) or getattr(real, "shutting_down", False):
            return SelfCheckError(f"self-check: the comparison of call {call} never came back (vLLM's executor "
                                  "stopped); nothing of that call is saved")
        t0 = time.perf_counter()
        replies = comparison.result()
        totals.seconds += time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - unverified rows are not saved, whatever stopped the comparison
        return SelfCheckError(f"self-check: the comparison of call {call} failed ({type(exc).__name__}: {exc}); "
                              "nothing of that call is saved")
    finally:
        comparison.close()
    totals.deferred += 1
    return _judged(replies, totals, call)


def _take_pending(totals) -> None:
    """The previous call's verdict, where it was left to come: its failure stops this call."""
    held, totals.pending = totals.pending, None
    if held is not None and not held.decided:
        error = held.settle()
        if error is not None:
            raise error


def _generate(wrapped, instance, args, kwargs):
    token_ids = kwargs["token_ids"] if "token_ids" in kwargs else (args[0] if args else None)
    totals = checking.totals_of(instance)
    _take_pending(totals)
    executor = getattr(instance, "executor", None)
    lengths = call_lengths(instance, token_ids)
    per_call = checking.sequences_per_call()
    most = checking.positions_per_sequence()
    full = checking.full_calls()
    if full and per_call == 0:
        from speculators_compat.patching import InvalidInputError

        raise InvalidInputError(f"SPECULATORS_COMPAT_UNVALIDATED=self-check needs the self-check, which "
                                f"{checking.SELF_CHECK_ENV}=0 turns off")
    if not lengths or executor is None or totals.off:
        return wrapped(*args, **kwargs)
    call = totals.seen
    totals.seen += 1
    checked = checking.sample(len(lengths), call, per_call, full)
    if not checked:
        return wrapped(*args, **kwargs)
    starts = list(itertools.accumulate([0] + lengths[:-1]))
    counter = instance._request_counter
    plan = checking.Plan({f"req_{counter}_{i}": (i, lengths[i], starts[i]) for i in checked},
                         0 if call < full else most, call)
    in_order = _in_order(executor)
    t0 = time.perf_counter()
    # once the workers have answered, armed without waiting: the call's next message takes the reply
    armed = executor.collective_rpc(compare.arm, args=(plan,), non_block=bool(totals.calls and in_order))
    totals.seconds += time.perf_counter() - t0
    if isinstance(armed, list) and (not armed or any(r is None for r in armed)):
        executor.collective_rpc(compare.arm, args=(None,))
        if full:
            from speculators_compat.patching import IncompatibleVllmError

            raise IncompatibleVllmError("SPECULATORS_COMPAT_UNVALIDATED=self-check: the workers do not run "
                                        "self-check-reference (disabled there, or vLLM's runner changed): this "
                                        "release cannot run under the self-check")
        totals.off = "the workers do not run self-check-reference"
        log.warning("self-check: off, %s", totals.off)
        return wrapped(*args, **kwargs)
    comparison = Comparison(instance, executor, checked, armed)
    reply.when_written(instance, comparison.send)
    done, held = False, None
    try:
        results = wrapped(*args, **kwargs)
        t0 = time.perf_counter()
        comparison.confirm(results)
        if in_order and call >= full:  # the samples of this call wait for the verdict, the next call does not
            held = atomic.hold([t for r in results for t in r["hidden_states"]],
                               functools.partial(_verdict, comparison, totals, call))
        replies = comparison.result() if held is None else None
        done = True
    finally:
        reply.take_written(instance)  # not run (the rows did not go through the segments): not for the next call
        if not done and not getattr(lifecycle.real_executor(executor), "is_failed", False):
            try:  # the workers stop recording (and have taken a comparison sent early); the call's own error
                executor.collective_rpc(compare.arm, args=(None,))  # is what the caller must see
            except Exception as exc:
                log.debug("self-check: could not disarm the workers: %s: %s", type(exc).__name__, exc)
        if held is None:
            comparison.close()
    totals.seconds += time.perf_counter() - t0 + comparison.seconds
    if held is not None:
        totals.pending = held
        return results
    error = _judged(replies, totals, call)
    if error is not None:
        raise error
    return results


apply = wrapping({"VllmHiddenStatesGenerator.generate": _generate})


PATCH = declare(
    title="the last layer's rows proven against the model's own next-token log-probs",
    delta="wrong rows (another sequence or position, shifted, captured at another point) returned silently "
    "-> SelfCheckError naming the sequence, the position and the difference",
    api="VllmHiddenStatesGenerator.generate (its request ids and per-sequence slicing)",
    kind=Kind.FEATURE,
    optional=True,  # without it the rows are unchecked, not changed
    after=("results-in-place", "guard-output"),  # checks what the guarded generate() returns
    upstream="not in speculators 0.3.x",
)
