"""Whether an install is covered, from the decisions of its patches and engine checks.

The registry decides one patch at a time (:func:`speculators_compat.core.registry.evaluate`); this
module answers for the install: the order refusals are listed in (:func:`rank`), the ids in
``SPECULATORS_COMPAT_DISABLE`` that name no patch, and the verdict with its reasons.
"""

from __future__ import annotations

from . import _env
from .registry import DISABLE_ENV, Cause, Context, Decision, Status

__all__ = ["rank", "unknown_disabled", "unknown_disabled_message", "verdict"]


def rank(decision: Decision) -> tuple[int, bool]:
    """Where a refusal is listed: what changed first (by :class:`Cause`), and for one cause an engine
    check that judges what the patches rely on (``first``: the release's ceiling, the API shapes)
    before them."""
    order = list(Cause)
    return (order.index(decision.cause) if decision.cause else len(order), not getattr(decision.patch, "first", False))


def unknown_disabled(known: list[str], disabled: frozenset[str] | None = None) -> list[str]:
    """The ids in ``SPECULATORS_COMPAT_DISABLE`` (or ``disabled``) that name no patch of ``known``."""
    disabled = _env.disabled() if disabled is None else disabled
    return sorted(disabled - set(known) - _env.NOT_PATCHES)


def unknown_disabled_message(unknown: list[str], known: list[str]) -> str:
    return (f"{DISABLE_ENV} names no patch: {', '.join(unknown)}. Known ids: {', '.join(sorted(known))} "
            "(and 'all'; 'resume' for the runner's output folder)")


def verdict(decisions: list[Decision], ctx: Context, unknown_ids: list[str] = ()) -> tuple[bool, list[str]]:
    """Whether the install is covered, and the reasons when it is not (the first ones first)."""
    reasons = []
    if ctx.vllm is None:
        reasons.append("vLLM is not installed")
    if ctx.speculators is None:
        reasons.append("speculators is not installed")
    if unknown_ids:
        reasons.append(f"{DISABLE_ENV} names no patch: {', '.join(unknown_ids)}")
    if ctx.unvalidated and ctx.vllm is not None and ctx.speculators is not None and ctx.record is None:
        reasons.append(f"vLLM {ctx.vllm.base} is not validated: it runs under {_env.UNVALIDATED}="
                       f"{_env.UNVALIDATED_SELF_CHECK} (every sequence of the first calls checked)")
    bad = [d for d in decisions if d.uncovers]
    bad.sort(key=lambda d: (d.status is not Status.REFUSED, *rank(d)))
    for d in bad:
        reasons.append(f"{d.patch.id} {d.status.value}: {d.reason}")
    return not reasons, reasons
