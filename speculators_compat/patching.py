"""The door for patch authors: everything a patch module (``patches/``) imports from the engine.

A patch module imports ``speculators_compat.patching`` and nothing else of the engine (a test of
``tests/core/test_imports.py`` holds it to that), so the engine's modules can move without touching a
patch. What is here:

* the declaration: ``PATCH = declare(...)`` (a :class:`Patch`, with :class:`Kind`, :class:`Side`,
  :class:`Edit`; the module's ``probe``, ``static_probe`` and ``apply`` and the usual target and
  side filled in), what a probe
  returns (:class:`Probe`, :class:`Shape`), the targets (:data:`GENERATOR`, :data:`WORKER`, ...)
  and :class:`Deferred` (a worker reply the driver resolves);
* the sources without importing vLLM, for static probes: :class:`Sources`, :class:`StaticView`,
  :func:`render`, :func:`stock_calls`, :func:`where_now`, :func:`required` (a parameter that must be passed);
* the errors a patch raises (:class:`IncompatibleVllmError`, :class:`InvalidInputError`, ...);
* :class:`Option`: an environment variable that belongs to one patch, declared in its module;
* the run services a patch may use (:mod:`~speculators_compat.services`): ``atomic``,
  ``lifecycle``, ``manifest``, ``leftovers``;
* what the engine decided, for the rare patch that depends on another's decision:
  :func:`patches`, :func:`applied_ids`, :func:`context`, :func:`evaluate`, :func:`validated_here`,
  :class:`Status`, ``versions`` and :func:`unvalidated_self_check`.

See ``docs/patches.md`` ("Writing a patch").
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any

from .check.calls import stock_calls
from .check.checks import required
from .check.inventory import where_now
from .check.sources import Sources, StaticView, render
from .core import versions
from .core._env import unvalidated_self_check
from .core.hooks import applied_ids, patches
from .core.registry import Edit, Kind, Patch, Probe, Shape, Side, Status, context, evaluate, validated_here
from .core.replies import Deferred
from .core.targets import GENERATOR, SPECULATORS_CONFIG, SPECULATORS_UTILS, WORKER
from .errors import (CaptureContractError, CompatError, ConfigurationError, IncompatibleVllmError, InvalidInputError,
                     SelfCheckError, WorkerDiedError)
from . import inputs
from .services import atomic, leftovers, lifecycle, manifest

__all__ = [
    "declare", "Patch", "Kind", "Side", "Edit", "Probe", "Shape", "Status", "Deferred",
    "GENERATOR", "WORKER", "SPECULATORS_CONFIG", "SPECULATORS_UTILS",
    "Sources", "StaticView", "render", "stock_calls", "where_now", "required",
    "CompatError", "IncompatibleVllmError", "ConfigurationError", "InvalidInputError", "CaptureContractError",
    "SelfCheckError", "WorkerDiedError",
    "Option", "options",
    "atomic", "lifecycle", "manifest", "leftovers", "inputs",
    "patches", "applied_ids", "context", "evaluate", "validated_here", "versions", "unvalidated_self_check",
]

#: what :func:`declare` takes from the declaring module where the declaration does not name it
FROM_THE_MODULE = ("probe", "static_probe", "apply")


def declare(**fields: Any) -> Patch:
    """A patch module's ``PATCH``: a :class:`Patch` of ``fields``, filled in where the declaration
    does not name them. The id is the module's name, with ``-`` for ``_``. The module's own ``probe``,
    ``static_probe`` and ``apply`` are taken from it. What its group repeats is its group's
    ``PATCH_DEFAULTS`` (a dict in the package's ``__init__``; a package inside a group may add its
    own). The target is the stock generator's module (:data:`GENERATOR`), and the side follows the
    target (the workers' for :data:`WORKER`, else the driver's). A patch for one speculators line
    (``>=0.3.0,<0.4``) is removed, unless ``remove_when=`` says otherwise, when that line is no longer
    supported, and its ``upstream`` is, unless named, that the line does not fix it."""
    module = sys._getframe(1).f_globals
    fields = {**group_defaults(module.get("__package__") or ""), **fields}
    fields.setdefault("id", module["__name__"].rpartition(".")[2].replace("_", "-"))
    for name in FROM_THE_MODULE:
        if name not in fields and name in module:
            fields[name] = module[name]
    fields.setdefault("target", GENERATOR)
    fields.setdefault("side", Side.WORKER if fields["target"] == WORKER else Side.DRIVER)
    line = speculators_line(fields.get("speculators", ""))
    if line:
        fields.setdefault("remove_when", f"speculators {line} is no longer supported")
        fields.setdefault("upstream", f"not fixed in speculators {line}")
    return Patch(**fields)


def group_defaults(package: str) -> dict[str, Any]:
    """The ``PATCH_DEFAULTS`` of ``package`` and the packages above it, the innermost winning."""
    found: dict[str, Any] = {}
    parts = package.split(".") if package else []
    for i in range(1, len(parts) + 1):
        above = sys.modules.get(".".join(parts[:i]))
        found.update(getattr(above, "__dict__", {}).get("PATCH_DEFAULTS", {}))
    return found


def speculators_line(releases: str) -> str | None:
    """``"0.3.x"`` for a range of one speculators line (``>=0.3.0,<0.4``); else None."""
    m = re.fullmatch(r">=(\d+)\.(\d+)\.0,<(\d+)\.(\d+)", releases.replace(" ", ""))
    if not m or (m[1], int(m[2]) + 1) != (m[3], int(m[4])):
        return None
    return f"{m[1]}.{m[2]}.x"


#: every option a patch module declared, by name (filled as the patch modules are imported)
_DECLARED: dict[str, "Option"] = {}


@dataclass(frozen=True)
class Option:
    """An environment variable that belongs to one patch: declared in the patch's module (its name,
    and what it means for the docs), read where the patch uses it. The engine parses none of them."""

    name: str
    doc: str

    def __post_init__(self) -> None:
        if not self.name.startswith("SPECULATORS_COMPAT_"):
            raise ValueError(f"{self.name}: a patch's option is named SPECULATORS_COMPAT_<NAME>")
        _DECLARED[self.name] = self

    def __str__(self) -> str:
        return self.name

    def raw(self) -> str:
        """The variable's value, stripped (``""``: unset)."""
        return os.environ.get(self.name, "").strip()


def options() -> dict[str, Option]:
    """The options of the patch modules imported so far, by name."""
    return dict(_DECLARED)
