"""Shards of one dataset: which part a process extracts, and the record every shard agrees on.

A run of speculators' offline data-generation script split over ``N`` processes (nodes, GPU
groups) gives each process one *shard*: a contiguous block of the preprocessed dataset, the
first ``len % N`` blocks one sample longer (as speculators >= 0.6 splits by ``--rank``). The
blocks are disjoint and cover the dataset, every sample keeps its global index as its file
name (``data_<i>.pt``), and all shards write into one output folder: their union is the folder
one process would have written.

Which shard a process is, in this order:

* ``--shard I/N`` given to ``speculators-compat run`` (``--shard 0/1``: the whole dataset,
  whatever the environment says);
* a launcher that follows torch's convention (``torchrun``, and others): ``RANK`` and
  ``WORLD_SIZE``;
* a Slurm job step (``srun``): ``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS`` (else
  ``SLURM_NTASKS``), only inside a step (``SLURM_STEP_ID`` set): a batch script itself also has
  ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``, and must not take shard 0 alone.

``shards.json`` in the output folder records the plan (dataset length, number of shards, a
fingerprint of the dataset); the first shard to reach its dataset writes it, every other one
checks it agrees, so shards that preprocessed different data (another ``--max-samples``,
``--seed``, data file) or were started with another ``N`` are refused instead of mixing.
Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ..services import atomic, manifest

__all__ = [
    "Shard",
    "ShardError",
    "RECORD",
    "parse",
    "from_environment",
    "span",
    "spans",
    "split",
    "fingerprint",
    "restrict",
    "read_record",
    "agree",
]

#: the shard plan, in the output folder
RECORD = "shards.json"
#: the shards' own bookkeeping (locks, shared-memory records), in the output folder
STATE_DIR = manifest.SHARDS_STATE_DIR
FORMAT = 1


class ShardError(RuntimeError):
    """A shard that cannot run: a malformed ``--shard``, or a plan the folder's record contradicts."""


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0-based), and where that came from (for the log)."""

    index: int
    count: int
    source: str = "--shard"
    #: ``"torch"`` (RANK / WORLD_SIZE), ``"slurm"`` (an srun step), ``""`` (an option)
    launcher: str = ""

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ShardError(f"shard {self.index} of {self.count}: need 0 <= I < N ({self.source})")

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def describe(self) -> str:
        return f"shard {self.label} ({self.source})"


_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def parse(text: str, source: str = "--shard") -> Shard:
    """``"I/N"`` -> ``Shard(I, N)``."""
    match = _SPEC.match(text or "")
    if not match:
        raise ShardError(f"{source} {text!r}: expected I/N, e.g. 0/4 (shard I of N, counted from 0)")
    return Shard(int(match.group(1)), int(match.group(2)), source)


def _int(env, name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def from_environment(env=None) -> Shard | None:
    """The shard a launcher gave this process, or ``None`` (not launched as one of several)."""
    env = os.environ if env is None else env
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        return Shard(rank, world, f"RANK={rank}, WORLD_SIZE={world}", "torch")
    if env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip():
        procid = _int(env, "SLURM_PROCID")
        name = "SLURM_STEP_NUM_TASKS" if _int(env, "SLURM_STEP_NUM_TASKS") is not None else "SLURM_NTASKS"
        ntasks = _int(env, name)
        if procid is not None and ntasks is not None:
            return Shard(procid, ntasks, f"SLURM_PROCID={procid}, {name}={ntasks}", "slurm")
    return None


def split(shard: Shard, k: int) -> list[Shard]:
    """Shard ``I/N`` run as ``k`` processes: shards ``I*k .. I*k+k-1`` of ``N*k`` (every process of
    the ``N`` launched with the same ``k``: ``N*k`` disjoint blocks that cover the dataset)."""
    return [Shard(shard.index * k + j, shard.count * k, f"{shard.describe()}, data parallel {j}/{k}") for j in range(k)]


def span(total: int, index: int, count: int) -> tuple[int, int]:
    """Shard ``index`` of ``count``'s block ``[start, end)`` of a dataset of ``total`` samples:
    contiguous blocks in shard order, the first ``total % count`` one sample longer."""
    if count < 1 or not 0 <= index < count or total < 0:
        raise ValueError(f"no shard {index} of {count} of {total} samples")
    base, extra = divmod(total, count)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def spans(total: int, count: int) -> list[tuple[int, int]]:
    return [span(total, i, count) for i in range(count)]


# -- the dataset -----------------------------------------------------------------------------


def _ids(row) -> list[int]:
    ids = row["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    return [int(t) for t in ids]


def fingerprint(dataset, probes: int = 16) -> str:
    """A digest of the dataset's length and of the token ids of up to ``probes`` evenly spaced
    samples (the first and the last included): equal for shards that preprocessed the same data
    in the same order, different when ``--max-samples``, ``--seed`` or the data differ."""
    total = len(dataset)
    digest = hashlib.sha256(str(total).encode())
    picks = sorted({(total - 1) * j // max(1, probes - 1) for j in range(probes)}) if total else []
    for i in picks:
        digest.update(f"|{i}:".encode())
        digest.update(json.dumps(_ids(dataset[i])).encode())
    return "sha256:" + digest.hexdigest()[:32]


def restrict(dataset, start: int, end: int):
    """Samples ``start .. end - 1`` as the same kind of dataset: ``Dataset.select`` for Hugging
    Face datasets (what speculators' preprocessing returns), slicing for a sequence."""
    if hasattr(dataset, "select"):
        return dataset.select(range(start, end))
    return dataset[start:end]


# -- the record --------------------------------------------------------------------------------


def read_record(folder: str | os.PathLike) -> dict | None:
    """``shards.json`` of ``folder`` as a dict, ``None`` if absent; raises ``ShardError`` if unreadable."""
    path = Path(folder) / RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ShardError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(record, dict) or not isinstance(record.get("dataset_length"), int) \
            or not isinstance(record.get("shards"), int):
        raise ShardError(f"{path} is not a shard record (dataset_length, shards)")
    return record


def check_count(folder: str | os.PathLike, shard: Shard) -> None:
    """Refuse a shard whose ``N`` differs from the one the folder's record was written for
    (shards of two plans would overlap); run as soon as the arguments are known."""
    record = read_record(folder)
    if record is not None and record["shards"] != shard.count:
        raise ShardError(_recount(folder, record, shard))


def _recount(folder, record: dict, shard: Shard) -> str:
    return (
        f"{Path(folder) / RECORD} records a run in {record['shards']} shards, this is {shard.describe()}: "
        f"shards of two plans would write the same samples. Run every shard as {{0..{record['shards'] - 1}}}"
        f"/{record['shards']}; to change the number of shards, stop every shard of the folder and delete "
        f"{RECORD} (the samples already written are kept)."
    )


def agree(folder: str | os.PathLike, shard: Shard, total: int, digest: str) -> dict:
    """Write the folder's record if it has none (the first shard to get here), else check that it
    describes this shard's plan and dataset; returns the record."""
    folder = Path(folder)
    mine = {
        "format": FORMAT,
        "dataset_length": total,
        "shards": shard.count,
        "fingerprint": digest,
        "spans": [list(s) for s in spans(total, shard.count)],
    }
    path = folder / RECORD
    if not path.exists():
        staged = path.with_name(f"{RECORD}.{socket.gethostname()}.{os.getpid()}")
        with atomic.atomic_path(staged) as tmp:
            Path(tmp).write_text(json.dumps(mine, indent=2) + "\n", encoding="utf-8")
        try:
            os.link(staged, path)  # only the first shard's record is kept
        except FileExistsError:
            pass
        finally:
            staged.unlink(missing_ok=True)
    record = read_record(folder)
    if record is None:  # pragma: no cover - removed between the link and the read
        raise ShardError(f"{path} vanished while shard {shard.label} was writing it")
    if record["shards"] != shard.count:
        raise ShardError(_recount(folder, record, shard))
    if record["dataset_length"] != total or record.get("fingerprint") != digest:
        raise ShardError(
            f"the dataset {shard.describe()} preprocessed ({total} samples, {digest}) is not the one "
            f"{path} records ({record['dataset_length']} samples, {record.get('fingerprint')}): every shard "
            "must run the same command (data, --max-samples, --seed, --seq-length, tokenizer) so that "
            "each sample index means the same sample everywhere."
        )
    return record
