"""Hybrid layers composed on the decoder kit's :class:`~vkformers.models.decoder.DecoderLayer` (the kit's
``make_layer`` hook), where a state-space mixer does not simply take the place of the attention."""
from __future__ import annotations

from dataclasses import dataclass, replace

from vkformers.engine import functional as F
from vkformers.models.decoder import DecoderLayer, make_norm
from vkformers.models.decoder.shared_block import SharedAdapters, SharedTransformerBlock
from vkformers.models.layers import Linear
from vkformers.models.module import Module, place

from vkformers_ssm.mixers import HybridMamba2Mixer, mixer_class


@dataclass(frozen=True)
class ParallelMultipliers:
    """Falcon-H1's muP scalings of a parallel layer: the attention's input and output, the mixer's output, the
    MLP's gate (inside the activation) and down projection."""

    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0


class ParallelMambaLayer(DecoderLayer):
    """Falcon-H1's block: a Mamba-2 mixer (``mamba``) and the kit's softmax attention both read the normed input;
    their scaled outputs are summed into the residual, then the gated MLP as usual. The spec's
    ``extra["mamba"]`` is the mixer's MambaSpec, ``extra["multipliers"]`` its :class:`ParallelMultipliers`."""

    def __init__(self, spec, index: int, alibi=None):
        super().__init__(spec, index, alibi)
        self.multipliers = spec.extra["multipliers"]
        self.parts["mamba"] = place(self, "mamba", HybridMamba2Mixer(spec.extra["mamba"]))

    def attention(self, h, ctx):
        m = self.multipliers
        ssm = self.parts["mamba"](h, ctx, self.index)
        attn = super().attention(h * m.attention_in if m.attention_in != 1.0 else h, ctx)
        return ssm * m.ssm_out + attn * m.attention_out

    def mlp(self, h):
        m, p = self.multipliers, self.parts
        gate = p["gate"](h)
        if m.mlp_gate != 1.0:
            gate = gate * m.mlp_gate
        out = p["down"](self.act(gate) * p["up"](h))
        return out * m.mlp_down if m.mlp_down != 1.0 else out

    def _fused_decode_plan(self):
        return None  # the fused decode kernels compose the kit's plain block, not this one


class _NoMLP(Module):
    """The MLP slot of a layer that is attention alone (its block is never called)."""

    path = "no_mlp"


class _AttentionOnly:
    """An ``MLPBlocks`` that leaves a layer without an MLP."""

    @staticmethod
    def block(spec, index):
        return _NoMLP()


class PlainMLP(Module):
    """down_proj(act(up_proj(x))), as a block's only mixer (Nemotron-H's relu2 MLP)."""

    def __init__(self, spec):
        super().__init__()
        self.up_proj = Linear(spec.hidden_size, spec.intermediate_size, bias=spec.mlp.bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp.bias)
        self.act = F.activation(spec.hidden_act)

    def forward(self, h):
        return self.down_proj(self.act(self.up_proj(h)))


class SingleMixerBlock(Module):
    """Nemotron-H's block: x + mixer(norm(x)) with one mixer per layer, by ``spec.extra["block_types"][index]``:
    "mamba" (this plugin's Mamba-2 mixer, ``extra["mamba"]``), "attention" (the kit's softmax attention: a
    DecoderLayer without norms or MLP, its projections directly under ``mixer``) or "mlp" (:class:`PlainMLP`)."""

    def __init__(self, spec, index: int, alibi=None):
        super().__init__()
        self.index, self.kind = index, spec.extra["block_types"][index]
        self.norm = make_norm(spec, spec.hidden_size)
        if self.kind == "mamba":
            self.mixer = HybridMamba2Mixer(spec.extra["mamba"])
        elif self.kind == "attention":
            attention_spec = replace(spec, attn_in_norm=None, mlp_in_norm=None, moe=_AttentionOnly(),
                                     attention=replace(spec.attention, path=""))
            self.mixer = DecoderLayer(attention_spec, index, alibi)
        else:
            self.mixer = PlainMLP(spec)

    def forward(self, x, ctx):
        h = self.norm(x)
        if self.kind == "mamba":
            out = self.mixer(h, ctx, self.index)
        elif self.kind == "attention":
            out = self.mixer.attention(h, ctx)
        else:
            out = self.mixer(h)
        return x + out


@dataclass(frozen=True)
class SharedBlocks:
    """Where Zamba's and Zamba2's hybrid layers run a shared transformer block: ``block_types`` per layer
    ("mamba" or "hybrid"), the block's path inside a hybrid layer, which block each hybrid layer runs (its
    ordinal among the hybrid layers modulo ``num_blocks``) and the per-use adapters' rank (0: none)."""

    block_types: tuple[str, ...]
    path: str = "shared_transf"
    num_blocks: int = 1
    adapter_rank: int = 0
    attention_adapters: bool = False
    mlp_adapters: bool = False

    def hybrid_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.block_types) if t == "hybrid"]

    def owners(self, layers_path: str) -> tuple:
        """DecoderSpec.shared_modules: each hybrid layer's block tied to the first layer running the same block."""
        hybrid = self.hybrid_layers()
        pairs = []
        for use, layer in enumerate(hybrid):
            owner = hybrid[use % self.num_blocks]
            if owner != layer:
                pairs.append((f"{layers_path}.{layer}.{self.path}", f"{layers_path}.{owner}.{self.path}"))
        return tuple(pairs)

    def adapters(self, use: int) -> SharedAdapters | None:
        if not self.adapter_rank or not (self.attention_adapters or self.mlp_adapters):
            return None
        count = len(self.hybrid_layers())
        return SharedAdapters(rank=self.adapter_rank,
                              uses=tuple(u for u in range(count) if u % self.num_blocks == use % self.num_blocks),
                              attention=self.attention_adapters, mlp=self.mlp_adapters)


class _MambaDecoder(Module):
    """A Mamba layer of Zamba: x + mamba(input_layernorm(x + extra)), ``extra`` the shared block's output (or 0)."""

    def __init__(self, spec, index: int):
        super().__init__()
        self.index = index
        self.input_layernorm = make_norm(spec, spec.hidden_size)
        self.mamba = mixer_class(spec.extra["mamba"])(spec.extra["mamba"])

    def forward(self, x, ctx, extra=None):
        return x + self.mamba(self.input_layernorm(x if extra is None else x + extra), ctx, self.index)


class SharedBlockLayer(Module):
    """Zamba's and Zamba2's layers (``spec.extra["shared_blocks"]``, a :class:`SharedBlocks`): a Mamba layer, or a
    hybrid one whose shared transformer block (core's :class:`SharedTransformerBlock`) reads the stream and the
    token embeddings, its ``linear`` projects the output, added to the input of the layer's Mamba decoder
    (``mamba_decoder``)."""

    def __init__(self, spec, index: int, alibi=None):
        super().__init__()
        shared = spec.extra["shared_blocks"]
        self.hybrid = shared.block_types[index] == "hybrid"
        if not self.hybrid:
            decoder = _MambaDecoder(spec, index)  # its norm and mixer saved directly under the layer
            object.__setattr__(self, "decoder", decoder)
            self.input_layernorm, self.mamba = decoder.input_layernorm, decoder.mamba
            return
        use = shared.hybrid_layers().index(index)
        object.__setattr__(self, "block", place(self, shared.path,
                                                SharedTransformerBlock(spec, index, use, shared.adapters(use))))
        self.linear = Linear(spec.hidden_size, spec.hidden_size, bias=False)
        self.mamba_decoder = _MambaDecoder(spec, index)

    def forward(self, x, ctx):
        if not self.hybrid:
            return self.decoder(x, ctx)
        return self.mamba_decoder(x, ctx, self.linear(self.block(x, ctx)))


@dataclass(frozen=True)
class ScaledResiduals:
    """MiniMax's residual wiring: each sublayer adds to its *normed* input, h * alpha + f(h) * beta, with one
    (alpha, beta) for the attention of linear layers, one for that of softmax layers, one for the MLP."""

    linear: tuple[float, float] = (1.0, 1.0)
    full: tuple[float, float] = (1.0, 1.0)
    mlp: tuple[float, float] = (1.0, 1.0)


class ScaledResidualLayer(DecoderLayer):
    """h = norm(x); x = h * alpha + attn(h) * beta; h = norm'(x); x = h * alpha' + mlp(h) * beta' (MiniMax); the
    spec's ``extra["residuals"]`` is its :class:`ScaledResiduals`."""

    def __init__(self, spec, index: int, alibi=None):
        super().__init__(spec, index, alibi)
        residuals = spec.extra["residuals"]
        self.attention_factors = residuals.linear if self.linear else residuals.full
        self.mlp_factors = residuals.mlp

    def _sequential_residual(self, x, ctx):
        h = self._norm("attn_in_norm", x)
        (alpha, beta), (mlp_alpha, mlp_beta) = self.attention_factors, self.mlp_factors
        x = h * alpha + self.attention(h, ctx) * beta
        h = self._norm("mlp_in_norm", x)
        return h * mlp_alpha + self.mlp(h) * mlp_beta

    def _fused_decode_plan(self):
        return None  # the fused decode kernels compose the kit's plain block, not this one
