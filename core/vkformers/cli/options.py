"""Argument types that check ranges where argparse parses, so a bad value is a one-line usage error
(``vkformers train: error: argument --batch-size: must be a whole number >= 1, got 0``), not a
failure minutes later. Use as ``type=`` in ``add_argument``; new options pick the type that fits.
"""
from __future__ import annotations

import argparse
import json
import math


def whole_number(low: int, high: int | None = None):
    """An int in [low, high] (high None: no upper bound)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be a whole number {span}, got {text}")
        return value
    parse.__name__ = "whole number"  # argparse names the type in its own messages
    return parse


def number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False):
    """A finite float in the interval from ``low`` to ``high`` (each end closed unless ``*_open``)."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    span = f"in {left}{low:g}, {high:g}{right}" if high is not None else f"{'>' if low_open else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or (
                high is not None and (value > high or (high_open and value == high))):
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


def whole_numbers(low: int):
    """Comma-separated whole numbers >= low, as a tuple ("none": the empty tuple)."""
    one = whole_number(low)

    def parse(text: str) -> tuple[int, ...]:
        if text.strip().lower() == "none":
            return ()
        return tuple(one(part.strip()) for part in text.split(","))
    parse.__name__ = "list of whole numbers"
    return parse


positive_int = whole_number(1)
non_negative_int = whole_number(0)
positive_number = number(0.0, low_open=True)
non_negative_number = number(0.0)
fraction = number(0.0, 1.0, high_open=True)  # a share or a probability that must leave something: [0, 1)
unit_interval = number(0.0, 1.0)


# the names a chat template's own arguments take (and apply_chat_template's): extra template variables may not
CHAT_TEMPLATE_ARGUMENTS = ("messages", "conversation", "tools", "documents", "add_generation_prompt",
                           "continue_final_message", "chat_template", "tokenize", "padding", "truncation",
                           "max_length", "return_tensors", "return_dict")


def template_variables_problem(value) -> str | None:
    """What is wrong with ``value`` as extra variables for a chat template (vLLM's chat_template_kwargs, such as
    {"enable_thinking": false}), or None where nothing is."""
    if not isinstance(value, dict):
        return f"must be a JSON object of template variables such as {{\"enable_thinking\": false}}, got {value!r}"
    taken = [name for name in value if name in CHAT_TEMPLATE_ARGUMENTS]
    if taken:
        return (f"may not set {', '.join(map(repr, taken))}: the chat template's own arguments come from the request "
                "itself")
    return None


def template_variables(text: str) -> dict:
    """A JSON object of extra chat template variables (template_variables_problem says what it may hold)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"enable_thinking\": false}}' ({exc})") \
            from None
    problem = template_variables_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


template_variables.__name__ = "JSON object"
