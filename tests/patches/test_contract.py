"""The contract test, generated over every patch of the patch set (as dd-trace-py's ``PatchTestCase``).

For each discovered patch: its declaration is well formed; applied through the engine it changes
its target, applied twice nothing more, reverted its target is what it was (on the real target where
it imports and the patch applies, else on a stand-in); and on an installed vLLM, its static probe
(what ``check`` uses) says what its runtime probe says. A new patch is picked up without editing
this file. ``CONTRACT_PATCH_SET`` names another patch set (tests/patches/test_new_patch.py uses it).
"""

from __future__ import annotations

import importlib.util
import os

import patch_contract
import patchset
import pytest

from speculators_compat.core import hooks
from speculators_compat.core.discovery import discover

PATCH_SET = os.environ.get("CONTRACT_PATCH_SET", hooks.PATCH_SET)
PATCHES = discover(PATCH_SET)


def test_the_patch_set_has_patches_with_unique_ids():
    ids = [p.id for p in PATCHES]
    assert ids and len(ids) == len(set(ids))


@pytest.fixture(scope="module", autouse=True)
def _restore():
    yield
    patch_contract.restore()


@pytest.fixture(params=PATCHES, ids=[p.id for p in PATCHES])
def patch(request):
    return request.param


def test_the_declaration_is_well_formed(patch):
    assert patch_contract.well_formed(patch) == []


def test_apply_twice_then_revert_restores_the_target(patch, monkeypatch):
    try:
        seen = patch_contract.apply_and_revert(patch, monkeypatch)
    except patch_contract.Skip as why:
        pytest.skip(str(why))
    if patchset.touches(patch):
        assert seen["applied"], "applying changed nothing it says it touches"
    assert seen["ids"] == [patch.id]
    assert seen["again"] == [], "a second apply changed the target again"
    assert seen["reverted"] == [], "revert left the target changed"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_static_probe_agrees_with_the_runtime_probe(patch):
    try:
        runtime, static = patch_contract.probes_agree(patch)
    except patch_contract.Skip as why:
        pytest.skip(str(why))
    assert static.shape is runtime.shape, (runtime.evidence, static.evidence)
