"""Cross-entropy loss over logits [rows, vocab] with int32 labels (shaders/common/cross_entropy.comp).

Semantics of torch.nn.functional.cross_entropy(reduction="mean", ignore_index=-100), as HF
uses it: rows labelled ignore_index have loss 0 and gradient 0; the mean divides the sum by
the count of the other rows, so with no such row it is 0/0 = NaN (like torch). A label that
is neither ignore_index nor in [0, vocab) gives NaN (loss and gradient) where torch raises.

Outputs of the forward, all float32: loss_rows [rows], lse [rows] (log-sum-exp, kept for
the backward instead of any vocab-sized buffer), loss_mean [1] and count [1] (rows not
ignored, a float). The backward recomputes softmax from logits and lse, reads d_loss [1]
and count [1] from the GPU, and writes d_logits (dtype of logits), which may be the logits
operand itself (in place: a variant binding the buffer once).
"""
from __future__ import annotations

from vkformers.engine.kernels.transformer_args import (
    checked, element_groups, element_variant, fits_uint32, operand, overlaps, positive, row_groups)

ACTIVATIONS = ("float32", "float16", "bfloat16")


def cross_entropy(seq, logits, labels, loss_rows, lse, loss_mean, count, *, rows: int, vocab: int,
                  ignore_index: int = -100):
    """Per-row loss and lse, then their mean over non-ignored rows (loss_mean) and that row count."""
    positive(rows=rows, vocab=vocab)
    fits_uint32("cross_entropy", rows * vocab)
    logits = checked(logits, ACTIVATIONS, rows * vocab, "cross_entropy logits")
    labels = checked(labels, "int32", rows, "cross_entropy labels")
    loss_rows = checked(loss_rows, "float32", rows, "cross_entropy loss_rows")
    lse = checked(lse, "float32", rows, "cross_entropy lse")
    loss_mean = checked(loss_mean, "float32", 1, "cross_entropy loss_mean")
    count = checked(count, "float32", 1, "cross_entropy count")
    seq.dispatch(seq.device.kernel("cross_entropy", element_variant(logits, "cross_entropy logits")),
                 [logits.buffer, labels.buffer, loss_rows.buffer, lse.buffer], row_groups(seq, rows),
                 push=[rows, vocab, int(ignore_index), logits.offset, labels.offset, loss_rows.offset, lse.offset])
    seq.dispatch(seq.device.kernel("cross_entropy", "mean"),
                 [loss_rows.buffer, labels.buffer, loss_mean.buffer, count.buffer], (1, 1, 1),
                 push=[rows, int(ignore_index), loss_rows.offset, labels.offset, loss_mean.offset, count.offset])


def cross_entropy_backward(seq, logits, labels, lse, d_loss, count, d_logits, *, rows: int, vocab: int,
                           ignore_index: int = -100):
    """d_logits = (softmax(logits) - onehot(label)) * d_loss / count; 0 on ignored rows."""
    positive(rows=rows, vocab=vocab)
    fits_uint32("cross_entropy_backward", rows * vocab)
    logits = checked(logits, ACTIVATIONS, rows * vocab, "cross_entropy_backward logits")
    d_logits = checked(d_logits, logits.dtype.name, rows * vocab, "cross_entropy_backward d_logits")
    labels = checked(labels, "int32", rows, "cross_entropy_backward labels")
    lse = checked(lse, "float32", rows, "cross_entropy_backward lse")
    d_loss = checked(d_loss, "float32", 1, "cross_entropy_backward d_loss")
    count = checked(count, "float32", 1, "cross_entropy_backward count")
    in_place = operand(logits) == operand(d_logits)
    if not in_place and overlaps(logits, rows * vocab, d_logits, rows * vocab):
        raise ValueError("cross_entropy_backward: d_logits partially overlaps logits")
    variant = ("backward_inplace_" if in_place else "backward_") + element_variant(logits, "cross_entropy logits")
    buffers = [logits.buffer, labels.buffer, lse.buffer, d_loss.buffer, count.buffer]
    seq.dispatch(seq.device.kernel("cross_entropy", variant), buffers + ([] if in_place else [d_logits.buffer]),
                 element_groups(seq, rows * vocab),
                 push=[rows, vocab, int(ignore_index), logits.offset, labels.offset, lse.offset, d_loss.offset,
                       count.offset, d_logits.offset])
