"""atomic-save -- every file the stock script writes into a crash-safe output folder appears complete or not at all.

Problem: not a vLLM delta; the stock ``scripts/data_generation_offline.py`` (speculators 0.3.0,
0.4.x) saves each sample with ``torch.save(data, "<output-dir>/data_<i>.pt")`` on 4 threads
and writes ``data_config.json`` with ``Path.write_text``, both straight to the final name. A
run killed during a save leaves a truncated file under the final name, which its
``max(index) + 1`` resume counts as done, and which the trainer later fails to load (or
loads nothing useful from).

How: ``torch.save``, ``pathlib.Path.write_text`` and ``pathlib.Path.write_bytes`` are
wrapped. A write whose destination is a path directly inside a folder registered with
:func:`speculators_compat.services.atomic.protect` -- ``speculators-compat run`` registers the
stock script's ``--output-dir`` -- goes to a temporary file in the same folder
(``.<name>.<random>.tmp``), which is fsynced, given the permissions ``open()`` would give
it, and renamed over the final name (:func:`speculators_compat.services.atomic.atomic_path`). For
``torch.save`` the fsync and the rename are deferred: the save returns once the file is written and
its write-back started, and one committer thread makes the files durable and renames them in
batches (the saving threads do not wait for the disk one file at a time;
``SPECULATORS_COMPAT_SAVE_SYNC=file`` turns this off); ``Path.write_text`` (``data_config.json``)
waits for them first, and the runner waits for the last at the end of the run. A sample holding
a tensor under a :func:`~speculators_compat.services.atomic.hold` (``self-check``: a call whose
verdict is still to come) is renamed once it is released, and removed if it is refused. Any other
destination (a file object, another folder, every write when nothing is registered) goes through
unchanged. A kill leaves at most a temporary file, which the next run's resume sets aside.

Speed (the stock script saves on 4 threads; the run must keep up with the prefill or the disk):
``torch.save`` writes every tensor's bytes through its C++ zip writer while holding the GIL and
computing a CRC-32 of them, so the 4 threads save one at a time, at the speed of one core's
CRC; and each of its system calls, like any made from Python, ends in a wait for the GIL, which
vLLM's driver holds most of the time in the same process. A ``torch.save(obj, path)`` into the
protected folder with torch's defaults is therefore written by :func:`_direct_save`: torch's own
``_save`` writes the archive (the pickle, the records' headers, the central directory) into
memory, every storage's record left as a hole of its size (``write_record_metadata``, what
``torch.serialization.skip_data`` does); then the whole file -- those pieces with each storage's
bytes in its hole -- goes to the temporary file in one ``os.pwritev``, which releases the GIL once
(:func:`speculators_compat.services.atomic.atomic_file`: create, set the size, write, start the
write-back, close: five system calls a sample). The archive is the one ``torch.save`` writes,
except that the tensors' records carry no CRC-32 (0, as with
``torch.serialization.set_crc32_options(False)``): ``torch.load`` reads it (it does not check
them), the small records (``data.pkl``, ...) keep theirs, so the runner's resume and ``verify``
read it too; a zip tool's ``testzip`` reports the tensors' records.
``SPECULATORS_COMPAT_SAVE_WRITER=torch`` (read at each save) writes with ``torch.save`` itself
instead, and so does a save with other arguments, or a torch whose ``_save`` /
``PyTorchFileWriter`` have another shape or whose trial sample does not load back (found when the
patch applies).

Errors on time: the stock script looks at its save futures only after its last batch, so a save
that fails (a full disk, a permission) would surface hours later. A failed write into the folder
is recorded (:func:`speculators_compat.services.atomic.record_failure`) and re-raised as before (a
failure of torch's zip writer, a ``RuntimeError`` without an errno, as an ``OSError``: ENOSPC where
the filesystem is full, else EIO; a writer that failed is marked finished, since one destroyed
unfinished aborts the process); the generator's ``generate()`` is wrapped to raise it at its next call as
:class:`speculators_compat.services.atomic.SaveFailedError` (an ``OSError`` with the original's
``errno``; the original is its ``__cause__``), before any request is sent.

Detection: ``torch.save`` takes ``(obj, f, ...)``; ``Path.write_text`` / ``write_bytes``
take ``(data, ...)``; the generator defines ``generate``. The direct writer: ``torch.serialization._save``
takes ``(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)``,
``torch._C.PyTorchFileWriter`` has ``write_record_metadata`` (torch 2.6 and later) and, writing
into a file object, leaves a record written without its data as a ``seek`` (checked with a trial
sample that must load back equal); each hole's size is checked against its storage's before the
file is written. A guard that does not depend on the vLLM release: applied wherever its
probe finds these calls.

Covers: speculators 0.3.x and 0.4.x from vLLM 0.11.1 on (the same torch and stdlib calls on
every release).

Remove when the stock script saves atomically (not in speculators 0.3.0 - 0.4.x); the direct writer
when ``torch.save`` writes its records without holding the GIL.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import pathlib
import pickle

from speculators_compat.patching import Kind, Probe, declare

from .._ranges import SPECULATORS_ALL

log = logging.getLogger("speculators_compat.atomic_save")

#: ``SPECULATORS_COMPAT_SAVE_WRITER=torch``: protected saves through ``torch.save`` itself
WRITER_ENV = "SPECULATORS_COMPAT_SAVE_WRITER"
#: a failure of torch's zip writer with less than this left on the folder's filesystem is a full disk
FULL_BELOW = 16 << 20
#: torch's ``_save`` parameters the direct writer passes
_SAVE_PARAMS = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]
#: whether the direct writer can be used with this torch (set when the patch applies)
_direct: list[bool] = []
#: buffers a ``pwritev`` takes at most (Linux's ``IOV_MAX``)
_IOV_MAX = 1024


def _judge(save_params: list[str] | None) -> Probe:
    if not save_params or save_params[:2] != ["obj", "f"]:
        return Probe.unknown(f"torch.save takes {save_params}, expected (obj, f, ...)")
    for method in ("write_text", "write_bytes"):
        names = list(inspect.signature(getattr(pathlib.Path, method)).parameters)
        if names[:2] != ["self", "data"]:
            return Probe.unknown(f"pathlib.Path.{method} takes {names}, expected (self, data, ...)")
    return Probe.new("torch.save(obj, f) and Path.write_text/write_bytes(data): writes into the run's output folder are made atomic")


def probe(module) -> Probe:
    import torch

    return _judge(list(inspect.signature(torch.save).parameters))


def static_probe(view) -> Probe:
    from speculators_compat.patching import Sources

    params = Sources("torch").params("torch.serialization", "save")
    return _judge(list(params) if params else None)


def direct_writer_fits(torch) -> str | None:
    """``None`` if this torch's ``_save`` and zip writer have the shape :func:`_direct_save` uses,
    else what differs."""
    params = list(inspect.signature(torch.serialization._save).parameters)
    if params != _SAVE_PARAMS:
        return f"torch.serialization._save takes {params}, expected {_SAVE_PARAMS}"
    for name in ("write_record_metadata", "write_record", "write_end_of_file"):
        if not hasattr(torch._C.PyTorchFileWriter, name):
            return f"torch._C.PyTorchFileWriter has no {name}"
    if not callable(getattr(torch.serialization, "_get_storage_alignment", None)):
        return "torch.serialization has no _get_storage_alignment"
    return _trial(torch)


def _trial(torch) -> str | None:
    """``None`` if a small sample written the direct writer's way (in memory) loads back equal
    with ``torch.load``; else what went wrong."""
    import io

    sample = {"ids": torch.arange(5), "states": [torch.ones(3, 4, dtype=torch.bfloat16), torch.zeros(0)]}
    try:
        buffers = _archive_buffers(sample, "a trial sample")
        got = torch.load(io.BytesIO(b"".join(bytes(b) for b in buffers)), weights_only=True)
    except (RuntimeError, OSError, TypeError, ValueError, KeyError, pickle.UnpicklingError) as error:
        return f"a sample written by the direct writer does not load back ({error!r})"
    if not (torch.equal(got["ids"], sample["ids"]) and torch.equal(got["states"][0], sample["states"][0])):
        return "a sample written by the direct writer loads back different"
    return None


class _Holes:
    """The zip writer as ``torch.serialization._save`` sees it: a storage's record gets its header
    and a hole of its size; the storage is kept to be written into the hole afterwards."""

    def __init__(self, writer, storage_type) -> None:
        self._writer = writer
        self._storage_type = storage_type
        self.storages: list[tuple[str, object, int]] = []

    def write_record(self, name, data, size):
        if isinstance(data, self._storage_type):
            self.storages.append((name, data, size))
            return self._writer.write_record_metadata(name, size)
        return self._writer.write_record(name, data, size)

    def write_record_metadata(self, name, size):
        return self._writer.write_record_metadata(name, size)


class _Archive:
    """The file object torch's zip writer writes the archive into, in memory: its bytes as pieces,
    each storage's record a hole (the writer's ``seek(size, SEEK_CUR)`` for a record written
    without its data)."""

    def __init__(self) -> None:
        self.size = 0
        self.pieces: list[bytearray] = [bytearray()]  # the bytes before each hole, and after the last
        self.holes: list[int] = []

    def write(self, data) -> int:
        self.pieces[-1] += data
        self.size += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR or offset < 0:
            raise OSError(f"atomic-save: the zip writer seeks ({offset}, {whence}); expected a hole (n, SEEK_CUR)")
        self.holes.append(offset)
        self.pieces.append(bytearray())
        self.size += offset
        return self.size

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass


def _layout(archive: _Archive, storages: list, path) -> list:
    """The archive's buffers in file order, each hole filled with its storage's bytes (checked
    against the storage's size)."""
    import torch

    filled = [(name, storage, size) for name, storage, size in storages if size]
    if [size for _, _, size in filled] != archive.holes:
        raise RuntimeError(f"atomic-save: the archive of {path} has holes of {archive.holes} bytes, its storages "
                           f"{[size for _, _, size in filled]}")
    buffers = [archive.pieces[0]]
    for (name, storage, size), piece in zip(filled, archive.pieces[1:]):
        if storage.nbytes() != size:
            raise RuntimeError(f"atomic-save: record {name} of {path} holds {size} bytes, "
                               f"its storage {storage.nbytes()}")
        data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))
        buffers += [memoryview(data.numpy()).cast("B"), piece]
    return [b for b in buffers if len(b)]


def _pwritev_all(fd: int, buffers: list) -> None:
    """Write ``buffers`` one after the other from offset 0: the file's size set first (the bytes
    then go within it, as they did into torch's archive with holes), then one ``os.pwritev`` (the
    GIL released once) for as many buffers as the system takes at a time."""
    views = [memoryview(b).cast("B") for b in buffers]
    os.ftruncate(fd, sum(len(v) for v in views))
    at = offset = 0
    while at < len(views):
        done = os.pwritev(fd, views[at:at + _IOV_MAX], offset)
        if done <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += done
        while at < len(views) and done >= len(views[at]):
            done -= len(views[at])
            at += 1
        if done:
            views[at] = views[at][done:]


def _direct_save(obj, fd: int, path="") -> None:
    """``torch.save(obj, path)`` into ``fd`` (open for writing at offset 0): torch's ``_save`` writes
    the archive into memory with a hole a storage; then the whole file, each storage's bytes in
    its hole, goes to the file with ``os.pwritev`` (the GIL released; the module's docstring)."""
    _pwritev_all(fd, _archive_buffers(obj, path))


def _archive_buffers(obj, path) -> list:
    """``obj``'s archive as ``torch.save`` writes it (the storages' records without CRC-32), as
    buffers in file order: the pieces torch's zip writer wrote into memory and the storages."""
    import torch

    ser = torch.serialization
    archive = _Archive()
    # CRC-32 on: the small records (data.pkl, ...) get theirs; the storages, written later, get 0
    writer = torch._C.PyTorchFileWriter(archive, True, ser._get_storage_alignment())
    holes = _Holes(writer, torch.UntypedStorage)
    try:
        ser._save(obj, holes, pickle, ser.DEFAULT_PROTOCOL, False)
        writer.write_end_of_file()
    except BaseException:
        _finish_failed(writer)
        raise
    finally:
        del writer, holes._writer
    return _layout(archive, holes.storages, path)


def _finish_failed(writer) -> None:
    """Mark a writer whose archive failed (a full disk) as finished: one left unfinished writes the
    archive's end from its destructor, and a failure there aborts the process (``std::terminate``)."""
    try:
        writer.write_end_of_file()  # marks it finished even when it fails
    except RuntimeError:
        pass


def _as_os_error(error: RuntimeError, final) -> OSError:
    """A failure of torch's zip writer (a ``RuntimeError`` without an errno) as the ``OSError`` a
    failed save is: ENOSPC where the folder's filesystem has less than :data:`FULL_BELOW` bytes
    left, else EIO; the message keeps torch's."""
    try:
        st = os.statvfs(os.path.dirname(os.fspath(final)) or ".")
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    except (OSError, AttributeError):
        free = None
    code = errno.ENOSPC if free is not None and free < FULL_BELOW else errno.EIO
    return OSError(code, f"{os.strerror(code)} ({error})", os.fspath(final))


def _use_direct(args, kwargs) -> bool:
    """The direct writer for ``torch.save(obj, f)`` with torch's defaults only."""
    return (bool(_direct) and _direct[0] and len(args) + len(kwargs) == 2
            and os.environ.get(WRITER_ENV, "").strip().lower() != "torch")


def _torch_save(wrapped, instance, args, kwargs):
    from speculators_compat.patching import atomic

    in_kwargs = "f" in kwargs
    target = kwargs["f"] if in_kwargs else (args[1] if len(args) > 1 else None)
    final = atomic.protected(target)
    if final is None:
        return wrapped(*args, **kwargs)
    obj = args[0] if args else kwargs.get("obj")
    held = atomic.hold_of(obj)  # e.g. a call's rows whose self-check verdict is still to come
    try:
        try:
            if _use_direct(args, kwargs):
                with atomic.atomic_file(final, defer=True, held=held) as fd:
                    return _direct_save(obj, fd, final)
            with atomic.atomic_path(final, defer=True, held=held) as tmp:
                if in_kwargs:
                    return wrapped(*args, **{**kwargs, "f": tmp})
                return wrapped(args[0], tmp, *args[2:], **kwargs)
        except RuntimeError as error:  # torch's zip writer failed (e.g. the disk is full)
            raise _as_os_error(error, final) from error
    except OSError as error:
        atomic.record_failure(final, error)
        raise


def _generate(wrapped, instance, args, kwargs):
    """A save into the output folder failed since the last call: stop here, with that error."""
    from speculators_compat.patching import atomic

    atomic.raise_if_failed()
    return wrapped(*args, **kwargs)


def _path_write(wrapped, instance, args, kwargs):
    from speculators_compat.patching import atomic

    final = atomic.protected(instance)
    if final is None:
        return wrapped(*args, **kwargs)
    atomic.settle()  # e.g. data_config.json: not after samples whose rows were refused
    atomic.raise_refused()
    try:
        with atomic.atomic_path(final) as tmp:
            # the temporary name is never protected: this call goes straight to pathlib
            return getattr(type(instance)(tmp), wrapped.__name__)(*args, **kwargs)
    except OSError as error:
        atomic.record_failure(final, error)
        raise


def apply(module, patcher) -> None:
    import torch

    unfit = direct_writer_fits(torch)
    if unfit:
        log.info("atomic-save: saves through torch.save itself (%s)", unfit)
    _direct[:] = [unfit is None]
    patcher.wrap(torch, "save", _torch_save)
    patcher.wrap(module.VllmHiddenStatesGenerator, "generate", _generate)
    patcher.wrap(pathlib.Path, "write_text", _path_write)
    patcher.wrap(pathlib.Path, "write_bytes", _path_write)


PATCH = declare(
    id="atomic-save",
    title="atomic writes into the run's output folder",
    delta="torch.save / Path.write_text straight to the final name (truncated files after a kill), a failed save seen after the last batch -> temporary file (written in one pwritev outside the GIL), fsync, rename; the next generate() raises a failed save",
    api="torch.save / pathlib.Path.write_text / pathlib.Path.write_bytes / VllmHiddenStatesGenerator.generate",
    kind=Kind.GUARD,
    depends_on=(),
    after=("worker-death",),  # wraps generate() outermost: a failed save stops the call before anything runs
    vllm=">=0.11.1",
    speculators=SPECULATORS_ALL,
    upstream="not in speculators (0.3.0 - 0.4.x save straight to the final name)",
    remove_when="the stock script saves atomically",
)
