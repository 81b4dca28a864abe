"""The declarative patch registry and the decision each patch gets.

Every patch is one :class:`Patch`: which module's import triggers it, the vLLM API delta it
answers (old -> new), a feature probe that inspects the real target (and a static twin that
reads the installed sources), how it applies (through a :class:`Patcher`, which records how to
undo it), the upstream reference and when it can be removed.

Three questions, three sources of truth:

* *Is the delta there?* -- the probe: ``Shape.OLD`` (stock code works as written), ``NEW`` (the
  shape this patch repairs) or ``UNKNOWN`` (neither: refuse).
* *Was this patch validated on the installed release?* -- data, not code: the record of the test
  matrix (:mod:`speculators_compat.validation`) that covers the installed vLLM. A release of a line
  nobody validated is covered by no record: the library's ceiling.
* *Which implementation?* -- a patch may have *variants* (``family``): each variant declares the
  vLLM range it implements (``vllm``), and outside it is ``not needed (superseded)``.

============================  =============================================================
probe / record says           status
============================  =============================================================
disabled by the user          ``disabled``
outside the patch's range     ``not needed`` (another variant of its family serves that release,
                              or the patch was written for newer releases only)
old shape                     ``not needed`` -- whatever the version says
unknown shape                 ``refused`` (cause ``UNKNOWN_SHAPE``) with the API and what to do
new shape, validated          ``applies``
new shape, not validated      a repair (delta, fix, platform): ``refused`` (``NOT_VALIDATED``);
                              a guard or feature: ``not needed`` (left off, stock behaviour)
============================  =============================================================

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
    "DISABLE_ENV",
]

DISABLE_ENV = _env.DISABLE


class Side(str, enum.Enum):
    DRIVER = "driver"  # the generator's process
    WORKER = "worker"  # every vLLM worker process


class Kind(str, enum.Enum):
    DELTA = "delta"  # repairs a vLLM API change the stock code trips on
    FIX = "fix"  # repairs a stock-code bug that gives wrong data on some releases
    PLATFORM = "platform"  # makes the stock code (or vLLM) correct on one platform
    GUARD = "guard"  # the library's own checks (input, output, API shapes, calls)
    FEATURE = "feature"  # an option or improvement the stock code does not have

    @property
    def required(self) -> bool:
        """A repair is needed for correct data where its delta is present: unvalidated, it refuses.
        A guard or feature is not: unvalidated, it is left off (the stock code runs as written)."""
        return self in (Kind.DELTA, Kind.FIX, Kind.PLATFORM)


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
    NOT_NEEDED = "not needed"
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
            "status": self.status.value,
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
    #: the vLLM releases this *variant* implements (empty: every release; the probe decides)
    vllm: str = ""
    #: variants of one repair share a family; outside its range a variant is superseded
    family: str = ""
    #: ids of the patches of the same target this one applies after (and so wraps)
    after: tuple[str, ...] = ()
    upstream: str = ""
    remove_when: str = ""
    #: the API named in a refusal
    api: str = ""
    #: ``static_probe(view) -> Probe``: the same judgement from the installed sources
    #: (a :class:`speculators_compat.sources.StaticView`), for the fast ``check``
    static_probe: Callable[[Any], Probe] | None = None
    #: how this patch changes the stock calls into vLLM (checked to bind at preflight)
    calls: dict[str, Edit] = field(default_factory=dict)
    #: a preflight check: its probe also gets the decisions taken before it
    #: (``probe(module_or_view, decisions)``)
    preflight: bool = False

    def __post_init__(self) -> None:
        if not self.family:
            object.__setattr__(self, "family", self.id)
        object.__setattr__(self, "after", tuple(self.after))
        object.__setattr__(self, "side", Side(self.side))
        object.__setattr__(self, "kind", Kind(self.kind))

    def __hash__(self) -> int:
        return hash(self.id)


@dataclass(frozen=True)
class Context:
    """What a decision depends on besides the probe, read once per evaluation."""

    vllm: versions.Installed | None
    speculators: versions.Installed | None
    disabled: frozenset[str]
    #: the validation record covering the installed vLLM (None: no release of its line validated)
    record: Any = None
    #: a validation run of the test matrix: unrecorded releases are let through (never for real work)
    recording: bool = False
    #: every vLLM release validated with the installed speculators line (named in refusals)
    validated: tuple[str, ...] = ()


def context(vllm: versions.Installed | None = None) -> Context:
    """What decisions depend on, for the installed vLLM (or ``vllm``: e.g. an unpacked wheel
    that ``check --vllm-root`` judges)."""
    from . import validation

    vllm = vllm or versions.vllm()
    spec = versions.speculators()
    record = validation.covering(vllm.base, spec.base) if vllm and spec else None
    validated = tuple(validation.validated_lines(spec.base)) if spec else ()
    return Context(vllm, spec, _env.disabled(), record, _env.record_dir() is not None, validated)


def evaluate(patch: Patch, module: ModuleType | None, view: Any = None, ctx: Context | None = None,
             prior: list[Decision] | None = None) -> Decision:
    """Decide whether ``patch`` applies to the installed versions and to ``module``.

    With ``view`` (a :class:`~speculators_compat.sources.StaticView`) and no module, the
    patch's static probe reads the installed sources instead (nothing is imported). ``prior``
    holds the decisions already taken for the same target (what a preflight check looks at)."""
    ctx = ctx or context()
    early = _gate(patch, ctx)
    if early is not None:
        return early
    if module is None and view is None:
        return Decision(patch, Status.PENDING, f"{patch.target} not imported yet")
    probe = _probe(patch, module, view, prior or [])
    if probe.shape is Shape.OLD:
        return Decision(patch, Status.NOT_NEEDED, f"delta absent: {probe.evidence}")
    if probe.shape is Shape.UNKNOWN:
        cause = probe.cause or Cause.UNKNOWN_SHAPE
        return Decision(patch, Status.REFUSED, refusal(patch, ctx, probe.evidence, cause), cause)
    return _validated(patch, ctx, probe)


def _gate(patch: Patch, ctx: Context) -> Decision | None:
    """The decisions that need no probe: disabled, nothing installed, another variant's range."""
    if "all" in ctx.disabled or patch.id in ctx.disabled:
        return Decision(patch, Status.DISABLED, f"disabled by {DISABLE_ENV}")
    if ctx.speculators is None:
        return Decision(patch, Status.NOT_NEEDED, "speculators is not installed")
    if not versions.in_range(ctx.speculators, patch.speculators):
        return Decision(
            patch, Status.NOT_NEEDED, f"speculators {ctx.speculators.version} is outside {patch.speculators}"
        )
    if ctx.vllm is None:
        return Decision(patch, Status.NOT_NEEDED, "vLLM is not installed")
    if patch.vllm and not versions.in_range(ctx.vllm, patch.vllm):
        variant = f" (a variant of {patch.family!r})" if patch.family != patch.id else ""
        return Decision(
            patch, Status.NOT_NEEDED, f"implemented for vLLM {patch.vllm}{variant}, not for {ctx.vllm.base}"
        )
    return None


def _probe(patch: Patch, module, view, prior: list[Decision]) -> Probe:
    try:
        if patch.preflight:
            return patch.probe(module, prior) if module is not None else patch.static_probe(view, prior)
        if module is not None:
            return patch.probe(module)
        if patch.static_probe is not None:
            return patch.static_probe(view)
        return Probe.unknown("no static probe for this patch: run the check with --deep")
    except (ImportError, AttributeError, TypeError, ValueError, OSError, LookupError) as exc:
        return Probe.unknown(f"probe failed: {type(exc).__name__}: {exc}")


def _validated(patch: Patch, ctx: Context, probe: Probe) -> Decision:
    record = ctx.record
    if record is not None and patch.id in record.applied:
        where = f"validated on vLLM {record.vllm} ({', '.join(record.platforms)})"
        return Decision(patch, Status.APPLIES, f"{probe.evidence}; {where}")
    if ctx.recording:
        return Decision(patch, Status.APPLIES, f"{probe.evidence}; recording a validation run")
    where = (
        f"the validation record of vLLM {record.vllm} does not list it"
        if record is not None
        else f"no release of the vLLM {ctx.vllm.base.major}.{ctx.vllm.base.minor} line was validated "
        f"with speculators {ctx.speculators.base.major}.{ctx.speculators.base.minor}"
    )
    if not patch.kind.required:
        return Decision(patch, Status.NOT_NEEDED, f"left off: {probe.evidence}, but {where}")
    evidence = f"the API shape matches ({probe.evidence}), but {where}"
    return Decision(patch, Status.REFUSED, refusal(patch, ctx, evidence, Cause.NOT_VALIDATED), Cause.NOT_VALIDATED)


def evaluate_all(patches: list[Patch], module: ModuleType | None = None, view: Any = None,
                 ctx: Context | None = None) -> list[Decision]:
    """The decisions for ``patches`` (one target, or all of them for the check), in order; a
    preflight check sees the decisions taken before it."""
    ctx = ctx or context()
    out: list[Decision] = []
    for patch in patches:
        out.append(evaluate(patch, module, view, ctx, out))
    return out


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


@dataclass
class Patcher:
    """Applies wrappers and remembers how to undo them (last in, first out)."""

    #: (owner, name, original, own, item): ``item`` marks a mapping entry (``owner[name]``)
    records: list[tuple[Any, Any, Any, bool, bool]] = field(default_factory=list)

    def wrap(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Replace ``owner.name`` by a ``wrapt.FunctionWrapper`` around it.

        ``name`` may be dotted (``"Class.method"``); an inherited attribute is wrapped where it is
        looked up (on ``owner``), and undone by deleting that override, as wrapt's
        ``resolve_path`` + ``apply_patch`` would."""
        import wrapt

        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        own = attr in vars(owner)
        original = vars(owner)[attr] if own else getattr(owner, attr)
        setattr(owner, attr, wrapt.FunctionWrapper(original, wrapper))
        self.records.append((owner, attr, original, own, False))

    def define(self, owner: Any, name: str, value: Any) -> None:
        """Bind a name ``owner`` does not have yet (e.g. a module global); undo deletes it again."""
        if name in vars(owner):
            raise ValueError(f"{getattr(owner, '__name__', owner)!s} already defines {name!r}")
        setattr(owner, name, value)
        self.records.append((owner, name, None, False, False))

    def set_item(self, mapping: Any, key: Any, value: Any) -> None:
        """Replace the existing entry ``mapping[key]`` (e.g. a module-level dispatch table);
        undo puts the original value back."""
        original = mapping[key]  # KeyError: nothing to replace, nothing is changed
        mapping[key] = value
        self.records.append((mapping, key, original, True, True))

    def undo(self) -> None:
        while self.records:
            owner, name, original, own, item = self.records.pop()
            if item:
                owner[name] = original
            elif own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
