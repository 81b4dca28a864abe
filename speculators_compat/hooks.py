"""Post-import hooks and the applied-patch state of this process.

``install()`` registers one ``wrapt`` post-import hook per target module; the hook fires
when the target is imported, or at once if it already is, so ``import speculators_compat``
may come before or after speculators and vLLM. Applying is idempotent (a patch applied
once is never applied again) and reversible (``revert()``). Nothing here imports torch or
vLLM: the patches import what they need when their target is imported.

Registration is deferred: until the package that holds every target (``speculators``) is
imported, ``install()`` only puts a small finder on ``sys.meta_path`` that never finds
anything; on the first import of ``speculators`` it loads the registry and wrapt and
registers the real hooks, before any target module can load. ``import speculators_compat``
therefore costs neither wrapt nor the patch modules (issue #7).
"""

from __future__ import annotations

import sys
import threading

from ._log import logger

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing alone costs ~4 ms
if TYPE_CHECKING:  # the registry (dataclasses, enum) loads with the hooks, not at import
    from types import ModuleType

    from .registry import Decision, Patch, Patcher

__all__ = ["install", "apply", "revert", "status", "applied_ids"]


_lock = threading.RLock()
_hooked: set[str] = set()
_active = True
_applied: dict[str, Patcher] = {}
_order: list[str] = []
_refusals: dict[str, Patcher] = {}
_decisions: dict[str, Decision] = {}
_suppressed: set[str] = set()


def _registry() -> list[Patch]:
    try:
        from .patches import REGISTRY
    except ModuleNotFoundError as exc:
        if exc.name != "speculators_compat.patches":
            raise
        raise ImportError(
            "speculators_compat.patches is missing: this speculators_compat was imported from a "
            "source checkout (its patches/ folder is installed as speculators_compat.patches). "
            "Install the package (pip install -e .) and run from outside the checkout root."
        ) from exc
    return REGISTRY


def _targets() -> list[str]:
    seen: list[str] = []
    for patch in _registry():
        if patch.target not in seen:
            seen.append(patch.target)
    return seen


#: the package every patch target lives in (checked by the unit tests): the hooks are
#: registered when it is first imported
TRIGGER = "speculators"


class _DeferredHooks:
    """A ``sys.meta_path`` finder that finds nothing: it registers the post-import hooks when
    ``TRIGGER`` is first looked up, then stays inert (it is never removed from
    ``sys.meta_path`` while the import system may be iterating over it)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ARG002 (finder protocol)
        if fullname == TRIGGER:
            _register_hooks()
        return None

    def invalidate_caches(self) -> None:
        pass


_deferred = _DeferredHooks()


def install() -> None:
    """Register the post-import hooks (once per target module and process).

    If ``speculators`` is not imported yet, this only arms the deferred finder (no wrapt,
    no registry import); otherwise the hooks are registered at once.
    """
    global _active
    with _lock:
        _active = True
        if TRIGGER in sys.modules or _hooked:
            _register_hooks()
        elif _deferred not in sys.meta_path:
            sys.meta_path.insert(0, _deferred)


def _register_hooks() -> None:
    import wrapt

    logger()  # the library's logger gets its NullHandler (or the verbose handler) now

    with _lock:
        for target in _targets():
            if target not in _hooked:
                _hooked.add(target)
                wrapt.register_post_import_hook(_on_import, target)


def _on_import(module: ModuleType) -> None:
    if _active:
        apply_module(module)


def apply_module(module: ModuleType) -> list[Decision]:
    """Evaluate and apply every patch that targets ``module``; idempotent."""
    from . import versions
    from .registry import DISABLE_ENV, Decision, Patcher, Status, evaluate
    from .patches import ENTRY_POINTS

    name = module.__name__
    out: list[Decision] = []
    with _lock:
        for patch in _registry():
            if patch.target != name:
                continue
            if patch.id in _applied:
                out.append(_decisions[patch.id])
                continue
            decision = evaluate(patch, module)
            if patch.id in _suppressed and decision.status is Status.APPLIES:
                decision = Decision(patch, Status.DISABLED, "reverted by speculators_compat.revert()")
            _decisions[patch.id] = decision
            out.append(decision)
            if decision.status is Status.APPLIES:
                patcher = Patcher()
                try:
                    patch.apply(module, patcher)
                except (AttributeError, TypeError, ValueError, ImportError) as exc:
                    # the target is not what the probe let us believe: refuse, never half-patch
                    patcher.undo()
                    decision = Decision(
                        patch,
                        Status.REFUSED,
                        f"[{patch.id}] {patch.api or patch.delta}: applying failed "
                        f"({type(exc).__name__}: {exc}); installed: {versions.vllm()}. Report this "
                        f"to speculators_compat; {DISABLE_ENV}={patch.id} runs the stock code "
                        f"unpatched at your own risk.",
                    )
                    _decisions[patch.id] = decision
                    out[-1] = decision
                    logger().error("%s", decision.reason)
                    continue
                except BaseException:
                    patcher.undo()
                    raise
                _applied[patch.id] = patcher
                _order.append(patch.id)
                logger().debug("applied %s to %s: %s", patch.id, name, decision.reason)
            else:
                logger().debug("%s %s: %s", patch.id, decision.status.value, decision.reason)
        refused = [d for d in out if d.status is Status.REFUSED]
        if refused and name not in _refusals and name in ENTRY_POINTS:
            _refusals[name] = _install_refusal(module, ENTRY_POINTS[name], refused)
    return out


def _install_refusal(module: ModuleType, entry: tuple[str, str], refused: list[Decision]) -> Patcher:
    """Make the target's entry point raise before it does any heavy work."""
    from .errors import IncompatibleVllmError
    from .registry import Patcher

    cls_name, method = entry
    # an API whose shape is unknown comes first: it is what actually changed
    refused = sorted(refused, key=lambda d: "the API shape matches" in d.reason)
    message = "speculators_compat refuses to run: " + " | ".join(d.reason for d in refused)
    logger().error(message)

    def refuse(wrapped, instance, args, kwargs):
        raise IncompatibleVllmError(message)

    patcher = Patcher()
    owner = getattr(module, cls_name, None)
    if owner is not None and hasattr(owner, method):
        patcher.wrap(owner, method, refuse)
    return patcher


def apply() -> list[Decision]:
    """Install the hooks and apply to every target already imported."""
    global _active
    _active = True
    _register_hooks()
    out: list[Decision] = []
    for target in _targets():
        module = sys.modules.get(target)
        if module is not None:
            out.extend(apply_module(module))
    return out


def revert(ids: list[str] | None = None) -> None:
    """Undo patches (all of them by default). Reverted ids stay off until ``apply(reset=True)``.

    Wrappers are undone last-in first-out and the remaining patches re-applied, so reverting
    one patch in the middle of a stack leaves the others intact. Objects created while a
    patch was active (a running generator, its executor proxy) keep it.
    """
    global _active
    with _lock:
        if ids is None:
            _active = False
            _suppressed.clear()
        else:
            _suppressed.update(ids)
        for pid in reversed(_order):
            _applied.pop(pid).undo()
        _order.clear()
        for patcher in _refusals.values():
            patcher.undo()
        _refusals.clear()
        _decisions.clear()
    if ids is not None:
        apply()


def reset() -> None:
    """Revert everything and forget reverted ids; the next ``apply()`` starts afresh."""
    revert()
    _suppressed.clear()


def applied_ids() -> list[str]:
    with _lock:
        return list(_order)


def status(import_targets: bool = False) -> list[Decision]:
    """The decision for every registered patch.

    Patches whose target module is not imported are evaluated against it only when
    ``import_targets`` is true (which imports speculators and vLLM); otherwise they are
    reported as pending.
    """
    from .registry import Decision, Status, evaluate

    import importlib

    out = []
    for patch in _registry():
        with _lock:
            if patch.id in _decisions:
                out.append(_decisions[patch.id])
                continue
        module = sys.modules.get(patch.target)
        if module is None and import_targets:
            try:
                module = importlib.import_module(patch.target)
            except ImportError as exc:
                out.append(Decision(patch, Status.REFUSED, f"cannot import {patch.target}: {exc}"))
                continue
        with _lock:
            if patch.id in _decisions:  # the import above fired the hook
                out.append(_decisions[patch.id])
                continue
        out.append(evaluate(patch, module))
    return out
