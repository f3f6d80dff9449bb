"""One decoder for every dense causal LM of the family, configured by a :class:`DecoderSpec`.

The model declares its parameters under the checkpoint's own names (``model.layers.0.
self_attn.q_proj.weight``, ``transformer.h.0.attn.c_attn.weight``, ...); fused projections
stay one parameter and are split with views, so gradients and saved checkpoints keep
Hugging Face's layout.

Forward semantics follow transformers 5: without a cache and without ``position_ids``
every row uses positions ``arange(T)`` (also with left padding); ``attention_mask`` zeros
mask those keys on top of the causal mask; ``labels`` are shifted inside (not for TrOCR, as there).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.rope_scaling import rope_parameters
from vkformers.engine import lazy
from vkformers.engine.function import grad_enabled
from vkformers.engine.tensor import Tensor
from vkformers.models.generation import GenerationMixin
from vkformers.models.inputs import InputLimits
from vkformers.models.layers import Conv1D, Embedding, LayerNorm, Linear, ModuleList, RMSNorm
from vkformers.models.loading import CausalLMOutput
from vkformers.models.module import Module, add_param, get_param, join_path, place
from vkformers.runtime import dtypes as dt

from vkformers_llama.gated_deltanet import GatedDeltaNet
from vkformers_llama.norms import make_norm
from vkformers_llama.variants import (DecoderSpec, alibi_slopes, decoder_spec,
                                      mpt_alibi_slopes, sinusoidal_table)


IGNORE_INDEX = -100

# Buffers some checkpoints carry that are not parameters (causal-mask and rotary caches).
IGNORED_CHECKPOINT_KEYS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                           "rotary_emb.inv_freq", ".act_fn.beta", ".act_fn.eps",  # these two: xIELU (Apertus)
                           ".e_score_correction_bias", ".expert_bias")  # MoE routing biases (load_buffers)


def _embed_norm_spec(spec: DecoderSpec) -> DecoderSpec:
    """The spec make_norm builds the embedding norm from: the blocks' norm, or a LayerNorm of its own."""
    if spec.embed_norm_layer_eps is None:
        return spec
    return replace(spec, norm="layer", norm_eps=spec.embed_norm_layer_eps, norm_weight=True, norm_bias=True,
                   norm_unit_offset=False)


def xielu(x, alpha_p, alpha_n, beta: float, eps: float):
    """Apertus' xIELU: alpha_p x^2 + beta x for x > 0, else alpha_n (expm1(min(x, eps)) - x) + beta x, with
    alpha_p = softplus(a_p) and alpha_n = beta + softplus(a_n) (learned a_p, a_n)."""
    ap, an = F.softplus(alpha_p), F.softplus(alpha_n) + beta
    positive = ap * x * x + x * beta
    negative = ((x.minimum(eps)).exp() - 1.0 - x) * an + x * beta
    return F.where(x > 0.0, positive, negative)


def make_projection(spec: DecoderSpec, in_features: int, out_features: int, bias: bool) -> Module:
    """A projection as the spec's checkpoints store it: Conv1D ([in, out], GPT-2) or Linear."""
    return (Conv1D if spec.conv1d else Linear)(in_features, out_features, bias=bias)


class HeadwiseNorm(Module):
    """QK-norm with one weight row per head (no bias), over each head's D values.

    ``stacked``: one [heads, D] parameter (Cohere's ``q_norm.weight``); otherwise one norm per head
    (StableLM's ``q_layernorm.norms.<h>.weight``), stacked in the forward pass.
    """

    def __init__(self, spec: DecoderSpec, heads: int, stacked: bool):
        super().__init__()
        self.spec, self.heads, self.stacked = spec, heads, stacked
        if stacked:
            self.param("weight", (heads, spec.head_dim))
        else:
            object.__setattr__(self, "norms", [place(self, f"norms.{h}", LayerNorm(spec.head_dim, bias=False))
                                               for h in range(heads)])

    def _weight(self):
        if self.stacked:
            return self.weight
        return F.stack([norm.weight for norm in self.norms])

    def forward(self, x):  # x [B, T, heads, D]
        if self.spec.norm == "rms":
            y = F.rms_norm(x, None, eps=self.spec.norm_eps)
        else:
            y = F.layer_norm(x, None, None, eps=self.spec.norm_eps)
        return y * self._weight()


class Context:
    """What every layer of one forward pass shares: positions, masks, rotary tables, the cache."""

    def __init__(self, positions, key_padding_mask, rope_tables, cache, rope_positions=None, query_scale=None,
                 host_mask=None, host_positions=None):
        self.positions, self.key_padding_mask, self.rope_tables, self.cache = (
            positions, key_padding_mask, rope_tables, cache)
        self.rope_positions = positions if rope_positions is None else rope_positions  # negated for NanoChat
        self.query_scale = query_scale        # [B, 1, T, 1] Llama-4 position scaling of the queries, or None
        self.host_mask = host_mask            # attention_mask as numpy [B, T] or None (host-built masks)
        self.host_positions = host_positions  # positions as numpy [B, T] (host-built masks), or None


class DecoderLayer(Module):
    """One block: attention and MLP with the spec's norms and residual wiring.

    Parameters live under the checkpoint's relative paths; ``self.parts`` keeps plain
    references to them (a dict, so they are not registered twice).
    """

    def __init__(self, spec: DecoderSpec, index: int, alibi=None):
        super().__init__()
        if spec.heads_per_layer:  # Laguna: the query head count differs per layer (the KV heads do not)
            spec = replace(spec, num_heads=spec.heads_per_layer[index])
        if spec.linear_layer_norms and spec.linear_layers and spec.linear_layers[index]:
            spec = replace(spec, **dict(spec.linear_layer_norms))
        s, d = spec, spec.hidden_size
        object.__setattr__(self, "parts", {})
        self.spec, self.index = s, index
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def add(role, relative_path, module):
            self.parts[role] = place(self, relative_path, module)

        for role in ("attn_in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm"):
            if getattr(s, role) and not (role == "attn_in_norm" and index in s.attn_in_norm_skipped):
                add(role, getattr(s, role), make_norm(s, d))
        self.linear = bool(s.linear_layers) and bool(s.linear_layers[index])
        if self.linear:  # Gated DeltaNet instead of the attention projections
            add("linear", s.linear_attn, (s.linear_module or GatedDeltaNet)(s))
        elif s.mla:
            self._init_mla(add)
            q_out = s.num_heads * s.mla_v_dim  # o_proj reads the value heads
        elif s.qkv_proj:
            add("qkv", join_path(s.attn, s.qkv_proj),
                make_projection(s, d, q_out + 2 * kv_out, bias=s.q_bias))
        else:
            q_width = 2 * q_out if s.q_gate else q_out  # Qwen3.5: [query | gate] per head
            add("q", join_path(s.attn, s.q_proj), make_projection(s, d, q_width, bias=s.q_bias))
            add("k", join_path(s.attn, s.k_proj), make_projection(s, d, kv_out, bias=s.k_bias))
            add("v", join_path(s.attn, s.v_proj), make_projection(s, d, kv_out, bias=s.v_bias))
        if not self.linear:
            add("o", join_path(s.attn, s.o_proj), make_projection(s, q_out, d, bias=s.o_bias))
        if s.q_norm and self.linear:
            pass  # a linear-attention layer has no q/k norm
        elif s.q_norm and s.qk_norm_scope in ("per_head", "per_head_list"):
            stacked = s.qk_norm_scope == "per_head"
            add("q_norm", join_path(s.attn, s.q_norm), HeadwiseNorm(s, s.num_heads, stacked))
            add("k_norm", join_path(s.attn, s.k_norm), HeadwiseNorm(s, s.num_kv_heads, stacked))
        elif s.q_norm:
            full = s.qk_norm_scope == "full"
            add("q_norm", join_path(s.attn, s.q_norm), make_norm(s, q_out if full else s.head_dim))
            add("k_norm", join_path(s.attn, s.k_norm), make_norm(s, kv_out if full else s.head_dim))
        inter = s.intermediate_size
        sparse = s.moe.block(s, index) if s.moe is not None else None
        if sparse is not None:  # a mixture-of-experts block instead of the dense MLP (vkformers-moe)
            add("moe", sparse.path, sparse)
            for path, module in getattr(sparse, "layer_modules", {}).items():  # its parts stored beside it
                place(self, path, module)
        elif s.mlp_kind == "gated" and s.gate_up_proj:
            add("gate_up", join_path(s.mlp, s.gate_up_proj), make_projection(s, d, 2 * inter, bias=s.mlp_bias))
        elif s.mlp_kind == "gated":
            add("gate", join_path(s.mlp, s.gate_proj), make_projection(s, d, inter, bias=s.mlp_bias))
            add("up", join_path(s.mlp, s.up_proj), make_projection(s, d, inter, bias=s.mlp_bias))
        else:
            add("up", join_path(s.mlp, s.up_proj), make_projection(s, d, inter, bias=s.mlp_bias))
        if sparse is None:
            add("down", join_path(s.mlp, s.down_proj), make_projection(s, inter, d, bias=s.mlp_bias))
        if s.attn_sub_norm:
            add("attn_sub_norm", join_path(s.attn, s.attn_sub_norm), make_norm(s, q_out))
        if s.mlp_sub_norm:
            add("mlp_sub_norm", join_path(s.mlp, s.mlp_sub_norm), make_norm(s, inter))
        if s.attention_sinks:
            add_param(self, join_path(s.attn, s.attention_sinks), (s.num_heads,))
        if s.output_gate:
            add("output_gate", join_path(s.attn, s.output_gate),
                Linear(d, s.num_heads if s.output_gate_per_head else q_out, bias=False))
        if s.attn_out_bias and index in s.attn_out_bias_layers:
            add_param(self, join_path(s.attn, s.attn_out_bias), (d,))
        for path, shape in s.unused_layer_params:
            add_param(self, path, shape)
        if s.hidden_act == "xielu":
            add_param(self, join_path(s.mlp, "act_fn.alpha_p"), (1,))
            add_param(self, join_path(s.mlp, "act_fn.alpha_n"), (1,))
            self.xielu_buffers = (0.5, -1e-6)  # transformers' defaults; from_pretrained reads the checkpoint's
            self.act = self._xielu
        else:
            self.act = F.activation(s.hidden_act)
        self.rotates = s.rope and (not s.rope_layers or bool(s.rope_layers[index]))
        self.scale = s.attention_scales[index] if s.attention_scales else s.head_dim ** -0.5
        self.window = s.windows[index] if s.windows else 0
        self.alibi = alibi

    def _norm(self, role, x):
        return self.parts[role](x) if role in self.parts else x

    def _param(self, path):
        return get_param(self, join_path(self.spec.attn, path))

    def _xielu(self, x):
        mlp = join_path(self.spec.mlp, "act_fn")
        beta, eps = self.xielu_buffers
        return xielu(x, get_param(self, mlp + ".alpha_p"), get_param(self, mlp + ".alpha_n"), beta, eps)

    # -- multi-head latent attention (DeepSeek-V2)

    def _init_mla(self, add):
        s, d = self.spec, self.spec.hidden_size
        heads, qk_dim = s.num_heads, s.mla_nope_dim + s.mla_rope_dim
        rms = replace(s, norm="rms", norm_weight=True, norm_unit_offset=False, norm_eps=s.mla_norm_eps or s.norm_eps)
        if s.mla_q_lora_rank:
            add("q_a", join_path(s.attn, "q_a_proj"), Linear(d, s.mla_q_lora_rank, bias=s.q_bias))
            add("q_a_norm", join_path(s.attn, "q_a_layernorm"), make_norm(rms, s.mla_q_lora_rank))
            add("q_b", join_path(s.attn, "q_b_proj"), Linear(s.mla_q_lora_rank, heads * qk_dim, bias=False))
        else:
            add("q", join_path(s.attn, "q_proj"), Linear(d, heads * qk_dim, bias=False))
        add("kv_a", join_path(s.attn, "kv_a_proj_with_mqa"),
            Linear(d, s.mla_kv_lora_rank + s.mla_rope_dim, bias=s.q_bias))
        add("kv_a_norm", join_path(s.attn, "kv_a_layernorm"), make_norm(rms, s.mla_kv_lora_rank))
        add("kv_b", join_path(s.attn, "kv_b_proj"),
            Linear(s.mla_kv_lora_rank, heads * (s.mla_nope_dim + s.mla_v_dim), bias=False))

    def _mla_qkv(self, h, ctx: Context, q=None):
        """q, k [B, H, T, nope + rope] and v [B, H, T, v_dim]; the rotary key part is shared by all heads. ``q``:
        the queries [B, T, H * (nope + rope)] when a plugin's layer projects them otherwise (A.X-K2)."""
        s, p = self.spec, self.parts
        batch, length, _ = h.shape
        heads, nope, rdim, vdim = s.num_heads, s.mla_nope_dim, s.mla_rope_dim, s.mla_v_dim
        if q is None:
            q = p["q_b"](p["q_a_norm"](p["q_a"](h))) if "q_b" in p else p["q"](h)
        if s.mla_q_scale != 1.0:
            q = q * s.mla_q_scale
        q = q.reshape(batch, length, heads, nope + rdim).permute(0, 2, 1, 3)
        compressed = p["kv_a"](h)
        latent, k_rot = (compressed[..., :s.mla_kv_lora_rank], compressed[..., s.mla_kv_lora_rank:]) if rdim else \
            (compressed, None)
        latent = p["kv_a_norm"](latent)
        if s.mla_kv_scale != 1.0:
            latent = latent * s.mla_kv_scale
        kv = p["kv_b"](latent).reshape(batch, length, heads, nope + vdim).permute(0, 2, 1, 3)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        if rdim:
            inv_freq, scaling = ctx.rope_tables[self.index]
            q_rot = F.rope(q[..., nope:].contiguous(), ctx.rope_positions, inv_freq, interleaved=s.rope_interleaved,
                           attention_scaling=scaling)
            k_rot = F.rope(k_rot.reshape(batch, 1, length, rdim), ctx.rope_positions, inv_freq,
                           interleaved=s.rope_interleaved, attention_scaling=scaling)
            q = F.cat([q[..., :nope], q_rot], -1)
            k = F.cat([k_nope, k_rot.expand(batch, heads, length, rdim)], -1)
        else:  # NoPE MLA (GLM-5.3-Flash): no rotary key part
            k = k_nope.contiguous()
        # the attention kernel has one head size: pad the narrower side with zeros (zero query/key dims add nothing
        # to the scores, whose scale is the qk head dim's; zero value dims are sliced off the output)
        if vdim > nope + rdim:
            q, k = (F.cat([t, Tensor(np.zeros((batch, heads, length, vdim - nope - rdim), np.float32), dtype=t.dtype)],
                          -1) for t in (q, k))
        if vdim < nope + rdim:
            padding = Tensor(np.zeros((batch, heads, length, nope + rdim - vdim), np.float32), dtype=v.dtype)
            v = F.cat([v, padding], -1)
        return q, k, v.contiguous()

    # -- attention

    def _project_qkv(self, h):
        s, p = self.spec, self.parts
        batch, length, _ = h.shape
        heads, kv_heads, dim = s.num_heads, s.num_kv_heads, s.head_dim
        if "qkv" not in p:
            return p["q"](h), p["k"](h), p["v"](h)
        fused = p["qkv"](h)
        if s.qkv_layout == "blocks":  # [q | k | v]
            q_out, kv_out = heads * dim, kv_heads * dim
            return fused[..., :q_out], fused[..., q_out:q_out + kv_out], fused[..., q_out + kv_out:]
        if s.qkv_layout == "per_head":  # [heads, (q, k, v), dim]
            grouped = fused.reshape(batch, length, heads, 3, dim)
            return tuple(grouped[:, :, :, i, :].reshape(batch, length, heads * dim) for i in range(3))
        if s.qkv_layout == "chunks_qvk":  # CodeGen: [chunks, (q, v, k), heads/chunks * dim]
            chunks = fused.reshape(batch, length, s.qkv_chunks, 3, heads * dim // s.qkv_chunks)
            q, v, k = (chunks[:, :, :, i, :].reshape(batch, length, heads * dim) for i in range(3))
            return q, k, v
        if s.qkv_layout == "grouped":  # [kv_heads, (queries of the group..., k, v), dim] (Falcon new arch)
            group = heads // kv_heads
            grouped = fused.reshape(batch, length, kv_heads, group + 2, dim)
            return (grouped[:, :, :, :group, :].reshape(batch, length, heads * dim),
                    grouped[:, :, :, group, :].reshape(batch, length, kv_heads * dim),
                    grouped[:, :, :, group + 1, :].reshape(batch, length, kv_heads * dim))
        raise ValueError(f"unknown qkv layout {s.qkv_layout!r}")

    def attention(self, h, ctx: Context):
        s, p = self.spec, self.parts
        batch, length, _ = h.shape
        if self.linear:
            return p["linear"](h, ctx, self.index)
        gate = p["output_gate"](h) if "output_gate" in p else None
        if gate is not None:
            gate = gate.sigmoid() if s.output_gate_sigmoid else F.softplus(gate)
        if s.mla:
            q, k, v = self._mla_qkv(h, ctx)
            return self._attend(q, k, v, ctx, batch, length)
        q, k, v = self._project_qkv(h)
        if s.q_gate:  # [B, T, heads, (query, gate), D]
            split = q.reshape(batch, length, s.num_heads, 2 * s.head_dim)
            gate = F.sigmoid(split[..., s.head_dim:].contiguous().reshape(batch, length, s.num_heads * s.head_dim))
            q = split[..., :s.head_dim].contiguous().reshape(batch, length, s.num_heads * s.head_dim)
        if "q_norm" in p and s.qk_norm_scope == "full" and s.clip_after_qk_norm:
            q, k = p["q_norm"](q), p["k_norm"](k)
        if s.clip_qkv is not None:
            # maximum/minimum rather than Tensor.clamp, whose backward multiplies two bool masks (unsupported)
            q, k, v = (t.maximum(-s.clip_qkv).minimum(s.clip_qkv) for t in (q, k, v))
        if "q_norm" in p and s.qk_norm_scope == "full" and not s.clip_after_qk_norm:
            q, k = p["q_norm"](q), p["k_norm"](k)
        q = q.reshape(batch, length, s.num_heads, s.head_dim)
        k = k.reshape(batch, length, s.num_kv_heads, s.head_dim)
        v = v.reshape(batch, length, s.num_kv_heads, s.head_dim)
        if "q_norm" in p and s.qk_norm_scope != "full" and not s.qk_norm_after_rope:
            q, k = p["q_norm"](q), p["k_norm"](k)
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        if self.rotates:
            inv_freq, scaling = ctx.rope_tables[self.index]
            q = F.rope(q, ctx.rope_positions, inv_freq, interleaved=s.rope_interleaved, attention_scaling=scaling)
            k = F.rope(k, ctx.rope_positions, inv_freq, interleaved=s.rope_interleaved, attention_scaling=scaling)
        if "q_norm" in p and s.qk_norm_after_rope:  # [B, H, T, D]: the norm is over D either way
            q, k = p["q_norm"](q), p["k_norm"](k)
        return self._attend(q, k, v, ctx, batch, length, gate)

    def _attend(self, q, k, v, ctx: Context, batch, length, gate=None):
        s, p = self.spec, self.parts
        if ctx.query_scale is not None:
            q = q * ctx.query_scale
        options = dict(scale=self.scale, window=self.window, softcap=s.attn_softcap, alibi_slopes=self.alibi,
                       key_padding_mask=ctx.key_padding_mask)
        if s.attention_sinks:
            options["return_lse"] = True
        out = self.attend_heads(q, k, v, ctx, **options)
        if s.attention_sinks:  # softmax over the scores and one sink logit per head, whose value is zero
            out, lse = out
            sinks = self._param(s.attention_sinks).float().reshape(1, -1, 1)
            out = out * (lse - sinks).sigmoid().cast(out.dtype).reshape(*lse.shape, 1)
        if s.mla and out.shape[-1] != s.mla_v_dim:
            out = out[..., :s.mla_v_dim]
        heads, dim = out.shape[1], out.shape[3]
        out = out.permute(0, 2, 1, 3)
        per_head = s.output_gate_per_head and not s.q_gate
        if gate is not None and per_head:  # gate [B, T, heads]: one factor per head
            out = out * gate.reshape(batch, length, heads, 1)
        out = out.reshape(batch, length, heads * dim)
        if gate is not None and not per_head:  # gate [B, T, heads * dim]
            out = out * gate
        out = p["o"](self._norm("attn_sub_norm", out))
        if s.attn_out_bias and self.index in s.attn_out_bias_layers:
            out = out + self._param(s.attn_out_bias)
        return out

    def attend_heads(self, q, k, v, ctx: Context, **options):
        """Causal attention of q [B, H, T, D] over k, v [B, KVH, T, D], which enter the cache here (if any). A
        plugin's layer may compose another mask (vkformers-moe's Llama 4 chunks)."""
        if ctx.cache is not None:
            return ctx.cache.attend(self.index, q, k, v, **options)
        return F.scaled_dot_product_attention(q, k, v, causal=True, **options)

    # -- MLP

    def mlp(self, h):
        p, s = self.parts, self.spec
        if "moe" in p:
            return p["moe"](h)
        if "gate_up" in p:
            gate_up = p["gate_up"](h)
            inter = s.intermediate_size
            hidden = self.act(gate_up[..., :inter]) * gate_up[..., inter:]
        elif "gate" in p:
            hidden = self.act(p["gate"](h)) * p["up"](h)
        else:
            hidden = self.act(p["up"](h))
        return p["down"](self._norm("mlp_sub_norm", hidden))

    # -- decode step: fused kernels

    def _fused_decode_plan(self):
        """What a fused decode step reads: the attention norm and (weight, bias or None) of the q, k, v and o
        products (row slices of a fused qkv_proj [q | k | v]), and for a gated MLP the MLP norm and its gate, up
        and down products (or of a fused gate_up_proj [gate | up]; "gate_up" None: the MLP, e.g. a MoE block, is
        composed as usual). None when this layer is not the plain pre-norm block with RMS norms and rotary (or
        no) attention that the fused kernels (engine/ops/decode.py) compose."""
        if type(self).attend_heads is not DecoderLayer.attend_heads:  # a plugin's own attention (Llama 4 chunks)
            return None
        s, p = self.spec, self.parts
        attn = ("qkv",) if "qkv" in p else ("q", "k", "v")
        mlp = ("gate_up",) if "gate_up" in p else ("gate", "up")
        disqualifying = {"attn_out_norm", "mlp_out_norm", "attn_sub_norm", "mlp_sub_norm", "output_gate", "linear"}
        qk_norm = (p["q_norm"], p["k_norm"]) if "q_norm" in p else None  # Qwen3: one RMS weight over each head
        if qk_norm and (s.qk_norm_scope != "head" or s.qk_norm_after_rope or s.head_dim > 256
                        or not all(isinstance(n, RMSNorm) and n.elementwise for n in qk_norm)):
            return None
        if (s.post_norm or s.parallel_residual or s.norm != "rms" or s.mla or s.q_gate or s.clip_qkv is not None
                or s.attention_sinks or s.query_position_scale is not None
                or (s.attn_out_bias and self.index in s.attn_out_bias_layers)
                or ("qkv" in p and s.qkv_layout != "blocks") or disqualifying & set(p)
                or any(n not in p for n in ("attn_in_norm", "mlp_in_norm", *attn, "o"))
                or any(type(p[n]) is not Linear or p[n].quantized for n in (*attn, "o"))
                or len({p[n].has_bias for n in attn}) != 1):
            return None
        fused_mlp = ("moe" not in p and s.mlp_kind == "gated" and _FUSED_ACTIVATIONS.get(s.hidden_act) is not None
                     and all(n in p and type(p[n]) is Linear and not p[n].quantized for n in (*mlp, "down"))
                     and len({p[n].has_bias for n in mlp}) == 1)

        def blocks(name, widths=None):  # (weight, bias or None) of a projection, or of each row block of a fused one
            w, b = p[name].weight, p[name].bias if p[name].has_bias else None
            starts = [0]
            for width in widths or ():
                starts.append(starts[-1] + width)
            if widths is None:
                return [(w, b)]
            return [(w[i:j], None if b is None else b[i:j]) for i, j in zip(starts, starts[1:])]
        q_out, kv_out, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        plan = dict(attn_norm=p["attn_in_norm"], mlp_norm=p["mlp_in_norm"], qk_norm=qk_norm, o=blocks("o")[0],
                    qkv=blocks("qkv", (q_out, kv_out, kv_out)) if "qkv" in p else [blocks(n)[0] for n in attn],
                    gate_up=None, down=None)
        if fused_mlp:
            plan.update(down=blocks("down")[0], gate_up=blocks("gate_up", (inter, inter)) if "gate_up" in p
                        else [blocks(n)[0] for n in mlp])
        return plan

    def _decode_fused(self, x, ctx: Context):
        """One decode step of this layer in five dispatches: norm + q/k/v + rotary + cache write, attention,
        o_proj + residual, norm + gate/up + activation, down + residual (with QK-norm: the q, k, v products, then
        the norms + rotary + cache write). None (nothing built) when the layer or its operands don't fit."""
        plan = self._fused_decode_plan()  # checked per call: LoRA may have wrapped a projection since
        if plan is None:
            return None
        s, cache, batch = self.spec, ctx.cache, x.shape[0]
        attn_norm, mlp_norm = _fused_norm(plan["attn_norm"]), _fused_norm(plan["mlp_norm"])
        weights = lambda part: [w for w, _ in plan[part]]  # noqa: E731
        biases = lambda part: None if plan[part][0][1] is None else [b for _, b in plan[part]]  # noqa: E731
        o, o_bias = plan["o"]
        fused_mlp = plan["gate_up"] is not None
        if not (F.fusable(x, weights("qkv"), attn_norm) and F.fusable_weights(x.dtype, batch, [o])
                and (not fused_mlp or (F.fusable(x, weights("gate_up"), mlp_norm)
                                       and F.fusable_weights(x.dtype, batch, [plan["down"][0]])))):
            return None
        bounds, _ = cache.step_inputs(1, ctx.key_padding_mask)
        inv_freq, scaling = ctx.rope_tables[self.index] if self.rotates else (None, 1.0)  # NoPE layers: no rotation
        rotary = dict(k_cache=cache.keys[self.index], v_cache=cache.values[self.index], cache_start=bounds[0:1],
                      positions=ctx.rope_positions, inv_freq=inv_freq, head_dim=s.head_dim, attention_scaling=scaling,
                      interleaved=s.rope_interleaved)
        if plan["qk_norm"] is None:
            q = F.fused_qkv_rope_write(x, *weights("qkv"), norm=attn_norm, biases=biases("qkv"), **rotary)
        else:  # three independent products (no barrier between them), then the per-head norms, rotary and cache
            q, k, v = (F.fused_linear(x, w, norm=attn_norm, bias=b) for w, b in plan["qkv"])
            q_norm, k_norm = (_fused_norm(n) for n in plan["qk_norm"])
            q = F.fused_head_norm_rope_write(q, k, v, q_norm=q_norm, k_norm=k_norm, **rotary)
        out = cache.attend_stored(self.index, q, scale=self.scale, window=self.window, softcap=s.attn_softcap,
                                  alibi_slopes=self.alibi, key_padding_mask=ctx.key_padding_mask)
        x = F.fused_linear(out.reshape(batch, 1, -1), o, bias=o_bias, residual=x, residual_scale=s.residual_scale)
        if not fused_mlp:  # a MoE block or another MLP: composed as in forward()
            return x + _scaled(self.mlp(self._norm("mlp_in_norm", x)), s.residual_scale)
        hidden = F.fused_gated(x, *weights("gate_up"), activation=_FUSED_ACTIVATIONS[s.hidden_act], norm=mlp_norm,
                               biases=biases("gate_up"))
        down, down_bias = plan["down"]
        return F.fused_linear(hidden, down, bias=down_bias, residual=x, residual_scale=s.residual_scale)

    def forward(self, x, ctx: Context):
        s = self.spec
        if ctx.cache is not None and x.shape[1] == 1 and not grad_enabled():
            fused = self._decode_fused(x, ctx)
            if fused is not None:
                return fused
        if s.post_norm:
            return self._forward_post_norm(x, ctx)
        h = self._norm("attn_in_norm", x)
        attn = self._norm("attn_out_norm", self.attention(h, ctx))
        if s.parallel_residual:  # attention and MLP both read the block input
            mlp_in = self._norm("mlp_in_norm", x) if "mlp_in_norm" in self.parts else h
            mlp = self._norm("mlp_out_norm", self.mlp(mlp_in))
            return x + _scaled(attn + mlp, s.residual_scale)
        x = x + _scaled(attn, s.residual_scale)
        mlp = self._norm("mlp_out_norm", self.mlp(self._norm("mlp_in_norm", x)))
        return x + _scaled(mlp, s.residual_scale)

    def _forward_post_norm(self, x, ctx: Context):
        """OPT-350m (do_layer_norm_before=False): x = norm(x + attn(x)); x = norm'(x + mlp(x))."""
        x = self._norm("attn_in_norm", x + self.attention(x, ctx))
        return self._norm("mlp_in_norm", x + self.mlp(x))


def _fused_norm(norm: RMSNorm) -> F.FusedNorm:
    """An RMSNorm module as the fused decode kernels' prologue."""
    return F.FusedNorm(norm.weight if norm.elementwise else None, norm.eps, norm.unit_offset)


# hidden_act names -> the fused decode kernel's activations
_FUSED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                      "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu"}


def _scaled(x, factor: float):
    return x if factor == 1.0 else x * factor


def _shift_labels(labels: np.ndarray) -> np.ndarray:
    shifted = np.full(labels.shape, IGNORE_INDEX, np.int32)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def _as_numpy(value, dtype=np.int64):
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.numpy()
    return np.asarray(value).astype(dtype)


def _mask_bytes(mask) -> np.ndarray:
    """An attention mask as a bool tensor's bytes: a captured training step derives it anew from the next batch's."""
    return (np.asarray(mask) != 0).astype(np.uint8)


def _round_to(value: float, dtype) -> float:
    """A Python float rounded to a storage dtype (torch multiplies by a scalar tensor of that dtype)."""
    if dtype is dt.bfloat16:
        return float(dt.from_bfloat16(dt.to_bfloat16(np.asarray([value], np.float32)))[0])
    if dtype is dt.float16:
        return float(np.float16(value))
    return float(np.float32(value))


def checkpoint_named(layers: ModuleList, spec) -> ModuleList:
    """``layers`` named by their checkpoint indices (DecoderSpec.checkpoint_layers) instead of 0, 1, ...: loading
    and saving then use the checkpoint's names; iteration and indexing stay in run order."""
    if spec.checkpoint_layers:
        layers._modules.clear()
        layers._modules.update((str(i), layer) for i, layer in zip(spec.checkpoint_layers, layers.items))
    return layers


class DecoderForCausalLM(Module, GenerationMixin):
    """A dense causal decoder of any architecture in :data:`vkformers_llama.variants.VARIANTS`."""

    ignored_checkpoint_keys = IGNORED_CHECKPOINT_KEYS
    supports_gradient_checkpointing = True  # run_layers goes through call_layer
    decoder_spec = staticmethod(decoder_spec)  # config -> DecoderSpec; a subclass may read other variants (vkformers-moe)

    def __init__(self, config: dict, architecture):
        super().__init__()
        name = getattr(architecture, "name", architecture)
        spec = self.decoder_spec(config, name)
        self.config, self.architecture_name, self.spec = config, name, spec
        self.dtype = dt.float32  # from_pretrained sets the loaded dtype
        # generate may replay a decode step without this forward (models/decode_capture.py), which sees
        # inputs that change every step but not ones that only change past some position (Llama 4's scale)
        self.capture_decode = spec.query_position_scale is None and not spec.linear_layers  # (linear layers: their
        # recurrent state lives on the cache, updated by the Python forward)
        # HF's longrope models switch to the long factors past the original context, and their
        # generate() then recomputes the cache with them (Phi-3): generation does the same.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) in ("longrope", "su"):
            self.recompute_cache_beyond = rope.get("original_max_position_embeddings") or \
                config.get("original_max_position_embeddings")
        d = spec.hidden_size
        alibi = None
        if spec.alibi:
            slopes = (mpt_alibi_slopes(spec.num_heads, spec.extra.get("alibi_bias_max", 8)) if spec.alibi_kind == "mpt"
                      else alibi_slopes(spec.num_heads))
            alibi = Tensor((slopes * np.float32(spec.alibi_slope_scale)).astype(np.float32))
        refs = dict(  # plain references (object.__setattr__): place() already registered them under HF paths
            embed=place(self, spec.embed, Embedding(spec.vocab_size + spec.embed_extra_rows, spec.embed_dim or d,
                                                         padding_idx=spec.embed_padding_idx)),
            project_in=place(self, spec.project_in, Linear(spec.embed_dim, d, bias=False)) if spec.project_in else None,
            project_out=(place(self, spec.project_out, Linear(d, spec.embed_dim, bias=False))
                         if spec.project_out else None),
            embed_norm=(place(self, spec.embed_norm, make_norm(_embed_norm_spec(spec), d))
                        if spec.embed_norm else None),
            position_embed=(place(self, spec.position_embed,
                                  Embedding(spec.max_position_embeddings + spec.position_offset, d))
                            if spec.position_embed else None),
            layers=place(self, spec.layers, checkpoint_named(ModuleList((spec.make_layer or DecoderLayer)(spec, i, alibi)
                                                                          for i in range(spec.num_layers)), spec)),
            final_norm=place(self, spec.final_norm, make_norm(spec, d)) if spec.final_norm else None,
            head_dense=(place(self, join_path(spec.head_transform, "dense"),
                              Linear(d, d, bias=spec.head_transform_bias))
                        if spec.head_transform else None),
            head_norm=(place(self, join_path(spec.head_transform, "norm"), make_norm(spec, d))
                       if spec.head_transform else None),
            lm_head=place(self, spec.lm_head, Linear(spec.embed_dim or d, spec.vocab_size, bias=spec.lm_head_bias)),
        )
        for name, module in refs.items():
            object.__setattr__(self, name, module)
        if spec.tie_embeddings:
            self.tie(f"{spec.lm_head}.weight", f"{spec.embed}.weight")
        self.rope_configs = spec.rope_configs or ((config, None),) * spec.num_layers
        self.position_table = None
        if spec.sinusoidal_positions:  # fixed, not a parameter
            rows = spec.max_position_embeddings + spec.position_offset
            self.position_table = Tensor(sinusoidal_table(spec.sinusoidal_positions, rows, d,
                                                          spec.extra.get("padding_row")))

    def load_state_dict(self, arrays, *args, **kwargs):
        if self.spec.checkpoint_layers:  # the layers this forward skips (Mllama's cross-attention ones): not loaded
            kept = {f"{self.spec.layers}.{i}." for i in self.spec.checkpoint_layers}
            arrays = {name: array for name, array in arrays.items()
                      if not name.startswith(f"{self.spec.layers}.") or name.startswith(tuple(kept))}
        for path, module in self.named_modules():  # files laid out otherwise than the parameters (OLMo Hybrid's convs)
            if hasattr(module, "convert_checkpoint"):
                arrays = module.convert_checkpoint(arrays, path)
        super().load_state_dict(arrays, *args, **kwargs)
        for path, module in self.named_modules():  # checkpoint buffers that are not parameters (MoE routing biases)
            if hasattr(module, "load_buffers"):
                module.load_buffers(arrays, path)
        if self.spec.hidden_act == "xielu":  # xIELU's beta / eps are checkpoint buffers, not parameters
            for i, layer in enumerate(self.layers):
                prefix = join_path(self.spec.layers, str(i), self.spec.mlp, "act_fn")
                if f"{prefix}.beta" in arrays:
                    layer.xielu_buffers = (float(np.asarray(arrays[f"{prefix}.beta"]).reshape(-1)[0]),
                                           float(np.asarray(arrays[f"{prefix}.eps"]).reshape(-1)[0]))

    # -- what GenerationMixin reads

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        """The attention's head size, what the KV cache stores: MLA pads the narrower of qk and v to the wider."""
        return max(self.spec.head_dim, self.spec.mla_v_dim) if self.spec.mla else self.spec.head_dim

    @property
    def max_position_embeddings(self) -> int:
        return self.spec.max_position_embeddings

    def input_limits(self) -> InputLimits:
        s = self.spec
        table = s.position_embed or s.sinusoidal_positions  # rotary, ALiBi and NoPE models have none to run past
        field = next((f for f in ("max_position_embeddings", "n_positions", "max_seq_len") if f in self.config),
                     "max_position_embeddings")
        return InputLimits(vocab_size=s.vocab_size + s.embed_extra_rows, label_classes=s.vocab_size,
                           max_length=s.max_position_embeddings if table else None, max_length_field=field,
                           min_position=-1 if s.generation_positions == "fairseq" else 0)

    # -- forward

    def _positions(self, batch, length, attention_mask, position_ids, past) -> np.ndarray:
        if position_ids is not None:
            given = position_ids.numpy() if isinstance(position_ids, Tensor) else np.asarray(position_ids)
            if given.shape == (batch, length) and given.dtype == np.int32:
                return given  # the array itself: generate recognises it in a captured decode step
            return np.broadcast_to(given, (batch, length)).astype(np.int32)
        if self.spec.positions_from_mask and attention_mask is not None:  # OPT: count only attended tokens
            return ((np.cumsum(attention_mask, axis=1) * attention_mask - 1)[:, -length:]).astype(np.int32)
        return np.broadcast_to(past + np.arange(length, dtype=np.int32), (batch, length)).astype(np.int32)

    def generation_positions(self, mask: np.ndarray, tokens: np.ndarray, prompt_length: int) -> np.ndarray:
        kind = self.spec.generation_positions
        if kind == "mask":
            return super().generation_positions(mask, tokens, prompt_length)
        index = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
        if kind == "index":
            return index.copy()
        # "fairseq": transformers counts non-pad ids from the prompt (cumsum), then places each later token at the
        # cache length; a pad id gets the padding row (relative position -1)
        real = tokens != self.spec.extra["padding_row"]
        counted = np.where(index < prompt_length, np.cumsum(real, axis=1) - 1, index)
        return np.where(real, counted, -1)

    def _rope_tables(self, seq_len: int):
        """(inv_freq Tensor, attention_scaling) per layer; layers sharing a rope config share one table."""
        tables, by_key = [], {}
        for config, layer_type in self.rope_configs:
            key = (id(config), layer_type)
            if key not in by_key:
                inv_freq, scaling = rope_parameters(config, seq_len, layer_type=layer_type)
                by_key[key] = (Tensor(inv_freq.astype(np.float32)), scaling)
            tables.append(by_key[key])
        return tables

    def prompt_padding_is_exact(self, length: int, padded: int) -> bool:
        """Whether a prompt padded on the right from ``length`` to ``padded`` tokens keeps its own tokens'
        logits and cache entries (generate pads prompts so that prompts of different lengths share a recorded
        prefill): causal attention without state outside the cache (capture_decode), and rotary tables that are
        the same for both lengths (dynamic NTK changes them past the original context)."""
        if not self.capture_decode:
            return False
        for config, layer_type in (self.rope_configs if self.spec.rope else ()):
            short, short_scale = rope_parameters(config, length, layer_type=layer_type)
            long, long_scale = rope_parameters(config, padded, layer_type=layer_type)
            if short_scale != long_scale or not np.array_equal(short, long):
                return False
        return True

    def _query_scale(self, positions):
        """Llama 4 / Ministral 3: 1 + beta * log(1 + floor(pos / L)) per position, as [B, 1, T, 1]."""
        if self.spec.query_position_scale is None:
            return None
        beta, length = self.spec.query_position_scale
        scale = 1.0 + beta * np.log1p(np.floor(positions.astype(np.float32) / np.float32(length)))
        return Tensor(scale.astype(np.float32)[:, None, :, None])

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, cache=None):
        s = self.spec
        length = np.shape(input_ids)[-1] if not isinstance(input_ids, Tensor) else input_ids.shape[-1]
        x = self.residual_stream(input_ids, attention_mask, position_ids, cache)
        logits = self._fused_decode_head(x) if cache is not None and length == 1 else None
        if logits is None:
            x = self.final_hidden_states(x)
            if self.head_dense is not None:
                x = self.head_norm(F.activation(s.head_transform_act)(self.head_dense(x)))
            logits = self.lm_head(x)
        if s.logits_scale != 1.0:
            logits = logits * s.logits_scale
        if s.final_softcap:
            logits = (logits * (1.0 / s.final_softcap)).tanh() * s.final_softcap
        if cache is not None:
            cache.advance(length)
        loss = self.loss(logits, labels, shift=s.shift_labels) if labels is not None else None
        return CausalLMOutput(logits=logits, loss=loss)

    def final_hidden_states(self, x):
        """The residual stream after the last layer -> the hidden states the LM head reads (transformers' base
        model's last_hidden_state): final norm, and the projection out of the hidden width where there is one."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def residual_stream(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        """Embeddings and every layer: the residual stream [B, T, hidden] before the final norm."""
        s = self.spec
        ids = input_ids if isinstance(input_ids, Tensor) else Tensor(np.asarray(input_ids, dtype=np.int32))
        if ids.dtype is not dt.int32:
            ids = ids.cast(dt.int32)
        batch, length = ids.shape
        past = cache.position if cache is not None else 0
        mask = _as_numpy(attention_mask)
        if position_ids is None and s.generation_positions == "fairseq" and not isinstance(input_ids, Tensor):
            # as transformers' TrOCR: the ids that are not the pad id are counted (a pad id takes the padding row
            # wherever it stands, attended or not); ids already on the device fall back to the mask's count
            real = np.asarray(input_ids) != s.extra["padding_row"]
            position_ids = np.where(real, np.cumsum(real, axis=1) - 1 + past, -1).astype(np.int32)
        positions = self._positions(batch, length, mask, position_ids, past)

        x = F.embedding(ids, self.embed.weight, padding_idx=self.embed.padding_idx)
        if s.embed_scale != 1.0:
            scale = _round_to(s.embed_scale, self.dtype) if s.embed_scale_in_dtype else s.embed_scale
            x = x * scale
        if self.project_in is not None:
            x = self.project_in(x)
        # One positions input, everything else derived on the GPU: a captured decode step rewrites
        # only this array (models/generation.py), so derived copies must not be separate host inputs.
        position_tensor = Tensor(positions)
        tables = [t for t in (self.position_embed.weight if self.position_embed is not None else None,
                              self.position_table) if t is not None]
        if tables:
            absolute = position_tensor + s.position_offset if s.position_offset else position_tensor
            for table in tables:
                x = x + F.embedding(absolute, table)
        if self.embed_norm is not None:
            x = self.embed_norm(x)

        key_padding_mask = None
        if mask is not None and (cache is not None or not mask.all()):
            key_padding_mask = Tensor(lazy.derived_input(_mask_bytes(mask), attention_mask, _mask_bytes), dtype=dt.bool_)
        rope_tables = self._rope_tables(int(positions.max()) + 1) if s.rope else None
        ctx = Context(position_tensor, key_padding_mask, rope_tables, cache,
                      rope_positions=-position_tensor if s.rope_negated else None,
                      query_scale=self._query_scale(positions), host_mask=mask, host_positions=positions)
        return self.run_layers(x, ctx)

    def run_layers(self, x, ctx: Context):
        """The layers over the residual stream, embeddings to final norm (a plugin's model may widen the stream
        between them: DeepSeek-V4's hyper-connections)."""
        for layer in self.layers:
            x = self.call_layer(layer, x, ctx)
        return x

    def _fused_decode_head(self, x):
        """Final RMS norm and lm_head of a decode step as one fused product, or None where they differ."""
        norm, head = self.final_norm, self.lm_head
        if (not isinstance(norm, RMSNorm) or self.project_out is not None or self.head_dense is not None
                or type(head) is not Linear or head.has_bias or head.quantized):
            return None
        fused_norm = _fused_norm(norm)
        return F.fused_linear(x, head.weight, norm=fused_norm) if F.fusable(x, [head.weight], fused_norm) else None

    @staticmethod
    def loss(logits, labels, shift: bool = True):
        """transformers' ForCausalLMLoss: token t predicts label t + 1 (label t without ``shift``); -100 is
        ignored; mean in float32."""
        labels = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels, dtype=np.int32)
        if shift:
            labels = lazy.derived_input(_shift_labels(labels), labels, _shift_labels)  # a captured step shifts anew
        return F.cross_entropy(logits.float(), Tensor(labels), ignore_index=IGNORE_INDEX)
