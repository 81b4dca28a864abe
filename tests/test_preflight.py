"""Preflight: refusals come from ``VllmHiddenStatesGenerator(...)`` before the executor starts
(no worker process, no weight load), naming the API, the installed version and what to do.

* On a release no validation run covers (suite ``preflight``): the ceiling refuses it.
* On a validated release (suite ``full``): with its validation record hidden (the case of a
  release nobody validated yet), and with a patch disabled whose stock call then no longer
  binds (``stock-calls`` refuses before the TypeError would come, after the weight load).
How long a refusal takes is measured in the README, not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytest.importorskip("speculators")

import matrix  # noqa: E402

from speculators_compat.core import _env, versions  # noqa: E402

SCRIPT = r"""
import multiprocessing, sys, time
import speculators_compat
from speculators_compat.check import validation
from speculators_compat.testing import tiny
if sys.argv[2] == "hide-record":  # a release nobody validated: no record covers it
    validation.load_table = lambda path=validation.SUPPORTED_FILE: {"schema": 1, "speculators": {}}
tiny.cpu_environment()
path = tiny.build_llama(sys.argv[1], num_layers=4)
t = time.perf_counter()
try:  # on transformers v5 an import-time patch may refuse at the import already
    from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
    VllmHiddenStatesGenerator(str(path), layer_ids=[0, 2], max_model_len=512)
except (speculators_compat.IncompatibleVllmError, speculators_compat.ConfigurationError) as exc:
    print("REFUSED", round(time.perf_counter() - t, 3), "children", len(multiprocessing.active_children()))
    print(type(exc).__name__, exc)
else:
    print("STARTED")
"""


def run(tmp_path, mode="as-is", disable=""):
    # a validation run (SPECULATORS_COMPAT_RECORD) reaches the child: it must apply what a recorded release would
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_") or k == "SPECULATORS_COMPAT_RECORD"}
    env["SPECULATORS_COMPAT_DISABLE"] = disable
    if mode == "hide-record":  # a release nobody validated, outside any validation run
        env.pop("SPECULATORS_COMPAT_RECORD", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "model"), mode],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )
    out = proc.stdout
    first = next((line for line in out.splitlines() if line.startswith(("REFUSED", "STARTED"))), "")
    assert first.startswith("REFUSED"), out[-2000:] + proc.stderr[-3000:]
    assert first.endswith("children 0")
    return out


def refuse(tmp_path, mode="as-is", disable=""):
    out = run(tmp_path, mode, disable)
    assert f"Installed: {versions.vllm()}." in out and "What to do: " in out
    return out


@matrix.suite_is("preflight")
def test_an_unvalidated_release_is_refused_before_the_engine_starts(tmp_path):
    out = refuse(tmp_path)
    line = f"{versions.vllm().base.major}.{versions.vllm().base.minor}"
    assert f"[validated-release] the installed vLLM release: no release of the vLLM {line} line was validated" in out
    assert "What to do: pin vLLM to a release speculators_compat validated with speculators" in out


@matrix.suite_is("full")
def test_a_release_without_a_validation_record_is_refused(tmp_path):
    out = refuse(tmp_path, "hide-record")
    assert "What to do: upgrade speculators_compat" in out  # nothing validated to pin to
    if "[validated-release]" in out:
        assert "was validated with speculators" in out
        # every repair whose delta is present is refused too (not validated), after the ceiling
        assert out.index("[validated-release]") < out.index("[v1]")
    else:
        # transformers v5: `import speculators` needs tf5-config-torch, refused at the import already
        assert "[tf5-config-torch]" in out and "but no validation run applied it on transformers 5." in out, out
        assert versions.installed("transformers").version.major >= 5


@matrix.suite_is("full")
@pytest.mark.skipif(versions.speculators().base.minor != 3, reason="speculators 0.3 calls Scheduler without block_size")
def test_a_stock_call_that_would_not_bind_is_refused(tmp_path):
    out = refuse(tmp_path, disable="v2")
    assert "[stock-calls]" in out
    assert "Scheduler(vllm_config=…, kv_cache_config=…, structured_output_manager=…)" in out
    assert "missing a required argument: 'block_size'" in out
    if not _env.record_dir():  # a validation run has no record yet to name
        assert "What to do: pin vLLM to a release speculators_compat validated with speculators 0.3" in out


@matrix.suite_is("full")
def test_a_misspelt_disabled_id_is_refused_naming_the_known_ids(tmp_path):
    """A typo in SPECULATORS_COMPAT_DISABLE would leave on what the user meant to turn off."""
    out = run(tmp_path, disable="v5,bogus-id")
    assert "ConfigurationError SPECULATORS_COMPAT_DISABLE names no patch: bogus-id. Known ids: " in out
    assert "guard-input" in out.split("Known ids: ", 1)[1]


@matrix.suite_is("preflight")
@pytest.mark.parametrize("mode", [[], ["--deep"]])
def test_check_says_not_covered(tmp_path, mode):
    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat.check", "--json", *mode],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert rep["covered"] is False and rep["mode"] == ("deep" if mode else "static")
    assert rep["validation"] is None
    status = {p["id"]: (p["status"], p["cause"]) for p in rep["patches"]}
    assert status["validated-release"] == ("refused", "not validated")
