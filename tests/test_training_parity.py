"""Two full training steps against transformers + torch.optim.AdamW (tests/fixtures/README.md).

For the fixtures that store ``adamw2.<param>`` (llama, qwen2, gemma2; tools/make_fixtures.py,
``adamw_steps=2``), transformers ran forward + backward on the fixture batch, one AdamW step
(lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight decay 0.01), then forward + backward again at the
updated weights and a second step with the same optimizer. Here vkformers does the same with its own
forward, its own gradients and its own AdamW, and every parameter must match transformers' after
the second step within 1e-5 absolute, element by element (max |ours - theirs|, the L-infinity norm).

One exception, from the arithmetic rather than the implementation: AdamW's first step moves an element
by lr * g / (|g| + eps) (eps 1e-8), whose derivative in g is lr * eps / (|g| + eps)^2. For a gradient
element of ~1e-7 (gemma2 has one: layers.1.mlp.gate_proj [18, 17], 1.4e-7, the sum of terms ~1e-3
that cancel) a 1e-8 difference in the gradient -- fp32 rounding of that sum -- moves the parameter by
~4e-5. Elements whose first-step reference gradient is nonzero and below TINY_GRAD (100 eps) are therefore held to
TINY_GRAD_ATOL (lr / 10: the step's sign and rough size) and counted; every other element to 1e-5.

(tests/test_adamw_parity.py checks one step from transformers' gradients; this one closes the loop.)
"""
import json

import numpy as np
import pytest

from test_decoder_parity import FIXTURES, fixture_names
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.safetensors_io import read_safetensors
from vkformers.optim import AdamW

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ATOL = 1e-5
TINY_GRAD = 1e-6
TINY_GRAD_ATOL = 1e-3


def two_step_fixtures() -> list[str]:
    names = []
    for name in fixture_names():
        meta = json.loads((FIXTURES / name / "meta.json").read_text())
        if "second_step" in meta.get("adamw", {}):
            names.append(name)
    return names


def test_the_required_fixtures_store_two_steps():
    assert {"llama", "qwen2", "gemma2"} <= set(two_step_fixtures())


def train_two_steps(name, order=None):
    """Two vkformers training steps on the fixture batch; returns ({reference name: parameter}, losses, reference).

    AdamW gets the parameters in model.named_parameters() order (as the Trainer passes them) unless
    ``order`` (a function of the list of names) says otherwise."""
    folder = FIXTURES / name
    reference = {k: e.as_float() for k, e in read_safetensors(folder / "reference.safetensors").items()}
    meta = json.loads((folder / "meta.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    params = dict(model.named_parameters())
    # transformers renames a few parameters on save: the fixture uses the in-memory names, we the saved ones.
    saved_as = dict(zip(sorted(meta.get("parameters_not_saved", [])), sorted(meta.get("saved_keys_not_parameters", []))))
    ours = {ref_name: params[saved_as.get(ref_name, ref_name)]
            for ref_name in (k[len("adamw2."):] for k in reference if k.startswith("adamw2."))}
    assert len(ours) == len(params), f"{name}: {len(params)} parameters, {len(ours)} in the reference"

    ids = reference["input_ids"].astype(np.int32)
    mask = reference["attention_mask"].astype(np.int32)
    labels = reference["labels"].astype(np.int32)
    model_order = {id(p): i for i, p in enumerate(params.values())}
    names = sorted(ours, key=lambda n: model_order[id(ours[n])])
    optimizer = AdamW([ours[n] for n in (order(names) if order else names)], **ADAMW)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # realizes forward, backward and the update
    return ours, losses, reference


@pytest.mark.parametrize("name", two_step_fixtures())
def test_two_training_steps_match_transformers(name):
    ours, losses, reference = train_two_steps(name)
    assert abs(losses[0] - float(reference["loss"])) <= 1e-5 * abs(float(reference["loss"]))
    assert losses[1] < losses[0], f"{name}: the first step did not lower the loss ({losses})"

    failures = []
    for ref_name, p in sorted(ours.items()):
        error = np.abs(p.numpy() - reference[f"adamw2.{ref_name}"])
        first_grad = reference[f"grad.{ref_name}"]
        tiny = (np.abs(first_grad) < TINY_GRAD) & (first_grad != 0)  # exact zeros (unused embedding rows) stay strict
        if not error[~tiny].max(initial=0.0) <= ATOL:
            failures.append(f"{ref_name}: max abs diff {error[~tiny].max():.3g}")
        if not error[tiny].max(initial=0.0) <= TINY_GRAD_ATOL:
            failures.append(f"{ref_name}: max abs diff {error[tiny].max():.3g} where |first gradient| < {TINY_GRAD}")
    assert not failures, f"{name}: after two steps (tolerance {ATOL} absolute): " + "; ".join(failures)


def test_adamw_parameter_order_does_not_matter():
    # Regression: an update writing several buffers (parameter, moments) waited only for the readers of the
    # last one, so a backward op could read a parameter after its update when parameters came in another order.
    ours, _, reference = train_two_steps("llama", order=lambda names: names[::-1])
    error = max(float(np.abs(p.numpy() - reference[f"adamw2.{n}"]).max()) for n, p in ours.items())
    assert error <= ATOL, f"reversed parameter order: max abs diff {error:.3g}"
