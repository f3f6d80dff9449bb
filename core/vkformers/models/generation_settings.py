"""What ``generate`` decodes with, resolved as transformers' GenerationMixin resolves it, and the logits processors
of transformers' that those settings turn on.

An argument left out of ``generate`` takes the model's generation_config (the checkpoint's generation_config.json,
or where it has none the config's generation keys, as transformers' GenerationConfig.from_model_config), then
transformers' default: so Llama 3 Instruct samples at its temperature 0.6 and top-p 0.9, Qwen2.5 with top-k 20 and
a repetition penalty, and ``do_sample=True`` alone keeps the 50 likeliest tokens, as transformers' ``generate``
does. Explicit arguments win.

:class:`LogitRules` holds the processors that set scores to -inf (or force one token), applied on the host to each
step's scores in transformers' order, after the repetition penalty and before temperature, top-k and top-p:
``no_repeat_ngram_size``, ``bad_words_ids``, ``forced_bos_token_id`` (mBART-50, NLLB, M2M100 choose their target
language with it; BART checkpoints force their bos), ``forced_eos_token_id`` (at the last step of ``max_length``),
``suppress_tokens`` and ``begin_suppress_tokens``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from vkformers.errors import InputError
from vkformers.models.beam_search import check_beam_settings
from vkformers.models.inputs import check_generation_settings, check_number, generation_lengths

# transformers' GenerationConfig defaults for what generate's sampling arguments leave out
SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0,
                     "repetition_penalty": 1.0}
# transformers' stop strings, with the tokenizer that reads them (generate's arguments only)
STOP_ARGUMENTS = ("stop_strings", "tokenizer")
# generate's arguments that turn LogitRules on (also read from the generation config)
RULE_ARGUMENTS = ("no_repeat_ngram_size", "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id",
                  "suppress_tokens", "begin_suppress_tokens")
# transformers' sampling warpers after min-p, carried by LogitRules (``warp``), and the values that turn them off
WARPER_ARGUMENTS = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}
# the caller's own processing (generate's arguments only): prefix_allowed_tokens_fn(batch_id, ids) -> allowed ids;
# logits_processor, callables (ids [rows, T] int64, scores [rows, vocab] float32) -> scores, run after transformers'
# processors and before its sampling warpers; stopping_criteria, callables (ids, None) -> bool per row (or one)
CALLER_ARGUMENTS = ("prefix_allowed_tokens_fn", "logits_processor", "stopping_criteria")


# the keys of transformers' GenerationConfig that generate reads; GenerationConfig.from_model_config copies them
# from a config that has no generation_config.json beside it
GENERATION_KEYS = ("max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature",
                   "top_k", "top_p", "min_p", "repetition_penalty", "num_beams", "length_penalty", "early_stopping",
                   "num_return_sequences", "no_repeat_ngram_size", "bad_words_ids", "forced_bos_token_id",
                   "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens", "bos_token_id", "eos_token_id",
                   "pad_token_id", "decoder_start_token_id", "typical_p", "epsilon_cutoff", "eta_cutoff")


def generation_config_of(config) -> dict:
    """What transformers' GenerationConfig.from_model_config keeps of a config: its generation keys that are set."""
    return {key: config[key] for key in GENERATION_KEYS if isinstance(config, dict) and config.get(key) is not None}


def config_value(sources, name: str):
    """``name`` from the first of ``sources`` (dicts or objects with attributes) that sets it (not None)."""
    for source in sources:
        if source is None:
            continue
        value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
        if value is not None:
            return value
    return None


def generation_sources(model) -> tuple:
    """Where ``model``'s generation settings come from, first found wins: as in transformers, its generation
    config where the checkpoint has one, else its config (a model may name more: ``generation_configs``)."""
    if hasattr(model, "generation_configs"):
        return tuple(model.generation_configs())
    return model_generation_sources(model)


def model_generation_sources(model) -> tuple:
    generation = getattr(model, "generation_config", None)
    return (generation,) if generation is not None else (getattr(model, "config", None),)


def end_token_ids(model, tokenizer=None) -> list[int]:
    """Where a chat completion stops: the tokenizer's end-of-sequence token, the generation config's and the
    config's (chat models end a turn with a token the base config may not list: Llama 3 Instruct's <|eot_id|>
    is in its generation config only)."""
    ids = [tokenizer.eos_token_id] if tokenizer is not None and tokenizer.eos_token_id is not None else []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = config_value((source,), "eos_token_id")
        ids += [int(e) for e in (value if isinstance(value, (list, tuple)) else [value]) if e is not None]
    return sorted(set(ids))


def sampling_settings(sources, **given) -> dict:
    """do_sample, temperature, top_k, top_p, min_p and repetition_penalty: each as given, else from ``sources``,
    else transformers' default."""
    settings = {}
    for name, default in SAMPLING_DEFAULTS.items():
        value = given.get(name)
        if value is None:
            value = config_value(sources, name)
        settings[name] = default if value is None else value
    return settings


def config_lengths(sources, max_new_tokens, options: dict, start_length: int):
    """(max_new_tokens, options) with the generation config's max_new_tokens or max_length, min_new_tokens or
    min_length where the call gives neither (lengths counting the whole sequence, as generation_lengths reads
    them; a configured max_length the ``start_length`` tokens already reach is left out)."""
    options = dict(options)
    if max_new_tokens is None and options.get("max_length") is None:
        max_new_tokens = config_value(sources, "max_new_tokens")
        longest = config_value(sources, "max_length")
        if max_new_tokens is None and longest is not None and longest > start_length:
            options["max_length"] = longest
    if options.get("min_new_tokens") is None and options.get("min_length") is None:
        for name in ("min_new_tokens", "min_length"):
            value = config_value(sources, name)
            if value:
                options[name] = value
                break
    return max_new_tokens, options


@dataclass(frozen=True)
class BeamSettings:
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False


BEAM_ARGUMENTS = ("num_beams", "length_penalty", "early_stopping")


def beam_settings(sources, options: dict, supported: bool, what: str = "generate") -> BeamSettings:
    """num_beams, length_penalty and early_stopping (popped from ``options``), else from ``sources``, else
    transformers' defaults. Where beam search is not ``supported``, a call asking for it is refused and a
    generation config asking for it gives a warning (decoding goes on without it)."""
    given = {name: options.pop(name) for name in BEAM_ARGUMENTS if name in options}
    value = {name: given[name] if given.get(name) is not None else config_value(sources, name)
             for name in BEAM_ARGUMENTS}
    beams = value["num_beams"] if value["num_beams"] is not None else 1
    if not supported and beams != 1:
        if "num_beams" in given:
            raise InputError(f"generate: beam search (num_beams={beams!r}) is not supported for this model; use "
                             "num_beams=1, and do_sample=True with num_return_sequences for several candidates")
        warnings.warn(f"{what}: the model's generation config asks for beam search (num_beams={beams}), which "
                      "vkformers does not run for this model; decoding without it (pass num_beams=1 to silence "
                      "this)", stacklevel=4)
        return BeamSettings()
    return BeamSettings(beams, 1.0 if value["length_penalty"] is None else value["length_penalty"],
                        False if value["early_stopping"] is None else value["early_stopping"])


@dataclass(frozen=True)
class OutputRequest:
    """What generate returns besides the tokens (transformers' ``return_dict_in_generate``, ``output_scores``,
    ``output_logits``)."""
    return_dict: bool = False
    scores: bool = False
    logits: bool = False

    @property
    def records(self) -> bool:
        return self.return_dict and (self.scores or self.logits)


def pop_output_request(options: dict) -> OutputRequest:
    """The output arguments of a generate call, taken out of ``options``. As in transformers, output_scores and
    output_logits change nothing without return_dict_in_generate."""
    names = {"return_dict_in_generate": "return_dict", "output_scores": "scores", "output_logits": "logits"}
    values = {}
    for name, field in names.items():
        value = options.pop(name, False)
        if not isinstance(value, bool):
            raise InputError(f"generate: {name} must be True or False, got {value!r}")
        values[field] = value
    return OutputRequest(**values)


@dataclass
class GenerateDecoderOnlyOutput:
    """generate's result with ``return_dict_in_generate=True`` (transformers' class of that name, numpy arrays):
    ``sequences`` [batch, T + new]; ``scores`` (with ``output_scores``): per new token the [batch, vocab] float32
    scores it was chosen from, after the logits processors (and, when sampling, temperature, top-k, top-p, min-p;
    the tokens they drop at -inf); ``logits`` (with ``output_logits``): the model's raw logits per new token.
    Indexed by name or, as transformers' ModelOutput, by position among the fields that are set."""
    sequences: np.ndarray
    scores: tuple | None = None
    logits: tuple | None = None
    attentions: tuple | None = None
    hidden_states: tuple | None = None
    past_key_values: object = None

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return tuple(v for v in vars(self).values() if v is not None)[key]

    def keys(self) -> list[str]:
        return [k for k, v in vars(self).items() if v is not None]


def pop_rule_arguments(options: dict) -> dict:
    """generate's LogitRules arguments (processors and the warpers it carries), taken out of its other keyword
    arguments."""
    return {name: options.pop(name) for name in (*RULE_ARGUMENTS, *WARPER_ARGUMENTS, *CALLER_ARGUMENTS)
            if name in options}


def resolve_call(sources, options: dict, max_new_tokens, start_length: int, beams: bool = False, **sampling):
    """One generate call's settings: (do_sample, temperature, top_k, top_p, min_p, repetition_penalty as a dict, its
    Lengths, its LogitRules arguments with its StopStrings or None under "stop_strings", its BeamSettings).
    ``options``: generate's other keyword arguments, left without the rule, stop and beam arguments;
    ``start_length``: the tokens before the first generated one; ``beams``: whether this generate runs beam
    search."""
    beam = beam_settings(sources, options, beams)
    settings = sampling_settings(sources, **sampling)
    rules = pop_rule_arguments(options)
    rules["stop_strings"] = pop_stop_strings(options, beam.num_beams)
    max_new_tokens, lengths_options = config_lengths(sources, max_new_tokens, options, start_length)
    lengths = generation_lengths(lengths_options, max_new_tokens, start_length,
                                 settings["do_sample"] or beam.num_beams > 1)
    check_generation_settings(lengths.max_new_tokens, settings["do_sample"], settings["temperature"],
                              settings["top_k"], settings["top_p"], settings["repetition_penalty"],
                              min_p=settings["min_p"])
    if beam.num_beams != 1:
        check_beam_settings(beam.num_beams, lengths.num_return_sequences, beam.length_penalty, beam.early_stopping,
                            settings["do_sample"])
    return settings, lengths, rules, beam


class StopStrings:
    """transformers' ``stop_strings`` (with ``tokenizer=``): a row is finished once its text holds one of the strings
    ending in its last token, which may run past the string's end (the tokens that completed it are kept)."""

    def __init__(self, strings, tokenizer):
        strings = [strings] if isinstance(strings, str) else strings
        if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(t, str) and t for t in strings):
            raise InputError(f"generate: stop_strings must be a string or a list of non-empty strings, got "
                             f"{strings!r}")
        if tokenizer is None or not hasattr(tokenizer, "decode"):
            raise InputError("generate: stop_strings needs the tokenizer that turns the tokens into text "
                             "(tokenizer=...), as in transformers")
        self.strings, self.tokenizer = list(strings), tokenizer
        self.window = max(len(t) for t in self.strings) + 2  # tokens enough to hold any of them, and one before

    def hits(self, tokens: np.ndarray) -> np.ndarray:
        """Per row of ``tokens`` [batch, T], whether a stop string ends in its last token."""
        found = np.zeros(tokens.shape[0], bool)
        for row, seq in enumerate(tokens[:, -self.window:].tolist()):
            before, after = self.tokenizer.decode(seq[:-1]), self.tokenizer.decode(seq)
            found[row] = any(after.find(t, max(0, len(before) - len(t) + 1)) >= 0 for t in self.strings)
        return found


def pop_stop_strings(options: dict, beams: int = 1) -> StopStrings | None:
    """generate's ``stop_strings`` and ``tokenizer`` arguments (taken out of ``options``) as StopStrings."""
    strings, tokenizer = options.pop("stop_strings", None), options.pop("tokenizer", None)
    if strings is None:
        return None
    if beams > 1:
        raise InputError("generate: stop_strings with beam search is not supported; leave one of them out")
    return StopStrings(strings, tokenizer)


def sampling_rng(seed) -> np.random.Generator:
    """numpy's generator that sampling with ``seed`` draws from (None: fresh entropy). A seed is any whole number, as
    torch's manual_seed (so vLLM) takes it: a negative one stands for its 64-bit two's complement."""
    if seed is None:
        return np.random.default_rng()
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise InputError(f"seed must be a whole number, got {seed!r}")
    return np.random.default_rng(int(seed) % 2 ** 64)


def softmax64(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in float64 (what sampling draws from; -inf scores get 0)."""
    z = scores.astype(np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _below(scores: np.ndarray, drop: np.ndarray) -> np.ndarray:
    """``scores`` with the ``drop`` ones at -inf, the likeliest token of each row kept whatever ``drop`` says."""
    drop = drop & (scores < scores.max(axis=-1, keepdims=True))
    return np.where(drop, -np.inf, scores).astype(scores.dtype, copy=False)


def _typical(scores: np.ndarray, mass: float) -> np.ndarray:
    """transformers' TypicalLogitsWarper: keep the tokens whose surprisal is closest to the entropy, in that order,
    until their probability reaches ``mass`` (the first always kept)."""
    probs = softmax64(scores)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_probs = np.log(probs)
        entropy = -np.nansum(log_probs * probs, axis=-1, keepdims=True)
    shifted = np.abs(-log_probs - entropy)
    order = np.argsort(shifted, axis=-1, kind="stable")
    sorted_shift = np.take_along_axis(shifted, order, axis=-1)
    cumulative = np.cumsum(np.take_along_axis(probs, order, axis=-1), axis=-1)
    last = np.minimum((cumulative < mass).sum(axis=-1), scores.shape[-1] - 1)
    drop_sorted = sorted_shift > np.take_along_axis(sorted_shift, last[:, None], axis=-1)
    drop_sorted[:, :1] = False
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, -np.inf, scores).astype(scores.dtype, copy=False)


def _token_list(value, name: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0 for v in values):
        raise InputError(f"generate: {name} must be token ids (whole numbers >= 0), got {value!r}")
    return [int(v) for v in values]


@dataclass
class LogitRules:
    """transformers' logits processors that ban or force tokens (see the module's docstring). ``max_length``:
    the whole sequence's length at which generation ends (forced_eos_token_id applies one step before);
    ``begin_index``: the length at which begin_suppress_tokens apply (the first generated token's)."""

    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple = ()
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple = ()
    suppress_tokens: tuple = ()
    begin_suppress_tokens: tuple = ()
    max_length: int = 0
    begin_index: int = 0
    stop_strings: StopStrings | None = None  # not a processor: a stopping criterion (finished)
    # sampling warpers after min-p (``warp``), in transformers' order; these values leave them off
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    # the caller's (CALLER_ARGUMENTS); ``beams``: rows per prompt, for prefix_allowed_tokens_fn's batch ids
    prefix_allowed_tokens_fn: object = None
    logits_processor: tuple = ()
    stopping_criteria: tuple = ()
    beams: int = 1

    @classmethod
    def resolve(cls, sources, given: dict, *, start_length: int, max_length: int, eos: list[int],
                beams: int = 1) -> "LogitRules":
        """The rules from ``given`` (generate's arguments, pop_rule_arguments; one given as None is off, as in
        transformers), else ``sources``. ``start_length``: the tokens before the first generated one (the prompt;
        an encoder-decoder's decoder start); ``beams``: rows per prompt (beams share a prompt's batch id)."""
        value = {name: given[name] if name in given else config_value(sources, name) for name in RULE_ARGUMENTS}
        stops = given.get("stop_strings")
        ngram = value["no_repeat_ngram_size"] or 0
        if isinstance(ngram, bool) or not isinstance(ngram, (int, np.integer)) or ngram < 0:
            raise InputError(f"generate: no_repeat_ngram_size must be a whole number >= 0, got {ngram!r}")
        bad = value["bad_words_ids"] or []
        if not isinstance(bad, (list, tuple)) or not all(isinstance(s, (list, tuple)) and s for s in bad):
            raise InputError(f"generate: bad_words_ids must be a list of token-id lists, got {bad!r}")
        # as transformers: a banned "word" that is only the end-of-sequence token is dropped
        bad = tuple(tuple(_token_list(s, "bad_words_ids")) for s in bad if list(s) not in [[e] for e in eos])
        bos = value["forced_bos_token_id"]
        forced_bos = _token_list(bos, "forced_bos_token_id")[0] if bos is not None else None
        begin = start_length if start_length > 1 or forced_bos is None else start_length + 1
        warpers = {}
        for name, off in WARPER_ARGUMENTS.items():
            chosen = given[name] if name in given else config_value(sources, name)
            chosen = off if chosen is None else chosen
            high = 1.0 if name == "typical_p" else None
            check_number(name, chosen, low=0, high=high, low_open=name == "typical_p",
                         hint=f" ({off:g} applies none)")
            if name != "typical_p" and chosen >= 1:
                raise InputError(f"generate: {name} must be in [0, 1), got {chosen!r} ({off:g} applies none)")
            warpers[name] = float(chosen)
        caller = {name: given[name] for name in CALLER_ARGUMENTS if given.get(name) is not None}
        prefix = caller.get("prefix_allowed_tokens_fn")
        if prefix is not None and not callable(prefix):
            raise InputError("generate: prefix_allowed_tokens_fn must be a function (batch_id, input_ids) -> token ids")
        for name in ("logits_processor", "stopping_criteria"):
            if name in caller:
                items = caller[name]
                items = tuple(items) if isinstance(items, (list, tuple)) else (items,)
                if not all(callable(item) for item in items):
                    raise InputError(f"generate: {name} must be a list of functions (input_ids, scores) -> ...")
                caller[name] = items
        return cls(int(ngram), bad, forced_bos, tuple(_token_list(value["forced_eos_token_id"], "forced_eos_token_id")),
                   tuple(_token_list(value["suppress_tokens"], "suppress_tokens")),
                   tuple(_token_list(value["begin_suppress_tokens"], "begin_suppress_tokens")), int(max_length), begin,
                   stops, **warpers, **caller, beams=max(int(beams), 1))

    def warp(self, scores: np.ndarray) -> np.ndarray:
        """Sampling scores after min-p through transformers' typical, epsilon and eta warpers (each keeps at least
        the likeliest token; the tokens they drop at -inf)."""
        if self.typical_p < 1.0:
            scores = _typical(scores, self.typical_p)
        if 0.0 < self.epsilon_cutoff < 1.0:
            scores = _below(scores, softmax64(scores) < self.epsilon_cutoff)
        if 0.0 < self.eta_cutoff < 1.0:
            probs = softmax64(scores)
            with np.errstate(divide="ignore", invalid="ignore"):
                entropy = -np.nansum(np.where(probs > 0, probs * np.log(probs), 0.0), axis=-1, keepdims=True)
            eta = np.minimum(self.eta_cutoff, np.sqrt(self.eta_cutoff) * np.exp(-entropy))
            scores = _below(scores, probs < eta)
        return scores

    def _caller_processors(self, scores: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        for processor in self.logits_processor:
            out = np.asarray(processor(np.asarray(tokens, np.int64), scores.copy()), np.float32)
            if out.shape != scores.shape:
                raise InputError(f"generate: a logits_processor returned scores of shape {out.shape}, not "
                                 f"{scores.shape}")
            scores = out
        return scores

    def finished(self, tokens: np.ndarray) -> np.ndarray:
        """Per row of ``tokens`` [batch, T] (the chosen token last), whether a stop string or one of the caller's
        stopping criteria (given the tokens and None for the scores) ended it."""
        done = np.zeros(tokens.shape[0], bool) if self.stop_strings is None else self.stop_strings.hits(tokens)
        for criterion in self.stopping_criteria:
            done |= np.broadcast_to(np.asarray(criterion(np.asarray(tokens, np.int64), None), bool), done.shape)
        return done

    @property
    def picks_on_host(self) -> bool:
        """Whether every token must be chosen on the host (no chained GPU argmax)."""
        return self.active or self.stop_strings is not None or bool(self.stopping_criteria)

    @property
    def active(self) -> bool:
        return bool(self.no_repeat_ngram_size or self.bad_words_ids or self.forced_bos_token_id is not None
                    or self.forced_eos_token_id or self.suppress_tokens or self.begin_suppress_tokens
                    or self.prefix_allowed_tokens_fn is not None or self.logits_processor)

    def apply(self, scores: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Each row's ``scores`` [batch, vocab] for the token after ``tokens`` [batch, T] (a copy where changed)."""
        if not self.active:
            return scores
        scores = scores.copy()
        length = tokens.shape[1]
        vocab = scores.shape[1]
        forced = ([self.forced_bos_token_id] if self.forced_bos_token_id is not None else []) + \
            list(self.forced_eos_token_id)
        if any(token >= vocab for token in forced):
            raise InputError(f"generate: a forced token ({forced}) is outside the vocabulary of {vocab} tokens")
        n = self.no_repeat_ngram_size
        if n and length + 1 >= n:
            for row, seq in enumerate(tokens.tolist()):
                prefix = tuple(seq[length - n + 1:]) if n > 1 else ()
                banned = {seq[i + n - 1] for i in range(length - n + 1) if tuple(seq[i:i + n - 1]) == prefix}
                scores[row, [t for t in banned if t < vocab]] = -np.inf
        for word in self.bad_words_ids:
            if word[-1] >= vocab:
                continue
            if len(word) == 1:
                scores[:, word[0]] = -np.inf
                continue
            prefix = np.asarray(word[:-1])
            if length >= len(prefix):
                hit = (tokens[:, length - len(prefix):] == prefix).all(axis=1)
                scores[hit, word[-1]] = -np.inf
        if self.prefix_allowed_tokens_fn is not None:
            scores = self._prefix_constraint(scores, tokens)
        if self.forced_bos_token_id is not None and length == 1:
            scores[:] = -np.inf
            scores[:, self.forced_bos_token_id] = 0.0
        if self.forced_eos_token_id and length == self.max_length - 1:
            scores[:] = -np.inf
            scores[:, list(self.forced_eos_token_id)] = 0.0
        if self.suppress_tokens:
            scores[:, [t for t in self.suppress_tokens if t < vocab]] = -np.inf
        if self.begin_suppress_tokens and length == self.begin_index:
            scores[:, [t for t in self.begin_suppress_tokens if t < vocab]] = -np.inf
        if self.logits_processor:  # after transformers' own processors, before its sampling warpers
            scores = self._caller_processors(scores, tokens)
        return scores

    def _prefix_constraint(self, scores: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """transformers' PrefixConstrainedLogitsProcessor: each row keeps the tokens prefix_allowed_tokens_fn allows
        (batch_id: the row's prompt); a prompt whose every row allows only tokens already at -inf gets them at 0."""
        mask = np.full(scores.shape, -np.inf, np.float32)
        for row in range(tokens.shape[0]):
            allowed = list(self.prefix_allowed_tokens_fn(row // self.beams, np.asarray(tokens[row], np.int64)))
            if not allowed:
                raise InputError(f"generate: prefix_allowed_tokens_fn allowed no token for batch id "
                                 f"{row // self.beams}: the constraint cannot be met")
            mask[row, allowed] = 0.0
        constrained = scores + mask
        stuck = np.isneginf(constrained.max(axis=-1)).reshape(-1, self.beams).all(axis=1)
        return np.where(np.repeat(stuck, self.beams)[:, None], mask, constrained)
