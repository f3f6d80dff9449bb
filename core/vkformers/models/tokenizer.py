"""Tokenizers of Hugging Face checkpoints: ``tokenizer.json`` through the ``tokenizers`` library.

``AutoTokenizer.from_pretrained(path_or_repo)`` (models/loading.py) reads ``tokenizer.json`` (the "fast"
tokenizer file every recent checkpoint ships) and ``tokenizer_config.json`` (special tokens, ``add_bos_token``,
padding side, chat template), or the tokenizer a ``.gguf`` file describes. A checkpoint without tokenizer.json has its
slow tokenizer's files (``vocab.txt``; ``vocab.json`` + ``merges.txt``; a SentencePiece ``.model``) rebuilt into the
``tokenizers`` tokenizer transformers builds from them (models/slow_tokenizers.py). The object it returns behaves
like a transformers fast tokenizer for the parts inference and training need::

    tok = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    batch = tok(["hi", "a longer prompt"], padding=True, padding_side="left", return_tensors="np")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    tok.decode(ids, skip_special_tokens=True)

As in transformers, a call pads or truncates only when it asks (``padding=``, ``truncation=``, ``max_length=``);
the padding and truncation a tokenizer.json may store (sentence-transformers checkpoints store pad-to-128) are not
applied, only their sides and pad token kept as defaults. BERT-style tokenizers also return ``token_type_ids``.

Chat templates are Jinja, rendered like transformers renders them (sandboxed, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML), so a template written for
transformers produces the same text here.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import threading
import warnings
from datetime import datetime
from pathlib import Path

import numpy as np

from vkformers.errors import VkformersError
from vkformers.models.hub import push_saved
from vkformers.models.slow_tokenizers import SlowTokenizerError, load_slow_tokenizer
from vkformers.models.tokenizer_files import extra_special_tokens, read_json, token_text, tokenizer_config

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# transformers' tokenizer classes whose model_input_names include token_type_ids (BERT-style models take them),
# by tokenizer_config.json "tokenizer_class" (with or without "Fast"), else by config.json "model_type".
TOKEN_TYPE_TOKENIZER_CLASSES = frozenset({
    "BertTokenizer", "CanineTokenizer", "ConvBertTokenizer", "DebertaTokenizer", "DebertaV2Tokenizer",
    "DPRContextEncoderTokenizer", "DPRQuestionEncoderTokenizer", "ElectraTokenizer", "FNetTokenizer",
    "LayoutLMTokenizer", "LayoutLMv2Tokenizer", "LxmertTokenizer", "MarkupLMTokenizer", "MobileBertTokenizer",
    "SqueezeBertTokenizer", "TapasTokenizer"})
TOKEN_TYPE_MODEL_TYPES = frozenset({
    "align", "bert", "blip", "bros", "canine", "chinese_clip", "convbert", "deberta", "deberta-v2", "distilbert",
    "dpr", "electra", "ernie", "flava", "fnet", "git", "layoutlm", "layoutlmv2", "lxmert", "markuplm",
    "megatron-bert", "mobilebert", "nezha", "nomic_bert", "qdqbert", "realm", "retribert", "squeezebert", "tapas",
    "tvp", "vilt", "visual_bert"})
PADDING_STRATEGIES = ("longest", "max_length", "do_not_pad")
TRUNCATION_STRATEGIES = ("longest_first", "only_first", "only_second", "do_not_truncate")
# transformers' tokenizer classes that switch to the target language's special tokens for text_target
TARGET_MODE_TOKENIZER_CLASSES = frozenset({
    "M2M100Tokenizer", "MarianTokenizer", "MBart50Tokenizer", "MBartTokenizer", "NllbTokenizer", "PLBartTokenizer",
    "RagTokenizer", "SeamlessM4TTokenizer"})
LARGE_INTEGER = int(1e20)  # transformers: a model_max_length above this means "no limit" (it stores 1e30)


def _model_input_names(config: dict) -> list[str]:
    """What transformers' tokenizer class for this checkpoint returns by default."""
    tokenizer_class = config.get("tokenizer_class")
    if tokenizer_class is not None:
        has_token_types = tokenizer_class.removesuffix("Fast") in TOKEN_TYPE_TOKENIZER_CLASSES
    else:
        has_token_types = config.get("model_type") in TOKEN_TYPE_MODEL_TYPES
    return ["input_ids", "token_type_ids", "attention_mask"] if has_token_types else ["input_ids", "attention_mask"]


class TokenizerError(VkformersError, ValueError):
    """A tokenizer that cannot be loaded or a call it cannot honour (e.g. padding without a pad token)."""


class BatchEncoding(dict):
    """``{"input_ids": ..., "attention_mask": ...}`` that also reads as attributes, like transformers'.

    A tokenizer call's result also keeps each row's ``tokenizers.Encoding`` (``encodings``), for the per-token
    maps transformers' fast tokenizers give: ``word_ids(i)``, ``sequence_ids(i)``, ``tokens(i)`` (row ``i``,
    padding and overflow rows included; None for special and pad tokens)."""

    def __init__(self, data=None, encodings=None):
        super().__init__(data or {})
        self.encodings = encodings

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def _encoding(self, batch_index: int, what: str):
        if self.encodings is None:
            raise TokenizerError(f"{what}() needs the encodings of a tokenizer call; this BatchEncoding has none")
        if not -len(self.encodings) <= batch_index < len(self.encodings):
            raise TokenizerError(f"{what}({batch_index}): the batch has {len(self.encodings)} row(s)")
        return self.encodings[batch_index]

    def word_ids(self, batch_index: int = 0) -> list:
        """Each token's word index in its text (None for special and pad tokens), as transformers gives it."""
        return self._encoding(batch_index, "word_ids").word_ids

    def sequence_ids(self, batch_index: int = 0) -> list:
        """Each token's sequence: 0 the text, 1 the pair's second text, None special and pad tokens."""
        return self._encoding(batch_index, "sequence_ids").sequence_ids

    def tokens(self, batch_index: int = 0) -> list[str]:
        return self._encoding(batch_index, "tokens").tokens


def _as_id_list(ids) -> list[int]:
    if hasattr(ids, "numpy"):  # a vkformers Tensor
        ids = ids.numpy()
    return np.asarray(ids).reshape(-1).astype(np.int64).tolist()


def _as_array(name: str, values: list) -> np.ndarray:
    """One int64 array of a batch's rows; rows of different lengths are refused (they need padding)."""
    lengths = sorted({len(v) for v in values if isinstance(v, (list, tuple))})
    if len(lengths) > 1:
        raise TokenizerError(f"{name}: rows of {lengths[0]} to {lengths[-1]} tokens cannot become one array; "
                             "pass padding=True (or padding='max_length') with return_tensors='np'")
    return np.asarray(values, dtype=np.int64) if values else np.zeros((0, 0), dtype=np.int64)


# transformers' clean-up of decoded text: the space a word-by-word tokenizer leaves before these goes
CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def clean_up_tokenization(text: str) -> str:
    for spaced, joined in CLEAN_UP:
        text = text.replace(spaced, joined)
    return text


class PreTrainedTokenizer:
    """A ``tokenizers.Tokenizer`` plus the settings transformers keeps in ``tokenizer_config.json``."""

    def __init__(self, backend, config: dict | None = None, *, name_or_path: str = ""):
        self.backend = backend
        self.config = dict(config or {})
        self.name_or_path = name_or_path
        self.saved_files: list[Path] = []  # what save_pretrained copies instead of writing tokenizer.json
        self.target_mode: tuple | None = None  # the (normalizer, pre-tokenizer) of text_target, where it differs
        # Held while the backend encodes: a call sets the backend's padding and truncation for itself (and
        # target_mode its normalizer and pre-tokenizer), so that a call in another thread must not encode then.
        self._backend_lock = threading.RLock()
        # tokenizer.json may store a padding and a truncation (sentence-transformers checkpoints pad to 128 and
        # cut there); transformers takes only their sides and pad token as defaults and pads or truncates a
        # call only when the call asks, so the backend keeps neither.
        stored_padding, stored_truncation = backend.padding or {}, backend.truncation or {}
        backend.no_padding()
        backend.no_truncation()
        self.padding_side = self.config.get("padding_side") or stored_padding.get("direction") or "right"
        self.truncation_side = self.config.get("truncation_side") or stored_truncation.get("direction") or "right"
        self.pad_token_type_id = stored_padding.get("pad_type_id", 0)
        self.model_max_length = self.config.get("model_max_length")
        self.model_input_names = list(self.config.get("model_input_names") or _model_input_names(self.config))
        self.chat_template = self.config.get("chat_template")
        for name in SPECIAL_TOKEN_NAMES:
            setattr(self, name, token_text(self.config.get(name)))
        if self.pad_token is None and stored_padding.get("pad_token") is not None:
            self.pad_token = stored_padding["pad_token"]
        self.additional_special_tokens = [token_text(t) for t in extra_special_tokens(self.config)]
        # the fill-in-the-middle token ids a GGUF file names (role -> id; models/fill_in_middle.py); a vocabulary's
        # own spelling of them is found there
        self.fim_token_ids: dict[str, int] = {}
        if "add_bos_token" in self.config or "add_eos_token" in self.config:
            self._set_bos_eos_post_processor(bool(self.config.get("add_bos_token")),
                                             bool(self.config.get("add_eos_token")))

    # -- special tokens ------------------------------------------------------------------------------------
    def _set_bos_eos_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """What transformers' Llama-style tokenizers do with add_bos_token/add_eos_token: rebuild the template."""
        from tokenizers import processors  # loaded with the first tokenizer, not with vkformers
        bos = [self.bos_token] if add_bos and self.bos_token_id is not None else []
        eos = [self.eos_token] if add_eos and self.eos_token_id is not None else []
        single = [*bos, "$A", *eos]
        pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
        specials = [(t, self._token_id(t)) for t in dict.fromkeys(bos + eos)]
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def _token_id(self, token):
        return None if token is None else self.backend.token_to_id(token)

    # bos_token_id, eos_token_id, ...: the id of each named special token (None where it has none)
    bos_token_id, eos_token_id, unk_token_id, sep_token_id, pad_token_id, cls_token_id, mask_token_id = (
        property(lambda self, name=name: self._token_id(getattr(self, name))) for name in SPECIAL_TOKEN_NAMES)

    @property
    def special_tokens_map(self) -> dict:
        """The named special tokens (what chat templates see as ``bos_token``, ``eos_token``, ...)."""
        named = {name: getattr(self, name) for name in SPECIAL_TOKEN_NAMES if getattr(self, name) is not None}
        if self.additional_special_tokens:
            named["additional_special_tokens"] = list(self.additional_special_tokens)
        return named

    @property
    def all_special_tokens(self) -> list[str]:
        tokens = [t for name, t in self.special_tokens_map.items() if name != "additional_special_tokens"]
        tokens += self.additional_special_tokens
        tokens += [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._token_id(t) for t in self.all_special_tokens) if i is not None]

    # -- vocabulary ----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def add_tokens(self, new_tokens, special_tokens: bool = False) -> int:
        """transformers' add_tokens: tokens (strings, or tokenizers.AddedToken) matched whole before the model's own
        splitting and given the next ids; returns how many are new. The model then needs
        ``resize_token_embeddings(len(tokenizer))``."""
        from tokenizers import AddedToken  # loaded with the first tokenizer, not with vkformers
        tokens = [new_tokens] if isinstance(new_tokens, (str, AddedToken)) else list(new_tokens)
        if not all(isinstance(t, (str, AddedToken)) and str(t) for t in tokens):
            raise TokenizerError(f"add_tokens takes non-empty strings (or AddedToken), got {new_tokens!r}")
        tokens = [t if isinstance(t, AddedToken) else
                  AddedToken(t, special=special_tokens, normalized=not special_tokens) for t in tokens]
        return self.backend.add_special_tokens(tokens) if special_tokens else self.backend.add_tokens(tokens)

    def add_special_tokens(self, special_tokens_dict: dict, replace_additional_special_tokens: bool = True) -> int:
        """transformers' add_special_tokens: ``{"pad_token": "<pad>", "additional_special_tokens": [...]}``; each
        named token becomes the tokenizer's (``pad_token``, ...), added to the vocabulary if new (the count
        returned)."""
        if not isinstance(special_tokens_dict, dict):
            raise TokenizerError(f"add_special_tokens takes a dict such as {{'pad_token': '<pad>'}}, got "
                                 f"{special_tokens_dict!r}")
        added = 0
        for key, value in special_tokens_dict.items():
            if key in SPECIAL_TOKEN_NAMES:
                added += self.add_tokens([value], special_tokens=True)
                setattr(self, key, token_text(value))
            elif key in ("additional_special_tokens", "extra_special_tokens"):
                added += self.add_tokens(list(value), special_tokens=True)
                contents = [token_text(v) for v in value]
                kept = [] if replace_additional_special_tokens else self.additional_special_tokens
                self.additional_special_tokens = list(dict.fromkeys(kept + contents))
            else:
                raise TokenizerError(f"add_special_tokens: {key!r} is not one of {', '.join(SPECIAL_TOKEN_NAMES)}, "
                                     "additional_special_tokens")
        return added

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, (int, np.integer)):
            return self.backend.id_to_token(int(ids))
        return [self.backend.id_to_token(i) for i in _as_id_list(ids)]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Tokens back to text through the tokenizer's decoder (a WordPiece's "##" joined, a byte-level BPE's
        bytes), as transformers' fast tokenizers do; without a decoder, joined by spaces."""
        decoder = self.backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    # -- encoding ------------------------------------------------------------------------------------------
    def encode(self, text, text_pair=None, *, add_special_tokens: bool = True, padding=False, truncation=None,
               max_length: int | None = None, stride: int = 0, padding_side: str | None = None,
               return_tensors: str | None = None, **kwargs) -> list[int]:
        """The ids of one text (or pair), as ``__call__`` computes them."""
        return self(text, text_pair, add_special_tokens=add_special_tokens, padding=padding, truncation=truncation,
                    max_length=max_length, stride=stride, padding_side=padding_side, return_tensors=return_tensors,
                    return_attention_mask=False, return_token_type_ids=False, **kwargs)["input_ids"]

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[str]:
        with self._backend_lock:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def __call__(self, text=None, text_pair=None, *, text_target=None, text_pair_target=None,
                 max_target_length: int | None = None, **options) -> BatchEncoding:
        """Encode ``text`` (see :meth:`encode_texts` for the options), ``text_target`` (a sequence-to-sequence
        model's decoder texts, with ``text_pair_target``) or both, as transformers does: the targets are encoded with
        the same options (``max_target_length``, where given, for their ``max_length``) and, beside ``text``, their
        ids are returned as ``labels`` (padding included: a collator masks it)."""
        if text is None and text_target is None:
            raise TokenizerError("tokenizer call: give text, text_target or both")
        encodings = None if text is None else self.encode_texts(text, text_pair, **options)
        if text_target is None:
            return encodings
        target_class = str(self.config.get("tokenizer_class") or "").removesuffix("Fast")
        if target_class in TARGET_MODE_TOKENIZER_CLASSES and self.target_mode is None:
            raise TokenizerError(f"text_target: transformers' {target_class} encodes targets with the target "
                                 "language's tokens, which vkformers does not set; encode the targets apart with "
                                 "them")
        target_options = dict(options)
        if max_target_length is not None:
            if options.get("max_length") is None and options.get("truncation") is None:
                target_options["truncation"] = False  # transformers decides truncation from max_length alone
            target_options["max_length"] = max_target_length
        with self._target_mode():
            targets = self.encode_texts(text_target, text_pair_target, **target_options)
        if encodings is None:
            return targets
        encodings["labels"] = targets["input_ids"]
        return encodings

    @contextlib.contextmanager
    def _target_mode(self):
        """The backend cutting text as the target language's model does (Marian's target.spm), while encoding
        targets."""
        if self.target_mode is None:
            yield
            return
        with self._backend_lock:
            kept = self.backend.normalizer, self.backend.pre_tokenizer
            self.backend.normalizer, self.backend.pre_tokenizer = self.target_mode
            try:
                yield
            finally:
                self.backend.normalizer, self.backend.pre_tokenizer = kept

    def encode_texts(self, text, text_pair=None, *, add_special_tokens: bool = True, padding=False, truncation=None,
                 max_length: int | None = None, stride: int = 0, is_split_into_words: bool = False,
                 pad_to_multiple_of: int | None = None, padding_side: str | None = None,
                 return_tensors: str | None = None, return_token_type_ids: bool | None = None,
                 return_attention_mask: bool | None = None, return_overflowing_tokens: bool = False,
                 return_special_tokens_mask: bool = False, return_offsets_mapping: bool = False,
                 return_length: bool = False, verbose: bool = True, **unsupported) -> BatchEncoding:
        """Encode a text, a pair (``tok(a, b)``) or a batch of either, as transformers' fast tokenizers do:
        nothing is padded or truncated unless asked.

        ``padding``: False/"do_not_pad", True/"longest" (the batch's longest) or "max_length" (``max_length``,
        default ``model_max_length``), rounded up to ``pad_to_multiple_of``, on ``padding_side`` ("left" or
        "right"; default the tokenizer's). ``truncation``: False/"do_not_truncate", True/"longest_first",
        "only_first" or "only_second", to ``max_length`` (default ``model_max_length``); ``max_length`` alone
        truncates longest-first. ``return_overflowing_tokens`` with ``stride`` returns the truncated remainder
        as extra rows (``overflow_to_sample_mapping`` names each row's text). ``is_split_into_words``: the texts
        are lists of words. ``return_token_type_ids``/``return_attention_mask`` default to what the model takes
        (``model_input_names``). ``return_tensors="np"`` gives int64 arrays [batch, length] (a single text
        becomes a batch of one); without it a batch gives lists of lists, a single text plain lists."""
        if unsupported:
            raise TokenizerError(f"tokenizer call: unsupported argument(s) {', '.join(sorted(unsupported))}")
        if return_tensors is not None and return_tensors != "np":
            raise TokenizerError(f"return_tensors={return_tensors!r}: vkformers runs without torch, tensorflow or "
                                 "jax and returns numpy arrays; use return_tensors='np'")
        padding_strategy, truncation_strategy, max_length = self._padding_truncation_strategies(
            padding, truncation, max_length, pad_to_multiple_of, verbose)
        side = padding_side if padding_side is not None else self.padding_side
        if side not in ("left", "right"):
            raise TokenizerError(f"padding_side={side!r}: use 'left' or 'right'")
        batched, inputs = self._batch_inputs(text, text_pair, is_split_into_words)
        encodings = self._encode_batch(inputs, add_special_tokens, is_split_into_words, padding_strategy,
                                       truncation_strategy, max_length, stride, pad_to_multiple_of, side)
        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        columns = {"input_ids": lambda e: e.ids}
        if return_token_type_ids:
            columns["token_type_ids"] = lambda e: e.type_ids
        if return_attention_mask:
            columns["attention_mask"] = lambda e: e.attention_mask
        if return_special_tokens_mask:
            columns["special_tokens_mask"] = lambda e: e.special_tokens_mask
        if return_offsets_mapping:
            columns["offset_mapping"] = lambda e: e.offsets
        if return_length:
            columns["length"] = lambda e: len(e.ids)
        rows, sample_of_row = [], []
        for index, encoding in enumerate(encodings):
            for row in [encoding, *encoding.overflowing] if return_overflowing_tokens else [encoding]:
                rows.append(row)
                sample_of_row.append(index)
        out = BatchEncoding({name: [column(row) for row in rows] for name, column in columns.items()}, rows)
        if return_overflowing_tokens:
            out["overflow_to_sample_mapping"] = sample_of_row
        if return_tensors == "np":
            return BatchEncoding({name: _as_array(name, values) for name, values in out.items()}, rows)
        if not batched and not return_overflowing_tokens:  # one text: drop the batch level, as transformers does
            out = BatchEncoding({name: values[0] if values and isinstance(values[0], list) else values
                                 for name, values in out.items()}, rows)
        return out

    def _padding_truncation_strategies(self, padding, truncation, max_length, pad_to_multiple_of, verbose):
        """transformers' rules: ``(padding, truncation, max_length)`` as the backend takes them."""
        if max_length is not None and padding is False and truncation is None:
            truncation = "longest_first"  # max_length alone truncates (transformers' backward compatibility)
        if padding is True:
            if verbose and max_length is not None and truncation in (None, False, "do_not_truncate"):
                warnings.warn("max_length is ignored when padding=True and there is no truncation; to pad to "
                              "max_length, use padding='max_length'", stacklevel=3)
            padding = "longest"
        elif padding is False or padding is None:
            padding = "do_not_pad"
        if padding not in PADDING_STRATEGIES:
            raise TokenizerError(f"padding={padding!r}: use False, True/'longest', 'max_length' or 'do_not_pad'")
        if truncation is True:
            truncation = "longest_first"
        elif truncation is False or truncation is None:
            truncation = "do_not_truncate"
        if truncation not in TRUNCATION_STRATEGIES:
            raise TokenizerError(f"truncation={truncation!r}: use False, True/'longest_first', 'only_first', "
                                 "'only_second' or 'do_not_truncate'")
        if max_length is None:
            limit = self.model_max_length
            unbounded = limit is None or limit > LARGE_INTEGER
            if padding == "max_length":
                if unbounded:
                    padding = "do_not_pad"
                else:
                    max_length = limit
            if truncation != "do_not_truncate":
                if unbounded:
                    truncation = "do_not_truncate"
                else:
                    max_length = limit
        elif not isinstance(max_length, (int, np.integer)) or isinstance(max_length, bool) or max_length < 0:
            raise TokenizerError(f"max_length={max_length!r}: a number of tokens (an int >= 0)")
        if padding != "do_not_pad" and self.pad_token_id is None:
            raise TokenizerError("this tokenizer has no pad token; set one first, e.g. "
                                 "`tokenizer.pad_token = tokenizer.eos_token`")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, (int, np.integer))
                                               or pad_to_multiple_of < 1):
            raise TokenizerError(f"pad_to_multiple_of={pad_to_multiple_of!r}: a positive int")
        if (truncation != "do_not_truncate" and padding != "do_not_pad" and pad_to_multiple_of is not None
                and max_length is not None and max_length % pad_to_multiple_of != 0):
            raise TokenizerError(f"truncation and padding are both on but the truncation length ({max_length}) is "
                                 f"not a multiple of pad_to_multiple_of ({pad_to_multiple_of}); pick a max_length "
                                 "that is")
        return padding, truncation, None if max_length is None else int(max_length)

    @staticmethod
    def _batch_inputs(text, text_pair, is_split_into_words):
        """``(batched, inputs)``: the backend's list of texts or (text, pair) tuples."""
        def valid(value):
            if isinstance(value, str):
                return True
            if not isinstance(value, (list, tuple)):
                return False
            if not value or isinstance(value[0], str):
                return True
            if isinstance(value[0], (list, tuple)):
                return not value[0] or isinstance(value[0][0], str)
            return False

        for name, value in (("text", text), ("text_pair", text_pair)):
            if value is not None and not valid(value):
                raise TokenizerError(f"{name} is a {type(value).__name__}: pass a str, a list of str (a batch), or "
                                     "with is_split_into_words=True a list of words or a list of such lists")
        if text is None:
            raise TokenizerError("no text given")
        if is_split_into_words:
            batched = isinstance(text, (list, tuple)) and bool(text) and isinstance(text[0], (list, tuple))
        else:
            batched = isinstance(text, (list, tuple))
        if not batched:
            return False, [(text, text_pair)] if text_pair else [text]
        if isinstance(text_pair, str):
            raise TokenizerError("a batch of texts needs text_pair as a list of the same length, not a str")
        if text_pair is not None and len(text) != len(text_pair):
            raise TokenizerError(f"{len(text)} texts but {len(text_pair)} text pairs")
        return True, list(zip(text, text_pair)) if text_pair is not None else list(text)

    def _encode_batch(self, inputs, add_special_tokens, is_split_into_words, padding, truncation, max_length,
                      stride, pad_to_multiple_of, side):
        """The backend's encodings with this call's padding and truncation (set for the call only: the
        tokenizer never pads or truncates unless asked)."""
        if not inputs:
            return []
        with self._backend_lock:
            try:
                if truncation != "do_not_truncate":
                    self.backend.enable_truncation(max_length, stride=stride, strategy=truncation,
                                                   direction=self.truncation_side)
                if padding != "do_not_pad":
                    self.backend.enable_padding(direction=side, pad_id=self.pad_token_id, pad_token=self.pad_token,
                                                pad_type_id=self.pad_token_type_id,
                                                pad_to_multiple_of=pad_to_multiple_of,
                                                length=max_length if padding == "max_length" else None)
                return self.backend.encode_batch(inputs, add_special_tokens=add_special_tokens,
                                                 is_pretokenized=is_split_into_words)
            except Exception as exc:  # the Rust side raises a bare Exception (e.g. a pair too short to truncate)
                raise TokenizerError(f"cannot encode with truncation={truncation!r}, max_length={max_length}, "
                                     f"stride={stride}: {exc}") from None
            finally:
                self.backend.no_truncation()
                self.backend.no_padding()

    # -- decoding ------------------------------------------------------------------------------------------
    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None) -> str:
        """Text of token ids (a list, numpy array or Tensor); like transformers, special tokens stay unless
        ``skip_special_tokens=True``, and ``clean_up_tokenization_spaces`` (default: tokenizer_config.json's, else
        False) drops the space before punctuation and English contractions, except for a BPE vocabulary, where
        transformers skips it (it would remove spaces the text had)."""
        if isinstance(ids, (int, np.integer)):
            ids = [int(ids)]
        text = self.backend.decode(_as_id_list(ids), skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))
        if clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            text = clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        if hasattr(sequences, "numpy"):
            sequences = sequences.numpy()
        return [self.decode(s, skip_special_tokens=skip_special_tokens,
                            clean_up_tokenization_spaces=clean_up_tokenization_spaces) for s in sequences]

    # -- chat ----------------------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None) -> str:
        """The template: the argument (a template or the name of one), else the tokenizer's ("default" of many)."""
        templates = self.chat_template
        if isinstance(templates, list):  # [{"name": ..., "template": ...}] as tokenizer_config.json stores several
            templates = {t["name"]: t["template"] for t in templates}
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if "default" not in templates:
                    raise TokenizerError(f"several chat templates ({', '.join(templates)}) and none named default; "
                                         "pass chat_template=NAME")
                return templates["default"]
        if chat_template is not None:
            return chat_template
        if not templates:
            raise TokenizerError(f"{self.name_or_path or 'this tokenizer'} has no chat template "
                                 "(tokenizer_config.json 'chat_template' or chat_template.jinja); pass chat_template=...")
        return templates

    def apply_chat_template(self, conversation, *, tools=None, documents=None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, padding=False, truncation=False, max_length=None,
                            return_tensors=None, return_dict: bool = True, **template_kwargs):
        """Render messages (``[{"role": ..., "content": ...}, ...]``, or a list of such conversations) with the
        chat template. ``tokenize=False`` returns the text; otherwise, as in transformers 5, the encoding dict
        (``return_dict=False``: just the ids). The rendered text already holds the template's special tokens,
        so it is encoded without adding BOS again."""
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("continue_final_message and add_generation_prompt exclude each other")
        if not conversation:
            raise TokenizerError("cannot apply a chat template to an empty conversation")
        batched = isinstance(conversation[0], (list, tuple))
        conversations = list(conversation) if batched else [conversation]
        template = compile_chat_template(self.get_chat_template(chat_template))
        context = {**self.special_tokens_map, **template_kwargs}
        rendered = [render_chat(template, list(messages), tools=tools, documents=documents,
                                add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, **context)
                    for messages in conversations]
        text = rendered if batched else rendered[0]
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False, padding=padding, truncation=truncation, max_length=max_length,
                   return_tensors=return_tensors)
        return out if return_dict else out["input_ids"]

    def save_pretrained(self, folder) -> None:
        """tokenizer.json and tokenizer_config.json (special tokens, BOS/EOS flags, chat template), as
        :func:`load_tokenizer_folder` and transformers read them."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.saved_files:  # a rebuilt tokenizer with Python parts: its own files, as transformers saves them
            for file in self.saved_files:
                if file.resolve() != (folder / file.name).resolve():
                    shutil.copyfile(file, folder / file.name)
        else:
            self.backend.save(str(folder / "tokenizer.json"))
        config = {k: v for k, v in self.config.items() if v is not None}
        for name in SPECIAL_TOKEN_NAMES:
            if getattr(self, name, None) is not None:
                config[name] = getattr(self, name)
        if self.additional_special_tokens:
            config["additional_special_tokens"] = list(self.additional_special_tokens)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                      encoding="utf-8")

    def push_to_hub(self, repo_id: str, *, commit_message: str = "Upload tokenizer", private: bool | None = None,
                    token=None, create_pr: bool = False, revision: str | None = None,
                    commit_description: str | None = None):
        """What save_pretrained writes, uploaded to the hub repo ``repo_id`` in one commit (created where missing),
        as transformers' push_to_hub; huggingface_hub's CommitInfo."""
        return push_saved(self.save_pretrained, repo_id, commit_message=commit_message, private=private, token=token,
                          create_pr=create_pr, revision=revision, commit_description=commit_description)

    def __repr__(self):
        return (f"PreTrainedTokenizer({self.name_or_path!r}, vocab={len(self)}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, pad={self.pad_token!r}, padding_side={self.padding_side!r})")


# -- chat templates (Jinja) ----------------------------------------------------------------------------------
_CONTINUE_MARK = "\x00vkformers-continue\x00"
_compiled_templates: dict[str, object] = {}  # least recently used first
MAX_COMPILED_TEMPLATES = 16  # a server may be handed many templates: keep the last few compiled


def compile_chat_template(source: str):
    """The template compiled in transformers' environment (cached: templates are long, compiling is slow)."""
    if source in _compiled_templates:
        _compiled_templates[source] = _compiled_templates.pop(source)  # now the most recently used
        return _compiled_templates[source]
    try:  # jinja2 is slow to import: only when a chat template is rendered
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizerError("chat templates need jinja2: pip install 'jinja2>=3.1'") from None

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks in transformers;
        # here it only renders its body, so templates using it still compile.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & for HTML, which would change the prompt text.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        compiled = environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TokenizerError(f"chat template does not compile: {exc} (line {exc.lineno})") from None
    _compiled_templates[source] = compiled
    while len(_compiled_templates) > max(MAX_COMPILED_TEMPLATES, 1):
        del _compiled_templates[next(iter(_compiled_templates))]
    return compiled


def render_chat(template, messages: list[dict], *, add_generation_prompt=False, continue_final_message=False,
                **context) -> str:
    """One conversation as text. ``continue_final_message`` leaves the last message open (no end-of-turn
    tokens after it), so the model continues it: the message gets a marker, and the text stops there."""
    import jinja2  # slow to import: only when a chat template is rendered
    messages = [dict(m) for m in messages]
    if continue_final_message:
        last = messages[-1]
        if not isinstance(last.get("content"), str):
            raise TokenizerError("continue_final_message needs the final message's content to be text")
        last["content"] = last["content"] + _CONTINUE_MARK
    try:
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"chat template: {exc}") from None
    if continue_final_message:
        if _CONTINUE_MARK not in text:
            raise TokenizerError("continue_final_message: the chat template dropped the final message's text")
        text = text[:text.index(_CONTINUE_MARK)]
    return text


# -- loading -------------------------------------------------------------------------------------------------
def _read_json(file: Path) -> dict:
    return read_json(file, TokenizerError)


def load_tokenizer_folder(folder: Path, *, name_or_path: str | None = None) -> PreTrainedTokenizer:
    """The tokenizer of a checkpoint folder: its tokenizer.json, else its slow tokenizer's files (vocab.txt,
    vocab.json + merges.txt, a SentencePiece .model) rebuilt as transformers does (models/slow_tokenizers.py)."""
    from tokenizers import Tokenizer  # loaded with the first tokenizer, not with vkformers
    folder = Path(folder)
    file = folder / "tokenizer.json"
    config = tokenizer_config(folder, TokenizerError)
    model_config = {}
    if (folder / "config.json").is_file() and not (file.is_file() and "tokenizer_class" in config):
        model_config = _read_json(folder / "config.json")
    slow = None
    if file.is_file():
        try:
            backend = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise TokenizerError(f"{file}: not a tokenizers file ({exc})") from None
    else:
        try:
            slow = load_slow_tokenizer(folder, config, model_config)
        except SlowTokenizerError as exc:
            raise TokenizerError(str(exc)) from None
        backend = slow.backend
        config = {**slow.defaults, **config}  # the tokenizer class's special tokens where the config names none
    if "tokenizer_class" not in config and model_config:
        # which inputs the model takes (token_type_ids or not) then follows its model_type, as in transformers
        config.setdefault("model_type", model_config.get("model_type"))
    tokenizer = PreTrainedTokenizer(backend, config, name_or_path=name_or_path or str(folder))
    if slow is not None and slow.post_processor is not None:
        # the classes that set their template after transformers applies add_bos_token/add_eos_token keep it
        backend.post_processor = slow.post_processor(tokenizer)
    if slow is not None and slow.decoder is not None:
        backend.decoder = slow.decoder(tokenizer)
    if slow is not None:
        tokenizer.saved_files = [folder / name for name in slow.files]
        tokenizer.target_mode = slow.target_mode
    return tokenizer


__all__ = ["BatchEncoding", "PreTrainedTokenizer", "TokenizerError", "compile_chat_template",
           "load_tokenizer_folder", "render_chat"]
