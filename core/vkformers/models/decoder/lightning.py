"""Lightning attention (MiniMax-01's ``linear_attention`` layers): linear attention with a fixed per-head decay, for
the kit's linear-attention slot.

    out_t = sum_{s <= t} exp(-slope_h (t - s)) (q_t . k_s) v_s        (no softmax, no scale, no normaliser)

:func:`lightning_attention` computes it in blocks of ``block_size`` tokens as transformers does: inside a block the
decayed causal product ((Q K^T) * D) V, across blocks the running state S = sum_s exp(-slope (t - s)) k_s v_s^T,
read as (Q * exp(-slope (i + 1))) S and carried on with exp(-slope n) S + (K * exp(-slope (n - 1 - j)))^T V. The
decays are host constants, the products engine matmuls, so autograd gives the backward pass; one call also runs
a decode step (one token from the cached state).

:class:`LightningAttention`: q, k, v = act(qkv_proj(h)) per head [q | k | v] (zeroed at padded positions),
out_proj(sigmoid(output_gate(h)) * RMSNorm(attention)). With a KV cache the state S per layer stays on the cache
object (``cache.lightning_states[layer]``), restarted at position 0.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.cache import register_row_state
from vkformers.models.layers import Linear, RMSNorm
from vkformers.models.module import Module


def lightning_slopes(heads: int, layer: int, layers: int) -> np.ndarray:
    """MiniMax's per-head decay rates of layer ``layer`` (float32 [heads]): (2^(-8 / heads))^(h + 1), scaled by
    1 - layer / (layers - 1 + 1e-5) + 1e-5, as transformers' get_slope_rate."""
    base = np.float32(1 / (2 ** (8 / heads)))
    rate = np.power(base, np.arange(1, heads + 1, dtype=np.float32)).astype(np.float32)
    return (rate * np.float32(1 - layer / (layers - 1 + 1e-5) + 1e-5)).astype(np.float32)


def _block_decays(slopes: np.ndarray, size: int):
    """float32 host constants of a block of ``size`` tokens: the queries' [H, n, 1], the keys' [H, n, 1], the
    causal in-block [H, n, n] decays and the whole block's [H, 1, 1]."""
    s = slopes.astype(np.float32)[:, None, None]
    steps = np.arange(1, size + 1, dtype=np.float32)[:, None]
    query = np.exp(-s * steps)
    key = np.exp(-s * (size - steps))
    distance = steps - steps.T
    diagonal = np.where(distance[None] >= 0, np.exp(-s * np.maximum(distance, 0)[None]), 0.0)
    return (query.astype(np.float32), key.astype(np.float32), diagonal.astype(np.float32),
            np.exp(-s * size).astype(np.float32))


def lightning_attention(q, k, v, slopes: np.ndarray, block_size: int, state=None):
    """Decayed linear attention of q, k [B, H, T, Dk], v [B, H, T, Dv] (float32) from ``state`` [B, H, Dk, Dv]
    (None: zeros): (out [B, H, T, Dv], the state after the last token)."""
    batch, heads, length, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        state = Tensor(np.zeros((batch, heads, dk, dv), np.float32))
    outputs = []
    for start in range(0, length, block_size):
        end = min(start + block_size, length)
        query_decay, key_decay, diagonal, whole = (Tensor(a) for a in _block_decays(slopes, end - start))
        qb, kb, vb = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = F.matmul(F.matmul(qb, kb.transpose(-1, -2)) * diagonal, vb)
        inter = F.matmul(qb * query_decay, state)
        outputs.append(intra + inter)
        state = state * whole + F.matmul((kb * key_decay).transpose(-1, -2), vb)
    out = F.cat(outputs, 2) if len(outputs) > 1 else outputs[0]
    return out, state


class LightningAttention(Module):
    """qkv_proj, output_gate, norm, out_proj; called by the decoder layer as ``(normed hidden states, Context,
    layer index)``."""

    def __init__(self, spec, *, heads: int, head_dim: int, block_size: int, activation: str, norm_eps: float = 1e-6):
        super().__init__()
        d, width = spec.hidden_size, heads * head_dim
        self.heads, self.head_dim, self.block_size = heads, head_dim, block_size
        self.qkv_proj = Linear(d, 3 * width, bias=False)
        self.output_gate = Linear(d, width, bias=False)
        self.norm = RMSNorm(width, eps=norm_eps)
        self.out_proj = Linear(width, d, bias=False)
        self.act = F.activation(activation)
        self.num_layers = spec.num_layers

    @classmethod
    def module(cls, heads: int, head_dim: int, block_size: int, activation: str, norm_eps: float = 1e-6):
        """The ``LinearAttentionSpec.module`` factory for layers of these sizes."""
        return partial(cls, heads=heads, head_dim=head_dim, block_size=block_size, activation=activation,
                       norm_eps=norm_eps)

    def forward(self, h, ctx, index: int):
        batch, length, _ = h.shape
        heads, dim = self.heads, self.head_dim
        qkv = self.act(self.qkv_proj(h))
        keep = ctx.padding_keep(length, qkv.dtype)
        if keep is not None:
            qkv = qkv * keep
        qkv = qkv.float().reshape(batch, length, heads, 3, dim).permute(3, 0, 2, 1, 4)       # [3, B, H, T, D]
        states = None
        if ctx.cache is not None:
            states = ctx.cache.__dict__.setdefault("lightning_states", {})
            if ctx.cache.position == 0:
                states.pop(index, None)
        out, state = lightning_attention(qkv[0], qkv[1], qkv[2], lightning_slopes(heads, index, self.num_layers),
                                         self.block_size, (states or {}).get(index))
        if states is not None:
            states[index] = state.detach()
        out = out.permute(0, 2, 1, 3).contiguous().reshape(batch, length, heads * dim).cast(h.dtype)
        return self.out_proj(F.sigmoid(self.output_gate(h)) * self.norm(out))


register_row_state("lightning_states")  # per row: a server's batch moves it with its row's keys and values
