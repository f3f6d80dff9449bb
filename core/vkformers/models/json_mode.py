"""JSON mode: output that is one JSON object, as OpenAI's ``response_format: {"type": "json_object"}`` promises.

:class:`JsonPrefix` reads text character by character and says whether it can still become a JSON object (and
whether it is one, complete). :class:`JsonChoice` picks a row's tokens with it: the likeliest token (greedy), or a
draw from the row's distribution, among those whose text keeps the output a valid prefix, trying candidates in order
of likelihood (greedy) or drawing again without the refused ones (sampling), so the choice is the one the
distribution restricted to valid tokens gives. Once the object is complete only an end token may follow.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from vkformers.errors import InputError

WHITESPACE = " \t\n\r"
# Whitespace between tokens at most this long in a row (indentation deep enough for pretty-printed JSON): a model
# that prefers blanks cannot fill its output with them
MAX_BLANK_RUN = 64
LITERALS = ("true", "false", "null")
# number states: where the text of a number is (complete in the ones of NUMBER_ENDS)
NUMBER_NEXT = {
    "start": {"-": "sign", "0": "zero", **{d: "int" for d in "123456789"}},
    "sign": {"0": "zero", **{d: "int" for d in "123456789"}},
    "zero": {".": "dot", "e": "e", "E": "e"},
    "int": {**{d: "int" for d in "0123456789"}, ".": "dot", "e": "e", "E": "e"},
    "dot": {d: "frac" for d in "0123456789"},
    "frac": {**{d: "frac" for d in "0123456789"}, "e": "e", "E": "e"},
    "e": {"+": "esign", "-": "esign", **{d: "exp" for d in "0123456789"}},
    "esign": {d: "exp" for d in "0123456789"},
    "exp": {d: "exp" for d in "0123456789"},
}
NUMBER_ENDS = {"zero", "int", "frac", "exp"}


@dataclass(frozen=True)
class JsonPrefix:
    """Where a JSON text is: ``stack`` of open containers ("{" or "["), ``mode`` what comes next ("value", "key",
    "key_or_close", "colon", "after", "value_or_close", "string", "escape", "unicode", "number", "literal", "done"),
    and the partial token's state (``key``: the open string is a key; ``part``: a number's state, a literal's text,
    the hex digits left of a \\u escape); ``blank``: whitespace in a row so far. The root must be an object, from the
    first character."""

    stack: tuple = ()
    mode: str = "value"
    key: bool = False
    part: object = None
    blank: int = 0

    @property
    def complete(self) -> bool:
        return self.mode == "done"

    def feed(self, text: str) -> "JsonPrefix | None":
        """The state after ``text``, or None where no JSON object starts so."""
        state = self
        for char in text:
            state = state._step(char)
            if state is None:
                return None
            if state.mode not in ("string", "escape", "unicode"):
                blank = state.blank + 1 if char in WHITESPACE else 0
                if blank > MAX_BLANK_RUN:
                    return None
                if blank != state.blank:
                    state = replace(state, blank=blank)
        return state

    def _close_value(self) -> "JsonPrefix":
        """A value ended: what its container expects next (the root: nothing but whitespace)."""
        return replace(self, mode="after" if self.stack else "done", key=False, part=None)

    def _step(self, c: str) -> "JsonPrefix | None":
        mode = self.mode
        if mode == "string":
            if c == '"':
                return replace(self, mode="colon", key=False) if self.key else self._close_value()
            if c == "\\":
                return replace(self, mode="escape")
            return self if c >= " " else None  # control characters must be escaped
        if mode == "escape":
            if c == "u":
                return replace(self, mode="unicode", part=4)
            return replace(self, mode="string") if c in '"\\/bfnrt' else None
        if mode == "unicode":
            if c not in "0123456789abcdefABCDEF":
                return None
            return replace(self, mode="string", part=None) if self.part == 1 else replace(self, part=self.part - 1)
        if mode == "number":
            following = NUMBER_NEXT[self.part].get(c)
            if following is not None:
                return replace(self, part=following)
            if self.part not in NUMBER_ENDS:
                return None
            after = self._close_value()
            return after._step(c)
        if mode == "literal":
            word = self.part + c
            matches = [w for w in LITERALS if w.startswith(word)]
            if not matches:
                return None
            return self._close_value() if word in LITERALS else replace(self, part=word)
        if c in WHITESPACE:
            return self if self.stack or mode == "done" else None  # the object comes first
        if mode == "done":
            return None
        if mode in ("value", "value_or_close"):
            if mode == "value_or_close" and c == "]":
                return replace(self, stack=self.stack[:-1])._close_value()
            if not self.stack and c != "{":  # the root is an object
                return None
            if c == "{":
                return replace(self, stack=self.stack + ("{",), mode="key_or_close")
            if c == "[":
                return replace(self, stack=self.stack + ("[",), mode="value_or_close")
            if c == '"':
                return replace(self, mode="string", key=False)
            if c in NUMBER_NEXT["start"]:
                return replace(self, mode="number", part=NUMBER_NEXT["start"][c])
            if c in "tfn":
                return replace(self, mode="literal", part=c)
            return None
        if mode in ("key", "key_or_close"):
            if c == '"':
                return replace(self, mode="string", key=True)
            if mode == "key_or_close" and c == "}":
                return replace(self, stack=self.stack[:-1])._close_value()
            return None
        if mode == "colon":
            return replace(self, mode="value") if c == ":" else None
        if mode == "after":
            top = self.stack[-1]
            if c == ",":
                return replace(self, mode="key" if top == "{" else "value")
            if c == ("}" if top == "{" else "]"):
                return replace(self, stack=self.stack[:-1])._close_value()
            return None
        return None


class JsonChoice:
    """A request's JSON mode: ``choose`` picks its next token from its scores and advances. ``token_text``: a
    token's text (cached by the caller); ``ends``: the end tokens, allowed only once the object is complete."""

    def __init__(self, token_text, ends):
        self.token_text, self.ends, self.state = token_text, set(int(e) for e in ends), JsonPrefix()

    def _next(self, token: int) -> JsonPrefix | None:
        if token in self.ends:
            return self.state if self.state.complete else None
        text = self.token_text(token)
        return self.state.feed(text) if text else None  # a token of no text would not move the object on

    def choose(self, probs: np.ndarray | None, scores: np.ndarray, rng=None) -> int:
        """Greedy (``probs`` None): the likeliest valid token of ``scores`` [vocab]; else a draw from ``probs``
        [vocab] among the valid tokens. When the object is complete: an end token."""
        if self.state.complete and self.ends:
            return max(self.ends, key=lambda e: scores[e])
        if probs is None:
            head = min(64, len(scores) - 1)  # the likeliest first: the whole vocabulary sorted only if none fits
            top = np.argpartition(-scores, head)[:head + 1]
            for order in (top[np.lexsort((top, -scores[top]))], np.argsort(-scores, kind="stable")):
                for token in order:
                    state = self._next(int(token))
                    if state is not None:
                        self.state = state
                        return int(token)
        else:
            probs = np.array(probs, np.float64)
            while probs.sum() > 0:
                token = int(rng.choice(len(probs), p=probs / probs.sum()))
                state = self._next(token)
                if state is not None:
                    self.state = state
                    return token
                probs[token] = 0.0
            return self.choose(None, scores)  # every token the warpers kept is refused: the likeliest valid one
        raise InputError("JSON mode: no token of this tokenizer continues the JSON object; leave response_format "
                         "out for this model")
