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
waits for them first, and the runner waits for the last at the end of the run. Any other
destination (a file object, another folder, every write when nothing is registered) goes through
unchanged. A kill leaves at most a temporary file, which the next run's resume sets aside.

Speed (the stock script saves on 4 threads; the run must keep up with the prefill or the disk):
``torch.save`` writes every tensor's bytes through its C++ zip writer while holding the GIL and
computing a CRC-32 of them, so the 4 threads save one at a time, at the speed of one core's
CRC. A ``torch.save(obj, path)`` into the protected folder with torch's defaults is therefore
written by :func:`_direct_save`: torch's own ``_save`` writes the archive (the pickle, the
records' headers, the central directory) with every storage's record left as a hole of its size
(``write_record_metadata``, what ``torch.serialization.skip_data`` does), then each storage's bytes
go into their hole with ``os.pwrite``, which releases the GIL. The archive is the one
``torch.save`` writes, except that the tensors' records carry no CRC-32 (0, as with
``torch.serialization.set_crc32_options(False)``): ``torch.load`` reads it (it does not check them),
the small records (``data.pkl``, ...) keep theirs, so the runner's resume and ``verify`` read it too;
a zip tool's ``testzip`` reports the tensors' records. ``SPECULATORS_COMPAT_SAVE_WRITER=torch`` (read at each save)
writes with ``torch.save`` itself instead, and so does a save with other arguments, or a torch whose
``_save`` / ``PyTorchFileWriter.write_record_metadata`` have another shape (found when the patch
applies).

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
takes ``(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)`` and
``torch._C.PyTorchFileWriter`` has ``write_record_metadata`` (torch 2.6 and later); each record's
size in the written archive is checked against its storage's before its bytes are written. A guard that does not depend on the vLLM release: applied wherever its
probe finds these calls.

Covers: speculators 0.3.x and 0.4.x from vLLM 0.11.1 on (the same torch and stdlib calls on
every release).

Remove when the stock script saves atomically (not in speculators 0.3.0 - 0.4.x); the direct writer
when ``torch.save`` writes its records without holding the GIL.
"""

from __future__ import annotations

import inspect
import logging
import os
import pathlib
import struct

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


def _data_offsets(path: str, names: list[str]) -> dict[str, tuple[int, int]]:
    """Each record's (data offset, size) in the zip archive at ``path`` (its local headers)."""
    import zipfile

    with zipfile.ZipFile(path) as z, open(path, "rb") as fh:
        infos = {info.filename.split("/", 1)[-1]: info for info in z.infolist()}
        offsets = {}
        for name in names:
            info = infos[name]
            fh.seek(info.header_offset)
            header = fh.read(30)
            if header[:4] != b"PK\x03\x04":
                raise OSError(f"{path}: record {name} has no local header at {info.header_offset}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            offsets[name] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return offsets


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)


def _direct_save(obj, path: str) -> None:
    """``torch.save(obj, path)``, the storages' bytes written with ``os.pwrite`` (the GIL released)
    and no CRC-32 for their records (the module's docstring)."""
    import pickle

    import torch

    ser = torch.serialization
    # CRC-32 on: the small records (data.pkl, ...) get theirs; the storages, written later, get 0
    writer = torch._C.PyTorchFileWriter(path, True, ser._get_storage_alignment())
    holes = _Holes(writer, torch.UntypedStorage)
    try:
        ser._save(obj, holes, pickle, ser.DEFAULT_PROTOCOL, False)
        writer.write_end_of_file()
    except BaseException:
        _finish_failed(writer)
        raise
    finally:
        del writer, holes._writer  # closes the file
    if not holes.storages:
        return
    offsets = _data_offsets(path, [name for name, _, _ in holes.storages])
    fd = os.open(path, os.O_WRONLY)
    try:
        for name, storage, size in holes.storages:
            offset, in_archive = offsets[name]
            if in_archive != size or storage.nbytes() != size:
                raise RuntimeError(f"atomic-save: record {name} of {path} holds {in_archive} bytes, "
                                   f"its storage {storage.nbytes()} (expected {size})")
            if size:
                data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))
                _pwrite_all(fd, memoryview(data.numpy()).cast("B"), offset)
    finally:
        os.close(fd)


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
    import errno

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
    try:
        with atomic.atomic_path(final, defer=True) as tmp:
            try:
                if _use_direct(args, kwargs):
                    return _direct_save(args[0] if args else kwargs["obj"], tmp)
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
    delta="torch.save / Path.write_text straight to the final name (truncated files after a kill), a failed save seen after the last batch -> temporary file (storages written outside the GIL), fsync, rename; the next generate() raises a failed save",
    api="torch.save / pathlib.Path.write_text / pathlib.Path.write_bytes / VllmHiddenStatesGenerator.generate",
    kind=Kind.GUARD,
    depends_on=(),
    after=("worker-death",),  # wraps generate() outermost: a failed save stops the call before anything runs
    vllm=">=0.11.1",
    speculators=SPECULATORS_ALL,
    upstream="not in speculators (0.3.0 - 0.4.x save straight to the final name)",
    remove_when="the stock script saves atomically",
)
