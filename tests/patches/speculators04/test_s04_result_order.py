"""s04-result-order: the order speculators 0.4 returns results in, inverted."""

from __future__ import annotations

import pytest


#: end to end (tests/test_e2e.py, speculators 0.4.0.1): the step that fails when the patch alone is
#: disabled, and a fragment of the failure
NEEDED_04 = {
    # the output guard catches the reordering; without it only the position check would
    "s04-result-order": ("mixed", "CaptureContractError: sequence 2: input_ids do not match the input"),
    "s04-result-order,guard-output": ("mixed", "sequence 2: input_ids differ from the input"),
}


@pytest.mark.parametrize("n", [1, 2, 10, 11, 12, 42, 120])
def test_s04_result_order_inverts_the_string_sort_of_request_ids(n):
    from speculators_compat.patches.speculators04.s04_result_order import input_order

    ids = [f"req_7_{i}" for i in range(n)]
    stock_order = [int(rid.rsplit("_", 1)[1]) for rid in sorted(ids)]  # what speculators 0.4 returns
    assert input_order(n) == stock_order
    assert sorted(input_order(n)) == list(range(n))
