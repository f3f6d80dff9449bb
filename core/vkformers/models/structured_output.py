"""Structured outputs: a request's tokens kept to a grammar, as OpenAI's ``response_format`` asks, through the
llguidance grammar engine (the optional ``serve`` extra: ``pip install 'vkformers[serve]'``).

``{"type": "json_schema", "json_schema": {"schema": ...}}``: the output is one JSON value valid against the schema
(:func:`json_schema_grammar`); ``{"type": "json_object"}``: one JSON object (:func:`any_object_grammar`). The root
starts at the first character; between JSON tokens comes at most one space, or a line break and an indentation
(WHITESPACE_PATTERN; a schema's ``"x-guidance": {"whitespace_pattern": ...}`` sets its own). vLLM's guided
decoding options map onto the same engine: :func:`regex_grammar` (the output matches a regex), :func:`choice_grammar`
(it is one of some strings), :func:`cfg_grammar` (a Lark or GBNF grammar).

llguidance reads the tokenizer's ``tokenizer.json`` (:class:`GrammarVocabulary`) and so sees each token as the
bytes it adds to the text: byte-level BPE tokens through the GPT-2 byte alphabet, SentencePiece pieces with U+2581
as a space and ``<0xNN>`` as that byte, so a character split over tokens is followed byte by byte. Special tokens
(and the unknown token) never take part in the output's text; the request's end tokens are allowed only where the
grammar accepts the output as it is. Each output keeps its own matcher (:class:`TokenConstraint`); its mask is
applied to the row's scores on the host before the choice (greedy, or after it temperature, top-k and top-p over
the allowed tokens only).

``generate`` takes the same through its ``logits_processor`` argument: :class:`GrammarLogitsProcessor`.
"""
from __future__ import annotations

import functools
import json
import threading
import weakref
from collections import OrderedDict

import numpy as np

from vkformers.errors import InputError, VkformersError

INSTALL_HINT = ("structured outputs (response_format json_schema or json_object, a regex, choices or a grammar) "
                "need the llguidance package: "
                "pip install 'vkformers[serve]'")
# Whitespace between JSON tokens: none, one space, or a line break and an indentation of at most MAX_INDENT spaces
# or tabs (compact and pretty-printed JSON alike, as llama.cpp's JSON grammars allow): a model that prefers blanks
# cannot fill its output with them
MAX_INDENT = 32
WHITESPACE_PATTERN = rf"(\x20|\r?\n[\x20\x09]{{0,{MAX_INDENT}}})"
ANY_OBJECT_SCHEMA = {"type": "object"}
# compiled grammars kept per vocabulary: the n choices of a request (and repeated schemas) copy one instead of
# compiling it again
COMPILED_GRAMMARS = 32
# GrammarLogitsProcessor's grammar states kept by the tokens that led to them (or two per row, if more), the least
# recently used dropped first: assisted generation asks again at an earlier length after a rejected draft token
KEPT_STATES = 256
THINKING_GAP = 8  # blanks between a thinking's closing tag and the constrained output (Qwen3 writes two line breaks)


def llguidance_module():
    """The llguidance package, or a VkformersError saying how to install it."""
    try:
        import llguidance  # (the optional [serve] extra: vkformers runs without it, structured outputs aside)
    except ImportError:
        raise VkformersError(INSTALL_HINT) from None
    return llguidance


class GrammarError(InputError):
    """A schema or grammar the grammar engine cannot compile, or an output it can no longer continue."""


def one_line(message) -> str:
    """An engine's message (a regex error spans lines) on one line."""
    return " ".join(str(message).split())


def json_schema_grammar(schema, *, strict: bool = True, whitespace_pattern: str | None = None,
                        compact: bool = False) -> str:
    """The llguidance grammar of outputs that are one JSON value valid against ``schema`` (a dict, or its JSON
    text). ``strict`` (OpenAI's ``json_schema.strict``): a keyword value llguidance does not implement (an unknown
    ``format``) is an error, as OpenAI's strict mode refuses what it cannot enforce; else it is ignored and the rest
    of the schema enforced. ``whitespace_pattern``: the regex of the whitespace between JSON tokens (over the
    schema's own); ``compact``: no whitespace at all (vLLM's disable_any_whitespace). Raises GrammarError, with a
    one-line message, for a schema that cannot be compiled."""
    llg = llguidance_module()
    if isinstance(schema, bool) or not isinstance(schema, (dict, str)):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    overrides = {"lenient": not strict}
    if compact:
        overrides.update(whitespace_flexible=False, whitespace_pattern=None, item_separator=",", key_separator=":")
    elif whitespace_pattern is not None:
        overrides["whitespace_pattern"] = whitespace_pattern
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE_PATTERN},
                                                         overrides=overrides)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be read: {one_line(exc)}") from None
    return checked(grammar, "the JSON schema")


def checked(grammar: str, what: str) -> str:
    """``grammar`` once llguidance has compiled it without a tokenizer; else GrammarError naming ``what``."""
    failed, messages = llguidance_module().LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(f"{what} cannot be compiled: {one_line(messages[0])}")
    return grammar


def closed_objects(schema):
    """``schema`` with ``"additionalProperties": false`` on each object schema that leaves it out (vLLM's
    disable_additional_properties): the output holds only the properties the schema names."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def regex_grammar(pattern) -> str:
    """Outputs that match ``pattern`` whole (Rust regex syntax, as llguidance reads it). Raises GrammarError."""
    if not isinstance(pattern, str):
        raise GrammarError(f"a regex must be a string, got {type(pattern).__name__}")
    return checked(llguidance_module().LLMatcher.grammar_from_regex(pattern), "the regex")


def choice_grammar(choices) -> str:
    """Outputs that are exactly one of the strings ``choices``. Raises GrammarError."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("the choices must be a non-empty list of strings")
    return checked(llguidance_module().grammar_from("choice", choices), "the choices")


def cfg_grammar(text) -> str:
    """Outputs of a context-free grammar: Lark syntax as llguidance reads it (a ``start:`` rule), or GBNF / EBNF
    as llama.cpp and xgrammar read it (a ``root ::=`` rule), which llguidance translates to Lark. Raises
    GrammarError, with the engine's reason, for one it cannot read or compile."""
    if not isinstance(text, str):
        raise GrammarError(f"a grammar must be a string, got {type(text).__name__}")
    try:
        grammar = llguidance_module().grammar_from("grammar", text)
    except ValueError as exc:  # GBNF the translation cannot read
        raise GrammarError(f"the grammar cannot be read (Lark or GBNF): {one_line(exc)}") from None
    return checked(grammar, "the grammar")


def after_thinking(grammar: str, tags: tuple[str, str], tokens: tuple[int | None, int | None] = (None, None), *,
                   opened: bool = True) -> str:
    """The grammar of replies that think before an output of ``grammar`` (a thinking model's, read by a reasoning
    parser, models/reasoning.py): free text up to the first closing tag, at most THINKING_GAP blanks, then the
    output. ``tags``: the thinking's opening and closing tags; ``tokens``: each one's token id where the vocabulary
    has it as one token (an added token, which the engine sees apart from the text: the tag is then that token, or
    its text written out). ``opened``: the reply starts inside the thinking (where it may still write the opening
    tag, after a few blanks); else it may open it so, or give the output at once. The thinking is free but for its
    end: its text cannot close it early, and the reply cannot stop inside it (its end tokens wait for the output)."""
    text = grammar.lstrip()
    if text.startswith("{"):  # llguidance's grammar list, else the text of a Lark grammar
        spec = json.loads(text)
    else:
        spec = {"grammars": [{"lark_grammar": grammar}]}
    first, *rest = spec["grammars"]
    name = first.get("name") or "output"
    (start, end), (start_token, end_token) = tags, tokens
    blanks = rf"[ \t\r\n]{{0,{THINKING_GAP}}}"
    token_opening = None if start_token is None else f"/{blanks}/ <[{start_token}]>"
    after = f"thinking /{blanks}/ @{name}"  # (the text tag's opening is thinking's text where it is open already)
    if opened:
        rules = f"start: {after}\n" if token_opening is None else f"start: ({token_opening})? {after}\n"
    else:
        rules = f"start: @{name} | opening {after}\nopening: /{blanks}{_literal(start)}/" + \
            ("" if token_opening is None else f" | {token_opening}") + "\n"
    rules += f"closed[lazy]: /(?s:.*){_literal(end)}/\n"
    rules += "thinking: closed\n" if end_token is None else \
        f"thinking: closed | THOUGHT <[{end_token}]>\nTHOUGHT: /(?s:.*)/\n"
    reasoned = {**spec, "grammars": [{"name": "reasoned", "lark_grammar": rules}, {**first, "name": name}, *rest]}
    return checked(json.dumps(reasoned), "the grammar after the thinking")


def _literal(text: str) -> str:
    """``text`` as a regex of itself, each character escaped (llguidance's regexes take \\x{...})."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


@functools.cache
def any_object_grammar() -> str:
    """The grammar of JSON mode (``response_format`` json_object): any one JSON object."""
    return json_schema_grammar(ANY_OBJECT_SCHEMA)


class GrammarVocabulary:
    """A tokenizer (vkformers' PreTrainedTokenizer) as the grammar engine reads it, for scores of ``width`` tokens
    (the model's vocabulary, which may hold more rows than the tokenizer has tokens: those are never allowed).
    ``text_tokens``: bool [width], the tokens that may stand in the output's text (not special, not unknown; added
    tokens that are not special are text, as decoding keeps them).
    Building one reads the whole vocabulary (a second for 100k+ tokens): :meth:`of` keeps one per tokenizer."""

    _built: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
    _building = threading.Lock()

    def __init__(self, tokenizer, width: int):
        llg = llguidance_module()
        backend = tokenizer.backend
        size = backend.get_vocab_size(with_added_tokens=True)
        eos = tokenizer.eos_token_id
        try:
            self.engine = llg.LLTokenizer(backend.to_str(), n_vocab=max(int(width), size),
                                          eos_token=0 if eos is None else int(eos))
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(f"the grammar engine cannot read this tokenizer ({one_line(exc)}): structured "
                               "outputs need a tokenizer.json of a BPE, WordPiece or Unigram model") from None
        self.width = int(width)
        text = np.zeros(self.width, bool)
        text[:min(size, self.width)] = True
        specials = {int(t) for t in tokenizer.all_special_ids if t is not None}
        specials |= {int(t) for t, added in backend.get_added_tokens_decoder().items() if added.special}
        if tokenizer.unk_token_id is not None:
            specials.add(int(tokenizer.unk_token_id))
        # tokens the engine sees apart from the text, but those added as text (a thinking model's <think>), which it
        # allows where a grammar names them
        added = {int(t) for t, token in backend.get_added_tokens_decoder().items() if not token.special}
        specials |= {t for t in range(min(size, self.width)) if self.engine.is_special_token(t) and t not in added}
        text[[t for t in specials if t < self.width]] = False
        self.text_tokens = text
        self._grammars: OrderedDict = OrderedDict()  # grammar -> a compiled matcher, copied for each output
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer, width: int) -> "GrammarVocabulary":
        """The vocabulary of ``tokenizer`` for ``width`` scores, built once."""
        with cls._building:
            built = cls._built.setdefault(tokenizer, {})
            if width not in built:
                built[width] = cls(tokenizer, width)
            return built[width]

    def matcher(self, grammar: str):
        """A fresh llguidance matcher of ``grammar`` (compiled once, then copied). Raises GrammarError."""
        llg = llguidance_module()
        with self._lock:
            compiled = self._grammars.get(grammar)
            if compiled is None:
                # (verbose errors would carry the parser's state and the whole grammar into a message)
                compiled = llg.LLMatcher(self.engine, grammar, log_level=0,
                                         limits=llg.LLParserLimits(verbose_errors=False))
                if compiled.is_error():
                    raise GrammarError(f"the grammar cannot be compiled: {one_line(compiled.get_error())}")
                self._grammars[grammar] = compiled
                while len(self._grammars) > COMPILED_GRAMMARS:
                    self._grammars.popitem(last=False)
            self._grammars.move_to_end(grammar)
            return compiled.deep_copy()


class TokenConstraint:
    """One output kept to ``grammar``: :meth:`mask` the scores of its next token, :meth:`advance` with the token
    chosen. ``ends``: the output's end tokens, allowed once the grammar accepts the output; ``complete``: the
    grammar takes no more text (only an end token may follow)."""

    def __init__(self, vocabulary: GrammarVocabulary, grammar: str, ends=()):
        self.vocabulary, self.ends = vocabulary, sorted({int(e) for e in ends if 0 <= int(e) < vocabulary.width})
        self.matcher = vocabulary.matcher(grammar)
        self.ended = False  # an end token was chosen

    @property
    def complete(self) -> bool:
        return self.ended or self.matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        """bool [width]: the tokens that keep the output one the grammar can still accept. Raises GrammarError
        where none may follow (the grammar is complete and the output has no end token, or the engine failed)."""
        width = self.vocabulary.width
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = bits[:width].astype(bool) & self.vocabulary.text_tokens
        if self.ends and self.matcher.is_accepting():
            allowed[self.ends] = True
        if self.ended or not allowed.any():
            error = self.matcher.get_error()
            raise GrammarError(f"the structured output cannot go on: {one_line(error)}" if error else
                               "the structured output is complete and no end token may close it")
        return allowed

    def mask(self, scores: np.ndarray) -> np.ndarray:
        """``scores`` [..., width] with the tokens the grammar refuses at -inf (a copy)."""
        return np.where(self.allowed(), scores, -np.inf).astype(scores.dtype, copy=False)

    def copy(self) -> "TokenConstraint":
        twin = object.__new__(TokenConstraint)
        twin.vocabulary, twin.ends, twin.ended = self.vocabulary, self.ends, self.ended
        twin.matcher = self.matcher.deep_copy()
        return twin

    def advance(self, token: int) -> None:
        """Take the chosen ``token`` (one :meth:`mask` allowed)."""
        token = int(token)
        if token in self.ends and self.matcher.is_accepting():
            self.ended = True
        elif not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not continue the structured output: "
                               f"{one_line(self.matcher.get_error())}")


class GrammarLogitsProcessor:
    """A ``logits_processor`` for ``generate`` that keeps every row's new tokens to a grammar, as ``vkformers
    serve`` keeps a request with ``response_format``::

        processor = GrammarLogitsProcessor.from_json_schema(schema, tokenizer)
        out = model.generate(ids, max_new_tokens=200, logits_processor=[processor])

    Each row follows the grammar from its first generated token, its state found by its tokens so far (so beams
    that reorder, or share a beginning, each keep theirs, and assisted generation may ask at any length of the
    sequence); a row past its end token is left as it is. A call whose rows do not begin with the prompts the
    grammar started after starts over (a new ``generate``). ``ends``: the end tokens (default: the tokenizer's
    eos), allowed once the grammar accepts the output."""

    def __init__(self, grammar: str, tokenizer, ends=None):
        self.grammar, self.tokenizer = grammar, tokenizer
        eos = tokenizer.eos_token_id if ends is None else ends
        self.ends = [] if eos is None else [int(e) for e in np.atleast_1d(eos)]
        self._root: TokenConstraint | None = None  # the state before a generated token
        self._states: OrderedDict = OrderedDict()  # a row's generated tokens -> its state after them
        self._prompts: set = set()  # the rows' prompts of the generate call the states follow
        self._start = 0

    @classmethod
    def from_json_schema(cls, schema, tokenizer, *, strict: bool = True, ends=None) -> "GrammarLogitsProcessor":
        """Outputs that are one JSON value valid against ``schema`` (a dict or JSON text; json_schema_grammar)."""
        return cls(json_schema_grammar(schema, strict=strict), tokenizer, ends)

    @classmethod
    def json_object(cls, tokenizer, ends=None) -> "GrammarLogitsProcessor":
        """Outputs that are one JSON object (OpenAI's JSON mode)."""
        return cls(any_object_grammar(), tokenizer, ends)

    def _state(self, generated: tuple) -> TokenConstraint:
        """The state after ``generated``: the one of its longest prefix known, advanced by the tokens after it (a
        row past its end token stays as it is)."""
        known = len(generated)
        while known and generated[:known] not in self._states:
            known -= 1
        if known:
            state = self._states[generated[:known]]
            self._states.move_to_end(generated[:known])
        else:
            state = self._root
        if known < len(generated):
            state = state.copy()
            for token in generated[known:]:
                if not state.ended:
                    state.advance(token)
            self._states[generated] = state
        return state

    def __call__(self, input_ids, scores: np.ndarray) -> np.ndarray:
        ids = np.asarray(input_ids, np.int64)
        length = ids.shape[1]
        # the same generate call asks after its prompts (assisted generation at any length of the sequence so far)
        continues = self._root is not None and length >= self._start and all(
            tuple(row[:self._start].tolist()) in self._prompts for row in ids)
        if not continues:  # a new generate call: every row starts the grammar
            self._root = TokenConstraint(GrammarVocabulary.of(self.tokenizer, scores.shape[-1]), self.grammar,
                                         self.ends)
            self._start, self._states = length, OrderedDict()
            self._prompts = {tuple(row.tolist()) for row in ids}
        states = [self._state(tuple(row[self._start:].tolist())) for row in ids]
        while len(self._states) > max(KEPT_STATES, 2 * len(ids)):  # the rows' own states are the newest
            self._states.popitem(last=False)
        out = np.array(scores, np.float32, copy=True)
        for row, state in enumerate(states):
            if not state.ended:
                allowed = state.allowed()
                # a row whose allowed tokens are all at -inf already (banned by an earlier processor: n-gram
                # blocking, bad words) draws among them evenly, as prefix_allowed_tokens_fn's rows do
                kept = np.where(allowed, out[row], -np.inf)
                out[row] = kept if np.isfinite(kept).any() else np.where(allowed, 0.0, -np.inf)
        return out
