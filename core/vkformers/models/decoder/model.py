"""The decoder kit's causal LM: one model for every decoder-only architecture, configured by a :class:`DecoderSpec`.

The model declares its parameters under the checkpoint's own names (``model.layers.0.
self_attn.q_proj.weight``, ``transformer.h.0.attn.c_attn.weight``, ...); fused projections
stay one parameter and are split with views, so gradients and saved checkpoints keep
Hugging Face's layout.

Forward semantics follow transformers 5: without a cache and without ``position_ids``
every row uses positions ``arange(T)`` (also with left padding); ``attention_mask`` zeros
mask those keys on top of the causal mask; ``labels`` are shifted inside (not for TrOCR, as there).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.rope_scaling import rope_parameters
from vkformers.engine.tensor import Tensor
from vkformers.errors import VkformersError
from vkformers.models.decoder.layer import Context, DecoderLayer, fused_norm
from vkformers.models.decoder.norms import make_norm
from vkformers.models.decoder.spec import DecoderSpec, NormSpec, alibi_slopes, mpt_alibi_slopes, sinusoidal_table
from vkformers.models.cache import EncoderDecoderCache
from vkformers.models.generation import GenerationMixin, kept_positions
from vkformers.models.inputs import InputLimits
from vkformers.models.layers import Embedding, Linear, ModuleList, RMSNorm
from vkformers.models.lazy_weights import LazyWeights
from vkformers.models.lm_loss import causal_lm_loss, target_count
from vkformers.models.loading import CausalLMOutput
from vkformers.models.module import Module, join_path, place
from vkformers.runtime import dtypes as dt

# Buffers some checkpoints carry that are not parameters (causal-mask and rotary caches).
IGNORED_CHECKPOINT_KEYS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                           "rotary_emb.inv_freq", ".act_fn.beta", ".act_fn.eps",  # these two: xIELU (Apertus)
                           ".e_score_correction_bias", ".expert_bias",  # MoE routing biases (load_buffers)
                           # lightning attention's decays (MiniMax), fixed by the config: recomputed (decoder/lightning.py)
                           ".self_attn.slope_rate", ".self_attn.query_decay", ".self_attn.key_decay",
                           ".self_attn.diagonal_decay")


def _embed_norms(spec: DecoderSpec) -> NormSpec:
    """The embedding norm: the blocks' norm, or a LayerNorm of its own."""
    if spec.embed_norm_layer_eps is None:
        return spec.norms
    return NormSpec("layer", eps=spec.embed_norm_layer_eps, weight=True, bias=True)


def _as_numpy(value, dtype=np.int64):
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.numpy()
    return np.asarray(value).astype(dtype)


def _mask_bytes(mask) -> np.ndarray:
    """An attention mask as a bool tensor's bytes: a captured training step derives it anew from the next batch's."""
    return (np.asarray(mask) != 0).astype(np.uint8)


def _round_to(value: float, dtype) -> float:
    """A Python float rounded to a storage dtype (torch multiplies by a scalar tensor of that dtype)."""
    if dtype is dt.bfloat16:
        return float(dt.from_bfloat16(dt.to_bfloat16(np.asarray([value], np.float32)))[0])
    if dtype is dt.float16:
        return float(np.float16(value))
    return float(np.float32(value))


def checkpoint_named(layers: ModuleList, spec) -> ModuleList:
    """``layers`` named by their checkpoint indices (DecoderSpec.checkpoint_layers) instead of 0, 1, ...: loading
    and saving then use the checkpoint's names; iteration and indexing stay in run order."""
    if spec.checkpoint_layers:
        layers._modules.clear()
        layers._modules.update((str(i), layer) for i, layer in zip(spec.checkpoint_layers, layers.items))
    return layers


class DecoderForCausalLM(Module, GenerationMixin):
    """The causal LM around :class:`DecoderLayer`: embeddings, the layers, final norm and head, as a
    :class:`DecoderSpec` configures them. A plugin subclasses it with its own :meth:`decoder_spec`."""

    ignored_checkpoint_keys = IGNORED_CHECKPOINT_KEYS
    supports_gradient_checkpointing = True  # run_layers goes through call_layer
    # layers keeping per-row recurrent state (ROW_STATES of models/cache.py) though the spec has no linear_attention
    # (a plugin's composed layers): their step replays as the linear layers' does (capture_decode_with_row_states)
    keeps_row_states = False
    accepts_logits_to_keep = True
    _recorded = None  # the hidden states run_layers appends to while recorded_stream records

    @staticmethod
    def decoder_spec(config: dict, architecture_name: str) -> DecoderSpec:
        """The spec of ``config``, resolved to ``architecture_name``: a plugin's subclass reads its variants."""
        raise NotImplementedError("a plugin's DecoderForCausalLM subclass sets decoder_spec to its variants' reader")

    def __init__(self, config: dict, architecture):
        super().__init__()
        name = getattr(architecture, "name", architecture)
        spec = self.decoder_spec(config, name)
        self.config, self.architecture_name, self.spec = config, name, spec
        self.dtype = dt.float32  # from_pretrained sets the loaded dtype
        # generate may replay a decode step without this forward (models/decode_capture.py), which rewrites the
        # ids, positions and cache inputs (what derives from them derives on the device: Llama 4's query scale), but
        # not linear layers' recurrent state, which lives on the cache, updated by the Python forward
        self.capture_decode = spec.linear_attention is None
        # HF's longrope models switch to the long factors past the original context, and their
        # generate() then recomputes the cache with them (Phi-3): generation does the same.
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) in ("longrope", "su"):
            self.recompute_cache_beyond = rope.get("original_max_position_embeddings") or \
                config.get("original_max_position_embeddings")
        d = spec.hidden_size
        alibi = None
        if spec.positions.alibi:
            slopes = (mpt_alibi_slopes(spec.num_heads, spec.extra.get("alibi_bias_max", 8))
                      if spec.positions.alibi_kind == "mpt" else alibi_slopes(spec.num_heads))
            alibi = Tensor((slopes * np.float32(spec.positions.alibi_slope_scale)).astype(np.float32))
        refs = dict(  # plain references (object.__setattr__): place() already registered them under HF paths
            embed=place(self, spec.embed, Embedding(spec.vocab_size + spec.embed_extra_rows, spec.embed_dim or d,
                                                         padding_idx=spec.embed_padding_idx)),
            project_in=place(self, spec.project_in, Linear(spec.embed_dim, d, bias=False)) if spec.project_in else None,
            project_out=(place(self, spec.project_out, Linear(d, spec.embed_dim, bias=False))
                         if spec.project_out else None),
            embed_norm=(place(self, spec.embed_norm, make_norm(_embed_norms(spec), d))
                        if spec.embed_norm else None),
            position_embed=(place(self, spec.position_embed,
                                  Embedding(spec.max_position_embeddings + spec.positions.offset, d))
                            if spec.position_embed else None),
            layers=place(self, spec.layers, checkpoint_named(ModuleList((spec.make_layer or DecoderLayer)(spec, i, alibi)
                                                                          for i in range(spec.num_layers)), spec)),
            final_norm=place(self, spec.final_norm, make_norm(spec, d)) if spec.final_norm else None,
            head_dense=(place(self, join_path(spec.head_transform, "dense"),
                              Linear(d, d, bias=spec.head_transform_bias))
                        if spec.head_transform else None),
            head_norm=(place(self, join_path(spec.head_transform, "norm"), make_norm(spec, d))
                       if spec.head_transform else None),
            lm_head=place(self, spec.lm_head, Linear(spec.embed_dim or d, spec.vocab_size, bias=spec.lm_head_bias)),
        )
        for name, module in refs.items():
            object.__setattr__(self, name, module)
        # a plugin's composed layer may attend outside the cache's captured decode attention (its capture_decode)
        self.capture_decode = self.capture_decode and all(getattr(layer, "capture_decode", True)
                                                          for layer in self.layers)
        # a model of linear layers whose step is captured once their states stay in persistent buffers overwritten
        # in place (generate's and a server's caches keep them so: KVCache.keep_states_in_place)
        self.capture_decode_with_row_states = (spec.linear_attention is not None or self.keeps_row_states) and \
            all(getattr(layer, "capture_decode", True) for layer in self.layers)
        if spec.tie_embeddings:
            self.tie(f"{spec.lm_head}.weight", f"{spec.embed}.weight")
        if spec.shared_modules:
            names = [name for name, _ in self.named_slots()]
            for path, owner in spec.shared_modules:
                for name in names:
                    if name.startswith(f"{path}."):
                        self.tie(name, f"{owner}.{name[len(path) + 1:]}")
        self.rope_configs = spec.positions.rope_configs or ((config, None),) * spec.num_layers
        self.position_table = None
        if spec.positions.sinusoidal:  # fixed, not a parameter
            rows = spec.max_position_embeddings + spec.positions.offset
            self.position_table = Tensor(sinusoidal_table(spec.positions.sinusoidal, rows, d,
                                                          spec.extra.get("padding_row")))

    def load_state_dict(self, arrays, *args, **kwargs):
        """Module.load_state_dict after the family's conversions (convert_checkpoint: on a LazyWeights, they change
        names and wrap readers, reading nothing), then the checkpoint buffers that are not parameters."""
        arrays = LazyWeights.of(arrays)
        if self.spec.checkpoint_layers:  # the layers this forward skips (Mllama's cross-attention ones): not loaded
            kept = tuple(f"{self.spec.layers}.{i}." for i in self.spec.checkpoint_layers)
            arrays = arrays.filtered(lambda name: not name.startswith(f"{self.spec.layers}.") or name.startswith(kept))
        for path, module in self.named_modules():  # files laid out otherwise than the parameters (OLMo Hybrid's convs)
            if hasattr(module, "convert_checkpoint"):
                arrays = module.convert_checkpoint(arrays, path)
        super().load_state_dict(arrays, *args, **kwargs)
        for path, module in self.named_modules():  # checkpoint buffers that are not parameters (MoE routing biases)
            if hasattr(module, "load_buffers"):
                module.load_buffers(arrays, path)
        if self.spec.hidden_act == "xielu":  # xIELU's beta / eps are checkpoint buffers, not parameters
            for i, layer in enumerate(self.layers):
                prefix = join_path(self.spec.layers, str(i), self.spec.mlp.path, "act_fn")
                if f"{prefix}.beta" in arrays:
                    layer.xielu_buffers = (float(np.asarray(arrays[f"{prefix}.beta"]).reshape(-1)[0]),
                                           float(np.asarray(arrays[f"{prefix}.eps"]).reshape(-1)[0]))

    # -- what GenerationMixin reads

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        """The attention's head size, what the KV cache stores: MLA pads the narrower of qk and v to the wider."""
        return max(self.spec.head_dim, self.spec.mla.v_dim) if self.spec.mla else self.spec.head_dim

    @property
    def max_position_embeddings(self) -> int:
        return self.spec.max_position_embeddings

    def input_limits(self) -> InputLimits:
        s = self.spec
        table = s.position_embed or s.positions.sinusoidal  # rotary, ALiBi and NoPE models have none to run past
        field = next((f for f in ("max_position_embeddings", "n_positions", "max_seq_len") if f in self.config),
                     "max_position_embeddings")
        return InputLimits(vocab_size=s.vocab_size + s.embed_extra_rows, label_classes=s.vocab_size,
                           max_length=s.max_position_embeddings if table else None, max_length_field=field,
                           min_position=-1 if s.positions.generation == "fairseq" else 0)

    # -- forward

    def _positions(self, batch, length, attention_mask, position_ids, past) -> np.ndarray:
        if position_ids is not None:
            given = position_ids.numpy() if isinstance(position_ids, Tensor) else np.asarray(position_ids)
            if given.shape == (batch, length) and given.dtype == np.int32:
                return given  # the array itself: generate recognises it in a captured decode step
            return np.broadcast_to(given, (batch, length)).astype(np.int32)
        if self.spec.positions.from_mask and attention_mask is not None:  # OPT: count only attended tokens
            return ((np.cumsum(attention_mask, axis=1) * attention_mask - 1)[:, -length:]).astype(np.int32)
        return np.broadcast_to(past + np.arange(length, dtype=np.int32), (batch, length)).astype(np.int32)

    def generation_positions(self, mask: np.ndarray, tokens: np.ndarray, prompt_length: int) -> np.ndarray:
        kind = self.spec.positions.generation
        if kind == "mask":
            return super().generation_positions(mask, tokens, prompt_length)
        index = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
        if kind == "index":
            return index.copy()
        # "fairseq": transformers counts non-pad ids from the prompt (cumsum), then places each later token at the
        # cache length; a pad id gets the padding row (relative position -1)
        real = tokens != self.spec.extra["padding_row"]
        counted = np.where(index < prompt_length, np.cumsum(real, axis=1) - 1, index)
        return np.where(real, counted, -1)

    def _rope_tables(self, seq_len: int):
        """(inv_freq Tensor, attention_scaling) per layer; layers sharing a rope config share one table."""
        tables, by_key = [], {}
        for config, layer_type in self.rope_configs:
            key = (id(config), layer_type)
            if key not in by_key:
                inv_freq, scaling = rope_parameters(config, seq_len, layer_type=layer_type)
                by_key[key] = (Tensor(inv_freq.astype(np.float32)), scaling)
            tables.append(by_key[key])
        return tables

    def prompt_padding_is_exact(self, length: int, padded: int) -> bool:
        """Whether a prompt padded on the right from ``length`` to ``padded`` tokens keeps its own tokens'
        logits and cache entries (generate pads prompts so that prompts of different lengths share a recorded
        prefill): causal attention without state outside the cache (capture_decode), and rotary tables that are
        the same for both lengths (dynamic NTK changes them past the original context)."""
        if not self.capture_decode:
            return False
        for config, layer_type in (self.rope_configs if self.spec.positions.rope else ()):
            short, short_scale = rope_parameters(config, length, layer_type=layer_type)
            long, long_scale = rope_parameters(config, padded, layer_type=layer_type)
            if short_scale != long_scale or not np.array_equal(short, long):
                return False
        return True

    def _query_scale(self, positions: Tensor):
        """Llama 4 / Ministral 3: 1 + beta * log(1 + floor(pos / L)) per position, as [B, 1, T, 1], derived on the
        device from the positions input (which a captured decode step rewrites). Positions below 0 count as 0; the
        floor of the non-negative quotient is its conversion to an integer (which truncates)."""
        if self.spec.positions.query_scale is None:
            return None
        beta, length = self.spec.positions.query_scale
        blocks = (positions.maximum(0).cast(dt.float32) / float(length)).cast(dt.int32).cast(dt.float32)
        scale = (blocks + 1.0).log() * beta + 1.0
        return scale.reshape(positions.shape[0], 1, positions.shape[1], 1)

    def forward(self, input_ids, attention_mask=None, labels=None, position_ids=None, cache=None,
                encoder_hidden_states=None, encoder_attention_mask=None, logits_to_keep=0,
                output_hidden_states=False):
        """transformers' forward; ``output_hidden_states``: also the embeddings and every layer's output, the last
        one after the final norm (as transformers gives them), whatever ``logits_to_keep`` keeps."""
        s = self.spec
        length = np.shape(input_ids)[-1] if not isinstance(input_ids, Tensor) else input_ids.shape[-1]
        if encoder_hidden_states is not None and s.cross_attention is None:
            raise VkformersError(f"{self.architecture_name}: encoder_hidden_states need a decoder with "
                                 "cross-attention (add_cross_attention)")
        encoder = None if encoder_hidden_states is None else (encoder_hidden_states, encoder_attention_mask)
        x, hidden_states = self.recorded_stream(
            output_hidden_states, lambda: self.residual_stream(input_ids, attention_mask, position_ids, cache,
                                                               encoder=encoder))
        logits = self._fused_decode_head(x) if cache is not None and length == 1 and not hidden_states else None
        if logits is None:
            x = self.final_hidden_states(kept_positions(x, logits_to_keep))
            logits = self.lm_logits(x)
        else:
            logits = self._scale_logits(logits)
        if hidden_states:  # the last one after the final norm, at every position
            hidden_states[-1] = self.final_hidden_states(hidden_states[-1])
        if cache is not None:
            cache.advance(length)
        if labels is not None and logits.shape[1] != length:
            raise VkformersError("labels need the logits of every position: leave logits_to_keep at 0")
        loss = None
        if labels is not None:  # in chunks of tokens when the logits are large (models/lm_loss.py)
            loss = causal_lm_loss(x, self.lm_logits, labels, shift=s.shift_labels, logits=logits)
        return CausalLMOutput(logits=logits, loss=loss, hidden_states=tuple(hidden_states) if hidden_states else None)

    def loss_target_count(self, labels) -> int:
        return target_count(labels, self.spec.shift_labels)

    def get_input_embeddings(self) -> Embedding:
        return self.embed

    def get_output_embeddings(self) -> Linear:
        return self.lm_head

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> Embedding:
        """transformers' resize_token_embeddings (after tokenizer.add_tokens): the token embedding and the LM head
        get ``new_num_tokens`` rows (rounded up to ``pad_to_multiple_of``), the new ones at the mean of the old
        (``mean_resizing``; else normal(0, initializer_range)), a tied head with them; config.vocab_size follows.
        Returns the input embeddings."""
        s = self.spec
        rows = s.vocab_size if new_num_tokens is None else new_num_tokens
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < 1:
            raise VkformersError(f"resize_token_embeddings: new_num_tokens must be a whole number >= 1, got {rows!r}")
        if pad_to_multiple_of is not None:
            if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, (int, np.integer)) or \
                    pad_to_multiple_of < 1:
                raise VkformersError(f"resize_token_embeddings: pad_to_multiple_of must be a whole number >= 1, got "
                                     f"{pad_to_multiple_of!r}")
            rows = -(-int(rows) // int(pad_to_multiple_of)) * int(pad_to_multiple_of)
        rows = int(rows)
        if s.embed_extra_rows:
            raise VkformersError(f"{self.architecture_name}: its embedding holds rows past the vocabulary; resizing "
                                 "it is not supported")
        if rows == s.vocab_size:
            return self.embed
        std = float(self.config.get("initializer_range", 0.02))
        weight = self.embed.resize_rows("weight", rows, mean_resizing=mean_resizing, std=std)
        head = self.lm_head._slots["weight"]
        if head.tied_to is not None:  # one tensor, resized with the embedding
            head.shape, head.tensor = weight.shape, weight
        else:
            self.lm_head.resize_rows("weight", rows, mean_resizing=mean_resizing, std=std)
        if "bias" in self.lm_head._slots:  # new logits' biases at the mean of the old (zero without mean_resizing)
            self.lm_head.resize_rows("bias", rows, mean_resizing=mean_resizing, std=0.0)
        self.lm_head.out_features = rows
        self.spec = dataclasses.replace(s, vocab_size=rows)
        self.config["vocab_size"] = rows
        self.forget_captures()  # recorded steps read the old tables
        return self.embed

    def lm_logits(self, x):
        """Final hidden states [..., H] -> logits: the head transform where there is one, lm_head, the logits'
        scale and final softcapping (the loss computes it chunk by chunk)."""
        if self.head_dense is not None:
            x = self.head_norm(F.activation(self.spec.head_transform_act)(self.head_dense(x)))
        return self._scale_logits(self.lm_head(x))

    def _scale_logits(self, logits):
        s = self.spec
        if s.logits_scale != 1.0:
            logits = logits * s.logits_scale
        if s.final_softcap:
            logits = (logits * (1.0 / s.final_softcap)).tanh() * s.final_softcap
        return logits

    def encoder_decoder_cache(self, batch: int, max_len: int, encoder_states, encoder_mask=None) -> EncoderDecoderCache:
        """A cache for decoding over ``encoder_states`` (an encoder-decoder's generate): the self-attention's keys
        and values, and every layer's cross-attention keys and values, computed here once."""
        if self.spec.cross_attention is None:
            raise VkformersError(f"{self.architecture_name}: a decoder without cross-attention (add_cross_attention) "
                                 "attends to no encoder")
        cache = EncoderDecoderCache(self.num_layers, batch, self.num_kv_heads, self.head_dim, max_len, self.dtype,
                                    self.embed.weight.device, encoder_states, encoder_mask)
        cache.fill_cross([layer.cross_keys_values(encoder_states) for layer in self.layers])
        return cache

    def final_hidden_states(self, x):
        """The residual stream after the last layer -> the hidden states the LM head reads (transformers' base
        model's last_hidden_state): final norm, and the projection out of the hidden width where there is one."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def residual_stream(self, input_ids, attention_mask=None, position_ids=None, cache=None, encoder=None):
        """Embeddings and every layer: the residual stream [B, T, hidden] before the final norm. ``encoder``: (the
        encoder's states, their attention mask or None) for the layers' cross-attention."""
        s = self.spec
        ids = input_ids if isinstance(input_ids, Tensor) else Tensor(np.asarray(input_ids, dtype=np.int32))
        if ids.dtype is not dt.int32:
            ids = ids.cast(dt.int32)
        batch, length = ids.shape
        past = cache.position if cache is not None else 0
        mask = _as_numpy(attention_mask)
        if position_ids is None and s.positions.generation == "fairseq" and not isinstance(input_ids, Tensor):
            # as transformers' TrOCR: the ids that are not the pad id are counted (a pad id takes the padding row
            # wherever it stands, attended or not); ids already on the device fall back to the mask's count
            real = np.asarray(input_ids) != s.extra["padding_row"]
            position_ids = np.where(real, np.cumsum(real, axis=1) - 1 + past, -1).astype(np.int32)
        positions = self._positions(batch, length, mask, position_ids, past)

        x = F.embedding(ids, self.embed.weight, padding_idx=self.embed.padding_idx)
        if s.embed_scale != 1.0:
            scale = _round_to(s.embed_scale, self.dtype) if s.embed_scale_in_dtype else s.embed_scale
            x = x * scale
        if self.project_in is not None:
            x = self.project_in(x)
        # One positions input, everything else derived on the GPU: a captured decode step rewrites
        # only this array (models/generation.py), so derived copies must not be separate host inputs.
        position_tensor = Tensor(positions)
        tables = [t for t in (self.position_embed.weight if self.position_embed is not None else None,
                              self.position_table) if t is not None]
        if tables:
            absolute = position_tensor + s.positions.offset if s.positions.offset else position_tensor
            for table in tables:
                x = x + F.embedding(absolute, table)
        if self.embed_norm is not None:
            x = self.embed_norm(x)

        key_padding_mask = None
        if mask is not None and (cache is not None or not mask.all()):
            key_padding_mask = Tensor(lazy.derived_input(_mask_bytes(mask), attention_mask, _mask_bytes), dtype=dt.bool_)
        rope_tables = self._rope_tables(int(positions.max()) + 1) if s.positions.rope else None
        ctx = Context(position_tensor, key_padding_mask, rope_tables, cache,
                      rope_positions=-position_tensor if s.positions.rope_negated else None,
                      query_scale=self._query_scale(position_tensor), host_mask=mask, host_positions=positions,
                      embeddings=x, mask_source=attention_mask, token_ids=ids)
        if encoder is not None:
            ctx.encoder_states = encoder[0]
            source = None if encoder[1] is None else _as_numpy(encoder[1])
            if source is not None and not source.all():
                ctx.encoder_padding_mask = Tensor(_mask_bytes(source), dtype=dt.bool_)
        return self.run_layers(x, ctx)

    def run_layers(self, x, ctx: Context):
        """The layers over the residual stream, embeddings to final norm (a plugin's model may widen the stream
        between them: DeepSeek-V4's hyper-connections), each layer's input kept while recorded_stream records."""
        count = len(self.layers)
        per_part = self.layers_per_part(x, count)
        for i, layer in enumerate(self.layers):
            if self._recorded is not None:
                self._recorded.append(x)
            x = self.call_layer(layer, x, ctx)
            self.submit_part(x, i + 1, count, per_part)
        if self._recorded is not None:
            self._recorded.append(x)
        return x

    def recorded_stream(self, record: bool, run):
        """(``run()``, the hidden states run_layers saw: the embeddings, then each layer's output; None unless
        ``record``). A plugin whose model runs its layers in a loop of its own does not record them: refused."""
        if not record:
            return run(), None
        if type(self).run_layers is not DecoderForCausalLM.run_layers:
            raise VkformersError(f"{self.architecture_name}: output_hidden_states is not supported (its layers run "
                                 "in a loop of the plugin's own); leave it off")
        self._recorded = []
        try:
            return run(), self._recorded
        finally:
            self._recorded = None

    def _fused_decode_head(self, x):
        """Final RMS norm and lm_head of a decode step as one fused product, or None where they differ."""
        norm, head = self.final_norm, self.lm_head
        if (not isinstance(norm, RMSNorm) or self.project_out is not None or self.head_dense is not None
                or type(head) is not Linear or head.has_bias or head.quantized):
            return None
        prologue = fused_norm(norm)
        return F.fused_linear(x, head.weight, norm=prologue) if F.fusable(x, [head.weight], prologue) else None
