"""Rotary-embedding frequencies of a Hugging Face config, without transformers or torch.

:func:`rope_parameters` reproduces transformers' ``modeling_rope_utils`` (5.x; the 4.x
formulas agree) for the rope types default, linear, dynamic (NTK; HunYuan's with a fixed
``alpha``), llama3, yarn, longrope and proportional, including its float32 arithmetic: torch
computes the frequencies in float32 from Python-float scalars, so every step below rounds to
float32 where torch's does
(numpy float32 + - * / are the same IEEE operations; pow may differ by an ulp).

Config names read (4.x and 5.x):
- 5.x: ``rope_parameters`` {rope_type, rope_theta, partial_rotary_factor, factor, ...}, or
  one such dict per layer type (``layer_type=``).
- 4.x: ``rope_theta``, ``partial_rotary_factor`` at the top level and ``rope_scaling``
  {type | rope_type, factor, ...}; ``original_max_position_embeddings`` at the top level
  (Phi-3) wins over the one in the scaling dict, as in transformers.
- ``head_dim`` (else hidden_size // num_attention_heads), ``max_position_embeddings``.

``seq_len`` is the length the frequencies are used for (max position + 1). It matters for
dynamic (frequencies change once seq_len > max_position_embeddings) and longrope (long
factors once seq_len > original_max_position_embeddings), the choices HF's
``dynamic_rope_update`` makes at run time; None means "at init" (max_position_embeddings for
dynamic, the short factors for longrope).
"""
from __future__ import annotations

import math

import numpy as np

F32 = np.float32
ROPE_TYPE_ALIASES = {"su": "longrope", "mrope": "default"}  # 4.x spellings (Phi-3 "su", Qwen2-VL "mrope")
# Models whose rotary embedding reads "dynamic" with an ``alpha`` as fixed NTK-alpha scaling (HunYuan's
# DynamicNTKAlphaRotary); every other model's "dynamic" ignores alpha, as transformers' shared one does.
NTK_ALPHA_MODEL_TYPES = frozenset({"hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text"})


def rope_parameters(config: dict, seq_len: int | None = None, *, layer_type: str | None = None
                    ) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [rot_dim / 2], attention_scaling) for a config.json dict."""
    params = _rope_dict(config, layer_type)
    rope_type = ROPE_TYPE_ALIASES.get(params["rope_type"], params["rope_type"])
    if rope_type == "dynamic" and params.get("alpha") and config.get("model_type") in NTK_ALPHA_MODEL_TYPES:
        rope_type = "ntk_alpha"
    if rope_type not in _COMPUTE:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(sorted(_COMPUTE))}")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    inv_freq, scaling = _COMPUTE[rope_type](params, config, head_dim, seq_len)
    return np.asarray(inv_freq, dtype=np.float32), float(scaling)


def rotary_dim(config: dict, *, layer_type: str | None = None) -> int:
    """How many dims of each head rotate: int(head_dim * partial_rotary_factor)."""
    params = _rope_dict(config, layer_type)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if ROPE_TYPE_ALIASES.get(params["rope_type"], params["rope_type"]) == "proportional":
        return head_dim
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _rope_dict(config: dict, layer_type: str | None) -> dict:
    """The standardized rope dict: transformers' standardize_rope_params on a plain dict."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if layer_type is not None:
        params = params[layer_type]
    elif params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope parameters are given per layer type ({', '.join(params)}); pass layer_type=")
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn", "longrope", "su"):
        if "original_max_position_embeddings" in config:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


def _exponents(dim: int) -> np.ndarray:
    """torch.arange(0, dim, 2).float() / dim, in float32."""
    return np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)


def _pow(base: float, exponents: np.ndarray) -> np.ndarray:
    """Python-float base ** float32 tensor: torch rounds the base to float32, then powf."""
    return (np.float64(F32(base)) ** exponents.astype(np.float64)).astype(F32)


def _plain_inv_freq(base: float, dim: int) -> np.ndarray:
    return F32(1.0) / _pow(base, _exponents(dim))


def _rot_dim(params: dict, head_dim: int) -> int:
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _default(params, config, head_dim, seq_len):
    return _plain_inv_freq(params["rope_theta"], _rot_dim(params, head_dim)), 1.0


def _linear(params, config, head_dim, seq_len):
    inv_freq = _plain_inv_freq(params["rope_theta"], _rot_dim(params, head_dim))
    return inv_freq / F32(params["factor"]), 1.0


def _dynamic(params, config, head_dim, seq_len):
    dim = _rot_dim(params, head_dim)
    factor, max_positions = params["factor"], config["max_position_embeddings"]
    seq_len = max_positions if seq_len is None else max(seq_len, max_positions)
    base = params["rope_theta"] * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return _plain_inv_freq(base, dim), 1.0


def _ntk_alpha(params, config, head_dim, seq_len):
    """HunYuan: base = theta * alpha ** (d / (d - 2)) over the whole head_dim, whatever the sequence length."""
    base = params["rope_theta"] * params["alpha"] ** (head_dim / (head_dim - 2))
    return _plain_inv_freq(base, head_dim), 1.0


def _llama3(params, config, head_dim, seq_len):
    inv_freq = _plain_inv_freq(params["rope_theta"], _rot_dim(params, head_dim))
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = F32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > F32(low_freq_wavelen), inv_freq / F32(factor), inv_freq)
    smooth = (F32(old_context) / wavelen - F32(low)) / F32(high - low)
    smoothed = (F32(1) - smooth) * scaled / F32(factor) + smooth * scaled
    medium = ~(wavelen < F32(high_freq_wavelen)) & ~(wavelen > F32(low_freq_wavelen))
    return np.where(medium, smoothed, scaled), 1.0


def _yarn(params, config, head_dim, seq_len):
    base = params["rope_theta"]
    dim = _rot_dim(params, head_dim)
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = config["max_position_embeddings"] / original

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = _pow(base, _exponents(dim))
    extrapolation = F32(1.0) / pos_freqs
    interpolation = F32(1.0) / (F32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), F32(0), F32(1))
    extrapolation_factor = F32(1) - ramp
    inv_freq = interpolation * (F32(1) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope(params, config, head_dim, seq_len):
    dim = _rot_dim(params, head_dim)
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = config["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext_factors = np.asarray(params["long_factor" if long else "short_factor"], dtype=F32)
    if ext_factors.shape != (dim // 2,):
        raise ValueError(f"longrope: {'long' if long else 'short'}_factor has {ext_factors.size} values, "
                         f"expected {dim // 2}")
    return F32(1.0) / (ext_factors * _pow(params["rope_theta"], _exponents(dim))), attention_factor


def _proportional(params, config, head_dim, seq_len):
    """Rotate the first partial_rotary_factor of the angles; the rest get frequency 0 (identity)."""
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(F32) / F32(head_dim)
    inv_freq = np.concatenate([F32(1.0) / _pow(params["rope_theta"], exponents),
                               np.zeros(head_dim // 2 - angles, F32)])
    return inv_freq / F32(params.get("factor", 1.0)), 1.0


_COMPUTE = {"default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn,
            "longrope": _longrope, "proportional": _proportional, "ntk_alpha": _ntk_alpha}
