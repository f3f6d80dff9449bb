"""The ops models are written with, named as in ``torch.nn.functional``."""
from __future__ import annotations

import math

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
from vkformers.engine.ops.pool import avg_pool1d
from vkformers.engine.ops.matmul import LinearFn
from vkformers.engine.ops.matmul import grouped_matmul as _grouped_matmul
from vkformers.engine.ops.matmul import matmul as _batched_matmul
from vkformers.engine.ops.quant import quantized_embedding, quantized_linear
from vkformers.engine.ops.trig import acos
from vkformers.engine.quantized import QuantizedTensor
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


def linear(x, weight, bias=None, live_rows=None):
    """x @ weight.T (+ bias), with weight [out_features, in_features] as in torch and HF checkpoints.

    Leading dimensions of x are folded into the rows of one product, so that the weight's gradient is
    one [in, out] product over all tokens, not one per batch row summed afterwards. ``live_rows`` (float32,
    one count, no gradient): the rows of x at or past it are padding, whose results are not used; the
    kernels may skip them (a mixture-of-experts expert run on the rows of the tokens that chose it; see
    engine.ops.matmul)."""
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


def normalize(x, p: float = 2.0, dim: int = -1, eps: float = 1e-12):
    """x / max(||x||_2, eps) along ``dim``, as torch.nn.functional.normalize (only p = 2)."""
    if p != 2.0:
        raise ValueError(f"normalize: only the Euclidean norm (p=2) is implemented, got p={p}")
    return x / (x * x).sum(dim, keepdim=True).sqrt().clamp(min=eps)


__all__ = ["FusedNorm", "acos", "activation", "avg_pool1d", "cat", "causal_conv1d", "cross_entropy", "depthwise_conv1d", "dropout", "dropout_rng_state", "embedding", "fusable",
           "fusable_weights", "fused_gated", "fused_head_norm_rope_write", "fused_linear", "fused_qkv_rope_write",
           "gated", "gather_flat", "gather_rows", "gelu", "grouped_matmul", "iterative_pinv", "layer_norm", "linear",
           "live_rows_where_used", "log_softmax", "lsh_expectation_attention", "manual_seed", "normalize", "quantized_embedding", "quantized_linear", "quick_gelu",
           "relu", "relu2", "rms_norm", "rope", "scaled_dot_product_attention", "set_dropout_rng_state", "sigmoid",
           "silu", "softmax", "softplus", "stack", "take_along_last", "tanh", "where"]
