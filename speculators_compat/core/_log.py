"""The ``speculators_compat`` logger, set up on first use (``logging`` is not imported by
``import speculators_compat`` unless ``SPECULATORS_COMPAT_VERBOSE`` is set)."""

from __future__ import annotations

from . import _env

_configured = False


def logger():
    """The ``speculators_compat`` logger: a ``NullHandler`` as libraries should have, plus a
    DEBUG stderr handler when ``SPECULATORS_COMPAT_VERBOSE=1``."""
    global _configured
    import logging

    log = logging.getLogger("speculators_compat")
    if not _configured:
        _configured = True
        log.addHandler(logging.NullHandler())
        if _env.verbose():
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.DEBUG)
    return log
