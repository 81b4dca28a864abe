"""A patch set's patches, found in its package, in the order they apply.

A *patch set* is a package whose modules (in its subpackages, the *groups* it lists in
``GROUPS``) each define ``PATCH``, a :class:`~speculators_compat.core.registry.Patch`; modules whose
name starts with ``_`` are its private helpers. Within one target, a patch applies after every
patch its ``after=`` names (and so wraps them); patches that ``after=`` does not order apply in
the order of their groups in ``GROUPS``, then of their ids.
"""

from __future__ import annotations

import importlib
import pkgutil

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .registry import Patch

__all__ = ["discover", "order"]


def discover(package: str) -> list[Patch]:
    """Import every public module of the patch set ``package`` and return its patches, in the
    order they apply."""
    root = importlib.import_module(package)
    groups = tuple(getattr(root, "GROUPS", ()))
    found: list[tuple[Patch, str]] = []
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        parts = info.name[len(package) + 1 :].split(".")
        if any(part.startswith("_") for part in parts):
            continue
        patch = getattr(importlib.import_module(info.name), "PATCH", None)
        if patch is None:
            continue
        if parts[0] not in groups:
            raise ImportError(f"{info.name}: patch {patch.id!r} is in no group of {package}.GROUPS {groups}")
        found.append((patch, parts[0]))
    rank = {patch.id: (groups.index(group), patch.id) for patch, group in found}
    return order([patch for patch, _ in found], key=lambda p: rank[p.id])


def order(patches: list[Patch], key=None) -> list[Patch]:
    """``patches`` in the order they apply: each after those its ``after=`` names, ties by ``key``
    (default: the id). Raises ``ImportError`` for a duplicate id, an ``after=`` that names no patch
    or a patch of another target, and a cycle."""
    key = key or (lambda p: p.id)
    by_id: dict[str, Patch] = {}
    for patch in patches:
        if patch.id in by_id:
            raise ImportError(f"duplicate patch id {patch.id!r}")
        by_id[patch.id] = patch
    for patch in patches:
        for other in patch.after:
            if other not in by_id:
                raise ImportError(f"{patch.id}: after={other!r} names no patch")
            if by_id[other].target != patch.target:
                raise ImportError(f"{patch.id}: after={other!r} is a patch of another target ({by_id[other].target})")
    placed: list[Patch] = []
    done: set[str] = set()
    left = sorted(patches, key=key)
    while left:
        ready = next((p for p in left if done.issuperset(p.after)), None)
        if ready is None:
            raise ImportError(f"after= forms a cycle among {sorted(p.id for p in left)}")
        placed.append(ready)
        done.add(ready.id)
        left.remove(ready)
    return placed
