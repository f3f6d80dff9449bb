"""Quantized weights: packed blocks on the device, dequantized only inside the products that read them.

A :class:`QuantizedTensor` is a logical [rows, cols] matrix kept as its block format's bytes (GGUF's Q4_0, Q4_1,
Q8_0, Q4_K, Q5_K, Q6_K, or QLoRA's NF4), one row after another: ``packed`` is a uint8 device tensor
[rows, row_bytes]. The GGUF layouts are the file's bytes unchanged (the GGUF spec, ggml-common.h); NF4 is stored
as blocks of 64 with a float32 absmax in front of their 32 bytes of nibbles (element 2i in the high nibble of
byte i, as bitsandbytes packs them). shaders/common/quant_block.glsl reads the same layouts.

The host side here: the format table, NF4's reference (de)quantization, quantizers for loading a float
checkpoint (``quantize``), and bitsandbytes' NF4 tensors (double-quantized absmax or plain) converted to ours.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vkformers.engine.function import wrap
from vkformers.engine.lazy import persistent_buffer
from vkformers.errors import QuantizationError
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import get_device

if TYPE_CHECKING:  # annotations only: engine/tensor.py sits above the ops, which use this module
    from vkformers.engine.tensor import Tensor


@dataclass(frozen=True)
class QuantFormat:
    name: str
    shader_id: int   # quant_block.glsl QUANT_*
    block: int       # elements per block
    block_bytes: int

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes


FORMATS = {f.name: f for f in (
    QuantFormat("q4_0", 0, 32, 18), QuantFormat("q4_1", 1, 32, 20), QuantFormat("q8_0", 2, 32, 34),
    QuantFormat("q4_k", 3, 256, 144), QuantFormat("q5_k", 4, 256, 176), QuantFormat("q6_k", 5, 256, 210),
    QuantFormat("nf4", 6, 64, 36))}
GGUF_FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")  # named in gguf's GGMLQuantizationType upper-cased
# What ``from_pretrained(..., quantization=...)`` quantizes a float checkpoint to.
QUANTIZE_FORMATS = ("nf4", "q4_0", "q4_1", "q8_0", "q4_k", "q5_k")

# QLoRA's 4-bit NormalFloat levels (bitsandbytes' NF4 code book).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    dtype=np.float32)


def quant_format(name: str) -> QuantFormat:
    key = str(name).lower()
    if key not in FORMATS:
        raise QuantizationError(f"unknown quantization {name!r}; supported: {', '.join(FORMATS)}")
    return FORMATS[key]


def _gguf_quants():
    try:
        import gguf.quants as quants  # the optional [gguf] extra: llama.cpp's own reference codecs
    except ImportError:
        raise QuantizationError("the GGUF block formats need the gguf package: pip install 'vkformers[gguf]'") from None
    return quants


def _gguf_type(fmt: QuantFormat):
    import gguf  # the optional [gguf] extra
    return gguf.GGMLQuantizationType[fmt.name.upper()]


# ---------------------------------------------------------------- host reference codecs

def nf4_dequantize(packed: np.ndarray, cols: int) -> np.ndarray:
    """Our NF4 rows ([rows, row_bytes] uint8) -> float32 [rows, cols]."""
    blocks = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1, 36)
    absmax = blocks[:, :4].copy().view(np.float32)  # [blocks, 1]
    nibbles = blocks[:, 4:]
    codes = np.stack([nibbles >> 4, nibbles & 15], axis=-1).reshape(-1, 64)
    return (NF4_LEVELS[codes] * absmax).reshape(-1, cols)


def nf4_quantize(array: np.ndarray) -> np.ndarray:
    """float [rows, cols] (cols a multiple of 64) -> our NF4 rows: absmax per 64, the nearest level per element."""
    values = np.asarray(array, dtype=np.float32)
    rows, cols = values.shape
    blocks = values.reshape(-1, 64)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    scaled = blocks / np.where(absmax == 0, 1.0, absmax)
    midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
    codes = np.searchsorted(midpoints, scaled).astype(np.uint8)
    return _nf4_pack(codes, absmax.astype(np.float32), rows, cols)


def _nf4_pack(codes: np.ndarray, absmax: np.ndarray, rows: int, cols: int) -> np.ndarray:
    pairs = codes.reshape(-1, 32, 2)
    nibbles = (pairs[..., 0] << 4) | pairs[..., 1]
    head = np.ascontiguousarray(absmax, dtype=np.float32).reshape(-1, 1).view(np.uint8)
    return np.concatenate([head, nibbles.astype(np.uint8)], axis=1).reshape(rows, cols // 64 * 36)


def nf4_from_bitsandbytes(packed: np.ndarray, absmax: np.ndarray, shape, *, blocksize: int = 64,
                          nested_absmax: np.ndarray | None = None, nested_code: np.ndarray | None = None,
                          offset: float = 0.0, nested_blocksize: int = 256) -> np.ndarray:
    """A bitsandbytes NF4 weight (``packed``: numel / 2 bytes, ``absmax``: float per block of 64, or with double
    quantization uint8 codes into ``nested_code`` scaled per ``nested_blocksize`` blocks by ``nested_absmax``,
    plus ``offset``) as our NF4 rows [rows, row_bytes]; the absmax is expanded exactly as bitsandbytes does."""
    rows, cols = (int(s) for s in shape)
    if blocksize != 64 or cols % 64:
        raise QuantizationError(f"NF4 weight {tuple(shape)}: only blocks of 64 along rows of a multiple of 64 "
                                f"elements are supported (blocksize {blocksize})")
    raw = np.asarray(packed, dtype=np.uint8).reshape(-1)
    codes = np.stack([raw >> 4, raw & 15], axis=-1).reshape(-1)
    if nested_absmax is not None:
        code_book = np.asarray(nested_code, dtype=np.float32)
        index = np.asarray(absmax, dtype=np.uint8).reshape(-1)
        scales = np.repeat(np.asarray(nested_absmax, dtype=np.float32).reshape(-1), nested_blocksize)[:index.size]
        block_absmax = code_book[index] * scales + np.float32(offset)
    else:
        block_absmax = np.asarray(absmax, dtype=np.float32).reshape(-1)
    return _nf4_pack(codes, block_absmax.astype(np.float32), rows, cols)


def dequantize(packed: np.ndarray, fmt, shape) -> np.ndarray:
    """Packed rows -> float32 [rows, cols]: the reference the kernels are tested against (gguf.quants for the
    GGUF formats, :func:`nf4_dequantize` for NF4)."""
    fmt = quant_format(fmt) if isinstance(fmt, str) else fmt
    rows, cols = shape
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(rows, fmt.row_bytes(cols))
    if fmt.name == "nf4":
        return nf4_dequantize(packed, cols)
    return np.asarray(_gguf_quants().dequantize(packed, _gguf_type(fmt)), dtype=np.float32).reshape(rows, cols)


def quantize(array: np.ndarray, fmt) -> np.ndarray:
    """float [rows, cols] -> packed rows in ``fmt`` (cols a multiple of its block)."""
    fmt = quant_format(fmt) if isinstance(fmt, str) else fmt
    values = np.ascontiguousarray(array, dtype=np.float32)
    if values.ndim != 2 or values.shape[1] % fmt.block:
        raise QuantizationError(f"{fmt.name} quantizes [rows, cols] with cols a multiple of {fmt.block}, "
                                f"got {values.shape}")
    if fmt.name == "nf4":
        return nf4_quantize(values)
    if fmt.name == "q4_k":
        return q4_k_quantize(values)
    if fmt.name == "q5_k":
        return q5_k_quantize(values)
    if fmt.name not in ("q4_0", "q4_1", "q8_0"):
        raise QuantizationError(f"quantizing to {fmt.name} is not supported; choose one of "
                                f"{', '.join(QUANTIZE_FORMATS)}")
    return np.asarray(_gguf_quants().quantize(values, _gguf_type(fmt)), dtype=np.uint8)


# The scale search of the K formats: each sub-block tries the codes of iscale = (nmax + delta) / (max - min) for these
# deltas (besides the plain min/max fit), refits scale and min to each candidate's codes by least squares and keeps
# the least squared error.
K_SEARCH_DELTAS = np.float32([-0.6, -0.3, 0.0, 0.3, 0.6, 0.9])
_K_CHUNK = 8192  # sub-blocks fitted at once: the arrays stay in cache


def _k_fit(sub: np.ndarray, nmax: int, search: bool) -> tuple[np.ndarray, np.ndarray]:
    """sub [n, 32] float32 -> (scale, min) per sub-block, x ~ scale * q - min with q in 0..nmax and min >= 0: the
    plain min/max fit, or (``search``) the least squared error over the candidate codes of K_SEARCH_DELTAS, each
    with scale and min refitted to its codes by least squares (the idea of llama.cpp's make_qkx2_quants). Every
    error comes from the sums of q, q^2, q*x, x and x^2, with no pass over the elements of its own."""
    low = np.minimum(sub.min(axis=1), 0.0)  # the min is stored as a non-negative offset
    span = sub.max(axis=1) - low
    scale = span / nmax
    if not search:
        return scale, -low
    n = np.float32(sub.shape[1])
    sum_x, sum_xx = sub.sum(axis=1), np.einsum("ij,ij->i", sub, sub)
    live = span > 0
    inv_span = np.divide(1.0, span, out=np.zeros_like(span), where=live)[:, None]
    centred = sub - low[:, None]
    q = np.empty_like(sub)

    def codes_and_sums(iscale_num):
        np.multiply(centred, inv_span * np.float32(iscale_num), out=q)
        np.rint(q, out=q)
        if iscale_num > nmax:  # centred * iscale reaches past nmax only then
            np.minimum(q, nmax, out=q)
        return q.sum(axis=1), np.einsum("ij,ij->i", q, q), np.einsum("ij,ij->i", q, sub)

    def error(s, o, sum_q, sum_qq, sum_qx):  # sum of (s q + o - x)^2
        return (s * s * sum_qq + 2 * s * o * sum_q + n * o * o - 2 * s * sum_qx - 2 * o * sum_x + sum_xx)

    offset = low.copy()
    best = error(scale, offset, *codes_and_sums(nmax))
    for delta in K_SEARCH_DELTAS:
        sum_q, sum_qq, sum_qx = codes_and_sums(nmax + delta)
        det = n * sum_qq - sum_q * sum_q
        ok = live & (det > 0)
        safe_det = np.where(ok, det, 1.0)
        s_fit = (n * sum_qx - sum_x * sum_q) / safe_det
        o_fit = (sum_qq * sum_x - sum_q * sum_qx) / safe_det
        positive = o_fit > 0  # the offset must stay <= 0: refit the scale alone through zero
        s_fit = np.where(positive, sum_qx / np.where(sum_qq > 0, sum_qq, 1.0), s_fit)
        o_fit = np.where(positive, 0.0, o_fit)
        ok &= s_fit > 0
        err = error(s_fit, o_fit, sum_q, sum_qq, sum_qx)
        better = ok & (err < best)
        best = np.where(better, err, best)
        scale = np.where(better, s_fit, scale)
        offset = np.where(better, o_fit, offset)
    return scale.astype(np.float32), (-offset).astype(np.float32)


def _k_quantize(values: np.ndarray, nmax: int, search: bool):
    """float [rows, cols] -> (d, dmin as float16 [blocks, 1], 6-bit sc and mn [blocks, 8], codes [blocks, 8, 32])."""
    sub = values.reshape(-1, 32)
    scale, mins = np.empty(len(sub), np.float32), np.empty(len(sub), np.float32)
    for at in range(0, len(sub), _K_CHUNK):
        scale[at:at + _K_CHUNK], mins[at:at + _K_CHUNK] = _k_fit(sub[at:at + _K_CHUNK], nmax, search)
    scale, mins, sub = scale.reshape(-1, 8), mins.reshape(-1, 8), sub.reshape(-1, 8, 32)
    d16 = (scale.max(axis=1, keepdims=True) / 63.0).astype(np.float16)
    dmin16 = (mins.max(axis=1, keepdims=True) / 63.0).astype(np.float16)
    d32, dmin32 = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(mins, dmin32, out=np.zeros_like(mins), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    eff_scale = (d32 * sc)[..., None]
    eff_min = (dmin32 * mn)[..., None]
    q = np.clip(np.rint(np.divide(sub + eff_min, eff_scale, out=np.zeros_like(sub), where=eff_scale > 0)), 0, nmax)
    return d16, dmin16, sc, mn, q.astype(np.uint8)


def _k_head(d16, dmin16, sc, mn) -> np.ndarray:
    """d, dmin and the 12 bytes of 6-bit scales and mins (ggml's get_scale_min_k4 packing): [blocks, 16]."""
    scales = np.zeros((sc.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return np.concatenate([d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), scales], axis=1)


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """The low 4 bits of codes [blocks, 8, 32]: chunk c of 64 holds sub-block 2c in the low nibbles, 2c+1 in the
    high."""
    pairs = (q & 15).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(-1, 128)


def q4_k_quantize(values: np.ndarray, search: bool = True) -> np.ndarray:
    """float [rows, cols] -> Q4_K blocks: per sub-block of 32 a scale and a min (x ~ sc * q - m, q in 0..15), both
    quantized to 6 bits against the block's d and dmin. ``search``: each sub-block's scale and min from the search of
    :func:`_k_fit` (least squared error); False: the plain min/max fit."""
    rows, cols = values.shape
    d16, dmin16, sc, mn, q = _k_quantize(np.asarray(values, np.float32), 15, search)
    return np.concatenate([_k_head(d16, dmin16, sc, mn), _k_nibbles(q)], axis=1).reshape(rows, cols // 256 * 144)


def q5_k_quantize(values: np.ndarray, search: bool = True) -> np.ndarray:
    """float [rows, cols] -> Q5_K blocks: as Q4_K with q in 0..31, the fifth bits in 32 bytes after the scales
    (element l of sub-block j: bit j of byte l)."""
    rows, cols = values.shape
    d16, dmin16, sc, mn, q = _k_quantize(np.asarray(values, np.float32), 31, search)
    high = (q >> 4).astype(np.uint8)  # [blocks, 8, 32]
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j, :] << j
    return np.concatenate([_k_head(d16, dmin16, sc, mn), qh, _k_nibbles(q)], axis=1).reshape(rows, cols // 256 * 176)


# ---------------------------------------------------------------- the device tensor

@dataclass
class QuantizedArray:
    """Host-side packed weight on its way to the device (what loaders put in a state dict)."""

    packed: np.ndarray   # uint8 [rows, row_bytes]
    format: str
    shape: tuple[int, int]

    @property
    def ndim(self) -> int:
        return 2

    def dequantize(self) -> np.ndarray:
        return dequantize(self.packed, self.format, self.shape)


class QuantizedTensor:
    """A frozen [rows, cols] weight held as packed blocks (``packed``: uint8 device tensor [rows, row_bytes]);
    ``dtype`` is the compute dtype of the products that read it (their activations and results)."""

    grad = None

    def __init__(self, packed: Tensor, fmt, shape, dtype="float32"):
        self.packed = packed
        self.format = quant_format(fmt) if isinstance(fmt, str) else fmt
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dt.as_dtype(dtype)
        if packed.shape != (self.shape[0], self.format.row_bytes(self.shape[1])):
            raise QuantizationError(f"{self.format.name} weight {self.shape}: packed bytes {packed.shape} do not fit")

    @classmethod
    def upload(cls, array: QuantizedArray, dtype="float32", name: str = "quantized") -> "QuantizedTensor":
        packed = wrap(persistent_buffer(np.ascontiguousarray(array.packed, dtype=np.uint8), dt.uint8, get_device(),
                                        name))
        return cls(packed, array.format, array.shape, dtype)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def requires_grad(self) -> bool:
        return False

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if value:
            raise QuantizationError(f"a {self.format.name} weight is frozen in its packed blocks and cannot be "
                                    "trained; train LoRA adapters on top of it (models.lora.apply_lora)")

    @property
    def lazy(self):
        return self.packed.lazy

    @property
    def device(self):
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.shape[0] * self.packed.shape[1]

    def numpy(self) -> np.ndarray:
        """The dequantized weight, float32."""
        return dequantize(self.packed.numpy(), self.format, self.shape)

    def packed_numpy(self) -> np.ndarray:
        """The packed bytes, uint8 [rows, row_bytes]."""
        return self.packed.numpy()

    def __repr__(self) -> str:
        return f"QuantizedTensor({self.format.name}, shape={self.shape}, compute dtype={self.dtype.name})"


def is_quantized(x) -> bool:
    return isinstance(x, (QuantizedTensor, QuantizedArray))


__all__ = ["FORMATS", "GGUF_FORMATS", "NF4_LEVELS", "QUANTIZE_FORMATS", "QuantFormat", "QuantizationError",
           "QuantizedArray", "QuantizedTensor", "dequantize", "is_quantized", "nf4_dequantize",
           "nf4_from_bitsandbytes", "nf4_quantize", "q4_k_quantize", "q5_k_quantize", "quant_format", "quantize"]
