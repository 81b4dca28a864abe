"""The contract every patch keeps, as functions the contract test runs over a patch set.

* its declaration is well formed (docstring with the delta's problem, detection and removal; ranges
  that parse; its module named by its id);
* applied through the engine, it changes what it says it touches; applied twice, nothing more
  changes; reverted, its target is what it was.

The target is the real module where it imports (the patch is then judged as in a real process and
skipped where it does not apply), else a stand-in (:class:`FakeTarget`) whose every class and
method exists: what the patch wraps is found there, and the engine is told the patch applies.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import types

import patchset
from packaging.specifiers import SpecifierSet

from speculators_compat.core import hooks, preflight, registry, targets
from speculators_compat.core.registry import Decision, Kind, Side, Status


class _Stub(type):
    """A stand-in class: any method it lacks exists (a plain function, kept once looked up)."""

    #: special methods a patch may wrap (others stay absent: inspect and wrapt look some up)
    SPECIAL = frozenset({"__del__", "__call__", "__missing__"})

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__") and name not in _Stub.SPECIAL:
            raise AttributeError(name)

        def method(*args, **kwargs):
            return None

        method.__name__, method.__qualname__ = name, f"{cls.__name__}.{name}"
        type.__setattr__(cls, name, method)
        return method


class FakeTarget(types.ModuleType):
    """A stand-in target module: any name it lacks is a stand-in class, kept once looked up."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        stub = _Stub(name, (), {"__module__": self.__name__})
        setattr(self, name, stub)
        return stub


def well_formed(patch) -> list[str]:
    """What is wrong with ``patch``'s declaration (empty: nothing)."""
    module = importlib.import_module(patchset._module_of(patch))
    doc = inspect.cleandoc(module.__doc__ or "")
    bad = []
    if not doc.startswith(f"{patch.id} -- "):
        bad.append(f"the docstring does not open with '{patch.id} -- <what it does>'")
    for word, what in (("detect", "how the delta is detected"), ("remov", "when it can be removed")):
        if not re.search(rf"\b{word}", doc, re.I):
            bad.append(f"the docstring does not say {what}")
    if module.__name__.rsplit(".", 1)[-1] != patch.id.replace("-", "_"):
        bad.append(f"module {module.__name__} is not named by its id")
    for field in ("title", "delta", "target", "speculators", "remove_when"):
        if not getattr(patch, field):
            bad.append(f"{field}= is empty")
    for field in ("vllm", "speculators"):
        try:
            SpecifierSet(getattr(patch, field))
        except ValueError as exc:
            bad.append(f"{field}={getattr(patch, field)!r} does not parse: {exc}")
    if not (isinstance(patch.side, Side) and isinstance(patch.kind, Kind)):
        bad.append("side= or kind= is not a Side / Kind")
    if not (callable(patch.probe) and callable(patch.apply) and callable(patch.static_probe)):
        bad.append("probe=, static_probe= and apply= must be callables")
    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", patch.id):
        bad.append(f"id {patch.id!r} is not lower-case words joined by '-'")
    return bad


def real_target(patch):
    """The imported target module, or None where it does not import here."""
    try:
        return importlib.import_module(patch.target)
    except ImportError:
        return None


def _owners(patch, module) -> list:
    """The objects whose attributes ``patch`` touches, found from ``module`` (its target) or imported."""
    out = [module]
    for touch in patchset.touches(patch):
        if ":" in touch.owner:  # an owner the static reading could not name
            continue
        if touch.owner == patch.target or touch.owner.startswith(patch.target + "."):
            path, obj = touch.owner[len(patch.target):].strip(".").split("."), module
        else:
            parts = touch.owner.split(".")
            for i in range(len(parts), 0, -1):
                if ".".join(parts[:i]) in sys.modules:
                    obj, path = sys.modules[".".join(parts[:i])], parts[i:]
                    break
            else:
                continue
        for part in filter(None, path):
            obj = getattr(obj, part, None)
        if obj is not None:
            out.append(obj)
    return out


def snapshot(patch, module) -> dict:
    """Every attribute of the target, of its classes and of what the patch touches (by identity)."""
    out = {}
    for owner in _owners(patch, module):
        items = owner.items() if isinstance(owner, dict) else vars(owner).items()  # a dispatch table
        for name, value in list(items):
            out[(id(owner), name)] = value
            if owner is module and isinstance(value, type):
                out.update({(id(value), k): v for k, v in list(vars(value).items())})
    return out


def changed(before: dict, after: dict) -> list:
    keys = set(before) | set(after)
    return sorted(str(k[1]) for k in keys if before.get(k, keys) is not after.get(k, keys))


class Skip(Exception):
    """This patch cannot be exercised here (its library is absent, or it does not apply)."""


def apply_and_revert(patch, monkeypatch) -> dict:
    """Apply ``patch`` alone through the engine (twice), then revert it, on its real target or a
    stand-in; returns what changed at each step. Raises :class:`Skip` where it cannot run here."""
    module = real_target(patch)
    fake = module is None
    if fake:
        module = FakeTarget(patch.target)
        monkeypatch.setattr(registry, "evaluate", lambda p, m, view=None, ctx=None, judge=None:
                            Decision(p, Status.APPLIES, "the contract test", needed=True))
        monkeypatch.setattr(preflight, "checks_of", lambda target: [])  # the engine's, not the patch's
        monkeypatch.setattr(targets, "ENTRY_POINTS", {})
        warm = registry.Patcher()  # the stand-in grows the names the patch looks up, once
        try:
            patch.apply(module, warm)
        except ImportError as exc:
            raise Skip(f"its apply needs {exc.name or exc} (not installed)") from None
        finally:
            records = len(warm.records)
            warm.undo()
        if not records and patchset.touches(patch):
            raise Skip("on a stand-in its apply changes nothing (it reads the real signatures first)")
    hooks.reset()
    try:
        hooks.install([patch])
        before = snapshot(patch, module)
        decision = hooks.apply_module(module)[0]
        if decision.status is not Status.APPLIES:
            raise Skip(f"{decision.status.value} here: {decision.reason}")
        applied = snapshot(patch, module)
        # what its Patcher recorded: owners the source does not name (found at run time) included
        patcher = hooks._state.applied.get(patch.id)
        records = list(patcher.records) if patcher is not None else []
        hooks.apply_module(module)
        again = snapshot(patch, module)
        ids = [i for i in hooks.applied_ids() if i not in preflight.ids()]
        hooks.revert()
        reverted = snapshot(patch, module)
        left = [str(name) for owner, name, original, own, item in records
                if (owner.get(name, _MISSING) if item else vars(owner).get(name, _MISSING))
                is not (original if own or item else _MISSING)]
    finally:
        hooks.reset()
        hooks.install(hooks.PATCH_SET)  # re-applied once, by restore(), where the targets are real
    return {"fake": fake, "applied": changed(before, applied) or sorted(str(r[1]) for r in records),
            "again": changed(applied, again), "reverted": changed(before, reverted) + left, "ids": ids}


_MISSING = object()


def probes_agree(patch) -> tuple:
    """``(runtime probe, static probe)`` of ``patch`` on the installed stock code (every patch
    reverted meanwhile)."""
    from speculators_compat.check.sources import StaticView

    module = real_target(patch)
    if module is None:
        raise Skip(f"{patch.target} does not import here")
    hooks.reset()
    try:
        return registry._probe(patch, module, None), registry._probe(patch, None, StaticView())
    finally:
        hooks.install(hooks.PATCH_SET)


def restore() -> None:
    """Apply the shipped patch set again (after the tests reverted it on the real targets)."""
    hooks.reset()
    hooks.install(hooks.PATCH_SET)
    hooks.apply()
