"""The user's world (issue #46): a typo, a fresh machine, a full disk, a small /dev/shm each end
in seconds with an error that says what to do. The runner tests drive ``tests/fake_datagen.py``
(the stock script's save/resume code, neither torch nor vLLM) through ``speculators-compat run``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speculators_compat import cli
from speculators_compat.check import command as check_command

HERE = Path(__file__).parent
SCRIPT = str(HERE / "fake_datagen.py")


def _env(**extra) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SPECULATORS_COMPAT_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    out.update(extra)
    return {k: v for k, v in out.items() if v is not None}


def _data(root: Path) -> Path:
    (root / "train.jsonl").write_text('{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}\n')
    return root / "train.jsonl"


def _run(cwd: Path, *args: str, environ=None, timeout=120) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.run", SCRIPT, *args], cwd=cwd,
                          env=environ or _env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')
    return folder


# -- a typo through the runner ------------------------------------------------------------------


def test_a_misspelt_model_folder_is_named_with_the_nearest_folder_and_no_output_folder_is_made(tmp_path):
    _model(tmp_path / "tiny-llama")
    data = _data(tmp_path)
    code, out, _ = _run(tmp_path, "--target-model-path", "./tiny-lama", "--train-data-path", str(data),
                        "--output-dir", "out")
    assert code == 2, out
    assert "speculators-compat run: --target-model-path: model path './tiny-lama' does not exist" in out, out
    assert f"the nearest folder that exists is {tmp_path}" in out, out
    assert "Traceback" not in out, out
    assert not (tmp_path / "out").exists()  # a run that did nothing leaves nothing


def test_a_model_folder_without_config_json_is_refused_before_the_script_runs(tmp_path):
    (tmp_path / "weights").mkdir()
    data = _data(tmp_path)
    code, out, _ = _run(tmp_path, "--target-model-path", "./weights", "--train-data-path", str(data),
                        "--output-dir", "out")
    assert code == 2 and "has no config.json" in out, out
    assert not (tmp_path / "out").exists()


def test_a_misspelt_data_file_is_named(tmp_path):
    _data(tmp_path)
    code, out, _ = _run(tmp_path, "--train-data-path", "trian.jsonl", "--output-dir", "out")
    assert code == 2, out
    assert "--train-data-path 'trian.jsonl' does not exist" in out, out
    assert "Traceback" not in out and not (tmp_path / "out").exists(), out


def test_an_output_folder_whose_parent_does_not_exist_is_refused_not_created(tmp_path):
    data = _data(tmp_path)
    code, out, _ = _run(tmp_path, "--train-data-path", str(data), "--output-dir", str(tmp_path / "sahred" / "out"))
    assert code == 2, out
    assert f"its parent folder {tmp_path / 'sahred'} does not exist" in out, out
    assert f"the nearest folder that exists is {tmp_path}" in out, out
    assert not (tmp_path / "sahred").exists()


def test_right_paths_still_run_to_the_end(tmp_path):
    model = _model(tmp_path / "tiny-llama")
    data = _data(tmp_path)
    code, out, _ = _run(tmp_path, "--target-model-path", str(model), "--train-data-path", str(data),
                        "--output-dir", "out")
    assert code == 0, out
    assert (tmp_path / "out" / "data_0.pt").is_file()


def test_a_hub_id_that_is_not_cached_while_the_hub_is_unreachable_ends_in_seconds(tmp_path):
    pytest.importorskip("huggingface_hub")
    data = _data(tmp_path)
    environ = _env(HF_HUB_OFFLINE=None, TRANSFORMERS_OFFLINE=None, HF_HOME=str(tmp_path / "hf"),
                   HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens on port 9: refused at once
    code, out, took = _run(tmp_path, "--target-model-path", "nobody/no-such-model", "--train-data-path", str(data),
                           "--output-dir", "out", environ=environ)
    assert code == 2, out
    assert "the Hugging Face hub cannot be reached" in out and "HF_HUB_OFFLINE=1" in out, out
    assert out.count("trying it as a Hugging Face hub id") <= 1, out  # each line once
    assert took < 30, took
    assert not (tmp_path / "out").exists()


def test_a_hub_id_that_is_not_cached_offline_is_named_at_once(tmp_path):
    pytest.importorskip("huggingface_hub")
    data = _data(tmp_path)
    environ = _env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    code, out, _ = _run(tmp_path, "--target-model-path", "nobody/no-such-model", "--train-data-path", str(data),
                        "--output-dir", "out", environ=environ)
    assert code == 2, out
    assert "not in the local hub cache while HF_HUB_OFFLINE=1" in out, out
    assert "Traceback" not in out and not (tmp_path / "out").exists(), out


# -- a typo elsewhere ---------------------------------------------------------------------------


def test_a_misspelt_disabled_id_lists_the_known_ids_and_no_pin_advice(monkeypatch, capsys):
    monkeypatch.setenv("SPECULATORS_COMPAT_DISABLE", "v55")
    code = check_command.main([])
    out = capsys.readouterr().out
    assert code == 1
    assert "SPECULATORS_COMPAT_DISABLE names no patch: v55. Known ids: " in out, out
    assert "guard-input" in out.split("Known ids:", 1)[1].splitlines()[0], out
    assert "pin it" not in out and "nearest validated set" not in out, out


def test_an_unknown_command_is_named_with_the_commands(capsys):
    assert cli.main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown command: bogus" in err, err
    for command in ("check", "demo", "run", "verify"):
        assert command in err.splitlines()[0], err
