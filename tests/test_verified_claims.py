"""Every status claim a plugin makes for a causal decoder is backed by a parity test that CI runs.

An architecture marked "verified" or "forward-verified" must have a fixture folder in
tests/fixtures/ whose config resolves to it and that tests/test_decoder_parity.py runs
(its parametrisation is the list of fixture folders, so a fixture is a test). "verified" also
needs the gradient comparison to run on that fixture, not to be skipped, and the fixture to hold the
greedy tokens that tests/test_generation.py and the AdamW step that tests/test_adamw_parity.py compare.
"""
from __future__ import annotations

import numpy as np
import pytest

import test_decoder_parity as parity
from fixture_cases import read_reference
from vkformers.models.loading import load_config
from vkformers.models.plugins import registry
from vkformers.models.safetensors_io import read_safetensors

CLAIMS = ("verified", "forward-verified")


def fixtures_by_architecture() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in parity.fixture_names():
        architecture = registry().resolve(load_config(parity.FIXTURES / name))
        found.setdefault(architecture.name, []).append(name)
    return found


def _gradients_compared(name: str) -> bool:
    """False when test_gradients skips this fixture (its loss reads padded rows that eager attention defines)."""
    import json
    folder = parity.FIXTURES / name
    meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").is_file() else {}
    if meta.get("attn_implementation", "eager") != "eager":
        return True
    ref = read_safetensors(folder / "reference.safetensors")
    mask, labels = ref["attention_mask"].as_float(), ref["labels"].as_float()
    return not parity.blind_reads(np.cumsum(mask, axis=1) == 0, labels, meta).any()


# Decoders here; other kinds prove their claims in their own files (test_verified_claims_<kind>.py).
claimed = [a for a in registry().architectures() if a.status in CLAIMS and a.kind == "causal-decoder"]


@pytest.mark.parametrize("architecture", claimed, ids=[a.name for a in claimed])
def test_claim_has_a_parity_fixture(architecture):
    fixtures = fixtures_by_architecture().get(architecture.name, [])
    assert fixtures, (f"{architecture.name} is marked {architecture.status} but no folder in {parity.FIXTURES} "
                      "resolves to it, so no test proves it")
    runnable = [f for f in fixtures if parity._unsupported_reason(parity.FIXTURES / f) is None]
    assert runnable, f"{architecture.name} is marked {architecture.status} but its fixtures {fixtures} are skipped"
    assert set(runnable) <= set(parity.fixture_names())  # parametrised in test_decoder_parity
    if architecture.status == "verified":
        assert any(_gradients_compared(f) for f in runnable), (
            f"{architecture.name} is marked verified but test_gradients skips its fixtures {runnable}")
        for f in runnable:
            reference = read_reference(parity.FIXTURES / f / "reference.safetensors")
            assert "greedy_tokens" in reference and any(k.startswith("adamw.") for k in reference), (
                f"{architecture.name} is marked verified but fixture {f} lacks greedy tokens or the AdamW step")


def test_claims_are_known_statuses():
    from vkformers_llama.variants import FAMILY
    assert set(FAMILY.statuses().values()) <= set(CLAIMS)
    # what the declarations claim is what the registry (and so the claims above) holds
    assert {a.name: a.status for a in registry().architectures()
            if a.family == "llama" and a.status != "registered"} == FAMILY.statuses()
