"""Beam search on the host, as transformers' ``GenerationMixin._beam_search`` runs it (``num_beams`` > 1).

Each prompt keeps ``num_beams`` running sequences (rows ``n * num_beams + b`` of the model's batch). Every step
adds each row's log-softmax of its logits (after the logits processors) to its running score, and keeps, per
prompt, the best ``max(2, 1 + eos tokens) * num_beams`` continuations over all its beams. Of those, the ones
ending in an end-of-sequence token (or reaching ``max_length``) among the first ``num_beams`` become finished
hypotheses, scored by their sum of log-probabilities over ``generated length ** length_penalty``; the best
``num_beams`` others run on, and the cache's rows follow them (``KVCache.reorder_rows``). A prompt stops as
transformers' ``early_stopping`` says: True, once it has ``num_beams`` finished hypotheses; False (default), once
no running beam's score at its current length could beat the worst of them; "never", the same at the longest
length when the length penalty rewards length. The result is each prompt's best ``num_return_sequences``
hypotheses, the longest setting the width, shorter ones filled as transformers fills them. Scores are float32 and
the -1e9 placeholders are transformers' own, so that ties and roundings come out the same.
"""
from __future__ import annotations

import numpy as np

from vkformers.errors import InputError

PLACEHOLDER = np.float32(-1.0e9)


def log_softmax(scores: np.ndarray) -> np.ndarray:
    """float32 log-softmax over the last axis."""
    scores = scores.astype(np.float32)
    top = scores.max(axis=-1, keepdims=True)
    shifted = scores - top
    return (shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))).astype(np.float32)


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest of each row, largest first (the lower index first among equal values): a
    partition, then a sort of those k alone (a row of num_beams x vocabulary entries is long)."""
    if k < values.shape[-1]:
        part = np.argpartition(-values, k - 1, axis=-1)[:, :k]
    else:
        part = np.broadcast_to(np.arange(values.shape[-1]), values.shape)
    order = np.lexsort((part, -np.take_along_axis(values, part, axis=-1)), axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def check_beam_settings(num_beams, num_return_sequences: int, length_penalty, early_stopping, do_sample) -> None:
    if isinstance(num_beams, bool) or not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
        raise InputError(f"generate: num_beams must be a whole number >= 1, got {num_beams!r}")
    if num_return_sequences > num_beams:
        raise InputError(f"generate: num_return_sequences={num_return_sequences} is more than num_beams={num_beams} "
                         "(beam search returns the best of its beams)")
    if do_sample:
        raise InputError("generate: beam search with do_sample=True (beam sampling) is not supported; use "
                         "num_beams=1 to sample, or do_sample=False for beam search")
    if not isinstance(length_penalty, (int, float)) or not np.isfinite(length_penalty):
        raise InputError(f"generate: length_penalty must be a finite number, got {length_penalty!r}")
    if early_stopping not in (True, False, "never"):
        raise InputError(f"generate: early_stopping must be True, False or 'never', got {early_stopping!r}")


def search_beams(search: "BeamSearch", logits: np.ndarray, process, advance) -> np.ndarray:
    """Run ``search`` to its end and return its result. ``logits`` [rows, vocab]: the first step's;
    ``process(log_probs, tokens)``: transformers' logits processors on a step's log-softmax after the rows'
    ``tokens``; ``advance(rows, tokens)``: move the model's cache rows as ``rows`` says (BeamSearch.step) and
    return the logits of the step after ``tokens``."""
    while True:
        rows = search.step(process(log_softmax(logits), search.sequences))
        if search.done:
            return search.result()
        logits = advance(rows, search.sequences)


class BeamSearch:
    """The search state of ``prompts`` [N, P] (int64; an encoder-decoder's decoder start tokens) with ``num_beams``
    beams each, up to ``max_length`` tokens in all (prompt included). Feed :meth:`step` each step's processed
    log-probabilities of :attr:`sequences`' rows; it returns the rows the next step's rows continue."""

    def __init__(self, prompts: np.ndarray, num_beams: int, max_length: int, eos: list[int], pad: int | None,
                 length_penalty: float = 1.0, early_stopping=False, num_return_sequences: int = 1):
        self.batch, self.prompt_length = prompts.shape
        self.num_beams, self.max_length = int(num_beams), int(max_length)
        self.eos = np.asarray(eos, np.int64)
        self.length_penalty, self.early_stopping = float(length_penalty), early_stopping
        self.num_return_sequences = int(num_return_sequences)
        self.keep = max(2, 1 + len(eos)) * self.num_beams
        # transformers' fill of unwritten positions: `pad or eos[0] if eos else -1` (a pad id of 0 counts as unset)
        self.fill = -1 if not len(eos) else (int(pad) if pad else int(eos[0]))
        n, b = self.batch, self.num_beams
        self.running = np.full((n, b, self.max_length), self.fill, np.int64)
        self.running[:, :, :self.prompt_length] = prompts[:, None, :]
        self.running_scores = np.zeros((n, b), np.float32)
        self.running_scores[:, 1:] = PLACEHOLDER
        self.finished = self.running.copy()
        self.finished_scores = np.full((n, b), PLACEHOLDER, np.float32)
        self.finished_lengths = np.zeros((n, b), np.int64)
        self.is_finished = np.zeros((n, b), bool)
        self.improvable = np.ones((n, 1), bool)
        self.length = self.prompt_length
        self.done = False

    @property
    def sequences(self) -> np.ndarray:
        """The running beams' tokens so far, [N * num_beams, length]."""
        return self.running[:, :, :self.length].reshape(self.batch * self.num_beams, self.length)

    def step(self, log_probs: np.ndarray) -> np.ndarray:
        """Advance by one token from ``log_probs`` [N * num_beams, vocab] (the processed log-softmax of each
        row's logits); returns, per row of the next step, the row of this step it continues."""
        n, b, length = self.batch, self.num_beams, self.length
        vocab = log_probs.shape[-1]
        total = (log_probs.reshape(n, b, vocab).astype(np.float32) + self.running_scores[:, :, None])
        total = total.reshape(n, b * vocab)
        picked = _top(total, self.keep)
        top_scores = np.take_along_axis(total, picked, axis=1)
        parents, tokens = picked // vocab, picked % vocab
        candidates = np.take_along_axis(self.running, parents[:, :, None], axis=1)
        candidates[:, :, length] = tokens
        ends = np.isin(tokens, self.eos) | (length + 1 >= self.max_length)

        # the best candidates that do not end run on
        running_scores = (top_scores + ends.astype(np.float32) * PLACEHOLDER).astype(np.float32)
        chosen = _top(running_scores, b)
        self.running = np.take_along_axis(candidates, chosen[:, :, None], axis=1)
        self.running_scores = np.take_along_axis(running_scores, chosen, axis=1)
        rows = np.take_along_axis(parents, chosen, axis=1) + np.arange(n)[:, None] * b

        # candidates that end among the first num_beams join the finished hypotheses, where they score better
        newly = ends & (np.arange(self.keep) < b)[None, :]
        scores = (top_scores / np.float32((length + 1 - self.prompt_length) ** self.length_penalty)).astype(np.float32)
        if self.early_stopping is True:
            scores = scores + (self.is_finished.all(axis=1, keepdims=True)).astype(np.float32) * PLACEHOLDER
        scores = scores + (~self.improvable).astype(np.float32) * PLACEHOLDER
        scores = (scores + (~newly).astype(np.float32) * PLACEHOLDER).astype(np.float32)
        merged_scores = np.concatenate([self.finished_scores, scores], axis=1)
        best = _top(merged_scores, b)
        self.finished = np.take_along_axis(np.concatenate([self.finished, candidates], axis=1), best[:, :, None],
                                           axis=1)
        self.finished_scores = np.take_along_axis(merged_scores, best, axis=1)
        lengths = np.concatenate([self.finished_lengths, np.full((n, self.keep), length + 1, np.int64)], axis=1)
        self.finished_lengths = np.take_along_axis(lengths, best, axis=1)
        self.is_finished = np.take_along_axis(np.concatenate([self.is_finished, newly], axis=1), best, axis=1)

        self.length = length + 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            hypothetical = self.max_length - self.prompt_length
        else:
            hypothetical = self.length - self.prompt_length
        best_possible = self.running_scores[:, :1] / np.float32(hypothetical ** self.length_penalty)
        worst = np.where(self.is_finished, self.finished_scores.min(axis=1, keepdims=True), PLACEHOLDER)
        self.improvable &= (best_possible > worst).any(axis=-1, keepdims=True)
        open_beam = not (self.is_finished.all() and self.early_stopping is True)
        self.done = not (self.improvable.any() and open_beam and not ends.all())
        return rows.reshape(-1)

    def result(self) -> np.ndarray:
        """Each prompt's best ``num_return_sequences`` hypotheses, [N * num_return_sequences, width], as
        transformers returns them."""
        kept = self.num_return_sequences
        sequences = self.finished[:, :kept].reshape(self.batch * kept, self.max_length)
        lengths = self.finished_lengths[:, :kept].reshape(-1)
        width = int(lengths.max()) if lengths.size else self.prompt_length
        return sequences[:, :max(width, self.prompt_length)]
