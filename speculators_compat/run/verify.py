"""``speculators-compat verify OUTPUT_DIR``: is an offline data-generation folder complete and consistent?

What it checks, and what each finding is called:

* ``hole``: an index of the dataset with no ``data_<i>.pt``. The dataset's length comes from
  ``data_config.json`` (``data.num_samples``), ``shards.json`` (a sharded run records it as soon
  as its first shard has preprocessed the data) or ``--expect N``; they must agree (``config``).
* ``duplicate``: an index more than one file stands for -- ``data_7.pt`` and ``data_07.pt``
  (the stock resume reads both as 7), or a ``data_<i>.pt`` in a subfolder: speculators' trainer
  loads every ``*pt`` file below the folder, each one a sample;
* ``stray``: a file the trainer would load that is no sample of the dataset (an index beyond it,
  another ``*pt`` name, anything in a subfolder), and temporary files of interrupted writes;
* ``unreadable``: a file that is not a complete ``torch.save`` archive of plain tensors (cut short,
  empty, a storage record missing or of the wrong size; see :mod:`speculators_compat.run.ptfile`);
* ``mismatch``: a sample whose layout differs from the folder's: ``input_ids`` and ``loss_mask``
  1-D of one length, ``hidden_states`` a list of ``[len, hidden]`` tensors, the number of layers,
  the hidden size and the dtypes those of the other samples and of ``data_config.json``
  (``hidden_states.layer_ids``, ``model.hidden_size``); ``sample_lengths.json`` (speculators 0.4)
  listing each sample's length;
* ``config``: ``data_config.json`` missing (the run -- or, sharded, the shard that completes the
  dataset -- has not finished), unreadable, or disagreeing with the other records.

By default only each file's metadata is read: its zip directory and its pickle, never the
states (20,000 samples of 4 layers in 8-12 s on 2 busy CPU cores). ``--full`` also loads every
file with ``torch.load`` and checks that its states are finite. Exit code 0 only when nothing was found; 1 otherwise; 2 when
the folder does not exist.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..services import atomic
from . import ptfile, resume, shards

__all__ = ["Finding", "Report", "verify", "main"]

@dataclass
class Finding:
    kind: str
    text: str
    index: int | None = None
    file: str | None = None

    def line(self) -> str:
        return f"  {self.kind:<11} {self.file + ': ' if self.file else ''}{self.text}"


@dataclass
class Report:
    folder: Path
    expected: int | None = None
    expected_from: list[str] = field(default_factory=list)
    samples: int = 0
    geometry: dict = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.findings

    def add(self, kind: str, text: str, index: int | None = None, file: str | None = None) -> None:
        self.findings.append(Finding(kind, text, index, file))

    def to_json(self) -> dict:
        return {
            "folder": str(self.folder),
            "complete": self.complete,
            "expected": self.expected,
            "expected_from": self.expected_from,
            "samples": self.samples,
            "geometry": self.geometry,
            "findings": [vars(f) for f in self.findings],
        }


def _ranges(indices: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def _load_json(path: Path, report: Report) -> dict | None:
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        report.add("config", f"unreadable ({type(exc).__name__}: {exc})", file=path.name)
        return None
    return value if isinstance(value, dict) else None


def _layout(meta) -> tuple[dict | None, str | None]:
    """The geometry of one sample's metadata, or why it is not a sample."""
    if not isinstance(meta, dict) or not {"input_ids", "hidden_states", "loss_mask"} <= set(meta):
        keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        return None, f"holds {keys}, not input_ids / hidden_states / loss_mask"
    ids, mask, states = meta["input_ids"], meta["loss_mask"], meta["hidden_states"]
    if not isinstance(ids, ptfile.TensorMeta) or len(ids.shape) != 1 or ids.shape[0] < 1:
        return None, f"input_ids is {getattr(ids, 'shape', ids)}, not a non-empty 1-D tensor"
    n = ids.shape[0]
    if not isinstance(mask, ptfile.TensorMeta) or mask.shape != (n,):
        return None, f"loss_mask is {mask.describe() if isinstance(mask, ptfile.TensorMeta) else mask}, input_ids has {n} tokens"
    if not isinstance(states, (list, tuple)) or not states:
        return None, "hidden_states is not a non-empty list of tensors"
    for j, h in enumerate(states):
        if not isinstance(h, ptfile.TensorMeta) or len(h.shape) != 2 or h.shape[0] != n:
            what = h.describe() if isinstance(h, ptfile.TensorMeta) else type(h).__name__
            return None, f"hidden_states[{j}] is {what}, expected [{n}, hidden]"
    hidden = {h.shape[1] for h in states}
    dtypes = {h.dtype for h in states}
    if len(hidden) > 1 or len(dtypes) > 1:
        return None, "hidden_states mixes " + ", ".join(h.describe() for h in states)
    return {
        "tokens": n, "layers": len(states), "hidden_size": hidden.pop(), "states_dtype": dtypes.pop(),
        "input_ids_dtype": ids.dtype, "loss_mask_dtype": mask.dtype,
    }, None


def _read(path: Path):
    try:
        return _layout(ptfile.read(path))
    except ptfile.BadArchive as exc:
        return None, f"unreadable: {exc}"
    except OSError as exc:
        return None, f"unreadable ({type(exc).__name__}: {exc})"


def _full(path: Path) -> str | None:
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises whatever the damage makes it raise
        return f"torch.load fails: {type(exc).__name__}: {exc}"
    bad = [j for j, h in enumerate(data["hidden_states"]) if not torch.isfinite(h).all()]
    return f"hidden_states {bad} hold inf or nan" if bad else None


GEOMETRY_KEYS = ("layers", "hidden_size", "states_dtype", "input_ids_dtype", "loss_mask_dtype")


def verify(folder: str | os.PathLike, full: bool = False, expect: int | None = None, workers: int = 16) -> Report:
    """Check ``folder`` (see the module docstring); changes nothing."""
    folder = Path(folder)
    report = Report(folder)
    by_index = _sample_names(folder, report)
    config = _load_json(folder / resume.CONFIG, report)
    total = _dataset_length(folder, report, config, expect, by_index)
    samples = _canonical_samples(report, by_index, total)
    items = sorted(samples.items())
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items) or 1))) as pool:
        layouts = list(pool.map(lambda item: _read(folder / item[1]), items))
    good = {}
    for (index, name), (layout, why) in zip(items, layouts):
        if layout is None:
            report.add("unreadable" if why.startswith("unreadable") else "mismatch",
                       why.removeprefix("unreadable: "), index, name)
        else:
            good[index] = layout
    _geometry(report, good, samples, config)
    _lengths(report, folder, good, total)
    if full and good:
        with ThreadPoolExecutor(max_workers=max(1, min(4, workers))) as pool:
            problems = list(pool.map(lambda i: _full(folder / samples[i]), sorted(good)))
        for index, why in zip(sorted(good), problems):
            if why:
                report.add("unreadable", why, index, samples[index])
    report.findings.sort(key=lambda f: (f.index if f.index is not None else -1, f.kind))
    return report


def _sample_names(folder: Path, report: Report) -> dict[int, list[str]]:
    """Every ``*pt`` file below ``folder`` by the index the trainer reads it as; strays reported."""
    by_index: dict[int, list[str]] = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != shards.STATE_DIR)
        rel_root = Path(root).relative_to(folder)
        for name in sorted(files):
            rel = str(rel_root / name) if str(rel_root) != "." else name
            top = str(rel_root) == "."
            if top and atomic.is_temporary(name):
                report.add("stray", "temporary file of an interrupted write", file=rel)
                continue
            if not name.endswith("pt"):
                continue
            index = resume.stock_index(name)
            if index is None:
                report.add("stray", "not a data_<i>.pt sample, but the trainer loads every *pt file below the "
                           "folder", file=rel)
                continue
            by_index.setdefault(index, []).append(rel)
    return by_index


def _dataset_length(folder: Path, report: Report, config: dict | None, expect: int | None,
                    by_index: dict[int, list[str]]) -> int:
    """The dataset's length from ``--expect``, the config and the shard record (they must agree);
    without any, the highest index found + 1 (reported)."""
    try:
        record = shards.read_record(folder)
    except shards.ShardError as exc:
        record = None
        report.add("config", str(exc), file=shards.RECORD)
    num = config.get("data", {}).get("num_samples") if config else None
    candidates = [(expect, "--expect"), (num, resume.CONFIG), ((record or {}).get("dataset_length"), shards.RECORD)]
    lengths = {source: value for value, source in candidates if isinstance(value, int)}
    if len(set(lengths.values())) > 1:
        report.add("config", "the dataset's length differs: " + ", ".join(f"{n} ({s})" for s, n in lengths.items()))
    report.expected_from = list(lengths)
    report.expected = next(iter(lengths.values()), None)
    if config is None and not (folder / resume.CONFIG).exists():
        report.add("config", "missing: the run (sharded: the shard that completes the dataset) has not finished",
                   file=resume.CONFIG)
    total = report.expected
    if total is None:
        top = max((i for i in by_index if i >= 0), default=-1) + 1
        report.add("config", f"the dataset's length is unknown (no {resume.CONFIG}, no {shards.RECORD}): checked "
                   f"data_0.pt .. data_{top - 1}.pt only; --expect N gives it")
        total = top
    return total


def _canonical_samples(report: Report, by_index: dict[int, list[str]], total: int) -> dict[int, str]:
    """``data_<i>.pt`` of each index of the dataset; strays beyond it, duplicates and holes reported."""
    samples: dict[int, str] = {}
    for index, names in sorted(by_index.items()):
        canonical = f"data_{index}.pt"
        if not 0 <= index < total:
            for name in names:
                report.add("stray", f"index {index} is beyond the dataset ({total} samples)", index, name)
            continue
        if len(names) > 1 or names[0] != canonical:
            others = [n for n in names if n != canonical]
            report.add("duplicate", f"index {index} is also in {', '.join(others)}" if canonical in names
                       else f"index {index} has no data_{index}.pt but {', '.join(names)}", index, canonical)
        if canonical in names:
            samples[index] = canonical
    for a, b in _ranges([i for i in range(total) if i not in by_index]):
        report.add("hole", f"index {a} missing" if a == b else f"indices {a} .. {b} missing ({b - a + 1})", a,
                   f"data_{a}.pt" if a == b else f"data_{a}.pt .. data_{b}.pt")
    report.samples = len(samples)
    return samples


def _geometry(report: Report, good: dict, samples: dict, config: dict | None) -> None:
    if not good:
        return
    common = Counter(tuple(g[k] for k in GEOMETRY_KEYS) for g in good.values()).most_common(1)[0][0]
    reference = dict(zip(GEOMETRY_KEYS, common))
    report.geometry = {**reference, "tokens": sum(g["tokens"] for g in good.values())}
    for index, layout in sorted(good.items()):
        differs = [f"{k} {layout[k]} (the folder's: {reference[k]})" for k in GEOMETRY_KEYS if layout[k] != reference[k]]
        if differs:
            report.add("mismatch", "; ".join(differs), index, samples[index])
    if config:
        layer_ids = config.get("hidden_states", {}).get("layer_ids")
        hidden = config.get("model", {}).get("hidden_size")
        if isinstance(layer_ids, list) and len(layer_ids) != reference["layers"]:
            report.add("config", f"hidden_states.layer_ids {layer_ids}: {len(layer_ids)} layers, the samples hold "
                       f"{reference['layers']}", file=resume.CONFIG)
        if isinstance(hidden, int) and hidden != reference["hidden_size"]:
            report.add("config", f"model.hidden_size {hidden}, the samples' states are {reference['hidden_size']} wide",
                       file=resume.CONFIG)


def _lengths(report: Report, folder: Path, good: dict, total: int) -> None:
    path = folder / resume.SAMPLE_LENGTHS
    lengths = _load_json(path, report)
    if lengths is None:
        return
    extra = sorted(k for k in lengths if not (k.isdigit() and int(k) < total))
    if extra:
        report.add("mismatch", f"lists {len(extra)} index(es) beyond the dataset: {', '.join(extra[:5])}", file=path.name)
    for index, layout in sorted(good.items()):
        listed = lengths.get(str(index))
        if listed != layout["tokens"]:
            report.add("mismatch", f"{resume.SAMPLE_LENGTHS} lists {listed} tokens, the file holds {layout['tokens']}",
                       index, f"data_{index}.pt")


def render(report: Report) -> str:
    n = report.expected
    head = f"{report.folder}: {report.samples} sample file(s)"
    if n is not None:
        head += f" of {n} expected (from {', '.join(report.expected_from)})"
    lines = [head]
    g = report.geometry
    if g:
        lines.append(f"  states: {g['layers']} layer(s) x {g['hidden_size']}, {g['states_dtype']}; input_ids "
                     f"{g['input_ids_dtype']}, loss_mask {g['loss_mask_dtype']}; {g['tokens']} tokens")
    lines += [f.line() for f in report.findings]
    if report.complete:
        lines.append("complete: yes")
    else:
        counts = Counter(f.kind for f in report.findings)
        lines.append("complete: NO (" + ", ".join(f"{c} {k}" for k, c in sorted(counts.items())) + ")")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="speculators-compat verify", description=(
        "Check that an offline data-generation output folder holds every sample of the dataset exactly "
        "once, each file complete and laid out like the others. Exit code 0 only when it does."))
    parser.add_argument("folder", help="the script's --output-dir")
    parser.add_argument("--full", action="store_true", help="also load every file with torch (slower)")
    parser.add_argument("--expect", type=int, default=None, metavar="N", help="the dataset's length, if known")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        print(f"speculators-compat verify: no such folder: {folder}", file=sys.stderr)
        return 2
    report = verify(folder, full=args.full, expect=args.expect)
    print(json.dumps(report.to_json(), indent=2) if args.json else render(report))
    return 0 if report.complete else 1


if __name__ == "__main__":
    sys.exit(main())
