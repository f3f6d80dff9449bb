"""The causal LM's loss (transformers' ForCausalLMLoss), in chunks of tokens when the logits would be large.

The logits of a training step are [batch, T, vocab]: at Llama-3's vocabulary (128,256) and 8 x 2,048 tokens 4.2 GB
in bfloat16, and at 8 x 4,096 more than one buffer may hold. Above LOSS_CHUNK_BYTES the loss is the sum over chunks
of rows of the flattened hidden states of each chunk's summed cross-entropy (engine checkpoint_sum: a chunk's logits
are recomputed in its backward, chunk after chunk, and the head's weight gradients added up as they go), divided by
the count of labels not ignored: one chunk's logits exist at a time, forward and backward. The cost: the head's
product runs once more, and a trained head's weight gradient is summed in float32 beside one chunk's. A model's
``logits`` stay a lazy tensor then, not part of the step's graph: computed if read, or with an optimizer step that
comes while a tensor still holds them (lazy.computed_before_assignments).
"""
from __future__ import annotations

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.checkpoint import checkpoint_sum
from vkformers.engine.tensor import Tensor
from vkformers.models.inputs import IGNORE_INDEX

# The most bytes of one chunk's logits, counted in float32 (and never more than a device buffer may hold).
LOSS_CHUNK_BYTES = 256 * 2**20


def shift_labels(labels: np.ndarray) -> np.ndarray:
    """Labels [B, T] -> the label each position predicts: t + 1's, -100 at the last position."""
    shifted = np.full(labels.shape, IGNORE_INDEX, np.int32)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def target_count(labels, shift: bool = True) -> int:
    """How many labels the causal LM's loss averages over: those not -100, from position 1 on when it shifts."""
    labels = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
    return int(((labels[..., 1:] if shift else labels) != IGNORE_INDEX).sum())


def label_tensor(labels, shift: bool = True) -> Tensor:
    """int32 labels as a graph input, shifted where the loss shifts them; a captured step (lazy.StepCapture) shifts
    each new batch's labels anew."""
    labels = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels, dtype=np.int32)
    if shift:
        labels = lazy.derived_input(shift_labels(labels), labels, shift_labels)
    return Tensor(labels)


def loss_chunk_rows(vocab: int, device) -> int:
    """Rows (tokens) per chunk of the loss: their logits within LOSS_CHUNK_BYTES and one device buffer."""
    return max(1, min(LOSS_CHUNK_BYTES, device.max_buffer_bytes) // (vocab * 4))


def causal_lm_loss(hidden: Tensor, head, labels, *, shift: bool = True, logits: Tensor | None = None,
                   widen: bool = False) -> Tensor:
    """Mean cross-entropy (float32) of ``head(hidden)`` against ``labels`` (ignoring -100; token t predicts label
    t + 1, or label t without ``shift``). ``hidden`` [..., H]; ``head`` maps hidden states to logits (the LM head
    with its scale, softcap); ``logits``: ``head(hidden)`` where the caller built it already (the model's output),
    read when the loss is not chunked and otherwise left to be computed only if read; ``widen``: the loss reads the
    logits cast to float32. In chunks when the logits pass LOSS_CHUNK_BYTES (see the module's docstring)."""
    targets = label_tensor(labels, shift).reshape(-1)
    rows = targets.shape[0]
    logits = logits if logits is not None else head(hidden)
    vocab = logits.shape[-1]
    if rows <= loss_chunk_rows(vocab, hidden.device):
        return F.cross_entropy(logits.float() if widen else logits, targets, ignore_index=IGNORE_INDEX)
    lazy.computed_before_assignments(logits.lazy)  # not in the step's graph, but read as it was if held
    count = (targets != IGNORE_INDEX).float().sum()  # on the device: follows a replayed step's labels
    chunk = loss_chunk_rows(vocab, hidden.device)
    pieces = F.split(hidden.reshape(rows, hidden.shape[-1]), chunk)
    labelled = [(p, targets[start:start + p.shape[0]]) for start, p in zip(range(0, rows, chunk), pieces)]

    def block(h, part_labels):
        part = head(h)
        return F.cross_entropy(part.float() if widen else part, part_labels, ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return checkpoint_sum(block, labelled) / count
