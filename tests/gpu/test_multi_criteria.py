"""What ``tests/gpu/multi.py``'s :func:`problems` flags, on made-up reports (no GPU, no vLLM, < 1 s):
the multi-GPU tests assert its verdict, so each of its checks must be able to fail."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import multi  # noqa: E402

LEFT = {"processes": [], "shm": [], "processes_seen": 5, "shm_seen": 4}
VERIFY = {"exit_code": 0, "last_line": "complete: yes"}
GPU_OK = {"over_baseline_mib": {}, "compute_apps": []}


def dp_report() -> dict:
    cmp = {"samples": 96, "byte_equal": 96, "unequal": [], "max_abs": 0.0, "max_rel_l2": 0.0}
    return {"scenario": "dp", "device": "cuda", "steps": {
        "setup": {"ok": True, "value": {}},
        "one_process": {"ok": True, "value": {"leftovers": LEFT}},
        "data_parallel": {"ok": True, "value": {
            "plan": "data parallel: 2 shards (0/2, 1/2 of 2), on GPUs 0; 1", "shard_gpus": {"101": ["0"], "102": ["1"]},
            "gpu_rise_mib": {"0": 70000, "1": 70000}, "finished_line": True, "config_line": True, "leftovers": LEFT,
            "vs_one_process": dict(cmp), "verify": dict(VERIFY)}},
        "kill_resume": {"ok": True, "value": {
            "killed": {"rc": 137, "failed_line": "data parallel: shard 1/2 (pid 7, CUDA_VISIBLE_DEVICES=1) was killed by "
                       "SIGKILL; stopped the other shards", "leftovers": LEFT, "gpu": GPU_OK},
            "resumed": {"killed_run_shm_left": [], "resume_lines": ["shard 1/2 ...: resuming at data_60.pt"],
                        "config_line": True, "leftovers": LEFT},
            "vs_one_process": dict(cmp, byte_equal=80, max_rel_l2=0.004), "verify": dict(VERIFY)}}}}


def kill_report() -> dict:
    return {"scenario": "kill", "device": "cuda", "steps": {
        "setup": {"ok": True, "value": {}}, "start": {"ok": True, "value": {}},
        "kill": {"ok": True, "value": {"victim": 42, "rank": 1, "error_seen": True, "seconds_to_error": 6.0,
                                       "error_line": "WorkerDiedError: ... (pid 42, rank 1 of 2) was killed by SIGKILL",
                                       "names_the_worker": True, "rc": 1, "leaked_shared_memory_warning": False}},
        "leftovers": {"ok": True, "value": dict(LEFT, shm_ours_since_start=[], gpu=GPU_OK)}}}


def changed(report: dict, path: str, new) -> dict:
    report = copy.deepcopy(report)
    *keys, last = path.split(".")
    node = report["steps"]
    for key in keys:
        node = node[key]
    node[last] = new
    return report


def test_good_reports_pass():
    assert multi.problems(dp_report()) == []
    assert multi.problems(kill_report()) == []


def test_a_killed_shard_may_leave_segments_that_the_resume_removes():
    report = changed(dp_report(), "kill_resume.value.killed.leftovers", dict(LEFT, shm=["psm_1"]))
    assert multi.problems(report) == []


def test_each_dp_check_can_fail():
    cases = {
        "data_parallel.value.vs_one_process.byte_equal": 95,
        "data_parallel.value.verify.exit_code": 1,
        "data_parallel.value.shard_gpus": {"101": ["0"], "102": ["0"]},
        "data_parallel.value.leftovers": dict(LEFT, processes=["9 VLLM::Worker_TP0"]),
        "kill_resume.value.killed.rc": 143,
        "kill_resume.value.killed.leftovers": dict(LEFT, processes=["9 VLLM::EngineCore"]),
        "kill_resume.value.killed.gpu": {"over_baseline_mib": {"1": 70000}, "compute_apps": []},
        "kill_resume.value.resumed.killed_run_shm_left": ["psm_1"],
        "kill_resume.value.vs_one_process.max_rel_l2": 0.2,
        "kill_resume.value.verify.last_line": "complete: no",
        "one_process.ok": False,
    }
    for path, value in cases.items():
        assert multi.problems(changed(dp_report(), path, value)), path
    assert multi.problems(dict(dp_report(), shm_ours_left=["speculators_compat-states-9"]))
    assert multi.problems(dict(dp_report(), gpu_after={"over_baseline_mib": {"0": 5000}, "compute_apps": []}))
    # without nvidia-smi's process list: the GPUs whose memory rose must be the plan's
    no_apps = changed(dp_report(), "data_parallel.value.shard_gpus", {})
    assert multi.problems(no_apps) == []
    assert multi.problems(changed(no_apps, "data_parallel.value.gpu_rise_mib", {"0": 70000, "1": 12}))


def test_each_kill_check_can_fail():
    cases = {
        "kill.value.seconds_to_error": 31.0,
        "kill.value.error_seen": False,
        "kill.value.names_the_worker": False,
        "kill.value.rc": 0,
        "leftovers.value.shm_ours_since_start": ["speculators_compat-states-1"],
        "leftovers.value.processes_seen": 0,
        "leftovers.value.gpu": {"over_baseline_mib": {}, "compute_apps": [{"pid": 5, "gpu": "0", "mib": 900}]},
    }
    for path, value in cases.items():
        assert multi.problems(changed(kill_report(), path, value)), path
