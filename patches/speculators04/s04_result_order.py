"""s04-result-order -- speculators 0.4 returns results in string order of request ids.

Problem: speculators 0.4.0/0.4.0.1 builds its results with ``for req_id in
sorted(request_id_to_idx)``: request ids are strings (``req_<call>_<i>``), so from 11
sequences up the results come back as ``[0, 1, 10, 2, 3, ...]``. Each result is internally
consistent (its ``input_ids`` match its states), so nothing fails -- but the stock data
script pairs results with loss masks by position: wrong training data, silently.

How: ``VllmHiddenStatesGenerator.generate`` is wrapped and the results are put back in input
order (the permutation is exactly the string sort of the indices, since every id of one call
shares its prefix). The output guard then checks that every result's ``input_ids`` equal the
input at that position.

Detection: the source of ``generate`` iterates ``sorted(request_id_to_idx...)``; without it,
not needed.

Remove when speculators returns results in input order (deleted generator in 0.5).
"""

from __future__ import annotations

from speculators_compat.patching import Probe, declare

from .._probes import generate_probes, wrapping

MARK = "sorted(request_id_to_idx"


def _judge(source: str) -> Probe:
    if MARK in source:
        return Probe.new(f"generate() builds results from {MARK}...)")
    return Probe.old(f"generate() has no {MARK}...)")


probe, static_probe = generate_probes(_judge)


def input_order(n: int) -> list[int]:
    """``input_order(n)[k]`` is the input index of the k-th result of the string-sorted loop."""
    return sorted(range(n), key=str)


def _generate(wrapped, instance, args, kwargs):
    results = wrapped(*args, **kwargs)
    ordered = [None] * len(results)
    for k, i in enumerate(input_order(len(results))):
        ordered[i] = results[k]
    return ordered


apply = wrapping({"VllmHiddenStatesGenerator.generate": _generate})


PATCH = declare(
    title="results in input order (speculators 0.4)",
    delta="results sorted by string request id -> input order",
    api="speculators VllmHiddenStatesGenerator.generate (0.4.x)",
    after=("s04-scheduler-loop",),  # reorders what the repaired loop returns
)
