"""The reply of a call whose rows the worker wrote in place, and the driver's per-call object.

The capturing worker answers ``_get_captured_states`` with a :class:`Written` (rows copied, which
layers' sums were finite): plain data, pickled as such. In the driver, ``results-in-place`` keeps
one :class:`Transfer` per ``generate()`` call on the generator and gives the stock code a view of
its executor (:class:`CallExecutor`) for the call; when ``collective_rpc`` returns the
:class:`Written`, the view turns it into the stock reply, one :class:`LayerRows` per layer (a real
tensor over the layer's rows in the driver's segment). The stock ``h[a:b].clone()`` of a
sequence's rows then gets the sequence's block tensor itself (it owns exactly its bytes), with no
copy. ``guard-output`` and ``self-check`` read the same call's :class:`Transfer` afterwards (which
blocks the worker found finite; where a block lies in the segments); a patch that needs the rows
as soon as they are in place (``self-check`` sends its comparison then, so the workers compare
while the driver hands the results out) registers with :func:`when_written`. Nothing here imports
torch at import time.
"""

from __future__ import annotations

import bisect
import functools
import itertools

import wrapt

from speculators_compat.patching import CaptureContractError, Deferred

#: attribute of the generator holding the :class:`Transfer` of its current (or last) call
TRANSFER_ATTR = "_speculators_compat_transfer"
#: the stock method whose reply :class:`CallExecutor` converts
METHOD = "_get_captured_states"
#: attribute of the generator holding the callables its next call runs once its rows are in place
WRITTEN_ATTR = "_speculators_compat_when_written"


class Written(Deferred):
    """A worker's reply when a plan was active: the rows are already in the driver's segment."""

    __slots__ = ("plan_id", "rows", "finite", "error")

    def __init__(self, plan_id: int, rows: int, finite, error=None) -> None:
        self.plan_id, self.rows, self.finite, self.error = plan_id, rows, finite, error

    def __getstate__(self):
        return (self.plan_id, self.rows, self.finite, self.error)

    def __setstate__(self, state):
        self.plan_id, self.rows, self.finite, self.error = state


class Transfer:
    """One ``generate()`` call's data path on the driver: its plan, the tensors over its segment
    until the reply is taken, then what the worker reported (``rows``, ``finite``) and where its
    blocks lie (by address: the transfer keeps no tensor once the call is over)."""

    def __init__(self, plan, layers: list | None, blocks: list[list] | None, on_written=(), make=None) -> None:
        self.plan, self._layers, self._blocks = plan, layers, blocks
        self._make = make  # ``make() -> (layers, blocks)`` when they are not given: see :meth:`prepare`
        self._on_written = list(on_written)  # see :func:`when_written`
        self.rows: int | None = None  # rows the worker copied (None: no reply yet)
        self.finite: list[bool] | None = None  # per layer: no inf/nan in any row
        #: ``{data_ptr: (shape, segment id, byte offset)}`` of every block handed out
        self._places: dict[int, tuple] = {}
        self._finite_ptrs: set[int] = set()

    @classmethod
    def deferred(cls, plan, make, on_written=()) -> Transfer:
        """A transfer whose tensors ``make()`` builds when the driver is about to wait for the
        reply (:meth:`prepare`: while the workers run the last steps), not before the first step."""
        return cls(plan, None, None, on_written, make)

    def prepare(self) -> None:
        """Build the call's tensors if they are still to be made (once; before :meth:`take`)."""
        make, self._make = self._make, None
        if make is not None:
            self._layers, self._blocks = make()

    def take(self, written: Written) -> list:
        """The stock reply for the worker's ``written``: one :class:`LayerRows` per layer.
        Raises :class:`CaptureContractError` for a reply of another call or a wrong row count."""
        self.prepare()
        plan = self.plan
        if written.plan_id != plan.id or self._layers is None:
            raise CaptureContractError(f"shm-transport: a reply for call {written.plan_id} during call {plan.id}")
        self.rows, self.finite = written.rows, written.finite
        error = written.error
        if error is None and written.rows != plan.rows:
            error = f"the worker captured {written.rows} rows per layer for {plan.rows} input tokens"
        layers, blocks = self._layers, self._blocks
        self.close()
        if error:
            raise CaptureContractError(error)
        starts = list(itertools.accumulate([0] + plan.lengths[:-1]))
        for j, layer in enumerate(blocks):
            for t, off in zip(layer, plan.offsets[j]):
                self._places[t.data_ptr()] = (tuple(t.shape), plan.segment, off)
                if self.finite and self.finite[j]:
                    self._finite_ptrs.add(t.data_ptr())
        callbacks, self._on_written = self._on_written, []
        for callback in callbacks:
            callback(blocks)
        layer_rows = tensor_types()[0]
        return [layer_rows.over(layer, starts, plan.lengths, blocks[j]) for j, layer in enumerate(layers)]

    def close(self) -> None:
        """Drop the call's tensors (the caller's blocks keep the segment held, nothing else)."""
        self._layers = self._blocks = self._make = None

    def certified(self, tensor) -> bool:
        """``tensor`` is a block of this call whose layer the worker found finite."""
        ptr = tensor.data_ptr()
        return ptr in self._finite_ptrs and self._places[ptr][0] == tuple(tensor.shape)

    def locate(self, tensor) -> tuple[int, int] | None:
        """``(segment id, byte offset)`` of ``tensor`` if it is one of this call's blocks, whole."""
        place = self._places.get(tensor.data_ptr())
        if place is None or place[0] != tuple(tensor.shape) or not tensor.is_contiguous():
            return None
        return place[1], place[2]


def when_written(generator, callback) -> None:
    """Have ``callback(blocks)`` run once the rows of ``generator``'s next call lie in the driver's
    segment: when the worker's reply is taken, before the stock code reads it. ``blocks[layer][seq]``
    are the tensors the caller will hold (each sequence's block, in input order, the layers as the
    reply lists them), and the call's :class:`Transfer` already locates them. Runs only where the
    call's rows go through the segments; an error it raises is the call's. Registered for one
    call: ``results-in-place`` takes what is registered when the call starts."""
    generator.__dict__.setdefault(WRITTEN_ATTR, []).append(callback)


def take_written(generator) -> list:
    """What :func:`when_written` registered for the call that starts (and no later one)."""
    return generator.__dict__.pop(WRITTEN_ATTR, None) or []


def transfer_of(generator) -> Transfer | None:
    """The :class:`Transfer` of ``generator``'s current call (``None``: the call's rows did not go
    through the segments). Replaced at the start of every call: never another call's."""
    return generator.__dict__.get(TRANSFER_ATTR)


class CallExecutor(wrapt.ObjectProxy):
    """The generator's executor for the duration of one call: the worker's :class:`Written` reply
    to ``_get_captured_states`` comes back as the stock list of layers (:meth:`Transfer.take`)."""

    def __init__(self, executor, transfer: Transfer) -> None:
        super().__init__(executor)
        self._self_transfer = transfer

    def collective_rpc(self, method, *args, **kwargs):
        if method == METHOD:
            self._self_transfer.prepare()  # while the workers may still run the call's last steps
        reply = self.__wrapped__.collective_rpc(method, *args, **kwargs)
        if method != METHOD:
            return reply
        if isinstance(reply, Written):
            return self._self_transfer.take(reply)
        if isinstance(reply, list) and reply and isinstance(reply[0], Written):
            return [self._self_transfer.take(reply[0]), *reply[1:]]
        return reply


@functools.lru_cache(maxsize=None)
def tensor_types():
    """``(LayerRows, Block)``, the classes, made at first use (torch is imported then)."""
    import torch

    class Block(torch.Tensor):
        """A sequence's rows of one layer: a real tensor over its block of the segment, whose
        first ``clone()`` (no arguments) hands out the block itself as a plain tensor (it owns
        exactly its bytes, and nothing else holds it); any other ``clone()`` copies."""

        __torch_function__ = torch._C._disabled_torch_function_impl  # results are plain tensors

        def clone(self, *args, **kwargs):
            if args or kwargs or self.__dict__.get("_taken"):
                return super().clone(*args, **kwargs)
            self._taken = True
            return self.as_subclass(torch.Tensor)

    class LayerRows(torch.Tensor):
        """One layer of a call's reply: a real ``rows x hidden`` tensor over the layer's rows in
        the driver's segment, as the stock reply's tensor. Indexed with exactly one sequence's
        rows (``h[a:b]``, as the stock generator cuts them) it gives that sequence's
        :class:`Block`; anything else is the plain tensor's (a view of the segment, or a copy
        where the tensor's own operation makes one)."""

        __torch_function__ = torch._C._disabled_torch_function_impl  # results are plain tensors

        @classmethod
        def over(cls, layer, starts: list[int], lengths: list[int], blocks: list):
            out = layer.as_subclass(cls)
            out._starts, out._lengths = starts, lengths
            out._blocks = [b.as_subclass(Block) for b in blocks]
            return out

        def __getitem__(self, key):
            if isinstance(key, slice) and key.step in (None, 1) and isinstance(key.stop, int):
                start = key.start or 0
                i = bisect.bisect_left(self._starts, start)
                if i < len(self._starts) and self._starts[i] == start and key.stop == start + self._lengths[i]:
                    return self._blocks[i]
            return super().__getitem__(key)

    return LayerRows, Block


def __getattr__(name):
    if name in ("LayerRows", "Block"):
        return tensor_types()[0 if name == "LayerRows" else 1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
