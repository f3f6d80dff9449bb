"""Per-architecture deltas: how each bidirectional encoder's config.json fills an :class:`EncoderSpec`.

A variant is BERT plus a declared difference (RoBERTa: other names, positions counted
from the padding index, a GELU head; MegatronBERT: pre-LayerNorm; ALBERT: factorised
embeddings and one block shared by every layer; ...). Every variant keeps Hugging Face's
parameter names, so checkpoints load and save unchanged.

A config option that changes the maths but is not implemented raises
:class:`UnsupportedConfigError` naming the option instead of silently computing something else.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from vkformers.errors import VkformersError
from vkformers.models.family import Family
from vkformers.models.registry import NESTED_TEXT_CONFIG

# The architectures of vkformers-bert, each declared once on its variant function (vkformers.models.family).
FAMILY = Family("bert", kind="encoder")
architecture = FAMILY.architecture


class UnsupportedConfigError(VkformersError, ValueError):
    """A config option of a known encoder architecture that the shared encoder does not implement."""


@dataclass
class EncoderSpec:
    """Every knob of the shared encoder block. Paths are Hugging Face parameter names."""

    # -- sizes
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2                 # 0: no token-type embeddings
    embedding_size: int | None = None        # width of the embeddings when it differs from hidden (ALBERT, ELECTRA)
    head_size: int | None = None             # width of the MLM head's transform (None: embedding width)

    # -- embeddings (paths relative to `embeddings`, except embed_norm and embed_project)
    embeddings: str = "bert.embeddings"
    word: str = "word_embeddings"
    position: str | None = "position_embeddings"
    token_type: str | None = "token_type_embeddings"
    embed_norm: str | None = "bert.embeddings.LayerNorm"  # full path (NomicBERT keeps it outside the embeddings)
    embed_project: str | None = None         # full path: embedding width -> hidden (ELECTRA, ALBERT, RemBERT)

    # -- layers: block i lives at layer_paths[i] (ALBERT repeats one path) or f"{layers}.{i}"
    layers: str = "bert.encoder.layer"
    layer_paths: tuple[str, ...] = ()
    qkv_proj: str | None = None              # one fused [q; k; v] projection instead of three (NomicBERT's Wqkv)
    q_proj: str = "attention.self.query"
    k_proj: str = "attention.self.key"
    v_proj: str = "attention.self.value"
    o_proj: str = "attention.output.dense"
    attn_norm: str = "attention.output.LayerNorm"   # post-LN: after the residual; pre-LN: on the block input
    up_proj: str = "intermediate.dense"
    down_proj: str = "output.dense"
    mlp_norm: str = "output.LayerNorm"
    gate_proj: str | None = None             # gated MLP: down(act(gate(x)) * up(x)) (NomicBERT's SwiGLU)
    fused_up_gate: bool = False              # up_proj holds [input; gate]: down(act(input) * gate) (ModernBERT's Wi)
    fused_act_half: int = 0                  # the half of the fused up_proj that goes through act (GTE: 1, [up; gate])
    up_bias: bool | None = None              # up_proj's bias (None: mlp_bias)
    num_kv_heads: int | None = None          # grouped-query attention (EuroBERT)
    qk_norm: tuple[str, str] | None = None   # LayerNorms (no bias) over the whole q / k projections (ESMC)
    qk_norm_eps: float = 1e-5
    residual_scale: float = 1.0              # x + f(norm(x)) / residual_scale (ESMC: sqrt(layers / 36))
    first_attn_norm_identity: bool = False   # layer 0 has no attention norm (ModernBERT: the embeddings end normed)
    layer_windows: tuple[int, ...] = ()      # per layer: 0 full attention, w > 0 keys with |i - j| <= w (ModernBERT)
    global_projections: tuple[str, str, str] | None = None  # Longformer: q, k, v of the global tokens' attention
    scattered_layers: bool = False           # part paths are full paths with {i} (XLM's per-layer lists)
    attn_bias: bool = True                   # q/k/v/o biases
    mlp_bias: bool = True
    pre_norm: bool = False                   # x + f(norm(x)) instead of norm(x + f(x))
    final_norm: str | None = None            # full path (pre-LN encoders)
    norm: str = "layer"                      # layer | rms: the blocks' and the final norm (EuroBERT: rms)
    norm_bias: bool = True                   # LayerNorms of the embeddings, blocks and the end carry a bias
    final_norm_bias: bool = True             # ESMC's final LayerNorm has none
    zero_padded_hidden: bool = False         # XLM: hidden states * attention_mask after the embeddings and each layer

    # -- numerics
    norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    # -- positions
    positions: str = "absolute"              # absolute (learned table) | rotary | none
    positions_from_padding: bool = False     # RoBERTa: cumsum(ids != pad) * (ids != pad) + pad
    pad_token_id: int | None = 0
    word_padding_idx: bool = True            # the word embedding has padding_idx = pad_token_id (transformers builds
    #                                          every family so but ESM C): lookups of it pass that row no gradient
    rotary_interleaved: bool = False         # RoFormer rotates pairs (2i, 2i+1); ESM rotate_half
    rotary_value: bool = False               # RoFormer's rotary_value: rotate v too
    rope_theta: float = 10000.0
    layer_rope_types: tuple[str, ...] = ()   # per layer: the rope_parameters key it rotates with (ModernBERT)
    rope_from_config: bool = False           # inv_freq and scaling from the config's rope_parameters (NomicBERT)
    frozen: tuple[str, ...] = ()             # full paths of checkpoint tables that are not trained (RoFormer's sinusoids)
    unused: tuple[tuple[str, tuple[int, ...]], ...] = ()  # parameters the MLM forward never reads (ESM contact head)
    ignored_suffixes: tuple[str, ...] = ()   # checkpoint buffers the float forward never reads (I-BERT's quantizers)
    lang_adapter: str | None = None          # X-MOD: the path (under a layer) of the language adapter that runs
    adapter_size: int = 0                    # its bottleneck width
    adapter_ln_before: bool = True           # the adapter's residual is the normed state (else the state before)
    idle_adapters: tuple[str, ...] = ()      # the other languages' adapters: loaded, not run, zero gradient (as torch)
    mixing: str = "attention"                # "fourier": the real part of a 2-D DFT over positions and hidden (FNet);
    #                                          "nystrom": the Nyström approximation of softmax attention (below);
    #                                          "lsh": YOSO's expected LSH collisions of unit q and k (below)
    reads_mask: bool = True                  # False: the attention mask is ignored, padding mixes in (FNet)
    causal: bool = False                     # is_decoder: causal self-attention (BertLMHeadModel)
    cross_attention: str | None = None       # add_cross_attention: the path (under a layer) of a post-LN attention
    #                                          over the encoder's states after the self-attention
    conv_kernel: int = 0                     # ConvBERT: > 0 mixes half the heads by span-based dynamic convolution
    conv_width: int = 0                      # ConvBERT: the q / k / v width (attention heads x their size)
    block: str = "bert"                      # "mobilebert": MobileBERT's bottlenecked block (MobileBertBlock)
    bottleneck_size: int = 0                 # MobileBERT: the width inside the block (intra_bottleneck_size)
    bottleneck_attention: bool = False       # q, k and v from the input bottleneck
    shared_qk_bottleneck: bool = True        # q and k from their own bottleneck, v from the block input
    extra_ffns: int = 0                      # feed-forward networks before the last one
    trigram_input: bool = False              # MobileBERT: [next; this; previous] word embeddings, then embed_transform
    word_size: int | None = None             # the word table's width when it differs from the embeddings'
    embed_transform: str | None = None       # full path: word width (x3 for trigrams) -> hidden, before positions
    split_decoder: str | None = None         # full path of the head's extra [hidden - word width, vocab] weight
    pointwise_groups: tuple[tuple[str, int], ...] = ()  # (role, groups): that projection is a grouped Conv1d of
    #                                          kernel 1, weight [out, in / groups, 1] (SqueezeBERT; roles q k v o up down)

    # -- DeBERTa's disentangled attention: q k^T plus content->position (c2p) and position->content (p2c) terms
    #    read from a table of relative-position embeddings, all scaled by 1 / sqrt(head_dim * (1 + len(terms)))
    score_terms: tuple[str, ...] = ()        # pos_att_type among "c2p", "p2c": each widens the scale's divisor
    relative_attention: bool = False         # add the terms (without it pos_att_type still sets the scale)
    rel_embeddings: str | None = None        # full path of the table [2 * span, hidden]
    rel_norm: str | None = None              # full path of its LayerNorm (norm_rel_ebd "layer_norm")
    position_buckets: int = -1               # > 0: log buckets beyond buckets / 2, span = buckets
    max_relative_positions: int = 512        # span without buckets
    share_att_key: bool = False              # positions go through the q / k projections, not their own
    pos_key_proj: str = "attention.self.pos_key_proj"
    pos_query_proj: str = "attention.self.pos_query_proj"
    pos_key_bias: bool = True
    span_from_length: bool = False           # DeBERTa (v1): span min(T, max_relative_positions), the table's middle rows
    qkv_per_head: bool = False               # the fused projection holds [q_h; k_h; v_h] head by head (DeBERTa's in_proj)
    qkv_bias: bool | None = None             # the fused projection's bias (None: attn_bias)
    qv_bias: tuple[str, str] | None = None   # separate q and v biases added after the projection (DeBERTa's q_bias, v_bias)

    # -- Nyströmformer: softmax attention approximated through landmarks (segment means of q and k), the inverse of
    #    the landmarks' own attention by iteration; a depthwise convolution over positions of the values added
    landmarks: int = 0                       # num_landmarks; == landmark_length: exact softmax attention
    landmark_length: int = 0                 # segment_means_seq_len: the one sequence length landmarks are taken at
    value_conv: str | None = None            # path (under a layer) of the value convolution, weight [heads, 1, k, 1]
    value_conv_kernel: int = 0
    value_conv_masked: bool = False          # the convolution reads the values times the attention mask (YOSO)
    position_offset: int = 0                 # positions count from this row of the table (Nyströmformer: 2)
    hash_bits: int = 0                       # YOSO: hash_code_len, the power of the collision probability

    # -- MPNet: a bias per head from a table of bucketed relative positions (T5's buckets), shared by every layer
    relative_bias: str | None = None         # full path of the table [buckets, heads]
    relative_bias_buckets: int = 32
    relative_bias_max_distance: int = 128

    # -- ESM's embedding tweaks
    token_dropout: bool = False              # zero the mask token's embedding, rescale by the observed mask ratio
    mask_token_id: int | None = None
    zero_padded_embeddings: bool = False     # embeddings * attention_mask

    # -- RoCBERT: [word; shape; pronunciation] embeddings (ids 0 when not given) mapped to the embedding width
    concat_embeds: tuple[tuple[str, int, int], ...] = ()   # (full path, rows, width)
    concat_map: str | None = None

    # -- MLM head: decoder(norm(act(dense(x)))) + bias
    head_dense: str | None = "cls.predictions.transform.dense"   # None: no transform (XLM, EuroBERT)
    head_norm: str | None = "cls.predictions.transform.LayerNorm"
    head_act: str = "gelu"
    decoder: str = "cls.predictions.decoder"
    decoder_bias: str | None = "cls.predictions.bias"   # separate bias parameter; None: the decoder Linear's own
    tie_embeddings: bool = True
    head_dense_bias: bool = True
    head_norm_bias: bool = True
    head_norm_eps: float | None = None       # None: norm_eps
    decoder_linear_bias: bool = True         # the decoder Linear's own bias when decoder_bias is None

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def embed_dim(self) -> int:
        return self.embedding_size or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def layer_path(self, index: int) -> str:
        return self.layer_paths[index] if self.layer_paths else f"{self.layers}.{index}"


@dataclass
class FunnelSpec:
    """The Funnel Transformer's sizes and options (vkformers_bert/funnel.py). Paths are transformers' own."""

    vocab_size: int
    d_model: int
    num_heads: int
    head_dim: int
    d_inner: int
    block_sizes: tuple[int, ...]
    block_repeats: tuple[int, ...]
    num_decoder_layers: int
    hidden_act: str = "gelu_new"
    norm_eps: float = 1e-9
    separate_cls: bool = True                # [CLS] kept apart from the pooling
    truncate_seq: bool = True                # the last position dropped before pairing (with separate_cls)
    tie_embeddings: bool = True
    pad_token_id: int | None = None          # the word embedding's padding_idx: lookups of it pass no gradient


# ---------------------------------------------------------------- config readers

def refuse(arch: str, config: dict, option: str, supported: Callable[[object], bool], default=None) -> None:
    """Raise UnsupportedConfigError when config[option] (or its default) is a value we do not implement."""
    value = config.get(option, default)
    if not supported(value):
        raise UnsupportedConfigError(f"{arch}: config option {option}={value!r} is not supported by vkformers' "
                                     f"encoder yet")


def _common_refusals(arch: str, config: dict, decoder_ok: bool = False) -> None:
    if not decoder_ok:
        refuse(arch, config, "is_decoder", lambda v: not v, False)
    refuse(arch, config, "add_cross_attention", lambda v: not v or (decoder_ok and config.get("is_decoder")), False)
    # transformers 5 dropped relative position embeddings from BERT-likes; a checkpoint trained with them
    # would compute something else, so it is refused rather than run with absolute positions
    refuse(arch, config, "position_embedding_type", lambda v: v in (None, "absolute"))


@architecture("bert", norm="layer", status="verified",
              notes="BERT-family; upstream claims HF forward-logit fixtures")
def bert(config: dict, prefix: str = "bert") -> EncoderSpec:
    arch = config.get("model_type", "bert")
    # BERT alone runs as a decoder (causal, with cross-attention: an encoder-decoder's decoder)
    _common_refusals(arch, config, decoder_ok=arch == "bert" and prefix == "bert")
    return EncoderSpec(
        causal=bool(config.get("is_decoder", False)) and arch == "bert" and prefix == "bert",
        cross_attention="crossattention" if config.get("add_cross_attention") and arch == "bert" and prefix == "bert"
        else None,
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=config.get("max_position_embeddings", 512),
        type_vocab_size=config.get("type_vocab_size", 2), norm_eps=config.get("layer_norm_eps", 1e-12),
        hidden_act=config.get("hidden_act", "gelu"), head_act=config.get("hidden_act", "gelu"),
        pad_token_id=config.get("pad_token_id", 0), tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        embeddings=f"{prefix}.embeddings", embed_norm=f"{prefix}.embeddings.LayerNorm",
        layers=f"{prefix}.encoder.layer")


@architecture("ernie", norm="layer", status="verified",
              notes="BERT-family")
def ernie(config: dict) -> EncoderSpec:
    refuse("ernie", config, "use_task_id", lambda v: not v, False)  # task-type embeddings
    return bert(config, "ernie")


@architecture("megatron-bert", norm="layer", status="verified",
              notes="causality per config; BERT-family")
def megatron_bert(config: dict) -> EncoderSpec:
    """Pre-LN BERT: no embedding LayerNorm, attention.ln / ln before the sublayers, encoder.ln at the end."""
    return replace(bert(config), embed_norm=None, pre_norm=True, attn_norm="attention.ln", mlp_norm="ln",
                   final_norm="bert.encoder.ln")


ROBERTA_HEAD = dict(head_dense="lm_head.dense", head_norm="lm_head.layer_norm", head_act="gelu",
                    decoder="lm_head.decoder", decoder_bias="lm_head.bias")


@architecture("roberta", norm="layer", status="verified",
              notes="BERT-family")
@architecture("camembert", norm="layer", status="verified",
              notes="BERT-family")
@architecture("xlm-roberta", norm="layer", status="verified",
              notes="BERT-family")
def roberta(config: dict, prefix: str = "roberta") -> EncoderSpec:
    """BERT with positions counted from padding_idx + 1 (padding tokens take padding_idx) and a GELU head."""
    return replace(bert(config, prefix), positions_from_padding=True, pad_token_id=config.get("pad_token_id", 1),
                   **ROBERTA_HEAD)


@architecture("data2vec-text", norm="layer", status="verified",
              notes="BERT-family")
def data2vec_text(config: dict) -> EncoderSpec:
    return roberta(config, "data2vec_text")


@architecture("roberta-prelayernorm", norm="layer", status="verified",
              notes="BERT-family")
def roberta_prelayernorm(config: dict) -> EncoderSpec:
    """RoBERTa with pre-LN blocks (attention.LayerNorm, intermediate.LayerNorm) and a final LayerNorm."""
    return replace(roberta(config, "roberta_prelayernorm"), pre_norm=True, attn_norm="attention.LayerNorm",
                   mlp_norm="intermediate.LayerNorm", final_norm="roberta_prelayernorm.LayerNorm")


@architecture("xlm-roberta-xl", norm="layer", status="verified",
              notes="BERT-family")
def xlm_roberta_xl(config: dict) -> EncoderSpec:
    """Pre-LN RoBERTa without the embedding LayerNorm (the XL/XXL models)."""
    return replace(roberta(config), embed_norm=None, pre_norm=True, attn_norm="attention.self_attn_layer_norm",
                   mlp_norm="LayerNorm", final_norm="roberta.encoder.LayerNorm")


@architecture("electra", norm="layer", status="verified",
              notes="BERT-family")
def electra(config: dict) -> EncoderSpec:
    """BERT embeddings of width embedding_size, projected to hidden; the generator's MLM head (GELU)."""
    spec = bert(config, "electra")
    size = config.get("embedding_size", 128)
    return replace(spec, embedding_size=size,
                   embed_project="electra.embeddings_project" if size != spec.hidden_size else None,
                   head_dense="generator_predictions.dense", head_norm="generator_predictions.LayerNorm",
                   head_act="gelu", decoder="generator_lm_head", decoder_bias=None)


@architecture("albert", norm="layer", status="verified",
              notes="BERT-family")
def albert(config: dict) -> EncoderSpec:
    """Factorised embeddings (embedding_size -> hidden) and one block per group, shared by its layers."""
    spec = bert(dict(config, hidden_act=config.get("hidden_act", "gelu_new")), "albert")
    groups, inner = config.get("num_hidden_groups", 1), config.get("inner_group_num", 1)
    group = "albert.encoder.albert_layer_groups"
    paths = []
    for i in range(spec.num_layers):  # transformers: group int(i / (layers / groups)), each applies its inner layers
        g = int(i / (spec.num_layers / groups))
        paths += [f"{group}.{g}.albert_layers.{j}" for j in range(inner)]
    return replace(spec, num_layers=len(paths), layer_paths=tuple(paths), embedding_size=config.get("embedding_size", 128),
                   embed_project="albert.encoder.embedding_hidden_mapping_in", q_proj="attention.query",
                   k_proj="attention.key", v_proj="attention.value", o_proj="attention.dense",
                   attn_norm="attention.LayerNorm", up_proj="ffn", down_proj="ffn_output",
                   mlp_norm="full_layer_layer_norm", head_dense="predictions.dense", head_norm="predictions.LayerNorm",
                   decoder="predictions.decoder", decoder_bias="predictions.bias")


@architecture("rembert", norm="layer", status="verified",
              notes="BERT-family")
def rembert(config: dict) -> EncoderSpec:
    """Input embeddings of input_embedding_size projected to hidden; an untied head of output_embedding_size."""
    spec = bert(dict(config, tie_word_embeddings=config.get("tie_word_embeddings", False)), "rembert")
    return replace(spec, embedding_size=config.get("input_embedding_size", 256),
                   head_size=config.get("output_embedding_size", 1664),
                   embed_project="rembert.encoder.embedding_hidden_mapping_in", head_dense="cls.predictions.dense",
                   head_norm="cls.predictions.LayerNorm", decoder_bias=None)


@architecture("roformer", norm="layer", status="verified",
              notes="BERT-family")
def roformer(config: dict) -> EncoderSpec:
    """Word + token-type embeddings only; interleaved rotary (sinusoid table as a frozen checkpoint tensor)."""
    spec = bert(config, "roformer")
    size = config.get("embedding_size") or spec.hidden_size
    return replace(spec, embedding_size=size, position=None, positions="rotary", rotary_interleaved=True,
                   rotary_value=bool(config.get("rotary_value", False)),
                   embed_project="roformer.embeddings_project" if size != spec.hidden_size else None,
                   frozen=("roformer.encoder.embed_positions.weight",))


@architecture("distilbert", norm="layer", status="verified",
              notes="BERT-family")
def distilbert(config: dict) -> EncoderSpec:
    arch = "distilbert"
    refuse(arch, config, "sinusoidal_pos_embds", lambda v: not v, False)
    dim = config["dim"]
    return EncoderSpec(
        vocab_size=config["vocab_size"], hidden_size=dim, num_layers=config["n_layers"], num_heads=config["n_heads"],
        intermediate_size=config["hidden_dim"], max_position_embeddings=config.get("max_position_embeddings", 512),
        type_vocab_size=0, token_type=None, embed_norm="distilbert.embeddings.LayerNorm", norm_eps=1e-12, hidden_act=config.get("activation", "gelu"),
        head_act=config.get("activation", "gelu"), pad_token_id=config.get("pad_token_id", 0),
        embeddings="distilbert.embeddings", layers="distilbert.transformer.layer", q_proj="attention.q_lin",
        k_proj="attention.k_lin", v_proj="attention.v_lin", o_proj="attention.out_lin", attn_norm="sa_layer_norm",
        up_proj="ffn.lin1", down_proj="ffn.lin2", mlp_norm="output_layer_norm", head_dense="vocab_transform",
        head_norm="vocab_layer_norm", decoder="vocab_projector", decoder_bias=None,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)))


@architecture("esm", norm="layer", status="verified",
              notes="BERT-family")
def esm(config: dict) -> EncoderSpec:
    """Pre-LN; positions from padding (absolute) or rotate_half rotary; token dropout; GELU everywhere."""
    arch = "esm"
    refuse(arch, config, "is_folding_model", lambda v: not v, False)
    position_type = config.get("position_embedding_type", "absolute")
    if position_type not in ("absolute", "rotary"):
        raise UnsupportedConfigError(f"esm: config option position_embedding_type={position_type!r} is not "
                                     "supported by vkformers' encoder yet")
    spec = bert(dict(config, position_embedding_type=None, hidden_act="gelu", type_vocab_size=0), "esm")
    rotary = position_type == "rotary"
    if config.get("token_dropout") and config.get("mask_token_id") is None:
        raise UnsupportedConfigError("esm: config option token_dropout=True needs mask_token_id")
    if not rotary and config.get("pad_token_id") is None:
        raise UnsupportedConfigError("esm: absolute positions need pad_token_id (positions count from it)")
    heads = spec.num_heads * spec.num_layers
    return replace(spec, token_type=None, type_vocab_size=0,
                   embed_norm="esm.embeddings.layer_norm" if config.get("emb_layer_norm_before") else None,
                   position=None if rotary else "position_embeddings", positions="rotary" if rotary else "absolute",
                   positions_from_padding=not rotary, pad_token_id=config.get("pad_token_id"),
                   pre_norm=True, attn_norm="attention.LayerNorm", mlp_norm="LayerNorm",
                   final_norm="esm.encoder.emb_layer_norm_after", token_dropout=bool(config.get("token_dropout")),
                   mask_token_id=config.get("mask_token_id"), zero_padded_embeddings=True,
                   unused=(("esm.contact_head.regression.weight", (1, heads)),
                           ("esm.contact_head.regression.bias", (1,))),
                   **ROBERTA_HEAD)


@architecture("nomic_bert", norm="layer", status="verified",
              notes="BERT-family")
def nomic_bert(config: dict) -> EncoderSpec:
    """Post-LN like BERT, but bias-free projections (q/k/v fused as attn.Wqkv), a SwiGLU MLP (fc11 up, fc12 gate),
    rotate_half rotary from rope_parameters and no position table. Names are the released checkpoints', which
    transformers 5 also writes (it renames them to q_proj/... in memory)."""
    spec = bert(dict(config, hidden_act=config.get("hidden_act", "silu")), "nomic_bert")
    heads = spec.num_heads
    if config.get("head_dim") not in (None, spec.hidden_size // heads):
        raise UnsupportedConfigError(f"nomic_bert: config option head_dim={config['head_dim']!r} is not supported "
                                     "by vkformers' encoder yet (it must be hidden_size / num_attention_heads)")
    return replace(spec, position=None, positions="rotary", rope_from_config=True, embed_norm="nomic_bert.emb_ln",
                   layers="nomic_bert.encoder.layers", qkv_proj="attn.Wqkv", o_proj="attn.out_proj",
                   attn_norm="norm1", up_proj="mlp.fc11", gate_proj="mlp.fc12", down_proj="mlp.fc2", mlp_norm="norm2",
                   attn_bias=False, mlp_bias=False, head_norm="cls.predictions.transform.layer_norm")


@architecture("big_bird", norm="layer", status="verified",
              notes="BERT-family; attention_type original_full only")
def big_bird(config: dict) -> EncoderSpec:
    """BERT when attention_type is "original_full"; block-sparse attention is refused (not implemented)."""
    refuse("big_bird", config, "attention_type", lambda v: v == "original_full", "block_sparse")
    refuse("big_bird", config, "rescale_embeddings", lambda v: not v, False)
    refuse("big_bird", config, "use_bias", lambda v: v, True)
    spec = bert(dict(config, hidden_act=config.get("hidden_act", "gelu_new")), "bert")
    return replace(spec, unused=(("bert.pooler.weight", (spec.hidden_size, spec.hidden_size)),
                                 ("bert.pooler.bias", (spec.hidden_size,))))


@architecture("roc_bert", norm="layer", status="verified",
              notes="causality per config; BERT-family")
def roc_bert(config: dict) -> EncoderSpec:
    """BERT whose word embedding is concatenated with shape and pronunciation embeddings (ids 0 unless given,
    which vkformers' forward does not take) and mapped back by embeddings.map_inputs_layer."""
    for option in ("enable_shape", "enable_pronunciation", "concat_input"):
        refuse("roc_bert", config, option, lambda v: v, True)
    spec = bert(config, "roc_bert")
    return replace(spec, concat_map="roc_bert.embeddings.map_inputs_layer", concat_embeds=(
        ("roc_bert.embeddings.shape_embed", config["shape_vocab_size"], config["shape_embed_dim"]),
        ("roc_bert.embeddings.pronunciation_embed", config["pronunciation_vocab_size"],
         config["pronunciation_embed_dim"])))


@architecture("jina_embeddings_v3", norm="layer", status="verified",
              notes="BERT-family")
def jina_embeddings_v3(config: dict) -> EncoderSpec:
    """Post-LN like XLM-RoBERTa, but no position table: rotate_half rotary (rope_parameters) on q and k; RoBERTa's
    head. Names are the released checkpoints' (which transformers 5 also writes): emb_ln, encoder.layers.i with
    mixer.Wqkv (fused, biased), mixer.out_proj, norm1, mlp.fc1/fc2, norm2."""
    spec = roberta(dict(config, layer_norm_eps=config.get("layer_norm_eps", 1e-5)))
    return replace(spec, position=None, positions="rotary", rope_from_config=True, positions_from_padding=False,
                   embed_norm="roberta.emb_ln", layers="roberta.encoder.layers", qkv_proj="mixer.Wqkv",
                   o_proj="mixer.out_proj", attn_norm="norm1", up_proj="mlp.fc1", down_proj="mlp.fc2",
                   mlp_norm="norm2")


@architecture("xlm", norm="layer", status="verified",
              notes="BERT-family")
@architecture("flaubert", norm="layer", status="verified",
              notes="BERT-family")
def xlm(config: dict) -> EncoderSpec:
    """XLM / FlauBERT: word + position embeddings, layer_norm_emb, post-LN blocks whose parts sit in per-layer lists, hidden states zeroed at padding after the embeddings
    and every layer, FFN of 4 x emb_dim, and a bare tied projection pred_layer.proj as the head."""
    arch = config.get("model_type", "xlm")
    refuse(arch, config, "causal", lambda v: not v, False)
    refuse(arch, config, "is_encoder", lambda v: v, True)
    refuse(arch, config, "sinusoidal_embeddings", lambda v: not v, False)
    refuse(arch, config, "asm", lambda v: not v, False)
    refuse(arch, config, "layerdrop", lambda v: not v, 0.0)  # a training-time option; refused rather than ignored
    # FlauBERT's pre_norm: transformers 5.24 cannot run it (no reference to check against), so it is refused
    refuse(arch, config, "pre_norm", lambda v: not v, False)
    dim = config["emb_dim"]
    t = "transformer"
    return EncoderSpec(
        vocab_size=config["vocab_size"], hidden_size=dim, num_layers=config["n_layers"], num_heads=config["n_heads"],
        intermediate_size=4 * dim, max_position_embeddings=config.get("max_position_embeddings", 512),
        type_vocab_size=0, token_type=None, embeddings=t, word="embeddings", position="position_embeddings",
        embed_norm=f"{t}.layer_norm_emb", norm_eps=config.get("layer_norm_eps", 1e-12),
        hidden_act="gelu" if config.get("gelu_activation", True) else "relu",
        pad_token_id=config.get("pad_token_id", 2), zero_padded_hidden=True, scattered_layers=True,
        q_proj=f"{t}.attentions.{{i}}.q_lin", k_proj=f"{t}.attentions.{{i}}.k_lin",
        v_proj=f"{t}.attentions.{{i}}.v_lin", o_proj=f"{t}.attentions.{{i}}.out_lin",
        attn_norm=f"{t}.layer_norm1.{{i}}", up_proj=f"{t}.ffns.{{i}}.lin1", down_proj=f"{t}.ffns.{{i}}.lin2",
        mlp_norm=f"{t}.layer_norm2.{{i}}",
        unused=((f"{t}.lang_embeddings.weight", (config.get("n_langs", 1), dim)),)
        if config.get("n_langs", 1) > 1 and config.get("use_lang_emb", True) else (),
        head_dense=None, head_norm=None, decoder="pred_layer.proj", decoder_bias=None,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)))


def _llama_like(config: dict, prefix: str, arch: str) -> EncoderSpec:
    """Pre-norm blocks with a SwiGLU MLP and rotary from rope_parameters, no position table or token types."""
    heads = config["num_attention_heads"]
    if config.get("head_dim") not in (None, config["hidden_size"] // heads):
        raise UnsupportedConfigError(f"{arch}: config option head_dim={config['head_dim']!r} is not supported by "
                                     "vkformers' encoder yet (it must be hidden_size / num_attention_heads)")
    bias = bool(config.get("attention_bias", False))
    return EncoderSpec(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
        num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=config["intermediate_size"], max_position_embeddings=config.get("max_position_embeddings"),
        type_vocab_size=0, token_type=None, position=None, positions="rotary", rope_from_config=True,
        embeddings=prefix, word="embed_tokens", embed_norm=None, layers=f"{prefix}.layers",
        q_proj="self_attn.q_proj", k_proj="self_attn.k_proj", v_proj="self_attn.v_proj", o_proj="self_attn.o_proj",
        attn_norm="input_layernorm", gate_proj="mlp.gate_proj", up_proj="mlp.up_proj", down_proj="mlp.down_proj",
        mlp_norm="post_attention_layernorm", attn_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)),
        pre_norm=True, final_norm=f"{prefix}.norm", hidden_act=config.get("hidden_act", "silu"),
        pad_token_id=config.get("pad_token_id"), tie_embeddings=bool(config.get("tie_word_embeddings", False)))


@architecture("eurobert", norm="rms", llama_layout=True, status="verified")
def eurobert(config: dict) -> EncoderSpec:
    """Llama's layout run bidirectionally: RMSNorm, grouped-query attention, SwiGLU, rotary; a bare lm_head."""
    spec = _llama_like(config, "model", "eurobert")
    return replace(spec, norm="rms", norm_eps=config.get("rms_norm_eps", 1e-5), head_dense=None, head_norm=None,
                   decoder="lm_head", decoder_bias=None, decoder_linear_bias=bool(config.get("mlp_bias", False)))


@architecture("esmc", norm="layer", status="verified",
              notes="full-projection QK norm")
def esmc(config: dict) -> EncoderSpec:
    """Llama-like with LayerNorms (eps 1e-5; the final one without bias), bias-free LayerNorms over the whole
    q and k projections, sublayer outputs divided by sqrt(layers / 36), and an untied ESM-style head
    dense -> gelu -> LayerNorm -> decoder (own bias)."""
    spec = _llama_like(config, "esmc", "esmc")
    if spec.num_kv_heads != spec.num_heads:
        raise UnsupportedConfigError("esmc: config option num_key_value_heads differs from num_attention_heads; "
                                     "its QK norm covers the full projection, which needs equal head counts")
    return replace(spec, norm_eps=1e-5, final_norm_bias=False, qk_norm=("self_attn.q_norm", "self_attn.k_norm"),
                   residual_scale=(spec.num_layers / 36) ** 0.5, head_dense="lm_head.dense",
                   head_norm="lm_head.layer_norm", head_norm_eps=1e-5, head_act="gelu", decoder="lm_head.decoder",
                   decoder_bias=None, word_padding_idx=False)


@architecture("modernbert", norm="layer", status="verified")
def modernbert(config: dict) -> EncoderSpec:
    """Pre-LN (bias per norm_bias, layer 0 without an attention norm: the embeddings end in a norm), fused
    Wqkv, GeGLU Wi = [input; gate], rotate_half rotary whose theta depends on the layer type, and sliding
    layers attending to keys within local_attention / 2 on both sides; head dense -> act -> norm -> tied decoder."""
    arch = "modernbert"
    refuse(arch, config, "sparse_prediction", lambda v: not v, False)
    heads, d = config["num_attention_heads"], config["hidden_size"]
    types = tuple(config.get("layer_types") or ())
    if len(types) != config["num_hidden_layers"] or set(types) - {"full_attention", "sliding_attention"}:
        raise UnsupportedConfigError(f"{arch}: config option layer_types={types!r} is not supported by vkformers' "
                                     "encoder yet")
    half = config.get("local_attention", 128) // 2
    norm_bias = bool(config.get("norm_bias", False))
    return EncoderSpec(
        vocab_size=config["vocab_size"], hidden_size=d, num_layers=config["num_hidden_layers"], num_heads=heads,
        intermediate_size=config["intermediate_size"], max_position_embeddings=config.get("max_position_embeddings"),
        type_vocab_size=0, token_type=None, position=None, positions="rotary", layer_rope_types=types,
        layer_windows=tuple(half if t == "sliding_attention" else 0 for t in types),
        embeddings="model.embeddings", word="tok_embeddings", embed_norm="model.embeddings.norm",
        layers="model.layers", qkv_proj="attn.Wqkv", o_proj="attn.Wo", attn_norm="attn_norm",
        first_attn_norm_identity=True, up_proj="mlp.Wi", fused_up_gate=True, down_proj="mlp.Wo", mlp_norm="mlp_norm",
        attn_bias=bool(config.get("attention_bias", False)), mlp_bias=bool(config.get("mlp_bias", False)),
        pre_norm=True, final_norm="model.final_norm", norm=("layer"), norm_bias=norm_bias,
        norm_eps=config.get("norm_eps", 1e-5), hidden_act=config.get("hidden_activation", "gelu"),
        head_dense="head.dense", head_dense_bias=bool(config.get("classifier_bias", False)), head_norm="head.norm",
        head_norm_bias=norm_bias, head_act=config.get("classifier_activation", "gelu"), decoder="decoder",
        decoder_bias=None, decoder_linear_bias=bool(config.get("decoder_bias", True)),
        pad_token_id=config.get("pad_token_id"), tie_embeddings=bool(config.get("tie_word_embeddings", True)))


@architecture("bert-generation", norm="layer", status="verified",
              notes="causality per config; BERT-family")
def bert_generation(config: dict) -> EncoderSpec:
    """BertGeneration's encoder with its LM head, bidirectional (is_decoder=False): BERT without token types
    whose head is the bare tied lm_head.decoder plus lm_head.bias."""
    spec = bert(dict(config, type_vocab_size=0), "bert")
    return replace(spec, token_type=None, head_dense=None, head_norm=None, decoder="lm_head.decoder",
                   decoder_bias="lm_head.bias")


def _pos_att_type(config: dict) -> tuple[str, ...]:
    terms = config.get("pos_att_type") or ()
    if isinstance(terms, str):  # older configs: "p2c|c2p"
        terms = [t.strip() for t in terms.lower().split("|") if t.strip()]
    return tuple(t for t in ("c2p", "p2c") if t in terms)


@architecture("deberta-v2", norm="layer", status="verified",
              notes="DeBERTa-v2/v3: disentangled relative attention (c2p, p2c), log position buckets")
def deberta_v2(config: dict) -> EncoderSpec:
    """BERT's post-LN blocks under the deberta prefix whose attention adds the c2p / p2c terms of a shared table of
    relative-position embeddings (encoder.rel_embeddings, LayerNorm'd by encoder.LayerNorm when norm_rel_ebd says
    so), the embeddings zeroed at padding after their LayerNorm, and the legacy BERT head (cls.predictions)."""
    arch = config.get("model_type", "deberta-v2")
    refuse(arch, config, "conv_kernel_size", lambda v: not v, 0)  # v2-xlarge's convolution after layer 0
    refuse(arch, config, "legacy", lambda v: v, True)             # the non-legacy lm_predictions head
    refuse(arch, config, "embedding_size", lambda v: v in (None, config["hidden_size"]))
    refuse(arch, config, "attention_head_size",
           lambda v: v in (None, config["hidden_size"] // config["num_attention_heads"]))
    refuse(arch, config, "z_steps", lambda v: not v, 0)
    unknown = [t for t in (config.get("pos_att_type") if isinstance(config.get("pos_att_type"), list) else [])
               if t not in ("c2p", "p2c")]
    if unknown:
        raise UnsupportedConfigError(f"{arch}: config option pos_att_type={unknown!r} is not supported by "
                                     "vkformers' encoder yet (only c2p and p2c)")
    relative = bool(config.get("relative_attention", False))
    norms = [x.strip() for x in str(config.get("norm_rel_ebd", "none")).lower().split("|")]
    spec = bert(dict(config, type_vocab_size=config.get("type_vocab_size", 0),
                     layer_norm_eps=config.get("layer_norm_eps", 1e-7)), "deberta")
    max_relative = config.get("max_relative_positions", -1)
    if max_relative is None or max_relative < 1:
        max_relative = spec.max_position_embeddings
    return replace(
        spec, token_type="token_type_embeddings" if spec.type_vocab_size else None,
        position="position_embeddings" if config.get("position_biased_input", True) else None,
        zero_padded_embeddings=True, q_proj="attention.self.query_proj", k_proj="attention.self.key_proj",
        v_proj="attention.self.value_proj", score_terms=_pos_att_type(config), relative_attention=relative,
        rel_embeddings="deberta.encoder.rel_embeddings" if relative else None,
        rel_norm="deberta.encoder.LayerNorm" if relative and "layer_norm" in norms else None,
        position_buckets=int(config.get("position_buckets", -1) or -1), max_relative_positions=int(max_relative),
        share_att_key=bool(config.get("share_att_key", False)))


@architecture("deberta", norm="layer", status="verified",
              notes="DeBERTa (v1): disentangled relative attention (c2p, p2c), fused per-head in_proj")
def deberta(config: dict) -> EncoderSpec:
    """DeBERTa-v2's layout with v1's attention: one bias-free in_proj holding [q; k; v] head by head plus separate
    q_bias / v_bias, pos_proj (no bias) / pos_q_proj for the positions, no position buckets and a span of
    min(T, max_relative_positions) rows each side of the table's middle."""
    refuse("deberta", config, "talking_head", lambda v: not v, False)
    spec = deberta_v2(dict(config, position_buckets=-1, share_att_key=False, norm_rel_ebd="none", conv_kernel_size=0,
                           attention_head_size=None))
    return replace(spec, qkv_proj="attention.self.in_proj", qkv_per_head=True, qkv_bias=False,
                   qv_bias=("attention.self.q_bias", "attention.self.v_bias"), pos_key_proj="attention.self.pos_proj",
                   pos_key_bias=False, pos_query_proj="attention.self.pos_q_proj", span_from_length=True)


@architecture("mpnet", norm="layer", status="verified",
              notes="BERT-family; T5-style relative position bias shared by the layers")
def mpnet(config: dict) -> EncoderSpec:
    """RoBERTa's embeddings (positions from padding 1, no token types) and head, attention.attn.q/k/v/o and
    attention.LayerNorm, plus a per-head bias of bucketed relative positions (encoder.relative_attention_bias) added
    to every layer's scores. transformers buckets with 32 whatever relative_attention_num_buckets says, so another
    count is refused."""
    refuse("mpnet", config, "relative_attention_num_buckets", lambda v: v == 32, 32)
    spec = roberta(dict(config, type_vocab_size=0, pad_token_id=1), "mpnet")
    return replace(spec, token_type=None, type_vocab_size=0, q_proj="attention.attn.q", k_proj="attention.attn.k",
                   v_proj="attention.attn.v", o_proj="attention.attn.o", attn_norm="attention.LayerNorm",
                   relative_bias="mpnet.encoder.relative_attention_bias", relative_bias_buckets=32)


@architecture("nystromformer", norm="layer", status="verified",
              notes="BERT-family; Nyström attention through landmarks with an iterative pseudo-inverse")
def nystromformer(config: dict) -> EncoderSpec:
    """BERT's post-LN layout under the nystromformer prefix (gelu_new, LayerNorm eps 1e-5, pad 1) whose position
    table has max_position_embeddings + 2 rows read from row 2 on, and whose attention, when num_landmarks is not
    segment_means_seq_len, is softmax(q kl^T) pinv(softmax(ql kl^T)) softmax(ql k^T + mask) v: ql, kl the means of
    num_landmarks equal segments of q and k (q, k scaled by head_dim^-1/4; the mask only on the last factor), pinv
    six Newton-Schulz steps from A^T / (the largest column sum over the batch). conv_kernel_size adds a depthwise
    convolution over positions of the values (one kernel per head, padding not masked)."""
    arch = "nystromformer"
    refuse(arch, config, "inv_coeff_init_option", lambda v: not v, False)  # transformers cannot read its option
    kernel = config.get("conv_kernel_size", 65)
    if kernel is not None and int(kernel) % 2 == 0:
        raise UnsupportedConfigError(f"{arch}: config option conv_kernel_size={kernel} is not supported (an even "
                                     "kernel lengthens the sequence by one: transformers cannot add it either)")
    length, landmarks = int(config.get("segment_means_seq_len", 64)), int(config.get("num_landmarks", 64))
    if landmarks <= 0 or length % landmarks:
        raise UnsupportedConfigError(f"{arch}: config option num_landmarks={landmarks} must divide "
                                     f"segment_means_seq_len={length}")
    spec = bert(dict(config, hidden_act=config.get("hidden_act", "gelu_new"),
                     layer_norm_eps=config.get("layer_norm_eps", 1e-5), pad_token_id=config.get("pad_token_id", 1),
                     max_position_embeddings=config.get("max_position_embeddings", 510) + 2), arch)
    return replace(spec, mixing="nystrom", landmarks=landmarks, landmark_length=length, position_offset=2,
                   value_conv="attention.self.conv" if kernel is not None else None,
                   value_conv_kernel=int(kernel or 0))


@architecture("yoso", norm="layer", status="verified",
              notes="BERT-family; YOSO's expectation attention (use_expectation), not its CUDA-only LSH sampling")
def yoso(config: dict) -> EncoderSpec:
    """BERT's post-LN layout under the yoso prefix (one token type, pad 1, positions from row 2 of a table of
    max_position_embeddings + 2 rows) whose attention is normalize(E v), E = (1 - acos(q^ k^T) / pi) ** hash_code_len
    with q^, k^ the unit queries and keys: the expected collisions of hash_code_len random hyperplanes, trained with
    YOSO's surrogate gradient. transformers ignores the attention mask there (its int(1 + mask / 10000) is 1 at
    every position), so padding is attended as in transformers; conv_window adds a depthwise convolution over
    positions of the masked values. use_expectation=False samples hashes in transformers' CUDA kernels: refused."""
    arch = "yoso"
    refuse(arch, config, "use_expectation", lambda v: v, True)
    window = config.get("conv_window")
    if window is not None and int(window) % 2 == 0:
        raise UnsupportedConfigError(f"{arch}: config option conv_window={window} is not supported (an even kernel "
                                     "lengthens the sequence by one: transformers cannot add it either)")
    spec = bert(dict(config, type_vocab_size=config.get("type_vocab_size", 1), pad_token_id=config.get("pad_token_id", 1),
                     max_position_embeddings=config.get("max_position_embeddings", 4096) + 2), arch)
    return replace(spec, mixing="lsh", hash_bits=int(config.get("hash_code_len", 9)), position_offset=2,
                   value_conv="attention.self.conv" if window is not None else None,
                   value_conv_kernel=int(window or 0), value_conv_masked=True)


@architecture("funnel", norm="layer", status="verified",
              model_class={"masked-lm": "vkformers_bert.funnel:FunnelForMaskedLM",
                           "base": "vkformers_bert.funnel:FunnelModel"},
              notes="Funnel Transformer: mean pooling between blocks, upsampling decoder, relative attention")
def funnel(config: dict) -> FunnelSpec:
    """Funnel Transformer (relative_shift attention, mean pooling of the queries only). attention_type "factorized",
    pooling_type "max" and pool_q_only=False are refused."""
    arch = "funnel"
    refuse(arch, config, "attention_type", lambda v: v == "relative_shift", "relative_shift")
    refuse(arch, config, "pooling_type", lambda v: v == "mean", "mean")
    refuse(arch, config, "pool_q_only", lambda v: v, True)
    d_model = int(config.get("d_model", 768))
    if d_model % 2:
        raise UnsupportedConfigError(f"{arch}: config option d_model={d_model} must be even (its sinusoid table holds "
                                     "sines and cosines of d_model / 2 frequencies)")
    sizes = tuple(int(b) for b in config.get("block_sizes", (4, 4, 4)))
    repeats = tuple(int(r) for r in (config.get("block_repeats") or [1] * len(sizes)))
    if len(repeats) != len(sizes) or not sizes:
        raise UnsupportedConfigError(f"{arch}: config options block_sizes={list(sizes)} and block_repeats="
                                     f"{list(repeats)} must have one entry per block")
    return FunnelSpec(
        vocab_size=int(config["vocab_size"]), d_model=d_model, num_heads=int(config.get("n_head", 12)),
        head_dim=int(config.get("d_head", 64)), d_inner=int(config.get("d_inner", 3072)), block_sizes=sizes,
        block_repeats=repeats, num_decoder_layers=int(config.get("num_decoder_layers", 2)),
        hidden_act=config.get("hidden_act", "gelu_new"), norm_eps=float(config.get("layer_norm_eps", 1e-9)),
        separate_cls=bool(config.get("separate_cls", True)), truncate_seq=bool(config.get("truncate_seq", True)),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)), pad_token_id=config.get("pad_token_id"))


@architecture("gte", norm="layer", status="verified",
              notes="BERT-family; rotary, fused qkv, GeGLU MLP")
def gte(config: dict) -> EncoderSpec:
    """Post-LN like BERT under the gte prefix, but no position table: rotate_half rotary from rope_parameters; a
    fused biased attention.qkv_proj and o_proj, attn_ln / mlp_ln, an MLP whose bias-free mlp.up_gate_proj holds
    [up; gate] (down(act(gate) * up), down_proj biased), token types only when type_vocab_size > 0, and a head
    lm_head.dense -> gelu -> lm_head.norm -> tied decoder with its own bias. Names as transformers writes them."""
    spec = bert(dict(config, type_vocab_size=config.get("type_vocab_size", 1), pad_token_id=config.get("pad_token_id", 1)),
                "gte")
    return replace(spec, position=None, positions="rotary", rope_from_config=True,
                   token_type="token_type_embeddings" if spec.type_vocab_size else None,
                   qkv_proj="attention.qkv_proj", o_proj="attention.o_proj", attn_norm="attn_ln",
                   up_proj="mlp.up_gate_proj", fused_up_gate=True, fused_act_half=1, up_bias=False,
                   down_proj="mlp.down_proj", mlp_norm="mlp_ln", head_dense="lm_head.dense", head_norm="lm_head.norm",
                   head_act="gelu", decoder="lm_head.decoder", decoder_bias=None)


@architecture("squeezebert", norm="layer", status="verified",
              notes="BERT-family; grouped pointwise convolutions for the projections")
def squeezebert(config: dict) -> EncoderSpec:
    """BERT's post-LN block under the transformer prefix whose six projections are Conv1d of kernel 1 with channel
    groups (q_groups, k_groups, v_groups, post_attention_groups, intermediate_groups, output_groups): block-diagonal
    products. The pooler is unused by the masked-LM loss."""
    refuse("squeezebert", config, "embedding_size", lambda v: v in (None, config["hidden_size"]))
    spec = bert(config, "transformer")
    d = spec.hidden_size
    groups = tuple((role, int(config.get(key, default))) for role, key, default in (
        ("q", "q_groups", 4), ("k", "k_groups", 4), ("v", "v_groups", 4), ("o", "post_attention_groups", 1),
        ("up", "intermediate_groups", 4), ("down", "output_groups", 4)))
    return replace(spec, layers="transformer.encoder.layers", q_proj="attention.query", k_proj="attention.key",
                   v_proj="attention.value", o_proj="post_attention.conv1d", attn_norm="post_attention.layernorm",
                   up_proj="intermediate.conv1d", down_proj="output.conv1d", mlp_norm="output.layernorm",
                   pointwise_groups=groups, unused=(("transformer.pooler.dense.weight", (d, d)),
                                                    ("transformer.pooler.dense.bias", (d,))))


@architecture("xmod", norm="layer", status="verified",
              notes="BERT-family; the default language's adapter")
def xmod(config: dict) -> EncoderSpec:
    """XLM-R whose layers end with a language adapter: h = down(...) + residual, LN(h), then
    dense2(act(dense1(LN(h)))) plus LN(h) (ln_before_adapter; else plus h), and LN again. vkformers runs the
    adapter of config.default_language for every row (transformers' lang_ids default); the other languages'
    adapters are loaded and get a zero gradient (transformers runs them on no rows)."""
    arch = "xmod"
    refuse(arch, config, "pre_norm", lambda v: not v, False)
    refuse(arch, config, "adapter_layer_norm", lambda v: not v, False)
    refuse(arch, config, "adapter_reuse_layer_norm", lambda v: v, True)
    languages = [str(x) for x in (config.get("languages") or ["en_XX"])]
    default = config.get("default_language")
    if default is None or str(default) not in languages:
        raise UnsupportedConfigError(f"xmod: config option default_language={default!r} must name one of "
                                     f"{languages}; set it in config.json (vkformers runs that language's adapter)")
    spec = roberta(config, "roberta")
    return replace(spec, lang_adapter=f"output.adapter_modules.{default}",
                   adapter_size=int(spec.hidden_size // config.get("adapter_reduction_factor", 2)),
                   adapter_ln_before=bool(config.get("ln_before_adapter", True)),
                   idle_adapters=tuple(f"output.adapter_modules.{lang}" for lang in languages if lang != str(default)))


@architecture("fnet", norm="layer", status="verified",
              notes="BERT-family; Fourier token mixing instead of attention, no attention mask")
def fnet(config: dict) -> EncoderSpec:
    """BERT's post-LN block whose attention is Re(FFT2(x)) over positions and hidden (no weights; its norm
    fourier.output.LayerNorm), embeddings LayerNorm'd then projected (embeddings.projection), gelu_new, and no
    attention mask at all: padding mixes into every position, as in transformers. The pooler is unused by the
    masked-LM loss. use_tpu_fourier_optimizations (a DFT of tpu_short_seq_length) is refused."""
    refuse("fnet", config, "use_tpu_fourier_optimizations", lambda v: not v, False)
    spec = bert(dict(config, hidden_act=config.get("hidden_act", "gelu_new"), type_vocab_size=config.get(
        "type_vocab_size", 4), pad_token_id=config.get("pad_token_id", 3), num_attention_heads=1), "fnet")
    d = spec.hidden_size
    return replace(spec, mixing="fourier", reads_mask=False, q_proj=None, k_proj=None, v_proj=None, o_proj=None,
                   attn_norm="fourier.output.LayerNorm", embed_project="fnet.embeddings.projection",
                   unused=(("fnet.pooler.dense.weight", (d, d)), ("fnet.pooler.dense.bias", (d,))))


@architecture("longformer", norm="layer", status="verified",
              notes="BERT-family; sliding-window attention and global tokens")
def longformer(config: dict) -> EncoderSpec:
    """RoBERTa under the longformer prefix whose layer i attends to keys within attention_window[i] / 2 on both
    sides and to every global token (global_attention_mask 1, or attention_mask 2, as transformers); a global token
    attends to every token through the query/key/value_global projections, which run only when a batch holds global
    tokens; padded query rows attend to nothing (their attention output is zero)."""
    layers = config["num_hidden_layers"]
    windows = config.get("attention_window", 512)
    windows = [windows] * layers if isinstance(windows, int) else list(windows)
    if len(windows) != layers or any(w <= 0 or w % 2 for w in windows):
        raise UnsupportedConfigError(f"longformer: config option attention_window={config.get('attention_window')!r} "
                                     f"must be one positive even number or one per layer ({layers})")
    spec = roberta(config, "longformer")
    return replace(spec, layer_windows=tuple(w // 2 for w in windows),
                   global_projections=tuple(f"attention.self.{name}_global" for name in ("query", "key", "value")))


@architecture("mobilebert", norm="layer", status="verified",
              notes="bottlenecked blocks, NoNorm, trigram embeddings")
def mobilebert(config: dict) -> EncoderSpec:
    """MobileBERT: trigram word embeddings of embedding_size mapped to hidden (embedding_transformation), then
    positions, token types and NoNorm (x * weight + bias); each block works at intra_bottleneck_size between an
    input bottleneck (and a shared one for q and k) and an output bottleneck back to hidden, with extra
    feed-forward networks; the head's transform is BERT's (with a LayerNorm), its decoder the word embeddings for
    the first embedding_size features and cls.predictions.dense for the rest."""
    arch = "mobilebert"
    refuse(arch, config, "normalization_type", lambda v: v == "no_norm", "no_norm")
    refuse(arch, config, "use_bottleneck", lambda v: v, True)
    spec = bert(dict(config, hidden_act=config.get("hidden_act", "relu")), "mobilebert")
    size = int(config.get("intra_bottleneck_size", 128))
    return replace(spec, block="mobilebert", bottleneck_size=size,
                   bottleneck_attention=bool(config.get("use_bottleneck_attention", False)),
                   shared_qk_bottleneck=bool(config.get("key_query_shared_bottleneck", True)),
                   extra_ffns=int(config.get("num_feedforward_networks", 4)) - 1,
                   trigram_input=bool(config.get("trigram_input", True)), word_size=int(config.get("embedding_size", 128)),
                   embed_transform="mobilebert.embeddings.embedding_transformation",
                   split_decoder="cls.predictions.dense", head_act=config.get("hidden_act", "relu"))


@architecture("luke", norm="layer", status="verified",
              notes="BERT-family; word tokens only (no entity inputs)")
def luke(config: dict) -> EncoderSpec:
    """LUKE on word tokens alone: RoBERTa's embeddings and blocks under the luke prefix with an untied
    lm_head.decoder (own bias). Entity inputs are not taken, so the entity embeddings, the entity-aware queries
    (w2e, e2w, e2e), the entity prediction head and the pooler never run and get no gradient."""
    spec = roberta(dict(config, tie_word_embeddings=config.get("tie_word_embeddings", True)), "luke")
    d, layers = spec.hidden_size, spec.num_layers
    entity_size, entities = int(config.get("entity_emb_size", 256)), int(config.get("entity_vocab_size", 500000))
    e = "luke.entity_embeddings"
    idle = [(f"{e}.entity_embeddings.weight", (entities, entity_size)),
            (f"{e}.position_embeddings.weight", (spec.max_position_embeddings, d)),
            (f"{e}.token_type_embeddings.weight", (spec.type_vocab_size, d)),
            (f"{e}.LayerNorm.weight", (d,)), (f"{e}.LayerNorm.bias", (d,)),
            ("luke.pooler.dense.weight", (d, d)), ("luke.pooler.dense.bias", (d,)),
            ("entity_predictions.transform.dense.weight", (entity_size, d)),
            ("entity_predictions.transform.dense.bias", (entity_size,)),
            ("entity_predictions.transform.LayerNorm.weight", (entity_size,)),
            ("entity_predictions.transform.LayerNorm.bias", (entity_size,)), ("entity_predictions.bias", (entities,))]
    if entity_size != d:
        idle.append((f"{e}.entity_embedding_dense.weight", (d, entity_size)))
    if config.get("use_entity_aware_attention", True):
        idle += [(f"luke.encoder.layer.{i}.attention.self.{q}_query.{part}", shape) for i in range(layers)
                 for q in ("w2e", "e2w", "e2e") for part, shape in (("weight", (d, d)), ("bias", (d,)))]
    return replace(spec, decoder="lm_head.decoder", decoder_bias=None, tie_embeddings=False, unused=tuple(idle))


@architecture("convbert", norm="layer", status="verified",
              notes="BERT-family; span-based dynamic convolution beside self-attention")
def convbert(config: dict) -> EncoderSpec:
    """ConvBERT: ELECTRA's embeddings and generator head under the convbert prefix; attention on
    num_attention_heads / head_ratio heads of half width, concatenated with as many heads of span-based dynamic
    convolution (a separable convolution of the input times the query picks, per position and head, softmax weights
    over conv_kernel_size neighbours of conv_out_layer's output), then attention.output."""
    arch = "convbert"
    refuse(arch, config, "num_groups", lambda v: v == 1, 1)  # grouped feed-forward layers
    kernel = int(config.get("conv_kernel_size", 9))
    if kernel % 2 == 0:
        raise UnsupportedConfigError(f"convbert: config option conv_kernel_size={kernel} is not supported by "
                                     "vkformers' encoder yet (an odd size keeps the length)")
    spec = bert(config, "convbert")
    heads = max(spec.num_heads // int(config.get("head_ratio", 2)), 1)
    width = heads * ((spec.hidden_size // heads) // 2)
    if 2 * width != spec.hidden_size:
        raise UnsupportedConfigError(f"convbert: hidden_size {spec.hidden_size} does not split into {heads} "
                                     "attention and convolution heads of equal size")
    size = config.get("embedding_size", 768)
    return replace(spec, num_heads=heads, conv_kernel=kernel, conv_width=width, embedding_size=size,
                   embed_project="convbert.embeddings_project" if size != spec.hidden_size else None,
                   head_dense="generator_predictions.dense", head_norm="generator_predictions.LayerNorm",
                   head_act="gelu", decoder="generator_lm_head", decoder_bias=None)


# I-BERT's quantizer state, written beside every weight even when quant_mode is off
IBERT_QUANT_BUFFERS = (".act_scaling_factor", ".x_min", ".x_max", "LayerNorm.shift", ".weight_integer",
                       ".weight_scaling_factor", ".bias_integer", ".fc_scaling_factor")


@architecture("ibert", norm="layer", status="verified",
              notes="BERT-family; quant_mode off (float), as RoBERTa")
def ibert(config: dict) -> EncoderSpec:
    """RoBERTa under the ibert prefix when quant_mode is off (its integer kernels are then plain float ops); the
    quantizers' buffers in the checkpoint are skipped. quant_mode=True (integer-only inference) is refused."""
    refuse("ibert", config, "quant_mode", lambda v: not v, False)
    return replace(roberta(config, "ibert"), ignored_suffixes=IBERT_QUANT_BUFFERS)


# Spellings whose backbone is the model_type of a nested config (multimodal wrappers): they run as
# whatever architecture that names.
FAMILY.wrappers({
    "modernvbert": NESTED_TEXT_CONFIG,  # no explicit dispatcher arm; handled by the generic text_config fallback
})

# Canonical architecture name -> its variant, from the declarations above.
VARIANTS: dict[str, Callable[[dict], EncoderSpec | FunnelSpec]] = FAMILY.variants()


def encoder_spec(config: dict, architecture_name: str) -> EncoderSpec | FunnelSpec:
    """The spec of a config (already resolved to ``architecture_name``, its canonical name)."""
    try:
        variant = VARIANTS[architecture_name]
    except KeyError:
        raise UnsupportedConfigError(f"architecture {architecture_name!r} is registered by vkformers-bert but has "
                                     f"no encoder variant yet; implemented: {', '.join(sorted(VARIANTS))}") from None
    return variant(config)
