"""Quantizing a float checkpoint while it loads: ``from_pretrained(path, quantization="nf4" | "q4_0" | ...)``.

The weights of the model's Linear layers are packed one tensor at a time (engine.quantized.quantize) before they
reach the device; embeddings, norms, biases and the LM head stay in the compute dtype. A weight whose inner size
is not a whole number of blocks stays in the compute dtype too, and one warning names them. A checkpoint saved
with bitsandbytes' NF4 loads packed as it is (:func:`bitsandbytes_nf4_weights`).
"""
from __future__ import annotations

import json
import warnings

import numpy as np

from vkformers.engine.quantized import (NF4_LEVELS, QUANTIZE_FORMATS, QuantizedArray, nf4_from_bitsandbytes,
                                       quant_format, quantize)
from vkformers.errors import QuantizationError
from vkformers.models.layers import Linear
from vkformers.models.module import Module, is_packed


def quantizable_weights(model: Module) -> list[str]:
    """Full names of the weights quantization packs: those of Linear layers other than the LM head (its own
    slot, not one tied to the embeddings)."""
    head = getattr(model, "lm_head", None)
    names = []
    for path, module in model.named_modules():
        if not isinstance(module, Linear) or module is head or path.rsplit(".", 1)[-1] == "lm_head":
            continue
        slot = module._slots.get("weight")
        if slot is not None and slot.tied_to is None:
            names.append(f"{path}.weight" if path else "weight")
    return names


class CheckpointQuantizer:
    """Packs the model's Linear weights (:func:`quantizable_weights`) in ``quantization`` as the checkpoint is
    read, one tensor at a time: ``quantizer(name, array)`` returns the array to load (a QuantizedArray for those
    weights). Weights whose inner size is not a whole number of blocks pass through; :meth:`warn_kept` names
    them in one warning."""

    def __init__(self, model: Module, quantization: str):
        if str(quantization).lower() not in QUANTIZE_FORMATS:
            raise QuantizationError(f"quantization={quantization!r} is not supported; choose one of "
                                    f"{', '.join(QUANTIZE_FORMATS)}")
        self.format = quant_format(quantization)
        self.names = set(quantizable_weights(model))
        self.kept: list[str] = []

    def __call__(self, name: str, array):
        if name not in self.names or getattr(array, "ndim", 0) != 2:
            return array
        if array.shape[1] % self.format.block:
            self.kept.append(f"{name} {tuple(array.shape)}")
            return array
        return QuantizedArray(quantize(np.asarray(array, dtype=np.float32), self.format), self.format.name,
                              tuple(int(s) for s in array.shape))

    def warn_kept(self) -> None:
        if self.kept:
            fmt, kept = self.format, self.kept
            warnings.warn(f"{fmt.name}: {len(kept)} weight(s) whose inner size is not a multiple of {fmt.block} "
                          f"stay in the compute dtype: {', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''}",
                          stacklevel=3)


def quantize_checkpoint(model: Module, arrays: dict, quantization: str) -> dict:
    """``arrays`` (already read) with the model's Linear weights packed (:class:`CheckpointQuantizer`)."""
    quantizer = CheckpointQuantizer(model, quantization)
    packed = {name: quantizer(name, array) for name, array in arrays.items()}
    quantizer.warn_kept()
    return packed


BNB_STATE = ".quant_state.bitsandbytes__nf4"  # bitsandbytes' packed QuantState (JSON bytes) beside a 4-bit weight
BNB_PARTS = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")


def bitsandbytes_nf4_weights(arrays: dict) -> dict:
    """A checkpoint saved with bitsandbytes' 4-bit NF4 (transformers' load_in_4bit): each ``X.weight`` (packed
    nibbles) with its ``X.weight.absmax`` (float, or uint8 codes when double-quantized, with ``nested_absmax``,
    ``nested_quant_map`` and the state's ``nested_offset``) and quant state becomes one NF4 QuantizedArray."""
    states = [name for name in arrays if name.endswith(BNB_STATE)]
    for state_name in states:
        name = state_name[:-len(BNB_STATE)]
        state = json.loads(np.asarray(arrays.pop(state_name), dtype=np.uint8).tobytes().decode())
        parts = {suffix: arrays.pop(name + suffix, None) for suffix in BNB_PARTS}
        if state.get("quant_type") != "nf4":
            raise QuantizationError(f"{name}: bitsandbytes {state.get('quant_type')!r} weights are not supported "
                                    "(only nf4)")
        if parts[".quant_map"] is not None and not np.allclose(parts[".quant_map"], NF4_LEVELS, atol=1e-6):
            raise QuantizationError(f"{name}: its NF4 code book is not bitsandbytes' standard one")
        shape = tuple(int(s) for s in state["shape"])
        if len(shape) != 2:
            raise QuantizationError(f"{name}: a bitsandbytes NF4 weight of shape {shape} is not a matrix")
        packed = nf4_from_bitsandbytes(arrays[name], parts[".absmax"], shape, blocksize=int(state["blocksize"]),
                                       nested_absmax=parts[".nested_absmax"], nested_code=parts[".nested_quant_map"],
                                       offset=float(state.get("nested_offset", 0.0)),
                                       nested_blocksize=int(state.get("nested_blocksize", 256)))
        arrays[name] = QuantizedArray(packed, "nf4", shape)
    return arrays


def quantized_weight_names(model: Module) -> list[str]:
    return [name for name, t in model.named_parameters() if is_packed(t)]


def refuse_quantized(model: Module, what: str, hint: str) -> None:
    """Raise QuantizationError for ``what`` (full training, saving) when the model holds quantized weights."""
    names = quantized_weight_names(model)
    if names:
        raise QuantizationError(f"{what} refused: {len(names)} weight(s) of this model are quantized "
                                f"({names[0]}, ...); {hint}")


__all__ = ["CheckpointQuantizer", "bitsandbytes_nf4_weights", "quantizable_weights", "quantize_checkpoint",
           "quantized_weight_names", "refuse_quantized"]
