"""xLSTM's mLSTM layer (``xLSTMForCausalLM``'s ``mlstm_layer``), a recurrent mixer for the decoder kit's
linear-attention slot, from engine ops.

    q, k, v, o = q(h), k(h), v(h), ogate_preact(h);  i, f = cap tanh(igate_preact(h) / cap), same for fgate
    per head, token by token (state C [dqk, dv], n [dqk], m scalar; all zero at the start):
        m' = max(logsigmoid(f) + m, i);  a = exp(logsigmoid(f) + m - m'),  b = exp(i - m')
        C = a C + b k v^T;  n = a n + b k;  q~ = q / sqrt(dqk)
        y = (q~ C) / (max(|q~ . n|, exp(-m')) + eps)
    out = out_proj(sigmoid(o) * weight * layer_norm_per_head(y))

This is transformers' native recurrent form (mlstm_recurrent_sequence_native / step_native), what it runs on a
sequence shorter than ``chunk_size`` and for every generation step; its chunkwise form for longer prompts computes
the same recurrence in blocks (in ``autocast_kernel_dtype``). The recurrence runs in float32 and autograd gives the
backward pass. transformers' xLSTM reads no attention mask (padding runs as tokens); on a cache whose padding only
lays rows out (a server's batch) padded tokens leave the state as it was, as RWKV's blocks do.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.models.cache import register_row_state
from vkformers.models.layers import Linear
from vkformers.models.module import Module

from vkformers_ssm.rwkv import layout_padding, row_states


class MLstmLayer(Module):
    """q, k, v, ogate_preact, igate_preact, fgate_preact, multihead_norm, out_proj; called by the decoder layer as
    ``(normed hidden states, Context, layer index)``."""

    def __init__(self, spec, *, heads: int, qk_dim: int, v_dim: int, gate_cap: float | None, eps: float,
                 norm_eps: float):
        super().__init__()
        d = spec.hidden_size
        self.heads, self.qk_dim, self.v_dim = heads, qk_dim, v_dim
        self.gate_cap, self.eps, self.norm_eps = gate_cap, eps, norm_eps
        self.q = Linear(d, qk_dim, bias=False)
        self.k = Linear(d, qk_dim, bias=False)
        self.v = Linear(d, v_dim, bias=False)
        self.ogate_preact = Linear(d, v_dim, bias=False)
        self.igate_preact = Linear(d, heads, bias=True)
        self.fgate_preact = Linear(d, heads, bias=True)
        norm = Module()
        norm.param("weight", (v_dim,))
        self.multihead_norm = norm
        self.out_proj = Linear(v_dim, d, bias=False)

    @classmethod
    def module(cls, **sizes):
        """The ``LinearAttentionSpec.module`` factory for layers of these sizes."""
        return partial(cls, **sizes)

    def _capped(self, x):
        return x if self.gate_cap is None else F.tanh(x * (1.0 / self.gate_cap)) * self.gate_cap

    def forward(self, h, ctx, index: int):
        batch, length, _ = h.shape
        heads, dq, dv = self.heads, self.qk_dim // self.heads, self.v_dim // self.heads
        q = (self.q(h).float() * dq ** -0.5).reshape(batch, length, heads, 1, dq)
        k = self.k(h).float().reshape(batch, length, heads, dq, 1)
        v = self.v(h).float().reshape(batch, length, heads, 1, dv)
        i_gate = self._capped(self.igate_preact(h).float()).reshape(batch, length, heads, 1)
        # logsigmoid(f) = -softplus(-f)
        f_log = F.softplus(self._capped(self.fgate_preact(h).float()) * -1.0).reshape(batch, length, heads, 1) * -1.0
        state, states = row_states(ctx, "mlstm_states", index)
        if state is None:
            state = (Tensor(np.zeros((batch, heads, dq, dv), np.float32)),
                     Tensor(np.zeros((batch, heads, 1, dq), np.float32)),
                     Tensor(np.zeros((batch, heads, 1), np.float32)))
        memory, normalizer, top = state
        padding = layout_padding(ctx, length)
        outputs = []
        for t in range(length):
            decayed = f_log[:, t] + top
            top_next = decayed.maximum(i_gate[:, t])
            forget, write = (decayed - top_next).exp(), (i_gate[:, t] - top_next).exp()    # [B, H, 1]
            k_t = k[:, t]                                                                    # [B, H, dq, 1]
            memory_next = memory * forget.reshape(batch, heads, 1, 1) + k_t * v[:, t] * write.reshape(
                batch, heads, 1, 1)
            normalizer_next = normalizer * forget.reshape(batch, heads, 1, 1) + k_t.reshape(
                batch, heads, 1, dq) * write.reshape(batch, heads, 1, 1)
            numerator = F.matmul(q[:, t], memory_next)                                       # [B, H, 1, dv]
            dot = F.matmul(q[:, t], normalizer_next.reshape(batch, heads, dq, 1))            # [B, H, 1, 1]
            floor = (top_next * -1.0).exp().reshape(batch, heads, 1, 1)
            outputs.append(numerator / (dot.abs().maximum(floor) + self.eps))
            if padding is None:
                memory, normalizer, top = memory_next, normalizer_next, top_next
            else:  # a padded token leaves the state as it was
                real, pad = padding[:, t].reshape(batch, 1, 1), 1.0 - padding[:, t].reshape(batch, 1, 1)
                memory = memory_next * Tensor(real[..., None]) + memory * Tensor(pad[..., None])
                normalizer = normalizer_next * Tensor(real[..., None]) + normalizer * Tensor(pad[..., None])
                top = top_next * Tensor(real) + top * Tensor(pad)
        y = F.stack(outputs, 1).reshape(batch, length, heads, dv)
        y = F.layer_norm(y, None, None, eps=self.norm_eps).reshape(batch, length, self.v_dim)
        y = y * self.multihead_norm.weight.float()
        if states is not None:
            states[index] = (memory.detach(), normalizer.detach(), top.detach())
        return self.out_proj((F.sigmoid(self.ogate_preact(h).float()) * y).cast(h.dtype))


register_row_state("mlstm_states")  # per row: a server's batch moves it with its row's keys and values
