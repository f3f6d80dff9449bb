"""Causal depthwise conv1d over time, channels last (shaders/common/causal_conv1d.comp).

x [batch, length, channels], weight [channels, kernel], optional bias [channels] and history
[batch, kernel - 1, channels] (the inputs before x, from a recurrent cache; zeros when absent), all of one
dtype (float32, float16, bfloat16); math in float32. The backward gives dx and float32 weight-gradient partials
[batch * dw_blocks(length, kernel), channels, kernel] (one per batch row and block of steps: the caller sums them).
"""
from __future__ import annotations

from vkformers.engine.kernels import LOOP_ITERATIONS
from vkformers.engine.kernels.transformer_args import checked, element_groups, element_variant, fits_uint32, positive

ACTIVATIONS = ("float32", "float16", "bfloat16")


# Steps one weight-gradient invocation sums at most: an invocation per (batch row, channel) alone leaves a GPU
# nearly idle (24 workgroups for Mamba-2 1.3B's 6144 conv channels at batch 1), each walking the whole sequence.
DW_SPAN = 128


def _dw_span(kernel: int) -> int:
    """Steps one weight-gradient invocation sums: DW_SPAN, or fewer where its loop over the kernel's taps, each over
    the steps, would pass LOOP_ITERATIONS (a loop of n trips costs n + 1)."""
    return max(1, min(DW_SPAN, (LOOP_ITERATIONS - 1) // kernel - 2))


def dw_blocks(length: int, kernel: int) -> int:
    """Blocks of steps per batch row in the weight-gradient partials."""
    return -(-length // _dw_span(kernel))


def _sizes(batch, length, channels, kernel):
    positive(batch=batch, length=length, channels=channels, kernel=kernel)
    fits_uint32("causal_conv1d", batch * (length + kernel) * channels)


def causal_conv1d(seq, x, weight, bias, history, out, *, batch, length, channels, kernel):
    _sizes(batch, length, channels, kernel)
    x = checked(x, ACTIVATIONS, batch * length * channels, "causal_conv1d x")
    dtype = x.dtype.name
    weight = checked(weight, dtype, channels * kernel, "causal_conv1d weight")
    out = checked(out, dtype, batch * length * channels, "causal_conv1d out")
    bias = None if bias is None else checked(bias, dtype, channels, "causal_conv1d bias")
    history = None if history is None or kernel == 1 else checked(
        history, dtype, batch * (kernel - 1) * channels, "causal_conv1d history")
    # absent operands are bound to x; the spec constants keep the kernel off them
    buffers = [x.buffer, (history or x).buffer, weight.buffer, (bias or x).buffer, out.buffer]
    seq.dispatch(seq.device.kernel("causal_conv1d", element_variant(x, "causal_conv1d")), buffers,
                 element_groups(seq, batch * length * channels),
                 push=[batch, length, channels, kernel, x.offset, (history or x).offset, weight.offset,
                       (bias or x).offset, out.offset],
                 spec=[int(history is not None), int(bias is not None)])


def causal_conv1d_backward(seq, d_out, x, weight, history, dx, dw_partial, *, batch, length, channels, kernel):
    """dx (when given) and dw_partial (float32 [batch * dw_blocks(length, kernel), channels, kernel], when given)
    from d_out."""
    _sizes(batch, length, channels, kernel)
    x = checked(x, ACTIVATIONS, batch * length * channels, "causal_conv1d_backward x")
    dtype = x.dtype.name
    d_out = checked(d_out, dtype, batch * length * channels, "causal_conv1d_backward d_out")
    weight = checked(weight, dtype, channels * kernel, "causal_conv1d_backward weight")
    history = None if history is None or kernel == 1 else checked(
        history, dtype, batch * (kernel - 1) * channels, "causal_conv1d_backward history")
    variant = element_variant(x, "causal_conv1d_backward")
    if dx is not None:
        dx = checked(dx, dtype, batch * length * channels, "causal_conv1d_backward dx")
        seq.dispatch(seq.device.kernel("causal_conv1d", "backward_dx_" + variant),
                     [d_out.buffer, weight.buffer, dx.buffer], element_groups(seq, batch * length * channels),
                     push=[batch, length, channels, kernel, d_out.offset, 0, weight.offset, 0, dx.offset],
                     spec=[0, 0])
    if dw_partial is not None:
        rows = batch * dw_blocks(length, kernel)
        dw_partial = checked(dw_partial, "float32", rows * channels * kernel, "causal_conv1d_backward dw")
        seq.dispatch(seq.device.kernel("causal_conv1d", "backward_dw_" + variant),
                     [x.buffer, (history or x).buffer, d_out.buffer, dw_partial.buffer],
                     element_groups(seq, rows * channels),
                     push=[batch, length, channels, kernel, x.offset, (history or x).offset, d_out.offset,
                           _dw_span(kernel), dw_partial.offset],
                     spec=[int(history is not None), 0])
