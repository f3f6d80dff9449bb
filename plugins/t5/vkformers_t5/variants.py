"""Per-architecture deltas: how each encoder-decoder's config.json fills a :class:`Seq2SeqSpec`.

One shared encoder-decoder (vkformers_t5.seq2seq) runs them all. A variant is its parent plus a
declared difference: ``mt5`` is ``t5`` with a gated feed-forward and no output rescale, ``umt5`` has a
relative position bias in every layer, ``mbart`` is ``bart`` with pre-LN and final layer norms,
``marian`` is ``bart`` with fixed sinusoidal positions and scaled embeddings, and so on. Parameter
names are Hugging Face's (two layouts: T5's ``encoder.block.0.layer.0.SelfAttention.q`` and
BART's ``model.encoder.layers.0.self_attn.q_proj``), so checkpoints load as they are.

A config option that changes the maths but is not implemented raises
:class:`UnsupportedConfigError` naming it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from vkformers.errors import VkformersError
from vkformers.models.family import Family

# The architectures of vkformers-t5, each declared once on its variant function (vkformers.models.family).
FAMILY = Family("t5", kind="encoder-decoder")
architecture = FAMILY.architecture


class UnsupportedConfigError(VkformersError, ValueError):
    """A config option of a known encoder-decoder that the shared model does not implement."""


@dataclass(frozen=True)
class Seq2SeqSpec:
    """Every knob of the shared encoder-decoder."""

    # -- sizes
    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    head_dim: int
    encoder_ffn: int
    decoder_ffn: int
    layout: str = "bart"                  # parameter names: a key of seq2seq.LAYOUTS (t5, bart, fsmt, ...)
    source_vocab_size: int | None = None  # FSMT: the encoder's own vocabulary (None: vocab_size)

    encoder_kv_heads: int | None = None   # grouped-query attention: key/value heads (None: as many as query heads)
    decoder_kv_heads: int | None = None

    # -- blocks
    norm: str = "layer"                   # layer | rms (T5LayerNorm: no mean subtraction, no bias)
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False        # rms: x * (1 + weight), as Gemma stores it
    sublayer_post_norm: bool = False      # x + post_norm(f(norm(x))) (T5Gemma's Gemma 2 sandwich); needs pre_norm
    pre_norm: bool = False                # x + f(norm(x)) (T5, mBART, Pegasus, ...) or norm(x + f(x)) (BART)
    final_norm: bool = False              # a norm after each stack's last layer
    activation: str = "gelu"
    gated_ffn: bool = False               # T5 v1.1: wo(act(wi_0 x) * wi_1 x)
    linear_bias: bool = True              # attention and feed-forward projections have biases
    attention_scale: float | None = None  # None: head_dim**-0.5; T5: 1.0
    attention_bias: bool | None = None    # q/k/v/o biases (None: linear_bias; PEGASUS-X: none, fc1/fc2 have them)
    attn_softcap: float = 0.0             # scores = c tanh(scores / c) in every attention (T5Gemma)
    final_softcap: float = 0.0            # the same on the logits
    encoder_windows: tuple[int, ...] = ()  # per layer: self-attention sliding window (0: full); empty: none.
    decoder_windows: tuple[int, ...] = ()  # encoder: |i - j| <= w (bidirectional); decoder: i - w < j <= i
    # LongT5's transient-global encoder: each layer also attends to one aggregate token per block of this many
    # input tokens (their normed sum), with a relative bias of (block - token's block) from layer 0's table
    transient_global_block: int = 0
    # LED's encoder (Longformer): tokens of a global_attention_mask attend to every key through their own
    # query/key/value_global projections, and every query attends to them besides its window
    encoder_global_attention: bool = False
    # PEGASUS-X's encoder: global_tokens learned tokens (embed_global) precede the input in every layer, with their
    # own pre-attention norm; block-local attention runs only when one local block covers the input, where it is
    # full attention over [global tokens; input] (longer inputs are refused)
    global_tokens: int = 0
    local_block: int = 0
    stagger_blocks: bool = False          # odd layers shift their blocks by half a block: the input must fit in half
    # Switch Transformers: these layers' feed-forward is a sparse top-1 mixture of experts (see seq2seq.SwitchMoE)
    encoder_sparse: tuple[bool, ...] = ()  # per encoder layer (empty: all dense)
    decoder_sparse: tuple[bool, ...] = ()
    num_experts: int = 0
    expert_capacity: int = 0              # tokens per expert and sequence (per forward call); later ones are dropped
    router_bias: bool = False
    # NLLB-MoE's sparse layers instead (see seq2seq.Top2MoE): top-2 routing over all the call's tokens, an expert
    # keeping at most ceil(fraction * tokens) of them (first choices before second ones, in token order)
    moe_top2: bool = False
    moe_capacity_fraction: float = 1.0
    moe_normalize_before_dropping: bool = False  # the two weights normalised before the capacity drops, not after
    moe_route_padding: bool = False       # router_ignore_padding_tokens: the encoder's pad tokens are routed too
    moe_output_scale: float = 1.0         # 1 - moe_token_dropout: transformers' experts' output in eval mode
    # ProphetNet's decoder: ngram predicting streams beside the main one (seq2seq.Block._ngram_self_attention), with
    # a relative bias projected from each query's hidden state (ngram_buckets buckets up to ngram_max_distance)
    ngram: int = 0
    ngram_buckets: int = 32
    ngram_max_distance: int = 128
    ngram_loss: bool = True               # the loss covers every stream (disable_ngram_loss: stream 0 only)
    label_smoothing: float = 0.0          # ProphetNet's eps
    cross_attention: bool = True          # the decoder attends to the encoder (False: ProphetNetForCausalLM's
    #                                       add_cross_attention=False, a decoder alone)

    # -- positions
    relative_buckets: int = 0             # T5 relative position bias (0: none)
    relative_max_distance: int = 128
    relative_bias_every_layer: bool = False  # umT5: each layer its own table; T5: layer 0's, shared
    rope: tuple = ()                      # (encoder config, decoder config) whose rope_parameters rotate q and k of
    #                                       self-attention (positions 0, 1, ... whatever the padding); empty: none
    positions: str | None = None          # learned | sinusoidal (Marian/Pegasus) | fairseq (M2M-100, FSMT) |
    #                                       fairseq_from_zero (PEGASUS-X: fairseq's table, rows 0, 1, ...) | None
    fairseq_table_trained: bool = False   # FSMT: the fairseq table is a parameter (embed_positions.weight, its
    #                                       pad row without gradient), read from the checkpoint when it has it
    fairseq_past_unmasked: bool = False   # FSMT: row = non-pad count * real + pad + past (M2M-100: the past is
    #                                       counted only for real tokens)
    position_offset: int = 0              # learned table row = position + offset (BART: 2)
    max_positions: int = 1024
    encoder_max_positions: int | None = None  # LED: the encoder's learned table has its own size (None: max_positions)

    # -- embeddings and head
    embed_scale: float = 1.0              # sqrt(d_model) with scale_embedding
    embed_norm: bool = False              # layernorm_embedding after the positions are added
    decoder_embed_norm_first: bool = False  # BlenderbotSmall's decoder: norm the token embeddings, then add positions
    final_logits_bias: bool = False       # a [1, vocab] buffer added to the logits
    pad_embedding_frozen: bool = False    # token embedding with padding_idx: pad tokens pass no gradient to it
    output_scale: float = 1.0             # T5: d_model**-0.5 before lm_head (scale_decoder_outputs)
    tie_lm_head: bool = True              # unless the checkpoint holds a distinct lm_head.weight

    # -- tokens
    pad_token_id: int = 0
    decoder_start_token_id: int | None = 0
    eos_token_id: int | list | None = None
    shift: str = "start"                  # start: [start] + labels[:-1]; wrap_last (mBART/PLBart): the last
    #                                       non-pad label first
    decoder_inputs_from_input_ids: bool = False  # BART: no decoder inputs and no labels -> shift input_ids
    decoder_pad_keys_masked: bool = False  # FSMT (fairseq): decoder self-attention ignores pad decoder tokens
    #                                        (forward without the cache, as transformers does when training)
    encoder_pads_masked: bool = False     # T5Gemma: without an attention_mask the encoder (only) masks pad tokens

    # -- T5Gemma 2
    qk_norm: bool = False                 # per-head RMSNorms q_norm / k_norm on queries and keys before rotary (the
    #                                       encoder's keys in cross-attention too)
    merged_cross_attention: bool = False  # the decoder's self-attention also attends to the encoder's keys, one
    #                                       softmax over both, through the same projections; no cross-attention block
    rope_layer_types: tuple = ()          # (encoder, decoder) layer types: rope_parameters hold one dict per type
    encoder_window_split: bool = False    # bidirectional window w: keys i - ((w + 1) // 2 - 1) .. i + w // 2
    #                                       (transformers' split), else |i - j| <= w
    eoi_token_id: int | None = None       # this token's embedding is the stack's eoi_embedding (unscaled)


def _get(config: dict, *names, default=None):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def refuse(arch: str, config: dict, option: str, supported, default=None) -> None:
    value = config.get(option, default)
    if not supported(value):
        raise UnsupportedConfigError(f"{arch}: config option {option}={value!r} is not supported by vkformers' "
                                     f"encoder-decoder yet")


# ---------------------------------------------------------------- T5 family

def t5_spec(config: dict, arch: str, *, every_layer_bias: bool = False, rescale: bool | None = None) -> Seq2SeqSpec:
    projection = str(config.get("feed_forward_proj", "relu"))
    parts = projection.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise UnsupportedConfigError(f"{arch}: feed_forward_proj={projection!r} is not 'ACT' or 'gated-ACT'")
    activation = "gelu_new" if projection == "gated-gelu" else parts[-1]
    if rescale is None:  # transformers 5: scale_decoder_outputs, saved from the tie_word_embeddings it was given
        rescale = bool(config["scale_decoder_outputs"]) if "scale_decoder_outputs" in config else \
            config.get("tie_word_embeddings", True) is not False
    d_model, heads = config["d_model"], config["num_heads"]
    layers = config["num_layers"]
    return Seq2SeqSpec(
        vocab_size=config["vocab_size"], d_model=d_model, encoder_layers=layers,
        decoder_layers=_get(config, "num_decoder_layers", default=layers), encoder_heads=heads, decoder_heads=heads,
        head_dim=config.get("d_kv", d_model // heads), encoder_ffn=config["d_ff"], decoder_ffn=config["d_ff"],
        layout="t5", norm="rms", norm_eps=config.get("layer_norm_epsilon", 1e-6), pre_norm=True, final_norm=True,
        activation=activation, gated_ffn=parts[0] == "gated" and len(parts) == 2, linear_bias=False,
        attention_scale=1.0, relative_buckets=config.get("relative_attention_num_buckets", 32),
        relative_max_distance=config.get("relative_attention_max_distance", 128),
        relative_bias_every_layer=every_layer_bias, positions=None,
        output_scale=d_model ** -0.5 if rescale else 1.0,
        pad_token_id=_get(config, "pad_token_id", default=0),
        decoder_start_token_id=_get(config, "decoder_start_token_id", "pad_token_id", default=0),
        eos_token_id=config.get("eos_token_id"), shift="start")


# ---------------------------------------------------------------- BART family

@architecture("bart", norm="layer", status="verified",
              notes="BART-layout; upstream claims HF forward-logit fixtures")
def bart_spec(config: dict, arch: str, **delta) -> Seq2SeqSpec:
    d_model = config["d_model"]
    spec = Seq2SeqSpec(
        vocab_size=config["vocab_size"], d_model=d_model,
        encoder_layers=config["encoder_layers"], decoder_layers=config["decoder_layers"],
        encoder_heads=config["encoder_attention_heads"], decoder_heads=config["decoder_attention_heads"],
        head_dim=d_model // config["encoder_attention_heads"],
        encoder_ffn=config["encoder_ffn_dim"], decoder_ffn=config["decoder_ffn_dim"], layout="bart",
        activation=config.get("activation_function", "gelu"),
        positions="learned", position_offset=2, max_positions=config.get("max_position_embeddings", 1024),
        embed_scale=math.sqrt(d_model) if config.get("scale_embedding", False) else 1.0,
        embed_norm=True, final_logits_bias=True, pad_embedding_frozen=True,
        tie_lm_head=config.get("tie_word_embeddings", True) is not False,
        pad_token_id=_get(config, "pad_token_id", default=1),
        decoder_start_token_id=_get(config, "decoder_start_token_id", "bos_token_id"),
        eos_token_id=config.get("eos_token_id"), decoder_inputs_from_input_ids=True)
    if d_model // config["decoder_attention_heads"] != spec.head_dim:
        raise UnsupportedConfigError(f"{arch}: encoder and decoder head sizes differ")
    return replace(spec, **delta)


@architecture("marian", norm="layer", status="verified",
              notes="not in upstream native dense-text-encoder set; BART-layout; sinusoidal positions")
def _marian(config, arch):
    refuse(arch, config, "share_encoder_decoder_embeddings", lambda v: v is not False, True)
    refuse(arch, config, "decoder_vocab_size", lambda v: v in (None, config["vocab_size"]))
    return bart_spec(config, arch, positions="sinusoidal", position_offset=0, embed_norm=False,
                     decoder_inputs_from_input_ids=False)


@architecture("fsmt", norm="layer", status="verified",
              notes="not in upstream native dense-text-encoder set; BART-layout; sinusoidal positions")
def _fsmt(config, arch):
    """FSMT (fairseq WMT19): post-LN BART layers without layernorm_embedding or final_logits_bias; separate
    source and target vocabularies (model.encoder/decoder.embed_tokens, no shared table); fairseq sinusoidal
    positions in a table that transformers trains (a parameter with padding_idx); the head is model.decoder.output_projection (tied to the decoder embedding only with
    tie_word_embeddings); labels shift with the last non-pad label wrapped first (its
    prepare_decoder_input_ids_from_labels)."""
    config = dict(config, vocab_size=config["tgt_vocab_size"])
    return bart_spec(config, arch, layout="fsmt", source_vocab_size=config["src_vocab_size"], positions="fairseq",
                     position_offset=0, fairseq_table_trained=True, fairseq_past_unmasked=True, embed_norm=False, final_logits_bias=False,
                     tie_lm_head=config.get("tie_word_embeddings", False) is True, shift="wrap_last",
                     decoder_inputs_from_input_ids=False, decoder_pad_keys_masked=True)


def _sparse_layers(layers: int, sparse: int) -> tuple[bool, ...]:
    """Switch Transformers' choice: every (layers // sparse)-th layer, from layer 1 (all when the step is 1)."""
    step = layers // sparse if sparse > 0 else layers
    return tuple((i % step == 1 or step == 1) if step > 0 else False for i in range(layers))


@architecture("longt5", norm="rms", status="verified",
              notes="T5-family; encoder local (|i - j| <= local_radius) or transient-global attention")
def _longt5(config, arch):
    """T5 whose encoder attends only to keys within local_radius of the query (its blocks of local_radius + 1
    tokens see their neighbour blocks, masked to that distance), with layer 0's relative bias; transient-global
    ("encoder_attention_type") adds, in each layer, one key per global_block_size tokens: the layer's
    global_input_layer_norm of their sum (orphan tokens of an incomplete last block join the block before),
    biased by the bucket of (global block - the query's block) from layer 0's global_relative_attention_bias."""
    kind = config.get("encoder_attention_type", "local")
    if kind not in ("local", "transient-global"):
        raise UnsupportedConfigError(f"{arch}: encoder_attention_type={kind!r} is not 'local' or 'transient-global'")
    spec = t5_spec(config, arch)
    tglobal = kind == "transient-global"
    return replace(spec, layout="longt5_tglobal" if tglobal else "longt5",
                   encoder_windows=(config.get("local_radius", 127),) * spec.encoder_layers,
                   transient_global_block=config.get("global_block_size", 16) if tglobal else 0)


@architecture("switch_transformers", norm="rms", moe=True, status="verified",
              notes="T5-family; relative position bias; upstream claims HF forward-logit fixtures")
def _switch(config, arch):
    """T5 (relu DenseActDense named ``mlp``) whose sparse layers route each token to one of num_experts
    experts (top-1 of a float32 softmax router), weighted by its router probability; an expert takes at most
    expert_capacity tokens of a sequence (in order), the rest skip the feed-forward. The loss is the
    cross-entropy only (transformers adds the router z/aux losses only with output_router_logits). The router's
    jitter noise (training only in transformers) is not applied."""
    refuse(arch, config, "router_dtype", lambda v: v == "float32", "float32")
    spec = t5_spec(dict(config, feed_forward_proj=config.get("dense_act_fn", "relu")), arch)
    decoder_layers = _get(config, "num_decoder_layers", default=config["num_layers"])
    return replace(spec, layout="switch",
                   encoder_sparse=_sparse_layers(config["num_layers"], config.get("num_sparse_encoder_layers", 3)),
                   decoder_sparse=_sparse_layers(decoder_layers, config.get("num_sparse_decoder_layers", 3)),
                   num_experts=config.get("num_experts", 8), expert_capacity=config.get("expert_capacity", 64),
                   router_bias=bool(config.get("router_bias", False)))


@architecture("pegasus_x", norm="layer", status="verified",
              notes=("not in upstream native dense-text-encoder set; BART-layout; sinusoidal positions; inputs longer "
                     "than one local attention block refused"))
def _pegasus_x(config, arch):
    return bart_spec(config, arch, pre_norm=True, final_norm=True, positions="fairseq_from_zero", position_offset=0,
                     embed_norm=False, final_logits_bias=False, attention_bias=False,
                     global_tokens=config.get("num_global_tokens", 32), local_block=config.get("block_size", 512),
                     stagger_blocks=bool(config.get("stagger_local_blocks", True)) and config["encoder_layers"] > 1,
                     decoder_inputs_from_input_ids=False)


@architecture("bigbird_pegasus", norm="layer", status="verified",
              notes="not in upstream native dense-text-encoder set; BART-layout; attention_type original_full only")
def _bigbird_pegasus(config, arch):
    """PEGASUS's pre-LN layers with learned positions from 0, scaled embeddings (scale_embedding defaults to
    true), final_logits_bias, and each stack's last norm named layernorm_embedding; q/k/v/o biases follow
    use_bias (fc1/fc2 always have them). The encoder's BigBird attention runs only as full attention."""
    if config.get("attention_type", "block_sparse") != "original_full":
        raise UnsupportedConfigError(
            f"{arch}: attention_type={config.get('attention_type', 'block_sparse')!r} is not supported: BigBird's "
            "block-sparse attention is not implemented; only attention_type='original_full' (full attention) runs")
    scale = math.sqrt(config["d_model"]) if config.get("scale_embedding", True) else 1.0
    return bart_spec(config, arch, layout="bigbird_pegasus", pre_norm=True, final_norm=True, position_offset=0,
                     embed_norm=False, embed_scale=scale, attention_bias=bool(config.get("use_bias", False)))


# the t5gemma spelling resolves here with its whole config
@architecture("t5_gemma_module", norm="rms", llama_layout=True, status="verified",
              notes=("native KV-cache generation; decoder module of t5gemma; runs the whole t5gemma config (encoder and"
                     " decoder must share hidden_size and head_dim)"),
              aliases=[
                  "t5gemma",  # decoder sub-config parsed as t5_gemma_module
              ])
def _t5gemma(config, arch):
    """T5Gemma: Gemma 2 stacks (T5GemmaModuleConfig each, under "encoder" and "decoder") as an encoder-decoder:
    (1 + w) RMSNorms before and after each sublayer, rotary self-attention (encoder bidirectional) with grouped
    key/value heads, query_pre_attn_scalar scaling, tanh soft-capping of attention scores and logits, sliding
    windows from layer_types (bidirectional |i - j| <= w in the encoder), a GeGLU feed-forward, embeddings
    scaled by sqrt(hidden); no shared table: the head (lm_head.out_proj) ties to the decoder's embeddings.
    Labels shift with decoder.bos_token_id first; the decoder ignores pad decoder tokens as transformers does
    when training (use_cache off)."""
    encoder, decoder = config.get("encoder"), config.get("decoder")
    if not isinstance(encoder, dict) or not isinstance(decoder, dict):
        raise UnsupportedConfigError(f"{arch}: a T5Gemma stack config alone is not a model; load the t5gemma "
                                     "config that holds it (encoder and decoder)")
    for option in ("hidden_size", "head_dim", "query_pre_attn_scalar", "attn_logit_softcapping", "rms_norm_eps",
                   "hidden_activation", "attention_bias"):
        if encoder.get(option) != decoder.get(option):
            raise UnsupportedConfigError(f"{arch}: encoder and decoder differ in {option} ({encoder.get(option)!r} "
                                         f"vs {decoder.get(option)!r}); vkformers' encoder-decoder shares it")

    def windows(stack):
        window = stack.get("sliding_window") or 0
        return tuple(window if t == "sliding_attention" else 0 for t in stack["layer_types"])

    d, bias = decoder["hidden_size"], bool(decoder.get("attention_bias", False))
    softcap = decoder.get("attn_logit_softcapping") or 0.0
    return Seq2SeqSpec(
        vocab_size=decoder["vocab_size"], source_vocab_size=encoder["vocab_size"], d_model=d,
        encoder_layers=encoder["num_hidden_layers"], decoder_layers=decoder["num_hidden_layers"],
        encoder_heads=encoder["num_attention_heads"], decoder_heads=decoder["num_attention_heads"],
        encoder_kv_heads=encoder["num_key_value_heads"], decoder_kv_heads=decoder["num_key_value_heads"],
        head_dim=decoder.get("head_dim") or d // decoder["num_attention_heads"],
        encoder_ffn=encoder["intermediate_size"], decoder_ffn=decoder["intermediate_size"], layout="t5gemma",
        norm="rms", norm_eps=decoder.get("rms_norm_eps", 1e-6), norm_unit_offset=True, pre_norm=True,
        sublayer_post_norm=True, final_norm=True, activation=decoder.get("hidden_activation", "gelu_pytorch_tanh"),
        gated_ffn=True, linear_bias=False, attention_bias=bias,
        attention_scale=decoder.get("query_pre_attn_scalar", 256) ** -0.5, attn_softcap=float(softcap),
        final_softcap=float(decoder.get("final_logit_softcapping") or 0.0),
        encoder_windows=windows(encoder), decoder_windows=windows(decoder), rope=(encoder, decoder),
        embed_scale=math.sqrt(d), pad_embedding_frozen=True,
        tie_lm_head=config.get("tie_word_embeddings", True) is not False,
        pad_token_id=_get(decoder, "pad_token_id", default=0), decoder_start_token_id=decoder.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"), decoder_pad_keys_masked=True, encoder_pads_masked=True)


@architecture("t5gemma2", norm="rms", status="verified",
              notes=("text model of T5Gemma2ForConditionalGeneration (no pixel_values; the vision tower's weights are "
                     "skipped); Gemma 3 stacks with the decoder's merged self/cross attention"))
def _t5gemma2(config, arch):
    """T5Gemma 2's text model as a delta of T5Gemma: Gemma 3 stacks (the encoder's under encoder.text_config) with
    per-head q_norm/k_norm, one rotary base per layer type, no attention soft-capping (transformers' attention never
    applies attn_logit_softcapping), sliding windows split around the query in the encoder; the decoder's merged
    attention (its own keys and the encoder's, k_norm on both, rotary on its own only, one softmax) replaces
    cross-attention; one embedding table (encoder, decoder and lm_head.out_proj) in which eoi_token_index reads
    eoi_embedding. No pad masking beyond the attention_mask: the decoder attends to pad decoder tokens."""
    encoder, decoder = config.get("encoder"), config.get("decoder")
    if not isinstance(encoder, dict) or not isinstance(encoder.get("text_config"), dict) or \
            not isinstance(decoder, dict):
        raise UnsupportedConfigError(f"{arch}: the config needs encoder.text_config and decoder (a T5Gemma2Config)")
    text = encoder["text_config"]
    if text.get("vocab_size") != decoder.get("vocab_size"):  # one table serves both stacks
        raise UnsupportedConfigError(f"{arch}: encoder and decoder differ in vocab_size ({text.get('vocab_size')!r} "
                                     f"vs {decoder.get('vocab_size')!r})")
    types = tuple(tuple(stack["layer_types"]) for stack in (text, decoder))
    spec = _t5gemma(dict(config, encoder=text, decoder=decoder), arch)
    eoi = config.get("eoi_token_index", encoder.get("eoi_token_index"))
    return replace(spec, layout="t5gemma2", source_vocab_size=None, attn_softcap=0.0, qk_norm=True,
                   merged_cross_attention=True, rope_layer_types=types, encoder_window_split=True,
                   eoi_token_id=eoi if eoi is not None and 0 <= eoi < spec.vocab_size else None,
                   decoder_pad_keys_masked=False, encoder_pads_masked=False,
                   tie_lm_head=config.get("tie_word_embeddings", True) is not False)


@architecture("led", norm="layer", status="verified",
              notes="BART-layout; encoder Longformer attention: sliding window and global_attention_mask tokens")
def _led(config, arch):
    """BART (post-LN, layernorm_embedding, final_logits_bias) under the led prefix with learned positions from 0
    (separate encoder and decoder table sizes) whose encoder self-attention is Longformer's: layer i's queries see
    the keys within attention_window[i] / 2, and the tokens a global_attention_mask marks attend to every key
    through query/key/value_global while every query attends to them (transformers pads the input to a multiple of
    the window with masked pad tokens, which changes nothing it returns)."""
    layers = config["encoder_layers"]
    windows = config.get("attention_window", 512)
    windows = [windows] * layers if isinstance(windows, int) else list(windows)
    if len(windows) != layers or any(w <= 0 or w % 2 for w in windows):
        raise UnsupportedConfigError(f"{arch}: config option attention_window={config.get('attention_window')!r} "
                                     f"must be one positive even number or one per encoder layer ({layers})")
    return bart_spec(dict(config, max_position_embeddings=config.get("max_decoder_position_embeddings", 1024)), arch,
                     layout="led", position_offset=0, encoder_windows=tuple(w // 2 for w in windows),
                     encoder_global_attention=True,
                     encoder_max_positions=config.get("max_encoder_position_embeddings", 16384))


@architecture("prophetnet", norm="layer", status="verified",
              model_class={"seq2seq-lm": "vkformers_t5.seq2seq:Seq2SeqForConditionalGeneration",
                           "base": "vkformers_t5.base:Seq2SeqModel",
                           "causal-lm": "vkformers_t5.prophetnet:ProphetNetForCausalLM"},
              notes="BART-layout post-LN; n-gram predicting streams in the decoder (logits from stream 0); the "
                    "decoder alone as ProphetNetForCausalLM")
def _prophetnet(config, arch):
    """ProphetNet: post-LN layers (feed_forward.intermediate/output), learned positions from pad + 1 (a table of
    max_position_embeddings rows), embeddings_layer_norm, one word_embeddings table tied everywhere. Its decoder runs
    the main stream and ngram predicting streams (ngram_embeddings[k - 1] plus the next position's embedding) through
    n-gram self-attention: the main stream causally over itself, stream k over the main stream's keys up to its
    position (k = 0) or before it, and its own key; a relative bias per query from relative_pos_embeddings. The logits
    are stream 0's; the loss is the mean cross-entropy over every stream's (the same labels), with eps label
    smoothing."""
    heads = config["num_encoder_attention_heads"]
    if config.get("num_decoder_attention_heads", heads) != heads:
        raise UnsupportedConfigError(f"{arch}: encoder and decoder head counts differ")
    refuse(arch, config, "ngram", lambda v: v >= 1, 2)  # the logits are predicting stream 0's
    pad = _get(config, "pad_token_id", default=0)
    rows = config.get("max_position_embeddings", 512)
    as_bart = dict(config, d_model=config["hidden_size"], encoder_layers=config["num_encoder_layers"],
                   decoder_layers=config["num_decoder_layers"], encoder_attention_heads=heads,
                   decoder_attention_heads=heads, pad_token_id=pad)
    return bart_spec(as_bart, arch, layout="prophetnet", position_offset=pad + 1, max_positions=rows - pad - 1,
                     final_logits_bias=False, decoder_inputs_from_input_ids=False,
                     ngram=config.get("ngram", 2), ngram_buckets=config.get("num_buckets", 32),
                     ngram_max_distance=config.get("relative_max_distance", 128),
                     ngram_loss=not config.get("disable_ngram_loss", False),
                     label_smoothing=float(config.get("eps", 0.0)),
                     cross_attention=bool(config.get("add_cross_attention", True)))


@architecture("mvp", norm="layer", status="verified",
              notes="BART-layout")
def _mvp(config, arch):
    refuse(arch, config, "use_prompt", lambda v: not v, False)  # prompt tables prepended to keys: not implemented
    return bart_spec(config, arch)


# Variants that are not named functions, declared here.
architecture("t5", norm="rms", status="verified",
             notes="T5-family; relative position bias; upstream claims HF forward-logit fixtures",
             variant=lambda c, a: t5_spec(c, a))
architecture("mt5", norm="rms", status="verified",
             notes="T5-family; relative position bias",
             variant=lambda c, a: t5_spec(c, a, rescale=False))  # transformers 5's mT5 never rescales
architecture("umt5", norm="rms", status="verified",
             notes="T5-family; relative position bias",
             variant=lambda c, a: t5_spec(c, a, every_layer_bias=True))
architecture("mbart", norm="layer", status="verified",
             notes="BART-layout",
             variant=lambda c, a: bart_spec(c, a, pre_norm=True, final_norm=True, shift="wrap_last"))
architecture("plbart", norm="layer", status="verified",
             notes="BART-layout",
             variant=lambda c, a: bart_spec(c, a, shift="wrap_last"))
architecture("blenderbot", norm="layer", status="verified",
             notes="BART-layout",
             variant=lambda c, a: bart_spec(c, a, pre_norm=True, final_norm=True, position_offset=0, embed_norm=False,
                                            decoder_inputs_from_input_ids=False))
architecture("blenderbot-small", norm="layer", status="verified",
             notes="not in upstream native dense-text-encoder set; BART-layout",
             variant=lambda c, a: bart_spec(c, a, position_offset=0, decoder_embed_norm_first=True,
                                            decoder_inputs_from_input_ids=False))
architecture("pegasus", norm="layer", status="verified",
             notes="BART-layout; sinusoidal positions",
             variant=lambda c, a: bart_spec(c, a, pre_norm=True, final_norm=True, positions="sinusoidal",
                                            position_offset=0, embed_norm=False, decoder_inputs_from_input_ids=False))


@architecture("m2m_100", norm="layer", status="verified",
              notes="BART-layout; sinusoidal positions")
def _m2m_100(config, arch, **delta):
    return bart_spec(config, arch, pre_norm=True, final_norm=True, positions="fairseq", position_offset=2,
                     embed_norm=False, final_logits_bias=False, decoder_inputs_from_input_ids=False, **delta)


@architecture("nllb-moe", norm="layer", moe=True, status="verified",
              notes=("M2M-100 with top-2 mixture-of-experts layers; reference: transformers 5.24 with its experts' "
                     "dispatch corrected (it runs expert_1 and expert_0 whatever the router chose)"))
def _nllb_moe(config, arch):
    """M2M-100 (pre-LN, fairseq sinusoidal positions, scaled embeddings) whose every encoder_sparse_step-th /
    decoder_sparse_step-th layer's feed-forward (``ffn``) is a top-2 mixture of num_experts fc1/fc2 experts with
    biases, under ``cross_attention`` / ``ff_layer_norm`` names. Eval-mode semantics, as every dropout here: an
    expert keeps ceil(moe_eval_capacity_token_fraction * tokens) tokens of a call (expert_capacity when the fraction
    is 0), and its output is scaled by 1 - moe_token_dropout. The loss is the cross-entropy only."""
    refuse(arch, config, "router_dtype", lambda v: v == "float32", "float32")
    refuse(arch, config, "second_expert_policy", lambda v: v == "all", "all")  # sampling/random: stochastic
    refuse(arch, config, "output_router_logits", lambda v: not v, False)  # would add the auxiliary loss
    fraction = float(config.get("moe_eval_capacity_token_fraction", 1.0))
    # batch-prioritised routing orders the tokens by router probability before the capacity drops; with a
    # fraction of 1 or more nothing is dropped and the order does not matter
    refuse(arch, config, "batch_prioritized_routing", lambda v: not v or fraction >= 1.0, False)
    def sparse(layers, step):
        return tuple((i + 1) % step == 0 if step > 0 else False for i in range(layers))
    return _m2m_100(config, arch, layout="nllb_moe", moe_top2=True,
                    encoder_sparse=sparse(config["encoder_layers"], config.get("encoder_sparse_step", 4)),
                    decoder_sparse=sparse(config["decoder_layers"], config.get("decoder_sparse_step", 4)),
                    num_experts=config.get("num_experts", 128), expert_capacity=config.get("expert_capacity", 64),
                    router_bias=bool(config.get("router_bias", False)), moe_capacity_fraction=fraction,
                    moe_normalize_before_dropping=bool(config.get("normalize_router_prob_before_dropping", False)),
                    moe_route_padding=bool(config.get("router_ignore_padding_tokens", False)),
                    moe_output_scale=1.0 - float(config.get("moe_token_dropout", 0.2)))

def _composed(config, arch):
    raise UnsupportedConfigError(f"{arch}: composed from registered encoder and decoder models "
                                 "(vkformers.models.encoder_decoder), not the shared encoder-decoder")


# transformers' EncoderDecoderModel: core composes the encoder's base model and the decoder's cross-attending causal
# LM, each from its own plugin
architecture("encoder-decoder", norm="layer", status="verified",
             notes=("any registered encoder whose plugin gives a base model + a decoder whose plugin gives a "
                    "cross-decoder (BERT, GPT-2 with add_cross_attention); generate decodes one token per step "
                    "over the decoder's cache"),
             model_class="vkformers.models.encoder_decoder:EncoderDecoderModel", variant=_composed)

# Canonical architecture name -> its variant, from the declarations above.
VARIANTS = FAMILY.variants()


def seq2seq_spec(config: dict, arch: str) -> Seq2SeqSpec:
    if arch not in VARIANTS:
        raise UnsupportedConfigError(f"{arch}: no encoder-decoder variant in vkformers-t5 yet "
                                     f"(implemented: {', '.join(sorted(VARIANTS))})")
    return VARIANTS[arch](config, arch)


# ---------------------------------------------------------------- position tables and buckets

def sinusoidal_table(rows: int, dim: int) -> np.ndarray:
    """Marian / Pegasus: [sin | cos] halves of pos / 10000^(2i / dim), from position 0 (computed in float64)."""
    position = np.arange(rows, dtype=np.float64)[:, None]
    inv = np.power(10000.0, 2 * (np.arange(dim) // 2) / dim)[None, :]
    angles = position / inv
    sentinel = dim // 2 + dim % 2
    table = np.empty((rows, dim), np.float32)
    table[:, :sentinel] = np.sin(angles[:, 0::2])
    table[:, sentinel:] = np.cos(angles[:, 1::2])
    return table


def fairseq_table(rows: int, dim: int, padding_idx: int | None) -> np.ndarray:
    """M2M-100: fairseq's [sin | cos] table (float32 maths), the padding row zero."""
    half = dim // 2
    step = np.float32(math.log(10000) / (half - 1))
    freqs = np.exp(np.arange(half, dtype=np.float32) * -step)
    angles = np.arange(rows, dtype=np.float32)[:, None] * freqs[None, :]
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    if dim % 2:
        table = np.concatenate([table, np.zeros((rows, 1), np.float32)], axis=1)
    if padding_idx is not None:
        table[padding_idx] = 0
    return table.astype(np.float32)


def transient_global_blocks(mask: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """LongT5's fixed global blocks of an int attention mask [B, T]: each token's block (int64 [B, T]; -1 for
    padding; an incomplete last block's tokens join the block before) and whether each of the T // block global
    tokens holds any token (bool [B, G]), as transformers' _make_global_fixed_block_ids computes them."""
    batch, length = mask.shape
    step = np.full((batch, length), 1.0 / block, np.float32)
    start = np.cumsum(step, axis=1, dtype=np.float32) - step
    ids = np.floor(np.where(mask != 0, 1.0, -1000.0).astype(np.float32) + start - 1.0).astype(np.int64)
    ids = np.maximum(ids, -1)
    ids = ids * mask + (mask - 1)
    ends = (np.arange(length) % block) == block - 1
    full = (ends[None, :] & (ids >= 0)).sum(-1, keepdims=True) - 1
    ids = np.where(ids < full, ids, full)
    count = length // block
    held = np.arange(count)[None, :] <= ids.max(-1, keepdims=True)
    return ids, held


def relative_buckets(query_positions: np.ndarray, key_length: int, *, bidirectional: bool, num_buckets: int,
                     max_distance: int) -> np.ndarray:
    """T5's bucket of (key position - query position) for every query/key pair, as int32 [Tq, Tk].

    Exact buckets for small distances, logarithmic ones up to max_distance (float32 maths as in
    transformers, so the boundaries fall where they do there); bidirectional (encoder) halves the
    buckets between keys before and after the query."""
    relative = np.arange(key_length, dtype=np.int64)[None, :] - query_positions.astype(np.int64)[:, None]
    buckets = np.zeros(relative.shape, np.int64)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    small = relative < max_exact
    with np.errstate(divide="ignore"):
        ratio = np.log(relative.astype(np.float32) / np.float32(max_exact)) / np.float32(
            math.log(max_distance / max_exact))
    large = max_exact + (ratio * np.float32(num_buckets - max_exact)).astype(np.float32)
    large = np.where(small, 0, large)  # log(0) = -inf where small: not used
    large = np.minimum(large.astype(np.int64), num_buckets - 1)
    buckets += np.where(small, relative, large)
    return buckets.astype(np.int32)
