"""``EncoderDecoderScheduler``: the requests of ``vkformers serve`` on an encoder-decoder model (T5, BART, Marian, ...).

A request's prompt is the encoder's input and its completion the decoder's tokens, as ``generate`` makes them. The
scheduler's thread takes the waiting requests in groups of up to ``max_batch``: a group's prompts are encoded
together (padded on the right, masked), then decoded step by step from the decoder's start token until each has
finished (its end token, max_tokens, a stop string, or its client gone); requests that arrive meanwhile wait for the
next group. Each decoder cache holds its group's encoder states for the cross-attention, so a group runs whole
(static batching) instead of joining a running batch as BatchScheduler's requests do. Each request chooses its
tokens on the host from its row of the step's logits as ``generate`` does for a batch of one (RequestScheduler),
after the logits processors its generation config turns on (forced_bos_token_id: the target language of mBART-50
and NLLB; forced_eos_token_id at max_tokens; bad_words_ids: Marian's pad; no_repeat_ngram_size; suppress_tokens),
so its tokens are those ``model.generate`` gives it alone with those settings (greedy or sampled; no beams).
"""
from __future__ import annotations

import time

import numpy as np

from vkformers.errors import InputError
from vkformers.models.batching import FINISH_CANCELLED, FINISH_LENGTH, Request, RequestScheduler, WarmupReport
from vkformers.models.decode_capture import to_scores
from vkformers.models.generation_settings import LogitRules, generation_sources


class EncoderDecoderScheduler(RequestScheduler):
    """Runs requests on ``model`` (an encoder-decoder with ``generation_encoder_states``, ``generation_cache`` and
    ``generation_step``, as Seq2SeqGenerationMixin's generate uses them), ``tokenizer`` decoding their text.
    ``max_batch``: most requests in a group; ``max_model_len``: most decoder tokens, its start token and those a
    request generates (default: the decoder's positions, else 2048); a prompt must fit the encoder's positions."""

    def __init__(self, model, tokenizer, *, max_batch: int = 64, max_model_len: int | None = None, eos=()):
        limits = model.input_limits()
        self._encoder_limit, decoder_limit = limits.max_length, limits.decoder_max_length
        max_model_len = int(max_model_len or decoder_limit or 2048)
        if decoder_limit is not None and max_model_len > decoder_limit:
            raise InputError(f"max_model_len {max_model_len} exceeds the decoder's {decoder_limit} positions")
        self._setup(model, tokenizer, max_batch=max_batch, max_model_len=max_model_len, eos=eos,
                    vocab_size=limits.decoder_vocab_size or limits.vocab_size)
        self.kv_blocks = None
        self.pad = model.pad_token(None, self.eos)
        self.start_token = model.decoder_start_token()

    def kv_cache_summary(self) -> str:
        return (f"encoder-decoder: groups of up to {self.max_batch} requests, each with its own decoder cache "
                "(no continuous batching)")

    def warm_up(self, batch_sizes=None, prompt_widths=None) -> WarmupReport:
        """Nothing to record ahead: a group's steps are built as it runs."""
        return WarmupReport()

    def release_caches(self, timeout: float | None = None) -> bool:
        return True  # a group's cache is let go when the group ends

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """The prompt must fit the encoder's positions, the decoder's start token and max_tokens max_model_len
        (InputError)."""
        if prompt_tokens < 1:
            raise InputError("the prompt is empty")
        if self._encoder_limit is not None and prompt_tokens > self._encoder_limit:
            raise InputError(f"the prompt ({prompt_tokens} tokens) exceeds the encoder's {self._encoder_limit} "
                             "positions; shorten it")
        if 1 + max_tokens > self.max_model_len:
            raise InputError(f"max_tokens ({max_tokens}) and the decoder's start token exceed the maximum length of "
                             f"{self.max_model_len} tokens; lower max_tokens")

    def _check_request(self, request: Request) -> None:
        if request.params.prompt_logprobs is not None:
            raise InputError("prompt log-probabilities: an encoder-decoder's prompt is its encoder's input, which it "
                             "does not predict; leave out prompt_logprobs (and logprobs with echo)")
        super()._check_request(request)

    def _serve(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._closing and not self._waiting:
                        self._cond.wait()
                    if self._closing:
                        return
                    group, self._waiting = self._waiting[:self.max_batch], self._waiting[self.max_batch:]
                    self.metrics.waiting = len(self._waiting)
                try:
                    self._run(group)
                except Exception as exc:  # the group fails; the next one starts afresh
                    self.last_error = exc
                    self.metrics.errors += 1
                    self._fail(group)
                finally:
                    self.metrics.live_rows = self.metrics.batch_rows = 0
        except BaseException as exc:  # the thread ends: no request may wait for it
            self.error = exc
            with self._cond:
                self._fail(self._waiting)
                self._waiting.clear()
            raise

    def _run(self, group: list[Request]) -> None:
        """Encode the group's prompts, then decode until each request has finished."""
        for request in group:
            if request.cancelled:
                self._finish(request, FINISH_CANCELLED)
            elif request.params.max_tokens == 0:  # the prompt echoed alone
                self._finish(request, FINISH_LENGTH)
        live = [r for r in group if not r.finished]
        if not live:
            return
        started = time.perf_counter()
        rows, width = len(live), max(len(r.prompt) for r in live)
        ids = np.full((rows, width), self.pad, np.int64)
        mask = np.zeros((rows, width), np.int64)
        for row, request in enumerate(live):
            ids[row, :len(request.prompt)] = request.prompt
            mask[row, :len(request.prompt)] = 1
        longest = max(r.params.max_tokens for r in live)
        sources = generation_sources(self.model)
        rules = [LogitRules.resolve(sources, {}, start_length=1, max_length=1 + r.params.max_tokens, eos=self.eos)
                 for r in live]
        states = self.model.generation_encoder_states(ids, mask)
        cache = self.model.generation_cache(rows, 1 + longest, states, mask)
        self.metrics.prefills += 1
        self.metrics.prefill_tokens += int(mask.sum())
        self.metrics.prefill_seconds += time.perf_counter() - started
        self.metrics.batch_rows = rows
        tokens = np.full((rows, 1), self.start_token, np.int64)
        for _ in range(longest):
            for request in live:
                if request.cancelled and not request.finished:
                    self._finish(request, FINISH_CANCELLED)
            running = [(row, r) for row, r in enumerate(live) if not r.finished]
            if not running:
                break
            self.metrics.live_rows = len(running)
            started = time.perf_counter()
            logits = self.model.generation_step(tokens, states, mask, cache)
            scores = to_scores(logits[:, logits.shape[1] - 1].contiguous().numpy())
            for row, request in running:  # the generation config's processors, on the decoder's tokens so far
                decoded = np.asarray([[self.start_token, *request.generated]], np.int64)
                scores[row:row + 1] = rules[row].apply(scores[row:row + 1], decoded)
            self.metrics.steps += 1
            self.metrics.occupancy_sum += len(running) / rows
            self.metrics.decode_seconds += time.perf_counter() - started
            self._choose(scores, running)
            tokens = np.array([[r.generated[-1] if r.generated else self.pad] for r in live], np.int64)
