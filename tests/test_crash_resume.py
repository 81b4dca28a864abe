"""End-to-end: a long extraction run that dies loses no data (issue #11), on the real vLLM.

The stock offline data-generation script is run through ``speculators-compat run`` on a
tiny local Llama, in its own session (process group), and killed the ways real runs die:

* SIGKILL of the whole process group at random moments, five times, each time followed by
  the same command again, until it finishes: the folder must hold every ``data_<i>.pt``
  exactly once, every file must load, and input_ids / loss masks must equal a clean run's,
  the states within fp32 precision (a resumed batch has other neighbours), and the shared
  memory each killed group left in /dev/shm must have been removed by the next run;
* the state such a kill leaves, built by hand (a truncated file, a hole below the highest
  index, no ``data_config.json``, a temporary file), then the same command again; and the
  same state under the stock code alone, which keeps the hole and the truncated file;
* SIGKILL of one vLLM worker during a call, and Ctrl-C (SIGINT) during a call, at TP=1 and
  TP=2: a clear error naming the worker within 30 s (resp. the shutdown line and exit code
  130), no process of the run left, no shared-memory segment of the run left in /dev/shm;
* two shards of one run on one folder, as torchrun and srun start them, one SIGKILLed and
  resumed by ``--data-parallel 2``: the folder equals a clean run's, ``verify`` passes on it and
  names a hole, a duplicate and a truncated file in a damaged copy.

The script is ``tests/stock_datagen.py`` (a stand-in that reproduces the real script's save
and resume code; the real one is not in the speculators wheel). With
``SPECULATORS_COMPAT_REAL_DATAGEN=/path/to/data_generation_offline.py`` (speculators 0.3.0's
``scripts/``) the tests run the real script instead, on a chat-format dataset.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("speculators")

import matrix  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from watch import Logged, all_pids, cmdline, shm_names  # noqa: E402  (the multi-GPU watcher reads /proc the same way)

# the full suite only (vLLM 0.16): each case starts vLLM, several times over
pytestmark = matrix.suite_is("full")
ENV = matrix.current()
TPS = [1, 2] if ENV is None or ENV.tp2 else [1]
run_kills = pytest.mark.skipif(ENV is not None and not ENV.run_kills,
                               reason=f"{ENV and ENV.name}: the whole-run kills run in another environment")

HERE = Path(__file__).parent
REAL = os.environ.get("SPECULATORS_COMPAT_REAL_DATAGEN", "")
SCRIPT = REAL or str(HERE / "stock_datagen.py")
LAYERS = ["0", "2", "5", "7"]
N_SAMPLES = 40
BATCH = 4
TOL = 1e-4
#: the stand-in sleeps this long after each batch: the tiny model's 10 batches would otherwise
#: all be done within a second of the start-up, leaving the kills nothing to land in
SLOW = {"SPECULATORS_DATAGEN_DELAY": "0.4"}
# back-to-back calls for the tests that interrupt a call: 0.3 s after the first call's log line
# one is running (a whole tiny run ends in < 1 s on a fast CPU: the kill found it finished)
BUSY = {"SPECULATORS_DATAGEN_REPEAT": "50"}


# -- the run ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama (with a chat template, for the real script) and a dataset of N_SAMPLES."""
    from speculators_compat.testing import tiny

    root = tmp_path_factory.mktemp("crash")
    model = tiny.build_llama(root / "model")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    rng = random.Random(11)
    lines = []
    if REAL:
        words = "the quick brown fox jumps over lazy dog hidden states flow through every layer".split()
        for _ in range(N_SAMPLES):
            conv = []
            for _ in range(rng.randint(1, 3)):
                conv.append({"from": "human", "value": " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))})
                conv.append({"from": "gpt", "value": " ".join(rng.choice(words) for _ in range(rng.randint(2, 90)))})
            lines.append(json.dumps({"conversations": conv}))
    else:
        for _ in range(N_SAMPLES):
            n = rng.randint(20, 400)
            lines.append(json.dumps({
                "input_ids": [rng.randrange(3, 500) for _ in range(n)],
                "loss_mask": [int(rng.random() < 0.6) for _ in range(n)],
            }))
    data = root / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return {"root": root, "model": str(model), "data": str(data)}


def command(setup, out: Path, tp: int = 1, batch: int = BATCH) -> list[str]:
    cmd = [
        sys.executable, "-m", "speculators_compat.run", SCRIPT,
        "--target-model-path", setup["model"], "--train-data-path", setup["data"],
        "--output-dir", str(out), "--layer-ids", *LAYERS, "--batch-size", str(batch),
        "--tensor-parallel-size", str(tp),
    ]
    if REAL:
        root = setup["root"]
        cmd += ["--num-preprocessing-workers", "1", "--hf-cache-dir", str(root / "hf-cache"),
                "--token-freq-path", str(root / "token_freq.pt")]
    return cmd


def environment(**extra) -> dict:
    # a validation run (SPECULATORS_COMPAT_RECORD) reaches the child: it must apply what a recorded release would
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")
           or k in ("SPECULATORS_COMPAT_RECORD", matrix.ENV_VAR)}
    env.update(
        SPECULATORS_COMPAT_DTYPE="float32", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1",
        VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    env.update(extra)
    return env


def terminal_sigint() -> None:
    """Give the runs SIGINT at its default, as a terminal's foreground job has it. A test run
    started in the background of a non-interactive shell (``cmd &``) inherits SIGINT ignored,
    the runs under test would too (an ignored signal survives exec), and the Ctrl-C test's
    SIGINT would stop only the vLLM workers, which set their own handler."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Run(Logged):
    """One run in its own session: its output, its processes, the /dev/shm names they map."""

    def __init__(self, cmd, env, cwd, log: Path):
        self.log_path = log
        self.log = open(log, "w")
        self.started = time.monotonic()
        terminal_sigint()
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.sid = self.proc.pid
        self.shm: set[str] = set()
        self.first_seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._sample, daemon=True)
        self._watch.start()

    def _sample(self):
        while not self._stop.is_set():
            for name in shm_names(session_pids(self.sid)) - self.shm:
                self.first_seen[name] = time.monotonic()
                self.shm.add(name)
            self._stop.wait(0.2)

    def kill_group(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.sid, sig)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = 900) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            rc = self.proc.wait()
            pytest.fail(f"the run did not end within {timeout} s:\n{self.text()[-4000:]}")
        self._stop.set()
        self._watch.join()
        self.log.close()
        return rc

    def leftovers(self, grace: float = 10.0) -> tuple[list[str], list[str]]:
        """Processes of the run's session still alive, and /dev/shm names it mapped that still exist."""
        end = time.monotonic() + grace
        while session_pids(self.sid) and time.monotonic() < end:
            time.sleep(0.2)
        procs = [f"{p} {cmdline(p)}" for p in session_pids(self.sid)]
        shm = sorted(n for n in self.shm if os.path.exists(f"/dev/shm/{n}"))
        return procs, shm

    def unlink_shm(self, names=None) -> list[str]:
        """Remove segments of this run that are still in /dev/shm (test hygiene)."""
        gone = []
        for name in sorted(self.shm if names is None else names):
            try:
                os.unlink(f"/dev/shm/{name}")
                gone.append(name)
            except OSError:
                pass
        return gone


def session_pids(sid: int) -> list[int]:
    out = []
    for pid in all_pids():
        try:
            if os.getsid(pid) == sid:
                out.append(pid)
        except OSError:
            continue
    return out


def samples(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.iterdir() if p.name.endswith("pt")), key=lambda n: (len(n), n))


def assert_same_dataset(out: Path, clean: Path, n: int = N_SAMPLES) -> float:
    """Every data_<i>.pt exactly once and loadable; ids and masks equal, states within TOL."""
    import torch

    assert samples(out) == [f"data_{i}.pt" for i in range(n)], samples(out)
    # a sharded run keeps its locks in .speculators-compat-shards (no *pt file: the trainer ignores it)
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != ".speculators-compat-shards"], \
        "temporary files left in the output folder"
    config = json.loads((out / "data_config.json").read_text())
    assert config["data"]["num_samples"] == n
    if (clean / "sample_lengths.json").exists():  # the speculators 0.4 script
        assert json.loads((out / "sample_lengths.json").read_text()) == json.loads((clean / "sample_lengths.json").read_text())
    worst = 0.0
    for i in range(n):
        got = torch.load(out / f"data_{i}.pt", weights_only=True)
        want = torch.load(clean / f"data_{i}.pt", weights_only=True)
        assert torch.equal(got["input_ids"], want["input_ids"]), i
        assert torch.equal(got["loss_mask"], want["loss_mask"]), i
        assert len(got["hidden_states"]) == len(want["hidden_states"]) == len(LAYERS)
        for a, b in zip(got["hidden_states"], want["hidden_states"]):
            assert a.shape == b.shape, i
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    assert worst <= TOL, f"max abs diff against the clean run {worst:.3g} > {TOL}"
    return worst


@pytest.fixture(scope="module")
def clean(setup):
    """A run nobody kills: the reference dataset, itself compared with HF fp32 on a few samples."""
    import torch

    from speculators_compat.testing import tiny

    out = setup["root"] / "clean"
    run = Run(command(setup, out), environment(), setup["root"], setup["root"] / "clean.log")
    rc = run.finish()
    assert rc == 0, run.text()[-5000:]
    assert samples(out) == [f"data_{i}.pt" for i in range(N_SAMPLES)]
    for i in (0, 17, N_SAMPLES - 1):
        saved = torch.load(out / f"data_{i}.pt", weights_only=True)
        ref = tiny.hf_reference(setup["model"], saved["input_ids"].tolist(), [int(x) for x in LAYERS])
        assert max((a - b).abs().max().item() for a, b in zip(saved["hidden_states"], ref)) <= TOL
    return out


# -- kills of the whole run ------------------------------------------------------------------


@run_kills
def test_killed_five_times_at_random_then_resumed_equals_a_clean_run(setup, clean, tmp_path):
    seed = int(os.environ.get("SPECULATORS_COMPAT_KILL_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    out = tmp_path / "out"
    history = []
    killed = []
    for attempt in range(5):
        have = len(samples(out)) if out.exists() else 0
        run = Run(command(setup, out), environment(**SLOW), tmp_path, tmp_path / f"run{attempt}.log")
        if rng.random() < 0.2:  # anywhere: start-up, the resume itself, the first batches
            where = f"at {rng.uniform(2, 25):.1f} s"
            deadline = time.monotonic() + float(where.split()[1])
            while time.monotonic() < deadline and run.proc.poll() is None:
                time.sleep(0.05)
        else:  # once the run has written a few new files, a random moment later
            target = have + rng.randint(1, 2 * BATCH)
            delay = rng.uniform(0, 1.5)
            where = f"{delay:.2f} s after {target} files"
            while run.proc.poll() is None and len(samples(out) if out.exists() else []) < target:
                time.sleep(0.02)
            time.sleep(delay)
        finished = run.proc.poll() is not None
        killed_at = time.monotonic()
        run.kill_group()
        run.finish()
        run.leftovers(grace=5)
        killed.append((run, killed_at))
        left = [n for n in run.shm if os.path.exists(f"/dev/shm/{n}")]
        repair = re.search(r"output folder \S+: ((?:resuming at data_\d+\.pt|no complete sample yet).*)", run.text())
        history.append(f"run {attempt + 1}: {repair.group(1) if repair else 'killed before its repair'}; "
                       f"killed {where}{' (had already ended)' if finished else ''} with "
                       f"{len(samples(out)) if out.exists() else 0} files, leaving {len(left)} shm segment(s)")
    final = Run(command(setup, out), environment(), tmp_path, tmp_path / "final.log")
    rc = final.finish()
    text = final.text()
    assert rc == 0, f"seed {seed}; {history}\n{text[-5000:]}"
    assert re.search(r"output folder .*: resuming at data_\d+\.pt", text), text[-3000:]
    worst = assert_same_dataset(out, clean)
    # what each killed group left in /dev/shm was removed by the next run, except segments
    # made in the last moment before the kill (the runner records them every 0.5 s)
    late = []
    for run, killed_at in killed:
        for name in run.shm:
            if os.path.exists(f"/dev/shm/{name}"):
                assert run.first_seen[name] > killed_at - 1.5, f"{name} of {run.log_path.name} was left in /dev/shm"
                late += run.unlink_shm([name])
    history.append(f"segments made < 1.5 s before a kill and left: {len(late)}")
    repair = re.search(r"output folder \S+: resuming at.*", text).group(0)
    print(f"seed {seed}:\n  " + "\n  ".join(history) + f"\n  final run: {repair}\n  max abs diff {worst:.2g}")


def damage(out: Path) -> None:
    """What a kill can leave: a truncated file, a hole below the highest index, no config,
    a temporary file of an interrupted atomic write."""
    blob = (out / "data_9.pt").read_bytes()
    (out / "data_9.pt").write_bytes(blob[: len(blob) // 2])
    (out / "data_4.pt").unlink()
    (out / "data_config.json").unlink()
    (out / ".data_23.pt.k3j2.tmp").write_bytes(blob[:100])


def test_same_command_after_a_kill_state_completes_the_dataset(setup, clean, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    damage(out)
    run = Run(command(setup, out), environment(), tmp_path, tmp_path / "rerun.log")
    rc = run.finish()
    text = run.text()
    assert rc == 0, text[-5000:]
    line = next(ln for ln in text.splitlines() if "output folder" in ln and "resuming at" in ln)
    # data_3 goes too: no config means the last run did not finish, and the stock script writes its config at the end
    assert "resuming at data_3.pt; kept data_0.pt .. data_2.pt (3 complete samples)" in line, line
    assert "data_9.pt (not a complete torch.save archive" in line and "1 temporary file(s)" in line, line
    aside = Path(re.search(r"set aside \d+ file\(s\) to (\S+):", line).group(1))
    assert aside.parent == out.parent / "out.set-aside"
    manifest = (aside / "MANIFEST.txt").read_text()
    assert "data_9.pt\tnot a complete torch.save archive" in manifest
    assert (aside / "data_39.pt").exists() and (aside / ".data_23.pt.k3j2.tmp").exists()
    assert_same_dataset(out, clean)


def test_stock_code_alone_keeps_the_hole_and_the_truncated_file(setup, clean, tmp_path):
    """The issue itself: without the runner's folder repair and atomic saves, the same state
    is 'complete' to the stock max + 1 resume -- the hole and the truncated file stay."""
    import torch

    out = tmp_path / "out"
    shutil.copytree(clean, out)
    damage(out)
    run = Run(command(setup, out), environment(SPECULATORS_COMPAT_DISABLE="resume,atomic-save"),
              tmp_path, tmp_path / "stock.log")
    rc = run.finish()
    text = run.text()
    assert rc == 0 and "All samples already processed!" in text, text[-3000:]
    assert "data_4.pt" not in samples(out) and not (out / "data_config.json").exists()
    with pytest.raises(Exception, match="zip"):
        torch.load(out / "data_9.pt", weights_only=True)


# -- a worker dies, Ctrl-C --------------------------------------------------------------------


def _worker_death_range() -> bool:
    from packaging.specifiers import SpecifierSet

    from speculators_compat.core import versions
    from speculators_compat.core import hooks

    patch = next(p for p in hooks.patches() if p.id == "worker-death")
    return SpecifierSet(patch.vllm).contains(versions.vllm().base, prereleases=True)


# worker-death covers vLLM 0.11.1 and later (its docstring says how, in each release's executor shape)
@pytest.mark.skipif(not _worker_death_range(), reason="worker-death: outside its vLLM range on this release")
@pytest.mark.parametrize("tp", TPS)
def test_a_worker_killed_mid_call_is_named_within_30_s(setup, tmp_path, tp):
    out = tmp_path / "out"
    run = Run(command(setup, out, tp=tp, batch=16), environment(**BUSY), tmp_path, tmp_path / "run.log")
    assert run.wait_for(r"generate\(\): 16 sequences", 600), run.text()[-4000:]
    time.sleep(0.3)  # the next call has started: the saves are asynchronous
    workers = [p for p in session_pids(run.sid) if "VLLM::Worker" in cmdline(p)]
    assert len(workers) == tp, [cmdline(p) for p in session_pids(run.sid)]
    victim = workers[-1]
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert run.wait_for(r"WorkerDiedError", 30), run.text()[-4000:]
    seconds = time.monotonic() - killed
    rc = run.finish(timeout=120)
    text = run.text()
    procs, shm = run.leftovers()
    error = next(ln for ln in text.splitlines() if "WorkerDiedError:" in ln)
    assert rc == 1, text[-3000:]
    assert f"(pid {victim}, rank {tp - 1} of {tp}) was killed by SIGKILL" in error, error
    assert "during generate()" in error and "run the same command again" in error
    assert "executor was shut down by vLLM after a worker died" in text
    assert "shut down cleanly" not in text
    assert "leaked shared_memory" not in text  # the dead worker's buffer was unlinked at once
    assert procs == [] and shm == [], (procs, shm)
    # with pipelined-steps the death usually surfaces from a reply still outstanding
    via = "a pipelined step's outstanding reply" if "pipelined_steps.py" in text else "a blocking call"
    print(f"TP={tp}: WorkerDiedError {seconds:.1f} s after the SIGKILL, raised from {via}; {error[:300]}")


@pytest.mark.parametrize("tp", TPS)
def test_ctrl_c_mid_call_stops_cleanly_with_exit_code_130(setup, tmp_path, tp):
    out = tmp_path / "out"
    run = Run(command(setup, out, tp=tp, batch=16), environment(**BUSY), tmp_path, tmp_path / "run.log")
    assert run.wait_for(r"generate\(\): 16 sequences", 600), run.text()[-4000:]
    time.sleep(0.3)
    sent = time.monotonic()
    run.kill_group(signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    rc = run.finish(timeout=120)
    seconds = time.monotonic() - sent
    text = run.text()
    procs, shm = run.leftovers()
    assert rc == 130, text[-4000:]
    line = next(ln for ln in text.splitlines() if "interrupted by SIGINT" in ln)
    assert "exit code 130" in line and "Run the same command again to resume" in line, line
    assert "Traceback" not in text, text[-4000:]
    assert procs == [] and shm == [], (procs, shm)
    print(f"TP={tp}: exit 130 {seconds:.1f} s after SIGINT; {line[-200:]}")


# -- shards of one run -------------------------------------------------------------------------


# TP=2 shards (4 vLLM workers at once) only on request: on 2 cores they take minutes
SHARD_TPS = [1] + ([2] if 2 in TPS and os.environ.get("SPECULATORS_COMPAT_SHARDS_TP2") else [])


@run_kills
@pytest.mark.parametrize("tp", SHARD_TPS)
def test_two_shards_one_killed_and_resumed_equal_a_clean_run(setup, clean, tmp_path, tp):
    """Shard 0 as torchrun starts it (RANK / WORLD_SIZE) and shard 1 as an srun step does
    (SLURM_PROCID / SLURM_NTASKS), at once on one folder; shard 1 is SIGKILLed after a few files
    of its block, then ``--data-parallel 2`` completes the run (shard 0's block is complete: it
    starts no engine). ``SPECULATORS_COMPAT_SHARDS_TP2=1`` adds the same at TP=2."""
    out = tmp_path / "out"
    first = Run(command(setup, out, tp=tp), environment(RANK="0", WORLD_SIZE="2"), tmp_path, tmp_path / "shard0.log")
    second = Run(command(setup, out, tp=tp), environment(SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_NTASKS="2", **SLOW),
                 tmp_path, tmp_path / "shard1.log")
    half = N_SAMPLES // 2
    deadline = time.monotonic() + 900
    while second.proc.poll() is None and time.monotonic() < deadline and \
            len([n for n in (samples(out) if out.exists() else []) if int(n[5:-3]) >= half]) < 2 * BATCH:
        time.sleep(0.05)
    time.sleep(random.uniform(0, 0.5))
    killed_at = time.monotonic()
    second.kill_group()
    second.finish()
    second.leftovers(grace=5)
    assert first.finish() == 0, first.text()[-5000:]
    assert "shard 0/2 (RANK=0, WORLD_SIZE=2)" in first.text()
    assert "shard 1/2 (SLURM_PROCID=1, SLURM_NTASKS=2)" in second.text(), second.text()[-3000:]
    assert not (out / "data_config.json").exists()
    cmd = command(setup, out, tp=tp)
    cmd[3:3] = ["--data-parallel", "2"]
    resumed = Run(cmd, environment(), tmp_path, tmp_path / "resumed.log")
    assert resumed.finish() == 0, resumed.text()[-5000:]
    text = resumed.text()
    assert "[shard 0/2]" in text and "every sample of the shard is there, nothing to do" in text, text[-5000:]
    assert re.search(rf"\[shard 1/2\].*shard 1/2 of {N_SAMPLES} samples \(data_{half}\.pt \.\. data_"
                     rf"{N_SAMPLES - 1}\.pt\): resuming at data_\d+\.pt", text), text[-5000:]
    assert f"completed the dataset ({N_SAMPLES} samples): writing data_config.json" in text
    worst = assert_same_dataset(out, clean)
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith("pt") and not p.name.startswith(".")) == \
        sorted(["shards.json"] + [p.name for p in clean.iterdir() if not p.name.endswith("pt")])
    left = [n for n in second.shm if os.path.exists(f"/dev/shm/{n}") and second.first_seen[n] < killed_at - 1.5]
    assert left == [], left  # the killed shard's segments were removed when it resumed
    second.unlink_shm()
    verify = [sys.executable, "-m", "speculators_compat.run.verify"]
    proc = subprocess.run([*verify, str(out), "--full"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("complete: yes"), proc.stdout + proc.stderr
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "data_4.pt").unlink()
    shutil.copy(bad / "data_7.pt", bad / "data_07.pt")
    blob = (bad / "data_9.pt").read_bytes()
    (bad / "data_9.pt").write_bytes(blob[: len(blob) // 2])
    proc = subprocess.run([*verify, str(bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for line in ("hole        data_4.pt: index 4 missing", "duplicate   data_7.pt: index 7 is also in data_07.pt",
                 "unreadable  data_9.pt: not a complete torch.save archive"):
        assert line in proc.stdout, proc.stdout
    print(f"TP={tp}: max abs diff against one process {worst:.2g}; damaged copy: {proc.stdout.splitlines()[-1]}")


# -- a full disk ------------------------------------------------------------------------------


from tmpfs import can_mount_tmpfs as _can_mount_tmpfs  # noqa: E402


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs root and a private mount namespace (unshare -m) for a tmpfs")
def test_a_full_disk_ends_with_the_cause_and_the_cure_and_the_same_command_completes(setup, clean, tmp_path):
    """The output folder on a 4 MiB tmpfs (about 9 of the 40 samples fit): torch.save through the
    atomic-save patch fails; the run exits 1 and its last line names the device, its free space,
    the samples complete and where the same command resumes; with room made, the same command
    completes a dataset equal to a clean run's."""
    import shlex

    disk = tmp_path / "disk"
    disk.mkdir()
    run = " ".join(shlex.quote(c) for c in command(setup, disk / "out"))
    script = (f"mount -t tmpfs -o size=4m tmpfs {disk} || exit 99\n"
              f"{run} > {tmp_path}/first.log 2>&1; echo $? > {tmp_path}/first.rc\n"
              f"cp -r {disk}/out {tmp_path}/after-first\n"
              f"mount -o remount,size=64m {disk}\n"  # the user frees space
              f"{run} > {tmp_path}/second.log 2>&1; echo $? > {tmp_path}/second.rc\n"
              f"cp -r {disk}/out {tmp_path}/copy\n")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], env=environment(), capture_output=True, text=True,
                          timeout=900, cwd=setup["root"], stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    first = (tmp_path / "first.log").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "1", first[-5000:]
    # the last line of the run (a worker process may still print as it exits)
    last = [ln for ln in first.strip().splitlines() if not ln.startswith("(Worker")][-1]
    m = re.fullmatch(r"speculators-compat run: no space left on the device holding the output folder "
                     rf"{re.escape(str(disk))}/out \(mounted at {re.escape(str(disk))}: (.+) free of 4\.0 MiB\)\. "
                     r"(\d+) samples? (?:are|is) complete.*\. Free space there and run the same command: it resumes "
                     r"at data_(\d+)\.pt\.", last)
    assert m, first[-5000:]
    n = int(m.group(2))
    assert 0 < n < N_SAMPLES and int(m.group(3)) == n, last
    kept = {p.name for p in (tmp_path / "after-first").iterdir()}
    assert {f"data_{i}.pt" for i in range(n)} <= kept, (n, sorted(kept))
    second = (tmp_path / "second.log").read_text()
    assert (tmp_path / "second.rc").read_text().strip() == "0", second[-5000:]
    assert_same_dataset(tmp_path / "copy", clean)
