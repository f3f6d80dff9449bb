"""The decoder's norms as a :class:`DecoderSpec` configures them: used by the decoder, by Gated DeltaNet and by
plugins that compose their own layers."""
from __future__ import annotations

from vkformers.engine import functional as F
from vkformers.models.decoder.spec import DecoderSpec, NormSpec
from vkformers.models.layers import LayerNorm, RMSNorm
from vkformers.models.module import Module


class LayerNorm1P(LayerNorm):
    """Nemotron's LayerNorm with the weight stored as an offset from 1: layer_norm(x) * (1 + w) + b."""

    def forward(self, x):
        return F.layer_norm(x, self.weight + 1.0, self.bias if self.has_bias else None, eps=self.eps)


def make_norm(spec: DecoderSpec | NormSpec, dim: int) -> Module:
    """The norm over ``dim`` channels as a :class:`NormSpec` (or a spec's ``norms``) configures it (RMSNorm or
    LayerNorm, weight, bias, unit offset, eps); plugins that compose their own layers build their norms with it."""
    norms = spec if isinstance(spec, NormSpec) else spec.norms
    if norms.kind == "rms":
        return RMSNorm(dim, eps=norms.eps, unit_offset=norms.unit_offset, elementwise=norms.weight)
    layer_norm = LayerNorm1P if norms.unit_offset else LayerNorm
    return layer_norm(dim, eps=norms.eps, bias=norms.bias, elementwise=norms.weight)
