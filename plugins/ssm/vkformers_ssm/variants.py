"""State-space architectures, each declared once on the variant function that reads its config into a
:class:`MambaSpec` (the knobs of the shared Mamba model, ``vkformers_ssm/model.py``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from vkformers.errors import VkformersError
from vkformers.models.family import Family

FAMILY = Family("ssm", kind="causal-decoder", norm="rms")
architecture = FAMILY.architecture


class UnsupportedConfigError(VkformersError, ValueError):
    """A config option the shared state-space model does not implement."""


@dataclass(frozen=True)
class MambaSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    state_size: int
    conv_kernel: int
    time_step_rank: int
    norm_eps: float
    hidden_act: str = "silu"
    use_bias: bool = False            # in_proj, out_proj
    use_conv_bias: bool = True
    tie_embeddings: bool = True
    residual_in_fp32: bool = True
    bcdt_norm_eps: float | None = None  # Falcon-Mamba: weightless RMSNorm of dt, B and C before use
    # Mamba-2: heads of head_dim channels, each with one scalar A, D and dt (dt_bias); B and C in n_groups groups
    # of heads, from the conv like x; out = gated group RMSNorm(y * silu(z)) (eps norm_eps)
    mamba2: bool = False
    num_heads: int = 0
    head_dim: int = 0
    n_groups: int = 1
    chunk_size: int = 256  # Mamba-2: steps per chunk of the chunked scan (prefill, training)


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


VARIANTS = FAMILY.variants()


def mamba_spec(config: dict, name: str) -> MambaSpec:
    try:
        variant = VARIANTS[name]
    except KeyError:
        raise UnsupportedConfigError(f"vkformers-ssm does not know architecture {name!r}") from None
    return variant(config)
