"""runner-v1: the V1 runner kept unless the user asks for Model Runner V2, and MRv2 let run only
where mrv2-rows is on and validated on the installed release (the validation table decides)."""

from __future__ import annotations

import importlib

import pytest

from probe_inputs import inst
from speculators_compat.check import validation
from speculators_compat.core.registry import Context
from speculators_compat.errors import IncompatibleVllmError


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "runner-v1": (
        "the CPU builds never pick Model Runner V2: tests/test_e2e.py "
        "test_model_runner_v2_asked_for_is_refused"
    ),
}

runner_v1 = importlib.import_module("speculators_compat.patches.vllm_api.runner_v1")
VAR = runner_v1.VAR


def context(applied=("runner-v1",), vllm="0.26.0", spec="0.3.0", disabled=(), recording=False) -> Context:
    """An install of vLLM ``vllm`` whose validation run (CUDA, on that release) applied ``applied``."""
    v, s, t = inst(vllm, "vllm"), inst(spec, "speculators"), inst("5.17.0", "transformers")
    table = validation.table({"schema": 1, "runs": [{"vllm": "0.26.0", "speculators": spec, "platform": "cuda",
                                                     "transformers": "5.17.0", "applied": list(applied)}]})
    ev = validation.evidence(s.base, table)
    return Context(v, s, frozenset(disabled), ev.covering(v.base, t.version), recording, (), t, ev)


@pytest.fixture
def init(monkeypatch):
    """Calls runner-v1's wrapper of the generator's ``__init__`` under a given context and variable."""

    def call(value, ctx):
        if value is None:
            monkeypatch.delenv(VAR, raising=False)
        else:
            monkeypatch.setenv(VAR, value)
        monkeypatch.setattr(runner_v1, "context", lambda: ctx)
        return runner_v1._init(lambda: "built", None, (), {})

    return call


def test_unset_the_v1_runner_is_chosen(init, monkeypatch):
    assert init(None, context()) == "built"
    import os

    assert os.environ[VAR] == "0"


def test_asked_for_where_mrv2_rows_is_not_validated_refuses_naming_where_it_is(init):
    with pytest.raises(IncompatibleVllmError) as err:
        init("1", context(applied=("runner-v1",)))
    msg = str(err.value)
    assert msg.startswith(f"[runner-v1] {VAR}=1:") and "validated on no vLLM release" in msg
    assert "unset VLLM_USE_V2_MODEL_RUNNER" in msg


def test_asked_for_where_mrv2_rows_is_validated_runs_mrv2(init):
    assert init("true", context(applied=("runner-v1", "mrv2-rows"))) == "built"
    assert init("1", context(applied=(), recording=True)) == "built"  # a validation run records it


@pytest.mark.parametrize("disabled", [("mrv2-rows",), ("all",)])
def test_asked_for_with_mrv2_rows_disabled_refuses(init, disabled):
    with pytest.raises(IncompatibleVllmError, match=r"mrv2-rows, which places its rows by request id, is off here "
                       r"\(disabled by SPECULATORS_COMPAT_DISABLE\)"):
        init("1", context(applied=("runner-v1", "mrv2-rows"), disabled=disabled))


def test_asked_for_under_speculators_04_refuses(init):
    with pytest.raises(IncompatibleVllmError, match=r"is off here \(speculators 0.4.1 is outside >=0.3.0,<0.4\)"):
        init("1", context(applied=("runner-v1", "mrv2-rows"), spec="0.4.1"))


def test_set_to_zero_is_left_alone(init, monkeypatch):
    assert init("0", context()) == "built"
    import os

    assert os.environ[VAR] == "0"
