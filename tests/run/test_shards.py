"""Unit tests of sharded runs (no vLLM, no torch): the blocks, the launchers' environments, the
folder's shard record, a shard's resume, and the runner driving ``tests/fake_datagen.py`` (the stock
0.4 script's save/resume code, without torch or vLLM) as shards, with ``--data-parallel`` and after
kills; its folders are compared with one process's and checked by ``verify``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import matrix
from speculators_compat.run import parallel, resume, shards, verify
from speculators_compat.services import manifest

# no vLLM needed: the unit tests and the full suites run them, not every release of the matrix
pytestmark = matrix.suite_is("full")

HERE = Path(__file__).parent.parent  # tests/
SCRIPT = str(HERE / "fake_datagen.py")
N = 23


# -- the blocks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("total", [0, 1, 5, 23, 100, 101])
@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 150])
def test_the_blocks_are_contiguous_disjoint_and_cover_the_dataset(total, count):
    blocks = shards.spans(total, count)
    assert blocks[0][0] == 0 and blocks[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    sizes = [end - start for start, end in blocks]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first total % count blocks are the longer ones
    assert sizes.count(total // count + 1) == (total % count if total % count else 0)


def test_the_split_of_a_launcher_shard_for_data_parallel():
    sub = shards.split(shards.Shard(1, 2, "RANK=1, WORLD_SIZE=2", "torch"), 4)
    assert [s.label for s in sub] == ["4/8", "5/8", "6/8", "7/8"]
    every = [s for i in range(2) for s in shards.split(shards.Shard(i, 2), 4)]
    assert sorted(s.index for s in every) == list(range(8))


def test_parse():
    assert shards.parse("3/8") == shards.Shard(3, 8)
    assert shards.parse(" 0 / 1 ").count == 1
    for bad in ("8/8", "-1/4", "1", "a/b", "1/0", ""):
        with pytest.raises(shards.ShardError):
            shards.parse(bad)


def test_the_launchers_environment():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "x"}
    assert shards.from_environment(torchrun) == shards.Shard(3, 8, "RANK=3, WORLD_SIZE=8", "torch")
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_JOB_ID": "1"}
    assert shards.from_environment(step).label == "5/6"
    step["SLURM_STEP_NUM_TASKS"] = "7"  # srun inside a larger allocation: the step's tasks count
    assert shards.from_environment(step).label == "5/7"
    # an sbatch script itself has SLURM_PROCID=0 and the job's SLURM_NTASKS, but is no step: not shard 0 alone
    assert shards.from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}) is None
    # torchrun started by srun (one per node): torch's ranks are the processes that extract
    assert shards.from_environment({**step, **torchrun}).label == "3/8"
    assert shards.from_environment({}) is None
    assert shards.from_environment({"RANK": "x", "WORLD_SIZE": "2"}) is None


def test_the_fingerprint_tells_datasets_apart():
    rows = [{"input_ids": list(range(i, i + 5))} for i in range(40)]
    assert shards.fingerprint(rows) == shards.fingerprint([dict(r) for r in rows])
    assert shards.fingerprint(rows) != shards.fingerprint(rows[:39])
    assert shards.fingerprint(rows) != shards.fingerprint(rows[1:] + rows[:1])
    assert shards.fingerprint([]) == shards.fingerprint([])


def test_the_record_is_written_once_and_contradictions_are_refused(tmp_path):
    shard = shards.Shard(0, 2)
    record = shards.agree(tmp_path, shard, 23, "sha256:a")
    assert record["spans"] == [[0, 12], [12, 23]] and record["dataset_length"] == 23
    assert shards.agree(tmp_path, shards.Shard(1, 2), 23, "sha256:a") == record
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards.json"]  # no staging file left
    with pytest.raises(shards.ShardError, match="records a run in 2 shards, this is shard 1/3"):
        shards.check_count(tmp_path, shards.Shard(1, 3))
    with pytest.raises(shards.ShardError, match="is not the one .* records"):
        shards.agree(tmp_path, shard, 22, "sha256:b")


# -- GPU groups --------------------------------------------------------------------------------------


def test_gpu_groups_and_the_tensor_parallel_size():
    gpus = [str(i) for i in range(8)]
    assert parallel.gpu_groups(gpus, 4, None) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    assert parallel.gpu_groups(gpus, 3, 2) == [["0", "1"], ["2", "3"], ["4", "5"]]
    with pytest.raises(shards.ShardError, match="need 8 GPUs; 3 visible"):
        parallel.gpu_groups(gpus[:3], 4, 2)
    assert parallel.tensor_parallel_size(["--x", "1", "--tensor-parallel-size", "2"]) == 2
    assert parallel.tensor_parallel_size(["--tensor-parallel-size=4", "--tensor-parallel-size", "8"]) == 8
    assert parallel.tensor_parallel_size(["--batch-size", "4"]) is None
    assert parallel.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == ["GPU-a", "GPU-b"]
    assert parallel.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    assert parallel.narrow_to_local_rank(env) == "4,5" and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert parallel.narrow_to_local_rank({"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) is None


# -- a shard's resume ----------------------------------------------------------------------------------


def _zip(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{path.stem}/data.pkl", b"\x80\x02}q\x00.")


def test_a_shard_repairs_its_block_only(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for i in list(range(0, 9)) + [11, 14, 15, 17]:
        _zip(out / f"data_{i}.pt")
    (out / "data_12.pt").write_bytes(b"cut")  # shard 1's block: 12 .. 22
    (out / ".data_16.pt.x1.tmp").write_bytes(b"")  # shard 1's interrupted write
    (out / ".data_3.pt.x2.tmp").write_bytes(b"")  # shard 0's: maybe being written right now
    _zip(out / "data_25.pt")  # beyond the dataset: the last shard's
    plan = resume.scan(out, span=(12, 23), total=23, shard="1/2")
    assert plan.resume_at == 12 and plan.kept == 0
    assert set(plan.set_aside) == {"data_12.pt", "data_14.pt", "data_15.pt", "data_17.pt", "data_25.pt",
                                   ".data_16.pt.x1.tmp"}
    assert plan.set_aside["data_12.pt"].startswith("not a complete torch.save archive")
    other = resume.scan(out, span=(0, 12), total=23, shard="0/2")
    assert other.resume_at == 9 and set(other.set_aside) == {"data_11.pt", ".data_3.pt.x2.tmp"}
    line = resume.describe(plan, Path("aside"))
    assert line.startswith(f"output folder {out}, shard 1/2 of 23 samples (data_12.pt .. data_22.pt): resuming at data_12.pt")


def test_the_config_belongs_to_the_shard_that_completes_the_dataset(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for i in range(10):
        _zip(out / f"data_{i}.pt")
    # shard 0 complete, shard 1 not: no config needed yet, nothing to redo
    assert resume.scan(out, span=(0, 5), total=12, shard="0/2").set_aside == {}
    # every sample there, no config (both shards ended before either saw the dataset complete)
    _zip(out / "data_10.pt")
    _zip(out / "data_11.pt")
    plan = resume.scan(out, span=(5, 12), total=12, shard="1/2")
    assert plan.resume_at == 11 and "regenerated so that this shard writes it" in plan.set_aside["data_11.pt"]
    # a config while the block has a hole claims a complete dataset: it goes
    (out / "data_config.json").write_text(json.dumps({"data": {"num_samples": 11}}))  # another dataset's
    plan = resume.scan(out, span=(5, 12), total=12, shard="1/2")
    assert plan.set_aside["data_config.json"] == "describes 11 samples, 12 are complete"
    assert plan.resume_at == 11 and "data_11.pt" in plan.set_aside
    (out / "data_config.json").write_text(json.dumps({"data": {"num_samples": 12}}))
    assert resume.scan(out, span=(5, 12), total=12, shard="1/2").set_aside == {}
    (out / "data_7.pt").unlink()
    plan = resume.scan(out, span=(5, 12), total=12, shard="1/2")
    assert plan.resume_at == 7 and "present while data_7.pt is missing" in plan.set_aside["data_config.json"]
    assert resume.describe(resume.scan(out, span=(0, 5), total=12, shard="0/2"), None).endswith(
        "every sample of the shard is there, nothing to do")


# -- the runner with shards -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    rng = random.Random(5)
    lines = []
    for _ in range(N):
        n = rng.randint(2, 40)
        lines.append(json.dumps({"input_ids": [rng.randrange(3, 500) for _ in range(n)],
                                 "loss_mask": [rng.randint(0, 1) for _ in range(n)]}))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def env(**extra) -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("SPECULATORS_COMPAT_", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
    out["CUDA_VISIBLE_DEVICES"] = ""  # no GPU: --data-parallel starts CPU processes
    out.update(extra)
    return out


def runner(data: Path, out: Path, *options: str, extra=(), environ=None, **popen):
    cmd = [sys.executable, "-m", "speculators_compat.run", *options, SCRIPT,
           "--train-data-path", str(data / "train.jsonl"), "--output-dir", str(out), *extra]
    return subprocess.Popen(cmd, env=environ or env(), cwd=data, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)


def run(data: Path, out: Path, *options: str, extra=(), environ=None) -> tuple[int, str]:
    proc = runner(data, out, *options, extra=extra, environ=environ)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout + stderr


def assert_same_folder(out: Path, one: Path) -> None:
    """The same sample files, record for record (zip timestamps aside), the same config and lengths."""
    per_run = (manifest.FILE,)  # one entry per process that wrote into the folder
    names = sorted(p.name for p in one.iterdir() if p.name not in per_run)
    assert sorted(p.name for p in out.iterdir() if p.name not in (shards.RECORD, shards.STATE_DIR, *per_run)) == names
    for name in names:
        if name.endswith(".pt"):
            with zipfile.ZipFile(one / name) as a, zipfile.ZipFile(out / name) as b:
                assert {n: a.read(n) for n in a.namelist()} == {n: b.read(n) for n in b.namelist()}, name
        else:
            assert json.loads((one / name).read_text()) == json.loads((out / name).read_text()), name


@pytest.fixture(scope="module")
def one(data):
    out = data / "one"
    rc, text = run(data, out)
    assert rc == 0, text
    assert verify.verify(out).complete
    return out


def test_shards_from_options_and_launchers_give_one_process_folder(data, one, tmp_path):
    out = tmp_path / "out"
    rc, text = run(data, out, "--shard", "0/3")
    assert rc == 0 and "shard 0/3 (--shard)" in text and "data_0.pt .. data_7.pt" in text, text
    assert "left to the shard that completes the dataset (8 of 23 samples there)" in text
    rc, text = run(data, out, environ=env(RANK="2", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"))
    assert rc == 0 and "shard 2/3 (RANK=2, WORLD_SIZE=3)" in text, text
    rc, text = run(data, out, environ=env(SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_NTASKS="3"))
    assert rc == 0 and "shard 1/3 (SLURM_PROCID=1, SLURM_NTASKS=3)" in text, text
    assert "completed the dataset (23 samples): writing data_config.json" in text
    assert_same_folder(out, one)
    assert json.loads((out / shards.RECORD).read_text())["spans"] == [[0, 8], [8, 16], [16, 23]]
    report = verify.verify(out)
    assert report.complete, verify.render(report)


def test_a_killed_shard_resumes_on_its_own(data, one, tmp_path):
    out = tmp_path / "out"
    rc, text = run(data, out, "--shard", "1/2", extra=["--batch-size", "2", "--die-at", "17"])
    assert rc == 3 and "dying before data_17.pt" in text, text
    # what a kill leaves: the block's last write cut short, a temporary file
    blob = (out / "data_15.pt").read_bytes()
    (out / "data_15.pt").write_bytes(blob[: len(blob) // 2])
    (out / ".data_16.pt.k3j2.tmp").write_bytes(blob[:10])
    rc, text = run(data, out, "--shard", "0/2")
    assert rc == 0, text
    report = verify.verify(out)
    kinds = {(f.kind, f.index) for f in report.findings}
    assert ("unreadable", 15) in kinds and ("hole", 16) in kinds and ("stray", None) in kinds, verify.render(report)
    rc, text = run(data, out, "--shard", "1/2")
    assert rc == 0, text
    assert "resuming at data_15.pt; kept data_12.pt .. data_14.pt (3 complete samples); set aside 2 file(s)" in text, text
    assert_same_folder(out, one)
    assert verify.verify(out).complete


def test_two_processes_on_one_shard_and_a_run_that_is_not_sharded_are_refused(data, tmp_path):
    out = tmp_path / "out"
    first = runner(data, out, "--shard", "0/2", extra=["--batch-size", "1", "--delay", "2"])
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("data_*.pt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        rc, text = run(data, out, "--shard", "0/2")
        assert rc == 1 and "shard 0/2 of" in text and "is being run by another process" in text, text
        rc, text = run(data, out)
        assert rc == 1 and "in use by another run, or by the shards of a sharded run" in text, text
        rc, text = run(data, out, "--shard", "1/3")
        assert rc == 1 and "records a run in 2 shards" in text, text
        rc, text = run(data, out, "--shard", "1/2", extra=["--max-samples", "20"])
        assert rc == 1 and "every shard must run the same command" in text, text
        rc, text = run(data, out, "--shard", "1/2", extra=["--start-idx", "4"])
        assert rc == 1 and "Leave --start-idx at 0" in text, text
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.communicate(timeout=60)


def test_a_launcher_environment_that_is_no_shard_runs_the_whole_dataset(data, one, tmp_path):
    out = tmp_path / "out"
    # inside an sbatch script, before any srun: SLURM_PROCID=0 and the job's SLURM_NTASKS, no step
    rc, text = run(data, out, environ=env(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_ID="7"))
    assert rc == 0 and "shard" not in text and not (out / shards.RECORD).exists(), text
    assert_same_folder(out, one)
    script = tmp_path / "other.py"
    script.write_text("print('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.run", str(script)], env=env(RANK="1", WORLD_SIZE="2"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "not sharded (only speculators' data_generation_offline.py" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.run", "--shard", "1/2", str(script)], env=env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "shard 1/2 (--shard) for" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.run", "--data-parallel", "2", str(script)],
                          env=env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not that script" in proc.stderr, proc.stderr


# -- --data-parallel ---------------------------------------------------------------------------------------


def test_data_parallel_shards_give_one_process_folder(data, one, tmp_path):
    out = tmp_path / "out"
    rc, text = run(data, out, "--data-parallel", "3")
    assert rc == 0, text
    assert "data parallel: 3 shards (0/3, 1/3, 2/3 of 3), on the CPU (no GPU visible)" in text
    assert "[shard 2/3] " in text and "data parallel: all 3 shards finished" in text
    assert_same_folder(out, one)
    # under a launcher: shard 1 of 2 nodes, 2 GPU groups each -> shards 2/4 and 3/4
    out2 = tmp_path / "out2"
    rc, text = run(data, out2, "--data-parallel", "2", environ=env(RANK="1", WORLD_SIZE="2"))
    assert rc == 0 and "(2/4, 3/4 of 4)" in text, text
    rc, text = run(data, out2, "--data-parallel", "2", environ=env(RANK="0", WORLD_SIZE="2"))
    assert rc == 0, text
    assert_same_folder(out2, one)


def test_a_dead_shard_stops_the_others_and_is_named(data, tmp_path):
    out = tmp_path / "out"
    # shard 1 (data_12 .. data_22) dies before data_14; shard 0 (12 samples, 1 s each) is still running
    rc, text = run(data, out, "--data-parallel", "2", extra=["--batch-size", "1", "--delay", "1", "--die-at", "14"])
    assert rc == 3, text
    line = next(ln for ln in text.splitlines() if "data parallel: shard" in ln)
    assert "shard 1/2 (pid" in line and "exited with code 3; stopped the other shards: shard 0/2" in line, line
    assert "exited with code 143" in line and "Run the same command again to resume" in line, line
    rc, text = run(data, out, "--data-parallel", "2")
    assert rc == 0, text
    assert verify.verify(out).complete


def test_ctrl_c_stops_every_shard_cleanly(data, tmp_path):
    out = tmp_path / "out"
    proc = runner(data, out, "--data-parallel", "2", extra=["--batch-size", "1", "--delay", "0.5"])
    deadline = time.monotonic() + 60
    while len(list(out.glob("data_*.pt"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the runner it started
    stdout, stderr = proc.communicate(timeout=60)
    text = stdout + stderr
    assert proc.returncode == 130, text
    line = next(ln for ln in text.splitlines() if "data parallel: interrupted by SIGINT" in ln)
    assert "shard 0/2 (pid" in line and "shard 1/2 (pid" in line and line.count("exited with code 130") == 2, line
    assert "[shard 0/2]" in text and "interrupted by SIGINT (Ctrl-C)" in text
    rc, text = run(data, out, "--data-parallel", "2")
    assert rc == 0 and verify.verify(out).complete, text
