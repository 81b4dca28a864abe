"""The real job end to end: the stock data script through ``speculators-compat run``, against the
disk's bandwidth, the save path's and the model's eager prefill (``python benchmarks/gpu.py stock``)."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import STOCK_TARGET, _proc_status_gib, prompts

def disk_bandwidth(folder: Path, gib: float, writers: int = 1) -> float:
    """Bytes/s of writing ``gib`` GiB to ``writers`` new files in ``folder`` at once, one thread each
    (64 MiB writes, then fsync), until the last file is on the disk."""
    from concurrent.futures import ThreadPoolExecutor

    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20) * 64
    n = max(1, int(gib * 16 / writers))

    def write(i: int) -> None:
        with open(folder / f".bandwidth{i}", "wb") as f:
            for _ in range(n):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    os.sync()
    t = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(writers)))
    dt = time.perf_counter() - t
    for i in range(writers):
        (folder / f".bandwidth{i}").unlink()
    return writers * n * len(block) / dt


def _measure_disk(report: dict, disk: Path, gib: float, writers: int) -> None:
    """One round of the disk's bandwidth (one writer and ``writers``) appended to
    ``disk_rounds``; ``disk_bytes_s_writers`` keeps the best of the rounds for each number of
    writers, ``disk_bytes_s_best`` the best of all: what the disk takes (fsync included). A
    virtual machine's disk can vary by half within minutes: measured before the runs and after
    each, the limit is the highest it was seen doing."""
    one = {"1": round(disk_bandwidth(disk, gib))}
    if writers > 1:
        one[str(writers)] = round(disk_bandwidth(disk, gib, writers))
    report["disk_rounds"].append(one)
    report["disk_bytes_s_writers"] = {k: max(r[k] for r in report["disk_rounds"]) for k in one}
    report["disk_bytes_s"] = report["disk_bytes_s_writers"]["1"]
    report["disk_bytes_s_best"] = max(report["disk_bytes_s_writers"].values())


def save_bandwidth(folder: Path, gib: float, hidden: int, layers: int, length: int, rounds: int = 2) -> dict:
    """Bytes/s of the stock script's save path, from memory the way ``results-in-place`` hands it
    out (blocks of one shared-memory segment, each its own tensor), 4 threads as the stock script:
    through ``atomic-save`` (temporary file, fsync, rename: what ``speculators-compat run`` does;
    ``direct``: the fsyncs and renames by its committer, ``direct_sync_file``: by each saving thread,
    ``SPECULATORS_COMPAT_SAVE_SYNC=file``) with its direct writer (``direct``: the storages written by ``os.pwrite`` outside the GIL, no
    CRC) and with ``torch.save``'s own writer (``torch``: ``SPECULATORS_COMPAT_SAVE_WRITER=torch``,
    the save path before the direct writer); plain ``torch.save`` to the final name with one
    ``sync`` at the end (``plain4_sync``: the stock script without ``atomic-save``, made durable); and
    ``direct`` with one ``sync`` at the end instead of an fsync per file (``direct_one_sync``).
    Alternated, ``rounds`` times each; medians."""
    import mmap
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch

    from speculators_compat.services import atomic
    from speculators_compat.patches.guards import atomic_save

    atomic_save._direct[:] = [atomic_save.direct_writer_fits(torch) is None]  # as when the patch applies
    block = length * hidden * 2
    n = max(4, int(gib * 2**30 // (block * layers)))
    path = f"/dev/shm/gpu-extract-save-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * layers * block)
        mm = mmap.mmap(fd, n * layers * block, mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    whole = np.frombuffer(mm, dtype=np.uint8)
    noise = np.frombuffer(os.urandom(16 << 20), dtype=np.uint8)  # every page touched, as a call's copies do
    for at in range(0, whole.size, noise.size):
        whole[at:at + noise.size] = noise[:whole.size - at]
    samples = [{"input_ids": torch.arange(length),
                "hidden_states": [torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=block,
                                                                 offset=(i * layers + j) * block))
                                  .view(torch.bfloat16).view(length, hidden) for j in range(layers)],
                "loss_mask": torch.ones(length, dtype=torch.long)} for i in range(n)]

    def atomic4(out: Path, writer: str, sync: str = "batch"):
        os.environ[atomic_save.WRITER_ENV] = writer
        os.environ[atomic.SYNC_ENV] = sync
        atomic.protect(out)
        try:
            with ThreadPoolExecutor(4) as pool:
                for f in [pool.submit(atomic_save._torch_save, torch.save, None, (d, out / f"data_{i}.pt"), {})
                          for i, d in enumerate(samples)]:
                    f.result()
            atomic.flush()  # the last file renamed
        finally:
            atomic.unprotect(out)
            os.environ.pop(atomic_save.WRITER_ENV, None)
            os.environ.pop(atomic.SYNC_ENV, None)

    def plain4(out: Path):
        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(torch.save, d, out / f"data_{i}.pt") for i, d in enumerate(samples)]:
                f.result()
        os.sync()

    def one_sync(out: Path):
        """``direct`` with no fsync per file, one ``sync`` at the end: what one sync per batch of
        files instead of one per file could gain (the benchmark's own variant, not a mode)."""
        fsync = os.fsync
        os.fsync = lambda fd: None
        try:
            atomic4(out, "direct", "file")
        finally:
            os.fsync = fsync
        os.sync()

    ways = {"direct": lambda out: atomic4(out, "direct"), "torch": lambda out: atomic4(out, "torch"),
            "direct_sync_file": lambda out: atomic4(out, "direct", "file"),
            "plain4_sync": plain4, "direct_one_sync": one_sync}
    got: dict = {name: [] for name in ways}
    for r in range(rounds):
        names = list(ways)
        for name in names[r % len(names):] + names[:r % len(names)]:
            out = folder / f".save-{name}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            os.sync()
            t = time.perf_counter()
            ways[name](out)
            dt = time.perf_counter() - t
            got[name].append(sum(f.stat().st_size for f in out.iterdir()) / dt)
            shutil.rmtree(out)
    del samples, whole
    mm.close()
    return {"samples": n, "sample_bytes": layers * block, "direct_writer": bool(atomic_save._direct[0]),
            "bytes_s": {k: round(statistics.median(v)) for k, v in got.items()},
            "runs_bytes_s": {k: [round(x) for x in v] for k, v in got.items()},
            "direct_over_torch": round(statistics.median(got["direct"]) / statistics.median(got["torch"]), 2)}


_GEN_LINE = re.compile(r"generate\(\): (\d+) sequences, (\d+) tokens, .* ([\d.]+) s")
_RUN_LINE = re.compile(r"run: (\d+) generate\(\) calls, (\d+) tokens, ([\d.]+) s \((\d+) tokens/s\)"
                       r"(?:; ([\d.]+) s between the calls[^;]*)?"
                       r"(?:; ([\d.]+) s waiting for held results .*?at most ([\d.]+) GiB)?")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def stock(model: str, out: Path, calls: int, batch: int, length: int, disk: Path, disk_gib: float,
          util: float, prefill_json: str | None = None, save_gib: float = 2.0, runs: int = 1,
          writer: str | None = None, disk_writers: int = 4, delete_saved: bool = False, sync: str | None = None) -> dict:
    """The ``stock`` command (the module's docstring says what it measures): the disk's bandwidth
    (one writer and ``disk_writers``) and the save path's, then ``runs`` runs of the stock script
    through ``speculators-compat run`` (the output removed between them), their memory sampled;
    the report written to ``out`` and printed. ``writer``: ``SPECULATORS_COMPAT_SAVE_WRITER`` for the
    runs (``torch``: the save path before the direct writer)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    layers_n = cfg["num_hidden_layers"]
    layer_ids = [2, layers_n // 2, layers_n - 3, layers_n - 1]
    report: dict = {"model": model, "calls": calls, "batch": batch, "length": length,
                    "record_dir": os.environ.get("SPECULATORS_COMPAT_RECORD") or None,
                    "async_steps_env": os.environ.get("SPECULATORS_COMPAT_ASYNC_STEPS"),
                    "save_writer": writer or "as installed (direct where torch allows)",
                    "save_sync": sync or "as installed", "deleted_when_counted": delete_saved}
    report["disk_rounds"] = []
    _measure_disk(report, disk, disk_gib, disk_writers)
    if save_gib > 0:
        report["save_path"] = save_bandwidth(disk, save_gib, cfg["hidden_size"], len(layer_ids), length)
    data, rows = _stock_dataset(disk, calls * batch, length, cfg["vocab_size"])
    bench_report = None
    if prefill_json and not Path(prefill_json).exists():
        report["prefill_json_missing"] = prefill_json  # run bench first: the runs are kept, without the ratios
    elif prefill_json:
        bench_report = json.loads(Path(prefill_json).read_text())
    env = dict(os.environ, **({"SPECULATORS_COMPAT_SAVE_WRITER": writer} if writer else {}),
               **({"SPECULATORS_COMPAT_SAVE_SYNC": sync} if sync else {}))
    report["runs"] = []
    for i in range(runs):
        one = _stock_run(model, disk, data, rows, length, batch, util, layer_ids, env,
                         Path(f"{out}.child{'' if i == 0 else i + 1}.log"), delete_saved)
        if i:
            one.pop("rss_gib_samples", None)
        report["runs"].append(one)
        _measure_disk(report, disk, disk_gib, disk_writers)  # the disk varies: measured again after each run
    if "save_path" in report:
        report["save_path"]["ratio_to_disk"] = {k: round(v / report["disk_bytes_s_best"], 3)
                                                for k, v in report["save_path"]["bytes_s"].items()}
    for one in report["runs"]:  # each run against the best the disk was measured doing, before or after
        if bench_report is not None and "tokens_s" in one:
            _against_prefill(one, report, bench_report, len(layer_ids) * cfg["hidden_size"] * 2)
        print(json.dumps({k: v for k, v in one.items() if k not in ("rss_gib_samples", "call_s", "log_tail")}),
              flush=True)
    _summarize_runs(report)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}), flush=True)
    return report


def _stock_run(model: str, disk: Path, data: Path, rows: list, length: int, batch: int, util: float, layer_ids,
               env: dict, log: Path, delete_saved: bool = False) -> dict:
    """One run of the stock script into ``disk/out`` (removed before and after): its figures.
    ``delete_saved``: each sample file is deleted once counted under its final name (runs longer
    than the disk holds)."""
    outdir = disk / "out"
    subprocess.run(["rm", "-rf", str(outdir)], check=True)
    cmd = _stock_command(model, data, outdir, length, batch, util, layer_ids)
    counted: dict[str, tuple[int, float]] = {}  # a sample file under its final name: (size, ctime)
    stop = threading.Event()

    def count(remove: bool) -> None:
        """Count every sample file under its final name (its size, and its ctime: the rename);
        ``remove``: then delete it (it is complete and on the disk: the save path fsyncs a file
        before it gets its final name, so removing it cancels no write-back)."""
        try:
            names = [e.name for e in os.scandir(outdir) if e.name.startswith("data_") and e.name.endswith(".pt")]
        except OSError:
            return
        for name in names:
            if name in counted:
                continue
            try:
                st = os.stat(outdir / name)
                counted[name] = (st.st_size, st.st_ctime)
                if remove:
                    os.unlink(outdir / name)
            except OSError:
                pass

    def deleter() -> None:
        while not stop.wait(0.5):
            count(True)

    remover = threading.Thread(target=deleter, daemon=True) if delete_saved else None
    t_start = time.time()
    if remover:
        remover.start()
    try:
        rc, lines, samples, end = _run_sampled(cmd, env)
    finally:
        stop.set()
        if remover:
            remover.join()
    count(False)
    log.write_text("\n".join(line for _, line in lines) + "\n")  # the whole run's output
    report: dict = {"rc": rc, "deleted_when_counted": delete_saved}
    report["log_tail"] = [line for _, line in lines if any(k in line for k in ("run:", "saved", "Error", "WARNING"))][-8:]
    gen = [(t, int(m.group(1)), int(m.group(2)), float(m.group(3))) for t, line in lines
           if (m := _GEN_LINE.search(line))]
    report.update(files=len(counted), bytes=sum(v[0] for v in counted.values()), run_s=round(end - t_start, 1))
    if not (counted and gen):
        report["error"] = "no file saved or no generate() line seen"
        subprocess.run(["rm", "-rf", str(outdir)], check=True)
        return report
    done = sorted(v[1] for v in counted.values())  # the rename (and the chmod just before it)
    report["tokens"] = sum(len(r) for r in rows[:len(counted)])
    first_call = _pipeline_figures(report, gen, done, report["tokens"], t_start, end)
    run = next((m for _, line in lines if (m := _RUN_LINE.search(line))), None)
    if run:
        _generate_figures(report, run)
    _memory_figures(report, samples, first_call, done[-1], t_start)
    subprocess.run(["rm", "-rf", str(outdir)], check=True)
    return report


def _summarize_runs(report: dict) -> None:
    """The runs' medians and spread (min, max) of the figures that compare runs."""
    done = [r for r in report["runs"] if "tokens_s" in r and r["rc"] == 0]  # a failed run's figures are no result
    report["runs_ok"] = len(done)
    report["runs_failed"] = len(report["runs"]) - len(done)
    for key in ("tokens_s", "bytes_s", "ratio_to_limit", "wall_ratio_to_limit", "ratio_to_prefill", "ratio_to_disk",
                "pipeline_s", "held_results_waited_s"):
        values = [r[key] for r in done if r.get(key) is not None]
        if values:
            report[f"{key}_median"] = round(statistics.median(values), 3)
            report[f"{key}_spread"] = [min(values), max(values)]
    if done and "limit_tokens_s" in done[0]:
        report["limited_by"] = done[0]["limited_by"]
        report["limit_tokens_s"] = done[0]["limit_tokens_s"]
        report["target"] = STOCK_TARGET
        report["meets_target"] = report.get("ratio_to_limit_median", 0) >= STOCK_TARGET and not report["runs_failed"]


def _stock_dataset(disk: Path, count: int, length: int, vocab: int) -> tuple[Path, list[list[int]]]:
    """``count`` random prompts of ``length`` tokens as the stand-in script's JSON-lines file."""
    data = disk / "train.jsonl"
    rows = prompts(count, length, vocab, seed=11)
    with open(data, "w") as f:
        for ids in rows:
            f.write(json.dumps({"input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n")
    return data, rows


def _stock_command(model: str, data: Path, outdir: Path, length: int, batch: int, util: float, layer_ids) -> list:
    """``speculators-compat run`` of ``tests/stock_datagen.py`` (the stock data script's shape)."""
    script = Path(__file__).resolve().parent.parent / "tests" / "stock_datagen.py"
    return [sys.executable, "-m", "speculators_compat", "run", str(script), "--target-model-path", model,
            "--train-data-path", str(data), "--output-dir", str(outdir), "--max-model-len", str(length + 1),
            "--batch-size", str(batch), "--gpu-memory-utilization", str(util),
            "--layer-ids", *map(str, layer_ids)]


def _run_sampled(cmd: list, env: dict | None = None) -> tuple[int, list, list, float]:
    """Run ``cmd`` to its end: its exit code, its output lines with the time each arrived, the
    samples ``(time, driver RSS, driver + workers RSS, /dev/shm used since the start)`` taken every
    0.2 s, and when it ended."""
    samples: list[tuple[float, float, float, int]] = []
    shm0 = _shm_used()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        driver = _proc_status_gib("VmRSS:", str(proc.pid))
        tree = driver + sum(_proc_status_gib("VmRSS:", str(c)) for c in _children(proc.pid))
        samples.append((time.time(), driver, tree, _shm_used() - shm0))
        time.sleep(0.2)
    end = time.time()
    reader.join(timeout=5)
    return proc.returncode, lines, samples, end


def _pipeline_figures(report: dict, gen: list, done: list, tokens: int, t_start: float, end: float) -> float:
    """The run's pipeline, from the first ``generate()`` call to the last file saved: its calls,
    the time between them, samples/tokens/bytes per second. Returns when the first call began."""
    first_call = gen[0][0] - gen[0][3]  # the first generate() line arrives at its call's end
    window = done[-1] - first_call
    per_call = [g[3] for g in gen]
    gaps = [b[0] - b[3] - a[0] for a, b in zip(gen, gen[1:])]  # from a call's end to the next one's start
    nbytes = report["bytes"]
    report.update(
        generate_calls=len(gen), call_s_median=round(statistics.median(per_call), 3), call_s_max=round(max(per_call), 3),
        call_s=[round(x, 3) for x in per_call],
        startup_s=round(first_call - t_start, 1), pipeline_s=round(window, 2), teardown_s=round(end - done[-1], 1),
        # the script's own time between calls (a call's line arrives at its end), and the saves
        # still running after the last call
        between_calls_s=round(sum(gaps), 2), between_calls_median_s=round(statistics.median(gaps or [0]), 3),
        after_last_call_s=round(done[-1] - gen[-1][0], 2),
        samples_s=round(report["files"] / window, 1), tokens_s=round(tokens / window), bytes_s=round(nbytes / window),
    )
    return first_call


def _generate_figures(report: dict, run) -> None:
    """The runner's end line: its ``generate()`` totals, the time between the calls, held results."""
    report["generate"] = {"calls": int(run.group(1)), "tokens": int(run.group(2)), "seconds": float(run.group(3)),
                          "tokens_s": int(run.group(4))}
    if run.group(5) is not None:
        report["generate"]["between_calls_s"] = float(run.group(5))
    if run.group(6) is not None:
        report["held_results_waited_s"] = float(run.group(6))
        report["held_results_peak_gib"] = float(run.group(7))


def _against_prefill(run: dict, report: dict, bench_report: dict, state_bytes: int) -> None:
    """One run against what bounds it: the prefill of a ``bench`` report of the same model
    (tokens/s) or the disk (its best bandwidth, fsync included, over the bytes a token writes:
    the files' bytes over their tokens; ``state_bytes``: a token's states alone, bf16). The figure,
    ``ratio_to_limit``: the extraction phase's tokens/s (first call to last file complete) over the
    lower of the two; ``wall_ratio_to_limit``: the same over the run's wall clock (launch to exit)."""
    prefill = bench_report["median_tokens_s"]["prefill"]
    disk = report["disk_bytes_s_best"]
    bytes_per_token = run["bytes"] / run["tokens"]
    run["prefill_tokens_s"] = round(prefill)
    run["prefill_bytes_s"] = round(prefill * bytes_per_token)
    run["bytes_per_token"] = round(bytes_per_token, 1)
    run["state_bytes_per_token"] = state_bytes
    run["disk_tokens_s"] = round(disk / bytes_per_token)
    run["ratio_to_prefill"] = round(run["tokens_s"] / prefill, 3)
    run["ratio_to_disk"] = round(run["bytes_s"] / disk, 3)
    if "generate" in run:
        run["generate"]["ratio_to_prefill"] = round(run["generate"]["tokens_s"] / prefill, 3)
    run["limited_by"] = "disk" if run["disk_tokens_s"] < prefill else "prefill"
    run["limit_tokens_s"] = min(run["disk_tokens_s"], round(prefill))
    run["ratio_to_limit"] = round(run["tokens_s"] / run["limit_tokens_s"], 3)
    run["wall_ratio_to_limit"] = round(run["tokens"] / run["run_s"] / run["limit_tokens_s"], 3)
    run["ratio_to_bound"] = run["ratio_to_limit"]


def _memory_figures(report: dict, samples: list, first_call: float, last_saved: float, t_start: float) -> None:
    """Resident memory and shared memory over the run; bounded when the pipeline's last quarter
    holds no more than its first."""
    inside = [x for x in samples if first_call <= x[0] <= last_saved]
    quarter = max(1, len(inside) // 4)
    report.update(
        rss_gib_max=round(max(x[1] for x in samples), 2),
        rss_tree_gib_max=round(max(x[2] for x in samples), 2),
        shm_gib_max=round(max(x[3] for x in samples) / 2**30, 2),
        # bounded: the last quarter of the pipeline holds no more than the first
        rss_gib_first_quarter_max=round(max((x[1] for x in inside[:quarter]), default=0.0), 2),
        rss_gib_last_quarter_max=round(max((x[1] for x in inside[-quarter:]), default=0.0), 2),
        rss_gib_samples=[[round(x[0] - t_start, 1), round(x[1], 2), round(x[2], 2), round(x[3] / 2**30, 2)]
                         for x in samples[:: max(1, len(samples) // 80)]],
    )
