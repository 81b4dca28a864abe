"""What a ``torch.save`` file holds -- shapes and dtypes -- read without torch and without its data.

``torch.save`` writes a zip archive: ``<name>/data.pkl``, a pickle of the saved object in which
every tensor is a call ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``
(``_rebuild_tensor_v3`` with the dtype for the newer dtypes) and every storage a persistent id
``("storage", <dtype>Storage, key, location, numel)``, and one record ``<name>/data/<key>`` per
storage. :func:`read` unpickles ``data.pkl`` alone, with nothing but those calls allowed (any
other global is refused, nothing is executed), and returns the object with each tensor replaced
by a :class:`TensorMeta`; then it checks that every storage's record is there with the size its
dtype and element count give, and that every tensor lies inside its storage. A sample file is
a few kilobytes of pickle and zip directory however large its states.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from dataclasses import dataclass

__all__ = ["TensorMeta", "BadArchive", "read", "ITEMSIZE"]

#: bytes per element of each dtype torch can save
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}
#: the typed storage classes torch pickles, by the dtype they hold
_STORAGES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "UntypedStorage": "uint8",
}


class BadArchive(ValueError):
    """Not a complete ``torch.save`` archive of plain tensors (the message says what is wrong)."""


@dataclass(frozen=True)
class TensorMeta:
    """A saved tensor, without its data."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        return f"[{', '.join(map(str, self.shape))}] {self.dtype}"


@dataclass(frozen=True)
class _StorageType:
    dtype: str


@dataclass(frozen=True)
class _Storage:
    dtype: str
    key: str
    numel: int


def _rebuild_v2(storage, offset, size, stride, *rest):
    return _tensor(storage, storage.dtype, offset, size, stride)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, *rest):
    return _tensor(storage, dtype, offset, size, stride)


def _tensor(storage, dtype, offset, size, stride) -> TensorMeta:
    if not isinstance(storage, _Storage) or dtype not in ITEMSIZE:
        raise BadArchive(f"a tensor of an unknown storage or dtype ({dtype})")
    return TensorMeta(dtype, tuple(int(d) for d in size), tuple(int(s) for s in stride), int(offset), storage.key)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file) -> None:
        super().__init__(file)
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module in ("torch", "torch.storage") and name in _STORAGES:
            return _StorageType(_STORAGES[name])
        if module == "torch" and name in ITEMSIZE:
            return name  # a dtype (the argument of _rebuild_tensor_v3)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise BadArchive(f"holds {module}.{name}, not plain tensors")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise BadArchive(f"an unknown persistent record {pid!r:.80}")
        storage = self.storages[str(pid[2])] = _Storage(pid[1].dtype, str(pid[2]), int(pid[4]))
        return storage


def _walk(obj):
    if isinstance(obj, TensorMeta):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _walk(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _walk(value)


def read(path) -> object:
    """The object saved in ``path``, every tensor a :class:`TensorMeta`; raises
    :class:`BadArchive` (or ``OSError``) if the archive is incomplete or holds anything else."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {i.filename: i for i in zf.infolist()}
            pkl = next((n for n in infos if n == "data.pkl" or n.endswith("/data.pkl")), None)
            if pkl is None:
                raise BadArchive("no data.pkl record: not a torch.save archive")
            prefix = pkl[: -len("data.pkl")]
            unpickler = _Unpickler(zf.open(pkl))
            try:
                obj = unpickler.load()
            except BadArchive:
                raise
            except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, IndexError) as exc:
                raise BadArchive(f"data.pkl does not unpickle ({type(exc).__name__}: {exc})") from None
    except zipfile.BadZipFile as exc:
        raise BadArchive(f"not a complete torch.save archive ({exc})") from None
    storages = unpickler.storages
    for key, storage in storages.items():
        record = infos.get(f"{prefix}data/{key}")
        want = storage.numel * ITEMSIZE[storage.dtype]
        if record is None:
            raise BadArchive(f"storage {key} has no data record")
        if record.file_size != want:
            raise BadArchive(f"storage {key} holds {record.file_size} bytes, {want} expected")
    for tensor in _walk(obj):
        storage = storages[tensor.storage]
        if tensor.numel:
            last = tensor.offset + sum((d - 1) * s for d, s in zip(tensor.shape, tensor.stride))
            size = storage.numel * ITEMSIZE[storage.dtype]
            if tensor.offset < 0 or (last + 1) * ITEMSIZE[tensor.dtype] > size:
                raise BadArchive(f"a {tensor.describe()} tensor lies outside its storage {tensor.storage}")
    return obj
