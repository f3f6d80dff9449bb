"""Gemma 4's text decoder layer: Gemma 3n's shared-KV attention and per-layer inputs (vkformers_llama.gemma3n) on one
residual stream, per-layer head sizes, and a mixture-of-experts block beside the MLP.

transformers 5 (Gemma4TextDecoderLayer), on the stream x:

- attention: q/k RMS-normed per head, values by a weightless RMS norm, scale 1; full-attention layers have heads of
  global_head_dim (and num_global_key_value_heads KV heads where attention_k_eq_v), and with attention_k_eq_v no
  v_proj: the values are the key projection (before k_norm). The last num_kv_shared_layers layers reuse the keys and
  values of the last earlier layer of their type (and with use_double_wide_mlp have an MLP twice as wide).
- x += post_attention_layernorm(attn(input_layernorm(x))).
- m = mlp(pre_feedforward_layernorm(x)); with the MoE block, m = post_feedforward_layernorm_1(m) +
  post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x))), the router reading x itself:
  softmax(proj(rms(x) * scale / sqrt(D))), top-k renormalised, times per_expert_scale; x += post_feedforward_layernorm(m).
- x += post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x)) * per_layer_input)).
- x *= layer_scalar (a checkpoint buffer).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vkformers.engine import functional as F
from vkformers.models.decoder import make_norm
from vkformers.models.decoder.spec import NormSpec
from vkformers.models.layers import Linear
from vkformers.models.module import add_param, get_param, place
from vkformers_llama.gemma3n import SharedKVLayer

from vkformers_moe.block import MoeSpec, SparseMoeBlock, topk_mask


@dataclass(frozen=True)
class Gemma4Layers:
    """The model's options; called with (spec, index, alibi) it builds layer ``index`` (DecoderSpec.make_layer)."""

    layer_types: tuple[str, ...]
    kv_sources: tuple[int | None, ...]       # per layer: the layer whose keys and values it reuses, or None
    head_dims: tuple[int, ...]               # per layer (global_head_dim on full-attention layers)
    kv_heads: tuple[int, ...]                # per layer (num_global_key_value_heads there with attention_k_eq_v)
    k_eq_v: bool                             # full-attention layers' values are their key projection
    per_layer_width: int                     # hidden_size_per_layer_input (0: no per-layer inputs)
    double_wide_mlp: bool                    # KV-sharing layers' MLP twice as wide
    experts: MoeSpec | None = None           # the MoE block beside every layer's MLP

    def __call__(self, spec, index: int, alibi=None) -> "Gemma4Layer":
        return Gemma4Layer(self, spec, index, alibi)

    def is_full(self, index: int) -> bool:
        return self.layer_types[index] == "full_attention"


class Gemma4Experts(SparseMoeBlock):
    """Gemma 4's router and experts, whose parameters sit in the layer (router.proj / scale / per_expert_scale,
    experts.gate_up_proj / down_proj): the block's ``router`` and ``experts`` containers are placed there."""

    def __init__(self, moe: MoeSpec, hidden: int, eps: float):
        super().__init__(moe, hidden)
        add_param(self, "router.scale", (hidden,))
        add_param(self, "router.per_expert_scale", (moe.num_experts,))
        self.eps = eps

    def routing_weights(self, x):
        moe = self.moe
        h = F.rms_norm(x, None, eps=self.eps) * get_param(self, "router.scale") * float(self.hidden ** -0.5)
        scores = self.router(h).float().softmax(-1)
        weights = F.where(topk_mask(scores.detach(), moe.top_k), scores, 0.0)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * get_param(self, "router.per_expert_scale").float()


class Gemma4Layer(SharedKVLayer):
    """One Gemma 4 block."""

    def __init__(self, options: Gemma4Layers, spec, index: int, alibi=None):
        full = options.is_full(index)
        shares = options.kv_sources[index] is not None
        sized = replace(spec, moe=None,
                        head_dim=options.head_dims[index], num_kv_heads=options.kv_heads[index],
                        intermediate_size=spec.intermediate_size * (2 if options.double_wide_mlp and shares else 1))
        super().__init__(sized, index, alibi)
        s, d = self.spec, self.spec.hidden_size
        self.options, self.layer_type = options, options.layer_types[index]
        if full and options.k_eq_v:  # the values are the key projection
            del self._modules[s.attention.path]._modules[s.attention.v_proj]
            del self.parts["v"]
        self.share_kv(options.kv_sources)
        rms = NormSpec("rms", eps=s.norms.eps)

        def add(path, module):
            object.__setattr__(self, path.replace(".", "_"), place(self, path, module))

        if options.per_layer_width:
            add("per_layer_input_gate", Linear(d, options.per_layer_width, bias=False))
            add("per_layer_projection", Linear(options.per_layer_width, d, bias=False))
            add("post_per_layer_input_norm", make_norm(rms, d))
        experts = None
        if options.experts is not None:
            experts = Gemma4Experts(options.experts, d, s.norms.eps)
            for name in ("router", "experts"):  # the block's parameters, under the layer's names
                place(self, name, experts._modules[name])
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                add(name, make_norm(rms, d))
        object.__setattr__(self, "experts_block", experts)
        self.layer_scalar = 1.0  # load_buffers reads the checkpoint's

    def load_buffers(self, arrays, prefix: str) -> None:
        name = f"{prefix}.layer_scalar"
        if name in arrays:
            self.layer_scalar = float(np.asarray(arrays[name], np.float32).reshape(-1)[0])

    def saved_buffers(self, prefix: str) -> dict:
        return {f"{prefix}.layer_scalar": np.asarray([self.layer_scalar], np.float32)}

    def _feed_forward(self, x):
        mlp = self._gated_mlp(self._norm("mlp_in_norm", x))
        block = self.experts_block
        if block is None:
            return mlp
        flat = x.reshape(-1, self.spec.hidden_size)
        weights = block.routing_weights(flat).cast(x.dtype)
        routed = block.experts_output(self.pre_feedforward_layernorm_2(flat), weights).reshape(*x.shape)
        return self.post_feedforward_layernorm_1(mlp) + self.post_feedforward_layernorm_2(routed)

    def forward(self, x, ctx):
        x = x + self._norm("attn_out_norm", self.shared_kv_attention(self._norm("attn_in_norm", x), ctx))
        x = x + self._norm("mlp_out_norm", self._feed_forward(x))
        if self.options.per_layer_width:
            gated = self.act(self.per_layer_input_gate(x)) * ctx.per_layer_inputs[self.index]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar if self.layer_scalar != 1.0 else x


def per_layer_shapes(layers) -> tuple[int, int]:
    """(KV heads, head dim) a cache needs for every layer's keys and values: the largest of each."""
    return max(layer.spec.num_kv_heads for layer in layers), max(layer.spec.head_dim for layer in layers)

