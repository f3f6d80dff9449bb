"""Task heads train through the Trainer and AdamW: a tiny BERT sequence classifier and a tiny Llama token
classifier learn toy tasks from padded batches (attention masks passed) well above chance on held-out data."""
from pathlib import Path

import numpy as np
import pytest

import vkformers
from vkformers.models.lora import LoraConfig, apply_lora, save_adapter, trainable_parameters
from vkformers.training.labelled import LabelledBatches, LabelledDataset, QuestionAnsweringDataset
from vkformers.training.trainer import Trainer, TrainingConfig, init_weights

VOCAB, LENGTH, BATCH = 24, 8, 16
KEY = 7  # sequence task: does the text hold this token?
BERT = {"model_type": "bert", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 16, "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0}
LLAMA = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 16, "pad_token_id": 0}


class Batches:
    """An endless stream of padded toy batches (what Trainer reads: next(), state_dict)."""

    def __init__(self, make, seed):
        self.make, self.rng = make, np.random.default_rng(seed)

    def __iter__(self):
        return self

    def __next__(self):
        return self.make(self.rng)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def padded_ids(rng, pad_id):
    ids = rng.integers(3, VOCAB, (BATCH, LENGTH))
    ids[ids == KEY] = KEY + 1
    lengths = rng.integers(3, LENGTH + 1, BATCH)
    mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int64)
    return ids, mask


def sequence_batch(rng):
    ids, mask = padded_ids(rng, 0)
    labels = rng.integers(0, 2, BATCH)
    where = rng.integers(0, LENGTH, BATCH) % mask.sum(1)
    ids[labels == 1, where[labels == 1]] = KEY
    ids[mask == 0] = 0
    return ids, labels, mask


def token_batch(rng):
    ids, mask = padded_ids(rng, 0)
    ids[mask == 0] = 0
    labels = np.where(mask == 1, ids % 3, -100)
    return ids, labels, mask


def train_and_score(model, make, steps, lr):
    init_weights(model, seed=0, std=0.1)
    config = TrainingConfig(steps=steps, batch_size=BATCH, seq_len=LENGTH, lr=lr, schedule="constant")
    Trainer(model, config, Batches(make, 1)).train()
    model.eval()
    ids, labels, mask = make(np.random.default_rng(99))
    logits = model(ids, attention_mask=mask).logits.numpy()
    predicted = logits.argmax(-1)
    keep = labels != -100
    return float((predicted[keep] == labels[keep]).mean())


def test_bert_sequence_classifier_learns():
    model = vkformers.AutoModelForSequenceClassification.from_config(dict(BERT, num_hidden_layers=2))
    assert train_and_score(model, sequence_batch, steps=60, lr=3e-3) >= 0.8


def test_llama_token_classifier_learns():
    model = vkformers.AutoModelForTokenClassification.from_config(dict(LLAMA, num_labels=3))
    assert train_and_score(model, token_batch, steps=40, lr=3e-3) >= 0.8


def test_lora_keeps_the_new_head_trainable_and_saved(tmp_path):
    """PEFT's modules_to_save: the adapters and the classifier train, the rest stays frozen; the saved adapter
    (with the classifier) restores the same logits on a fresh model."""
    fixture = Path(__file__).parent / "fixtures" / "heads" / "bert-sequence"
    model = vkformers.AutoModelForSequenceClassification.from_pretrained(fixture)
    apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], modules_to_save=["classifier"]))
    trainable = {name for name, _ in trainable_parameters(model)}
    assert {"classifier.weight", "classifier.bias"} <= trainable
    assert not any(name.startswith("bert.") and "lora_" not in name for name in trainable)
    config = TrainingConfig(steps=5, batch_size=BATCH, seq_len=LENGTH, lr=1e-2, schedule="constant")
    before = model.state_dict()["classifier.weight"].copy()
    Trainer(model, config, Batches(sequence_batch, 1)).train()
    assert not np.allclose(model.state_dict()["classifier.weight"], before)
    save_adapter(model, tmp_path / "adapter")
    ids, _, mask = sequence_batch(np.random.default_rng(5))
    model.eval()
    expected = model(ids, attention_mask=mask).logits.numpy()
    again = vkformers.AutoModelForSequenceClassification.from_pretrained(fixture, adapter=tmp_path / "adapter")
    np.testing.assert_allclose(again(ids, attention_mask=mask).logits.numpy(), expected, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients():
    fixture = Path(__file__).parent / "fixtures" / "heads" / "llama-sequence"
    ids, mask = np.array([[5, 9, 11, 0], [7, 8, 6, 12]]), np.array([[1, 1, 1, 0], [1, 1, 1, 1]])

    def gradients(checkpointing):
        model = vkformers.AutoModelForSequenceClassification.from_pretrained(fixture)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        model(ids, attention_mask=mask, labels=np.array([0, 2])).loss.backward()
        return {name: param.grad.numpy() for name, param in model.named_parameters()}
    plain, recomputed = gradients(False), gradients(True)
    assert all(np.array_equal(plain[name], recomputed[name]) for name in plain)


def replayed_and_built_losses(monkeypatch, auto, config, make):
    """Six Trainer steps' losses of a fresh head model of ``config``: with the recorded step replayed from the third
    step on (the next batch's ids, mask and labels written in: declared derived inputs), and built anew every step."""
    def losses(replay):
        model = auto.from_config(config)
        init_weights(model, seed=0, std=0.1)
        trainer = Trainer(model, TrainingConfig(steps=6, batch_size=BATCH, seq_len=LENGTH, lr=3e-3,
                                                schedule="constant"), Batches(make, 1))
        if not replay:  # nothing is recorded, so every step is built
            monkeypatch.setattr(type(trainer._capture), "_observe", lambda *args: None)
        history = [record["loss"] for record in trainer.train()]
        assert trainer._capture.ready is replay
        return history
    return losses(True), losses(False)


def test_replayed_classifier_steps_match_built_ones(monkeypatch):
    """A BERT sequence classifier: the replayed steps' losses equal those of steps built anew every time."""
    replayed, built = replayed_and_built_losses(monkeypatch, vkformers.AutoModelForSequenceClassification, BERT,
                                                sequence_batch)
    np.testing.assert_allclose(replayed, built, rtol=1e-6)


def test_replayed_decoder_classifier_steps_match_built_ones(monkeypatch):
    """The same for a Llama sequence classifier: its padding mask and last-token indices are derived anew."""
    replayed, built = replayed_and_built_losses(monkeypatch, vkformers.AutoModelForSequenceClassification, LLAMA,
                                                sequence_batch)
    np.testing.assert_allclose(replayed, built, rtol=1e-6)


def qa_batch(rng):
    """A question-answering batch as the Trainer reads it: ids, [start, end] labels, mask, token types."""
    ids, mask = padded_ids(rng, 0)
    ids[mask == 0] = 0
    types = (np.arange(LENGTH)[None] >= 2).astype(np.int64) * mask
    start = rng.integers(2, 3 + (mask.sum(1) - 3) // 2)
    return ids, np.stack([start, start + 1], 1), mask, types


def test_replayed_question_answering_steps_match_built_ones(monkeypatch):
    """A BERT QA head: start/end labels in one array and the token type ids of text pairs, each derived or read
    anew when the step replays."""
    replayed, built = replayed_and_built_losses(monkeypatch, vkformers.AutoModelForQuestionAnswering, BERT, qa_batch)
    np.testing.assert_allclose(replayed, built, rtol=1e-6)


# ---------------------------------------------------------------- the filler rows of an epoch's last batch

def labelled_rows(task, count=5):
    """``count`` padded rows of a task as LabelledBatches reads them, with the model that trains on them."""
    rng = np.random.default_rng(3)
    ids, mask = padded_ids(rng, 0)
    ids, mask = ids[:count], mask[:count]
    ids[mask == 0] = 0
    auto = vkformers.AutoModelForSequenceClassification
    if task == "single":
        labels, config = rng.integers(0, 3, count), dict(BERT, num_labels=3)
    elif task == "regression":
        labels, config = rng.standard_normal(count).astype(np.float32), dict(BERT, num_labels=1)
    elif task == "multi-label":
        labels = rng.integers(0, 2, (count, 3)).astype(np.float32)
        config = dict(BERT, num_labels=3, problem_type="multi_label_classification")
    elif task == "token":
        labels, config = np.where(mask == 1, ids % 3, -100), dict(LLAMA, num_labels=3)
        auto = vkformers.AutoModelForTokenClassification
    else:
        _, labels, mask, types = qa_batch(rng)
        labels, mask, types = labels[:count], mask[:count], types[:count]
        auto, config = vkformers.AutoModelForQuestionAnswering, BERT
        dataset = QuestionAnsweringDataset(ids, mask, labels, {}, LENGTH, np.arange(count), [None] * count,
                                           token_type_ids=types)
    if task != "qa":
        dataset = LabelledDataset(ids, mask, labels, {}, LENGTH)
    model = auto.from_config(config)
    init_weights(model, seed=0, std=0.1)
    return dataset, model.train()


def dataset_parts(dataset):
    """(input_ids, labels, attention_mask[, token_type_ids]) of every row, as LabelledBatches puts them."""
    types = getattr(dataset, "token_type_ids", None)
    return (dataset.input_ids, dataset.labels, dataset.attention_mask) + (() if types is None else (types,))


def batch_loss_and_gradients(model, batch):
    ids, labels, mask, *types = batch
    for param in model.parameters():
        param.grad = None
    loss = model(ids, labels=labels, attention_mask=mask, **dict(zip(["token_type_ids"], types))).loss
    loss.backward()
    return loss.item(), {name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None}


TASKS = ["single", "regression", "multi-label", "token", "qa"]


@pytest.mark.parametrize("task", TASKS)
def test_filler_rows_leave_each_heads_loss_and_gradients_of_the_real_rows(task):
    """5 rows, batch 4: the epoch's second batch is row 4 and 3 filler rows (copies of rows 0-2, their attention
    masks and token types kept) whose labels mean "no target" to the head's loss (-100, NaN for float labels,
    -100 for an answer's positions); its loss and gradients are those of row 4 alone."""
    dataset, model = labelled_rows(task)
    batches = LabelledBatches(dataset, 4, shuffle=False)
    next(batches)
    tail = next(batches)
    assert batches.state_dict()["epoch"] == 1 and batches.state_dict()["cursor"] == 0
    parts = dataset_parts(dataset)
    assert len(tail) == len(parts) == (4 if task == "qa" else 3)
    for index, (got, rows) in enumerate(zip(tail, parts)):
        if index != 1:  # all but the labels: copies of rows 0-2
            np.testing.assert_array_equal(got, rows[[4, 0, 1, 2]])
    filler = tail[1][1:]
    assert (np.isnan(filler) if filler.dtype.kind == "f" else filler == -100).all()
    assert model.loss_target_count(tail[1]) == model.loss_target_count(dataset.labels[4:]) > 0
    loss, grads = batch_loss_and_gradients(model, tail)
    alone, alone_grads = batch_loss_and_gradients(model, [part[4:] for part in parts])
    assert loss == pytest.approx(alone, rel=1e-6)
    assert sorted(grads) == sorted(alone_grads)
    # the floor: 1e-6 of the largest gradient, for those that are zero but for rounding (the attention key's bias)
    floor = 1e-6 * max(np.abs(grad).max() for grad in alone_grads.values())
    for name, grad in alone_grads.items():
        np.testing.assert_allclose(grads[name], grad, rtol=1e-6, atol=floor, err_msg=name)


@pytest.mark.parametrize("task", TASKS)
def test_an_epochs_last_step_with_a_micro_batch_of_filler_alone(task):
    """Batch 2, 2 micro-batches a step: the step that ends the epoch holds row 4 beside a filler row, then a
    micro-batch of filler alone (no targets: it weighs nothing); its loss and gradient norm are those of row 4."""
    dataset, model = labelled_rows(task)
    batches = LabelledBatches(dataset, 2, shuffle=False)
    batches.load_state_dict({**batches.state_dict(), "cursor": 4})
    config = dict(steps=1, seq_len=LENGTH, lr=1e-3, schedule="constant", clip=0.0)
    [record] = Trainer(model, TrainingConfig(batch_size=2, grad_accum=2, **config), batches).train()
    _, reference = labelled_rows(task)
    row = tuple(part[4:] for part in dataset_parts(dataset))
    expected = Trainer(reference, TrainingConfig(batch_size=1, **config), LabelledBatches(dataset, 1)).train_step([row])
    assert record["loss"] == pytest.approx(expected.loss, rel=1e-6)
    assert record["grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-6)


def test_replayed_steps_with_filler_match_built_ones(monkeypatch):
    """A regression head over three epochs of 5 rows in batches of 2: every third step holds a filler row (NaN
    label), and the replayed steps' losses equal those of steps built anew every time."""
    def losses(replay):
        dataset, model = labelled_rows("regression")
        trainer = Trainer(model, TrainingConfig(steps=9, batch_size=2, seq_len=LENGTH, lr=3e-3, schedule="constant"),
                          LabelledBatches(dataset, 2, seed=1))
        if not replay:  # nothing is recorded, so every step is built
            monkeypatch.setattr(type(trainer._capture), "_observe", lambda *args: None)
        history = [record["loss"] for record in trainer.train()]
        assert trainer._capture.ready is replay and trainer.train_batches.state_dict()["epoch"] == 3
        return history
    replayed, built = losses(True), losses(False)
    assert all(np.isfinite(replayed))
    np.testing.assert_allclose(replayed, built, rtol=1e-6)
