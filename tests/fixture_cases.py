"""What the parity tests share: the fixture folders under a root, and fixtures loaded once per session."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vkformers.models.safetensors_io import read_safetensors

# generate's settings of the GenerationConfig the fixtures' greedy references were made with (no beams, no forced
# tokens: tools/make_seq2seq_fixtures.py's clean_generation_config), over what a fixture's own config asks for
CLEAN_GENERATION = {"num_beams": 1, "forced_bos_token_id": None, "forced_eos_token_id": None}

# (step kind, the kind whose parameters it starts from; None: the fixture's model.safetensors)
ADAMW_STEPS = (("adamw", None), ("adamw2", "adamw"))


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


def read_reference(path: Path) -> dict[str, np.ndarray]:
    """A reference file's tensors (bfloat16 as float32), with the AdamW parameters ``adamw.<p>`` and ``adamw2.<p>``
    rebuilt in float32 from the steps stored in their place (tests/fixtures/README.md,
    tools/compact_adamw_fixtures.py's ``expand``): base + float32(adamw_delta.<p>) * adamw_delta_scale.<p>."""
    path = Path(path)
    ref = {k: e.as_float() for k, e in read_safetensors(path).items()}
    if not any(k.startswith(tuple(f"{kind}_delta." for kind, _ in ADAMW_STEPS)) for k in ref):
        return ref
    model = {k: e.as_float() for k, e in read_safetensors(path.parent / "model.safetensors").items()}
    for kind, base_kind in ADAMW_STEPS:
        base = model if base_kind is None else {k[len(base_kind) + 1:]: v for k, v in ref.items()
                                                 if k.startswith(base_kind + ".")}
        for key in [k for k in ref if k.startswith(kind + "_delta.")]:
            name = key[len(kind) + len("_delta."):]
            scale = ref.pop(f"{kind}_delta_scale.{name}")
            ref[f"{kind}.{name}"] = base[name].astype(np.float32) + ref.pop(key).astype(np.float32) * np.float32(scale)
    return ref
