"""validated-release -- the library's ceiling: a vLLM line nobody validated is refused.

Problem: every patch probes the one API it repairs, and ``api-inventory``/``stock-calls`` check
the APIs the stock code uses. A new release can still change what none of them look at (the
order of a step's tokens, a kernel, a default): only an end-to-end comparison with HF
transformers shows that. A release whose line (``major.minor``) the test matrix never validated
with the installed speculators line must not run, even if every probe is content.

How: nothing is wrapped. The check looks up the validated release that covers the installed
vLLM (:mod:`speculators_compat.validation`: the newest validated release of the same line that is
not newer than the installed base release, validated on the installed transformers major line)
and refuses when there is none, naming the validated releases (or the transformers release to
pin, where the vLLM line was validated on the other transformers major line). Later patch releases and nightlies of a validated line are covered by it (their shapes
are still checked by every probe and by ``api-inventory``).

Detection: ``speculators_compat/supported.json``, generated from the test matrix's runs
(``python tests/matrix.py record``).

Remove: never; add the release to the matrix instead.
"""

from __future__ import annotations

from speculators_compat.registry import Cause, Kind, Patch, Probe, Side, context, uncovered_release
from speculators_compat.targets import GENERATOR

from .._ranges import SPECULATORS_ALL


def _judge(prior=None, installed=None) -> Probe:  # noqa: ARG001 (a preflight check's signature)
    ctx = context(installed)
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
                         f"({uncovered_release(ctx)})")
    return Probe.unknown(f"{uncovered_release(ctx)} (validated: {', '.join(ctx.validated) or 'none'})",
                         Cause.NOT_VALIDATED)


def probe(module, prior) -> Probe:  # noqa: ARG001
    return _judge(prior)


def static_probe(view, prior) -> Probe:  # noqa: ARG001
    return _judge(prior, getattr(view, "installed", None))


def apply(module, patcher) -> None:
    """Nothing to wrap: the probe is the check."""


PATCH = Patch(
    id="validated-release",
    title="the installed vLLM line was validated end to end",
    delta="a vLLM line the test matrix never compared with HF transformers -> refused",
    api="the installed vLLM release",
    side=Side.DRIVER,
    target=GENERATOR,
    speculators=SPECULATORS_ALL,
    probe=probe,
    static_probe=static_probe,
    apply=apply,
    kind=Kind.GUARD,
    depends_on=(),  # it is the release check itself
    preflight=True,
    upstream="-",
    remove_when="never: add the release to the test matrix (tests/matrix.toml)",
)
