"""Per-architecture deltas: how each dense decoder's config.json fills the decoder kit's :class:`DecoderSpec`
(:mod:`vkformers.models.decoder`).

Like transformers' modular files, a variant is its parent plus a declared difference:
``mistral`` is ``llama`` with a sliding window, ``gemma2`` is ``gemma`` with sublayer
post-norms and soft-capping, and so on. Every variant keeps Hugging Face's parameter
names, so a checkpoint loads as is (fused projections stay fused parameters and are split
with views in the forward pass).

A config option that changes the maths but is not implemented raises
:class:`UnsupportedConfigError` naming the option, instead of silently computing
something else.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from vkformers.models.decoder.spec import (AttentionSpec, CrossAttentionSpec, DecoderSpec, LinearAttentionSpec, MLPSpec,
                                           NormSpec, PositionSpec, UnsupportedConfigError, first_of, layer_types, padding_idx, refuse,
                                           sliding_windows, with_mla)
from vkformers.models.family import Family
from vkformers.models.registry import NESTED_TEXT_CONFIG, NestedConfig
from vkformers_llama.cpmant import CpmAntInputs
from vkformers_llama.diffllama import DiffAttention
from vkformers_llama.doge import DynamicMaskAttention
from vkformers_llama.gemma3n import Gemma3nLayers, shared_kv_sources
from vkformers_llama.xlnet import XLNetSpec, xlnet_spec

# The architectures of vkformers-llama, each declared once on its variant function (vkformers.models.family).
FAMILY = Family("llama", kind="causal-decoder")
architecture = FAMILY.architecture


def _sizes(config: dict) -> dict:
    hidden = first_of(config, "hidden_size", "n_embd", "d_model")
    heads = first_of(config, "num_attention_heads", "n_head")
    return dict(
        vocab_size=config["vocab_size"], hidden_size=hidden,
        num_layers=first_of(config, "num_hidden_layers", "n_layer"),
        num_heads=heads, num_kv_heads=first_of(config, "num_key_value_heads", default=heads),
        head_dim=first_of(config, "head_dim", default=hidden // heads),
        intermediate_size=first_of(config, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                                 default=4 * hidden),
        max_position_embeddings=first_of(config, "max_position_embeddings", "n_positions", default=2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        embed_padding_idx=padding_idx(config),
    )


# ---------------------------------------------------------------- the variants

@architecture("llama", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation; upstream claims HF forward-logit fixtures",
              aliases=[
                  "code_llama",  # historical Code Llama spelling; Llama parser
                  "mllama_text_model",  # Mllama text-only: cross-attention layers skipped, self-attention layers run on Llama graph
                  "mllama",  # multimodal wrapper; text_config parsed as mllama_text_model
                  "paddleocr_vl_text",  # parsed on Llama contract (use_bias mapped to attention/mlp bias; mRoPE reduced)
              ])
# Emu3's text decoder is a Llama block (attention_bias read by llama)
@architecture("emu3_text_model", norm="rms", llama_layout=True, status="verified",
              aliases=[
                  "emu3",  # multimodal wrapper; text_config
              ])
def llama(config: dict) -> DecoderSpec:
    arch = config.get("model_type", "llama")
    refuse(arch, config, "pretraining_tp", lambda v: v in (None, 1))
    bias = bool(config.get("attention_bias", False))
    spec = DecoderSpec(**_sizes(config), norms=NormSpec(eps=first_of(config, "rms_norm_eps", default=1e-6)),
                       hidden_act=config.get("hidden_act", "silu"),
                       attention=AttentionSpec(q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias),
                       mlp=MLPSpec(bias=bool(config.get("mlp_bias", False))))
    return mllama_text_model(config, spec) if arch == "mllama_text_model" else spec


def mllama_text_model(config: dict, spec: DecoderSpec) -> DecoderSpec:
    """Mllama's text model run text-only: Llama whose cross_attention_layers (image cross-attention, which
    transformers skips without image states) are left out, and whose embedding has 8 more rows (image tokens)."""
    refuse("mllama_text_model", config, "tie_word_embeddings", lambda v: not v)  # embedding and head differ in rows
    cross = set(config.get("cross_attention_layers") or ())
    kept = tuple(i for i in range(spec.num_layers) if i not in cross)
    return replace(spec, num_layers=len(kept), checkpoint_layers=kept, embed_extra_rows=8)


@architecture("mistral", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation; upstream claims HF forward-logit fixtures",
              aliases=[
                  "mistral3",  # multimodal wrapper; text_config parsed with Mistral parser
              ])
def mistral(config: dict) -> DecoderSpec:
    spec = llama(config)
    return spec.amend("attention", windows=sliding_windows(config, spec.num_layers, every_layer=True))


@architecture("qwen2", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation; upstream claims HF forward-logit fixtures",
              aliases=[
                  "qwen2_vl_text",  # mRoPE reduced to 1-D RoPE for text-only
                  "qwen2_5_vl_text",  # mRoPE reduced to 1-D RoPE for text-only
                  "qwen2_vl",  # multimodal wrapper; text_config parsed as Qwen2-VL text
                  "qwen2_5_vl",  # multimodal wrapper; text_config parsed as Qwen2-VL text
                  "qwen2_5_omni_text",  # parsed with Qwen2-VL text parser
              ])
def qwen2(config: dict) -> DecoderSpec:
    spec = llama(config)
    spec = replace(spec, attention=replace(spec.attention, q_bias=True, k_bias=True, v_bias=True, o_bias=False))
    if config.get("layer_types"):
        windows = sliding_windows(config, spec.num_layers, every_layer=False)
    elif config.get("use_sliding_window"):  # 4.x: layers from max_window_layers on slide
        first = config.get("max_window_layers", 0)
        windows = tuple(config["sliding_window"] if i >= first else 0 for i in range(spec.num_layers))
    else:
        windows = ()
    return replace(spec, attention=replace(spec.attention, windows=windows))


@architecture("qwen3", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation",
              aliases=[
                  "qwen3_vl_text",  # normalized to qwen3
                  "qwen3_vl",  # multimodal wrapper; text_config
              ])
def qwen3(config: dict) -> DecoderSpec:
    spec = qwen2(config)
    return replace(spec,
                   attention=replace(spec.attention, q_bias=bool(config.get("attention_bias", False)),
                                     k_bias=bool(config.get("attention_bias", False)),
                                     v_bias=bool(config.get("attention_bias", False)),
                                     o_bias=bool(config.get("attention_bias", False)), q_norm="q_norm",
                                     k_norm="k_norm"))


@architecture("gemma", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation")
def gemma(config: dict) -> DecoderSpec:
    act = first_of(config, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
    spec = llama(config)
    return replace(spec, hidden_act=act,
                   norms=replace(spec.norms, unit_offset=True), embed_scale=config["hidden_size"] ** 0.5,
                   embed_scale_in_dtype=True, tie_embeddings=bool(config.get("tie_word_embeddings", True)))


def _gemma_layer_types(config: dict, num_layers: int, default_sliding: Callable[[int], bool]) -> list[str]:
    types = config.get("layer_types")
    if types:
        return list(types)
    return ["sliding_attention" if default_sliding(i) else "full_attention" for i in range(num_layers)]


@architecture("gemma2", norm="rms", llama_layout=True, status="verified",
              notes="pre+post sublayer norms; logit softcapping")
def gemma2(config: dict) -> DecoderSpec:
    spec = gemma(config)
    types = _gemma_layer_types(config, spec.num_layers, lambda i: i % 2 == 0)
    window = config.get("sliding_window") or 0
    scale = first_of(config, "query_pre_attn_scalar", default=spec.head_dim) ** -0.5
    return replace(spec, attn_out_norm="post_attention_layernorm", mlp_in_norm="pre_feedforward_layernorm",
                   mlp_out_norm="post_feedforward_layernorm",
                   attention=replace(spec.attention, scales=(scale,) * spec.num_layers,
                                     windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                                     softcap=config.get("attn_logit_softcapping") or 0.0,
                                     blind_rows="all"),  # eager only
                   final_softcap=config.get("final_logit_softcapping") or 0.0)


@architecture("gemma3_text", norm="rms", llama_layout=True, status="verified",
              notes="pre+post sublayer norms; QK-norm",
              aliases=[
                  "gemma3",  # multimodal wrapper; text_config
              ])
def gemma3_text(config: dict) -> DecoderSpec:
    spec = gemma2(config).amend("attention", blind_rows="zero")  # sdpa
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
    types = _gemma_layer_types(config, spec.num_layers, lambda i: (i + 1) % pattern != 0)
    window = config.get("sliding_window") or 0
    params = config.get("rope_parameters")
    if params and all(isinstance(v, dict) for v in params.values()):  # 5.x: one rope dict per layer type
        ropes = tuple((config, t) for t in types)
    else:  # 4.x: local layers use rope_local_base_freq without scaling
        local = dict(config, rope_scaling=None, rope_parameters=None,
                     rope_theta=config.get("rope_local_base_freq", 10000.0))
        ropes = tuple((local if t == "sliding_attention" else config, None) for t in types)
    return replace(spec,
                   attention=replace(spec.attention, q_norm="q_norm", k_norm="k_norm",
                                     windows=tuple(window if t == "sliding_attention" else 0 for t in types)),
                   positions=replace(spec.positions, rope_configs=ropes))


@architecture("gemma3n_text", norm="rms", llama_layout=True, status="verified",
              model_class="vkformers_llama.model:Gemma3nForCausalLM",
              notes="AltUp streams, LAuReL, per-layer inputs, KV sharing across layers, gaussian top-k activation "
                    "sparsity (gemma3n.py)")
def gemma3n_text(config: dict) -> DecoderSpec:
    """Gemma 3's attention layers (sliding / full by layer_types, q/k norms, sandwich norms, soft-capped logits) with
    plain-weight RMS norms, a weightless value norm and scale 1, in Gemma 3n's layer (vkformers_llama.gemma3n):
    AltUp over altup_num_inputs streams, a LAuReL branch, per-layer inputs, KV sharing in the last
    num_kv_shared_layers layers, per-layer MLP widths and activation sparsity. altup_coef_clip (a clamp of the
    AltUp coefficient weights in training mode, at 120 by default) is not applied."""
    n = config.get("num_hidden_layers", 35)
    sizes = config.get("intermediate_size", 16384)
    sizes = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes] * n
    types = config.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                          for i in range(n)]
    sparsity = config.get("activation_sparsity_pattern")
    if sparsity is None:
        sparsity = [0.95] * (10 if n > 10 else 0) + [0.0] * (n - (10 if n > 10 else 0))
    sparsity = list(sparsity) if isinstance(sparsity, (list, tuple)) else [sparsity] * n
    if len(sizes) != n or len(sparsity) != n or len(types) != n:
        raise UnsupportedConfigError("gemma3n_text: intermediate_size, activation_sparsity_pattern and layer_types "
                                     "need one entry per layer; fix the config")
    rope = {} if isinstance(config.get("rope_parameters"), dict) else {
        "rope_theta": config.get("rope_theta", 1e6), "rope_local_base_freq": config.get("rope_local_base_freq", 1e4)}
    config = dict(config, **rope, intermediate_size=sizes[0], layer_types=types,
                  head_dim=config.get("head_dim", 256), sliding_window=config.get("sliding_window", 512),
                  final_logit_softcapping=config.get("final_logit_softcapping", 30.0))
    spec = gemma3_text(config)
    layers = Gemma3nLayers(
        altup_inputs=int(config.get("altup_num_inputs", 4)), altup_active=int(config.get("altup_active_idx", 0)),
        altup_correct_scale=bool(config.get("altup_correct_scale", True)),
        laurel_rank=int(config.get("laurel_rank", 64)),
        per_layer_width=int(config.get("hidden_size_per_layer_input", 256)),
        intermediate_sizes=tuple(int(w) for w in sizes), sparsity=tuple(float(p) for p in sparsity),
        layer_types=tuple(types),
        kv_sources=shared_kv_sources("gemma3n_text", types, int(config.get("num_kv_shared_layers", 15))))
    return replace(spec, norms=replace(spec.norms, unit_offset=False), make_layer=layers,
                   attention=replace(spec.attention, scales=(1.0,) * spec.num_layers),
                   extra=dict(spec.extra, per_layer_vocab=int(config.get("vocab_size_per_layer_input", 262144))))


@architecture("phi3", norm="rms", status="verified",
              notes="native KV-cache generation; upstream claims 2-step AdamW parity",
              aliases=[
                  "phi4_multimodal",  # root config normalized to phi3; image/audio towers preserved, not executed; upstream claims 2-step AdamW parity
              ])
def phi3(config: dict) -> DecoderSpec:
    spec = mistral(config)
    return replace(spec,
                   attention=replace(spec.attention, qkv_proj="qkv_proj", qkv_layout="blocks"),
                   mlp=replace(spec.mlp, gate_up_proj="gate_up_proj"),
                   norms=replace(spec.norms, eps=first_of(config, "rms_norm_eps", default=1e-5)))


@architecture("olmo", norm="layer", llama_layout=True, status="verified",
              notes="parameter-free LayerNorm")
def olmo(config: dict) -> DecoderSpec:
    spec = llama(config)
    return replace(spec, norms=replace(spec.norms, kind="layer", eps=1e-5, weight=False, bias=False),
                   attention=replace(spec.attention, clip_qkv=config.get("clip_qkv")))


@architecture("olmo2", norm="rms", llama_layout=True, status="verified")
def olmo2(config: dict) -> DecoderSpec:
    spec = llama(config)
    return replace(spec,
                   attention=replace(spec.attention, q_norm="q_norm", k_norm="k_norm", qk_norm_scope="full"),
                   attn_in_norm=None,
                   attn_out_norm="post_attention_layernorm", mlp_in_norm=None,
                   mlp_out_norm="post_feedforward_layernorm",
                   norms=replace(spec.norms, eps=config.get("rms_norm_eps", 1e-5)))


@architecture("granite", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation",
              aliases=[
                  "granite4_vision_text",  # normalized to granite
              ])
def granite(config: dict) -> DecoderSpec:
    spec = llama(config)
    return replace(spec, embed_scale=config.get("embedding_multiplier", 1.0),
                   residual_scale=config.get("residual_multiplier", 1.0),
                   attention=replace(spec.attention, scales=(config.get("attention_multiplier",
                                                                        1.0),) * config["num_hidden_layers"]),
                   logits_scale=1.0 / config.get("logits_scaling", 1.0))


@architecture("cohere", norm="layer", llama_layout=True, status="verified")
def cohere(config: dict) -> DecoderSpec:
    qk_norm = bool(config.get("use_qk_norm", False))
    spec = llama(config)
    return replace(spec,
                   attention=replace(spec.attention, q_norm="q_norm" if qk_norm else None,
                                     k_norm="k_norm" if qk_norm else None, qk_norm_scope="per_head"),
                   norms=replace(spec.norms, kind="layer", eps=config.get("layer_norm_eps", 1e-5), bias=False),
                   parallel_residual=True, mlp_in_norm=None, positions=replace(spec.positions, rope_interleaved=True),
                   logits_scale=config.get("logit_scale", 1.0),
                   tie_embeddings=bool(config.get("tie_word_embeddings", True)))


@architecture("stablelm", norm="layer", llama_layout=True, status="verified",
              notes="native KV-cache generation")
def stablelm(config: dict) -> DecoderSpec:
    qk_norm = bool(config.get("qk_layernorm", False))
    bias = bool(config.get("use_qkv_bias", False))
    parallel = bool(config.get("use_parallel_residual", False))
    spec = llama(config)
    return replace(spec, norms=replace(spec.norms, kind="layer", eps=config.get("layer_norm_eps", 1e-5), bias=True),
                   attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=False,
                                     q_norm="q_layernorm" if qk_norm else None,
                                     k_norm="k_layernorm" if qk_norm else None, qk_norm_scope="per_head_list"),
                   parallel_residual=parallel,
                   mlp_in_norm=None if parallel else "post_attention_layernorm")


@architecture("starcoder2", norm="layer", status="verified",
              notes="native KV-cache generation")
def starcoder2(config: dict) -> DecoderSpec:
    bias = bool(config.get("use_bias", True))
    spec = mistral(config)
    return replace(spec, norms=replace(spec.norms, kind="layer", eps=config.get("norm_epsilon", 1e-5), bias=True),
                   hidden_act=config.get("hidden_act", "gelu_pytorch_tanh"),
                   mlp=replace(spec.mlp, kind="plain", up_proj="c_fc", down_proj="c_proj", bias=bias),
                   attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias))


@architecture("gpt2", norm="layer", status="verified",
              notes="native KV-cache generation; upstream claims HF forward-logit fixtures")
@architecture("gpt-sw3", norm="layer", status="verified")  # GPT2Config / GPT2LMHeadModel under another model_type
def gpt2(config: dict) -> DecoderSpec:
    refuse("gpt2", config, "scale_attn_weights", lambda v: v in (None, True))
    spec = DecoderSpec(**_sizes(config))
    scales = tuple(spec.head_dim ** -0.5 / ((i + 1) if config.get("scale_attn_by_inverse_layer_idx") else 1)
                   for i in range(spec.num_layers))
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   embed="transformer.wte", position_embed="transformer.wpe",
                   positions=replace(spec.positions, rope=False),
                   layers="transformer.h", final_norm="transformer.ln_f",
                   attention=replace(spec.attention, path="attn", qkv_proj="c_attn", o_proj="c_proj", q_bias=True,
                                     k_bias=True, v_bias=True, o_bias=True, scales=scales),
                   attn_in_norm="ln_1", mlp_in_norm="ln_2",
                   mlp=replace(spec.mlp, kind="plain", up_proj="c_fc", down_proj="c_proj", bias=True),
                   conv1d=True,
                   # add_cross_attention: crossattention (q_attn, c_attn [k | v], c_proj) after ln_cross_attn, run
                   # when encoder_hidden_states are given (an encoder-decoder's decoder)
                   cross_attention=CrossAttentionSpec() if config.get("add_cross_attention") else None,
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_epsilon", 1e-5)),
                   hidden_act=config.get("activation_function", "gelu_new"))


@architecture("gpt_neox", norm="layer", status="verified")
def gpt_neox(config: dict) -> DecoderSpec:
    spec = DecoderSpec(**_sizes(config))
    rope_config = dict(config)  # 4.x spelled the rotary fraction and base differently
    if "rotary_pct" in config and "partial_rotary_factor" not in config and not config.get("rope_parameters"):
        rope_config["partial_rotary_factor"] = config["rotary_pct"]
    if "rotary_emb_base" in config and not config.get("rope_parameters"):
        rope_config["rope_theta"] = config["rotary_emb_base"]
    parallel = bool(config.get("use_parallel_residual", True))
    bias = bool(config.get("attention_bias", True))
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   embed="gpt_neox.embed_in", layers="gpt_neox.layers",
                   final_norm="gpt_neox.final_layer_norm", lm_head="embed_out",
                   attention=replace(spec.attention, path="attention", qkv_proj="query_key_value",
                                     qkv_layout="per_head", o_proj="dense", q_bias=bias, k_bias=bias, v_bias=bias,
                                     o_bias=bias),
                   mlp=replace(spec.mlp, kind="plain", up_proj="dense_h_to_4h", down_proj="dense_4h_to_h", bias=True),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_eps", 1e-5)),
                   hidden_act=config.get("hidden_act", "gelu"),
                   parallel_residual=parallel,
                   positions=replace(spec.positions, rope_configs=((rope_config, None),) * spec.num_layers),
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)))


@architecture("phi", norm="layer", status="verified")
def phi(config: dict) -> DecoderSpec:
    qk_norm = bool(config.get("qk_layernorm", False))
    spec = DecoderSpec(**_sizes(config))
    return replace(spec, final_norm="model.final_layernorm",
                   attention=replace(spec.attention, o_proj="dense", q_bias=True, k_bias=True, v_bias=True,
                                     o_bias=True, q_norm="q_layernorm" if qk_norm else None,
                                     k_norm="k_layernorm" if qk_norm else None),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_eps", 1e-5)),
                   hidden_act=config.get("hidden_act", "gelu_new"),
                   lm_head_bias=True,
                   parallel_residual=True, mlp_in_norm=None,
                   tie_embeddings=bool(config.get("tie_word_embeddings", False))).amend("mlp", kind="plain",
                                                                                        up_proj="fc1", down_proj="fc2",
                                                                                        bias=True)


@architecture("opt", norm="layer", status="verified")
def opt(config: dict) -> DecoderSpec:
    refuse("opt", config, "layer_norm_elementwise_affine", lambda v: v in (None, True))
    bias = bool(config.get("enable_bias", True))
    spec = DecoderSpec(**_sizes(config))
    pre_norm = config.get("do_layer_norm_before", True)
    embed_dim = config.get("word_embed_proj_dim") or spec.hidden_size
    projected = embed_dim != spec.hidden_size
    if projected or not pre_norm:
        spec = replace(spec, embed_dim=embed_dim, project_in="model.decoder.project_in" if projected else None,
                       project_out="model.decoder.project_out" if projected else None, post_norm=not pre_norm)
    remove_final = config.get("_remove_final_layer_norm") or not pre_norm
    return replace(spec, embed="model.decoder.embed_tokens", position_embed="model.decoder.embed_positions",
                   positions=replace(spec.positions, offset=2, from_mask=True, rope=False),
                   layers="model.decoder.layers",
                   final_norm=None if remove_final else "model.decoder.final_layer_norm",
                   attention=replace(spec.attention, o_proj="out_proj", q_bias=bias, k_bias=bias, v_bias=bias,
                                     o_bias=bias), attn_in_norm="self_attn_layer_norm", mlp_in_norm="final_layer_norm",
                   mlp=replace(spec.mlp, path="", kind="plain", up_proj="fc1", down_proj="fc2", bias=bias),
                   norms=replace(spec.norms, kind="layer", bias=bias, eps=1e-5),
                   hidden_act=config.get("activation_function", "relu"))


@architecture("falcon", norm="layer", status="verified")
def falcon(config: dict) -> DecoderSpec:
    new_arch = bool(config.get("new_decoder_architecture", False))
    if new_arch:
        refuse("falcon", config, "num_ln_in_parallel_attn", lambda v: v in (None, 2))
    else:
        refuse("falcon", config, "num_ln_in_parallel_attn", lambda v: v in (None, 1))
    spec = DecoderSpec(**_sizes(config))
    heads = spec.num_heads
    kv_heads = config.get("num_kv_heads", heads) if new_arch else (1 if config.get("multi_query", True) else heads)
    parallel = new_arch or bool(config.get("parallel_attn", True))
    bias = bool(config.get("bias", False))
    if new_arch:
        norms = dict(attn_in_norm="ln_attn", mlp_in_norm="ln_mlp")
    else:
        norms = dict(attn_in_norm="input_layernorm", mlp_in_norm=None if parallel else "post_attention_layernorm")
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   num_kv_heads=kv_heads, embed="transformer.word_embeddings",
                   layers="transformer.h",
                   final_norm="transformer.ln_f",
                   attention=replace(spec.attention, path="self_attention", qkv_proj="query_key_value",
                                     qkv_layout="grouped" if new_arch else ("blocks" if kv_heads == 1 else "per_head"),
                                     o_proj="dense", q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias,
                                     # with ALiBi its mask is a float one (dtype minimum), in sdpa too
                                     blind_rows="all" if config.get("alibi") else "zero"),
                   mlp=replace(spec.mlp, kind="plain", up_proj="dense_h_to_4h", down_proj="dense_4h_to_h", bias=bias),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_epsilon", 1e-5)),
                   hidden_act=config.get("activation", "gelu"),
                   parallel_residual=parallel,
                   intermediate_size=config.get("ffn_hidden_size") or 4 * spec.hidden_size, **norms,
                   # Falcon-RW: ALiBi instead of rotary, added before the 1/sqrt(D) scaling
                   positions=replace(spec.positions, rope=False, alibi=True, alibi_slope_scale=spec.head_dim ** -0.5)
                   if config.get("alibi") else spec.positions)


@architecture("bloom", norm="layer", status="verified",
              notes="ALiBi")
def bloom(config: dict) -> DecoderSpec:
    refuse("bloom", config, "apply_residual_connection_post_layernorm", lambda v: not v)
    spec = DecoderSpec(**_sizes(config))
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   embed="transformer.word_embeddings",
                   embed_norm="transformer.word_embeddings_layernorm",
                   layers="transformer.h", final_norm="transformer.ln_f",
                   attention=replace(spec.attention, path="self_attention", qkv_proj="query_key_value",
                                     qkv_layout="per_head", o_proj="dense", q_bias=True, k_bias=True, v_bias=True,
                                     o_bias=True, blind_rows="all"),  # eager only
                   mlp=replace(spec.mlp, kind="plain", up_proj="dense_h_to_4h", down_proj="dense_4h_to_h", bias=True),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_epsilon", 1e-5)),
                   hidden_act="gelu_pytorch_tanh",
                   positions=replace(spec.positions, rope=False, alibi=True),
                   intermediate_size=4 * spec.hidden_size)


# -- Llama-block relatives

@architecture("arcee", norm="rms", llama_layout=True, status="verified")
def arcee(config: dict) -> DecoderSpec:
    """Llama with a plain (ungated) up/down MLP (squared ReLU)."""
    return replace(llama(config), hidden_act=config.get("hidden_act", "relu2")).amend("mlp", kind="plain")


@architecture("ministral", norm="rms", llama_layout=True, status="verified")
def ministral(config: dict) -> DecoderSpec:
    """Mistral with per-layer layer_types (sliding_windows reads them)."""
    return mistral(config)


@architecture("ministral3", norm="rms", llama_layout=True, status="verified")
def ministral3(config: dict) -> DecoderSpec:
    """Mistral + Llama-4 query scaling by position (rope_parameters.llama_4_scaling_beta)."""
    spec = mistral(config)
    params = config.get("rope_parameters") or {}
    beta = params.get("llama_4_scaling_beta")
    if beta:
        spec = spec.amend("positions", query_scale=(float(beta), int(params["original_max_position_embeddings"])))
    return spec


@architecture("helium", norm="rms", llama_layout=True, status="verified")
def helium(config: dict) -> DecoderSpec:
    spec = llama(config)
    return replace(spec, positions=replace(spec.positions, rope_interleaved=True))


@architecture("smollm3", norm="rms", llama_layout=True, status="verified")
def smollm3(config: dict) -> DecoderSpec:
    """Llama with NoPE layers: no_rope_layers[i] == 1 means layer i rotates."""
    spec = llama(config)
    use_rope = config.get("no_rope_layers")
    windows = sliding_windows(config, spec.num_layers, every_layer=False) if config.get("use_sliding_window") else ()
    return replace(spec,
                   positions=replace(spec.positions, rope_layers=tuple(bool(u) for u in use_rope) if use_rope else ()),
                   attention=replace(spec.attention, windows=windows),
                   tie_embeddings=bool(config.get("tie_word_embeddings", True)))


@architecture("ernie4_5", norm="rms", llama_layout=True, status="verified")
def ernie4_5(config: dict) -> DecoderSpec:
    bias = bool(config.get("use_bias", False))
    spec = llama(config)
    return replace(spec, positions=replace(spec.positions, rope_interleaved=True), mlp=replace(spec.mlp, bias=bias),
                   attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias))


@architecture("glm", norm="rms", llama_layout=True, status="verified")
def glm(config: dict) -> DecoderSpec:
    """Fused gate_up MLP, q/k/v biases, interleaved partial rotary."""
    # GLM-OCR's text attention has no biases (its config has no attention_bias field)
    bias = bool(config.get("attention_bias", config.get("model_type") != "glm_ocr_text"))
    spec = llama(config)
    return replace(spec, attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=False),
                   positions=replace(spec.positions, rope_interleaved=True)).amend("mlp", gate_up_proj="gate_up_proj")


@architecture("glm4", norm="rms", llama_layout=True, status="verified",
              aliases=[
                  "glm4v_text",  # GLM4V text: full-head RoPE, mRoPE reduced to 1-D
                  "glm4v",  # multimodal wrapper; text_config parsed as glm4v_text
                  "glm_ocr_text",  # parsed with GLM4V text parser
                  "glm_ocr",  # multimodal wrapper; text_config parsed with GLM4V text parser
              ])
def glm4(config: dict) -> DecoderSpec:
    """GLM with sandwich norms on the attention and MLP outputs."""
    return replace(glm(config), attn_out_norm="post_self_attn_layernorm", mlp_out_norm="post_mlp_layernorm")


@architecture("hunyuan_v1_dense", norm="rms", llama_layout=True, status="verified",
              notes="DynamicNTKAlpha RoPE",
              aliases=[
                  "hunyuan_vl_text",  # mRoPE reduced; tied embeddings default
                  "hunyuan_vl",  # multimodal wrapper; text_config parsed as hunyuan_vl_text
              ])
def hunyuan_v1_dense(config: dict) -> DecoderSpec:
    qk_norm = bool(config.get("use_qk_norm", True))
    spec = llama(config)
    return replace(spec,
                   attention=replace(spec.attention, q_norm="query_layernorm" if qk_norm else None,
                                     k_norm="key_layernorm" if qk_norm else None, qk_norm_after_rope=True))


@architecture("hyperclovax", norm="rms", llama_layout=True, status="verified")
def hyperclovax(config: dict) -> DecoderSpec:
    """Granite multipliers plus Peri-LN post-norms on both sublayer outputs."""
    spec = replace(granite(config), logits_scale=config.get("logits_scaling", 1.0))  # multiplies, unlike Granite
    if config.get("use_post_norm", True):
        spec = replace(spec, attn_out_norm="post_norm1", mlp_out_norm="post_norm2")
    return spec


@architecture("granite_swa", norm="rms", llama_layout=True, status="verified")
def granite_swa(config: dict) -> DecoderSpec:
    """Granite + per-layer sliding window, per-layer rope theta (0: NoPE) and per-head attention sinks."""
    spec = granite(config)
    types = layer_types(config, spec.num_layers)
    thetas = config.get("layer_rope_theta") or [first_of(config, "rope_theta", default=10000.0)] * spec.num_layers
    rope_configs = tuple((_with_rope_theta(config, t), None) for t in thetas)
    return replace(spec,
                   attention=replace(spec.attention, sinks="sinks",
                                     windows=tuple(config["sliding_window"] if t == "sliding_attention" else 0
                                                   for t in types)),
                   positions=replace(spec.positions, rope_configs=rope_configs,
                                     rope_layers=tuple(bool(t) for t in thetas)))


def _with_rope_theta(config: dict, theta: float) -> dict:
    params = dict(config.get("rope_parameters") or {"rope_type": "default"})
    params["rope_theta"] = theta or 10000.0  # theta 0 marks a NoPE layer (rope_layers); any table will do
    return dict(config, rope_parameters=params)


@architecture("olmo3", norm="rms", llama_layout=True, status="verified")
def olmo3(config: dict) -> DecoderSpec:
    """OLMo 2 block with per-layer sliding windows and a rope dict per layer type."""
    spec = olmo2(config)
    types = layer_types(config, spec.num_layers)
    params = config.get("rope_parameters")
    ropes = tuple((config, t) for t in types) if params and all(isinstance(v, dict) for v in params.values()) else ()
    return replace(spec,
                   attention=replace(spec.attention, windows=sliding_windows(config, spec.num_layers,
                                                                             every_layer=False)),
                   positions=replace(spec.positions, rope_configs=ropes))


@architecture("exaone4", norm="rms", llama_layout=True, status="verified",
              aliases=[
                  "exaone4_5_text",  # legacy spelling normalized to exaone4
              ])
def exaone4(config: dict) -> DecoderSpec:
    """OLMo 2-style post-norms with per-head q/k RMSNorm; with sliding layers, only those rotate."""
    spec = olmo2(config)
    spec = replace(spec, attention=replace(spec.attention, qk_norm_scope="head"))
    types = layer_types(config, spec.num_layers)
    windows = sliding_windows(config, spec.num_layers, every_layer=False)
    rope_layers = tuple(t == "sliding_attention" for t in types) if config.get("sliding_window") else ()
    return replace(spec,
                   attention=replace(spec.attention, windows=windows),
                   positions=replace(spec.positions, rope_layers=rope_layers))


@architecture("cohere2", norm="layer", llama_layout=True, status="verified")
def cohere2(config: dict) -> DecoderSpec:
    """Cohere with sliding layers that rotate and full-attention layers without rotary."""
    spec = cohere(config)
    types = layer_types(config, spec.num_layers)
    return replace(spec,
                   attention=replace(spec.attention, windows=sliding_windows(config, spec.num_layers,
                                                                             every_layer=False)),
                   positions=replace(spec.positions, rope_layers=tuple(t == "sliding_attention" for t in types)))


@architecture("cohere_compass_text", norm="layer", llama_layout=True, status="verified",
              aliases=[
                  "cohere_compass",  # wrapper; text_config
              ])
def cohere_compass_text(config: dict) -> DecoderSpec:
    """Cohere 2's block with rotate_half rotary from a rope dict per layer type; a type whose dict is null has
    no rotary (NoPE). Text positions are equal on the three M-RoPE axes, so its multimodal rope is 1-D rope."""
    spec = cohere(config)
    types = layer_types(config, spec.num_layers)
    params = config.get("rope_parameters") or {}
    no_rope = dict(config, rope_parameters={"rope_type": "default"})  # any table: rope_layers skips the rotation
    return replace(spec, logits_scale=config.get("logit_scale") or 1.0,
                   attention=replace(spec.attention, windows=sliding_windows(config, spec.num_layers,
                                                                             every_layer=False)),
                   positions=replace(spec.positions, rope_interleaved=False,
                                     rope_configs=tuple((config, t) if params.get(t) else (no_rope, None)
                                                        for t in types),
                                     rope_layers=tuple(bool(params.get(t)) for t in types)))


@architecture("modernbert-decoder", norm="layer", status="verified")
def modernbert_decoder(config: dict) -> DecoderSpec:
    """Embedding LayerNorm, no attention input norm in layer 0, fused Wi = [input | gate] GLU, MHA with per-layer
    sliding windows (local_attention // 2) and a rope dict per layer type, then a dense-gelu-LayerNorm prediction
    head before the tied ``decoder`` projection (with bias)."""
    spec = DecoderSpec(**_sizes(dict(config, num_key_value_heads=None)))
    types = layer_types(config, spec.num_layers)
    local = config.get("local_attention")
    window = config.get("sliding_window") or (local // 2 if local else 0)
    attn_bias, mlp_bias = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    return replace(spec, embed="model.embeddings.tok_embeddings", embed_norm="model.embeddings.norm",
                   final_norm="model.final_norm", lm_head="decoder", lm_head_bias=bool(config.get("decoder_bias", True)),
                   head_transform="lm_head", head_transform_bias=bool(config.get("classifier_bias", False)),
                   head_transform_act=config.get("classifier_activation", "gelu"),
                   attention=replace(spec.attention, path="attn", o_proj="Wo", q_bias=attn_bias, k_bias=attn_bias,
                                     v_bias=attn_bias, o_bias=attn_bias,
                                     windows=tuple(window if t == "sliding_attention" else 0 for t in types)),
                   attn_in_norm="attn_norm", attn_in_norm_skipped=(0,), mlp_in_norm="mlp_norm",
                   mlp=replace(spec.mlp, gate_up_proj="Wi", down_proj="Wo", bias=mlp_bias),
                   norms=replace(spec.norms, kind="layer", bias=bool(config.get("norm_bias", False)),
                                 eps=config.get("norm_eps", 1e-5)),
                   hidden_act=config.get("hidden_activation", "gelu"),
                   positions=replace(spec.positions, rope_configs=tuple((config, t) for t in types)),
                   tie_embeddings=bool(config.get("tie_word_embeddings", True)))


@architecture("vaultgemma", norm="rms", llama_layout=True, status="verified")
def vaultgemma(config: dict) -> DecoderSpec:
    """Gemma 2 without the sublayer post-norms."""
    return replace(gemma2(config), attn_out_norm=None, mlp_out_norm=None)


@architecture("jais2", norm="layer", llama_layout=True, status="verified",
              notes="native KV-cache generation")
def jais2(config: dict) -> DecoderSpec:
    """LayerNorm with bias, plain squared-ReLU MLP, biases."""
    spec = llama(config)
    return replace(spec, norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_eps", 1e-5)),
                   hidden_act=config.get("hidden_act", "relu2")).amend("mlp", kind="plain")


@architecture("nemotron", norm="layer", llama_layout=True, status="verified")
def nemotron(config: dict) -> DecoderSpec:
    """LayerNorm1P (x * (1 + w) + b), plain squared-ReLU MLP, partial rotary."""
    spec = llama(config)
    return replace(spec,
                   norms=replace(spec.norms, kind="layer", bias=True, unit_offset=True,
                                 eps=first_of(config, "norm_eps", "layer_norm_eps", default=1e-5)),
                   hidden_act=config.get("hidden_act", "relu2")).amend("mlp", kind="plain")


@architecture("nanochat", norm="rms", llama_layout=True, status="verified",
              notes="parameter-free RMSNorm")
def nanochat(config: dict) -> DecoderSpec:
    """Parameter-free RMSNorm everywhere (also right after the embedding and on q/k after rotary), rotation by
    -theta, plain squared-ReLU fc1/fc2 MLP, final soft-capping."""
    spec = llama(config)
    return replace(spec, norms=replace(spec.norms, weight=False), embed_norm="model.norm",
                   hidden_act=config.get("hidden_act", "relu2"),
                   attention=replace(spec.attention, q_norm="q_norm", k_norm="k_norm", qk_norm_after_rope=True),
                   positions=replace(spec.positions, rope_negated=True),
                   final_softcap=config.get("final_logit_softcapping") or 0.0).amend("mlp", up_proj="fc1",
                                                                                     down_proj="fc2", kind="plain")


@architecture("apertus", norm="rms", llama_layout=True, status="verified",
              notes="xIELU activation")
def apertus(config: dict) -> DecoderSpec:
    """Plain up/down MLP with the learned xIELU activation; q/k RMSNorm; renamed sublayer norms."""
    qk_norm = bool(config.get("qk_norm", True))
    spec = llama(config)
    return replace(spec, hidden_act=config.get("hidden_act", "xielu"), mlp=replace(spec.mlp, kind="plain"),
                   attn_in_norm="attention_layernorm", mlp_in_norm="feedforward_layernorm",
                   attention=replace(spec.attention, q_norm="q_norm" if qk_norm else None,
                                     k_norm="k_norm" if qk_norm else None))


@architecture("apertus1p5_text", norm="rms", llama_layout=True, status="verified",
              notes="xIELU activation; lm_head pruned to output_vocab_size")
def apertus1p5_text(config: dict) -> DecoderSpec:
    """Apertus whose lm_head may keep only the first output_vocab_size ids (the text prefix of the vocabulary):
    the embedding keeps the rows past them (visual and audio codes) for input."""
    spec = apertus(config)
    rows = config.get("output_vocab_size")
    if not rows or rows == spec.vocab_size:
        return spec
    refuse("apertus1p5_text", config, "tie_word_embeddings", lambda v: not v)  # a pruned head is its own matrix
    return replace(spec, vocab_size=rows, embed_extra_rows=spec.vocab_size - rows)


@architecture("bitnet", norm="rms", llama_layout=True, status="verified",
              notes="relu2 + projection sub-norms")
def bitnet(config: dict) -> DecoderSpec:
    """Llama with squared-ReLU GLU and RMSNorm sub-norms before o_proj and down_proj. Plain float weights: a
    checkpoint quantised for BitNet kernels (quantization_config) is refused."""
    refuse("bitnet", config, "quantization_config", lambda v: not v)
    spec = llama(config)
    return replace(spec, hidden_act=config.get("hidden_act", "relu2"),
                   attention=replace(spec.attention, sub_norm="attn_sub_norm")).amend("mlp", sub_norm="ffn_sub_norm")


@architecture("persimmon", norm="layer", status="verified",
              aliases=[
                  "fuyu",  # text_config (or legacy root fields) parsed as Persimmon
              ])
def persimmon(config: dict) -> DecoderSpec:
    """Fused per-head query_key_value, per-head q/k LayerNorm, partial rotary, squared-ReLU MLP, biases."""
    qk_norm = bool(config.get("qk_layernorm", True))
    spec = DecoderSpec(**_sizes(config))
    return replace(spec, final_norm="model.final_layernorm",
                   attention=replace(spec.attention, qkv_proj="query_key_value", qkv_layout="per_head", o_proj="dense",
                                     q_bias=True, k_bias=True, v_bias=True, o_bias=True,
                                     q_norm="q_layernorm" if qk_norm else None,
                                     k_norm="k_layernorm" if qk_norm else None),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_eps", 1e-5)),
                   hidden_act=config.get("hidden_act", "relu2"),
                   tie_embeddings=bool(config.get("tie_word_embeddings", False))).amend("mlp", kind="plain",
                                                                                        up_proj="dense_h_to_4h",
                                                                                        down_proj="dense_4h_to_h",
                                                                                        bias=True)


# its fixture is built with transformers 4.49 (removed in 5)
@architecture("open-llama", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation")
def open_llama(config: dict) -> DecoderSpec:
    """Open-Llama (transformers 4.x's deprecated OpenLlama): Llama with MHA only, a LayerNorm (eps 1e-5, torch's
    default) on the embeddings (use_stable_embedding) and logits from the embedding matrix without an lm_head
    (shared_input_output_embedding, whatever tie_word_embeddings says). Its other options only act in training
    mode: hidden / attention dropout (vkformers applies no dropout, in any family) and
    use_memory_efficient_attention (xformers' kernel, and transformers then drops the padding mask)."""
    # its rotary: 4.x rope_scaling {type: linear | dynamic}; dynamic keeps the longest table seen by the model
    # object and sizes it by the cached length (pads included), unlike the shared per-forward dynamic rope
    refuse("open-llama", config, "rope_scaling", lambda v: not v or v.get("type") == "linear")
    spec = llama(dict(config, num_key_value_heads=None, head_dim=None))
    shared = config.get("shared_input_output_embedding", True)
    stable = config.get("use_stable_embedding", True)
    return replace(spec, tie_embeddings=bool(shared or config.get("tie_word_embeddings", False)),
                   embed_norm="model.embed_layer_norm" if stable else None, embed_norm_layer_eps=1e-5)


@architecture("seed_oss", norm="rms", llama_layout=True, status="verified")
def seed_oss(config: dict) -> DecoderSpec:
    """Llama with q/k/v biases on by default (attention_bias) and the o_proj bias apart (attention_out_bias)."""
    bias = bool(config.get("attention_bias", True))
    spec = llama(config)
    return replace(spec,
                   attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias,
                                     o_bias=bool(config.get("attention_out_bias", False))))


@architecture("cwm", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation")
def cwm(config: dict) -> DecoderSpec:
    """Llama with per-layer sliding windows from layer_types (its default rope is llama3)."""
    spec = llama(config)
    return replace(spec,
                   attention=replace(spec.attention, windows=sliding_windows(config, spec.num_layers,
                                                                             every_layer=False)))


@architecture("internlm3", norm="rms", llama_layout=True, status="verified")
def internlm3(config: dict) -> DecoderSpec:
    """Llama (transformers runs it as LlamaForCausalLM); its own configs name the biases qkv_bias and bias."""
    return llama(dict(config, attention_bias=first_of(config, "attention_bias", "qkv_bias", default=False),
                      mlp_bias=first_of(config, "mlp_bias", "bias", default=False)))


@architecture("iquestcoder", norm="rms", llama_layout=True, status="verified")
def iquestcoder(config: dict) -> DecoderSpec:
    """Llama (transformers runs it as LlamaForCausalLM); the original code's clip_qkv and sliding window, which no
    released checkpoint enables, are refused as transformers refuses them."""
    refuse("iquestcoder", config, "clip_qkv", lambda v: v is None)
    refuse("iquestcoder", config, "use_sliding_window", lambda v: not v)
    return llama(config)


@architecture("diffllama", norm="rms", llama_layout=True, status="verified",
              notes="differential attention (diffllama.py)")
def diffllama(config: dict) -> DecoderSpec:
    """Llama whose attention is differential (vkformers_llama.diffllama): two softmax maps' difference over the two
    halves of the value heads, a weightless RMS norm per head pair, learned lambda_q1/k1/q2/k2 per layer."""
    refuse("diffllama", config, "num_key_value_heads", lambda v: v is not None and v % 2 == 0)
    spec = llama(config)
    return replace(spec, make_layer=DiffAttention(eps=spec.norms.eps))


@architecture("doge", norm="rms", llama_layout=True, status="verified",
              notes="dynamic mask attention (a key bias from the values), per-channel residual scales, CDMoE's "
                    "single-neuron experts beside the MLP (doge.py)")
def doge(config: dict) -> DecoderSpec:
    """Qwen3-like attention (per-head q/k RMSNorm before rotary) whose scores get a bias per key and KV head,
    exp(A * softplus(dt_proj(values))) (vkformers_llama.doge), residuals scaled by learned input_residual /
    post_attention_residual, and with is_moe CDMoE's product-key experts added to the MLP. Sliding windows,
    keep_window_size below the position table and the router's auxiliary loss are refused."""
    refuse("doge", config, "output_router_logits", lambda v: not v, False)
    refuse("doge", config, "sliding_window", lambda v: v is None)
    positions = config.get("max_position_embeddings", 2048)
    refuse("doge", config, "keep_window_size", lambda v: int(v) >= positions, 2048)
    spec = qwen3(dict(config, tie_word_embeddings=bool(config.get("tie_word_embeddings", False))))
    experts = int(config.get("num_experts", 16384)) if config.get("is_moe", False) else 0
    top_k = int(config.get("num_experts_per_tok", 64))
    if experts and not 0 < top_k <= math.isqrt(experts) ** 2:
        raise UnsupportedConfigError(f"doge: num_experts_per_tok {top_k} must be in 1..{math.isqrt(experts) ** 2} "
                                     "(the product keys' experts); fix the config")
    return replace(spec, make_layer=DynamicMaskAttention(
        keep_window_size=int(config.get("keep_window_size", 2048)), dt_bias=bool(config.get("attention_bias", False)),
        num_experts=experts, top_k=top_k, norm_topk=bool(config.get("norm_topk_prob", False))))


@architecture("exaone", norm="rms", llama_layout=True, status="verified")
def exaone(config: dict) -> DecoderSpec:
    """EXAONE 3: Llama under its original checkpoint names (transformer.h.<i>.attn.attention.*, ln_1 / ln_2,
    c_fc_0 / c_fc_1 / c_proj, which transformers' conversion maps to Llama's) and config names (num_layers,
    layer_norm_epsilon, activation_function); rope theta 5e5 by default."""
    config = dict(config, num_hidden_layers=first_of(config, "num_hidden_layers", "num_layers"),
                  rms_norm_eps=first_of(config, "rms_norm_eps", "layer_norm_epsilon", default=1e-5),
                  hidden_act=first_of(config, "hidden_act", "activation_function", default="silu"))
    if not config.get("rope_parameters") and "rope_theta" not in config:
        config["rope_theta"] = 500000.0
    spec = llama(config)
    return replace(spec, embed="transformer.wte", layers="transformer.h", final_norm="transformer.ln_f",
                   attn_in_norm="ln_1", mlp_in_norm="ln_2",
                   positions=replace(spec.positions, rope_configs=((config, None),) * spec.num_layers),
                   attention=replace(spec.attention, path="attn.attention", o_proj="out_proj"),
                   mlp=replace(spec.mlp, gate_proj="c_fc_0", up_proj="c_fc_1", down_proj="c_proj"))


# -- GPT-family relatives

@architecture("gptj", norm="layer", status="verified")
def gptj(config: dict) -> DecoderSpec:
    """Parallel block from one LayerNorm, interleaved rotary on the first rotary_dim dims, lm_head bias."""
    spec = DecoderSpec(**_sizes(config))
    rotary = config.get("rotary_dim") or spec.head_dim
    rope_config = dict(config, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                    partial_rotary_factor=rotary / spec.head_dim),
                       hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads)
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   embed="transformer.wte", layers="transformer.h", final_norm="transformer.ln_f",
                   attention=replace(spec.attention, path="attn", o_proj="out_proj"),
                   attn_in_norm="ln_1", mlp_in_norm=None, parallel_residual=True,
                   mlp=replace(spec.mlp, up_proj="fc_in", down_proj="fc_out", kind="plain", bias=True),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_epsilon", 1e-5)),
                   hidden_act=config.get("activation_function", "gelu_new"), lm_head_bias=True,
                   positions=replace(spec.positions, rope_interleaved=True,
                                     rope_configs=((rope_config, None),) * spec.num_layers),
                   tie_embeddings=bool(config.get("tie_word_embeddings", False)))


@architecture("codegen", norm="layer", status="verified")
def codegen(config: dict) -> DecoderSpec:
    """GPT-J with one fused qkv_proj in 4 model-parallel chunks, each [q, v, k]."""
    spec = gptj(config)
    return replace(spec, attention=replace(spec.attention, qkv_proj="qkv_proj", qkv_layout="chunks_qvk", qkv_chunks=4))


@architecture("gpt_neox_japanese", norm="layer", status="verified")
def gpt_neox_japanese(config: dict) -> DecoderSpec:
    """Sequential GPT-NeoX block without projection biases; the last layer adds a separate dense_bias."""
    spec = DecoderSpec(**_sizes(config))
    inter = spec.hidden_size * config.get("intermediate_multiple_size", 4)
    rope_config = dict(config)
    if "rotary_pct" in config and not config.get("rope_parameters"):
        rope_config["partial_rotary_factor"] = config["rotary_pct"]
    if "rotary_emb_base" in config and not config.get("rope_parameters"):
        rope_config["rope_theta"] = config["rotary_emb_base"]
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   embed="gpt_neox_japanese.embed_in", layers="gpt_neox_japanese.layers",
                   final_norm="gpt_neox_japanese.final_layer_norm", lm_head="embed_out",
                   attention=replace(spec.attention, path="attention", qkv_proj="query_key_value",
                                     qkv_layout="per_head", o_proj="dense", out_bias="dense_bias",
                                     out_bias_layers=(spec.num_layers - 1,), blind_rows="all"),  # eager only
                   mlp=replace(spec.mlp, kind="plain", up_proj="dense_h_to_4h", down_proj="dense_4h_to_h"),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_eps", 1e-5)),
                   hidden_act=config.get("hidden_act", "gelu"),
                   intermediate_size=inter,
                   positions=replace(spec.positions, rope_configs=((rope_config, None),) * spec.num_layers),
                   tie_embeddings=bool(config.get("tie_word_embeddings", True)))


@architecture("gpt_bigcode", norm="layer", status="verified")
def gpt_bigcode(config: dict) -> DecoderSpec:
    """GPT-2 with nn.Linear weights and multi-query attention (c_attn = [q | k | v], one KV head)."""
    refuse("gpt_bigcode", config, "scale_attn_weights", lambda v: v in (None, True))
    spec = gpt2(config)
    kv_heads = 1 if config.get("multi_query", True) else spec.num_heads
    return replace(spec, conv1d=False, num_kv_heads=kv_heads, attention=replace(spec.attention, scales=()),
                   hidden_act=config.get("activation_function", "gelu_pytorch_tanh"))


@architecture("gpt_neo", norm="layer", status="verified")
def gpt_neo(config: dict) -> DecoderSpec:
    """GPT-2-like block with nn.Linear q/k/v (no bias), unscaled scores and global/local (windowed) layers."""
    spec = DecoderSpec(**_sizes(dict(config, num_attention_heads=config["num_heads"],
                                     num_hidden_layers=config["num_layers"])))
    types = []
    for pattern, repeat in config.get("attention_types") or [[["global"], spec.num_layers]]:
        types += list(pattern) * repeat
    window = config.get("window_size", 256)
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   embed="transformer.wte", position_embed="transformer.wpe",
                   positions=replace(spec.positions, rope=False),
                   layers="transformer.h", final_norm="transformer.ln_f",
                   attention=replace(spec.attention, path="attn.attention", o_proj="out_proj", o_bias=True,
                                     scales=(1.0,) * spec.num_layers,
                                     windows=tuple(window if t == "local" else 0 for t in types[:spec.num_layers]),
                                     blind_rows="causal"),  # eager only: its causal fill plus the padding mask
                   attn_in_norm="ln_1", mlp_in_norm="ln_2",
                   mlp=replace(spec.mlp, kind="plain", up_proj="c_fc", down_proj="c_proj", bias=True),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_epsilon", 1e-5)),
                   hidden_act=config.get("activation_function", "gelu_new"))


@architecture("openai-gpt", norm="layer", status="verified")
def openai_gpt(config: dict) -> DecoderSpec:
    """GPT-1: GPT-2's Conv1D layers with post-LayerNorm blocks and no final norm."""
    spec = DecoderSpec(**_sizes(config))
    act = {"gelu": "gelu_new"}.get(config.get("afn", "gelu"), config.get("afn", "gelu"))  # its "gelu" is gelu_new
    spec = gpt2(dict(config, activation_function=act))
    return replace(spec, embed="transformer.tokens_embed",
                   position_embed="transformer.positions_embed", final_norm=None, post_norm=True,
                   # eager only: a -1e4 causal fill (scores times 0: no gradient) under the padding mask's minimum
                   attention=replace(spec.attention, scales=(), blind_rows="attended", blind_rows_score_grad=0.0),
                   intermediate_size=4 * spec.hidden_size)


@architecture("biogpt", norm="layer", status="verified")
def biogpt(config: dict) -> DecoderSpec:
    """OPT-like pre-LN block: scaled embeddings, learned positions offset by 2, tied output_projection. Its
    LayerNorms are built without an eps (torch's default 1e-5): transformers never reads layer_norm_eps (1e-12)."""
    spec = DecoderSpec(**_sizes(config))
    scale = math.sqrt(spec.hidden_size) if config.get("scale_embedding", True) else 1.0
    return replace(spec, embed="biogpt.embed_tokens", embed_scale=scale, position_embed="biogpt.embed_positions",
                   positions=replace(spec.positions, offset=2, rope=False), layers="biogpt.layers",
                   final_norm="biogpt.layer_norm",
                   lm_head="output_projection",
                   attention=replace(spec.attention, o_proj="out_proj", q_bias=True, k_bias=True, v_bias=True,
                                     o_bias=True), attn_in_norm="self_attn_layer_norm",
                   mlp_in_norm="final_layer_norm",
                   mlp=replace(spec.mlp, path="", kind="plain", up_proj="fc1", down_proj="fc2", bias=True),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=1e-5),
                   hidden_act=config.get("hidden_act", "gelu"))


@architecture("xglm", norm="layer", status="verified",
              notes="sinusoidal positions")
def xglm(config: dict) -> DecoderSpec:
    """BioGPT's block with a fixed fairseq sinusoidal position table (offset 2) instead of a learned one."""
    spec = biogpt(dict(config, hidden_size=config["d_model"], num_attention_heads=config["attention_heads"],
                       num_hidden_layers=config["num_layers"],
                       hidden_act=config.get("activation_function", "gelu")))
    scale = math.sqrt(spec.hidden_size) if config.get("scale_embedding", True) else 1.0
    return replace(spec, embed="model.embed_tokens", embed_scale=scale, position_embed=None,
                   positions=replace(spec.positions, sinusoidal="fairseq"), layers="model.layers",
                   final_norm="model.layer_norm",
                   lm_head="lm_head", intermediate_size=config.get("ffn_dim", 4 * spec.hidden_size),
                   extra=dict(padding_row=config.get("pad_token_id")),
                   # eager only; its clamp at the dtype minimum ties there, halving the scores' gradient
                   attention=replace(spec.attention, blind_rows="all", blind_rows_score_grad=0.5))


@architecture("trocr", norm="layer", status="verified",
              notes="TrOCRForCausalLM: the decoder alone (vision encoder not native)")
def trocr(config: dict) -> DecoderSpec:
    """TrOCRForCausalLM, the decoder without encoder states: OPT-350m's post-LN block with layernorm_embedding
    after the positions, no final norm, tied output_projection, and labels not shifted inside. Positions are
    learned (offset 2, arange) or fairseq sinusoidal counted over non-pad tokens (rows from pad + 1; the
    attention mask stands in for input_ids != pad). Its forward takes no position_ids, so under generate a
    left-padded row's learned positions count the pads, and its sinusoidal ones too from the first new token on
    (cache length + 1): PositionSpec.generation. TrOCRForCausalLM always builds the layers' cross-attention
    (is_decoder): carried, never run."""
    spec = opt(dict(config, hidden_size=config["d_model"], num_attention_heads=config["decoder_attention_heads"],
                    num_hidden_layers=config["decoder_layers"], ffn_dim=config["decoder_ffn_dim"],
                    do_layer_norm_before=False, word_embed_proj_dim=None,
                    activation_function=config.get("activation_function", "gelu")))
    d, pad = spec.hidden_size, config.get("pad_token_id")
    scale = math.sqrt(d) if config.get("scale_embedding", False) else 1.0
    if config.get("use_learned_position_embeddings", True):
        spec = spec.amend("positions", from_mask=False, generation="index")
    else:
        if pad is None:
            raise UnsupportedConfigError("trocr: sinusoidal positions need a pad_token_id (their padding row)")
        spec = replace(spec, position_embed=None, extra=dict(padding_row=pad)).amend(
            "positions", sinusoidal="fairseq", offset=pad + 1, generation="fairseq")
    kdim = config.get("cross_attention_hidden_size") or d
    cross = tuple((f"encoder_attn.{name}.{kind}", shape)
                  for name, rows, cols in (("k_proj", d, kdim), ("v_proj", d, kdim), ("q_proj", d, d),
                                           ("out_proj", d, d))
                  for kind, shape in (("weight", (rows, cols)), ("bias", (rows,))))
    cross += (("encoder_attn_layer_norm.weight", (d,)), ("encoder_attn_layer_norm.bias", (d,)))
    return replace(spec, embed_scale=scale, embed_norm="model.decoder.layernorm_embedding"
                   if config.get("layernorm_embedding", True) else None, lm_head="output_projection",
                   tie_embeddings=config.get("tie_word_embeddings", True) is not False, shift_labels=False,
                   unused_layer_params=cross, attention=replace(spec.attention, blind_rows="all"))  # eager only


@architecture("ctrl", norm="layer", status="verified",
              notes="sinusoidal positions")
def ctrl(config: dict) -> DecoderSpec:
    """Pre-LN block with scaled embeddings and a fixed [sin | cos] position table; lm_head bias."""
    spec = DecoderSpec(**_sizes(dict(config, intermediate_size=config.get("dff"))))
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   embed="transformer.w", embed_scale=math.sqrt(spec.hidden_size),
                   positions=replace(spec.positions, sinusoidal="ctrl", rope=False),
                   layers="transformer.h", final_norm="transformer.layernorm",
                   attention=replace(spec.attention, path="multi_head_attention", q_proj="Wq", k_proj="Wk",
                                     v_proj="Wv", o_proj="dense", q_bias=True, k_bias=True, v_bias=True, o_bias=True),
                   attn_in_norm="layernorm1",
                   mlp_in_norm="layernorm2",
                   mlp=replace(spec.mlp, path="ffn", kind="plain", up_proj="0", down_proj="2", bias=True),
                   norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("layer_norm_epsilon", 1e-6)),
                   hidden_act="relu",
                   lm_head_bias=True)


@architecture("mpt", norm="layer", status="verified",
              notes="ALiBi")
def mpt(config: dict) -> DecoderSpec:
    """ALiBi, fused Wqkv [q | k | v], bias-free LayerNorm and projections, 4x GELU MLP."""
    attn = config.get("attn_config") or {}
    for option, ok in (("qk_ln", lambda v: not v), ("clip_qkv", lambda v: v is None),
                       ("softmax_scale", lambda v: v is None), ("alibi", lambda v: v in (None, True)),
                       ("prefix_lm", lambda v: not v), ("attn_uses_sequence_id", lambda v: not v)):
        refuse("mpt", attn, option, ok)
    refuse("mpt", config, "logit_scale", lambda v: v is None)
    bias = not config.get("no_bias", True)
    spec = DecoderSpec(**_sizes(dict(config, hidden_size=config["d_model"], num_attention_heads=config["n_heads"],
                                     num_hidden_layers=config["n_layers"],
                                     max_position_embeddings=config.get("max_seq_len"))))
    return replace(spec, embed_padding_idx=None,  # built without padding_idx in transformers
                   embed="transformer.wte", layers="transformer.blocks", final_norm="transformer.norm_f",
                   attention=replace(spec.attention, path="attn", qkv_proj="Wqkv", o_proj="out_proj", q_bias=bias,
                                     k_bias=bias, v_bias=bias, o_bias=bias, blind_rows="all",
                                     blind_rows_score_grad=0.0),  # eager only, masked_fill
                   attn_in_norm="norm_1",
                   mlp_in_norm="norm_2",
                   mlp=replace(spec.mlp, path="ffn", kind="plain", bias=bias),
                   norms=replace(spec.norms, kind="layer", bias=bias, eps=config.get("layer_norm_epsilon", 1e-5)),
                   hidden_act="gelu",
                   positions=replace(spec.positions, rope=False, alibi=True, alibi_kind="mpt"),
                   intermediate_size=4 * spec.hidden_size, extra=dict(alibi_bias_max=attn.get("alibi_bias_max", 8)))


# -- hybrid decoders: Gated DeltaNet linear-attention layers beside softmax-attention ones

@architecture("qwen3_5_text", norm="rms", llama_layout=True, status="verified",
              notes=("native KV-cache generation; hybrid Gated-DeltaNet/full-attention schedule; upstream claims 2-step"
                     " AdamW parity"),
              aliases=[
                  "qwen3_5",  # multimodal wrapper; text_config
              ])
def qwen3_5_text(config: dict) -> DecoderSpec:
    """Qwen3.5's hybrid decoder: Gated DeltaNet linear-attention layers (gated_deltanet.py) and softmax-attention
    layers whose q_proj also yields a sigmoid output gate, (1 + w) RMSNorm everywhere (q/k norm per head),
    partial rotary. Text positions are equal on the M-RoPE axes, so the multimodal rope is 1-D rope."""
    spec = qwen3(dict(config, attention_bias=config.get("attention_bias", False)))
    types = layer_types(config, spec.num_layers)
    linear_attention = LinearAttentionSpec(layers=tuple(t == "linear_attention" for t in types),
                                           k_heads=config.get("linear_num_key_heads", 16),
                                           v_heads=config.get("linear_num_value_heads", 32),
                                           k_dim=config.get("linear_key_head_dim", 128),
                                           v_dim=config.get("linear_value_head_dim", 128),
                                           conv_kernel=config.get("linear_conv_kernel_dim", 4))
    return replace(spec,
                   attention=replace(spec.attention, windows=(), q_gate=True),
                   norms=replace(spec.norms, unit_offset=True),
                   linear_attention=linear_attention)


@architecture("olmo_hybrid", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation; hybrid Gated-DeltaNet/full-attention schedule")
def olmo_hybrid(config: dict) -> DecoderSpec:
    """OLMo 2 attention blocks (post-norms, q/k norm over the whole projection; no rotary when rope_theta is None,
    as released) and pre-norm Gated DeltaNet blocks with separate projections, one conv per q/k/v and
    beta = 2 sigmoid(b). Names as its checkpoints store them (what transformers' save_pretrained writes):
    attention_layer_norm / feedforward_layer_norm for input_layernorm / post_attention_layernorm."""
    refuse("olmo_hybrid", config, "hidden_act", lambda v: v in ("silu", "swish"), "silu")  # also the conv's
    spec = olmo2(config)
    types = layer_types(config, spec.num_layers)
    params = config.get("rope_parameters")
    k_heads = config.get("linear_num_key_heads") or spec.num_heads
    k_dim = config.get("linear_key_head_dim") or int(0.75 * spec.hidden_size / k_heads)
    linear_attention = LinearAttentionSpec(
        layers=tuple(t == "linear_attention" for t in types),
        k_heads=k_heads, v_heads=config.get("linear_num_value_heads") or spec.num_heads,
        k_dim=k_dim, v_dim=config.get("linear_value_head_dim") or 2 * k_dim,
        conv_kernel=config.get("linear_conv_kernel_dim", 4), split_projections=True,
        beta_scale=2.0 if config.get("linear_allow_neg_eigval", True) else 1.0,
        norm_eps=1e-5,  # fixed in transformers (FLA's FusedRMSNormGated default)
        layer_norms=(("attn_in_norm", "attention_layer_norm"), ("attn_out_norm", None),
                     ("mlp_in_norm", "feedforward_layer_norm"), ("mlp_out_norm", None)))
    return replace(spec, attn_out_norm="feedforward_layer_norm",
                   positions=replace(spec.positions, rope=not (isinstance(params, dict) and "rope_theta" in params
                                                               and params["rope_theta"] is None)),
                   linear_attention=linear_attention)


# -- multi-head latent attention

@architecture("minicpm3", norm="rms", llama_layout=True, status="verified",
              notes="MLA")
def minicpm3(config: dict) -> DecoderSpec:
    """MLA + muP scalings: embeddings * scale_emb, residual branches * scale_depth / sqrt(layers), logits on
    hidden / (hidden_size / dim_model_base)."""
    spec = with_mla(llama(config), config)
    spec = spec.amend("positions", rope_interleaved=False)  # cos/sin rotate_half, not DeepSeek's pairs
    return replace(spec, embed_scale=config.get("scale_emb", 1.0),
                   residual_scale=config.get("scale_depth", 1.0) / math.sqrt(spec.num_layers),
                   logits_scale=config.get("dim_model_base", spec.hidden_size) / spec.hidden_size,
                   tie_embeddings=bool(config.get("tie_word_embeddings", True)))


@architecture("youtu", norm="rms", llama_layout=True, status="verified",
              notes="MLA (DeepSeek-style)")
def youtu(config: dict) -> DecoderSpec:
    return replace(with_mla(llama(config), config), tie_embeddings=bool(config.get("tie_word_embeddings", True)))


@architecture("cpmant", norm="rms", status="verified", model_class="vkformers_llama.model:CpmAntForCausalLM",
              notes="learned prompt tokens and segment embeddings, bidirectional attention with bucketed relative "
                    "position and segment biases (cpmant.py); labels not shifted")
def cpmant(config: dict) -> DecoderSpec:
    """CPM-Ant: pre-norm blocks (RMS norms, q/k/v/o without bias, a GeGLU of exact gelu) under CPM-Ant's names, on
    the layer of vkformers_llama.cpmant, whose model (model.CpmAntForCausalLM) adds the prompt and segments."""
    refuse("cpmant", config, "dropout_p", lambda v: not v, 0.0)
    heads, hidden = config.get("num_attention_heads", 32), config.get("hidden_size", 4096)
    prompt_length, prompt_types = config.get("prompt_length", 32), config.get("prompt_types", 32)
    inputs = CpmAntInputs(prompt_length=prompt_length, segment_types=config.get("segment_types", 32),
                          num_buckets=config.get("position_bias_num_buckets", 512),
                          max_distance=config.get("position_bias_max_distance", 2048))
    return DecoderSpec(
        vocab_size=config.get("vocab_size", 30720), hidden_size=hidden, num_layers=config.get("num_hidden_layers", 48),
        num_heads=heads, num_kv_heads=heads, head_dim=config.get("dim_head", 128),
        intermediate_size=config.get("dim_ff", 10240), max_position_embeddings=config.get("max_position_embeddings", 2048),
        embed="cpmant.input_embedding", embed_extra_rows=prompt_types * prompt_length,
        layers="cpmant.encoder.layers", final_norm="cpmant.encoder.output_layernorm",
        attention=AttentionSpec(path="self_att.self_attention", q_proj="project_q", k_proj="project_k",
                                v_proj="project_v", o_proj="attention_out"),
        positions=PositionSpec(rope=False),
        norms=NormSpec(eps=config.get("eps", 1e-6)),
        mlp=MLPSpec(path="ffn.ffn", gate_proj="w_in.w_0", up_proj="w_in.w_1", down_proj="w_out"),
        attn_in_norm="self_att.layernorm_before_attention", mlp_in_norm="ffn.layernorm_before_ffn",
        hidden_act="gelu", shift_labels=False, make_layer=inputs, extra={"cpmant": inputs})



@architecture("xlnet", norm="layer", status="verified",
              model_class={"causal-lm": "vkformers_llama.xlnet:XLNetLMHeadModel",
                           "base": "vkformers_llama.xlnet:XLNetModel"},
              notes="two-stream relative attention with segment terms, perm_mask / target_mapping and mems; generate "
                    "as transformers' (dummy token, query stream, mems) (xlnet.py); labels not shifted; base model "
                    "and its sequence, token, choice and simple QA heads")
def xlnet(config: dict) -> XLNetSpec:
    """XLNet: its own post-LN model (vkformers_llama.xlnet), not the decoder kit; the refused options by name."""
    return xlnet_spec(config)

# Spellings whose backbone is the model_type of a nested config (multimodal wrappers): they run as
# whatever architecture that names.
FAMILY.wrappers({
    "exaone4_5":            NESTED_TEXT_CONFIG,  # typically exaone4_5_text/exaone4 -> exaone4
    "cohere2_vision":       NestedConfig(("text_config",), (("logit_scale", 1.0),)),  # its lm_head does not scale logits
    # Cosmos3-Omni's language model is saved at the file's root, with Diffusers attention names
    "cosmos3_omni":         NestedConfig(("text_config",), renames=(
        (r"^(layers|embed_tokens|norm)\.", r"model.language_model.\1."),
        *((rf"\.self_attn\.{old}\.", f".self_attn.{new}.") for old, new in (
            ("to_q", "q_proj"), ("to_k", "k_proj"), ("to_v", "v_proj"), ("to_out", "o_proj"), ("norm_q", "q_norm"),
            ("norm_k", "k_norm"))))),
    "got_ocr2":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "aya_vision":           NestedConfig(("text_config",), (("logit_scale", 1.0),)),  # its lm_head does not scale logits
    "llava":                NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "llava_next":           NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "llava_next_video":     NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "llava_onevision":      NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "video_llava":          NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "video_llama_3":        NESTED_TEXT_CONFIG,  # explicit dispatcher arm
    "vipllava":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "idefics2":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "idefics3":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "smolvlm":              NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "qwen2_audio":          NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "voxtral":              NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "fast_vlm":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "internvl":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "janus":                NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "ovis2":                NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "paligemma":            NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "deepseek_vl":          NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "deepseek_vl_hybrid":   NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "paddleocr_vl":         NESTED_TEXT_CONFIG,  # generic wrapper arm; legacy flat root config falls back to paddleocr_vl_text -> llama
    "audioflamingo3":       NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "qwen3_asr":            NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "granite_speech":       NestedConfig(("text_config",), (("logits_scaling", 1.0),)),  # its lm_head skips logits_scaling
    "granite_speech_plus":  NestedConfig(("text_config",), (("logits_scaling", 1.0),)),  # its lm_head skips logits_scaling
    "granite4_vision":      NESTED_TEXT_CONFIG,  # typically granite4_vision_text -> granite
    "glmasr":               NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "musicflamingo":        NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "vibevoice_asr":        NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
})

# Canonical architecture name -> its variant, from the declarations above.
VARIANTS: dict[str, Callable[[dict], DecoderSpec]] = FAMILY.variants()


def decoder_spec(config: dict, architecture_name: str) -> DecoderSpec:
    """The spec of a config (already resolved to ``architecture_name``, its canonical name)."""
    try:
        variant = VARIANTS[architecture_name]
    except KeyError:
        raise UnsupportedConfigError(f"architecture {architecture_name!r} is registered by vkformers-llama but "
                                     f"has no decoder variant yet; implemented: {', '.join(sorted(VARIANTS))}"
                                     ) from None
    return variant(config)
