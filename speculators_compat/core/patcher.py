"""How a patch is applied and undone: :class:`Patcher` wraps, defines and replaces, and undoes
what it did last in, first out (a patch's ``apply`` is given one; ``revert()`` calls ``undo``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


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
