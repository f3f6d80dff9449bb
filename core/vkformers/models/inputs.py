"""The checks every model's forward and ``generate`` run on their inputs, on the host, before any graph is built.

A model declares what its inputs may hold (:class:`InputLimits`: its vocabulary, its position table, ...) through
``Module.input_limits()``; ``Module.__call__`` checks a call against it, so every family gets the same checks and
the same messages. A token id outside the vocabulary would otherwise read another row of the device's memory (or
zeros) and give finite, wrong logits; a label outside it a NaN loss; a sequence past a learned position table
garbage positions. Each check is a min/max or a shape comparison over arrays the host already holds: a
tensor computed on the device is checked for its dtype and shape only (reading it back would cost a submission).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np

from vkformers.engine.tensor import Tensor
from vkformers.errors import InputError
from vkformers.runtime import dtypes as dt

IGNORE_INDEX = -100  # a label that takes no part in the loss (transformers' ignore index)


@dataclass(frozen=True)
class InputLimits:
    """What a model's forward accepts (``Module.input_limits()``)."""

    vocab_size: int                       # input_ids in [0, vocab_size): the embedding table's rows
    label_classes: int | None = None      # labels in [0, label_classes) or -100; default vocab_size
    max_length: int | None = None         # tokens per sequence (cache included) a position table has rows for;
    #                                       None: rotary or relative positions, no table to run past
    max_length_field: str = "max_position_embeddings"  # the config field that sets max_length, for messages
    min_position: int = 0                 # position_ids below it are refused (-1: a fairseq table's padding row)
    type_vocab_size: int | None = None    # token_type_ids in [0, type_vocab_size)
    decoder_vocab_size: int | None = None  # encoder-decoders: decoder_input_ids (input_ids are the encoder's)
    decoder_max_length: int | None = None
    labels_like: str | None = "input_ids"  # the argument whose shape labels have (decoder_input_ids in seq2seq);
    #                                        None: the model checks its labels itself (task heads)
    one_dimensional_ok: bool = False      # a 1-D input_ids is one sequence (the encoder-decoders take it)


def id_array(array) -> np.ndarray:
    """Token ids (or a mask) as an int64 array [batch, length]: a Tensor or array-like, one row where 1-D."""
    if isinstance(array, Tensor):
        array = array.numpy()
    array = np.asarray(array)
    if array.ndim == 1:
        array = array[None, :]
    return array.astype(np.int64)


def check_model_inputs(limits: InputLimits, arguments: dict) -> None:
    """Raise :class:`InputError` for the first argument in ``arguments`` (forward's names: input_ids,
    attention_mask, labels, position_ids, token_type_ids, decoder_input_ids, decoder_attention_mask, cache) that
    the model cannot run."""
    ids = _token_ids(limits, "input_ids", arguments.get("input_ids"), limits.vocab_size, "vocab_size")
    if ids is None:
        return
    cache = arguments.get("cache")
    past = int(getattr(cache, "position", 0) or 0)
    _mask(arguments, "attention_mask", ids, past)
    _positions(limits, arguments.get("position_ids"), ids)
    if arguments.get("position_ids") is None:
        _length("input_ids", ids.shape[-1], past, limits.max_length, limits.max_length_field)
    if arguments.get("token_type_ids") is not None and limits.type_vocab_size is not None:
        types = _token_ids(limits, "token_type_ids", arguments["token_type_ids"], limits.type_vocab_size,
                           "type_vocab_size")
        _same_shape("token_type_ids", types, "input_ids", ids)
    decoder_ids = None
    if arguments.get("decoder_input_ids") is not None:
        decoder_ids = _token_ids(limits, "decoder_input_ids", arguments["decoder_input_ids"],
                                 limits.decoder_vocab_size or limits.vocab_size, "vocab_size")
        _length("decoder_input_ids", decoder_ids.shape[-1], 0, limits.decoder_max_length, limits.max_length_field)
        _mask(arguments, "decoder_attention_mask", decoder_ids, 0)
    if arguments.get("labels") is not None and limits.labels_like is not None:
        labels = _labels(limits, arguments["labels"])
        like = ids if limits.labels_like == "input_ids" else decoder_ids
        if like is not None:
            _same_shape("labels", labels, limits.labels_like, like)
        elif limits.labels_like == "decoder_input_ids":  # the decoder reads the labels shifted right
            _length("labels", labels.shape[-1], 0, limits.decoder_max_length, limits.max_length_field)


def check_prompt_length(limits: InputLimits | None, length: int, max_new_tokens: int, decoder: bool = False) -> None:
    """generate's prompt and new tokens must fit the position table: refused before the first token. The last new
    token is never fed back, so a prompt of L tokens and N new ones reads positions 0 to L + N - 2 (the prompt
    itself was checked against the table as forward's input_ids)."""
    limit = None if limits is None else limits.decoder_max_length if decoder else limits.max_length
    needed = length + max(max_new_tokens - 1, 0)
    if limit is not None and needed > limit:
        what = "the decoder start token" if decoder else f"a prompt of {length} tokens"
        raise InputError(f"generate: {what} and max_new_tokens={max_new_tokens} need {needed} positions, past the "
                         f"model's {limit} ({limits.max_length_field}); pass max_new_tokens <= {limit - length + 1}")


# ---------------------------------------------------------------- the checks


class _Array:
    """An argument's dtype and shape, and its values when the host holds them (else None)."""

    def __init__(self, value):
        if isinstance(value, Tensor):
            self.shape, self.values = value.shape, value.peek()
            self.kind = "b" if value.dtype is dt.bool_ else "i" if value.dtype in (dt.int32, dt.uint8) else "f"
            self.type_name = value.dtype.name
        else:
            array = np.asarray(value)
            self.shape, self.values, self.kind, self.type_name = array.shape, array, array.dtype.kind, str(array.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _token_ids(limits, name, value, rows, field):
    if value is None:
        return None
    try:
        array = _Array(value)
    except ValueError:  # a ragged nested list
        raise InputError(f"{name}: rows of different lengths; pad them to one length (and pass attention_mask)") \
            from None
    if array.kind not in "iu":
        raise InputError(f"{name} holds {array.type_name} values; token ids must be integers: pass an integer "
                         "array (numpy int64 or int32), as the tokenizer returns")
    if array.ndim != 2 and not (array.ndim == 1 and limits.one_dimensional_ok):
        raise InputError(f"{name} has shape {tuple(array.shape)}; it must be [batch, length] (2-D)")
    if 0 in array.shape:
        raise InputError(f"{name} has shape {tuple(array.shape)}: every row needs at least one token")
    if array.values is not None:
        low, high = int(array.values.min()), int(array.values.max())
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise InputError(f"{name} holds id {bad}, outside the model's {rows} ids ({field}: 0 to {rows - 1}); "
                             "check that the tokenizer belongs to this model")
    return array


def _labels(limits, value):
    classes = limits.label_classes or limits.vocab_size
    array = _Array(value)
    if array.kind not in "iu":
        raise InputError(f"labels hold {array.type_name} values; labels must be integer token ids (-100: ignored)")
    if array.values is not None and array.values.size:
        values = array.values
        bad = values[(values != IGNORE_INDEX) & ((values < 0) | (values >= classes))]
        if bad.size:
            raise InputError(f"labels hold {int(bad.reshape(-1)[0])}, outside the model's {classes} classes "
                             f"(0 to {classes - 1}, or -100 for a position the loss ignores)")
    return array


def _mask(arguments, name, ids, past: int) -> None:
    value = arguments.get(name)
    if value is None:
        return
    mask = _Array(value)
    if mask.kind not in "biuf":
        raise InputError(f"{name} holds {mask.type_name} values; it must hold 1 (a token) and 0 (padding)")
    rows = ids.shape if ids.ndim == 2 else (1, ids.shape[0])
    shape = tuple(mask.shape) if mask.ndim == 2 else (1, mask.shape[0]) if mask.ndim == 1 else tuple(mask.shape)
    expected = [rows] + ([(rows[0], past + rows[1])] if past else [])
    if shape not in expected:
        with_cache = f" (or {expected[1]}: the cached tokens and the new ones)" if past else ""
        raise InputError(f"{name} has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}; the mask needs one "
                         f"entry per token: {rows}{with_cache}")
    if mask.values is not None and not np.isin(mask.values, (0, 1)).all():
        raise InputError(f"{name} holds values other than 0 and 1; it must hold 1 (a token) and 0 (padding)")


def _positions(limits, value, ids) -> None:
    if value is None:
        return
    positions = _Array(value)
    if positions.kind not in "iu":
        raise InputError(f"position_ids hold {positions.type_name} values; they must be integers")
    rows = ids.shape if ids.ndim == 2 else (1, ids.shape[0])
    try:
        np.broadcast_shapes(tuple(positions.shape), rows)
    except ValueError:
        raise InputError(f"position_ids have shape {tuple(positions.shape)}, input_ids {tuple(ids.shape)}; "
                         "they need one position per token") from None
    if positions.values is not None and positions.values.size:
        low, high = int(positions.values.min()), int(positions.values.max())
        if low < limits.min_position:
            raise InputError(f"position_ids hold {low}; positions count from {limits.min_position}")
        if limits.max_length is not None and high >= limits.max_length:
            raise InputError(f"position_ids hold {high}, past the model's {limits.max_length} positions "
                             f"({limits.max_length_field}: 0 to {limits.max_length - 1})")


def _length(name, length: int, past: int, limit, field) -> None:
    if limit is not None and past + length > limit:
        cached = f" after {past} cached ones" if past else ""
        raise InputError(f"{name}: {length} tokens{cached} run past the model's {limit} positions ({field}); "
                         f"truncate the input to at most {limit - past} tokens")


def _same_shape(name, array, other_name, other) -> None:
    if tuple(array.shape) != tuple(other.shape):
        raise InputError(f"{name} has shape {tuple(array.shape)}, {other_name} {tuple(other.shape)}; "
                         "they must match")


# ---------------------------------------------------------------- binding a call to forward's names

_PARAMETERS: dict[type, list[str]] = {}


def forward_arguments(model, args: tuple, kwargs: dict) -> dict:
    """``{name: value}`` of a forward call, by the names of the first ``forward`` in the model's classes that
    lists them (a subclass's ``forward(input_ids, *args, **kwargs)`` passes through to its parent's)."""
    cls = type(model)
    names = _PARAMETERS.get(cls)
    if names is None:
        names = []
        for klass in cls.__mro__:
            forward = klass.__dict__.get("forward")
            if forward is None:
                continue
            parameters = list(inspect.signature(forward).parameters.values())[1:]
            if not any(p.kind is p.VAR_POSITIONAL for p in parameters):
                names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
                break
        _PARAMETERS[cls] = names
    arguments = dict(zip(names, args))
    arguments.update(kwargs)
    return arguments


def check_number(name: str, value, *, low=None, high=None, low_open=False, integer=False, hint: str = "") -> None:
    """A generation setting: a finite number (an integer where ``integer``) within [low, high] ((low, high] with
    ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InputError(f"generate: {name} must be a number, got {value!r}{hint}")
    if integer and not float(value).is_integer():
        raise InputError(f"generate: {name} must be a whole number, got {value!r}{hint}")
    if not math.isfinite(value) or (low is not None and (value <= low if low_open else value < low)) or \
            (high is not None and value > high):
        if high is not None:
            bounds = f"in {'(' if low_open else '['}{low}, {high}]"
        else:
            bounds = f"a finite {'whole ' if integer else ''}number {'>' if low_open else '>='} {low}"
        raise InputError(f"generate: {name} must be {bounds}, got {value!r}{hint}")


# transformers' generate arguments that change nothing at these values: vkformers decodes one beam, always with a
# cache, and returns the token ids only
NEUTRAL_OPTIONS = {"num_beams": 1, "num_beam_groups": 1, "return_dict_in_generate": False, "output_scores": False,
                   "output_attentions": False, "output_hidden_states": False}


# the names generation_lengths takes
TRANSFORMERS_ARGUMENTS = frozenset({"max_length", "min_length", "min_new_tokens", "num_return_sequences",
                                    "use_cache", *NEUTRAL_OPTIONS})


@dataclass(frozen=True)
class Lengths:
    """How many tokens generate makes per row, and how many rows per prompt."""

    max_new_tokens: int
    min_new_tokens: int = 0       # end-of-sequence tokens are held back until this many new tokens
    num_return_sequences: int = 1


def generation_lengths(options: dict, max_new_tokens, start_length: int, do_sample: bool) -> Lengths:
    """generate's lengths from its own ``max_new_tokens`` (None: not given) and transformers' arguments in
    ``options``: ``max_length`` and ``min_length`` count the whole sequence (the prompt, or an encoder-decoder's
    decoder start, of ``start_length`` tokens, included) and give way to ``max_new_tokens`` / ``min_new_tokens``;
    ``num_return_sequences`` samples that many rows per prompt; ``use_cache`` and NEUTRAL_OPTIONS at their values
    pass. Anything else is refused by name. 20 new tokens when no length is given."""
    options = dict(options)
    max_length, min_length = options.pop("max_length", None), options.pop("min_length", None)
    min_new_tokens, count = options.pop("min_new_tokens", None), options.pop("num_return_sequences", 1)
    if not isinstance(options.pop("use_cache", True), bool):
        raise InputError("generate: use_cache must be True or False (vkformers always decodes with a cache)")
    for name, value in options.items():
        if name not in NEUTRAL_OPTIONS:
            raise InputError(f"generate: unknown argument {name!r}")
        if value != NEUTRAL_OPTIONS[name]:
            raise InputError(f"generate: {name}={value!r} is not supported; leave it at {NEUTRAL_OPTIONS[name]!r}")
    if max_new_tokens is None and max_length is not None:
        check_number("max_length", max_length, low=1, integer=True)
        if max_length <= start_length:
            raise InputError(f"generate: max_length={max_length} leaves no room after the {start_length} tokens "
                             "already there (it counts the whole sequence); give max_new_tokens instead")
        max_new_tokens = int(max_length) - start_length
    max_new_tokens = 20 if max_new_tokens is None else max_new_tokens
    check_number("max_new_tokens", max_new_tokens, low=0, integer=True)
    if min_new_tokens is None and min_length is not None:
        check_number("min_length", min_length, low=0, integer=True)
        min_new_tokens = max(0, int(min_length) - start_length)
    check_number("min_new_tokens", 0 if min_new_tokens is None else min_new_tokens, low=0, integer=True)
    check_number("num_return_sequences", count, low=1, integer=True)
    if count > 1 and not do_sample:
        raise InputError(f"generate: num_return_sequences={count} needs do_sample=True or num_beams >= "
                         f"{count} (greedy decoding gives one sequence per prompt)")
    return Lengths(int(max_new_tokens), int(min_new_tokens or 0), int(count))


def check_generation_settings(max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty=1.0,
                              min_p: float = 0.0) -> None:
    """generate's settings, refused when invalid whether or not they are used (temperature when greedy, ...)."""
    check_number("max_new_tokens", max_new_tokens, low=0, integer=True)
    check_number("temperature", temperature, low=0, hint=" (do_sample=False decodes greedily)")
    if do_sample and temperature == 0:
        raise InputError("generate: temperature must be > 0 when sampling, got 0 (use do_sample=False for greedy "
                         "decoding)")
    check_number("top_k", top_k, low=0, integer=True, hint=" (0 keeps every token)")
    check_number("top_p", top_p, low=0, high=1, low_open=True, hint=" (1 keeps every token)")
    check_number("min_p", min_p, low=0, high=1, hint=" (0 keeps every token)")
    check_number("repetition_penalty", repetition_penalty, low=0, low_open=True, hint=" (1 applies none)")
