"""Where each patch was validated: data written by the test matrix, read by the engine.

``validated.json`` holds one entry per validation run of the matrix (one vLLM release, one
speculators release, one platform): which patches applied, on which models and tensor-parallel
sizes, when. It is *evidence*, not code: the test matrix writes it (``python tests/matrix.py record DIR``
merges the runs a matrix session wrote with ``SPECULATORS_COMPAT_RECORD=DIR`` when every
end-to-end test passed).

The engine asks one question of it: was this patch validated on the installed release? The
record that *covers* an installed vLLM is the newest recorded release of the same line
(``major.minor``) that is not newer than the installed base release, for the installed
speculators line. So a later patch release or a nightly of a validated line (``0.16.1.dev20+g…``)
is covered by its line's newest validated release below it -- every probe and the API inventory
still check its shapes -- while a release of an unseen line (``0.34.0``, ``0.17.0.dev3`` when 0.17
was never validated) is covered by nothing: that is the library's ceiling. A patch whose delta
is present but that never applied in the covering record was not validated there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Record", "VALIDATED_FILE", "SCHEMA", "covering", "records", "load", "line", "validated_lines"]

VALIDATED_FILE = os.path.join(os.path.dirname(__file__), "validated.json")
SCHEMA = 1


@dataclass(frozen=True)
class Record:
    """What the validation runs of one (vLLM release, speculators line) showed, all platforms together."""

    vllm: str
    speculators_line: str
    applied: frozenset[str]
    runs: tuple[dict, ...]

    @property
    def platforms(self) -> list[str]:
        return sorted({r["platform"] for r in self.runs})


def line(version) -> tuple[int, int]:
    """``(major, minor)`` of a ``packaging`` Version or a version string."""
    from packaging.version import Version

    v = version if not isinstance(version, str) else Version(version)
    return v.major, v.minor


@lru_cache(maxsize=None)
def load(path: str = VALIDATED_FILE) -> dict:
    if not os.path.exists(path):
        return {"schema": SCHEMA, "runs": []}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def records(speculators_line: tuple[int, int], data: dict | None = None) -> dict[str, Record]:
    """``{vllm release: Record}`` for one speculators line."""
    data = load() if data is None else data
    grouped: dict[str, list[dict]] = {}
    for run in data.get("runs", []):
        if line(run["speculators"]) == tuple(speculators_line):
            grouped.setdefault(run["vllm"], []).append(run)
    return {
        rel: Record(rel, "%d.%d" % tuple(speculators_line), frozenset().union(*(r["applied"] for r in runs)), tuple(runs))
        for rel, runs in grouped.items()
    }


def covering(vllm_base, speculators_version, data: dict | None = None) -> Record | None:
    """The record that covers an installed vLLM (its *base* release) with an installed speculators."""
    from packaging.version import Version

    table = records(line(speculators_version), data)
    same_line = [Version(rel) for rel in table if line(rel) == line(vllm_base) and Version(rel) <= vllm_base]
    if not same_line:
        return None
    return table[str(max(same_line))]


def validated_lines(speculators_version, data: dict | None = None) -> list[str]:
    """The recorded vLLM releases for a speculators line, oldest first (for messages)."""
    from packaging.version import Version

    return sorted(records(line(speculators_version), data), key=Version)
