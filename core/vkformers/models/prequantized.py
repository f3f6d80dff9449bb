"""Checkpoints published pre-quantized: config.json's ``quantization_config`` read, their weights turned into ours.

- FP8 (``quant_method: "fp8"``, transformers' FineGrainedFP8; Qwen3-*-FP8, DeepSeek-V3): each ``X.weight`` stored
  as float8 e4m3fn with ``X.weight_scale_inv`` (float32, one per ``weight_block_size`` block of [rows, cols]; a
  dim that is not a multiple of the block has a last, partial block) is dequantized to ``w = f8 * scale`` in float32,
  one tensor at a time, as transformers does where the GPU lacks FP8. compressed-tensors' "float-quantized" format
  (``X.weight_scale`` per tensor, per output channel or per block) the same way. Only dynamic activation scales
  load: static ones would quantize the activations too.

Each format reads the tensors of the checkpoint (memory-mapped) and gives ``(name, array)`` one weight at a time.
"""
from __future__ import annotations

import numpy as np

from vkformers.errors import QuantizationError

ORIGINAL_HINT = 'load the original (unquantized) checkpoint instead, with quantization="q4_k" (or "q8_0") to pack it'


def _field(config: dict, *names, default=None):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


class PrequantizedFormat:
    """A quantization_config vkformers reads: :meth:`tensors` turns the checkpoint's stored tensors into the model's
    weights. ``keep_packed``: weights that a block format holds exactly stay packed (no other quantization= asked)."""

    method = ""

    def tensors(self, entries: dict, keep_packed: bool = True):
        raise NotImplementedError


# ---------------------------------------------------------------- FP8

class Float8Format(PrequantizedFormat):
    """float8 weights with float32 scales: ``scale_suffix`` "_scale_inv" (FineGrainedFP8) or "_scale"
    (compressed-tensors); ``block`` [rows, cols] per scale where the scales are blocked."""

    def __init__(self, method: str, scale_suffix: str, block=None):
        self.method, self.scale_suffix = method, scale_suffix
        self.block = None if block is None else tuple(int(b) for b in block)

    def tensors(self, entries: dict, keep_packed: bool = True):
        scales = {name for name in entries if name.endswith(".weight" + self.scale_suffix)}
        for name, entry in entries.items():
            if name in scales:
                continue
            scale_name = name + self.scale_suffix
            if entry.code not in ("F8_E4M3", "F8_E5M2") or scale_name not in entries:
                yield name, entry.as_float()
                continue
            yield name, self.dequantize(name, entry.as_float(), np.asarray(entries[scale_name].as_float(),
                                                                           dtype=np.float32))

    def dequantize(self, name: str, values: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """``values`` (float32, decoded from float8) times its scale: one for all, per output row ([rows, 1]) or
        per block (ceil(rows / block rows), ceil(cols / block cols))."""
        if values.ndim < 2:
            raise QuantizationError(f"{name}: a float8 weight of shape {values.shape} is not a matrix")
        rows, cols = values.shape[-2:]
        if scale.size == 1:
            return values * scale.reshape(())
        if self.block is not None:
            grid = (-(-rows // self.block[0]), -(-cols // self.block[1]))
            if scale.shape[-2:] != grid or scale.shape[:-2] != values.shape[:-2]:
                raise QuantizationError(f"{name}: {name}{self.scale_suffix} has shape {list(scale.shape)}, but a "
                                        f"{list(values.shape)} weight in blocks of {list(self.block)} has "
                                        f"{list(values.shape[:-2]) + list(grid)}; re-download the checkpoint")
            expanded = np.repeat(np.repeat(scale, self.block[0], axis=-2), self.block[1], axis=-1)
            return values * expanded[..., :rows, :cols]
        if scale.shape[-2:] == (rows, 1) and scale.shape[:-2] == values.shape[:-2]:
            return values * scale
        raise QuantizationError(f"{name}: {name}{self.scale_suffix} of shape {list(scale.shape)} is neither one "
                                f"scale nor one per output row of the {list(values.shape)} weight")


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


READERS = {"fp8": _fp8, "compressed-tensors": _compressed_tensors}


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


__all__ = ["Float8Format", "PrequantizedFormat", "checkpoint_quantization"]
