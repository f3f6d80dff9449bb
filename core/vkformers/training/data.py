"""Training data: read text, JSONL, Parquet or a hub dataset, tokenize, pack into sequences, batch by seed.

The pipeline, in order:

1. ``read_records(path, ...)`` yields :class:`Record`s (``text``, optionally a ``prompt``) from a
   plain-text file (one document per file), JSONL (``text_column``, or ``prompt_column`` +
   ``completion_column``) or Parquet (same columns; needs ``pyarrow``: ``pip install vkformers[parquet]``).
   Conversations, as TRL's SFT reads them: rows with a "messages" column (a list of {"role", "content"}) and no
   text column are chat records, rendered with the tokenizer's chat template.
   Bad data raises :class:`DataError` naming the file and line: an empty file, a missing column,
   text that is not UTF-8, a line that is not JSON, a message without a role or content.
2. ``tokenize_records`` turns records into one token stream with labels: each document is followed
   by the tokenizer's EOS; prompt tokens get label -100 so only the completion counts in the loss. A
   conversation trains on all its tokens, or with ``assistant_only_loss`` on the assistant turns only (each turn's
   text, from the end of the template's generation prompt before it through the turn's closing tokens).
3. ``PackedDataset`` cuts the stream into sequences of ``seq_len`` tokens (documents run on across
   sequence boundaries, as in GPT-style packing; attention is not masked between documents). Without packing
   (``PackedDataset.one_per_record``, ``vkformers train --no-packing``, TRL's SFT default) each document or
   conversation is a sequence of its own, cut at ``seq_len`` and padded after its end, the padding out of the loss
   (a causal LM's tokens never see the padding after them).
4. ``Batches`` walks the sequences in a per-epoch permutation drawn from ``(seed, epoch)``, every one once an
   epoch as transformers' Trainer does: the last batch, short there, is filled up here with filler rows whose labels
   are all -100 (no loss, no gradient), so every step keeps one shape; with gradient accumulation an epoch ends on
   an optimizer step, its last step's micro-batches after the last sequence all filler. Its position (epoch,
   cursor) is all a checkpoint needs to continue exactly where it stopped.

Tokenizers: anything with ``encode(text) -> list[int]`` and ``eos_token_id``.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from vkformers.errors import VkformersError
from vkformers.models.loading import AutoTokenizer

IGNORE_INDEX = -100
TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


class DataError(VkformersError, ValueError):
    """Training data that cannot be used, with the file (and line) at fault."""


@dataclass
class Record:
    text: str                  # the document, or the completion when ``prompt`` is set
    prompt: str | None = None  # masked out of the loss
    where: str = ""            # "file:line" for error messages
    messages: list | None = None  # a conversation (then ``text`` is unused)


CHAT_COLUMN = "messages"  # the column of conversations, as TRL's SFT names it


# ---------------------------------------------------------------- tokenizers

class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, EOS = 256 (vocab 257). For tests and for models trained from scratch."""

    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def load_tokenizer(name_or_path):
    """``"byte"`` -> :class:`ByteTokenizer`; otherwise the tokenizer of a model folder or hub repo."""
    if str(name_or_path) == "byte":
        return ByteTokenizer()
    return AutoTokenizer.from_pretrained(name_or_path)


# ---------------------------------------------------------------- reading

def data_files(paths: Sequence) -> list[Path]:
    """Files to read: each file as given, each folder's data files (recursively, sorted)."""
    files = []
    for p in paths:
        p = Path(os.path.expanduser(str(p)))
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in DATA_SUFFIXES)
            if not found:
                raise DataError(f"{p}: no data files ({', '.join(DATA_SUFFIXES)}) in this folder")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"{p}: no such file or folder")
    return files


def read_records(path, *, text_column: str | None = None, prompt_column: str | None = None,
                 completion_column: str | None = None) -> Iterator[Record]:
    """Records of one file, chosen by its suffix (anything not JSONL or Parquet is read as plain text)."""
    path = Path(path)
    if (prompt_column is None) != (completion_column is None):
        raise DataError("prompt and completion columns go together: give both or neither")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        yield from _read_jsonl(path, text_column, prompt_column, completion_column)
    elif suffix in PARQUET_SUFFIXES:
        yield from _read_parquet(path, text_column, prompt_column, completion_column)
    else:
        yield Record(_read_text(path), None, f"{path}")


def _decode(raw: bytes, path: Path, first_line: int = 1) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + raw[:exc.start].count(b"\n")
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {column}); "
                        "convert the file to UTF-8") from None


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    text = _decode(raw, path).removeprefix("\ufeff")  # a UTF-8 byte-order mark
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    return text


def _pick_columns(row: dict, where: str, text_column, prompt_column, completion_column) -> Record:
    if text_column is None and prompt_column is None and CHAT_COLUMN in row and "text" not in row:
        return Record("", None, where, _messages(row[CHAT_COLUMN], where))

    def get(column):
        if column not in row:
            raise DataError(f"{where}: no column {column!r} (columns: {', '.join(map(str, row)) or 'none'})")
        value = row[column]
        if not isinstance(value, str):
            raise DataError(f"{where}: column {column!r} holds {type(value).__name__}, not text")
        return value

    if prompt_column is not None:
        return Record(get(completion_column), get(prompt_column), where)
    return Record(get(text_column or "text"), None, where)


def _messages(value, where: str) -> list[dict]:
    """A conversation's messages, each {"role": str, "content": str}, or a DataError naming the one at fault."""
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: column {CHAT_COLUMN!r} must be a list of messages, got {type(value).__name__}")
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {index} must have a text 'role' and 'content', got {message!r}"[:300])
    return [dict(m) for m in value]


def _read_jsonl(path: Path, text_column, prompt_column, completion_column) -> Iterator[Record]:
    count = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, path, number)
            if number == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark (Windows editors write one)
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
            count += 1
            yield _pick_columns(row, where, text_column, prompt_column, completion_column)
    if count == 0:
        raise DataError(f"{path}: the file is empty (no JSON lines)")


def _read_parquet(path: Path, text_column, prompt_column, completion_column) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq  # the optional [parquet] extra
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install 'vkformers[parquet]')") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = [c for c in (prompt_column, completion_column) if c] or [text_column or "text"]
    names = file.schema_arrow.names
    if text_column is None and prompt_column is None and CHAT_COLUMN in names and "text" not in names:
        columns = [CHAT_COLUMN]
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r} (columns: {', '.join(file.schema_arrow.names)})")
    if file.metadata.num_rows == 0:
        raise DataError(f"{path}: the file is empty (no rows)")
    row_number = 0
    for batch in file.iter_batches(columns=columns):
        for row in batch.to_pylist():
            row_number += 1
            yield _pick_columns(row, f"{path}:row {row_number}", text_column, prompt_column, completion_column)


# ---------------------------------------------------------------- hub datasets

def hf_dataset_files(repo_id: str, split: str = "train", *, revision: str | None = None, cache_dir=None) -> list[Path]:
    """The Parquet/JSONL/text files of one split of a hub dataset, downloaded once into the HF cache.

    Works offline (HF_HUB_OFFLINE=1) from the cache. A file belongs to the split when the split's
    name is a whole component of its path (``data/train-00000-of-00001.parquet``, ``train.jsonl``,
    ``default/train/0000.parquet``).
    """
    from huggingface_hub import constants, snapshot_download  # slow to import: only for a hub name
    suffixes = ("parquet", "jsonl", "txt")
    patterns = [f"*{split}*.{s}" for s in suffixes]
    try:
        folder = Path(snapshot_download(repo_id, repo_type="dataset", revision=revision, cache_dir=cache_dir,
                                        allow_patterns=patterns, local_files_only=bool(constants.HF_HUB_OFFLINE)))
    except Exception as exc:  # huggingface_hub raises many types; all mean "could not get it"
        mode = "offline and not in the cache" if constants.HF_HUB_OFFLINE else "could not be downloaded"
        raise DataError(f"dataset {repo_id!r} (split {split!r}) {mode}: {type(exc).__name__}: {exc}") from None
    token = re.compile(rf"(^|[/_.\-]){re.escape(split)}([/_.\-]|$)")
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lstrip(".") in suffixes
                   and token.search(f.relative_to(folder).as_posix()))
    if not files:
        raise DataError(f"dataset {repo_id!r} has no {'/'.join(suffixes)} files for split {split!r}")
    return files


# ---------------------------------------------------------------- tokenizing and packing

def tokenize_each(records: Iterable[Record], tokenizer,
                  assistant_only_loss: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Each record's tokens (int32) and labels: prompts masked with -100, EOS after every document; conversations
    through the chat template as it renders them, its own end-of-turn tokens ending each, no EOS added (as TRL's
    SFT adds EOS to plain text only; ``assistant_only_loss``: only the assistant turns in the loss)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    for record in records:
        if record.messages is not None:
            ids, kept = chat_tokens(record, tokenizer, assistant_only_loss)
            yield np.asarray(ids, np.int32), np.where(kept, np.asarray(ids, np.int32), IGNORE_INDEX).astype(np.int32)
            continue
        prompt = tokenizer.encode(record.prompt) if record.prompt else []
        body = list(tokenizer.encode(record.text)) + ([eos] if eos is not None else [])
        yield np.asarray(list(prompt) + body, np.int32), np.asarray([IGNORE_INDEX] * len(prompt) + body, np.int32)


def tokenize_records(records: Iterable[Record], tokenizer,
                     assistant_only_loss: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One token stream (int32) and its labels: :func:`tokenize_each`'s, end to end."""
    pairs = list(tokenize_each(records, tokenizer, assistant_only_loss))
    if not pairs:
        raise DataError("no training records")
    return np.concatenate([ids for ids, _ in pairs]), np.concatenate([labels for _, labels in pairs])


def chat_tokens(record: Record, tokenizer, assistant_only_loss: bool) -> tuple[list[int], list[bool]]:
    """A conversation's token ids through the chat template (its special tokens as the template writes them), and
    which of them count in the loss: all, or with ``assistant_only_loss`` those whose text lies in an assistant
    turn (from the end of the conversation before it, rendered with the generation prompt, to the end of the
    conversation through it)."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise DataError(f"{record.where}: a conversation needs a tokenizer with a chat template (--tokenizer)")
    messages = record.messages
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=assistant_only_loss)
    except VkformersError as exc:
        raise DataError(f"{record.where}: {exc}") from None
    ids = [int(t) for t in encoded["input_ids"]]
    if not assistant_only_loss:
        return ids, [True] * len(ids)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True) \
            if index else ""
        through = tokenizer.apply_chat_template(messages[:index + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError(f"{record.where}: the chat template renders the start of this conversation otherwise "
                            "than the whole (it rewrites earlier turns), so its assistant turns cannot be found; "
                            "train without --assistant-only-loss")
        spans.append((len(before), len(through)))
    if not spans:
        raise DataError(f"{record.where}: no assistant message, so --assistant-only-loss leaves nothing to train on")
    kept = [any(start <= begin < end for start, end in spans) for begin, _ in encoded["offset_mapping"]]
    return ids, kept


class PackedDataset:
    """``[n, seq_len]`` input ids and labels cut from one token stream (the tail shorter than seq_len is dropped)."""

    def __init__(self, tokens: np.ndarray, labels: np.ndarray, seq_len: int):
        if seq_len < 2:
            raise DataError(f"seq_len must be at least 2, got {seq_len}")
        n = len(tokens) // seq_len
        ids = tokens[: n * seq_len].reshape(n, seq_len)
        lab = labels[: n * seq_len].reshape(n, seq_len)
        useful = (lab[:, 1:] != IGNORE_INDEX).any(axis=1)  # sequences that are all prompt train nothing
        self.input_ids, self.labels, self.seq_len = ids[useful], lab[useful], seq_len
        self.num_tokens = int(len(tokens))

    @classmethod
    def one_per_record(cls, pairs, seq_len: int, pad_id: int = 0) -> "PackedDataset":
        """A sequence per record (``pairs``: tokens and labels of each, :func:`tokenize_each`), cut at ``seq_len``
        and padded after its end with ``pad_id``, labelled -100 there; records with nothing to train on dropped."""
        if seq_len < 2:
            raise DataError(f"seq_len must be at least 2, got {seq_len}")
        rows = [(ids[:seq_len], labels[:seq_len]) for ids, labels in pairs]
        if not rows:
            raise DataError("no training records")
        ids = np.full((len(rows), seq_len), pad_id, np.int32)
        labels = np.full((len(rows), seq_len), IGNORE_INDEX, np.int32)
        for row, (tokens, marks) in enumerate(rows):
            ids[row, :len(tokens)], labels[row, :len(marks)] = tokens, marks
        out = cls.__new__(cls)
        useful = (labels[:, 1:] != IGNORE_INDEX).any(axis=1)
        out.input_ids, out.labels, out.seq_len = ids[useful], labels[useful], seq_len
        out.num_tokens = int(sum(len(tokens) for tokens, _ in rows))
        return out

    def __len__(self) -> int:
        return len(self.input_ids)

    def split(self, eval_fraction: float) -> tuple["PackedDataset", "PackedDataset | None"]:
        """(train, held-out) with the last ``eval_fraction`` of the sequences held out (at least one)."""
        if eval_fraction <= 0:
            return self, None
        held = max(1, int(round(len(self) * eval_fraction)))
        if held >= len(self):
            raise DataError(f"only {len(self)} sequences of {self.seq_len} tokens: too few to hold out "
                            f"{eval_fraction:.0%} for evaluation")
        return self.subset(slice(0, len(self) - held)), self.subset(slice(len(self) - held, None))

    def subset(self, rows) -> "PackedDataset":
        out = PackedDataset.__new__(PackedDataset)
        out.input_ids, out.labels, out.seq_len = self.input_ids[rows], self.labels[rows], self.seq_len
        out.num_tokens = int(out.input_ids.size)
        return out


def load_dataset(paths: Sequence, tokenizer, seq_len: int, *, text_column=None, prompt_column=None,
                 completion_column=None, assistant_only_loss: bool = False, packing: bool = True) -> PackedDataset:
    """Read, tokenize and pack every file of ``paths`` (files or folders); ``assistant_only_loss``: conversations
    train on their assistant turns only; without ``packing``, a padded sequence per document or conversation."""
    files = data_files(paths)

    def records():
        for file in files:
            yield from read_records(file, text_column=text_column, prompt_column=prompt_column,
                                    completion_column=completion_column)

    if not packing:
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else (getattr(tokenizer, "eos_token_id", None) or 0)
        dataset = PackedDataset.one_per_record(tokenize_each(records(), tokenizer, assistant_only_loss), seq_len, pad)
        if len(dataset) == 0:
            raise DataError(f"{', '.join(map(str, files))}: no document has a token to train on")
        return dataset
    tokens, labels = tokenize_records(records(), tokenizer, assistant_only_loss)
    dataset = PackedDataset(tokens, labels, seq_len)
    if len(dataset) == 0:
        raise DataError(f"{', '.join(map(str, files))}: {len(tokens)} tokens make no full sequence of "
                        f"{seq_len}; lower --seq-len or add data")
    return dataset


# ---------------------------------------------------------------- batching

class Batches:
    """Batches of ``batch_size`` sequences in a seeded per-epoch order; resumable from ``state_dict()``.

    Epoch ``e`` visits every sequence once, in ``default_rng([seed, e]).permutation(n)``, ``batch_size`` at a time,
    as transformers' Trainer does (``dataloader_drop_last=False``). Every batch keeps one shape, so that a recorded
    step replays: the epoch's last batch, short in transformers, is filled up to ``batch_size`` with filler rows,
    copies of sequences from the start of the epoch's order whose labels are all "no target" (-100; NaN for float
    labels), which carry no loss and no gradient. :meth:`next_step` takes the micro-batches of one optimizer step
    and ends each epoch on a step: the micro-batches after the last sequence are all filler, so an epoch is
    ``steps_per_epoch(micro_batches) = ceil(n / (batch_size * micro_batches))`` steps. The order depends only on
    (seed, epoch, cursor).
    """

    def __init__(self, dataset: PackedDataset, batch_size: int, seed: int = 0, shuffle: bool = True):
        if len(dataset) == 0:
            raise DataError("the data makes no sequence to train on; add data or lower --seq-len")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.cursor = epoch, 0
        self._order = self._permutation(epoch)

    def steps_per_epoch(self, micro_batches: int = 1) -> int:
        """Optimizer steps of ``micro_batches`` batches each that one pass over the data takes (the last one
        filled up)."""
        return -(-len(self.dataset) // (self.batch_size * micro_batches))

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_step(1)[0]

    def next_step(self, micro_batches: int) -> list:
        """The ``micro_batches`` batches of one optimizer step; the step that takes an epoch's last sequence ends
        the epoch, its batches past that sequence all filler."""
        if self.cursor >= len(self.dataset):  # a position saved at the end of an epoch
            self._start_epoch(self.epoch + 1)
        batches = []
        for _ in range(micro_batches):
            positions = np.arange(self.cursor, self.cursor + self.batch_size)
            self.cursor += self.batch_size
            batches.append(self._batch(self._order[positions % len(self._order)], positions < len(self._order)))
        if self.cursor >= len(self.dataset):
            self._start_epoch(self.epoch + 1)
        return batches

    def _batch(self, rows: np.ndarray, real: np.ndarray) -> tuple:
        """The batch of the dataset's ``rows``, those not ``real`` (filler) without targets."""
        return self.dataset.input_ids[rows], without_targets(self.dataset.labels[rows], real)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "batch_size": self.batch_size,
                "num_sequences": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_sequences", len(self.dataset)) != len(self.dataset):
            raise DataError(f"the checkpoint was trained on {state['num_sequences']} sequences, this data makes "
                            f"{len(self.dataset)}: resume with the same data, tokenizer and --seq-len")
        self.seed = state["seed"]
        self._start_epoch(state["epoch"])
        self.cursor = state["cursor"]


def without_targets(labels: np.ndarray, real: np.ndarray) -> np.ndarray:
    """``labels`` with the rows not ``real`` set to "no target": -100 for integer labels (tokens, classes, tags,
    answer positions), NaN for float ones (regression, multi-label), which the losses leave out."""
    if real.all():
        return labels
    labels = labels.copy()
    labels[~real] = IGNORE_INDEX if np.issubdtype(labels.dtype, np.integer) else np.nan
    return labels


def fixed_batches(dataset: PackedDataset, batch_size: int, max_batches: int | None = None):
    """The held-out split in order, as batches of at most ``batch_size`` (for evaluation)."""
    n = len(dataset)
    starts = range(0, n, batch_size)
    if max_batches is not None:
        starts = list(starts)[:max_batches]
    return [(dataset.input_ids[s:s + batch_size], dataset.labels[s:s + batch_size]) for s in starts]
