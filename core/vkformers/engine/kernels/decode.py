"""Fused decode-step products (shaders/common/decode_matvec.comp): ``epilogue(rms_norm(x) @ W^T)``.

A decode step multiplies one token per sequence (at most ``MAX_ROWS`` rows) by every weight of the
model. On a GPU each product is bound by reading its weight, and what costs most beside them are
the small dependent dispatches between products (norm, rotary, cache write, activation, residual
add), each a few microseconds of idle GPU. One dispatch here does a whole span of them:

- ``mode="plain"``:  out = [residual + residual_scale *] (norm(x) @ W0^T [+ bias0])
- ``mode="gated"``:  out = act(norm(x) @ W0^T [+ b0]) * (norm(x) @ W1^T [+ b1])
- ``mode="qkv"``:    q, k, v = norm(x) @ {W0, W1, W2}^T [+ biases]; q and k rotated (rotary
  embedding at ``positions``); q -> out0 [rows, heads, 1, head_dim], k and v written into the KV
  caches out1 / out2 [rows, kv_heads, capacity, head_dim] at slot ``cache_start[0]``.

x, the weights, the norm weight, biases, residual and outputs share one dtype (float32, float16 or
bfloat16); accumulation is float32 and every intermediate stays float32 (Hugging Face rounds the
norm output and each product to a 16-bit dtype in between: the 16-bit results differ by that
rounding). The rows of x, the norm weight and the weights are read as 16-byte vectors: k and x's
offset must be whole vectors, and so must the weights' and norm weight's offsets (row slices of one fused
weight are fine; :func:`supported` says).

Quantized weights (``quant_format``: the weights' block format, or one per weight as a Q4_K_M file mixes Q4_K and
Q6_K; uint8 operands whose offsets are whole 4-byte words) take the kernel's q_* variants, which dequantize 32-weight
units as they read them.
"""
from __future__ import annotations

from vkformers.engine.kernels import Operand, operand, require_elements, subgroups_are_full
from vkformers.engine.kernels.transformer_args import element_variant

MAX_ROWS = 8
MODES = {"plain": 0, "gated": 1, "qkv": 2}
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


def elements_per_vector(dtype) -> int:
    return 4 if dtype.name == "float32" else 8


def weight_formats(quant_format, count: int) -> list | None:
    """One block format per weight (None: dense weights) from ``quant_format``: one format or a sequence of them."""
    if quant_format is None:
        return None
    formats = list(quant_format) if isinstance(quant_format, (list, tuple)) else [quant_format] * count
    if len(formats) != count:
        raise ValueError(f"decode_matvec: {len(formats)} block formats for {count} weights")
    return formats


def supported(x: Operand, weights, k: int, rows: int, norm_weight: Operand | None = None, quant_format=None) -> bool:
    """Whether the fused kernel can take these operands (else the caller composes the ordinary ops)."""
    per_vector = elements_per_vector(x.dtype)
    formats = weight_formats(quant_format, len(weights))
    dense = [] if formats is not None else list(weights)
    whole = dense + ([norm_weight] if norm_weight is not None else [])
    packed = formats is None or (all(k % f.block == 0 for f in formats)
                                 and all(w.dtype.name == "uint8" and w.offset % 4 == 0 for w in weights))
    return (1 <= rows <= MAX_ROWS and x.dtype.name in ("float32", "float16", "bfloat16") and packed
            and k % per_vector == 0 and x.offset % per_vector == 0
            and all(w.offset % per_vector == 0 and w.dtype is x.dtype for w in whole))


# Packed weights at batch 1 on a GPU: (subgroups per workgroup, units of 32 weights in flight per lane, pairs of columns
# computed together (sharing each read of x), split k: the workgroup's subgroups share its pairs, taking units of k in
# turn[, units side by side in a lane: 2 shares the decoding of a block's scales between its units 2m and 2m + 1]),
# by the first weight's block format, or by (format, kind) for one kind of product (product_kind: "qkv", "gated",
# "plain", and "plain_long" for a plain product whose k is at least twice its width, as down_proj). The most specific
# key wins; a format not listed takes QUANT_LAUNCH_DEFAULT. ``bench/quant.py --sweep`` times QUANT_SWEEP_SHAPES on
# the H200 at the Llama-3-8B shape and prints the lines to put here.
QUANT_LAUNCH = {"q4_k": (2, 1, 2, 1), ("q4_k", "plain"): (1, 1, 2, 0, 2), ("q4_k", "gated"): (4, 1, 4, 0),
                ("q4_k", "plain_long"): (1, 1, 2, 0, 2),
                "q5_k": (1, 1, 2, 0, 2), ("q5_k", "gated"): (4, 1, 2, 0), "q6_k": (2, 1, 2, 1),
                "q8_0": (4, 1, 2, 1), "q4_0": (1, 2, 2, 0)}
QUANT_LAUNCH_DEFAULT = (4, 1, 2, 1)
# The launch shapes bench/quant.py --sweep times for the first format, the likeliest first (the tests run each of them
# on a GPU): k split over 2, 4 or 8 subgroups, or a subgroup (alone or 4 in a workgroup) per group of pairs; 1 to 4
# units in flight, 1 or 2 side by side; 1 to 4 pairs. (k = 4096 is 128 units: 8 split subgroups, 256 lanes, leave
# half of them idle.)
QUANT_SWEEP_SHAPES = (
    (4, 1, 2, 1), (2, 1, 2, 1, 2), (4, 1, 1, 1), (2, 1, 2, 1), (4, 1, 4, 1), (2, 1, 4, 1, 2), (1, 1, 2, 0, 2),
    (4, 1, 2, 0, 2), (4, 1, 2, 0), (1, 2, 2, 0), (4, 2, 2, 0), (2, 1, 1, 1, 2), (4, 1, 2, 1, 2), (2, 2, 2, 1),
    (4, 2, 2, 1), (2, 1, 4, 1), (8, 1, 2, 1), (8, 1, 1, 1), (1, 1, 4, 0, 2), (1, 2, 2, 0, 2), (4, 2, 2, 0, 2),
    (1, 1, 2, 0), (1, 1, 4, 0), (4, 1, 4, 0), (1, 2, 4, 0), (4, 2, 4, 0), (1, 4, 2, 0), (4, 4, 2, 0),
    (2, 1, 1, 1), (2, 2, 1, 1), (2, 2, 4, 1), (4, 2, 1, 1), (4, 2, 4, 1), (8, 1, 4, 1), (4, 1, 1, 1, 2),
    (4, 1, 4, 1, 2), (1, 1, 1, 0, 2), (1, 1, 1, 0), (4, 1, 1, 0), (1, 2, 1, 0), (4, 2, 1, 0), (1, 4, 1, 0),
    (4, 4, 1, 0))
# The part of them swept for the formats after the first (bench/quant.py --sweep, under its time budget).
QUANT_SWEEP_SHORT = ((4, 1, 2, 1), (2, 1, 2, 1, 2), (4, 1, 1, 1), (2, 1, 2, 1), (4, 1, 4, 1), (1, 1, 2, 0, 2),
                     (4, 1, 2, 0, 2), (4, 1, 2, 0), (1, 2, 2, 0), (4, 2, 2, 1), (8, 1, 2, 1), (1, 1, 1, 0))


def product_kind(mode: str, k: int, widths) -> str:
    """QUANT_LAUNCH's kind of a decode product: its mode, and "plain_long" for a plain one with k >= 2 x its width."""
    return "plain_long" if mode == "plain" and k >= 2 * int(widths[0]) else mode


def quant_launch(quant: str, kind: str = "plain") -> tuple[int, ...]:
    """QUANT_LAUNCH's shape for packed weights in ``quant`` at batch 1 (subgroups counted in 32 lanes)."""
    return tuple(QUANT_LAUNCH.get((quant, kind)) or QUANT_LAUNCH.get(quant, QUANT_LAUNCH_DEFAULT))


def launch_shape(device, rows: int = 1, quant: str | None = None, kind: str = "plain") -> tuple[int, ...]:
    """(subgroups per workgroup, vectors of W per lane in flight, pairs of columns per subgroup, split k: the
    workgroup's subgroups share each pair, each taking a slice of k). A GPU, one row: 4 subgroups sharing one pair,
    2 vectors in flight per lane (on the H200 a TinyLlama token's decode products took 0.41 ms per 8 layers against
    0.49 with one pair per subgroup and 4 in flight, ``bench/decode.py --sweep``: the narrow o_proj and down_proj
    gain most); more rows: one pair per subgroup, 4 in flight (batch 8 decoded 1,336 tok/s so, 1,104 split). A CPU
    (lavapipe): one subgroup doing 4 pairs (as the small-m matmul: fewer, longer workgroups). The tests also run
    the GPU shapes on lavapipe. ``quant``: the block format of packed weights (``kind``: product_kind); at one row a
    GPU takes quant_launch's shape (its subgroups counted in 32 lanes), where the pairs of a workgroup (split k) or
    subgroup share their reads of x and "in flight" counts units of 32 weights."""
    if device.is_cpu:
        return 1, 1, 4, 0
    subgroups = max(1, 128 // device.limits["subgroup_size"])
    if quant is not None and rows == 1:
        shape = quant_launch(quant, kind)
        return (max(1, shape[0] * 32 // device.limits["subgroup_size"]),) + tuple(shape[1:])
    return (subgroups, 2, 1, 1) if rows == 1 else (subgroups, 4, 1, 0)


def decode_matvec(seq, x, weights, out0, *, rows: int, k: int, widths, mode: str = "plain", norm_weight=None,
                  norm: bool = False, eps: float = 1e-6, norm_offset: bool = False, biases=None, residual=None,
                  residual_scale: float = 1.0, activation: str = "silu", out1=None, out2=None, positions=None,
                  cache_start=None, inv_freq=None, head_dim: int = 0, rot_dim: int = 0, kv_heads: int = 0,
                  capacity: int = 0, attention_scaling: float = 1.0, interleaved: bool = False,
                  launch: tuple[int, ...] | None = None, quant_format=None, page_size: int = 0,
                  bias_rows=None) -> None:
    """Record one fused product (see the module docstring). ``weights``: 1 (plain), 2 (gated: gate, up)
    or 3 (qkv) operands [n_i, k] with ``widths`` the n_i; ``biases`` the same count (None where a weight has none) or
    None, each [n_i], or [rows, n_i] where ``bias_rows`` (one flag per weight) says so; ``norm`` turns the RMS norm
    prologue on (``norm_weight`` None: no weight). ``launch``: (subgroups per workgroup, vectors in flight, pairs per
    subgroup, split k[, packed weights: units side by side]) instead of :func:`launch_shape` (bench/decode.py and
    bench/quant.py sweep them).
    ``quant_format`` (engine.quantized.QuantFormat, or one per weight): the weights are packed uint8 operands of
    that format. ``page_size`` > 0 (qkv):
    out1 / out2 are pools of blocks [blocks, kv_heads, page_size, head_dim] and cache_start the paged cache's step
    [start, end, block tables of capacity / page_size entries per row]."""
    x, out0 = operand(x), operand(out0)
    weights = [operand(w) for w in weights]
    expected = {"plain": 1, "gated": 2, "qkv": 3}[mode]
    if len(weights) != expected:
        raise ValueError(f"decode_matvec: mode {mode!r} takes {expected} weights, got {len(weights)}")
    norm_weight = operand(norm_weight) if norm_weight is not None else None
    if not supported(x, weights, k, rows, norm_weight, quant_format):
        raise ValueError(f"decode_matvec: unsupported operands (rows {rows}, k {k}, dtype {x.dtype.name}, "
                         f"offsets must be whole 16-byte vectors)")
    ns = [int(n) for n in widths]
    formats = weight_formats(quant_format, len(weights))
    for i, (w, n) in enumerate(zip(weights, ns)):
        require_elements(w, n * (formats[i].row_bytes(k) if formats else k), "decode_matvec weight")
    if mode == "gated" and ns[0] != ns[1]:
        raise ValueError(f"decode_matvec: gate ({ns[0]}) and up ({ns[1]}) widths differ")
    require_elements(x, rows * k, "decode_matvec x")
    bias_rows = [bool(f) for f in bias_rows] if bias_rows is not None else [False] * len(ns)
    if biases is not None:
        if len(biases) != len(ns) or len(bias_rows) != len(ns):
            raise ValueError(f"decode_matvec: {len(ns)} weights, {len(biases)} biases, {len(bias_rows)} bias_rows")
        biases = [operand(b) if b is not None else None for b in biases]
        for b, n, per_row in zip(biases, ns, bias_rows):
            if b is not None:
                require_elements(b, rows * n if per_row else n, "decode_matvec bias")
    bias_mask = sum(1 << i for i, b in enumerate(biases or []) if b is not None)
    bias_rows_mask = sum(1 << i for i, (b, f) in enumerate(zip(biases or [], bias_rows)) if b is not None and f)
    if mode == "qkv":
        if head_dim % 2 or rot_dim % 2 or rot_dim > head_dim or any(n % head_dim for n in ns):
            raise ValueError(f"decode_matvec: head_dim {head_dim} / rot_dim {rot_dim} do not fit widths {ns}")
        out1, out2 = operand(out1), operand(out2)
        if page_size and (capacity % page_size or cache_start is None):
            raise ValueError(f"decode_matvec: a paged cache needs capacity ({capacity}) a multiple of page_size "
                             f"({page_size}) and its step tensor as cache_start")
        for cache, what in ((out1, "k cache"), (out2, "v cache")):
            require_elements(cache, (page_size if page_size else rows * capacity) * kv_heads * head_dim,
                             f"decode_matvec {what}")
        if page_size:
            require_elements(operand(cache_start), 2 + rows * capacity // page_size, "decode_matvec block tables")
        require_elements(out0, rows * ns[0], "decode_matvec q")
    else:
        require_elements(out0, rows * ns[0], "decode_matvec out")
    if residual is not None:
        residual = operand(residual)
        require_elements(residual, rows * ns[0], "decode_matvec residual")

    filler_in, filler_out = x, out0  # absent operands: spec constants keep the kernel off them
    positions = operand(positions) if positions is not None else filler_in
    cache_start = operand(cache_start) if cache_start is not None else filler_in
    inv_freq = operand(inv_freq) if inv_freq is not None else filler_in
    padded_w = weights + [weights[0]] * (3 - len(weights))
    padded_b = [b if b is not None else filler_in for b in biases or []]
    padded_b += [filler_in] * (3 - len(padded_b))
    buffers = [x.buffer, (norm_weight or x).buffer, *(w.buffer for w in padded_w), *(b.buffer for b in padded_b),
               (residual or filler_in).buffer, out0.buffer, (out1 or filler_out).buffer, (out2 or filler_out).buffer,
               positions.buffer, cache_start.buffer, inv_freq.buffer]
    padded_n = ns + [0] * (3 - len(ns))
    push = [k, *padded_n, float(eps), float(residual_scale), head_dim, rot_dim, kv_heads, capacity,
            float(attention_scaling), *(b.offset for b in padded_b), (residual or filler_in).offset, out0.offset,
            positions.offset, cache_start.offset, inv_freq.offset, x.offset // elements_per_vector(x.dtype),
            *(w.offset if formats is not None else w.offset // elements_per_vector(x.dtype) for w in padded_w),
            (norm_weight or x).offset // elements_per_vector(x.dtype)]
    device = seq.device
    subgroup = device.limits["subgroup_size"]
    if not subgroups_are_full(device):  # the lanes stride over k by gl_SubgroupSize: missing ones skip their part
        raise ValueError(f"decode_matvec: {device.name} runs subgroups narrower than the {subgroup} lanes the "
                         f"kernel counts on; compose the ordinary ops instead (engine.ops.decode.fusable says)")
    subgroups, unroll, per_subgroup, split_k, *adjacent = launch or launch_shape(
        device, rows, formats[0].name if formats else None, product_kind(mode, k, ns))
    adjacent = adjacent[0] if adjacent and formats is not None and (k // 32) % adjacent[0] == 0 else 1
    if adjacent not in (1, 2):
        raise ValueError(f"decode_matvec: 1 or 2 units side by side, got {adjacent}")
    if split_k and subgroups > 32:
        raise ValueError(f"decode_matvec: split k takes at most 32 subgroups per workgroup, got {subgroups}")
    threads = subgroups * subgroup
    pairs = {"plain": -(-ns[0] // 2), "gated": ns[0], "qkv": sum(ns) // 2}[mode]
    per_group = per_subgroup if split_k else subgroups * per_subgroup
    spec = [threads, rows, MODES[mode], int(norm), int(norm_weight is not None), int(norm_offset),
            bias_mask, int(residual is not None), ACTIVATIONS[activation], int(interleaved), unroll,
            per_subgroup, int(split_k), int(page_size), bias_rows_mask]
    variant = element_variant(x, "decode_matvec")
    if formats is not None:
        variant = "q_" + variant
        padded_f = formats + [formats[0]] * (3 - len(formats))
        spec += [padded_f[0].shader_id, int(all(w.offset % 16 == 0 for w in padded_w)), padded_f[1].shader_id,
                 padded_f[2].shader_id, adjacent]
    seq.dispatch(device.kernel("decode_matvec", variant), buffers,
                 (-(-pairs // per_group), 1, 1), push, spec)


def decode_head_norm_rope(seq, q_in, k_in, v_in, q_weight, k_weight, q_out, k_cache, v_cache, cache_start, *,
                          rows: int, heads: int, kv_heads: int, head_dim: int, capacity: int, eps: float,
                          positions=None, inv_freq=None, rot_dim: int = 0, attention_scaling: float = 1.0,
                          interleaved: bool = False, norm_offset: bool = False, page_size: int = 0) -> None:
    """QK-norm models' decode tail (shaders/common/decode_head_norm_rope.comp): RMS norm of each q and k head
    (weights [head_dim]), the rotary embedding, q into q_out [rows, heads, 1, head_dim], k and v into the caches
    [rows, kv_heads, capacity, head_dim] at slot ``cache_start[0]``. q_in, k_in, v_in: [rows, heads * head_dim].
    ``page_size`` > 0: paged caches, as decode_matvec's."""
    q_in, k_in, v_in, q_weight, k_weight, q_out, k_cache, v_cache, cache_start = map(
        operand, (q_in, k_in, v_in, q_weight, k_weight, q_out, k_cache, v_cache, cache_start))
    if head_dim % 2 or head_dim > 256 or rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"decode_head_norm_rope: head_dim {head_dim} (even, at most 256) / rot_dim {rot_dim}")
    for x, count, what in ((q_in, rows * heads * head_dim, "q"), (k_in, rows * kv_heads * head_dim, "k"),
                           (v_in, rows * kv_heads * head_dim, "v"), (q_weight, head_dim, "q norm weight"),
                           (k_weight, head_dim, "k norm weight"), (q_out, rows * heads * head_dim, "q out"),
                           (k_cache, (page_size or rows * capacity) * kv_heads * head_dim, "k cache"),
                           (v_cache, (page_size or rows * capacity) * kv_heads * head_dim, "v cache")):
        require_elements(x, count, f"decode_head_norm_rope {what}")
    positions = operand(positions) if positions is not None else cache_start
    inv_freq = operand(inv_freq) if inv_freq is not None else cache_start  # unread without rotary dims
    buffers = [q_in.buffer, k_in.buffer, v_in.buffer, q_weight.buffer, k_weight.buffer, positions.buffer,
               inv_freq.buffer, cache_start.buffer, q_out.buffer, k_cache.buffer, v_cache.buffer]
    push = [heads, kv_heads, head_dim, rot_dim, capacity, float(eps), float(attention_scaling), q_in.offset,
            k_in.offset, v_in.offset, q_weight.offset, k_weight.offset, positions.offset, inv_freq.offset,
            cache_start.offset]
    device = seq.device
    seq.dispatch(device.kernel("decode_head_norm_rope", element_variant(q_in, "decode_head_norm_rope")), buffers,
                 (rows * (heads + kv_heads), 1, 1), push, [int(interleaved), int(norm_offset), int(page_size)])


def next_token(seq, logits, ids, bounds, history, *, rows: int, vocab: int, row_stride: int, step: int,
               positions=None) -> None:
    """Between chained greedy decode steps (shaders/common/decode_next_token.comp): ``ids[r]`` and
    ``history[step * rows + r]`` = argmax of row r of ``logits`` (``row_stride`` elements apart; the lowest index
    among equal maxima, as numpy), ``positions[r] += 1`` when given, and both cache bounds ``[start, end] += 1``.
    ids, positions: int32 [rows]; bounds: uint32 [2]; history: int32 [steps * rows]."""
    logits, ids, bounds, history = map(operand, (logits, ids, bounds, history))
    positions = operand(positions) if positions is not None else None
    require_elements(logits, (rows - 1) * row_stride + vocab, "next_token logits")
    for x, count, what in ((ids, rows, "ids"), (bounds, 2, "bounds"), (history, (step + 1) * rows, "history")):
        require_elements(x, count, f"next_token {what}")
    if positions is not None:
        require_elements(positions, rows, "next_token positions")
    push = [vocab, row_stride, logits.offset, ids.offset, positions.offset if positions is not None else 0,
            bounds.offset, history.offset + step * rows, int(positions is not None)]
    threads = 1 << (min(1024, int(seq.device.limits.get("max_compute_work_group_invocations", 128))).bit_length() - 1)
    seq.dispatch(seq.device.kernel("decode_next_token", element_variant(logits, "next_token")),
                 [logits.buffer, ids.buffer, (positions or ids).buffer, bounds.buffer, history.buffer], (rows, 1, 1),
                 push, spec=[threads])
