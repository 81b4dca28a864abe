"""The run manifest: where a dataset's rows came from, beside the stock ``data_config.json``.

``speculators-compat run`` writes ``speculators_compat_manifest.json`` into the output folder of
speculators' data-generation script (the folder it makes crash-safe) when the script ends,
fails or is interrupted, atomically (:mod:`speculators_compat.services.atomic`). It holds one entry per
run that wrote into the folder (a resumed dataset lists each), newest last::

    {"schema": 1, "runs": [{
        "started": "2026-12-03T10:00:00Z", "ended": "...", "status": "finished",
        "versions": {"vllm": "vllm 0.26.0", "speculators": "0.3.0", "torch": "2.9.1",
                     "transformers": "4.57.1", "speculators_compat": "0.1.0"},
        "patches": {"driver": [...], "workers": [...]},
        "shard": "0/4" (a shard of the dataset only),
        "generators": [{"model": "/models/kimi", "config_sha256": "...", "layer_ids": [2, 30, 58, 60],
                        "dtype": "bfloat16", "tensor_parallel_size": 8, "max_model_len": 4096,
                        "self_check": {"calls": 120, "sequences": 120, "rows": 301234,
                                       "worst_relative": 0.0021, "worst_nats": 0.05, ...}}]}]}

``patches.workers`` is the list every worker applied (or one list per rank where they differ).
A generator's facts are taken at its first ``generate()`` (the ``report`` patch calls
:func:`note_generator`), its self-check totals when the run ends. Nothing here imports torch
or vLLM.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("speculators_compat")

__all__ = ["FILE", "SCHEMA", "arm", "armed", "note_generator", "entry", "write"]

FILE = "speculators_compat_manifest.json"
#: the lock file the shards of one dataset take in turn to add their entries (in their state folder)
LOCK = "manifest.lock"
#: the state folder of a sharded dataset (:data:`speculators_compat.run.shards.STATE_DIR`)
SHARDS_STATE_DIR = ".speculators-compat-shards"
SCHEMA = 1
#: attribute of a generator whose facts were taken
NOTED = "_speculators_compat_manifest"

_lock = threading.Lock()
_state: dict = {"folder": None, "started": None, "generators": []}


def _utc(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def arm(folder: str | os.PathLike, shard: str | None = None) -> None:
    """This run writes its dataset (``shard``: one shard ``I/N`` of it) into ``folder``: the
    manifest goes there when it ends."""
    with _lock:
        _state.update(folder=os.fspath(folder), started=_utc(), generators=[], shard=shard)


def armed() -> bool:
    return _state["folder"] is not None


def _applied_in_worker(worker) -> list[str]:
    from ..core import hooks

    return hooks.applied_ids()


def _config_hash(model_config) -> str | None:
    path = os.path.join(str(getattr(model_config, "model", "")), "config.json")
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        pass
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        return None
    return hashlib.sha256(hf_config.to_json_string(use_diff=False).encode()).hexdigest()


def note_generator(generator, self_check=None) -> None:
    """Take ``generator``'s facts (once; only while a manifest is armed). ``self_check``: the
    generator's self-check totals (``calls``, ``off``, ``failed``, ``as_dict()``), read at the end."""
    if not armed() or generator.__dict__.get(NOTED):
        return
    from ..core import hooks

    generator.__dict__[NOTED] = True
    config = generator.vllm_config
    workers: object = None
    executor = getattr(generator, "executor", None)
    if executor is not None:
        try:
            per_rank = executor.collective_rpc(_applied_in_worker)
        except Exception as exc:  # the manifest says so; the run goes on
            per_rank = None
            workers = f"not known ({type(exc).__name__}: {exc})"
        if per_rank is not None:
            workers = per_rank[0] if all(r == per_rank[0] for r in per_rank) else per_rank
    facts = {
        "model": str(config.model_config.model),
        "config_sha256": _config_hash(config.model_config),
        "layer_ids": sorted(set(generator.layer_ids)),
        "dtype": str(config.model_config.dtype).replace("torch.", ""),
        "tensor_parallel_size": int(config.parallel_config.tensor_parallel_size),
        "max_model_len": int(config.model_config.max_model_len),
        "driver_patches": hooks.applied_ids(),
        "worker_patches": workers,
        "_totals": self_check,
    }
    with _lock:
        _state["generators"].append(facts)


def entry(status: str) -> dict:
    """This run's entry."""
    from .. import __version__
    from ..core import hooks, versions

    def version(dist: str) -> str | None:
        found = versions.installed(dist)
        return str(found.version) if found else None

    vllm = versions.vllm()
    with _lock:
        noted = list(_state["generators"])
        started = _state["started"]
        shard = _state.get("shard")
    generators, workers = [], []
    for facts in noted:
        facts = dict(facts)
        totals = facts.pop("_totals")
        facts["self_check"] = totals.as_dict() if totals and (totals.calls or totals.off or totals.failed) else None
        driver = facts.pop("driver_patches")
        worker = facts.pop("worker_patches")
        if worker not in workers:
            workers.append(worker)
        generators.append(facts)
    return {
        "started": started,
        "ended": _utc(),
        "status": status,
        **({"shard": shard} if shard else {}),
        "versions": {"vllm": str(vllm) if vllm else None, "speculators": version("speculators"),
                     "torch": version("torch"), "transformers": version("transformers"),
                     "speculators_compat": __version__},
        "patches": {"driver": noted[-1]["driver_patches"] if noted else hooks.applied_ids(),
                    "workers": workers[0] if len(workers) == 1 else workers},
        "generators": generators,
    }


@contextlib.contextmanager
def _shards_lock(folder: str):
    state = Path(folder) / SHARDS_STATE_DIR
    if _state.get("shard") is None or not state.is_dir():
        yield
        return
    with open(state / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def write(status: str) -> Path | None:
    """Add this run's entry to the armed folder's manifest (atomically); ``None`` if none is armed."""
    from . import atomic

    folder = _state["folder"]
    if folder is None or not os.path.isdir(folder):
        return None
    path = Path(folder) / FILE
    new = entry(status)
    # the shards of one dataset end at their own times: one writer at a time, none lost (an
    # unsharded run holds the whole folder alone)
    with _shards_lock(folder):
        runs: list = []
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(old, dict) and old.get("schema") == SCHEMA and isinstance(old.get("runs"), list):
                runs = old["runs"]
        except (OSError, ValueError):
            pass
        runs.append(new)
        atomic.write_text(path, json.dumps({"schema": SCHEMA, "runs": runs}, indent=1) + "\n")
    with _lock:
        _state["folder"] = None
    log.info("run manifest: %s", path)
    return path
