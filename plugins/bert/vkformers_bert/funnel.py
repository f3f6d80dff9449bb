"""Funnel Transformer with its masked-LM head (transformers' FunnelForMaskedLM), configured by a :class:`FunnelSpec`.

Blocks of post-LN layers over a sequence halved before every block but the first (the queries of a block's first
layer are means of position pairs, the keys and values the full sequence; the [CLS] position is kept apart), then a
decoder that repeats the last block's positions back to full length, adds the first block's output and runs more
layers. Attention scores are content (q + r_w_bias) k^T plus relative positions (q + r_r_bias) through a sinusoid
table of distances (Transformer-XL's relative shift) plus token-type terms (q + r_s_bias) . seg_embed, the last two
zeroed on the [CLS] row and column, with padded keys at -1e6.

The sequence bookkeeping (which positions survive a pooling, their distances, the pooled masks) is fixed by the
length and the inputs, so it is computed on the host; the differentiable work runs on the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.tensor import Tensor
from vkformers.errors import InputError
from vkformers.models.heads import BaseModelOutput, SequenceHead, TaskHeads
from vkformers.models.inputs import InputLimits
from vkformers.models.layers import Embedding, LayerNorm, Linear
from vkformers.models.module import Module, place
from vkformers.runtime import dtypes as dt

from vkformers_bert.encoder import IGNORE_INDEX, MaskedLMOutput, _as_int_array
from vkformers_bert.variants import FunnelSpec, encoder_spec

MASKED_SCORE = 1e6       # transformers' INF: padded keys get score - 1e6, not -inf
CLS_TOKEN_TYPE = 2       # token type that counts as the same segment as every other


# ---------------------------------------------------------------- host-side sequence bookkeeping

def stride_pool(array: np.ndarray, axis: int, spec: FunnelSpec) -> np.ndarray:
    """Keep the positions a pooling keeps along ``axis``: [CLS] then every other one (transformers' stride_pool)."""
    array = np.moveaxis(array, axis, 0)
    if spec.separate_cls:
        array = np.concatenate([array[:1], array], 0)
    array = array[:-1:2] if spec.separate_cls and spec.truncate_seq else array[::2]
    return np.moveaxis(array, 0, axis)


def pool_positions(length: int, spec: FunnelSpec, source=None):
    """The pooled sequence's rows as windows of the full one: [CLS] apart, the rest (last dropped when truncating)
    in pairs. ``source`` [B, T]: returns its min over each window (the attention mask's pooling)."""
    rows = np.arange(length)
    if spec.separate_cls:
        rows = np.concatenate([rows[:1], rows[:-1] if spec.truncate_seq else rows])
    windows = [rows[s:s + 2] for s in range(0, len(rows), 2)]
    return windows if source is None else np.stack([source[:, w].min(1) for w in windows], 1)


def pooled_length(length: int, spec: FunnelSpec) -> int:
    return len(pool_positions(length, spec))


def sinusoid_table(length: int, d_model: int) -> np.ndarray:
    """[sin | cos] of the distances -2 T .. 2 T - 1 at Transformer-XL's frequencies, float32 as torch computes it."""
    half = d_model // 2
    inv_freq = (np.float32(1) / (np.float32(10000) ** (np.arange(half, dtype=np.float32) / np.float32(half))))
    rel = np.arange(-2 * length, 2 * length, dtype=np.float32)
    sinusoid = (rel[:, None] * inv_freq[None]).astype(np.float32)
    return np.concatenate([np.sin(sinusoid), np.cos(sinusoid)], -1).astype(np.float32)


def relative_distances(pos: list, stride: int, pooled: list | None = None, shift: int = 1) -> np.ndarray:
    """The distances whose embeddings a block's attention reads (transformers' relative_pos)."""
    pooled = pos if pooled is None else pooled
    ref_point = pooled[0] - pos[0]
    max_dist = ref_point + shift * len(pooled) * stride
    min_dist = pooled[0] - pos[-1]
    return np.arange(max_dist, min_dist - 1, -stride)


def shift_index(queries: int, rows: int, keys: int, shift: int) -> np.ndarray:
    """The column of the [queries, rows] positional scores each [query, key] score takes: transformers' relative
    shift (a reshape to [rows, queries], ``shift`` rows dropped, reshaped back) replayed on flat indices. The reshape
    keeps every score in its query's row; checked."""
    flat = np.arange(queries * rows).reshape(rows, queries)[shift:].reshape(queries, rows - shift)[:, :keys]
    if not (flat // rows == np.arange(queries)[:, None]).all():
        raise ValueError(f"funnel: the relative shift of {queries} queries over {rows} distances mixes rows")
    return (flat % rows).astype(np.int32)


@dataclass
class Attending:
    """What the layers of one stage read besides their input: per-block position tables, the token-type and
    [CLS] masks, the additive key mask (host arrays, turned into tensors where used)."""
    positions: list        # per block: (table of the unpooled layers [R, d], of the pooling layer [R', d] or None)
    same_type: np.ndarray  # bool [B, queries, keys]
    cls_mask: np.ndarray   # float32 [queries, keys]: 0 on [CLS]'s row and column
    key_mask: np.ndarray   # float32 [B, keys]: 1 real, 0 padding


class FunnelAttention(Module):
    def __init__(self, spec: FunnelSpec, block: int):
        super().__init__()
        d, n, h = spec.d_model, spec.num_heads, spec.head_dim
        self.spec, self.block = spec, block
        self.q_head = Linear(d, n * h, bias=False)
        self.k_head = Linear(d, n * h)
        self.v_head = Linear(d, n * h)
        for name, shape in (("r_w_bias", (n, h)), ("r_r_bias", (n, h)), ("r_kernel", (d, n, h)),
                            ("r_s_bias", (n, h)), ("seg_embed", (2, n, h))):
            self.param(name, shape)
        self.post_proj = Linear(n * h, d)
        self.layer_norm = LayerNorm(d, eps=spec.norm_eps)

    def forward(self, query, key, att: Attending):
        s = self.spec
        batch, queries, _ = query.shape
        keys = key.shape[1]
        n, h = s.num_heads, s.head_dim
        scale = 1.0 / float(h) ** 0.5
        q = (self.q_head(query) * scale).reshape(batch, queries, n, h).permute(0, 2, 1, 3)   # [B, n, i, h]
        k = self.k_head(key).reshape(batch, keys, n, h).permute(0, 2, 1, 3)
        v = self.v_head(key).reshape(batch, keys, n, h).permute(0, 2, 1, 3)
        content = (q + (self.r_w_bias * scale).reshape(1, n, 1, h)) @ k.transpose(-2, -1)
        # relative positions: (q + r_r_bias) . (R W_r) over every distance, then each key's distance picked
        shift = 2 if queries != keys else 1
        table = att.positions[self.block][shift - 1]
        r_head = Tensor(table).cast(query.dtype) @ self.r_kernel.reshape(s.d_model, n * h)          # [R, n h]
        r_head = r_head.reshape(table.shape[0], n, h).permute(1, 2, 0)                            # [n, h, R]
        positional = (q + (self.r_r_bias * scale).reshape(1, n, 1, h)) @ r_head                     # [B, n, i, R]
        positional = F.take_along_last(positional, Tensor(shift_index(queries, table.shape[0], keys, shift)))
        cls_mask = Tensor(att.cls_mask).cast(query.dtype)
        # token types: the score of the same segment or of another one, per query and head
        types = (q + (self.r_s_bias * scale).reshape(1, n, 1, h)) @ self.seg_embed.permute(1, 2, 0)  # [B, n, i, 2]
        other, same = types[..., 0:1], types[..., 1:2]
        same_type = Tensor(att.same_type.astype(np.float32)[:, None]).cast(query.dtype)
        token_type = other + same_type * (same - other)
        scores = content + (positional + token_type) * cls_mask
        if not att.key_mask.all():
            bias = ((att.key_mask - np.float32(1)) * np.float32(MASKED_SCORE))[:, None, None, :].astype(np.float32)
            scores = scores.float() + Tensor(bias)
        out = scores.softmax(-1).cast(v.dtype) @ v                                                 # [B, n, i, h]
        out = self.post_proj(out.permute(0, 2, 1, 3).reshape(batch, queries, n * h))
        return self.layer_norm(query + out)


class FunnelFFN(Module):
    def __init__(self, spec: FunnelSpec):
        super().__init__()
        self.linear_1 = Linear(spec.d_model, spec.d_inner)
        self.linear_2 = Linear(spec.d_inner, spec.d_model)
        self.layer_norm = LayerNorm(spec.d_model, eps=spec.norm_eps)
        self.act = F.activation(spec.hidden_act)

    def forward(self, x):
        return self.layer_norm(x + self.linear_2(self.act(self.linear_1(x))))


class FunnelLayer(Module):
    def __init__(self, spec: FunnelSpec, block: int):
        super().__init__()
        self.attention = FunnelAttention(spec, block)
        self.ffn = FunnelFFN(spec)

    def forward(self, query, key, att: Attending):
        return self.ffn(self.attention(query, key, att))


class FunnelForMaskedLM(Module):
    """transformers' FunnelForMaskedLM: ``model(input_ids, attention_mask=None, token_type_ids=None, labels=None)``
    returns ``.logits`` [B, T, vocab] and, with labels, the masked-LM ``.loss``. ``decoder`` / ``head`` False build
    the bases below (FunnelBaseModel has no decoder; neither base has the LM head)."""

    def __init__(self, config: dict, architecture, *, decoder: bool = True, head: bool = True):
        super().__init__()
        name = getattr(architecture, "name", architecture)
        spec = encoder_spec(config, name)
        self.config, self.architecture_name, self.spec = config, name, spec
        self.dtype = dt.float32  # from_pretrained sets the loaded dtype
        words = place(self, "funnel.embeddings.word_embeddings", Embedding(spec.vocab_size, spec.d_model))
        embed_norm = place(self, "funnel.embeddings.layer_norm", LayerNorm(spec.d_model, eps=spec.norm_eps))
        blocks = [[place(self, f"funnel.encoder.blocks.{b}.{i}", FunnelLayer(spec, b)) for i in range(size)]
                  for b, size in enumerate(spec.block_sizes)]
        layers = [place(self, f"funnel.decoder.layers.{i}", FunnelLayer(spec, 0))
                  for i in range(spec.num_decoder_layers)] if decoder else None
        lm_head = place(self, "lm_head", Linear(spec.d_model, spec.vocab_size)) if head else None
        for key, value in (("word", words), ("embed_norm", embed_norm), ("blocks", blocks),
                           ("decoder_layers", layers), ("head", lm_head)):
            object.__setattr__(self, key, value)  # plain references: place() registered them under HF paths
        if head and spec.tie_embeddings:
            self.tie("lm_head.weight", "funnel.embeddings.word_embeddings.weight")
        self.ignored_checkpoint_keys = ()

    def input_limits(self) -> InputLimits:
        return InputLimits(vocab_size=self.spec.vocab_size)  # no position table; token types are only compared

    # -- the host-side attention inputs

    def _attending(self, length: int, types: np.ndarray, mask: np.ndarray) -> Attending:
        """transformers' init_attention_inputs: the position tables of every block for a sequence of ``length``."""
        s = self.spec
        table = sinusoid_table(length, s.d_model)
        zero = 2 * length
        pos = list(range(length))
        positions = []
        for block in range(len(s.block_sizes)):
            pooling = None
            pooled = pos
            if block:
                pooled = self._pooled_ids(pos, block)
                pooling = table[relative_distances(pos, 2 ** (block - 1), pooled, shift=2) + zero]
            pos = pooled
            positions.append((table[relative_distances(pos, 2 ** block) + zero], pooling))
        same = (types[:, :, None] == types[:, None]) | (types == CLS_TOKEN_TYPE)[:, :, None] | \
               (types == CLS_TOKEN_TYPE)[:, None]
        cls_mask = np.ones((length, length), np.float32)
        if s.separate_cls:
            cls_mask[0, :] = cls_mask[:, 0] = 0
        return Attending(positions, same, cls_mask, mask.astype(np.float32))

    def _pooled_ids(self, pos: list, block: int) -> list:
        if self.spec.separate_cls:
            rest = pos[1:-1] if self.spec.truncate_seq else pos[1:]
            return [-(2 ** block) + 1] + rest[::2]
        return pos[::2]

    def _pool_hidden(self, hidden):
        s = self.spec
        if s.separate_cls:
            hidden = F.cat([hidden[:, :1], hidden[:, :-1] if s.truncate_seq else hidden], 1)
        return F.avg_pool1d(hidden, 2)

    def _upsample(self, x, length: int):
        """Each position of the last block repeated 2^(blocks - 1) times back to ``length`` ([CLS] kept apart)."""
        s = self.spec
        stride = 2 ** (len(s.block_sizes) - 1)
        if stride == 1:
            return x
        batch, rows, d = x.shape
        cls, x = (x[:, :1], x[:, 1:]) if s.separate_cls else (None, x)
        rows = x.shape[1]
        out = x.reshape(batch, rows, 1, d).expand(batch, rows, stride, d).contiguous().reshape(batch, rows * stride, d)
        if cls is None:
            return out[:, :length]
        if s.truncate_seq:
            zeros = Tensor(np.zeros((batch, stride - 1, d), np.float32)).cast(out.dtype)
            out = F.cat([out, zeros], 1)
        return F.cat([cls, out[:, :length - 1]], 1)

    # -- forward

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, hidden_states: list | None = None):
        """The decoder's last hidden states [B, T, d_model] (without a decoder: the last block's, pooled);
        ``hidden_states``, a list, receives the embeddings' output and every layer's, as transformers'."""
        s = self.spec
        ids = _as_int_array(input_ids)
        batch, length = ids.shape
        shortest = 3 if s.separate_cls else 2
        if len(s.block_sizes) > 1 and length < shortest:  # no pooling, yet the later blocks' tables expect one
            raise InputError(f"funnel: input_ids of {length} tokens are too short for {len(s.block_sizes)} blocks of "
                             f"pooling; give at least {shortest} (transformers cannot run them either)")
        mask = np.ones((batch, length), np.int64) if attention_mask is None else _as_int_array(attention_mask)
        types = np.zeros((batch, length), np.int64) if token_type_ids is None else _as_int_array(token_type_ids)
        x = self.embed_norm(F.embedding(Tensor(ids.astype(np.int32)), self.word.weight, padding_idx=s.pad_token_id))
        full = self._attending(length, types, mask)
        att = Attending(full.positions, full.same_type, full.cls_mask, full.key_mask)
        hidden, states = x, [x]
        for block, layers in enumerate(self.blocks):
            pooling = block > 0 and hidden.shape[1] > (2 if s.separate_cls else 1)
            if pooling:
                pooled = self._pool_hidden(hidden)
                att = Attending(att.positions, stride_pool(att.same_type, 1, s), stride_pool(att.cls_mask, 0, s),
                                att.key_mask)
            for index, layer in enumerate(layers):
                for repeat in range(s.block_repeats[block]):
                    first = pooling and index == 0 and repeat == 0
                    hidden = layer(pooled, hidden, att) if first else layer(hidden, hidden, att)
                    if first:
                        att = Attending(att.positions, stride_pool(att.same_type, 2, s),
                                        stride_pool(att.cls_mask, 1, s), pool_positions(att.key_mask.shape[1], s,
                                                                                        att.key_mask))
                    states.append(hidden)
        if self.decoder_layers is None:
            if hidden_states is not None:
                hidden_states.extend(states)
            return hidden
        hidden = self._upsample(hidden, length) + states[s.block_sizes[0]]
        states.append(hidden)
        for layer in self.decoder_layers:
            hidden = layer(hidden, hidden, full)
            states.append(hidden)
        if hidden_states is not None:
            hidden_states.extend(states)
        return hidden

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        logits = self.head(self.encode(input_ids, attention_mask, token_type_ids))
        loss = None
        if labels is not None:
            labels = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
            loss = F.cross_entropy(logits.float(), Tensor(labels.astype(np.int32)), ignore_index=IGNORE_INDEX)
        return MaskedLMOutput(logits=logits, loss=loss)


# transformers' FunnelClassificationHead: linear_hidden, tanh, linear_out on the first token (sequences and choices)
FUNNEL_CLASSIFIER = SequenceHead("first", out="classifier.linear_out", dense="classifier.linear_hidden",
                                 dense_act="tanh")


class FunnelModel(FunnelForMaskedLM):
    """transformers' FunnelModel (the token-classification and question-answering base): ``last_hidden_state`` the
    decoder's [B, T, d_model], no pooler; ``hidden_states`` the embeddings', every encoder layer's, the upsampled
    sum and every decoder layer's."""

    base_model_prefix = "funnel"

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = True, *, decoder: bool = True):
        super().__init__(config, architecture, decoder=decoder, head=False)
        self.output_size = self.spec.d_model

    @classmethod
    def task_heads(cls, config: dict, spelling: str) -> TaskHeads | None:
        if spelling != "funnel":
            return None
        return TaskHeads(FUNNEL_CLASSIFIER, multiple_choice=FUNNEL_CLASSIFIER,
                         base_classes=(("sequence-classification", FunnelBaseModel),
                                       ("multiple-choice", FunnelBaseModel)))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_hidden_states=False):
        recorded = [] if output_hidden_states else None
        x = self.encode(input_ids, attention_mask, token_type_ids, hidden_states=recorded)
        return BaseModelOutput(last_hidden_state=x, pooler_output=None,
                               hidden_states=tuple(recorded) if recorded is not None else None)


class FunnelBaseModel(FunnelModel):
    """transformers' FunnelBaseModel (the sequence-classification and multiple-choice base): the encoder alone, its
    last hidden state as long as the last block's pooled sequence."""

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = True):
        super().__init__(config, architecture, add_pooling_layer, decoder=False)
