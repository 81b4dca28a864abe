"""Unit tests of the crash-safe output folder (no vLLM, no torch): the folder scan and repair,
the atomic writes, the recognition of the stock script, and the runner's exit codes.

A ``torch.save`` file is a zip archive with an ``<name>/data.pkl`` record; the tests write
such archives with :mod:`zipfile` (what :func:`speculators_compat.run.resume.check_sample` reads).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from speculators_compat.run import resume, stock_script
from speculators_compat.services import atomic

HERE = Path(__file__).parent.parent  # tests/


def sample(path: Path, n: int = 3) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{path.stem}/data.pkl", b"\x80\x02}q\x00." * n)
        zf.writestr(f"{path.stem}/data/0", os.urandom(64 * n))
        zf.writestr(f"{path.stem}/version", b"3\n")


def folder_with(tmp_path: Path, n: int, config: bool = True) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    for i in range(n):
        sample(out / f"data_{i}.pt", i + 1)
    if config:
        (out / "data_config.json").write_text(json.dumps({"data": {"num_samples": n}}))
    return out


def test_a_complete_folder_resumes_at_its_end_and_moves_nothing(tmp_path):
    out = folder_with(tmp_path, 6)
    plan = resume.scan(out)
    assert plan.resume_at == 6 and plan.set_aside == {}
    assert resume.describe(plan, None).endswith("resuming at data_6.pt; kept data_0.pt .. data_5.pt (6 complete samples); nothing set aside")


def test_truncated_file_hole_and_missing_config(tmp_path):
    out = folder_with(tmp_path, 12, config=False)
    blob = (out / "data_5.pt").read_bytes()
    (out / "data_5.pt").write_bytes(blob[:-30])  # the central directory is cut off
    (out / "data_8.pt").unlink()
    (out / "data_3.pt").write_bytes(b"")
    plan = resume.scan(out)
    # data_3 (empty) is the first unreadable index; with no config, data_2 is regenerated too
    assert plan.resume_at == 2
    assert plan.set_aside["data_3.pt"] == "empty file"
    assert plan.set_aside["data_5.pt"].startswith("not a complete torch.save archive")
    assert plan.set_aside["data_2.pt"].startswith("data_config.json missing")
    assert set(plan.set_aside) == {f"data_{i}.pt" for i in (2, 3, 4, 5, 6, 7, 9, 10, 11)}
    text = resume.summarize(plan.set_aside)
    assert "data_4.pt," in text and "data_6.pt .. data_7.pt" in text and "data_9.pt .. data_11.pt" in text


def test_a_config_that_does_not_describe_the_kept_files_is_set_aside(tmp_path):
    out = folder_with(tmp_path, 5)
    (out / "data_config.json").write_text(json.dumps({"data": {"num_samples": 3}}))
    plan = resume.scan(out)
    assert plan.resume_at == 4
    assert "describes 3 samples, 5 are complete" in plan.set_aside["data_config.json"]
    (out / "data_config.json").write_text("{\"data\": {\"num_sa")  # cut short
    assert "unreadable" in resume.scan(out).set_aside["data_config.json"]


def test_names_the_stock_resume_misreads_and_temporary_files(tmp_path):
    out = folder_with(tmp_path, 3)
    sample(out / "data_07.pt")  # int("07") == 7: the stock resume would jump to 8
    sample(out / "data_-1.pt")
    (out / ".data_3.pt.x1y2.tmp").write_bytes(b"partial")
    (out / "notes.txt").write_text("not ours")
    (out / "data_x.pt").write_text("not an index")
    plan = resume.scan(out)
    assert plan.resume_at == 3
    assert set(plan.set_aside) == {"data_07.pt", "data_-1.pt", ".data_3.pt.x1y2.tmp"}


def test_prepare_moves_files_aside_with_a_manifest_and_logs_one_line(tmp_path, caplog):
    out = folder_with(tmp_path, 8, config=False)
    (out / "data_4.pt").unlink()
    with caplog.at_level(logging.INFO, logger="speculators_compat.run"):
        plan = resume.prepare(out)
    try:
        assert sorted(p.name for p in out.iterdir()) == ["data_0.pt", "data_1.pt", "data_2.pt"]
        dest = next((tmp_path / "out.set-aside").iterdir())
        moved = sorted(p.name for p in dest.iterdir())
        assert moved == ["MANIFEST.txt", "data_3.pt", "data_5.pt", "data_6.pt", "data_7.pt"]
        manifest = (dest / "MANIFEST.txt").read_text().splitlines()
        assert manifest[0].endswith("the run resumed at data_3.pt")
        assert manifest[1].startswith("data_7.pt\t")  # highest first: an interrupted repair is redone
        lines = [r.getMessage() for r in caplog.records if r.name == "speculators_compat.run"]
        assert len(lines) == 1 and str(dest) in lines[0] and "resuming at data_3.pt" in lines[0]
        assert plan.resume_at == 3 and atomic.protected(out / "data_3.pt") == out / "data_3.pt"
    finally:
        resume.finish()
        atomic.unprotect()


def test_a_new_folder_is_created_locked_and_protected(tmp_path, caplog):
    out = tmp_path / "new" / "out"
    with caplog.at_level(logging.INFO, logger="speculators_compat.run"):
        resume.prepare(out)
    try:
        assert out.is_dir()
        assert "no complete sample yet, the run starts at data_0.pt" in caplog.text
        # a second process on the same folder is refused while this one holds it
        code = (
            "import sys; from speculators_compat.run import resume\n"
            "try:\n    resume.lock(resume.Path(sys.argv[1]))\n"
            "except resume.OutputFolderError as e:\n    print('refused:', e)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=tmp_path)
        assert proc.stdout.startswith("refused:") and "in use by another run" in proc.stdout, proc.stderr
    finally:
        resume.finish()
        atomic.unprotect()
    assert not (out / ".speculators-compat-shm").exists()


def test_atomic_path_renames_complete_files_only(tmp_path):
    final = tmp_path / "data_0.pt"
    final.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic.atomic_path(final) as tmp:
            Path(tmp).write_bytes(b"half")
            raise RuntimeError("killed")
    assert final.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["data_0.pt"]
    atomic.protect(tmp_path)
    try:
        with atomic.atomic_path(final) as tmp:
            assert Path(tmp).parent == tmp_path and Path(tmp).name.startswith(".data_0.pt.")
            Path(tmp).write_bytes(b"new")
        assert final.read_bytes() == b"new"
        umask = os.umask(0o022)
        os.umask(umask)
        assert stat.S_IMODE(final.stat().st_mode) == 0o666 & ~umask
    finally:
        atomic.unprotect()


def test_atomic_file_renames_complete_files_only_and_closes_its_descriptor(tmp_path):
    """``atomic_file``: the body writes through the descriptor it is given; a body that fails
    leaves the final name untouched, no temporary file and no open descriptor; one that succeeds
    renames the file, with the mode a plain ``open()`` gives."""
    final = tmp_path / "data_0.pt"
    final.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic.atomic_file(final) as fd:
            os.pwrite(fd, b"half", 0)
            raise RuntimeError("killed")
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    assert final.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["data_0.pt"]
    with atomic.atomic_file(final) as fd:
        os.pwritev(fd, [b"ne", b"w"], 0)
    assert final.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["data_0.pt"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(final.stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("writer", ["path", "file"])
def test_atomic_writes_sync_what_the_body_wrote_before_the_rename(tmp_path, monkeypatch, writer):
    """Without ``defer`` the file is fsynced once its body has written it and before it is renamed
    over the final name: the fsync reaches the file the body wrote (through the yielded path or
    descriptor), holding the body's bytes, and comes before the rename."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        info = os.fstat(fd)
        events.append(("fsync", info.st_ino, info.st_size))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.stat(src).st_ino, Path(dst).name))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    final = tmp_path / "data_0.pt"
    if writer == "path":
        with atomic.atomic_path(final) as tmp:
            Path(tmp).write_bytes(b"twelve bytes")
    else:
        with atomic.atomic_file(final) as fd:
            os.pwrite(fd, b"twelve bytes", 0)
    ino = final.stat().st_ino
    assert final.read_bytes() == b"twelve bytes"
    assert ("fsync", ino, 12) in events and ("rename", ino, "data_0.pt") in events, events
    assert events.index(("fsync", ino, 12)) < events.index(("rename", ino, "data_0.pt")), events


def test_only_direct_children_of_a_protected_folder_are_protected(tmp_path):
    atomic.protect(tmp_path / "out")
    try:
        assert atomic.protected(str(tmp_path / "out" / "data_1.pt")) == tmp_path / "out" / "data_1.pt"
        assert atomic.protected(tmp_path / "out" / "sub" / "data_1.pt") is None
        assert atomic.protected(tmp_path / "other" / "data_1.pt") is None
        assert atomic.protected(tmp_path / "out" / ".data_1.pt.ab12.tmp") is None
        assert atomic.protected(object()) is None
    finally:
        atomic.unprotect()
    assert atomic.protected(tmp_path / "out" / "data_1.pt") is None


def test_the_stand_in_is_recognised_and_a_changed_copy_is_not(tmp_path):
    found = stock_script.recognise(HERE / "stock_datagen.py")
    assert found is not None and found.known and found.variant == "0.3"
    changed = tmp_path / "changed.py"
    changed.write_text((HERE / "stock_datagen.py").read_text().replace("torch.save(data_dict", "my_save(data_dict"))
    found = stock_script.recognise(changed)
    assert found is not None and found.problems == ("save_sample_to_disk() does not call torch.save",)
    assert stock_script.recognise(HERE / "scenario.py") is None


STOCK_LIKE = '''
import argparse, os, signal, sys, time
from pathlib import Path

def find_last_checkpoint(output_dir):
    max_index = -1
    for p in Path(output_dir).iterdir():
        if p.name.startswith("data_") and p.name.endswith(".pt"):
            max_index = max(max_index, int(p.stem[5:]))
    return max_index + 1

def save_sample_to_disk(data_dict, output_path):
    torch.save(data_dict, output_path)

def generate_and_save_hidden_states(args, dataset):
    start = find_last_checkpoint(args.output_dir)
    file_idx = start
    (Path(args.output_dir) / f"data_{file_idx}.pt").write_bytes(b"not written by torch")
    (Path(args.output_dir) / "data_config.json").write_text("{}")
    print("resumed at", start, flush=True)
    if args.then == "sigint":
        raise KeyboardInterrupt
    if args.then == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-dir")
    ap.add_argument("--then", default="")
    generate_and_save_hidden_states(ap.parse_args(), None)
'''


@pytest.mark.parametrize("then, code", [("", 0), ("sigint", 130), ("sigterm", 143)])
def test_runner_repairs_the_folder_then_exits_130_or_143_on_an_interrupt(tmp_path, then, code):
    script = tmp_path / "data_generation_offline.py"
    script.write_text(STOCK_LIKE)
    out = folder_with(tmp_path, 4, config=False)
    (out / "data_2.pt").write_bytes(b"truncated")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "speculators_compat.run", str(script), "--output-dir", str(out), "--then", then],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60,
    )
    assert proc.returncode == code, proc.stderr
    assert "resumed at 1" in proc.stdout  # data_2 unreadable, and no config: data_1 is redone
    assert "output folder" in proc.stderr and "resuming at data_1.pt" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["data_0.pt", "data_1.pt", "data_config.json",
                                                     "speculators_compat_manifest.json"]
    runs = json.loads((out / "speculators_compat_manifest.json").read_text())["runs"]
    status = {0: "finished", 130: "interrupted by SIGINT", 143: "interrupted by SIGTERM"}[code]
    assert [(r["status"], r["generators"]) for r in runs] == [(status, [])]
    assert runs[0]["versions"]["speculators_compat"] and runs[0]["started"] <= runs[0]["ended"]
    if code:
        signame = "SIGINT (Ctrl-C)" if code == 130 else "SIGTERM"
        assert f"interrupted by {signame}: no live generator to stop; exit code {code}" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_runner_refuses_a_script_that_looks_stock_but_saves_differently(tmp_path):
    script = tmp_path / "data_generation_offline.py"
    script.write_text(STOCK_LIKE.replace("return max_index + 1", "return max_index"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_COMPAT_")}
    cmd = [sys.executable, "-m", "speculators_compat.run", str(script), "--output-dir", str(tmp_path / "o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 1
    assert "find_last_checkpoint() does not resume at max(index) + 1" in proc.stderr
    assert "SPECULATORS_COMPAT_DISABLE=resume" in proc.stderr
    env["SPECULATORS_COMPAT_DISABLE"] = "resume"
    (tmp_path / "o").mkdir()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 0 and "resumed at -1" in proc.stdout and "output folder" not in proc.stderr


def test_sample_lengths_of_the_04_script_are_completed_for_the_kept_samples(tmp_path):
    torch = pytest.importorskip("torch")
    out = tmp_path / "out"
    out.mkdir()
    for i, n in enumerate([5, 9, 3, 7]):
        torch.save({"input_ids": torch.arange(n), "hidden_states": [torch.zeros(n, 4)]}, out / f"data_{i}.pt")
    (out / "sample_lengths.json").write_text(json.dumps({"1": 9, "3": 7, "12": 4}))
    assert resume.rebuild_lengths(out, 3) == 2  # 0 and 2 were missing; 3 and 12 will be written again
    assert json.loads((out / "sample_lengths.json").read_text()) == {"0": 5, "1": 9, "2": 3}
    assert resume.rebuild_lengths(out, 3) == 0
    (out / "sample_lengths.json").write_text("{\"0\": 5, \"1")  # cut short by a kill
    assert resume.rebuild_lengths(out, 4) == 4
    assert json.loads((out / "sample_lengths.json").read_text()) == {"0": 5, "1": 9, "2": 3, "3": 7}


def test_shared_memory_a_killed_run_left_is_removed_by_the_next_run(tmp_path):
    from multiprocessing import resource_tracker, shared_memory

    from speculators_compat.services import leftovers

    out = tmp_path / "out"
    out.mkdir()
    recorder = leftovers.Recorder(out)
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        recorder.poll()  # what the recording thread does every half second
        assert shm.name in json.loads((out / leftovers.RECORD).read_text())
        # the run is killed outright: nobody unlinks the segment, the record stays
        assert leftovers.clean(out) == [shm.name]
        assert not os.path.exists(f"/dev/shm/{shm.name}") and not (out / leftovers.RECORD).exists()
        assert leftovers.clean(out) == []
    finally:
        shm.close()
        try:
            shm.unlink()
        except FileNotFoundError:
            resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - removed above


def test_a_run_that_ends_normally_leaves_no_record(tmp_path):
    from speculators_compat.services import leftovers

    recorder = leftovers.Recorder(tmp_path, interval=0.05).start()
    (tmp_path / leftovers.RECORD).write_text('["psm_0"]')  # as if something had been recorded
    recorder.stop()
    assert not (tmp_path / leftovers.RECORD).exists()


SPAWNING_SCRIPT = '''
import sys
# what a stock script's top-level "import speculators" would find: the hooks armed or not
ARMED = "speculators_compat" in sys.modules


def child(queue):
    import __main__
    queue.put(__main__.ARMED)


if __name__ == "__main__":
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its workers
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    print("child re-imported the script with the hooks armed:", queue.get(timeout=120))
    proc.join()
'''


def test_a_process_spawned_from_a_runner_script_imports_the_script_with_the_hooks_armed(tmp_path):
    # vLLM's workers are spawned: the child re-imports the script before vLLM loads its plugins
    script = tmp_path / "spawner.py"
    script.write_text(SPAWNING_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "speculators_compat.run", str(script)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hooks armed: True" in out.stdout
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path, env=env)
    assert "hooks armed: False" in plain.stdout  # without the runner: what the test guards against


def test_the_start_up_hook_runs_a_shadowed_sitecustomize(tmp_path):
    from speculators_compat.core import children

    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE'] = 'ran'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([children.BOOTSTRAP, str(other)]))
    out = subprocess.run([sys.executable, "-c", "import os, sys; print('speculators_compat' in sys.modules, "
                          "os.environ.get('OTHER_SITECUSTOMIZE'))"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.stdout.split() == ["True", "ran"], out.stderr[-2000:]


SPAWNER = '''
import os, sys
ARMED = "speculators_compat" in sys.modules  # what a top-level "import speculators" would find


def child(queue):
    import __main__
    queue.put((__main__.ARMED, os.environ.get("OTHER")))


if __name__ == "__main__":
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # as vLLM starts its workers
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    armed, other = queue.get(timeout=120)
    print("child armed:", armed)
    print("child sitecustomize:", other)
    proc.join()
'''

IMPORT_FIRST = '''
import os, runpy, sys
import speculators_compat
if sys.argv[1] == "revert":
    speculators_compat.revert()
print("PYTHONPATH:", os.environ.get("PYTHONPATH"))
sys.argv = [sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.parametrize("revert", [False, True])
def test_import_first_arms_the_processes_multiprocessing_spawns(tmp_path, revert):
    """``import speculators_compat`` first, then the script (no runner): a spawned child re-imports
    the script with the hooks armed; a ``sitecustomize`` and the ``PYTHONPATH`` entries already
    there are kept; ``revert()`` takes the hook off again and leaves ``PYTHONPATH`` as it was."""
    import speculators_compat
    from speculators_compat.core import children

    script = tmp_path / "spawner.py"
    script.write_text(SPAWNER)
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(IMPORT_FIRST)
    other = tmp_path / "other"
    other.mkdir()
    # the user's own sitecustomize: it must still run, in the parent and in the spawned child
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER'] = os.environ.get('OTHER', '') + 'ran'\n")
    # the folder holding the package this test imported: the child imports the same copy
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(speculators_compat.__file__)))
    before = os.pathsep.join([str(other), package_root])
    env = dict(os.environ, PYTHONPATH=before)
    env.pop("OTHER", None)
    out = subprocess.run([sys.executable, str(wrapper), "revert" if revert else "keep", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    if revert:
        assert lines["PYTHONPATH"] == before
        assert lines["child armed"] == "False"
    else:
        assert lines["PYTHONPATH"] == os.pathsep.join([children.BOOTSTRAP, before])
        assert lines["child armed"] == "True"
    # the parent ran the user's sitecustomize ("ran", inherited), the child ran it again
    assert lines["child sitecustomize"] == "ranran"


def test_arm_and_disarm_keep_what_was_there(monkeypatch):
    from speculators_compat.core import children

    monkeypatch.setattr(children, "_added", [])
    monkeypatch.setattr(children, "_was_set", [])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    added = children.arm()
    assert added[0] == children.BOOTSTRAP and os.environ["PYTHONPATH"].split(os.pathsep) == added
    assert children.arm() == [] and children.armed()
    children.disarm()
    assert "PYTHONPATH" not in os.environ and not children.armed()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/a", "/b"]))
    children.arm()
    assert os.environ["PYTHONPATH"].split(os.pathsep)[-2:] == ["/a", "/b"]
    children.disarm()
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/a", "/b"])
