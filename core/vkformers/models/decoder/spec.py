"""The decoder kit's spec: every option of :class:`DecoderSpec`, and the config readers variants fill it with.

A plugin's variant function reads a Hugging Face config.json into a :class:`DecoderSpec`; the shared
decoder (:mod:`vkformers.models.decoder.model`) builds its layers from it. A config option that changes
the maths but is not implemented raises :class:`UnsupportedConfigError` naming the option.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import numpy as np

from vkformers.errors import VkformersError
from vkformers.models.module import Module


class UnsupportedConfigError(VkformersError, ValueError):
    """A config option of a known architecture that the shared decoder does not implement."""


@dataclass
class NormSpec:
    """The blocks' norms, as :func:`~vkformers.models.decoder.norms.make_norm` builds them."""

    kind: str = "rms"                        # rms | layer
    eps: float = 1e-6
    weight: bool = True                      # False: parameter-free (OLMo)
    bias: bool = False                       # LayerNorm bias
    unit_offset: bool = False                # Gemma: x * (1 + weight); Nemotron's LayerNorm1P: x * (1 + weight) + bias


@dataclass
class PositionSpec:
    """How positions enter: rotary on q and k (per-layer configs and NoPE layers), ALiBi slopes, or an absolute
    position table added to the embeddings; and how positions are counted."""

    rope: bool = True
    rope_interleaved: bool = False           # rotate pairs (2i, 2i+1) (GPT-J, CodeGen, Cohere)
    rope_configs: tuple = ()                 # per layer (config dict, layer_type) for rope_parameters; empty: (config,
    #                                          None)
    rope_layers: tuple[bool, ...] = ()       # per layer: does it rotate (SmolLM3 NoPE, Cohere2 full layers); empty: all
    rope_negated: bool = False               # rotate by -theta (NanoChat's rotate_half is cat(x2, -x1))
    query_scale: tuple[float, int] | None = None  # (beta, L): q *= 1 + beta log(1 + floor(pos / L)) (Llama 4)
    alibi: bool = False
    alibi_kind: str = "bloom"                # bloom | mpt: how the per-head slopes are spaced
    alibi_slope_scale: float = 1.0           # Falcon adds ALiBi before the 1/sqrt(D) scaling
    sinusoidal: str | None = None            # fixed [sin | cos] position table added to the embeddings: fairseq (XGLM)
    #                                          or ctrl; indexed by position + offset
    offset: int = 0                          # OPT: learned table index = position + 2
    from_mask: bool = False                  # OPT: position = cumsum(attention_mask) - 1
    # The positions transformers' generate ends up using: "mask" (the position_ids it passes, cumsum(mask) - 1);
    # TrOCR reads none and counts itself: "index" (learned table: every token at its index, pads included) or
    # "fairseq" (sinusoidal: the prompt's non-pad tokens counted, each later token at its index, pads -1)
    generation: str = "mask"


@dataclass
class AttentionSpec:
    """Softmax attention over q/k/v projections: names relative to ``path`` inside the layer, biases, QK-norm,
    gates, and the per-layer scale and window."""

    path: str = "self_attn"
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    qkv_proj: str | None = None              # one fused projection instead of q/k/v
    qkv_layout: str = "blocks"               # blocks: [q | k | v]; per_head: [H, 3, D]; grouped: [KVH, H/KVH + 2, D];
    #                                          chunks_qvk: [qkv_chunks, (q, v, k), H/qkv_chunks * D] (CodeGen)
    qkv_chunks: int = 1
    q_bias: bool = False
    k_bias: bool = False
    v_bias: bool = False
    o_bias: bool = False
    q_norm: str | None = None                # QK-norm parameter names (inside path)
    k_norm: str | None = None
    qk_norm_after_rope: bool = False         # HunYuan, NanoChat: normalise q/k after the rotation
    qk_norm_scope: str = "head"              # head: each head's D values, one shared weight [D]; full: the whole
    #                                          projection; per_head: weight [heads, D]; per_head_list: norms.<h>
    clip_qkv: float | None = None            # OLMo: clamp q, k, v to [-c, c]
    clip_after_qk_norm: bool = False         # OLMoE: clamp after the whole-projection q/k norm, not before
    q_gate: bool = False                     # q_proj yields [query | gate] per head; output *= sigmoid(gate) (Qwen3.5)
    output_gate: str | None = None           # projection whose softplus scales the attention output before o_proj
    #                                          (Laguna's g_proj)
    output_gate_per_head: bool = True        # one gate per head (broadcast over head_dim), else one per channel
    output_gate_sigmoid: bool = False        # sigmoid instead of softplus (AFMoE's gate_proj)
    sinks: str | None = None                 # per-head learned sink logit: out * sigmoid(lse - sink)
    sub_norm: str | None = None              # on the heads' output before o_proj (BitNet)
    out_bias: str | None = None              # a bias added after o_proj, stored apart (GPT-NeoX-Japanese dense_bias)
    out_bias_layers: tuple[int, ...] = ()    # the layers that have it
    softcap: float = 0.0                     # c tanh(scores / c) (Gemma 2)
    scales: tuple[float, ...] = ()           # per layer softmax scale; empty: 1 / sqrt(head_dim)
    windows: tuple[int, ...] = ()            # per layer sliding window (0: full attention); empty: none
    heads_per_layer: tuple[int, ...] = ()    # query heads of each layer when they differ (Laguna); empty: num_heads
    in_width: int | None = None              # q/k/v input width (and attn_in_norm's) when not hidden_size (Zamba's
    #                                          shared block reads [stream | token embeddings])
    # A query row that sees no key (a left-padded position): what transformers' reference puts there. "zero" (sdpa,
    # sinks; the kernel's own); "all": the mean of every value (eager with an additive dtype-minimum mask, whose
    # softmax over equal scores is uniform); "causal": the mean of the values its causal (and window) mask shows,
    # padding aside (GPT-Neo: the masks stack to -inf outside them); "attended": the mean of the row's unpadded
    # values, later ones included (GPT-1: a -1e4 causal fill under the dtype-minimum padding mask).
    blind_rows: str = "zero"
    blind_rows_score_grad: float = 1.0       # the share of the uniform softmax's gradient its scores keep there: 1
    #                                          (the mask is added), 0 (replaced: MPT's masked_fill), 0.5 (XGLM's
    #                                          clamp at the minimum ties there, and torch splits a tie's gradient)
    module: Callable | None = None           # (spec) -> a plugin's attention module at ``path`` instead of the q/k/v/o
    #                                          projections, called (h, ctx, layer index) -> [B, T, hidden] (JetMoE's
    #                                          mixture of attention heads); it attends through ctx as the layer would


@dataclass
class MLPSpec:
    """The dense MLP: down(act(gate(x)) * up(x)) ("gated") or down(act(up(x))) ("plain"); names relative to
    ``path`` inside the layer."""

    path: str = "mlp"
    kind: str = "gated"                      # gated | plain
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"                 # plain MLPs name their input projection here (fc1, c_fc, ...)
    down_proj: str = "down_proj"
    gate_up_proj: str | None = None          # fused [gate | up] (Phi-3)
    bias: bool = False                       # gate/up and down alike
    sub_norm: str | None = None              # on act(gate) * up before down_proj (BitNet)


class MLPBlocks(Protocol):
    """The decoder's MLP slot (``DecoderSpec.moe``), filled by a plugin: ``block(spec, index)`` gives the Module
    that layer ``index`` runs instead of its dense MLP, or None to keep the dense MLP there. The block is placed at
    its ``path`` inside the layer and called on the normed hidden states [B, T, hidden]; modules it keeps beside
    it in the layer go in its ``layer_modules`` ({path: Module}). Checkpoint buffers that are not parameters reach
    it through ``load_buffers(arrays, prefix)`` when it defines one (any module may; ``saved_buffers(prefix)`` gives
    them back to save_pretrained)."""

    def block(self, spec: DecoderSpec, index: int) -> Module | None: ...


@dataclass
class LinearAttentionSpec:
    """Gated DeltaNet linear attention (:mod:`vkformers.models.decoder.gated_deltanet`) on the layers ``layers``
    marks, in place of softmax attention: its sizes and how its checkpoints lay out the projections."""

    layers: tuple[bool, ...]                 # per layer: linear attention (True) or softmax attention
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4
    path: str = "linear_attn"                # its module, relative to the layer
    grouped_projections: bool = False        # Qwen3-Next: in_proj_qkvz / in_proj_ba laid out per key head ([q k v z] /
    #                                          [b a] of its value heads) instead of in_proj_qkv / _z / _b / _a
    split_projections: bool = False          # OLMo Hybrid: q/k/v/g/b/a_proj, one conv per q/k/v (q_conv1d, ...),
    #                                          o_norm, o_proj
    beta_scale: float = 1.0                  # beta = scale * sigmoid(b) (OLMo Hybrid's allow_neg_eigval: 2)
    norm_eps: float | None = None            # the gated output norm's eps when not the spec's norms.eps (OLMo Hybrid)
    layer_norms: tuple = ()                  # (role, path) pairs: the linear layers' norms where they differ from
    #                                          the attention layers' (OLMo Hybrid: pre-norm linear blocks)
    module: Callable | None = None           # (spec) -> the linear layers' module, instead of GatedDeltaNet (a
    #                                          plugin's variant of it: vkformers-moe's Kimi Delta Attention)


@dataclass
class MLASpec:
    """DeepSeek-V2's multi-head latent attention: q (optionally through a LoRA) and a compressed kv latent, whose
    up-projection gives each head's key (nope part) and value; one rotary key part shared by all heads."""

    kv_lora_rank: int
    nope_dim: int                            # per-head query/key dims without rotary
    rope_dim: int                            # per-head rotary dims (0: NoPE MLA)
    v_dim: int
    q_lora_rank: int | None = None           # None: one q_proj
    q_scale: float = 1.0                     # multiplies the queries (LongCat: sqrt(hidden / q_lora_rank))
    kv_scale: float = 1.0                    # multiplies the normed kv latent (LongCat: sqrt(hidden / kv_lora_rank))
    norm_eps: float | None = None            # q_a / kv_a norms' eps when not the spec's norms.eps (LongCat: 1e-6)
    rope_key_norm: str | None = None         # an RMSNorm on the shared rotary key part before rotary (dots3-note)


@dataclass
class CrossAttentionSpec:
    """Attention over an encoder's states after the self-attention, pre-norm (GPT-2's add_cross_attention: the
    decoder of an encoder-decoder). Queries from ``q_proj``, keys and values from one ``kv_proj`` [k | v] of the
    encoder's states, the self-attention's heads and scales."""

    path: str = "crossattention"
    norm: str = "ln_cross_attn"              # the layer's norm before it
    q_proj: str = "q_attn"
    kv_proj: str = "c_attn"
    o_proj: str = "c_proj"
    bias: bool = True


@dataclass
class DecoderSpec:
    """The shared decoder's configuration: sizes, checkpoint names, numerics, and one sub-spec per part of the
    block. Names are Hugging Face parameter paths."""

    # -- sizes
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 2048

    # -- parameter names (model level: full paths; layer level: relative to the layer)
    embed: str = "model.embed_tokens"
    embed_norm: str | None = None            # BLOOM's word_embeddings_layernorm
    embed_norm_layer_eps: float | None = None  # set: embed_norm is a LayerNorm with weight and bias of this eps,
    #                                          whatever ``norms`` the blocks use (Open-Llama's stable embedding)
    embed_dim: int | None = None             # token-embedding width when it differs from hidden_size (OPT-350m)
    project_in: str | None = None            # embed_dim -> hidden after the embedding, hidden -> embed_dim before lm_head
    project_out: str | None = None
    position_embed: str | None = None        # learned absolute positions (GPT-2 wpe, OPT embed_positions)
    layers: str = "model.layers"
    final_norm: str | None = "model.norm"
    lm_head: str = "lm_head"
    head_transform: str | None = None        # norm(act(dense(x))) between the final norm and lm_head (ModernBERT's
    #                                          prediction head "lm_head", before its "decoder" projection)
    head_transform_bias: bool = False
    head_transform_act: str = "gelu"

    # -- sub-specs: what each part of the block computes (variants change them with replace(...) or amend)
    attention: AttentionSpec = field(default_factory=lambda: AttentionSpec())  # softmax attention over q/k/v heads
    mla: MLASpec | None = None               # DeepSeek-V2 multi-head latent attention instead of q/k/v projections
    linear_attention: LinearAttentionSpec | None = None  # Gated DeltaNet instead of softmax attention on some layers
    positions: PositionSpec = field(default_factory=lambda: PositionSpec())  # rotary, ALiBi or position tables
    norms: NormSpec = field(default_factory=lambda: NormSpec())  # every norm of the blocks (make_norm)
    mlp: MLPSpec = field(default_factory=lambda: MLPSpec())  # the dense MLP (a layer's moe block replaces it)
    moe: MLPBlocks | None = None             # the MLP slot: a plugin's blocks replacing the dense MLP of some layers
    #                                          (vkformers-moe's MoeSpec); None: every layer's MLP is ``mlp``

    # -- where the norms sit (layer-relative names; None: no such norm)
    attn_in_norm: str | None = "input_layernorm"
    attn_in_norm_skipped: tuple[int, ...] = ()  # layers without it (ModernBERT's layer 0 reads the embedding norm)
    attn_out_norm: str | None = None         # on the attention output before the residual (Gemma 2/3, OLMo 2)
    mlp_in_norm: str | None = "post_attention_layernorm"
    mlp_out_norm: str | None = None          # on the MLP output before the residual (Gemma 2/3, OLMo 2)

    # -- numerics
    hidden_act: str = "silu"                 # also "xielu" (Apertus: learned alpha_p / alpha_n under mlp.act_fn)
    lm_head_bias: bool = False
    conv1d: bool = False                     # GPT-2 Conv1D weights, stored [in, out]
    cross_attention: CrossAttentionSpec | None = None  # attention over encoder_hidden_states after the self-attention
    post_norm: bool = False                  # x = norm(x + f(x)) with attn_in_norm / mlp_in_norm (OPT-350m)
    parallel_residual: bool = False          # x + attn(norm(x)) + mlp(norm'(x)); norm' = attn_in_norm when mlp_in_norm is None
    final_softcap: float = 0.0

    # -- scalings
    embed_scale: float = 1.0                 # Gemma sqrt(hidden) (rounded to the model dtype), Granite embedding_multiplier
    embed_scale_in_dtype: bool = False
    residual_scale: float = 1.0              # Granite residual_multiplier
    logits_scale: float = 1.0                # Granite 1 / logits_scaling, Cohere logit_scale
    tie_embeddings: bool = False
    embed_padding_idx: int | None = None     # the token embedding's padding_idx: lookups of it pass no gradient to
    #                                          its row, as transformers builds most families (pad_token_id);
    #                                          GPT-2-era families build it without one (None)
    embed_extra_rows: int = 0                # embedding rows past vocab_size that text never looks up (Mllama: 8)
    shift_labels: bool = True                # False: labels[t] is the target of logits[t] (TrOCRForCausalLM)
    unused_layer_params: tuple = ()          # (layer-relative path, shape): tensors each layer's checkpoint holds that
    #                                          this forward never reads (TrOCR's encoder_attn without encoder states);
    #                                          loaded and saved as they are, never given a gradient

    # -- plugin hooks
    make_layer: Callable | None = None       # (spec, index, alibi) -> layer, instead of DecoderLayer: a plugin's
    #                                          composed layer (vkformers-moe's Llama 4 attention, LongCat's sublayers)
    shared_modules: tuple = ()               # (path, owner path) pairs, full names: every parameter under path is its
    #                                          owner's (one block that several layers run: Zamba's shared
    #                                          transformer), so the checkpoint holds it once and its gradient sums
    checkpoint_layers: tuple[int, ...] = ()  # each layer's index in the checkpoint when the file has others this
    #                                          forward skips (Mllama's cross-attention layers), whose weights are
    #                                          not loaded; empty: 0 .. num_layers - 1

    extra: dict = field(default_factory=dict)  # free room for a variant's own notes

    def amend(self, part: str, **changes) -> DecoderSpec:
        """This spec with fields of its sub-spec ``part`` changed: ``spec.amend("mla", norm_eps=1e-6)`` is
        ``replace(spec, mla=replace(spec.mla, norm_eps=1e-6))``."""
        current = getattr(self, part)
        if current is None:
            raise ValueError(f"DecoderSpec.{part} is not set: replace(spec, {part}=...) sets the whole sub-spec")
        return replace(self, **{part: replace(current, **changes)})


# ---------------------------------------------------------------- config readers

def first_of(config: dict, *names, default=None):
    """The value of the first of ``names`` the config sets (not None), else ``default``: one option under the
    spellings of several config classes (hidden_size, n_embd, d_model)."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def refuse(arch: str, config: dict, option: str, supported: Callable[[object], bool], default=None) -> None:
    """Raise UnsupportedConfigError when config[option] (or its default) is a value we do not implement."""
    value = config.get(option, default)
    if not supported(value):
        raise UnsupportedConfigError(f"{arch}: config option {option}={value!r} is not supported by vkformers' "
                                     f"decoder yet")


def padding_idx(config: dict) -> int | None:
    """The config's pad_token_id as nn.Embedding(vocab, dim, padding_idx=pad_token_id) takes it (negative: from
    the end), or None without one. One outside the table (transformers refuses it) matches no id: None."""
    pad, rows = config.get("pad_token_id"), config["vocab_size"]
    return pad if isinstance(pad, int) and not isinstance(pad, bool) and -rows <= pad < rows else None


def sliding_windows(config: dict, num_layers: int, *, every_layer: bool) -> tuple[int, ...]:
    """Per-layer windows: from layer_types when the config has them, else the whole stack or none."""
    window = config.get("sliding_window") or 0
    types = config.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window if every_layer else 0,) * num_layers


def alibi_slopes(num_heads: int) -> np.ndarray:
    """BLOOM / MPT ALiBi slopes (float32 [heads]): a geometric series, interleaved when heads is not 2^n."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** i for i in range(1, closest + 1)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** i for i in range(1, 1 + 2 * (num_heads - closest), 2)]
    return np.asarray(slopes, dtype=np.float32)


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> np.ndarray:
    """MPT's ALiBi slopes: 2^-(i * max / n') for the next power of two n', odd ones first when n is not 2^k."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / np.power(2.0, np.arange(1, padded + 1, dtype=np.float32) * np.float32(alibi_bias_max / padded))
    if padded != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes.astype(np.float32)


def sinusoidal_table(kind: str, rows: int, dim: int, padding_row: int | None = None) -> np.ndarray:
    """A fixed [rows, dim] float32 position table, [sin | cos] halves.

    fairseq (XGLM): frequencies exp(-i * log(10000) / (dim/2 - 1)), i < dim/2; ``padding_row`` is zero.
    ctrl: angle pos / 10000^(2 (j // 2) / dim) over all j; sines of the even j, cosines of the odd j.
    """
    pos = np.arange(rows, dtype=np.float32)[:, None]
    if kind == "fairseq":
        half = dim // 2
        freq = np.exp(np.arange(half, dtype=np.float32) * np.float32(-math.log(10000) / (half - 1)))
        angles = pos * freq[None, :]
        table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
        if dim % 2:
            table = np.concatenate([table, np.zeros((rows, 1), np.float32)], axis=1)
        if padding_row is not None:
            table[padding_row] = 0.0
    elif kind == "ctrl":
        j = np.arange(dim)
        rates = (1.0 / np.power(10000.0, (2 * (j // 2)) / np.float32(dim))).astype(np.float32)
        angles = pos * rates[None, :]
        table = np.concatenate([np.sin(angles[:, 0::2]), np.cos(angles[:, 1::2])], axis=1)
    else:
        raise ValueError(f"unknown sinusoidal position table {kind!r}")
    return table.astype(np.float32)


def layer_types(config: dict, num_layers: int) -> list[str]:
    """Each layer's attention type from the config's layer_types (default: every layer "full_attention")."""
    return list(config.get("layer_types") or ["full_attention"] * num_layers)


def with_mla(spec: DecoderSpec, config: dict) -> DecoderSpec:
    """``spec`` with DeepSeek-V2's multi-head latent attention from the config's q/kv LoRA ranks and nope / rope / v
    head dims: interleaved rotary on the rope dims only, the softmax scale with YaRN's mscale when it sets one."""
    nope, rope_dim, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scale = (nope + rope_dim) ** -0.5
    if params.get("rope_type", params.get("type")) == "yarn" and params.get("mscale_all_dim"):
        factor = params.get("factor", 1.0)
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    rope_config = dict(config, head_dim=rope_dim)
    mla = MLASpec(q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"], nope_dim=nope,
                  rope_dim=rope_dim, v_dim=v_dim)
    return replace(spec, mla=mla,
                   head_dim=nope + rope_dim, num_kv_heads=spec.num_heads,
                   positions=replace(spec.positions, rope_interleaved=True, rope_configs=((rope_config,
                                                                                           None),) * spec.num_layers),
                   attention=replace(spec.attention, scales=(scale,) * spec.num_layers))
