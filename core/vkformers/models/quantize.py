"""Quantizing a float checkpoint while it loads: ``from_pretrained(path, quantization="nf4" | "q4_0" | ...)``.

The weights of the model's Linear layers are packed one tensor at a time (engine.quantized.quantize) before they
reach the device; embeddings, norms, biases and the LM head stay in the compute dtype. A weight whose inner size
is not a whole number of blocks stays in the compute dtype too, and one warning names them. A checkpoint saved
with bitsandbytes' NF4 loads packed as it is (:func:`bitsandbytes_nf4_weights`).

transformers' spellings are read too (:func:`transformers_quantization`): ``quantization_config=
BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16")`` packs NF4 and
computes in bfloat16; ``load_in_8bit=True`` packs Q8_0 (8-bit blocks of 32 with one scale each, in place of
bitsandbytes' LLM.int8 rows); bitsandbytes' FP4 is not offered, and NF4 takes its place with a warning.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np

from vkformers.engine.quantized import (NF4_LEVELS, QUANTIZE_FORMATS, QuantizedArray, nf4_from_bitsandbytes,
                                       quant_format, quantize)
from vkformers.errors import QuantizationError
from vkformers.models.layers import Linear
from vkformers.models.lazy_weights import LazyWeights, Weight
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
    them in one warning. :meth:`converted` packs a LazyWeights' tensors as each is read."""

    def __init__(self, model: Module, quantization: str):
        if str(quantization).lower() not in QUANTIZE_FORMATS:
            raise QuantizationError(f"quantization={quantization!r} is not supported; choose one of "
                                    f"{', '.join(QUANTIZE_FORMATS)}")
        self.format = quant_format(quantization)
        self.names = set(quantizable_weights(model))
        self.kept: list[str] = []

    def __call__(self, name: str, array):
        if name not in self.names or getattr(array, "ndim", 0) != 2 or isinstance(array, QuantizedArray):
            return array  # a weight the checkpoint stores packed stays as it is
        if array.shape[1] % self.format.block:
            self.kept.append(f"{name} {tuple(array.shape)}")
            return array
        return self._pack(name, array)

    def converted(self, weights: LazyWeights) -> LazyWeights:
        """``weights`` with the Linear weights packed when read; those whose shape says they stay unpacked are
        named (:meth:`warn_kept`) now, before any is read."""
        out = {}
        for name in weights:
            weight, shape = weights.weight(name), weights.known_shape(name)
            if name in self.names and shape is None:  # the shape only the values tell
                weight = weight.converted(partial(self, name))
            elif name in self.names and len(shape) == 2:
                if shape[1] % self.format.block:
                    self.kept.append(f"{name} {shape}")
                else:
                    weight = weight.converted(partial(self._pack, name))
            out[name] = weight
        return LazyWeights(out)

    def _pack(self, name: str, array):
        """``array`` packed (where it is not already)."""
        if getattr(array, "ndim", 0) != 2 or isinstance(array, QuantizedArray):
            return array  # a weight the checkpoint stores packed stays as it is
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


def bitsandbytes_nf4_weights(weights: LazyWeights) -> LazyWeights:
    """A checkpoint saved with bitsandbytes' 4-bit NF4 (transformers' load_in_4bit): each ``X.weight`` (packed
    nibbles) with its ``X.weight.absmax`` (float, or uint8 codes when double-quantized, with ``nested_absmax``,
    ``nested_quant_map`` and the state's ``nested_offset``) and quant state becomes one NF4 QuantizedArray, packed
    when it is read. The quant states and code books (a few bytes each) are checked now."""
    states = [name for name in weights if name.endswith(BNB_STATE)]
    if not states:
        return weights
    dropped, packed = set(states), {}
    for state_name in states:
        name = state_name[:-len(BNB_STATE)]
        state = json.loads(np.asarray(weights[state_name], dtype=np.uint8).tobytes().decode())
        parts = {suffix: weights.weight(name + suffix) if name + suffix in weights else None for suffix in BNB_PARTS}
        dropped.update(name + suffix for suffix in BNB_PARTS)
        if state.get("quant_type") != "nf4":
            raise QuantizationError(f"{name}: bitsandbytes {state.get('quant_type')!r} weights are not supported "
                                    "(only nf4)")
        if parts[".quant_map"] is not None and not np.allclose(parts[".quant_map"].read(), NF4_LEVELS, atol=1e-6):
            raise QuantizationError(f"{name}: its NF4 code book is not bitsandbytes' standard one")
        shape = tuple(int(s) for s in state["shape"])
        if len(shape) != 2:
            raise QuantizationError(f"{name}: a bitsandbytes NF4 weight of shape {shape} is not a matrix")
        packed[name] = Weight(shape, partial(_bitsandbytes_nf4, weights.weight(name), parts, state, shape))
    return weights.without(dropped - set(packed)).updated(packed)


def _bitsandbytes_nf4(weight: Weight, parts: dict, state: dict, shape) -> QuantizedArray:
    read = {suffix: None if part is None else part.read() for suffix, part in parts.items()}
    packed = nf4_from_bitsandbytes(weight.read(), read[".absmax"], shape, blocksize=int(state["blocksize"]),
                                   nested_absmax=read[".nested_absmax"], nested_code=read[".nested_quant_map"],
                                   offset=float(state.get("nested_offset", 0.0)),
                                   nested_blocksize=int(state.get("nested_blocksize", 256)))
    return QuantizedArray(packed, "nf4", shape)


def quantized_weight_names(model: Module) -> list[str]:
    return [name for name, t in model.named_parameters() if is_packed(t)]


def refuse_quantized(model: Module, what: str, hint: str) -> None:
    """Raise QuantizationError for ``what`` (full training, saving) when the model holds quantized weights."""
    names = quantized_weight_names(model)
    if names:
        raise QuantizationError(f"{what} refused: {len(names)} weight(s) of this model are quantized "
                                f"({names[0]}, ...); {hint}")


@dataclass
class BitsAndBytesConfig:
    """transformers' BitsAndBytesConfig fields, for code written against it: :func:`transformers_quantization` reads
    it as vkformers' quantization at load (see the module's docstring)."""
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_compute_dtype: object = None
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_quant_storage: object = None
    llm_int8_threshold: float = 6.0
    llm_int8_skip_modules: list | None = None
    llm_int8_enable_fp32_cpu_offload: bool = False
    llm_int8_has_fp16_weight: bool = False
    quant_method: str = "bitsandbytes"

    def to_dict(self) -> dict:
        return asdict(self)


def _field(config, name: str, default=None):
    value = config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
    return default if value is None else value


def transformers_quantization(options: dict, quantization: str | None, dtype) -> tuple[str | None, object]:
    """Take transformers' ``quantization_config`` (a BitsAndBytesConfig or its dict), ``load_in_4bit`` and
    ``load_in_8bit`` out of from_pretrained's ``options``: (the quantization to pack, the dtype to compute in)."""
    config = options.pop("quantization_config", None)
    load_4bit, load_8bit = bool(options.pop("load_in_4bit", False)), bool(options.pop("load_in_8bit", False))
    if config is None and not (load_4bit or load_8bit):
        return quantization, dtype
    if quantization is not None:
        raise QuantizationError(f"quantization={quantization!r} and transformers' quantization_config / load_in_4bit "
                                "/ load_in_8bit: give one of them")
    config = {} if config is None else config
    method = str(_field(config, "quant_method", "bitsandbytes")).lower()
    if method != "bitsandbytes":
        raise QuantizationError(f"quantization_config of quant_method {method!r}: vkformers quantizes at load as "
                                f"bitsandbytes does (or quantization= one of {', '.join(QUANTIZE_FORMATS)})")
    load_4bit = load_4bit or bool(_field(config, "load_in_4bit", False))
    load_8bit = load_8bit or bool(_field(config, "load_in_8bit", False))
    if load_4bit == load_8bit:
        raise QuantizationError("quantization_config: set one of load_in_4bit and load_in_8bit")
    skipped = [m for m in _field(config, "llm_int8_skip_modules", []) if m != "lm_head"]
    if skipped:
        raise QuantizationError(f"llm_int8_skip_modules {skipped}: vkformers keeps the LM head, embeddings and norms "
                                "unpacked and packs every other Linear weight")
    if load_8bit:
        return "q8_0", dtype
    kind = str(_field(config, "bnb_4bit_quant_type", "fp4")).lower()
    if kind not in ("nf4", "fp4"):
        raise QuantizationError(f"bnb_4bit_quant_type={kind!r}: bitsandbytes takes 'nf4' or 'fp4'")
    if kind == "fp4":
        warnings.warn("load_in_4bit: bitsandbytes' FP4 is not offered; the weights are packed as NF4 (QLoRA's "
                      "4-bit NormalFloat; bnb_4bit_quant_type='nf4' asks for it)", stacklevel=3)
    compute = _field(config, "bnb_4bit_compute_dtype")
    if compute is not None and dtype in ("float32", None):
        dtype = str(compute).removeprefix("torch.")
    return "nf4", dtype


__all__ = ["BitsAndBytesConfig", "CheckpointQuantizer", "bitsandbytes_nf4_weights", "quantizable_weights",
           "quantize_checkpoint",
           "quantized_weight_names", "refuse_quantized", "transformers_quantization"]
