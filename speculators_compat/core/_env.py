"""The library's environment variables, parsed in one place (stdlib only, no imports).

``SPECULATORS_COMPAT_DISABLE``  comma- or semicolon-separated patch ids to leave off, or ``all``
                                (also ``*`` or ``1``); case-insensitive. ``resume`` (not a patch)
                                makes ``speculators-compat run`` leave the stock script's output
                                folder alone. An id that names no patch is an error (the check
                                says so, the generator refuses).
``SPECULATORS_COMPAT_VERBOSE``  ``1``/``true``/``yes``: log which patch applied where, to stderr.
``SPECULATORS_COMPAT_RECORD``   a folder: this is a validation run of the test matrix (see
                                :mod:`speculators_compat.check.validation`); never set it for real work.
``SPECULATORS_COMPAT_SELF_CHECK``  sequences per ``generate()`` call whose last-layer rows are
                                checked against the model's own log-probs (default 1; ``0``: off;
                                ``all``); the ``self-check`` patch.
``SPECULATORS_COMPAT_SELF_CHECK_TOLERANCE``  the relative difference a checked position may have.
``SPECULATORS_COMPAT_UNVALIDATED``  ``self-check``: run on a vLLM release no validation run covers,
                                with the self-check on every sequence of the first calls and on the
                                sampled ones after (it stops the run at the first mismatch).
``SPECULATORS_COMPAT_SHM_DIR``  the shared-memory folder the captured states travel through
                                (default ``/dev/shm``).
``SPECULATORS_COMPAT_HELD_RESULTS``  how many calls' worth of results the caller may hold (not yet
                                freed, e.g. not yet saved) before ``generate()`` waits (default 4;
                                ``0``: never wait).
``SPECULATORS_COMPAT_ASYNC_STEPS``  ``0``: steps are not pipelined on an accelerator.
``SPECULATORS_COMPAT_DTYPE``    the model dtype of every generator that is not given one.
``SPECULATORS_COMPAT_RUNNER``   set by ``speculators-compat run`` to its process id (not an option):
                                the vLLM workers it starts leave Ctrl-C to it.
"""

from __future__ import annotations

import os

DISABLE = "SPECULATORS_COMPAT_DISABLE"
VERBOSE = "SPECULATORS_COMPAT_VERBOSE"
RECORD = "SPECULATORS_COMPAT_RECORD"
SELF_CHECK = "SPECULATORS_COMPAT_SELF_CHECK"
SELF_CHECK_TOLERANCE = "SPECULATORS_COMPAT_SELF_CHECK_TOLERANCE"
UNVALIDATED = "SPECULATORS_COMPAT_UNVALIDATED"
RUNNER = "SPECULATORS_COMPAT_RUNNER"
SHM_DIR = "SPECULATORS_COMPAT_SHM_DIR"
HELD_RESULTS = "SPECULATORS_COMPAT_HELD_RESULTS"
ASYNC_STEPS = "SPECULATORS_COMPAT_ASYNC_STEPS"
DTYPE = "SPECULATORS_COMPAT_DTYPE"
#: calls' worth of results held before ``generate()`` waits, by default
HELD_RESULTS_DEFAULT = 4.0
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


def shm_dir() -> str:
    """``SPECULATORS_COMPAT_SHM_DIR``: the shared-memory folder (default ``/dev/shm``)."""
    return os.environ.get(SHM_DIR, "").strip() or "/dev/shm"


def held_results() -> float:
    """``SPECULATORS_COMPAT_HELD_RESULTS``: calls' worth of results the caller may hold before
    ``generate()`` waits (``0``: never). Raises ``ValueError`` naming the variable for a bad value."""
    raw = os.environ.get(HELD_RESULTS, "").strip()
    if not raw:
        return HELD_RESULTS_DEFAULT
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{HELD_RESULTS}={raw!r}: expected a number of calls (0 = no limit)") from None


def async_steps_off() -> bool:
    """``SPECULATORS_COMPAT_ASYNC_STEPS=0``: the user keeps steps unpipelined."""
    return os.environ.get(ASYNC_STEPS, "").strip() == "0"


def dtype() -> str | None:
    """``SPECULATORS_COMPAT_DTYPE``: the default model dtype (``None``: unset)."""
    return os.environ.get(DTYPE, "").strip() or None


def self_check() -> int | None:
    """``SPECULATORS_COMPAT_SELF_CHECK``: sequences per call (``-1``: ``all``; ``None``: unset).
    Raises ``ValueError`` naming the variable for a bad value."""
    raw = os.environ.get(SELF_CHECK, "").strip().lower()
    if not raw:
        return None
    if raw == "all":
        return -1
    try:
        value = int(raw)
    except ValueError:
        value = -2
    if value < 0:
        raise ValueError(f"{SELF_CHECK}={raw!r}: expected a number of sequences per call (0 = off) or 'all'")
    return value


def self_check_tolerance() -> float | None:
    """``SPECULATORS_COMPAT_SELF_CHECK_TOLERANCE`` (``None``: unset). Raises ``ValueError`` naming
    the variable for a value that is not a positive number."""
    raw = os.environ.get(SELF_CHECK_TOLERANCE, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{SELF_CHECK_TOLERANCE}={raw!r}: expected a positive number")
    return value
