"""Gradient checkpointing (engine/checkpoint.py, Module.gradient_checkpointing_enable): the same loss and
bit-identical gradients as without it (dense and MoE decoders, LoRA with dropout, an encoder with dropout), a
training step that is still one replayed submission, and less peak buffer memory for a model of several layers."""
import json
from pathlib import Path

import numpy as np
import pytest

from vkformers.engine import lazy
from vkformers.engine.checkpoint import Checkpoint
from vkformers.engine.ops import nn as nn_ops
from vkformers.models.loading import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM
from vkformers.models.module import GradientCheckpointingError
from vkformers.runtime import vulkan
from vkformers.training import Batches, LoraConfig, Trainer, TrainingConfig, apply_lora, init_weights
from vkformers.training.data import PackedDataset

FIXTURES = Path(__file__).parent / "fixtures"


def gradients(model, checkpointing, **inputs):
    """Loss and every gradient of one forward and backward in training mode (the dropout generator seeded)."""
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    else:
        model.gradient_checkpointing_disable()
    nn_ops.manual_seed(5)
    with lazy.deferred_backward():  # as the trainer: the step's graph realized at once
        out = model(**inputs)
        out.loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    rng_after = nn_ops.dropout_rng_state()
    for p in model.parameters():
        p.grad = None
    return out.loss.item(), grads, rng_after


def assert_identical(model, monkeypatch, **inputs):
    loss, grads, rng = gradients(model, False, **inputs)
    recomputed = []
    backward = Checkpoint.backward
    monkeypatch.setattr(Checkpoint, "backward", lambda self, *g: recomputed.append(1) or backward(self, *g))
    loss_ckpt, grads_ckpt, rng_ckpt = gradients(model, True, **inputs)
    assert len(recomputed) == model.config["num_hidden_layers"]  # each layer recomputed once
    assert loss_ckpt == loss
    assert grads and sorted(grads_ckpt) == sorted(grads)
    for name, g in grads.items():
        np.testing.assert_array_equal(grads_ckpt[name], g, err_msg=name)
    assert rng_ckpt == rng  # the recomputation reused the dropout seeds, drawing none


def batch(vocab, shape=(2, 12), seed=0):
    return np.random.default_rng(seed).integers(3, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2_moe"])
def test_decoder_gradients_are_bit_identical(name, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")
    ids = batch(model.config["vocab_size"])
    assert_identical(model, monkeypatch, input_ids=ids, labels=ids)


def test_lora_with_dropout_gradients_are_bit_identical(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32")
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["q_proj", "v_proj", "down_proj"]))
    rng = np.random.default_rng(1)
    for _, p in model.named_parameters():  # non-zero lora_B, so every adapter gets a gradient through the layers
        if p.requires_grad:
            p.lazy.base.buffer.write((rng.standard_normal(p.shape) * 0.1).astype(np.float32))
    ids = batch(model.config["vocab_size"])
    assert_identical(model, monkeypatch, input_ids=ids, labels=ids)


def test_encoder_with_dropout_gradients_are_bit_identical(monkeypatch):
    config = json.loads((FIXTURES / "encoders" / "bert" / "config.json").read_text())
    config.update(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = AutoModelForMaskedLM.from_config(config)
    init_weights(model, seed=0)
    ids = batch(config["vocab_size"])
    labels = np.where(np.arange(12) % 3 == 0, ids, -100).astype(np.int32)
    assert_identical(model, monkeypatch, input_ids=ids, labels=labels)


def step_peak_bytes(model, ids, checkpointing) -> int:
    """Peak bytes of live device buffers over one forward + backward (recorded afresh), above what was live."""
    model.train()
    model.gradient_checkpointing_enable() if checkpointing else model.gradient_checkpointing_disable()
    lazy.clear_plan_cache()
    vulkan.reset_peak_buffer_memory()
    live = vulkan.buffer_memory()["live_bytes"]
    with lazy.deferred_backward():
        out = model(ids, labels=ids)
        out.loss.backward()
    lazy.realize([out.loss.lazy] + [p.grad.lazy for p in model.parameters()])
    peak = vulkan.buffer_memory()["peak_bytes"] - live
    for p in model.parameters():
        p.grad = None
    return peak


def test_checkpointing_lowers_the_step_peak_memory():
    config = json.loads((FIXTURES / "llama" / "config.json").read_text())
    config.update(num_hidden_layers=6, hidden_size=64, intermediate_size=128, head_dim=16)
    model = AutoModelForCausalLM.from_config(config)
    init_weights(model, seed=0)
    ids = batch(config["vocab_size"], (4, 64))
    plain, checkpointed = step_peak_bytes(model, ids, False), step_peak_bytes(model, ids, True)
    # six layers' activations against one layer's plus the six layer inputs (parameters and gradients in both)
    assert checkpointed < 0.6 * plain, (checkpointed, plain)


def test_training_steps_replay_with_the_same_losses(tmp_path):
    tokens = np.random.default_rng(0).integers(3, 48, 4000).astype(np.int32)
    histories = []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32")
        apply_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "up_proj"]))
        config = TrainingConfig(steps=5, batch_size=2, seq_len=16, lr=1e-2, schedule="constant", seed=1,
                                gradient_checkpointing=checkpointing)
        trainer = Trainer(model, config, Batches(PackedDataset(tokens, tokens.copy(), 16), 2, seed=1))
        assert model.is_gradient_checkpointing == checkpointing
        recorded = None
        losses = []
        for step in range(5):
            losses.append(trainer.train_step(trainer._next_micro_batches()).loss)
            if step == 1:
                recorded, replayed = lazy.stats["recorded"], lazy.stats["replayed"]
        assert lazy.stats["recorded"] == recorded and lazy.stats["replayed"] >= replayed + 3  # steps 3-5 replayed
        histories.append(losses)
    assert histories[0] == histories[1]


def test_models_without_it_say_so():
    model = AutoModelForSeq2SeqLM.from_pretrained(FIXTURES / "seq2seq" / "t5", dtype="float32")
    with pytest.raises(GradientCheckpointingError, match="does not support gradient checkpointing"):
        model.gradient_checkpointing_enable()


def test_a_block_reading_a_computed_tensor_stops_its_backward_there():
    """The recomputation's backward hands the gradient of an outside result to the outer graph (not through it)."""
    import vkformers as vkf
    from vkformers.engine.checkpoint import checkpoint
    rng = np.random.default_rng(0)
    w = vkf.parameter(rng.standard_normal((4, 4)).astype(np.float32))
    x0 = vkf.tensor(rng.standard_normal((3, 4)).astype(np.float32), requires_grad=True)
    expected = None
    for checkpointing in (False, True):
        shared = (w * 2.0).tanh()  # computed before the block, read inside it
        block = (lambda h: (h @ shared).sin() + h)
        y = checkpoint(block, x0 * 1.5) if checkpointing else block(x0 * 1.5)
        y.sum().backward()
        got = (w.grad.numpy(), x0.grad.numpy())
        w.grad = x0.grad = None
        if expected is None:
            expected = got
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
