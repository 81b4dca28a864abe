"""Errors raised by speculators_compat. All derive from :class:`CompatError`."""

from __future__ import annotations

__all__ = [
    "CompatError",
    "IncompatibleVllmError",
    "ConfigurationError",
    "InvalidInputError",
    "CaptureContractError",
    "SelfCheckError",
    "WorkerDiedError",
]


class CompatError(RuntimeError):
    """Base class of every error speculators_compat raises on purpose."""


class IncompatibleVllmError(CompatError):
    """A patch could not prove that its target has the shape it was written for."""


class ConfigurationError(CompatError, ValueError):
    """The library's own settings are wrong, e.g. an id in ``SPECULATORS_COMPAT_DISABLE`` that
    names no patch (the message lists the valid ids)."""


class InvalidInputError(CompatError, ValueError):
    """``generate()`` or the constructor was given input it cannot process correctly."""


class CaptureContractError(CompatError):
    """The captured hidden states do not satisfy the output contract."""


class SelfCheckError(CaptureContractError):
    """A checked sequence's last-layer rows do not give the model's own next-token log-probs."""


class WorkerDiedError(CompatError):
    """A vLLM worker process of the generator's executor died (killed, crashed, OOM): vLLM
    shut the executor down, and this generator cannot be used any more."""
