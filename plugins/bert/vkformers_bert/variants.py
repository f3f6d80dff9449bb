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
    num_kv_heads: int | None = None          # grouped-query attention (EuroBERT)
    qk_norm: tuple[str, str] | None = None   # LayerNorms (no bias) over the whole q / k projections (ESMC)
    qk_norm_eps: float = 1e-5
    residual_scale: float = 1.0              # x + f(norm(x)) / residual_scale (ESMC: sqrt(layers / 36))
    first_attn_norm_identity: bool = False   # layer 0 has no attention norm (ModernBERT: the embeddings end normed)
    layer_windows: tuple[int, ...] = ()      # per layer: 0 full attention, w > 0 keys with |i - j| <= w (ModernBERT)
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


# ---------------------------------------------------------------- config readers

def refuse(arch: str, config: dict, option: str, supported: Callable[[object], bool], default=None) -> None:
    """Raise UnsupportedConfigError when config[option] (or its default) is a value we do not implement."""
    value = config.get(option, default)
    if not supported(value):
        raise UnsupportedConfigError(f"{arch}: config option {option}={value!r} is not supported by vkformers' "
                                     f"encoder yet")


def _common_refusals(arch: str, config: dict) -> None:
    refuse(arch, config, "is_decoder", lambda v: not v, False)
    refuse(arch, config, "add_cross_attention", lambda v: not v, False)
    # transformers 5 dropped relative position embeddings from BERT-likes; a checkpoint trained with them
    # would compute something else, so it is refused rather than run with absolute positions
    refuse(arch, config, "position_embedding_type", lambda v: v in (None, "absolute"))


@architecture("bert", norm="layer", status="verified",
              notes="BERT-family; upstream claims HF forward-logit fixtures")
def bert(config: dict, prefix: str = "bert") -> EncoderSpec:
    arch = config.get("model_type", "bert")
    _common_refusals(arch, config)
    return EncoderSpec(
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


# Spellings whose backbone is the model_type of a nested config (multimodal wrappers): they run as
# whatever architecture that names.
FAMILY.wrappers({
    "modernvbert": NESTED_TEXT_CONFIG,  # no explicit dispatcher arm; handled by the generic text_config fallback
})

# Canonical architecture name -> its variant, from the declarations above.
VARIANTS: dict[str, Callable[[dict], EncoderSpec]] = FAMILY.variants()


def encoder_spec(config: dict, architecture_name: str) -> EncoderSpec:
    """The spec of a config (already resolved to ``architecture_name``, its canonical name)."""
    try:
        variant = VARIANTS[architecture_name]
    except KeyError:
        raise UnsupportedConfigError(f"architecture {architecture_name!r} is registered by vkformers-bert but has "
                                     f"no encoder variant yet; implemented: {', '.join(sorted(VARIANTS))}") from None
    return variant(config)
