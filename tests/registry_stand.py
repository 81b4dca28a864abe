"""What the engine's unit tests (tests/core, tests/check, tests/services) share: throw-away patches,
contexts and targets."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest
from packaging.version import Version

import speculators_compat
from probe_inputs import _context_of, inst, sig
from speculators_compat.core import _env, hooks, versions
from speculators_compat.check import validation
from speculators_compat.errors import IncompatibleVllmError
from speculators_compat.core.registry import (Cause, Context, Edit, Kind, Patch, Probe, Side, Status, evaluate,
                                        uncovered_release)
from speculators_compat.core.verdict import unknown_disabled, verdict
from speculators_compat.core.targets import GENERATOR, SPECULATORS_CONFIG, SPECULATORS_UTILS, WORKER


def make_patch(pid="p1", target="fake_target", shape="new", vllm="", attr="f", kind=Kind.DELTA, depends_on=("vllm",)):
    calls = {"apply": 0}

    def probe(module):
        return {"new": Probe.new, "old": Probe.old, "unknown": Probe.unknown}[shape](f"{shape} shape")

    def apply(module, patcher):
        calls["apply"] += 1
        patcher.wrap(module, attr, lambda w, i, a, k: ("wrapped", pid, w(*a, **k)))

    p = Patch(
        id=pid, title=pid, delta="old -> new", side=Side.DRIVER, target=target, vllm=vllm,
        speculators=">=0.3,<0.4", probe=probe, apply=apply, api=f"fake.{attr}", kind=kind, depends_on=depends_on,
    )
    return p, calls
