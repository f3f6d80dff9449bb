"""How llama.cpp ``.gguf`` files of the dense decoders map to their Hugging Face configs and checkpoints.

One :class:`~vkformers.models.gguf.GGUFArchitecture` per GGUF ``general.architecture``: the metadata keys
llama.cpp's convert_hf_to_gguf writes, its tensor names (``blk.N.attn_q``, ``token_embd``, ...) and what the
converter changed on the way (llama's Q/K row order, Gemma's norm weights stored as 1 + w, GPT-2's Conv1D
weights stored transposed, Falcon's fused QKV regrouped).
"""
from __future__ import annotations

import numpy as np

from vkformers.models.gguf import (DECODER_TENSORS, DERIVED_TENSORS, LLAMA_ROTARY_TRANSFORMS, GGUFArchitecture, GGUFMetadata,
                                   TensorTransform, common_metadata)
from vkformers.models.module import CheckpointError

from vkformers_llama.variants import FAMILY

LLAMA_LAYERS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QK_NORM_LAYERS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
GEMMA2_LAYERS = {**LLAMA_LAYERS, "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def _with_window(metadata: GGUFMetadata, config: dict) -> dict:
    window = metadata.get("attention.sliding_window")
    return {**config, "sliding_window": window} if window else config


def llama3_rope_divisors(inv_freq: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """What each rotary frequency is divided by under Llama 3's rope scaling (transformers' "llama3" rope,
    llama.cpp's rope_freqs tensor): 1 for short wavelengths, ``factor`` for long ones, a blend between."""
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def _llama3_rope(metadata: GGUFMetadata, config: dict) -> dict | None:
    """Llama 3.1+'s rope scaling, which llama.cpp keeps only as the per-frequency divisors of rope_freqs: the
    transformers parameters that give the same divisors. Only the ratios original / low and original / high
    matter, so original is the file's context length; with fewer than two blended frequencies, Llama 3's
    high / low = 4 fixes the band."""
    divisors = metadata.tensor("rope_freqs.weight")
    if divisors is None or metadata.rope_scaling():
        return None
    divisors = divisors.astype(np.float64)
    rotary = metadata.get("rope.dimension_count") or config["head_dim"]
    inv_freq = config["rope_theta"] ** (-np.arange(0, rotary, 2) / rotary)
    factor = float(divisors.max())
    original = config["max_position_embeddings"]
    position = original * inv_freq / (2 * np.pi)  # original / wavelength
    blended = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    share = (1 / divisors - 1 / factor) / (1 - 1 / factor)  # 0 at factor, 1 at 1: (position - low) / (high - low)
    if blended.sum() >= 2:
        slope, intercept = np.polyfit(position[blended], share[blended], 1)
        low = -intercept / slope
        high = low + 1 / slope
    elif blended.sum() == 1:
        low = float(position[blended][0] / (1 + 3 * share[blended][0]))
        high = 4 * low
    else:
        scaled = position[divisors >= factor - 1e-6]
        low = float(scaled.max()) * 1.01 if scaled.size else float(position.min()) / 2
        high = 4 * low
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low), "high_freq_factor": float(high),
            "original_max_position_embeddings": original}
    if not np.allclose(llama3_rope_divisors(inv_freq, factor, low, high, original), divisors, rtol=1e-4):
        raise CheckpointError(f"GGUF rope_freqs of this {metadata.architecture} file are not Llama 3's rope "
                              f"scaling; vkformers cannot express them as a transformers rope config")
    return rope


def _llama_config(metadata: GGUFMetadata) -> dict:
    config = {**metadata.common_config(), "attention_bias": metadata.has_tensor("blk.0.attn_q.bias"),
              "mlp_bias": metadata.has_tensor("blk.0.ffn_up.bias")}
    rope = _llama3_rope(metadata, config)
    if rope:
        config["rope_scaling"] = rope
    return config


def _mistral_config(metadata: GGUFMetadata) -> dict:
    return _with_window(metadata, _llama_config(metadata))


def _mistral_metadata(config: dict) -> dict:
    window = config.get("sliding_window")
    return {**common_metadata(config), **({"attention.sliding_window": window} if window else {})}


def _has_sliding_window(metadata: GGUFMetadata) -> bool:
    return bool(metadata.get("attention.sliding_window"))


def _qwen2_config(metadata: GGUFMetadata) -> dict:
    return {**metadata.common_config(), "use_sliding_window": False}


def _qwen3_config(metadata: GGUFMetadata) -> dict:
    return {**metadata.common_config(), "attention_bias": metadata.has_tensor("blk.0.attn_q.bias")}


def _minus_one(weight: np.ndarray, config: dict) -> np.ndarray:
    """llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight alone)."""
    return weight - np.float32(1.0)


GEMMA_NORM = TensorTransform(_minus_one)


def _gemma_config(metadata: GGUFMetadata) -> dict:
    return {**metadata.common_config(), "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True}


def _gemma2_config(metadata: GGUFMetadata) -> dict:
    config = _gemma_config(metadata)
    scale = metadata.get("attention.scale")  # llama.cpp's query scale; absent: 1/sqrt(head_dim)
    config.update(query_pre_attn_scalar=round(scale ** -2) if scale else config["head_dim"],
                  attn_logit_softcapping=metadata.get("attn_logit_softcapping"),
                  final_logit_softcapping=metadata.get("final_logit_softcapping"),
                  sliding_window=metadata.get("attention.sliding_window"))
    layers = config["num_hidden_layers"]
    config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return config


def _gemma3_config(metadata: GGUFMetadata) -> dict:
    config = _gemma2_config(metadata)
    layers = config["num_hidden_layers"]
    pattern = metadata.get("attention.sliding_window_pattern", 6)  # a period, or one flag per layer
    sliding = pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(layers)]
    config.update(layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                  rope_local_base_freq=10000.0)  # llama.cpp's fixed base of Gemma 3's local layers
    return config


def _phi3_config(metadata: GGUFMetadata) -> dict:
    config = _with_window(metadata, metadata.common_config())
    rotary = metadata.get("rope.dimension_count")
    if rotary:
        config["partial_rotary_factor"] = rotary / config["head_dim"]
    original = metadata.get("rope.scaling.original_context_length")
    if original:
        config["original_max_position_embeddings"] = original
    long, short = metadata.tensor("rope_factors_long.weight"), metadata.tensor("rope_factors_short.weight")
    if long is not None and short is not None:  # LongRoPE (Phi-3 128k, Phi-3.5): llama.cpp keeps its factors as data
        config["rope_scaling"] = {"rope_type": "longrope", "long_factor": long.tolist(),
                                  "short_factor": short.tolist(),
                                  "original_max_position_embeddings": original or config["max_position_embeddings"]}
    return config


def _starcoder2_config(metadata: GGUFMetadata) -> dict:
    config = _with_window(metadata, metadata.common_config())
    config.pop("rms_norm_eps")
    return {**config, "norm_epsilon": metadata.get("attention.layer_norm_epsilon", 1e-5),
            "use_bias": metadata.has_tensor("blk.0.attn_q.bias"), "hidden_act": "gelu_pytorch_tanh"}


def _transpose(weight: np.ndarray, config: dict) -> np.ndarray:
    """GPT-2 keeps Conv1D weights [in, out]; llama.cpp stores them as linear [out, in]."""
    return weight.T if weight.ndim == 2 else weight


CONV1D = TensorTransform(_transpose)


def _gpt2_config(metadata: GGUFMetadata) -> dict:
    common = metadata.common_config()
    return {"n_embd": common["hidden_size"], "n_layer": common["num_hidden_layers"],
            "n_head": common["num_attention_heads"], "n_inner": common["intermediate_size"],
            "n_positions": common["max_position_embeddings"], "vocab_size": common["vocab_size"],
            "layer_norm_epsilon": metadata.get("attention.layer_norm_epsilon", 1e-5),
            "activation_function": "gelu_new", "tie_word_embeddings": True}


def _falcon_qkv_groups(weight: np.ndarray, config: dict) -> np.ndarray:
    """llama.cpp writes Falcon's fused QKV as [all q | all k | all v]; HF groups it per KV head
    [q of the group's heads | k | v] (for one KV head, the same order)."""
    heads = config["num_attention_heads"]
    kv = config["num_kv_heads"] if config["new_decoder_architecture"] else 1
    head_dim = weight.shape[0] // (heads + 2 * kv)
    rest = weight.shape[1:]
    q = weight[:heads * head_dim].reshape(kv, heads // kv, head_dim, *rest)
    k = weight[heads * head_dim:(heads + kv) * head_dim].reshape(kv, 1, head_dim, *rest)
    v = weight[(heads + kv) * head_dim:].reshape(kv, 1, head_dim, *rest)
    return np.concatenate([q, k, v], axis=1).reshape(weight.shape)


def _falcon_config(metadata: GGUFMetadata) -> dict:
    common = metadata.common_config()
    kv = common["num_key_value_heads"]
    new_arch = metadata.has_tensor("blk.0.attn_norm_2.weight")
    ffn = metadata.shape("blk.0.ffn_up.weight")
    return {"hidden_size": common["hidden_size"], "num_hidden_layers": common["num_hidden_layers"],
            "num_attention_heads": common["num_attention_heads"], "num_kv_heads": kv,
            "multi_query": kv == 1 and not new_arch, "new_decoder_architecture": new_arch, "parallel_attn": True,
            "bias": metadata.has_tensor("blk.0.attn_qkv.bias"), "alibi": False,
            "ffn_hidden_size": ffn[0] if ffn else 4 * common["hidden_size"],
            "layer_norm_epsilon": metadata.get("attention.layer_norm_epsilon", 1e-5),
            "max_position_embeddings": common["max_position_embeddings"], "rope_theta": common["rope_theta"],
            "vocab_size": common["vocab_size"], "tie_word_embeddings": common["tie_word_embeddings"]}


FALCON_LAYERS = {"attn_qkv": "self_attention.query_key_value", "attn_output": "self_attention.dense",
                 "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
FALCON_TENSORS = {"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f", "output": "lm_head"}
FALCON_QKV = {"attn_qkv": TensorTransform(_falcon_qkv_groups, reorders_rows=True)}

FAMILY.gguf(
    # Mistral is written as llama; a sliding window (Mistral 7B v0.1) makes it mistral. Llama with experts
    # (Mixtral) is vkformers-moe's.
    GGUFArchitecture("llama", "mistral", "MistralForCausalLM", _mistral_config, LLAMA_LAYERS,
                     transforms=LLAMA_ROTARY_TRANSFORMS, applies=_has_sliding_window, metadata=_mistral_metadata),
    GGUFArchitecture("llama", "llama", "LlamaForCausalLM", _llama_config, LLAMA_LAYERS,
                     transforms=LLAMA_ROTARY_TRANSFORMS, metadata=common_metadata),
    GGUFArchitecture("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen2_config, LLAMA_LAYERS, metadata=common_metadata),
    GGUFArchitecture("qwen3", "qwen3", "Qwen3ForCausalLM", _qwen3_config, {**LLAMA_LAYERS, **QK_NORM_LAYERS},
                     metadata=common_metadata),
    GGUFArchitecture("gemma", "gemma", "GemmaForCausalLM", _gemma_config, LLAMA_LAYERS,
                     transforms={stem: GEMMA_NORM for stem in ("attn_norm", "ffn_norm", "output_norm")}),
    GGUFArchitecture("gemma2", "gemma2", "Gemma2ForCausalLM", _gemma2_config, GEMMA2_LAYERS,
                     transforms={stem: GEMMA_NORM for stem in ("attn_norm", "post_attention_norm", "ffn_norm",
                                                               "post_ffw_norm", "output_norm")}),
    GGUFArchitecture("gemma3", "gemma3_text", "Gemma3ForCausalLM", _gemma3_config,
                     {**GEMMA2_LAYERS, **QK_NORM_LAYERS},
                     transforms={stem: GEMMA_NORM for stem in ("attn_norm", "post_attention_norm", "ffn_norm",
                                                               "post_ffw_norm", "output_norm", "attn_q_norm",
                                                               "attn_k_norm")}),
    GGUFArchitecture("phi3", "phi3", "Phi3ForCausalLM", _phi3_config,
                     {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj",
                      "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                      "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
                     skipped=(*DERIVED_TENSORS, "rope_factors_long", "rope_factors_short")),  # in the config
    GGUFArchitecture("starcoder2", "starcoder2", "Starcoder2ForCausalLM", _starcoder2_config,
                     {**LLAMA_LAYERS, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}),
    GGUFArchitecture("gpt2", "gpt2", "GPT2LMHeadModel", _gpt2_config,
                     {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                      "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
                     tensors={"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                              "output_norm": "transformer.ln_f"},
                     layer_prefix="transformer.h",
                     transforms={stem: CONV1D for stem in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")},
                     skipped=("output",)),  # the converter repeats the tied embedding as output
    GGUFArchitecture("falcon", "falcon", "FalconForCausalLM", _falcon_config,
                     {**FALCON_LAYERS, "attn_norm": "ln_attn", "attn_norm_2": "ln_mlp"},
                     tensors=FALCON_TENSORS, layer_prefix="transformer.h", transforms=FALCON_QKV,
                     applies=lambda metadata: metadata.has_tensor("blk.0.attn_norm_2.weight")),
    GGUFArchitecture("falcon", "falcon", "FalconForCausalLM", _falcon_config,
                     {**FALCON_LAYERS, "attn_norm": "input_layernorm"},
                     tensors=FALCON_TENSORS, layer_prefix="transformer.h", transforms=FALCON_QKV),
)

__all__ = ["DECODER_TENSORS", "GEMMA2_LAYERS", "LLAMA_LAYERS", "QK_NORM_LAYERS"]
