"""The patch modules: one per vLLM API delta, stock-code fix, platform fix, guard or feature.

Every module in this package that defines ``PATCH`` (a :class:`~speculators_compat.registry.Patch`)
is registered -- adding a delta is adding one file. Within one target module patches apply in
the order of their declared ``priority`` (then id): later patches wrap earlier ones, so the
guards (high priorities) see the patched generator. Each module's docstring gives the delta,
how it is detected, and when it can be removed. Importing this package imports neither torch
nor vLLM. The private modules hold what patches share: ``_probes`` (helpers for probes), ``_ranges``
(version ranges), ``_idle_output`` (the scheduler output v5, s04-scheduler-loop and guard-input share).
"""

from __future__ import annotations

import importlib
import pkgutil

from speculators_compat.targets import GENERATOR, SPECULATORS_CONFIG, SPECULATORS_UTILS, WORKER


def discover() -> list:
    """Import every public module of this package and return its ``PATCH``es, in order."""
    found = []
    for info in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
        if info.name.rsplit(".", 1)[-1].startswith("_"):
            continue
        module = importlib.import_module(info.name)
        patch = getattr(module, "PATCH", None)
        if patch is not None:
            found.append(patch)
    found.sort(key=lambda p: (p.priority, p.id))
    ids = [p.id for p in found]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ImportError(f"speculators_compat.patches: duplicate patch ids {duplicates}")
    return found


REGISTRY = discover()

#: where a refused patch stops its target before any heavy work: (class, method)
ENTRY_POINTS = {
    GENERATOR: ("VllmHiddenStatesGenerator", "__init__"),
    WORKER: ("HiddenStatesWorkerExtension", "_setup_hidden_states_capture"),
}

#: targets imported while ``import speculators`` runs, with no entry point to stop: a refused
#: patch there fails that import with the refusal (instead of the foreign traceback that follows)
REFUSE_AT_IMPORT = frozenset({SPECULATORS_UTILS, SPECULATORS_CONFIG})

__all__ = ["REGISTRY", "ENTRY_POINTS", "REFUSE_AT_IMPORT", "GENERATOR", "WORKER", "discover"]
