"""The training loop: schedules, clipping, accumulation, one replay per step, mixed precision, evaluation.

``TinyLM`` (a small pre-norm decoder built from vkformers layers) stands in for the llama
plugin's model; test_lora.py and test_checkpoint.py import it from here.
"""
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.models.layers import Embedding, Linear, ModuleList, RMSNorm
from vkformers.models.lm_loss import target_count
from vkformers.models.loading import AutoModelForCausalLM, AutoModelForSeq2SeqLM, CausalLMOutput
from vkformers.models.module import Module
from vkformers.errors import UnsafePathError
from vkformers.models.atomic import atomic_write, write_json_atomic
from vkformers.training import (Batches, ByteTokenizer, NonFiniteLossError, PackedDataset, Trainer, TrainingConfig,
                                fixed_batches, init_weights, lr_factor, tokenize_records)
from vkformers.training.checkpoint import write_into
from vkformers.training.data import Record
from vkformers.training.trainer import TrainingConfigError, VocabularyMismatchError, write_loss_curve

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

    def loss_target_count(self, labels) -> int:  # the labels its loss reads: shifted by one
        return target_count(labels)


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


def test_captures_sharing_a_plan_replay_their_own_constants():
    """Two steps of one graph that differ in a constant input (an offset made inside the step) share the engine's
    plan: each capture replays with the constant it observed, however the other's replays and a plain realization
    of the same graph come between (their constants left in the plan's input buffers); gone, they hold it no more."""
    offsets = [np.full(4, 10.0, np.float32), np.full(4, -3.0, np.float32)]
    captures = [lazy.StepCapture(), lazy.StepCapture()]

    def step(which, x):
        return captures[which].run(lambda: [vkf.tensor(x) + vkf.tensor(offsets[which].copy())], {"x": x})[0]

    rng = np.random.default_rng(0)
    for which in (0, 0, 1, 1):  # each observed twice: both ready
        x = rng.standard_normal(4).astype(np.float32)
        np.testing.assert_array_equal(step(which, x), x + offsets[which])
    assert all(c.ready for c in captures) and captures[0].previous.plan is captures[1].previous.plan
    for which in (0, 1, 1, 0, 0, 1, "plain", 0, "plain", 1):
        x = rng.standard_normal(4).astype(np.float32)
        if which == "plain":
            np.testing.assert_array_equal((vkf.tensor(x) + vkf.tensor(np.ones(4, np.float32))).numpy(), x + 1)
        else:
            np.testing.assert_array_equal(step(which, x), x + offsets[which])
    plan = captures[0].previous.plan
    captures.clear()
    assert len(plan.holders) == 0  # the plan's note of whose inputs it holds keeps no capture alive


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


def small_llama(seed=0):
    from vkformers.models.loading import AutoModelForCausalLM
    config = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(seed)
    model.load_state_dict({n: (np.ones(s.shape, np.float32) if n.endswith("norm.weight")
                               else rng.standard_normal(s.shape).astype(np.float32) * 0.1)
                           for n, s in model.named_slots() if s.tied_to is None})
    return model.train()


def test_gradient_accumulation_weights_micro_batches_by_their_targets():
    """Prompts masked (-100) in one micro-batch and not in the other: the step's loss is the mean over every
    target of the step and its update the one that one batch of all the rows gives, as transformers' Trainer
    counts num_items_in_batch. The mean of the two micro-batches' means would weigh the masked batch's few
    targets as much as the other's many."""
    data = tiny_data()
    ids, labels = next(Batches(data, 4, seed=2))
    labels = labels.copy()
    labels[:2, :12] = -100  # the first micro-batch: 3 targets a row (after the shift), the second 15
    big, small = small_llama(), small_llama()
    base = dict(steps=1, seq_len=16, lr=1e-2, schedule="constant", clip=0.0)
    whole = Trainer(big, TrainingConfig(batch_size=4, **base), Batches(data, 4)).train_step([(ids, labels)])
    split = Trainer(small, TrainingConfig(batch_size=2, grad_accum=2, **base), Batches(data, 2)).train_step(
        [(ids[:2], labels[:2]), (ids[2:], labels[2:])])
    assert split.loss == pytest.approx(whole.loss, rel=1e-6)
    for name, weight in big.named_parameters():
        np.testing.assert_allclose(dict(small.named_parameters())[name].numpy(), weight.numpy(), rtol=1e-4,
                                   atol=2e-5, err_msg=name)
    means = [small_llama()(ids[rows], labels=labels[rows]).loss.item() for rows in (slice(0, 2), slice(2, 4))]
    assert abs(np.mean(means) - whole.loss) > 1e-3 * whole.loss  # what an even split would have reported


def loss_and_gradients(model, ids, labels):
    for param in model.parameters():
        param.grad = None
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.item(), {name: param.grad.numpy() for name, param in model.named_parameters()}


def at_the_epochs_tail(data, batch_size):
    """Batches of ``data`` in order (no shuffle), placed at the last whole batch of the first epoch."""
    batches = Batches(data, batch_size, shuffle=False)
    batches.load_state_dict({**batches.state_dict(), "cursor": len(data) // batch_size * batch_size})
    return batches


def test_filler_rows_leave_the_loss_and_gradients_of_the_real_rows():
    """The epoch's last batch of 4 (111 sequences: 3 left, a filler row whose labels are all -100 after them) gives
    the loss and every gradient of those 3 sequences alone in a batch of 3, as transformers' Trainer takes the short
    last batch (dataloader_drop_last=False)."""
    data = tiny_data()
    assert len(data) % 4 == 3
    ids, labels = next(at_the_epochs_tail(data, 4))
    assert ids.shape == (4, 16) and (labels[3] == -100).all()
    np.testing.assert_array_equal(ids[3], data.input_ids[0])  # a copy of a sequence: attention over real tokens
    model = small_llama()
    loss, grads = loss_and_gradients(model, ids, labels)
    alone, alone_grads = loss_and_gradients(model, data.input_ids[-3:], data.labels[-3:])
    assert loss == pytest.approx(alone, rel=1e-6)
    floor = 1e-6 * max(np.abs(grad).max() for grad in alone_grads.values())  # for gradients zero but for rounding
    for name, grad in alone_grads.items():
        np.testing.assert_allclose(grads[name], grad, rtol=1e-6, atol=floor, err_msg=name)


def test_an_epochs_last_step_weighs_only_its_sequences():
    """Batch 2, 3 micro-batches a step: the step that ends the epoch (111 sequences, 3 left) holds a whole
    micro-batch, one with a filler row and one all filler (loss 0/0: it must weigh nothing, not make the step NaN);
    its loss, gradient norm and update are those of one step on the 3 sequences, and the next step starts the
    next epoch."""
    data = tiny_data()
    batches = at_the_epochs_tail(data, 2)
    batches.load_state_dict({**batches.state_dict(), "cursor": 108})
    base = dict(steps=1, seq_len=16, lr=1e-2, schedule="constant", clip=0.0)
    split, whole = small_llama(), small_llama()
    trainer = Trainer(split, TrainingConfig(batch_size=2, grad_accum=3, **base), batches)
    [record] = trainer.train()
    assert batches.state_dict()["epoch"] == 1 and batches.state_dict()["cursor"] == 0
    reference = Trainer(whole, TrainingConfig(batch_size=3, **base), Batches(data, 3)).train_step(
        [(data.input_ids[-3:], data.labels[-3:])])
    assert record["loss"] == pytest.approx(reference.loss, rel=1e-6)
    assert record["grad_norm"] == pytest.approx(reference.grad_norm, rel=1e-6)
    for name, weight in whole.named_parameters():
        np.testing.assert_allclose(dict(split.named_parameters())[name].numpy(), weight.numpy(), rtol=1e-4,
                                   atol=2e-5, err_msg=name)


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



def test_a_diverged_fp16_run_keeps_its_metrics_and_names_the_last_good_checkpoint(tmp_path):
    """A NaN forward in fp16: the steps are skipped, the scale halves until it underflows and the run stops.
    The checkpoint saved after the skipped step 2 is not called good; the metrics and the curve stay."""
    config = TrainingConfig(steps=1, batch_size=4, seq_len=16, lr=1e-2, precision="fp16", schedule="constant",
                            save_every=1, keep=1, loss_scale=2.0 ** -23)
    model = tiny_model(dtype="float16")
    trainer = Trainer(model, config, Batches(tiny_data(), 4), out_dir=tmp_path)
    trainer.train()
    good = trainer.last_checkpoint
    trainer.config.steps = 6
    broken = model.lm_head.weight.numpy()
    broken[0, 0] = np.inf
    write_into(model.lm_head.weight, broken)
    with pytest.raises(NonFiniteLossError) as stopped:
        trainer.train()
    message = str(stopped.value)
    assert message.startswith("step 3: the fp16 loss scale underflowed")
    assert f"Last good checkpoint: {good} (resume from it, --resume {good}," in message
    assert good.name == "checkpoint-1"  # kept beside the newest (--keep 1): the only one worth resuming
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert f"the metrics of the steps run are in {tmp_path / 'metrics.jsonl'}" in message
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and math.isfinite(metrics[0]["loss"])
    assert math.isnan(metrics[1]["loss"]) and metrics[1]["skipped"]
    assert trainer.loss_curve_file == tmp_path / "loss_curve.png"
    assert trainer.loss_curve_file.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


# ---------------------------------------------------------------- the loss curve

def png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_loss_curve_is_drawn_by_matplotlib_from_finite_points(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra: pip install 'vkformers[plot]'")
    history = [{"step": i, "loss": 5.0 / i} for i in range(1, 31)]
    history[9]["loss"] = math.nan                 # an fp16 step that overflowed
    history[19]["loss"] = math.inf
    history[14]["eval_loss"], history[29]["eval_loss"] = 1.5, math.nan
    assert write_loss_curve(tmp_path / "curve.png", history) is True
    data = (tmp_path / "curve.png").read_bytes()
    assert png_size(data) == (800, 450) and b"Matplotlib" in data  # savefig's Software text chunk
    assert not list(tmp_path.glob("*.tmp"))


def test_without_matplotlib_no_curve_is_written(tmp_path, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    assert write_loss_curve(tmp_path / "curve.png", [{"step": 1, "loss": 1.0}]) is False
    assert not (tmp_path / "curve.png").exists()


# ---------------------------------------------------------------- bad settings and data

@pytest.mark.parametrize("setting, message", [
    (dict(batch_size=0), "batch_size must be a whole number >= 1, got 0"),
    (dict(seq_len=1), "seq_len must be a whole number >= 2, got 1"),
    (dict(grad_accum=0), "grad_accum must be a whole number >= 1, got 0"),
    (dict(lr=-1e-3), "lr must be a finite number > 0, got -0.001"),
    (dict(lr=math.nan), "lr must be a finite number > 0, got nan"),
    (dict(clip=-1.0), "clip must be a finite number >= 0 (0: off), got -1.0"),
    (dict(betas=(0.9, 1.0)), "betas must be two numbers in [0, 1), got (0.9, 1.0)"),
    (dict(precision="int8"), "precision must be one of fp32, bf16, fp16, got 'int8'"),
])
def test_training_settings_out_of_range_are_refused(setting, message):
    with pytest.raises(TrainingConfigError) as error:
        TrainingConfig(**setting)
    assert str(error.value) == message


def test_token_ids_past_the_model_vocabulary_are_refused_before_a_step(tmp_path):
    tokens = np.arange(16 * 8, dtype=np.int32) % 257
    tokens[::7] = 300  # in every batch; the model has 257 ids
    trainer = Trainer(tiny_model(), TrainingConfig(steps=2, batch_size=4, seq_len=16),
                      Batches(PackedDataset(tokens, tokens.copy(), 16), 4), out_dir=tmp_path)
    with pytest.raises(VocabularyMismatchError, match=r"the training data holds token id 300 but the model's "
                                                       r"vocabulary has 257 ids \(0-256\): the tokenizer does not "
                                                       r"belong to this model"):
        trainer.train()
    assert trainer.step == 0


# ---------------------------------------------------------------- files: never through a link

def make_run(out, steps=2):
    return Trainer(tiny_model(), TrainingConfig(steps=steps, batch_size=4, seq_len=16, save_every=steps),
                   Batches(tiny_data(), 4), out_dir=out)


@pytest.mark.parametrize("name", ["metrics.jsonl", "loss_curve.png"])
@pytest.mark.parametrize("target", ["an existing file", "a missing file"])
def test_the_trainer_never_writes_through_a_link_in_its_folder(tmp_path, name, target):
    outside = tmp_path / "elsewhere" / "precious.txt"
    outside.parent.mkdir()
    if target == "an existing file":
        outside.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    (out / name).symlink_to(outside)
    with pytest.raises(UnsafePathError, match=f"run/{name} is a symbolic link; vkformers does not write through "
                                              "links"):
        make_run(out).train()
    assert sorted(p.name for p in outside.parent.iterdir()) == (["precious.txt"] if outside.exists() else [])
    if target == "an existing file":
        assert outside.read_text() == "precious"


def test_metrics_with_another_hard_link_are_not_appended_to(tmp_path):
    outside = tmp_path / "precious.jsonl"
    outside.write_text("precious\n")
    out = tmp_path / "run"
    out.mkdir()
    os.link(outside, out / "metrics.jsonl")
    with pytest.raises(UnsafePathError, match="metrics.jsonl has other hard links"):
        make_run(out).train()
    assert outside.read_text() == "precious\n"


@pytest.mark.parametrize("link", ["checkpoints", "final", "final/config.json", "final/model.safetensors"])
def test_subfolders_and_their_files_are_not_written_through_links(tmp_path, link):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    out = tmp_path / "run"
    (out / link).parent.mkdir(parents=True)
    (out / link).symlink_to(outside if "." not in link else outside / "file")
    trainer = make_run(out)
    with pytest.raises(UnsafePathError, match=f"run/{link} is a symbolic link"):
        trainer.train()
        trainer.save_final()
    assert list(outside.iterdir()) == []


def test_an_atomic_write_neither_follows_its_target_nor_its_temporary_name(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "state.json.tmp").symlink_to(outside)  # a planted temporary name is replaced, not followed
    write_json_atomic(folder / "state.json", {"step": 3})
    assert json.loads((folder / "state.json").read_text()) == {"step": 3} and outside.read_text() == "precious"
    assert sorted(p.name for p in folder.iterdir()) == ["state.json"]
    def full_disk(f):
        f.write("partial")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match=r"No space left on device: '.*state.json'"):
        with atomic_write(folder / "state.json", "w") as f:
            full_disk(f)
    assert json.loads((folder / "state.json").read_text()) == {"step": 3}  # the old file, whole
    assert sorted(p.name for p in folder.iterdir()) == ["state.json"]
    (folder / "link.json").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="link.json is a symbolic link"):
        write_json_atomic(folder / "link.json", {"step": 4})
    assert outside.read_text() == "precious" and (folder / "link.json").is_symlink()


def test_tokenizer_files_are_not_copied_through_a_link(tmp_path):
    from vkformers.cli.train import copy_tokenizer_files
    source = tmp_path / "model"
    source.mkdir()
    (source / "tokenizer.json").write_text("{}")
    (source / "tokenizer_config.json").write_text("{}")
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "tokenizer.json").symlink_to(tmp_path / "created-elsewhere.json")  # dangling: copy2 would create it
    with pytest.raises(UnsafePathError, match="final/tokenizer.json is a symbolic link"):
        copy_tokenizer_files(source, final)
    assert not (tmp_path / "created-elsewhere.json").exists()
    (final / "tokenizer.json").unlink()
    copy_tokenizer_files(source, final)
    assert sorted(p.name for p in final.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


# ---------------------------------------------------------------- vkformers train end to end

@pytest.fixture
def llama_config(tmp_path):
    from test_lora import tiny_llama_folder
    from vkformers.models.loading import AutoModelForCausalLM
    try:
        AutoModelForCausalLM.from_config({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
                                          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})
    except Exception as exc:  # the llama plugin's model is not installed
        pytest.skip(f"no llama causal-LM implementation: {exc}")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 40)
    return tiny_llama_folder(tmp_path / "config"), ["--tokenizer", "byte", "--data", str(corpus), "--batch-size", "2",
                                                    "--seq-len", "16", "--lr", "1e-2", "--no-progress"]


def test_cli_train_refuses_a_tokenizer_larger_than_the_model_up_front(tmp_path, capsys, llama_config):
    from vkformers.cli import main
    folder, common = llama_config
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    assert main(["train", "--model", str(folder), "--from-scratch", "--out", str(tmp_path / "run"), *common]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("vkformers train: error: the training data (tokenized by byte) holds token id ")
    assert "but the model's vocabulary has 100 ids (0-99): the tokenizer does not belong to this model" in err
    assert "training" not in out and not (tmp_path / "run").exists()


def test_cli_train_resumes_past_a_damaged_checkpoint_and_notes_a_missing_plot(tmp_path, capsys, monkeypatch,
                                                                             llama_config):
    from vkformers.cli import main
    folder, common = llama_config
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "run"
    argv = ["train", "--model", str(folder), "--from-scratch", "--out", str(out), "--save-every", "2", *common]
    assert main([*argv, "--steps", "4"]) == 0
    err = capsys.readouterr().err
    assert "vkformers train: note: no loss_curve.png: drawing it needs matplotlib (pip install 'vkformers[plot]'); " \
           "metrics.jsonl has every step" in err
    assert not (out / "loss_curve.png").exists() and (out / "final" / "model.safetensors").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4

    state = out / "checkpoints" / "checkpoint-4" / "trainer_state.json"
    state.write_text(state.read_text()[:40])  # cut short
    assert main([*argv, "--steps", "6", "--resume"]) == 0
    printed, err = capsys.readouterr()
    assert f"vkformers train: skipped {state.parent}: trainer_state.json has 40 bytes, the manifest says " in err
    assert f"resumed from {out / 'checkpoints' / 'checkpoint-2'} at step 2" in printed and "done: step 6" in printed
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_cli_epochs_are_whole_passes_over_the_data(tmp_path, capsys, llama_config):
    """--epochs N: N passes over the 105 training sequences (107 less 2 held out), every one of them, the last
    batch of each filled up; an epoch is ceil(105 / (batch size x grad-accum)) steps, as transformers' Trainer
    counts them, and ends on a step, so the run ends at the start of epoch N."""
    from vkformers.cli import main
    folder, common = llama_config
    common = [arg if arg != "2" else "4" for arg in common]  # --batch-size 4
    for name, flags, steps, epochs in (("one", ["--epochs", "1"], 27, 1),
                                       ("two", ["--epochs", "2", "--grad-accum", "2"], 28, 2)):
        out = tmp_path / name
        assert main(["train", "--model", str(folder), "--from-scratch", "--out", str(out), *common, *flags]) == 0
        assert "on 105 sequences of 16 tokens (2 held out)" in capsys.readouterr().out
        assert len((out / "metrics.jsonl").read_text().splitlines()) == steps
        state = json.loads((out / "checkpoints" / f"checkpoint-{steps}" / "trainer_state.json").read_text())
        assert (state["data_position"]["epoch"], state["data_position"]["cursor"]) == (epochs, 0)


def test_cli_trains_lora_on_conversations_with_the_assistant_turns_only(tmp_path, capsys):
    """`vkformers train` on JSONL conversations (a "messages" column) through the model's chat template, LoRA,
    --assistant-only-loss, a padded sequence per conversation (--no-packing), one pass (--epochs 1): the loss falls
    on the assistant turns."""
    from vkformers.cli import main
    model = Path(__file__).parent / "data" / "pipeline"  # a tiny Llama whose tokenizer has a chat template
    turns = [{"role": "user", "content": "Hello, how are you?"},
             {"role": "assistant", "content": "Paris is the capital."}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": turns}) for _ in range(12)) + "\n")
    argv = ["train", "--model", str(model), "--data", str(tmp_path / "chat.jsonl"), "--out", str(tmp_path / "run"),
            "--assistant-only-loss", "--no-packing", "--lora-rank", "4", "--seq-len", "32", "--batch-size", "2",
            "--epochs", "1",
            "--lr", "0.01", "--eval-fraction", "0.1"]
    assert main(argv) == 0
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]  # one pass: 11 conversations (one held out) 2 at a time
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()
    capsys.readouterr()
    assert main(["train", "--model", str(model), "--data", str(tmp_path / "chat.jsonl"), "--out",
                 str(tmp_path / "cls"), "--task", "sequence-classification", "--assistant-only-loss"]) == 1
    assert "--assistant-only-loss are for causal-lm" in capsys.readouterr().err
    assert main([*argv, "--steps", "3"]) == 1
    assert "--steps and --epochs both given" in capsys.readouterr().err


def test_init_weights_zeroes_padding_rows_and_unit_offset_norms():
    """As transformers' _init_weights: an embedding's padding_idx row starts at zero (through a tied table, BART's
    model.shared), an RMS norm that scales by 1 + weight (Gemma) starts at zero, other norms at one."""
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8, pad_token_id=3)
    gemma = AutoModelForCausalLM.from_config(dict(model_type="gemma", **small))
    init_weights(gemma, seed=0)
    weights = {name: value.numpy() for name, value in gemma.named_parameters()}
    assert not weights["model.embed_tokens.weight"][3].any() and weights["model.embed_tokens.weight"][4].any()
    norms = [name for name in weights if name.endswith("norm.weight")]
    assert len(norms) == 3 and all(not weights[name].any() for name in norms)
    llama = AutoModelForCausalLM.from_config(dict(model_type="llama", **small))
    init_weights(llama, seed=0)
    weights = {name: value.numpy() for name, value in llama.named_parameters()}
    assert not weights["model.embed_tokens.weight"][3].any()
    assert all((weights[name] == 1).all() for name in weights if name.endswith("norm.weight"))
    bart = AutoModelForSeq2SeqLM.from_config(dict(
        model_type="bart", vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=1))
    init_weights(bart, seed=0)
    shared = dict(bart.named_parameters())["model.shared.weight"].numpy()
    assert not shared[1].any() and shared[0].any()
