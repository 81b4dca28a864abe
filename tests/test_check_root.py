"""``check --vllm-root``: a vLLM release judged from its unpacked sources, before installing it.

Runs where ``SPECULATORS_COMPAT_TEST_VLLM_ROOT`` names such a folder (tox env ``check0330``:
vLLM 0.33.0, the newest release, a CUDA-only wheel this machine could not run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.environ.get("SPECULATORS_COMPAT_TEST_VLLM_ROOT")
pytestmark = pytest.mark.skipif(not ROOT, reason="SPECULATORS_COMPAT_TEST_VLLM_ROOT not set")

#: what vLLM 0.33.0 removed that the stock generator imports (issue #12, measured from its sources)
GONE_IN_033 = {
    "vllm.v1.core.kv_cache_utils.get_kv_cache_config_from_groups",
    "vllm.v1.core.kv_cache_utils._get_kv_cache_groups_uniform_spec",
    "vllm.v1.core.kv_cache_utils.unify_hybrid_kv_cache_specs",
}


def test_an_unvalidated_release_is_not_covered_and_each_unknown_api_is_named(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.check", "--json", "--vllm-root", ROOT],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert rep["covered"] is False and rep["validation"] is None
    version = rep["vllm"]["version"]
    status = {p["id"]: p for p in rep["patches"]}
    assert status["validated-release"]["status"] == "refused"
    assert f"vLLM {'.'.join(version.split('.')[:2])} line was validated" in status["validated-release"]["reason"]
    unknown = {a["api"] for a in rep["apis"] if a["status"] == "unknown"}
    if version.startswith("0.33."):
        assert unknown == GONE_IN_033
        assert all("(absent)" in a["difference"] for a in rep["apis"] if a["status"] == "unknown")
        assert status["api-inventory"]["status"] == "refused"
        assert all(api in status["api-inventory"]["reason"] for api in GONE_IN_033)
