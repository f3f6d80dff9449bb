"""What the parity tests share: the fixture folders under a root, and fixtures loaded once per session."""
from __future__ import annotations

from pathlib import Path

import pytest


def fixture_folders(root: Path) -> list[str]:
    """Every fixture folder (one with a reference) under ``root``, sorted; none if root is missing."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "reference.safetensors").is_file())


def with_known_failures(names, known: dict) -> list:
    """``names`` as pytest parameters, those in ``known`` (name -> the open bug) expected to fail (strictly: a
    fixed one must leave the list)."""
    return [pytest.param(n, marks=pytest.mark.xfail(reason=known[n], strict=True)) if n in known else n
            for n in names]


class CachedCase:
    """A fixture a subclass loads and runs in ``__init__(name)``, once per test session (``get``)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._cache = {}

    @classmethod
    def get(cls, name: str):
        if name not in cls._cache:
            cls._cache[name] = cls(name)
        return cls._cache[name]
