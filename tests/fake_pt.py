"""``torch.save`` archives written without torch, for the unit tests (no torch there).

:func:`save` writes what ``torch.save`` writes for a dict of lists of dense tensors: a zip
archive with ``<name>/data.pkl`` -- a protocol-2 pickle in which each tensor is
``torch._utils._rebuild_tensor_v2(<persistent storage>, 0, size, stride, False, OrderedDict())``
-- and one ``<name>/data/<key>`` record per storage. ``tests/run/test_verify.py`` checks, where torch
is installed, that :mod:`speculators_compat.run.ptfile` reads torch's own archives the same way.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

STORAGE = {"float32": "FloatStorage", "bfloat16": "BFloat16Storage", "int64": "LongStorage"}
FORMAT = {"float32": "f", "int64": "q"}


class Tensor:
    """A dense row-major tensor: ``dtype``, ``shape`` and its flat values."""

    def __init__(self, dtype: str, shape: tuple[int, ...], values) -> None:
        self.dtype, self.shape, self.values = dtype, tuple(shape), list(values)

    def data(self) -> bytes:
        if self.dtype == "bfloat16":  # the high half of each float32
            return b"".join(struct.pack("<f", float(v))[2:] for v in self.values)
        return struct.pack(f"<{len(self.values)}{FORMAT[self.dtype]}", *self.values)

    def stride(self) -> tuple[int, ...]:
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))


def _pickle(obj, storages: list[bytes]) -> bytes:
    out = bytearray(b"\x80\x02")  # PROTO 2

    def emit(o) -> None:
        if isinstance(o, dict):
            out.extend(b"}")  # EMPTY_DICT
            if o:
                out.extend(b"(")  # MARK
                for k, v in o.items():
                    emit(k)
                    emit(v)
                out.extend(b"u")  # SETITEMS
        elif isinstance(o, list):
            out.extend(b"]")  # EMPTY_LIST
            if o:
                out.extend(b"(")
                for v in o:
                    emit(v)
                out.extend(b"e")  # APPENDS
        elif isinstance(o, tuple):
            out.extend(b"(")
            for v in o:
                emit(v)
            out.extend(b"t")  # TUPLE
        elif isinstance(o, bool):
            out.extend(b"\x88" if o else b"\x89")  # NEWTRUE / NEWFALSE
        elif isinstance(o, int):
            out.extend(b"J" + struct.pack("<i", o))  # BININT
        elif isinstance(o, str):
            raw = o.encode()
            out.extend(b"X" + struct.pack("<I", len(raw)) + raw)  # BINUNICODE
        elif isinstance(o, Tensor):
            key = str(len(storages))
            storages.append(o.data())
            numel = len(o.values)
            out.extend(b"ctorch._utils\n_rebuild_tensor_v2\n(")  # GLOBAL, MARK (the arguments)
            out.extend(b"(")
            emit("storage")
            out.extend(f"ctorch\n{STORAGE[o.dtype]}\n".encode())
            emit(key)
            emit("cpu")
            emit(numel)
            out.extend(b"tQ")  # TUPLE, BINPERSID
            emit(0)
            emit(o.shape)
            emit(o.stride())
            emit(False)
            out.extend(b"ccollections\nOrderedDict\n)R")  # GLOBAL, EMPTY_TUPLE, REDUCE
            out.extend(b"tR")  # TUPLE, REDUCE
        else:
            raise TypeError(type(o))

    emit(obj)
    out.extend(b".")
    return bytes(out)


def save(obj, path) -> None:
    """Write ``obj`` (dicts, lists, ints, strs and :class:`Tensor`) to ``path`` as torch would; into
    a folder the runner protects, atomically, as the ``atomic-save`` patch makes ``torch.save``
    (a file under its final name is complete: a shard counts the others' files by name)."""
    try:
        from speculators_compat.services import atomic
    except ImportError:  # the fake alone, without the library
        atomic = None
    final = atomic.protected(path) if atomic is not None else None
    name = Path(path).name.split(".")[0] or "archive"
    if final is None:
        _write(obj, Path(path), name)
        return
    with atomic.atomic_path(final) as tmp:
        _write(obj, Path(tmp), name)


def _write(obj, path: Path, name: str) -> None:
    storages: list[bytes] = []
    pkl = _pickle(obj, storages)
    with open(path, "wb") as fh, zipfile.ZipFile(fh, "w") as zf:
        zf.writestr(f"{name}/data.pkl", pkl)
        zf.writestr(f"{name}/byteorder", "little")
        for key, data in enumerate(storages):
            zf.writestr(f"{name}/data/{key}", data)
        zf.writestr(f"{name}/version", "3\n")


def sample(n: int, layers: int = 3, hidden: int = 4, seed: int = 0, dtype: str = "float32") -> dict:
    """A sample as the stock script saves it: ``input_ids``, ``hidden_states``, ``loss_mask``."""
    ids = [(seed * 7 + j * 13) % 500 for j in range(n)]
    states = [Tensor(dtype, (n, hidden), [((t + k) % 17) / 8 + layer for t in ids for k in range(hidden)])
              for layer in range(layers)]
    return {"input_ids": Tensor("int64", (n,), ids), "hidden_states": states,
            "loss_mask": Tensor("int64", (n,), [j % 2 for j in range(n)])}
