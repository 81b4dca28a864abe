"""The check: which patches an installed (or unpacked) vLLM needs and whether they cover it,
judged from the sources without importing vLLM (``python -m speculators_compat.check``).

:mod:`.command` is the command; :mod:`.sources` reads a release's sources; :mod:`.inventory`
compares its APIs with the recorded ones; :mod:`.calls` the stock code's calls; :mod:`.validation`
the validation records; :mod:`.constraints` the nearest validated set of pins."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m speculators_compat.check`` (see :func:`.command.main`)."""
    from .command import main as _main

    return _main(argv)
