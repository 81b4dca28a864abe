"""The engine's three checks (:mod:`speculators_compat.core.preflight` holds what a check is and
runs them; this module says what they judge).

``validated-release``: the installed vLLM line was validated end to end; ``api-inventory``: every
vLLM API the stock code uses has a known shape; ``stock-calls``: every stock call into vLLM binds
as the applied patches edit it (it reads the ``calls=`` of every patch that applies, with no list
of them). They are wired into the engine by ``speculators_compat/__init__.py``, so that ``core``
imports nothing of ``check``.

Nothing here imports the patch set: the checks see the patches only through their decisions.
"""

from __future__ import annotations

import importlib
import inspect

from ..core import registry
from ..core.preflight import Check
from ..core.registry import Cause, Context, Probe, Status
from ..core.targets import GENERATOR
from .calls import Call, stock_calls

__all__ = ["CHECKS", "binds", "judge_calls", "required", "runtime_signature"]


# -- validated-release ---------------------------------------------------------------------------


def _validated_release(module, view, decisions, ctx: Context) -> Probe:  # noqa: ARG001
    if ctx.record is not None:
        rec = ctx.record
        line = f"{ctx.vllm.base.major}.{ctx.vllm.base.minor}"
        same = "" if str(ctx.vllm.base) == rec.vllm else f", the newest validated release of the {line} line"
        return Probe.new(f"covered by the validation of vLLM {rec.vllm}{same} ({', '.join(rec.platforms)}; "
                         f"transformers {', '.join(rec.transformers)})")
    if ctx.recording:
        return Probe.new(f"vLLM {ctx.vllm.base}: recording a validation run")
    if ctx.unvalidated:
        return Probe.new(f"vLLM {ctx.vllm.base} is not validated: it runs under the self-check opt-in "
                         f"({registry.uncovered_release(ctx)})")
    return Probe.unknown(f"{registry.uncovered_release(ctx)} (validated: {', '.join(ctx.validated) or 'none'})",
                         Cause.NOT_VALIDATED)


# -- api-inventory -------------------------------------------------------------------------------


def _api_inventory(module, view, decisions, ctx) -> Probe:  # noqa: ARG001
    from . import inventory
    from .sources import StaticView

    entries = inventory.inventory(view if view is not None else StaticView())
    bad = inventory.unknown(entries)
    if bad:
        return Probe.unknown("unknown API shape: " + "; ".join(bad))
    newer = sum(e["status"] == "compatible" for e in entries)
    text = f"{len(entries)} vLLM APIs of the stock code have recorded shapes"
    return Probe.new(text + (f" ({newer} with added optional parameters only)" if newer else ""))


# -- stock-calls ---------------------------------------------------------------------------------


def required(param: inspect.Parameter) -> bool:
    """``param`` must be passed: no default, and not ``*args`` / ``**kwargs``."""
    return param.default is inspect.Parameter.empty and param.kind not in (
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    )


def binds(params: dict[str, inspect.Parameter], names, positional: int = 0) -> str | None:
    """Why a call passing ``positional`` arguments and ``names`` as keywords does not bind to
    ``params`` (``None``: it binds)."""
    P = inspect.Parameter
    ordered = [p for p in params.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is P.VAR_POSITIONAL for p in params.values())
    if positional > len(ordered) and not takes_varargs:
        return f"takes {len(ordered)} positional arguments but {positional} were given"
    filled = {p.name for p in ordered[:positional]}
    takes_any = any(p.kind is P.VAR_KEYWORD for p in params.values())
    unknown = [n for n in names if not takes_any and (n not in params or params[n].kind is P.POSITIONAL_ONLY)]
    if unknown:
        return f"got an unexpected keyword argument {unknown[0]!r}"
    twice = [n for n in names if n in filled]
    if twice:
        return f"got multiple values for argument {twice[0]!r}"
    missing = [n for n, p in params.items() if required(p) and n not in names and n not in filled]
    if missing:
        return f"missing a required argument: {missing[0]!r}"
    return None


def _edits(decisions) -> dict[str, tuple[set[str], set[str], list[str]]]:
    """``{call name: (added, dropped, by)}`` from the patches that apply."""
    out: dict[str, tuple[set[str], set[str], list[str]]] = {}
    for decision in decisions:
        if decision.status is not Status.APPLIES:
            continue
        for name, edit in decision.patch.calls.items():
            add, drop, by = out.setdefault(name, (set(), set(), []))
            add.update(edit.add)
            drop.update(edit.drop)
            by.append(decision.patch.id)
    return out


def judge_calls(calls: list[Call], signature_of, decisions) -> Probe:
    """Bind ``calls`` (as the applying patches of ``decisions`` edit them) to ``signature_of(call)``."""
    if not calls:
        return Probe.unknown("no vLLM call found in the installed stock generator")
    edits = _edits(decisions)
    broken, unchecked = [], []
    for call in calls:
        sig = signature_of(call)
        if sig is None:
            unchecked.append(call.name)
            continue
        add, drop, by = edits.get(call.name, (set(), set(), []))
        keywords = [k for k in call.keywords if k not in drop] + sorted(add - set(call.keywords))
        why = binds(sig, keywords, call.positional)
        if why:
            edited = f" as edited by {', '.join(by)}" if by else ""
            where = call.where.rsplit(".", 1)[-1]
            broken.append(f"{call.text()} ({where}.py line {call.line}){edited}: {why}")
    if broken:
        return Probe.unknown("stock call does not bind: " + "; ".join(broken), Cause.CALL_DOES_NOT_BIND)
    text = f"{len(calls) - len(unchecked)} stock calls into vLLM bind"
    return Probe.new(text + (f" ({', '.join(sorted(set(unchecked)))}: no readable signature)" if unchecked else ""))


def runtime_signature(module):
    """``signature_of(call)`` from the imported objects (``module``: the generator module)."""

    def signature_of(call: Call):
        # a call of the worker extension: its name is looked up where the worker imports it from
        # (the generator module does not import get_pp_group & co.)
        owner = module if call.where == GENERATOR or not call.module else importlib.import_module(call.module)
        obj = getattr(owner, call.cls)
        if call.method:
            obj = getattr(obj, call.method)
        try:
            sig = dict(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            return None
        if call.method:  # an instance method of the executor or the scheduler
            sig.pop(next(iter(sig)), None)  # self
        return sig

    return signature_of


def _stock_calls(module, view, decisions, ctx) -> Probe:  # noqa: ARG001
    from .sources import StaticView

    if module is not None:
        return judge_calls(stock_calls(StaticView()), runtime_signature(module), decisions)

    def signature_of(call: Call):
        return view.vllm.params(call.module, call.cls, call.method)

    return judge_calls(stock_calls(view), signature_of, decisions)


CHECKS: tuple[Check, ...] = (
    Check(
        id="validated-release",
        title="the installed vLLM line was validated end to end",
        delta="a vLLM line the test matrix never compared with HF transformers -> refused",
        api="the installed vLLM release",
        judge=_validated_release,
        first=True,
        remove_when="never: add the release to the test matrix (tests/matrix.toml)",
        doc="The library's ceiling: a vLLM line (``major.minor``) that the test matrix never validated with "
            "the installed speculators line is refused, even if every probe is content (only an end-to-end "
            "comparison with HF transformers shows a changed token order, kernel or default). Later patch "
            "releases and nightlies of a validated line are covered by it. Detection: "
            "``speculators_compat/check/supported.json``.",
    ),
    Check(
        id="api-inventory",
        title="every vLLM API the stock code uses has a known shape",
        delta="any vLLM API of the stock code -> a shape recorded on a validated release",
        api="the vLLM APIs of VllmHiddenStatesGenerator and its worker extension",
        judge=_api_inventory,
        first=True,
        remove_when="never; re-record known_apis.json for each newly validated vLLM release",
        doc="Every vLLM API the stock generator and worker extension use (the names they import, the executor "
            "and scheduler methods they call) is compared with the signatures recorded on the validated releases "
            "(``speculators_compat/check/known_apis.json``): a name gone, a parameter removed or a new required one "
            "is refused; added optional parameters pass. Detection: :mod:`speculators_compat.check.inventory`.",
    ),
    Check(
        id="stock-calls",
        title="every stock call into vLLM binds",
        delta="a constructor or method of vLLM gains a required parameter or loses one the stock code passes "
        "-> refused before the weight load",
        api="the vLLM calls of VllmHiddenStatesGenerator",
        judge=_stock_calls,
        remove_when="never: this is the engine's own check",
        doc="Every vLLM call of the installed stock generator (:mod:`speculators_compat.check.calls`), edited as the "
            "patches that apply declare (``calls=``: keywords added or dropped), is bound to the installed "
            "signature; a call that does not bind is refused, naming the call, the parameter and the release. "
            "Detection: runtime signatures, or the same read from the installed sources.",
    ),
)
