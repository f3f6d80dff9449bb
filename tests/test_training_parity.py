"""Two full training steps against transformers + torch.optim.AdamW (tests/fixtures/README.md).

For the fixtures that store ``adamw2.<param>`` (llama, qwen2, gemma2; tools/make_fixtures.py,
``adamw_steps=2``), transformers ran forward + backward on the fixture batch, one AdamW step
(lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight decay 0.01), then forward + backward again at the
updated weights and a second step with the same optimizer. Here vkformers does the same with its own
forward, its own gradients and its own AdamW, and every parameter must match transformers' after
the second step, element by element, within

    ATOL + lr * AMPLIFICATION * GRAD_NOISE * max|g1 of its tensor| / (|g1| + eps)

The absolute part (1e-5) is the implementation's. The second part is what float32 gradients alone allow,
whoever computes them: AdamW normalizes each element's step by its gradient's size (lr * m / sqrt(v)), so a
gradient error d moves the parameter by about lr * d / |g| (the first step's lr * g1 / (|g1| + eps) hardly
depends on g1; the second step's m / sqrt(v), a function of g1 and g2, changes by at most 1.2 d / |g1| for
errors d in both, whatever g2 is; AMPLIFICATION = 4 leaves room for g2's noise, relative to its own tensor's
scale, being larger than g1's). A gradient is a float32 sum over the batch's tokens whose rounding, in any
order of summation, is GRAD_NOISE (1e-6, a few float32 epsilons times the square root of the terms) of the
tensor's largest gradient, g1 being the first step's reference gradient. Where |g1| is near its tensor's largest, the second part is ~1e-8 and the
bound is 1e-5; an element whose gradient nearly cancels is amplified: qwen2's layers.1.self_attn.k_proj.bias
has one of 8e-6 in a tensor whose largest is 1.2e-2 (with rotary positions a key bias barely moves the
scores), gemma2's layers.1.mlp.gate_proj one of 1.4e-7. transformers itself, run on another CPU, moves
qwen2's layers.0 k_proj.bias by 2.7e-6 against its own fixture after the two steps; a GPU sums in other
orders still.

(tests/test_adamw_parity.py checks one step from transformers' gradients; this one closes the loop.)
"""
import json

import numpy as np
import pytest

from fixture_cases import read_reference
from test_decoder_parity import FIXTURES, fixture_names
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.optim import AdamW

ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ATOL = 1e-5
GRAD_NOISE = 1e-6
AMPLIFICATION = 4.0


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
    reference = read_reference(folder / "reference.safetensors")
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
        bound = tolerance(reference[f"grad.{ref_name}"])
        worst = np.unravel_index(np.argmax(error / bound), error.shape)
        if not error[worst] <= bound[worst]:
            g1 = reference[f"grad.{ref_name}"]
            failures.append(f"{ref_name}{list(worst)}: {error[worst]:.3g} > {bound[worst]:.3g} (first gradient "
                            f"{g1[worst]:.3g}, its tensor's largest {np.abs(g1).max():.3g})")
    assert not failures, f"{name}: after two steps: " + "; ".join(failures)


def tolerance(first_grad: np.ndarray) -> np.ndarray:
    """Each element's bound (see the module docstring): ATOL, plus what float32 gradient noise of its tensor
    moves it by through AdamW's normalized steps. An exactly zero gradient (an unused embedding row) is summed
    from no terms: its bound is ATOL."""
    noise = GRAD_NOISE * np.abs(first_grad).max()
    amplified = ADAMW["lr"] * AMPLIFICATION * noise / (np.abs(first_grad) + ADAMW["eps"])
    return ATOL + np.where(first_grad != 0, amplified, 0.0)


def test_adamw_parameter_order_does_not_matter():
    # Regression: an update writing several buffers (parameter, moments) waited only for the readers of the
    # last one, so a backward op could read a parameter after its update when parameters came in another order.
    ours, _, reference = train_two_steps("llama", order=lambda names: names[::-1])
    excess = max(float((np.abs(p.numpy() - reference[f"adamw2.{n}"]) / tolerance(reference[f"grad.{n}"])).max())
                 for n, p in ours.items())
    assert excess <= 1.0, f"reversed parameter order: {excess:.3g} times the tolerance"
