"""Reasoning in a thinking model's output, told apart from its answer as vLLM's ``--reasoning-parser`` tells it
(``vkformers serve --reasoning-parser NAME``).

Thinking models (DeepSeek-R1 and its distills, QwQ, Qwen3, GLM-4.5 and others of the same tags) write their chain
of thought between ``<think>`` and ``</think>``, then the answer. The chat template often writes the opening tag
itself, at the end of the prompt (``<think>\\n``), so that the reply starts inside the thinking; a template with a
switch to turn thinking off (Qwen3's ``enable_thinking``) writes a thinking already closed (``<think>\\n\\n</think>``).
Where the reply starts is read from the template's generation prompt (:meth:`ThinkingTags.reply_start`): the text
it adds for the assistant's turn, not earlier turns, whose own thinking may be there. Then:

- ``deepseek_r1``: the reply starts inside the thinking (opened by the template, or by the reply's own leading
  ``<think>``): everything before ``</think>`` is reasoning, the rest the answer;
- ``qwen3``: the reply thinks only where the thinking is opened, by the template (Qwen3-Thinking-2507, Qwen3.5) or
  by the reply's own leading ``<think>`` (Qwen3); a reply that opens none is all answer.

With either, a reply that ends before ``</think>`` (cut by its token limit) is all reasoning, as vLLM gives it, and a
generation prompt that closes the thinking makes the whole reply the answer. The tags themselves are in neither
part. :class:`ReasoningStream` splits a reply as it comes (the text that may be the start of a tag held back until
it is known); a whole reply is split by feeding it the same way, so a streamed reply and a whole one agree.
"""
from __future__ import annotations

import bisect

# where a reply starts: inside the thinking; where it may open the thinking with its first tag; in the answer
THINKING, OPENING, ANSWER = "thinking", "opening", "answer"


class ThinkingTags:
    """The tags a model's thinking stands between; ``thinks_unopened``: a reply whose thinking neither the template
    nor the reply opens still starts inside it (DeepSeek-R1's parser), else it is all answer (Qwen3's)."""

    start, end = "<think>", "</think>"
    thinks_unopened = True

    def reply_start(self, generation_prompt: str) -> str:
        """Where a reply after ``generation_prompt`` (the text the chat template adds for the assistant's turn)
        starts: THINKING where the prompt's last tag opens the thinking, ANSWER where it closes it (thinking off),
        else THINKING or OPENING as the parser takes a reply nothing opened."""
        opened, closed = generation_prompt.rfind(self.start), generation_prompt.rfind(self.end)
        if closed > opened:
            return ANSWER
        if opened > closed or self.thinks_unopened:
            return THINKING
        return OPENING

    def tag_tokens(self, tokenizer) -> tuple[int | None, int | None]:
        """Each tag's token id where ``tokenizer`` makes it one token (thinking models' vocabularies add them),
        else None."""
        ids = [tokenizer(tag, add_special_tokens=False)["input_ids"] for tag in (self.start, self.end)]
        return tuple(int(tag[0]) if len(tag) == 1 else None for tag in ids)


class DeepSeekR1Reasoning(ThinkingTags):
    """DeepSeek-R1 and its distills (and QwQ): the reply is reasoning up to ``</think>``."""


class Qwen3Reasoning(ThinkingTags):
    """Qwen3: reasoning only between ``<think>`` (the template's or the reply's) and ``</think>``."""

    thinks_unopened = False


REASONING_PARSERS = {"deepseek_r1": DeepSeekR1Reasoning, "qwen3": Qwen3Reasoning}


class ReasoningStream:
    """A reply's text split into reasoning and answer as it comes, from ``state`` (ThinkingTags.reply_start's):
    :meth:`feed` returns the reasoning and the answer text that may be sent now, :meth:`finish` the rest.

    A leading ``<think>`` (after blanks) opens the thinking, or is dropped where the reply starts inside it already;
    ``</think>`` closes it; text that may be the beginning of such a tag waits for the next piece. ``reasoning``,
    ``content``: all of each given so far; ``thought``: whether the reply was ever inside the thinking.
    ``reasoning_tokens``: the tokens between the tags (between the reply's start and ``</think>`` where the template
    opened the thinking; up to the reply's end where it never closed), as vLLM counts them, from the running token
    counts that come with the pieces: exact where each piece is a token's text, as the scheduler sends them."""

    def __init__(self, tags: ThinkingTags, state: str):
        self.tags, self.state = tags, state
        self.fresh = True  # inside the thinking, nothing but blanks read yet (a <think> there is dropped)
        self.thought = state == THINKING
        self.reasoning = self.content = ""
        self.pending = ""  # text read and not given yet
        self.read = 0      # characters of the reply before ``pending``
        self.tokens = 0    # tokens of the reply so far
        self.reasoning_tokens = 0
        self._ends, self._counts = [], []  # while the thinking may go on: each piece's end in the reply, tokens then
        self._opened_at = 0  # tokens before the thinking's text

    def feed(self, piece: str, tokens: int = 0) -> tuple[str, str]:
        """(reasoning, answer text) of ``piece`` that may be given now, the reply's tokens being ``tokens`` once
        it is read."""
        self.tokens = tokens
        if piece:
            self.pending += piece
            if self.state != ANSWER:
                self._ends.append(self.read + len(self.pending))
                self._counts.append(tokens)
        reasoning = content = ""
        start, end = self.tags.start, self.tags.end
        while self.pending:
            if self.state == ANSWER:
                content += self._take(len(self.pending))
                break
            if self.state == OPENING or self.fresh:  # the reply's first tag may open (or repeat) the thinking
                head = self.pending.lstrip()
                if head.startswith(start):
                    self._take(len(self.pending) - len(head) + len(start))
                    self.state, self.fresh, self.thought = THINKING, False, True
                    self._opened_at = self._tokens_before(self.read)
                    continue
                if start.startswith(head):  # blanks, or the tag's first characters: wait for more
                    break
                if self.state == OPENING:
                    self.state, self._ends, self._counts = ANSWER, [], []
                    continue
                self.fresh = False
            closing = self.pending.find(end)
            if closing >= 0:
                reasoning += self._take(closing)
                self.reasoning_tokens = self._tokens_before(self.read) - self._opened_at
                self._take(len(end))
                self.state, self._ends, self._counts = ANSWER, [], []
                continue
            reasoning += self._take(len(self.pending) - _held(self.pending, end))
            break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, answer text) held back at the reply's end: a thinking never closed keeps its text (and its
        tokens count as reasoning); a reply that never opened one keeps its blanks as answer."""
        rest = self._take(len(self.pending))
        if self.state == THINKING:
            self.reasoning_tokens = self.tokens - self._opened_at
            self.reasoning += rest
            return rest, ""
        self.content += rest
        return "", rest

    def _take(self, count: int) -> str:
        taken, self.pending = self.pending[:count], self.pending[count:]
        self.read += count
        return taken

    def _tokens_before(self, offset: int) -> int:
        """The tokens whose text ends at or before ``offset`` in the reply."""
        last = bisect.bisect_right(self._ends, offset) - 1
        return self._counts[last] if last >= 0 else 0


def _held(text: str, tag: str) -> int:
    """How many of ``text``'s last characters may be the beginning of ``tag`` (held back until the next piece)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0
