"""Checkpoints published pre-quantized: config.json's ``quantization_config`` read, their weights turned into ours.

- FP8 (``quant_method: "fp8"``, transformers' FineGrainedFP8; Qwen3-*-FP8, DeepSeek-V3): each ``X.weight`` stored
  as float8 e4m3fn with ``X.weight_scale_inv`` (float32, one per ``weight_block_size`` block of [rows, cols]; a
  dim that is not a multiple of the block has a last, partial block) is dequantized to ``w = f8 * scale`` in float32,
  one tensor at a time, as transformers does where the GPU lacks FP8. compressed-tensors' "float-quantized" format
  (``X.weight_scale`` per tensor, per output channel or per block) the same way. Only dynamic activation scales
  load: static ones would quantize the activations too.
- GPTQ (``quant_method: "gptq"``, checkpoint_format "gptq") and AWQ (``"awq"``, version "gemm"), 4 bits: their
  codes q, zeros z and float16 scales s give ``w = (q - z) * s`` per group of inputs (GPTQ's classic format stores
  z - 1, AWQ's nibbles run in the order 0, 2, 4, 6, 1, 3, 5, 7). Where each run of 32 inputs lies in one group (group
  sizes 32, 64, 128, ..., no desc_act reordering) the weight stays packed as Q4_1 blocks: d = s and m = -z * s
  rounded to float16, so a dequantized element differs from (q - z) * s by at most half a float16 ulp of z * s (at
  most 1/128 of s); otherwise it is dequantized to float32 (then the compute dtype, or packed as ``quantization=``
  asks).

Each format turns the tensors of the checkpoint (memory-mapped) into the model's weights, each read, dequantized or
packed only when it is uploaded (models/lazy_weights.py); what can be checked without the values is checked first.
"""
from __future__ import annotations

import numpy as np

from functools import partial

from vkformers.engine.quantized import QuantizedArray
from vkformers.errors import QuantizationError
from vkformers.models.lazy_weights import Weight

ORIGINAL_HINT = 'load the original (unquantized) checkpoint instead, with quantization="q4_k" (or "q8_0") to pack it'


def _field(config: dict, *names, default=None):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


class PrequantizedFormat:
    """A quantization_config vkformers reads: :meth:`weights` turns the checkpoint's stored tensors (name ->
    TensorEntry) into the model's weights (name -> Weight, read when uploaded). ``keep_packed``: 4-bit weights stay
    packed as Q4_1 where exact (no other quantization= asked)."""

    method = ""

    def weights(self, entries: dict, keep_packed: bool = True) -> dict[str, Weight]:
        raise NotImplementedError


# ---------------------------------------------------------------- FP8

class Float8Format(PrequantizedFormat):
    """float8 weights with float32 scales: ``scale_suffix`` "_scale_inv" (FineGrainedFP8) or "_scale"
    (compressed-tensors); ``block`` [rows, cols] per scale where the scales are blocked."""

    def __init__(self, method: str, scale_suffix: str, block=None):
        self.method, self.scale_suffix = method, scale_suffix
        self.block = None if block is None else tuple(int(b) for b in block)

    def weights(self, entries: dict, keep_packed: bool = True) -> dict[str, Weight]:
        scales = {name for name in entries if name.endswith(".weight" + self.scale_suffix)}
        out = {}
        for name, entry in entries.items():
            if name in scales:
                continue
            scale = entries.get(name + self.scale_suffix)
            if entry.code not in ("F8_E4M3", "F8_E5M2") or scale is None:
                out[name] = entry.weight()
                continue
            self.check_scale(name, entry.array.shape, scale.array.shape)
            out[name] = Weight(entry.array.shape, partial(self._read, name, entry, scale))
        return out

    def _read(self, name: str, entry, scale) -> np.ndarray:
        return self.dequantize(name, entry.as_float(), np.asarray(scale.as_float(), dtype=np.float32))

    def check_scale(self, name: str, shape, scale_shape) -> None:
        """QuantizationError where a weight of ``shape`` cannot take scales of ``scale_shape`` (one for all, per
        output row ([rows, 1]) or per block (ceil(rows / block rows), ceil(cols / block cols)))."""
        shape, scale_shape = tuple(shape), tuple(scale_shape)
        if len(shape) < 2:
            raise QuantizationError(f"{name}: a float8 weight of shape {shape} is not a matrix")
        rows, cols = shape[-2:]
        if int(np.prod(scale_shape)) == 1:
            return
        if self.block is not None:
            grid = (-(-rows // self.block[0]), -(-cols // self.block[1]))
            if scale_shape[-2:] != grid or scale_shape[:-2] != shape[:-2]:
                raise QuantizationError(f"{name}: {name}{self.scale_suffix} has shape {list(scale_shape)}, but a "
                                        f"{list(shape)} weight in blocks of {list(self.block)} has "
                                        f"{list(shape[:-2]) + list(grid)}; re-download the checkpoint")
            return
        if scale_shape[-2:] != (rows, 1) or scale_shape[:-2] != shape[:-2]:
            raise QuantizationError(f"{name}: {name}{self.scale_suffix} of shape {list(scale_shape)} is neither one "
                                    f"scale nor one per output row of the {list(shape)} weight")

    def dequantize(self, name: str, values: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """``values`` (float32, decoded from float8) times its scale (:meth:`check_scale`)."""
        self.check_scale(name, values.shape, scale.shape)
        rows, cols = values.shape[-2:]
        if scale.size == 1:
            return values * scale.reshape(())
        if self.block is not None:
            expanded = np.repeat(np.repeat(scale, self.block[0], axis=-2), self.block[1], axis=-1)
            return values * expanded[..., :rows, :cols]
        return values * scale


def _dynamic_activations(activation_scheme) -> None:
    if activation_scheme not in (None, "dynamic"):
        raise QuantizationError(f'FP8 checkpoint with activation_scheme {activation_scheme!r}: vkformers computes '
                                f'activations in the compute dtype and reads only "dynamic" FP8 checkpoints; '
                                f'{ORIGINAL_HINT}')


def _fp8(config: dict) -> Float8Format:
    _dynamic_activations(config.get("activation_scheme", "dynamic"))
    block = config.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(int(b) for b in block) < 1):
        raise QuantizationError(f"quant_method 'fp8': weight_block_size {block} is not [rows, cols]")
    return Float8Format("fp8", "_scale_inv", block)


def _compressed_tensors(config: dict) -> Float8Format:
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise QuantizationError(f"quant_method 'compressed-tensors' of format {fmt!r}: vkformers reads only its "
                                f'"float-quantized" (FP8) format; {ORIGINAL_HINT}')
    blocks = set()
    for group_name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
            raise QuantizationError(f"compressed-tensors group {group_name!r}: {weights.get('num_bits')}-bit "
                                    f"{weights.get('type')} weights; vkformers reads 8-bit float ones; "
                                    f"{ORIGINAL_HINT}")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block") or not weights.get("symmetric", True):
            raise QuantizationError(f"compressed-tensors group {group_name!r}: {strategy!r} weight scales"
                                    f"{'' if weights.get('symmetric', True) else ' with zero points'} are not "
                                    f"read (tensor, channel and block ones are); {ORIGINAL_HINT}")
        if strategy == "block":
            blocks.add(tuple(weights.get("block_structure") or ()))
        activations = group.get("input_activations")
        if activations and not activations.get("dynamic", False):
            _dynamic_activations("static")
    if len(blocks) > 1:
        raise QuantizationError(f"compressed-tensors: several block structures {sorted(blocks)}; one is read")
    return Float8Format("compressed-tensors", "_scale", next(iter(blocks)) if blocks else None)


# ---------------------------------------------------------------- GPTQ and AWQ, 4 bits

AWQ_NIBBLE_COLUMNS = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # the column each of a word's 8 nibbles holds (low first)
Q4_1_BLOCK = 32


def unpack_nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 8 nibbles (low first) laid along ``axis`` (0: [n, m] -> [8n, m]; 1: [n, m] -> [n, 8m])."""
    words = np.asarray(words).astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(0, 32, 4)
    if axis == 0:
        return ((words[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, words.shape[1]).astype(np.uint8)
    return ((words[:, :, None] >> shifts[None, None, :]) & 15).reshape(words.shape[0], -1).astype(np.uint8)


def awq_columns(nibbles: np.ndarray) -> np.ndarray:
    """AWQ's [n, 8m] nibbles (each word's in AWQ order) -> [n, 8m] in column order."""
    n, width = nibbles.shape
    order = np.empty(8, np.int64)
    order[AWQ_NIBBLE_COLUMNS] = np.arange(8)  # column c sits in nibble order[c]
    return nibbles.reshape(n, width // 8, 8)[:, :, order].reshape(n, width)


def dequantize_int4(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """codes [in, out], zeros and scales [n_groups, out], groups [in] -> the weight [out, in], float32:
    (q - z) * s, exact (a small integer times a float16)."""
    values = (codes.astype(np.float32) - zeros[groups].astype(np.float32)) * scales[groups].astype(np.float32)
    return np.ascontiguousarray(values.T)


def q4_1_blocks(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The same weight as Q4_1 rows [out, in / 32 * 20] (each run of 32 inputs in one group): d = s, m = -z * s
    in float16, then the 16 bytes of codes (element j in the low nibble of byte j, j + 16 in the high)."""
    n_in, n_out = codes.shape
    block_groups = groups[::Q4_1_BLOCK]                                   # [in / 32]
    d = scales[block_groups].astype(np.float16).T                         # [out, in / 32]
    m = (-zeros[block_groups].astype(np.float32) * scales[block_groups].astype(np.float32)).astype(np.float16).T
    q = codes.T.reshape(n_out, n_in // Q4_1_BLOCK, Q4_1_BLOCK)
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    head = np.stack([d, m], axis=-1).view(np.uint8).reshape(n_out, -1, 4)
    return np.concatenate([head, nibbles], axis=-1).reshape(n_out, -1)


class Int4Format(PrequantizedFormat):
    """GPTQ's or AWQ's 4-bit linear weights: ``X.qweight``, ``X.qzeros``, ``X.scales`` (and GPTQ's ``X.g_idx``)
    become ``X.weight``."""

    SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")

    def __init__(self, method: str, group_size: int):
        self.method, self.group_size = method, int(group_size)

    def weights(self, entries: dict, keep_packed: bool = True) -> dict[str, Weight]:
        out = {}
        for name, entry in entries.items():
            if name.endswith(self.SUFFIXES[1:]) and name.rsplit(".", 1)[0] + ".qweight" in entries:
                continue
            if not name.endswith(".qweight"):
                out[name] = entry.weight()
                continue
            stem = name[:-len(".qweight")]
            parts = {suffix: entries.get(stem + suffix) for suffix in self.SUFFIXES}
            absent = [stem + s for s in (".qzeros", ".scales") if parts[s] is None]
            if absent:
                raise QuantizationError(f"{self.method} checkpoint: {name} has no {absent[0]}; re-download it")
            n_in, n_out = self.check_shapes(stem, parts)
            groups = self.stored_groups(stem, parts, n_in)
            packed = keep_packed and n_in % Q4_1_BLOCK == 0 and \
                bool((groups.reshape(-1, Q4_1_BLOCK) == groups[::Q4_1_BLOCK, None]).all())
            out[stem + ".weight"] = Weight((n_out, n_in), partial(self._read, stem, parts, packed))
        return out

    def _read(self, stem: str, parts: dict, packed: bool):
        codes, zeros, scales = self.unpack(stem, parts)
        groups = self.stored_groups(stem, parts, codes.shape[0])
        if packed:
            return QuantizedArray(q4_1_blocks(codes, zeros, scales, groups), "q4_1", (codes.shape[1], codes.shape[0]))
        return dequantize_int4(codes, zeros, scales, groups)

    def stored_groups(self, stem: str, parts: dict, n_in: int) -> np.ndarray:
        """Each input's group: the checkpoint's g_idx, or runs of group_size."""
        g_idx = parts[".g_idx"]
        return self.groups(stem, n_in, parts[".scales"].array.shape[0],
                           None if g_idx is None else np.asarray(g_idx.array, dtype=np.int64))

    def groups(self, stem: str, n_in: int, n_groups: int, g_idx) -> np.ndarray:
        if g_idx is None:
            size = n_in if self.group_size <= 0 else self.group_size
            g_idx = np.arange(n_in) // size
        if g_idx.shape != (n_in,) or g_idx.min() < 0 or g_idx.max() >= n_groups:
            raise QuantizationError(f"{self.method} checkpoint: {stem}'s groups (g_idx) do not fit its {n_in} "
                                    f"inputs and {n_groups} scale rows; re-download it")
        return g_idx

    def unpack(self, stem: str, parts: dict):
        """(codes [in, out] uint8, zeros [n_groups, out] int, scales [n_groups, out] float16)."""
        raise NotImplementedError

    def unpacked_shapes(self, parts: dict) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes :meth:`unpack` gives the codes and the zeros, from the stored ones."""
        raise NotImplementedError

    def check_shapes(self, stem: str, parts: dict) -> tuple[int, int]:
        """(inputs, outputs) of the weight; QuantizationError where qweight, qzeros and scales disagree."""
        codes, zeros = self.unpacked_shapes(parts)
        scales = tuple(parts[".scales"].array.shape)
        if zeros != scales or scales[1] != codes[1]:
            raise QuantizationError(f"{self.method} checkpoint: {stem}'s qweight, qzeros and scales shapes disagree; "
                                    "re-download it")
        return codes


class GPTQFormat(Int4Format):
    """qweight int32 [in / 8, out] (input 8r + k in nibble k of row r), qzeros int32 [n_groups, out / 8] holding
    z - 1 (output 8c + k in nibble k), scales [n_groups, out], g_idx [in] (each input's group)."""

    def unpacked_shapes(self, parts):
        (words, n_out), (groups, zero_words) = parts[".qweight"].array.shape, parts[".qzeros"].array.shape
        return (8 * words, n_out), (groups, 8 * zero_words)

    def unpack(self, stem, parts):
        self.check_shapes(stem, parts)
        codes = unpack_nibbles(parts[".qweight"].array, axis=0)
        zeros = unpack_nibbles(parts[".qzeros"].array, axis=1).astype(np.int16) + 1
        scales = np.asarray(parts[".scales"].as_float(), dtype=np.float16)
        return codes, zeros, scales


class AWQFormat(Int4Format):
    """AWQ's GEMM layout: qweight int32 [in, out / 8] and qzeros int32 [n_groups, out / 8], each word's nibbles
    in AWQ's column order; scales [n_groups, out]; the zeros as stored."""

    def unpacked_shapes(self, parts):
        (n_in, words), (groups, zero_words) = parts[".qweight"].array.shape, parts[".qzeros"].array.shape
        return (n_in, 8 * words), (groups, 8 * zero_words)

    def unpack(self, stem, parts):
        self.check_shapes(stem, parts)
        codes = awq_columns(unpack_nibbles(parts[".qweight"].array, axis=1))
        zeros = awq_columns(unpack_nibbles(parts[".qzeros"].array, axis=1)).astype(np.int16)
        scales = np.asarray(parts[".scales"].as_float(), dtype=np.float16)
        return codes, zeros, scales


def _gptq(config: dict) -> GPTQFormat:
    bits = int(_field(config, "bits", default=4))
    checkpoint_format = str(_field(config, "checkpoint_format", default="gptq")).lower()
    if config.get("is_marlin_format") or checkpoint_format != "gptq":
        checkpoint_format = "marlin" if config.get("is_marlin_format") else checkpoint_format
        raise QuantizationError(f"quant_method 'gptq' with checkpoint_format {checkpoint_format!r}: vkformers reads "
                                f"GPTQ's classic 'gptq' layout; {ORIGINAL_HINT}")
    if bits != 4:
        raise QuantizationError(f"quant_method 'gptq' of {bits} bits: vkformers reads 4-bit GPTQ; {ORIGINAL_HINT}")
    return GPTQFormat("gptq", int(_field(config, "group_size", default=128)))


def _awq(config: dict) -> AWQFormat:
    bits = int(_field(config, "bits", "w_bit", default=4))
    version = str(_field(config, "version", default="gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"quant_method 'awq' of version {version!r}: vkformers reads AWQ's 'gemm' layout; "
                                f"{ORIGINAL_HINT}")
    zero_point = bool(_field(config, "zero_point", default=True))
    if bits != 4 or not zero_point:
        raise QuantizationError(f"quant_method 'awq' of {bits} bits{'' if zero_point else ' without zero points'}: "
                                f"vkformers reads 4-bit AWQ with zero points; {ORIGINAL_HINT}")
    return AWQFormat("awq", int(_field(config, "group_size", "q_group_size", default=128)))


READERS = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq}


def checkpoint_quantization(config: dict) -> PrequantizedFormat | None:
    """The format of a checkpoint's ``quantization_config`` (config.json), or None where it has none or one read
    elsewhere (bitsandbytes: models/quantize.py). Any other raises QuantizationError naming it."""
    settings = config.get("quantization_config")
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise QuantizationError("config.json: quantization_config is not an object; fix or re-download the file")
    method = str(settings.get("quant_method", "")).lower()
    if method == "bitsandbytes":
        return None
    if method not in READERS:
        raise QuantizationError(f"checkpoint quantized with quant_method {method!r}: vkformers reads "
                                f"{', '.join(READERS)} and bitsandbytes NF4 checkpoints; {ORIGINAL_HINT}")
    return READERS[method](settings)


__all__ = ["AWQFormat", "Float8Format", "GPTQFormat", "PrequantizedFormat", "awq_columns", "checkpoint_quantization",
           "dequantize_int4", "q4_1_blocks", "unpack_nibbles"]
