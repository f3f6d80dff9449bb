"""Per-architecture deltas of the mixture-of-experts decoders: a dense parent's :class:`DecoderSpec`
(the decoder kit's spec, read by a vkformers-llama variant) plus a :class:`MoeSpec` for the sparse layers, e.g. Mixtral = Mistral + a
top-2 renormalised softmax router over SwiGLU experts stored as ``block_sparse_moe.experts.<e>.w1/w3/w2``.

Names are the checkpoint's (what transformers' ``save_pretrained`` writes: transformers 5 keeps the
experts fused in memory but saves one module per expert, and vkformers keeps the saved layout).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from vkformers.models.decoder.spec import (DecoderSpec, LinearAttentionSpec, UnsupportedConfigError, first_of,
                                           layer_types, refuse, sliding_windows, with_mla)
from vkformers.models.family import Family
from vkformers.models.registry import NESTED_TEXT_CONFIG, NestedConfig
# dense parents this plugin's architectures extend (vkformers-llama is a declared dependency)
from vkformers_llama.gemma3n import shared_kv_sources
from vkformers_llama.variants import (cohere2, ernie4_5, gemma3_text, granite, granite_swa, hunyuan_v1_dense, llama,
                                      mistral, olmo2, qwen2, qwen3, qwen3_5_text)

from vkformers_moe.axk2 import Axk2Attention
from vkformers_moe.block import MoeSpec
from vkformers_moe.deepseek_v4 import DeepseekV4Layers
from vkformers_moe.dots3 import Dots3Attention
from vkformers_moe.gemma4 import Gemma4Layers
from vkformers_moe.glm5_next import Glm5NextLayers, KimiDeltaAttention
from vkformers_moe.kimi_linear import kimi_linear_layer
from vkformers_moe.jetmoe import JetMoeAttention
from vkformers_moe.llama4 import Llama4Attention
from vkformers_moe.mimo import MimoAttention
from vkformers_moe.qwen4_exp import Qwen4ExpLayers
from vkformers_moe.minimax_m3 import MinimaxM3Attention
from vkformers_moe.longcat import LongcatLayers

# The architectures of vkformers-moe, each declared once on its variant function (vkformers.models.family).
FAMILY = Family("moe", kind="causal-decoder", moe=True)
architecture = FAMILY.architecture


def _refuse_training_extras(arch: str, config: dict) -> None:
    """Options that change the loss or training-time routing, which the block does not implement."""
    refuse(arch, config, "output_router_logits", lambda v: not v)  # adds the load-balancing loss to the loss
    refuse(arch, config, "router_jitter_noise", lambda v: not v)   # multiplicative noise on the router input


def num_experts(config: dict, default: int) -> int:
    """Routed experts: num_experts or num_local_experts (transformers saves either spelling, by config class)."""
    return first_of(config, "num_experts", "num_local_experts", "n_routed_experts", default=default)


def sparse_step_layers(config: dict, num_layers: int) -> tuple[bool, ...]:
    """Qwen-MoE's schedule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    dense = set(config.get("mlp_only_layers") or ())
    step = config.get("decoder_sparse_step") or 1
    experts = num_experts(config, 0)
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


@architecture("mixtral", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation; upstream claims HF forward-logit fixtures")
def mixtral(config: dict) -> DecoderSpec:
    """Mistral whose MLP is a top-k (renormalised) softmax router over SwiGLU experts w1 (gate), w3 (up), w2 (down)."""
    _refuse_training_extras("mixtral", config)
    spec = mistral(config)
    moe = MoeSpec(num_experts=num_experts(config, 8), top_k=config.get("num_experts_per_tok", 2),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, hidden_act=spec.hidden_act,
                  path="block_sparse_moe", norm_topk=True, expert_names=("w1", "w3", "w2"))
    return replace(spec, moe=moe)


@architecture("phimoe", norm="layer", llama_layout=True, status="verified",
              notes="native KV-cache generation; SparseMixer routing")
def phimoe(config: dict) -> DecoderSpec:
    """PhiMoE: Mistral (sliding_window) with LayerNorms with bias, q/k/v/o biases (attention_bias), lm_head bias
    (lm_head_bias) and SparseMixer routing over Mixtral-style experts (block_sparse_moe.experts.<e>.w1/w3/w2);
    router_jitter_noise is SparseMixer's threshold here, not training noise."""
    refuse("phimoe", config, "output_router_logits", lambda v: not v)
    refuse("phimoe", config, "input_jitter_noise", lambda v: not v)
    bias = bool(config.get("attention_bias", False))
    spec = mistral(config)
    spec = replace(spec, norms=replace(spec.norms, kind="layer", bias=True, eps=config.get("rms_norm_eps", 1e-5)),
                   attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias, o_bias=bias),
                   lm_head_bias=bool(config.get("lm_head_bias", False)))
    moe = MoeSpec(num_experts=num_experts(config, 16), top_k=config.get("num_experts_per_tok", 2),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, hidden_act=spec.hidden_act,
                  path="block_sparse_moe", scoring="sparsemixer",
                  sparsemixer_eps=float(config.get("router_jitter_noise", 0.01) or 0.0), expert_names=("w1", "w3", "w2"))
    return replace(spec, moe=moe)


@architecture("qwen2_moe", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation")
def qwen2_moe(config: dict) -> DecoderSpec:
    """Qwen2 with top-k softmax experts (norm_topk_prob), plus a shared expert gated by sigmoid(shared_expert_gate)."""
    _refuse_training_extras("qwen2_moe", config)
    bias = bool(config.get("qkv_bias", True))
    spec = qwen2(config)
    spec = replace(spec, attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias))
    moe = MoeSpec(num_experts=num_experts(config, 60), top_k=config.get("num_experts_per_tok", 4),
                  expert_size=config.get("moe_intermediate_size", 1408),
                  layers=sparse_step_layers(dict(config, num_experts=num_experts(config, 60)), spec.num_layers),
                  hidden_act=spec.hidden_act, norm_topk=bool(config.get("norm_topk_prob", False)),
                  shared="shared_expert", shared_size=config.get("shared_expert_intermediate_size", 5632),
                  shared_gate="shared_expert_gate")
    return replace(spec, moe=moe)


@architecture("qwen3_moe", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation",
              aliases=[
                  "qwen3_vl_moe_text",  # normalized to qwen3_moe
                  "qwen3_vl_moe",  # multimodal wrapper; text_config
                  "qwen3_omni_moe_text",  # normalized to qwen3_moe
              ])
def qwen3_moe(config: dict) -> DecoderSpec:
    """Qwen3 (per-head q/k RMSNorm) with top-k softmax experts (norm_topk_prob), no shared expert. Qwen3-VL-MoE's text
    model (qwen3_vl_moe_text) keeps its experts fused (experts.gate_up_proj, experts.down_proj), in either layout."""
    _refuse_training_extras("qwen3_moe", config)
    spec = qwen3(config)
    moe = MoeSpec(num_experts=num_experts(config, 128), top_k=config.get("num_experts_per_tok", 8),
                  expert_size=config.get("moe_intermediate_size", 768),
                  layers=sparse_step_layers(dict(config, num_experts=num_experts(config, 128)), spec.num_layers),
                  hidden_act=spec.hidden_act, norm_topk=bool(config.get("norm_topk_prob", False)))
    if config.get("model_type") == "qwen3_vl_moe_text":
        moe = replace(moe, fused_experts=("gate_up_proj", "down_proj"), fused_either_layout=True)
    return replace(spec, moe=moe)


@architecture("qwen3_5_moe_text", norm="rms", llama_layout=True, status="verified",
              notes=("native KV-cache generation; hybrid Gated-DeltaNet/full-attention schedule; upstream claims 2-step"
                     " AdamW parity"),
              aliases=[
                  "qwen3_5_moe",  # multimodal wrapper; text_config
              ])
def qwen3_5_moe_text(config: dict) -> DecoderSpec:
    """Qwen3.5's hybrid decoder (Gated DeltaNet and gated-attention layers) with a sparse block in every layer: softmax
    router mlp.gate, top-k always renormalised, SwiGLU experts (saved one module per expert), plus a shared_expert
    scaled by sigmoid(shared_expert_gate(x))."""
    _refuse_training_extras("qwen3_5_moe_text", config)
    spec = qwen3_5_text(config)
    moe = MoeSpec(num_experts=num_experts(config, 256), top_k=config.get("num_experts_per_tok", 8),
                  expert_size=config.get("moe_intermediate_size", 512), layers=(True,) * spec.num_layers,
                  hidden_act=spec.hidden_act, norm_topk=True, shared="shared_expert",
                  shared_size=config.get("shared_expert_intermediate_size", 512), shared_gate="shared_expert_gate")
    return replace(spec, moe=moe)


@architecture("qwen3_next", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation; hybrid Gated-DeltaNet/full-attention schedule")
def qwen3_next(config: dict) -> DecoderSpec:
    """Qwen3.5's hybrid decoder whose Gated DeltaNet projections are laid out per key head (in_proj_qkvz,
    in_proj_ba), with Qwen2-MoE's sparse block (norm_topk_prob, sigmoid-gated shared_expert) on the layers of
    decoder_sparse_step / mlp_only_layers and dense MLPs of intermediate_size elsewhere."""
    _refuse_training_extras("qwen3_next", config)
    moe = qwen2_moe(dict(config, norm_topk_prob=config.get("norm_topk_prob", True))).moe
    return replace(qwen3_5_text(config).amend("linear_attention", grouped_projections=True), moe=moe)


@architecture("llama4_text", norm="rms", llama_layout=True, status="verified",
              notes="chunked attention; NoPE layers",
              aliases=[
                  "llama4",  # multimodal wrapper; text_config
              ])
def llama4_text(config: dict) -> DecoderSpec:
    """Llama 4's text decoder: Llama blocks (feed_forward) with interleaved rotary on the layers no_rope_layers marks,
    Llama 4's attention deltas (llama4.py: chunked attention, NoPE temperature, weightless q/k norm) and, on
    moe_layers (default every interleave_moe_layer_step-th), a sparse block: sigmoid of the top-k router logits
    scaling each chosen expert's input, experts saved fused and transposed (experts.gate_up_proj [E, H, 2I],
    down_proj [E, I, H]), plus a shared_expert; dense layers have intermediate_size_mlp."""
    _refuse_training_extras("llama4_text", config)
    spec = llama(config)
    n = spec.num_layers
    interval = config.get("no_rope_layer_interval") or 4
    rotary = [bool(r) for r in config.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(n)]]
    chunk = config.get("attention_chunk_size")
    types = config.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rotary]
    step = config.get("interleave_moe_layer_step") or 1
    sparse = config.get("moe_layers")
    sparse = set(range(step - 1, n, step) if sparse is None else sparse)
    attention = Llama4Attention(
        chunks=tuple(chunk if t == "chunked_attention" else 0 for t in types),
        qk_norm=tuple(bool(config.get("use_qk_norm", True)) and r for r in rotary),
        temperature=tuple(bool(config.get("attn_temperature_tuning", True)) and not r for r in rotary),
        floor_scale=float(config.get("floor_scale", 8192)), attn_scale=float(config.get("attn_scale", 0.1)),
        eps=spec.norms.eps)
    size = config.get("intermediate_size", 8192)
    moe = MoeSpec(num_experts=num_experts(config, 16), top_k=config.get("num_experts_per_tok", 1), expert_size=size,
                  layers=tuple(i in sparse for i in range(n)), hidden_act=spec.hidden_act, path="feed_forward",
                  router="router", scoring="sigmoid", scale_inputs=True, fused_experts=("gate_up_proj", "down_proj"),
                  fused_transposed=True, shared="shared_expert", shared_size=size)
    return replace(spec, mlp=replace(spec.mlp, path="feed_forward"),
                   intermediate_size=config.get("intermediate_size_mlp", 16384),
                   positions=replace(spec.positions, rope_interleaved=True, rope_layers=tuple(rotary)),
                   make_layer=attention, moe=moe)


@architecture("longcat_flash", norm="rms", llama_layout=True, status="verified",
              notes="MLA via Youtu/DeepSeek normalization; zero/identity experts")
def longcat_flash(config: dict) -> DecoderSpec:
    """LongCat-Flash (longcat.py): num_layers layers of two sublayers, each DeepSeek-V3's MLA (interleaved rotary,
    q_lora_rank; queries scaled by sqrt(hidden / q_lora_rank), the normed kv latent by sqrt(hidden / kv_lora_rank),
    both latent norms with eps 1e-6) and a dense MLP of ffn_hidden_size, plus a sparse block per layer: softmax router
    mlp.router.classifier over n_routed_experts and zero_expert_num identity experts, top-moe_topk chosen with the
    router.e_score_correction_bias buffer, not renormalised, scaled by routed_scaling_factor; experts of
    expert_ffn_hidden_size (the identity experts' gate/up projections are stored but never run)."""
    _refuse_training_extras("longcat_flash", config)
    layers = config.get("num_layers") or config["num_hidden_layers"] // 2
    flat = dict(config, num_hidden_layers=2 * layers, intermediate_size=config.get("ffn_hidden_size", 12288))
    hidden = config["hidden_size"]
    sub = with_mla(llama(flat), flat).amend("mla", q_scale=(hidden / config["q_lora_rank"]) ** 0.5,
                                            kv_scale=(hidden / config["kv_lora_rank"]) ** 0.5, norm_eps=1e-6)
    experts, identity = config.get("n_routed_experts", 512), config.get("zero_expert_num") or 0
    moe = MoeSpec(num_experts=experts, top_k=config.get("moe_topk", 12),
                  expert_size=config.get("expert_ffn_hidden_size", 2048), layers=(True,) * layers,
                  hidden_act=sub.hidden_act, router="router.classifier",
                  router_bias=bool(config.get("router_bias", False)),
                  selection_bias="router.e_score_correction_bias",
                  routed_scale=float(config.get("routed_scaling_factor", 6.0)), identity_experts=identity,
                  identity_weights=("gate_proj", "up_proj"))
    return replace(sub, num_layers=layers, make_layer=LongcatLayers(sub), moe=moe)


@architecture("gpt_oss", norm="rms", llama_layout=True, status="verified",
              notes=("native KV-cache generation; clipped SwiGLU (gpt_oss_swiglu shader); alternating sliding/full "
                     "attention; upstream claims 2-step AdamW parity"))
def gpt_oss(config: dict) -> DecoderSpec:
    """GPT-OSS: Llama attention with q/k/v/o biases (attention_bias, on by default), per-head sinks and layer_types
    (default: even layers sliding, odd full), with a sparse block in every layer: router mlp.router with a bias,
    softmax over the top-k logits (= renormalised top-k softmax), experts saved fused and transposed with biases
    (experts.gate_up_proj [E, H, 2I] whose columns alternate gate, up; gate_up_proj_bias [E, 2I]; down_proj
    [E, I, H]; down_proj_bias [E, H]) and the clipped SwiGLU of swiglu_alpha / swiglu_limit."""
    _refuse_training_extras("gpt_oss", config)
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    spec = llama(dict(config, attention_bias=config.get("attention_bias", True)))
    moe = MoeSpec(num_experts=num_experts(config, 128), top_k=config.get("num_experts_per_tok", 4),
                  expert_size=spec.intermediate_size, layers=(True,) * n, router="router", router_bias=True,
                  norm_topk=True, fused_experts=("gate_up_proj", "down_proj"), fused_transposed=True,
                  fused_bias=("gate_up_proj_bias", "down_proj_bias"), gate_up_interleaved=True,
                  swiglu_clip=(float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))))
    return replace(spec,
                   attention=replace(spec.attention, windows=sliding_windows(dict(config, layer_types=types), n,
                                                                             every_layer=False), sinks="sinks"),
                   moe=moe)


@architecture("mimo_v2_flash", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation")
def mimo_v2_flash(config: dict) -> DecoderSpec:
    """MiMo-V2-Flash (mimo.py): Llama blocks whose sliding layers (layer_types; default: all but layer 0 and every
    6th) have twice the KV heads and per-head sinks (self_attn.attention_sink_bias); value heads of v_head_dim
    scaled by attention_value_scale, o_proj without bias; rotary per layer type (default rope on
    int(head_dim * partial_rotary_factor) dims, 0.334 when a type's dict omits it). Sparse layers (mlp_layer_types;
    default all but the first): DeepSeek-V3's router (sigmoid, e_score_correction_bias, groups, norm_topk_prob,
    routed_scaling_factor) without shared experts."""
    _refuse_training_extras("mimo_v2_flash", config)
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                          for i in range(n)]
    window = config.get("sliding_window", 129)
    if config.get("sliding_window_size") is not None:  # the released configs' spelling: keys before the query
        window = config["sliding_window_size"] + 1
    ropes = config.get("rope_parameters") or {"full_attention": {"rope_type": "default", "rope_theta": 5e6},
                                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    ropes = {t: dict(p, partial_rotary_factor=p.get("partial_rotary_factor", 0.334)) for t, p in ropes.items()}
    rope_config = dict(config, rope_parameters=ropes)
    spec = llama(config)
    kv_heads = tuple(2 * spec.num_kv_heads if t == "sliding_attention" else spec.num_kv_heads for t in types)
    v_dim, value_scale = config.get("v_head_dim", 128), config.get("attention_value_scale", 0.707)
    refuse("mimo_v2_flash", config, "v_head_dim", lambda v: v <= spec.head_dim, 128)  # values padded to head_dim
    attention = MimoAttention(kv_heads=kv_heads, sinks=tuple(t == "sliding_attention" for t in types),
                              v_head_dim=v_dim, value_scale=1.0 if value_scale is None else float(value_scale))
    spec = replace(spec, num_kv_heads=max(kv_heads),
                   attention=replace(spec.attention, sinks="attention_sink_bias",
                                     windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                                     blind_rows="all"),  # eager only (the sliding layers' sinks give zeros)
                   make_layer=attention,
                   positions=replace(spec.positions, rope_configs=tuple((rope_config, t) for t in types)))
    return replace(spec, moe=replace(deepseek_moe(config, spec), layers=_mlp_layer_types(config, n)))


@architecture("deepseek_v4", norm="rms", status="verified",
              notes=("native KV-cache generation; HCA/CSA compressed attention + mHC + hyper head (composed from engine"
                     " ops, deepseek_v4.py); upstream claims 2-step AdamW parity"),
              model_class="vkformers_moe.model:DeepseekV4ForCausalLM")
def deepseek_v4(config: dict) -> DecoderSpec:
    """DeepSeek-V4 (deepseek_v4.py): hc_mult hyper-connected residual streams, shared-KV attention with sinks over a
    sliding window plus compressed entries (layer_types: sliding / CSA with a lightning indexer / HCA), grouped output
    projection; a sparse block in every layer (sqrt(softplus) scores, hash-routed on the hash_moe layers, top-k of
    scores + gate.bias elsewhere; clipped SwiGLU experts and one shared expert of moe_intermediate_size)."""
    _refuse_training_extras("deepseek_v4", config)
    refuse("deepseek_v4", config, "scoring_func", lambda v: v == "sqrtsoftplus", "sqrtsoftplus")
    refuse("deepseek_v4", config, "norm_topk_prob", lambda v: v is not False, True)
    n = config["num_hidden_layers"]
    size = config.get("moe_intermediate_size", 2048)
    spec = replace(llama(dict(config, intermediate_size=size, tie_word_embeddings=False)), num_kv_heads=1,
                   lm_head="head")
    types = tuple(config.get("layer_types") or ["heavily_compressed_attention"] * min(n, 2) + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))])
    mlp_types = config.get("mlp_layer_types") or ["hash_moe"] * min(n, 3) + ["moe"] * max(n - 3, 0)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128,
             **(config.get("compress_rates") or {})}
    moe = MoeSpec(num_experts=num_experts(config, 256), top_k=config.get("num_experts_per_tok") or 6, expert_size=size,
                  layers=(True,) * n, path="ffn", router="gate", selection_bias="gate.bias", norm_topk=True,
                  norm_eps=1e-20, routed_scale=float(config.get("routed_scaling_factor") or 1.0),
                  expert_names=("w1", "w3", "w2"), shared="shared_experts", shared_size=size)
    partial = config.get("partial_rotary_factor") or 64 / 512
    layers = DeepseekV4Layers(
        layer_types=types, hash_layers=tuple(t == "hash_moe" for t in mlp_types), moe=moe,
        hash_moe=replace(moe, selection_bias=None), swiglu_limit=float(config.get("swiglu_limit", 10.0)),
        q_lora_rank=config.get("q_lora_rank", 1024), o_groups=config.get("o_groups", 8),
        o_lora_rank=config.get("o_lora_rank", 1024), rope_dim=int(spec.head_dim * partial),
        window=config.get("sliding_window", 128), csa_rate=rates["compressed_sparse_attention"],
        hca_rate=rates["heavily_compressed_attention"], index_heads=config.get("index_n_heads", 64),
        index_dim=config.get("index_head_dim", 128), index_topk=config.get("index_topk", 512),
        hc_mult=config.get("hc_mult", 4), sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
        hc_eps=float(config.get("hc_eps", 1e-6)))
    ropes = tuple((config, "main" if t == "sliding_attention" else "compress") for t in types)
    return replace(spec, make_layer=layers, positions=replace(spec.positions, rope_configs=ropes))

@architecture("qwen4_exp_text", norm="rms", llama_layout=True, status="verified",
              notes=("native KV-cache generation; DeltaNet + sparse QSA + GR/hyper-connection streams + PLE (composed "
                     "from engine ops, qwen4_exp.py); upstream claims 2-step AdamW parity"),
              model_class="vkformers_moe.model:Qwen4ExpForCausalLM",
              aliases=[
                  "qwen4_exp",  # wrapper; text_config
              ])
def qwen4_exp_text(config: dict) -> DecoderSpec:
    """Qwen4-Exp (qwen4_exp.py): Qwen3.5-MoE's layers without their norms, between gated residuals over hc_count
    streams (collapsed by hyper_connection_mixer, no final norm); PLE hashed n-gram embeddings on ple_layer_ids;
    QSA block selection on the attention layers when indexer_n_heads is set."""
    refuse("qwen4_exp_text", config, "output_gate_type", lambda v: v in (None, "silu", "swish"), "silu")
    refuse("qwen4_exp_text", config, "hidden_act", lambda v: v in ("silu", "swish"), "silu")
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or ["linear_attention" if (i + 1) % 4 else "indexed_attention" for i in range(n)]
    spec = qwen3_5_moe_text(dict(config, layer_types=types))
    ple = sorted(set(config.get("ple_layer_ids") or ()))
    refuse("qwen4_exp_text", config, "ple_layer_ids", lambda v: all(types[i - 1] == "linear_attention" for i in ple))
    if config.get("indexer_n_heads") is not None:
        refuse("qwen4_exp_text", config, "indexer_kv_heads", lambda v: v == 1, 1)
    eos = config.get("eos_token_id")
    hidden = spec.hidden_size
    layers = Qwen4ExpLayers(
        hc_count=config.get("hc_count", 4), hc_lowrank=config.get("hc_lowrank", 320),
        ple_index=tuple(ple.index(i + 1) if i + 1 in ple else None for i in range(n)),
        ple_dim=config.get("ple_embed_dim") or hidden, ple_kernel=config.get("ple_conv_kernel_size", 4),
        ngram_size=config.get("ngram_size", 3), heads_per_ngram=config.get("heads_per_ngram", 8),
        ngram_base=config.get("ngram_vocab_size_base", 20_000_000),
        ngram_divisor=config.get("make_ngram_vocab_size_divisible_by", 128),
        ngram_shards=config.get("split_ngram_parts", 512), seed=config.get("seed", 1234),
        eos=(eos[0] if isinstance(eos, list) else eos) if eos is not None else 0,
        index_heads=config.get("indexer_n_heads") or 0, index_dim=config.get("indexer_head_dim") or 0,
        budget=config.get("indexer_budget") or 0, ratio=config.get("indexer_compress_ratio") or 1)
    return replace(spec, attn_in_norm=None, mlp_in_norm=None, final_norm=None, make_layer=layers)


@architecture("olmoe", norm="rms", llama_layout=True, status="verified")
def olmoe(config: dict) -> DecoderSpec:
    """OLMo-style attention (q/k RMSNorm over the whole projection, clip_qkv) with top-k softmax experts in every
    layer (norm_topk_prob)."""
    _refuse_training_extras("olmoe", config)
    spec = llama(config)
    spec = replace(spec,
                   attention=replace(spec.attention, q_norm="q_norm", k_norm="k_norm", qk_norm_scope="full",
                                     clip_qkv=config.get("clip_qkv"), clip_after_qk_norm=True),
                   norms=replace(spec.norms, eps=config.get("rms_norm_eps", 1e-5)))
    moe = MoeSpec(num_experts=num_experts(config, 64), top_k=config.get("num_experts_per_tok", 8),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, hidden_act=spec.hidden_act,
                  norm_topk=bool(config.get("norm_topk_prob", False)))
    return replace(spec, moe=moe)


@architecture("granitemoe", norm="rms", llama_layout=True, status="verified")
def granitemoe(config: dict) -> DecoderSpec:
    """Granite's multipliers with experts stored fused: block_sparse_moe.input_linear.weight [E, 2I, H] ([gate | up])
    and output_linear.weight [E, H, I]; softmax over the top-k router logits (= renormalised top-k softmax)."""
    _refuse_training_extras("granitemoe", config)
    spec = granite(config)
    moe = MoeSpec(num_experts=num_experts(config, 8), top_k=config.get("num_experts_per_tok", 2),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, hidden_act=spec.hidden_act,
                  path="block_sparse_moe", router="router.layer", norm_topk=True, experts="",
                  fused_experts=("input_linear.weight", "output_linear.weight"))
    return replace(spec, moe=moe)


@architecture("jetmoe", norm="rms", llama_layout=True, status="verified",
              notes="mixture of attention heads (jetmoe.py)")
def jetmoe(config: dict) -> DecoderSpec:
    """JetMoE: a mixture of attention heads (vkformers_moe.jetmoe: top_k query experts of KVH heads over one shared
    kv_proj) and a sparse MLP in every layer whose experts are stored fused (mlp.input_linear [E, 2I, H] = [gate |
    up], output_linear [E, H, I]) with a bias on its output; both routers take the softmax over the top_k logits."""
    arch = "jetmoe"
    _refuse_training_extras(arch, config)
    # transformers' layer norms keep eps 1e-6 whatever rms_norm_eps says (only the final norm reads it)
    refuse(arch, config, "rms_norm_eps", lambda v: v == 1e-6, 1e-6)
    experts, top_k = config.get("num_local_experts", 8), config.get("num_experts_per_tok", 2)
    kv_heads = config.get("num_key_value_heads", 16)
    spec = llama(dict(config, num_attention_heads=kv_heads * top_k, num_key_value_heads=kv_heads,
                      head_dim=config.get("kv_channels", 128), hidden_act=config.get("activation_function", "silu"),
                      tie_word_embeddings=config.get("tie_word_embeddings", True)))
    moe = MoeSpec(num_experts=experts, top_k=top_k, expert_size=spec.intermediate_size,
                  layers=(True,) * spec.num_layers, hidden_act=spec.hidden_act, router="router.layer", norm_topk=True,
                  experts="", fused_experts=("input_linear.weight", "output_linear.weight"), output_bias="bias")
    return replace(spec, moe=moe, attention=replace(spec.attention, path="self_attention",
                                                    module=JetMoeAttention(experts, top_k)))


@architecture("granitemoeshared", norm="rms", llama_layout=True, status="verified")
def granitemoeshared(config: dict) -> DecoderSpec:
    """GraniteMoE plus an always-on shared MLP beside the sparse block (layers.<i>.shared_mlp, fused like the experts:
    input_linear [2S, H] = [gate | up], output_linear [H, S]; none when shared_intermediate_size is 0)."""
    spec = granitemoe(config)
    size = config.get("shared_intermediate_size") or 0
    if not size:
        return spec
    return replace(spec, moe=replace(spec.moe, shared="shared_mlp", shared_size=size, shared_in_layer=True,
                                     shared_fused=True, shared_names=("input_linear", "output_linear")))


@architecture("granitemoe_swa", norm="rms", llama_layout=True, status="verified")
def granitemoe_swa(config: dict) -> DecoderSpec:
    """granite_swa's attention (per-layer sliding windows and rope theta, per-head sinks) with GraniteMoeShared's
    sparse block and shared MLP; no checkpoint conversion in transformers, so the block is saved as it runs: router
    block_sparse_moe.router.weight, experts fused as experts.gate_up_proj [E, 2I, H] and experts.down_proj."""
    moe = replace(granitemoeshared(config).moe, router="router", experts="experts",
                  fused_experts=("gate_up_proj", "down_proj"))
    return replace(granite_swa(config), moe=moe)


@architecture("ernie4_5_moe", norm="rms", llama_layout=True, status="verified")
def ernie4_5_moe(config: dict) -> DecoderSpec:
    """ERNIE 4.5 (interleaved rotary, use_bias) whose layers moe_layer_start_index..moe_layer_end_index, every
    moe_layer_interval-th, are sparse: softmax router gate over moe_num_experts, top-moe_k chosen on the scores plus
    the gradient-free parameter moe_statics.e_score_correction_bias [1, E], the unbiased scores renormalised (the
    moe_norm_min clamp of the sum never binds: top-k softmax sums are far above it); shared_experts of
    moe_intermediate_size * moe_num_shared_experts (with biases when use_bias, as lm_head then has one)."""
    _refuse_training_extras("ernie4_5_moe", config)
    spec = replace(ernie4_5(config), lm_head_bias=bool(config.get("use_bias", False)))  # unlike dense ERNIE 4.5
    n = spec.num_layers
    start, end = config.get("moe_layer_start_index", 1), config.get("moe_layer_end_index", -1)
    end = n - 1 if end == -1 else end
    interval = config.get("moe_layer_interval") or 1
    experts = first_of(config, "moe_num_experts", "num_experts", default=64)
    size, shared = config.get("moe_intermediate_size", 1536), config.get("moe_num_shared_experts", 2) or 0
    refuse("ernie4_5_moe", config, "moe_norm_min", lambda v: v is None or v <= 1e-6)
    moe = MoeSpec(num_experts=experts, top_k=first_of(config, "moe_k", "num_experts_per_tok", default=6),
                  expert_size=size,
                  layers=tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n)),
                  hidden_act=spec.hidden_act, selection_bias="moe_statics.e_score_correction_bias",
                  selection_bias_is_parameter=True, selection_bias_shape=(1, experts), norm_topk=True,
                  shared="shared_experts" if shared else None, shared_size=size * shared,
                  shared_bias=bool(config.get("use_bias", False)))
    return replace(spec, moe=moe)


def _mlp_types(config: dict, num_layers: int) -> list[str]:
    """mlp_layer_types, else the first first_k_dense_replace layers dense."""
    dense = config.get("first_k_dense_replace") or 0
    return config.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(num_layers)]


@architecture("cohere2_moe", norm="layer", llama_layout=True, status="verified")
def cohere2_moe(config: dict) -> DecoderSpec:
    """Cohere 2 (parallel residual, interleaved rotary on sliding layers, logit_scale) with RMSNorm when rms_norm_eps
    is set; dense layers (mlp_layer_types) of prefix_dense_intermediate_size, which always rotate when
    prefix_dense_sliding_window_pattern is 1; sparse layers: router gate, top-k of the logits then softmax over them
    (= renormalised top-k softmax) or sigmoid (renormalised if norm_topk_prob), experts of intermediate_size,
    num_shared_experts * intermediate_size shared experts summed or averaged with them."""
    _refuse_training_extras("cohere2_moe", config)
    selection = config.get("expert_selection_fn") or "softmax"
    refuse("cohere2_moe", config, "expert_selection_fn", lambda v: (v or "softmax") in ("softmax", "sigmoid"))
    combine = config.get("shared_expert_combination_strategy") or "average"
    refuse("cohere2_moe", config, "shared_expert_combination_strategy", lambda v: (v or "average") in ("sum", "average"))
    spec = cohere2(config)
    n = spec.num_layers
    mlp_types, types = _mlp_types(config, n), layer_types(config, n)
    force = config.get("prefix_dense_sliding_window_pattern", 1) == 1
    spec = replace(spec,
                   positions=replace(spec.positions, rope_layers=tuple(
                       t == "sliding_attention" or (m == "dense" and force) for t, m in zip(types, mlp_types))),
                   intermediate_size=config.get("prefix_dense_intermediate_size") or spec.intermediate_size)
    if config.get("rms_norm_eps") is not None:
        spec = replace(spec, norms=replace(spec.norms, kind="rms", eps=config["rms_norm_eps"]))
    size, shared = config.get("intermediate_size"), config.get("num_shared_experts") or 0
    moe = MoeSpec(num_experts=num_experts(config, 8), top_k=config.get("num_experts_per_tok", 2), expert_size=size,
                  layers=tuple(m == "sparse" for m in mlp_types), hidden_act=spec.hidden_act, scoring=selection,
                  norm_topk=selection == "softmax" or bool(config.get("norm_topk_prob", True)),
                  shared="shared_experts" if shared else None, shared_size=size * shared,
                  output_scale=0.5 if shared and combine == "average" else 1.0)
    return replace(spec, moe=moe)


@architecture("exaone_moe", norm="rms", llama_layout=True, status="verified")
def exaone_moe(config: dict) -> DecoderSpec:
    """EXAONE MoE: Qwen3-style pre-norm block with per-head q/k RMSNorm, EXAONE 4's per-layer windows (with sliding
    layers only those rotate), DeepSeek-V3's router (e_score_correction_bias saved as mlp.e_score_correction_bias)
    on the layers mlp_layer_types marks sparse, num_shared_experts shared experts."""
    _refuse_training_extras("exaone_moe", config)
    spec = qwen3(config)
    n = spec.num_layers
    types = layer_types(config, n)
    spec = replace(spec, attention=replace(spec.attention, windows=sliding_windows(config, n, every_layer=False)),
                   positions=replace(spec.positions, rope_layers=tuple(t == "sliding_attention" for t in types)
                                     if config.get("sliding_window") else ()))
    moe = replace(deepseek_moe(config, spec), selection_bias="e_score_correction_bias",
                  layers=tuple(m == "sparse" for m in _mlp_types(dict(config, first_k_dense_replace=config.get(
                      "first_k_dense_replace", 1)), n)),
                  shared="shared_experts", shared_size=config.get("moe_intermediate_size", 1024) *
                  (config.get("num_shared_experts", 1) or 0))
    if not moe.shared_size:
        moe = replace(moe, shared=None)
    return replace(spec, moe=moe)


@architecture("minimax_m2", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation; upstream claims 2-step AdamW parity")
def minimax_m2(config: dict) -> DecoderSpec:
    """MiniMax-M2: Llama attention with q/k RMSNorm over the whole projection and partial rotary (rope_parameters
    partial_rotary_factor, which transformers derives from the released configs' rotary_dim); a sparse block in every
    layer, saved as Mixtral's (block_sparse_moe, experts.<e>.w1/w3/w2): sigmoid router, top-k chosen with the
    block_sparse_moe.e_score_correction_bias buffer, the unbiased scores renormalised."""
    _refuse_training_extras("minimax_m2", config)
    if "rotary_dim" in config and "partial_rotary_factor" not in (config.get("rope_parameters") or {}):
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        config = dict(config, rope_parameters=dict(config.get("rope_parameters") or {},
                                                   partial_rotary_factor=config["rotary_dim"] / head_dim))
    spec = llama(config)
    spec = replace(spec, attention=replace(spec.attention, q_norm="q_norm", k_norm="k_norm", qk_norm_scope="full"))
    moe = MoeSpec(num_experts=num_experts(config, 256), top_k=config.get("num_experts_per_tok", 8),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, hidden_act=spec.hidden_act,
                  path="block_sparse_moe", scoring="sigmoid", selection_bias="e_score_correction_bias",
                  norm_topk=True, expert_names=("w1", "w3", "w2"))
    return replace(spec, moe=moe)


@architecture("minimax_m3_vl_text", norm="rms", llama_layout=True, status="verified",
              notes=("native KV-cache generation; Lightning-indexer block-sparse attention; GPT-OSS clipped SwiGLU; "
                     "upstream claims 2-step AdamW parity"),
              aliases=[
                  "minimax_m3_vl",  # wrapper; text_config; model.language_model.* prefix
              ])
def minimax_m3_vl_text(config: dict) -> DecoderSpec:
    """MiniMax-M3's text decoder (minimax_m3.py): Llama attention with per-head q/k norms before the rotation, (1 + w)
    RMS norms everywhere, rotary from rope_parameters alone (transformers 5.24 ignores rotary_dim here, unlike
    MiniMax-M2); lightning-indexer block-sparse attention on the layers layer_types marks minimax_m3_sparse. MLPs
    (mlp_layer_types): dense ones of dense_intermediate_size (fused gate_up_proj), sparse ones with a sigmoid router
    (gate.e_score_correction_bias for choosing), top-k renormalised, the routed output scaled by
    routed_scaling_factor, experts fused [E, 2I, H] / [E, H, I], shared_experts (fused gate_up_proj). Every GLU is
    GPT-OSS's clipped SwiGLU (swiglu_alpha, swiglu_limit). The released configs' sparse_attention_config and
    moe_layer_freq are read as transformers reads them."""
    _refuse_training_extras("minimax_m3_vl_text", config)
    legacy = config.get("sparse_attention_config") or {}
    index = {flat: legacy.get(old, config.get(flat, default)) for flat, old, default in (
        ("index_n_heads", "sparse_num_index_heads", 4), ("index_head_dim", "sparse_index_dim", 128),
        ("index_block_size", "sparse_block_size", 128), ("index_topk_blocks", "sparse_topk_blocks", 16),
        ("index_local_blocks", "sparse_local_block", 1))}
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or (["minimax_m3_sparse" if f else "full_attention"
                                           for f in legacy["sparse_attention_freq"]]
                                          if "sparse_attention_freq" in legacy else ["full_attention"] * n)
    mlp_types = config.get("mlp_layer_types") or (["sparse" if f else "dense" for f in config["moe_layer_freq"]]
                                                  if config.get("moe_layer_freq") is not None else ["sparse"] * n)
    clip = (float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0)))
    spec = llama(dict(config, hidden_act="silu"))
    spec = replace(spec,
                   attention=replace(spec.attention, q_norm="q_norm", k_norm="k_norm"),
                   norms=replace(spec.norms, unit_offset=True),
                   intermediate_size=config.get("dense_intermediate_size", 12288))
    spec = spec.amend("mlp", gate_up_proj="gate_up_proj")
    rope = config.get("rope_parameters") or {}
    rotary = int(spec.head_dim * rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if "minimax_m3_sparse" in types:  # transformers rotates the indexer by the first index_head_dim rotary columns
        flat = dict(config, **index)
        refuse("minimax_m3_vl_text", flat, "index_head_dim", lambda v: v >= rotary)
        refuse("minimax_m3_vl_text", flat, "index_n_heads", lambda v: spec.num_heads % v == 0)
        # more forced local blocks than kept ones: transformers keeps an arbitrary subset of them
        refuse("minimax_m3_vl_text", flat, "index_local_blocks", lambda v: v <= index["index_topk_blocks"])
    attention = MinimaxM3Attention(
        sparse=tuple(t == "minimax_m3_sparse" for t in types), index_heads=index["index_n_heads"],
        index_dim=index["index_head_dim"], block=index["index_block_size"], topk_blocks=index["index_topk_blocks"],
        local_blocks=index["index_local_blocks"], swiglu_clip=clip)
    moe = MoeSpec(num_experts=num_experts(config, 128), top_k=config.get("num_experts_per_tok", 4),
                  expert_size=config.get("intermediate_size", 3072), layers=tuple(t == "sparse" for t in mlp_types),
                  scoring="sigmoid", selection_bias="gate.e_score_correction_bias", norm_topk=True,
                  routed_scale=float(config.get("routed_scaling_factor", 2.0)),
                  fused_experts=("gate_up_proj", "down_proj"), swiglu_clip=clip, shared="shared_experts",
                  shared_size=config.get("shared_intermediate_size", 3072), shared_names=("gate_up_proj", "down_proj"),
                  shared_fused=True, shared_swiglu_clip=True)
    return replace(spec, make_layer=attention, moe=moe)


@architecture("solar_open", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation")
def solar_open(config: dict) -> DecoderSpec:
    """Solar Open: Llama attention (q/k/v biases under attention_bias, o_proj never) with DeepSeek-V3's router (sigmoid,
    gate.e_score_correction_bias, groups, renormalised, routed_scaling_factor) and n_shared_experts shared experts in
    every layer."""
    _refuse_training_extras("solar_open", config)
    bias = bool(config.get("attention_bias", False))
    spec = llama(dict(config, attention_bias=False))
    spec = replace(spec, attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias))
    moe = replace(deepseek_moe(dict(config, first_k_dense_replace=0), spec),
                  num_experts=num_experts(config, 128))
    return replace(spec, moe=moe)


@architecture("mellum", norm="rms", llama_layout=True, status="verified",
              notes="parsed via Qwen3 geometry")
def mellum(config: dict) -> DecoderSpec:
    """Mellum: Qwen3 attention (per-head q/k RMSNorm) with per-layer sliding windows and one rope_parameters dict per
    layer type; sparse layers (mlp_layer_types) with a top-k softmax router (norm_topk_prob), dense ones of
    intermediate_size. Multi-token-prediction layers (mtp.*) are not part of the causal LM (transformers ignores them)."""
    _refuse_training_extras("mellum", config)
    spec = qwen3(config)
    n = spec.num_layers
    types = layer_types(config, n)
    params = config.get("rope_parameters")
    ropes = tuple((config, t) for t in types) if params and all(isinstance(v, dict) for v in params.values()) else ()
    spec = replace(spec,
                   attention=replace(spec.attention, windows=sliding_windows(config, n, every_layer=False)),
                   positions=replace(spec.positions, rope_configs=ropes))
    moe = MoeSpec(num_experts=num_experts(config, 64), top_k=config.get("num_experts_per_tok", 8),
                  expert_size=config.get("moe_intermediate_size", 896),
                  layers=tuple(m == "sparse" for m in (config.get("mlp_layer_types") or ["sparse"] * n)),
                  hidden_act=spec.hidden_act, norm_topk=bool(config.get("norm_topk_prob", True)))
    return replace(spec, moe=moe)


@architecture("afmoe", norm="rms", llama_layout=True, status="verified")
def afmoe(config: dict) -> DecoderSpec:
    """AFMoE: per-head q/k RMSNorm, rotary on sliding layers only, attention output gated by sigmoid(gate_proj(x))
    per channel, norms before and after attention and MLP, sqrt(hidden) embedding scale under mup_enabled; after
    num_dense_layers dense layers, a sigmoid router mlp.router.gate chosen with the gradient-free parameter
    mlp.expert_bias, renormalised (+1e-20) and scaled by route_scale, plus num_shared_experts shared experts."""
    _refuse_training_extras("afmoe", config)
    spec = qwen3(config)
    n = spec.num_layers
    types = layer_types(config, n)
    spec = replace(spec,
                   attention=replace(spec.attention, windows=sliding_windows(config, n, every_layer=False),
                                     output_gate="gate_proj", output_gate_per_head=False, output_gate_sigmoid=True),
                   positions=replace(spec.positions, rope_layers=tuple(t == "sliding_attention" for t in types)),
                   attn_out_norm="post_attention_layernorm", mlp_in_norm="pre_mlp_layernorm",
                   mlp_out_norm="post_mlp_layernorm",
                   embed_scale=spec.hidden_size ** 0.5 if config.get("mup_enabled") else 1.0)
    size, shared = config.get("moe_intermediate_size", 1408), config.get("num_shared_experts", 2) or 0
    dense = config.get("num_dense_layers", 1) or 0
    moe = MoeSpec(num_experts=num_experts(config, 64), top_k=config.get("num_experts_per_tok", 6), expert_size=size,
                  layers=tuple(i >= dense for i in range(n)), hidden_act=spec.hidden_act, router="router.gate",
                  scoring="sigmoid", selection_bias="expert_bias", selection_bias_is_parameter=True, norm_topk=True,
                  norm_eps=1e-20, routed_scale=float(config.get("route_scale") or 1.0),
                  shared="shared_experts" if shared else None, shared_size=size * shared)
    return replace(spec, moe=moe)


@architecture("dbrx", norm="layer", status="verified",
              notes="native KV-cache generation; upstream claims HF forward-logit fixtures")
def dbrx(config: dict) -> DecoderSpec:
    """DBRX (nested attn_config / ffn_config): transformer.blocks.<i>.norm_attn_norm.{norm_1, attn, norm_2} with
    LayerNorms without bias, fused Wqkv [q | k | v] clamped by clip_qkv, out_proj; ffn: softmax router
    ffn.router.layer, top moe_top_k divided by their moe_normalize_expert_weights-norm (1: their sum; None: kept),
    experts stacked as ffn.experts.mlp.w1 (gate) / v1 (up) / w2 (down) [E * ffn_hidden_size, d_model]."""
    _refuse_training_extras("dbrx", config)
    attn, ffn = config.get("attn_config") or {}, config.get("ffn_config") or {}
    refuse("dbrx", ffn, "moe_normalize_expert_weights", lambda v: v in (None, 1, 1.0), default=1.0)
    refuse("dbrx", ffn, "moe_jitter_eps", lambda v: not v)
    act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    flat = dict(config, hidden_size=config["d_model"], num_attention_heads=config["n_heads"],
                num_hidden_layers=config["n_layers"], num_key_value_heads=attn.get("kv_n_heads", 1),
                max_position_embeddings=config.get("max_seq_len", 2048), intermediate_size=ffn.get("ffn_hidden_size",
                3584), tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), hidden_act=act)
    if not flat.get("rope_parameters") and "rope_theta" in attn:
        flat["rope_parameters"] = {"rope_type": "default", "rope_theta": attn["rope_theta"]}
    spec = llama(flat)
    spec = replace(spec, embed="transformer.wte", layers="transformer.blocks", final_norm="transformer.norm_f",
                   attn_in_norm="norm_attn_norm.norm_1", mlp_in_norm="norm_attn_norm.norm_2",
                   attention=replace(spec.attention, path="norm_attn_norm.attn", qkv_proj="Wqkv", qkv_layout="blocks",
                                     o_proj="out_proj", clip_qkv=attn.get("clip_qkv")),
                   norms=replace(spec.norms, kind="layer", eps=1e-5, bias=False),
                   positions=replace(spec.positions, rope_configs=((flat, None),) * flat["n_layers"]))  # flat sizes
    moe = MoeSpec(num_experts=ffn.get("moe_num_experts", 4), top_k=ffn.get("moe_top_k", 1),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, hidden_act=act, path="ffn",
                  router="router.layer", norm_topk=ffn.get("moe_normalize_expert_weights", 1.0) is not None,
                  experts="experts.mlp", stacked_experts=True, expert_names=("w1", "v1", "w2"))
    return replace(spec, moe=moe)


@architecture("aria_text", norm="rms", llama_layout=True, status="verified",
              aliases=[
                  "aria",  # multimodal wrapper; text_config
              ])
def aria_text(config: dict) -> DecoderSpec:
    """Aria's text decoder: Llama with a sparse block in every layer: router mlp.router, softmax over the top-k logits
    (= renormalised top-k softmax), SiLU experts saved fused and transposed (experts.fc1.weight [E, H, 2I] = [gate |
    up], fc2.weight [E, I, H]), shared_experts of intermediate_size * moe_num_shared_experts."""
    _refuse_training_extras("aria_text", config)
    refuse("aria_text", config, "hidden_act", lambda v: v == "silu", default="silu")  # the routed experts are SiLU
    refuse("aria_text", config, "mlp_bias", lambda v: not v)
    spec = llama(config)
    shared = config.get("moe_num_shared_experts", 2) or 0
    moe = MoeSpec(num_experts=config.get("moe_num_experts", 8), top_k=config.get("moe_topk", 2),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, router="router",
                  norm_topk=True, fused_experts=("fc1.weight", "fc2.weight"), fused_transposed=True,
                  shared="shared_experts" if shared else None, shared_size=spec.intermediate_size * shared)
    return replace(spec, moe=moe)


@architecture("flex_olmo", norm="rms", llama_layout=True, status="verified")
def flex_olmo(config: dict) -> DecoderSpec:
    """OLMo 2's block (norms after attention and MLP, q/k RMSNorm over the whole projection) with top-k softmax
    experts in every layer (norm_topk_prob)."""
    _refuse_training_extras("flex_olmo", config)
    spec = olmo2(config)
    moe = MoeSpec(num_experts=num_experts(config, 7), top_k=config.get("num_experts_per_tok", 5),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, hidden_act=spec.hidden_act,
                  norm_topk=bool(config.get("norm_topk_prob", False)))
    return replace(spec, moe=moe)


@architecture("hunyuan_v1_moe", norm="rms", llama_layout=True, status="verified")
def hunyuan_v1_moe(config: dict) -> DecoderSpec:
    """HunYuan's block (q/k RMSNorm after rotary) with a renormalised top-k softmax router mlp.gate.wg over experts of
    width intermediate_size, plus an always-on shared_mlp of that width."""
    _refuse_training_extras("hunyuan_v1_moe", config)
    for option in ("num_experts", "moe_topk"):
        refuse("hunyuan_v1_moe", config, option, lambda v: not isinstance(v, list))  # per-layer expert counts
    spec = hunyuan_v1_dense(config)
    moe = MoeSpec(num_experts=num_experts(config, 1), top_k=config.get("moe_topk", 1),
                  expert_size=spec.intermediate_size, layers=(True,) * spec.num_layers, hidden_act=spec.hidden_act,
                  router="gate.wg", norm_topk=True, shared="shared_mlp", shared_size=spec.intermediate_size)
    return replace(spec, moe=moe)


def first_dense_layers(config: dict, num_layers: int) -> tuple[bool, ...]:
    """DeepSeek's schedule: the first first_k_dense_replace layers dense, the others sparse."""
    dense = config.get("first_k_dense_replace") or 0
    return tuple(i >= dense for i in range(num_layers))


def deepseek_moe(config: dict, spec: DecoderSpec, *, scoring: str = "sigmoid", selection_bias: bool = True,
                 group_score: str = "top2_sum", norm_default: bool = True) -> MoeSpec:
    """DeepSeek-V3's router (also GLM-4.5, dots.llm1): sigmoid scores, an e_score_correction_bias buffer added for
    choosing only, the topk_group best of n_group expert groups eligible, chosen scores renormalised (+1e-20) and
    scaled by routed_scaling_factor; n_shared_experts always-on experts of moe_intermediate_size each."""
    size = config.get("moe_intermediate_size", 1408)
    shared = config.get("n_shared_experts") or 0
    return MoeSpec(num_experts=num_experts(config, 256), top_k=config.get("num_experts_per_tok") or 8,
                   expert_size=size, layers=first_dense_layers(config, spec.num_layers), hidden_act=spec.hidden_act,
                   scoring=scoring, selection_bias="gate.e_score_correction_bias" if selection_bias else None,
                   num_groups=config.get("n_group") or 1, topk_groups=config.get("topk_group") or 1,
                   group_score=group_score, norm_topk=bool(config.get("norm_topk_prob", norm_default)), norm_eps=1e-20,
                   routed_scale=float(config.get("routed_scaling_factor") or 1.0),
                   shared="shared_experts" if shared else None, shared_size=size * shared)


@architecture("deepseek_v3", norm="rms", llama_layout=True, status="verified",
              notes="MLA + grouped-sigmoid MoE",
              aliases=[
                  "glm4_moe_lite",  # GLM-4.7-Flash-style MLA+MoE; defaults normalized onto DeepSeek-V3 contract
                  "deepseek_v32",  # DeepSeek-V3.2: DeepSeek-V3 contract plus DSA indexer attached by package loader
                  "kimi_k2",  # normalized to deepseek_v3
                  "glm_moe_dsa",  # GLM-5 MoE-DSA: normalized to deepseek_v32 then DeepSeek-V3 contract
              ])
def deepseek_v3(config: dict) -> DecoderSpec:
    """DeepSeek-V2's multi-head latent attention (rope_interleave) with DeepSeek-V3's sigmoid router after the first
    first_k_dense_replace dense layers. Configs of its aliases deepseek_v32 / glm_moe_dsa (or with index_topk) add
    the DSA indexer: deepseek_v32()."""
    _refuse_training_extras("deepseek_v3", config)
    if config.get("model_type") in DSA_MODEL_TYPES or "index_topk" in config:
        return deepseek_v32(config)
    spec = with_mla(llama(config), config)
    spec = replace(spec,
                   positions=replace(spec.positions, rope_interleaved=config.get("rope_interleave", True) is not False))
    return replace(spec, moe=deepseek_moe(config, spec))


DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")


def dsa_indexer_types(config: dict, num_layers: int) -> list[str]:
    """GLM-5's per-layer indexer modes ("full" runs the indexer, "shared" reuses the previous layer's selection):
    indexer_types, else index_topk_pattern ("FSS..."), else every index_topk_freq-th layer from
    index_skip_topk_offset - 1 (transformers' GlmMoeDsaConfig). DeepSeek-V3.2: every layer full."""
    if config.get("model_type") not in ("glm_moe_dsa", "glm5_next_text"):
        return ["full"] * num_layers
    if config.get("indexer_types"):
        return list(config["indexer_types"])
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(config.get("index_topk_freq", 1), 1), config.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def deepseek_v32(config: dict) -> DecoderSpec:
    """DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa), aliases of deepseek_v3: its MLA (always with a q LoRA,
    interleaved rotary) plus the DSA indexer of axk2.py (each query attends to its index_topk best keys) with
    A.X-K2's gates off. GLM-5's indexer rotates interleaved pairs, and its "shared" layers reuse the previous layer's
    selection. Sparse layers from mlp_layer_types (default: the first first_k_dense_replace, 3, dense)."""
    arch = config.get("model_type") or "deepseek_v32"
    refuse(arch, config, "q_lora_rank", lambda v: bool(v) and v > 0, 1536)  # the indexer reads the q LoRA
    spec = with_mla(llama(config), config)
    spec = spec.amend("positions", rope_interleaved=True).amend("mla", norm_eps=1e-6)  # q_a / kv_a: RMSNorm's eps
    n, dense = spec.num_layers, config.get("first_k_dense_replace", 3)
    types = config.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(n)]
    indexer = dsa_indexer_types(config, n)
    refuse(arch, config, "indexer_types", lambda v: indexer[0] == "full" and set(indexer) <= {"full", "shared"},
           indexer)  # a shared layer needs a full one before it
    glm = arch == "glm_moe_dsa"
    attention = Axk2Attention(index_topk=config.get("index_topk", 2048),
                              index_heads=config.get("index_n_heads", 32 if glm else 64),
                              index_dim=config.get("index_head_dim", 128), index_rope_interleaved=glm,
                              shared_index=tuple(t == "shared" for t in indexer))
    moe = replace(deepseek_moe(config, spec), layers=tuple(t == "sparse" for t in types))
    return replace(spec, moe=moe, make_layer=attention)


@architecture("glm5_next_text", norm="rms", llama_layout=True, status="verified",
              notes=("native KV-cache generation; KDA linear attention + DSA sparse attention + mHC (parsed via "
                     "DeepSeek-V3.2 contract; composed from engine ops, glm5_next.py)"),
              model_class="vkformers_moe.model:Glm5NextForCausalLM",
              aliases=[
                  "glm5_next",  # wrapper; text_config
              ])
def glm5_next_text(config: dict) -> DecoderSpec:
    """GLM-5.3-Flash's text decoder (glm5_next.py): hc_mult hyper-connected streams (DeepSeek-V4's, collapsed by their
    mean), layer_types "linear_attention" Kimi Delta Attention (linear_* sizes, linear_attn_config) and
    "indexed_attention" NoPE MLA with a pooled DSA indexer (index_kpool; indexer_types "shared" layers reuse the
    previous layer's choice); clipped SwiGLU (swiglu_limit) in dense MLPs, experts and shared experts; DeepSeek-V3's
    router on the mlp_layer_types "sparse" layers."""
    arch = "glm5_next_text"
    _refuse_training_extras(arch, config)
    refuse(arch, config, "qk_rope_head_dim", lambda v: not v, 0)  # transformers requires NoPE here
    refuse(arch, config, "hidden_act", lambda v: v == "silu", "silu")  # the experts' clipped SwiGLU is silu's
    refuse(arch, config, "q_lora_rank", lambda v: bool(v), 1536)  # the indexer reads the q LoRA
    n = config.get("num_hidden_layers", 45)
    types = ["indexed_attention" if t == "full_attention" else t for t in config.get("layer_types") or
             ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]]
    mlp_types = config.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
    indexer = dsa_indexer_types(config, n)
    linear = tuple(t == "linear_attention" for t in types)
    # transformers hands a shared layer the choice of the layer right before it, which must run its indexer
    refuse(arch, config, "indexer_types", lambda v: all(
        indexer[i] == "full" or (not linear[i] and i and not linear[i - 1] and indexer[i - 1] == "full")
        for i in range(n)), indexer)
    lin = config.get("linear_attn_config") or {}
    lower = lin.get("gate_lower_bound", config.get("linear_lower_bound", -5.0))
    if lower is None and lin.get("safe_gate", bool(lin)):
        lower = -5.0
    heads, dim = lin.get("num_heads", config.get("linear_num_heads", 64)), lin.get("head_dim",
                                                                                   config.get("linear_head_dim", 128))
    spec = with_mla(llama(dict(config, head_dim=None)), config)
    linear_attention = LinearAttentionSpec(
        layers=linear, path="self_attn", k_heads=heads, v_heads=heads, k_dim=dim, v_dim=dim, split_projections=True,
        conv_kernel=lin.get("short_conv_kernel_size", config.get("linear_conv_kernel_dim", 4)),
        module=lambda s: KimiDeltaAttention(s, lower_bound=lower))
    spec = replace(spec, positions=replace(spec.positions, rope=False), linear_attention=linear_attention)
    layers = Glm5NextLayers(
        index_topk=config.get("index_topk", 2048), index_heads=config.get("index_n_heads", 32),
        index_dim=config.get("index_head_dim", 128),
        shared_index=tuple(lin_i or t == "shared" for lin_i, t in zip(linear, indexer)),  # linear: no indexer
        kpool=config.get("index_kpool", 16), kpool_tail=bool(config.get("index_kpool_always_select_tail", True)),
        swiglu_limit=float(config.get("swiglu_limit", 10.0)), hc_mult=config.get("hc_mult", 4),
        sinkhorn_iters=config.get("hc_sinkhorn_iters", 20), hc_eps=float(config.get("hc_eps", 1e-6)))
    moe = replace(deepseek_moe(config, spec), layers=tuple(t == "sparse" for t in mlp_types))
    return replace(spec, moe=moe, make_layer=layers)


@architecture("kimi_linear", norm="rms", llama_layout=True, status="verified",
              notes="Kimi Delta Attention (glm5_next.py's, decay -exp(A_log) softplus) and MLA without rotary; "
                    "DeepSeek-V3's router in block_sparse_moe")
def kimi_linear(config: dict) -> DecoderSpec:
    """Kimi Linear: layer_types "linear_attention" Kimi Delta Attention (linear_attn_config or linear_* sizes; the
    decay without a lower bound, A_log stored [1, 1, heads, 1]) and "full_attention" MLA whose shared key part is
    not rotated; mlp_layer_types "sparse" layers a DeepSeek-V3 router over SwiGLU experts (w1, w3, w2) with shared
    experts, under block_sparse_moe, where transformers also saves the dense MLPs (kimi_linear.py)."""
    arch = "kimi_linear"
    # the config's own spellings (KimiLinearConfig.attribute_map), which transformers saves
    for ours, saved in (("max_position_embeddings", "model_max_length"), ("norm_topk_prob", "moe_renormalize"),
                        ("n_group", "num_expert_group"), ("num_experts_per_tok", "num_experts_per_token"),
                        ("n_shared_experts", "num_shared_experts")):
        if saved in config and ours not in config:
            config = dict(config, **{ours: config[saved]})
    _refuse_training_extras(arch, config)
    heads = config.get("num_attention_heads", 32)
    # the MLA's kv_b_proj gives every query head its own key and value
    refuse(arch, config, "num_key_value_heads", lambda v: v in (None, heads), heads)
    n = config.get("num_hidden_layers", 27)
    lin = config.get("linear_attn_config") or {}
    types = config.get("layer_types")
    if types is None and "full_attn_layers" in lin and "kda_layers" in lin:  # 1-based in the released configs
        full = {i - 1 for i in lin["full_attn_layers"]}
        types = ["full_attention" if i in full else "linear_attention" for i in range(n)]
    types = types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    mlp_types = config.get("mlp_layer_types") or ["dense" if i < config.get("first_k_dense_replace", 1) else "sparse"
                                                  for i in range(n)]
    linear_heads = lin.get("num_heads", config.get("linear_num_heads", 32))
    dim = lin.get("head_dim", config.get("linear_head_dim", 128))
    config = dict(config, head_dim=None, rms_norm_eps=config.get("rms_norm_eps", 1e-5),
                  v_head_dim=config.get("v_head_dim") or 128, qk_nope_head_dim=config.get("qk_nope_head_dim", 128),
                  qk_rope_head_dim=config.get("qk_rope_head_dim", 64), kv_lora_rank=config.get("kv_lora_rank", 512))
    spec = with_mla(llama(config), config)
    linear_attention = LinearAttentionSpec(
        layers=tuple(t == "linear_attention" for t in types), path="self_attn", k_heads=linear_heads,
        v_heads=linear_heads, k_dim=dim, v_dim=dim, split_projections=True,
        conv_kernel=lin.get("short_conv_kernel_size", config.get("linear_conv_kernel_dim", 4)),
        module=lambda s: KimiDeltaAttention(s, lower_bound=None, a_log_shape=(1, 1, linear_heads, 1)))
    moe = replace(deepseek_moe(config, spec), layers=tuple(t == "sparse" for t in mlp_types), path="block_sparse_moe",
                  expert_names=("w1", "w3", "w2"), shared_names=("gate_proj", "up_proj", "down_proj"))
    # KimiLinearForCausalLM ties nothing (its _tied_weights_keys is empty), whatever tie_word_embeddings says
    return replace(spec, positions=replace(spec.positions, rope=False), linear_attention=linear_attention, moe=moe,
                   tie_embeddings=False,
                   mla=replace(spec.mla, norm_eps=1e-6), mlp=replace(spec.mlp, path="block_sparse_moe"),
                   make_layer=kimi_linear_layer)


@architecture("axk1", norm="rms", llama_layout=True, status="verified",
              notes="DeepSeek-V3-derived (MLA)")
def axk1(config: dict) -> DecoderSpec:
    """A.X-K1: DeepSeek-V3 (MLA with a q LoRA, grouped sigmoid router, shared experts) whose sparse layers
    (mlp_layer_types) end in an RMSNorm on the block's output, saved beside it as layers.<i>.post_mlp_layernorm."""
    _refuse_training_extras("axk1", config)
    spec = with_mla(llama(config), config)
    spec = replace(spec,
                   positions=replace(spec.positions, rope_interleaved=config.get("rope_interleave", True) is not False))
    n = spec.num_layers
    types = config.get("mlp_layer_types") or ["sparse" if i >= 1 else "dense" for i in range(n)]
    moe = replace(deepseek_moe(config, spec), layers=tuple(t == "sparse" for t in types),
                  output_norm="post_mlp_layernorm")
    return replace(spec, moe=moe)


@architecture("axk2", norm="rms", llama_layout=True, status="verified",
              notes="DeepSeek-V3.2-derived (MLA + DSA)")
def axk2(config: dict) -> DecoderSpec:
    """A.X-K2 (axk2.py): DeepSeek-V3.2's MLA with the DSA indexer (each query attends to its index_topk best keys),
    a fused query/gate projection (q_b_proj) whose sigmoid gate scales the attention output, and gated RMS norms
    (input_layernorm; post_attention_layernorm of the sparse layers). Sparse layers (mlp_layer_types): DeepSeek-V3's
    router (groups only when n_group is set), shared experts."""
    _refuse_training_extras("axk2", config)
    refuse("axk2", config, "q_lora_rank", lambda v: bool(v) and v > 0, 384)  # the indexer and gate read the q LoRA
    spec = with_mla(llama(config), config)
    spec = spec.amend("positions", rope_interleaved=True).amend("mla", norm_eps=1e-6)  # q_a / kv_a: AXK2RMSNorm's eps
    n = spec.num_layers
    types = config.get("mlp_layer_types") or ["sparse" if i >= 1 else "dense" for i in range(n)]
    moe = replace(deepseek_moe(config, spec), layers=tuple(t == "sparse" for t in types))
    attention = Axk2Attention(index_topk=config.get("index_topk", 2048), index_heads=config.get("index_n_heads", 16),
                              index_dim=config.get("index_head_dim", 128), gate_rank=config.get("gated_norm_rank", 16))
    return replace(spec, moe=moe, make_layer=attention)


DOTS3_LAYER_SIZES = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "head_dim", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim")


@architecture("dots3_note_text", norm="rms", llama_layout=True, status="verified",
              model_class="vkformers_moe.model:Dots3NoteForCausalLM",
              notes="DeepSeek-V3.2 MLA with per-layer sizes and rotary, a rope-only key norm, scaled LoRA latents, a "
                    "per-head output gate; GLM-5's DSA indexer on indexed layers, sliding windows on the others "
                    "(dots3.py)")
def dots3_note_text(config: dict) -> DecoderSpec:
    """dots3-note's text decoder (vkformers_moe.dots3): layer_types "indexed_attention" (DSA), "sliding_attention"
    or "full_attention", each layer's MLA sizes from per_layer_config over the config's own; DeepSeek-V3's grouped
    sigmoid router on mlp_layer_types' sparse layers, shared experts of shared_experts_intermediate_size each."""
    _refuse_training_extras("dots3_note_text", config)
    n = config["num_hidden_layers"]
    types = config.get("layer_types") or ["indexed_attention" if i < 2 or i % 4 == 1 else "sliding_attention"
                                          for i in range(n)]
    refuse("dots3_note_text", config, "layer_types",
           lambda v: set(types) <= {"indexed_attention", "sliding_attention", "full_attention"}, types)
    per_layer = {int(i): values for i, values in (config.get("per_layer_config") or {}).items()}
    hidden, base = config["hidden_size"], llama(config)
    specs, scales, q_scales, widths = [], [], [], []
    for i, layer_type in enumerate(types):
        sizes = dict(config, **{k: v for k, v in per_layer.get(i, {}).items() if k in DOTS3_LAYER_SIZES})
        refuse("dots3_note_text", sizes, "q_lora_rank", lambda v: bool(v) and v > 0)  # the indexer reads the q LoRA
        heads = sizes["num_attention_heads"]
        layer = with_mla(replace(base, num_heads=heads, num_kv_heads=heads), sizes)
        rope = (dict(config, head_dim=sizes.get("head_dim") or sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]),
                layer_type)
        layer = replace(layer, positions=replace(layer.positions, rope_configs=(rope,) * n),
                        mla=replace(layer.mla, kv_scale=(hidden / sizes["kv_lora_rank"]) ** 0.5,
                                    rope_key_norm="k_rope_only_layernorm"))
        specs.append(layer)
        scales.append((layer.mla.nope_dim + layer.mla.rope_dim) ** -0.5)
        q_scales.append((hidden / sizes["q_lora_rank"]) ** 0.5)
        widths.append(heads * max(layer.mla.nope_dim + layer.mla.rope_dim, layer.mla.v_dim))
    window = config.get("sliding_window") or 0
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    mlp_types = config.get("mlp_layer_types") or ["dense" if i < 1 else "sparse" for i in range(n)]
    moe = replace(deepseek_moe(config, base), layers=tuple(t == "sparse" for t in mlp_types),
                  shared_size=config.get("shared_experts_intermediate_size", 1536) * (config.get("n_shared_experts") or 0))
    attention = Dots3Attention(
        index_topk=config.get("index_topk", 2048), index_heads=config.get("index_n_heads", 64),
        index_dim=config.get("index_head_dim", 128), index_rope_interleaved=True,
        shared_index=tuple(t != "indexed_attention" for t in types),  # no indexer of their own
        indexed=tuple(t == "indexed_attention" for t in types), q_scales=tuple(q_scales), cache_width=max(widths),
        layer_specs=tuple(replace(layer, moe=moe, attention=replace(layer.attention, scales=tuple(scales),
                                                                    windows=windows))
                          for layer in specs))
    first = specs[0]
    return replace(first, moe=moe, make_layer=attention,
                   attention=replace(first.attention, scales=tuple(scales), windows=windows),
                   positions=replace(first.positions, rope_configs=tuple(layer.positions.rope_configs[0]
                                                                         for layer in specs)))


@architecture("glm4_moe", norm="rms", llama_layout=True, status="verified",
              aliases=[
                  "glm4v_moe_text",  # GLM-4.5V text; mRoPE reduced
                  "glm4v_moe",  # multimodal wrapper; text_config parsed as glm4v_moe_text
              ])
def glm4_moe(config: dict) -> DecoderSpec:
    """GLM-4.5: Llama attention with q/k/v biases (attention_bias), optional per-head q/k RMSNorm (use_qk_norm),
    rotate_half partial rotary (0.5 by default), and DeepSeek-V3's router after first_k_dense_replace dense layers."""
    _refuse_training_extras("glm4_moe", config)
    bias = bool(config.get("attention_bias", False))
    qk_norm = bool(config.get("use_qk_norm", False))
    spec = llama(dict(config, attention_bias=False))
    spec = replace(spec,
                   attention=replace(spec.attention, q_bias=bias, k_bias=bias, v_bias=bias,
                                     q_norm="q_norm" if qk_norm else None, k_norm="k_norm" if qk_norm else None))
    return replace(spec, moe=deepseek_moe(config, spec))


def _sarvam_names(config: dict) -> dict:
    """Sarvam's own config names for the expert counts (transformers' attribute_map)."""
    return dict(config, n_routed_experts=first_of(config, "n_routed_experts", "num_experts", "num_local_experts"),
                n_shared_experts=first_of(config, "n_shared_experts", "num_shared_experts"))


@architecture("sarvam_moe", norm="rms", llama_layout=True, status="verified")
def sarvam_moe(config: dict) -> DecoderSpec:
    """Sarvam-30B: GLM-4.5 (transformers runs it as Glm4MoeForCausalLM) with q/k RMSNorm on and rotary over the whole
    head by default, under Sarvam's checkpoint names, which transformers' conversion maps to GLM's: one fused
    [q | k | v] attention.query_key_value, attention.dense, query_ / key_layernorm, model.word_embeddings and the
    router's selection bias mlp.gate.expert_bias."""
    config = dict(_sarvam_names(config), use_qk_norm=config.get("use_qk_norm", True),
                  attention_bias=first_of(config, "attention_bias", "use_qkv_bias", default=False))
    spec = glm4_moe(config)
    a = spec.attention
    return replace(spec, embed="model.word_embeddings",
                   attention=replace(a, path="attention", qkv_proj="query_key_value", o_proj="dense",
                                     q_norm=a.q_norm and "query_layernorm", k_norm=a.k_norm and "key_layernorm"),
                   moe=replace(spec.moe, selection_bias="gate.expert_bias"))


@architecture("sarvam_mla", norm="rms", llama_layout=True, status="verified")
def sarvam_mla(config: dict) -> DecoderSpec:
    """Sarvam-105B: DeepSeek-V3 (transformers runs it as DeepseekV3ForCausalLM); its original configs spell the
    expert counts num_experts / num_shared_experts and YaRN as rope_scaling type deepseek_yarn."""
    config = _sarvam_names(config)
    rope = config.get("rope_scaling") or {}
    if not config.get("rope_parameters") and "deepseek_yarn" in (rope.get("type"), rope.get("rope_type")):
        config = dict(config, rope_scaling=None,
                      rope_parameters={k: v for k, v in rope.items() if k != "type"} | {"rope_type": "yarn"})
    return deepseek_v3(config)


@architecture("dots1", norm="rms", llama_layout=True, status="verified",
              notes="Qwen3-style attention")
def dots1(config: dict) -> DecoderSpec:
    """dots.llm1: Qwen3 attention (per-head q/k RMSNorm, per-layer sliding windows) with DeepSeek-V3's router after
    first_k_dense_replace dense layers (norm_topk_prob off by default)."""
    _refuse_training_extras("dots1", config)
    spec = qwen3(config)
    return replace(spec, moe=deepseek_moe(config, spec, norm_default=False))


# -- decoders whose config may make every layer dense: the dense parent's spec alone then (fixtures *_dense), with the
#    sparse block on the sparse layers otherwise (fixtures *_moe)

def _with_moe(arch: str, config: dict, spec: DecoderSpec, sparse: bool,
              sparse_block: Callable[[dict, DecoderSpec], MoeSpec]) -> DecoderSpec:
    """``spec`` with the block ``sparse_block(config, spec)`` in its sparse layers when it has any, else ``spec``."""
    if not sparse:
        return spec
    _refuse_training_extras(arch, config)
    return replace(spec, moe=sparse_block(config, spec))


def _has_sparse_mlp_layers(config: dict, num_layers: int) -> bool:
    """mlp_layer_types (default: the first layer dense, the others mixture-of-experts) names a sparse layer."""
    types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
    return any(t != "dense" for t in types)


def _mlp_layer_types(config: dict, num_layers: int) -> tuple[bool, ...]:
    """mlp_layer_types (default: the first layer dense, the others sparse)."""
    types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
    return tuple(t == "sparse" for t in types)


@architecture("hy_v3", norm="rms", llama_layout=True, status="verified")
def hy_v3(config: dict) -> DecoderSpec:
    """Hunyuan V3: Llama with per-head q/k RMSNorm before the rotation; sparse layers from mlp_layer_types."""
    spec = llama(config)
    spec = replace(spec, attention=replace(spec.attention, q_norm="q_norm", k_norm="k_norm"))
    return _with_moe("hy_v3", config, spec, _has_sparse_mlp_layers(config, spec.num_layers), _hy_v3_moe)


def _hy_v3_moe(config: dict, spec: DecoderSpec) -> MoeSpec:
    """Hunyuan V3: sigmoid router mlp.router.gate with the buffer mlp.expert_bias added for choosing, chosen scores
    renormalised (+1e-20) and scaled by router_scaling_factor; always-on shared_mlp (moe_intermediate_size *
    num_shared_experts); sparse layers from mlp_layer_types."""
    size, shared = config.get("moe_intermediate_size", 1536), config.get("num_shared_experts") or 0
    return MoeSpec(num_experts=num_experts(config, 192), top_k=config.get("num_experts_per_tok") or 8,
                   expert_size=size, layers=_mlp_layer_types(config, spec.num_layers), hidden_act=spec.hidden_act,
                   router="router.gate", scoring="sigmoid", selection_bias="expert_bias", norm_topk=True,
                   norm_eps=1e-20, routed_scale=float(config.get("router_scaling_factor", 2.826)),
                   shared="shared_mlp" if shared else None, shared_size=size * shared)


@architecture("laguna", norm="rms", llama_layout=True, status="verified")
def laguna(config: dict) -> DecoderSpec:
    """Laguna (sparse layers from mlp_layer_types): per-head q/k RMSNorm, a softplus output gate (g_proj) per head or
    per channel, per-layer query head counts, per-layer sliding windows and a rope dict (with partial rotary) per
    layer type."""
    refuse("laguna", config, "gating", lambda v: v in (None, True, "per-head", "per-element"))
    spec = llama(config)
    types = layer_types(config, spec.num_layers)
    heads = config.get("num_attention_heads_per_layer")
    params = config.get("rope_parameters")
    ropes = tuple((config, t) for t in types) if params and all(isinstance(v, dict) for v in params.values()) else ()
    spec = replace(spec,
                   attention=replace(spec.attention, q_norm="q_norm", k_norm="k_norm", output_gate="g_proj",
                                     output_gate_per_head=config.get("gating", True) != "per-element",
                                     heads_per_layer=tuple(heads) if heads else (),
                                     windows=sliding_windows(config, spec.num_layers, every_layer=False)),
                   positions=replace(spec.positions, rope_configs=ropes))
    return _with_moe("laguna", config, spec, _has_sparse_mlp_layers(config, spec.num_layers), _laguna_moe)


def _laguna_moe(config: dict, spec: DecoderSpec) -> MoeSpec:
    """Laguna: optionally soft-capped sigmoid router, a trained (gradient-free) selection bias saved as
    experts.e_score_correction_bias, chosen scores renormalised and scaled by moe_routed_scaling_factor; an always-on
    shared expert (shared_expert_intermediate_size); sparse layers from mlp_layer_types."""
    refuse("laguna", config, "moe_apply_router_weight_on_input", lambda v: not v)
    return MoeSpec(num_experts=num_experts(config, 256), top_k=config.get("num_experts_per_tok") or 8,
                   expert_size=config.get("moe_intermediate_size", 512),
                   layers=_mlp_layer_types(config, spec.num_layers), hidden_act=spec.hidden_act,
                   router_softcap=float(config.get("moe_router_logit_softcapping") or 0.0), scoring="sigmoid",
                   selection_bias="experts.e_score_correction_bias", selection_bias_is_parameter=True, norm_topk=True,
                   routed_scale=float(config.get("moe_routed_scaling_factor", 1.0)), shared="shared_expert",
                   shared_size=config.get("shared_expert_intermediate_size", 512))


@architecture("deepseek_v2", norm="rms", llama_layout=True, status="verified",
              notes="MLA")
def deepseek_v2(config: dict) -> DecoderSpec:
    """Llama block with MLA; mixture-of-experts MLPs from layer first_k_dense_replace on."""
    spec = with_mla(llama(config), config)
    dense = config.get("first_k_dense_replace", 0)
    sparse = bool(config.get("n_routed_experts") or 0) and dense < spec.num_layers
    return _with_moe("deepseek_v2", config, spec, sparse, _deepseek_v2_moe)


def _deepseek_v2_moe(config: dict, spec: DecoderSpec) -> MoeSpec:
    """DeepSeek-V2: softmax scores, greedy top-k or group_limited_greedy (the topk_group groups with the largest
    maximum eligible), chosen scores scaled by routed_scaling_factor, not renormalised."""
    method = config.get("topk_method") or "greedy"
    refuse("deepseek_v2", config, "topk_method", lambda v: (v or "greedy") in ("greedy", "group_limited_greedy"))
    # transformers 5.24 never renormalises DeepSeek-V2's weights; a config asking for it would be ambiguous
    refuse("deepseek_v2", config, "norm_topk_prob", lambda v: not v)
    grouped = method == "group_limited_greedy"
    return replace(deepseek_moe(config, spec, scoring="softmax", selection_bias=False, group_score="max"),
                   num_groups=(config.get("n_group") or 1) if grouped else 1,
                   topk_groups=(config.get("topk_group") or 1) if grouped else 1, norm_topk=False)


@architecture("mistral4", norm="rms", llama_layout=True, status="verified",
              notes="native KV-cache generation; upstream claims 2-step AdamW parity")
def mistral4(config: dict) -> DecoderSpec:
    """Mistral 4: MLA whose rotary dims come from rope_parameters.partial_rotary_factor of head_dim (nope + rope),
    optional interleaving (rope_interleave) and Llama-4 query scaling by position; mixture-of-experts MLPs from
    layer first_k_dense_replace on."""
    spec = llama(config)
    dense = config.get("first_k_dense_replace") or 0
    sparse = bool(config.get("n_routed_experts") or 0) and dense < spec.num_layers
    spec = with_mla(spec, config)
    params = config.get("rope_parameters") or {}
    rope_config = dict(config, head_dim=spec.head_dim)
    if "partial_rotary_factor" not in params:  # transformers' default: the rotary share of the qk head
        rope_config["rope_parameters"] = dict(params, partial_rotary_factor=spec.mla.rope_dim / spec.head_dim)
    spec = replace(spec,
                   positions=replace(spec.positions, rope_interleaved=config.get("rope_interleave", True) is not False,
                                     rope_configs=((rope_config, None),) * spec.num_layers))
    beta = params.get("llama_4_scaling_beta")
    if beta:
        spec = spec.amend("positions", query_scale=(float(beta), int(params["original_max_position_embeddings"])))
    return _with_moe("mistral4", config, spec, sparse, _mistral4_moe)


def _mistral4_moe(config: dict, spec: DecoderSpec) -> MoeSpec:
    """Mistral 4: DeepSeek-V3's grouped choice (top-2 sums) on softmax scores, no selection bias; experts stored fused
    as transformers saves them (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    return replace(deepseek_moe(config, spec, scoring="softmax", selection_bias=False),
                   fused_experts=("gate_up_proj", "down_proj"))


def _gemma4_layer_sizes(config: dict, types: list[str], k_eq_v: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per layer (head_dim, KV heads): per_layer_config's overrides (saved by transformers), else the full-attention
    layers' global_head_dim and, with attention_k_eq_v, num_global_key_value_heads."""
    head_dim, kv_heads = config.get("head_dim", 256), config.get("num_key_value_heads", 4)
    per_layer = config.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": config.get("global_head_dim", 512)}
        if k_eq_v and config.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        per_layer = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
    overrides = [dict(per_layer.get(str(i)) or per_layer.get(i) or {}) for i in range(len(types))]
    for i, layer in enumerate(overrides):
        unknown = set(layer) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UnsupportedConfigError(f"{config.get('model_type', 'gemma4_text')}: per_layer_config of layer {i} sets {sorted(unknown)}, which "
                                         "vkformers' decoder does not vary per layer")
    return (tuple(int(o.get("head_dim", head_dim)) for o in overrides),
            tuple(int(o.get("num_key_value_heads", kv_heads)) for o in overrides))


@architecture("gemma4_text", norm="rms", llama_layout=True, status="verified",
              model_class="vkformers_moe.model:Gemma4ForCausalLM",
              notes="per-layer inputs, per-layer head sizes, KV sharing across layers, attention_k_eq_v, a MoE block "
                    "beside the MLP (gemma4.py)")
def gemma4_text(config: dict) -> DecoderSpec:
    """Gemma 3's attention layers (sliding / full by layer_types, q/k norms, sandwich norms, soft-capped logits) with
    plain-weight RMS norms, a weightless value norm and scale 1, in Gemma 4's layer (vkformers_moe.gemma4): per-layer
    head sizes (per_layer_config), values from the key projection on full layers (attention_k_eq_v), proportional
    rotary there, KV sharing in the last num_kv_shared_layers layers (Gemma 3n's), per-layer inputs, a MoE block
    beside the MLP (enable_moe_block) and each layer's layer_scalar."""
    arch = config.get("model_type", "gemma4_text")
    # "vision" makes only image tokens attend both ways: text alone is causal
    refuse(arch, config, "use_bidirectional_attention", lambda v: v in (None, "vision"))
    _refuse_training_extras(arch, config)
    n = config.get("num_hidden_layers", 30)
    types = list(config.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                               for i in range(n)])
    types[-1] = "full_attention"  # as transformers forces
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    head_dims, kv_heads = _gemma4_layer_sizes(config, types, k_eq_v)
    rope = config.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    config = dict(config, layer_types=types, rope_parameters=rope, head_dim=config.get("head_dim", 256),
                  num_key_value_heads=config.get("num_key_value_heads", 4),
                  sliding_window=config.get("sliding_window", 512),
                  hidden_size_per_layer_input=config.get("hidden_size_per_layer_input", 256))
    spec = gemma3_text(config)
    if max(kv_heads) % min(kv_heads) or spec.num_heads % max(kv_heads) or any(max(kv_heads) % h for h in kv_heads):
        raise UnsupportedConfigError(f"{arch}: KV heads per layer {sorted(set(kv_heads))} must divide each "
                                     f"other and num_attention_heads {spec.num_heads}")
    sized = {}  # one rotary config per (layer type, head size): layers sharing one share their tables
    ropes = tuple((sized.setdefault((t, d), dict(config, head_dim=d)), t) for t, d in zip(types, head_dims))
    experts = None
    if config.get("enable_moe_block"):
        experts = MoeSpec(num_experts=config["num_experts"], top_k=config["top_k_experts"],
                          expert_size=config["moe_intermediate_size"], layers=(True,) * n, hidden_act=spec.hidden_act,
                          router="router.proj", experts="experts", fused_experts=("gate_up_proj", "down_proj"),
                          norm_topk=True)
    width = config.get("hidden_size_per_layer_input") or 0
    layers = Gemma4Layers(
        layer_types=tuple(types), head_dims=head_dims, kv_heads=kv_heads, k_eq_v=k_eq_v,
        kv_sources=shared_kv_sources(arch, types, int(config.get("num_kv_shared_layers", 0))),
        per_layer_width=int(width), double_wide_mlp=bool(config.get("use_double_wide_mlp", False)), experts=experts)
    return replace(spec, norms=replace(spec.norms, unit_offset=False), make_layer=layers,
                   attention=replace(spec.attention, scales=(1.0,) * spec.num_layers),
                   positions=replace(spec.positions, rope_configs=ropes),
                   extra=dict(spec.extra, per_layer_vocab=int(config.get("vocab_size_per_layer_input", 262144))))



@architecture("gemma4_unified_text", norm="rms", llama_layout=True, status="verified",
              model_class="vkformers_moe.model:Gemma4ForCausalLM",
              notes="Gemma 4's layers without per-layer inputs or the MoE block")
def gemma4_unified_text(config: dict) -> DecoderSpec:
    """gemma4_text without per-layer inputs or the MoE block, its config's own defaults (a window of 1024)."""
    refuse("gemma4_unified_text", config, "enable_moe_block", lambda v: not v)
    refuse("gemma4_unified_text", config, "hidden_size_per_layer_input", lambda v: not v)
    return gemma4_text(dict(config, hidden_size_per_layer_input=0, sliding_window=config.get("sliding_window", 1024)))

# Spellings whose backbone is the model_type of a nested config (multimodal wrappers): they run as
# whatever architecture that names.
FAMILY.wrappers({
    "qwen3_omni_moe_thinker": NESTED_TEXT_CONFIG,  # typically qwen3_omni_moe_text -> qwen3_moe
    "qwen3_omni_moe":         NestedConfig(("thinker_config", "text_config")),  # resolves thinker_config.text_config dynamically; typically qwen3_omni_moe_text -> qwen3_moe
    "glm46v":                 NESTED_TEXT_CONFIG,  # explicit dispatcher arm
    "kimi_k25":               NESTED_TEXT_CONFIG,  # typically kimi_k2 -> deepseek_v3; upstream claims 2-step AdamW parity
})

# Canonical architecture name -> its variant, from the declarations above.
VARIANTS: dict[str, Callable[[dict], DecoderSpec]] = FAMILY.variants()


def decoder_spec(config: dict, architecture_name: str) -> DecoderSpec:
    """The spec of a config already resolved to ``architecture_name`` (one of this plugin's architectures)."""
    try:
        variant = VARIANTS[architecture_name]
    except KeyError:
        raise UnsupportedConfigError(f"architecture {architecture_name!r} is registered by vkformers-moe but has no "
                                     f"decoder variant yet; implemented: {', '.join(sorted(VARIANTS))}") from None
    return variant(config)
