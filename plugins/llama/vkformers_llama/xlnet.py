"""XLNet with its language-model head (transformers 5 XLNetLMHeadModel), batch-first.

- Post-LN layers: relative attention, then a feed-forward block, each with a residual and a LayerNorm. The
  projections q, k, v, o, r are [d_model, heads, head_dim] tensors.
- Scores are (content (q + r_w_bias) k + positions (q + r_r_bias) R W_r + segments (q + r_s_bias) seg_embed)
  / sqrt(head_dim), R the sinusoid table of the distances klen .. -qlen + 1 read through Transformer-XL's
  relative shift; the segment term (token_type_ids only) tells apart keys of the query's segment from the others.
- Masks are built on the host from attention_mask and perm_mask: 1 hides a key. The content stream (h) always
  sees its own position; the query stream (g, only with target_mapping) starts from mask_emb, sees what the mask
  leaves and is the output.
- mems: every layer's input kept (the last mem_len) and attended by every query; generate follows transformers'
  prepare_inputs_for_generation: a dummy token 0 appended, hidden from every query and predicted by the query
  stream, the last two positions of the mems dropped and recomputed each step, attention_mask unused.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.function import no_grad
from vkformers.engine.tensor import Tensor
from vkformers.errors import InputError
from vkformers.models.decoder import UnsupportedConfigError
from vkformers.models.generation import end_stream, pick_next_tokens, stream_tokens
from vkformers.models.generation_settings import LogitRules, generation_sources, resolve_call, sampling_rng
from vkformers.models.inputs import InputLimits, check_model_inputs
from vkformers.models.heads import BaseModelOutput, TaskHeads, sequence_summary
from vkformers.models.layers import Embedding, LayerNorm, Linear
from vkformers.models.loading import CausalLMOutput
from vkformers.models.module import Module, add_param, get_param, place
from vkformers.runtime import dtypes as dt

IGNORE_INDEX = -100
HIDDEN = np.float32(1e30)  # transformers subtracts 1e30 from the scores of hidden keys
DUMMY_TOKEN = 0            # the token generate appends as the position to predict
RECOMPUTED = 2             # the last mems positions each generate step drops and recomputes


@dataclass(frozen=True)
class XLNetSpec:
    vocab_size: int
    d_model: int
    num_heads: int
    head_dim: int
    d_inner: int
    num_layers: int
    activation: str
    norm_eps: float
    dropout: float
    mem_len: int | None
    shift_labels: bool = False  # the loss reads labels[t] for logits[t] (the Trainer refuses such models)


def xlnet_spec(config: dict) -> XLNetSpec:
    """The sizes of transformers' XLNetConfig; the options the model does not implement are refused by name."""
    arch = "xlnet"
    for key, ok, want in (("attn_type", lambda v: v == "bi", "bi"), ("bi_data", lambda v: not v, False),
                          ("same_length", lambda v: not v, False), ("clamp_len", lambda v: v is None or v < 0, -1),
                          ("reuse_len", lambda v: not v, None), ("use_mems_train", lambda v: not v, False)):
        if key in config and not ok(config[key]):
            raise UnsupportedConfigError(f"{arch}: config option {key}={config[key]!r} is not implemented "
                                         f"(use {want!r})")
    d = int(config.get("d_model", 1024))
    heads = int(config.get("n_head", 16))
    if d % 2:
        raise UnsupportedConfigError(f"{arch}: config option d_model={d} must be even (its sinusoid table holds "
                                     "sines and cosines of d_model / 2 frequencies)")
    mem_len = config.get("mem_len", 512)
    return XLNetSpec(vocab_size=int(config["vocab_size"]), d_model=d, num_heads=heads,
                     head_dim=int(config.get("d_head", d // heads)), d_inner=int(config.get("d_inner", 4096)),
                     num_layers=int(config.get("n_layer", 24)), activation=config.get("ff_activation", "gelu"),
                     norm_eps=float(config.get("layer_norm_eps", 1e-12)), dropout=float(config.get("dropout", 0.1)),
                     mem_len=int(mem_len) if mem_len else None)


# ---------------------------------------------------------------- host-side positions and masks

def position_table(qlen: int, klen: int, d_model: int) -> np.ndarray:
    """[sin | cos] of the distances klen, klen - 1, .. -qlen + 1 (attn_type "bi"), float32 as torch computes it."""
    inv_freq = np.float32(1) / np.power(np.float32(10000), np.arange(0, d_model, 2, dtype=np.float32)
                                        / np.float32(d_model))
    distances = np.arange(klen, -qlen, -1).astype(np.float32)
    sinusoid = (distances[:, None] * inv_freq[None]).astype(np.float32)
    return np.concatenate([np.sin(sinusoid), np.cos(sinusoid)], -1).astype(np.float32)


def shift_index(qlen: int, klen: int) -> np.ndarray:
    """The column of the [qlen, klen + qlen] positional scores each [query, key] score takes: transformers'
    rel_shift_bnij (a reshape to [klen + qlen, qlen], the first row dropped, reshaped back, the first klen
    columns) replayed on flat indices."""
    rows = klen + qlen
    flat = np.arange(qlen * rows).reshape(rows, qlen)[1:].reshape(qlen, rows - 1)[:, :klen]
    assert (flat // rows == np.arange(qlen)[:, None]).all()  # each score stays in its query's row
    return (flat % rows).astype(np.int32)


def attention_masks(batch: int, qlen: int, mlen: int, attention_mask, perm_mask):
    """(hidden keys of the query stream, of the content stream) as float32 [B, qlen, mlen + qlen] (1 hides), or
    (None, None) when nothing is hidden: transformers' attn_mask and non_tgt_mask."""
    data = None
    if attention_mask is not None:
        data = np.broadcast_to((1.0 - attention_mask.astype(np.float32))[:, None, :], (batch, qlen, qlen))
    if perm_mask is not None:
        data = perm_mask.astype(np.float32) if data is None else data + perm_mask.astype(np.float32)
    if data is None:
        return None, None
    data = np.concatenate([np.zeros((batch, qlen, mlen), np.float32), data], -1)
    hidden = (data > 0).astype(np.float32)
    own = np.concatenate([np.zeros((qlen, mlen), np.float32), np.eye(qlen, dtype=np.float32)], -1)
    return hidden, ((hidden - own[None]) > 0).astype(np.float32)


def _host(x, dtype=None):
    if x is None:
        return None
    x = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    return x if dtype is None else x.astype(dtype)


@dataclass
class Streams:
    """What every layer reads besides its input: the position table, the shift, the masks and segments."""
    table: object          # Tensor [klen + qlen, d_model]: the distances' sinusoids, dropped out once per forward
    shift: np.ndarray
    mask_h: np.ndarray | None
    mask_g: np.ndarray | None
    other_segment: np.ndarray | None  # float32 [B, qlen, klen]: 1 where key and query segments differ
    target_mapping: np.ndarray | None


# ---------------------------------------------------------------- layers

class XLNetRelativeAttention(Module):
    def __init__(self, spec: XLNetSpec):
        super().__init__()
        d, n, h = spec.d_model, spec.num_heads, spec.head_dim
        self.spec = spec
        for name in ("q", "k", "v", "o", "r"):
            self.param(name, (d, n, h))
        for name in ("r_r_bias", "r_s_bias", "r_w_bias"):
            self.param(name, (n, h))
        self.param("seg_embed", (2, n, h))
        self.layer_norm = LayerNorm(d, eps=spec.norm_eps)

    def _project(self, x, weight):
        s = self.spec
        batch, length, _ = x.shape
        heads = x @ weight.reshape(s.d_model, s.num_heads * s.head_dim)
        return heads.reshape(batch, length, s.num_heads, s.head_dim).permute(0, 2, 1, 3)      # [B, n, T, h]

    def _bias(self, name):
        return getattr(self, name).reshape(1, self.spec.num_heads, 1, self.spec.head_dim)

    def _core(self, q, k, v, k_r, st: Streams, hidden):
        """rel_attn_core: q [B, n, i, h] over keys k, v [B, n, j, h]; k_r [n, h, P] the positions' keys."""
        s = self.spec
        content = (q + self._bias("r_w_bias")) @ k.transpose(-2, -1)
        positional = F.take_along_last((q + self._bias("r_r_bias")) @ k_r, Tensor(st.shift))
        scores = content + positional
        if st.other_segment is not None:
            types = (q + self._bias("r_s_bias")) @ self.seg_embed.permute(1, 2, 0)                # [B, n, i, 2]
            same, other = types[..., 0:1], types[..., 1:2]
            scores = scores + same + Tensor(st.other_segment[:, None]).cast(q.dtype) * (other - same)
        scores = scores.float() * (1.0 / float(s.head_dim) ** 0.5)
        if hidden is not None:
            scores = scores - Tensor((hidden * HIDDEN)[:, None])
        probs = F.dropout(scores.softmax(-1), s.dropout, self.training)
        return probs.cast(v.dtype) @ v                                                              # [B, n, i, h]

    def _post(self, x, vec):
        s = self.spec
        batch, heads, length, h = vec.shape
        out = vec.permute(0, 2, 1, 3).reshape(batch, length, heads * h) @ \
            self.o.reshape(s.d_model, heads * h).transpose(0, 1)
        return self.layer_norm(F.dropout(out, s.dropout, self.training) + x)

    def forward(self, h, g, mem, st: Streams):
        s = self.spec
        cat = h if mem is None else F.cat([mem.cast(h.dtype), h], 1)
        k, v = self._project(cat, self.k), self._project(cat, self.v)
        table = st.table
        k_r = (table @ self.r.reshape(s.d_model, s.num_heads * s.head_dim)).reshape(
            table.shape[0], s.num_heads, s.head_dim).permute(1, 2, 0)                              # [n, h, P]
        out_h = self._post(h, self._core(self._project(h, self.q), k, v, k_r, st, st.mask_h))
        if g is None:
            return out_h, None
        q_g = self._project(g, self.q)                                                              # [B, n, m, h]
        mapping = Tensor(st.target_mapping).cast(h.dtype)                                           # [B, m, l]
        batch, heads, predicted, hd = q_g.shape
        flat = q_g.permute(0, 2, 1, 3).reshape(batch, predicted, heads * hd)
        q_l = (mapping.transpose(-2, -1) @ flat).reshape(batch, -1, heads, hd).permute(0, 2, 1, 3)
        vec = self._core(q_l, k, v, k_r, st, st.mask_g)                                            # [B, n, l, h]
        length = vec.shape[2]
        vec = (mapping @ vec.permute(0, 2, 1, 3).reshape(batch, length, heads * hd)).reshape(
            batch, predicted, heads, hd).permute(0, 2, 1, 3)
        return out_h, self._post(g, vec)


class XLNetFeedForward(Module):
    def __init__(self, spec: XLNetSpec):
        super().__init__()
        self.spec = spec
        self.layer_norm = LayerNorm(spec.d_model, eps=spec.norm_eps)
        self.layer_1 = Linear(spec.d_model, spec.d_inner)
        self.layer_2 = Linear(spec.d_inner, spec.d_model)
        self.act = F.activation(spec.activation)

    def forward(self, x):
        p, training = self.spec.dropout, self.training
        out = F.dropout(self.act(self.layer_1(x)), p, training)
        return self.layer_norm(F.dropout(self.layer_2(out), p, training) + x)


class XLNetLayer(Module):
    def __init__(self, spec: XLNetSpec):
        super().__init__()
        self.rel_attn = XLNetRelativeAttention(spec)
        self.ff = XLNetFeedForward(spec)

    def forward(self, h, g, mem, st: Streams):
        h, g = self.rel_attn(h, g, mem, st)
        return self.ff(h), (None if g is None else self.ff(g))


# ---------------------------------------------------------------- the model

@dataclass
class XLNetLMOutput(CausalLMOutput):
    mems: tuple | None = None


@dataclass
class XLNetModelOutput(BaseModelOutput):
    mems: tuple | None = None


# transformers' XLNetConfig defaults of its sequence summary (the last position, a projection, tanh)
XLNET_SUMMARY = dict(summary_type="last", summary_use_proj=True, summary_activation="tanh",
                     summary_proj_to_labels=False)


def xlnet_heads(config: dict) -> TaskHeads:
    """XLNet's: the sequence summary (sequence_summary.summary, by default on the last position, padding or not)
    then logits_proj, for sequences and for each choice; a token classifier; the simple question-answering head
    (qa_outputs: XLNetForQuestionAnsweringSimple, not the beam-search head of XLNetForQuestionAnswering)."""
    if config.get("summary_use_proj", True) and config.get("summary_proj_to_labels", False):
        raise UnsupportedConfigError("xlnet: config option summary_proj_to_labels=True is not supported (transformers' "
                                     "logits_proj then reads a summary of num_labels values, not d_model)")
    summary = sequence_summary(config, "logits_proj", XLNET_SUMMARY)
    return TaskHeads(summary, multiple_choice=summary)


class XLNetTransformer(Module):
    """The embeddings and layers under ``transformer.``, what the LM head model and the base model share."""

    def __init__(self, config: dict, architecture):
        super().__init__()
        spec = xlnet_spec(config)
        self.config, self.architecture_name, self.spec = config, getattr(architecture, "name", architecture), spec
        self.dtype = dt.float32  # from_pretrained sets the loaded dtype
        embed = place(self, "transformer.word_embedding", Embedding(spec.vocab_size, spec.d_model))
        add_param(self, "transformer.mask_emb", (1, 1, spec.d_model))
        layers = [place(self, f"transformer.layer.{i}", XLNetLayer(spec)) for i in range(spec.num_layers)]
        for key, value in (("embed", embed), ("layer_list", layers)):
            object.__setattr__(self, key, value)  # plain references: place() registered them under HF paths
        self.ignored_checkpoint_keys = ()

    def input_limits(self) -> InputLimits:
        # relative positions: no position table; labels follow target_mapping, checked in forward
        return InputLimits(vocab_size=self.spec.vocab_size, labels_like=None)

    def transformer(self, input_ids, attention_mask=None, perm_mask=None, target_mapping=None, token_type_ids=None,
                    mems=None, use_mems: bool = False, hidden_states: list | None = None):
        """transformers' XLNetModel: the output stream [B, T, d_model] (the query stream's [B, predictions,
        d_model] with target_mapping), and with use_mems each layer's input to keep (the last mem_len).
        ``hidden_states``, a list, receives each layer's input and the last layer's output (the content stream's)."""
        s = self.spec
        ids = _host(input_ids, np.int64)
        if ids.ndim != 2:
            raise InputError(f"xlnet: input_ids must be [batch, length], got {ids.shape}")
        batch, qlen = ids.shape
        mask, perm, mapping = _host(attention_mask), _host(perm_mask), _host(target_mapping, np.float32)
        for name, value, shape in (("perm_mask", perm, (batch, qlen, qlen)),
                                   ("target_mapping", mapping, (batch, None, qlen))):
            if value is not None and (value.ndim != 3 or value.shape[0] != batch or value.shape[2] != qlen
                                      or (shape[1] is not None and value.shape[1] != shape[1])):
                raise InputError(f"xlnet: {name} must be {list(shape)} (None: any) for input_ids {list(ids.shape)}, "
                                 f"got {list(value.shape)}")
        if mems is not None:
            mems = [m if isinstance(m, Tensor) else Tensor(np.asarray(m, np.float32)) for m in mems]
            if len(mems) != s.num_layers or any(tuple(m.shape) != (batch, mems[0].shape[1], s.d_model) for m in mems):
                raise InputError(f"xlnet: mems must hold one [batch, memory, d_model] tensor per layer "
                                 f"({s.num_layers}) for {batch} rows, as an earlier call's .mems")
        mlen = 0 if mems is None else mems[0].shape[1]
        klen = mlen + qlen
        mask_g, mask_h = attention_masks(batch, qlen, mlen, mask, perm)
        other = None
        if token_type_ids is not None:
            types = _host(token_type_ids, np.int64)
            keys = np.concatenate([np.zeros((batch, mlen), np.int64), types], 1)
            other = (types[:, :, None] != keys[:, None, :]).astype(np.float32)
        table = F.dropout(Tensor(position_table(qlen, klen, s.d_model)).cast(self.embed.weight.dtype), s.dropout,
                          self.training)
        st = Streams(table, shift_index(qlen, klen), mask_h, mask_g, other, mapping)
        h = F.dropout(F.embedding(Tensor(ids.astype(np.int32)), self.embed.weight), s.dropout, self.training)
        g = None
        if mapping is not None:
            g = F.dropout(get_param(self, "transformer.mask_emb").expand(batch, mapping.shape[1], s.d_model),
                          s.dropout, self.training)
        new_mems = []
        for i, layer in enumerate(self.layer_list):
            if use_mems:
                kept = h if mems is None else F.cat([mems[i].cast(h.dtype), h], 1)
                cut = kept.shape[1] - s.mem_len if s.mem_len and kept.shape[1] > s.mem_len else 0
                new_mems.append(kept[:, cut:].detach())
            if hidden_states is not None:
                hidden_states.append(h)
            h, g = layer(h, g, None if mems is None else mems[i], st)
        if hidden_states is not None:
            hidden_states.append(h)
        return F.dropout(h if g is None else g, s.dropout, self.training), (tuple(new_mems) if use_mems else None)


class XLNetModel(XLNetTransformer):
    """transformers' XLNetModel (``vkformers.AutoModel``) and the base of its task heads: ``model(input_ids,
    attention_mask=None, token_type_ids=None, output_hidden_states=False, perm_mask=None, target_mapping=None,
    mems=None, use_mems=False)`` returns ``.last_hidden_state`` ([B, T, d_model], the query stream's with
    target_mapping), ``.hidden_states`` (the embeddings, then each layer's content stream) and, with use_mems,
    ``.mems``."""

    base_model_prefix = "transformer"

    def __init__(self, config: dict, architecture, add_pooling_layer: bool = True):
        super().__init__(config, architecture)

    @classmethod
    def task_heads(cls, config: dict, spelling: str) -> TaskHeads | None:
        return xlnet_heads(config) if spelling == "xlnet" else None  # a wrapper asks every base class

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_hidden_states: bool = False,
                perm_mask=None, target_mapping=None, mems=None, use_mems: bool = False):
        recorded = [] if output_hidden_states else None
        out, new_mems = self.transformer(input_ids, attention_mask, perm_mask, target_mapping, token_type_ids, mems,
                                         use_mems, recorded)
        return XLNetModelOutput(last_hidden_state=out, hidden_states=None if recorded is None else tuple(recorded),
                                mems=new_mems)


class XLNetLMHeadModel(XLNetTransformer):
    """transformers' XLNetLMHeadModel: ``model(input_ids, attention_mask=None, labels=None, perm_mask=None,
    target_mapping=None, token_type_ids=None, mems=None, use_mems=False)`` returns ``.logits`` ([B, T, vocab], or
    [B, predictions, vocab] with target_mapping), the cross-entropy ``.loss`` of labels (not shifted) and, with
    use_mems, ``.mems`` (per layer [B, memory, d_model])."""

    capture_decode = False  # each step's masks and position table are built on the host

    def __init__(self, config: dict, architecture):
        super().__init__(config, architecture)
        object.__setattr__(self, "head", place(self, "lm_loss", Linear(self.spec.d_model, self.spec.vocab_size)))
        if config.get("tie_word_embeddings", True):
            self.tie("lm_loss.weight", "transformer.word_embedding.weight")

    def forward(self, input_ids, attention_mask=None, labels=None, perm_mask=None, target_mapping=None,
                token_type_ids=None, mems=None, use_mems: bool = False, position_ids=None, cache=None):
        if cache is not None:
            raise InputError("xlnet: no key/value cache; generation keeps mems (use_mems=True, then mems=...)")
        s = self.spec
        out, new_mems = self.transformer(input_ids, attention_mask, perm_mask, target_mapping, token_type_ids, mems,
                                         use_mems)
        logits = self.head(out)
        loss = None
        if labels is not None:
            target = _host(labels, np.int64)
            batch, qlen = _host(input_ids).shape
            mapping = _host(target_mapping)
            want = (batch, qlen if mapping is None else mapping.shape[1])
            if target.shape != want:
                raise InputError(f"xlnet: labels must be {list(want)} (one per "
                                 f"{'position' if mapping is None else 'target_mapping row'}), got {list(target.shape)}")
            if ((target != IGNORE_INDEX) & ((target < 0) | (target >= s.vocab_size))).any():
                raise InputError(f"xlnet: labels must be token ids below {s.vocab_size} or {IGNORE_INDEX} (ignored)")
            target = target.astype(np.int32)
            loss = F.cross_entropy(logits.float().reshape(-1, s.vocab_size), Tensor(target.reshape(-1)),
                                   ignore_index=IGNORE_INDEX)
        return XLNetLMOutput(logits=logits, loss=loss, mems=new_mems)

    def generate(self, input_ids, max_new_tokens: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None, eos_token_id=None,
                 attention_mask=None, streamer=None, pad_token_id: int | None = None, min_p: float | None = None,
                 **options):
        """Prompt + up to ``max_new_tokens`` tokens per row, numpy int64 [batch, T + new], as transformers' generate
        runs XLNetLMHeadModel (the settings, their defaults and logits processors as GenerationMixin.generate's).
        ``attention_mask`` is accepted and not used, as there: a padded row attends its pads."""
        tokens = _host(input_ids, np.int64)
        tokens = tokens[None] if tokens.ndim == 1 else tokens
        sources = generation_sources(self)
        settings, lengths, given_rules, _ = resolve_call(
            sources, options, max_new_tokens, tokens.shape[-1], do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
        do_sample, temperature, top_k, top_p, min_p, repetition_penalty = settings.values()
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise InputError(f"generate: input_ids must be [batch, length] with length >= 1, got {tokens.shape}")
        check_model_inputs(self.input_limits(), {"input_ids": tokens, "attention_mask": _host(attention_mask)})
        tokens = np.repeat(tokens, lengths.num_return_sequences, axis=0)
        eos = self.config.get("eos_token_id") if eos_token_id is None else eos_token_id
        eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple, np.ndarray)) else [eos])]
        pad = self.config.get("pad_token_id") if pad_token_id is None else pad_token_id
        pad = int(pad if pad is not None else (eos[0] if eos else 0))
        rules = LogitRules.resolve(sources, given_rules, start_length=tokens.shape[1],
                                   max_length=tokens.shape[1] + lengths.max_new_tokens, eos=eos)
        rng = sampling_rng(seed)
        if hasattr(streamer, "put"):
            streamer.put(tokens)
        batch = tokens.shape[0]
        unfinished = np.ones(batch, bool)
        mems = None
        with no_grad():
            for step in range(lengths.max_new_tokens):
                context = tokens if mems is None else tokens[:, -RECOMPUTED:]
                ids = np.concatenate([context, np.full((batch, 1), DUMMY_TOKEN, np.int64)], 1)
                length = ids.shape[1]
                perm = np.zeros((batch, length, length), np.float32)
                perm[:, :, -1] = 1.0
                mapping = np.zeros((batch, 1, length), np.float32)
                mapping[:, 0, -1] = 1.0
                kept = None if mems is None else [m[:, :-RECOMPUTED] for m in mems]
                out = self(ids, perm_mask=perm, target_mapping=mapping, mems=kept, use_mems=True)
                logits = out.logits.float().numpy()[:, -1]
                mems = list(out.mems)
                chosen = pick_next_tokens(logits, tokens, do_sample, rng, temperature, top_k, top_p,
                                          repetition_penalty, eos if step < lengths.min_new_tokens else (), rules,
                                          min_p)
                chosen = np.where(unfinished, chosen, pad).astype(np.int64)
                tokens = np.concatenate([tokens, chosen[:, None]], 1)
                stream_tokens(streamer, chosen)
                if eos:
                    unfinished &= ~np.isin(chosen, eos)
                unfinished &= ~rules.finished(tokens)
                if not unfinished.any():
                    break
        end_stream(streamer)
        return tokens
