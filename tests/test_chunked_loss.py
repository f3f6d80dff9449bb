"""The causal LM loss in chunks of tokens (models/lm_loss.py, engine checkpoint_sum): the loss, every gradient and
the logits of the unchunked path on decoder fixtures (a final softcap, tied embeddings, Mamba-2), padded batches,
a chunk boundary inside a row and a shorter tail chunk; AdamW steps of a replayed training step; and a step's plan
whose peak is below the unchunked one's by the logits less one chunk and the lm_head gradient's second buffer.

Tolerances: the loss within 1e-6 relative; a gradient within GRAD_NOISE of its tensor's largest element (float32
sums over the tokens in another order: the lm_head gradient is added up chunk by chunk, and products of fewer rows
may split their sums otherwise; 8e-7 is the most seen here)."""
from pathlib import Path

import numpy as np
import pytest

from vkformers.engine import functional as F
from vkformers.engine import lazy
from vkformers.engine.checkpoint import CheckpointedSum
from vkformers.engine.tensor import Tensor
from vkformers.errors import VkformersError
from vkformers.models import lm_loss
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.optim import AdamW
from vkformers.training import LoraConfig, Trainer, TrainingConfig, apply_lora

FIXTURES = Path(__file__).parent / "fixtures"
GRAD_NOISE = 2e-6
UNCHUNKED = 2**40


def chunk_bytes(rows, vocab):
    """LOSS_CHUNK_BYTES giving chunks of ``rows`` tokens."""
    return rows * vocab * 4


def padded_batch(vocab, shape=(2, 11), seed=0):
    ids = np.random.default_rng(seed).integers(3, vocab, shape).astype(np.int32)
    mask = np.ones(shape, np.int32)
    mask[1, 7:] = 0
    labels = np.where(mask == 1, ids, -100).astype(np.int32)
    return ids, mask, labels


def forward_backward(model, monkeypatch, chunk, ids, mask, labels):
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_BYTES", chunk)
    model.train()
    with lazy.deferred_backward():
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return out.loss.item(), grads, out.logits.numpy()


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2", "mamba2"])  # gemma2: softcap, tied; gpt2: tied
def test_chunked_loss_matches_the_unchunked_loss_and_gradients(name, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")
    vocab = model.config["vocab_size"]
    batch = padded_batch(vocab)
    loss, grads, logits = forward_backward(model, monkeypatch, UNCHUNKED, *batch)
    pieces = []
    backward = CheckpointedSum.backward
    monkeypatch.setattr(CheckpointedSum, "backward",
                        lambda self, g: pieces.append(len(self.seeds)) or backward(self, g))
    # 22 tokens in chunks of 5: boundaries inside rows, a tail chunk of 2, one chunk all padding but a token
    loss_c, grads_c, logits_c = forward_backward(model, monkeypatch, chunk_bytes(5, vocab), *batch)
    assert pieces == [5]
    assert abs(loss_c - loss) <= 1e-6 * abs(loss), (loss_c, loss)
    assert grads and sorted(grads_c) == sorted(grads)
    for n, g in grads.items():
        np.testing.assert_allclose(grads_c[n], g, rtol=0, atol=GRAD_NOISE * np.abs(g).max(), err_msg=n)
    np.testing.assert_array_equal(logits_c, logits)  # computed when read, by the same head


def test_a_chunk_of_ignored_labels_only_adds_nothing(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32")
    vocab = model.config["vocab_size"]
    ids, mask, labels = padded_batch(vocab, shape=(2, 12))
    labels[1, 2:] = -100  # tokens 14..23 have no label: chunks of 4 from 12 on carry one label, then none
    loss, grads, _ = forward_backward(model, monkeypatch, UNCHUNKED, ids, mask, labels)
    loss_c, grads_c, _ = forward_backward(model, monkeypatch, chunk_bytes(4, vocab), ids, mask, labels)
    assert np.isfinite(loss_c) and abs(loss_c - loss) <= 1e-6 * abs(loss)
    for n, g in grads.items():
        np.testing.assert_allclose(grads_c[n], g, rtol=0, atol=GRAD_NOISE * np.abs(g).max(), err_msg=n)


def train(monkeypatch, chunk, batches):
    """AdamW steps of the llama fixture (from the third on, replays of the captured step: the labels, their shift
    and their count come from each new batch)."""
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_BYTES", chunk)
    lazy.clear_plan_cache()
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32")
    trainer = Trainer(model, TrainingConfig(steps=len(batches), batch_size=2, seq_len=11, lr=1e-2,
                                            schedule="constant"), train_batches=None)
    losses = [trainer.train_step([(ids, labels, mask)]).loss for ids, mask, labels in batches]
    return losses, {n: p.numpy() for n, p in model.named_parameters()}


def test_adamw_steps_match(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32")
    batches = [padded_batch(48)] * 2
    _, first, _ = forward_backward(model, monkeypatch, UNCHUNKED, *batches[0])  # the first step's gradients
    losses, weights = train(monkeypatch, UNCHUNKED, batches)
    losses_c, weights_c = train(monkeypatch, chunk_bytes(5, 48), batches)
    np.testing.assert_allclose(losses_c, losses, rtol=1e-6)
    for n, w in weights.items():
        # tests/test_training_parity.py's bound: AdamW divides each step by its gradient's size, so a rounding of
        # GRAD_NOISE moves an element by about lr * GRAD_NOISE * max|g| / |g| (4x: room for the second step's)
        g = np.abs(first[n])
        bound = 1e-5 + 1e-2 * 4 * GRAD_NOISE * g.max() / (g + 1e-8)
        assert (np.abs(weights_c[n] - w) <= bound).all(), n


def test_replayed_steps_count_each_batch_labels(monkeypatch):
    batches = []
    for step in range(4):  # padded differently each step: the count of labels changes
        ids, mask, labels = padded_batch(48, seed=step)
        labels[step % 2, 3 + step:] = -100
        batches.append((ids, mask, labels))
    losses, _ = train(monkeypatch, UNCHUNKED, batches)
    replayed = lazy.stats["replayed"]
    losses_c, _ = train(monkeypatch, chunk_bytes(5, 48), batches)
    assert lazy.stats["replayed"] >= replayed + 2  # steps 3 and 4 replayed the captured step
    np.testing.assert_allclose(losses_c, losses, rtol=1e-6)


# hidden 64, vocab 8192, 2 x 256 tokens: float32 logits of 16 MiB against a 2 MiB lm_head
CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False, hidden_act="silu")
BATCH, SEQ = 2, 256


def step_report(monkeypatch, chunk):
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_BYTES", chunk)
    lazy.clear_plan_cache()
    model = AutoModelForCausalLM.from_config(CONFIG)
    rng = np.random.default_rng(0)
    model.load_state_dict({n: rng.standard_normal(s.shape).astype(np.float32) * 0.05
                           for n, s in model.named_slots() if s.tied_to is None}, dtype="float32")
    trainer = Trainer(model, TrainingConfig(steps=1, batch_size=BATCH, seq_len=SEQ, lr=1e-3, schedule="constant"),
                      train_batches=None)
    ids = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (BATCH, SEQ)).astype(np.int32)
    loss = trainer.train_step([(ids, ids.copy())]).loss
    return loss, lazy.memory_report()


def test_a_chunked_step_plans_one_chunk_of_logits(monkeypatch):
    rows, vocab, hidden = BATCH * SEQ, CONFIG["vocab_size"], CONFIG["hidden_size"]
    logits, weight, chunk = rows * vocab * 4, vocab * hidden * 4, chunk_bytes(32, vocab)
    loss, full = step_report(monkeypatch, UNCHUNKED)
    loss_c, chunked = step_report(monkeypatch, chunk)
    assert abs(loss_c - loss) <= 1e-6 * abs(loss)
    assert full["peak_live"] >= logits  # the whole logits alive at once
    # one chunk's logits alive at a time, and the lm_head gradient summed chunk by chunk (the sum and the chunk's
    # own: one weight-sized buffer more than unchunked); the full logits' lm_head product is not in the plan
    assert chunked["peak_live"] < logits / 2, chunked
    saved = full["peak_live"] - chunked["peak_live"]
    assert saved >= logits - chunk - weight - 2**20, (full, chunked)
    assert not any(shape in ((rows, vocab), (BATCH, SEQ, vocab)) for _, shape, _, _ in chunked["largest_at_peak"])


def test_cross_entropy_sum_and_its_gradient():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    labels = np.array([1, -100, 3, 9, -100, 0], np.int32)
    logits = Tensor(x, requires_grad=True)
    loss = F.cross_entropy(logits, Tensor(labels), reduction="sum")
    loss.backward()
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    keep = labels != -100
    want = (lse - x[np.arange(6), np.where(keep, labels, 0)])[keep].sum()
    assert abs(loss.item() - want) <= 1e-6 * abs(want)
    grad = np.exp(x - lse[:, None])
    grad[np.arange(6), np.where(keep, labels, 0)] -= 1.0
    grad[~keep] = 0.0
    np.testing.assert_allclose(logits.grad.numpy(), grad, rtol=0, atol=1e-6)
    ignored = Tensor(x, requires_grad=True)
    none = F.cross_entropy(ignored, Tensor(np.full(6, -100, np.int32)), reduction="sum")
    none.backward()
    assert none.item() == 0.0 and not ignored.grad.numpy().any()
    with pytest.raises(VkformersError, match="reduction"):
        F.cross_entropy(logits, Tensor(labels), reduction="none")


def test_split_views_and_joins_the_gradients():
    x = Tensor(np.arange(14 * 3, dtype=np.float32).reshape(14, 3), requires_grad=True)
    pieces = F.split(x, 5)
    assert [p.shape for p in pieces] == [(5, 3), (5, 3), (4, 3)]
    np.testing.assert_array_equal(pieces[2].numpy(), x.numpy()[10:])
    (pieces[0] * 2.0 + 0.0).sum().backward()  # the other pieces get no gradient: zeros
    want = np.zeros((14, 3), np.float32)
    want[:5] = 2.0
    np.testing.assert_array_equal(x.grad.numpy(), want)


def test_chunked_loss_with_checkpointed_layers_and_lora(monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32")
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), seed=0)
    model.gradient_checkpointing_enable()
    batch = padded_batch(48)
    loss, grads, _ = forward_backward(model, monkeypatch, UNCHUNKED, *batch)
    loss_c, grads_c, _ = forward_backward(model, monkeypatch, chunk_bytes(5, 48), *batch)
    assert abs(loss_c - loss) <= 1e-6 * abs(loss)
    assert grads and sorted(grads_c) == sorted(grads) and all("lora_" in n for n in grads)  # lm_head frozen
    for n, g in grads.items():
        np.testing.assert_allclose(grads_c[n], g, rtol=0, atol=GRAD_NOISE * np.abs(g).max(), err_msg=n)


def test_held_logits_are_computed_before_an_update_changes_the_weights(monkeypatch):
    """The full logits are not in a chunked step's graph; a tensor holding them across an optimizer step still reads
    the logits of the weights the forward ran with (computed with the update, before it)."""
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_BYTES", chunk_bytes(5, 48))
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama", dtype="float32")
    ids, mask, labels = padded_batch(48)
    before = model(ids, attention_mask=mask).logits.numpy()
    optimizer = AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    optimizer.step()
    lazy.realize([])
    np.testing.assert_array_equal(out.logits.numpy(), before)
    assert np.abs(model(ids, attention_mask=mask).logits.numpy() - before).max() > 1e-3  # the weights did change
