"""vkformers-ssm's Mamba model beyond the parity fixtures: training through the Trainer (captured steps replay
and equal steps built every time; the loss drops), gradient checkpointing, and a config option it does not
implement refused by name. The parity with transformers itself is tests/test_decoder_parity.py,
test_generation.py, test_adamw_parity.py, test_training_parity.py and test_padded_parity.py on
tests/fixtures/mamba and tests/fixtures/falcon_mamba."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vkformers import no_grad
from vkformers.engine import lazy
from vkformers.models import generation
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.safetensors_io import read_safetensors
from vkformers.models.lora import LoraConfig, apply_lora
from vkformers.training import Batches, PackedDataset, Trainer, TrainingConfig
from vkformers_ssm.variants import UnsupportedConfigError, mamba, mamba2

FIXTURE = Path(__file__).parent / "fixtures" / "mamba"


def _data(seq_len=12):
    """Four sequences: every batch of four is the whole set, so the loss must drop step after step."""
    tokens = np.random.default_rng(0).integers(3, 48, 4 * seq_len).astype(np.int64)
    return PackedDataset(tokens, tokens.copy(), seq_len)


def _train(capture: bool, name: str):
    model = AutoModelForCausalLM.from_pretrained(FIXTURE.parent / name, dtype="float32")
    config = TrainingConfig(steps=5, batch_size=4, seq_len=12, lr=1e-2, schedule="cosine", warmup=1, clip=1.0,
                            seed=3)
    trainer = Trainer(model, config, Batches(_data(), 4, seed=1))
    if not capture:
        run_step = trainer._capture.run
        trainer._capture.run = lambda *a: (trainer._capture.forget(), run_step(*a))[1]
    results = trainer.train()
    return [r["loss"] for r in results], model.backbone.layers[0].mixer.A_log.numpy()


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_trainer_steps_replay_and_equal_built_steps(name):
    (captured, a_captured), (built, a_built) = _train(True, name), _train(False, name)
    assert captured == built
    np.testing.assert_array_equal(a_captured, a_built)
    steps = captured[1:]  # the first step's learning rate is 0 (warm-up)
    assert all(later < earlier for earlier, later in zip(steps, steps[1:])), captured


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_gradient_checkpointing_gives_the_same_gradients(name):
    ids = np.random.default_rng(1).integers(3, 48, (2, 10)).astype(np.int32)
    grads = []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(FIXTURE.parent / name, dtype="float32")
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.numpy() for n, p in model.named_parameters()})
    for name in grads[0]:
        np.testing.assert_array_equal(grads[0][name], grads[1][name], err_msg=name)


def test_an_unimplemented_activation_is_refused():
    config = json.loads((FIXTURE / "config.json").read_text())
    with pytest.raises(UnsupportedConfigError, match="hidden_act"):
        mamba({**config, "hidden_act": "gelu"})


def test_mamba2_refuses_a_time_step_limit_it_does_not_apply():
    config = json.loads((FIXTURE.parent / "mamba2" / "config.json").read_text())
    config["time_step_limit"] = [0.0, 1.0]
    with pytest.raises(UnsupportedConfigError, match="time_step_limit"):
        mamba2(config)


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_bfloat16_follows_float32(name):
    """The 16-bit path (conv in bfloat16, the scan in float32 from bfloat16 inputs) stays near the float32 logits."""
    ids = np.random.default_rng(4).integers(3, 48, (2, 9)).astype(np.int32)
    folder = FIXTURE.parent / name
    full = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")(ids).logits.numpy()
    half = AutoModelForCausalLM.from_pretrained(folder, dtype="bfloat16")(ids).logits.float().numpy()
    assert np.abs(half - full).max() <= 0.05 * np.abs(full).max()
    assert (half.argmax(-1) == full.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_generate_replays_the_recorded_decode_step(name):
    """Decode steps run the Python forward twice (recorded, confirmed), then replay in place-updated states, chained
    on the GPU (tests/conftest.py chains 8 steps); the tokens stay transformers' (the fixture's greedy tokens), and a
    second call replays from its first step."""
    folder = FIXTURE.parent / name
    reference = read_safetensors(folder / "reference.safetensors")
    want = reference["greedy_tokens"].as_float().astype(np.int64)
    prompt = reference["input_ids"].as_float().astype(np.int32)[:1]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    forwards, original = [], model.forward
    model.forward = lambda *a, **k: forwards.append(1) or original(*a, **k)
    new = want.shape[1] - prompt.shape[1]
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=new), want)
    assert len(forwards) == 3  # prefill and two decode steps; the rest replayed
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=new), want)
    assert len(forwards) == 4  # the prefill only


def test_mamba2_decode_step_copies_only_what_it_must(monkeypatch):
    """A decode step is short of GPU work, so its copies are dispatches that count. In float32 each layer's only
    strided copies are the conv history's update (the concatenation, two, and its write to the cache), the scan
    state's write and D given to its channels: dt and A come from ops that read their heads broadcast, and x, B and
    C are dense views of one row's xBC."""
    monkeypatch.setattr(generation, "CHAIN_STEPS", 1)
    model = AutoModelForCausalLM.from_pretrained(FIXTURE.parent / "mamba2", dtype="float32")
    prompt = np.array([[5, 9, 11, 3]], np.int32)

    def copies(new):
        lazy.clear_plan_cache()
        model.forget_captures()
        with no_grad(), lazy.profile() as prof:
            model.generate(prompt, max_new_tokens=new, eos_token_id=[])
        return sum(n for name, (_, n) in prof.kernels.items() if name.startswith("copy_strided"))

    steps = 3
    per_step = (copies(2 + steps) - copies(2)) / steps
    assert per_step == 5 * len(model.backbone.layers)


def test_lora_adapters_train_on_the_mixer_projections():
    model = AutoModelForCausalLM.from_pretrained(FIXTURE.parent / "mamba2", dtype="float32")
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj", "out_proj"]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    before = model.backbone.layers[0].mixer.in_proj.weight.numpy().copy()
    config = TrainingConfig(steps=4, batch_size=4, seq_len=12, lr=1e-2, schedule="constant", seed=3)
    losses = [r["loss"] for r in Trainer(model, config, Batches(_data(), 4, seed=1)).train()]
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(model.backbone.layers[0].mixer.in_proj.weight.numpy(), before)
