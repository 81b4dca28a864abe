"""Arm the Python processes this one starts: ``speculators_compat/bootstrap`` on ``PYTHONPATH``.

multiprocessing *spawns* vLLM's workers: a spawned child re-imports the user's script as
``__mp_main__`` before vLLM loads its plugins, so a script that imports ``speculators`` at its
top would import it unpatched there (on transformers v5 that import fails:
``PydanticUndefinedAnnotation: name 'torch' is not defined``). With the bootstrap folder first on
``PYTHONPATH``, every Python process started from here on imports ``speculators_compat`` at
start-up (the folder's ``sitecustomize``, which then runs the ``sitecustomize`` it shadows), so
the hooks are armed before the script is re-imported.

``import speculators_compat`` calls :func:`arm`, and so does ``speculators-compat run``;
``speculators_compat.revert()`` calls :func:`disarm`, which takes out exactly the entries
:func:`arm` added (the ones that were there before stay, in their order). Stdlib only.
"""

from __future__ import annotations

import os
import threading

#: the package folder (``speculators_compat``)
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOTSTRAP = os.path.join(PACKAGE, "bootstrap")
PYTHONPATH = "PYTHONPATH"

_lock = threading.Lock()
_added: list[str] = []  # the entries arm() put on PYTHONPATH (and that are still ours to remove)
_was_set: list[bool] = []  # whether PYTHONPATH existed before the first arm()


def _entries() -> list[str]:
    return [p for p in os.environ.get(PYTHONPATH, "").split(os.pathsep) if p]


def _package_root() -> str | None:
    """The folder holding this package, when it is a source checkout (not a site-packages): a
    child needs it on ``PYTHONPATH`` to import ``speculators_compat`` at all. An installed
    package's site-packages is never put there (ahead of the standard library, it would let an
    installed backport shadow a stdlib module)."""
    import site

    root = os.path.dirname(PACKAGE)
    user = site.getusersitepackages() if site.ENABLE_USER_SITE is not None else ""
    sites = {os.path.abspath(p) for p in [*site.getsitepackages(), user] if p}
    return None if root in sites else root


def arm() -> list[str]:
    """Put the bootstrap folder (and, from a source checkout, the checkout) first on
    ``PYTHONPATH``, keeping the entries already there; idempotent. Returns what it added."""
    with _lock:
        current = _entries()
        root = _package_root()
        wanted = [BOOTSTRAP] + ([root] if root else [])
        new = [p for p in wanted if p not in current]
        if not new:
            return []
        if not _added and not _was_set:
            _was_set.append(PYTHONPATH in os.environ)
        os.environ[PYTHONPATH] = os.pathsep.join(new + current)
        _added.extend(new)
        return new


def disarm() -> None:
    """Take out what :func:`arm` added; ``PYTHONPATH`` is removed if it was not set before and
    nothing else is left in it."""
    with _lock:
        if not _added:
            return
        rest = [p for p in _entries() if p not in _added]
        del _added[:]
        if rest or (_was_set and _was_set[0]):
            os.environ[PYTHONPATH] = os.pathsep.join(rest)
        else:
            os.environ.pop(PYTHONPATH, None)
        del _was_set[:]


def armed() -> bool:
    """The bootstrap folder is on ``PYTHONPATH``."""
    return BOOTSTRAP in _entries()
