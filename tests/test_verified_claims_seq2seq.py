"""Every status claim the encoder-decoder plugin (vkformers-t5) makes is backed by a parity test that CI runs.

An encoder-decoder marked "verified" or "forward-verified" must have a fixture folder in
tests/fixtures/seq2seq/ whose config resolves to it (tests/test_seq2seq_parity.py is parametrised over
those folders, so a fixture is a test). "verified" also needs the fixture to hold what the gradient,
AdamW and greedy-decoding tests compare: a gradient for every trainable parameter, the parameters after
one AdamW step, and the greedy tokens with the per-step logits.
"""
from __future__ import annotations

import json

import pytest

import test_seq2seq_parity as parity
from fixture_cases import read_reference
from vkformers.models.loading import load_config
from vkformers.models.plugins import registry

CLAIMS = ("verified", "forward-verified")


def fixtures_by_architecture() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in parity.fixture_names():
        found.setdefault(registry().resolve(load_config(parity.FIXTURES / name)).name, []).append(name)
    return found


claimed = [a for a in registry().architectures() if a.status in CLAIMS and a.kind == "encoder-decoder"]


def test_some_claims_are_made():
    assert claimed, "no encoder-decoder is claimed: the plugin's declared statuses did not register"


@pytest.mark.parametrize("architecture", claimed, ids=[a.name for a in claimed])
def test_claim_has_a_parity_fixture(architecture):
    fixtures = fixtures_by_architecture().get(architecture.name, [])
    assert fixtures, (f"{architecture.name} is marked {architecture.status} but no folder in {parity.FIXTURES} "
                      "resolves to it, so no test proves it")
    if architecture.status != "verified":
        return
    for name in fixtures:
        folder = parity.FIXTURES / name
        meta = json.loads((folder / "meta.json").read_text())
        keys = set(read_reference(folder / "reference.safetensors"))
        trainable = [n for n in meta["parameters"] if n not in meta["params_frozen"]]
        assert trainable and all(f"grad.{n}" in keys and f"adamw.{n}" in keys for n in trainable), (
            f"{architecture.name} is marked verified but fixture {name} lacks gradients or the AdamW step")
        assert {"greedy_tokens", "greedy_logits"} <= keys, (
            f"{architecture.name} is marked verified but fixture {name} lacks the greedy decoding reference")


def test_claims_are_known_statuses():
    from vkformers_t5.variants import FAMILY
    assert set(FAMILY.statuses().values()) <= set(CLAIMS)
    assert {a.name: a.status for a in registry().architectures()
            if a.family == "t5" and a.status != "registered"} == FAMILY.statuses()
