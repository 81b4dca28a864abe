"""The declarative patch registry and the decision each patch gets.

Every patch is one :class:`Patch`: which module's import triggers it, the vLLM API delta
it answers (old -> new), the vLLM and speculators ranges it was validated on, a feature
probe that inspects the real target, how it applies (through a :class:`Patcher`, which
records how to undo it), the upstream reference and when it can be removed.

The decision for one patch, given the installed versions and the probe:

============================  =============================================================
probe says                    status
============================  =============================================================
old shape (delta absent)      ``not needed`` -- whatever the version says
new shape, version validated  ``applies``
new shape, version below      ``not needed`` (the stock code is left as written there)
new shape, version above      ``refused`` (the shape matches but nobody validated it there)
unknown shape                 ``refused`` with the API, expected vs found, and what to do
============================  =============================================================

Versions are compared on their base release (``0.16.1.dev3+g1`` -> ``0.16.1``), so a
nightly of a validated release line is covered and ``0.17.0.dev3`` is not silently
treated as ``<0.17`` or ``>=0.17``: it is judged as 0.17.0, and refused if the probes do
not match what the registry knows.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from . import versions

__all__ = [
    "Shape",
    "Probe",
    "Status",
    "Decision",
    "Patch",
    "Patcher",
    "evaluate",
    "disabled_ids",
    "DISABLE_ENV",
]

DISABLE_ENV = "SPECULATORS_COMPAT_DISABLE"

#: kinds that add something (a guard, an option, a log line) rather than repair a delta: below
#: their validated range they are simply not applied; a repair whose new API shape is found
#: below its range is refused (the delta exists, the patch was not validated there)
OPTIONAL_KINDS = frozenset({"guard", "feature"})


class Shape(enum.Enum):
    NEW = "new"  # the delta is present and the target has the expected new shape
    OLD = "old"  # the delta is absent: stock code works as written
    UNKNOWN = "unknown"  # neither: refuse


@dataclass(frozen=True)
class Probe:
    shape: Shape
    evidence: str

    @classmethod
    def new(cls, evidence: str) -> "Probe":
        return cls(Shape.NEW, evidence)

    @classmethod
    def old(cls, evidence: str) -> "Probe":
        return cls(Shape.OLD, evidence)

    @classmethod
    def unknown(cls, evidence: str) -> "Probe":
        return cls(Shape.UNKNOWN, evidence)


class Status(str, enum.Enum):
    APPLIES = "applies"
    NOT_NEEDED = "not needed"
    REFUSED = "refused"
    DISABLED = "disabled"
    PENDING = "pending"  # its target module has not been imported in this process


@dataclass(frozen=True)
class Decision:
    patch: "Patch"
    status: Status
    reason: str

    def as_dict(self) -> dict[str, Any]:
        p = self.patch
        return {
            "id": p.id,
            "title": p.title,
            "side": p.side,
            "kind": p.kind,
            "delta": p.delta,
            "target": p.target,
            "vllm_validated": p.vllm,
            "speculators": p.speculators,
            "status": self.status.value,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Patch:
    """One patch: one vLLM API delta (``kind="delta"``) or one guard (``kind="guard"``)."""

    id: str
    title: str
    #: the API that changed, as ``old -> new``
    delta: str
    #: ``"driver"`` (the generator process) or ``"worker"`` (every vLLM worker process)
    side: str
    #: module whose import triggers the patch
    target: str
    #: vLLM releases (base versions) this patch was validated on
    vllm: str
    #: speculators releases this patch is for
    speculators: str
    #: ``probe(module) -> Probe``: inspects the real target
    probe: Callable[[ModuleType], Probe]
    #: ``apply(module, patcher)``: installs the patch through the patcher
    apply: Callable[[ModuleType, "Patcher"], None]
    upstream: str = ""
    remove_when: str = ""
    kind: str = "delta"
    #: the API named in a refusal
    api: str = ""
    #: ``static_probe(view) -> Probe``: the same judgement from the installed sources
    #: (a :class:`speculators_compat.sources.StaticView`), for the fast ``check``
    static_probe: Callable[[Any], Probe] | None = None

    def __hash__(self) -> int:
        return hash(self.id)


def disabled_ids() -> set[str]:
    """Patch ids disabled through ``SPECULATORS_COMPAT_DISABLE`` (``all`` or ``*`` = every patch)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return {part.strip() for part in raw.replace(";", ",").split(",") if part.strip()}


def _is_disabled(patch: Patch) -> bool:
    ids = disabled_ids()
    return bool(ids & {"all", "*", "1", patch.id})


def evaluate(patch: Patch, module: ModuleType | None, view: Any = None) -> Decision:
    """Decide whether ``patch`` applies to the installed versions and to ``module``.

    With ``view`` (a :class:`~speculators_compat.sources.StaticView`) and no module, the
    patch's static probe reads the installed sources instead (nothing is imported)."""
    if _is_disabled(patch):
        return Decision(patch, Status.DISABLED, f"disabled by {DISABLE_ENV}")
    spec = versions.speculators()
    if spec is None:
        return Decision(patch, Status.NOT_NEEDED, "speculators is not installed")
    if not versions.in_range(spec, patch.speculators):
        return Decision(
            patch,
            Status.NOT_NEEDED,
            f"speculators {spec.version} is outside the affected range {patch.speculators}",
        )
    vllm = versions.vllm()
    if vllm is None:
        return Decision(patch, Status.NOT_NEEDED, "vLLM is not installed")
    if module is None and view is None:
        return Decision(patch, Status.PENDING, f"{patch.target} not imported yet")
    try:
        if module is not None:
            probe = patch.probe(module)
        elif patch.static_probe is not None:
            probe = patch.static_probe(view)
        else:
            probe = Probe.unknown("no static probe for this patch: run the check with --deep")
    except (ImportError, AttributeError, TypeError, ValueError, OSError, LookupError) as exc:
        probe = Probe.unknown(f"probe failed: {type(exc).__name__}: {exc}")
    if probe.shape is Shape.OLD:
        return Decision(patch, Status.NOT_NEEDED, f"delta absent: {probe.evidence}")
    if probe.shape is Shape.UNKNOWN:
        return Decision(patch, Status.REFUSED, _refusal(patch, vllm, probe.evidence))
    if versions.below_range(vllm, patch.vllm):
        if patch.kind in OPTIONAL_KINDS:
            return Decision(
                patch,
                Status.NOT_NEEDED,
                f"{vllm} predates the releases this {patch.kind} is for ({patch.vllm}); probe: {probe.evidence}",
            )
        # the newer API shape on an older release: the delta is there, but unvalidated
        return Decision(
            patch,
            Status.REFUSED,
            _refusal(
                patch,
                vllm,
                f"the API shape matches ({probe.evidence}), but {vllm} (base {vllm.base}) is "
                f"older than the releases this patch was validated on ({patch.vllm})",
            ),
        )
    if not versions.in_range(vllm, patch.vllm):
        return Decision(
            patch,
            Status.REFUSED,
            _refusal(
                patch,
                vllm,
                f"the API shape matches ({probe.evidence}), but {vllm} (base {vllm.base}) is "
                f"outside the releases this patch was validated on ({patch.vllm})",
            ),
        )
    return Decision(patch, Status.APPLIES, probe.evidence)


def _refusal(patch: Patch, vllm: versions.Installed, evidence: str) -> str:
    return (
        f"[{patch.id}] {patch.api or patch.delta}: {evidence}. Installed: {vllm}. "
        f"speculators_compat knows this API only for vLLM {patch.vllm}: pin vLLM to such a "
        f"release, or upgrade speculators_compat; {DISABLE_ENV}={patch.id} runs the stock "
        f"code unpatched at your own risk."
    )


@dataclass
class Patcher:
    """Applies wrappers and remembers how to undo them (last in, first out)."""

    records: list[tuple[Any, str, Any, bool]] = field(default_factory=list)

    def wrap(self, owner: Any, name: str, wrapper: Callable[..., Any]) -> None:
        """Replace ``owner.name`` by a ``wrapt.FunctionWrapper`` around it."""
        import wrapt

        own = name in vars(owner)
        original = vars(owner)[name] if own else getattr(owner, name)
        setattr(owner, name, wrapt.FunctionWrapper(original, wrapper))
        self.records.append((owner, name, original, own))

    def undo(self) -> None:
        while self.records:
            owner, name, original, own = self.records.pop()
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
