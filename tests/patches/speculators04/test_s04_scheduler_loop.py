"""s04-scheduler-loop: the probe reads speculators 0.4's generate loop; the scheduler wrapper frees
the requests whose prompt is fully computed before the next schedule."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from speculators_compat.patches.speculators04 import s04_scheduler_loop as patch


#: end to end (tests/test_e2e.py, speculators 0.4.0.1): the step that fails when the patch alone is
#: disabled, and a fragment of the failure
NEEDED_04 = {"s04-scheduler-loop": ("mixed", "not found in captured states")}


def test_the_judgement():
    assert patch._judge("while not self.all_prefill_complete(): self.scheduler.schedule()").shape.value == "new"
    assert patch._judge("out = self.scheduler.update_from_output(so, mo)").shape.value == "old"
    assert patch._judge("for step in steps: pass").shape.value == "unknown"


class _Req:
    def __init__(self, computed, prompt, finished=False):
        self.num_computed_tokens, self.num_prompt_tokens, self._finished = computed, prompt, finished

    def is_finished(self):
        return self._finished


def test_prefilled_requests_are_finished_before_the_next_schedule(monkeypatch):
    status = SimpleNamespace(FINISHED_ABORTED="aborted")
    request_mod = SimpleNamespace(RequestStatus=status)
    monkeypatch.setitem(sys.modules, "vllm.v1.request", request_mod)
    finished = []
    scheduler = SimpleNamespace(
        requests={"a": _Req(5, 5), "b": _Req(2, 5), "c": _Req(9, 5, finished=True)},
        finish_requests=lambda ids, why: finished.append((ids, why)),
    )
    monkeypatch.setattr(patch, "remember_idle", lambda sched, out: out)
    wrapped = lambda: "output"  # noqa: E731
    wrapped.__self__ = scheduler
    assert patch._free_prefilled(wrapped, None, (), {}) == "output"
    assert finished == [(["a"], "aborted")]
