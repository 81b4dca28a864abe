"""Decisions that deferred files wait for (stdlib only): see :func:`speculators_compat.services.atomic.hold`.

A :class:`Hold` covers some objects (a call's result tensors, by identity, weakly); the committer
of :mod:`.atomic` renames a file saved from one of them once the hold is released and removes it
if the hold is refused. The thread that made a hold decides it (``settle``), at the latest when it
next waits for the committer.
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["Hold", "cover", "hold_of", "settle_own", "on_decided"]

_guard = threading.Lock()
#: the undecided holds, and the objects holds cover: ``id(obj) -> (weak reference, hold)``
_holds: list = []
_held: dict[int, tuple] = {}
#: called (no arguments) whenever a hold is decided, in the deciding thread
_listeners: list = []


def on_decided(listener) -> None:
    """Have ``listener()`` called whenever a hold is decided (the committer's wake-up)."""
    _listeners.append(listener)


class Hold:
    """A decision deferred files wait for before they get their final names (see :func:`.atomic.hold`):
    released, they are renamed as any other; refused, they are removed. ``settle()`` (the maker's)
    returns the error to refuse with, or ``None``; it runs once, in the thread that made the hold."""

    def __init__(self, settle) -> None:
        self._settle, self.owner = settle, threading.get_ident()
        self._done = threading.Event()
        self.error: BaseException | None = None

    @property
    def decided(self) -> bool:
        return self._done.is_set()

    def settle(self) -> BaseException | None:
        """Decide now (the maker's thread only; once): the error it was refused with, or ``None``."""
        if not self._done.is_set():
            try:
                self.error = self._settle()
            except Exception as exc:  # noqa: BLE001 - a decision that cannot be taken refuses the files
                self.error = exc
            with _guard:
                if self in _holds:
                    _holds.remove(self)
            self._done.set()
            for listener in list(_listeners):
                listener()
        return self.error

    def wait(self) -> BaseException | None:
        """The decision: taken here in the maker's thread, awaited in any other."""
        if self.owner == threading.get_ident():
            return self.settle()
        self._done.wait()
        return self.error


def cover(objects, made: Hold) -> Hold:
    """``made`` now covers ``objects`` (those that take a weak reference); the entries of objects
    gone are dropped."""
    with _guard:
        for key in [k for k, (ref, _) in _held.items() if ref() is None]:
            del _held[key]
        for obj in objects:
            try:
                _held[id(obj)] = (weakref.ref(obj), made)
            except TypeError:  # no weak reference to it: not covered
                continue
        _holds.append(made)
    return made


def hold_of(obj) -> Hold | None:
    """The :class:`Hold` covering ``obj`` or an object in it (dict values and list or tuple items,
    two levels down), or ``None``."""
    if not _held:
        return None
    todo, depth = [obj], 0
    while todo and depth < 3:
        nxt = []
        for item in todo:
            entry = _held.get(id(item))
            if entry is not None and entry[0]() is item:
                return entry[1]
            if isinstance(item, dict):
                nxt.extend(item.values())
            elif isinstance(item, (list, tuple)):
                nxt.extend(item)
        todo, depth = nxt, depth + 1
    return None


def settle_own() -> list[BaseException]:
    """Decide the holds this thread made; the errors of those refused."""
    me = threading.get_ident()
    with _guard:
        mine = [h for h in _holds if h.owner == me]
    return [e for e in (made.settle() for made in mine) if e is not None]
