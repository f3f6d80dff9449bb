"""Element types of device buffers and their host (numpy) representation.

kp knows no 16-bit types, so every buffer is raw 32-bit words on the device and
the dtype lives here. Host-side, bfloat16 is held as its uint16 bit pattern
(numpy has no bfloat16); use :func:`to_bfloat16` / :func:`from_bfloat16`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str
    itemsize: int
    host: np.dtype  # numpy dtype of the host representation

    def __repr__(self) -> str:
        return f"vkformers.{self.name}"


float32 = DType("float32", 4, np.dtype(np.float32))
float16 = DType("float16", 2, np.dtype(np.float16))
bfloat16 = DType("bfloat16", 2, np.dtype(np.uint16))
int32 = DType("int32", 4, np.dtype(np.int32))
uint32 = DType("uint32", 4, np.dtype(np.uint32))
uint8 = DType("uint8", 1, np.dtype(np.uint8))
bool_ = DType("bool", 1, np.dtype(np.uint8))  # masks: one byte per element

ALL = {d.name: d for d in (float32, float16, bfloat16, int32, uint32, uint8, bool_)}
ALIASES = {"fp32": float32, "f32": float32, "fp16": float16, "f16": float16, "half": float16,
           "bf16": bfloat16, "i32": int32, "u32": uint32, "u8": uint8}


def as_dtype(value) -> DType:
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        if value in ALL:
            return ALL[value]
        if value in ALIASES:
            return ALIASES[value]
    else:
        np_dtype = np.dtype(value)
        for d in (float32, float16, int32, uint32, uint8):
            if d.host == np_dtype:
                return d
        if np_dtype == np.bool_:
            return bool_
    raise TypeError(f"unsupported dtype {value!r}; supported: {', '.join(ALL)}")


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even; NaN stays NaN (as 0x7FC0). In place on
    one temporary: a model's weights go through here while loading, one (large) tensor at a time."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    out = rounded.astype(np.uint16)
    del rounded
    out[np.isnan(x)] = 0x7FC0
    return out


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32)
    wide <<= 16
    return wide.view(np.float32)


def canonical_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits as ``to_bfloat16(from_bfloat16(bits))`` gives them, without the float32 copy: the same bits
    (``bits`` itself where it holds no NaN), every NaN as 0x7FC0."""
    bits = np.asarray(bits, dtype=np.uint16)
    nan = (bits & 0x7FFF) > 0x7F80
    if not nan.any():
        return bits
    out = bits.copy()
    out[nan] = 0x7FC0
    return out


def _float8_e4m3fn_table() -> np.ndarray:
    """The 256 values of float8 e4m3fn (OCP FP8: bias 7, no infinities, S.1111.111 is NaN), float32."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 15, (codes & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    return np.where((codes & 0x7F) == 0x7F, np.nan, sign * magnitude).astype(np.float32)


FLOAT8_E4M3FN = _float8_e4m3fn_table()


def from_float8_e4m3fn(codes: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes (uint8) -> float32, exactly (NaN kept)."""
    return FLOAT8_E4M3FN[np.asarray(codes, dtype=np.uint8)]


def from_float8_e5m2(codes: np.ndarray) -> np.ndarray:
    """float8 e5m2 bytes (uint8) -> float32, exactly: e5m2 is the high byte of a float16."""
    return (np.asarray(codes, dtype=np.uint8).astype(np.uint16) << 8).view(np.float16).astype(np.float32)
