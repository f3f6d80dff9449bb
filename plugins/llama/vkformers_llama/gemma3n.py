"""Gemma 3n's text decoder layer on the shared decoder kit.

transformers 5 (Gemma3nTextDecoderLayer), on ``altup_num_inputs`` residual streams [N, B, T, D]:

- AltUp predict: modalities = tanh(modality_router(router_norm(x_active) / D)); stream j becomes
  x_j + sum_i x_i c_{j N + i} with c = prediction_coefs(modalities).
- The active prediction a runs the block: h = input_layernorm(a); LAuReL h + post_laurel_norm(right(left(h)));
  attention (q/k RMS-normed per head, values by a weightless RMS norm, scale 1) with its post-norm;
  y = ((a + attn) + laurel) / sqrt(2); y += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(y))), the
  MLP's gate sparsified on the layers of ``activation_sparsity_pattern`` (relu(gate - mean - std * icdf(p))).
- AltUp correct: stream j += (y - prediction_active) * (1 + correction_coefs(modalities(y)))_j.
- Per-layer input: streams 1.. += post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(
  corrected_active * correct_output_scale)) * per_layer_input)).

KV sharing: the last ``num_kv_shared_layers`` layers have no key / value projections; each attends over the keys
and values of the last earlier layer of its type (sliding or full), which that layer leaves on the context (and, in
a decode step, in its cache slot).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import NormalDist

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.decoder import DecoderLayer, make_norm
from vkformers.models.decoder.spec import NormSpec, UnsupportedConfigError
from vkformers.models.layers import Embedding, Linear
from vkformers.models.module import add_param, get_param, place


def shared_kv_sources(arch: str, types: list[str], shared: int) -> tuple[int | None, ...]:
    """Per layer, the layer whose keys and values it reuses (transformers' kv_sharing_modes): each of the last
    ``shared`` layers reads the last earlier layer of its type."""
    first = len(types) - shared
    if shared <= 0:
        return (None,) * len(types)
    if set(types[:first]) != set(types):
        raise UnsupportedConfigError(f"{arch}: every layer type of the num_kv_shared_layers last layers needs an "
                                     "earlier layer of that type; fix the config")
    last = {t: max(i for i in range(first) if types[i] == t) for t in set(types)}
    return tuple(None if i < first else last[types[i]] for i in range(len(types)))


def _widened(x, width: int):
    """x [..., D] with zeros after its D values up to ``width`` (a cache row wider than this layer's heads)."""
    if x.shape[-1] == width:
        return x
    zeros = Tensor(np.zeros((*x.shape[:-1], width - x.shape[-1]), np.float32)).cast(x.dtype)
    return F.cat([x, zeros], -1)


class SharedKVLayer(DecoderLayer):
    """A decoder layer in a model whose last layers reuse earlier layers' keys and values (Gemma 3n, Gemma 4).

    ``share_kv(kv_sources)`` (after DecoderLayer's init) drops the key / value projections of a layer that reuses
    another's; a layer whose keys and values are reused leaves them on the context (``ctx.shared_kv``, a dict the
    model sets) and, in a decode step, in its cache slot. Where this layer's heads are narrower or fewer than the
    cache's (per-layer head dims), its keys and values enter the cache zero-padded and with each head repeated, and
    its queries zero-padded: the scores and the kept values do not change (the softmax scale is the layer's own).
    """

    def share_kv(self, kv_sources) -> None:
        s = self.spec
        self.kv_source = kv_sources[self.index]
        self.stores_kv = self.index in kv_sources
        if self.kv_source is not None:  # no key / value projections of its own
            attention = self._modules[s.attention.path]
            for role, name in (("k", s.attention.k_proj), ("v", s.attention.v_proj), ("k_norm", s.attention.k_norm)):
                if role in self.parts:
                    del attention._modules[name]
                    del self.parts[role]

    def shared_kv_attention(self, h, ctx):
        """The attention output for h [B, T, D]: q/k RMS-normed per head and rotated, values by a weightless RMS
        norm, over this layer's own keys and values or (``kv_source``) another layer's. A layer without a value
        projection (Gemma 4's attention_k_eq_v) takes the values from the key projection."""
        s, p = self.spec, self.parts
        batch, length, _ = h.shape
        inv_freq, scaling = ctx.rope_tables[self.index]

        def rotated(x, heads, norm):
            x = norm(x.reshape(batch, length, heads, s.head_dim)).permute(0, 2, 1, 3)
            return F.rope(x, ctx.rope_positions, inv_freq, attention_scaling=scaling)

        q = rotated(p["q"](h), s.num_heads, p["q_norm"])
        options = dict(scale=self.scale, window=self.window, softcap=0.0, alibi_slopes=None,
                       key_padding_mask=ctx.key_padding_mask)
        if self.kv_source is not None:
            out = self.attend_shared(q, ctx, options)
        else:
            keys = p["k"](h)
            k = rotated(keys, s.num_kv_heads, p["k_norm"])
            values = p["v"](h) if "v" in p else keys
            v = F.rms_norm(values.reshape(batch, length, s.num_kv_heads, s.head_dim), None,
                           eps=s.norms.eps).permute(0, 2, 1, 3)
            out = self.attend_heads(q, k, v, ctx, **options)
            if self.stores_kv:
                ctx.shared_kv[self.index] = self.attended_kv(k, v, ctx)
        out = out.permute(0, 2, 1, 3).reshape(batch, length, s.num_heads * s.head_dim)
        return p["o"](out)

    def attend_heads(self, q, k, v, ctx, **options):
        cache = ctx.cache
        if cache is None or (k.shape[1], k.shape[3]) == (cache.kv_heads, cache.head_dim):
            return super().attend_heads(q, k, v, ctx, **options)
        batch, heads, length, dim = k.shape
        repeat = cache.kv_heads // heads

        def to_cache(t):
            t = t.reshape(batch, heads, 1, length, dim).expand(batch, heads, repeat, length, dim).contiguous()
            return _widened(t.reshape(batch, cache.kv_heads, length, dim), cache.head_dim)
        out = cache.attend(self.index, _widened(q, cache.head_dim), to_cache(k), to_cache(v), **options)
        return out[..., :q.shape[-1]].contiguous()

    def attended_kv(self, k, v, ctx):
        """The keys and values this layer's prefill attended over: the new ones, or with a cache already holding
        some, the cache's (a decode step's sharing layers read the cache slot itself)."""
        cache = ctx.cache
        if cache is None or cache.position == 0:
            return k, v
        end = cache.position + k.shape[2]
        return cache.keys[self.index][:, :, :end], cache.values[self.index][:, :, :end]

    def attend_shared(self, q, ctx, options):
        """Attention of q [B, H, T, D] over the keys and values of layer ``kv_source``."""
        cache, new, width = ctx.cache, q.shape[2], q.shape[-1]
        if cache is not None and new == 1:
            out = cache.attend_stored(self.kv_source, _widened(q, cache.head_dim), **options)
            return out[..., :width].contiguous() if cache.head_dim != width else out
        k, v = ctx.shared_kv[self.kv_source]
        if cache is not None:
            options = dict(options, key_padding_mask=cache.step_inputs(new)[1])
            k, v = k.cast(q.dtype), v.cast(q.dtype)
        out = F.scaled_dot_product_attention(_widened(q, k.shape[-1]), k, v, causal=True, **options)
        return out[..., :width].contiguous() if k.shape[-1] != width else out


def add_per_layer_inputs(model, spec, width: int, vocab: int) -> None:
    """The per-layer input embeddings of Gemma 3n and Gemma 4, placed on ``model`` under their checkpoint names:
    embed_tokens_per_layer [vocab, layers * width], per_layer_model_projection, per_layer_projection_norm."""
    d, total = spec.hidden_size, spec.num_layers * width
    refs = dict(
        per_layer_vocab=vocab, per_layer_width=width,
        per_layer_embed=place(model, "model.embed_tokens_per_layer",
                              Embedding(vocab, total, padding_idx=spec.embed_padding_idx)),
        per_layer_model_projection=place(model, "model.per_layer_model_projection", Linear(d, total, bias=False)),
        per_layer_projection_norm=place(model, "model.per_layer_projection_norm",
                                        make_norm(NormSpec("rms", eps=spec.norms.eps), width)))
    for name, value in refs.items():
        object.__setattr__(model, name, value)


def per_layer_inputs(model, ids: Tensor, x) -> list:
    """Each layer's per-layer input [B, T, width] from the token ids (int32 [B, T] on the device: a captured decode
    step rewrites only them, so the per-layer ids derive from them there) and embeddings x: (RMS-normed
    per_layer_model_projection(x) / sqrt(D) + embed_tokens_per_layer(ids) * sqrt(width)) / sqrt(2), ids past the
    per-layer vocabulary reading row 0 (add_per_layer_inputs placed the modules)."""
    batch, length, d = x.shape
    layers, width = model.spec.num_layers, model.per_layer_width
    table = model.per_layer_embed(F.where(ids < model.per_layer_vocab, ids, 0))
    table = table * float(np.float32(width ** 0.5))
    projected = model.per_layer_model_projection(x) * float(np.float32(d ** -0.5))
    projected = model.per_layer_projection_norm(projected.reshape(batch, length, layers, width))
    inputs = (projected + table.reshape(projected.shape)) * float(np.float32(2.0 ** -0.5))
    return [inputs[:, :, i].contiguous() for i in range(layers)]


@dataclass(frozen=True)
class Gemma3nLayers:
    """The model's options; called with (spec, index, alibi) it builds layer ``index`` (DecoderSpec.make_layer)."""

    altup_inputs: int
    altup_active: int
    altup_correct_scale: bool
    laurel_rank: int
    per_layer_width: int
    intermediate_sizes: tuple[int, ...]
    sparsity: tuple[float, ...]
    layer_types: tuple[str, ...]
    kv_sources: tuple[int | None, ...]  # per layer: the layer whose keys and values it reuses, or None

    def __call__(self, spec, index: int, alibi=None) -> "Gemma3nLayer":
        return Gemma3nLayer(self, spec, index, alibi)


class Gemma3nLayer(SharedKVLayer):
    """One Gemma 3n block over the AltUp streams."""

    def __init__(self, options: Gemma3nLayers, spec, index: int, alibi=None):
        super().__init__(replace(spec, intermediate_size=options.intermediate_sizes[index]), index, alibi)
        s, d, n = self.spec, self.spec.hidden_size, options.altup_inputs
        self.options, self.layer_type = options, options.layer_types[index]
        self.share_kv(options.kv_sources)
        rms = NormSpec("rms", eps=s.norms.eps)

        def add(path, module):
            object.__setattr__(self, path.replace(".", "_"), place(self, path, module))

        add("altup.correction_coefs", Linear(n, n, bias=False))
        add("altup.prediction_coefs", Linear(n, n * n, bias=False))
        add("altup.modality_router", Linear(d, n, bias=False))
        add("altup.router_norm", make_norm(rms, d))
        add_param(self, "altup.correct_output_scale", (d,))
        add("laurel.linear_left", Linear(d, options.laurel_rank, bias=False))
        add("laurel.linear_right", Linear(options.laurel_rank, d, bias=False))
        add("laurel.post_laurel_norm", make_norm(rms, d))
        add("per_layer_input_gate", Linear(d, options.per_layer_width, bias=False))
        add("per_layer_projection", Linear(options.per_layer_width, d, bias=False))
        add("post_per_layer_input_norm", make_norm(rms, d))
        sparsity = options.sparsity[index]
        self.sparsity_cutoff = NormalDist().inv_cdf(sparsity) if sparsity > 0.0 else None

    # -- AltUp

    def _modalities(self, x):
        routed = self.altup_modality_router(self.altup_router_norm(x) * (1.0 / self.spec.hidden_size))
        return routed.float().tanh().cast(x.dtype)

    def _predict(self, streams):
        n = self.options.altup_inputs
        coefs = self.altup_prediction_coefs(self._modalities(streams[self.options.altup_active]))
        out = []
        for j in range(n):
            mixed = streams[j]
            for i in range(n):
                mixed = mixed + streams[i] * coefs[..., j * n + i:j * n + i + 1]
            out.append(mixed)
        return out

    def _correct(self, predictions, activated):
        coefs = self.altup_correction_coefs(self._modalities(activated)) + 1.0
        innovation = activated - predictions[self.options.altup_active]
        return [p + innovation * coefs[..., j:j + 1] for j, p in enumerate(predictions)]

    # -- MLP with the gate's activation sparsity

    def _sparse_gated_mlp(self, h):
        p = self.parts
        gate = p["gate"](h)
        if self.sparsity_cutoff is not None:
            mean = gate.mean(-1, keepdim=True)
            std = ((gate - mean) * (gate - mean)).mean(-1, keepdim=True).sqrt()
            gate = (gate - (mean + std * self.sparsity_cutoff)).relu()
        return p["down"](self.act(gate) * p["up"](h))

    # -- the block

    def forward(self, streams, ctx):
        o = self.options
        predictions = self._predict([streams[i] for i in range(o.altup_inputs)])
        active = predictions[o.altup_active]
        normed = self._norm("attn_in_norm", active)
        laurel = normed + self.laurel_post_laurel_norm(self.laurel_linear_right(self.laurel_linear_left(normed)))
        attn = self._norm("attn_out_norm", self.shared_kv_attention(normed, ctx))
        y = (active + attn + laurel) * (1.0 / math.sqrt(2.0))
        y = y + self._norm("mlp_out_norm", self._sparse_gated_mlp(self._norm("mlp_in_norm", y)))
        corrected = self._correct(predictions, y)
        first = corrected[o.altup_active]
        if o.altup_correct_scale:
            first = first * get_param(self, "altup.correct_output_scale")
        first = self.act(self.per_layer_input_gate(first)) * ctx.per_layer_inputs[self.index]
        first = self.post_per_layer_input_norm(self.per_layer_projection(first))
        return F.stack([corrected[0]] + [c + first for c in corrected[1:]], dim=0)
