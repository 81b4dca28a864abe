"""Where each patch was validated: evidence from the test matrix, as a patch x release table.

Two files, both data:

* ``validated.json`` -- the raw validation runs, written by the test matrix (``python
  tools/matrix.py record DIR`` merges the runs a matrix session wrote with
  ``SPECULATORS_COMPAT_RECORD=DIR`` when every end-to-end test passed). One run is one vLLM
  release, one speculators release, one transformers release and one platform: the models it
  compared with HF transformers in fp32, the tensor-parallel sizes, and the patches that applied.
* ``supported.json`` -- generated from it (:func:`table`, by ``python tools/matrix.py generate``;
  a unit test keeps it current). Per speculators line (``0.3``, ``0.4``): the vLLM releases
  validated end to end (with the platforms and transformers releases of their runs), and for
  every patch the vLLM and transformers releases on which a validation run applied it. The
  engine reads only this table.

The questions the engine asks (:class:`Evidence`):

* *Which validated release covers the installed vLLM?* The newest validated release of the same
  line (``major.minor``) that is not newer than the installed base release, among the runs made
  with the installed transformers major line (a vLLM validated on transformers 4 only does not
  cover a transformers 5 install). So a later patch release or a nightly of a validated line
  (``0.16.1.dev20+g...``) is covered by its line's newest validated release below it, while a
  release of a line nobody validated is covered by nothing: that is the library's ceiling.
* *Was this patch validated there?* For a patch whose delta depends on the vLLM release: did a
  validation run of the covering release apply it. For one whose delta depends on the
  transformers release: did a validation run apply it on a transformers release of the installed
  line (``major.minor``) not newer than the installed one. A patch that depends on neither is
  not gated by the table at all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

__all__ = [
    "VALIDATED_FILE", "SUPPORTED_FILE", "SCHEMA", "TABLE_SCHEMA", "Release", "Evidence", "line", "major",
    "load", "load_table", "table", "evidence",
]

HERE = os.path.dirname(__file__)
VALIDATED_FILE = os.path.join(HERE, "validated.json")
SUPPORTED_FILE = os.path.join(HERE, "supported.json")
#: the schema of validated.json (runs) and of supported.json (the generated table)
SCHEMA = 1
TABLE_SCHEMA = 1


def _version(text):
    from packaging.version import Version

    return text if not isinstance(text, str) else Version(text)


def line(version) -> tuple[int, int]:
    """``(major, minor)`` of a ``packaging`` Version or a version string."""
    v = _version(version)
    return v.major, v.minor


def major(version) -> str:
    """The major line of a version (``"5"`` for transformers ``5.24.0``)."""
    return str(_version(version).major)


def _text(v) -> str:
    return "%d.%d" % line(v)


@lru_cache(maxsize=None)
def load(path: str = VALIDATED_FILE) -> dict:
    """The validation runs (``{"schema": 1, "runs": [...]}``)."""
    if not os.path.exists(path):
        return {"schema": SCHEMA, "runs": []}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


@lru_cache(maxsize=None)
def load_table(path: str = SUPPORTED_FILE) -> dict:
    """The patch x release table the engine reads (generated from the runs by :func:`table`)."""
    if not os.path.exists(path):
        return {"schema": TABLE_SCHEMA, "speculators": {}}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def table(data: dict) -> dict:
    """The patch x release table of validation runs ``data`` (what ``supported.json`` holds)."""
    from packaging.version import Version

    out: dict[str, dict] = {}
    for run in data.get("runs", []):
        spec = out.setdefault(_text(run["speculators"]), {"vllm": {}, "patches": {}})
        rel = spec["vllm"].setdefault(run["vllm"], {"platforms": set(), "transformers": set()})
        rel["platforms"].add(run["platform"])
        if run.get("transformers"):
            rel["transformers"].add(run["transformers"])
        for pid in run["applied"]:
            entry = spec["patches"].setdefault(pid, {"vllm": set(), "transformers": set()})
            entry["vllm"].add(run["vllm"])
            if run.get("transformers"):
                entry["transformers"].add(run["transformers"])

    def ordered(values):
        return sorted(values, key=Version)

    return {
        "schema": TABLE_SCHEMA,
        "speculators": {
            s: {
                "vllm": {
                    rel: {"platforms": sorted(v["platforms"]), "transformers": ordered(v["transformers"])}
                    for rel, v in sorted(spec["vllm"].items(), key=lambda kv: Version(kv[0]))
                },
                "patches": {
                    pid: {"vllm": ordered(p["vllm"]), "transformers": ordered(p["transformers"])}
                    for pid, p in sorted(spec["patches"].items())
                },
            }
            for s, spec in sorted(out.items())
        },
    }


@dataclass(frozen=True)
class Release:
    """A vLLM release validated end to end with one speculators line."""

    vllm: str
    platforms: tuple[str, ...]
    #: the transformers releases of its validation runs
    transformers: tuple[str, ...]


class Evidence:
    """The validation evidence for one speculators line (a part of ``supported.json``)."""

    def __init__(self, speculators_line: str, part: dict) -> None:
        self.speculators_line = speculators_line
        self._vllm: dict = part.get("vllm", {})
        self._patches: dict = part.get("patches", {})

    def releases(self, transformers=None) -> list[Release]:
        """The validated vLLM releases, oldest first; with ``transformers``: those validated on
        its major line."""
        out = []
        for rel, v in self._vllm.items():
            tfs = tuple(v["transformers"])
            if transformers is not None and tfs and major(transformers) not in {major(t) for t in tfs}:
                continue
            out.append(Release(rel, tuple(v["platforms"]), tfs))
        return out

    def covering(self, vllm_base, transformers=None) -> Release | None:
        """The validated release that covers an installed vLLM (its *base* release) with an
        installed transformers (None: any)."""
        same_line = [r for r in self.releases(transformers)
                     if line(r.vllm) == line(vllm_base) and _version(r.vllm) <= _version(vllm_base)]
        return max(same_line, key=lambda r: _version(r.vllm), default=None)

    def line_without_transformers(self, vllm_base, transformers) -> Release | None:
        """The release that would cover ``vllm_base`` on another transformers major line (to
        name the transformers release to pin when the installed one was never validated)."""
        if transformers is None:
            return None
        other = self.covering(vllm_base)
        return other if other is not None and self.covering(vllm_base, transformers) is None else None

    def patch_releases(self, patch_id: str) -> list[str]:
        """The vLLM releases on which a validation run applied the patch, oldest first."""
        return list(self._patches.get(patch_id, {}).get("vllm", []))

    def patch_transformers(self, patch_id: str) -> list[str]:
        """The transformers releases on which a validation run applied the patch, oldest first."""
        return list(self._patches.get(patch_id, {}).get("transformers", []))

    def transformers_covering(self, patch_id: str, transformers) -> str | None:
        """The transformers release that validates the patch for an installed ``transformers``:
        the newest validated one of the same line not newer than it (None: none)."""
        if transformers is None:
            return None
        same = [t for t in self.patch_transformers(patch_id)
                if line(t) == line(transformers) and _version(t) <= _version(transformers)]
        return max(same, key=_version, default=None)


def evidence(speculators_version, data: dict | None = None) -> Evidence:
    """The evidence for the installed speculators line (``data``: a table, default
    ``supported.json``)."""
    data = load_table() if data is None else data
    key = _text(speculators_version)
    return Evidence(key, data.get("speculators", {}).get(key, {}))
