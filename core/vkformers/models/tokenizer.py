"""Tokenizers of Hugging Face checkpoints: ``tokenizer.json`` through the ``tokenizers`` library.

``AutoTokenizer.from_pretrained(path_or_repo)`` reads ``tokenizer.json`` (the "fast" tokenizer file every
recent checkpoint ships) and ``tokenizer_config.json`` (special tokens, ``add_bos_token``, padding side, chat
template), or the tokenizer a ``.gguf`` file describes. The object it returns behaves like a transformers
fast tokenizer for the parts inference and training need::

    tok = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    batch = tok(["hi", "a longer prompt"], padding=True, padding_side="left", return_tensors="np")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    tok.decode(ids, skip_special_tokens=True)

Chat templates are Jinja, rendered like transformers renders them (sandboxed, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML), so a template written for
transformers produces the same text here. Slow (sentencepiece ``tokenizer.model`` only) tokenizers are not read:
such a checkpoint needs its ``tokenizer.json`` (``transformers`` writes one with ``save_pretrained``).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

from vkformers.errors import VkformersError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(VkformersError, ValueError):
    """A tokenizer that cannot be loaded or a call it cannot honour (e.g. padding without a pad token)."""


class BatchEncoding(dict):
    """``{"input_ids": ..., "attention_mask": ...}`` that also reads as attributes, like transformers'."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _token_content(value):
    """A special token as tokenizer_config.json spells it: a string or a serialised AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_list(ids) -> list[int]:
    if hasattr(ids, "numpy"):  # a vkformers Tensor
        ids = ids.numpy()
    return np.asarray(ids).reshape(-1).astype(np.int64).tolist()


class PreTrainedTokenizer:
    """A ``tokenizers.Tokenizer`` plus the settings transformers keeps in ``tokenizer_config.json``."""

    def __init__(self, backend, config: dict | None = None, *, name_or_path: str = ""):
        self.backend = backend
        self.config = dict(config or {})
        self.name_or_path = name_or_path
        self.padding_side = self.config.get("padding_side", "right")
        self.truncation_side = self.config.get("truncation_side", "right")
        self.model_max_length = self.config.get("model_max_length")
        self.chat_template = self.config.get("chat_template")
        for name in SPECIAL_TOKEN_NAMES:
            setattr(self, name, _token_content(self.config.get(name)))
        extra = self.config.get("additional_special_tokens") or self.config.get("extra_special_tokens") or []
        self.additional_special_tokens = [_token_content(t) for t in (extra.values() if isinstance(extra, dict)
                                                                      else extra)]
        if "add_bos_token" in self.config or "add_eos_token" in self.config:
            self._set_bos_eos_post_processor(bool(self.config.get("add_bos_token")),
                                             bool(self.config.get("add_eos_token")))

    # -- special tokens ------------------------------------------------------------------------------------
    def _set_bos_eos_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """What transformers' Llama-style tokenizers do with add_bos_token/add_eos_token: rebuild the template."""
        from tokenizers import processors
        bos = [self.bos_token] if add_bos and self.bos_token_id is not None else []
        eos = [self.eos_token] if add_eos and self.eos_token_id is not None else []
        single = [*bos, "$A", *eos]
        pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
        specials = [(t, self._token_id(t)) for t in dict.fromkeys(bos + eos)]
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def _token_id(self, token):
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self):
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self):
        return self._token_id(self.eos_token)

    @property
    def pad_token_id(self):
        return self._token_id(self.pad_token)

    @property
    def unk_token_id(self):
        return self._token_id(self.unk_token)

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

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, (int, np.integer)):
            return self.backend.id_to_token(int(ids))
        return [self.backend.id_to_token(i) for i in _as_id_list(ids)]

    # -- encoding ------------------------------------------------------------------------------------------
    def encode(self, text: str, text_pair: str | None = None, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, text_pair, add_special_tokens=add_special_tokens).ids

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[str]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def __call__(self, text, text_pair=None, *, add_special_tokens: bool = True, padding=False,
                 truncation=False, max_length: int | None = None, padding_side: str | None = None,
                 return_tensors: str | None = None, return_attention_mask: bool = True, **unused) -> BatchEncoding:
        """Encode one text or a list. ``padding``: False, True/"longest" or "max_length"; ``padding_side``
        "left" (for generation) or "right" (default: the tokenizer's). ``return_tensors="np"`` gives int64
        arrays [batch, length] (a single text becomes a batch of one)."""
        batched = not isinstance(text, str)
        texts = list(text) if batched else [text]
        pairs = (list(text_pair) if batched else [text_pair]) if text_pair is not None else None
        if pairs is not None and len(pairs) != len(texts):
            raise TokenizerError(f"{len(texts)} texts but {len(pairs)} text pairs")
        inputs = list(zip(texts, pairs)) if pairs is not None else texts
        encodings = self.backend.encode_batch(inputs, add_special_tokens=add_special_tokens) if inputs else []
        rows = [e.ids for e in encodings]
        if truncation and max_length is None:
            max_length = self.model_max_length
        if truncation and max_length is not None:
            rows = [r[-max_length:] if self.truncation_side == "left" else r[:max_length] for r in rows]
        masks = [[1] * len(r) for r in rows]
        if padding in (True, "longest", "max_length"):
            rows, masks = self._pad(rows, masks, padding, max_length, padding_side or self.padding_side)
        elif padding not in (False, None, "do_not_pad"):
            raise TokenizerError(f"padding={padding!r}: use False, True/'longest' or 'max_length'")
        if return_tensors is not None:
            if return_tensors != "np":
                raise TokenizerError(f"return_tensors={return_tensors!r}: vkformers tokenizers return numpy ('np')")
            if len({len(r) for r in rows}) > 1:
                raise TokenizerError("texts of different lengths need padding=True to become one array")
            rows, masks = np.array(rows, dtype=np.int64), np.array(masks, dtype=np.int64)
        elif not batched:
            rows, masks = rows[0], masks[0]
        out = BatchEncoding(input_ids=rows)
        if return_attention_mask:
            out["attention_mask"] = masks
        return out

    def _pad(self, rows, masks, padding, max_length, side):
        if side not in ("left", "right"):
            raise TokenizerError(f"padding_side={side!r}: 'left' or 'right'")
        if self.pad_token_id is None:
            raise TokenizerError("this tokenizer has no pad token; set one first, e.g. "
                                 "`tokenizer.pad_token = tokenizer.eos_token`")
        width = max((len(r) for r in rows), default=0)
        if padding == "max_length":
            if max_length is None:
                raise TokenizerError("padding='max_length' needs max_length")
            width = max(width, max_length)
        padded, padded_masks = [], []
        for row, mask in zip(rows, masks):
            fill = width - len(row)
            if side == "left":
                padded.append([self.pad_token_id] * fill + row)
                padded_masks.append([0] * fill + mask)
            else:
                padded.append(row + [self.pad_token_id] * fill)
                padded_masks.append(mask + [0] * fill)
        return padded, padded_masks

    # -- decoding ------------------------------------------------------------------------------------------
    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of token ids (a list, numpy array or Tensor); like transformers, special tokens stay unless
        ``skip_special_tokens=True``."""
        if isinstance(ids, (int, np.integer)):
            ids = [int(ids)]
        return self.backend.decode(_as_id_list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        if hasattr(sequences, "numpy"):
            sequences = sequences.numpy()
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

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
    try:
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
    import jinja2
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
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{file}: not valid JSON ({exc})") from None


def tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json, completed from special_tokens_map.json and chat_template.jinja when present."""
    config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    special_map = folder / "special_tokens_map.json"
    if special_map.is_file():
        for name, value in _read_json(special_map).items():
            config.setdefault(name, value)
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        config["chat_template"] = template_file.read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():  # processors' spelling
        config.setdefault("chat_template", _read_json(folder / "chat_template.json").get("chat_template"))
    return config


class AutoTokenizer:
    @classmethod
    def from_pretrained(cls, name_or_path, *, revision: str | None = None, cache_dir=None,
                        padding_side: str | None = None, **unused) -> PreTrainedTokenizer:
        """The tokenizer of a checkpoint folder, a hub repo id (through the HF cache; HF_HUB_OFFLINE honoured)
        or a ``.gguf`` file."""
        from vkformers.models import gguf
        if gguf.is_gguf_file(name_or_path):
            tokenizer = gguf.load_gguf_tokenizer(name_or_path)
        else:
            from vkformers.models.loading import resolve_checkpoint
            folder = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
            tokenizer = load_tokenizer_folder(folder, name_or_path=str(name_or_path))
        if padding_side is not None:
            tokenizer.padding_side = padding_side
        return tokenizer


def load_tokenizer_folder(folder: Path, *, name_or_path: str | None = None) -> PreTrainedTokenizer:
    from tokenizers import Tokenizer
    folder = Path(folder)
    file = folder / "tokenizer.json"
    if not file.is_file():
        present = [name for name in ("tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
                   if (folder / name).is_file()]
        hint = (f" (it has {', '.join(present)}: a slow tokenizer; write tokenizer.json with transformers' "
                "tokenizer.save_pretrained)") if present else ""
        raise TokenizerError(f"{folder}: no tokenizer.json; vkformers reads the tokenizers-library file "
                             f"tokenizer.json (with tokenizer_config.json for special tokens){hint}")
    try:
        backend = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises a bare Exception on malformed files
        raise TokenizerError(f"{file}: not a tokenizers file ({exc})") from None
    return PreTrainedTokenizer(backend, tokenizer_config(folder), name_or_path=name_or_path or str(folder))


__all__ = ["AutoTokenizer", "BatchEncoding", "PreTrainedTokenizer", "TokenizerError", "compile_chat_template",
           "load_tokenizer_folder", "render_chat"]
