"""The decoder kit's block: one :class:`DecoderLayer` (attention and MLP with the spec's norms and residual
wiring), the :class:`Context` every layer of a forward pass shares, and the pieces plugins compose their own
layers from (:func:`make_projection`, :class:`HeadwiseNorm`).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.function import grad_enabled
from vkformers.engine.tensor import Tensor
from vkformers.models.decoder.gated_deltanet import GatedDeltaNet
from vkformers.models.decoder.norms import make_norm
from vkformers.models.decoder.spec import DecoderSpec, NormSpec
from vkformers.models.layers import Conv1D, LayerNorm, Linear, RMSNorm, UpdatedLinear
from vkformers.models.module import Module, add_param, get_param, join_path, place
from vkformers.runtime import dtypes as dt


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
        if self.spec.norms.kind == "rms":
            y = F.rms_norm(x, None, eps=self.spec.norms.eps)
        else:
            y = F.layer_norm(x, None, None, eps=self.spec.norms.eps)
        return y * self._weight()


def _repeat_kv(x, heads: int):
    """[B, KVH, T, D] -> [B, heads, T, D]: query head h reads kv head h // (heads // KVH)."""
    batch, kv_heads, length, dim = x.shape
    if kv_heads == heads:
        return x
    return x.reshape(batch, kv_heads, 1, length, dim).expand(
        batch, kv_heads, heads // kv_heads, length, dim).contiguous().reshape(batch, heads, length, dim)


# The scores' shrink factor of the blind rows' gradient term (a power of two: q scales exactly)
BLIND_SCORE_EPS = 2.0 ** -20


def blind_row_indicator(attention_mask, length: int, window: int) -> np.ndarray:
    """float32 [B, 1, T, 1]: 1 for each query that sees no key under the causal mask, ``window`` and
    ``attention_mask`` [B, T] (1: attend), else 0."""
    mask = np.asarray(attention_mask)[:, -length:] != 0
    query, key = np.arange(length)[:, None], np.arange(length)[None, :]
    shown = key <= query
    if window:
        shown &= query - key < window
    blind = ~(shown[None] & mask[:, None, :]).any(-1)  # [B, T]
    return blind[:, None, :, None].astype(np.float32)


class Context:
    """What every layer of one forward pass shares: positions, masks, rotary tables, the cache."""

    def __init__(self, positions, key_padding_mask, rope_tables, cache, rope_positions=None, query_scale=None,
                 host_mask=None, host_positions=None, embeddings=None, mask_source=None, token_ids=None):
        self.positions, self.key_padding_mask, self.rope_tables, self.cache = (
            positions, key_padding_mask, rope_tables, cache)
        self.encoder_states = None            # cross-attention: the encoder's last hidden states [B, S, D]
        self.encoder_padding_mask = None      # and their bool [B, S] padding mask, or None
        self.rope_positions = positions if rope_positions is None else rope_positions  # negated for NanoChat
        self.query_scale = query_scale        # [B, 1, T, 1] Llama-4 position scaling of the queries, or None
        self.host_mask = host_mask            # attention_mask as numpy [B, T] or None (host-built masks)
        self.host_positions = host_positions  # positions as numpy [B, T] (host-built masks), or None
        self.mask_source = mask_source        # attention_mask as given: what a captured step derives host_mask's
        #                                       inputs from (lazy.derived_input)
        self.embeddings = embeddings          # the token embeddings entering the first layer (Zamba's shared blocks
        #                                       read them beside the stream), or None
        self.token_ids = token_ids            # the token ids on the device, int32 [B, T] (what a layer derives from
        #                                       them it derives there: a captured step rewrites only the ids), or None
        self._padding_keeps: dict = {}        # padding_keep's tensors, one per (columns, dtype) for all layers

    def padding_mask(self, length: int) -> np.ndarray | None:
        """1 at the last ``length`` columns' tokens and 0 at their padding, float32 [B, length] on the host, or None
        where none of them is padding."""
        mask = self.host_mask
        if mask is None or mask[:, -length:].all():
            return None
        return mask[:, -length:].astype(np.float32)

    def padding_keep(self, length: int, dtype) -> Tensor | None:
        """padding_mask as a tensor [B, length, 1] in ``dtype`` (a recurrent mixer's inputs times it), or None; made
        once per forward, so that every layer reads one input rather than uploading its own copy."""
        key = (length, str(dtype))
        if key not in self._padding_keeps:
            mask = self.padding_mask(length)
            self._padding_keeps[key] = None if mask is None else Tensor(mask[:, :, None], dtype=dtype)
        return self._padding_keeps[key]

    @property
    def padding_is_layout(self) -> bool:
        """Whether padding only lays rows out in columns (a server's batch: KVCache.padding_is_layout)."""
        return self.cache is not None and self.cache.padding_is_layout


class DecoderLayer(Module):
    """One block: attention and MLP with the spec's norms and residual wiring.

    Parameters live under the checkpoint's relative paths; ``self.parts`` keeps plain
    references to them (a dict, so they are not registered twice).
    """

    def __init__(self, spec: DecoderSpec, index: int, alibi=None):
        super().__init__()
        if spec.attention.heads_per_layer:  # Laguna: the query head count differs per layer (the KV heads do not)
            spec = replace(spec, num_heads=spec.attention.heads_per_layer[index])
        linear = spec.linear_attention
        if linear is not None and linear.layer_norms and linear.layers[index]:
            spec = replace(spec, **dict(linear.layer_norms))
        s, a, d = spec, spec.attention, spec.hidden_size
        object.__setattr__(self, "parts", {})
        self.spec, self.index = s, index
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def add(role, relative_path, module):
            self.parts[role] = place(self, relative_path, module)

        attn_in = a.in_width or d  # the attention's input width (Zamba's shared block: [stream | embeddings])
        for role in ("attn_in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm"):
            if getattr(s, role) and not (role == "attn_in_norm" and index in s.attn_in_norm_skipped):
                add(role, getattr(s, role), make_norm(s, attn_in if role == "attn_in_norm" else d))
        if s.cross_attention is not None:  # GPT-2 as an encoder-decoder's decoder
            c = s.cross_attention
            add("cross_norm", c.norm, make_norm(s, d))
            add("cross_q", f"{c.path}.{c.q_proj}", make_projection(s, d, q_out, c.bias))
            add("cross_kv", f"{c.path}.{c.kv_proj}", make_projection(s, d, 2 * q_out, c.bias))
            add("cross_o", f"{c.path}.{c.o_proj}", make_projection(s, q_out, d, c.bias))
        self.linear = linear is not None and bool(linear.layers[index])
        own_attention = a.module is not None and not self.linear
        if self.linear:  # Gated DeltaNet instead of the attention projections
            add("linear", linear.path, (linear.module or GatedDeltaNet)(s))
        elif own_attention:  # a plugin's attention module instead of the projections
            add("own_attention", a.path, a.module(s))
        elif s.mla:
            self._init_mla(add)
            q_out = s.num_heads * s.mla.v_dim  # o_proj reads the value heads
        elif a.qkv_proj:
            add("qkv", join_path(a.path, a.qkv_proj),
                make_projection(s, d, q_out + 2 * kv_out, bias=a.q_bias))
        else:
            q_width = 2 * q_out if a.q_gate else q_out  # Qwen3.5: [query | gate] per head
            add("q", join_path(a.path, a.q_proj), make_projection(s, attn_in, q_width, bias=a.q_bias))
            add("k", join_path(a.path, a.k_proj), make_projection(s, attn_in, kv_out, bias=a.k_bias))
            add("v", join_path(a.path, a.v_proj), make_projection(s, attn_in, kv_out, bias=a.v_bias))
        if not self.linear and not own_attention:
            add("o", join_path(a.path, a.o_proj), make_projection(s, q_out, d, bias=a.o_bias))
        if a.q_norm and (self.linear or own_attention):
            pass  # a linear-attention layer has no q/k norm; a plugin's attention module has its own
        elif a.q_norm and a.qk_norm_scope in ("per_head", "per_head_list"):
            stacked = a.qk_norm_scope == "per_head"
            add("q_norm", join_path(a.path, a.q_norm), HeadwiseNorm(s, s.num_heads, stacked))
            add("k_norm", join_path(a.path, a.k_norm), HeadwiseNorm(s, s.num_kv_heads, stacked))
        elif a.q_norm:
            full = a.qk_norm_scope == "full"
            add("q_norm", join_path(a.path, a.q_norm), make_norm(s, q_out if full else s.head_dim))
            add("k_norm", join_path(a.path, a.k_norm), make_norm(s, kv_out if full else s.head_dim))
        inter, m = s.intermediate_size, s.mlp
        sparse = s.moe.block(s, index) if s.moe is not None else None
        if sparse is not None:  # the MLP slot's block instead of the dense MLP (vkformers-moe's sparse block)
            add("moe", sparse.path, sparse)
            for path, module in getattr(sparse, "layer_modules", {}).items():  # its parts stored beside it
                place(self, path, module)
        elif m.kind == "gated" and m.gate_up_proj:
            add("gate_up", join_path(m.path, m.gate_up_proj), make_projection(s, d, 2 * inter, bias=m.bias))
        elif m.kind == "gated":
            add("gate", join_path(m.path, m.gate_proj), make_projection(s, d, inter, bias=m.bias))
            add("up", join_path(m.path, m.up_proj), make_projection(s, d, inter, bias=m.bias))
        else:
            add("up", join_path(m.path, m.up_proj), make_projection(s, d, inter, bias=m.bias))
        if sparse is None:
            add("down", join_path(m.path, m.down_proj), make_projection(s, inter, d, bias=m.bias))
        if a.sub_norm:
            add("attn_sub_norm", join_path(a.path, a.sub_norm), make_norm(s, q_out))
        if m.sub_norm:
            add("mlp_sub_norm", join_path(m.path, m.sub_norm), make_norm(s, inter))
        if a.sinks:
            add_param(self, join_path(a.path, a.sinks), (s.num_heads,))
        if a.output_gate and not self.linear and not own_attention:  # the softmax attention layers' gate
            add("output_gate", join_path(a.path, a.output_gate),
                Linear(d, s.num_heads if a.output_gate_per_head else q_out, bias=False))
        if a.out_bias and index in a.out_bias_layers:
            add_param(self, join_path(a.path, a.out_bias), (d,))
        for path, shape in s.unused_layer_params:
            add_param(self, path, shape)
        if s.hidden_act == "xielu":
            add_param(self, join_path(s.mlp.path, "act_fn.alpha_p"), (1,))
            add_param(self, join_path(s.mlp.path, "act_fn.alpha_n"), (1,))
            self.xielu_buffers = (0.5, -1e-6)  # transformers' defaults; from_pretrained reads the checkpoint's
            self.act = self._xielu
        else:
            self.act = F.activation(s.hidden_act)
        self.rotates = s.positions.rope and (not s.positions.rope_layers or bool(s.positions.rope_layers[index]))
        self.scale = a.scales[index] if a.scales else s.head_dim ** -0.5
        self.window = a.windows[index] if a.windows else 0
        self.alibi = alibi
        self._choose_strategies()

    def _choose_strategies(self):
        """Pick, once from the spec, the functions forward runs: which attention (linear, MLA or softmax over
        q/k/v projections), how a fused qkv projection splits, where the QK-norm sits, which MLP (the slot's
        block, a fused or separate gated MLP, a plain one) and how the residual stream is wired."""
        s, p = self.spec, self.parts
        if self.linear:
            attention = self._linear_attention
        elif "own_attention" in p:
            attention = self._own_attention
        elif s.mla:
            attention = self._mla_attention
        else:
            attention = self._softmax_attention
        split = _QKV_SPLITS.get(s.attention.qkv_layout) if "qkv" in p else _separate_qkv
        if split is None:
            raise ValueError(f"unknown qkv layout {s.attention.qkv_layout!r}")
        qk_norm = None
        if "q_norm" in p and s.attention.qk_norm_scope == "full":
            qk_norm = "after_clip" if s.attention.clip_after_qk_norm else "before_clip"
        elif "q_norm" in p:
            qk_norm = "after_rope" if s.attention.qk_norm_after_rope else "heads"
        if "moe" in p:
            mlp = self._sparse_mlp
        elif "gate_up" in p:
            mlp = self._fused_gated_mlp
        elif "gate" in p:
            mlp = self._gated_mlp
        else:
            mlp = self._plain_mlp
        residual = (self._post_norm_residual if s.post_norm else self._parallel_residual if s.parallel_residual
                    else self._sequential_residual)
        for name, value in (("_attention", attention), ("_split_qkv", split), ("_qk_norm_at", qk_norm),
                            ("_mlp", mlp), ("_residual", residual)):
            object.__setattr__(self, name, value)

    def _norm(self, role, x):
        return self.parts[role](x) if role in self.parts else x

    def _param(self, path):
        return get_param(self, join_path(self.spec.attention.path, path))

    def _xielu(self, x):
        mlp = join_path(self.spec.mlp.path, "act_fn")
        beta, eps = self.xielu_buffers
        return xielu(x, get_param(self, mlp + ".alpha_p"), get_param(self, mlp + ".alpha_n"), beta, eps)

    # -- multi-head latent attention (DeepSeek-V2)

    def _init_mla(self, add):
        s, m, d = self.spec, self.spec.mla, self.spec.hidden_size
        heads, qk_dim = s.num_heads, m.nope_dim + m.rope_dim
        rms = NormSpec("rms", eps=m.norm_eps or s.norms.eps)
        if m.q_lora_rank:
            add("q_a", join_path(s.attention.path, "q_a_proj"), Linear(d, m.q_lora_rank, bias=s.attention.q_bias))
            add("q_a_norm", join_path(s.attention.path, "q_a_layernorm"), make_norm(rms, m.q_lora_rank))
            add("q_b", join_path(s.attention.path, "q_b_proj"), Linear(m.q_lora_rank, heads * qk_dim, bias=False))
        else:
            add("q", join_path(s.attention.path, "q_proj"), Linear(d, heads * qk_dim, bias=False))
        add("kv_a", join_path(s.attention.path, "kv_a_proj_with_mqa"),
            Linear(d, m.kv_lora_rank + m.rope_dim, bias=s.attention.q_bias))
        add("kv_a_norm", join_path(s.attention.path, "kv_a_layernorm"), make_norm(rms, m.kv_lora_rank))
        if m.rope_key_norm:
            add("rope_key_norm", join_path(s.attention.path, m.rope_key_norm), make_norm(rms, m.rope_dim))
        add("kv_b", join_path(s.attention.path, "kv_b_proj"),
            Linear(m.kv_lora_rank, heads * (m.nope_dim + m.v_dim), bias=False))

    def _mla_qkv(self, h, ctx: Context, q=None):
        """q, k [B, H, T, nope + rope] and v [B, H, T, v_dim]; the rotary key part is shared by all heads. ``q``:
        the queries [B, T, H * (nope + rope)] when a plugin's layer projects them otherwise (A.X-K2)."""
        s, m, p = self.spec, self.spec.mla, self.parts
        batch, length, _ = h.shape
        heads, nope, rdim, vdim = s.num_heads, m.nope_dim, m.rope_dim, m.v_dim
        if q is None:
            q = p["q_b"](p["q_a_norm"](p["q_a"](h))) if "q_b" in p else p["q"](h)
        if m.q_scale != 1.0:
            q = q * m.q_scale
        q = q.reshape(batch, length, heads, nope + rdim).permute(0, 2, 1, 3)
        compressed = p["kv_a"](h)
        latent, k_rot = (compressed[..., :m.kv_lora_rank], compressed[..., m.kv_lora_rank:]) if rdim else \
            (compressed, None)
        latent = p["kv_a_norm"](latent)
        if "rope_key_norm" in p:
            k_rot = p["rope_key_norm"](k_rot)
        if m.kv_scale != 1.0:
            latent = latent * m.kv_scale
        kv = p["kv_b"](latent).reshape(batch, length, heads, nope + vdim).permute(0, 2, 1, 3)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        if rdim and self.rotates:
            inv_freq, scaling = ctx.rope_tables[self.index]
            q_rot = F.rope(q[..., nope:].contiguous(), ctx.rope_positions, inv_freq,
                           interleaved=s.positions.rope_interleaved, attention_scaling=scaling)
            k_rot = F.rope(k_rot.reshape(batch, 1, length, rdim), ctx.rope_positions, inv_freq,
                           interleaved=s.positions.rope_interleaved, attention_scaling=scaling)
            q = F.cat([q[..., :nope], q_rot], -1)
            k = F.cat([k_nope, k_rot.expand(batch, heads, length, rdim)], -1)
        elif rdim:  # Kimi Linear: the shared key part without rotary
            k = F.cat([k_nope, k_rot.reshape(batch, 1, length, rdim).expand(batch, heads, length, rdim)], -1)
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
        return self._split_qkv(self.spec, self.parts, h)

    def attention(self, h, ctx: Context):
        """The attention sublayer on the normed stream ``h``, as chosen at build time."""
        return self._attention(h, ctx)

    def _linear_attention(self, h, ctx: Context):
        return self.parts["linear"](h, ctx, self.index)

    def _own_attention(self, h, ctx: Context):
        return self.parts["own_attention"](h, ctx, self.index)

    def _mla_attention(self, h, ctx: Context):
        batch, length, _ = h.shape
        q, k, v = self._mla_qkv(h, ctx)
        return self._attend(q, k, v, ctx, batch, length)

    def _softmax_attention(self, h, ctx: Context):
        s, a, p = self.spec, self.spec.attention, self.parts
        batch, length, _ = h.shape
        gate = p["output_gate"](h) if "output_gate" in p else None
        if gate is not None:
            gate = gate.sigmoid() if a.output_gate_sigmoid else F.softplus(gate)
        q, k, v = self._project_qkv(h)
        if a.q_gate:  # [B, T, heads, (query, gate), D]
            split = q.reshape(batch, length, s.num_heads, 2 * s.head_dim)
            gate = F.sigmoid(split[..., s.head_dim:].contiguous().reshape(batch, length, s.num_heads * s.head_dim))
            q = split[..., :s.head_dim].contiguous().reshape(batch, length, s.num_heads * s.head_dim)
        if self._qk_norm_at == "after_clip":  # OLMoE: the clip reads the normed q, k
            q, k = p["q_norm"](q), p["k_norm"](k)
        if a.clip_qkv is not None:
            # maximum/minimum rather than Tensor.clamp, whose backward multiplies two bool masks (unsupported)
            q, k, v = (t.maximum(-a.clip_qkv).minimum(a.clip_qkv) for t in (q, k, v))
        if self._qk_norm_at == "before_clip":  # the whole projection's norm, named for where it sits in HF's order
            q, k = p["q_norm"](q), p["k_norm"](k)
        q = q.reshape(batch, length, s.num_heads, s.head_dim)
        k = k.reshape(batch, length, s.num_kv_heads, s.head_dim)
        v = v.reshape(batch, length, s.num_kv_heads, s.head_dim)
        if self._qk_norm_at == "heads":
            q, k = p["q_norm"](q), p["k_norm"](k)
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        if self.rotates:
            inv_freq, scaling = ctx.rope_tables[self.index]
            q = F.rope(q, ctx.rope_positions, inv_freq, interleaved=s.positions.rope_interleaved,
                       attention_scaling=scaling)
            k = F.rope(k, ctx.rope_positions, inv_freq, interleaved=s.positions.rope_interleaved,
                       attention_scaling=scaling)
        if self._qk_norm_at == "after_rope":  # [B, H, T, D]: the norm is over D either way
            q, k = p["q_norm"](q), p["k_norm"](k)
        return self._attend(q, k, v, ctx, batch, length, gate)

    def _attend(self, q, k, v, ctx: Context, batch, length, gate=None):
        s, a, p = self.spec, self.spec.attention, self.parts
        if ctx.query_scale is not None:
            q = q * ctx.query_scale
        options = dict(scale=self.scale, window=self.window, softcap=a.softcap, alibi_slopes=self.alibi,
                       key_padding_mask=ctx.key_padding_mask)
        if a.sinks:
            options["return_lse"] = True
        out = self.attend_heads(q, k, v, ctx, **options)
        # only where a padding mask is (as the key mask): a captured step's plan then stays valid for every batch.
        # A layer with sinks gives zeros there, as the reference (its sink takes every weight beside the minimum).
        if a.blind_rows != "zero" and not a.sinks and ctx.cache is None and ctx.key_padding_mask is not None:
            out = out + self._blind_rows_mean(q, k, v, ctx)
        if a.sinks:
            out = self._weigh_sinks(*out)
        if s.mla and out.shape[-1] != s.mla.v_dim:
            out = out[..., :s.mla.v_dim]
        heads, dim = out.shape[1], out.shape[3]
        out = out.permute(0, 2, 1, 3)
        per_head = a.output_gate_per_head and not a.q_gate
        if gate is not None and per_head:  # gate [B, T, heads]: one factor per head
            out = out * gate.reshape(batch, length, heads, 1)
        out = out.reshape(batch, length, heads * dim)
        if gate is not None and not per_head:  # gate [B, T, heads * dim]
            out = out * gate
        out = p["o"](self._norm("attn_sub_norm", out))
        if a.out_bias and self.index in a.out_bias_layers:
            out = out + self._param(a.out_bias)
        return out

    def _weigh_sinks(self, out, lse):
        """Attention output [B, H, T, D] of a softmax over the scores and one sink logit per head, whose value is
        zero (gpt-oss): the kernel's output (over the scores alone) times sigmoid(lse - sink)."""
        sinks = self._param(self.spec.attention.sinks).float().reshape(1, -1, 1)
        return out * (lse - sinks).sigmoid().cast(out.dtype).reshape(*lse.shape, 1)

    def _blind_rows_mean(self, q, k, v, ctx: Context):
        """What the spec's reference puts in the query rows that see no key, where the kernel leaves zeros (and no
        gradient): the mean of the values ``attention.blind_rows`` names, from the kernel itself with all-zero
        scores (uniform weights over the keys its masks leave), kept on those rows only. Where the reference adds
        its mask to the scores, they keep the uniform softmax's gradient (the forward value ignores them beside the
        dtype's minimum): the kernel on scores shrunk by EPS, minus itself, over EPS, is a term of value zero with
        that gradient to q and k (to within EPS times a score)."""
        a = self.spec.attention
        length = q.shape[2]
        derive = partial(blind_row_indicator, length=length, window=self.window)
        blind = Tensor(lazy.derived_input(derive(ctx.host_mask), ctx.mask_source, derive))  # [B, 1, T, 1]
        if blind.dtype is not v.dtype:
            blind = blind.cast(v.dtype)
        if a.blind_rows not in ("all", "causal", "attended"):
            raise ValueError(f"attention.blind_rows: unknown kind {a.blind_rows!r} (zero, all, causal or attended)")
        keys = dict(scale=self.scale, causal=a.blind_rows == "causal",
                    window=self.window if a.blind_rows == "causal" else 0,
                    key_padding_mask=ctx.key_padding_mask if a.blind_rows == "attended" else None)
        value_dim = v.shape[-1]
        if value_dim < q.shape[-1]:  # the kernel has one head size: values padded with zeros (MiMo's, MLA's)
            v = F.cat([v, Tensor(np.zeros(v.shape[:-1] + (q.shape[-1] - value_dim,), np.float32), dtype=v.dtype)], -1)
        mean = F.scaled_dot_product_attention(q.detach() * 0.0, k, v, **keys)
        if a.blind_rows_score_grad != 0.0 and grad_enabled():
            if a.softcap:  # the cap's slope depends on each score: the scores themselves (Gemma 2: all keys)
                if a.blind_rows != "all":
                    raise ValueError("attention.blind_rows: with softcap only 'all' keeps the scores' gradient")
                scores = (q @ _repeat_kv(k, q.shape[1]).transpose(-1, -2)) * self.scale  # [B, H, T, T]
                scores = (scores * (1.0 / a.softcap)).tanh() * a.softcap
                fixed = _repeat_kv(v, q.shape[1]).detach()
                f = (scores @ fixed - scores.sum(-1, keepdim=True) * mean.detach()) * (1.0 / length)
            else:
                if v.dtype is dt.float16:  # the gradient scaled by 1 / EPS would overflow float16: float32 there
                    q, k, v = q.float(), k.float(), v.float()
                f = F.scaled_dot_product_attention(q * BLIND_SCORE_EPS, k, v.detach(), **keys) * (1.0 / BLIND_SCORE_EPS)
            if a.blind_rows_score_grad != 1.0:
                f = f * a.blind_rows_score_grad
            zero = f - f.detach()  # in f's dtype: f itself may not fit float16
            mean = mean + (zero if zero.dtype is mean.dtype else zero.cast(mean.dtype))
        return (mean if value_dim == mean.shape[-1] else mean[..., :value_dim]) * blind

    def attend_heads(self, q, k, v, ctx: Context, **options):
        """Causal attention of q [B, H, T, D] over k, v [B, KVH, T, D], which enter the cache here (if any). A
        plugin's layer may compose another mask (vkformers-moe's Llama 4 chunks)."""
        if ctx.cache is not None:
            return ctx.cache.attend(self.index, q, k, v, **options)
        return F.scaled_dot_product_attention(q, k, v, causal=True, **options)

    # -- MLP

    def mlp(self, h):
        """The MLP sublayer on the normed stream ``h``, as chosen at build time (a slot's block, or dense)."""
        return self._mlp(h)

    def _sparse_mlp(self, h):
        return self.parts["moe"](h)

    def _fused_gated_mlp(self, h):
        p, inter = self.parts, self.spec.intermediate_size
        gate_up = p["gate_up"](h)
        return p["down"](self._norm("mlp_sub_norm", self.act(gate_up[..., :inter]) * gate_up[..., inter:]))

    def _gated_mlp(self, h):
        p = self.parts
        return p["down"](self._norm("mlp_sub_norm", self.act(p["gate"](h)) * p["up"](h)))

    def _plain_mlp(self, h):
        p = self.parts
        return p["down"](self._norm("mlp_sub_norm", self.act(p["up"](h))))

    # -- decode step: fused kernels

    def _fused_decode_plan(self):
        """What a fused decode step reads: the attention norm and (weight, bias or None) of the q, k, v and o
        products (row slices of a fused qkv_proj [q | k | v]), and for a gated MLP the MLP norm and its gate, up
        and down products (or of a fused gate_up_proj [gate | up]; "gate_up" None: the MLP, e.g. a MoE block, is
        composed as usual). None when this layer is not the block with RMS norms and rotary (or no) attention that
        the fused kernels (engine/ops/decode.py) compose: the input norms (or none, as EXAONE 4) are the kernels'
        prologues, norms of the attention's and the MLP's outputs (Gemma 2 and 3, EXAONE 4) follow their fused
        products, before the residual."""
        if type(self).attend_heads is not DecoderLayer.attend_heads:  # a plugin's own attention (Llama 4 chunks)
            return None
        s, p = self.spec, self.parts
        attn = ("qkv",) if "qkv" in p else ("q", "k", "v")
        mlp = ("gate_up",) if "gate_up" in p else ("gate", "up")
        disqualifying = {"attn_sub_norm", "mlp_sub_norm", "output_gate", "linear", "own_attention", "cross_q"}
        qk_norm = (p["q_norm"], p["k_norm"]) if "q_norm" in p else None  # Qwen3: one RMS weight over each head
        if qk_norm and (s.attention.qk_norm_scope != "head" or s.attention.qk_norm_after_rope or s.head_dim > 256
                        or not all(isinstance(n, RMSNorm) and n.elementwise for n in qk_norm)):
            return None
        if (s.post_norm or s.parallel_residual or s.norms.kind != "rms" or s.mla or s.attention.q_gate
                or s.attention.clip_qkv is not None
                or (s.attention.out_bias and self.index in s.attention.out_bias_layers)
                or ("qkv" in p and s.attention.qkv_layout != "blocks") or disqualifying & set(p)
                or any(n not in p for n in (*attn, "o"))
                # quantized weights fuse whole (F.fusable: each packed tensor whole, in its own block format)
                or any(not _fuses(p[n]) or (p[n].quantized and n == "qkv") for n in (*attn, "o"))
                or len({p[n].has_bias for n in attn}) != 1):
            return None
        fused_mlp = ("moe" not in p and s.mlp.kind == "gated" and _FUSED_ACTIVATIONS.get(s.hidden_act) is not None
                     and all(n in p and _fuses(p[n]) and not (p[n].quantized and n == "gate_up")
                             for n in (*mlp, "down"))
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
        plan = dict(attn_norm=p.get("attn_in_norm"), mlp_norm=p.get("mlp_in_norm"), qk_norm=qk_norm, o=blocks("o")[0],
                    qkv=blocks("qkv", (q_out, kv_out, kv_out)) if "qkv" in p else [blocks(n)[0] for n in attn],
                    gate_up=None, down=None, modules=dict(qkv=[p[n] for n in attn], o=[p["o"]]))
        if fused_mlp:
            plan.update(down=blocks("down")[0], gate_up=blocks("gate_up", (inter, inter)) if "gate_up" in p
                        else [blocks(n)[0] for n in mlp])
            plan["modules"].update(gate_up=[p[n] for n in mlp], down=[p["down"]])
        return plan

    def _decode_fused(self, x, ctx: Context):
        """One decode step of this layer in five dispatches: norm + q/k/v + rotary + cache write, attention,
        o_proj + residual, norm + gate/up + activation, down + residual (with QK-norm: the q, k, v products, then
        the norms + rotary + cache write). None (nothing built) when the layer or its operands don't fit."""
        plan = self._fused_decode_plan()  # checked per call: LoRA may have wrapped a projection since
        if plan is None:
            return None
        s, cache, batch = self.spec, ctx.cache, x.shape[0]
        attn_norm, mlp_norm = (None if plan[n] is None else fused_norm(plan[n]) for n in ("attn_norm", "mlp_norm"))
        weights = lambda part: [w for w, _ in plan[part]]  # noqa: E731

        def biases(part, source=None):
            """The biases of a part's products, with the row updates of its UpdatedLinear layers (computed from
            ``source()``, their input) added: the kernels add either where the bias goes."""
            blocks = plan[part] if isinstance(plan[part], list) else [plan[part]]  # (o and down: one product)
            blocks = _with_row_updates(blocks, plan["modules"][part], source)
            return None if all(b is None for _, b in blocks) else [b for _, b in blocks]
        o, _ = plan["o"]
        fused_mlp = plan["gate_up"] is not None
        if not (F.fusable(x, weights("qkv"), attn_norm) and F.fusable_weights(x.dtype, batch, [o])
                and (not fused_mlp or (F.fusable(x, weights("gate_up"), mlp_norm)
                                       and F.fusable_weights(x.dtype, batch, [plan["down"][0]])))):
            return None
        bounds, _ = cache.step_inputs(1, ctx.key_padding_mask)
        inv_freq, scaling = ctx.rope_tables[self.index] if self.rotates else (None, 1.0)  # NoPE layers: no rotation
        rotary = dict(k_cache=cache.keys[self.index], v_cache=cache.values[self.index], cache_start=bounds[0:1],
                      positions=ctx.rope_positions, inv_freq=inv_freq, head_dim=s.head_dim, attention_scaling=scaling,
                      interleaved=s.positions.rope_interleaved)
        if getattr(cache, "paged", False):  # the write goes through the block tables of the step tensor
            rotary.update(cache_start=bounds, page_size=cache.page_size, capacity=cache.max_len)
        qkv_biases = biases("qkv", lambda: self._norm("attn_in_norm", x))
        if plan["qk_norm"] is None:
            q = F.fused_qkv_rope_write(x, *weights("qkv"), norm=attn_norm, biases=qkv_biases, **rotary)
        else:  # three independent products (no barrier between them), then the per-head norms, rotary and cache
            q, k, v = (F.fused_linear(x, w, norm=attn_norm, bias=b)
                       for w, b in zip(weights("qkv"), qkv_biases or [None] * 3))
            q_norm, k_norm = (fused_norm(n) for n in plan["qk_norm"])
            q = F.fused_head_norm_rope_write(q, k, v, q_norm=q_norm, k_norm=k_norm, **rotary)
        if ctx.query_scale is not None:  # Llama 4-style scaling of the rotated queries, as _attend applies it
            q = q * ctx.query_scale
        sinks = s.attention.sinks
        out = cache.attend_stored(self.index, q, scale=self.scale, window=self.window, softcap=s.attention.softcap,
                                  alibi_slopes=self.alibi, key_padding_mask=ctx.key_padding_mask,
                                  return_lse=bool(sinks))
        if sinks:
            out = self._weigh_sinks(*out)
        out = out.reshape(batch, 1, -1)
        x = self._fused_residual(x, "attn_out_norm", out, o, (biases("o", lambda: out) or [None])[0])
        if not fused_mlp:  # a MoE block or another MLP: composed as in forward()
            return x + _scaled(self._norm("mlp_out_norm", self.mlp(self._norm("mlp_in_norm", x))), s.residual_scale)
        hidden = F.fused_gated(x, *weights("gate_up"), activation=_FUSED_ACTIVATIONS[s.hidden_act], norm=mlp_norm,
                               biases=biases("gate_up", lambda: self._norm("mlp_in_norm", x)))
        return self._fused_residual(x, "mlp_out_norm", hidden, plan["down"][0],
                                    (biases("down", lambda: hidden) or [None])[0])

    def _fused_residual(self, x, out_norm: str, h, weight, bias):
        """x + residual_scale * (h @ weight.T + bias): one fused product with the residual added, or, where the
        layer normalizes that output (``out_norm`` among its parts), the product, the norm and the addition."""
        s = self.spec
        if out_norm not in self.parts:
            return F.fused_linear(h, weight, bias=bias, residual=x, residual_scale=s.residual_scale)
        return x + _scaled(self.parts[out_norm](F.fused_linear(h, weight, bias=bias)), s.residual_scale)

    def forward(self, x, ctx: Context):
        if ctx.cache is not None and x.shape[1] == 1 and not grad_enabled():
            fused = self._decode_fused(x, ctx)
            if fused is not None:
                return fused
        return self._residual(x, ctx)

    def _sequential_residual(self, x, ctx: Context):
        """Pre-norm blocks: x += attn(norm(x)); x += mlp(norm'(x)) (optional post-norms on each output)."""
        s = self.spec
        attn = self._norm("attn_out_norm", self.attention(self._norm("attn_in_norm", x), ctx))
        x = x + _scaled(attn, s.residual_scale)
        if "cross_q" in self.parts and ctx.encoder_states is not None:  # as transformers, only given the states
            x = x + self.cross_attention(self.parts["cross_norm"](x), ctx)
        mlp = self._norm("mlp_out_norm", self.mlp(self._norm("mlp_in_norm", x)))
        return x + _scaled(mlp, s.residual_scale)

    def cross_keys_values(self, states):
        """The cross-attention's keys and values [B, heads, S, head_dim] of the encoder's states."""
        s = self.spec
        batch, sources, _ = states.shape
        width = s.num_heads * s.head_dim
        kv = self.parts["cross_kv"](states)
        return tuple(t.contiguous().reshape(batch, sources, s.num_heads, s.head_dim).permute(0, 2, 1, 3)
                     for t in (kv[..., :width], kv[..., width:]))

    def cross_attention(self, h, ctx: Context):
        """Attention of h's queries over the encoder's states (their padding hidden), the self-attention's scale;
        their keys and values from the cache where it holds them (EncoderDecoderCache)."""
        s, p = self.spec, self.parts
        batch, length, _ = h.shape
        width = s.num_heads * s.head_dim
        cross = getattr(ctx.cache, "cross", None)
        k, v = cross[self.index] if cross else self.cross_keys_values(ctx.encoder_states)
        q = p["cross_q"](h).contiguous().reshape(batch, length, s.num_heads, s.head_dim).permute(0, 2, 1, 3)
        scale = s.attention.scales[self.index] if s.attention.scales else s.head_dim ** -0.5
        out = F.scaled_dot_product_attention(q, k, v, causal=False, scale=scale,
                                             key_padding_mask=ctx.encoder_padding_mask)
        return p["cross_o"](out.permute(0, 2, 1, 3).reshape(batch, length, width))

    def _parallel_residual(self, x, ctx: Context):
        """Attention and MLP both read the block input: x + attn(norm(x)) + mlp(norm'(x)) (norm' = norm without
        an mlp_in_norm)."""
        h = self._norm("attn_in_norm", x)
        attn = self._norm("attn_out_norm", self.attention(h, ctx))
        mlp_in = self._norm("mlp_in_norm", x) if "mlp_in_norm" in self.parts else h
        mlp = self._norm("mlp_out_norm", self.mlp(mlp_in))
        return x + _scaled(attn + mlp, self.spec.residual_scale)

    def _post_norm_residual(self, x, ctx: Context):
        """OPT-350m (do_layer_norm_before=False): x = norm(x + attn(x)); x = norm'(x + mlp(x))."""
        x = self._norm("attn_in_norm", x + self.attention(x, ctx))
        return self._norm("mlp_in_norm", x + self.mlp(x))


def _fuses(linear) -> bool:
    """Whether a decode step's fused kernels compute this projection: a plain Linear, or one whose difference is a
    row update added to its output (UpdatedLinear)."""
    return type(linear) is Linear or isinstance(linear, UpdatedLinear)


def _with_row_updates(blocks, modules, source):
    """(weight, bias) blocks of a fused product with the row updates of ``modules`` (one module per block, or one
    fused projection whose row blocks they are) added to the biases; ``source()`` gives the modules' input."""
    if not any(isinstance(m, UpdatedLinear) for m in modules):
        return blocks
    h = source()
    updates = [m.row_update(h) if isinstance(m, UpdatedLinear) else None for m in modules]
    if len(modules) == 1 and len(blocks) > 1:  # [q | k | v] or [gate | up] of one projection: its columns in turn
        update, updates, start = updates[0], [], 0
        for weight, _ in blocks:
            updates.append(None if update is None else update[..., start:start + weight.shape[0]])
            start += weight.shape[0]
    return [(w, b if u is None else (u if b is None else u + b)) for (w, b), u in zip(blocks, updates)]


def fused_norm(norm: RMSNorm) -> F.FusedNorm:
    """An RMSNorm module as the fused decode kernels' prologue."""
    return F.FusedNorm(norm.weight if norm.elementwise else None, norm.eps, norm.unit_offset)


# hidden_act names -> the fused decode kernel's activations
_FUSED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                      "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu"}


def _scaled(x, factor: float):
    return x if factor == 1.0 else x * factor


# How a layer's q, k, v come out of its projections, by AttentionSpec.qkv_layout (chosen once per layer).

def _separate_qkv(s: DecoderSpec, p: dict, h):
    return p["q"](h), p["k"](h), p["v"](h)


def _blocks_qkv(s: DecoderSpec, p: dict, h):  # [q | k | v]
    fused = p["qkv"](h)
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return fused[..., :q_out], fused[..., q_out:q_out + kv_out], fused[..., q_out + kv_out:]


def _per_head_qkv(s: DecoderSpec, p: dict, h):  # [heads, (q, k, v), dim]
    fused = p["qkv"](h)
    batch, length, _ = h.shape
    grouped = fused.reshape(batch, length, s.num_heads, 3, s.head_dim)
    return tuple(grouped[:, :, :, i, :].reshape(batch, length, s.num_heads * s.head_dim) for i in range(3))


def _chunks_qvk_qkv(s: DecoderSpec, p: dict, h):  # CodeGen: [chunks, (q, v, k), heads/chunks * dim]
    fused = p["qkv"](h)
    batch, length, _ = h.shape
    width = s.num_heads * s.head_dim
    chunks = fused.reshape(batch, length, s.attention.qkv_chunks, 3, width // s.attention.qkv_chunks)
    q, v, k = (chunks[:, :, :, i, :].reshape(batch, length, width) for i in range(3))
    return q, k, v


def _grouped_qkv(s: DecoderSpec, p: dict, h):  # [kv_heads, (queries of the group..., k, v), dim] (Falcon new arch)
    fused = p["qkv"](h)
    batch, length, _ = h.shape
    heads, kv_heads, dim = s.num_heads, s.num_kv_heads, s.head_dim
    group = heads // kv_heads
    grouped = fused.reshape(batch, length, kv_heads, group + 2, dim)
    return (grouped[:, :, :, :group, :].reshape(batch, length, heads * dim),
            grouped[:, :, :, group, :].reshape(batch, length, kv_heads * dim),
            grouped[:, :, :, group + 1, :].reshape(batch, length, kv_heads * dim))


_QKV_SPLITS = {"blocks": _blocks_qkv, "per_head": _per_head_qkv, "chunks_qvk": _chunks_qvk_qkv,
               "grouped": _grouped_qkv}
