"""``Seq2SeqGenerationMixin.generate``: decoding for encoder-decoders, as transformers' ``generate`` runs them.

The encoder runs once; the decoder then takes one token per step over an :class:`EncoderDecoderCache` (its
self-attention keys and values, and each layer's cross-attention keys and values, computed once from the encoder's
states). The next token is chosen on the host as the decoder-only loop chooses it (``pick_next_tokens``).

A model class inheriting the mixin provides

- ``input_limits()`` (``decoder_max_length``, ``decoder_vocab_size``);
- ``generation_encoder_states(ids, mask, **encoder_inputs)``: the encoder's states as the decoder reads them;
- ``generation_cache(batch, max_len, encoder_states, mask)``: a fresh cache, its cross-attention part filled;
- ``generation_step(ids, encoder_states, mask, cache)``: the logits [batch, T, vocab] of decoder tokens ``ids``
  (int64 [batch, T]) after those the cache holds, advancing it;

and optionally ``generation_encoder_inputs`` (the names of the encoder's own inputs generate passes on: LED's
global_attention_mask), ``generation_configs()`` (the dicts settings are read from, first found wins) and
``default_pad_token_id()``.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine.function import no_grad
from vkformers.errors import InputError, VkformersError
from vkformers.models.decode_capture import to_scores
from vkformers.models.generation import end_stream, pick_next_tokens, processed_scores, stream_tokens
from vkformers.models.beam_search import BeamSearch, search_beams
from vkformers.models.generation_settings import (BEAM_ARGUMENTS, RULE_ARGUMENTS, STOP_ARGUMENTS, LogitRules,
                                                 config_value, generation_sources, model_generation_sources,
                                                 resolve_call, sampling_rng)
from vkformers.models.inputs import TRANSFORMERS_ARGUMENTS, check_model_inputs, check_prompt_length, id_array


class Seq2SeqGenerationMixin:
    generation_encoder_inputs: tuple = ()

    def generation_configs(self) -> tuple:
        """Where generate reads its settings (eos, pad, decoder start, ...): the generation config where the
        checkpoint has one, else the config (models/generation_settings.py)."""
        return model_generation_sources(self)

    def generation_setting(self, name: str):
        return config_value(self.generation_configs(), name)

    def default_pad_token_id(self) -> int | None:
        return self.generation_setting("pad_token_id")

    def pad_token(self, given: int | None, eos: list[int]) -> int:
        """The token a finished row is padded with: ``given``, else the config's pad_token_id, else the first eos."""
        pad = self.default_pad_token_id() if given is None else given
        return int(pad) if pad is not None else (eos[0] if eos else 0)

    def decoder_start_token(self, given: int | None = None) -> int:
        """The token the decoder starts from: ``given``, else the generation config's (or config's)
        decoder_start_token_id, else its bos_token_id."""
        start = given
        for name in ("decoder_start_token_id", "bos_token_id"):
            start = self.generation_setting(name) if start is None else start
        if start is None:
            raise VkformersError(f"{getattr(self, 'architecture_name', 'generate')}: no decoder_start_token_id "
                                 "(config or argument)")
        return int(start)

    def generate(self, input_ids, max_new_tokens: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None, eos_token_id=None,
                 attention_mask=None, decoder_start_token_id: int | None = None, pad_token_id: int | None = None,
                 output_logits: bool = False, min_p: float | None = None, streamer=None, **encoder_inputs):
        """Decoder tokens [batch, 1 + new] (int64), decoder_start_token_id first, as transformers returns them.

        Greedy unless ``do_sample`` (temperature, top-k, top-p; ``sampling_rng(seed)``); the
        repetition penalty counts the decoder's tokens. ``eos_token_id`` (default: the config's): a row that
        produced it is finished and gets ``pad_token_id`` from then on (default: the config's, else the first eos);
        generation stops when every row is finished. Without ``attention_mask`` the input's pad tokens are masked
        (pad differing from eos), as transformers infers it. The decoder starts from ``decoder_start_token_id``
        (default: the config's, else its bos_token_id). ``output_logits``: also each step's logits [new, batch,
        vocab]. transformers' length arguments are taken as GenerationMixin.generate takes them, counting the
        decoder's tokens (its start token included: max_length=20 gives 19 new), and so are the logits processors
        of models/generation_settings.py (``forced_bos_token_id``, ``no_repeat_ngram_size``, ...); what the call
        leaves out comes from the generation config, then transformers' defaults, as the decoder-only generate
        resolves them. Other keyword arguments go to the encoder, where the model takes them (LED's
        global_attention_mask). ``streamer`` (TextStreamer, TextIteratorStreamer or a callable): the decoder's start
        token, then each step's tokens, as transformers hands an encoder-decoder's to it (not with beam search)."""
        options = {k: encoder_inputs.pop(k) for k in list(encoder_inputs) if k not in self.generation_encoder_inputs}
        unknown = sorted(k for k in options if k not in TRANSFORMERS_ARGUMENTS and k not in RULE_ARGUMENTS
                         and k not in BEAM_ARGUMENTS and k not in STOP_ARGUMENTS)
        if unknown:
            raise InputError(f"generate: {getattr(self, 'architecture_name', type(self).__name__)} takes no "
                             f"{unknown[0]}; leave it out")
        sources = generation_sources(self)
        settings, lengths, given_rules, beam = resolve_call(
            sources, options, max_new_tokens, 1, beams=True, do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
        do_sample, temperature, top_k, top_p, min_p, repetition_penalty = settings.values()
        max_new_tokens = lengths.max_new_tokens
        limits = self.input_limits()
        check_model_inputs(limits, {"input_ids": input_ids, "attention_mask": attention_mask})
        check_prompt_length(limits, 1, max_new_tokens, decoder=True)
        if beam.num_beams > 1 and output_logits:
            raise InputError("generate: output_logits with beam search is not supported; leave one of them out")
        if beam.num_beams > 1 and streamer is not None:
            raise InputError(f"generate: a streamer cannot follow beam search (num_beams={beam.num_beams}: a beam's "
                             "tokens change until it ends); pass num_beams=1 or leave the streamer out")
        ids = id_array(input_ids)
        copies = beam.num_beams if beam.num_beams > 1 else lengths.num_return_sequences  # rows per prompt
        if attention_mask is not None:
            attention_mask = np.repeat(id_array(attention_mask), copies, axis=0)
        ids = np.repeat(ids, copies, axis=0)
        if copies > 1:  # LED's global_attention_mask: one row per returned sequence (or beam) too
            encoder_inputs = {k: np.repeat(v.numpy() if hasattr(v, "numpy") else np.asarray(v), copies, axis=0)
                              for k, v in encoder_inputs.items()}
        batch = ids.shape[0]
        eos = self.generation_setting("eos_token_id") if eos_token_id is None else eos_token_id
        eos = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple, np.ndarray)) else [eos])]
        pad = self.pad_token(pad_token_id, eos)
        if attention_mask is not None:
            mask = id_array(attention_mask)
        elif pad in ids and pad not in eos:
            mask = (ids != pad).astype(np.int64)
        else:
            mask = np.ones_like(ids)
        start = self.decoder_start_token(decoder_start_token_id)
        rules = LogitRules.resolve(sources, given_rules, start_length=1, max_length=1 + max_new_tokens, eos=eos,
                                   beams=beam.num_beams)
        rng = sampling_rng(seed)
        tokens = np.full((batch, 1), int(start), np.int64)
        if hasattr(streamer, "put"):
            streamer.put(tokens)
        step_logits = []
        with no_grad():
            states = self.generation_encoder_states(ids, mask, **encoder_inputs)
            cache = self.generation_cache(batch, 1 + max(max_new_tokens, 1), states, mask)
            if beam.num_beams > 1:
                search = BeamSearch(tokens[::beam.num_beams], beam.num_beams, 1 + max_new_tokens, eos, pad,
                                    beam.length_penalty, beam.early_stopping, lengths.num_return_sequences)
                return self._search_beams(search, states, mask, cache, repetition_penalty, rules,
                                          eos, lengths.min_new_tokens)
            unfinished = np.ones(batch, bool)
            next_input = tokens
            for step in range(max_new_tokens):
                logits = self.generation_step(next_input, states, mask, cache)
                scores = to_scores(logits[:, logits.shape[1] - 1].contiguous().numpy())
                step_logits.append(scores)
                chosen = pick_next_tokens(scores, tokens, do_sample, rng, temperature, top_k, top_p,
                                          repetition_penalty, eos if step < lengths.min_new_tokens else (), rules,
                                          min_p)
                chosen = np.where(unfinished, chosen, pad).astype(np.int64)
                tokens = np.concatenate([tokens, chosen[:, None]], axis=1)
                stream_tokens(streamer, chosen)
                if eos:
                    unfinished &= ~np.isin(chosen, eos)
                unfinished &= ~rules.finished(tokens)
                if not unfinished.any():
                    break
                next_input = chosen[:, None]
        end_stream(streamer)
        if output_logits:
            vocab = limits.decoder_vocab_size or limits.vocab_size
            return tokens, np.stack(step_logits) if step_logits else np.zeros((0, batch, vocab), np.float32)
        return tokens

    def _search_beams(self, search: BeamSearch, states, mask, cache, repetition_penalty, rules, eos,
                      min_new_tokens: int) -> np.ndarray:
        """generate's beam search (models/beam_search.py), the cache's rows following the beams."""
        def step_scores(tokens):
            logits = self.generation_step(tokens[:, -1:], states, mask, cache)
            return to_scores(logits[:, logits.shape[1] - 1].contiguous().numpy())

        def advance(rows, tokens):
            cache.reorder_rows(rows)
            return step_scores(tokens)
        return search_beams(search, step_scores(search.sequences), lambda scores, tokens: processed_scores(
            scores, tokens, repetition_penalty, eos if tokens.shape[1] - 1 < min_new_tokens else (), rules), advance)
