"""JetMoE's mixture of attention heads (MoA), the shared decoder layer's attention module (AttentionSpec.module).

transformers 5 (JetMoeMoA, JetMoeAttention): one key/value projection kv_proj [2 KVH D, hidden] ([k | v]) shared
by every expert; a router (softmax over the top_k of num_experts logits) picks top_k query experts per token, each
projecting the token to KVH query heads (input_linear [E, KVH D, hidden]); every query head reads the KV head of its
index, with rotary on queries and keys and the usual causal softmax; each chosen expert maps its heads' output back
(output_linear [E, hidden, KVH D]), weighted by its routing weight, and a bias [hidden] is added.

Here every expert's query heads attend (E KVH heads, laid out so that head (n, e) reads KV head n) and the experts
no token chose are weighted by zero: the same output and gradients as transformers' routed computation.
"""
from __future__ import annotations

from dataclasses import dataclass

from vkformers.engine import functional as F
from vkformers.engine.ops.routing import topk_mask
from vkformers.models.layers import Linear
from vkformers.models.module import Module


@dataclass(frozen=True)
class JetMoeAttention:
    """The options; called with the spec it builds the module (AttentionSpec.module)."""

    num_experts: int
    top_k: int

    def __call__(self, spec) -> "MixtureOfAttentionHeads":
        return MixtureOfAttentionHeads(spec, self.num_experts, self.top_k)


class MixtureOfAttentionHeads(Module):
    """Parameters under JetMoE's names: kv_proj, experts.{input_linear,output_linear}.weight, experts.bias,
    experts.router.layer."""

    def __init__(self, spec, num_experts: int, top_k: int):
        super().__init__()
        hidden, width = spec.hidden_size, spec.num_kv_heads * spec.head_dim
        self.num_experts, self.top_k = num_experts, top_k
        self.kv_heads, self.head_dim, self.hidden = spec.num_kv_heads, spec.head_dim, hidden
        self.kv_proj = Linear(hidden, 2 * width, bias=False)
        experts = Module()
        for name, shape in (("input_linear", (num_experts, width, hidden)),
                            ("output_linear", (num_experts, hidden, width))):
            linear = Module()
            linear.param("weight", shape)
            setattr(experts, name, linear)
        experts.param("bias", (hidden,))
        router = Module()
        router.layer = Linear(hidden, num_experts, bias=False)
        experts.router = router
        self.experts = experts

    def routing_weights(self, x):
        """[tokens, experts]: softmax over each token's top_k router logits, zero elsewhere."""
        scores = self.experts.router.layer(x).float().softmax(-1)
        weights = F.where(topk_mask(scores, self.top_k), scores, 0.0)
        return weights / weights.sum(-1, keepdim=True)

    def forward(self, h, ctx, index: int):
        batch, length, hidden = h.shape
        experts, kv_heads, dim = self.num_experts, self.kv_heads, self.head_dim
        width = kv_heads * dim
        x = h.reshape(batch * length, hidden)
        weights = self.routing_weights(x).cast(x.dtype)
        queries = F.linear(x, self.experts.input_linear.weight.reshape(experts * width, hidden))
        q = (queries.reshape(batch, length, experts, kv_heads, dim).permute(0, 3, 2, 1, 4).contiguous()
             .reshape(batch, kv_heads * experts, length, dim))
        kv = self.kv_proj(h)
        k, v = (t.contiguous().reshape(batch, length, kv_heads, dim).permute(0, 2, 1, 3).contiguous()
                for t in (kv[..., :width], kv[..., width:]))
        inv_freq, scaling = ctx.rope_tables[index]
        q = F.rope(q, ctx.rope_positions, inv_freq, attention_scaling=scaling)
        k = F.rope(k, ctx.rope_positions, inv_freq, attention_scaling=scaling)
        options = dict(scale=dim ** -0.5, key_padding_mask=ctx.key_padding_mask)
        out = (ctx.cache.attend(index, q, k, v, **options) if ctx.cache is not None
               else F.scaled_dot_product_attention(q, k, v, causal=True, **options))
        out = (out.reshape(batch, kv_heads, experts, length, dim).permute(0, 3, 2, 1, 4).contiguous()
               .reshape(batch * length, experts, width))
        out = (out * weights.reshape(batch * length, experts, 1)).reshape(batch * length, experts * width)
        output = self.experts.output_linear.weight.permute(1, 0, 2).contiguous().reshape(hidden, experts * width)
        return (F.linear(out, output) + self.experts.bias).reshape(batch, length, hidden)
