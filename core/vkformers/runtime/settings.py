"""Bounds and switches read from the environment (VKFORMERS_*), parsed once at import by the module they set."""
from __future__ import annotations

import os
import re

from vkformers.errors import InvalidSettingError

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.I)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def count_setting(name: str, default: int) -> int:
    """The non-negative integer in environment variable ``name``, or ``default`` when it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise InvalidSettingError(f"{name}={raw!r} is not a count; set it to a non-negative integer such as {default}")
    return int(raw)


def bytes_setting(name: str, default: int) -> int:
    """A size in bytes from environment variable ``name``: an integer, optionally with K, M, G or T (powers of
    1024; "512M", "2GiB"); ``default`` when it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    match = _SIZE.match(raw)
    if match is None:
        raise InvalidSettingError(f"{name}={raw!r} is not a size; set it to bytes such as {default} or 512M or 2G")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]
