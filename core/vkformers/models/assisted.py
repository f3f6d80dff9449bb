"""Assisted generation, as transformers' assisted decoding: candidate tokens are drafted cheaply, then the main model
checks them all in one forward over its cache, keeps those it agrees with, adds one token of its own and forgets the
rest (``KVCache.crop``).

Two ways to draft, chosen by ``generate``'s arguments:

- ``prompt_lookup_num_tokens=N`` (transformers' PromptLookupCandidateGenerator): the last n tokens (n from
  ``max_matching_ngram_size``, default 2, down to 1) are looked up earlier in the sequence; the up to N tokens that
  followed their first match are the draft (cut at an end-of-sequence token, and before the first token the logits
  processors forbid).
- ``assistant_model=`` a smaller causal LM of the same vocabulary (transformers' AssistedCandidateGenerator): it
  drafts up to ``num_assistant_tokens`` tokens (default 20) with the main model's settings, on a cache of its own that
  follows the sequence, and stops early at an end-of-sequence token or once its chosen token's probability falls
  below ``assistant_confidence_threshold`` (default 0.4; 0 drafts every token). ``num_assistant_tokens_schedule``:
  "constant" (default), "heuristic" (2 more tokens after a round that kept every draft token, 1 fewer otherwise,
  kept for the assistant's next call as transformers keeps it in its generation config) or "heuristic_transient"
  (the same within one call). Left out of the call, these come from the assistant's generation config, then
  transformers' defaults.

Which draft tokens stay: greedy, those equal to the main model's own choices at their positions (so the tokens are
the unassisted greedy ones); sampling with an assistant model, transformers' speculative sampling (each draft token
kept with probability min(1, p/q), the first rejected one replaced by a draw from max(p - q, 0)), whose tokens follow
the main model's distribution; sampling with prompt lookup, a draw from the main model at every position, the draft
kept while it matches them. One row only (batch size 1, one return sequence) and no beam search, as in transformers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vkformers.errors import InputError
from vkformers.models.decode_capture import capture_key
from vkformers.models.generation_settings import config_value, model_generation_sources

# transformers' GenerationConfig defaults for assisted generation
NUM_ASSISTANT_TOKENS = 20
SCHEDULES = ("constant", "heuristic", "heuristic_transient")
CONFIDENCE_THRESHOLD = 0.4
MAX_MATCHING_NGRAM_SIZE = 2
ASSISTED_ARGUMENTS = ("assistant_model", "prompt_lookup_num_tokens", "max_matching_ngram_size",
                      "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                      "assistant_tokenizer")


class AssistedGenerationError(InputError):
    """Assisted generation asked for with arguments or models it cannot run with."""


@dataclass(frozen=True)
class AssistedSettings:
    """One generate call's assisted decoding: ``assistant`` (a causal LM) or ``prompt_lookup`` (draft tokens at
    most), with their settings."""

    assistant: object = None
    prompt_lookup: int = 0
    ngram_size: int = MAX_MATCHING_NGRAM_SIZE
    num_tokens: int = NUM_ASSISTANT_TOKENS
    schedule: str = "constant"
    confidence: float = CONFIDENCE_THRESHOLD


@dataclass
class AssistedStats:
    """What the last assisted generate did: ``rounds`` (one main-model forward each, or none where the held logits
    sufficed), ``drafted`` and ``accepted`` draft tokens (``history``: per round, the pair), ``forwards`` of the main
    model after the prompt and how many of them ``replayed`` a recorded plan."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    replayed: int = 0
    history: list = field(default_factory=list)


def _whole(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise AssistedGenerationError(f"generate: {name} must be a whole number >= {low}, got {value!r}")
    return int(value)


def pop_assisted_settings(options: dict) -> AssistedSettings | None:
    """The assisted-generation arguments of a generate call, taken out of ``options`` (None: not asked for).
    Settings left out come from the assistant's generation config, then transformers' defaults."""
    given = {name: options.pop(name) for name in ASSISTED_ARGUMENTS if name in options}
    assistant, lookup = given.get("assistant_model"), given.get("prompt_lookup_num_tokens")
    if given.get("assistant_tokenizer") is not None:
        raise AssistedGenerationError("generate: an assistant with a tokenizer of its own (universal assisted "
                                      "decoding) is not supported; give an assistant_model of the main model's "
                                      "vocabulary and leave assistant_tokenizer out")
    if assistant is None and lookup is None:
        if any(given.get(name) is not None for name in ASSISTED_ARGUMENTS):
            named = ", ".join(name for name in ASSISTED_ARGUMENTS if given.get(name) is not None)
            raise AssistedGenerationError(f"generate: {named} without assistant_model or prompt_lookup_num_tokens "
                                          "drafts nothing; give one of them")
        return None
    if assistant is not None and lookup is not None:
        raise AssistedGenerationError("generate: give assistant_model or prompt_lookup_num_tokens, not both (each "
                                      "drafts the candidate tokens its own way)")
    if lookup is not None:
        ngram = given.get("max_matching_ngram_size")
        return AssistedSettings(prompt_lookup=_whole("prompt_lookup_num_tokens", lookup, 1),
                                ngram_size=_whole("max_matching_ngram_size",
                                                  MAX_MATCHING_NGRAM_SIZE if ngram is None else ngram, 1))
    sources = model_generation_sources(assistant)

    def setting(name, default):
        value = given[name] if given.get(name) is not None else config_value(sources, name)
        return default if value is None else value
    schedule = setting("num_assistant_tokens_schedule", "constant")
    if schedule not in SCHEDULES:
        raise AssistedGenerationError(f"generate: num_assistant_tokens_schedule must be one of {', '.join(SCHEDULES)}"
                                      f", got {schedule!r}")
    confidence = setting("assistant_confidence_threshold", CONFIDENCE_THRESHOLD)
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float, np.integer, np.floating)) \
            or not 0 <= confidence <= 1:
        raise AssistedGenerationError(f"generate: assistant_confidence_threshold must be in [0, 1] (0: draft every "
                                      f"token), got {confidence!r}")
    return AssistedSettings(assistant=assistant,
                            num_tokens=_whole("num_assistant_tokens", setting("num_assistant_tokens",
                                                                                NUM_ASSISTANT_TOKENS), 1),
                            schedule=schedule, confidence=float(confidence))


def check_forgets(cache, role: str, model) -> None:
    """Refuse, after the prompt's forward and before any token, a cache on which ``model``'s layers keep state
    besides keys and values (an indexer's keys): ``crop`` cannot forget rejected draft tokens from it."""
    state = cache.layer_state()
    if state:
        raise AssistedGenerationError(
            f"generate: {role} ({type(model).__name__}) keeps {', '.join(state)} on its cache besides keys and "
            "values, which cannot forget rejected draft tokens; generate without assistant_model and "
            "prompt_lookup_num_tokens")


def lookup_candidates(tokens: np.ndarray, count: int, ngram_size: int, eos, allowed) -> np.ndarray:
    """transformers' prompt lookup: up to ``count`` tokens that followed the first earlier match of the sequence's
    last n tokens (n from ``ngram_size`` down to 1), ``tokens`` [T] int64; cut before the first token ``allowed(seq,
    token)`` refuses (a logits processor bans it after ``seq``) and at the first of ``eos`` (which it drops). A match
    whose first token is refused is passed over. Empty where nothing matches."""
    length = tokens.shape[0]
    if count <= 0:
        return tokens[:0]
    for size in range(min(ngram_size, length - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens, size)
        for start in np.flatnonzero((windows == tokens[length - size:]).all(axis=1)):
            begin = start + size
            chosen = tokens[begin:min(begin + count, length)]
            if not len(chosen):
                continue
            kept = 0
            while kept < len(chosen) and allowed(np.concatenate([tokens, chosen[:kept]]), int(chosen[kept])):
                kept += 1
            if not kept:
                continue
            chosen = chosen[:kept]
            ends = np.flatnonzero(np.isin(chosen, eos)) if len(eos) else []
            return chosen[:ends[0]] if len(ends) else chosen
    return tokens[:0]


def matching_tokens(candidates: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, int]:
    """Greedy verification (and prompt lookup when sampling): ``chosen`` [K + 1], the main model's tokens at each
    draft position and after the last; the draft tokens equal to them until the first that is not, then the main
    model's token there. (tokens, draft tokens kept)."""
    differs = np.flatnonzero(candidates != chosen[:len(candidates)])
    kept = int(differs[0]) if len(differs) else len(candidates)
    return chosen[:kept + 1], kept


def speculative_tokens(candidates: np.ndarray, draft_probs: np.ndarray, probs: np.ndarray,
                       rng: np.random.Generator, draw) -> tuple[np.ndarray, int]:
    """transformers' speculative sampling (Leviathan et al. 2023, algorithm 1): draft token i, drawn from the
    assistant's ``draft_probs[i]``, is kept with probability min(1, p/q) under the main model's ``probs[i]`` ([K + 1,
    vocab]), until the first rejection; there the next token is drawn from max(p - q, 0) renormalised, else after the
    last draft token from ``probs[K]``. ``draw(probs [1, vocab], rng)``: one token. (tokens, draft tokens kept)."""
    count = len(candidates)
    steps = np.arange(count)
    q, p = draft_probs[steps, candidates], probs[steps, candidates]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = p / q
    rejected = np.flatnonzero(~(rng.random(count) <= ratio))
    kept = int(rejected[0]) if len(rejected) else count
    target = probs[kept]
    if kept < count:
        residual = np.maximum(target - draft_probs[kept], 0.0)
        # p == q leaves nothing to draw from: p itself (transformers would divide by zero)
        target = residual / residual.sum() if residual.sum() > 0 else target
    token = int(draw(target[None], rng)[0])
    return np.concatenate([candidates[:kept], [token]]).astype(np.int64), kept


def next_draft_length(current: int, schedule: str, kept: int, drafted: int) -> int:
    """transformers' num_assistant_tokens schedule after a round that kept ``kept`` of ``drafted`` draft tokens."""
    if schedule == "constant":
        return current
    return current + 2 if kept == drafted else max(1, current - 1)


def padded_length(count: int, pad: bool, room: int) -> int | None:
    """The tokens a forward of ``count`` runs at: the next power of two where ``pad`` and it fits ``room`` (the
    cache's and the position table's), else None (its own count)."""
    if not pad:
        return None
    padded = 1 << (count - 1).bit_length()
    return padded if count < padded <= room else None


class PromptLookup:
    """Draft tokens copied from the sequence itself (lookup_candidates)."""

    def __init__(self, settings: AssistedSettings, choice, eos):
        self.settings, self.choice, self.eos = settings, choice, eos

    def draft(self, tokens: np.ndarray, limit: int, rng) -> tuple[np.ndarray, None]:
        return lookup_candidates(tokens, min(self.settings.prompt_lookup, limit), self.settings.ngram_size, self.eos,
                                 self.choice.allowed), None

    def update(self, kept: int, drafted: int) -> None:
        pass

    def finish(self) -> None:
        pass


class DraftModel:
    """Draft tokens from an assistant model, chosen as the main model chooses (``choice``), on a cache of the
    assistant's own that follows the sequence: each round it forgets the draft tokens the main model rejected and
    runs the tokens it has not seen (its decode steps and catch-up forwards replay recorded plans)."""

    def __init__(self, settings: AssistedSettings, choice, eos, prompt_mask: np.ndarray, capacity: int,
                 pad: bool):
        self.settings, self.choice, self.eos, self.pad = settings, choice, eos, pad
        self.assistant = settings.assistant
        self.count = settings.num_tokens
        self.prompt_mask = prompt_mask
        self.cache, self.decode, self.key = self.assistant._draft_state(capacity)
        self.room = min(self.cache.max_len, getattr(self.assistant, "max_position_embeddings", capacity))
        self.fed = prompt_mask[0, :0].astype(np.int64)  # the sequence's tokens the assistant's cache holds

    def draft(self, tokens: np.ndarray, limit: int, rng) -> tuple[np.ndarray, np.ndarray | None]:
        """Up to ``limit`` tokens (and, when sampling, the probabilities each was drawn from) after ``tokens``."""
        count = min(self.count, limit)
        if count <= 0:
            return tokens[:0], None
        logits = self._follow(tokens)
        drafted, probs = [], []
        sequence = tokens
        for step in range(count):
            scores = self.choice.scores(logits, sequence[None])
            token = self.choice.pick(scores, rng)
            chosen = self.choice.probs(scores)
            drafted.append(token)
            probs.append(chosen[0])
            sequence = np.append(sequence, token)
            confident = chosen[0, token] >= self.settings.confidence
            if token in self.eos or not confident or step == count - 1:
                break
            logits = self._run(sequence[-1:])
        return np.array(drafted, np.int64), np.stack(probs) if self.choice.do_sample else None

    def _follow(self, tokens: np.ndarray) -> np.ndarray:
        """The assistant's logits after ``tokens``: its cache cut back to what it shares with them, the rest run."""
        shared = min(len(self.fed), len(tokens) - 1)
        differs = np.flatnonzero(self.fed[:shared] != tokens[:shared])
        shared = int(differs[0]) if len(differs) else shared
        if shared == 0:
            self.cache.reset()
            self.fed = tokens[:0]
            mask = self._mask(len(tokens))
            positions = self.assistant.generation_positions(mask, tokens[None], len(tokens))
            self.fed = tokens.copy()
            logits = self.assistant.prefill(tokens[None], mask, positions, self.cache)
            check_forgets(self.cache, "the assistant", self.assistant)
            return logits
        self.cache.crop(shared)
        self.fed = tokens[:shared]
        return self._run(tokens[shared:])

    def _run(self, new: np.ndarray) -> np.ndarray:
        """The assistant's forward of ``new`` tokens after those its cache holds: the last one's logits [1, vocab]."""
        self.fed = np.concatenate([self.fed, new])
        mask = self._mask(len(self.fed))
        positions = self.assistant.generation_positions(mask, self.fed[None], self.prompt_mask.shape[1])
        ids, positions = new[None].astype(np.int32), positions[:, -len(new):].astype(np.int32)
        if len(new) == 1:
            return self.assistant.decode_step(self.decode, self.cache, ids, positions, mask,
                                              replay=self.assistant.replays_decode())
        padded = padded_length(len(new), self.pad, self.room - self.cache.position)
        logits, _ = self.assistant._forward_tokens(self.cache, ids, positions, mask, self.key, padded)
        if padded:
            self.cache.crop(len(self.fed))
        return logits[:, -1]

    def _mask(self, length: int) -> np.ndarray:
        prompt = self.prompt_mask.shape[1]
        return np.concatenate([self.prompt_mask, np.ones((1, length - prompt), self.prompt_mask.dtype)], axis=1)

    def update(self, kept: int, drafted: int) -> None:
        self.count = next_draft_length(self.count, self.settings.schedule, kept, drafted)

    def finish(self) -> None:
        """As transformers: the "heuristic" schedule's draft length carries over to the assistant's next call."""
        if self.settings.schedule == "heuristic":
            config = getattr(self.assistant, "generation_config", None)
            if isinstance(config, dict):
                config["num_assistant_tokens"] = self.count
            elif config is None:
                self.assistant.generation_config = {"num_assistant_tokens": self.count}
            else:
                config.num_assistant_tokens = self.count


def assisted_decode(model, settings: AssistedSettings, logits: np.ndarray, prompt: np.ndarray, mask: np.ndarray,
                    cache, decode, choice, max_new_tokens: int, eos: list[int], rng, on_token, pad: bool):
    """generate's rounds of assisted decoding for one row, after the prompt's forward: ``logits`` [1, vocab] (for
    the first new token), ``prompt`` and ``mask`` [1, T], ``cache`` holding the prompt (with chunks_replay),
    ``decode`` the main model's decode capture; ``choice``: generate's token choice (scores, probs, pick, allowed,
    finished, do_sample); ``on_token(token, scores, logits)`` for each new token; ``pad``: verification forwards
    padded to a power of two tokens. Returns (the tokens [1, T + new], AssistedStats)."""
    check_forgets(cache, "this model", model)
    length = prompt.shape[1]
    tokens = prompt[0].astype(np.int64)
    drafter = PromptLookup(settings, choice, eos) if settings.assistant is None else \
        DraftModel(settings, choice, eos, mask, cache.max_len, pad)
    key = capture_key(model, cache) if model.replays_decode() else None
    limit = min(cache.max_len, getattr(model, "max_position_embeddings", cache.max_len))
    stats = AssistedStats()
    held = logits  # the main model's logits after every token while its cache holds them all (the prompt's)
    finished = False
    while not finished:
        before = len(tokens)
        candidates, draft_probs = drafter.draft(tokens, length + max_new_tokens - before - 1, rng)
        drafted = len(candidates)
        # the tokens the main model has not run: the last one chosen (unless held) and the draft
        new = candidates if held is not None else np.concatenate([tokens[-1:], candidates])
        rows = [held] if held is not None else []
        if len(new):
            sequence = np.concatenate([tokens, candidates])
            full_mask = np.concatenate([mask, np.ones((1, len(sequence) - length), mask.dtype)], axis=1)
            positions = model.generation_positions(full_mask, sequence[None], length)[:, -len(new):]
            ids, positions = new[None].astype(np.int32), positions.astype(np.int32)
            if len(new) == 1:
                replays = decode.replays
                rows.append(model.decode_step(decode, cache, ids, positions, full_mask, replay=key is not None))
                replayed = decode.replays > replays
            else:
                padded = padded_length(len(new), pad, limit - cache.position)
                step, replayed = model._forward_tokens(cache, ids, positions, full_mask, key, padded)
                rows.append(step[0])
            stats.forwards += 1
            stats.replayed += int(replayed)
        step_logits = np.concatenate(rows).astype(np.float32, copy=False)  # [drafted + 1, vocab]
        sequence = np.concatenate([tokens, candidates])
        scores = np.concatenate([choice.scores(step_logits[i:i + 1], sequence[None, :before + i])
                                 for i in range(drafted + 1)])
        if draft_probs is not None:
            chosen, _ = speculative_tokens(candidates, draft_probs, choice.probs(scores), rng, choice.draw)
        else:
            picks = np.array([choice.pick(scores[i:i + 1], rng) for i in range(drafted + 1)], np.int64)
            chosen, _ = matching_tokens(candidates, picks)
        added = 0
        for token in chosen:  # cut at the length, an end-of-sequence token or a stopping rule
            tokens = np.append(tokens, token)
            on_token(int(token), scores[added:added + 1], step_logits[added:added + 1])
            added += 1
            if len(tokens) - length >= max_new_tokens or token in eos or choice.finished(tokens[None]):
                finished = True
                break
        kept = added - 1  # the draft tokens the sequence took (transformers' n_matches)
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += kept
        stats.history.append((drafted, kept))
        # the cache keeps what it ran of the sequence: all but its last token, which the next round runs
        cache.crop(min(cache.position, before + kept))
        held = None
        drafter.update(kept, drafted)
    drafter.finish()
    return tokens[None], stats
