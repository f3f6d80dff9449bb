"""Fill-in-the-middle (FIM) prompts of code models: the code before the cursor and the code after it, laid out
around the model's FIM tokens so that it generates what goes between (editors' code completion)::

    ids = vkformers.fill_in_middle_prompt(tok, "def area(r):\\n    return ", "\\n\\nprint(area(2))")
    ends = [tok.eos_token_id, *vkformers.fill_in_middle_tokens(tok).end]
    middle = model.generate(np.array([ids]), max_new_tokens=32, eos_token_id=ends)[0, len(ids):]

The tokens and their order come from the tokenizer, not from a model's name:

- a GGUF file's ``tokenizer.ggml.fim_pre_token_id``, ``fim_suf_token_id``, ``fim_mid_token_id`` (or the older
  ``prefix_token_id``, ``suffix_token_id``, ``middle_token_id``), and ``fim_pad``, ``fim_rep``, ``fim_sep``, as
  llama.cpp writes them (``PreTrainedTokenizer.fim_token_ids``, models/gguf.py);
- else the vocabulary's spelling of them, one family of FIM_FAMILIES: StarCoder's and Granite's ``<fim_prefix>``,
  SantaCoder's ``<fim-prefix>``, Qwen2.5-Coder's, Qwen3-Coder's and CodeGemma's ``<|fim_prefix|>``, DeepSeek-Coder's
  ``<｜fim▁begin｜>``, CodeLlama's ``▁<PRE>``, GLM-4's ``<|code_prefix|>``, Mistral's (Codestral's) ``[PREFIX]``.

The prompt, as token ids (the FIM tokens by id, the code as text, no BOS/EOS inside):

- prefix first (PSM), as the models' cards and llama.cpp's /infill lay it out:
  ``[BOS] PRE prefix SUF suffix MID``; CodeLlama's ``<PRE> {prefix} <SUF>{suffix} <MID>``, whose ▁<SUF> and ▁<MID>
  tokens hold the spaces before them;
- suffix first for Mistral's tokens, as mistral-common's ``encode_fim``: ``BOS [SUFFIX] suffix [PREFIX] prefix``,
  no middle token: the model goes on from the prefix.

The prefix is tokenized as a text at the start of a prompt (a SentencePiece tokenizer's leading space included), the
suffix without that space (Meta's ``encode_infilling``, mistral-common's ``_encode_infilling``), which byte-level
vocabularies never add. BOS starts the prompt where the tokenizer starts a text with it (``add_bos_token``), as
llama.cpp decides. The middle ends at the model's end-of-sequence token or at one of ``FillInMiddleTokens.end``:
the FIM tokens themselves, the pad, repository and file-separator tokens, CodeLlama's ▁<EOT> and ``<|endoftext|>``
(llama.cpp's end-of-generation tokens), none of which is part of the text.
"""
from __future__ import annotations

from dataclasses import dataclass

from vkformers.errors import VkformersError

# (name, prefix token, suffix token, middle token or None, suffix first): each family's spelling, first found wins
FIM_FAMILIES = (
    ("Qwen2.5-Coder / Qwen3-Coder / CodeGemma", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", False),
    ("StarCoder / Granite", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", False),
    ("SantaCoder", "<fim-prefix>", "<fim-suffix>", "<fim-middle>", False),
    ("DeepSeek-Coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", False),
    ("CodeLlama", "▁<PRE>", "▁<SUF>", "▁<MID>", False),
    ("CodeLlama", "<PRE>", "<SUF>", "<MID>", False),
    ("GLM-4", "<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>", False),
    ("Mistral", "[PREFIX]", "[SUFFIX]", None, True),
)
# tokens after which a middle is done (llama.cpp's end-of-generation FIM pad, repo and file-separator tokens, and
# the end-of-text tokens code models end a file with)
FIM_END_SPELLINGS = ("<|fim_pad|>", "<fim_pad>", "<fim-pad>", "<|file_sep|>", "<|file_separator|>", "<|repo_name|>",
                     "<reponame>", "<|fim_repo|>", "▁<EOT>", "<EOT>", "<|endoftext|>")
GGUF_END_ROLES = ("pad", "repo", "separator")
# a symbol that joins with no code, put before a text and taken off again to tokenize it without a SentencePiece
# tokenizer's leading space (Meta's and mistral-common's choice)
SENTINEL = "\u263a"
SPACE_MARK = "\u2581"  # SentencePiece's "▁"


class FillInMiddleError(VkformersError, ValueError):
    """A fill-in-the-middle prompt asked of a tokenizer that has no FIM tokens."""


@dataclass(frozen=True)
class FillInMiddleTokens:
    """A tokenizer's FIM token ids: ``middle`` None where the prompt ends with the prefix (Mistral's);
    ``suffix_first``: the suffix comes before the prefix; ``end``: the ids that end a middle besides the
    end-of-sequence token; ``family``: where they were found (a FIM_FAMILIES name, or "GGUF metadata")."""
    prefix: int
    suffix: int
    middle: int | None
    suffix_first: bool
    end: tuple[int, ...]
    family: str


def fill_in_middle_tokens(tokenizer) -> FillInMiddleTokens | None:
    """The tokenizer's FIM tokens, from a GGUF's metadata, else from its vocabulary's spelling; None where it has
    none."""
    named = getattr(tokenizer, "fim_token_ids", None) or {}
    ends = [named[role] for role in GGUF_END_ROLES if role in named]
    ends += [i for i in (_token_id(tokenizer, t) for t in FIM_END_SPELLINGS) if i is not None]
    if all(role in named for role in ("prefix", "suffix", "middle")):
        markers = (named["prefix"], named["suffix"], named["middle"])
        return FillInMiddleTokens(*markers, False, _unique(ends + list(markers)), "GGUF metadata")
    for family, *spellings, suffix_first in FIM_FAMILIES:
        ids = [None if t is None else _token_id(tokenizer, t) for t in spellings]
        if ids[0] is not None and ids[1] is not None and (spellings[2] is None or ids[2] is not None):
            return FillInMiddleTokens(*ids, suffix_first, _unique(ends + [i for i in ids if i is not None]), family)
    return None


def no_fill_in_middle_tokens() -> str:
    """Why a tokenizer without FIM tokens takes no FIM prompt, in one line."""
    names = ", ".join(dict.fromkeys(family[1] for family in FIM_FAMILIES))
    return (f"this model has no fill-in-the-middle tokens: its tokenizer spells none of {names}, and no GGUF "
            "tokenizer.ggml.fim_pre_token_id names one; use a code model trained for it (StarCoder, Qwen2.5-Coder, "
            "CodeGemma, DeepSeek-Coder, CodeLlama, Codestral)")


def fill_in_middle_prompt(tokenizer, prefix: str, suffix: str, tokens: FillInMiddleTokens | None = None) -> list[int]:
    """The token ids of a FIM prompt: the model generates the text between ``prefix`` (the code before the cursor)
    and ``suffix`` (the code after it); ``tokens``: fill_in_middle_tokens(tokenizer), found again when not given.
    Raises FillInMiddleError where the tokenizer has no FIM tokens."""
    if not isinstance(prefix, str) or not isinstance(suffix, str):
        raise FillInMiddleError(f"fill_in_middle_prompt takes the prefix and the suffix as strings, got "
                                f"{type(prefix).__name__} and {type(suffix).__name__}")
    tokens = tokens or fill_in_middle_tokens(tokenizer)
    if tokens is None:
        raise FillInMiddleError(no_fill_in_middle_tokens())
    start = [tokenizer.bos_token_id] if _starts_with_bos(tokenizer) else []
    before = [tokens.prefix, *_text_ids(tokenizer, prefix)]
    after = [tokens.suffix, *_ids_without_leading_space(tokenizer, suffix)]
    middle = [] if tokens.middle is None else [tokens.middle]
    return start + (after + before if tokens.suffix_first else before + after) + middle


def _token_id(tokenizer, token: str) -> int | None:
    index = tokenizer.convert_tokens_to_ids(token)
    return None if index is None or index < 0 else int(index)


def _unique(ids) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


def _text_ids(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []


def _starts_with_bos(tokenizer) -> bool:
    """Whether the tokenizer starts a text with its BOS token (add_bos_token), as llama.cpp adds one."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("", add_special_tokens=True)["input_ids"][:1] == [bos]


def _ids_without_leading_space(tokenizer, text: str) -> list[int]:
    """``text``'s ids as the continuation of a text: without the space a SentencePiece tokenizer puts before a
    text's first word (the sentinel's ids taken off the front of the sentinel and the text's). Byte-level
    vocabularies add none: their first token starts with no "▁"."""
    ids = _text_ids(tokenizer, text)
    if not ids or not tokenizer.convert_ids_to_tokens(ids[0]).startswith(SPACE_MARK):
        return ids
    head = _text_ids(tokenizer, SENTINEL)
    marked = _text_ids(tokenizer, SENTINEL + text)
    if marked[:len(head)] == head:
        return marked[len(head):]
    # the sentinel joined the text's first token: the space alone can still go
    return ids[1:] if tokenizer.convert_ids_to_tokens(ids[0]) == SPACE_MARK else ids


__all__ = ["FIM_FAMILIES", "FIM_END_SPELLINGS", "FillInMiddleError", "FillInMiddleTokens", "fill_in_middle_prompt",
           "fill_in_middle_tokens", "no_fill_in_middle_tokens"]
