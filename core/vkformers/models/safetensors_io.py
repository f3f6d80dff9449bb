"""Reading and writing safetensors files with numpy, bfloat16 included.

The format is an 8-byte little-endian header length, a JSON header (name ->
dtype, shape, byte range) and the raw data. The ``safetensors`` package's numpy
API cannot hold bfloat16, so we read the layout ourselves (memory-mapped) and
keep bfloat16 as its uint16 bit pattern. Errors name the file and the problem.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from vkformers.models.atomic import atomic_write
from vkformers.models.lazy_weights import Weight
from vkformers.models.module import CheckpointError
from vkformers.runtime import dtypes as dt

NUMPY_OF = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64,
            "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
            "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}  # float8 kept as its bytes
FLOAT8_DECODERS = {"F8_E4M3": dt.from_float8_e4m3fn, "F8_E5M2": dt.from_float8_e5m2}
CODE_OF = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32",
           np.dtype(np.int64): "I64", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL", np.dtype(np.int8): "I8"}
MAX_HEADER = 100 << 20


class TensorEntry:
    """One tensor of a file: its raw array (bfloat16 as uint16, float8 as uint8) and its stored dtype code."""

    def __init__(self, array: np.ndarray, code: str):
        self.array, self.code = array, code

    def as_float(self) -> np.ndarray:
        """float32 for bfloat16 and float8 (exact), the stored dtype otherwise."""
        if self.code in FLOAT8_DECODERS:
            return FLOAT8_DECODERS[self.code](self.array)
        return dt.from_bfloat16(self.array) if self.code == "BF16" else self.array

    def as_bfloat16(self) -> np.ndarray:
        """A bfloat16 tensor's bits as ``dt.to_bfloat16(self.as_float())`` gives them (every NaN as 0x7FC0)."""
        return dt.canonical_bfloat16(self.array)

    def weight(self) -> Weight:
        """This tensor as :meth:`as_float` reads it, not read yet (models/lazy_weights.py); a bfloat16 one also
        as its bits (:meth:`as_bfloat16`), for a bfloat16 model."""
        return Weight(self.array.shape, self.as_float, self.as_bfloat16 if self.code == "BF16" else None)


def read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: corrupt safetensors header (claims {length} bytes, file has {size})")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + length


def read_safetensors(path) -> dict[str, TensorEntry]:
    """Every tensor of one file, memory-mapped."""
    path = Path(path)
    header, data_start = read_header(path)
    data_size = path.stat().st_size - data_start
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_size,)) if data_size else \
        np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt entry for tensor {name!r}") from None
        if code not in NUMPY_OF:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {code}")
        itemsize = np.dtype(NUMPY_OF[code]).itemsize
        if not 0 <= begin <= end <= data_size or end - begin != int(np.prod(shape)) * itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} has a byte range [{begin}, {end}) that does not fit "
                                  f"its shape {list(shape)} or the file (truncated or corrupt)")
        out[name] = TensorEntry(mapped[begin:end].view(NUMPY_OF[code]).reshape(shape), code)
    return out


def write_safetensors(path, tensors: dict[str, np.ndarray], *, bfloat16: set[str] = frozenset(),
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (names in ``bfloat16`` hold uint16 bit patterns) atomically: temp file, fsync, rename."""
    path = Path(path)
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = metadata
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        code = "BF16" if name in bfloat16 else CODE_OF.get(array.dtype)
        if code is None:
            raise TypeError(f"cannot store tensor {name!r} of dtype {array.dtype} in safetensors")
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        blobs.append(array)
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
    with atomic_write(path, "wb") as f:  # never through a link at path
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for array in blobs:
            f.write(array.tobytes())
