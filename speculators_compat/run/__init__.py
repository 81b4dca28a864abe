"""The runner and long-run tools: ``python -m speculators_compat.run`` (:mod:`.command`) runs a stock
extraction script under the library with crash-safe resume (:mod:`.resume`), shards
(:mod:`.shards`, :mod:`.sharded`, :mod:`.parallel`) and ``verify`` (:mod:`.verify`,
:mod:`.ptfile`). The state it shares with the patches -- atomic writes, the generators' lifecycle,
the run manifest, shared-memory leftovers -- is in :mod:`speculators_compat.services`."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m speculators_compat.run`` (see :func:`.command.main`)."""
    from .command import main as _main

    return _main(argv)
