"""The shared decoder against transformers: every fixture in tests/fixtures/<name>/ (tools/make_fixtures.py).

Each fixture is a tiny random checkpoint plus transformers' own outputs for a [2, 8] batch whose
second row is left-padded by 2. A new fixture folder is tested automatically.

Tolerances (float32 throughout):
- logits: 1e-4 absolute;
- loss: 1e-5 relative;
- gradients: per tensor, max |ours - theirs| <= 1e-3 * max(max |theirs|, 1e-3 * G), G being the
  largest gradient magnitude of the whole model. The floor is for tensors whose exact gradient is
  zero (a key bias without rotary embeddings shifts every score of a query equally), where the
  reference holds only rounding noise.

Query rows that see no key at all (the padded positions of the left-padded row: causal + padding
mask hide every key) are defined differently by transformers' attention implementations: "sdpa"
gives zeros there (as vkformers' kernel does), "eager" an average of values. With an eager
fixture those logits are compared only where the spec reproduces that average (AttentionSpec.blind_rows), and when its labels make the loss read them (a padded
position predicting the first real token), the loss is compared with that one term removed from
both sides, and the gradients cannot be compared (the test says so).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from vkformers.models.loading import AutoModelForCausalLM

from fixture_cases import CachedCase, fixture_folders, read_reference

FIXTURES = Path(os.environ.get("VKFORMERS_FIXTURES", Path(__file__).parent / "fixtures"))  # override: other fixtures
IGNORE = -100
LOGITS_ATOL = 1e-4
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-3


def fixture_names() -> list[str]:
    """Every fixture folder (one with a reference); tests/test_verified_claims.py uses the same list."""
    return fixture_folders(FIXTURES)


def _unsupported_reason(folder: Path) -> str | None:
    """Why the decoder refuses this fixture's config (an unimplemented architecture or option), or None."""
    from vkformers.models.loading import load_config
    from vkformers.models.plugins import registry
    from vkformers_llama.variants import UnsupportedConfigError, decoder_spec
    config = load_config(folder)
    architecture = registry().resolve(config)
    if architecture.family == "ssm":  # state-space models (vkformers-ssm's own model)
        from vkformers_ssm.variants import UnsupportedConfigError, mamba_spec as decoder_spec
    elif architecture.family == "moe":  # the same decoder with a mixture-of-experts block (vkformers-moe's variants)
        from vkformers_moe.variants import decoder_spec
    elif architecture.family != "llama":
        return f"architecture {architecture.name} belongs to vkformers-{architecture.family}"
    try:
        decoder_spec(config, architecture.name)
    except UnsupportedConfigError as exc:
        return str(exc)
    return None


class Case(CachedCase):
    """One fixture run once per test session: forward with labels, then backward."""


    def __init__(self, name: str):
        self.folder = FIXTURES / name
        self.meta = json.loads((self.folder / "meta.json").read_text()) if (self.folder / "meta.json").is_file() \
            else {}
        self.ref = read_reference(self.folder / "reference.safetensors")
        ids = self.ref["input_ids"].astype(np.int32)
        self.mask = self.ref["attention_mask"].astype(np.int32)
        labels = self.ref["labels"].astype(np.int32)
        # query t of row b sees no key when every key 0..t is padding
        self.sees_nothing = np.cumsum(self.mask, axis=1) == 0
        self.eager = self.meta.get("attn_implementation", "eager") == "eager"
        # positions t whose logits predict a label (labels[t + 1]; TrOCR: labels[t]) while seeing no key
        reads_blind = blind_reads(self.sees_nothing, labels, self.meta)
        self.loss_reads_blind_rows = bool(self.eager and reads_blind.any())
        self.ref_loss = float(self.ref["loss"])
        if self.loss_reads_blind_rows:  # drop those terms from both losses (exact, from the reference logits)
            shift = label_shift(self.meta)
            self.ref_loss = _loss_without(self.ref["logits"], labels, reads_blind, self.ref_loss, shift)
            labels = labels.copy()
            labels[:, shift:][reads_blind[:, :labels.shape[1] - shift]] = IGNORE

        self.model = AutoModelForCausalLM.from_pretrained(self.folder, dtype="float32")
        out = self.model(ids, attention_mask=self.mask, labels=labels)
        self.logits = out.logits.numpy()
        self.loss = out.loss.item()
        out.loss.backward()
        self.params = dict(self.model.named_parameters())


def label_shift(meta: dict) -> int:
    """1: logits[t] predicts labels[t + 1] (transformers shifts inside); 0: labels[t] (meta loss_shifts_labels false)."""
    return 1 if meta.get("loss_shifts_labels", True) else 0


def blind_reads(sees_nothing: np.ndarray, labels: np.ndarray, meta: dict) -> np.ndarray:
    """Positions whose logits the loss reads (their label is not ignored) while the query sees no key."""
    shift, length = label_shift(meta), labels.shape[1]
    reads = np.zeros_like(sees_nothing)
    reads[:, :length - shift] = sees_nothing[:, :length - shift] & (labels[:, shift:] != IGNORE)
    return reads


def _loss_without(logits, labels, drop, loss, shift=1) -> float:
    """The mean cross-entropy ``loss`` recomputed without the terms at positions ``drop``."""
    length = labels.shape[1]
    z = logits[:, :length - shift].astype(np.float64)
    y = labels[:, shift:]
    keep = y != IGNORE
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse - np.take_along_axis(z, np.where(keep, y, 0)[..., None], -1)[..., 0]
    dropped = drop[:, :length - shift] & keep
    total = loss * keep.sum() - nll[dropped].sum()
    return float(total / (keep.sum() - dropped.sum()))


def _case(name: str) -> Case:
    reason = _unsupported_reason(FIXTURES / name)
    if reason:
        pytest.skip(f"not implemented: {reason}")
    return Case.get(name)


@pytest.mark.parametrize("name", fixture_names())
def test_logits(name):
    check_logits(name, _case(name))


def check_logits(name: str, case: Case) -> None:
    # Query rows that see no key are defined differently by each implementation (eager: mean of the values;
    # some sdpa paths too; our kernel: zeros), and no loss term reads them: compare the others, and them too where
    # the spec reproduces the reference there (AttentionSpec.blind_rows).
    spec = getattr(case.model, "spec", None)
    reproduced = getattr(getattr(spec, "attention", None), "blind_rows", "zero") != "zero"
    compared = np.ones_like(case.sees_nothing) if reproduced else ~case.sees_nothing
    error = np.abs(case.logits - case.ref["logits"])[compared].max()
    assert error <= LOGITS_ATOL, f"{name}: logits differ by {error:.3g} (tolerance {LOGITS_ATOL})"


@pytest.mark.parametrize("name", fixture_names())
def test_loss(name):
    case = _case(name)
    error = abs(case.loss - case.ref_loss) / abs(case.ref_loss)
    assert error <= LOSS_RTOL, f"{name}: loss {case.loss} vs {case.ref_loss} (relative error {error:.3g})"


def _grad_names(case: Case) -> dict[str, str]:
    """Reference gradient name -> our parameter name. Ours are the checkpoint's names; the fixture's are
    transformers' in-memory names, which differ where transformers renames on save (GPT-NeoX embed_out)."""
    grads = {k[len("grad."):] for k in case.ref if k.startswith("grad.")}
    renamed_from = sorted(case.meta.get("parameters_not_saved", []))
    renamed_to = sorted(case.meta.get("saved_keys_not_parameters", []))
    renames = dict(zip(renamed_from, renamed_to)) if len(renamed_from) == len(renamed_to) else {}
    return {g: (g if g in case.params else renames.get(g, g)) for g in grads}


@pytest.mark.parametrize("name", fixture_names())
def test_gradients(name):
    check_gradients(name, _case(name))


def check_gradients(name: str, case: Case) -> None:
    if case.loss_reads_blind_rows:
        pytest.skip("the fixture's loss reads logits of padded query rows that see no key, which eager attention "
                    "fills with an average of all values; regenerate it with those labels set to -100")
    names = _grad_names(case)
    missing = sorted(ours for ours in names.values() if ours not in case.params)
    assert not missing, f"{name}: reference gradients for parameters the model lacks: {missing}"
    assert len(names) == len(case.params), f"{name}: {len(case.params)} parameters, {len(names)} reference grads"
    largest = max(np.abs(case.ref[f"grad.{g}"]).max() for g in names)
    failures = []
    for theirs, ours in sorted(names.items()):
        expected = case.ref[f"grad.{theirs}"]
        grad = case.params[ours].grad
        got = np.zeros_like(expected) if grad is None else grad.numpy()
        error = np.abs(got - expected).max()
        bound = GRAD_RTOL * max(np.abs(expected).max(), 1e-3 * largest)
        if not error <= bound:
            failures.append(f"{ours}: {error:.3g} > {bound:.3g}")
    assert not failures, f"{name}: gradients differ: " + "; ".join(failures)


@pytest.mark.parametrize("name", fixture_names())
def test_gradient_presence(name):
    """A parameter has a gradient (zeros included) exactly where torch gives it one: torch's AdamW decays a
    parameter whose gradient is zero and skips one without (meta.json params_without_grad)."""
    case = _case(name)
    if case.loss_reads_blind_rows:
        pytest.skip("the fixture's gradients cannot be compared (see test_gradients)")
    without_grad = set(case.meta.get("params_without_grad", []))
    differ = [f"{ours}: " + ("no gradient, where torch has one" if case.params[ours].grad is None
                             else "a gradient, where torch has none")
              for theirs, ours in sorted(_grad_names(case).items())
              if (case.params[ours].grad is None) != (theirs in without_grad)]
    assert not differ, f"{name}: " + "; ".join(differ)


# Greedy tokens with the KV cache (reference greedy_tokens / greedy_logits) are compared in
# tests/test_generation.py, one AdamW step in tests/test_adamw_parity.py.
