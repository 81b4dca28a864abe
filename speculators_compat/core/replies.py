"""Worker replies that a driver-side patch turns into the stock value after ``collective_rpc`` returns.

A patch may have the workers answer a stock ``collective_rpc`` with a small stand-in (say, "the
rows are already in your shared memory") that the same patch converts, in the driver, into the
value the stock code expects before the stock code reads it. Such a reply derives from
:class:`Deferred`, so that patches checking the shape of a stock reply (an API-delta repair)
leave it to the patch that converts it, without knowing that patch's types.
"""

from __future__ import annotations

__all__ = ["Deferred"]


class Deferred:
    """Base of a worker's reply that a driver-side patch converts into the stock value (and
    checks) after ``collective_rpc`` returns; it never reaches the stock code."""

    __slots__ = ()
