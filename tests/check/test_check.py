"""Unit tests of ``speculators_compat/check``: the validation records, the stock-call binding of the
engine checks (:mod:`speculators_compat.check.checks`) and the ``check`` command's text and JSON.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest
from packaging.version import Version

import speculators_compat
from probe_inputs import _context_of, inst, sig
from registry_stand import make_patch
from speculators_compat.core import _env, hooks, versions
from speculators_compat.check import validation
from speculators_compat.errors import IncompatibleVllmError
from speculators_compat.core.registry import (Cause, Context, Edit, Kind, Patch, Probe, Side, Status, evaluate,
                                        uncovered_release)
from speculators_compat.core.verdict import unknown_disabled, verdict
from speculators_compat.core.targets import GENERATOR, SPECULATORS_CONFIG, SPECULATORS_UTILS, WORKER


RUNS = {
    "schema": 1,
    "runs": [
        {"vllm": "0.11.0", "speculators": "0.3.0", "platform": "cpu", "transformers": "4.57.6",
         "applied": ["cpu-mem-get-info"]},
        {"vllm": "0.16.0", "speculators": "0.3.0", "platform": "cpu", "transformers": "4.57.6", "applied": ["p1", "v2"]},
        {"vllm": "0.16.0", "speculators": "0.3.0", "platform": "cuda", "transformers": "4.57.6", "applied": ["offload"]},
        {"vllm": "0.20.2", "speculators": "0.3.0", "platform": "cpu", "transformers": "4.57.6", "applied": ["p1"]},
        {"vllm": "0.20.2", "speculators": "0.3.0", "platform": "cpu", "transformers": "5.17.0", "applied": ["p1", "tf"]},
        {"vllm": "0.26.0", "speculators": "0.3.0", "platform": "cpu", "transformers": "5.24.0", "applied": ["p1", "tf"]},
        {"vllm": "0.16.0", "speculators": "0.4.0.1", "platform": "cpu", "transformers": "4.57.6", "applied": ["s04"]},
    ],
}


TABLE = validation.table(RUNS)


@pytest.mark.parametrize(
    "vllm, spec, tf, covered_by",
    [
        ("0.16.0", "0.3.0", "4.57.6", "0.16.0"),
        ("0.16.0+cpu", "0.3.0", "4.57.6", "0.16.0"),
        ("0.16.1.dev20+gabc", "0.3.0", "4.57.6", "0.16.0"),  # a nightly of a validated line
        ("0.16.2", "0.3.0", "4.57.6", "0.16.0"),  # a later patch release of a validated line
        ("0.17.0.dev3", "0.3.0", "4.57.6", None),  # a line nobody validated: the ceiling
        ("0.17.0", "0.3.0", "4.57.6", None),
        ("0.11.2", "0.3.0", "4.57.6", "0.11.0"),  # same line, newer than the validated 0.11.0
        ("0.20.0", "0.3.0", "4.57.6", None),  # older than the only validated release of its line
        ("0.20.3", "0.3.0", "4.57.6", "0.20.2"),
        ("0.20.3", "0.3.0", "5.30.1", "0.20.2"),  # validated on transformers 5 too
        ("0.16.0", "0.3.0", "5.24.0", None),  # validated on transformers 4 only
        ("0.16.0", "0.3.0", None, "0.16.0"),
        ("0.16.0", "0.4.0.1", "4.57.6", "0.16.0"),
        ("0.15.1", "0.4.0.1", "4.57.6", None),
    ],
)
def test_the_release_that_covers_an_install(vllm, spec, tf, covered_by):
    rec = validation.evidence(Version(spec), TABLE).covering(Version(Version(vllm).base_version),
                                                             Version(tf) if tf else None)
    assert (rec.vllm if rec else None) == covered_by


def test_the_table_is_per_patch_and_unites_the_platforms():
    ev = validation.evidence(Version("0.3.0"), TABLE)
    rec = ev.covering(Version("0.16.0"))
    assert rec.platforms == ("cpu", "cuda") and rec.transformers == ("4.57.6",)
    assert ev.patch_releases("p1") == ["0.16.0", "0.20.2", "0.26.0"]
    assert ev.patch_releases("offload") == ["0.16.0"] and ev.patch_releases("s04") == []
    assert ev.patch_transformers("tf") == ["5.17.0", "5.24.0"]
    # a transformers-dependent patch: validated on the installed line, not newer than the install
    assert ev.transformers_covering("tf", Version("5.24.3")) == "5.24.0"
    assert ev.transformers_covering("tf", Version("5.25.0")) is None
    assert ev.transformers_covering("tf", Version("5.17.0")) == "5.17.0"


@pytest.mark.parametrize(
    "params, positional, keywords, why",
    [
        (sig("a", "b"), 0, ["a", "b"], None),
        (sig("a", "b"), 1, ["b"], None),
        (sig("a", "b"), 0, ["a"], "missing a required argument: 'b'"),
        (sig("a"), 0, ["a", "c"], "got an unexpected keyword argument 'c'"),
        (sig("a", varkw=True), 0, ["a", "c"], None),
        (sig("a"), 2, [], "takes 1 positional arguments but 2 were given"),
        (sig("a", "b"), 1, ["a", "b"], "got multiple values for argument 'a'"),
        (sig("a", kwonly=("k",)), 1, ["k"], None),
    ],
)
def test_binds(params, positional, keywords, why):
    from speculators_compat.check.checks import binds

    assert binds(params, keywords, positional) == why


def test_stock_calls_are_bound_as_the_applied_patches_edit_them():
    from speculators_compat.check.calls import Call
    from speculators_compat.check.checks import judge_calls as _judge
    from speculators_compat.core.registry import Decision

    calls = [Call("Scheduler", "m", 0, ("vllm_config", "kv"), 10), Call("Request", "m", 0, ("rid", "eos"), 20),
             Call("SamplingParams", "m", 0, ("max_tokens",), 30)]
    signatures = {"Scheduler": sig("vllm_config", "kv", "block_size"), "Request": sig("rid"), "SamplingParams": None}
    v2, _ = make_patch("v2")
    v2 = Patch(**{**v2.__dict__, "calls": {"Scheduler": Edit(add=("block_size",))}})
    v6 = Patch(**{**v2.__dict__, "id": "v6", "calls": {"Request": Edit(drop=("eos",))}})
    applies = [Decision(v2, Status.APPLIES, ""), Decision(v6, Status.APPLIES, "")]
    ok = _judge(calls, lambda c: signatures[c.name], applies)
    assert ok.shape.value == "new" and "2 stock calls into vLLM bind (SamplingParams: no readable signature)" in ok.evidence
    broken = _judge(calls, lambda c: signatures[c.name], applies[:1])
    assert broken.shape.value == "unknown" and broken.cause is Cause.CALL_DOES_NOT_BIND
    assert ("Request(rid=…, eos=…) (vllm_hidden_states_generator.py line 20): got an unexpected keyword "
            "argument 'eos'") in broken.evidence


def test_stock_calls_are_read_from_the_generator_source(tmp_path):
    from speculators_compat.check.calls import stock_calls
    from speculators_compat.check.sources import Sources, StaticView

    gen = tmp_path / "speculators" / "data_generation"
    gen.mkdir(parents=True)
    for d in (tmp_path / "speculators", gen):
        (d / "__init__.py").write_text("")
    (gen / "vllm_hidden_states_generator.py").write_text(textwrap.dedent("""
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import Request

        class VllmHiddenStatesGenerator:
            def __init__(self):
                self.scheduler = Scheduler(vllm_config=1, kv_cache_config=2)
                self.executor = None

            def generate(self, ids):
                self.scheduler.add_request(Request(request_id="r", eos_token_id=2))
                self.executor.collective_rpc("_reset_capture")
                other.thing(1)
    """))
    view = StaticView(vllm=Sources("vllm", str(tmp_path / "nothing")),
                      speculators=Sources("speculators", str(tmp_path / "speculators")), cpu=True)
    found = [(c.name, c.module, c.positional, c.keywords) for c in stock_calls(view)]
    assert found == [
        ("Scheduler", "vllm.v1.core.sched.scheduler", 0, ("vllm_config", "kv_cache_config")),
        ("Scheduler.add_request", "vllm.v1.core.sched.scheduler", 1, ()),
        ("Request", "vllm.v1.request", 0, ("request_id", "eos_token_id")),
        ("MultiprocExecutor.collective_rpc", "", 1, ()),
    ]


def assert_listed_as_check_lists(ids: list[str], by_side: bool = False) -> None:
    """Every patch once, in the order they apply (``by_side``: the driver's, then the workers'), and
    each engine check once, after every patch of its target (the checks run after them)."""
    from speculators_compat.core import preflight

    checks = set(preflight.ids())
    patches = hooks.patches()
    if by_side:
        patches = [p for p in patches if p.side is Side.DRIVER] + [p for p in patches if p.side is Side.WORKER]
    assert [i for i in ids if i not in checks] == [p.id for p in patches]
    assert sorted(i for i in ids if i in checks) == sorted(checks)
    for check in preflight.CHECKS:
        of_target = [ids.index(p.id) for p in hooks.patches() if p.target == check.target]
        assert ids.index(check.id) > max(of_target), (check.id, ids)


def test_check_json_follows_the_documented_schema(tmp_path):
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat.check", "--json"], capture_output=True, text=True, cwd=tmp_path
    )
    rep = json.loads(proc.stdout)
    assert proc.returncode == (0 if rep["covered"] else 1), proc.stderr[-2000:]
    assert set(rep) == {"schema", "mode", "python", "torch", "transformers", "vllm", "speculators", "validation",
                        "covered", "reasons", "unknown_disabled", "patches", "apis"}
    assert rep["schema"] == 4 and rep["mode"] == "static"
    assert rep["covered"] is (rep["reasons"] == [])
    for p in rep["patches"]:
        assert set(p) == {"id", "title", "side", "kind", "family", "delta", "target", "vllm_range", "speculators",
                          "depends_on", "optional", "status", "needed", "cause", "reason"}
        assert p["status"] in {"applies", "not needed", "left off", "refused", "disabled"}
        assert (p["cause"] is None) == (p["status"] != "refused")
    for a in rep["apis"]:
        assert {"api", "found", "status", "releases", "expected"} <= set(a)
        assert a["status"] in {"known", "compatible", "unknown"}
        assert ("difference" in a) == (a["status"] == "unknown")
    if rep["vllm"] is None:  # the unit env: not covered, and no patch list to say why
        assert rep["covered"] is False and rep["apis"] == [] and rep["validation"] is None
        assert rep["patches"] == [] and "vLLM is not installed" in rep["reasons"]
    else:
        assert_listed_as_check_lists(ids=[p["id"] for p in rep["patches"]])


ROW = re.compile(r"^  (applies|not needed|left off|disabled|refused|pending)\s+(\S+)  (.*)$")


def test_check_text_says_the_verdict_first_and_one_line_per_patch(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "speculators_compat.check", "-v"], capture_output=True, text=True, cwd=tmp_path
    ).stdout.splitlines()
    assert out[0] in {"covered: yes", "covered: NO"}
    assert (out[0] == "covered: yes") == (not out[1].startswith("  - "))
    rows = {m.group(2): (i, m.group(1)) for i, line in enumerate(out) if (m := ROW.match(line))}
    if versions.vllm() is None:  # nothing installed: the verdict says so in a few lines
        assert rows == {} and len(out) < 10 and "  - vLLM is not installed" in out
        return
    assert_listed_as_check_lists(list(rows), by_side=True)
    for patch in hooks.patches():  # -v: the evidence, then the delta
        row = rows[patch.id][0]
        assert out[row + 2].split(None, 1) == ["delta:", patch.delta], out[row + 2]
    short = subprocess.run([sys.executable, "-m", "speculators_compat.check"], capture_output=True, text=True,
                           cwd=tmp_path).stdout.splitlines()
    assert len(short) < len(out) and sum(bool(ROW.match(line)) for line in short) == len(rows)


def test_check_refuses_an_unknown_disabled_id_and_names_the_known_ones(tmp_path):
    env = {**os.environ, "SPECULATORS_COMPAT_DISABLE": "v5,bogus-id"}
    proc = subprocess.run([sys.executable, "-m", "speculators_compat.check"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[0] == "covered: NO"
    line = next(ln for ln in proc.stdout.splitlines() if "names no patch" in ln)
    assert line.startswith("  - SPECULATORS_COMPAT_DISABLE names no patch: bogus-id. Known ids: "), line
    assert " v5, " in line and "guard-input" in line, line


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_checks_list_of_the_projects_dependencies_is_setup_cfgs():
    """``check`` names the project's own dependencies from a list of its own (it runs from a
    checkout that was never installed, without the package's metadata): the same as setup.cfg's
    ``install_requires``."""
    import configparser

    from speculators_compat.check import command

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(CHECKOUT, "setup.cfg"))
    lines = [ln.strip() for ln in cfg["options"]["install_requires"].splitlines() if ln.strip()]
    assert tuple(re.split(r"[<>=!~;\[ ]", ln)[0] for ln in lines) == command.DEPENDENCIES


@pytest.mark.parametrize("missing", ["wrapt", "packaging"])
def test_check_in_a_python_without_the_projects_dependencies_says_to_install_the_project(tmp_path, missing):
    """From a checkout, in a Python where the project was never installed: one line saying to
    install it (``pip install .``), exit code 2, no traceback."""
    code = (f"import runpy, sys; sys.modules[{missing!r}] = None; "  # import of it: ModuleNotFoundError
            "runpy.run_module('speculators_compat.check', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"speculators_compat check: {missing}, which speculators_compat needs, is not installed" in proc.stderr
    assert "`pip install .` at the root of the clone" in proc.stderr, proc.stderr


def test_the_runtime_binding_looks_worker_calls_up_where_the_worker_imports_them():
    from speculators_compat.check.calls import Call
    from speculators_compat.check.checks import runtime_signature as _runtime_signature

    generator = types.ModuleType(GENERATOR)  # imports nothing the worker calls
    generator.Scheduler = lambda vllm_config, block_size: None
    signature_of = _runtime_signature(generator)
    assert list(signature_of(Call("dumps", "json", 1, (), 3, WORKER)))[0] == "obj"
    assert list(signature_of(Call("Scheduler", "vllm.v1.core.sched.scheduler", 0, (), 5, GENERATOR))) == [
        "vllm_config", "block_size"]
