"""The shared encoder against transformers: every fixture in tests/fixtures/encoders/<name>/
(tools/make_encoder_fixtures.py), loaded with AutoModelForMaskedLM.

Each fixture is a tiny random *ForMaskedLM checkpoint plus transformers' outputs for a [2, 8] batch
whose second row is right-padded by 2. A new fixture folder is tested automatically.

Tolerances (float32):
- logits: 1e-4 absolute at the non-padded positions;
- loss: 1e-5 relative;
- gradients: per tensor, max |ours - theirs| <= 1e-3 * max(max |theirs|, 1e-3 * G), G being the
  largest gradient magnitude of the model (the floor covers tensors whose exact gradient is zero,
  such as key biases, which shift every score of a query equally: the reference holds rounding noise);
- one AdamW step from the reference gradients: 1e-5 absolute.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine.lazy import realize
from vkformers.models.loading import AutoModelForMaskedLM, load_config
from vkformers.models.safetensors_io import read_safetensors
from vkformers.optim import AdamW

from fixture_cases import CachedCase, fixture_folders, read_reference

FIXTURES = Path(os.environ.get("VKFORMERS_ENCODER_FIXTURES", Path(__file__).parent / "fixtures" / "encoders"))
LOGITS_ATOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-3
ADAMW_ATOL = 1e-5


def fixture_names() -> list[str]:
    """Every fixture folder (one with a reference); tests/test_verified_claims_encoder.py uses the same list."""
    return fixture_folders(FIXTURES)


def unsupported_reason(folder: Path) -> str | None:
    """Why the encoder refuses this fixture's config (an unimplemented architecture or option), or None."""
    from vkformers.models.plugins import registry
    from vkformers_bert.variants import UnsupportedConfigError, encoder_spec
    config = load_config(folder)
    architecture = registry().resolve(config)
    if architecture.family != "bert":
        return f"architecture {architecture.name} belongs to vkformers-{architecture.family}"
    try:
        encoder_spec(config, architecture.name)
    except UnsupportedConfigError as exc:
        return str(exc)
    return None


def _reference(folder: Path) -> dict[str, np.ndarray]:
    return read_reference(folder / "reference.safetensors")


def _inputs(ref):
    types = ref.get("token_type_ids")
    return dict(input_ids=ref["input_ids"].astype(np.int32), attention_mask=ref["attention_mask"].astype(np.int32),
                token_type_ids=None if types is None else types.astype(np.int32))


class Case(CachedCase):
    """One fixture run once per test session: forward with labels, then backward."""

    @classmethod
    def get(cls, name: str) -> "Case":
        reason = unsupported_reason(FIXTURES / name)
        if reason:
            pytest.skip(f"not implemented: {reason}")
        return super().get(name)

    def __init__(self, name: str):
        self.folder = FIXTURES / name
        self.meta = json.loads((self.folder / "meta.json").read_text())
        self.ref = _reference(self.folder)
        self.mask = self.ref["attention_mask"].astype(bool)
        self.model = AutoModelForMaskedLM.from_pretrained(self.folder, dtype="float32")
        out = self.model(**_inputs(self.ref), labels=self.ref["labels"].astype(np.int32))
        out.loss.backward()
        self.params = dict(self.model.named_parameters())
        # one plan for the forward and backward: reading each tensor separately would run them piecemeal
        realize([out.logits.lazy, out.loss.lazy] + [p.grad.lazy for p in self.params.values() if p.grad is not None])
        self.logits = out.logits.numpy()
        self.loss = out.loss.item()


@pytest.mark.parametrize("name", fixture_names())
def test_logits(name):
    case = Case.get(name)
    assert case.logits.shape == case.ref["logits"].shape
    error = np.abs(case.logits - case.ref["logits"])[case.mask].max()
    assert error <= LOGITS_ATOL, f"{name}: logits differ by {error:.3g} (tolerance {LOGITS_ATOL})"


@pytest.mark.parametrize("name", fixture_names())
def test_loss(name):
    case = Case.get(name)
    expected = float(case.ref["loss"])
    error = abs(case.loss - expected) / abs(expected)
    assert error <= LOSS_RTOL, f"{name}: loss {case.loss} vs {expected} (relative error {error:.3g})"


@pytest.mark.parametrize("name", fixture_names())
def test_gradients(name):
    case = Case.get(name)
    names = sorted(k[len("grad."):] for k in case.ref if k.startswith("grad."))
    assert sorted(case.params) == names, f"{name}: parameter names differ from transformers'"
    largest = max(np.abs(case.ref[f"grad.{n}"]).max() for n in names)
    without_grad = set(case.meta["params_without_grad"])
    failures = []
    for n in names:
        expected = case.ref[f"grad.{n}"]
        grad = case.params[n].grad
        if (grad is None) != (n in without_grad):  # torch's AdamW decays a zero gradient, skips a missing one
            failures.append(f"{n}: " + ("no gradient, where torch has one" if grad is None
                                        else "a gradient, where torch has none"))
            continue
        got = np.zeros_like(expected) if grad is None else grad.numpy()
        error = np.abs(got - expected).max()
        bound = GRAD_RTOL * max(np.abs(expected).max(), 1e-3 * largest)
        if not error <= bound:
            failures.append(f"{n}: {error:.3g} > {bound:.3g}")
    assert not failures, f"{name}: gradients differ: " + "; ".join(failures)


@pytest.mark.parametrize("name", fixture_names())
def test_one_adamw_step_matches_torch(name):
    """The reference gradients through vkformers' AdamW give torch's parameters (parameters without a gradient,
    e.g. RoFormer's frozen sinusoids or ESM's unused contact head, are left alone by torch and by us)."""
    if unsupported_reason(FIXTURES / name):
        pytest.skip("not implemented")
    folder = FIXTURES / name
    ref = _reference(folder)
    frozen = set(json.loads((folder / "meta.json").read_text())["params_without_grad"])
    params = dict(AutoModelForMaskedLM.from_pretrained(folder, dtype="float32").named_parameters())
    before = {n: params[n].numpy() for n in frozen}
    trained = {n: p for n, p in params.items() if n not in frozen}
    for n, p in trained.items():
        p.grad = vkf.tensor(ref[f"grad.{n}"])
    AdamW(list(trained.values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).step()
    for n, p in params.items():
        np.testing.assert_allclose(p.numpy(), before[n] if n in frozen else ref[f"adamw.{n}"], atol=ADAMW_ATOL,
                                   rtol=0, err_msg=f"{name}: {n}")
        if n in frozen:
            np.testing.assert_array_equal(before[n], ref[f"adamw.{n}"])


@pytest.mark.parametrize("name", ["albert", "esm"])
def test_save_pretrained_round_trip(name, tmp_path):
    """save_pretrained writes the fixture's tensor names (tied decoder once, ESM's LayerNorm.gamma read as
    .weight, which transformers reads back too) and config; reloading gives the same logits."""
    if name not in fixture_names():
        pytest.skip(f"fixture {name} missing")
    case = Case.get(name)
    case.model.save_pretrained(tmp_path)
    saved = set(read_safetensors(tmp_path / "model.safetensors"))
    assert saved == set(case.params)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == case.meta["model_type"]
    again = AutoModelForMaskedLM.from_pretrained(tmp_path)
    logits = again(**_inputs(case.ref)).logits.numpy()
    np.testing.assert_allclose(logits, case.logits, atol=1e-6, rtol=0)


def test_albert_shares_one_block_between_layers():
    case = Case.get("albert")
    blocks = case.model.layers
    assert len(blocks) == 2 and blocks[0] is blocks[1]
    assert not any(".albert_layers.1." in n or "albert_layer_groups.1" in n for n in case.params)


def test_unsupported_option_is_named():
    from vkformers_bert.variants import UnsupportedConfigError
    config = dict(load_config(FIXTURES / "bert"), position_embedding_type="relative_key")
    with pytest.raises(UnsupportedConfigError, match="position_embedding_type='relative_key'"):
        AutoModelForMaskedLM.from_config(config)
    config = dict(load_config(FIXTURES / "distilbert"), sinusoidal_pos_embds=True)
    with pytest.raises(UnsupportedConfigError, match="sinusoidal_pos_embds=True"):
        AutoModelForMaskedLM.from_config(config)


def test_unimplemented_encoder_architecture_is_named():
    from vkformers_bert.variants import UnsupportedConfigError, encoder_spec
    with pytest.raises(UnsupportedConfigError, match="'made-up-encoder'.*no encoder variant"):
        encoder_spec({"vocab_size": 48}, "made-up-encoder")


@pytest.mark.parametrize("fixture, option, value", [
    ("big_bird", "attention_type", "block_sparse"), ("flaubert", "pre_norm", True), ("xlm", "causal", True),
    ("roc_bert", "concat_input", False), ("modernbert", "sparse_prediction", True),
    ("nystromformer", "inv_coeff_init_option", True), ("nystromformer", "conv_kernel_size", 4),
    ("nystromformer", "num_landmarks", 3), ("yoso", "use_expectation", False), ("yoso", "conv_window", 4),
    ("funnel", "attention_type", "factorized"), ("funnel", "pooling_type", "max"), ("funnel", "pool_q_only", False)])
def test_unimplemented_variant_options_are_named(fixture, option, value):
    from vkformers_bert.variants import UnsupportedConfigError
    if fixture not in fixture_names():
        pytest.skip(f"fixture {fixture} missing")
    config = dict(load_config(FIXTURES / fixture), **{option: value})
    with pytest.raises(UnsupportedConfigError, match=f"{option}={value!r}"):
        AutoModelForMaskedLM.from_config(config)


def test_modernbert_sliding_layer_sees_only_its_window():
    """Layer 1 of the ModernBERT fixture is a sliding layer (|i - j| <= 2 of 8 positions): run with full attention
    there instead, the logits move far beyond the parity tolerance, so the window is what the fixture checks."""
    case = Case.get("modernbert")
    layers = case.model.layers
    assert [layer.window for layer in layers] == [0, 2]
    layers[1].window = 0
    try:
        logits = case.model(**_inputs(case.ref)).logits.numpy()
    finally:
        layers[1].window = 2
    assert np.abs(logits - case.ref["logits"])[case.mask].max() > 100 * LOGITS_ATOL


def test_too_long_input_is_refused():
    model = Case.get("bert").model
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(np.full((1, 41), 7, np.int32))


def test_nystromformer_landmarks_need_their_sequence_length():
    """The landmarks are means of num_landmarks segments of exactly segment_means_seq_len positions (8 here):
    another length is refused by name (transformers would reshape across the batch), and exact attention (every
    position a landmark) moves the logits far beyond the tolerance, so the approximation is what the fixture checks."""
    from vkformers.errors import InputError
    case = Case.get("nystromformer")
    with pytest.raises(InputError, match="segment_means_seq_len=8"):
        case.model(case.ref["input_ids"][:, :6].astype(np.int32))
    spec = case.model.spec
    for layer in case.model.layers:
        layer.spec = replace(spec, landmarks=spec.landmark_length)
    try:
        logits = case.model(**_inputs(case.ref)).logits.numpy()
    finally:
        for layer in case.model.layers:
            layer.spec = spec
    assert np.abs(logits - case.ref["logits"])[case.mask].max() > 100 * LOGITS_ATOL


def test_funnel_runs_other_lengths_and_refuses_too_short_ones():
    """The fixture is [2, 8]; a length of 7 pools into an odd number of pairs. Too short a sequence for the
    pooling (transformers fails on it too) is refused by name."""
    from vkformers.errors import InputError
    case = Case.get("funnel")
    logits = case.model(case.ref["input_ids"][:, :7].astype(np.int32)).logits.numpy()
    assert logits.shape == (2, 7, case.ref["logits"].shape[-1]) and np.isfinite(logits).all()
    with pytest.raises(InputError, match="too short"):
        case.model(case.ref["input_ids"][:, :2].astype(np.int32))
