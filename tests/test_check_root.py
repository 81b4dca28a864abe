"""``check --vllm-root``: a vLLM release judged from its unpacked sources, without installing it.

Runs where ``SPECULATORS_COMPAT_TEST_VLLM_ROOT`` names such a folder: tox envs ``check0330`` and
``check0340`` (vLLM 0.33.0 and 0.34.0, CUDA-only wheels, no CPU build; their GPU validation runs
are in validated.json), with the transformers those runs used. Each of the release's patches is
judged from the real sources, and the verdict must match what the GPU run recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.environ.get("SPECULATORS_COMPAT_TEST_VLLM_ROOT")
pytestmark = pytest.mark.skipif(not ROOT, reason="SPECULATORS_COMPAT_TEST_VLLM_ROOT not set")

#: what each release needs beyond 0.32's patches, judged from its sources: (patch, status)
EXPECTED = {
    "0.33": {"v8": "applies", "v7": "applies", "worker-death": "applies", "runner-v1": "applies",
             "v9": "not needed", "mrv2-rows": "not needed", "self-check-reference": "applies"},
    "0.34": {"v8": "applies", "v7": "applies", "worker-death": "applies", "runner-v1": "not needed",
             "v9": "applies", "mrv2-rows": "applies", "self-check-reference": "applies"},
}


def report(tmp_path, *extra, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.check", "--json", "--vllm-root", ROOT, *extra],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**base, **env})
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_release_is_covered_with_the_patches_its_deltas_need(tmp_path):
    rep = report(tmp_path)
    line = ".".join(rep["vllm"]["version"].split(".")[:2])
    status = {p["id"]: p["status"] for p in rep["patches"]}
    assert rep["covered"] is True, [(p["id"], p["reason"]) for p in rep["patches"] if p["status"] == "refused"]
    assert {pid: status[pid] for pid in EXPECTED[line]} == EXPECTED[line]
    assert not [a["api"] for a in rep["apis"] if a["status"] == "unknown"]


def test_the_moved_kv_cache_helpers_are_read_where_they_live_now(tmp_path):
    rep = report(tmp_path)
    moved = {a["api"]: a.get("moved_to") for a in rep["apis"] if a["api"].startswith("vllm.v1.core.kv_cache_utils.")}
    for name in ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_config_from_groups", "unify_hybrid_kv_cache_specs"):
        assert moved[f"vllm.v1.core.kv_cache_utils.{name}"] == "vllm.v1.core.kv_cache_planning"


def test_without_the_move_the_refusal_says_where_the_helpers_went(tmp_path):
    env = dict(os.environ, SPECULATORS_COMPAT_DISABLE="v8")
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.check", "--json", "--vllm-root", ROOT],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    rep = json.loads(proc.stdout)
    assert proc.returncode == 1 and rep["covered"] is False
    v8 = next(p for p in rep["patches"] if p["id"] == "v8")
    assert v8["status"] == "disabled" and "kv_cache_planning" in v8["reason"]


def test_model_runner_v2_asked_for_needs_mrv2_rows_validated_on_the_release(tmp_path):
    """0.33 ships both runners: with VLLM_USE_V2_MODEL_RUNNER=1 MRv2 runs, so mrv2-rows is needed,
    and its fields are in 0.33's MRv2; no validation run applied it on 0.33, so it is refused
    (runner-v1 refuses the variable before the weights load). On 0.34 it is needed either way. The
    self-check's reference is judged on MRv2's prompt log-probs code, as it runs."""
    rep = report(tmp_path, VLLM_USE_V2_MODEL_RUNNER="1")
    line = ".".join(rep["vllm"]["version"].split(".")[:2])
    rows = next(p for p in rep["patches"] if p["id"] == "mrv2-rows")
    reference = next(p for p in rep["patches"] if p["id"] == "self-check-reference")
    assert "Model Runner V2 finds a request's prompt rows" in reference["reason"], reference  # judged as MRv2 runs
    if line == "0.34":
        assert rows["status"] == "applies" and rep["covered"] is True, rows
        return
    assert rows["status"] == "refused" and rep["covered"] is False, rows
    assert ("VLLM_USE_V2_MODEL_RUNNER asks for Model Runner V2 (without it the V1 runner runs): a step's rows are "
            "found by request id") in rows["reason"], rows["reason"]
    assert "no validation run applied it on vLLM 0.33.0" in rows["reason"], rows["reason"]
