"""vkformers train --task sequence-classification: labelled CSV / JSONL rows (string labels: the bundled toy
sentiment dataset, examples/data), a tiny BERT from scratch with the all-MiniLM-L6-v2 tokenizer, full and LoRA
fine-tuning; held-out accuracy and macro F1 printed and in metrics.jsonl; final/ loads back as a classifier with the label names."""
import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from bundled_models import minilm_folder

import vkformers
from vkformers.cli import main
from vkformers.training.labelled import classification_metrics

FILLER = ["the", "a", "movie", "day", "was", "it", "very", "and", "so"]


def model_folder(tmp_path) -> Path:
    source = minilm_folder()
    folder = tmp_path / "tiny-bert"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_metrics():
    metrics = classification_metrics(np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2]), 3)
    assert metrics["accuracy"] == 0.75
    assert metrics["f1_macro"] == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


# the bundled toy dataset (tools/make_toy_sentiment.py): 320 train and 96 held-out short reviews, pos / neg
TOY = Path(__file__).resolve().parent.parent / "examples" / "data"


def write_data(tmp_path, flip=False):
    """The bundled train split as CSV and its held-out split as JSONL (both readers run); ``flip``: labels swapped."""
    def table(name):
        with (TOY / name).open(newline="") as f:
            return list(csv.DictReader(f))

    def label(r):
        return {"pos": "neg", "neg": "pos"}[r["label"]] if flip else r["label"]
    train = tmp_path / f"train{flip:d}.csv"
    train.write_text("sentence,sentiment\n" + "".join(f"{r['text']},{label(r)}\n" for r in table("sentiment_train.csv")))
    held_out = tmp_path / f"eval{flip:d}.jsonl"
    held_out.write_text("".join(json.dumps({"sentence": r["text"], "sentiment": label(r)}) + "\n"
                                for r in table("sentiment_test.csv")))
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
    batch = tok(["the food was great", "overall the service was awful"], padding=True, return_tensors="np")
    predicted = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.numpy().argmax(-1)
    assert [model.config["id2label"][str(i)] for i in predicted] == ["pos", "neg"]
    # LoRA on the trained classifier, taught the opposite labels: the adapters and the head (kept trainable and
    # saved through modules_to_save, as PEFT's SEQ_CLS task does) learn it
    adapter = train(final, write_data(tmp_path, flip=True), tmp_path / "lora", "--lora-rank", "4",
                    "--lora-targets", "query", "value", "--lr", "5e-2", "--steps", "60")
    config = json.loads((adapter / "adapter_config.json").read_text())
    # PEFT's AutoPeftModelForSequenceClassification loads only adapters of its task type
    assert (config["modules_to_save"], config["task_type"]) == (["classifier"], "SEQ_CLS")


def test_data_parallel_classifier_is_refused(tmp_path, capsys):
    train_file, held_out = write_data(tmp_path)
    code = main(["train", "--task", "sequence-classification", "--model", str(model_folder(tmp_path)), "--data",
                 str(train_file), "--text-column", "sentence", "--label-column", "sentiment", "--out",
                 str(tmp_path / "out"), "--data-parallel", "2", "--no-progress"])
    assert code == 1
    assert "--data-parallel trains --task causal-lm only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ---------------------------------------------------------------- token classification (NER)
PEOPLE, PLACES = ["john", "mary", "anna", "peter"], ["paris", "london", "berlin", "tokyo"]


def test_entity_metrics_as_seqeval():
    """seqeval's documented example (f1 0.5), chunks that start at I- or change type, and the tag alignment."""
    from vkformers.training.labelled import align_word_labels, entities, entity_metrics
    gold = [["O", "O", "O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    predicted = [["O", "O", "B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    metrics = entity_metrics(predicted, gold)
    assert (metrics["precision"], metrics["recall"], metrics["f1"]) == (0.5, 0.5, 0.5)
    assert entities(["I-PER", "I-PER", "I-LOC", "B-LOC", "O", "I-PER"]) == {("PER", 0, 1), ("LOC", 2, 2),
                                                                          ("LOC", 3, 3), ("PER", 5, 5)}
    assert align_word_labels([None, 0, 1, 1, 2, None, None], [3, 4, 5]) == [-100, 3, 4, -100, 5, -100, -100]


def tagged_rows(count, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        words, tags = [], []
        for _ in range(rng.integers(3, 7)):
            kind = rng.choice(["O", "O", "PER", "LOC"])
            if kind == "O":
                pair = [(str(rng.choice(FILLER)), "O")]
            elif kind == "PER":  # a name and a word of two sub-tokens: B- then I-
                pair = [(str(rng.choice(PEOPLE)), "B-PER"), ("tokenization", "I-PER")]
            else:
                pair = [(str(rng.choice(PLACES)), "B-LOC")]
            words += [w for w, _ in pair]
            tags += [t for _, t in pair]
        out.append({"words": words, "tags": tags})
    return out


def test_train_token_classifier(tmp_path, capsys):
    model = model_folder(tmp_path)
    train_file, held_out = tmp_path / "train.jsonl", tmp_path / "eval.csv"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in tagged_rows(96, 0)))
    held_out.write_text("words,tags\n" + "".join(f"{' '.join(r['words'])},{' '.join(r['tags'])}\n"
                                               for r in tagged_rows(32, 1)))
    out = tmp_path / "ner"
    args = ["train", "--task", "token-classification", "--model", str(model), "--from-scratch", "--data",
            str(train_file), "--eval-data", str(held_out), "--text-column", "words", "--label-column", "tags",
            "--out", str(out), "--steps", "40", "--batch-size", "16", "--seq-len", "24", "--lr", "1e-2",
            "--schedule", "constant", "--no-progress"]
    assert main(args) == 0
    assert "held-out precision" in capsys.readouterr().out
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["eval_f1"] >= 0.8 and record["eval_accuracy"] >= 0.9, record
    tagger = vkformers.AutoModelForTokenClassification.from_pretrained(out / "final")
    assert tagger.config["id2label"] == {"0": "B-LOC", "1": "B-PER", "2": "I-PER", "3": "O"}
    tok = vkformers.AutoTokenizer.from_pretrained(out / "final")
    words = ["the", "mary", "tokenization", "was", "paris"]
    batch = tok([words], is_split_into_words=True, return_tensors="np")
    best = tagger(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.numpy().argmax(-1)[0]
    first = [i for i, w in enumerate(batch.word_ids(0)) if w is not None and w != batch.word_ids(0)[i - 1]]
    assert [tagger.config["id2label"][str(best[i])] for i in first] == ["O", "B-PER", "I-PER", "O", "B-LOC"]
    # LoRA on the tagger: the adapters train and the token classifier is kept trainable and saved
    lora = tmp_path / "ner-lora"
    assert main(["train", "--task", "token-classification", "--model", str(out / "final"), "--data", str(train_file),
                 "--eval-data", str(held_out), "--text-column", "words", "--label-column", "tags", "--out", str(lora),
                 "--steps", "4", "--batch-size", "16", "--seq-len", "24", "--lora-rank", "4", "--no-progress"]) == 0
    config = json.loads((lora / "final" / "adapter_config.json").read_text())
    assert (config["modules_to_save"], config["task_type"]) == (["classifier"], "TOKEN_CLS")


# ---------------------------------------------------------------- extractive question answering
def squad_rows(count, seed):
    """Contexts of filler words around one name (a few long enough to need several windows); the question asks
    for the name, the answer is it (SQuAD's answers: text and character start)."""
    rng = np.random.default_rng(seed)
    out = []
    for index in range(count):
        words = [str(w) for w in rng.choice(FILLER, rng.integers(3, 24 if index % 8 == 0 else 8))]
        name = str(rng.choice(PEOPLE))
        position = int(rng.integers(0, len(words) + 1))
        context = " ".join(words[:position] + [name] + words[position:])
        start = len(" ".join(words[:position] + [""])) if position else 0
        out.append({"id": str(index), "question": "who was it ?", "context": context,
                    "answers": {"text": [name], "answer_start": [start]}})
    return out


def test_squad_metrics_and_windows():
    from vkformers.training.labelled import squad_scores
    assert squad_scores("The Paris", ["paris"]) == (1.0, 1.0)
    assert squad_scores("in paris france", ["paris"]) == (0.0, 0.5)
    assert squad_scores("", []) == (1.0, 1.0)


def test_train_question_answering(tmp_path, capsys):
    from vkformers.training.labelled import load_question_answering
    model = model_folder(tmp_path)
    rows = squad_rows(96, 0)
    assert all(r["context"][r["answers"]["answer_start"][0]:].startswith(r["answers"]["text"][0]) for r in rows)
    train_file, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in squad_rows(32, 1)))
    tok = vkformers.AutoTokenizer.from_pretrained(model)
    data = load_question_answering([train_file], tok, 16, stride=4)
    assert len(data) > len(rows) and data.seq_len == 16  # long contexts: several windows
    # BERT's segments, passed to the model in training and evaluation: 0 for [CLS] question [SEP], 1 the context
    for r in range(len(data)):
        context = [i for i, span in enumerate(data.offsets[r]) if span is not None]
        assert data.token_type_ids[r, 0] == 0 and (data.token_type_ids[r, context] == 1).all()
    for row in range(len(data)):  # labelled windows point at the name's tokens, the others at CLS
        start, end = data.labels[row]
        example = rows[data.example_of[row]]
        if start:
            span = data.offsets[row]
            assert example["context"][span[start][0]:span[end][1]] == example["answers"]["text"][0]
        else:
            assert example["answers"]["text"][0] not in tok.decode(data.input_ids[row][data.attention_mask[row] > 0])
    out = tmp_path / "qa"
    args = ["train", "--task", "question-answering", "--model", str(model), "--from-scratch", "--data",
            str(train_file), "--eval-data", str(held_out), "--out", str(out), "--steps", "40", "--batch-size", "16",
            "--seq-len", "16", "--doc-stride", "4", "--lr", "1e-2", "--schedule", "constant", "--no-progress"]
    assert main(args) == 0
    assert "held-out exact_match" in capsys.readouterr().out
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert record["eval_exact_match"] >= 80 and record["eval_f1"] >= 80, record
    reader = vkformers.AutoModelForQuestionAnswering.from_pretrained(out / "final")
    assert [n for n, _ in reader.named_parameters() if not n.startswith("bert.")] == ["qa_outputs.weight",
                                                                                   "qa_outputs.bias"]


def test_a_missing_column_is_named(tmp_path, capsys):
    train_file, _ = write_data(tmp_path)
    code = main(["train", "--task", "sequence-classification", "--model", str(model_folder(tmp_path)), "--data",
                 str(train_file), "--text-column", "sentence", "--label-column", "stars", "--out",
                 str(tmp_path / "out"), "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err
    assert "no column 'stars'" in err and "--label-column" in err and "Traceback" not in err


def test_a_regression_label_that_is_not_a_number_is_named(tmp_path):
    """NaN marks a filler row's missing target (training/data.py's Batches), so a data row may not hold one."""
    from vkformers.training.data import DataError
    from vkformers.training.labelled import load_labelled
    data = tmp_path / "scores.csv"
    data.write_text("text,score\nthe food was great,4.5\nawful,nan\n")
    tokenizer = vkformers.AutoTokenizer.from_pretrained(model_folder(tmp_path))
    with pytest.raises(DataError, match=r"scores.csv:3: label nan is not a finite number; give the row a value"):
        load_labelled([data], tokenizer, 16, label_column="score")
    data.write_text("text,score\nthe food was great,4.5\nawful,1.25\n")
    assert load_labelled([data], tokenizer, 16, label_column="score").labels.tolist() == [4.5, 1.25]
