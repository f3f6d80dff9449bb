"""transformers' text streamers for ``generate(..., streamer=...)``: ``TextStreamer`` prints the text as it comes,
``TextIteratorStreamer`` hands it to another thread as an iterator (a chat UI running generate in a thread).

generate calls ``put`` with the prompt ([1, T]) first, then with each step's new token ([1]), and ``end`` once. The
text is released in transformers' pieces: the tokens so far are decoded anew each time, and what is printable is
what cannot change with the next token: the whole text at a newline (the cache then restarts from the last token,
which keeps the next line's leading space), at a CJK character, or when all that is new is letters, marks,
digits and spaces; otherwise up to the last space (a symbol may start a longer one, or be half a character).
"""
from __future__ import annotations

import unicodedata
from queue import Queue

import numpy as np

from vkformers.errors import InputError

# The CJK ideograph blocks transformers' streamers print at once (no spaces between words there)
CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def is_cjk(char: str) -> bool:
    code = ord(char)
    return any(low <= code <= high for low, high in CJK_RANGES)


class TextStreamer:
    """Prints generate's text to stdout as it becomes final (``skip_prompt``: not the prompt; ``decode_kwargs``:
    for ``tokenizer.decode``, such as ``skip_special_tokens=True``). One row at a time, as transformers'."""

    def __init__(self, tokenizer, skip_prompt: bool = False, **decode_kwargs):
        self.tokenizer, self.skip_prompt, self.decode_kwargs = tokenizer, skip_prompt, decode_kwargs
        self.token_cache: list[int] = []
        self.print_len = 0
        self.next_tokens_are_prompt = True

    def put(self, value) -> None:
        value = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        if value.ndim > 1 and value.shape[0] > 1:
            raise InputError(f"{type(self).__name__} streams one row; generate was given {value.shape[0]}")
        value = value.reshape(-1)
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(int(t) for t in value)
        text = self._decode(self.token_cache)
        new = text[self.print_len:]
        if text.endswith("\n"):
            printable = new
            self.token_cache = self.token_cache[-1:]
            self.print_len = len(self._decode(self.token_cache))
        elif text and is_cjk(text[-1]):
            printable = new
            self.print_len += len(printable)
        elif all(char.isspace() or unicodedata.category(char)[0] in "LMN" for char in new):
            printable = new
            self.print_len += len(printable)
        else:
            printable = text[self.print_len:text.rfind(" ") + 1]
            self.print_len += len(printable)
        self.on_finalized_text(printable)

    def end(self) -> None:
        """The rest of the text, then the end of the stream (a newline, for this class)."""
        printable = self._decode(self.token_cache)[self.print_len:] if self.token_cache else ""
        self.token_cache, self.print_len = [], 0
        self.next_tokens_are_prompt = True
        self.on_finalized_text(printable, stream_end=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, flush=True, end=None if stream_end else "")

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, **self.decode_kwargs)


class TextIteratorStreamer(TextStreamer):
    """The text as an iterator for another thread, as transformers' class::

        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        Thread(target=model.generate, args=(ids,), kwargs=dict(streamer=streamer, max_new_tokens=64)).start()
        for text in streamer: ...

    ``timeout``: seconds a read waits for the next piece (None: for ever), after which ``queue.Empty`` is raised,
    so that a reader learns that generate failed in its thread."""

    def __init__(self, tokenizer, skip_prompt: bool = False, timeout: float | None = None, **decode_kwargs):
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.text_queue: Queue = Queue()
        self.stop_signal = None
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self.stop_signal:
            raise StopIteration
        return value
