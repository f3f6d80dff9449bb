"""``GenerationMixin.generate``: autoregressive decoding with a KV cache, as transformers' ``generate``.

One forward over the prompt fills the cache (prefill); then each new token is one forward of
a single position. That decode forward builds the same graph every step (the cache reads its
position from a small uploaded tensor), so it is recorded once and replayed for every later
token (models/decode_capture.py). Choosing the next token runs on the host in numpy, on the last
position's logits (``[batch, vocab]`` read back per step), with transformers' semantics and order:
repetition penalty, then (when sampling) temperature, top-k, top-p. Plain greedy decoding on a GPU
chains CHAIN_STEPS replays per submission instead, the GPU taking the argmax between them.

A model class inheriting the mixin provides ``num_layers``, ``num_kv_heads``, ``head_dim``,
``max_position_embeddings`` and ``dtype``; optionally ``recompute_cache_beyond`` (an int: when the
sequence first grows past that length, the cache is dropped and the whole sequence recomputed
once, as transformers' Phi-3 does for its longrope tables); and a forward
``model(input_ids, attention_mask=None, position_ids=None, cache=None)`` returning an object
with ``logits`` [batch, T, vocab] that calls ``cache.attend`` in its attention layers and
``cache.advance(T)`` once at the end.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.function import no_grad
from vkformers.engine.tensor import Tensor
from vkformers.models.assisted import (AssistedGenerationError, AssistedSettings, AssistedStats, assisted_decode,
                                       pop_assisted_settings)
from vkformers.models.beam_search import BeamSearch, log_softmax, search_beams
from vkformers.models.cache import KVCache
from vkformers.errors import InputError
from vkformers.models.decode_capture import DecodeCapture, capture_key, to_scores
from vkformers.models.generation_settings import (GenerateDecoderOnlyOutput, LogitRules, config_value,
                                                   generation_sources, pop_output_request, resolve_call, sampling_rng)
from vkformers.models.generation_settings import softmax64 as _softmax
from vkformers.models.inputs import check_model_inputs, check_prompt_length
from vkformers.runtime import dtypes as dt

PREFILL_CAPTURES = 4  # prompt lengths whose recorded prefill a model keeps
# A model whose prompt_padding_is_exact(length, padded) allows it pads a prompt on the right to a multiple of this
# (causal attention: the padding changes none of the prompt's logits, and the cache forgets it), so that prompts of
# different lengths share one recorded prefill: on a GPU a 22-layer prefill's Python graph costs more than its
# GPU time, and up to 63 more tokens cost little. A CPU device computes every padding token at full cost: 0, off.
PREFILL_BUCKET = {"gpu": 64, "cpu": 0}
CACHE_ROUNDING = 128  # cache lengths round up to this, so that similar calls reuse the cache (and its plans)
CHUNK_CAPTURES = 8  # token counts of forwards after stored ones (assisted generation) whose recorded plan is kept
# Whether assisted generation pads a verification forward to a power of two tokens, so that drafts of any length
# replay a few recorded plans: on a GPU a forward's Python graph costs more than the GPU time of a few more tokens
# (a small batch's product reads the weights once whatever its rows). A CPU device computes the padding at full cost.
DRAFT_PADDING = {"gpu": True, "cpu": False}
# Greedy decode steps per submission once the step is captured (the GPU chooses the tokens in between). None:
# 8 on a GPU; 1 on a CPU device, whose own work hides the host's round trip (lavapipe measured no gain) and where
# a streamer would otherwise get its tokens in bursts seconds apart.
CHAIN_STEPS: int | None = None


class GenerationMixin:
    # whether forward takes ``logits_to_keep`` (kept_positions): prefills then compute only the logits they read
    accepts_logits_to_keep = False

    def generate(self, input_ids, max_new_tokens: int | None = None, do_sample: bool | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None, eos_token_id=None,
                 attention_mask=None, streamer=None, pad_token_id: int | None = None, min_p: float | None = None,
                 **options):
        """Prompt + up to ``max_new_tokens`` new tokens per row (20 by default), as a numpy int64 array
        [batch, T + new].

        input_ids: [batch, T] (or [T]); batched prompts of different lengths are left-padded, with
        ``attention_mask`` (1 = token, 0 = padding; default all ones). Positions are
        ``cumsum(attention_mask) - 1`` as in transformers. Greedy unless ``do_sample``; sampling draws
        from ``sampling_rng(seed)`` (deterministic for a given seed). ``eos_token_id``
        (int or list; default: the model's generation_config, else its config): a row that produced
        one is finished and gets ``pad_token_id`` from then on; generation stops when every row is
        finished. ``streamer``: a callable given each step's new tokens ([batch] int64), or an
        object with transformers' ``put``/``end`` methods (put first receives the prompt).
        transformers' ``max_length``, ``min_length``, ``min_new_tokens``, ``num_return_sequences`` (rows of a
        prompt follow each other) and ``use_cache`` are taken too (inputs.generation_lengths), and the logits
        processors of models/generation_settings.py (``no_repeat_ngram_size``, ``bad_words_ids``,
        ``forced_bos_token_id``, ...), beam search (``num_beams``, models/beam_search.py) and ``stop_strings``
        with ``tokenizer``. What the call leaves out comes from the model's generation config, then
        transformers' defaults (sampling keeps the 50 likeliest tokens unless top_k says otherwise).
        ``return_dict_in_generate=True``: a GenerateDecoderOnlyOutput instead of the array, with each step's
        scores (``output_scores``) and raw logits (``output_logits``) where asked for. ``prompt_lookup_num_tokens``
        or ``assistant_model`` (one row): transformers' assisted generation (models/assisted.py).
        """
        ids = np.asarray(input_ids.numpy() if hasattr(input_ids, "numpy") else input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        options = dict(options)
        output = pop_output_request(options)
        assisted = pop_assisted_settings(options)
        sources = generation_sources(self)
        settings, lengths, given_rules, beam = resolve_call(
            sources, options, max_new_tokens, ids.shape[-1], beams=self.runs_beam_search(), do_sample=do_sample,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
        do_sample, temperature, top_k, top_p, min_p, repetition_penalty = settings.values()
        max_new_tokens = lengths.max_new_tokens
        mask = None if attention_mask is None else np.asarray(
            attention_mask.numpy() if hasattr(attention_mask, "numpy") else attention_mask)
        limits = self.input_limits()
        if limits is not None:
            check_model_inputs(limits, {"input_ids": ids, "attention_mask": mask})
            check_prompt_length(limits, ids.shape[1], max_new_tokens)
        elif ids.ndim != 2 or ids.shape[1] == 0:
            raise InputError(f"generate: input_ids must be [batch, length] with length >= 1, got {ids.shape}")
        ids = ids.astype(np.int64)
        mask = np.ones_like(ids) if mask is None else mask.astype(np.int64)
        if mask.shape != ids.shape:
            raise InputError(f"generate: attention_mask {mask.shape} does not match input_ids {ids.shape}")
        beams = beam.num_beams if beam.num_beams > 1 else 0
        if beams and output.records:
            raise InputError("generate: output_scores and output_logits with beam search are not supported; leave "
                             "them out (return_dict_in_generate alone gives the sequences)")
        if beams and streamer is not None:
            raise InputError("generate: a streamer cannot follow beam search (a beam's tokens change until it "
                             "ends); leave the streamer or num_beams out")
        if assisted is not None:
            self._check_assisted(assisted, ids.shape[0], beams, lengths.num_return_sequences)
            object.__setattr__(self, "assisted_stats", AssistedStats())  # this call's (none where it makes no token)
        ids, mask = (np.repeat(a, beams or lengths.num_return_sequences, axis=0) for a in (ids, mask))
        batch, length = ids.shape
        eos = _eos_ids(self, eos_token_id)
        pad = _pad_id(self, pad_token_id, eos)
        rules = LogitRules.resolve(sources, given_rules, start_length=length, max_length=length + max_new_tokens,
                                   eos=eos, beams=beams or 1)
        rng = sampling_rng(seed)
        if hasattr(streamer, "put"):
            streamer.put(ids)
        if max_new_tokens == 0:
            end_stream(streamer)
            return _generate_output(ids, output, [], [])

        cache = self._generation_cache(batch, length + max_new_tokens, chunks_replay=assisted is not None)
        positions = self.generation_positions(mask, ids, length)
        unfinished = np.ones(batch, bool)
        tokens = ids
        recompute_beyond = getattr(self, "recompute_cache_beyond", None)
        capture_limit = self.max_position_embeddings if self.replays_decode() else 0
        # a step that is not replayed is held for no later call either (its states may not be kept in place)
        key = capture_key(self, cache) if capture_limit else None
        decode = self._decode_capture(cache, key)
        # a recorded prefill may serve later prompts of its shape: ids, positions and the padding mask are its
        # inputs, everything else follows from the shape (Phi-3's recomputation point aside)
        capturable = capture_limit and recompute_beyond is None
        bucket = PREFILL_BUCKET["cpu" if cache.device.is_cpu else "gpu"]
        padded = _padded_length(self, length, bucket, min(cache.max_len, capture_limit)) if capturable else None
        prefill = self._prefill_capture(cache, padded or length, padded is not None, key) if capturable else None
        # the GPU may pick the tokens (not where each step's scores are returned)
        greedy = not do_sample and repetition_penalty == 1.0 and not rules.picks_on_host and not output.records
        chosen = []  # tokens the GPU already chose in a chained replay (the steps for them ran)
        step_scores, step_logits = [], []  # output_scores, output_logits
        padding = prompt_padding(mask)  # what the repetition penalty passes over
        with no_grad():
            logits = self._prefill(ids, mask, positions, cache, prefill, padded)
            if beams:
                search = BeamSearch(ids[::beams], beams, length + max_new_tokens, eos, pad, beam.length_penalty,
                                    beam.early_stopping, lengths.num_return_sequences)
                return _generate_output(self._search_beams(search, logits, mask, cache, decode, repetition_penalty,
                                                           rules, eos, lengths.min_new_tokens, padding),
                                        output, [], [])
            if assisted is not None:
                choice = TokenChoice(do_sample, temperature, top_k, top_p, min_p, repetition_penalty, rules, padding,
                                     eos, lengths.min_new_tokens, length, logits.shape[-1])

                def on_token(token: int, scores: np.ndarray, raw: np.ndarray) -> None:
                    stream_tokens(streamer, np.array([token], np.int64))
                    if output.scores:
                        step_scores.append(scores)
                    if output.logits:
                        step_logits.append(raw)
                tokens, stats = assisted_decode(self, assisted, logits, ids, mask, cache, decode, choice,
                                                max_new_tokens, eos, rng, on_token,
                                                DRAFT_PADDING["cpu" if cache.device.is_cpu else "gpu"])
                object.__setattr__(self, "assisted_stats", stats)
                end_stream(streamer)
                return _generate_output(tokens, output, step_scores, step_logits)
            for step in range(max_new_tokens):
                stepped = bool(chosen)  # a token the GPU chose: the chain also ran its step
                suppress = eos if step < lengths.min_new_tokens else ()
                if stepped:
                    next_tokens = chosen.pop(0)
                elif output.records:
                    scores = processed_scores(logits, tokens, repetition_penalty, suppress, rules, padding)
                    warped = warped_scores(scores, temperature, top_k, top_p, min_p, rules) if do_sample \
                        else scores
                    next_tokens = _draw(_softmax(warped), rng) if do_sample else scores.argmax(axis=-1)
                    if output.scores:
                        step_scores.append(warped)
                    if output.logits:
                        step_logits.append(logits)
                else:
                    next_tokens = pick_next_tokens(logits, tokens, do_sample, rng, temperature, top_k, top_p,
                                                   repetition_penalty, suppress, rules, min_p, padding)
                next_tokens = np.where(unfinished, next_tokens, pad).astype(np.int64)
                tokens = np.concatenate([tokens, next_tokens[:, None]], axis=1)
                stream_tokens(streamer, next_tokens)
                if eos:
                    unfinished &= ~np.isin(next_tokens, eos)
                unfinished &= ~rules.finished(tokens)
                if not unfinished.any() or step == max_new_tokens - 1:
                    break
                mask = np.concatenate([mask, np.ones((batch, 1), mask.dtype)], axis=1)
                if stepped:
                    continue  # its step ran in the chain that chose it
                if recompute_beyond is not None and cache.position <= recompute_beyond < tokens.shape[1]:
                    # the model's positional tables change for every token past this length (Phi-3
                    # longrope): as transformers does, drop the cache and recompute the whole sequence once
                    decode.forget()
                    cache.reset()
                    positions = self.generation_positions(mask, tokens, length)
                    keep = {"logits_to_keep": 1} if self.accepts_logits_to_keep else {}
                    logits = _last_logits(self(tokens, attention_mask=mask, position_ids=positions, cache=cache,
                                               **keep))
                    continue
                # int32 arrays the model turns into its input tensors as they are: a captured step finds them
                step_ids = next_tokens[:, None].astype(np.int32)
                step_positions = self.generation_positions(mask, tokens, length)[:, -1:].astype(np.int32)
                if decode.ready and tokens.shape[1] <= capture_limit:
                    # greedy: chain steps in one submission, the GPU choosing the tokens in between, while the
                    # sequence stays short of the capture limit and of the Phi-3 recomputation point
                    steps = min(_chain_steps(cache.device), max_new_tokens - 1 - step,
                                capture_limit - tokens.shape[1] + 1)
                    if recompute_beyond is not None and cache.position <= recompute_beyond:
                        steps = min(steps, recompute_beyond - tokens.shape[1] + 1)
                    if greedy and steps > 1 and step + 1 >= lengths.min_new_tokens:  # the GPU's picks hold no eos back
                        result = decode.run_chain(step_ids, step_positions, steps)
                        if result is not None:
                            logits, chosen = result
                            continue
                    logits = decode.run(step_ids, step_positions)
                    if logits is not None:
                        continue
                logits = self.decode_step(decode, cache, step_ids, step_positions, mask, replay=False)
        end_stream(streamer)
        return _generate_output(tokens, output, step_scores, step_logits)

    def compute_transition_scores(self, sequences, scores, normalize_logits: bool = False) -> np.ndarray:
        """transformers' ``compute_transition_scores`` without beams: each generated token's score [batch, new]
        from generate's ``sequences`` and ``scores`` (return_dict_in_generate, output_scores); with
        ``normalize_logits``, log-softmax of each step's scores first (log-probabilities)."""
        sequences = np.asarray(sequences.numpy() if hasattr(sequences, "numpy") else sequences)
        steps = np.stack([np.asarray(s, np.float32) for s in scores])  # [new, batch, vocab]
        if normalize_logits:
            steps = log_softmax(steps)
        new = sequences[:, sequences.shape[1] - steps.shape[0]:]
        return np.take_along_axis(steps.transpose(1, 0, 2), new[:, :, None], axis=-1)[..., 0]

    def _check_assisted(self, assisted: AssistedSettings, batch: int, beams: int, num_return_sequences: int) -> None:
        """What assisted generation refuses, as transformers does: several rows, beam search, models whose cache
        cannot forget rejected draft tokens, and an assistant that is no causal LM of this model's vocabulary."""
        if beams:
            raise AssistedGenerationError(f"generate: assisted generation cannot run beam search (num_beams={beams});"
                                          " use num_beams=1, or leave assistant_model and prompt_lookup_num_tokens out")
        if num_return_sequences > 1 or batch > 1:
            raise AssistedGenerationError(
                f"generate: assisted generation runs one sequence at a time, as in transformers (batch size "
                f"{batch}, num_return_sequences {num_return_sequences}); call generate once per prompt and sequence")
        for role, model in (("this model", self), ("the assistant", assisted.assistant)):
            if model is None:
                continue
            if not isinstance(model, GenerationMixin) or getattr(model, "is_encoder_decoder", False):
                raise AssistedGenerationError(f"generate: assistant_model must be a vkformers causal LM (as "
                                              f"AutoModelForCausalLM loads), got {type(model).__name__}")
            if not model.runs_beam_search():
                raise AssistedGenerationError(
                    f"generate: {role} ({type(model).__name__}) keeps state besides keys and values (a recurrent "
                    "layer's) or recomputes its positions, so its cache cannot forget rejected draft tokens; "
                    "generate without assistant_model and prompt_lookup_num_tokens")
        if assisted.assistant is not None:
            vocab, theirs = _vocab_size(self), _vocab_size(assisted.assistant)
            if vocab is not None and theirs is not None and vocab != theirs:
                raise AssistedGenerationError(
                    f"generate: the assistant's vocabulary ({theirs} tokens) is not this model's ({vocab}): its draft "
                    "tokens would mean other text; use an assistant trained with this model's tokenizer")

    def runs_beam_search(self) -> bool:
        """Whether generate runs beam search for this model: its cache rows can follow the beams (keys and values
        only, no recurrent state) and its positions need no recomputation (Phi-3's longrope)."""
        return (not getattr(self, "keeps_row_states", False) and getattr(self, "recompute_cache_beyond", None) is None
                and getattr(getattr(self, "spec", None), "linear_attention", None) is None
                and not getattr(self, "attention_free", False))

    def _search_beams(self, search: BeamSearch, logits, mask, cache, decode, repetition_penalty, rules, eos,
                      min_new_tokens: int, padding: np.ndarray | None = None) -> np.ndarray:
        """generate's beam search (models/beam_search.py) from the prefill's ``logits``: each decode step (replayed
        once recorded) on the rows the beams continue, the cache's rows following them."""
        prompt_length = search.prompt_length

        def advance(rows, tokens):
            nonlocal mask  # the attention mask follows the rows, one more column each step
            cache.reorder_rows(rows)
            mask = np.concatenate([mask[rows], np.ones((len(rows), 1), mask.dtype)], axis=1)
            positions = self.generation_positions(mask, tokens, prompt_length)[:, -1:].astype(np.int32)
            return self.decode_step(decode, cache, tokens[:, -1:].astype(np.int32), positions, mask)
        return search_beams(search, logits, lambda scores, tokens: processed_scores(
            scores, tokens, repetition_penalty, eos if tokens.shape[1] - prompt_length < min_new_tokens else (), rules,
            padding), advance)

    def replays_decode(self) -> bool:
        """Whether generate records its decode step once and replays it: ``capture_decode`` (the step depends on
        nothing outside its inputs and the cache), or ``capture_decode_with_row_states`` (so too once the layers'
        recurrent states live in persistent buffers overwritten in place, as generate's cache keeps them)."""
        return bool(getattr(self, "capture_decode", True) or getattr(self, "capture_decode_with_row_states", False))

    def decode_step(self, decode: "DecodeCapture", cache: KVCache, step_ids: np.ndarray, step_positions: np.ndarray,
                    mask: np.ndarray, replay: bool = True) -> np.ndarray:
        """One decode step of every row: ``step_ids`` and ``step_positions`` (int32 [batch, 1]) in, the logits
        (float32 [batch, vocab]) out. ``decode`` replays its recorded step when it is ready (and ``replay``), else
        the model's forward runs and ``decode`` watches it. ``mask``: the attention mask over every token so far,
        the new ones included ([batch, stored + 1])."""
        if replay and decode.ready:
            logits = decode.run(step_ids, step_positions)
            if logits is not None:
                return logits
        with lazy.capture() as seen:
            out = self(step_ids, attention_mask=mask, position_ids=step_positions, cache=cache)
            last = _last_position(out)
            del out
            logits = to_scores(last.numpy())
        decode.observe(seen.runs, step_ids, step_positions, last)
        return logits

    def generation_positions(self, mask: np.ndarray, tokens: np.ndarray, prompt_length: int) -> np.ndarray:
        """The positions [batch, T] of every token so far (the prompt's first ``prompt_length``), as the model sees
        them under transformers' generate: the position_ids generate passes (cumsum(attention_mask) - 1). A model
        whose forward reads no position_ids (and counts the tokens itself) overrides this."""
        return _positions(mask)

    def forget_captures(self) -> None:
        """Drop the recorded prefill and decode steps that later generate calls would replay. Their key covers
        the parameters, the cache and the mode, not a module setting that changes the graph (the experts mode
        of vkformers_moe.block.set_experts_mode, say): after such a change, call this."""
        object.__setattr__(self, "_held_decode", None)
        object.__setattr__(self, "_held_prefill", None)
        object.__setattr__(self, "_held_chunks", None)
        object.__setattr__(self, "_held_draft", None)

    def _decode_capture(self, cache: KVCache, key) -> "DecodeCapture":
        """The captured decode step of the last generate when it still applies (same cache, same parameter
        buffers, all realized, same mode and fused-kernel switch), so that a later call replays from its first
        decode step instead of building and confirming two steps in Python (~40 ms each for a 22-layer model);
        else a new capture. ``key``: :func:`capture_key` of this model and cache."""
        held = getattr(self, "_held_decode", None)
        if key is not None and held is not None and held[0] == key:
            return held[1]
        decode = DecodeCapture(cache)
        object.__setattr__(self, "_held_decode", (key, decode) if key is not None else None)
        return decode

    def prefill(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, cache: KVCache,
                capture: DecodeCapture | None = None) -> np.ndarray:
        """The forward of left-padded prompts ``ids`` [batch, T] (``mask``: 1 = token, over the cache's stored
        tokens and these) into ``cache``: the last position's logits, float32 [batch, vocab]. ``capture`` (a
        DecodeCapture of ``tokens`` T on this cache, for calls of this shape only): replays its recorded plan once
        two calls confirmed it (the caller sees to it that nothing else in the graph changes between them)."""
        return self._prefill(ids, mask, positions, cache, capture)

    def _prefill(self, ids, mask, positions, cache: KVCache, capture: "DecodeCapture | None",
                 padded: int | None = None) -> np.ndarray:
        """The prompt's forward into the cache: the last position's logits (float32 [batch, vocab]). With a
        capture, a prompt of a shape two earlier calls ran replays their plan without the Python forward;
        ``padded`` (>= the prompt's length, or None): the prompt runs padded on the right to that length
        (repeating its last token), its last real token's logits are picked on the GPU by an input (so prompts
        of every length up to ``padded`` share one plan), and the cache forgets the padding."""
        keep = {"logits_to_keep": 1} if self.accepts_logits_to_keep else {}
        if capture is None:
            return _last_logits(self(ids, attention_mask=mask, position_ids=positions, cache=cache, **keep))
        # int32 arrays the model turns into its input tensors as they are: the capture finds them in the plan
        ids, positions = ids.astype(np.int32), positions.astype(np.int32)
        batch, length = ids.shape
        extra = (padded or length) - length
        rows = None if padded is None else np.arange(batch, dtype=np.int32) * padded + (length - 1)
        if extra:
            ids = np.ascontiguousarray(np.concatenate([ids, np.repeat(ids[:, -1:], extra, axis=1)], axis=1))
            positions = np.ascontiguousarray(np.concatenate(
                [positions, positions[:, -1:] + np.arange(1, extra + 1, dtype=np.int32)], axis=1))
            mask = np.concatenate([mask, np.ones((batch, extra), mask.dtype)], axis=1)
        if capture.ready:
            logits = capture.run(ids, positions, rows, mask)
            if logits is not None:
                cache.rewind(extra)
                return logits
        if rows is not None and self.accepts_logits_to_keep:
            keep = {"logits_to_keep": Tensor(rows)}
        with lazy.capture() as seen:
            out = self(ids, attention_mask=mask, position_ids=positions, cache=cache, **keep)
            picked = rows is None or self.accepts_logits_to_keep
            last = _last_position(out) if picked else _positions_logits(out, rows)
            del out  # the logits buffer is the plan's: holding it would force a copy at the next replay
            logits = to_scores(last.numpy())
        capture.observe(seen.runs, ids, positions, last, rows)
        cache.rewind(extra)
        return logits

    def _forward_tokens(self, cache: KVCache, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, key,
                        padded: int | None = None) -> tuple[np.ndarray, bool]:
        """The forward of ``ids`` [batch, T] after the tokens ``cache`` stores (a draft verified, an assistant
        catching up): every position's logits, float32 [batch, T, vocab], and whether a recorded plan ran it
        instead of the Python forward. The plan is recorded per token count once two forwards confirmed it, which
        needs the cache's ``chunks_replay`` and a ``key`` (capture_key of this model and cache; None: never
        recorded). ``padded`` (>= T): run padded on the right to that many tokens (the last one repeated), so that
        drafts of several lengths share one plan: causal attention leaves the real tokens' logits as they are, and
        the cache holds the padding until the caller crops it. ``mask``: over the stored tokens and these."""
        batch, length = ids.shape
        extra = (padded or length) - length
        # int32 arrays the model turns into its input tensors as they are: the capture finds them in the plan
        ids, positions = ids.astype(np.int32), positions.astype(np.int32)
        if extra:
            ids = np.ascontiguousarray(np.concatenate([ids, np.repeat(ids[:, -1:], extra, axis=1)], axis=1))
            positions = np.ascontiguousarray(np.concatenate(
                [positions, positions[:, -1:] + np.arange(1, extra + 1, dtype=np.int32)], axis=1))
            mask = np.concatenate([mask, np.ones((batch, extra), mask.dtype)], axis=1)
        capture = self._chunk_capture(cache, length + extra, key) if cache.chunks_replay else None
        if capture is not None and capture.ready:
            logits = capture.run(ids, positions)
            if logits is not None:
                return logits.reshape(batch, length + extra, -1)[:, :length], True
        with lazy.capture() as seen:
            out = self(ids, attention_mask=mask, position_ids=positions, cache=cache)
            every = out.logits.contiguous()
            del out  # the logits buffer is the plan's: holding it would force a copy at the next replay
            logits = to_scores(every.numpy())
        if capture is not None:
            capture.observe(seen.runs, ids, positions, every)
        return logits[:, :length], False

    def _chunk_capture(self, cache: KVCache, tokens: int, key) -> "DecodeCapture | None":
        """The capture of forwards of ``tokens`` tokens after stored ones on this cache (CHUNK_CAPTURES kept, the
        least recently used dropped first), or None without a ``key``."""
        if key is None:
            return None
        captures = getattr(self, "_held_chunks", None)
        if captures is None:
            captures = {}
            object.__setattr__(self, "_held_chunks", captures)
        capture = captures.pop((key, tokens), None) or DecodeCapture(cache, tokens=tokens, across_positions=True)
        captures[key, tokens] = capture
        while len(captures) > CHUNK_CAPTURES:
            captures.pop(next(iter(captures)))
        return capture

    def _prefill_capture(self, cache: KVCache, length: int, padded: bool, key) -> "DecodeCapture | None":
        """The prefill capture for prompts of ``length`` tokens on this cache, run ``padded`` (with the input that
        picks each row's last token) or not (the PREFILL_CAPTURES shapes used most recently are kept; a change of
        ``key``, as for the decode capture, drops them all), or None while a parameter has pending updates."""
        if key is None:
            return None
        held = getattr(self, "_held_prefill", None)
        if held is None or held[0] != key:
            held = (key, {})
            object.__setattr__(self, "_held_prefill", held)
        captures = held[1]
        capture = captures.pop((length, padded), None) or DecodeCapture(cache, tokens=length)
        captures[length, padded] = capture  # least recently used first
        while len(captures) > max(PREFILL_CAPTURES, 1):
            captures.pop(next(iter(captures)))
        return capture

    def _generation_cache(self, batch: int, length: int, chunks_replay: bool = False) -> KVCache:
        """A reset KV cache for ``batch`` rows of up to ``length`` tokens; reused across calls when it fits,
        so that a later generate replays the decode step recorded by an earlier one. ``chunks_replay``: the
        cache's setting of that name (assisted generation's verification forwards replay)."""
        cache = getattr(self, "_kv_cache", None)
        if cache is None or cache.batch != batch or cache.max_len < length or cache.dtype != _dtype(self):
            object.__setattr__(self, "_kv_cache", None)  # free the old buffers before allocating new ones
            object.__setattr__(self, "_held_decode", None)  # (its recorded step holds them too)
            object.__setattr__(self, "_held_prefill", None)
            object.__setattr__(self, "_held_chunks", None)
            del cache
            cache = _new_cache(self, batch, length)
            object.__setattr__(self, "_kv_cache", cache)
        return self._ready_cache(cache, chunks_replay)

    def _ready_cache(self, cache: KVCache, chunks_replay: bool) -> KVCache:
        if self.replays_decode():
            cache.keep_states_in_place()  # every decode step reads and writes the same buffers: it replays
        cache.chunks_replay = chunks_replay
        cache.reset()
        return cache

    def _draft_state(self, length: int) -> tuple[KVCache, "DecodeCapture", object]:
        """This model drafting for another (assisted generation): a reset cache of its own for one row of up to
        ``length`` tokens (apart from the one generate decodes on, so that a model may assist itself), the decode
        capture that replays its steps and their capture key; all kept for the next call while they fit."""
        held = getattr(self, "_held_draft", None)
        cache = held[0] if held is not None else None
        if cache is None or cache.max_len < length or cache.dtype != _dtype(self):
            object.__setattr__(self, "_held_draft", None)
            del held, cache
            cache = _new_cache(self, 1, length)
            held = (cache, None, None)
        cache = self._ready_cache(cache, chunks_replay=True)
        key = capture_key(self, cache) if self.replays_decode() else None
        decode = held[1] if key is not None and held[2] == key else DecodeCapture(cache)
        object.__setattr__(self, "_held_draft", (cache, decode, key))
        return cache, decode, key


# ---------------------------------------------------------------- model attributes

def _new_cache(model, batch: int, length: int) -> KVCache:
    """A KV cache for ``model``: ``batch`` rows of ``length`` tokens rounded up to CACHE_ROUNDING."""
    max_len = -(-length // CACHE_ROUNDING) * CACHE_ROUNDING
    # a model without attention (attention_free): no key/value layers, the cache holds its states only
    layers, kv_heads, head_dim = ((0, 1, 1) if getattr(model, "attention_free", False)
                                  else (model.num_layers, model.num_kv_heads, model.head_dim))
    return KVCache(layers, batch, kv_heads, head_dim, max_len, _dtype(model), _device(model))


def _chain_steps(device) -> int:
    return CHAIN_STEPS if CHAIN_STEPS is not None else (1 if device.is_cpu else 8)


def _positions(mask: np.ndarray) -> np.ndarray:
    """transformers' generate positions: cumsum(attention_mask) - 1, with 0 at padding (5.x; 4.x put 1 there). Most
    models never let a padded position reach a real token; those that do (DeepSeek-V4's compressed entries pool the
    padded tokens' states) depend on it."""
    positions = np.cumsum(mask, axis=1) - 1
    positions[mask == 0] = 0
    return positions


def _dtype(model):
    return dt.as_dtype(getattr(model, "dtype", None) or "float32")


def _device(model):
    params = model.parameters() if hasattr(model, "parameters") else []
    return params[0].device if params else None


def _config_value(model, name):
    """``name`` from the model's generation_config where it has one, else from its config (dicts or objects)."""
    return config_value(generation_sources(model), name)


def _vocab_size(model) -> int | None:
    value = config_value((getattr(model, "config", None),), "vocab_size")
    return None if value is None else int(value)


def _eos_ids(model, eos_token_id) -> list[int]:
    eos = _config_value(model, "eos_token_id") if eos_token_id is None else eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple, np.ndarray)) else [eos])]


def _pad_id(model, pad_token_id, eos: list[int]) -> int:
    pad = _config_value(model, "pad_token_id") if pad_token_id is None else pad_token_id
    if pad is None:
        pad = eos[0] if eos else 0
    return int(pad)


# ---------------------------------------------------------------- logits processing (host, numpy)

def kept_positions(x, logits_to_keep):
    """The positions of the hidden states ``x`` [B, T, H] that a causal LM's head turns into logits, as
    transformers' ``logits_to_keep``: 0 all, an int k the last k ([B, k, H]); or an int32 Tensor [B] of one
    flat position b * T + t per row ([B, 1, H]: a captured prefill's last real token, rewritten per replay). A
    prefill reads one position's logits: the head's product and its [B, T, vocab] buffer shrink T-fold."""
    if isinstance(logits_to_keep, Tensor):
        batch, length, hidden = x.shape
        return F.embedding(logits_to_keep, x.reshape(batch * length, hidden)).reshape(batch, 1, hidden)
    if not logits_to_keep or logits_to_keep >= x.shape[1]:
        return x
    return x[:, x.shape[1] - logits_to_keep:]


def _last_position(out):
    """The last position's logits [batch, vocab] as a tensor, sliced on the GPU so only those are read back."""
    logits = out.logits
    return logits[:, logits.shape[1] - 1].contiguous()


def _positions_logits(out, rows: np.ndarray):
    """The logits of flat position ``rows[b]`` (b * length + position) for each batch row, as [batch, vocab],
    picked on the GPU from an input that a captured prefill rewrites."""
    logits = out.logits
    batch, length, vocab = logits.shape
    return F.embedding(Tensor(rows), logits.reshape(batch * length, vocab))


def _padded_length(model, length: int, bucket: int, limit: int) -> int | None:
    """The prompt length a reusable prefill runs at: ``length`` rounded up to ``bucket`` where the model says
    right padding is exact for it (``prompt_padding_is_exact(length, padded)``) and it fits ``limit``; None
    where it does not or ``bucket`` is 0 (the prompt runs at its own length)."""
    if bucket < 1:
        return None
    padded = -(-length // bucket) * bucket
    exact = getattr(model, "prompt_padding_is_exact", None)
    if padded > limit or exact is None or not exact(length, padded):
        return None
    return padded


def _last_logits(out) -> np.ndarray:
    """The last position's logits as float32 [batch, vocab]."""
    return to_scores(_last_position(out).numpy())


def _apply_repetition_penalty(scores: np.ndarray, tokens: np.ndarray, penalty: float,
                              prompt_padding: np.ndarray | None = None) -> np.ndarray:
    """transformers' RepetitionPenaltyLogitsProcessor: for every token id present in the row so far
    (prompt included), a positive score is divided by the penalty and a negative one multiplied. A left-padded
    row's first ``prompt_padding[row]`` tokens (its padding) count for nothing, as transformers leaves them out."""
    if penalty == 1.0:
        return scores
    scores = scores.copy()
    rows = np.arange(scores.shape[0])[:, None]
    if prompt_padding is not None:  # padding positions point past the vocabulary, at a column dropped after
        tokens = np.where(np.arange(tokens.shape[1])[None] < np.asarray(prompt_padding)[:, None], scores.shape[1],
                          tokens)
    seen = np.zeros((scores.shape[0], scores.shape[1] + 1), bool)
    seen[rows, tokens] = True
    seen = seen[:, :-1]
    scores[seen] = np.where(scores[seen] < 0, scores[seen] * penalty, scores[seen] / penalty)
    return scores


def prompt_padding(mask: np.ndarray | None) -> np.ndarray | None:
    """Per row, the padding before its first token (transformers: the attention mask's first non-zero column)."""
    return None if mask is None else (np.asarray(mask) != 0).argmax(axis=1)


def apply_top_k(scores: np.ndarray, top_k: int) -> np.ndarray:
    """Keep the top_k highest scores per row (ties with the k-th kept), the rest -inf."""
    if top_k <= 0 or top_k >= scores.shape[-1]:
        return scores
    kth = np.partition(scores, -top_k, axis=-1)[:, -top_k][:, None]
    return np.where(scores < kth, -np.inf, scores)


def apply_top_p(scores: np.ndarray, top_p: float) -> np.ndarray:
    """transformers' TopPLogitsWarper: drop the least likely tokens whose cumulative probability
    (ascending) stays <= 1 - top_p; the most likely token always stays."""
    if top_p >= 1.0:
        return scores
    order = np.argsort(scores, axis=-1, kind="stable")
    sorted_scores = np.take_along_axis(scores, order, axis=-1)
    cumulative = np.cumsum(_softmax(sorted_scores), axis=-1)
    remove_sorted = cumulative <= 1 - top_p
    remove_sorted[:, -1] = False
    remove = np.zeros_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, -np.inf, scores)


def apply_min_p(scores: np.ndarray, min_p: float) -> np.ndarray:
    """transformers' MinPLogitsWarper: drop the tokens less likely than ``min_p`` times the likeliest one."""
    if min_p <= 0.0:
        return scores
    probs = _softmax(scores)
    return np.where(probs < min_p * probs.max(axis=-1, keepdims=True), -np.inf, scores)


def warped_scores(scores: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0, rules: LogitRules | None = None) -> np.ndarray:
    """Scores through transformers' sampling warpers in its order: temperature, then top-k, then top-p, then min-p,
    then ``rules``' typical, epsilon and eta cutoffs (the tokens they drop at -inf)."""
    scores = scores / temperature if temperature != 1.0 else scores
    scores = apply_min_p(apply_top_p(apply_top_k(scores, top_k), top_p), min_p)
    return rules.warp(scores) if rules is not None else scores


def sampling_probabilities(scores: np.ndarray, temperature: float = 1.0, top_k: int = 0,
                           top_p: float = 1.0, min_p: float = 0.0, rules: LogitRules | None = None) -> np.ndarray:
    """The distribution sampling draws from: the softmax of :func:`warped_scores`."""
    return _softmax(warped_scores(scores, temperature, top_k, top_p, min_p, rules))


def _sample(scores, rng: np.random.Generator, temperature, top_k, top_p, min_p: float = 0.0,
            rules: LogitRules | None = None) -> np.ndarray:
    return _draw(sampling_probabilities(scores, temperature, top_k, top_p, min_p, rules), rng)


def _draw(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row from ``probs`` [batch, vocab]."""
    cumulative = np.cumsum(probs, axis=-1)
    draws = rng.random(probs.shape[0]) * cumulative[:, -1]
    picked = np.array([np.searchsorted(c, d, side="right") for c, d in zip(cumulative, draws)])
    # a draw at the very top (rounding) lands past the end: take the last token that has probability
    last_possible = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    return np.minimum(picked, last_possible)


def processed_scores(scores: np.ndarray, tokens: np.ndarray, repetition_penalty: float = 1.0, suppress=(),
                     rules: LogitRules | None = None, padding: np.ndarray | None = None) -> np.ndarray:
    """A step's ``scores`` [batch, vocab] (logits, or a beam search's log-probabilities) after ``tokens`` so far,
    through transformers' processors in its order: the tokens in ``suppress`` never (end-of-sequence before
    min_new_tokens), the repetition penalty (``padding``: per row, the left padding it passes over,
    :func:`prompt_padding`), then ``rules`` (models/generation_settings.py)."""
    if len(suppress):
        scores = scores.copy()
        scores[:, list(suppress)] = -np.inf
    scores = _apply_repetition_penalty(scores, tokens, repetition_penalty, padding)
    return rules.apply(scores, tokens) if rules is not None else scores


def pick_next_tokens(logits: np.ndarray, tokens: np.ndarray, do_sample: bool, rng: np.random.Generator,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     repetition_penalty: float = 1.0, suppress=(), rules: LogitRules | None = None,
                     min_p: float = 0.0, padding: np.ndarray | None = None) -> np.ndarray:
    """generate's choice of each row's next token from its step ``logits`` [batch, vocab] after ``tokens`` so far:
    the tokens in ``suppress`` never (end-of-sequence before min_new_tokens), the repetition penalty, ``rules``
    (models/generation_settings.py), then argmax, or a draw from ``rng`` when ``do_sample`` (for models with
    their own generation loop)."""
    scores = processed_scores(logits, tokens, repetition_penalty, suppress, rules, padding)
    if do_sample:
        return _sample(scores, rng, temperature, top_k, top_p, min_p, rules)
    return scores.argmax(axis=-1)


class TokenChoice:
    """generate's choice of one row's next token from a position's logits, for assisted generation (models/
    assisted.py), which chooses at several positions of a draft: transformers' processors (the end-of-sequence
    tokens suppressed before ``min_new_tokens``), then when sampling its warpers, then argmax or a draw."""

    def __init__(self, do_sample: bool, temperature: float, top_k: int, top_p: float, min_p: float,
                 repetition_penalty: float, rules: LogitRules, padding, eos: list[int], min_new_tokens: int,
                 prompt_length: int, vocab: int):
        self.do_sample, self.temperature, self.top_k, self.top_p, self.min_p = (do_sample, temperature, top_k, top_p,
                                                                                min_p)
        self.repetition_penalty, self.rules, self.padding, self.eos = repetition_penalty, rules, padding, eos
        self.min_new_tokens, self.prompt_length, self.vocab = min_new_tokens, prompt_length, vocab

    def _processed(self, logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        suppress = self.eos if tokens.shape[1] - self.prompt_length < self.min_new_tokens else ()
        return processed_scores(logits, tokens, self.repetition_penalty, suppress, self.rules, self.padding)

    def scores(self, logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The scores [1, vocab] the token after ``tokens`` [1, T] is chosen from, given its ``logits`` [1, vocab]."""
        scores = self._processed(logits, tokens)
        return warped_scores(scores, self.temperature, self.top_k, self.top_p, self.min_p, self.rules) \
            if self.do_sample else scores

    def probs(self, scores: np.ndarray) -> np.ndarray:
        return _softmax(scores)

    def draw(self, probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _draw(probs, rng)

    def pick(self, scores: np.ndarray, rng: np.random.Generator) -> int:
        return int(_draw(_softmax(scores), rng)[0] if self.do_sample else scores[0].argmax())

    def allowed(self, tokens: np.ndarray, token: int) -> bool:
        """Whether the processors leave ``token`` possible after ``tokens`` [T] (transformers' prompt lookup asks
        them of uniform logits)."""
        ones = np.ones((1, self.vocab), np.float32)
        return bool(np.isfinite(self._processed(ones, tokens[None])[0, token]))

    def finished(self, tokens: np.ndarray) -> bool:
        """Whether a stop string or stopping criterion ends ``tokens`` [1, T]."""
        return bool(self.rules.finished(tokens)[0])


def _generate_output(tokens: np.ndarray, output, scores: list, logits: list):
    """generate's result: the tokens, or a GenerateDecoderOnlyOutput (return_dict_in_generate)."""
    if not output.return_dict:
        return tokens
    return GenerateDecoderOnlyOutput(sequences=tokens, scores=tuple(scores) if output.scores else None,
                                     logits=tuple(logits) if output.logits else None)


def stream_tokens(streamer, tokens: np.ndarray) -> None:
    """Hand ``tokens`` to a streamer: a callable, or an object with transformers' ``put`` (None: nothing)."""
    if streamer is None:
        return
    if hasattr(streamer, "put"):
        streamer.put(tokens)
    else:
        streamer(tokens)


def end_stream(streamer) -> None:
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
