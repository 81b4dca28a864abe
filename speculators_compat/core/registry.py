"""The declarative patch registry and the decision each patch gets.

Every patch is one :class:`Patch`: which module's import triggers it, the vLLM API delta it
answers (old -> new), a feature probe that inspects the real target (and a static twin that
reads the installed sources), how it applies (through a :class:`Patcher`, which records how to
undo it), the upstream reference and when it can be removed.

Three questions, three sources of truth:

* *Is the delta there?* -- the probe: ``Shape.OLD`` (stock code works as written), ``NEW`` (the
  shape this patch repairs) or ``UNKNOWN`` (neither: refuse).
* *Was this patch validated here?* -- data, not code: the patch x release table of the test
  matrix (:mod:`speculators_compat.check.validation`). A patch declares what its delta depends on
  (``depends_on``): the vLLM release (validated on the release that covers the installed vLLM),
  the transformers release (validated on the installed transformers line), or nothing (not gated
  by the table: tokenizer-trust, most guards).
* *Which implementation?* -- a patch declares the vLLM releases it is written for (``vllm``);
  variants of one repair (``family``) split the releases between them.

============================  =============================================================
probe / table says            status
============================  =============================================================
disabled by the user          ``disabled``
outside the patch's range     ``not needed`` (a variant, a feature or a guard written for other
                              releases); a repair whose delta is present there is ``refused``
old shape                     ``not needed`` -- whatever the version says
unknown shape                 ``refused`` (cause ``UNKNOWN_SHAPE``) with the API and what to do
new shape, validated          ``applies``
new shape, not validated      a repair (delta, fix, platform): ``refused`` (``NOT_VALIDATED``);
                              a guard, feature or performance patch: ``left off`` (stock behaviour)
============================  =============================================================

:func:`speculators_compat.core.verdict.verdict` says whether an install is *covered*: nothing
refused, nothing left off or disabled where its delta is present -- except an optional patch (a
performance patch, whose absence leaves the stock data path: same rows, more time or memory; the
self-check) -- and no unknown id in ``SPECULATORS_COMPAT_DISABLE``.
``SPECULATORS_COMPAT_UNVALIDATED=self-check`` lets a release no validation run covers run under
the self-check; it is never covered.

Versions are compared on their base release (``0.16.1.dev3+g1`` -> ``0.16.1``), so a nightly
is judged by the release it leads to: ``0.17.0.dev3`` is neither ``<0.17`` nor silently
``>=0.17``; it is covered only if the 0.17 line was validated.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from . import _env, versions
from .patcher import Patcher

__all__ = [
    "Side",
    "Kind",
    "Shape",
    "Probe",
    "Status",
    "Cause",
    "Decision",
    "Patch",
    "Patcher",
    "Context",
    "context",
    "evaluate",
    "evaluate_all",
    "refusal",
    "uncovered_release",
    "validated_here",
    "DISABLE_ENV",
    "DEPENDENCIES",
]

DISABLE_ENV = _env.DISABLE
#: what a patch's delta can depend on (``Patch.depends_on``)
DEPENDENCIES = ("vllm", "transformers")


class Side(str, enum.Enum):
    DRIVER = "driver"  # the generator's process
    WORKER = "worker"  # every vLLM worker process


class Kind(str, enum.Enum):
    DELTA = "delta"  # repairs a vLLM API change the stock code trips on
    FIX = "fix"  # repairs a stock-code bug that gives wrong data on some releases
    PLATFORM = "platform"  # makes the stock code (or vLLM) correct on one platform
    GUARD = "guard"  # the library's own checks (input, output, API shapes, calls)
    FEATURE = "feature"  # an option the stock code does not have
    PERFORMANCE = "performance"  # speed or memory only: the same rows, bit for bit, without it

    @property
    def required(self) -> bool:
        """A repair is needed for correct data where its delta is present: unvalidated, it refuses.
        A guard, feature or performance patch is not: unvalidated, it is left off (the stock code
        runs as written)."""
        return self in (Kind.DELTA, Kind.FIX, Kind.PLATFORM)

    @property
    def optional(self) -> bool:
        """Left off or disabled, the install is still covered: the stock data path runs."""
        return self is Kind.PERFORMANCE


class Shape(enum.Enum):
    NEW = "new"  # the delta is present and the target has the expected new shape
    OLD = "old"  # the delta is absent: stock code works as written
    UNKNOWN = "unknown"  # neither: refuse


@dataclass(frozen=True)
class Probe:
    shape: Shape
    evidence: str
    #: why an unknown shape is refused (default: ``Cause.UNKNOWN_SHAPE``)
    cause: "Cause | None" = None

    @classmethod
    def new(cls, evidence: str) -> "Probe":
        return cls(Shape.NEW, evidence)

    @classmethod
    def old(cls, evidence: str) -> "Probe":
        return cls(Shape.OLD, evidence)

    @classmethod
    def unknown(cls, evidence: str, cause: "Cause | None" = None) -> "Probe":
        return cls(Shape.UNKNOWN, evidence, cause)


class Status(str, enum.Enum):
    APPLIES = "applies"
    NOT_NEEDED = "not needed"  # the delta is absent (or the patch is not written for this release)
    LEFT_OFF = "left off"  # the delta is present, but no validation run applied it here
    REFUSED = "refused"
    DISABLED = "disabled"
    PENDING = "pending"  # its target module has not been imported in this process


class Cause(str, enum.Enum):
    """Why a patch was refused (refusals are listed in this order: what changed comes first)."""

    UNKNOWN_SHAPE = "unknown shape"  # the target is neither the old nor the new shape
    CALL_DOES_NOT_BIND = "call does not bind"  # a stock call into vLLM would raise TypeError
    NOT_VALIDATED = "not validated"  # the shape matches, but nobody validated it on this release
    APPLY_FAILED = "apply failed"  # the target was not what the probe let us believe


@dataclass(frozen=True)
class Decision:
    patch: "Patch"
    status: Status
    reason: str
    cause: Cause | None = None
    #: whether the delta is present (the probe found the new or an unknown shape); None: not probed
    needed: bool | None = None

    @property
    def uncovers(self) -> bool:
        """Whether this decision makes the install not covered (see :func:`verdict`)."""
        if self.status in (Status.REFUSED, Status.PENDING):
            return True
        if self.status in (Status.LEFT_OFF, Status.DISABLED):
            return self.needed is not False and not self.patch.optional
        return False

    def as_dict(self) -> dict[str, Any]:
        p = self.patch
        return {
            "id": p.id,
            "title": p.title,
            "side": p.side.value,
            "kind": p.kind.value,
            "family": p.family,
            "delta": p.delta,
            "target": p.target,
            "vllm_range": p.vllm,
            "speculators": p.speculators,
            "depends_on": list(p.depends_on),
            "optional": p.optional,
            "status": self.status.value,
            "needed": self.needed,
            "cause": self.cause.value if self.cause else None,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Edit:
    """How a patch changes the keyword arguments of one stock call into vLLM."""

    add: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Patch:
    """One patch: one vLLM API delta, stock-code fix, platform fix, guard or feature."""

    id: str
    title: str
    #: the API that changed, as ``old -> new``
    delta: str
    side: Side
    #: module whose import triggers the patch
    target: str
    #: speculators releases this patch is for
    speculators: str
    #: ``probe(module) -> Probe``: inspects the real target
    probe: Callable[[ModuleType], Probe]
    #: ``apply(module, patcher)``: installs the patch through the patcher
    apply: Callable[[ModuleType, "Patcher"], None]
    kind: Kind = Kind.DELTA
    #: the vLLM releases the patch is written for (empty: every release; the probe decides)
    vllm: str = ""
    #: what its delta depends on, and so where it must have been validated: ``"vllm"`` (the
    #: release), ``"transformers"``, or nothing (not gated by the validation table)
    depends_on: tuple[str, ...] = ("vllm",)
    #: the install is covered without it: left off or disabled, the same rows come back (every
    #: performance patch; the self-check, whose absence leaves the rows unchecked, not changed)
    optional: bool = False
    #: variants of one repair share a family; outside its range a variant is superseded
    family: str = ""
    #: ids of the patches of the same target this one applies after (and so wraps)
    after: tuple[str, ...] = ()
    upstream: str = ""
    remove_when: str = ""
    #: the API named in a refusal
    api: str = ""
    #: ``static_probe(view) -> Probe``: the same judgement from the installed sources
    #: (a :class:`speculators_compat.check.sources.StaticView`), for the fast ``check``
    static_probe: Callable[[Any], Probe] | None = None
    #: how this patch changes the stock calls into vLLM (the ``stock-calls`` check of
    #: :mod:`speculators_compat.check.checks` binds the calls as the applied patches edit them)
    calls: dict[str, Edit] = field(default_factory=dict)
    #: names vLLM moved that this patch binds again where the stock code imports them:
    #: ``"old.module.name" -> "new.module"`` (the static check reads them where they are now)
    moves: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.family:
            object.__setattr__(self, "family", self.id)
        object.__setattr__(self, "after", tuple(self.after))
        object.__setattr__(self, "depends_on", tuple(self.depends_on))
        object.__setattr__(self, "side", Side(self.side))
        object.__setattr__(self, "kind", Kind(self.kind))
        if self.kind.optional:
            object.__setattr__(self, "optional", True)
        unknown = set(self.depends_on) - set(DEPENDENCIES)
        if unknown:
            raise ValueError(f"{self.id}: depends_on names {sorted(unknown)}; known: {DEPENDENCIES}")

    def __hash__(self) -> int:
        return hash(self.id)


@dataclass(frozen=True)
class Context:
    """What a decision depends on besides the probe, read once per evaluation."""

    vllm: versions.Installed | None
    speculators: versions.Installed | None
    disabled: frozenset[str]
    #: the validated release covering the installed vLLM and transformers
    #: (a :class:`~speculators_compat.check.validation.Release`; None: none covers it)
    record: Any = None
    #: a validation run of the test matrix: unrecorded releases are let through (never for real work)
    recording: bool = False
    #: every vLLM release validated with the installed speculators line (named in refusals)
    validated: tuple[str, ...] = ()
    transformers: versions.Installed | None = None
    #: the validation evidence of the installed speculators line
    #: (a :class:`~speculators_compat.check.validation.Evidence`)
    evidence: Any = None
    #: ``SPECULATORS_COMPAT_UNVALIDATED=self-check``: a release no validation run covers runs
    #: under the self-check (never covered; shapes are still checked)
    unvalidated: bool = False


#: where the validation evidence comes from: ``[source]``, ``source(speculators release, table)``
#: (set by :func:`wire_evidence`: ``speculators_compat/__init__.py`` wires
#: :func:`speculators_compat.check.validation.evidence`)
_EVIDENCE: list[Callable[[Any, dict | None], Any]] = []


def wire_evidence(source: Callable[[Any, dict | None], Any]) -> None:
    """Read the validation evidence of a speculators release from ``source(release, table)``."""
    _EVIDENCE[:] = [source]


def context(vllm: versions.Installed | None = None, table: dict | None = None) -> Context:
    """What decisions depend on, for the installed vLLM (or ``vllm``: e.g. an unpacked wheel
    that ``check --vllm-root`` judges); ``table``: a validation table instead of ``supported.json``."""
    vllm = vllm or versions.vllm()
    spec = versions.speculators()
    tf = versions.installed("transformers")
    ev = _EVIDENCE[0](spec.base, table) if spec and _EVIDENCE else None
    tf_version = tf.version if tf else None
    record = ev.covering(vllm.base, tf_version) if ev and vllm else None
    validated = tuple(r.vllm for r in ev.releases()) if ev else ()
    return Context(vllm, spec, _env.disabled(), record, _env.record_dir() is not None, validated, tf, ev,
                   _env.unvalidated_self_check())


def evaluate(patch: Patch, module: ModuleType | None, view: Any = None, ctx: Context | None = None,
             judge: Callable[[], Probe] | None = None) -> Decision:
    """Decide whether ``patch`` applies to the installed versions and to ``module``.

    With ``view`` (a :class:`~speculators_compat.check.sources.StaticView`) and no module, the
    patch's static probe reads the installed sources instead (nothing is imported). ``judge``
    replaces the probe (an engine check of :mod:`speculators_compat.core.preflight` judges what the
    patches decided). A disabled patch is probed too: whether its delta is present decides the
    verdict."""
    ctx = ctx or context()
    disabled = "all" in ctx.disabled or patch.id in ctx.disabled
    early = _gate(patch, ctx)
    if early is not None and (early.needed is False or not patch.kind.required):
        return _disabled(early) if disabled else early
    if module is None and view is None:
        if disabled:
            return Decision(patch, Status.DISABLED, f"disabled by {DISABLE_ENV}")
        return Decision(patch, Status.PENDING, f"{patch.target} not imported yet")
    probe = _probe(patch, module, view, judge)
    if disabled:
        found = "delta absent" if probe.shape is Shape.OLD else "its delta is present"
        return Decision(patch, Status.DISABLED, f"disabled by {DISABLE_ENV} ({found}: {probe.evidence})",
                        needed=probe.shape is not Shape.OLD)
    if early is not None:  # a repair outside the releases it was written for
        if probe.shape is Shape.OLD:
            return Decision(patch, Status.NOT_NEEDED, f"delta absent: {probe.evidence}", needed=False)
        evidence = (f"the delta is present ({probe.evidence}) on vLLM {ctx.vllm.base}, outside the releases "
                    f"this patch is written for ({patch.vllm})")
        return Decision(patch, Status.REFUSED, refusal(patch, ctx, evidence, Cause.UNKNOWN_SHAPE),
                        Cause.UNKNOWN_SHAPE, needed=True)
    if probe.shape is Shape.OLD:
        return Decision(patch, Status.NOT_NEEDED, f"delta absent: {probe.evidence}", needed=False)
    if probe.shape is Shape.UNKNOWN:
        cause = probe.cause or Cause.UNKNOWN_SHAPE
        return Decision(patch, Status.REFUSED, refusal(patch, ctx, probe.evidence, cause), cause, needed=True)
    return _validated(patch, ctx, probe)


def _disabled(decision: Decision) -> Decision:
    return Decision(decision.patch, Status.DISABLED, f"disabled by {DISABLE_ENV} ({decision.reason})",
                    needed=False)


def _gate(patch: Patch, ctx: Context) -> Decision | None:
    """The decisions that need no probe: nothing installed, another variant's release, a release
    the patch is not written for (``needed`` None there: a repair is probed all the same)."""
    if ctx.speculators is None:
        return Decision(patch, Status.NOT_NEEDED, "speculators is not installed", needed=False)
    if not versions.in_range(ctx.speculators, patch.speculators):
        return Decision(
            patch, Status.NOT_NEEDED, f"speculators {ctx.speculators.version} is outside {patch.speculators}",
            needed=False,
        )
    if ctx.vllm is None:
        return Decision(patch, Status.NOT_NEEDED, "vLLM is not installed", needed=False)
    if patch.vllm and not versions.in_range(ctx.vllm, patch.vllm):
        if patch.family != patch.id:
            return Decision(patch, Status.NOT_NEEDED, f"written for vLLM {patch.vllm}; another variant of "
                            f"{patch.family!r} serves {ctx.vllm.base}", needed=False)
        return Decision(patch, Status.NOT_NEEDED, f"written for vLLM {patch.vllm}, not for {ctx.vllm.base}")
    return None


def _probe(patch: Patch, module, view, judge: Callable[[], Probe] | None = None) -> Probe:
    try:
        if judge is not None:
            return judge()
        if module is not None:
            return patch.probe(module)
        if patch.static_probe is not None:
            return patch.static_probe(view)
        return Probe.unknown("no static probe for this patch: run the check with --deep")
    except (ImportError, AttributeError, TypeError, ValueError, OSError, LookupError) as exc:
        return Probe.unknown(f"probe failed: {type(exc).__name__}: {exc}")


def _not_validated(patch: Patch, ctx: Context) -> list[str]:
    """Why the validation table does not vouch for ``patch`` here (empty: it does)."""
    why = []
    ev = ctx.evidence
    for dependency in patch.depends_on:
        if dependency == "vllm":
            rec = ctx.record
            if rec is None and ctx.unvalidated:
                continue  # the opt-in: this release runs under the self-check (the verdict says NO)
            if rec is None:
                why.append(uncovered_release(ctx))
            elif rec.vllm not in ev.patch_releases(patch.id):
                why.append(f"no validation run applied it on vLLM {rec.vllm}, the release that covers "
                           f"vLLM {ctx.vllm.base}")
        elif dependency == "transformers":
            tf = ctx.transformers.version if ctx.transformers else None
            if ev is None or ev.transformers_covering(patch.id, tf) is None:
                seen = ev.patch_transformers(patch.id) if ev else []
                pin = _transformers_pin(ctx, seen)
                why.append(f"no validation run applied it on transformers {_line(tf) if tf else '(not installed)'}"
                           + (f" (validated on transformers {', '.join(seen)})" if seen else "")
                           + (f"; pin transformers=={pin}" if pin else ""))
    return why


def validated_here(patch: Patch, ctx: Context) -> bool:
    """Whether the validation table vouches for ``patch`` on the installed releases (a validation
    run vouches for what it records; a vLLM release no run covers, for nothing that depends on it).
    For a patch whose runtime choice rests on another's validation."""
    if ctx.recording:
        return True
    if "vllm" in patch.depends_on and ctx.record is None:
        return False
    return not _not_validated(patch, ctx)


def _line(version) -> str:
    return f"{version.major}.{version.minor}"


def _transformers_pin(ctx: Context, seen: list[str]) -> str | None:
    """The transformers release to pin: one the covering vLLM release was validated with, and on
    which the patch was validated (else the newest that validated the patch)."""
    rec = ctx.record
    both = [t for t in (rec.transformers if rec else ()) if t in seen]
    return (both or seen or [None])[-1]


def uncovered_release(ctx: Context) -> str:
    """Why no validated release covers the installed vLLM (and what to pin)."""
    vllm, spec = ctx.vllm.base, ctx.speculators.base
    tf = ctx.transformers.version if ctx.transformers else None
    other = ctx.evidence.line_without_transformers(vllm, tf) if ctx.evidence else None
    if other is not None:
        return (f"vLLM {other.vllm} was validated with transformers {', '.join(other.transformers)} only, not on "
                f"transformers {tf.major}.x (installed: {tf}); pin transformers=={other.transformers[-1]}")
    return (f"no release of the vLLM {_line(vllm)} line was validated with speculators {_line(spec)}")


def _validated(patch: Patch, ctx: Context, probe: Probe) -> Decision:
    if not patch.depends_on:
        return Decision(patch, Status.APPLIES, f"{probe.evidence}; does not depend on the vLLM or transformers "
                        "release", needed=True)
    if ctx.recording:
        return Decision(patch, Status.APPLIES, f"{probe.evidence}; recording a validation run", needed=True)
    why = _not_validated(patch, ctx)
    if not why:
        where = []
        if "vllm" in patch.depends_on and ctx.record is None:
            where.append(f"no vLLM release (running under {_env.UNVALIDATED}={_env.UNVALIDATED_SELF_CHECK})")
        elif "vllm" in patch.depends_on:
            where.append(f"vLLM {ctx.record.vllm} ({', '.join(ctx.record.platforms)})")
        if "transformers" in patch.depends_on:
            where.append(f"transformers {ctx.evidence.transformers_covering(patch.id, ctx.transformers.version)}")
        return Decision(patch, Status.APPLIES, f"{probe.evidence}; validated on {' and '.join(where)}", needed=True)
    if not patch.kind.required:
        return Decision(patch, Status.LEFT_OFF, f"not validated here: {'; '.join(why)} ({probe.evidence})",
                        needed=True)
    evidence = f"the API shape matches ({probe.evidence}), but {'; '.join(why)}"
    return Decision(patch, Status.REFUSED, refusal(patch, ctx, evidence, Cause.NOT_VALIDATED), Cause.NOT_VALIDATED,
                    needed=True)


def evaluate_all(patches: list[Patch], module: ModuleType | None = None, view: Any = None,
                 ctx: Context | None = None) -> list[Decision]:
    """The decisions for ``patches`` (one target, or all of them), in order (the engine checks
    that follow them: :func:`speculators_compat.core.preflight.evaluate_all`)."""
    ctx = ctx or context()
    return [evaluate(patch, module, view, ctx) for patch in patches]


def refusal(patch: Patch, ctx: Context, evidence: str, cause: Cause) -> str:
    """The one message of a refusal: the patch, the API, what was found, the install, what to do."""
    installed = f"{ctx.vllm}" if ctx.vllm else "no vLLM"
    if cause is Cause.APPLY_FAILED:
        todo = "report this to speculators_compat"
    elif ctx.validated and ctx.speculators:
        spec = ctx.speculators.base
        todo = (
            f"pin vLLM to a release speculators_compat validated with speculators {spec.major}.{spec.minor} "
            f"({', '.join(ctx.validated)}), or upgrade speculators_compat"
        )
    else:
        todo = "upgrade speculators_compat"
    return (
        f"[{patch.id}] {patch.api or patch.delta}: {evidence}. Installed: {installed}. What to do: {todo}; "
        f"{DISABLE_ENV}={patch.id} runs the stock code without this patch at your own risk."
    )
