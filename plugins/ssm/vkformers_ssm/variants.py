"""State-space architectures, each declared once on the variant function that reads its config into a
:class:`MambaSpec` (the knobs of the shared Mamba model, ``vkformers_ssm/model.py``)."""
from __future__ import annotations

import math

import numpy as np
from dataclasses import replace
from typing import Callable

from vkformers.errors import VkformersError
from vkformers.models.family import Family

from vkformers.models.decoder.lightning import LightningAttention
from vkformers.models.decoder.rglru import RecurrentBlock
from vkformers.models.decoder.short_conv import ShortConv
from vkformers.models.decoder.spec import (AttentionSpec, DecoderSpec, LinearAttentionSpec, MLPSpec, NormSpec,
                                           PositionSpec, first_of, padding_idx, sliding_windows)

from vkformers_moe.block import MoeSpec
from vkformers_moe.variants import granitemoeshared, mixtral

from vkformers_ssm.layers import (ParallelMambaLayer, ParallelMultipliers, ScaledResidualLayer, ScaledResiduals,
                                  SharedBlockLayer, SharedBlocks, SingleMixerBlock)
from vkformers_ssm.mixers import MambaSpec, mixer_module
from vkformers_ssm.rwkv import RwkvChannelMixes, RwkvLayer, RwkvTimeMix
from vkformers_ssm.xlstm import MLstmLayer

FAMILY = Family("ssm", kind="causal-decoder", norm="rms")
architecture = FAMILY.architecture


class UnsupportedConfigError(VkformersError, ValueError):
    """A config option the shared state-space model does not implement."""


def refuse(arch: str, config: dict, option: str, supported: Callable[[object], bool], default=None) -> None:
    value = config.get(option, default)
    if not supported(value):
        raise UnsupportedConfigError(f"{arch}: {option}={value!r} is not supported by vkformers-ssm; "
                                     "use a checkpoint without it")


def _time_step_rank(config: dict) -> int:
    rank = config.get("time_step_rank", "auto")
    return math.ceil(config["hidden_size"] / 16) if rank == "auto" else int(rank)


@architecture("mamba", status="verified",
              notes="selective scan, causal depthwise conv1d kernels; recurrent state cache for generation")
def mamba(config: dict) -> MambaSpec:
    refuse("mamba", config, "hidden_act", lambda v: v == "silu", "silu")
    refuse("mamba", config, "conv_kernel", lambda v: int(v) >= 2, 4)
    hidden = config["hidden_size"]
    return MambaSpec(
        vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=config["num_hidden_layers"],
        intermediate_size=config.get("intermediate_size") or int(config.get("expand", 2) * hidden),
        state_size=config.get("state_size", 16), conv_kernel=config.get("conv_kernel", 4),
        time_step_rank=_time_step_rank(config), norm_eps=config.get("layer_norm_epsilon", 1e-5),
        use_bias=bool(config.get("use_bias", False)), use_conv_bias=bool(config.get("use_conv_bias", True)),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        residual_in_fp32=bool(config.get("residual_in_fp32", True)))


@architecture("falcon_mamba", status="verified", notes="Mamba with weightless RMSNorms of dt, B and C")
def falcon_mamba(config: dict) -> MambaSpec:
    return replace(mamba(config), bcdt_norm_eps=config.get("mixer_rms_eps", 1e-6))


@architecture("mamba2", status="verified",
              notes="Mamba-2 on the selective-scan kernel (B, C in groups; per-head A, D, dt); gated group RMSNorm")
def mamba2(config: dict) -> MambaSpec:
    refuse("mamba2", config, "hidden_act", lambda v: v == "silu", "silu")
    refuse("mamba2", config, "conv_kernel", lambda v: int(v) >= 2, 4)
    refuse("mamba2", config, "chunk_size", lambda v: int(v) >= 1, 256)
    refuse("mamba2", config, "time_step_limit", lambda v: list(v) == [0.0, float("inf")], (0.0, float("inf")))
    hidden = config["hidden_size"]
    inner = int(config.get("expand", 2) * hidden)
    heads, head_dim, groups = config.get("num_heads", 128), config.get("head_dim", 64), config.get("n_groups", 8)
    if heads * head_dim != inner or heads % groups:
        raise UnsupportedConfigError(f"mamba2: num_heads {heads} x head_dim {head_dim} must equal expand x "
                                     f"hidden_size ({inner}), and num_heads split in n_groups ({groups}); "
                                     "fix the config")
    return MambaSpec(
        vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=config["num_hidden_layers"],
        intermediate_size=inner, state_size=config.get("state_size", 128), conv_kernel=config.get("conv_kernel", 4),
        time_step_rank=0, norm_eps=config.get("layer_norm_epsilon", 1e-5),
        use_bias=bool(config.get("use_bias", False)), use_conv_bias=bool(config.get("use_conv_bias", True)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        residual_in_fp32=bool(config.get("residual_in_fp32", True)),
        mamba2=True, num_heads=heads, head_dim=head_dim, n_groups=groups, chunk_size=int(config.get("chunk_size", 256)))


# -- hybrids: the decoder kit's layers with Mamba mixers on some of them (vkformers_ssm.model.HybridForCausalLM)

HYBRID_MODEL = "vkformers_ssm.model:HybridForCausalLM"


def _mamba2_mixer(arch: str, config: dict, hidden: int, *, inner: int, heads: int, head_dim: int, groups: int,
                  state: int, kernel: int, chunk: int, eps: float, bias: bool, conv_bias: bool) -> MambaSpec:
    """A hybrid layer's Mamba-2 mixer, from the sizes its config names under its own spellings."""
    refuse(arch, config, "time_step_limit", lambda v: v is None or list(v) == [0.0, float("inf")], None)
    if heads * head_dim != inner or heads % groups or kernel < 2 or chunk < 1:
        raise UnsupportedConfigError(f"{arch}: {heads} mamba heads x head dim {head_dim} must equal the mamba "
                                     f"width ({inner}), split in {groups} groups, with a conv kernel of 2 or more; "
                                     "fix the config")
    return MambaSpec(vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=config["num_hidden_layers"],
                     intermediate_size=inner, state_size=state, conv_kernel=kernel, time_step_rank=0, norm_eps=eps,
                     use_bias=bias, use_conv_bias=conv_bias, mamba2=True, num_heads=heads, head_dim=head_dim,
                     n_groups=groups, chunk_size=chunk)


def _hybrid_decoder(config: dict, mamba_layers, mixer: MambaSpec, **changes) -> DecoderSpec:
    """A Llama-like decoder spec (GQA softmax attention with rotary, gated MLP, RMSNorms) whose layers marked in
    ``mamba_layers`` run ``mixer`` (at the layer's ``mamba``) instead of attention."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    attention_bias = bool(config.get("attention_bias", False))
    layers = config["num_hidden_layers"]
    spec = DecoderSpec(
        vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=first_of(config, "num_key_value_heads", default=heads),
        head_dim=first_of(config, "head_dim", default=hidden // heads),
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), embed_padding_idx=padding_idx(config),
        norms=NormSpec(eps=config.get("rms_norm_eps", 1e-6)), hidden_act=config.get("hidden_act", "silu"),
        attention=AttentionSpec(q_bias=attention_bias, k_bias=attention_bias, v_bias=attention_bias,
                                o_bias=attention_bias),
        mlp=MLPSpec(bias=bool(config.get("mlp_bias", False))),
        # the slot's head sizes are Gated DeltaNet's, which a Mamba module does not read
        linear_attention=LinearAttentionSpec(layers=tuple(bool(m) for m in mamba_layers), k_heads=1, v_heads=1,
                                             k_dim=1, v_dim=1, path="mamba", module=mixer_module(mixer)),
        extra={"mamba": mixer})
    return replace(spec, **changes)



def _mamba_fields_mixer(arch: str, config: dict, hidden: int, *, default_eps: float):
    """The Mamba-2 mixer of a hybrid whose config names its fields mamba_* (Bamba, GraniteMoeHybrid)."""
    heads, inner = config.get("mamba_n_heads", 128), int(config.get("mamba_expand", 2) * hidden)
    head_dim = config.get("mamba_d_head", "auto")
    return _mamba2_mixer(arch, config, hidden, inner=inner, heads=heads,
                         head_dim=inner // heads if head_dim == "auto" else int(head_dim),
                         groups=config.get("mamba_n_groups", 1), state=config.get("mamba_d_state", 256),
                         kernel=config.get("mamba_d_conv", 4), chunk=config.get("mamba_chunk_size", 256),
                         eps=config.get("rms_norm_eps", default_eps), bias=bool(config.get("mamba_proj_bias", False)),
                         conv_bias=bool(config.get("mamba_conv_bias", True)))

@architecture("bamba", status="verified", model_class=HYBRID_MODEL,
              notes="Mamba-2 and attention layers (attn_layer_indices) on the decoder kit; per-layer conv and scan "
                    "states on the KV cache")
def bamba(config: dict) -> DecoderSpec:
    refuse("bamba", config, "hidden_act", lambda v: v == "silu", "silu")  # also the mixer's conv activation
    refuse("bamba", config, "z_loss_coefficient", lambda v: not v, 0.0)
    hidden = config["hidden_size"]
    mixer = _mamba_fields_mixer("bamba", config, hidden, default_eps=1e-5)
    attention_layers = set(config.get("attn_layer_indices") or ())
    # BambaConfig fixes rotary to half of each head whatever the config file says
    rope_config = dict(config, partial_rotary_factor=0.5)
    if isinstance(config.get("rope_parameters"), dict):
        rope_config["rope_parameters"] = dict(config["rope_parameters"], partial_rotary_factor=0.5)
    spec = _hybrid_decoder(config, [i not in attention_layers for i in range(config["num_hidden_layers"])], mixer,
                           mlp_in_norm="pre_ff_layernorm", final_norm="model.final_layernorm")
    return replace(spec, mlp=replace(spec.mlp, path="feed_forward"),
                   positions=replace(spec.positions, rope_configs=((rope_config, None),) * spec.num_layers))


@architecture("falcon_h1", status="verified", model_class=HYBRID_MODEL,
              notes="Mamba-2 mixer and attention in parallel in every layer, with Falcon-H1's muP multipliers")
def falcon_h1(config: dict) -> DecoderSpec:
    refuse("falcon_h1", config, "hidden_act", lambda v: v == "silu", "silu")
    hidden, heads = config["hidden_size"], config.get("mamba_n_heads", 128)
    inner = config.get("mamba_d_ssm", 1024)
    inner = int(config.get("mamba_expand", 2) * hidden) if inner is None else int(inner)
    head_dim = config.get("mamba_d_head", "auto")
    gated_norm = (("before_gate" if config.get("mamba_norm_before_gate", True) else "after_gate")
                  if config.get("mamba_rms_norm", False) else None)
    ssm_multipliers = config.get("ssm_multipliers") or (1.0,) * 5
    mixer = replace(
        _mamba2_mixer("falcon_h1", config, hidden, inner=inner, heads=heads,
                      head_dim=inner // heads if head_dim == "auto" else int(head_dim),
                      groups=config.get("mamba_n_groups", 1), state=config.get("mamba_d_state", 256),
                      kernel=config.get("mamba_d_conv", 4), chunk=config.get("mamba_chunk_size", 256),
                      eps=config.get("rms_norm_eps", 1e-5), bias=bool(config.get("mamba_proj_bias", False)),
                      conv_bias=bool(config.get("mamba_conv_bias", True))),
        gated_norm=gated_norm, in_multiplier=float(config.get("ssm_in_multiplier", 1.0)),
        proj_multipliers=None if all(m == 1.0 for m in ssm_multipliers) else tuple(map(float, ssm_multipliers)))
    if bool(config.get("projectors_bias", False)) != bool(config.get("mamba_proj_bias", False)):
        raise UnsupportedConfigError("falcon_h1: projectors_bias (the mixer's out_proj bias) must equal "
                                     "mamba_proj_bias (its in_proj bias) in vkformers-ssm; use such a checkpoint")
    gate, down = config.get("mlp_multipliers") or (1.0, 1.0)
    multipliers = ParallelMultipliers(
        attention_in=float(config.get("attention_in_multiplier", 1.0)),
        attention_out=float(config.get("attention_out_multiplier", 1.0)),
        ssm_out=float(config.get("ssm_out_multiplier", 1.0)), mlp_gate=float(gate), mlp_down=float(down))
    spec = _hybrid_decoder(config, [False] * config["num_hidden_layers"], mixer,
                           mlp_in_norm="pre_ff_layernorm", final_norm="model.final_layernorm",
                           embed_scale=float(config.get("embedding_multiplier", 1.0)),
                           logits_scale=float(config.get("lm_head_multiplier", 1.0)),
                           make_layer=ParallelMambaLayer)
    # key_multiplier scales the keys: the same scores as the softmax scale times it
    key_scale = spec.head_dim ** -0.5 * float(config.get("key_multiplier", 1.0))
    return replace(spec, mlp=replace(spec.mlp, path="feed_forward"), linear_attention=None,
                   attention=replace(spec.attention, scales=(key_scale,) * spec.num_layers),
                   extra=dict(spec.extra, multipliers=multipliers))


NEMOTRON_H_BLOCKS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe",
                     "M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


@architecture("nemotron_h", status="verified", model_class=HYBRID_MODEL,
              notes="a pattern of Mamba-2, attention (no rotary) and relu2 MLP blocks, one mixer each; "
                    "mixture-of-experts blocks refused")
def nemotron_h(config: dict) -> DecoderSpec:
    types = config.get("layers_block_type") or config.get("layer_types") or list(
        config.get("hybrid_override_pattern") or "")
    if not types:
        raise UnsupportedConfigError("nemotron_h: the config names no layers_block_type (nor hybrid_override_pattern); "
                                     "fix the config")
    blocks = tuple(NEMOTRON_H_BLOCKS.get(t, t) for t in types)
    if "moe" in blocks:
        raise UnsupportedConfigError("nemotron_h: mixture-of-experts blocks (layers_block_type 'moe') are not "
                                     "supported by vkformers-ssm yet; use a checkpoint without them")
    refuse("nemotron_h", config, "mamba_hidden_act", lambda v: v == "silu", "silu")
    refuse("nemotron_h", config, "sliding_window", lambda v: v is None, None)
    refuse("nemotron_h", config, "residual_in_fp32", lambda v: not v, False)
    refuse("nemotron_h", config, "num_nextn_predict_layers", lambda v: not v, 0)
    config = dict(config, num_hidden_layers=len(blocks), rms_norm_eps=config.get("layer_norm_epsilon", 1e-5),
                  hidden_act=config.get("mlp_hidden_act", "relu2"))
    hidden = config["hidden_size"]
    heads, head_dim = config.get("mamba_num_heads", 128), config.get("mamba_head_dim", 64)
    bias = bool(config.get("use_bias", False))
    # transformers' Nemotron-H reads no time_step_limit: its mixer's limit is (time_step_min, inf), dt_min below
    mixer = _mamba2_mixer("nemotron_h", dict(config, time_step_limit=None), hidden, inner=heads * head_dim, heads=heads, head_dim=head_dim,
                          groups=config.get("n_groups", 8), state=config.get("ssm_state_size", 128),
                          kernel=config.get("conv_kernel", 4), chunk=config.get("chunk_size", 128),
                          eps=config.get("layer_norm_epsilon", 1e-5), bias=bias,
                          conv_bias=bool(config.get("use_conv_bias", True)))
    mixer = replace(mixer, dt_min=float(config.get("time_step_min", 0.001)))
    spec = _hybrid_decoder(config, [False] * len(blocks), mixer, embed="backbone.embeddings",
                           layers="backbone.layers", final_norm="backbone.norm_f",
                           embed_padding_idx=None, make_layer=SingleMixerBlock, linear_attention=None)
    return replace(spec, positions=replace(spec.positions, rope=False),  # q/k/v/o without biases whatever the config
                   attention=replace(spec.attention, q_bias=False, k_bias=False, v_bias=False, o_bias=False),
                   mlp=replace(spec.mlp, kind="plain", bias=bool(config.get("mlp_bias", False))),
                   extra=dict(spec.extra, block_types=blocks))


@architecture("jamba", status="verified", model_class=HYBRID_MODEL,
              notes="Mamba-1 (weighted dt/B/C norms) and attention layers, sparse feed_forward blocks "
                    "(vkformers-moe's MoeSpec) every expert_layer_period layers")
def jamba(config: dict) -> DecoderSpec:
    refuse("jamba", config, "hidden_act", lambda v: v == "silu", "silu")
    refuse("jamba", config, "output_router_logits", lambda v: not v, False)  # its auxiliary loss is not in ours
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    rank = config.get("mamba_dt_rank", "auto")
    eps = config.get("rms_norm_eps", 1e-6)
    mixer = MambaSpec(
        vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=layers,
        intermediate_size=int(config.get("mamba_expand", 2) * hidden), state_size=config.get("mamba_d_state", 16),
        conv_kernel=config.get("mamba_d_conv", 4), time_step_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        norm_eps=eps, use_bias=bool(config.get("mamba_proj_bias", False)),
        use_conv_bias=bool(config.get("mamba_conv_bias", True)), bcdt_norm_eps=eps, bcdt_norm_weights=True)
    if mixer.conv_kernel < 2:
        raise UnsupportedConfigError("jamba: mamba_d_conv must be 2 or more; fix the config")
    attention = [i % config.get("attn_layer_period", 8) == config.get("attn_layer_offset", 4) for i in range(layers)]
    experts = config.get("num_experts", 16)
    sparse = tuple(experts > 1 and i % config.get("expert_layer_period", 2) == config.get("expert_layer_offset", 1)
                   for i in range(layers))
    spec = _hybrid_decoder(config, [not a for a in attention], mixer, mlp_in_norm="pre_ff_layernorm",
                           final_norm="model.final_layernorm")
    moe = MoeSpec(num_experts=experts, top_k=config.get("num_experts_per_tok", 2), expert_size=spec.intermediate_size,
                  layers=sparse, hidden_act=spec.hidden_act, path="feed_forward", router="router") if any(sparse) \
        else None
    return replace(spec, mlp=replace(spec.mlp, path="feed_forward", bias=False), moe=moe,  # no biases in Jamba
                   attention=replace(spec.attention, q_bias=False, k_bias=False, v_bias=False, o_bias=False),
                   positions=replace(spec.positions, rope=False))


@architecture("granitemoehybrid", status="verified", model_class=HYBRID_MODEL,
              notes="GraniteMoeShared (vkformers-moe's variant: multipliers, sparse block, shared MLP) with Mamba-2 "
                    "mixers on its linear_attention layers")
def granitemoehybrid(config: dict) -> DecoderSpec:
    refuse("granitemoehybrid", config, "hidden_act", lambda v: v == "silu", "silu")  # also the mixer's conv activation
    refuse("granitemoehybrid", config, "position_embedding_type", lambda v: v in (None, "nope", "rope"), None)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    types = config.get("layer_types") or config.get("layers_block_type") or ["linear_attention"] * layers
    mamba_layers = [t in ("linear_attention", "mamba") for t in types]
    mixer = _mamba_fields_mixer("granitemoehybrid", config, hidden, default_eps=1e-6)
    if not config.get("num_local_experts", 8):
        raise UnsupportedConfigError("granitemoehybrid: num_local_experts=0 (the shared MLP alone) is not supported "
                                     "by vkformers-ssm yet; use a checkpoint with experts")
    spec = granitemoeshared(config)
    linear = LinearAttentionSpec(layers=tuple(mamba_layers), k_heads=1, v_heads=1, k_dim=1, v_dim=1, path="mamba",
                                 module=mixer_module(mixer))
    return replace(spec, linear_attention=linear, extra=dict(spec.extra, mamba=mixer),
                   positions=replace(spec.positions, rope=config.get("position_embedding_type") == "rope"))


def _zamba_block_types(arch: str, config: dict) -> tuple[str, ...]:
    """Zamba's and Zamba2's layers, "hybrid" (a shared transformer block before the Mamba layer) or "mamba"."""
    layers = config["num_hidden_layers"]
    types = config.get("layers_block_type") or config.get("layer_types")
    if not types:
        period, offset = config.get("attn_layer_period", 6), config.get("attn_layer_offset", 4)
        types = ["mamba", "mamba", "hybrid"] + ["hybrid" if i % period == offset else "mamba"
                                                for i in range(layers - 3)]
    types = tuple("hybrid" if t == "hybrid" else "mamba" for t in types)
    if len(types) != layers:
        raise UnsupportedConfigError(f"{arch}: layers_block_type names {len(types)} layers for num_hidden_layers "
                                     f"{layers}; fix the config")
    return types


def _shared_block_decoder(arch: str, config: dict, mixer: MambaSpec, shared: SharedBlocks) -> DecoderSpec:
    """Zamba's decoder: every layer a Mamba layer, the hybrid ones first running a shared transformer block over
    [stream | token embeddings] (vkformers_ssm.layers.SharedBlockLayer), whose attention has no rotary and the
    scale (head_dim / 2)^-1/2."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("attention_head_dim") or 2 * hidden // heads
    config = dict(config, head_dim=head_dim)  # also the rotary's (Zamba2's use_mem_rope)
    spec = _hybrid_decoder(config, [False] * config["num_hidden_layers"], mixer,
                           mlp_in_norm="pre_ff_layernorm", final_norm="model.final_layernorm",
                           make_layer=SharedBlockLayer, linear_attention=None,
                           shared_modules=shared.owners("model.layers"),
                           tie_embeddings=bool(config.get("tie_word_embeddings", True)))
    return replace(spec, mlp=replace(spec.mlp, path="feed_forward"),
                   positions=replace(spec.positions, rope=False, rope_configs=((config, None),) * spec.num_layers),
                   attention=replace(spec.attention, q_bias=False, k_bias=False, v_bias=False, o_bias=False,
                                     in_width=int(config.get("attention_hidden_size") or 2 * hidden),
                                     scales=((head_dim / 2) ** -0.5,) * spec.num_layers),
                   extra=dict(spec.extra, shared_blocks=shared))


@architecture("zamba", status="verified", model_class=HYBRID_MODEL,
              notes="multi-head Mamba-1 layers; hybrid layers first run one shared transformer block (core's "
                    "SharedTransformerBlock, tied across them) over [stream | token embeddings]")
def zamba(config: dict) -> DecoderSpec:
    refuse("zamba", config, "hidden_mamba_act", lambda v: v == "silu", "silu")
    hidden = config["hidden_size"]
    rank = config.get("mamba_dt_rank", "auto")
    heads = config.get("n_mamba_heads", 2)
    mixer = MambaSpec(
        vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=config["num_hidden_layers"],
        intermediate_size=int(config.get("mamba_expand", 2) * hidden), state_size=config.get("mamba_d_state", 16),
        conv_kernel=config.get("mamba_d_conv", 4), time_step_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        norm_eps=config.get("rms_norm_eps", 1e-5), use_bias=bool(config.get("mamba_proj_bias", False)),
        use_conv_bias=bool(config.get("mamba_conv_bias", True)), mamba1_heads=heads)
    if mixer.intermediate_size % heads or mixer.conv_kernel < 2:
        raise UnsupportedConfigError(f"zamba: n_mamba_heads ({heads}) must divide mamba_expand x hidden_size "
                                     f"({mixer.intermediate_size}) and mamba_d_conv be 2 or more; fix the config")
    config = dict(config, hidden_act=config.get("hidden_act", "gelu"), rms_norm_eps=config.get("rms_norm_eps", 1e-5))
    return _shared_block_decoder("zamba", config, mixer, SharedBlocks(_zamba_block_types("zamba", config)))


@architecture("zamba2", status="verified", model_class=HYBRID_MODEL,
              notes="Zamba with Mamba-2 mixers; num_mem_blocks shared blocks in turn, per-use low-rank adapters on "
                    "q/k/v and the fused gate_up, optional rotary (use_mem_rope)")
def zamba2(config: dict) -> DecoderSpec:
    refuse("zamba2", config, "use_long_context", lambda v: not v, False)
    hidden, heads = config["hidden_size"], config.get("n_mamba_heads", 8)
    inner = int(config.get("mamba_expand", 2) * hidden)
    bias = bool(config.get("add_bias_linear", False))
    # transformers' Zamba2 reads no time_step_limit: its mixer's limit is (time_step_min, inf), dt_min below
    mixer = _mamba2_mixer("zamba2", dict(config, time_step_limit=None), hidden, inner=inner, heads=heads,
                          head_dim=inner // heads, groups=config.get("mamba_ngroups", 1),
                          state=config.get("mamba_d_state", 64), kernel=config.get("mamba_d_conv", 4),
                          chunk=config.get("chunk_size", 256), eps=1e-5, bias=bias, conv_bias=True)
    mixer = replace(mixer, dt_min=float(config.get("time_step_min", 0.001)))
    attention_heads = config.get("num_attention_heads", 32)
    config = dict(config, hidden_act=config.get("hidden_act", "gelu"), rms_norm_eps=config.get("rms_norm_eps", 1e-5),
                  intermediate_size=config.get("intermediate_size") or 4 * hidden,
                  attention_head_dim=2 * hidden // attention_heads, attention_hidden_size=2 * hidden)
    shared = SharedBlocks(_zamba_block_types("zamba2", config), path="shared_transformer",
                          num_blocks=int(config.get("num_mem_blocks", 1)), adapter_rank=int(config.get("adapter_rank", 128)),
                          attention_adapters=bool(config.get("use_shared_attention_adapter", False)), mlp_adapters=True)
    spec = _shared_block_decoder("zamba2", config, mixer, shared)
    if shared.attention_adapters and spec.num_kv_heads != spec.num_heads:
        raise UnsupportedConfigError("zamba2: attention adapters need num_key_value_heads equal to "
                                     "num_attention_heads (their outputs are 2 x hidden_size wide); fix the config")
    return replace(spec, positions=replace(spec.positions, rope=bool(config.get("use_mem_rope", False))),
                   mlp=replace(spec.mlp, gate_up_proj="gate_up_proj", bias=bias))


def _lfm2_mlp_width(config: dict) -> int:
    """LFM2's feed-forward width: with block_auto_adjust_ff_dim, 2/3 of intermediate_size times
    block_ffn_dim_multiplier, rounded up to block_multiple_of (transformers' Lfm2MLP)."""
    width = config.get("block_ff_dim") or config["intermediate_size"]
    if config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = config.get("block_multiple_of", 256)
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    return width


@architecture("lfm2", status="verified", model_class=HYBRID_MODEL,
              notes="gated short-convolution blocks (core's decoder-kit ShortConv: C * conv(B * x), no activation) "
                    "and QK-normed GQA attention layers (layer_types); conv states on the KV cache")
def lfm2(config: dict) -> DecoderSpec:
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        attention_layers = config.get("full_attn_idxs")
        attention_layers = set(range(layers) if attention_layers is None else attention_layers)
        types = ["full_attention" if i in attention_layers else "conv" for i in range(layers)]
    rope = {} if config.get("rope_parameters") or config.get("rope_theta") else {"rope_theta": 1e6}
    config = dict(config, **rope, intermediate_size=_lfm2_mlp_width(config), rms_norm_eps=config.get("norm_eps", 1e-5),
                  tie_word_embeddings=config.get("tie_embedding", config.get("tie_word_embeddings", True)))
    spec = _hybrid_decoder(config, [False] * layers, None, attn_in_norm="operator_norm", mlp_in_norm="ffn_norm",
                           final_norm="model.embedding_norm", extra={})
    conv = LinearAttentionSpec(layers=tuple(t == "conv" for t in types), k_heads=1, v_heads=1, k_dim=1, v_dim=1,
                               conv_kernel=int(config.get("conv_L_cache", 3)), path="conv",
                               module=ShortConv.module(int(config.get("conv_L_cache", 3)),
                                                       bool(config.get("conv_bias", False))))
    return replace(spec, linear_attention=conv,
                   attention=replace(spec.attention, o_proj="out_proj", q_norm="q_layernorm", k_norm="k_layernorm",
                                     q_bias=False, k_bias=False, v_bias=False, o_bias=False),
                   mlp=replace(spec.mlp, path="feed_forward", gate_proj="w1", up_proj="w3", down_proj="w2", bias=False))


@architecture("lfm2_moe", status="verified", model_class=HYBRID_MODEL,
              notes="LFM2 whose feed-forward past num_dense_layers is a sparse block: sigmoid router, expert_bias "
                    "for choosing only, top-k renormalised and scaled, SwiGLU experts (w1, w3, w2)")
def lfm2_moe(config: dict) -> DecoderSpec:
    spec = lfm2(dict(config, block_auto_adjust_ff_dim=False))
    dense = int(config.get("num_dense_layers", 2))
    moe = MoeSpec(num_experts=int(config.get("num_experts", 32)), top_k=int(config.get("num_experts_per_tok", 4)),
                  expert_size=int(config.get("moe_intermediate_size", 1792)),
                  layers=tuple(i >= dense for i in range(spec.num_layers)), hidden_act="silu", path="feed_forward",
                  scoring="sigmoid", selection_bias="expert_bias" if config.get("use_expert_bias", True) else None,
                  norm_topk=bool(config.get("norm_topk_prob", True)), norm_eps=1e-6,
                  routed_scale=float(config.get("routed_scaling_factor", 1.0)), expert_names=("w1", "w3", "w2"))
    return replace(spec, moe=moe)


LFM3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
             "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5}}


@architecture("lfm3", status="verified", model_class=HYBRID_MODEL,
              notes="LFM2's short-convolution blocks beside sliding and full Qwen3-style attention layers "
                    "(per-head q_norm / k_norm, per-layer-type rotary: default on sliding, proportional on full), a "
                    "sigmoid per-head output gate (gate_proj), sandwich norms on both sublayers")
def lfm3(config: dict) -> DecoderSpec:
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
        for i in range(layers)]
    config = dict(config, layer_types=types, rope_parameters=config.get("rope_parameters") or LFM3_ROPE,
                  block_auto_adjust_ff_dim=False, full_attn_idxs=None)
    spec = lfm2(config)
    rope_configs = tuple((config, "full_attention" if t == "conv" else t) for t in types)
    sandwich = bool(config.get("use_sandwich_norm", True))
    gated = bool(config.get("use_attention_gate", True))
    bias = bool(config.get("attention_bias", False))
    return replace(spec, attention=replace(spec.attention, o_proj="o_proj", q_norm="q_norm", k_norm="k_norm", q_bias=bias,
                                     k_bias=bias, v_bias=bias, o_bias=bias,
                                     output_gate="gate_proj" if gated else None, output_gate_sigmoid=True,
                                     windows=sliding_windows(config, layers, every_layer=False)),
                   positions=replace(spec.positions, rope_configs=rope_configs),
                   attn_out_norm="post_operator_norm" if sandwich else None,
                   mlp_out_norm="post_ffn_norm" if sandwich else None)


def _bfloat16(value: float) -> float:
    """``value`` rounded to bfloat16 (to nearest even), as a float."""
    bits = int(np.float32(value).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.uint32(bits).view(np.float32))


@architecture("recurrent_gemma", status="verified", model_class=HYBRID_MODEL,
              notes="Griffin's recurrent blocks (core's decoder-kit RecurrentBlock: conv + RG-LRU, token-by-token "
                    "recurrence) and sliding-window attention layers (block_types), Gemma norms, soft-capped logits")
def recurrent_gemma(config: dict) -> DecoderSpec:
    refuse("recurrent_gemma", config, "rope_parameters",
           lambda v: not isinstance(v, dict) or v.get("rope_type", "default") == "default", None)
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    blocks = (list(config.get("block_types") or ("recurrent", "recurrent", "attention")) * layers)[:layers]
    width = config.get("lru_width") or hidden
    if width % heads:
        raise UnsupportedConfigError(f"recurrent_gemma: num_attention_heads ({heads}) must divide lru_width "
                                     f"({width}); fix the config")
    rope = {} if isinstance(config.get("rope_parameters"), dict) else {"partial_rotary_factor": 0.5}
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    config = dict(config, **rope, head_dim=hidden // heads, intermediate_size=config["intermediate_size"] // 2,
                  hidden_act=activation, mlp_bias=True, rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                  tie_word_embeddings=config.get("tie_word_embeddings", True))
    spec = _hybrid_decoder(config, [False] * layers, None, attn_in_norm="temporal_pre_norm",
                           mlp_in_norm="channel_pre_norm", final_norm="model.final_norm", extra={},
                           embed_scale=_bfloat16(hidden ** 0.5), embed_scale_in_dtype=True,
                           final_softcap=float(config.get("logits_soft_cap", 30.0)))
    window = int(config.get("attention_window_size", 2048))
    bias = bool(config.get("attention_bias", False))
    recurrent = LinearAttentionSpec(
        layers=tuple(b == "recurrent" for b in blocks), k_heads=1, v_heads=1, k_dim=1, v_dim=1,
        conv_kernel=int(config.get("conv1d_width", 4)), path="temporal_block",
        module=RecurrentBlock.module(width, heads, int(config.get("conv1d_width", 4)), activation))
    return replace(spec, linear_attention=recurrent, norms=replace(spec.norms, unit_offset=True),
                   positions=replace(spec.positions, rope_configs=((config, None),) * layers),
                   attention=replace(spec.attention, path="temporal_block", q_bias=bias, k_bias=bias, v_bias=bias,
                                     o_bias=True, windows=(window,) * layers),
                   mlp=replace(spec.mlp, path="mlp_block"))


@architecture("rwkv", status="verified", model_class=HYBRID_MODEL,
              notes="RWKV-4: time mix (the WKV recurrence over time_decay / time_first, token by token) in the "
                    "linear-attention slot, channel mix in the MLP slot, token shift states on the cache; like "
                    "transformers, reads no attention mask; rescale_every (an eval-time float16 guard) not applied")
def rwkv(config: dict) -> DecoderSpec:
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    width = config.get("attention_hidden_size") or hidden
    # a decoder-kit spec whose every layer is the recurrent slot; no layer attends, so the attention sizes only
    # shape the (unused) key/value cache: one head of 4 dims, the smallest whole 16-byte row a paged cache takes
    spec = DecoderSpec(
        vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=layers, num_heads=1, num_kv_heads=1,
        head_dim=4, intermediate_size=config.get("intermediate_size") or 4 * hidden,
        max_position_embeddings=config.get("context_length", 1024), embed="rwkv.embeddings", layers="rwkv.blocks",
        final_norm="rwkv.ln_out", lm_head="head", attn_in_norm="ln1", mlp_in_norm="ln2",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        norms=NormSpec(kind="layer", eps=config.get("layer_norm_epsilon", 1e-5), bias=True),
        positions=PositionSpec(rope=False),
        linear_attention=LinearAttentionSpec(layers=(True,) * layers, k_heads=1, v_heads=1, k_dim=1, v_dim=1,
                                             path="attention", module=RwkvTimeMix.module(width)),
        make_layer=RwkvLayer)
    return replace(spec, moe=RwkvChannelMixes(spec.intermediate_size))


def _round_up(value: float, multiple: int) -> int:
    return int(-(-value // multiple) * multiple)


@architecture("xlstm", status="verified", model_class=HYBRID_MODEL,
              notes="mLSTM blocks (matrix memory with exponential input and sigmoid forget gates, transformers' "
                    "native recurrent form, token by token) in the linear-attention slot, SwiGLU feed-forward; "
                    "like transformers, reads no attention mask")
def xlstm(config: dict) -> DecoderSpec:
    refuse("xlstm", config, "weight_mode", lambda v: v == "single", "single")
    refuse("xlstm", config, "use_bias", lambda v: not v, False)
    hidden = first_of(config, "hidden_size", "embedding_dim")
    layers = first_of(config, "num_hidden_layers", "num_blocks")
    heads = config.get("num_heads", 8)
    qk_dim, v_dim = int(hidden * config.get("qk_dim_factor", 0.5)), int(hidden * config.get("v_dim_factor", 1.0))
    if qk_dim % heads or v_dim % heads:
        raise UnsupportedConfigError(f"xlstm: num_heads ({heads}) must divide the query/key width ({qk_dim}) and the "
                                     f"value width ({v_dim}); fix the config")
    eps = config.get("norm_eps", 1e-6)
    # no layer attends: the attention sizes only shape the (unused) key/value cache, as RWKV's
    spec = DecoderSpec(
        vocab_size=config["vocab_size"], hidden_size=hidden, num_layers=layers, num_heads=1, num_kv_heads=1,
        head_dim=4, intermediate_size=_round_up(hidden * config.get("ffn_proj_factor", 2.667),
                                                config.get("ffn_round_up_to_multiple_of", 64)),
        embed="backbone.embeddings", layers="backbone.blocks", final_norm="backbone.out_norm",
        attn_in_norm="norm_mlstm", mlp_in_norm="norm_ffn", norms=NormSpec(eps=eps),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), positions=PositionSpec(rope=False),
        final_softcap=float(config.get("output_logit_soft_cap") or 0.0),
        mlp=MLPSpec(path="ffn", gate_proj="proj_up_gate", up_proj="proj_up", down_proj="proj_down"),
        linear_attention=LinearAttentionSpec(
            layers=(True,) * layers, k_heads=1, v_heads=1, k_dim=1, v_dim=1, path="mlstm_layer",
            module=MLstmLayer.module(heads=heads, qk_dim=qk_dim, v_dim=v_dim, gate_cap=config.get("gate_soft_cap", 15.0),
                                     eps=config.get("eps", 1e-6), norm_eps=eps)))
    return spec


@architecture("minimax", status="verified", model_class=HYBRID_MODEL,
              notes="Mixtral (vkformers-moe's variant: GQA, sparse SwiGLU experts) whose linear_attention layers run "
                    "lightning attention (core's decoder-kit LightningAttention: linear attention with a per-head "
                    "decay, in blocks); residuals from the normed stream with per-type alpha / beta factors")
def minimax(config: dict) -> DecoderSpec:
    spec = mixtral(config)
    layers = spec.num_layers
    types = config.get("layer_types") or ["full_attention"] * layers
    if len(types) != layers or not set(types) <= {"full_attention", "linear_attention"}:
        raise UnsupportedConfigError(f"minimax: layer_types must name full_attention or linear_attention for each "
                                     f"of the {layers} layers, got {types!r}; fix the config")
    lightning = LinearAttentionSpec(
        layers=tuple(t == "linear_attention" for t in types), k_heads=1, v_heads=1, k_dim=1, v_dim=1,
        path="self_attn", module=LightningAttention.module(spec.num_heads, spec.head_dim,
                                                           int(config.get("block_size", 256)), spec.hidden_act))

    def factors(kind: str) -> tuple[float, float]:
        return float(config.get(f"{kind}_alpha_factor", 1)), float(config.get(f"{kind}_beta_factor", 1))
    residuals = ScaledResiduals(linear=factors("linear_attn"), full=factors("full_attn"), mlp=factors("mlp"))
    return replace(spec, linear_attention=lightning, make_layer=ScaledResidualLayer,
                   extra=dict(spec.extra, residuals=residuals))


VARIANTS = FAMILY.variants()


def mamba_spec(config: dict, name: str) -> MambaSpec | DecoderSpec:
    try:
        variant = VARIANTS[name]
    except KeyError:
        raise UnsupportedConfigError(f"vkformers-ssm does not know architecture {name!r}") from None
    return variant(config)
