"""Fused decode-step ops on tensors (engine/kernels/decode.py): a product with the steps around it.

Inference only (no gradient): models call them for a decode step (one new token per sequence) under
``no_grad`` when :func:`fusable` accepts the operands, and compose the ordinary ops otherwise. Each
replaces a norm, a product and its epilogue (bias, residual add, gated activation, or rotary
embedding plus the KV-cache write) by one dispatch.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from vkformers.engine.function import CopyStrided, KernelOp, contiguous, grad_enabled, node, wrap
from vkformers.engine.kernels import decode as KD
from vkformers.engine.kernels import matmul as KM
from vkformers.engine.kernels import subgroups_are_full
from vkformers.engine.quantized import QuantizedTensor, quant_format
from vkformers.engine.row_blocks import RowBlocks
from vkformers.runtime import dtypes as dt


# None (the default): on GPUs only. The fused kernels trade a little arithmetic for fewer dispatches, which a
# GPU waits on; on a CPU device (lavapipe) decoding ran slower fused (bench/llama.py --layers 4 --fused-ab:
# 1.2 against 1.5 tokens/s, docs/benchmarks.md).
# True / False (VKFORMERS_FUSED_DECODE=1 / 0) force them on or off: the tests on lavapipe, a benchmark
# comparing both, or ruling them out when chasing a wrong result. Never on a device whose subgroups may hold fewer
# invocations than gl_SubgroupSize (kernels.subgroup_lanes): the kernel's lanes would skip the missing lanes' part.
enabled: bool | None = {"1": True, "0": False}.get(os.environ.get("VKFORMERS_FUSED_DECODE", ""))
# Past the rows where x @ W^T takes the small-m kernel, a GPU's cooperative-matrix tiles (COOPMAT_SKINNY) read large
# weights faster than the fused kernel, whose arithmetic per weight grows with the rows, even with the norm and
# epilogues as dispatches of their own; small products gain more from the dispatches fusion saves (runs L10 and L11 of
# docs/benchmarks.md: Llama-3-8B's products, the largest weight of each 32-112 MiB, against TinyLlama's, at most
# 22 MiB). A product whose largest weight has this many bytes or more takes the ordinary ops there.
FUSED_DENSE_MAX_BYTES = 32 << 20


@dataclass(frozen=True)
class FusedNorm:
    """The RMS norm folded in front of a product: ``weight`` None for a norm without one."""

    weight: object  # Tensor or None
    eps: float
    unit_offset: bool = False


class DecodeMatvec(KernelOp):
    """ins: x [, norm weight], weights [, biases] [, residual] [, cache start [, positions, inv_freq], k cache,
    v cache]; outs: out0 [, k cache, v cache (in place)]. Attributes are decode_matvec's keywords."""

    name = "decode_matvec"

    def emit(self, seq, outs, ins):
        ins = list(ins)
        x = ins.pop(0)
        norm_weight = ins.pop(0).operand if self.has_norm_weight else None
        weights = [ins.pop(0).operand for _ in self.widths]
        biases = [ins.pop(0).operand if kind else None for kind in self.bias_kinds] if any(self.bias_kinds) else None
        residual = ins.pop(0).operand if self.has_residual else None
        extra = {}
        if self.mode == "qkv":
            start, positions, inv_freq = _cache_start_and_rotary(ins, self.rot_dim)
            extra = dict(out1=outs[1].operand, out2=outs[2].operand, positions=positions, cache_start=start,
                         inv_freq=inv_freq)
        quant = [quant_format(name) for name in self.attrs["quant"].split(",")] if self.attrs.get("quant") else None
        KD.decode_matvec(seq, x.operand, weights, outs[0].operand, rows=self.rows, k=self.k, widths=self.widths,
                         mode=self.mode, norm_weight=norm_weight, norm=self.norm, eps=self.eps,
                         norm_offset=self.norm_offset, biases=biases, residual=residual,
                         residual_scale=self.residual_scale, activation=self.activation, head_dim=self.head_dim,
                         rot_dim=self.rot_dim, kv_heads=self.kv_heads, capacity=self.capacity,
                         attention_scaling=self.attention_scaling, interleaved=self.interleaved, quant_format=quant,
                         page_size=self.attrs.get("page_size", 0), bias_rows=[k == "row" for k in self.bias_kinds],
                         **extra)


def fusable(x, weights, norm: FusedNorm | None = None) -> bool:
    """Whether the fused kernel takes x [..., k] (at most 8 rows) and these [n, k] weights: no gradient
    recorded, one dtype, contiguous weights (row slices of a fused one are fine) starting on a 16-byte vector,
    k a whole number of vectors."""
    if grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    return x.shape[-1] == weights[0].shape[-1] and fusable_weights(x.dtype, math.prod(x.shape[:-1]), weights, norm)


def fusable_weights(dtype, rows: int, weights, norm: FusedNorm | None = None) -> bool:
    """:func:`fusable` for an input still to be computed: ``rows`` rows of ``dtype`` times these weights. By
    default, past the rows where the plain product would take the small-m kernel, dense weights fuse only while
    each is under FUSED_DENSE_MAX_BYTES (see there)."""
    if any(isinstance(w, RowBlocks) for w in weights):  # the kernel binds each weight whole
        return False
    device = weights[0].lazy.device
    if enabled is False or (enabled is None and device.is_cpu) or not subgroups_are_full(device):
        return False
    if enabled is None and not isinstance(weights[0], QuantizedTensor) \
            and KM.select_algorithm(device, dtype, rows, trans_b=True) != "small_m" \
            and max(math.prod(w.shape) for w in weights) * dtype.itemsize >= FUSED_DENSE_MAX_BYTES:
        return False
    k, per_vector = weights[0].shape[-1], KD.elements_per_vector(dtype)
    quantized = [w for w in weights if isinstance(w, QuantizedTensor)]
    if quantized:  # all packed (each in its own block format), each a whole QuantizedTensor on a 4-byte word
        if len(quantized) != len(weights) or any(k % w.format.block for w in quantized) \
                or any(w.lazy.view.offset % 4 or not w.lazy.view.is_contiguous for w in quantized):
            return False
    dense = [] if quantized else list(weights)
    whole = dense + ([norm.weight] if norm is not None and norm.weight is not None else [])
    return (1 <= rows <= KD.MAX_ROWS and dtype.name in ("float32", "float16", "bfloat16")
            and k % per_vector == 0 and all(w.ndim == 2 and w.shape[1] == k for w in weights)
            and all(w.dtype is dtype and w.lazy.view.offset % per_vector == 0 and w.lazy.view.is_contiguous
                    for w in whole))


def _inputs_and_attrs(x, weights, norm, biases, residual):
    rows, k = math.prod(x.shape[:-1]), x.shape[-1]
    x_lazy = contiguous(x.lazy)
    if x_lazy.view.offset % KD.elements_per_vector(x.dtype):
        x_lazy = node(CopyStrided(), [x_lazy], [(x_lazy.shape, x_lazy.dtype)])[0]
    inputs = [x_lazy]
    if norm is not None and norm.weight is not None:
        inputs.append(norm.weight.lazy)
    inputs += [w.lazy for w in weights]
    bias_kinds = tuple(None if b is None else ("row" if b.ndim > 1 else "column")
                       for b in biases or [None] * len(weights))
    for b in biases or ():
        if b is not None:
            inputs.append(contiguous(b.cast(x.dtype).lazy))
    if residual is not None:
        inputs.append(residual.cast(x.dtype).lazy)
    attrs = dict(rows=rows, k=k, widths=tuple(w.shape[0] for w in weights), norm=norm is not None,
                 has_norm_weight=norm is not None and norm.weight is not None,
                 eps=float(norm.eps) if norm else 0.0, norm_offset=bool(norm and norm.unit_offset),
                 bias_kinds=bias_kinds, has_residual=residual is not None, residual_scale=1.0,
                 activation="silu", head_dim=0, rot_dim=0, kv_heads=0, capacity=0, attention_scaling=1.0,
                 interleaved=False,
                 quant=",".join(w.format.name for w in weights) if isinstance(weights[0], QuantizedTensor) else None)
    return inputs, attrs


def fused_linear(x, weight, *, norm: FusedNorm | None = None, bias=None, residual=None, residual_scale: float = 1.0):
    """``[residual + residual_scale *] (rms_norm(x) @ weight.T [+ bias])`` for x [..., k]: one dispatch. ``bias`` is
    [n], or one per row of x ([..., n]: an update computed beside the step, as a served adapter's); so are the
    ``biases`` of :func:`fused_gated` and :func:`fused_qkv_rope_write`, where an entry may be None (no bias)."""
    inputs, attrs = _inputs_and_attrs(x, [weight], norm, None if bias is None else [bias], residual)
    attrs.update(mode="plain", residual_scale=float(residual_scale))
    shape = x.shape[:-1] + (weight.shape[0],)
    return wrap(node(DecodeMatvec(**attrs), inputs, [(shape, x.dtype)])[0])


def fused_gated(x, gate_weight, up_weight, *, activation: str = "silu", norm: FusedNorm | None = None, biases=None):
    """``act(rms_norm(x) @ gate.T [+ b]) * (rms_norm(x) @ up.T [+ b])`` for x [..., k]: one dispatch."""
    if activation not in KD.ACTIVATIONS:
        raise ValueError(f"fused_gated: activation must be one of {sorted(KD.ACTIVATIONS)}, not {activation!r}")
    inputs, attrs = _inputs_and_attrs(x, [gate_weight, up_weight], norm, biases, None)
    attrs.update(mode="gated", activation=activation)
    shape = x.shape[:-1] + (gate_weight.shape[0],)
    return wrap(node(DecodeMatvec(**attrs), inputs, [(shape, x.dtype)])[0])


def fused_qkv_rope_write(x, wq, wk, wv, *, k_cache, v_cache, cache_start, head_dim: int, positions=None,
                         inv_freq=None, attention_scaling: float = 1.0, interleaved: bool = False,
                         norm: FusedNorm | None = None, biases=None, page_size: int = 0, capacity: int = 0):
    """q, k, v projections of x [batch, 1, hidden] with the rotary embedding (angles ``positions`` [batch, 1]
    int32 times ``inv_freq`` float32 [rot_dim / 2]; None: no rotation, a NoPE layer), k and v written into the
    caches [batch, kv_heads, capacity, head_dim] (persistent tensors) at slot ``cache_start[0]`` (uint32, read
    on the GPU). Returns q [batch, heads, 1, head_dim]; the caches' tensors are updated in place. ``page_size`` >
    0: the caches are a paged cache's pools [blocks, kv_heads, page_size, head_dim], ``cache_start`` its step tensor
    [start, end, tables] and ``capacity`` its rows' logical length (engine/ops/cache.py)."""
    length = x.shape[1]
    if length != 1:
        raise ValueError(f"fused_qkv_rope_write: one new token per sequence, got {length}")
    for cache, what in ((k_cache, "k"), (v_cache, "v")):
        if not cache.lazy.base.persistent or cache.dtype is not x.dtype:
            raise ValueError(f"fused_qkv_rope_write: the {what} cache must be a persistent {x.dtype.name} tensor")
    inputs, attrs = _inputs_and_attrs(x, [wq, wk, wv], norm, biases, None)
    attrs.update(mode="qkv", **_rotary_attrs(head_dim, inv_freq, attention_scaling, interleaved, k_cache, page_size,
                                             capacity))
    if page_size:
        attrs["page_size"] = int(page_size)  # (absent otherwise: the recorded plans of contiguous caches keep their key)
    return _rotate_and_write(DecodeMatvec(**attrs), inputs, wq.shape[0] // head_dim, k_cache, v_cache, cache_start,
                             positions, inv_freq, x.shape[0])


def _rotary_attrs(head_dim, inv_freq, attention_scaling, interleaved, k_cache, page_size=0, capacity=0) -> dict:
    """The rotary and cache attributes shared by the two kernels that end a decode step's q/k/v."""
    if page_size and (k_cache.shape[2] != page_size or capacity % page_size):
        raise ValueError(f"paged cache write: pools {k_cache.shape} and capacity {capacity} do not fit page_size "
                         f"{page_size}")
    return dict(head_dim=head_dim, rot_dim=0 if inv_freq is None else 2 * inv_freq.shape[0],
                kv_heads=k_cache.shape[1], capacity=capacity if page_size else k_cache.shape[2],
                attention_scaling=float(attention_scaling), interleaved=bool(interleaved))


def _rotate_and_write(op, inputs, heads: int, k_cache, v_cache, cache_start, positions, inv_freq, batch: int):
    """Add ``op``, which rotates q and k and writes k and v into the caches at ``cache_start[0]``: its inputs end
    with the cache start [, positions, inv_freq] and the caches, its outputs are q [B, H, 1, D] and the caches
    (in place). Returns q; the caches' tensors now hold the write."""
    inputs = inputs + [(cache_start if cache_start.numel() > 1 else cache_start.reshape(1)).lazy]
    if inv_freq is not None:
        inputs += [positions.cast(dt.int32).lazy, inv_freq.float().lazy]
    inputs += [k_cache.lazy, v_cache.lazy]
    head_dim, dtype = k_cache.shape[3], k_cache.dtype
    q, k_out, v_out = node(op, inputs, [((batch, heads, 1, head_dim), dtype), (k_cache.shape, dtype),
                                        (v_cache.shape, dtype)], into=[None, k_cache.lazy, v_cache.lazy])
    k_cache._set_lazy(k_out)
    v_cache._set_lazy(v_out)
    return wrap(q)


def _cache_start_and_rotary(ins: list, rot_dim: int):
    """(cache start, positions, inv_freq) operands popped from the front of a :func:`_rotate_and_write` op's
    remaining inputs (positions and inv_freq None without rotary dims)."""
    start = ins.pop(0).operand
    return (start, ins.pop(0).operand, ins.pop(0).operand) if rot_dim else (start, None, None)


class DecodeHeadNormRope(KernelOp):
    """ins: q, k, v, q norm weight, k norm weight, cache start [, positions, inv_freq], k cache, v cache;
    outs: q [B, H, 1, D], k cache, v cache (in place)."""

    name = "decode_head_norm_rope"

    def emit(self, seq, outs, ins):
        q, k, v, q_weight, k_weight, *rest = ins
        start, positions, inv_freq = _cache_start_and_rotary(rest, self.rot_dim)
        KD.decode_head_norm_rope(seq, q.operand, k.operand, v.operand, q_weight.operand, k_weight.operand,
                                 outs[0].operand, outs[1].operand, outs[2].operand, start, rows=self.rows,
                                 heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                 capacity=self.capacity, eps=self.eps, positions=positions, inv_freq=inv_freq,
                                 rot_dim=self.rot_dim, attention_scaling=self.attention_scaling,
                                 interleaved=self.interleaved, norm_offset=self.norm_offset,
                                 page_size=self.page_size)


def fused_head_norm_rope_write(q, k, v, *, q_norm: FusedNorm, k_norm: FusedNorm, k_cache, v_cache, cache_start,
                               head_dim: int, positions=None, inv_freq=None, attention_scaling: float = 1.0,
                               interleaved: bool = False, page_size: int = 0, capacity: int = 0):
    """QK-norm (one weight [head_dim] per q / k, as Qwen3), the rotary embedding and the KV-cache write of a decode
    step in one dispatch. q [B, 1, H * D], k and v [B, 1, KVH * D] (e.g. fused_linear's products); returns q
    [B, H, 1, D]; the caches' tensors are updated in place at slot ``cache_start[0]``."""
    if q_norm.weight is None or k_norm.weight is None or q_norm.unit_offset != k_norm.unit_offset:
        raise ValueError("fused_head_norm_rope_write: q and k norms need weights of the same kind")
    inputs = [t.cast(k_cache.dtype).contiguous().lazy for t in (q, k, v, q_norm.weight, k_norm.weight)]
    heads = q.shape[-1] // head_dim
    op = DecodeHeadNormRope(rows=q.shape[0], heads=heads, eps=float(q_norm.eps), norm_offset=bool(q_norm.unit_offset),
                            page_size=int(page_size),
                            **_rotary_attrs(head_dim, inv_freq, attention_scaling, interleaved, k_cache, page_size,
                                            capacity))
    return _rotate_and_write(op, inputs, heads, k_cache, v_cache, cache_start, positions, inv_freq, q.shape[0])
