"""The training loop: schedules, clipping, accumulation, one replay per step, mixed precision, evaluation.

``TinyLM`` (a small pre-norm decoder built from vkformers layers) stands in for the llama
plugin's model; test_lora.py and test_checkpoint.py import it from here.
"""
import json
import math

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.models.layers import Embedding, Linear, ModuleList, RMSNorm
from vkformers.models.loading import CausalLMOutput
from vkformers.models.module import Module
from vkformers.training import (Batches, ByteTokenizer, NonFiniteLossError, PackedDataset, Trainer, TrainingConfig,
                                fixed_batches, init_weights, lr_factor, tokenize_records)
from vkformers.training.data import Record

VOCAB, HIDDEN, HEADS = 257, 32, 2


class Block(Module):
    def __init__(self, dropout):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.q_proj, self.k_proj = Linear(HIDDEN, HIDDEN, bias=False), Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj, self.o_proj = Linear(HIDDEN, HIDDEN, bias=False), Linear(HIDDEN, HIDDEN, bias=False)
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.up_proj, self.down_proj = Linear(HIDDEN, 2 * HIDDEN), Linear(2 * HIDDEN, HIDDEN)
        self.p = dropout

    def heads(self, x):
        b, t, _ = x.shape
        return x.reshape(b, t, HEADS, HIDDEN // HEADS).transpose(1, 2)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        att = F.scaled_dot_product_attention(self.heads(self.q_proj(h)), self.heads(self.k_proj(h)),
                                             self.heads(self.v_proj(h)))
        x = x + F.dropout(self.o_proj(att.transpose(1, 2).reshape(b, t, HIDDEN)), self.p, self.training)
        return x + self.down_proj(F.silu(self.up_proj(self.post_attention_layernorm(x))))


class TinyLM(Module):
    """Token + position embeddings, blocks, norm, lm_head; HF loss semantics (shift inside, -100 ignored)."""

    def __init__(self, layers=1, dropout=0.0, max_len=64):
        super().__init__()
        self.embed_tokens, self.embed_positions = Embedding(VOCAB, HIDDEN), Embedding(max_len, HIDDEN)
        self.layers = ModuleList(Block(dropout) for _ in range(layers))
        self.norm, self.lm_head = RMSNorm(HIDDEN), Linear(HIDDEN, VOCAB, bias=False)
        self.config = {"model_type": "tiny", "vocab_size": VOCAB}

    def forward(self, input_ids, labels=None):
        ids = np.asarray(input_ids, np.int32)
        t = ids.shape[1]
        x = self.embed_tokens(vkf.tensor(ids)) + self.embed_positions(vkf.tensor(np.arange(t, dtype=np.int32)))
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            labels = np.asarray(labels, np.int32)
            # declared, so that a captured training step can shift the next batch's labels itself
            loss = F.cross_entropy(logits.float(), vkf.tensor(lazy.derived_input(shift(labels), labels, shift)))
        return CausalLMOutput(logits=logits, loss=loss)


def shift(labels):
    return np.concatenate([labels[:, 1:], np.full((len(labels), 1), -100, np.int32)], 1)


def tiny_model(seed=0, dtype="float32", dropout=0.0):
    model = TinyLM(dropout=dropout)
    init_weights(model, seed=seed, dtype=dtype)
    return model.train()


TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "A stitch in time saves nine. " * 3) * 8


def tiny_data(seq_len=16):
    tokens, labels = tokenize_records([Record(TEXT)], ByteTokenizer())
    return PackedDataset(tokens, labels, seq_len)


def losses(results):
    return [r["loss"] for r in results]


# ---------------------------------------------------------------- schedules

def test_schedules_match_transformers_formulas():
    assert lr_factor(0, schedule="constant", warmup=4, total=10) == 0.0
    assert lr_factor(2, schedule="linear", warmup=4, total=10) == 0.5
    assert lr_factor(4, schedule="linear", warmup=4, total=10) == 1.0
    assert lr_factor(7, schedule="linear", warmup=4, total=10) == pytest.approx(0.5)
    assert lr_factor(10, schedule="linear", warmup=4, total=10) == 0.0
    assert lr_factor(7, schedule="cosine", warmup=4, total=10) == pytest.approx(0.5)
    assert lr_factor(5, schedule="cosine", warmup=4, total=10) == pytest.approx(0.5 * (1 + math.cos(math.pi / 6)))
    assert lr_factor(10, schedule="cosine", warmup=0, total=10, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(50, schedule="constant", warmup=4, total=10) == 1.0
    with pytest.raises(ValueError, match="unknown"):
        lr_factor(0, schedule="exponential")


# ---------------------------------------------------------------- the loop

def test_a_model_whose_loss_does_not_shift_labels_is_refused():
    """TrOCRForCausalLM's loss reads labels[t] for logits[t]; the Trainer's batches assume the shift inside."""
    pytest.importorskip("vkformers_llama")
    from vkformers.models.loading import AutoModelForCausalLM
    from pathlib import Path
    model = AutoModelForCausalLM.from_pretrained(Path(__file__).parent / "fixtures" / "trocr", dtype="float32")
    with pytest.raises(vkf.VkformersError, match="trocr: its loss reads labels"):
        Trainer(model, TrainingConfig(steps=1, batch_size=1, seq_len=8), None)


def test_loss_drops_and_steps_replay_one_recording(tmp_path):
    data = tiny_data()
    train, held = data.split(0.1)
    config = TrainingConfig(steps=8, batch_size=4, seq_len=16, lr=1e-2, schedule="cosine", warmup=2, clip=1.0)
    trainer = Trainer(tiny_model(), config, Batches(train, 4, seed=0), eval_batches=fixed_batches(held, 4),
                      out_dir=tmp_path)
    recorded = []
    original = trainer.train_step

    def counting(batch):
        out = original(batch)
        recorded.append(lazy.stats["recorded"])
        return out
    trainer.train_step = counting
    results = trainer.train()
    assert len(results) == 8
    assert recorded[2:] == [recorded[1]] * 6  # steps 3..8 replay step 2's plan
    assert results[-1]["loss"] < results[0]["loss"] - 1.0
    assert "eval_loss" in results[-1] and math.isfinite(results[-1]["eval_loss"])
    assert all(r["grad_norm"] > 0 for r in results)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 9))
    assert lines[0]["lr"] == 0.0 and lines[1]["lr"] == pytest.approx(5e-3)
    png = (tmp_path / "loss_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and b"IEND" in png


def test_captured_steps_replay_without_building_and_equal_built_steps():
    """From step 3 a step replays its recorded plan without running the model's Python forward; with
    dropout (seeds drawn per step), a cosine schedule and clipping, losses and weights equal those of
    steps built every time, exactly."""
    def run(build_every_step):
        model = tiny_model(dropout=0.1)
        config = TrainingConfig(steps=6, batch_size=4, seq_len=16, lr=1e-2, schedule="cosine", warmup=2, clip=0.5,
                                seed=3)
        trainer = Trainer(model, config, Batches(tiny_data(), 4, seed=1))
        forwards, original = [], model.forward
        model.forward = lambda *a, **k: forwards.append(1) or original(*a, **k)
        if build_every_step:
            run_step = trainer._capture.run
            trainer._capture.run = lambda *a: (trainer._capture.forget(), run_step(*a))[1]
        results = trainer.train()
        steps = [st["step"] for st in trainer.optimizer.state.values()]
        return losses(results), model.lm_head.weight.numpy(), len(forwards), steps

    captured, built = run(False), run(True)
    assert captured[0] == built[0]
    np.testing.assert_array_equal(captured[1], built[1])
    assert (captured[2], built[2]) == (2, 6)
    assert set(captured[3]) == set(built[3]) == {6}  # the optimizer counted every replayed step


def test_a_copied_input_is_never_replayed():
    """A step whose graph takes a copy of a named input (not declared) cannot be replayed: it keeps
    building, so a later batch is never mistaken for a constant."""
    capture, x = lazy.StepCapture(), np.arange(4, dtype=np.float32)
    for _ in range(4):
        value = capture.run(lambda: [vkf.tensor(x.copy()) * 2.0], {"x": x})[0]
        np.testing.assert_array_equal(value, x * 2)
        assert not capture.ready
    values = []
    for i in range(4):  # as it is: replayed from the third call, with the new values; a view reads its span
        y = np.arange(6, dtype=np.float32) + i
        values.append(capture.run(lambda: [(vkf.tensor(y) * 2.0).reshape(2, 3)[:, 1:]], {"y": y})[0])
    assert capture.ready
    for i, v in enumerate(values):
        np.testing.assert_array_equal(v, ((np.arange(6) + i) * 2.0).reshape(2, 3)[:, 1:])


def test_clipping_scales_the_update_by_the_global_norm():
    """With clip c far below the gradient norm, SGD-like first Adam steps are sign-based; check the
    factor directly: the update of a clipped run equals one of an unclipped run on pre-scaled grads."""
    data = tiny_data()
    batch = [next(Batches(data, 4, seed=1))]
    a, b = tiny_model(), tiny_model()
    base = dict(steps=1, batch_size=4, seq_len=16, lr=1e-3, schedule="constant", eps=1e-3)
    ta = Trainer(a, TrainingConfig(clip=0.0, **base), Batches(data, 4))
    tb = Trainer(b, TrainingConfig(clip=0.05, **base), Batches(data, 4))
    ra, rb = ta.train_step(batch), tb.train_step(batch)
    assert ra.grad_norm == pytest.approx(rb.grad_norm, rel=1e-5) and ra.grad_norm > 0.05
    # With eps large the first Adam step is lr * g / (|g| + eps/..): smaller grads move less.
    da = np.abs(a.lm_head.weight.numpy() - tiny_model().lm_head.weight.numpy()).sum()
    db = np.abs(b.lm_head.weight.numpy() - tiny_model().lm_head.weight.numpy()).sum()
    assert db < 0.8 * da


def test_global_norm_matches_numpy_of_the_gradients():
    data = tiny_data()
    batch = [next(Batches(data, 2, seed=3))]
    model = tiny_model()
    loss = model(*batch[0][:1], labels=batch[0][1]).loss
    loss.backward()
    expected = math.sqrt(sum(float((p.grad.numpy().astype(np.float64) ** 2).sum())
                             for p in model.parameters() if p.grad is not None))
    for p in model.parameters():
        p.grad = None
    trainer = Trainer(model, TrainingConfig(steps=1, batch_size=2, seq_len=16, clip=0.0), Batches(data, 2))
    assert trainer.train_step(batch).grad_norm == pytest.approx(expected, rel=1e-4)


def test_gradient_accumulation_equals_the_big_batch():
    data = tiny_data()
    ids, labels = next(Batches(data, 4, seed=2))
    big, small = tiny_model(), tiny_model()
    base = dict(steps=1, seq_len=16, lr=1e-2, schedule="constant", clip=0.0)
    Trainer(big, TrainingConfig(batch_size=4, **base), Batches(data, 4)).train_step([(ids, labels)])
    Trainer(small, TrainingConfig(batch_size=2, grad_accum=2, **base), Batches(data, 2)).train_step(
        [(ids[:2], labels[:2]), (ids[2:], labels[2:])])
    # atol: Adam divides by sqrt(v), so an element whose gradient is near zero amplifies the summation-order
    # difference of two half batches against one batch (up to ~1e-5 here, against an update of lr = 1e-2)
    np.testing.assert_allclose(small.lm_head.weight.numpy(), big.lm_head.weight.numpy(), rtol=1e-4, atol=2e-5)


def test_seed_fixes_data_order_and_dropout():
    def run(seed):
        config = TrainingConfig(steps=3, batch_size=4, seq_len=16, lr=1e-2, seed=seed)
        return losses(Trainer(tiny_model(dropout=0.1), config, Batches(tiny_data(), 4, seed=seed)).train())
    first = run(5)
    assert run(5) == first
    assert run(6) != first


def test_bf16_weights_train_with_float32_masters():
    config = TrainingConfig(steps=6, batch_size=4, seq_len=16, lr=1e-2, precision="bf16", schedule="constant")
    model = tiny_model(dtype="bfloat16")
    trainer = Trainer(model, config, Batches(tiny_data(), 4))
    results = trainer.train()
    assert model.lm_head.weight.dtype is vkf.bfloat16
    assert results[-1]["loss"] < results[0]["loss"]
    master = trainer.optimizer.state[id(model.lm_head.weight)]["master"]
    assert master.dtype is vkf.float32


def test_fp16_dynamic_loss_scaling_skips_overflowing_steps():
    config = TrainingConfig(steps=12, batch_size=4, seq_len=16, lr=1e-2, precision="fp16", schedule="constant",
                            loss_scale=2.0 ** 20, scale_growth_interval=3)
    model = tiny_model(dtype="float16")
    before = model.lm_head.weight.numpy().copy()
    trainer = Trainer(model, config, Batches(tiny_data(), 4))
    first = trainer.train_step([next(trainer.train_batches)])
    assert first.skipped and first.loss_scale == 2.0 ** 20 and trainer.scaler.scale == 2.0 ** 19
    np.testing.assert_array_equal(model.lm_head.weight.numpy(), before)  # the skipped step changed nothing
    state = trainer.optimizer.state[id(model.lm_head.weight)]
    assert state["step"] == 0 and not state["exp_avg"].numpy().any()
    results = trainer.train()
    skipped = [r["skipped"] for r in results]
    assert skipped[0] and not all(skipped) and not skipped[-1]
    scales = [r["loss_scale"] for r in results]
    first_good = skipped.index(False)
    assert scales[:first_good + 1] == [2.0 ** (19 - i) for i in range(first_good + 1)]
    assert not np.array_equal(model.lm_head.weight.numpy(), before)
    assert all(math.isfinite(r["loss"]) for r in results)


def test_non_finite_loss_stops_with_a_clear_message(tmp_path):
    config = TrainingConfig(steps=4, batch_size=4, seq_len=16, lr=1e-2, save_every=1)
    model = tiny_model()
    trainer = Trainer(model, config, Batches(tiny_data(), 4), out_dir=tmp_path)
    trainer.config.steps = 1
    trainer.train()
    good = trainer.last_checkpoint
    trainer.config.steps = 4
    bad = model.lm_head.weight.numpy()
    bad[0, 0] = np.inf
    from vkformers.training.checkpoint import write_into
    write_into(model.lm_head.weight, bad)
    with pytest.raises(NonFiniteLossError, match=f"step 2: .*not finite.*{good.name}"):
        trainer.train()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]
