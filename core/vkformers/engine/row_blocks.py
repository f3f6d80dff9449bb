"""Weights larger than one device buffer, held as blocks of consecutive rows.

A storage buffer binds at most ``maxStorageBufferRange`` bytes: 4 GiB on most discrete GPUs, but 1 GiB or 128 MiB
on integrated, mobile and layered drivers (lavapipe, Dozen), where a 150k-token vocabulary's embedding does not fit.
Such a [rows, cols] weight becomes a :class:`RowBlocks`: each block of rows is a parameter of its own (a Tensor, or
a QuantizedTensor of packed blocks), so that its gradient and optimizer state are buffers of that size too.
``F.linear`` joins the blocks' products along the output features and ``F.embedding`` adds the blocks' lookups
(each block reads the ids that fall in it, a zero row elsewhere); nothing else reads the weight whole. Blocks are
sized so that a float32 copy of each fits (a gradient, an AdamW moment, a master weight). Weights that fit stay
whole Tensors: nothing changes for them.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine.quantized import QuantizedArray, QuantizedTensor
from vkformers.errors import RowBlocksError, VkformersError
from vkformers.runtime.vulkan import get_device

# The most bytes a float32 copy of one block may take; None: what the device binds in one buffer. Tests lower it
# to split small weights.
BLOCK_BYTES: int | None = None


def block_bytes(device) -> int:
    return BLOCK_BYTES if BLOCK_BYTES is not None else device.max_buffer_bytes


def row_spans(rows: int, row_bytes: int, device) -> list[tuple[int, int]]:
    """(start, stop) of the row blocks a weight of ``rows`` rows is held in on ``device``, where the largest copy
    kept of it takes ``row_bytes`` a row (float32: 4 per value; packed blocks: their bytes): one span when that
    fits one buffer, else as few blocks of equal rows as fit."""
    limit = block_bytes(device)
    if rows * row_bytes <= limit:
        return [(0, rows)]
    per_block = limit // row_bytes
    if per_block < 1:
        raise VkformersError(f"one weight row of {row_bytes:,} bytes does not fit one buffer of this device "
                             f"({limit:,} bytes); use a device with a larger maxStorageBufferRange")
    count = -(-rows // per_block)
    size = -(-rows // count)
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def split_rows(array, spans):
    """The row blocks of a host array (numpy, or a QuantizedArray of packed rows)."""
    if isinstance(array, QuantizedArray):
        return [QuantizedArray(array.packed[a:b], array.format, (b - a, *array.shape[1:])) for a, b in spans]
    return [array[a:b] for a, b in spans]


class RowBlocks:
    """A [rows, cols] weight held as ``parts``, blocks of its consecutive rows ``spans`` (start, stop) (see the
    module's docstring). It reads like the tensor it stands for (shape, dtype, device, requires_grad, numpy());
    ``F.linear`` and ``F.embedding`` take it."""

    grad = None

    def __init__(self, parts):
        if len(parts) < 2 or len({p.shape[1:] for p in parts}) != 1 or len({p.dtype for p in parts}) != 1:
            raise ValueError("RowBlocks: at least two blocks of one width and dtype")
        self.parts = list(parts)
        stops = np.cumsum([p.shape[0] for p in parts]).tolist()
        self.spans = list(zip([0] + stops[:-1], stops))
        self.shape = (stops[-1], *parts[0].shape[1:])

    @property
    def dtype(self):
        return self.parts[0].dtype

    @property
    def device(self):
        return self.parts[0].device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def quantized(self) -> bool:
        return isinstance(self.parts[0], QuantizedTensor)

    @property
    def format(self):
        """The block format of packed parts (QuantizedTensor.format)."""
        return self.parts[0].format

    @property
    def requires_grad(self) -> bool:
        return self.parts[0].requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        for part in self.parts:
            part.requires_grad = value

    def numpy(self) -> np.ndarray:
        """The whole weight (as each part's numpy() gives it: packed parts dequantized)."""
        return np.concatenate([p.numpy() for p in self.parts])

    def packed_numpy(self) -> np.ndarray:
        """Packed parts' bytes, [rows, row_bytes]."""
        return np.concatenate([p.packed_numpy() for p in self.parts])

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RowBlocksError(
            f"a weight of shape {self.shape} is held in {len(self.parts)} blocks of rows, since it passes what one "
            f"buffer of this device binds, and only F.linear and F.embedding read it that way (not .{name}); run "
            "on a device with a larger maxStorageBufferRange (vkformers devices)")

    def __repr__(self) -> str:
        return f"RowBlocks(shape={self.shape}, dtype={self.dtype.name}, blocks={len(self.parts)})"


def upload_packed(array: QuantizedArray, dtype, name: str):
    """QuantizedTensor.upload, or a RowBlocks of packed parts where the packed bytes pass one device buffer."""
    spans = row_spans(array.shape[0], array.packed.shape[1], get_device())
    if len(spans) == 1:
        return QuantizedTensor.upload(array, dtype=dtype, name=name)
    return RowBlocks([QuantizedTensor.upload(part, dtype=dtype, name=f"{name}[{a}:{b}]")
                      for part, (a, b) in zip(split_rows(array, spans), spans)])


def device_tensors(params) -> list:
    """``params`` with every RowBlocks replaced by its parts: the tensors the device holds, one per buffer."""
    out = []
    for p in params:
        out.extend(p.parts if isinstance(p, RowBlocks) else (p,))
    return out


__all__ = ["BLOCK_BYTES", "RowBlocks", "block_bytes", "device_tensors", "row_spans", "split_rows",
           "upload_packed"]
