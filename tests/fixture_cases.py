"""What the parity tests share: the fixture folders under a root, and fixtures loaded once per session."""
from __future__ import annotations

from pathlib import Path


def fixture_folders(root: Path) -> list[str]:
    """Every fixture folder (one with a reference) under ``root``, sorted; none if root is missing."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "reference.safetensors").is_file())


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
