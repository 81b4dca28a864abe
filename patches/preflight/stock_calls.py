"""stock-calls -- every call the stock generator makes into vLLM binds, before the weights load.

Problem: a release that adds a required parameter to a constructor (``Scheduler(block_size=)``
in 0.11.1) or drops one the stock code passes (``Request(eos_token_id=)`` in 0.17.0) makes the
stock code raise ``TypeError`` deep inside ``__init__`` or ``generate()``, after the executor has
started and the model has loaded. Recording a release's API shapes (``api-inventory``) says only
that the shapes were seen, not that the stock calls bind to them.

How: nothing is wrapped. The check reads every vLLM call of the installed stock generator
(:mod:`speculators_compat.calls`: constructors, functions, and the methods it calls on its
executor and scheduler), applies the edits of the patches that apply before it (``Patch.calls``:
keywords they add or drop), and binds the result to the installed signature. A call that does not
bind is refused at the generator's preflight, naming the call, the parameter and the release.

Detection: runtime signatures (``inspect``) of the generator module's names; the fast check reads
the same signatures from the installed sources. A name whose signature cannot be read (an enum, a
msgspec struct) is listed as unchecked; ``api-inventory`` still checks that it exists.

Remove: never; it is the engine's own check.
"""

from __future__ import annotations

import importlib
import inspect

from speculators_compat.calls import Call, stock_calls
from speculators_compat.registry import Cause, Kind, Patch, Probe, Side, Status
from speculators_compat.targets import GENERATOR

from .._probes import params, required
from .._ranges import SPECULATORS_ALL

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


def _edits(prior) -> dict[str, tuple[set[str], set[str], list[str]]]:
    """``{call name: (added, dropped, by)}`` from the patches that apply."""
    out: dict[str, tuple[set[str], set[str], list[str]]] = {}
    for decision in prior:
        if decision.status is not Status.APPLIES:
            continue
        for name, edit in decision.patch.calls.items():
            add, drop, by = out.setdefault(name, (set(), set(), []))
            add.update(edit.add)
            drop.update(edit.drop)
            by.append(decision.patch.id)
    return out


def _judge(calls: list[Call], signature_of, prior) -> Probe:
    if not calls:
        return Probe.unknown("no vLLM call found in the installed stock generator")
    edits = _edits(prior)
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


def _runtime_signature(module):
    def signature_of(call: Call):
        # a call of the worker extension: its name is looked up where the worker imports it from
        # (the generator module does not import get_pp_group & co.)
        owner = module if call.where == GENERATOR or not call.module else importlib.import_module(call.module)
        obj = getattr(owner, call.cls)
        if call.method:
            obj = getattr(obj, call.method)
        try:
            sig = params(obj)
        except (TypeError, ValueError):
            return None
        if call.method:  # an instance method of the executor or the scheduler
            sig.pop(next(iter(sig)), None)  # self
        return sig

    return signature_of


def probe(module, prior) -> Probe:
    from speculators_compat.sources import StaticView

    return _judge(stock_calls(StaticView()), _runtime_signature(module), prior)


def static_probe(view, prior) -> Probe:
    def signature_of(call: Call):
        return view.vllm.params(call.module, call.cls, call.method)

    return _judge(stock_calls(view), signature_of, prior)


def apply(module, patcher) -> None:
    """Nothing to wrap: the probe is the check."""


PATCH = Patch(
    id="stock-calls",
    title="every stock call into vLLM binds",
    delta="a constructor or method of vLLM gains a required parameter or loses one the stock code passes "
    "-> refused before the weight load",
    api="the vLLM calls of VllmHiddenStatesGenerator",
    side=Side.DRIVER,
    target=GENERATOR,
    speculators=SPECULATORS_ALL,
    probe=probe,
    static_probe=static_probe,
    apply=apply,
    kind=Kind.GUARD,
    depends_on=(),
    # binds the calls as these edit them; after every repair and feature
    after=("v1", "v1-prefix-caching", "v1-chunked-prefill", "v2", "v5", "v6", "v9", "driver-threads"),
    preflight=True,
    upstream="-",
    remove_when="never: this is the engine's own check",
)
