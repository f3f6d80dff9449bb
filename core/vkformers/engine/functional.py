"""The ops models are written with, named as in ``torch.nn.functional``."""
from __future__ import annotations

import math

import numpy as np

from vkformers.engine.ops.decode import (  # fused decode-step products (inference)
    FusedNorm,
    fusable,
    fusable_weights,
    fused_gated,
    fused_head_norm_rope_write,
    fused_linear,
    fused_qkv_rope_write,
)
from vkformers.engine.ops.conv import causal_conv1d, depthwise_conv1d
from vkformers.engine.ops.elementwise import cat, stack, unary, where
from vkformers.engine.ops.linalg import iterative_pinv
from vkformers.engine.ops.lsh import lsh_expectation_attention
from vkformers.engine.ops.movement import split
from vkformers.engine.ops.pool import avg_pool1d
from vkformers.engine.ops.matmul import LinearFn
from vkformers.engine.ops.matmul import grouped_matmul as _grouped_matmul
from vkformers.engine.ops.matmul import matmul as _batched_matmul
from vkformers.engine.ops.quant import quantized_embedding, quantized_linear
from vkformers.engine.ops.trig import acos
from vkformers.engine.quantized import QuantizedTensor
from vkformers.engine.row_blocks import RowBlocks
from vkformers.engine.ops.nn import (
    cross_entropy,
    dropout,
    dropout_rng_state,
    embedding,
    gather_flat,
    gather_rows,
    layer_norm,
    manual_seed,
    rms_norm,
    rope,
    scaled_dot_product_attention,
    set_dropout_rng_state,
    take_along_last,
)
from vkformers.engine.tensor import UNSET, gradient_use  # noqa: F401 (models count gradients with it)
from vkformers.engine.tensor import tensor, zeros


def linear(x, weight, bias=None, live_rows=None):
    """x @ weight.T (+ bias), with weight [out_features, in_features] as in torch and HF checkpoints.

    Leading dimensions of x are folded into the rows of one product, so that the weight's gradient is
    one [in, out] product over all tokens, not one per batch row summed afterwards. ``live_rows`` (float32,
    one count, no gradient): the rows of x at or past it are padding, whose results are not used; the
    kernels may skip them (a mixture-of-experts expert run on the rows of the tokens that chose it; see
    engine.ops.matmul)."""
    if isinstance(weight, RowBlocks):  # too large for one buffer: the blocks' output features side by side
        y = cat([linear(x, part, live_rows=live_rows) for part in weight.parts], -1)
        return y + bias if bias is not None else y
    if isinstance(weight, QuantizedTensor):  # packed blocks, dequantized inside the product
        return quantized_linear(x, weight, bias)
    if x.ndim >= 2 and weight.ndim == 2:
        y = LinearFn.apply(x, weight, live_rows)
    else:
        y = x @ weight.transpose(-1, -2)
    return y + bias if bias is not None else y


def matmul(a, b, live_rows=None):
    """a @ b with numpy broadcasting over batch dims; ``live_rows``: as :func:`linear`'s, one count per product."""
    return _batched_matmul(a, b, live_rows)


def grouped_matmul(x, weights, spans):
    """x [rows, k] @ w_e over each span e of its rows (spans float32 [E, 2] of start, count; no gradient), for
    ``weights`` E tensors [k, n] or one [E, k, n]: a mixture of experts over its tokens' rows packed expert by
    expert, one node for all experts. Rows in no span are left unwritten (engine.ops.matmul.GroupedMatmulFn)."""
    return _grouped_matmul(x, weights, spans)


def live_rows_where_used(weights):
    """float32 [n] for ``weights`` [..., n] (no gradient): per column, the number of rows (the leading dims'
    product) where some row's entry in that column is nonzero, else 0. The ``live_rows`` of products that run
    on every row but matter only where a row uses them: a mixture-of-experts expert and its routing weights
    (an expert no token chose is skipped whole)."""
    rows = math.prod(weights.shape[:-1])
    used = weights.float().detach().abs().reshape(rows, -1).sum(0) > 0.0
    return where(used, float(rows), 0.0)


def relu(x):
    return unary(x, "relu")


def relu2(x):
    """relu(x) squared (Primer / Nemotron)."""
    return unary(x, "relu2")


def gelu(x, approximate: str = "none"):
    return unary(x, "gelu_tanh" if approximate == "tanh" else "gelu")


def quick_gelu(x):
    return unary(x, "quick_gelu")


def silu(x):
    return unary(x, "silu")


def sigmoid(x):
    return unary(x, "sigmoid")


def tanh(x):
    return unary(x, "tanh")


def softplus(x, beta: float = 1.0, threshold: float = 20.0):
    """log(1 + e^(beta x)) / beta, and x itself where beta x > threshold, as torch.nn.functional.softplus."""
    if beta == 1.0 and threshold == 20.0:
        return unary(x, "softplus")
    scaled = x * beta
    return where(scaled > threshold, x, unary(scaled, "softplus") * (1.0 / beta))


ACTIVATIONS = {"relu": relu, "relu2": relu2, "gelu": gelu, "gelu_new": lambda x: gelu(x, "tanh"),
               "gelu_pytorch_tanh": lambda x: gelu(x, "tanh"), "gelu_fast": lambda x: gelu(x, "tanh"),
               "quick_gelu": quick_gelu, "silu": silu, "swish": silu, "sigmoid": sigmoid, "tanh": tanh,
               "softplus": softplus}


def activation(name: str):
    """The activation function an HF config names in ``hidden_act`` / ``hidden_activation``."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(sorted(ACTIVATIONS))}") from None


def gated(gate, up, act: str = "silu"):
    """act(gate) * up: SwiGLU with silu, GeGLU with gelu."""
    return activation(act)(gate) * up


def softmax(x, dim=UNSET, *, axis=UNSET):
    """softmax over ``dim`` (or numpy's ``axis``; default the last)."""
    return x.softmax(axis, dim=dim)


def log_softmax(x, dim=UNSET, *, axis=UNSET):
    return x.log_softmax(axis, dim=dim)


def cumsum_rows(x):
    """Inclusive running sums down the rows of x [N, C]: two small triangular products (within blocks of about
    sqrt(N) rows, then over the blocks' totals), memory O(N sqrt(N)) rather than an [N, N] matrix's."""
    rows, columns = x.shape
    block = math.isqrt(max(rows - 1, 0)) + 1
    blocks = -(-rows // block)
    padded = blocks * block
    if padded != rows:
        x = cat([x, zeros((padded - rows, columns), dtype=x.dtype, device=x.device)], 0)
    x = x.reshape(blocks, block, columns)
    lower = tensor(np.broadcast_to(np.tril(np.ones((block, block), np.float32)), (blocks, block, block)).copy(),
                   dtype=x.dtype)
    within = lower @ x                                                       # [blocks, block, C]
    if blocks > 1:
        earlier = tensor(np.tril(np.ones((blocks, blocks), np.float32), -1), dtype=x.dtype)
        within = within + (earlier @ x.sum(1)).unsqueeze(1)                  # the blocks before each block
    out = within.reshape(padded, columns)
    return out[:rows] if padded != rows else out


BAND_MASKED = -1e9  # additive score of a key outside the band (exp underflows to exactly 0)


def banded_attention(q, k, v, radius: int, *, scale: float, band_bias=None, key_mask=None, extra_keys=None,
                     extra_values=None, extra_bias=None):
    """softmax(scale * q k^T + bias) v where query i sees the keys j with |i - j| <= radius (and, if given, the
    extra keys every query sees), in memory linear in the length: the queries go in blocks of L = radius + 1, each
    over its own and its two neighbours' blocks of keys (as LongT5's local attention computes it).

    q, k, v [B, H, T, D]. ``band_bias`` [1 or B, H, L, 3L]: an additive term by (query's place in its block, key's
    place in the three blocks), the same for every block (a bias of the offset j - i). ``key_mask`` bool numpy
    [B, T]: the keys that may be seen (False: padding). ``extra_keys``/``extra_values`` [B, H, G, D] with
    ``extra_bias`` [1 or B, H, T, G] (masks included). A query that sees no key (a padding row) gets a meaningless
    average."""
    batch, heads, length, dim = q.shape
    block = radius + 1
    blocks = -(-length // block)
    padded = blocks * block

    def padded_rows(x, before: int, after: int):
        parts = [x]
        if before:
            parts.insert(0, zeros((x.shape[0], x.shape[1], before, x.shape[3]), dtype=x.dtype, device=x.device))
        if after:
            parts.append(zeros((x.shape[0], x.shape[1], after, x.shape[3]), dtype=x.dtype, device=x.device))
        return cat(parts, 2) if len(parts) > 1 else x

    def three_blocks(x):  # [B, H, T, D] -> [B, H * nb, 3L, D]: each block's neighbours' keys and its own
        x = padded_rows(x, block, padded - length + block).reshape(batch, heads, blocks + 2, block, dim)
        x = cat([x[:, :, i:i + blocks] for i in range(3)], 3)
        return x.reshape(batch, heads * blocks, 3 * block, dim)

    queries = padded_rows(q, 0, padded - length).reshape(batch, heads * blocks, block, dim)
    keys, values = three_blocks(k), three_blocks(v)
    scores = (queries @ keys.transpose(-1, -2)) * scale                     # [B, H * nb, L, 3L]
    query = np.arange(blocks)[:, None, None] * block + np.arange(block)[None, :, None]
    key = (np.arange(blocks)[:, None, None] - 1) * block + np.arange(3 * block)[None, None, :]
    allowed = (np.abs(key - query) <= radius) & (key >= 0) & (key < length)  # [nb, L, 3L]
    allowed = np.broadcast_to(allowed, (1 if key_mask is None else batch,) + allowed.shape)
    if key_mask is not None:
        seen = np.concatenate([np.zeros((batch, block), bool), np.asarray(key_mask, bool),
                               np.zeros((batch, padded - length + block), bool)], axis=1)
        allowed = allowed & seen[:, np.clip(key + block, 0, None)]
    mask = tensor(np.where(allowed, 0.0, BAND_MASKED).astype(np.float32)[:, None])  # [B or 1, 1, nb, L, 3L]
    scores = scores.reshape(batch, heads, blocks, block, 3 * block) + mask.cast(scores.dtype)
    if band_bias is not None:
        scores = scores + band_bias.unsqueeze(2)
    if extra_keys is not None:
        count = extra_keys.shape[2]
        side = (queries.reshape(batch, heads, padded, dim) @ extra_keys.transpose(-1, -2)) * scale  # [B, H, Tp, G]
        if extra_bias is not None:
            bias = extra_bias.expand(batch, heads, length, count).contiguous()
            side = side + padded_rows(bias, 0, padded - length)
        scores = cat([scores, side.reshape(batch, heads, blocks, block, count)], 4)
        values = cat([values, extra_values.unsqueeze(2).expand(batch, heads, blocks, count, dim).contiguous()
                      .reshape(batch, heads * blocks, count, dim)], 2)
    probs = scores.softmax(-1).reshape(batch, heads * blocks, block, -1)
    out = (probs @ values).reshape(batch, heads, padded, dim)
    return out[:, :, :length] if padded != length else out


def normalize(x, p: float = 2.0, dim: int = -1, eps: float = 1e-12):
    """x / max(||x||_2, eps) along ``dim``, as torch.nn.functional.normalize (only p = 2)."""
    if p != 2.0:
        raise ValueError(f"normalize: only the Euclidean norm (p=2) is implemented, got p={p}")
    return x / (x * x).sum(dim, keepdim=True).sqrt().clamp(min=eps)


__all__ = ["FusedNorm", "acos", "activation", "avg_pool1d", "banded_attention", "cat", "causal_conv1d", "cross_entropy", "cumsum_rows", "depthwise_conv1d", "dropout", "dropout_rng_state", "embedding", "fusable",
           "fusable_weights", "fused_gated", "fused_head_norm_rope_write", "fused_linear", "fused_qkv_rope_write",
           "gated", "gather_flat", "gather_rows", "gelu", "grouped_matmul", "iterative_pinv", "layer_norm", "linear",
           "live_rows_where_used", "log_softmax", "lsh_expectation_attention", "manual_seed", "normalize", "quantized_embedding", "quantized_linear", "quick_gelu",
           "relu", "relu2", "rms_norm", "rope", "scaled_dot_product_attention", "set_dropout_rng_state", "sigmoid",
           "silu", "softmax", "softplus", "split", "stack", "take_along_last", "tanh", "where"]
