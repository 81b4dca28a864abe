"""The runner and long-run tools: ``python -m speculators_compat.run`` (:mod:`.command`) runs a stock
extraction script under the library with crash-safe resume (:mod:`.resume`, :mod:`.leftovers`),
shards (:mod:`.shards`, :mod:`.sharded`, :mod:`.parallel`), a manifest (:mod:`.manifest`),
``verify`` (:mod:`.verify`, :mod:`.ptfile`), atomic writes (:mod:`.atomic`) and the generator's
lifecycle (:mod:`.lifecycle`)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m speculators_compat.run`` (see :func:`.command.main`)."""
    from .command import main as _main

    return _main(argv)
