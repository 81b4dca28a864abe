"""A new patch is one module and its test file: discovery, the order, ``check``, the contract test and
the generated docs pick the module up with no other edit, and its own tests live in
``tests/patches/<group>/test_<module>.py`` (as docs/patches.md says), which the unit env collects.

The patch set here is written to a temporary folder: two patches of a stand-in library
(``dummy_lib.engine``, which does not exist, so the contract test uses its stand-in target), one
wrapping what the other wrapped; and a broken patch set whose patch bypasses its ``Patcher``.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import patchdoc
import patchset
import pytest
from packaging.version import Version

from speculators_compat.check import command as check

from speculators_compat.core import hooks, registry, versions
from speculators_compat.core.discovery import discover, order

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = "dummy_lib.engine"

REPAIR = '''
"""dummy-repair -- the stand-in library's ``Engine.run`` answers in a list again.

Problem: ``Engine.run`` returns its answer bare where the caller indexes a list.
Detection: ``Engine`` has ``run``. Remove when the stand-in library is gone.
"""

from speculators_compat.core.registry import Kind, Patch, Probe, Side


def probe(module):
    return Probe.new("Engine.run found") if hasattr(module.Engine, "run") else Probe.old("no Engine.run")


def static_probe(view):
    return Probe.new("Engine.run (read from nothing: a stand-in)")


def _run(wrapped, instance, args, kwargs):
    return [wrapped(*args, **kwargs)]


def apply(module, patcher):
    patcher.wrap(module.Engine, "run", _run)


PATCH = Patch(id="dummy-repair", title="Engine.run answers in a list", delta="Engine.run() -> x instead of [x]",
              api="dummy_lib.engine.Engine.run", side=Side.DRIVER, kind=Kind.DELTA, target="{target}",
              speculators=">=0.3.0,<0.5", depends_on=(), probe=probe, static_probe=static_probe, apply=apply,
              remove_when="the stand-in library is gone")
'''

GUARD = '''
"""dummy-guard -- the stand-in library's ``Engine.run`` is checked after the repair.

Problem: nothing checks what ``Engine.run`` returns. Detection: ``Engine`` has ``run``.
Remove when the stand-in library is gone.
"""

from speculators_compat.core.registry import Kind, Patch, Probe, Side


def probe(module):
    return Probe.new("Engine.run found")


def static_probe(view):
    return Probe.new("Engine.run (a stand-in)")


def _run(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    assert isinstance(out, list)
    return out


def apply(module, patcher):
    patcher.wrap(module.Engine, "run", _run)


PATCH = Patch(id="dummy-guard", title="Engine.run checked", delta="-- (nothing checks Engine.run)",
              side=Side.DRIVER, kind=Kind.GUARD, target="{target}", speculators=">=0.3.0,<0.5", depends_on=(),
              after=("dummy-repair",),  # wraps Engine.run outside the repair: checks what it returns
              probe=probe, static_probe=static_probe, apply=apply, remove_when="the stand-in library is gone")
'''

#: a patch that changes its target behind its Patcher's back: revert cannot restore it
BROKEN = REPAIR.replace("dummy-repair", "dummy-broken").replace(
    'patcher.wrap(module.Engine, "run", _run)', "module.Engine.run = lambda self: [None]")


def _write_set(folder, name: str, modules: dict[str, str]) -> None:
    root = folder / name
    (root / "extra").mkdir(parents=True)
    (root / "__init__.py").write_text('"""A patch set of the tests."""\n\nGROUPS = ("extra",)\n')
    (root / "extra" / "__init__.py").write_text("")
    for module, text in modules.items():
        (root / "extra" / f"{module}.py").write_text(textwrap.dedent(text).replace("{target}", TARGET))


@pytest.fixture
def dummy(tmp_path, monkeypatch):
    _write_set(tmp_path, "dummyset", {"dummy_repair": REPAIR, "dummy_guard": GUARD})
    _write_set(tmp_path, "brokenset", {"dummy_broken": BROKEN})
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("dummyset", "brokenset")]:
        del sys.modules[name]
    hooks.reset()
    hooks.install(hooks.PATCH_SET)


def test_discovery_and_the_order_pick_it_up(dummy):
    found = discover("dummyset")
    assert [p.id for p in found] == ["dummy-repair", "dummy-guard"]  # after=, not the id's order
    both = order([*found[::-1], *hooks.patches()])
    ids = [p.id for p in both]
    assert ids.index("dummy-repair") < ids.index("dummy-guard") and len(ids) == len(hooks.patches()) + 2
    shared = {t.key for t in patchset.touches(found[0])} & {t.key for t in patchset.touches(found[1])}
    assert shared == {(f"{TARGET}.Engine", "run")}  # what the order's property tests look at


def test_a_feature_package_in_a_group_is_discovered(tmp_path, monkeypatch):
    """A group may hold a package (a feature's patches beside their runtime, as
    ``features/datapath``): its patch modules are found, in that group; its runtime modules (no
    ``PATCH``) are imported and skipped; a patch outside every group is refused."""
    root = tmp_path / "featureset"
    feature = root / "extra" / "feature"
    feature.mkdir(parents=True)
    (root / "__init__.py").write_text('GROUPS = ("extra",)\n')
    (root / "extra" / "__init__.py").write_text("")
    (feature / "__init__.py").write_text("")
    (feature / "dummy_repair.py").write_text(textwrap.dedent(REPAIR).replace("{target}", TARGET)
                                             + "\nfrom . import runtime  # noqa: E402\n")
    (feature / "runtime.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = discover("featureset")
        assert [p.id for p in found] == ["dummy-repair"]
        assert sys.modules["featureset.extra.feature.runtime"].IMPORTED  # walked, not a patch
        (root / "loose").mkdir()
        (root / "loose" / "__init__.py").write_text("")
        (root / "loose" / "dummy_guard.py").write_text(textwrap.dedent(GUARD).replace("{target}", TARGET))
        with pytest.raises(ImportError, match="in no group"):
            discover("featureset")
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "featureset"]:
            del sys.modules[name]


def test_the_data_path_is_one_package_of_the_features_group():
    import patchdoc

    ids = {"offload-captured", "shm-transport", "results-in-place", "self-check", "self-check-reference"}
    found = {p.id: p for p in hooks.patches() if p.id in ids}
    assert set(found) == ids
    for patch in found.values():
        assert patchset._module_of(patch).startswith(f"{hooks.PATCH_SET}.features.datapath.")
        assert patchdoc._group(patch) == "features"


def test_check_reports_it(dummy, monkeypatch):
    installed = registry.Context(vllm=versions.Installed("vllm", Version("0.16.0")),
                                 speculators=versions.Installed("speculators", Version("0.3.0")),
                                 disabled=frozenset())
    monkeypatch.setattr(registry, "context", lambda *a, **k: installed)
    hooks.install("dummyset")
    rep = check.report()
    assert [(p["id"], p["status"]) for p in rep["patches"]] == [("dummy-repair", "applies"),
                                                                ("dummy-guard", "applies")]
    assert rep["covered"] is True
    text = check._text(rep)
    assert "dummy-repair" in text and "Engine.run answers in a list" in text


def test_the_generated_docs_list_it(dummy):
    text = patchdoc.section(discover("dummyset"), ("extra",))
    assert "### `extra/`" in text
    assert "#### `dummy-repair`: Engine.run answers in a list" in text
    assert "The stand-in library's ``Engine.run`` answers in a list again." in text
    assert "- delta: Engine.run() -> x instead of [x]" in text
    assert text.index("`dummy-repair`") < text.index("`dummy-guard`")


def _contract(dummy, patch_set: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CONTRACT_PATCH_SET": patch_set,
           "PYTHONPATH": os.pathsep.join([str(dummy), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                           os.path.join(ROOT, "tests", "patches", "test_contract.py")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_the_contract_test_runs_over_it(dummy):
    out = _contract(dummy, "dummyset")
    assert out.returncode == 0, out.stdout[-3000:]
    for pid in ("dummy-repair", "dummy-guard"):
        for test in ("test_the_declaration_is_well_formed", "test_apply_twice_then_revert_restores_the_target"):
            assert f"PASSED tests/patches/test_contract.py::{test}[{pid}]" in out.stdout, out.stdout[-3000:]


def test_the_contract_test_fails_a_patch_that_bypasses_its_patcher(dummy):
    out = _contract(dummy, "brokenset")
    assert out.returncode == 1
    assert "FAILED tests/patches/test_contract.py::test_apply_twice_then_revert_restores_the_target[dummy-broken]" \
        in out.stdout, out.stdout[-3000:]


def test_its_test_file_is_where_the_docs_say(dummy):
    found = discover("dummyset")
    assert [patchset.test_file(p) for p in found] == ["tests/patches/extra/test_dummy_repair.py",
                                                      "tests/patches/extra/test_dummy_guard.py"]
    with open(os.path.join(ROOT, "docs", "patches.md")) as fh:
        assert "are `tests/patches/<group>/test_<module>.py`" in fh.read()


def test_every_patch_has_its_test_file_and_every_test_file_a_patch_and_the_unit_env_runs_them():
    """Each patch module has its own ``tests/patches/<group>/test_<module>.py`` and each test file
    there names a patch module of that group: none is missing or misfiled, and their names are
    unique as the patch ids are (pytest imports them without packages)."""
    expected = {patchset.test_file(p) for p in hooks.patches()}
    files = sorted(os.path.relpath(f, ROOT).replace(os.sep, "/")
                   for f in glob.glob(os.path.join(ROOT, "tests", "patches", "*", "test_*.py")))
    assert not expected - set(files), f"patches without their own test file: {sorted(expected - set(files))}"
    assert files and set(files) == expected, f"test files naming no patch: {sorted(set(files) - expected)}"
    assert len({os.path.basename(f) for f in files}) == len(files)
    with open(os.path.join(ROOT, "tox.ini")) as fh:
        unit = fh.read().split("[testenv:unit]", 1)[1].split("\n[", 1)[0]
    assert " tests/patches " in unit


def test_every_patch_test_file_says_where_its_patch_is_shown_needed():
    """The "this patch is needed" evidence lives with each patch's test: ``NEEDED`` (the e2e step that
    fails with the patch off, and how), ``NEEDED_WHERE``, ``NEEDED_04`` or ``SHOWN_NEEDED`` (where else);
    tests/test_e2e.py runs them."""
    missing = []
    for patch in hooks.patches():
        found = patchset.evidence(os.path.join(ROOT, patchset.test_file(patch)))
        declared = {pid for key in found for pid in key.split(",")}
        if patch.id not in declared:
            missing.append(patchset.test_file(patch))
    assert not missing, f"test files that do not say where their patch is shown needed: {missing}"
    assert patchset.evidence(os.path.join(ROOT, "tests", "patches", "vllm_api", "test_v2.py")) == \
        {"v2": ("start", "block_size")}
