"""Post-import hooks and the applied-patch state of this process.

``install()`` registers one ``wrapt`` post-import hook per target module; the hook fires
when the target is imported, or at once if it already is, so ``import speculators_compat``
may come before or after speculators and vLLM. Applying is idempotent (a patch applied
once is never applied again) and reversible (``revert()``). Nothing here imports torch or
vLLM: the patches import what they need when their target is imported.

The patches come from the registry passed to ``install()``: by default the patch set this
distribution ships (``PATCH_SET``, found by :mod:`speculators_compat.core.discovery`); where a
refusal stops a target is the engine's own policy (:mod:`speculators_compat.core.targets`).

Registration is deferred: until the package that holds every target (``speculators``) is
imported, ``install()`` only puts a small finder on ``sys.meta_path`` that never finds
anything; on the first import of ``speculators`` it loads the registry and wrapt and
registers the real hooks, before any target module can load. ``import speculators_compat``
therefore costs neither wrapt nor the patch modules.

Probes run outside the state lock (they may import vLLM modules, as wrapt runs its hooks
outside its own lock); only the bookkeeping and the wrapping happen under it.
"""

from __future__ import annotations

import sys
import threading

from . import children, targets
from ._log import logger

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing alone costs ~4 ms
if TYPE_CHECKING:  # the registry (dataclasses, enum) loads with the hooks, not at import
    from types import ModuleType

    from .registry import Decision, Patch, Patcher

__all__ = ["install", "apply", "revert", "reset", "status", "applied_ids", "patches", "TRIGGER", "PATCH_SET"]

#: the package every patch target lives in (checked by the unit tests): the hooks are
#: registered when it is first imported
TRIGGER = "speculators"
#: the patch set this distribution ships (``patches/``): the default registry, by name
PATCH_SET = targets.PATCH_SET


class _State:
    """Everything this process knows about its patches (one instance, under one lock)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.hooked: set[str] = set()  # targets with a registered post-import hook
        self.active = True  # False after revert(): hooks fire but apply nothing
        self.applied: dict[str, Patcher] = {}  # patch id -> how to undo it, in order applied
        self.refusals: dict[str, Patcher] = {}  # target -> the entry-point refusal wrapper
        self.undo: list[Patcher] = []  # every patcher above (patches and refusals), in order installed
        self.decisions: dict[str, Decision] = {}
        self.suppressed: set[str] = set()  # ids reverted one by one
        self.source: str | list = PATCH_SET  # the registry: a patch set's name, or the patches
        self.registry: list | None = None  # the patches of ``source``, in order, once loaded


_state = _State()


def patches() -> list[Patch]:
    """The registered patches, in the order they apply (the registry given to ``install()``)."""
    with _state.lock:
        source, registry = _state.source, _state.registry
    if registry is None:  # discovered outside the lock: it imports the patch modules
        if isinstance(source, str):
            from .discovery import discover

            registry = discover(source)
        else:
            registry = source
        with _state.lock:
            if _state.source is source:
                _state.registry = registry
    return registry


def _targets() -> list[str]:
    return list(dict.fromkeys(p.target for p in patches()))


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


def install(registry: str | list[Patch] | None = None) -> None:
    """Register the post-import hooks (once per target module and process).

    ``registry``: the patches to apply -- the name of a patch-set package (discovered when first
    needed; ``PATCH_SET`` unless another was given before) or a list of patches, in the order
    they apply. If ``speculators`` is not imported yet, this only arms the deferred finder (no
    wrapt, no registry import); otherwise the hooks are registered at once. The Python processes
    started from here on are armed too (:func:`speculators_compat.core.children.arm`: a process that
    multiprocessing spawns re-imports the script with the hooks armed).
    """
    with _state.lock:
        if registry is not None:
            _state.source, _state.registry = registry, None
        _state.active = True
        if TRIGGER in sys.modules or _state.hooked:
            _register_hooks()
        elif _deferred not in sys.meta_path:
            sys.meta_path.insert(0, _deferred)
    children.arm()


def _register_hooks() -> None:
    import wrapt

    logger()  # the library's logger gets its NullHandler (or the verbose handler) now
    with _state.lock:
        todo = [t for t in _targets() if t not in _state.hooked]
        _state.hooked.update(todo)
    for target in todo:  # wrapt may call the hook at once: outside our lock
        wrapt.register_post_import_hook(_on_import, target)


def _on_import(module: ModuleType) -> None:
    if _state.active:
        apply_module(module)


def apply_module(module: ModuleType) -> list[Decision]:
    """Evaluate and apply every patch that targets ``module``; idempotent."""
    from .registry import Cause, Decision, Patcher, Status, context, evaluate, refusal
    from .verdict import unknown_disabled, unknown_disabled_message

    name = module.__name__
    ctx = context()
    out: list[Decision] = []
    for patch in (p for p in patches() if p.target == name):
        with _state.lock:
            if patch.id in _state.applied:
                out.append(_state.decisions[patch.id])
                continue
        decision = evaluate(patch, module, ctx=ctx)
        if patch.id in _state.suppressed and decision.status is Status.APPLIES:
            decision = Decision(patch, Status.DISABLED, "reverted by speculators_compat.revert()")
        if decision.status is Status.APPLIES:
            with _state.lock:
                if patch.id in _state.applied:  # another thread applied it meanwhile
                    out.append(_state.decisions[patch.id])
                    continue
                patcher = Patcher()
                try:
                    patch.apply(module, patcher)
                except (AttributeError, TypeError, ValueError, ImportError) as exc:
                    # the target is not what the probe let us believe: refuse, never half-patch
                    patcher.undo()
                    evidence = f"applying failed ({type(exc).__name__}: {exc})"
                    decision = Decision(patch, Status.REFUSED, refusal(patch, ctx, evidence, Cause.APPLY_FAILED),
                                        Cause.APPLY_FAILED)
                except BaseException:
                    patcher.undo()
                    raise
                else:
                    _state.applied[patch.id] = patcher
                    _state.undo.append(patcher)
                    logger().debug("applied %s to %s: %s", patch.id, name, decision.reason)
        if decision.status is not Status.APPLIES:
            log = logger().error if decision.status is Status.REFUSED else logger().debug
            log("%s %s: %s", patch.id, decision.status.value, decision.reason)
        with _state.lock:
            _state.decisions[patch.id] = decision
        out.append(decision)
    out += _run_checks(module, ctx, out)
    refused = [d for d in out if d.status is Status.REFUSED]
    message = refusal_message(refused) if refused else ""
    opt_in = [d for d in out if d.patch.id in _unvalidated_requires(name)
              and d.status is not Status.APPLIES] if ctx.unvalidated and ctx.record is None else []
    if opt_in:  # the self-check opt-in without the self-check would run an unvalidated release blind
        message = " | ".join(filter(None, [message or "speculators_compat refuses to run", *(
            f"[{d.patch.id}] SPECULATORS_COMPAT_UNVALIDATED=self-check runs vLLM {ctx.vllm.base} only under the "
            f"self-check, which does not apply here ({d.status.value}: {d.reason})" for d in opt_in)]))
    configuration = False
    if name in targets.ENTRY_POINTS:
        known = known_ids()
        unknown = unknown_disabled(known)
        if unknown:  # a misspelt id would leave on what the user meant to turn off: a configuration error
            configuration = True
            message = " | ".join(filter(None, [unknown_disabled_message(unknown, known), message]))
    with _state.lock:
        if message and name not in _state.refusals and name in targets.ENTRY_POINTS:
            _state.refusals[name] = _install_refusal(module, targets.ENTRY_POINTS[name], message, configuration)
            _state.undo.append(_state.refusals[name])
    if refused and name in targets.REFUSE_AT_IMPORT:
        # an import-time target (speculators.utils on transformers v5): without the patch the
        # import itself fails further on with a foreign traceback; fail it here, saying why
        from ..errors import IncompatibleVllmError

        raise IncompatibleVllmError(refusal_message(refused))
    return out


def _run_checks(module: ModuleType, ctx, decisions: list[Decision]) -> list[Decision]:
    """The engine checks of ``module``'s target (:mod:`speculators_compat.core.preflight`), after every
    patch of it (a passed check is listed with the applied patches)."""
    from . import preflight
    from .registry import Decision, Patcher, Status

    out = []
    for check in preflight.checks_of(module.__name__):
        with _state.lock:  # passed once: kept (as an applied patch is); else judged again
            known = _state.decisions.get(check.id) if check.id in _state.applied else None
        if known is None:
            known = preflight.evaluate(check, module, None, ctx, decisions)
            if check.id in _state.suppressed and known.status is Status.APPLIES:
                known = Decision(check, Status.DISABLED, "reverted by speculators_compat.revert()")
            if known.status is not Status.APPLIES:
                log = logger().error if known.status is Status.REFUSED else logger().debug
                log("%s %s: %s", check.id, known.status.value, known.reason)
            with _state.lock:
                _state.decisions[check.id] = known
                if known.status is Status.APPLIES:
                    _state.applied.setdefault(check.id, Patcher())
        out.append(known)
    return out


def known_ids() -> list[str]:
    """The ids ``SPECULATORS_COMPAT_DISABLE`` may name: the patches' and the engine checks'."""
    from . import preflight

    return [p.id for p in patches()] + preflight.ids()


def _unvalidated_requires(target: str) -> tuple[str, ...]:
    """The patches the patch set requires on ``target`` under the self-check opt-in (its
    ``UNVALIDATED_REQUIRES``; none for a registry given as a list)."""
    source = _state.source
    if not isinstance(source, str):
        return ()
    import importlib

    return tuple(getattr(importlib.import_module(source), targets.UNVALIDATED_REQUIRES, {}).get(target, ()))


def refusal_message(refused: list[Decision]) -> str:
    """One message for every refusal, what changed first (by cause), then the rest."""
    from .verdict import rank

    ranked = sorted(refused, key=rank)
    return ("speculators_compat refuses to run: " + " | ".join(d.reason for d in ranked)
            + " | `python -m speculators_compat.check --constraints` prints the nearest validated set of releases "
            "as pins for `pip install -c`")


def _install_refusal(module: ModuleType, entry: tuple[str, str], message: str,
                     configuration: bool = False) -> Patcher:
    """Make the target's entry point raise ``message`` before it does any heavy work: a
    ``ConfigurationError`` when ``configuration`` (the library's own settings are wrong), else
    ``IncompatibleVllmError``."""
    from ..errors import ConfigurationError, IncompatibleVllmError
    from .registry import Patcher

    cls_name, method = entry
    logger().error(message)
    error = ConfigurationError if configuration else IncompatibleVllmError

    def refuse(wrapped, instance, args, kwargs):
        raise error(message)

    patcher = Patcher()
    owner = getattr(module, cls_name, None)
    if owner is not None and hasattr(owner, method):
        patcher.wrap(owner, method, refuse)
    return patcher


def apply() -> list[Decision]:
    """Install the hooks and apply to every target already imported."""
    with _state.lock:
        _state.active = True
    _register_hooks()
    children.arm()
    out: list[Decision] = []
    for target in _targets():
        module = sys.modules.get(target)
        if module is not None:
            out.extend(apply_module(module))
    return out


def revert(ids: list[str] | None = None) -> None:
    """Undo patches (all of them by default); ``reset()`` forgets the ids reverted one by one.

    Wrappers are undone last-in first-out and the remaining patches re-applied, so reverting
    one patch in the middle of a stack leaves the others intact. Objects created while a
    patch was active (a running generator, its executor proxy) keep it. Reverting all also takes
    the start-up hook off ``PYTHONPATH`` (processes started afterwards are not armed).
    """
    if ids is None:
        children.disarm()
    with _state.lock:
        if ids is None:
            _state.active = False
            _state.suppressed.clear()
        else:
            _state.suppressed.update(ids)
        # last in, first out, refusals included: an entry point's refusal wraps what the patches
        # of its target wrapped before it, and a patch applied later wraps the refusal
        while _state.undo:
            _state.undo.pop().undo()
        _state.applied.clear()
        _state.refusals.clear()
        _state.decisions.clear()
    if ids is not None:
        apply()


def reset() -> None:
    """Revert everything and forget reverted ids; the next ``apply()`` starts afresh."""
    revert()
    with _state.lock:
        _state.suppressed.clear()


def applied_ids() -> list[str]:
    with _state.lock:
        return list(_state.applied)


def status(import_targets: bool = False) -> list[Decision]:
    """The decision for every registered patch, and for the engine checks of each target (after its
    patches).

    Patches whose target module is not imported are evaluated against it only when
    ``import_targets`` is true (which imports speculators and vLLM); otherwise they are
    reported as pending.
    """
    import importlib

    from . import preflight
    from .registry import Decision, Status, context, evaluate

    ctx = context()
    out: list[Decision] = []
    registry = patches()
    for target in dict.fromkeys(p.target for p in registry):
        mine: list[Decision] = []
        for patch in (p for p in registry if p.target == target):
            with _state.lock:
                known = _state.decisions.get(patch.id)
            if known is None:
                module = sys.modules.get(patch.target)
                if module is None and import_targets:
                    try:
                        module = importlib.import_module(patch.target)
                    except ImportError as exc:
                        mine.append(Decision(patch, Status.REFUSED, f"cannot import {patch.target}: {exc}"))
                        continue
                with _state.lock:  # the import above fired the hook
                    known = _state.decisions.get(patch.id)
                if known is None:
                    known = evaluate(patch, module, ctx=ctx)
            mine.append(known)
        for check in preflight.checks_of(target):  # after every patch of the target
            with _state.lock:
                known = _state.decisions.get(check.id)
            if known is None:
                known = preflight.evaluate(check, sys.modules.get(target), None, ctx, mine)
            mine.append(known)
        out += mine
    return preflight.in_order(registry, out)  # as check orders its static decisions
