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
  (:mod:`speculators_compat.leftovers` records them while a run is alive);
* the folder is registered with :func:`speculators_compat.atomic.protect`, so that the
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

import ast
import json
import os
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from . import atomic, leftovers

__all__ = [
    "StockScript",
    "Plan",
    "OutputFolderError",
    "recognise",
    "scan",
    "prepare",
    "stock_index",
]

CONFIG = "data_config.json"
SAMPLE_LENGTHS = "sample_lengths.json"  # written by the speculators 0.4 script
SET_ASIDE_SUFFIX = ".set-aside"

#: the functions of the stock script whose behaviour this module relies on
BEYOND = "beyond the first missing or unreadable index"

STOCK_FUNCTIONS = ("find_last_checkpoint", "save_sample_to_disk", "generate_and_save_hidden_states")


class OutputFolderError(RuntimeError):
    """The output folder cannot be made crash-safe (busy, unwritable, unknown script)."""


# -- the stock script ------------------------------------------------------------------------


@dataclass(frozen=True)
class StockScript:
    """What :func:`recognise` found in a script."""

    path: str
    #: ``"0.3"`` (no sample_lengths.json) or ``"0.4"`` (writes sample_lengths.json)
    variant: str
    #: what differs from the known stock code; empty when the script is recognised
    problems: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        return not self.problems


def _calls(node: ast.AST) -> list[str]:
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            try:
                out.append(ast.unparse(sub.func))
            except (ValueError, TypeError, AttributeError):  # pragma: no cover - malformed tree
                continue
    return out


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def recognise(path: str | os.PathLike) -> StockScript | None:
    """``None`` if the script is not a data-generation script at all (none of
    :data:`STOCK_FUNCTIONS` is defined); otherwise what was found, with ``problems`` naming
    every way its save/resume code differs from the stock script's (0.3.0, 0.4.x)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if not any(name in funcs for name in STOCK_FUNCTIONS):
        return None
    problems: list[str] = []
    for name in STOCK_FUNCTIONS:
        if name not in funcs:
            problems.append(f"no function {name}()")
    find = funcs.get("find_last_checkpoint")
    if find is not None:
        text = ast.unparse(find)
        if not {"data_", ".pt"} <= _strings(find) or "max_index + 1" not in text:
            problems.append("find_last_checkpoint() does not resume at max(index) + 1 of data_<i>.pt files")
    save = funcs.get("save_sample_to_disk")
    if save is not None and "torch.save" not in _calls(save):
        problems.append("save_sample_to_disk() does not call torch.save")
    gen = funcs.get("generate_and_save_hidden_states")
    if gen is not None:
        text = ast.unparse(gen)
        if "find_last_checkpoint(args.output_dir)" not in text:
            problems.append("generate_and_save_hidden_states() does not resume from find_last_checkpoint(args.output_dir)")
        if "data_{file_idx}.pt" not in text:
            problems.append("generate_and_save_hidden_states() does not name files data_{file_idx}.pt")
    if CONFIG not in _strings(tree):
        problems.append(f"no {CONFIG}")
    variant = "0.4" if SAMPLE_LENGTHS in _strings(tree) else "0.3"
    return StockScript(str(path), variant, tuple(problems))


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
    """What :func:`scan` decided for one folder."""

    folder: Path
    #: the first index to (re)generate: every ``data_<i>.pt`` below it is complete
    resume_at: int = 0
    #: file name -> why it is set aside
    set_aside: dict[str, str] = field(default_factory=dict)
    config_present: bool = False

    @property
    def kept(self) -> int:
        return self.resume_at


def scan(folder: str | os.PathLike, workers: int = 8) -> Plan:
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
    """
    folder = Path(folder)
    plan = Plan(folder)
    if not folder.is_dir():
        return plan
    names = sorted(os.listdir(folder))
    samples: dict[int, str] = {}
    for name in names:
        if atomic.is_temporary(name):
            plan.set_aside[name] = "temporary file of an interrupted write"
            continue
        index = stock_index(name)
        if index is None:
            continue
        if name != f"data_{index}.pt" or index < 0:
            plan.set_aside[name] = f"not a data_<i>.pt name the stock resume reads correctly (read as {index})"
            continue
        samples[index] = name
    problems = _check_all(folder, samples, workers)
    k = 0
    while k in samples and k not in problems:
        k += 1
    for index in sorted(samples):
        if index < k:
            continue
        if index in problems:
            plan.set_aside[samples[index]] = problems[index]
        elif index > k:
            plan.set_aside[samples[index]] = f"{BEYOND} ({k})"
    config = folder / CONFIG
    plan.config_present = config.exists()
    if k > 0:
        why = check_config(config, k) if plan.config_present else "missing"
        if why is not None:
            if plan.config_present:
                plan.set_aside[CONFIG] = f"{why}: the previous run did not finish"
            k -= 1
            plan.set_aside[samples[k]] = (
                f"{CONFIG} {why}: regenerated so that the run finishes and writes its config"
            )
    plan.resume_at = k
    lengths = folder / SAMPLE_LENGTHS
    if lengths.exists():
        try:
            json.loads(lengths.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            plan.set_aside[SAMPLE_LENGTHS] = f"unreadable ({type(exc).__name__}): the stock resume would fail on it"
    return plan


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


def lock(folder: Path) -> None:
    """Hold an exclusive ``flock`` on the folder for the life of this process (released by
    the kernel however the process ends): a second run on the same folder is refused."""
    import fcntl

    key = str(folder.resolve())
    if key in _locks:
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputFolderError(
            f"{folder} is in use by another run (it holds the folder's lock): two runs writing "
            "the same output folder would overwrite and set aside each other's files. Wait for "
            "it to end, or use another --output-dir."
        ) from None
    except OSError as exc:  # a file system without flock (some NFS mounts): go on unlocked
        os.close(fd)
        _log().debug("cannot lock %s (%s): a second run on it would not be refused", folder, exc)
        return
    _locks[key] = fd


def set_aside_folder(folder: Path) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return folder.parent / f"{folder.name}{SET_ASIDE_SUFFIX}" / f"{stamp}-{os.getpid()}"


def apply_plan(plan: Plan) -> Path | None:
    """Move the planned files aside (highest index first, so that an interrupted repair is
    simply redone by the next run) and write the manifest; returns where they went."""
    if not plan.set_aside:
        return None
    dest = set_aside_folder(plan.folder)
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
    """The one log line of :func:`prepare`."""
    if plan.resume_at == 0 and not plan.set_aside:
        return f"output folder {plan.folder}: no complete sample yet, the run starts at data_0.pt"
    kept = "no complete sample" if plan.resume_at == 0 else (
        f"kept data_0.pt .. data_{plan.resume_at - 1}.pt ({plan.resume_at} complete samples)"
    )
    head = f"output folder {plan.folder}: resuming at data_{plan.resume_at}.pt; {kept}"
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
    (``input_ids`` only, memory-mapped); entries from the resume point on are dropped (the
    run writes them again). Returns how many entries were added."""
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
    import torch

    for i in missing:
        data = torch.load(folder / f"data_{i}.pt", mmap=True, weights_only=True, map_location="cpu")
        current[str(i)] = int(data["input_ids"].numel())
    for key in stale:
        del current[key]
    ordered = {str(i): current[str(i)] for i in range(kept)}
    atomic.write_text(path, json.dumps(ordered, indent=2))
    return len(missing)


def prepare(folder: str | os.PathLike, script: StockScript | None = None) -> Plan:
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
    _recorders.append(leftovers.Recorder(folder).start())
    return plan


_recorders: list = []


def finish() -> None:
    """The run ended in a way this process sees: stop recording its shared memory (the
    record is removed; only a run killed outright leaves one for the next run to clean)."""
    while _recorders:
        _recorders.pop().stop()


def _log():
    import logging

    return logging.getLogger("speculators_compat.run")
