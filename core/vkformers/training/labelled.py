"""Labelled texts for the task heads (``vkformers train --task sequence-classification``): rows of CSV (the
standard library's reader), JSONL or Parquet (pyarrow, the ``parquet`` extra) files, each a text and a label,
tokenized to one padded shape for the whole run, and the metrics of a classifier on the held-out rows.

Labels that are all integers stay class ids; strings become ids in sorted order (``id2label`` keeps the names);
numbers that are not all integers make a regression (one output, mean-squared error).
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from vkformers.training.data import Batches, DataError, data_files

CSV_SUFFIXES, JSONL_SUFFIXES, PARQUET_SUFFIXES = (".csv",), (".jsonl", ".json"), (".parquet",)


def read_rows(path: Path) -> Iterator[tuple[dict, str]]:
    """(row, "file:line") of a CSV, JSONL or Parquet file."""
    suffix = path.suffix.lower()
    if suffix in CSV_SUFFIXES:
        with open(path, newline="", encoding="utf-8-sig") as f:
            for number, row in enumerate(csv.DictReader(f), start=2):
                yield row, f"{path}:{number}"
    elif suffix in JSONL_SUFFIXES:
        with open(path, encoding="utf-8-sig") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{number}: expected a JSON object per line")
                yield row, f"{path}:{number}"
    elif suffix in PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq  # the optional [parquet] extra
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install 'vkformers[parquet]')") from None
        for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield row, f"{path}:row {number}"
    else:
        raise DataError(f"{path}: labelled data must be .csv, .jsonl or .parquet")


@dataclass
class LabelledDataset:
    """Token ids and attention masks [N, L] (one padded length for every row) and one label per row."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray
    id2label: dict            # {"0": name, ...}; {} for a regression
    seq_len: int

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def problem_type(self) -> str:
        return "regression" if not self.id2label else "single_label_classification"

    def subset(self, rows) -> "LabelledDataset":
        return LabelledDataset(self.input_ids[rows], self.attention_mask[rows], self.labels[rows], self.id2label,
                               self.seq_len)

    def split(self, fraction: float, seed: int = 0):
        """(train, held-out) with ``fraction`` of the rows held out in a seeded order; held-out None at 0."""
        count = int(round(len(self) * fraction))
        if count == 0:
            return self, None
        order = np.random.default_rng(seed).permutation(len(self))
        return self.subset(np.sort(order[count:])), self.subset(np.sort(order[:count]))


def _label_table(values: list, where: list[str]):
    """(labels array, id2label) for the label column's values."""
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        count = max(values) + 1
        if min(values) < 0:
            raise DataError(f"{where[values.index(min(values))]}: label {min(values)} is negative")
        return np.asarray(values, np.int64), {str(i): f"LABEL_{i}" for i in range(count)}
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return np.asarray(values, np.float32), {}
    names = sorted({str(v) for v in values})
    if len(names) < 2:
        raise DataError(f"the label column holds one class only ({names[0]!r}); a classifier needs two or more")
    index = {name: i for i, name in enumerate(names)}
    return np.asarray([index[str(v)] for v in values], np.int64), {str(i): n for i, n in enumerate(names)}


def load_labelled(paths: Sequence, tokenizer, seq_len: int, *, text_column: str = "text",
                  label_column: str = "label", label_names: dict | None = None) -> LabelledDataset:
    """Every row's text tokenized (truncated to ``seq_len``, padded to the longest row) with its label.
    ``label_names`` ({"0": name, ...}): the training data's classes, so that held-out files map names alike."""
    texts, values, where = [], [], []
    for path in data_files(paths):
        for row, at in read_rows(path):
            for column in (text_column, label_column):
                if column not in row:
                    raise DataError(f"{at}: no column {column!r} (columns: {', '.join(map(str, row))}); pass "
                                    "--text-column / --label-column")
            if not isinstance(row[text_column], str):
                raise DataError(f"{at}: column {text_column!r} is not a text")
            texts.append(row[text_column])
            # CSV holds strings: its numbers read back as numbers
            values.append(_number(row[label_column]) if path.suffix.lower() in CSV_SUFFIXES else row[label_column])
            where.append(at)
    if not texts:
        raise DataError(f"{', '.join(map(str, paths))}: no rows")
    if label_names:
        index = {name: int(i) for i, name in label_names.items()}
        unknown = [(v, w) for v, w in zip(values, where) if str(v) not in index and v not in range(len(index))]
        if unknown:
            raise DataError(f"{unknown[0][1]}: label {unknown[0][0]!r} is not one of the training data's classes")
        labels = np.asarray([index.get(str(v), v) for v in values], np.int64)
        id2label = dict(label_names)
    else:
        labels, id2label = _label_table(values, where)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    encoded = tokenizer(texts, truncation=True, max_length=seq_len)["input_ids"]
    length = max(len(ids) for ids in encoded)
    ids = np.full((len(encoded), length), pad_id, np.int64)
    mask = np.zeros((len(encoded), length), np.int64)
    for row, tokens in enumerate(encoded):
        ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
    return LabelledDataset(ids, mask, labels, id2label, length)


def _number(value):
    for kind in (int, float):
        try:
            return kind(value)
        except (TypeError, ValueError):
            pass
    return value


class LabelledBatches(Batches):
    """Batches of (input_ids, labels, attention_mask), in the seeded per-epoch order of :class:`Batches`."""

    def __next__(self):
        ids, labels = super().__next__()
        rows = self._order[self.cursor - self.batch_size:self.cursor]
        return ids, labels, self.dataset.attention_mask[rows]


def labelled_batches(dataset: LabelledDataset, batch_size: int, max_batches: int | None = None) -> list:
    """The held-out rows in order, as (input_ids, labels, attention_mask) batches of at most ``batch_size``."""
    starts = list(range(0, len(dataset), batch_size))[:max_batches]
    return [(dataset.input_ids[s:s + batch_size], dataset.labels[s:s + batch_size],
             dataset.attention_mask[s:s + batch_size]) for s in starts]


def classification_metrics(predicted: np.ndarray, labels: np.ndarray, num_labels: int) -> dict:
    """Accuracy and macro F1 (the mean over the classes present in labels or predictions of 2PR / (P + R))."""
    accuracy = float((predicted == labels).mean())
    scores = []
    for c in range(num_labels):
        tp = int(((predicted == c) & (labels == c)).sum())
        fp, fn = int(((predicted == c) & (labels != c)).sum()), int(((predicted != c) & (labels == c)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": accuracy, "f1_macro": float(np.mean(scores)) if scores else 0.0}


def evaluate_classifier(model, batches: list) -> dict:
    """The classifier's metrics over held-out batches (accuracy and macro F1; mean-squared error for a
    regression)."""
    model.eval()
    outputs, labels = [], []
    for ids, batch_labels, mask in batches:
        outputs.append(model(ids, attention_mask=mask).logits.numpy())
        labels.append(batch_labels)
    model.train()
    logits, labels = np.concatenate(outputs), np.concatenate(labels)
    if logits.shape[-1] == 1 and labels.dtype.kind == "f":
        return {"mse": float(((logits[:, 0] - labels) ** 2).mean())}
    return classification_metrics(logits.argmax(-1), labels, logits.shape[-1])


__all__ = ["LabelledBatches", "LabelledDataset", "classification_metrics", "evaluate_classifier", "labelled_batches",
           "load_labelled", "read_rows"]
