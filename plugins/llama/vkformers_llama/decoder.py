"""One decoder for every dense causal LM of the family, configured by a :class:`DecoderSpec`.

The model declares its parameters under the checkpoint's own names (``model.layers.0.
self_attn.q_proj.weight``, ``transformer.h.0.attn.c_attn.weight``, ...); fused projections
stay one parameter and are split with views, so gradients and saved checkpoints keep
Hugging Face's layout.

Forward semantics follow transformers 5: without a cache and without ``position_ids``
every row uses positions ``arange(T)`` (also with left padding); ``attention_mask`` zeros
mask those keys on top of the causal mask; ``labels`` are shifted inside.
"""
from __future__ import annotations


import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.rope_scaling import rope_parameters
from vkformers.engine.tensor import Tensor
from vkformers.models.layers import Conv1D, Embedding, LayerNorm, Linear, ModuleList, RMSNorm
from vkformers.models.loading import CausalLMOutput
from vkformers.models.module import Module
from vkformers.runtime import dtypes as dt

from vkformers_llama.variants import DecoderSpec, alibi_slopes, decoder_spec

try:
    from vkformers.models.generation import GenerationMixin
except ImportError:  # TODO(lead): remove once core/vkformers/models/generation.py lands (written in parallel)
    class GenerationMixin:  # type: ignore[no-redef]
        pass

IGNORE_INDEX = -100

# Buffers some checkpoints carry that are not parameters (causal-mask and rotary caches).
IGNORED_CHECKPOINT_KEYS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                           "rotary_emb.inv_freq")


def place(root: Module, path: str, module: Module) -> Module:
    """Attach ``module`` under a dotted HF path, creating plain container modules on the way."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        node = node._modules[part] if part in node._modules else node.add(part, Module())
    return node.add(name, module)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def make_norm(spec: DecoderSpec, dim: int) -> Module:
    if spec.norm == "rms":
        return RMSNorm(dim, eps=spec.norm_eps, unit_offset=spec.norm_unit_offset, elementwise=spec.norm_weight)
    return LayerNorm(dim, eps=spec.norm_eps, bias=spec.norm_bias, elementwise=spec.norm_weight)


def make_projection(spec: DecoderSpec, in_features: int, out_features: int, bias: bool) -> Module:
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
        # stack the per-head weights without a concat op: sum_h one_hot(h) (x) weight_h
        rows = None
        for h, norm in enumerate(self.norms):
            one_hot = np.zeros((self.heads, 1), np.float32)
            one_hot[h] = 1.0
            row = Tensor(one_hot, dtype=norm.weight.dtype) * norm.weight
            rows = row if rows is None else rows + row
        return rows

    def forward(self, x):  # x [B, T, heads, D]
        if self.spec.norm == "rms":
            y = F.rms_norm(x, None, eps=self.spec.norm_eps)
        else:
            y = F.layer_norm(x, None, None, eps=self.spec.norm_eps)
        return y * self._weight()


class Context:
    """What every layer of one forward pass shares: positions, masks, rotary tables, the cache."""

    def __init__(self, positions, key_padding_mask, rope_tables, cache):
        self.positions, self.key_padding_mask, self.rope_tables, self.cache = (
            positions, key_padding_mask, rope_tables, cache)


class DecoderLayer(Module):
    """One block: attention and MLP with the spec's norms and residual wiring.

    Parameters live under the checkpoint's relative paths; ``self.parts`` keeps plain
    references to them (a dict, so they are not registered twice).
    """

    def __init__(self, spec: DecoderSpec, index: int, alibi=None):
        super().__init__()
        s, d = spec, spec.hidden_size
        object.__setattr__(self, "parts", {})
        self.spec, self.index = s, index
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim

        def add(role, relative_path, module):
            self.parts[role] = place(self, relative_path, module)

        for role in ("attn_in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm"):
            if getattr(s, role):
                add(role, getattr(s, role), make_norm(s, d))
        if s.qkv_proj:
            add("qkv", _join(s.attn, s.qkv_proj),
                make_projection(s, d, q_out + 2 * kv_out, bias=s.q_bias))
        else:
            add("q", _join(s.attn, s.q_proj), make_projection(s, d, q_out, bias=s.q_bias))
            add("k", _join(s.attn, s.k_proj), make_projection(s, d, kv_out, bias=s.k_bias))
            add("v", _join(s.attn, s.v_proj), make_projection(s, d, kv_out, bias=s.v_bias))
        add("o", _join(s.attn, s.o_proj), make_projection(s, q_out, d, bias=s.o_bias))
        if s.q_norm and s.qk_norm_scope in ("per_head", "per_head_list"):
            stacked = s.qk_norm_scope == "per_head"
            add("q_norm", _join(s.attn, s.q_norm), HeadwiseNorm(s, s.num_heads, stacked))
            add("k_norm", _join(s.attn, s.k_norm), HeadwiseNorm(s, s.num_kv_heads, stacked))
        elif s.q_norm:
            full = s.qk_norm_scope == "full"
            add("q_norm", _join(s.attn, s.q_norm), make_norm(s, q_out if full else s.head_dim))
            add("k_norm", _join(s.attn, s.k_norm), make_norm(s, kv_out if full else s.head_dim))
        inter = s.intermediate_size
        if s.mlp_kind == "gated" and s.gate_up_proj:
            add("gate_up", _join(s.mlp, s.gate_up_proj), make_projection(s, d, 2 * inter, bias=s.mlp_bias))
        elif s.mlp_kind == "gated":
            add("gate", _join(s.mlp, s.gate_proj), make_projection(s, d, inter, bias=s.mlp_bias))
            add("up", _join(s.mlp, s.up_proj), make_projection(s, d, inter, bias=s.mlp_bias))
        else:
            add("up", _join(s.mlp, s.up_proj), make_projection(s, d, inter, bias=s.mlp_bias))
        add("down", _join(s.mlp, s.down_proj), make_projection(s, inter, d, bias=s.mlp_bias))
        self.act = F.activation(s.hidden_act)
        self.scale = s.attention_scales[index] if s.attention_scales else s.head_dim ** -0.5
        self.window = s.windows[index] if s.windows else 0
        self.alibi = alibi

    def _norm(self, role, x):
        return self.parts[role](x) if role in self.parts else x

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
        q, k, v = self._project_qkv(h)
        if s.clip_qkv is not None:
            # maximum/minimum rather than Tensor.clamp, whose backward multiplies two bool masks (unsupported)
            q, k, v = (t.maximum(-s.clip_qkv).minimum(s.clip_qkv) for t in (q, k, v))
        if "q_norm" in p and s.qk_norm_scope == "full":
            q, k = p["q_norm"](q), p["k_norm"](k)
        q = q.reshape(batch, length, s.num_heads, s.head_dim)
        k = k.reshape(batch, length, s.num_kv_heads, s.head_dim)
        v = v.reshape(batch, length, s.num_kv_heads, s.head_dim)
        if "q_norm" in p and s.qk_norm_scope != "full":
            q, k = p["q_norm"](q), p["k_norm"](k)
        q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
        if s.rope:
            inv_freq, scaling = ctx.rope_tables[self.index]
            q = F.rope(q, ctx.positions, inv_freq, interleaved=s.rope_interleaved, attention_scaling=scaling)
            k = F.rope(k, ctx.positions, inv_freq, interleaved=s.rope_interleaved, attention_scaling=scaling)
        options = dict(scale=self.scale, window=self.window, softcap=s.attn_softcap, alibi_slopes=self.alibi,
                       key_padding_mask=ctx.key_padding_mask)
        if ctx.cache is not None:
            out = ctx.cache.attend(self.index, q, k, v, **options)
        else:
            out = F.scaled_dot_product_attention(q, k, v, causal=True, **options)
        out = out.permute(0, 2, 1, 3).reshape(batch, length, s.num_heads * s.head_dim)
        return p["o"](out)

    # -- MLP

    def mlp(self, h):
        p, s = self.parts, self.spec
        if "gate_up" in p:
            gate_up = p["gate_up"](h)
            inter = s.intermediate_size
            hidden = self.act(gate_up[..., :inter]) * gate_up[..., inter:]
        elif "gate" in p:
            hidden = self.act(p["gate"](h)) * p["up"](h)
        else:
            hidden = self.act(p["up"](h))
        return p["down"](hidden)

    def forward(self, x, ctx: Context):
        s = self.spec
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


def _scaled(x, factor: float):
    return x if factor == 1.0 else x * factor


def _as_numpy(value, dtype=np.int64):
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.numpy()
    return np.asarray(value).astype(dtype)


def _round_to(value: float, dtype) -> float:
    """A Python float rounded to a storage dtype (torch multiplies by a scalar tensor of that dtype)."""
    if dtype is dt.bfloat16:
        return float(dt.from_bfloat16(dt.to_bfloat16(np.asarray([value], np.float32)))[0])
    if dtype is dt.float16:
        return float(np.float16(value))
    return float(np.float32(value))


class DecoderForCausalLM(Module, GenerationMixin):
    """A dense causal decoder of any architecture in :data:`vkformers_llama.variants.VARIANTS`."""

    ignored_checkpoint_keys = IGNORED_CHECKPOINT_KEYS

    def __init__(self, config: dict, architecture):
        super().__init__()
        name = getattr(architecture, "name", architecture)
        spec = decoder_spec(config, name)
        self.config, self.architecture_name, self.spec = config, name, spec
        self.dtype = dt.float32  # from_pretrained sets the loaded dtype
        # HF's longrope models switch to the long factors past the original context, and their
        # generate() then recomputes the cache with them (Phi-3): generation does the same.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) in ("longrope", "su"):
            self.recompute_cache_beyond = rope.get("original_max_position_embeddings") or \
                config.get("original_max_position_embeddings")
        d = spec.hidden_size
        alibi = Tensor(alibi_slopes(spec.num_heads)) if spec.alibi else None
        refs = dict(  # plain references (object.__setattr__): place() already registered them under HF paths
            embed=place(self, spec.embed, Embedding(spec.vocab_size, spec.embed_dim or d)),
            project_in=place(self, spec.project_in, Linear(spec.embed_dim, d, bias=False)) if spec.project_in else None,
            project_out=(place(self, spec.project_out, Linear(d, spec.embed_dim, bias=False))
                         if spec.project_out else None),
            embed_norm=place(self, spec.embed_norm, make_norm(spec, d)) if spec.embed_norm else None,
            position_embed=(place(self, spec.position_embed,
                                  Embedding(spec.max_position_embeddings + spec.position_offset, d))
                            if spec.position_embed else None),
            layers=place(self, spec.layers, ModuleList(DecoderLayer(spec, i, alibi) for i in range(spec.num_layers))),
            final_norm=place(self, spec.final_norm, make_norm(spec, d)) if spec.final_norm else None,
            lm_head=place(self, spec.lm_head, Linear(spec.embed_dim or d, spec.vocab_size, bias=spec.lm_head_bias)),
        )
        for name, module in refs.items():
            object.__setattr__(self, name, module)
        if spec.tie_embeddings:
            self.tie(f"{spec.lm_head}.weight", f"{spec.embed}.weight")
        self.rope_configs = spec.rope_configs or ((config, None),) * spec.num_layers

    # -- what GenerationMixin reads

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def max_position_embeddings(self) -> int:
        return self.spec.max_position_embeddings

    # -- forward

    def _positions(self, batch, length, attention_mask, position_ids, past) -> np.ndarray:
        if position_ids is not None:
            return np.broadcast_to(_as_numpy(position_ids), (batch, length)).astype(np.int32)
        if self.spec.positions_from_mask and attention_mask is not None:  # OPT: count only attended tokens
            return ((np.cumsum(attention_mask, axis=1) * attention_mask - 1)[:, -length:]).astype(np.int32)
        return np.broadcast_to(past + np.arange(length, dtype=np.int32), (batch, length)).astype(np.int32)

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

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, cache=None):
        s = self.spec
        ids = input_ids if isinstance(input_ids, Tensor) else Tensor(np.asarray(input_ids, dtype=np.int32))
        if ids.dtype is not dt.int32:
            ids = ids.cast(dt.int32)
        batch, length = ids.shape
        past = cache.position if cache is not None else 0
        mask = _as_numpy(attention_mask)
        positions = self._positions(batch, length, mask, position_ids, past)

        x = F.embedding(ids, self.embed.weight)
        if s.embed_scale != 1.0:
            scale = _round_to(s.embed_scale, self.dtype) if s.embed_scale_in_dtype else s.embed_scale
            x = x * scale
        if self.project_in is not None:
            x = self.project_in(x)
        if self.position_embed is not None:
            x = x + F.embedding(Tensor(positions + np.int32(s.position_offset)), self.position_embed.weight)
        if self.embed_norm is not None:
            x = self.embed_norm(x)

        key_padding_mask = None
        if mask is not None and (cache is not None or not mask.all()):
            key_padding_mask = Tensor(mask.astype(bool))
        rope_tables = self._rope_tables(int(positions.max()) + 1) if s.rope else None
        ctx = Context(Tensor(positions), key_padding_mask, rope_tables, cache)
        for layer in self.layers:
            x = layer(x, ctx)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        logits = self.lm_head(x)
        if s.logits_scale != 1.0:
            logits = logits * s.logits_scale
        if s.final_softcap:
            logits = (logits * (1.0 / s.final_softcap)).tanh() * s.final_softcap
        if cache is not None:
            cache.advance(length)
        loss = self.loss(logits, labels) if labels is not None else None
        return CausalLMOutput(logits=logits, loss=loss)

    @staticmethod
    def loss(logits, labels):
        """transformers' ForCausalLMLoss: token t predicts label t + 1; -100 is ignored; mean in float32."""
        labels = _as_numpy(labels, np.int32)
        shifted = np.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        return F.cross_entropy(logits.float(), Tensor(shifted), ignore_index=IGNORE_INDEX)
