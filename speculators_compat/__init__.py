"""speculators_compat: run stock speculators hidden-state extraction correctly on newer vLLM.

``import speculators_compat`` registers post-import hooks; the patches apply when
``speculators.data_generation`` (driver side) and its worker extension (in every vLLM
worker) are imported. Importing this package imports neither torch nor vLLM.

Set ``SPECULATORS_COMPAT_DISABLE=all`` (or a comma-separated list of patch ids) to keep
patches off; ``python -m speculators_compat.check`` shows what applies and why.
"""

from __future__ import annotations

import os

from .core import _checkout, _env
from .core import preflight as _preflight
from .core import registry as _registry
from .core._log import logger as _logger
from .errors import (CaptureContractError, CompatError, ConfigurationError, IncompatibleVllmError, InvalidInputError,
                     SelfCheckError, WorkerDiedError)
from .core.hooks import applied_ids, apply, install, reset, revert, status

__version__ = "0.2.0"

__all__ = [
    "__version__",
    "apply",
    "revert",
    "reset",
    "status",
    "install",
    "applied_ids",
    "CompatError",
    "IncompatibleVllmError",
    "ConfigurationError",
    "InvalidInputError",
    "CaptureContractError",
    "SelfCheckError",
    "WorkerDiedError",
]

_checkout.install(os.path.dirname(os.path.abspath(__file__)))


def _checks():
    from .check import checks

    return checks.CHECKS


def _evidence(release, table):
    from .check import validation

    return validation.evidence(release, table)


# the engine's core imports nothing of check/ or run/: its checks and the validation evidence are wired in here
_preflight.wire(_checks)
_registry.wire_evidence(_evidence)

if _env.verbose():
    _logger()  # at once, so the verbose handler is there before anything logs

if not _env.all_disabled():
    install()
