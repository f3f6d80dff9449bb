"""RMSNorm and LayerNorm over the last axis of x [rows, cols] (shaders/common/norm.comp).

Math is float32 whatever the storage type (float32, float16, bfloat16). x, weight, bias,
out, d_out and dx share one dtype; the statistics (mean, rstd: float32 [rows]) and the
parameter gradients (dweight, dbias: float32 [cols]) are float32.

Rounding order for float16/bfloat16, as Hugging Face:
- RMSNorm without unit offset (LlamaRMSNorm): normalize in fp32, round to the input dtype,
  then multiply by the weight and round again (``round_before_weight=True``).
- RMSNorm with unit offset (GemmaRMSNorm): y = x_hat * (1 + w) in fp32, rounded once.
- LayerNorm (torch.nn.LayerNorm): everything in fp32, rounded once.
The backward treats those intermediate roundings as identity (float32 throughout),
except that dweight sums dy * (rounded x_hat) where the forward rounded before the weight.

Parameter gradients are reduced in two deterministic passes: partial column sums over
chunks of rows into a float32 workspace, then a sum over chunks. ``accumulate=True``
adds into dweight/dbias instead of overwriting them.
"""
from __future__ import annotations

from vkformers.engine.kernels.transformer_args import (
    LOCAL_SIZE, checked, element_groups, element_variant, fits_uint32, positive, row_groups)

ACTIVATIONS = ("float32", "float16", "bfloat16")
MAX_CHUNKS = 256  # rows are split in at most this many chunks for the dweight/dbias partial sums
MIN_ROWS_PER_CHUNK = 16


def _spec(layer_norm, has_weight, has_bias, unit_offset, round_before_weight, accumulate=False):
    return [int(layer_norm), int(has_weight), int(has_bias), int(unit_offset), int(round_before_weight),
            int(accumulate)]


def _check_sizes(rows, cols, eps=None):
    positive(rows=rows, cols=cols)
    fits_uint32("norm", rows * cols)
    if eps is not None and not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


def _forward(seq, x, weight, bias, out, mean, rstd, *, rows, cols, eps, layer_norm, unit_offset,
             round_before_weight):
    _check_sizes(rows, cols, eps)
    what = "layer_norm" if layer_norm else "rms_norm"
    x = checked(x, ACTIVATIONS, rows * cols, f"{what} x")
    out = checked(out, x.dtype.name, rows * cols, f"{what} out")
    weight = None if weight is None else checked(weight, x.dtype.name, cols, f"{what} weight")
    bias = None if bias is None else checked(bias, x.dtype.name, cols, f"{what} bias")
    rstd = checked(rstd, "float32", rows, f"{what} rstd")
    mean = checked(mean, "float32", rows, f"{what} mean") if layer_norm else rstd
    if unit_offset and weight is None:
        raise ValueError(f"{what}: unit_offset needs a weight")
    kernel = seq.device.kernel("norm", element_variant(x, what))
    # Absent operands are bound to a present buffer; the spec constants keep the kernel off them.
    buffers = [x.buffer, (weight or x).buffer, (bias or x).buffer, out.buffer, mean.buffer, rstd.buffer]
    seq.dispatch(kernel, buffers, row_groups(seq, rows),
                 push=[rows, cols, float(eps), x.offset, (weight or x).offset, (bias or x).offset, out.offset,
                       mean.offset, rstd.offset],
                 spec=_spec(layer_norm, weight is not None, bias is not None, unit_offset, round_before_weight))


def _backward(seq, d_out, x, weight, mean, rstd, dx, dweight, dbias, *, rows, cols, layer_norm, unit_offset,
              round_before_weight, accumulate, workspace):
    _check_sizes(rows, cols)
    what = "layer_norm_backward" if layer_norm else "rms_norm_backward"
    x = checked(x, ACTIVATIONS, rows * cols, f"{what} x")
    d_out = checked(d_out, x.dtype.name, rows * cols, f"{what} d_out")
    weight = None if weight is None else checked(weight, x.dtype.name, cols, f"{what} weight")
    rstd = checked(rstd, "float32", rows, f"{what} rstd")
    mean = checked(mean, "float32", rows, f"{what} mean") if layer_norm else rstd
    dx = None if dx is None else checked(dx, x.dtype.name, rows * cols, f"{what} dx")
    dweight = None if dweight is None else checked(dweight, "float32", cols, f"{what} dweight")
    dbias = None if dbias is None else checked(dbias, "float32", cols, f"{what} dbias")
    if unit_offset and weight is None:
        raise ValueError(f"{what}: unit_offset needs a weight")
    if dweight is not None and weight is None:
        raise ValueError(f"{what}: dweight given for a norm without weight")
    variant = element_variant(x, what)
    spec = _spec(layer_norm, weight is not None, False, unit_offset, round_before_weight)

    if dx is not None:
        kernel = seq.device.kernel("norm", "backward_dx_" + variant)
        seq.dispatch(kernel, [x.buffer, (weight or x).buffer, d_out.buffer, mean.buffer, rstd.buffer, dx.buffer],
                     row_groups(seq, rows),
                     push=[rows, cols, x.offset, (weight or x).offset, d_out.offset, mean.offset, rstd.offset,
                           dx.offset],
                     spec=spec)

    if dweight is None and dbias is None:
        return
    chunks, rows_per_chunk = _chunking(rows)
    if workspace is None:
        workspace = seq.scratch(2 * chunks * cols, "float32", name=f"{what} workspace")
    workspace = checked(workspace, "float32", 2 * chunks * cols, f"{what} workspace")
    if workspace.offset != 0:
        raise ValueError(f"{what}: the workspace must start at offset 0")
    param_spec = _spec(layer_norm, dweight is not None, dbias is not None, unit_offset, round_before_weight,
                       accumulate)
    kernel = seq.device.kernel("norm", "backward_param_" + variant)
    seq.dispatch(kernel, [x.buffer, d_out.buffer, mean.buffer, rstd.buffer, workspace.buffer],
                 (-(-cols // LOCAL_SIZE), chunks, 1),
                 push=[rows, cols, rows_per_chunk, x.offset, d_out.offset, mean.offset, rstd.offset],
                 spec=param_spec)
    present = dweight or dbias
    seq.dispatch(seq.device.kernel("norm", "reduce_param"), [workspace.buffer, present.buffer,
                                                             (dbias or present).buffer],
                 element_groups(seq, cols),
                 push=[cols, chunks, present.offset, (dbias or present).offset], spec=param_spec)


def _chunking(rows: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of the dweight/dbias partial sums."""
    rows_per_chunk = -(-rows // min(MAX_CHUNKS, -(-rows // MIN_ROWS_PER_CHUNK)))
    return -(-rows // rows_per_chunk), rows_per_chunk


def norm_workspace_elements(rows: int, cols: int) -> int:
    """Float32 elements of the workspace the backward needs for dweight/dbias (pass one to reuse it)."""
    return 2 * _chunking(rows)[0] * cols


def rms_norm(seq, x, weight, out, rstd, *, rows: int, cols: int, eps: float, unit_offset: bool = False,
             round_before_weight: bool | None = None):
    """out = x / sqrt(mean(x^2) + eps) * w (w: weight, 1 + weight with unit_offset, or 1 when weight is None).

    rstd (float32 [rows]) receives 1 / sqrt(mean(x^2) + eps) for the backward.
    round_before_weight: None picks HF's order (True for Llama style, False with unit_offset).
    """
    if round_before_weight is None:
        round_before_weight = not unit_offset
    _forward(seq, x, weight, None, out, None, rstd, rows=rows, cols=cols, eps=eps, layer_norm=False,
             unit_offset=unit_offset, round_before_weight=round_before_weight)


def rms_norm_backward(seq, d_out, x, weight, rstd, dx, dweight, *, rows: int, cols: int, unit_offset: bool = False,
                      round_before_weight: bool | None = None, accumulate: bool = False, workspace=None):
    """dx (dtype of x; None to skip) and dweight (float32 [cols]; None to skip) of rms_norm."""
    if round_before_weight is None:
        round_before_weight = not unit_offset
    _backward(seq, d_out, x, weight, None, rstd, dx, dweight, None, rows=rows, cols=cols, layer_norm=False,
              unit_offset=unit_offset, round_before_weight=round_before_weight, accumulate=accumulate,
              workspace=workspace)


def layer_norm(seq, x, weight, bias, out, mean, rstd, *, rows: int, cols: int, eps: float):
    """out = (x - mean) / sqrt(var + eps) * weight + bias (biased var; weight/bias may be None).

    mean and rstd (float32 [rows]) are kept for the backward.
    """
    _forward(seq, x, weight, bias, out, mean, rstd, rows=rows, cols=cols, eps=eps, layer_norm=True,
             unit_offset=False, round_before_weight=False)


def layer_norm_backward(seq, d_out, x, weight, mean, rstd, dx, dweight, dbias, *, rows: int, cols: int,
                        accumulate: bool = False, workspace=None):
    """dx (dtype of x), dweight and dbias (float32 [cols]) of layer_norm; any of the three may be None."""
    _backward(seq, d_out, x, weight, mean, rstd, dx, dweight, dbias, rows=rows, cols=cols, layer_norm=True,
              unit_offset=False, round_before_weight=False, accumulate=accumulate, workspace=workspace)
