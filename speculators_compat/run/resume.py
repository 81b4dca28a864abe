"""Crash-safe output folders for speculators' offline data-generation script.

The stock ``scripts/data_generation_offline.py`` (speculators 0.3.0 and 0.4.x) writes one
``data_<i>.pt`` per sample with ``torch.save`` straight to the final path, on a pool of 4
threads (so out of order, and awaited only at the end of the run), writes
``data_config.json`` with ``Path.write_text`` once everything is saved, and resumes from
``max(i) + 1`` of the files it finds. A run killed at the wrong moment (preemption, the OOM
killer, Ctrl-C, a SIGKILL of the job) leaves a truncated file that counts as done, or holes
below the highest index that a resume never fills.

``speculators-compat run`` makes such a folder crash-safe without changing the script:

* :func:`recognise` reads the script with :mod:`ast` (nothing is executed) and says whether
  it is the stock script, with the save and resume code this module knows;
* when the script has parsed its arguments, :func:`prepare` locks ``--output-dir`` against a
  second run, finds the first missing or unreadable index, moves every sample file from that
  index on (and any unreadable or stray file) aside, so that the stock ``max + 1`` resume
  starts exactly there, and logs one line saying what was kept and what was set aside where;
* the shared-memory segments a run killed outright left in /dev/shm are removed
  (:mod:`speculators_compat.services.leftovers` records them while a run is alive);
* the folder is registered with :func:`speculators_compat.services.atomic.protect`, so that the
  ``atomic-save`` patch turns every ``torch.save`` / ``Path.write_text`` / ``Path.write_bytes``
  into it into a write to a temporary file in the same folder, fsynced, then renamed over the
  final name: a file under its final name is always complete.

Files are never deleted: what is set aside goes to ``<output-dir>.set-aside/<UTC time>-<pid>/``
next to the output folder (not inside it: speculators' trainer loads every ``*pt`` file
under the data folder, subfolders included), with a ``MANIFEST.txt`` giving each file's
reason. Nothing here imports torch or vLLM: a sample file is checked as the zip archive
``torch.save`` writes (its central directory, which is written last, must be complete).
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..services import atomic, leftovers
from . import ptfile, shards
from . import stock_script
from .stock_script import CONFIG, SAMPLE_LENGTHS

__all__ = [
    "Plan",
    "OutputFolderError",
    "scan",
    "prepare",
    "stock_index",
]

SET_ASIDE_SUFFIX = ".set-aside"

BEYOND = "beyond the first missing or unreadable index"

class OutputFolderError(RuntimeError):
    """The output folder cannot be made crash-safe (busy, unwritable, unknown script)."""


# -- reading the folder ----------------------------------------------------------------------


def stock_index(name: str) -> int | None:
    """The index the stock ``find_last_checkpoint`` reads from a file name (its exact rule:
    ``data_`` prefix, ``.pt`` suffix, ``int()`` of the stem after the prefix), or ``None``."""
    if not (name.startswith("data_") and name.endswith(".pt")):
        return None
    try:
        return int(Path(name).stem[5:])
    except ValueError:
        return None


def check_sample(path: str | os.PathLike) -> str | None:
    """``None`` if ``path`` is a complete ``torch.save`` archive, else why not.

    ``torch.save`` writes a zip archive whose central directory comes last: a file cut short
    anywhere (a killed writer) has none, and ``zipfile`` refuses it. Only the end of the file
    and the directory are read, so checking 100k samples stays cheap."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty file"
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except zipfile.BadZipFile as exc:
        return f"not a complete torch.save archive ({exc})"
    except (OSError, ValueError, EOFError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"
    if not any(i.filename.endswith("/data.pkl") or i.filename == "data.pkl" for i in infos):
        return "no data.pkl record: not a torch.save archive"
    for info in infos:
        if info.header_offset + info.compress_size > size:
            return f"record {info.filename} runs past the end of the file"
    return None


def check_config(path: Path, kept: int) -> str | None:
    """``None`` if ``data_config.json`` parses and describes ``kept`` samples, else why not."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"unreadable ({type(exc).__name__})"
    num = config.get("data", {}).get("num_samples") if isinstance(config, dict) else None
    if num != kept:
        return f"describes {num} samples, {kept} are complete"
    return None


@dataclass
class Plan:
    """What :func:`scan` decided for one folder (or for one shard's block of it)."""

    folder: Path
    #: the first index to (re)generate: every ``data_<i>.pt`` below it (from ``span[0]``) is complete
    resume_at: int = 0
    #: file name -> why it is set aside
    set_aside: dict[str, str] = field(default_factory=dict)
    config_present: bool = False
    #: a shard's block ``[start, end)`` of the dataset and the dataset's length; ``None``: the whole folder
    span: tuple[int, int] | None = None
    total: int | None = None
    #: the shard (``"I/N"``) the plan is for, in the log line and the set-aside folder's name
    shard: str = ""

    @property
    def start(self) -> int:
        return self.span[0] if self.span else 0

    @property
    def kept(self) -> int:
        return self.resume_at - self.start


def scan(
    folder: str | os.PathLike,
    workers: int = 8,
    span: tuple[int, int] | None = None,
    total: int | None = None,
    shard: str = "",
) -> Plan:
    """Decide where a run in ``folder`` must resume and what must be moved aside; changes nothing.

    * the first index that is missing or unreadable is where the run resumes; every sample
      file from there on is set aside (so the stock ``max + 1`` resume starts there);
    * files the stock resume would misread (``data_007.pt``, ``data_-1.pt``) and temporary
      files of interrupted atomic writes are set aside;
    * if ``data_config.json`` is missing or does not describe the kept files, the previous
      run did not finish: it is set aside with the last kept sample, so that the stock
      script, which writes its config only after generating, runs again and writes it
      (otherwise a run killed after its last sample but before its config would be "done"
      with no config forever).

    With ``span`` (a shard's block ``[start, end)`` of a dataset of ``total`` samples) only the
    files of that block are considered -- other shards, maybe running, own the rest; the first
    shard also owns misread names below 0, the last one every index from ``total`` on. The
    config is written by the shard that completes the dataset: it is set aside when this block
    has a hole, and when it is missing while every sample of the dataset is there, the block's
    last sample is regenerated so that its shard writes it.
    """
    folder = Path(folder)
    plan = Plan(folder, span=span, total=total, shard=shard)
    start, end = span if span else (0, None)
    if span:
        plan.resume_at = start
    if not folder.is_dir():
        return plan
    names = sorted(os.listdir(folder))
    samples = _sample_files(plan, names)
    problems = _check_all(folder, samples, workers)
    k = start
    while k in samples and k not in problems and (end is None or k < end):
        k += 1
    for index in sorted(samples):
        if index < k:
            continue
        if index in problems:
            plan.set_aside[samples[index]] = problems[index]
        elif index > k or (end is not None and index >= end):
            plan.set_aside[samples[index]] = f"{BEYOND} ({k})"
    config = folder / CONFIG
    plan.config_present = config.exists()
    if span is None:
        k = _whole_run_config(plan, config, k, samples)
    else:
        k = _shard_config(plan, config, k, samples, set(names))
    plan.resume_at = k
    lengths = folder / SAMPLE_LENGTHS
    if span is None and lengths.exists():
        try:
            json.loads(lengths.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            plan.set_aside[SAMPLE_LENGTHS] = f"unreadable ({type(exc).__name__}): the stock resume would fail on it"
    return plan


def _owns(plan: Plan, index: int) -> bool:
    """Whether ``index`` belongs to the plan's block (the whole run owns every index)."""
    if plan.span is None:
        return True
    start, end = plan.span
    first, last = start == 0, plan.total is not None and end == plan.total
    return start <= index < end or (first and index < 0) or (last and index >= plan.total)


def _sample_files(plan: Plan, names: list[str]) -> dict[int, str]:
    """The block's sample files by index; temporary files and misread names are set aside."""
    samples: dict[int, str] = {}
    for name in names:
        temporary = atomic.TEMP_RE.match(name)
        if temporary:
            index = stock_index(temporary.group("final"))
            if plan.span is None or (index is not None and _owns(plan, index)):
                plan.set_aside[name] = "temporary file of an interrupted write"
            continue
        index = stock_index(name)
        if index is None or not _owns(plan, index):
            continue
        if name != f"data_{index}.pt" or index < 0:
            plan.set_aside[name] = f"not a data_<i>.pt name the stock resume reads correctly (read as {index})"
            continue
        samples[index] = name
    return samples


def _whole_run_config(plan: Plan, config: Path, k: int, samples: dict[int, str]) -> int:
    """A whole run's config: a missing or stale one means the run did not finish (its last kept
    sample is regenerated so that the stock script writes the config again). Returns where to resume."""
    if k > 0:
        why = check_config(config, k) if plan.config_present else "missing"
        if why is not None:
            if plan.config_present:
                plan.set_aside[CONFIG] = f"{why}: the previous run did not finish"
            k -= 1
            plan.set_aside[samples[k]] = f"{CONFIG} {why}: regenerated so that the run finishes and writes its config"
    return k


def _shard_config(plan: Plan, config: Path, k: int, samples: dict[int, str], present: set[str]) -> int:
    """A shard's view of the config, written by the shard that completes the dataset. Returns
    where to resume."""
    start, end = plan.span
    total = plan.total
    why = "missing"
    if plan.config_present:
        why = check_config(config, total) if k == end else f"present while data_{k}.pt is missing"
        if why is not None:
            plan.set_aside[CONFIG] = f"{why}: the dataset is not complete" if k < end else why
    if why is not None and k == end > start and all(f"data_{i}.pt" in present for i in range(total or 0)):
        k -= 1
        plan.set_aside[samples[k]] = (f"{CONFIG} {why} while every sample is there: "
                                      "regenerated so that this shard writes it")
    return k


def _check_all(folder: Path, samples: dict[int, str], workers: int) -> dict[int, str]:
    if not samples:
        return {}
    from concurrent.futures import ThreadPoolExecutor

    items = sorted(samples.items())
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as pool:
        results = pool.map(lambda item: check_sample(folder / item[1]), items)
        return {index: why for (index, _), why in zip(items, results) if why is not None}


# -- changing the folder ---------------------------------------------------------------------

_locks: dict[str, int] = {}


def lock(folder: Path, shard: str = "") -> None:
    """Hold a ``flock`` on the folder for the life of this process (released by the kernel
    however the process ends): a second run on the same folder is refused. A shard (``"I/N"``)
    holds the folder's lock shared, with its other shards, and an exclusive lock of its own
    (``.speculators-compat-shards/shard-<I>.lock``): a second process on the same shard, and a
    run that is not sharded, are refused."""
    if not shard:
        _flock(folder, exclusive=True, refusal=(
            f"{folder} is in use by another run, or by the shards of a sharded run (it holds the "
            "folder's lock): two runs writing the same output folder would overwrite and set aside "
            "each other's files. Wait for it to end, or use another --output-dir."
        ))
        return
    _flock(folder, exclusive=False, refusal=(
        f"{folder} is in use by a run that is not sharded (it holds the folder's lock): a shard "
        f"would write the samples that run writes. Wait for it to end."
    ))
    index = shard.split("/")[0]
    state = folder / shards.STATE_DIR
    state.mkdir(exist_ok=True)
    _flock(state / f"shard-{index}.lock", exclusive=True, refusal=(
        f"shard {shard} of {folder} is being run by another process (it holds the shard's lock): two "
        "processes on one shard would write the same samples. Each process of a sharded run needs "
        "its own shard (--shard I/N, or the launcher's RANK / SLURM_PROCID)."
    ))


def _flock(path: Path, exclusive: bool, refusal: str) -> None:
    import fcntl

    key = f"{path.resolve()}:{'ex' if exclusive else 'sh'}"
    if key in _locks:
        return
    fd = os.open(path, os.O_RDONLY) if path.is_dir() else os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputFolderError(refusal) from None
    except OSError as exc:  # a file system without flock (some NFS mounts): go on unlocked
        os.close(fd)
        _log().debug("cannot lock %s (%s): a second run on it would not be refused", path, exc)
        return
    _locks[key] = fd


def set_aside_folder(folder: Path, shard: str = "") -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    tag = f"-shard{shard.replace('/', 'of')}" if shard else ""
    return folder.parent / f"{folder.name}{SET_ASIDE_SUFFIX}" / f"{stamp}-{os.getpid()}{tag}"


def apply_plan(plan: Plan) -> Path | None:
    """Move the planned files aside (highest index first, so that an interrupted repair is
    simply redone by the next run) and write the manifest; returns where they went."""
    if not plan.set_aside:
        return None
    dest = set_aside_folder(plan.folder, plan.shard)
    try:
        dest.mkdir(parents=True, exist_ok=False)
    except OSError as exc:
        raise OutputFolderError(
            f"cannot create {dest} to set aside {len(plan.set_aside)} file(s) of {plan.folder} "
            f"({exc}); nothing was changed. Make {plan.folder.parent} writable and run again."
        ) from exc

    def order(name: str) -> tuple[int, str]:
        index = stock_index(name)
        return (-(index if index is not None else -1), name)

    lines = []
    for name in sorted(plan.set_aside, key=order):
        os.replace(plan.folder / name, dest / name)
        lines.append(f"{name}\t{plan.set_aside[name]}\n")
    (dest / "MANIFEST.txt").write_text(
        f"set aside from {plan.folder} by speculators-compat run (pid {os.getpid()}); the run "
        f"resumed at data_{plan.resume_at}.pt\n" + "".join(lines),
        encoding="utf-8",
    )
    return dest


def describe(plan: Plan, dest: Path | None) -> str:
    """The one log line of :func:`prepare` (and of a shard's preparation)."""
    where = f"output folder {plan.folder}"
    start = plan.start
    if plan.span is not None:
        end = plan.span[1]
        block = f"data_{start}.pt .. data_{end - 1}.pt" if end > start else "no sample (more shards than samples)"
        where += f", shard {plan.shard} of {plan.total} samples ({block})"
        if plan.resume_at == end and not plan.set_aside:
            return f"{where}: every sample of the shard is there, nothing to do"
    if plan.resume_at == start and not plan.set_aside:
        return f"{where}: no complete sample yet, the run starts at data_{start}.pt"
    kept = "no complete sample" if plan.kept == 0 else (
        f"kept data_{start}.pt .. data_{plan.resume_at - 1}.pt ({plan.kept} complete samples)"
    )
    head = f"{where}: resuming at data_{plan.resume_at}.pt; {kept}"
    if not plan.set_aside:
        return head + "; nothing set aside"
    return f"{head}; set aside {len(plan.set_aside)} file(s) to {dest}: {summarize(plan.set_aside)} (reasons in MANIFEST.txt)"


def summarize(set_aside: dict[str, str], limit: int = 12) -> str:
    """``data_3.pt (unreadable: ...), data_5.pt .. data_9.pt, data_config.json (...), 2 temporary
    files``: files set aside only because they lie beyond the resume point are given as ranges,
    every other file with its reason."""
    beyond = sorted(
        i for n, why in set_aside.items() if why.startswith(BEYOND) and (i := stock_index(n)) is not None
    )
    temps = [n for n in set_aside if atomic.is_temporary(n)]
    skip = set(temps) | {f"data_{i}.pt" for i in beyond}

    def order(name: str) -> tuple[int, str]:
        index = stock_index(name)
        return (index if index is not None else 1 << 62, name)

    parts = [f"{n} ({set_aside[n]})" for n in sorted(set_aside, key=order) if n not in skip]
    start = prev = None
    for i in beyond + [None]:
        if start is not None and (i is None or i != prev + 1):
            parts.append(f"data_{start}.pt" if start == prev else f"data_{start}.pt .. data_{prev}.pt")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    if temps:
        parts.append(f"{len(temps)} temporary file(s) of interrupted writes")
    if len(parts) > limit:
        parts = parts[:limit] + [f"and {len(parts) - limit} more"]
    return ", ".join(parts)


def rebuild_lengths(folder: Path, kept: int) -> int:
    """Make ``sample_lengths.json`` (speculators 0.4's script) list exactly the kept samples.

    The 0.4 script writes it once, at the very end, with ``open(..., "w")``; on a resume it
    loads it and adds the new samples. A run killed before the end never wrote it, so the
    resumed run's file lacks every sample of the killed run (the trainer then falls back to
    lengths estimated from file sizes). The missing entries are read from the kept files
    (the shape of ``input_ids``, from the archive's pickle: no tensor is loaded); entries from
    the resume point on are dropped (the run writes them again). Returns how many entries
    were added."""
    path = folder / SAMPLE_LENGTHS
    try:
        current = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (OSError, UnicodeDecodeError, ValueError):
        current = {}
    if not isinstance(current, dict):
        current = {}
    missing = [i for i in range(kept) if str(i) not in current]
    stale = [key for key in current if not (key.isdigit() and int(key) < kept)]
    if not missing and not stale:
        return 0
    for i in missing:
        current[str(i)] = ptfile.read(folder / f"data_{i}.pt")["input_ids"].numel
    for key in stale:
        del current[key]
    ordered = {str(i): current[str(i)] for i in range(kept)}
    atomic.write_text(path, json.dumps(ordered, indent=2))
    return len(missing)


def prepare(folder: str | os.PathLike, script: "stock_script.StockScript | None" = None) -> Plan:
    """Lock ``folder``, set aside what the stock resume would get wrong, log one line, and
    register the folder for atomic writes. Returns the plan that was carried out."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock(folder)
    removed = leftovers.clean(folder)  # the lock is ours: the run that recorded them is gone
    plan = scan(folder)
    dest = apply_plan(plan)
    line = describe(plan, dest)
    if script is not None and script.variant == "0.4" and plan.resume_at > 0:
        added = rebuild_lengths(folder, plan.resume_at)
        if added:
            line += f"; {SAMPLE_LENGTHS}: added the lengths of {added} kept sample(s) it lacked"
    if removed:
        line += f"; removed {len(removed)} shared-memory segment(s) a killed run left in /dev/shm"
    level = 30 if plan.set_aside or removed else 20  # WARNING when something was cleaned up
    _log().log(level, "%s", line)
    atomic.protect(folder)
    watch(folder)
    return plan


_recorders: list = []


def watch(folder: Path, record: str = leftovers.RECORD) -> None:
    """Record the shared memory this run maps in ``folder``'s ``record`` until :func:`finish`."""
    _recorders.append(leftovers.Recorder(folder, record=record).start())


def finish() -> None:
    """The run ended in a way this process sees: stop recording its shared memory (the
    record is removed; only a run killed outright leaves one for the next run to clean)."""
    while _recorders:
        _recorders.pop().stop()


def _log():
    import logging

    return logging.getLogger("speculators_compat.run")
