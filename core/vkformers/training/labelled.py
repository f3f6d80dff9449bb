"""Labelled texts for the task heads (``vkformers train --task sequence-classification|token-classification``)
and sequence-to-sequence pairs (``--task seq2seq``, :func:`load_seq2seq`):
rows of CSV (the standard library's reader), JSONL or Parquet (pyarrow, the ``parquet`` extra) files, each a text
and a label (or a list of words and one tag per word), tokenized to one padded shape for the whole run, and the
metrics of a classifier on the held-out rows.

Labels that are all integers stay class ids; strings become ids in sorted order (``id2label`` keeps the names);
numbers that are not all integers make a regression (one output, mean-squared error). Word tags are aligned to
tokens as transformers' run_ner example does: each word's first sub-token carries its tag, the other sub-tokens and
the special and pad tokens -100 (no loss); the held-out metrics are seqeval's entity-level precision, recall and F1
(IOB tags: ``B-PER``, ``I-PER``, ``O``) and the accuracy over tagged tokens. Extractive question answering reads
SQuAD rows (question, context, ``answers`` {"text": [...], "answer_start": [...]}) as transformers' run_qa example
does: question and context as a pair, long contexts cut into windows overlapping by ``stride`` tokens, each
window's labels the answer's first and last token (the first token, CLS, where the answer is not inside it); the
held-out metrics are SQuAD's exact match and F1 of the best span per question.
"""
from __future__ import annotations

import csv
import json
import math
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from vkformers.training.data import Batches, DataError, data_files

CSV_SUFFIXES, JSONL_SUFFIXES, PARQUET_SUFFIXES = (".csv",), (".jsonl", ".json"), (".parquet",)
IGNORE_INDEX = -100  # a token without a label (transformers' -100)
PUNCTUATION = frozenset(string.punctuation)


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
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:  # (NaN marks a row without a target: an epoch's filler rows)
            raise DataError(f"{where[bad]}: label {values[bad]!r} is not a finite number; give the row a value or "
                            "leave it out")
        return np.asarray(values, np.float32), {}
    names = sorted({str(v) for v in values})
    if len(names) < 2:
        raise DataError(f"the label column holds one class only ({names[0]!r}); a classifier needs two or more")
    index = {name: i for i, name in enumerate(names)}
    return np.asarray([index[str(v)] for v in values], np.int64), {str(i): n for i, n in enumerate(names)}


def _require_columns(row: dict, at: str, columns, options: str = "--text-column / --label-column") -> None:
    for column in columns:
        if column not in row:
            raise DataError(f"{at}: no column {column!r} (columns: {', '.join(map(str, row))}); pass {options}")


def load_labelled(paths: Sequence, tokenizer, seq_len: int, *, text_column: str = "text",
                  label_column: str = "label", label_names: dict | None = None) -> LabelledDataset:
    """Every row's text tokenized (truncated to ``seq_len``, padded to the longest row) with its label.
    ``label_names`` ({"0": name, ...}): the training data's classes, so that held-out files map names alike."""
    texts, values, where = [], [], []
    for path in data_files(paths):
        for row, at in read_rows(path):
            _require_columns(row, at, (text_column, label_column))
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
    ids, mask = _padded(tokenizer(texts, truncation=True, max_length=seq_len)["input_ids"], pad_id)
    return LabelledDataset(ids, mask, labels, id2label, ids.shape[1])


def nested_column(row: dict, column: str, at: str):
    """``row[column]``; a dotted name reads into nested objects (``translation.en`` of the hub's translation
    datasets, whose rows are {"translation": {"de": ..., "en": ...}})."""
    value = row
    for part in column.split(".") if column not in row else [column]:
        if not isinstance(value, dict) or part not in value:
            keys = ", ".join(map(str, value)) if isinstance(value, dict) else type(value).__name__
            raise DataError(f"{at}: no column {column!r} (at {part!r}: {keys}); pass --text-column / --label-column")
        value = value[part]
    return value


def load_seq2seq(paths: Sequence, tokenizer, seq_len: int, target_len: int, *, text_column: str = "source",
                 label_column: str = "target") -> LabelledDataset:
    """Rows of a source and a target text for a sequence-to-sequence model, as transformers' run_summarization and
    run_translation examples prepare them: ``tokenizer(sources, text_target=targets)`` (each side with its special
    tokens, truncated to ``seq_len`` and ``target_len``), the sources padded to the longest row with their mask, the
    targets' ids the labels, padded with -100 (no loss there)."""
    sources, targets = [], []
    for path in data_files(paths):
        for row, at in read_rows(path):
            for column, texts in ((text_column, sources), (label_column, targets)):
                value = nested_column(row, column, at)
                if not isinstance(value, str):
                    raise DataError(f"{at}: column {column!r} is not a text")
                texts.append(value)
    if not sources:
        raise DataError(f"{', '.join(map(str, paths))}: no rows")
    if not callable(tokenizer):
        raise DataError("a sequence-to-sequence model trains with its own tokenizer: drop --tokenizer byte")
    encoded = tokenizer(sources, text_target=targets, truncation=True, max_length=seq_len,
                        max_target_length=target_len)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    ids, mask = _padded(encoded["input_ids"], pad_id)
    labels, _ = _padded(encoded["labels"], IGNORE_INDEX)
    return LabelledDataset(ids, mask, labels, {}, ids.shape[1])


def _padded(rows: list, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Token rows right-padded with ``pad`` to the longest, and their mask."""
    length = max(len(tokens) for tokens in rows)
    ids, mask = np.full((len(rows), length), pad, np.int64), np.zeros((len(rows), length), np.int64)
    for row, tokens in enumerate(rows):
        ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
    return ids, mask


def _words(value, at: str, what: str) -> list:
    """A list column as a list; a string (CSV) split on whitespace."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise DataError(f"{at}: column {what!r} is a {type(value).__name__}; give a list (JSONL/Parquet) or "
                    "space-separated words (CSV)")


def load_token_labelled(paths: Sequence, tokenizer, seq_len: int, *, text_column: str = "tokens",
                        label_column: str = "ner_tags", label_names: dict | None = None) -> LabelledDataset:
    """Rows of words and one tag per word, tokenized as pre-split words (truncated to ``seq_len``, padded to the
    longest row), the tags on each word's first sub-token and -100 on every other token."""
    words, tags, where = [], [], []
    for path in data_files(paths):
        for row, at in read_rows(path):
            _require_columns(row, at, (text_column, label_column))
            row_words, row_tags = _words(row[text_column], at, text_column), _words(row[label_column], at,
                                                                                  label_column)
            if len(row_words) != len(row_tags):
                raise DataError(f"{at}: {len(row_words)} words but {len(row_tags)} tags; give one tag per word")
            if not row_words:
                continue
            if path.suffix.lower() in CSV_SUFFIXES:
                row_tags = [_number(t) for t in row_tags]
            words.append([str(w) for w in row_words])
            tags.append(row_tags)
            where.append(at)
    if not words:
        raise DataError(f"{', '.join(map(str, paths))}: no rows")
    flat = [t for row in tags for t in row]
    if label_names:
        index = {name: int(i) for i, name in label_names.items()}
        unknown = [t for t in flat if str(t) not in index and t not in range(len(index))]
        if unknown:
            at = where[next(i for i, row in enumerate(tags) if unknown[0] in row)]
            raise DataError(f"{at}: tag {unknown[0]!r} is not one of the training data's tags")
        ids_of = [[index.get(str(t), t) for t in row] for row in tags]
        id2label = dict(label_names)
    else:
        if any(isinstance(t, float) for t in flat):
            raise DataError("token classification needs class tags (names or integer ids), not numbers with "
                            "decimals")
        table, id2label = _label_table(flat, [w for w, row in zip(where, tags) for _ in row])
        ids_of, start = [], 0
        for row in tags:
            ids_of.append(table[start:start + len(row)].tolist())
            start += len(row)
    if getattr(tokenizer, "backend", None) is None:
        raise DataError("token classification tokenizes pre-split words: it needs a tokenizer.json tokenizer, "
                        "not --tokenizer byte")
    encoded = tokenizer(words, is_split_into_words=True, truncation=True, max_length=seq_len)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    length = max(len(ids) for ids in encoded["input_ids"])
    ids = np.full((len(words), length), pad_id, np.int64)
    mask = np.zeros((len(words), length), np.int64)
    labels = np.full((len(words), length), IGNORE_INDEX, np.int64)
    for row, tokens in enumerate(encoded["input_ids"]):
        ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
        labels[row, :len(tokens)] = align_word_labels(encoded.word_ids(row), ids_of[row])
    return LabelledDataset(ids, mask, labels, id2label, length)


def align_word_labels(word_ids: list, word_labels: list) -> list[int]:
    """Token labels from word labels: the word's label on its first sub-token, -100 on the other sub-tokens and
    on special tokens (word id None), as transformers' run_ner example with label_all_tokens=False."""
    labels, previous = [], None
    for word in word_ids:
        labels.append(IGNORE_INDEX if word is None or word == previous else int(word_labels[word]))
        previous = word
    return labels


@dataclass
class QuestionAnsweringDataset(LabelledDataset):
    """Windows of (question, context) pairs; labels [N, 2] the answer's start and end token (0, 0: not inside).
    ``example_of`` names each window's question, ``offsets`` each window's token character spans in the context
    (None outside it); ``contexts`` and ``answers`` (the gold texts) are per question."""

    example_of: np.ndarray = None
    offsets: list = None
    contexts: list = None
    answers: list = None
    token_type_ids: np.ndarray | None = None  # 0 question, 1 context, where the tokenizer gives them (BERT)

    def subset(self, rows) -> "QuestionAnsweringDataset":
        rows = np.asarray(rows)
        return QuestionAnsweringDataset(self.input_ids[rows], self.attention_mask[rows], self.labels[rows],
                                        self.id2label, self.seq_len, self.example_of[rows],
                                        [self.offsets[i] for i in rows], self.contexts, self.answers,
                                        None if self.token_type_ids is None else self.token_type_ids[rows])


def _answers(value, at: str) -> tuple[list, list]:
    """SQuAD's answers field: {"text": [...], "answer_start": [...]} (a list of such dicts also read)."""
    if isinstance(value, dict):
        texts, starts = value.get("text"), value.get("answer_start")
    elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
        texts, starts = [v.get("text") for v in value], [v.get("answer_start") for v in value]
    else:
        texts = starts = None
    if isinstance(texts, str):
        texts, starts = [texts], [starts]
    if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
        raise DataError(f"{at}: answers must be SQuAD's {{\"text\": [...], \"answer_start\": [...]}}")
    return texts, starts


def load_question_answering(paths: Sequence, tokenizer, seq_len: int, *, question_column: str = "question",
                            context_column: str = "context", answers_column: str = "answers",
                            stride: int | None = None) -> QuestionAnsweringDataset:
    """SQuAD-format JSONL or Parquet rows as windows of at most ``seq_len`` tokens (question first, context cut
    with ``stride`` tokens of overlap), padded to the longest window."""
    questions, contexts, answers = [], [], []
    for path in data_files(paths):
        if path.suffix.lower() in CSV_SUFFIXES:
            raise DataError(f"{path}: question answering reads SQuAD-format JSONL or Parquet (answers is a "
                            "structure), not CSV")
        for row, at in read_rows(path):
            _require_columns(row, at, (question_column, context_column, answers_column),
                             "--question-column / --text-column / --label-column")
            texts, starts = _answers(row[answers_column], at)
            for text, start in zip(texts, starts):
                if not isinstance(start, int) or row[context_column][start:start + len(text)] != text:
                    raise DataError(f"{at}: answer {text!r} is not at character {start!r} of the context")
            questions.append(str(row[question_column]).lstrip())  # run_qa: leading spaces waste the window
            contexts.append(str(row[context_column]))
            answers.append((texts, starts))
    if not questions:
        raise DataError(f"{', '.join(map(str, paths))}: no rows")
    if getattr(tokenizer, "backend", None) is None:
        raise DataError("question answering needs a tokenizer.json tokenizer (offsets), not --tokenizer byte")
    stride = seq_len // 4 if stride is None else stride
    encoded = tokenizer(questions, contexts, truncation="only_second", max_length=seq_len, stride=stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows = encoded["input_ids"]
    length = max(len(ids) for ids in rows)
    ids = np.full((len(rows), length), pad_id, np.int64)
    mask = np.zeros((len(rows), length), np.int64)
    labels = np.zeros((len(rows), 2), np.int64)
    types = np.zeros((len(rows), length), np.int64) if "token_type_ids" in encoded else None
    offsets = []
    for row, tokens in enumerate(rows):
        ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
        if types is not None:
            types[row, :len(tokens)] = encoded["token_type_ids"][row]
        in_context = [sequence == 1 for sequence in encoded.sequence_ids(row)]
        spans = [tuple(span) if inside else None for span, inside in zip(encoded["offset_mapping"][row], in_context)]
        offsets.append(spans)
        texts, starts = answers[encoded["overflow_to_sample_mapping"][row]]
        if not texts:
            continue
        first, last = starts[0], starts[0] + len(texts[0])
        inside = [i for i, span in enumerate(spans) if span is not None]
        if not inside or spans[inside[0]][0] > first or spans[inside[-1]][1] < last:
            continue  # the answer is not in this window: (0, 0), the CLS token
        start = next(i for i in inside if spans[i][1] > first)
        end = next(i for i in reversed(inside) if spans[i][0] < last)
        labels[row] = start, end
    return QuestionAnsweringDataset(ids, mask, labels, {}, length,
                                    np.asarray(encoded["overflow_to_sample_mapping"], np.int64), offsets, contexts,
                                    [texts for texts, _ in answers], types)


def _squad_normalize(text: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, words split on whitespace."""
    text = "".join(c for c in text.lower() if c not in PUNCTUATION)
    return [w for w in text.split() if w not in ("a", "an", "the")]


def squad_scores(predicted: str, gold: list[str]) -> tuple[float, float]:
    """(exact match, F1) of one prediction against its gold answers (the best of them), as SQuAD v1.1 scores."""
    if not gold:
        return float(predicted == ""), float(predicted == "")
    exact, best_f1 = 0.0, 0.0
    guess = _squad_normalize(predicted)
    for answer in gold:
        truth = _squad_normalize(answer)
        exact = max(exact, float(guess == truth))
        common = sum(min(guess.count(w), truth.count(w)) for w in set(guess))
        if common:
            precision, recall = common / len(guess), common / len(truth)
            best_f1 = max(best_f1, 2 * precision * recall / (precision + recall))
    return exact, best_f1


def best_span(start_logits, end_logits, offsets: list, n_best: int = 20, max_answer_length: int = 30):
    """(score, first, last) of the best context span of one window (transformers' run_qa post-processing: the
    n_best starts and ends, inside the context, last >= first, at most max_answer_length tokens); None if none."""
    best = None
    starts = np.argsort(start_logits)[::-1][:n_best]
    ends = np.argsort(end_logits)[::-1][:n_best]
    for s in starts:
        for e in ends:
            if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                continue
            if e < s or e - s + 1 > max_answer_length:
                continue
            score = float(start_logits[s] + end_logits[e])
            if best is None or score > best[0]:
                best = (score, int(s), int(e))
    return best


def evaluate_question_answering(model, dataset: QuestionAnsweringDataset, batch_size: int) -> dict:
    """SQuAD exact match and F1 (in %) of each held-out question's best span over its windows."""
    model.eval()
    best = {}
    for first in range(0, len(dataset), batch_size):
        rows = range(first, min(first + batch_size, len(dataset)))
        types = {} if dataset.token_type_ids is None else {"token_type_ids": dataset.token_type_ids[first:rows.stop]}
        out = model(dataset.input_ids[first:rows.stop], attention_mask=dataset.attention_mask[first:rows.stop],
                    **types)
        starts, ends = out.start_logits.numpy(), out.end_logits.numpy()
        for i, row in enumerate(rows):
            span = best_span(starts[i], ends[i], dataset.offsets[row])
            example = int(dataset.example_of[row])
            if span is not None and (example not in best or span[0] > best[example][0]):
                offsets = dataset.offsets[row]
                best[example] = (span[0], dataset.contexts[example][offsets[span[1]][0]:offsets[span[2]][1]])
    model.train()
    examples = sorted(set(dataset.example_of.tolist()))
    scores = [squad_scores(best.get(e, (0, ""))[1], dataset.answers[e]) for e in examples]
    return {"exact_match": 100 * float(np.mean([s[0] for s in scores])),
            "f1": 100 * float(np.mean([s[1] for s in scores]))}


def _number(value):
    for kind in (int, float):
        try:
            return kind(value)
        except (TypeError, ValueError):
            pass
    return value


class LabelledBatches(Batches):
    """Batches of (input_ids, labels, attention_mask[, token_type_ids]), in the seeded per-epoch order of
    :class:`Batches` (token type ids where the dataset has them: text pairs of a BERT-style tokenizer). A filler row
    keeps the attention mask and token type ids of the row it copies; its labels are -100 (class ids, tags, answer
    positions) or NaN (a regression's values), which the heads' losses leave out."""

    def _batch(self, rows, real):
        ids, labels = super()._batch(rows, real)
        types = getattr(self.dataset, "token_type_ids", None)
        return (ids, labels, self.dataset.attention_mask[rows]) + (() if types is None else (types[rows],))


def labelled_batches(dataset: LabelledDataset, batch_size: int, max_batches: int | None = None) -> list:
    """The held-out rows in order, as (input_ids, labels, attention_mask[, token_type_ids]) batches of at most
    ``batch_size``."""
    starts = list(range(0, len(dataset), batch_size))[:max_batches]
    types = getattr(dataset, "token_type_ids", None)
    return [(dataset.input_ids[s:s + batch_size], dataset.labels[s:s + batch_size],
             dataset.attention_mask[s:s + batch_size]) + (() if types is None else (types[s:s + batch_size],))
            for s in starts]


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


def entities(tags: Sequence[str]) -> set:
    """The (type, start, end) chunks of an IOB tag sequence, read as seqeval's default (conlleval) mode does: a
    chunk starts at B-X, at I-X after another type or O, and ends before O, B- or another type. A tag without a
    prefix counts as I- of itself."""
    chunks, start, kind = set(), None, None
    for position, tag in enumerate([*tags, "O"]):
        prefix, _, name = tag.partition("-") if tag[:2] in ("B-", "I-", "E-", "S-") else ("I", "", tag)
        if tag == "O":
            prefix, name = "O", None
        ends = kind is not None and (prefix in ("O", "B", "S") or name != kind)
        if ends:
            chunks.add((kind, start, position - 1))
            kind = None
        if prefix != "O" and (kind is None or prefix in ("B", "S")):
            start, kind = position, name
        if prefix in ("E", "S") and kind is not None:
            chunks.add((kind, start, position))
            kind = None
    return chunks


def entity_metrics(predicted: list, gold: list) -> dict:
    """seqeval's micro-averaged entity precision, recall and F1 over sentences of tag names, and token accuracy."""
    found = correct = expected = 0
    for p, g in zip(predicted, gold):
        p_chunks, g_chunks = entities(p), entities(g)
        found, expected, correct = found + len(p_chunks), expected + len(g_chunks), correct + len(p_chunks & g_chunks)
    precision = correct / found if found else 0.0
    recall = correct / expected if expected else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    tokens = sum(len(g) for g in gold)
    accuracy = sum(a == b for p, g in zip(predicted, gold) for a, b in zip(p, g)) / tokens if tokens else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "accuracy": accuracy}


def evaluate_token_classifier(model, batches: list, id2label: dict) -> dict:
    """Entity-level precision, recall, F1 and token accuracy over the held-out batches' tagged tokens."""
    model.eval()
    predicted, gold = [], []
    for ids, labels, mask in batches:
        best = model(ids, attention_mask=mask).logits.numpy().argmax(-1)
        for row_best, row_labels in zip(best, labels):
            keep = row_labels != IGNORE_INDEX
            predicted.append([id2label[str(i)] for i in row_best[keep]])
            gold.append([id2label[str(i)] for i in row_labels[keep]])
    model.train()
    return entity_metrics(predicted, gold)


__all__ = ["IGNORE_INDEX", "LabelledBatches", "LabelledDataset", "QuestionAnsweringDataset", "align_word_labels",
           "best_span", "classification_metrics", "entities", "entity_metrics", "evaluate_classifier",
           "evaluate_question_answering", "evaluate_token_classifier", "labelled_batches", "load_labelled",
           "load_question_answering", "load_token_labelled", "read_rows", "squad_scores"]
