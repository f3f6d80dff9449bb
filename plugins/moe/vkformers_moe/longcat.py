"""LongCat-Flash's layer: two shared-decoder sublayers and one sparse block between them, composed.

transformers 5 (LongcatFlashDecoderLayer): each layer i holds two sublayers j = 0, 1, each a pre-norm MLA attention
(self_attn.<j>, input_layernorm.<j>, KV-cache slot 2i + j) and a pre-norm dense MLP (mlps.<j>,
post_attention_layernorm.<j>). The sparse block (mlp) reads the first sublayer's post-attention norm, and its output
joins the residual stream after the second sublayer:

    x = x + attn0(norm_in0(x));  h = norm_post0(x);  x = x + mlp0(h)
    x = x + attn1(norm_in1(x));  x = x + mlp1(norm_post1(x)) + moe(h)
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from vkformers.models.module import Module, place
from vkformers.models.decoder import DecoderLayer


def graft(root: Module, module: Module) -> None:
    """Register module's modules in root under the same paths (plain containers are merged, not shared)."""
    for name, child in module._modules.items():
        if type(child) is Module and not child._slots:
            graft(root._modules[name] if name in root._modules else root.add(name, Module()), child)
        else:
            root.add(name, child)


@dataclass(frozen=True)
class LongcatLayers:
    """Called with (spec, index, alibi), builds LongCat layer ``index`` (DecoderSpec.make_layer); ``sublayer`` is
    the spec of its sublayers, whose per-layer tuples (rotary tables, attention scales) count sublayers."""

    sublayer: object  # DecoderSpec

    def __call__(self, spec, index: int, alibi=None) -> "LongcatLayer":
        return LongcatLayer(self.sublayer, spec, index, alibi)


class LongcatLayer(Module):
    cache_slots = 2  # KV-cache slots: one per attention sublayer

    def __init__(self, sublayer, spec, index: int, alibi=None):
        super().__init__()
        subs = []
        for j in (0, 1):
            sub_spec = replace(sublayer,
                               attention=replace(sublayer.attention, path=f"self_attn.{j}"),
                               mlp=replace(sublayer.mlp, path=f"mlps.{j}"),
                               attn_in_norm=f"input_layernorm.{j}",
                               mlp_in_norm=f"post_attention_layernorm.{j}", moe=None, make_layer=None)
            sub = DecoderLayer(sub_spec, 2 * index + j, alibi)
            graft(self, sub)  # their parameters live under this layer's names
            subs.append(sub)
        object.__setattr__(self, "subs", subs)
        block = spec.moe.block(spec, index)
        object.__setattr__(self, "moe", place(self, block.path, block))

    def forward(self, x, ctx):
        first, second = self.subs
        x = x + first.attention(first._norm("attn_in_norm", x), ctx)
        h = first._norm("mlp_in_norm", x)
        x = x + first.mlp(h)
        return second(x, ctx) + self.moe(h)
