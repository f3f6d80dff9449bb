"""CPM-Ant's attention on the shared decoder layer, and the host side of its inputs (transformers 5
CpmAntModel / CpmAntAttention / CpmAntSegmentPositionEmbedding).

- ``prompt_length`` learned prompt tokens (ids vocab + 2P .. vocab + 3P, segment 0) come before the text, whose
  tokens are segment 2 (id 0: segment 0). The outputs of the prompt positions are dropped before the head.
- The attention is not causal: every valid query sees every valid key. Valid are the prompt and the last
  ``count(ids != 0)`` text columns (so left padding with id 0 drops out). A query that sees nothing gives zeros.
- Each head adds a learned bias, read from one table by bucket: keys of the query's segment by the bucket of
  key - query (T5's bidirectional log buckets), others by num_buckets + segment(q) * segment_types + segment(k).
- With a cache (generate), the prompt's keys and values stay on the cache object beside the text's, and each
  step's query attends to all of them, as transformers' cached step does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.models.decoder import DecoderLayer

HIDDEN = -1e30  # added to the scores of the keys a query does not see


@dataclass(frozen=True)
class CpmAntInputs:
    """The sizes of CPM-Ant's prompt, segments and position buckets."""

    prompt_length: int
    segment_types: int
    num_buckets: int
    max_distance: int

    def __call__(self, spec, index: int, alibi=None) -> "CpmAntLayer":  # DecoderSpec.make_layer
        return CpmAntLayer(spec, index, alibi)

    def position_buckets(self, relative: np.ndarray) -> np.ndarray:
        """CpmAntSegmentPositionEmbedding._position_bucket of key - query, float32 logarithms as torch's."""
        half = self.num_buckets // 2
        exact = half // 2
        distance = np.abs(relative)
        scaled = (np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(exact))
                  / np.float32(math.log(self.max_distance / exact)) * np.float32(half - exact))
        large = np.minimum(exact + scaled.astype(np.int32), half - 1)
        return ((relative > 0) * half + np.where(distance < exact, distance, large)).astype(np.int32)

    def layout(self, history: np.ndarray, new: int, with_prompt: bool):
        """For the text ids so far ``history`` [B, T] whose last ``new`` are this call's (after the prompt when
        ``with_prompt``): (segments of this call's columns [B, C], bucket ids [B, C, P + T], additive mask
        [B, 1, C, P + T], query validity [B, 1, C, 1])."""
        batch, length = history.shape
        p = self.prompt_length
        text_segments = np.where(history != 0, 2, 0).astype(np.int32)
        counted = (text_segments != 0).sum(-1)
        valid = np.concatenate([np.ones((batch, p), bool),
                                np.arange(length)[::-1][None, :] < counted[:, None]], axis=1)
        segments = np.concatenate([np.zeros((batch, p), np.int32), text_segments], axis=1)
        total = p + length
        columns = np.arange(total - new - (p if with_prompt else 0), total)
        q_segments = segments[:, columns]
        relative = np.arange(total)[None, :] - columns[:, None]
        buckets = np.where(q_segments[:, :, None] == segments[:, None, :], self.position_buckets(relative)[None],
                           self.num_buckets + q_segments[:, :, None] * self.segment_types + segments[:, None, :])
        seen = valid[:, columns][:, :, None] & valid[:, None, :]
        mask = np.where(seen, 0.0, HIDDEN).astype(np.float32)[:, None]
        return (q_segments, buckets.astype(np.int32), mask,
                valid[:, columns].astype(np.float32)[:, None, :, None])


class CpmAntLayer(DecoderLayer):
    """The shared layer whose attention adds CPM-Ant's bias and mask (``ctx.attention_bias``, built once per
    forward by the model) to the scores, over the prompt's keys and the text's."""

    capture_decode = False  # each step's bias and mask are built on the host

    def attend_heads(self, q, k, v, ctx, **options):
        prompt = ctx.prompt_columns
        if ctx.cache is not None:
            aside = ctx.cache.__dict__.setdefault("prompt_kv", {})
            if prompt:
                aside[self.index] = (k[:, :, :prompt].contiguous(), v[:, :, :prompt].contiguous())
            new = q.shape[2] - prompt
            ctx.cache.attend(self.index, q[:, :, prompt:].contiguous(), k[:, :, prompt:].contiguous(),
                             v[:, :, prompt:].contiguous(), scale=options["scale"])  # stores; its causal output unused
            end = ctx.cache.position + new
            kept_k, kept_v = aside[self.index]
            k = F.cat([kept_k, ctx.cache.keys[self.index][:, :, :end].cast(q.dtype)], 2)
            v = F.cat([kept_v, ctx.cache.values[self.index][:, :, :end].cast(q.dtype)], 2)
        scores = (q @ k.transpose(-1, -2)).float() * options["scale"] + ctx.attention_bias
        return (scores.softmax(-1) * ctx.query_valid).cast(v.dtype) @ v
