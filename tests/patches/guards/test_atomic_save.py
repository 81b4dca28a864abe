"""atomic-save: its wrapper of ``Path.write_text`` writes into a protected folder through a temporary
file, and anywhere else through the original call (the folder's protection itself is tested in
tests/run/test_resume.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators_compat.services import atomic


#: where this patch is shown needed (tests/test_e2e.py reads it)
SHOWN_NEEDED = {
    "atomic-save": (
        "tests/test_crash_resume.py (the stock code alone keeps a truncated file; five random kills end "
        "in the clean dataset)"
    ),
}


def test_the_atomic_save_wrapper_of_path_write_text(tmp_path):
    from speculators_compat.patches.guards.atomic_save import _path_write

    out = tmp_path / "out"
    out.mkdir()
    atomic.protect(out)
    try:
        seen = []

        def wrapped(data):  # what wrapt passes: the bound original, here a recorder
            seen.append(data)

        config = out / "data_config.json"
        _path_write(Path.write_text.__get__(config), config, ("{}",), {})
        assert config.read_text() == "{}" and seen == []  # written through a temporary file
        other = tmp_path / "elsewhere.json"
        _path_write(wrapped, other, ("x",), {})
        assert seen == ["x"]  # outside the folder: the original call
    finally:
        atomic.unprotect()
    assert sorted(p.name for p in out.iterdir()) == ["data_config.json"]


def _sample(torch, length=37, hidden=24):
    """A sample of the stock script's shape: 4 bf16 layers (one a view into a larger storage,
    one empty-length-safe), int64 ids and mask."""
    big = torch.randn(length * 2, hidden).to(torch.bfloat16)
    return {"input_ids": torch.arange(length), "loss_mask": torch.ones(length, dtype=torch.long),
            "hidden_states": [torch.randn(length, hidden).to(torch.bfloat16), big[length:],
                              torch.randn(length, hidden, dtype=torch.float32), torch.zeros(0, hidden)]}


def test_the_direct_writer_writes_what_torch_load_reads_back(tmp_path):
    """The direct writer's archive loads with plain ``torch.load`` (weights_only) into tensors equal
    to the saved ones, views and an empty tensor included, and holds the same records as
    ``torch.save``'s archive of the same object."""
    import zipfile

    import pytest

    torch = pytest.importorskip("torch")
    from speculators_compat.patches.guards import atomic_save

    if atomic_save.direct_writer_fits(torch):
        pytest.skip(f"this torch: {atomic_save.direct_writer_fits(torch)}")
    sample = _sample(torch)
    with open(tmp_path / "a.pt", "wb") as f:
        atomic_save._direct_save(sample, f.fileno(), tmp_path / "a.pt")
    torch.save(sample, tmp_path / "a_ref.pt")
    got = torch.load(tmp_path / "a.pt", weights_only=True)
    assert torch.equal(got["input_ids"], sample["input_ids"]) and torch.equal(got["loss_mask"], sample["loss_mask"])
    assert len(got["hidden_states"]) == 4
    for a, b in zip(got["hidden_states"], sample["hidden_states"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    def records(path):
        with zipfile.ZipFile(path) as z:
            return [(i.filename.split("/", 1)[1], i.file_size) for i in z.infolist()]

    assert records(tmp_path / "a.pt") == records(tmp_path / "a_ref.pt")
    # the runner's own reader (resume, verify) reads data.pkl through zipfile, which checks its CRC-32
    from speculators_compat.run import ptfile, resume

    assert resume.check_sample(tmp_path / "a.pt") is None
    layout = ptfile.read(tmp_path / "a.pt")
    assert [t.shape for t in layout["hidden_states"]] == [tuple(t.shape) for t in sample["hidden_states"]]
    with zipfile.ZipFile(tmp_path / "a.pt") as z:
        bad = z.testzip()
    assert bad is None or "/data/" in bad  # only the tensors' records carry no CRC-32


def test_a_protected_torch_save_goes_through_the_direct_writer_and_the_switch_turns_it_off(tmp_path, monkeypatch):
    """``torch.save(obj, path)`` into a protected folder: written by the direct writer (record CRCs
    0), atomically (no temporary file left), loadable; with ``SPECULATORS_COMPAT_SAVE_WRITER=torch``
    and with any other argument: by ``torch.save`` itself (CRCs set)."""
    import zipfile

    import pytest

    torch = pytest.importorskip("torch")
    from speculators_compat.patches.guards import atomic_save

    if atomic_save.direct_writer_fits(torch):
        pytest.skip(f"this torch: {atomic_save.direct_writer_fits(torch)}")
    monkeypatch.setattr(atomic_save, "_direct", [True])
    out = tmp_path / "out"
    out.mkdir()
    sample = _sample(torch)

    def crcs(path):
        with zipfile.ZipFile(path) as z:
            return {i.CRC for i in z.infolist() if "/data/" in i.filename and i.file_size}

    atomic.protect(out)
    try:
        atomic_save._torch_save(torch.save, None, (sample, out / "data_0.pt"), {})
        monkeypatch.setenv(atomic_save.WRITER_ENV, "torch")
        atomic_save._torch_save(torch.save, None, (sample, out / "data_1.pt"), {})
        monkeypatch.delenv(atomic_save.WRITER_ENV)
        atomic_save._torch_save(torch.save, None, (sample, out / "data_2.pt"), {"pickle_protocol": 2})
        atomic.flush()  # the committer's fsyncs and renames
    finally:
        atomic.unprotect()
    assert sorted(p.name for p in out.iterdir()) == ["data_0.pt", "data_1.pt", "data_2.pt"]
    assert crcs(out / "data_0.pt") == {0}
    assert 0 not in crcs(out / "data_1.pt") and 0 not in crcs(out / "data_2.pt")
    for i in range(3):
        got = torch.load(out / f"data_{i}.pt", weights_only=True)
        assert all(torch.equal(a, b) for a, b in zip(got["hidden_states"], sample["hidden_states"]))


def test_a_direct_save_is_one_pwritev_on_the_file_it_created(tmp_path, monkeypatch):
    """The direct writer makes a sample's file with one ``os.pwritev`` on the descriptor it created
    (each system call made from Python ends in a wait for the GIL, held by vLLM's driver): no
    second ``open()``, no ``pwrite`` a storage, no chmod; the file gets the mode a plain
    ``open()`` gives, and it is renamed once the committer has it on the disk."""
    import os
    import stat

    torch = pytest.importorskip("torch")
    from speculators_compat.patches.guards import atomic_save

    if atomic_save.direct_writer_fits(torch):
        pytest.skip(f"this torch: {atomic_save.direct_writer_fits(torch)}")
    monkeypatch.setattr(atomic_save, "_direct", [True])
    calls = []
    for name in ("pwritev", "pwrite", "write", "open", "chmod", "fchmod"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    out = tmp_path / "out"
    out.mkdir()
    sample = _sample(torch, length=300, hidden=64)
    atomic.protect(out)
    try:
        atomic_save._torch_save(torch.save, None, (sample, out / "data_0.pt"), {})
        saved = list(calls)
        atomic.flush()
    finally:
        atomic.unprotect()
    assert saved == ["open", "pwritev"], saved  # the temporary file's creation, then its bytes
    got = torch.load(out / "data_0.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(got["hidden_states"], sample["hidden_states"]))
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((out / "data_0.pt").stat().st_mode) == 0o666 & ~umask


@pytest.mark.parametrize("most", [7, 4096])
def test_pwritev_all_writes_every_buffer_in_order_through_short_writes(tmp_path, monkeypatch, most):
    """``os.pwritev`` may write less than asked, and takes at most ``IOV_MAX`` buffers: the rest
    follows, in order, from where it stopped."""
    import os

    from speculators_compat.patches.guards import atomic_save

    real = os.pwritev

    def short(fd, buffers, offset):
        left, taken = most, []
        for b in buffers:
            taken.append(bytes(b[:left]))
            left -= len(taken[-1])
            if not left:
                break
        return real(fd, taken, offset)

    monkeypatch.setattr(os, "pwritev", short)
    monkeypatch.setattr(atomic_save, "_IOV_MAX", 3)
    buffers = [os.urandom(n) for n in (1, 0, 300, 5, 4000, 17, 2)]
    with open(tmp_path / "f", "wb") as f:
        atomic_save._pwritev_all(f.fileno(), [bytearray(b) for b in buffers])
    assert (tmp_path / "f").read_bytes() == b"".join(buffers)


def test_an_archive_whose_holes_do_not_match_its_storages_is_refused(tmp_path):
    """Each hole the zip writer left must be its storage's size, in order: else the save fails
    (a ``RuntimeError``, raised as a failed save) rather than write a wrong file."""
    torch = pytest.importorskip("torch")
    from speculators_compat.patches.guards import atomic_save

    archive = atomic_save._Archive()
    archive.write(b"head")
    archive.seek(8, 1)
    archive.write(b"tail")
    storage = torch.arange(3, dtype=torch.int32).untyped_storage()  # 12 bytes, not 8
    with pytest.raises(RuntimeError, match="holes of \\[8\\] bytes"):
        atomic_save._layout(archive, [("data/0", storage, 12)], tmp_path / "data_0.pt")
    with pytest.raises(OSError, match="expected a hole"):
        archive.seek(0)


def test_a_torch_whose_writer_does_not_leave_holes_as_seeks_gets_torch_save(monkeypatch):
    """The direct writer relies on torch's zip writer leaving a record written without its data as
    a ``seek`` of the file object: a torch that writes it otherwise fails the trial sample, and
    ``direct_writer_fits`` names why (the patch then saves through ``torch.save``)."""
    torch = pytest.importorskip("torch")
    from speculators_compat.patches.guards import atomic_save

    if atomic_save.direct_writer_fits(torch):
        pytest.skip(f"this torch: {atomic_save.direct_writer_fits(torch)}")

    def zeros_instead(self, offset, whence=0):  # as a writer that fills the hole would
        self.write(bytes(offset))
        return self.size

    monkeypatch.setattr(atomic_save._Archive, "seek", zeros_instead)
    why = atomic_save.direct_writer_fits(torch)
    assert why and "does not load back" in why and "holes" in why, why


def test_a_failed_save_stops_the_next_generate_call_with_its_error(tmp_path):
    """A save into the protected folder that fails (here the writer raises ENOSPC) is re-raised to its caller as before, and the next
    ``generate()`` raises ``SaveFailedError``: an ``OSError`` with the same errno and file name,
    the original as its ``__cause__``, before the stock call runs. Fails on the code that only
    re-raised it in the save's future."""
    import errno

    import pytest

    from speculators_compat.patches.guards import atomic_save

    out = tmp_path / "out"
    out.mkdir()
    calls = []

    def full_disk(obj, f, *a, **k):
        calls.append(f)
        raise OSError(errno.ENOSPC, "No space left on device", f)

    def stock_generate(*a, **k):
        calls.append("generate")
        return "rows"

    atomic.clear_failures()
    atomic.protect(out)
    try:
        assert atomic_save._generate(stock_generate, None, (), {}) == "rows"
        with pytest.raises(OSError) as raised:
            atomic_save._torch_save(full_disk, None, ({"x": 1}, out / "data_0.pt"), {"pickle_protocol": 2})
        assert raised.value.errno == errno.ENOSPC
        with pytest.raises(atomic.SaveFailedError) as stopped:
            atomic_save._generate(stock_generate, None, (), {})
        with pytest.raises(OSError):
            atomic_save._generate(stock_generate, None, (), {})  # every later call too
    finally:
        atomic.unprotect()
        atomic.clear_failures()
    assert calls.count("generate") == 1
    err = stopped.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename == str(out / "data_0.pt")
    assert err.__cause__ is raised.value and "data_0.pt" in str(err) and "No space left" in str(err)
    assert list(out.iterdir()) == []  # the temporary file is gone, nothing under the final name


@pytest.mark.parametrize("durable", ["syncfs", "fsync", "fuse"])
def test_the_committer_renames_a_sample_only_once_on_the_disk_and_a_failed_sync_stops_the_next_call(
        tmp_path, monkeypatch, durable):
    """A protected ``torch.save`` hands its temporary file to the committer: after :func:`flush` it
    has its final name, and was made durable before the rename -- by one ``syncfs`` of its
    local filesystem a batch (Linux 5.8+), or else by an fsync of the file (``durable="fsync"``: no
    usable ``syncfs``; ``"fuse"``: a filesystem whose ``syncfs`` is not trusted); ``Path.write_text`` into the folder (``data_config.json``, through
    ``atomic_path``) comes after the samples; a sync that fails there (a ``syncfs`` error, then the
    file's own fsync) leaves nothing under the final name, and the next ``generate()`` raises
    ``SaveFailedError`` with its errno. With ``SPECULATORS_COMPAT_SAVE_SYNC=file`` the save itself
    renames its file."""
    import errno
    import os

    from speculators_compat.patches.guards import atomic_save

    out = tmp_path / "out"
    out.mkdir()
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else str(fd)
        events.append(("fsync", os.path.basename(name)))
        if "data_bad" in name:
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    def syncfs(fd):
        events.append(("syncfs", os.readlink(f"/proc/self/fd/{fd}")))
        os.sync()
        return -1 if any(p.name.startswith(".data_bad") for p in out.iterdir()) else 0

    def replace(src, dst):
        events.append(("rename", os.path.basename(str(src)), os.path.basename(str(dst))))
        return real_replace(src, dst)

    def plain_save(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"x" * 100)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(atomic, "_syncfs", [None if durable == "fsync" else syncfs])
    monkeypatch.setattr(atomic, "_filesystems", {})
    monkeypatch.setattr(atomic, "filesystem_type", lambda folder: "fuse.gcsfuse" if durable == "fuse" else "ext4")
    atomic.clear_failures()
    atomic.protect(out)
    try:
        for i in range(3):
            atomic_save._torch_save(plain_save, None, ({}, out / f"data_{i}.pt"), {"pickle_protocol": 2})
        atomic.write_text(out / "data_config.json", "{}")  # as the patched Path.write_text
        names = sorted(p.name for p in out.iterdir())
        assert names == ["data_0.pt", "data_1.pt", "data_2.pt", "data_config.json"]
        for i in range(3):  # each sample on the disk (under its temporary name) before its rename
            rename = next(k for k, e in enumerate(events) if e[0] == "rename" and e[2] == f"data_{i}.pt")
            tmp = events[rename][1]
            if durable == "syncfs":
                assert ("syncfs", str(out)) in events[:rename]
                assert ("fsync", tmp) not in events  # the batch's syncfs, not an fsync a file
            else:
                assert ("fsync", tmp) in events[:rename]
                assert not any(e[0] == "syncfs" for e in events)
        config = next(k for k, e in enumerate(events) if e[0] == "rename" and e[2] == "data_config.json")
        assert all(k < config for k, e in enumerate(events) if e[0] == "rename" and e[2].endswith(".pt"))

        atomic_save._torch_save(plain_save, None, ({}, out / "data_bad.pt"), {"pickle_protocol": 2})
        atomic.flush(raise_failed=False)
        assert not any(p.name.startswith(("data_bad", ".data_bad")) for p in out.iterdir())
        with pytest.raises(atomic.SaveFailedError) as stopped:
            atomic_save._generate(lambda: "rows", None, (), {})
        assert stopped.value.errno == errno.EIO and stopped.value.filename == str(out / "data_bad.pt")
        with pytest.raises(atomic.SaveFailedError):
            atomic.flush()
        atomic.clear_failures()

        monkeypatch.setenv(atomic.SYNC_ENV, "file")
        events.clear()
        atomic_save._torch_save(plain_save, None, ({}, out / "data_3.pt"), {"pickle_protocol": 2})
        assert (out / "data_3.pt").exists() and events[-1][0] == "rename"
    finally:
        atomic.unprotect()
        atomic.clear_failures()


def test_writers_wait_while_the_committer_holds_max_pending_files(tmp_path, monkeypatch):
    """The committer's queue is bounded: with ``MAX_PENDING`` files handed over and not yet renamed
    (the committer stuck in a slow sync), the next save waits instead of leaving one more temporary
    file on the disk, and goes on once the committer takes the queue."""
    import threading

    from speculators_compat.patches.guards import atomic_save

    out = tmp_path / "out"
    out.mkdir()
    release, syncing = threading.Event(), threading.Event()

    def slow_syncfs(fd):
        syncing.set()
        release.wait(30)
        return 0

    def plain_save(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"x" * 10)

    monkeypatch.setattr(atomic, "MAX_PENDING", 2)
    monkeypatch.setattr(atomic, "_syncfs", [slow_syncfs])
    monkeypatch.setattr(atomic, "_filesystems", {str(out): "ext4"})
    atomic.clear_failures()
    atomic.protect(out)
    saved = []

    def save(i):
        atomic_save._torch_save(plain_save, None, ({}, out / f"data_{i}.pt"), {"pickle_protocol": 2})
        saved.append(i)

    try:
        save(0)
        assert syncing.wait(10)  # the committer took data_0 and is stuck in its sync
        save(1)
        save(2)  # the queue is full now: two files wait behind the batch being synced
        late = threading.Thread(target=save, args=(3,), daemon=True)
        late.start()
        late.join(0.5)
        assert late.is_alive() and saved == [0, 1, 2]  # data_3 waits: no third temporary file queued
        assert len(atomic._pending) == 2  # data_1, data_2 queued; data_0 in the batch being synced
        assert sum(p.name.endswith(".tmp") for p in out.iterdir()) == 4  # and data_3 written, waiting to queue
        release.set()
        late.join(10)
        assert not late.is_alive() and saved == [0, 1, 2, 3]
        atomic.flush()
        assert sorted(p.name for p in out.iterdir()) == [f"data_{i}.pt" for i in range(4)]
    finally:
        release.set()
        atomic.unprotect()
        atomic.clear_failures()


def test_the_filesystem_of_a_folder_is_read_from_mountinfo(tmp_path):
    """The committer trusts ``syncfs`` on local filesystems only: the type of the innermost mount
    holding the folder (octal escapes in mount points decoded), ``None`` where mountinfo is
    unreadable."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / / rw,relatime - ext4 /dev/vda rw\n"
        "23 22 0:22 / /data rw,relatime shared:1 - xfs /dev/vdb rw\n"
        "24 23 0:23 / /data/my\\040bucket rw,nosuid - fuse.gcsfuse bucket rw,user_id=0\n"
        "25 22 0:24 / /dev/shm rw - tmpfs tmpfs rw\n")
    got = {folder: atomic.filesystem_type(folder, str(mountinfo))
           for folder in ("/work/out", "/data", "/data/out", "/data/my bucket/out", "/data/my", "/dev/shm")}
    assert got == {"/work/out": "ext4", "/data": "xfs", "/data/out": "xfs", "/data/my bucket/out": "fuse.gcsfuse",
                   "/data/my": "xfs", "/dev/shm": "tmpfs"}
    assert atomic.filesystem_type("/data", str(tmp_path / "absent")) is None
    assert "fuse.gcsfuse" not in atomic.SYNCFS_FILESYSTEMS and "ext4" in atomic.SYNCFS_FILESYSTEMS


@pytest.mark.parametrize("writer", ["direct", "torch"])
def test_a_save_whose_zip_writer_fails_raises_an_os_error_and_the_process_lives_on(tmp_path, writer):
    """A save that hits a full disk (here a file-size limit) raises an ``OSError``, recorded as a
    failed save, and the process goes on. torch's zip writer (``SPECULATORS_COMPAT_SAVE_WRITER=torch``)
    fails with a ``RuntimeError`` without an errno, raised as EIO (the filesystem is not full; the
    writer's error its cause; a writer destroyed unfinished would write the archive's end in its
    destructor, where a second failure aborts the process: ``std::terminate``, exit 134). The direct
    writer's ``pwritev`` fails with the system's error (EFBIG here, ENOSPC on a full disk)."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    script = """
import gc, os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
import torch
from speculators_compat.patches.guards import atomic_save
from speculators_compat.services import atomic
atomic_save._direct[:] = [atomic_save.direct_writer_fits(torch) is None]
print("direct", atomic_save._direct[0])
os.environ[atomic_save.WRITER_ENV] = sys.argv[2]
out = sys.argv[1]
atomic.protect(out)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    atomic_save._torch_save(torch.save, None, ({"meta": "x" * 100000, "t": torch.zeros(10)},
                                               os.path.join(out, "data_0.pt")), {})
except OSError as error:
    print("raised", type(error).__name__, error.errno, type(error.__cause__).__name__)
gc.collect()
try:
    atomic.raise_if_failed()
except atomic.SaveFailedError as error:
    print("recorded", error.errno)
print("alive", sorted(os.listdir(out)))
"""
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", script, str(out), writer], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "direct True" in proc.stdout, proc.stdout
    if writer == "torch":
        assert "raised OSError 5 RuntimeError" in proc.stdout and "recorded 5" in proc.stdout, proc.stdout
    else:
        assert "raised OSError 27 NoneType" in proc.stdout and "recorded 27" in proc.stdout, proc.stdout
    assert "alive []" in proc.stdout, proc.stdout


def test_a_zip_writer_failure_is_enospc_on_a_full_filesystem_else_eio(monkeypatch, tmp_path):
    """The ``OSError`` a failure of torch's zip writer becomes: ENOSPC where the folder's filesystem
    has less than ``FULL_BELOW`` bytes left (the runner's full-disk message then), else EIO; torch's
    message kept, the final name as the file name."""
    import errno
    import os

    from speculators_compat.patches.guards import atomic_save

    class Stat:
        f_bfree = f_bavail = 3
        f_frsize = 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Stat)
    error = atomic_save._as_os_error(RuntimeError("unexpected pos 1088 vs 982"), tmp_path / "data_1.pt")
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC, error
    assert "unexpected pos 1088 vs 982" in str(error) and error.filename == str(tmp_path / "data_1.pt")
    Stat.f_bfree = Stat.f_bavail = atomic_save.FULL_BELOW // Stat.f_frsize + 1
    assert atomic_save._as_os_error(RuntimeError("boom"), tmp_path / "data_1.pt").errno == errno.EIO


def test_a_committer_that_fails_unexpectedly_fails_its_batch_and_commits_the_next(tmp_path, monkeypatch):
    """An error in the committer other than the disk's (a bug) must not lose its batch silently: the
    batch's samples are recorded as failed (EIO, the error named), so the next ``generate()`` stops
    the run; the committer lives on for the next batch."""
    import errno

    from speculators_compat.patches.guards import atomic_save

    out = tmp_path / "out"
    out.mkdir()
    calls = []

    def broken_once(folder):
        calls.append(folder)
        if len(calls) == 1:
            raise TypeError("a bug")
        return False

    def plain_save(obj, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"x" * 10)

    monkeypatch.setattr(atomic, "_sync_filesystem", broken_once)
    atomic.clear_failures()
    atomic.protect(out)
    try:
        atomic_save._torch_save(plain_save, None, ({}, out / "data_0.pt"), {"pickle_protocol": 2})
        atomic.flush(raise_failed=False)
        with pytest.raises(atomic.SaveFailedError) as stopped:
            atomic_save._generate(lambda: "rows", None, (), {})
        assert stopped.value.errno == errno.EIO and "a bug" in str(stopped.value)
        assert stopped.value.filename == str(out / "data_0.pt")
        atomic.clear_failures()
        atomic_save._torch_save(plain_save, None, ({}, out / "data_1.pt"), {"pickle_protocol": 2})
        atomic.flush()
        assert (out / "data_1.pt").exists() and not (out / "data_0.pt").exists()
    finally:
        atomic.unprotect()
        atomic.clear_failures()


class _Rows:
    """A stand-in for a call's result tensor (the holds cover objects by identity, weakly)."""


def _save_in_thread(atomic_save, obj, path):
    """One save as the stock script's pool makes it: on a thread of its own (which never decides holds)."""
    import threading

    def plain_save(o, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"x" * 10)

    t = threading.Thread(target=atomic_save._torch_save, args=(plain_save, None, (obj, path), {"pickle_protocol": 2}))
    t.start()
    t.join(10)
    assert not t.is_alive()


def test_held_samples_get_their_names_once_released_and_are_removed_if_refused(tmp_path, monkeypatch):
    """A sample holding an object under a hold waits, as a temporary file, for the hold: renamed
    once it is released, removed if it is refused. The maker's thread decides it when it next waits
    for the committer; an error no caller was given (decided by ``flush``) is raised by ``flush`` and
    stops the stock script's ``Path.write_text`` into the folder (not the runner's own writes); one
    the maker reported itself is not raised again."""
    import time

    from speculators_compat.patches.guards import atomic_save

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.delenv(atomic.SYNC_ENV, raising=False)
    a, b, other = _Rows(), _Rows(), _Rows()
    assert atomic.hold([a], lambda: None) is None  # no protected folder: nothing can wait for it
    atomic.clear_failures()
    atomic.protect(out)
    decided = []
    try:
        released = atomic.hold([a], lambda: decided.append("a"))
        _save_in_thread(atomic_save, {"hidden_states": [a], "input_ids": other}, out / "data_0.pt")
        _save_in_thread(atomic_save, {"hidden_states": [other]}, out / "data_1.pt")  # not covered
        deadline = time.monotonic() + 10
        while not (out / "data_1.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        names = sorted(p.name for p in out.iterdir())
        assert "data_1.pt" in names and "data_0.pt" not in names and decided == []  # data_0 waits
        assert atomic.hold_of({"x": [a]}) is released and atomic.hold_of([other]) is None
        atomic.flush()  # this thread made the hold: decided here, released
        assert decided == ["a"] and sorted(p.name for p in out.iterdir()) == ["data_0.pt", "data_1.pt"]

        refused = atomic.hold([b], lambda: RuntimeError("call 1: rows wrong"))
        _save_in_thread(atomic_save, {"hidden_states": [b]}, out / "data_2.pt")
        assert isinstance(refused.settle(), RuntimeError)  # the maker reports it (generate() raises it)
        atomic.flush()  # not raised again here
        assert sorted(p.name for p in out.iterdir()) == ["data_0.pt", "data_1.pt"]  # data_2 removed

        last = atomic.hold([b], lambda: RuntimeError("call 2: rows wrong"))
        _save_in_thread(atomic_save, {"hidden_states": [b]}, out / "data_3.pt")
        config = out / "data_config.json"
        with pytest.raises(RuntimeError, match="call 2: rows wrong"):  # the stock script's config: not after it
            atomic_save._path_write(Path.write_text.__get__(config), config, ("{}",), {})
        with pytest.raises(RuntimeError, match="call 2"):
            atomic.flush()
        assert last.decided and sorted(p.name for p in out.iterdir()) == ["data_0.pt", "data_1.pt"]
        atomic.write_text(out / "manifest.json", "{}")  # the runner's own writes go on
        assert (out / "manifest.json").exists()
        monkeypatch.setenv(atomic.SYNC_ENV, "file")
        assert atomic.hold([b], lambda: None) is None  # every save renamed by its writer: nothing waits
    finally:
        atomic.unprotect()
        atomic.clear_failures()


def test_a_thread_whose_own_saves_fill_the_queue_decides_its_holds_instead_of_waiting(tmp_path, monkeypatch):
    """The thread that made a hold and saves itself (no pool) never waits on a committer that waits
    for that thread's decision: with the queue full it decides its holds first."""
    import threading

    from speculators_compat.patches.guards import atomic_save

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.delenv(atomic.SYNC_ENV, raising=False)
    monkeypatch.setattr(atomic, "MAX_PENDING", 1)
    atomic.clear_failures()
    atomic.protect(out)

    def plain_save(o, f, *a, **k):
        with open(f, "wb") as fh:
            fh.write(b"x")

    def run():
        rows = [_Rows() for _ in range(4)]
        for i, r in enumerate(rows):
            atomic.hold([r], lambda: None)
            atomic_save._torch_save(plain_save, None, ({"hidden_states": [r]}, out / f"data_{i}.pt"), {})
        atomic.flush()

    try:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the saving thread waits for a committer that waits for it"
        assert sorted(p.name for p in out.iterdir()) == [f"data_{i}.pt" for i in range(4)]
    finally:
        atomic.unprotect()
        atomic.clear_failures()
