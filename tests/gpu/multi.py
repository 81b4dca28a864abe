"""The multi-GPU scenarios of issue 36, each writing one JSON report (and exiting 1 on a problem).

    python3 tests/gpu/multi.py dp   --out FILE [--device cuda|cpu] [--model DIR] [--tp 1]
                                    [--samples N] [--batch B] [--work DIR]
    python3 tests/gpu/multi.py kill --out FILE [--device cuda|cpu] [--model DIR] [--tp 2] [--work DIR]

``dp``: the stock offline script (``tests/stock_datagen.py``; ``--script`` for another) through
``speculators-compat run --data-parallel 2`` with ``CUDA_VISIBLE_DEVICES`` split by the library
(``speculators_compat/run/parallel.py``), against one process on the first GPU group:
every sample's tensors byte-equal (each shard's block starts on a batch boundary, so every batch
has the same sequences as in one process); which GPUs each shard's processes held (nvidia-smi);
then a fresh run in which shard 1's whole process group is SIGKILLed mid-run (the launcher stops
shard 0 and exits with shard 1's code), the same command again (resumes, completes), the union
against one process, ``speculators-compat verify --full`` (exit 0, "complete: yes"), no process
of any shard left, no /dev/shm segment of the run left, the GPUs' memory back to where it was.

``kill``: the stock script at ``--tp`` (2) through ``speculators-compat run``, back-to-back calls
(``SPECULATORS_DATAGEN_REPEAT``); once a call runs, the last vLLM worker is SIGKILLed: seconds to
the ``WorkerDiedError`` naming it (pid, rank, SIGKILL; <= 30 s), exit code 1, no process of the
run left, no /dev/shm segment it mapped left and no ``speculators_compat-*`` file made since the
start, the GPUs' memory freed (nvidia-smi: no compute process of the run, memory.used back within
1 GiB of the baseline) and how long that took.

``--device cpu`` is the dry run on a CPU build of vLLM (fp32, the tiny Llama of the CPU tests
built under ``--work``, spawned workers, no GPU assignment: K processes on the CPU); the logic and
the checks are the same, tensors compared within 1e-4 where the CPU threads may reorder sums.
On CUDA the model is ``$G016_ROOT/models/llama`` (``tools/gpu/run.sh prepare``).

Run from outside the checkout root (the installed speculators_compat is the one tested); the
children run in ``--work`` (default ``$G016_ROOT/multi/dp`` or ``/kill``). :func:`problems` is what the tests
(``tests/gpu/test_multi.py``) assert. No torch or vLLM import here but inside the functions;
the runs are watched by ``tests/gpu/watch.py``. SIGTERM / SIGINT SIGKILL every run's sessions.

Not here: the TP=2 extraction against HF fp32 (``run.sh tests-tp2``), the self-check at TP=2
(``run.sh selfcheck-tp2``, i.e. ``tools/gpu/selfcheck.py --tp 2``) and the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from watch import (  # noqa: E402
    SHM_PREFIX, Run, _stat, cmdline, gpu_apps, gpu_memory, shm_ours_since, stop_all, visible_gpus,
)

STOCK = HERE.parent / "stock_datagen.py"
ROOT = Path(os.environ.get("G016_ROOT", "/tmp/g016"))
#: seconds from the SIGKILL of a worker to the WorkerDiedError (issue 36)
DEATH_LIMIT = 30.0
#: memory.used per GPU after the run may exceed the baseline by this much (MiB)
GPU_SLACK_MIB = 1024
CPU_TOL = 1e-4
#: a resumed batch has other neighbours: bf16 rows may then differ in their last bits
BF16_REL_L2 = 0.03


# -- the scenarios --------------------------------------------------------------------------------


class Scenario:
    def __init__(self, args):
        self.args = args
        self.cuda = args.device == "cuda"
        self.out = Path(args.out)
        self.work = Path(args.work or ROOT / "multi" / args.cmd)
        self.report: dict = {"scenario": args.cmd, "device": args.device, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                             "argv": sys.argv[1:], "steps": {}}
        self.t0 = time.time()

    def save(self):
        self.report["wall_s"] = round(time.time() - self.t0, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.report, indent=1, default=str))

    def step(self, name, fn) -> bool:
        t = time.time()
        try:
            self.report["steps"][name] = {"ok": True, "value": fn(), "seconds": round(time.time() - t, 1)}
        except BaseException as exc:  # noqa: BLE001 - the report records any failure
            self.report["steps"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000],
                                          "trace": traceback.format_exc()[-4000:], "seconds": round(time.time() - t, 1)}
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # stop_all: this script was stopped
                self.save()
                raise
        self.save()
        return self.report["steps"][name]["ok"]

    # -- set-up

    def env(self, **extra) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")
               or k == "SPECULATORS_COMPAT_RECORD"}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
                   VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_NO_USAGE_STATS="1")
        if self.cuda:
            env.setdefault("NCCL_NVLS_ENABLE", "0")
            env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        else:
            env.update(SPECULATORS_COMPAT_DTYPE="float32", VLLM_CPU_KVCACHE_SPACE="1",
                       VLLM_CPU_OMP_THREADS_BIND="nobind")
            env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(extra)
        return env

    def setup(self, samples: int, lengths: tuple[int, int], batch: int) -> dict:
        if self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        if self.args.model:
            model = Path(self.args.model)
        elif self.cuda:
            model = ROOT / "models" / "llama"
        else:
            from speculators_compat.testing import tiny

            model = tiny.build_llama(self.work / "model")
        if not (model / "config.json").exists():
            raise FileNotFoundError(f"{model}: no config.json (on CUDA: bash tools/gpu/run.sh prepare first)")
        cfg = json.loads((model / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        n_layers = cfg["num_hidden_layers"]
        layers = sorted({0, 1, n_layers - 3, n_layers - 1} if n_layers > 4 else set(range(n_layers)))
        hi = min(cfg["vocab_size"], 512) - 12
        rng = random.Random(36)
        lines = []
        for _ in range(samples):
            n = rng.randint(*lengths)
            lines.append(json.dumps({"input_ids": [rng.randrange(3, hi) for _ in range(n)],
                                     "loss_mask": [int(rng.random() < 0.6) for _ in range(n)]}))
        data = self.work / "train.jsonl"
        data.write_text("\n".join(lines) + "\n")
        self.model, self.data, self.layers = model, data, layers
        gpus = visible_gpus() if self.cuda else []
        if self.cuda and len(gpus) < 2 * self.args.tp and self.args.cmd == "dp":
            raise RuntimeError(f"data parallel 2 at TP={self.args.tp} needs {2 * self.args.tp} GPUs, {len(gpus)} visible")
        if self.cuda and len(gpus) < self.args.tp:
            raise RuntimeError(f"TP={self.args.tp} needs {self.args.tp} GPUs, {len(gpus)} visible")
        self.gpus = gpus
        self.baseline = gpu_memory() if self.cuda else None
        return {"model": str(model), "layers": layers, "samples": samples, "batch": batch,
                "tp": self.args.tp, "gpus": gpus, "gpu_memory_mib_before": self.baseline,
                "script": str(self.args.script), "python": sys.executable}

    def command(self, out: Path, *runner_opts: str, batch: int | None = None) -> list[str]:
        return [sys.executable, "-m", "speculators_compat.run", *runner_opts, str(self.args.script),
                "--target-model-path", str(self.model), "--train-data-path", str(self.data),
                "--output-dir", str(out), "--layer-ids", *map(str, self.layers),
                "--batch-size", str(batch or self.args.batch), "--tensor-parallel-size", str(self.args.tp),
                "--gpu-memory-utilization", str(self.args.util)]

    def start(self, name: str, cmd, **env) -> Run:
        return Run(cmd, self.env(**env), self.work, self.work / f"{name}.log", self.cuda)

    def rise(self, run: Run) -> dict | None:
        """Per GPU, the most memory.used rose over the baseline while ``run`` ran (MiB): where
        nvidia-smi lists no compute process (a container's own PID namespace), what shows which
        GPUs a run used."""
        if not self.cuda:
            return None
        return {i: peak - (self.baseline or {}).get(i, 0) for i, peak in run.gpu_peak.items()}

    def gpu_after(self, wait: float = 30.0) -> dict | None:
        """The GPUs once the run is over: compute processes left, memory.used against the
        baseline, and the seconds it took to come back (polled up to ``wait``)."""
        if not self.cuda:
            return None
        t = time.monotonic()
        while True:
            mem, apps = gpu_memory() or {}, gpu_apps() or []
            over = {i: mem[i] - self.baseline.get(i, 0) for i in mem if mem[i] - self.baseline.get(i, 0) > GPU_SLACK_MIB}
            if (not over and not apps) or time.monotonic() - t > wait:
                return {"memory_mib": mem, "baseline_mib": self.baseline, "over_baseline_mib": over,
                        "compute_apps": apps, "freed_after_s": round(time.monotonic() - t, 1)}
            time.sleep(0.5)

    # -- comparison

    def compare(self, got: Path, want: Path) -> dict:
        """Per sample: ids and masks equal, hidden states byte-equal (same dtype, torch.equal),
        max abs difference and relative L2."""
        import torch

        n = len(self.data.read_text().splitlines())
        names = sorted((p.name for p in got.iterdir() if p.name.endswith(".pt")), key=lambda s: (len(s), s))
        if names != [f"data_{i}.pt" for i in range(n)]:
            raise AssertionError(f"{got}: {len(names)} files, not data_0..data_{n - 1}.pt: {names[:5]}...")
        byte_equal, worst_abs, worst_rel, unequal = 0, 0.0, 0.0, []
        for i in range(n):
            a = torch.load(got / f"data_{i}.pt", weights_only=True)
            b = torch.load(want / f"data_{i}.pt", weights_only=True)
            if not (torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])):
                raise AssertionError(f"data_{i}.pt: input_ids or loss_mask differ")
            if len(a["hidden_states"]) != len(b["hidden_states"]):
                raise AssertionError(f"data_{i}.pt: {len(a['hidden_states'])} layers, {len(b['hidden_states'])} in one process")
            same = True
            for x, y in zip(a["hidden_states"], b["hidden_states"]):
                if x.shape != y.shape or x.dtype != y.dtype:
                    raise AssertionError(f"data_{i}.pt: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
                same = same and torch.equal(x, y)
                d = (x.float() - y.float())
                worst_abs = max(worst_abs, d.abs().max().item())
                worst_rel = max(worst_rel, (d.norm() / y.float().norm().clamp_min(1e-30)).item())
            byte_equal += same
            if not same:
                unequal.append(i)
        return {"samples": n, "byte_equal": byte_equal, "unequal": unequal[:40], "max_abs": worst_abs,
                "max_rel_l2": worst_rel, "dtype": str(a["hidden_states"][0].dtype)}

    def verify(self, folder: Path) -> dict:
        proc = subprocess.run([sys.executable, "-m", "speculators_compat", "verify", str(folder), "--full"],
                              capture_output=True, text=True, cwd=self.work, env=self.env(), timeout=300)
        return {"exit_code": proc.returncode, "last_line": (proc.stdout.strip().splitlines() or [""])[-1],
                "stdout": proc.stdout[-1500:], "stderr": proc.stderr[-1500:]}


def shard_groups(run: Run) -> dict:
    """Which GPUs each shard's session held (sessions other than the launcher's)."""
    return {str(sid): sorted(g) for sid, g in run.gpu_of_session.items() if sid != run.proc.pid}


def scenario_dp(args) -> Scenario:
    sc = Scenario(args)
    if args.samples % (2 * args.batch):
        raise SystemExit(f"--samples {args.samples} must be a multiple of 2 x --batch {args.batch}: "
                         "each shard's block must start on a batch boundary for byte-equal rows")
    lengths = (20, 1500) if sc.cuda else (20, 400)
    if not sc.step("setup", lambda: sc.setup(args.samples, lengths, args.batch)):
        return sc
    one_dir, dp_dir, kill_dir = sc.work / "one", sc.work / "dp", sc.work / "dpkill"
    timeout = args.timeout

    def one_process():
        env = {"CUDA_VISIBLE_DEVICES": ",".join(sc.gpus[:args.tp])} if sc.cuda else {}
        run = sc.start("one", sc.command(one_dir), **env)
        rc = run.finish(timeout)
        if rc != 0:
            raise RuntimeError(f"one process exited {rc}: {run.text()[-3000:]}")
        return {"rc": rc, "seconds": run.seconds, "gpus_held": {str(k): sorted(v) for k, v in run.gpu_of_session.items()},
                "gpu_rise_mib": sc.rise(run), "leftovers": run.leftovers()}

    def data_parallel():
        run = sc.start("dp", sc.command(dp_dir, "--data-parallel", "2"))
        rc = run.finish(timeout)
        text = run.text()
        if rc != 0:
            raise RuntimeError(f"--data-parallel 2 exited {rc}: {text[-3000:]}")
        plan = re.search(r"data parallel: 2 shards .*", text)
        value = {"rc": rc, "seconds": run.seconds, "plan": plan.group(0)[:300] if plan else None,
                 "shard_gpus": shard_groups(run), "gpu_rise_mib": sc.rise(run),
                 "finished_line": "data parallel: all 2 shards finished" in text,
                 "config_line": bool(re.search(r"completed the dataset \(\d+ samples\)", text)),
                 "leftovers": run.leftovers()}
        value["vs_one_process"] = sc.compare(dp_dir, one_dir)
        value["verify"] = sc.verify(dp_dir)
        return value

    def kill_and_resume():
        half = args.samples // 2
        run = sc.start("dpkill", sc.command(kill_dir, "--data-parallel", "2"),
                       SPECULATORS_DATAGEN_DELAY=str(args.delay))
        deadline = time.monotonic() + timeout

        def block1():
            if not kill_dir.exists():
                return 0
            return len([p for p in kill_dir.iterdir() if re.fullmatch(r"data_\d+\.pt", p.name) and int(p.name[5:-3]) >= half])
        while run.proc.poll() is None and time.monotonic() < deadline and block1() < 2 * args.batch:
            time.sleep(0.05)
        shard1 = [p for p in run.alive() if "--shard 1/2" in cmdline(p) and (_stat(p) or (0, 0))[1] == p]
        if run.proc.poll() is not None or not shard1:
            run.finish(10)
            raise RuntimeError(f"shard 1 was not running when it had {block1()} files: {run.text()[-3000:]}")
        time.sleep(random.uniform(0, 0.5))
        files_at_kill = block1()
        killed_at = time.monotonic()
        os.killpg(shard1[0], signal.SIGKILL)
        rc = run.finish(timeout)
        stop_s = round(time.monotonic() - killed_at, 1)
        text = run.text()
        failed = next((ln for ln in text.splitlines() if "data parallel:" in ln and "stopped the other shards" in ln), None)
        first = {"rc": rc, "stopped_s": stop_s, "shard1_files_at_kill": files_at_kill, "failed_line": failed and failed[-400:],
                 "shard_gpus": shard_groups(run), "leftovers": run.leftovers(), "gpu": sc.gpu_after()}
        resumed = sc.start("dpresume", sc.command(kill_dir, "--data-parallel", "2"))
        rc2 = resumed.finish(timeout)
        text2 = resumed.text()
        if rc2 != 0:
            raise RuntimeError(f"the resumed run exited {rc2}: {text2[-3000:]}")
        resumes = [ln[-300:] for ln in text2.splitlines() if "resuming at data_" in ln or "nothing to do" in ln]
        late = [n for n in run.shm if os.path.exists(f"/dev/shm/{n}") and run.shm_first[n] < killed_at - 1.5]
        second = {"rc": rc2, "seconds": resumed.seconds, "resume_lines": resumes, "shard_gpus": shard_groups(resumed),
                  "config_line": bool(re.search(r"completed the dataset \(\d+ samples\)", text2)),
                  "killed_run_shm_left": late, "leftovers": resumed.leftovers()}
        for name in run.shm | resumed.shm:  # test hygiene: segments made in the last moment before the kill
            if os.path.exists(f"/dev/shm/{name}") and name not in late:
                try:
                    os.unlink(f"/dev/shm/{name}")
                except OSError:
                    pass
        return {"killed": first, "resumed": second, "vs_one_process": sc.compare(kill_dir, one_dir),
                "verify": sc.verify(kill_dir)}

    if sc.step("one_process", one_process):
        sc.step("data_parallel", data_parallel)
        sc.step("kill_resume", kill_and_resume)
    sc.report["shm_ours_left"] = shm_ours_since(sc.t0)
    sc.report["gpu_after"] = sc.gpu_after()
    return sc


def scenario_kill(args) -> Scenario:
    sc = Scenario(args)
    lengths = (200, 1500) if sc.cuda else (20, 300)
    if not sc.step("setup", lambda: sc.setup(64, lengths, 16)):
        return sc
    holder: dict = {}

    def start():
        run = holder["run"] = sc.start("kill", sc.command(sc.work / "out", batch=16),
                                       SPECULATORS_DATAGEN_REPEAT=str(args.repeat))
        if not run.wait_for(r"generate\(\): 16 sequences", args.timeout):
            raise RuntimeError(f"no call within {args.timeout} s: {run.text()[-3000:]}")
        time.sleep(0.3)  # the next call has started: the saves are asynchronous
        workers = [p for p in run.alive() if "VLLM::Worker" in cmdline(p)]
        titled = bool(workers)
        if not workers:  # no setproctitle: the spawned children of the runner, in start order
            workers = sorted(p for p in run.alive() if "spawn_main" in cmdline(p) and (_stat(p) or (0, 0))[0] == run.proc.pid)
        holder["workers"] = workers
        time.sleep(1.2 if sc.cuda else 0)  # one GPU sample with the workers up
        return {"workers": [f"{p} {cmdline(p)}" for p in workers], "worker_titles": titled,
                "gpu_memory_mib": gpu_memory() if sc.cuda else None,
                "gpus_held": {str(k): sorted(v) for k, v in run.gpu_of_session.items()}}

    def kill():
        run, workers = holder["run"], holder["workers"]
        if len(workers) != args.tp:
            raise RuntimeError(f"{len(workers)} vLLM worker processes, expected {args.tp}: "
                               f"{[cmdline(p) for p in run.alive()]}")
        victim = workers[-1]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        seen = run.wait_for(r"WorkerDiedError", 120)
        seconds = round(time.monotonic() - killed, 1)
        rc = run.finish(180)
        text = run.text()
        error = next((ln for ln in text.splitlines() if "WorkerDiedError:" in ln), None)
        return {"victim": victim, "rank": args.tp - 1, "error_seen": seen, "seconds_to_error": seconds if seen else None,
                "rc": rc, "error_line": error and error[-600:],
                "names_the_worker": bool(error and f"(pid {victim}, rank {args.tp - 1} of {args.tp}) was killed by SIGKILL" in error),
                "shutdown_line": "executor was shut down by vLLM after a worker died" in text,
                "leaked_shared_memory_warning": "leaked shared_memory" in text,
                "exit_s": run.seconds}

    def leftovers():
        run = holder["run"]
        left = run.leftovers()
        return {**left, "shm_ours_since_start": shm_ours_since(sc.t0), "gpu": sc.gpu_after(),
                "gpu_rise_mib": sc.rise(run)}

    if sc.step("start", start):
        sc.step("kill", kill)
    if "run" in holder:
        if holder["run"].proc.poll() is None:
            holder["run"].kill_all()
            holder["run"].finish(30)
        sc.step("leftovers", leftovers)
    return sc


# -- what must hold -------------------------------------------------------------------------------


def problems(report: dict) -> list[str]:
    """What the tests assert, as sentences (empty: every check held)."""
    steps = report.get("steps", {})
    out = [f"{k}: {v.get('error', '')[:600]}" for k, v in steps.items() if not v.get("ok")]
    cuda = report.get("device") == "cuda"

    def value(name):
        return (steps.get(name) or {}).get("value") or {}

    def gpu_freed(where, gpu):
        if cuda and gpu is not None and (gpu["over_baseline_mib"] or gpu["compute_apps"]):
            out.append(f"{where}: GPU memory not freed: {gpu}")

    def leftover(where, left):
        if left and (left.get("processes") or left.get("shm")):
            out.append(f"{where}: left {left}")
        if left and not left.get("processes_seen"):
            out.append(f"{where}: the watcher saw no process of the run (the leftover checks are void)")

    if report.get("scenario") == "dp":
        if "one_process" in steps and "data_parallel" not in steps:
            out.append("data_parallel: not run")
        dp = value("data_parallel")
        if dp:
            cmp = dp["vs_one_process"]
            if cuda and cmp["byte_equal"] != cmp["samples"]:
                out.append(f"data_parallel: {cmp['samples'] - cmp['byte_equal']} of {cmp['samples']} samples not "
                           f"byte-equal to one process's (max abs {cmp['max_abs']:.3g}; {cmp['unequal'][:10]})")
            if not cuda and cmp["max_abs"] > CPU_TOL:
                out.append(f"data_parallel: max abs {cmp['max_abs']:.3g} > {CPU_TOL} against one process")
            if dp["verify"]["exit_code"] != 0 or not dp["verify"]["last_line"].endswith("complete: yes"):
                out.append(f"data_parallel: verify {dp['verify']}")
            if not dp["finished_line"] or not dp["config_line"]:
                out.append("data_parallel: no 'all 2 shards finished' / 'completed the dataset' line")
            leftover("data_parallel", dp["leftovers"])
            if cuda and dp["shard_gpus"]:
                held = list(dp["shard_gpus"].values())
                flat = [g for h in held for g in h]
                if len(held) != 2 or len(flat) != len(set(flat)):
                    out.append(f"data_parallel: the shards did not hold disjoint GPU groups: {dp['shard_gpus']}")
            elif cuda:  # nvidia-smi lists no processes here: every GPU of the plan must have been used
                used = sorted(i for i, mib in (dp["gpu_rise_mib"] or {}).items() if mib > GPU_SLACK_MIB)
                want = sorted(re.findall(r"\d+", (dp["plan"] or "").partition(" on GPUs ")[2]))
                if not want or used != want:
                    out.append(f"data_parallel: GPUs used {used}, the plan's {want} ({dp['plan']})")
        kr = value("kill_resume")
        if kr:
            k, r, cmp = kr["killed"], kr["resumed"], kr["vs_one_process"]
            if k["rc"] != 128 + signal.SIGKILL or not k["failed_line"] or "shard 1/2" not in k["failed_line"]:
                out.append(f"kill_resume: the launcher did not name shard 1's SIGKILL: rc {k['rc']}, {k['failed_line']}")
            # a SIGKILLed shard cannot remove its segments: the resumed run must (killed_run_shm_left)
            leftover("kill_resume (killed run)", dict(k["leftovers"], shm=[]))
            gpu_freed("kill_resume (killed run)", k["gpu"])
            if r["killed_run_shm_left"]:
                out.append(f"kill_resume: the killed shard's segments outlived the resume: {r['killed_run_shm_left']}")
            if not any("resuming at data_" in ln for ln in r["resume_lines"]) or not r["config_line"]:
                out.append(f"kill_resume: no resume / completion line: {r['resume_lines']}")
            leftover("kill_resume (resumed run)", r["leftovers"])
            limit = BF16_REL_L2 if cuda else None
            if limit is not None and cmp["max_rel_l2"] > limit:
                out.append(f"kill_resume: rel L2 {cmp['max_rel_l2']:.3g} > {limit} against one process")
            if not cuda and cmp["max_abs"] > CPU_TOL:
                out.append(f"kill_resume: max abs {cmp['max_abs']:.3g} > {CPU_TOL} against one process")
            if kr["verify"]["exit_code"] != 0 or not kr["verify"]["last_line"].endswith("complete: yes"):
                out.append(f"kill_resume: verify {kr['verify']}")
        elif "data_parallel" in steps and "kill_resume" not in steps:
            out.append("kill_resume: not run")
        gpu_freed("dp (at the end)", report.get("gpu_after"))
        if report.get("shm_ours_left"):
            out.append(f"dp: {SHM_PREFIX}* left in /dev/shm: {report['shm_ours_left']}")
    elif report.get("scenario") == "kill":
        k = value("kill")
        if "start" in steps and not k:
            out.append("kill: not run")
        if k:
            if not k["error_seen"] or k["seconds_to_error"] > DEATH_LIMIT:
                out.append(f"kill: WorkerDiedError after {k['seconds_to_error']} s (limit {DEATH_LIMIT}): {k['error_line']}")
            if not k["names_the_worker"]:
                out.append(f"kill: the error does not name pid {k['victim']} rank {k['rank']}: {k['error_line']}")
            if k["rc"] != 1:
                out.append(f"kill: exit code {k['rc']}, expected 1")
            if k["leaked_shared_memory_warning"]:
                out.append("kill: 'leaked shared_memory' in the run's output")
        left = value("leftovers")
        if left:
            leftover("kill", left)
            if left["shm_ours_since_start"]:
                out.append(f"kill: {SHM_PREFIX}* left in /dev/shm: {left['shm_ours_since_start']}")
            gpu_freed("kill", left["gpu"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=["dp", "kill"])
    ap.add_argument("--out", required=True, help="the JSON report")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", help="model folder (default: $G016_ROOT/models/llama on CUDA, a tiny Llama on the CPU)")
    ap.add_argument("--work", help="where the runs write (default $G016_ROOT/multi/CMD; emptied first)")
    ap.add_argument("--script", default=str(STOCK), help="the stock script (default tests/stock_datagen.py)")
    ap.add_argument("--tp", type=int, help="tensor parallel size (dp: of each shard, default 1; kill: default 2)")
    ap.add_argument("--samples", type=int, help="dp: dataset size (default 96 on CUDA, 48 on the CPU)")
    ap.add_argument("--batch", type=int, help="dp: the script's --batch-size (default 8 on CUDA, 4 on the CPU)")
    ap.add_argument("--delay", type=float, default=None, help="dp: seconds after each batch in the killed run")
    ap.add_argument("--repeat", type=int, default=None,
                    help="kill: calls per batch, back to back (default 500 on CUDA, 50 on the CPU): one is running at the kill")
    ap.add_argument("--util", type=float, default=None, help="gpu_memory_utilization (default 0.5 on CUDA)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds for one run (default 240 CUDA, 900 CPU)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.tp = args.tp or (1 if args.cmd == "dp" else 2)
    args.samples = args.samples or (96 if cuda else 48)
    args.batch = args.batch or (8 if cuda else 4)
    args.delay = args.delay if args.delay is not None else (1.0 if cuda else 0.4)
    args.repeat = args.repeat or (500 if cuda else 50)
    args.util = args.util if args.util is not None else (0.5 if cuda else 0.8)
    args.timeout = args.timeout or (240 if cuda else 900)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_all)
    sc = scenario_dp(args) if args.cmd == "dp" else scenario_kill(args)
    sc.report["problems"] = problems(sc.report)
    sc.save()
    print(json.dumps({"scenario": args.cmd, "device": args.device, "wall_s": sc.report["wall_s"],
                      "problems": sc.report["problems"]}, indent=1))
    return 1 if sc.report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
