"""The library's environment variables, parsed in one place (stdlib only, no imports).

``SPECULATORS_COMPAT_DISABLE``  comma- or semicolon-separated patch ids to leave off, or ``all``
                                (also ``*`` or ``1``); case-insensitive. ``resume`` (not a patch)
                                makes ``speculators-compat run`` leave the stock script's output
                                folder alone. An id that names no patch is an error (the check
                                says so, the generator refuses).
``SPECULATORS_COMPAT_VERBOSE``  ``1``/``true``/``yes``: log which patch applied where, to stderr.
``SPECULATORS_COMPAT_RECORD``   a folder: this is a validation run of the test matrix (see
                                :mod:`speculators_compat.check.validation`); never set it for real work.
``SPECULATORS_COMPAT_UNVALIDATED``  ``self-check``: run on a vLLM release no validation run covers,
                                with the self-check on every sequence of the first calls and on the
                                sampled ones after (it stops the run at the first mismatch).
``SPECULATORS_COMPAT_RUNNER``   set by ``speculators-compat run`` to its process id (not an option):
                                the vLLM workers it starts leave Ctrl-C to it.

The options that belong to one patch (``SPECULATORS_COMPAT_SELF_CHECK``, ``_SHM_DIR``, ``_DTYPE``,
...) are declared and read in that patch's module
(:class:`speculators_compat.patching.Option`), not here.
"""

from __future__ import annotations

import os

DISABLE = "SPECULATORS_COMPAT_DISABLE"
VERBOSE = "SPECULATORS_COMPAT_VERBOSE"
RECORD = "SPECULATORS_COMPAT_RECORD"
UNVALIDATED = "SPECULATORS_COMPAT_UNVALIDATED"
RUNNER = "SPECULATORS_COMPAT_RUNNER"
#: the one value ``SPECULATORS_COMPAT_UNVALIDATED`` takes
UNVALIDATED_SELF_CHECK = "self-check"

_ALL = frozenset({"all", "*", "1"})
#: the ids of SPECULATORS_COMPAT_DISABLE that are not patch ids
NOT_PATCHES = frozenset({"all", "resume"})
_TRUE = frozenset({"1", "true", "yes", "on"})


def disabled() -> frozenset[str]:
    """The disabled patch ids, lower-cased (``"all"`` stands for every patch)."""
    raw = os.environ.get(DISABLE, "")
    ids = {part.strip().lower() for part in raw.replace(";", ",").split(",") if part.strip()}
    return frozenset({"all"} if ids & _ALL else ids)


def all_disabled() -> bool:
    return "all" in disabled()


def verbose() -> bool:
    return os.environ.get(VERBOSE, "").strip().lower() in _TRUE


def record_dir() -> str | None:
    """The folder of a validation run (``SPECULATORS_COMPAT_RECORD``), or None."""
    return os.environ.get(RECORD, "").strip() or None


def unvalidated() -> str | None:
    """``SPECULATORS_COMPAT_UNVALIDATED``, lower-cased (``None`` when unset)."""
    return os.environ.get(UNVALIDATED, "").strip().lower() or None


def unvalidated_self_check() -> bool:
    """The user opted in to a release no validation run covers, under the self-check."""
    return unvalidated() == UNVALIDATED_SELF_CHECK
