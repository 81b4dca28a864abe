"""The engine's checks before the executor starts: they run after every patch of their target.

A check judges what the patches left: the installed vLLM line was validated end to end
(``validated-release``), every vLLM API the stock code uses has a known shape (``api-inventory``),
and every stock call into vLLM binds as the applied patches edit it (``stock-calls``: it reads
the ``calls=`` of every patch that applies, with no list of them). A check that finds something
wrong is refused as a patch is: the target's entry point raises ``IncompatibleVllmError`` before
the weights load, with the same message. A check's decision is shown by ``check`` with the
patches' (the same fields: it is not gated by the validation table, and never optional), a
passed check is listed with the applied patches, and ``SPECULATORS_COMPAT_DISABLE=<check id>``
skips it at the user's risk.

This module says what a check is and runs the checks; which checks there are is wired in from
above (``speculators_compat/__init__.py`` wires :mod:`speculators_compat.check.checks`), so the
engine's core imports nothing of ``check`` or ``run``. Nothing here imports the patch set: the
checks see the patches only through their decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from . import registry
from .registry import Context, Decision, Kind, Probe, Side
from .targets import GENERATOR

__all__ = ["Check", "CHECKS", "wire", "checks", "checks_of", "ids", "evaluate", "evaluate_all", "in_order"]

#: the speculators releases the engine's checks serve (those the patch set serves)
SPECULATORS = ">=0.3.0,<0.5"


@dataclass(frozen=True)
class Check:
    """One engine check: described as a patch is (``check`` and a refusal show it the same way),
    judged by ``judge(module, view, decisions, ctx)``: ``module`` the imported target (or None and
    ``view`` the installed sources), ``decisions`` those of every patch of the target."""

    id: str
    title: str
    delta: str
    api: str
    judge: Callable[[ModuleType | None, Any, list[Decision], Context], Probe]
    remove_when: str
    #: what it does, for the docs
    doc: str = ""
    target: str = GENERATOR
    side: Side = Side.DRIVER
    kind: Kind = Kind.GUARD
    speculators: str = SPECULATORS
    vllm: str = ""
    depends_on: tuple[str, ...] = ()
    optional: bool = False
    upstream: str = "-"
    after: tuple[str, ...] = ()
    calls: dict = field(default_factory=dict)
    #: listed before the patches refused for the same cause: it judges what they rely on
    first: bool = False

    @property
    def family(self) -> str:
        return self.id

    def __hash__(self) -> int:
        return hash(self.id)


#: where the checks come from: ``[source]``, ``source()`` returning them (set by :func:`wire`)
_WIRED: list[Callable[[], tuple[Check, ...]]] = []


def wire(source: Callable[[], tuple[Check, ...]]) -> None:
    """Take the engine's checks from ``source()`` (called when they are first needed)."""
    _WIRED[:] = [source]


def checks() -> tuple[Check, ...]:
    """The engine's checks, in their order (none when nothing was wired)."""
    return tuple(_WIRED[0]()) if _WIRED else ()


def __getattr__(name: str):
    if name == "CHECKS":  # read as a constant: preflight.CHECKS
        return checks()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def checks_of(target: str) -> list[Check]:
    return [c for c in checks() if c.target == target]


def ids() -> list[str]:
    return [c.id for c in checks()]


def evaluate(check: Check, module: ModuleType | None, view: Any, ctx: Context,
             decisions: list[Decision]) -> Decision:
    """``check``'s decision, given the ``decisions`` of every patch of its target."""
    return registry.evaluate(check, module, view, ctx, judge=lambda: check.judge(module, view, decisions, ctx))


def evaluate_all(patches, module: ModuleType | None = None, view: Any = None,
                 ctx: Context | None = None) -> list[Decision]:
    """The decisions of ``patches``, in their order, each target's checks after its last patch."""
    ctx = ctx or registry.context()
    out: list[Decision] = []
    for target in dict.fromkeys(p.target for p in patches):
        decisions = registry.evaluate_all([p for p in patches if p.target == target], module, view, ctx)
        out += decisions + [evaluate(c, module, view, ctx, decisions) for c in checks_of(target)]
    return in_order(patches, out)


def in_order(patches, decisions: list[Decision]) -> list[Decision]:
    """``decisions`` in the order ``patches`` apply, each target's checks right after its last patch."""
    rank = {p.id: i for i, p in enumerate(patches)}
    last = {p.target: rank[p.id] for p in patches}
    return sorted(decisions, key=lambda d: rank[d.patch.id] if d.patch.id in rank else last[d.patch.target] + 0.5)
