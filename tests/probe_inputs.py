"""Small builders of what the probes and the decision read: signatures as ``inspect`` gives them
(``P``, ``sig``) and an install's context from a validation table (``inst``, ``_context_of``); for
tests/core, tests/check and the patches' own tests (tests/patches/<group>/)."""

from __future__ import annotations

import inspect

from packaging.version import Version

from speculators_compat.check import validation
from speculators_compat.core import versions
from speculators_compat.core.registry import Context


def inst(v: str, dist: str = "vllm") -> versions.Installed:
    return versions.Installed(dist, Version(v))


def _context_of(vllm: str, spec: str, tf: str, table: dict) -> Context:
    """The context an install of these releases gets from the shipped validation table."""
    v, s, t = inst(vllm, "vllm"), inst(spec, "speculators"), inst(tf, "transformers")
    ev = validation.evidence(s.base, table)
    return Context(v, s, frozenset(), ev.covering(v.base, t.version), False, (), t, ev)


def P(name, default=inspect.Parameter.empty, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD):
    return inspect.Parameter(name, kind, default=default)


def sig(*names, optional=(), kwonly=(), varkw=False):
    out = {n: P(n) for n in names}
    out.update({n: P(n, None) for n in optional})
    out.update({n: P(n, None, inspect.Parameter.KEYWORD_ONLY) for n in kwonly})
    if varkw:
        out["kw"] = P("kw", kind=inspect.Parameter.VAR_KEYWORD)
    return out
