"""A call's layout in a driver's segment: what the driver sends the capturing worker before the call."""

from __future__ import annotations

from .segments import align

#: alignment of every layer's region in a segment (bytes); a layer's blocks follow each other
BLOCK_ALIGN = 64


class Plan:
    """Where a call's captured rows go: sent to the workers before the call (small, picklable).

    ``lengths``: rows per sequence in input order; ``offsets[layer][seq]``: byte offset of that
    block in the segment; every block is ``lengths[seq] x hidden`` of ``dtype``, and a layer's
    blocks follow each other (the layer is one ``rows x hidden`` region)."""

    __slots__ = ("id", "segment", "path", "size", "lengths", "hidden", "dtype", "offsets", "retire")

    def __init__(self, id, segment, path, size, lengths, hidden, dtype, offsets, retire=()):
        self.id, self.segment, self.path, self.size = id, segment, path, size
        self.lengths, self.hidden, self.dtype, self.offsets = lengths, hidden, dtype, offsets
        self.retire = tuple(retire)

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)

    @property
    def rows(self) -> int:
        return sum(self.lengths)


def call_lengths(generator, token_ids) -> list[int] | None:
    """Rows per sequence of a call, as the stock code cuts them (``max_model_len - 1`` at most);
    ``None`` where the input is not a batch of non-empty sequences (the call is the stock code's)."""
    if token_ids is None:
        return None
    try:
        max_len = generator.vllm_config.model_config.max_model_len - 1
        if hasattr(token_ids, "tolist") and hasattr(token_ids, "dim"):  # a tensor: its shape, no list of ints
            if token_ids.dim() != 2:
                return None
            lengths = [min(int(token_ids.shape[1]), max_len)] * int(token_ids.shape[0])
        else:
            lengths = [min(len(ids), max_len) for ids in token_ids]
    except TypeError:
        return None
    return lengths if lengths and all(n > 0 for n in lengths) else None


def layout(lengths: list[int], layers: int, hidden: int, size: int) -> tuple[list[list[int]], int]:
    """Byte offsets ``[layer][seq]`` of each block (``size``: bytes per value), layer-major, each
    layer's blocks back to back, and the bytes they span."""
    offsets, at = [], 0
    for _ in range(layers):
        row = []
        for n in lengths:
            row.append(at)
            at += n * hidden * size
        offsets.append(row)
        at = align(at, BLOCK_ALIGN)
    return offsets, max(at, 1)
