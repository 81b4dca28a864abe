"""One shard of speculators' offline data-generation script, the script unchanged.

``speculators-compat run`` with a shard (``--shard I/N``, or a launcher's ``RANK`` /
``SLURM_PROCID``, see :mod:`speculators_compat.run.shards`) runs the stock script as it is; what
changes happens around three of its functions, in the script's own namespace, for the time of
its one call of ``generate_and_save_hidden_states(args, dataset)``:

* when the script has parsed its arguments (:func:`arm`), the output folder is locked for this
  shard (shared with the other shards, refused to a second process on the same shard or to a run
  that is not sharded), its writes are made atomic, and the shared memory a killed run of this
  shard left is removed;
* ``generate_and_save_hidden_states`` gets the shard's block ``[start, end)`` of the preprocessed
  dataset (``Dataset.select``) and ``args.start_idx = start``: the stock loop names the samples
  it writes ``data_<start + j>.pt``, their global indices. Before that, the folder's
  ``shards.json`` is written or checked (same dataset, same number of shards), and whatever a
  killed run of this shard left that its resume would get wrong is set aside, as for a run that
  is not sharded, but only within the block (:func:`speculators_compat.run.resume.scan`);
* ``find_last_checkpoint`` -- the stock ``max(index) + 1`` -- is read over the block only: the
  other shards' files are not this shard's progress;
* ``save_config`` writes ``data_config.json`` only once every sample of the dataset is there,
  with the whole dataset's ``num_samples``: the shard that completes the dataset writes the
  config one process would have written; the others leave it;
* with speculators 0.4's script, its ``sample_lengths.json`` reads and writes go to the shard's
  own file (``.speculators-compat-shards/sample_lengths-<I>.json``); the shard that completes
  the dataset merges them into ``sample_lengths.json``.
"""

from __future__ import annotations

import builtins
import inspect
import json
import logging
import os
import sys
from pathlib import Path

from ..services import atomic, leftovers
from . import resume, shards, stock_script
from .resume import CONFIG, SAMPLE_LENGTHS, OutputFolderError

__all__ = ["arm", "resume_point", "complete"]

#: the stock function the shard wraps, and the two it replaces during that call
ENTRY = "generate_and_save_hidden_states"


def _log() -> logging.Logger:
    return logging.getLogger("speculators_compat.run")


def _private_lengths(folder: Path, index: int) -> Path:
    return folder / shards.STATE_DIR / f"sample_lengths-{index}.json"


def resume_point(folder: Path, start: int, end: int) -> int:
    """The stock ``find_last_checkpoint`` rule over the block: one past the highest
    ``data_<i>.pt`` with ``start <= i < end``, else ``start``."""
    highest = start - 1
    for name in os.listdir(folder):
        index = resume.stock_index(name)
        if index is not None and start <= index < end:
            highest = max(highest, index)
    return highest + 1


def complete(folder: Path, total: int) -> int:
    """How many of ``data_0.pt .. data_<total - 1>.pt`` are in ``folder`` (by name: every save
    into the folder is atomic, a file under its final name is complete)."""
    names = set(os.listdir(folder))
    return sum(1 for i in range(total) if f"data_{i}.pt" in names)


def arm(namespace, found: stock_script.StockScript, shard: shards.Shard, patcher) -> None:
    """Prepare ``namespace.output_dir`` for ``shard`` and wrap the script's entry point; called
    by the runner when the stock script has parsed its arguments."""
    if getattr(namespace, "start_idx", 0):
        raise OutputFolderError(
            f"--start-idx {namespace.start_idx}: the stock option offsets the output file names; a "
            "sharded run names every sample by its index in the dataset. Leave --start-idx at 0."
        )
    module = sys.modules.get("__main__")
    entry = getattr(module, ENTRY, None)
    main_file = getattr(module, "__file__", None)
    if entry is None or not main_file or os.path.realpath(main_file) != os.path.realpath(found.path):
        raise OutputFolderError(f"{found.path}: no {ENTRY}() in the running script to give shard {shard.label} to")
    folder = Path(namespace.output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    resume.lock(folder, shard.label)
    try:
        shards.check_count(folder, shard)
    except shards.ShardError as exc:
        raise OutputFolderError(str(exc)) from None
    record = f"{shards.STATE_DIR}/shm-{shard.index}.json"
    removed = leftovers.clean(folder, record)  # this shard's lock is ours: its last run is gone
    atomic.protect(folder)
    resume.watch(folder, record)
    _log().info("%s: extracting its block of the dataset into %s", shard.describe(), folder)
    state = _State(folder, found, shard, module, removed)
    patcher.wrap(module, ENTRY, state.generate)


class _State:
    def __init__(self, folder: Path, found: stock_script.StockScript, shard: shards.Shard, module, removed) -> None:
        self.folder = folder
        self.found = found
        self.shard = shard
        self.module = module
        self.removed = removed
        self.total = 0

    # -- generate_and_save_hidden_states(args, dataset) ------------------------------------------

    def generate(self, wrapped, instance, args, kwargs):
        from ..core.registry import Patcher

        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        script_args, dataset = list(bound.arguments.values())[:2]
        total = self.total = len(dataset)
        start, end = shards.span(total, self.shard.index, self.shard.count)
        try:
            shards.agree(self.folder, self.shard, total, shards.fingerprint(dataset))
        except shards.ShardError as exc:
            raise OutputFolderError(str(exc)) from None
        self._repair(start, end)
        local = Patcher()
        previous = script_args.start_idx
        try:
            local.wrap(self.module, "find_last_checkpoint", lambda w, i, a, k: resume_point(self.folder, start, end))
            if hasattr(self.module, "save_config"):
                local.wrap(self.module, "save_config", self.save_config)
            if self.found.variant == "0.4":
                local.define(self.module, "open", self._open)
            script_args.start_idx = start
            return wrapped(script_args, shards.restrict(dataset, start, end))
        finally:
            script_args.start_idx = previous
            local.undo()

    def _repair(self, start: int, end: int) -> None:
        plan = resume.scan(self.folder, span=(start, end), total=self.total, shard=self.shard.label)
        dest = resume.apply_plan(plan)
        line = resume.describe(plan, dest)
        private = _private_lengths(self.folder, self.shard.index)
        if self.found.variant == "0.4" and private.exists():
            try:
                json.loads(private.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError):
                private.unlink()  # cut short by a kill: the stock resume would fail to load it
                line += f"; removed its unreadable {private.name}"
        if self.removed:
            line += f"; removed {len(self.removed)} shared-memory segment(s) a killed run left in /dev/shm"
        _log().log(30 if plan.set_aside or self.removed else 20, "%s", line)

    # -- save_config(args, generator, num_samples, output_dir) ---------------------------------

    def save_config(self, wrapped, instance, args, kwargs):
        atomic.flush()  # this shard's last samples renamed (or their failure raised) before counting
        there = complete(self.folder, self.total)
        if there < self.total:
            _log().info(
                "shard %s done; %s is left to the shard that completes the dataset (%d of %d samples there)",
                self.shard.label, CONFIG, there, self.total,
            )
            return None
        if self.found.variant == "0.4":
            self._merge_lengths()
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        bound.arguments["num_samples"] = self.total
        _log().info("shard %s completed the dataset (%d samples): writing %s", self.shard.label, self.total, CONFIG)
        return wrapped(*bound.args, **bound.kwargs)

    # -- speculators 0.4: sample_lengths.json ------------------------------------------------------

    def _open(self, file, *args, **kwargs):
        shared = os.path.realpath(self.folder / SAMPLE_LENGTHS)
        if isinstance(file, (str, os.PathLike)) and os.path.realpath(file) == shared:
            file = _private_lengths(self.folder, self.shard.index)
        return builtins.open(file, *args, **kwargs)

    def _merge_lengths(self) -> None:
        merged: dict[str, int] = {}
        for path in [self.folder / SAMPLE_LENGTHS] + [
            _private_lengths(self.folder, j) for j in range(self.shard.count)
        ]:
            try:
                part = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            if isinstance(part, dict):
                merged.update({k: v for k, v in part.items()
                               if k.isdigit() and int(k) < self.total and isinstance(v, int)})
        ordered = {str(i): merged[str(i)] for i in range(self.total) if str(i) in merged}
        atomic.write_text(self.folder / SAMPLE_LENGTHS, json.dumps(ordered, indent=2))
        added = resume.rebuild_lengths(self.folder, self.total)
        if added:
            _log().info("%s: read the lengths of %d sample(s) no shard had recorded", SAMPLE_LENGTHS, added)
