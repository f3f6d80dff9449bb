"""Every status claim vkformers-bert makes for an encoder is backed by a parity fixture that CI runs.

An encoder marked "verified" or "forward-verified" must have a folder in tests/fixtures/encoders/
whose config resolves to it and that tests/test_encoder_parity.py runs (its parametrisation is the
list of fixture folders, so a fixture is a test) without skipping it. "verified" also needs the
fixture to hold every parameter's gradient and the AdamW step those tests compare.
"""
from __future__ import annotations

import pytest

import test_encoder_parity as parity
from fixture_cases import read_reference
from vkformers.models.loading import load_config
from vkformers.models.plugins import registry

CLAIMS = ("verified", "forward-verified")


def fixtures_by_architecture() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in parity.fixture_names():
        architecture = registry().resolve(load_config(parity.FIXTURES / name))
        found.setdefault(architecture.name, []).append(name)
    return found


claimed = [a for a in registry().architectures() if a.status in CLAIMS and a.kind == "encoder"]


@pytest.mark.parametrize("architecture", claimed, ids=[a.name for a in claimed])
def test_claim_has_a_parity_fixture(architecture):
    fixtures = fixtures_by_architecture().get(architecture.name, [])
    assert fixtures, (f"{architecture.name} is marked {architecture.status} but no folder in {parity.FIXTURES} "
                      "resolves to it, so no test proves it")
    runnable = [f for f in fixtures if parity.unsupported_reason(parity.FIXTURES / f) is None]
    assert runnable, f"{architecture.name} is marked {architecture.status} but its fixtures {fixtures} are skipped"
    if architecture.status == "verified":
        for f in runnable:
            reference = read_reference(parity.FIXTURES / f / "reference.safetensors")
            grads = {k[len("grad."):] for k in reference if k.startswith("grad.")}
            steps = {k[len("adamw."):] for k in reference if k.startswith("adamw.")}
            assert grads and grads == steps, (
                f"{architecture.name} is marked verified but fixture {f} lacks gradients or the AdamW step")


def test_encoder_claims_are_known_statuses():
    from vkformers_bert.variants import FAMILY
    assert set(FAMILY.statuses().values()) <= set(CLAIMS)
    assert {a.name: a.status for a in registry().architectures()
            if a.family == "bert" and a.status != "registered"} == FAMILY.statuses()


def test_the_bert_plugin_serves_masked_lm():
    from vkformers.models.plugins import plugin_manager
    bert = registry().get("bert")
    assert bert.tasks == ("masked-lm",)
    assert plugin_manager().hook.vkformers_model_class(architecture=bert, task="masked-lm") is not None
