"""Hybrid layers composed on the decoder kit's :class:`~vkformers.models.decoder.DecoderLayer` (the kit's
``make_layer`` hook), where a state-space mixer does not simply take the place of the attention."""
from __future__ import annotations

from dataclasses import dataclass, replace

from vkformers.engine import functional as F
from vkformers.models.decoder import DecoderLayer, make_norm
from vkformers.models.layers import Linear
from vkformers.models.module import Module, place

from vkformers_ssm.mixers import HybridMamba2Mixer


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
