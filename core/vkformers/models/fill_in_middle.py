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

llama.cpp's /infill prompt (``infill_prompt``) adds repository-level context before it: chunks of other files, laid
out with the repository-name and file-separator tokens where the vocabulary has them (Qwen2.5-Coder's
``<|repo_name|>`` and ``<|file_sep|>``, found as llama.cpp finds them), the repo-level pattern of Qwen2.5-Coder's
report::

    <|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text}...<|file_sep|>filename\\n<|fim_prefix|>...

else each chunk after a ``\\n\\n--- snippet ---\\n\\n`` line; and the text typed on the cursor's line (its ``prompt``)
after the prefix.
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
# llama.cpp's spellings of the repository-name and file-separator tokens of repository-level prompts (a GGUF's
# fim_rep_token_id and fim_sep_token_id first)
REPOSITORY_SPELLINGS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FILE_SEPARATOR_SPELLINGS = ("<|file_sep|>",)
# llama.cpp's /infill: the repository's and the current file's names it writes, a chunk's name when it gives none,
# and the line before each chunk where the vocabulary has no file separator
REPOSITORY_NAME, CURRENT_FILE_NAME, UNNAMED_CHUNK = "myproject", "filename", "tmp"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"
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
    end-of-sequence token; ``family``: where they were found (a FIM_FAMILIES name, or "GGUF metadata");
    ``repository`` and ``file_separator``: the tokens of repository-level context (infill_prompt), None where the
    vocabulary has none."""
    prefix: int
    suffix: int
    middle: int | None
    suffix_first: bool
    end: tuple[int, ...]
    family: str
    repository: int | None = None
    file_separator: int | None = None


def fill_in_middle_tokens(tokenizer) -> FillInMiddleTokens | None:
    """The tokenizer's FIM tokens, from a GGUF's metadata, else from its vocabulary's spelling; None where it has
    none."""
    named = getattr(tokenizer, "fim_token_ids", None) or {}
    ends = [named[role] for role in GGUF_END_ROLES if role in named]
    ends += [i for i in (_token_id(tokenizer, t) for t in FIM_END_SPELLINGS) if i is not None]
    context = {"repository": _first_id(tokenizer, named.get("repo"), REPOSITORY_SPELLINGS),
               "file_separator": _first_id(tokenizer, named.get("separator"), FILE_SEPARATOR_SPELLINGS)}
    if all(role in named for role in ("prefix", "suffix", "middle")):
        markers = (named["prefix"], named["suffix"], named["middle"])
        return FillInMiddleTokens(*markers, False, _unique(ends + list(markers)), "GGUF metadata", **context)
    for family, *spellings, suffix_first in FIM_FAMILIES:
        ids = [None if t is None else _token_id(tokenizer, t) for t in spellings]
        if ids[0] is not None and ids[1] is not None and (spellings[2] is None or ids[2] is not None):
            return FillInMiddleTokens(*ids, suffix_first, _unique(ends + [i for i in ids if i is not None]), family,
                                      **context)
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
    tokens = _tokens_of(tokenizer, tokens)
    return _start(tokenizer) + _laid_out(tokens, _text_ids(tokenizer, prefix),
                                         _ids_without_leading_space(tokenizer, suffix))


def infill_prompt(tokenizer, prefix: str, suffix: str, extra=(), prompt: str = "",
                  tokens: FillInMiddleTokens | None = None, *, batch: int | None = None, context: int | None = None,
                  reserve: int = 0) -> list[int]:
    """The token ids of llama.cpp's /infill prompt: fill_in_middle_prompt's, with ``prompt`` (the text typed on the
    cursor's line) after the prefix and, before it all (after BOS), the repository-level context of ``extra``:
    (filename or None, text) pairs of other files' chunks. With the tokenizer's repository and file-separator tokens
    (FillInMiddleTokens.repository, .file_separator) it reads
    ``REPO myproject\\n SEP {filename}\\n{text} ... SEP filename\\n``, the repository token's part and the
    separators' each only where the vocabulary has that token (as llama.cpp lays it out, even with no chunks);
    without a file separator each chunk comes after a "--- snippet ---" line (SNIPPET_SEPARATOR).

    With ``batch`` (llama.cpp's n_batch), as llama.cpp fits the prompt: the prefix keeps its last 3/4 of the batch
    (``3 * (batch // 4)`` tokens), the suffix its first ``batch // 4 - 2 - len(prompt's tokens)``; with
    ``context`` too, the repository-level context keeps its last ``context - batch - 2 * reserve`` tokens
    (``reserve``: the tokens to generate). Raises FillInMiddleError where the tokenizer has no FIM tokens."""
    extra = list(extra)
    if not all(isinstance(t, str) for t in (prefix, suffix, prompt)) or not all(
            len(chunk) == 2 and isinstance(chunk[0], (str, type(None))) and isinstance(chunk[1], str)
            for chunk in extra):
        raise FillInMiddleError("infill_prompt takes the prefix, suffix and prompt as strings and each chunk of extra "
                                "as a (filename or None, text) pair of strings")
    tokens = _tokens_of(tokenizer, tokens)
    before = _text_ids(tokenizer, prefix)
    typed = _ids_without_leading_space(tokenizer, prompt)
    after = _ids_without_leading_space(tokenizer, suffix)
    files = _repository_ids(tokenizer, tokens, extra)
    if batch is not None:
        quarter = batch // 4
        before = before[max(len(before) - 3 * quarter, 0):]
        after = after[:max(quarter - (2 + len(typed)), 0)]
        if context is not None:
            files = files[max(len(files) - max(context - batch - 2 * reserve, 0), 0):]
    return _start(tokenizer) + files + _laid_out(tokens, before + typed, after)


def _tokens_of(tokenizer, tokens: FillInMiddleTokens | None) -> FillInMiddleTokens:
    tokens = tokens or fill_in_middle_tokens(tokenizer)
    if tokens is None:
        raise FillInMiddleError(no_fill_in_middle_tokens())
    return tokens


def _start(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if _starts_with_bos(tokenizer) else []


def _laid_out(tokens: FillInMiddleTokens, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
    """The FIM tokens around the prefix's and the suffix's ids, in the model's order (no BOS)."""
    before, after = [tokens.prefix, *prefix_ids], [tokens.suffix, *suffix_ids]
    middle = [] if tokens.middle is None else [tokens.middle]
    return (after + before if tokens.suffix_first else before + after) + middle


def _repository_ids(tokenizer, tokens: FillInMiddleTokens, extra) -> list[int]:
    """The repository-level context of infill_prompt, as token ids (each text a continuation: no leading space)."""
    def text(value: str) -> list[int]:
        return _ids_without_leading_space(tokenizer, value)
    ids = [] if tokens.repository is None else [tokens.repository, *text(REPOSITORY_NAME + "\n")]
    for filename, chunk in extra:
        if tokens.file_separator is None:
            ids += text(SNIPPET_SEPARATOR)
        else:
            ids += [tokens.file_separator, *text((filename if filename is not None else UNNAMED_CHUNK) + "\n")]
        ids += text(chunk)
    if tokens.file_separator is not None:
        ids += [tokens.file_separator, *text(CURRENT_FILE_NAME + "\n")]
    return ids


def _first_id(tokenizer, named: int | None, spellings) -> int | None:
    """A GGUF's named token, else the first of ``spellings`` the vocabulary has."""
    if named is not None:
        return int(named)
    return next((i for i in (_token_id(tokenizer, t) for t in spellings) if i is not None), None)


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
           "fill_in_middle_tokens", "infill_prompt", "no_fill_in_middle_tokens"]
