"""vkformers train --task seq2seq: rows of a source and a target text train an encoder-decoder (a tiny T5 from
scratch with the T5 SentencePiece tokenizer of tests/fixtures/slow_tokenizers), full and LoRA, as transformers'
run_translation example prepares them: the targets tokenized as the target side, their ids the labels (-100 on
padding)."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import vkformers
from vkformers.cli import main
from vkformers.models.lora import load_adapter
from vkformers.training.data import DataError
from vkformers.training.labelled import load_seq2seq

FIXTURES = Path(__file__).parent / "fixtures"
PAIRS = [("copy: hello world", "hello world"), ("copy: the quick fox", "the quick fox"),
         ("copy: GPUs run shaders", "GPUs run shaders"), ("copy: tokens and text", "tokens and text"),
         ("copy: the lazy dog", "the lazy dog"), ("copy: hello tokens", "hello tokens"),
         ("copy: compute is portable", "compute is portable"), ("copy: we'll see", "we'll see")]


def t5_folder(tmp_path) -> Path:
    """A tiny T5's config (tests/fixtures/seq2seq/t5) with the slow T5 tokenizer's vocabulary."""
    folder = tmp_path / "tiny-t5"
    folder.mkdir()
    shutil.copy(FIXTURES / "slow_tokenizers" / "t5" / "spiece.model", folder / "spiece.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer"}))
    config = json.loads((FIXTURES / "seq2seq" / "t5" / "config.json").read_text())
    tok = vkformers.AutoTokenizer.from_pretrained(folder)
    config.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  decoder_start_token_id=tok.pad_token_id, d_model=64, d_ff=128, d_kv=16)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_pairs(path: Path, pairs, nested: bool = False) -> Path:
    rows = [{"translation": {"en": s, "xx": t}} if nested else {"source": s, "target": t} for s, t in pairs]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_pairs_are_tokenized_as_the_target_side_with_labels_padded_by_minus_100(tmp_path):
    folder = t5_folder(tmp_path)
    tok = vkformers.AutoTokenizer.from_pretrained(folder)
    data = write_pairs(tmp_path / "pairs.jsonl", PAIRS[:3], nested=True)
    dataset = load_seq2seq([data], tok, 12, 4, text_column="translation.en", label_column="translation.xx")
    sources, targets = [s for s, _ in PAIRS[:3]], [t for _, t in PAIRS[:3]]
    want = tok(sources, text_target=targets, truncation=True, max_length=12, max_target_length=4)
    for row in range(3):
        ids, labels = want["input_ids"][row], want["labels"][row]
        assert dataset.input_ids[row].tolist() == ids + [tok.pad_token_id] * (dataset.seq_len - len(ids))
        assert dataset.attention_mask[row].tolist() == [1] * len(ids) + [0] * (dataset.seq_len - len(ids))
        assert dataset.labels[row].tolist() == labels + [-100] * (dataset.labels.shape[1] - len(labels))
        assert len(labels) <= 4 and labels[-1] == tok.eos_token_id
    with pytest.raises(DataError, match=r"no column 'translation.de' \(at 'de': en, xx\)"):
        load_seq2seq([data], tok, 12, 4, text_column="translation.de")


def test_train_seq2seq_full_then_lora(tmp_path, capsys):
    """A copy task: the loss falls, final/ loads as a seq2seq model that copies a training source's text (in Python
    and through vkformers generate), and LoRA adapters are written with PEFT's SEQ_2_SEQ_LM task type."""
    folder = t5_folder(tmp_path)
    data = write_pairs(tmp_path / "train.jsonl", PAIRS)
    common = ["--task", "seq2seq", "--data", str(data), "--eval-data", str(data), "--batch-size", "8",
              "--seq-len", "16", "--target-len", "12", "--no-progress", "--schedule", "constant"]
    assert main(["train", "--model", str(folder), "--from-scratch", "--out", str(tmp_path / "full"), "--steps", "60",
                 "--lr", "1e-2", *common]) == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses[-1] < 0.1 * losses[0]
    final = tmp_path / "full" / "final"
    model = vkformers.AutoModelForSeq2SeqLM.from_pretrained(final, dtype="float32")
    tok = vkformers.AutoTokenizer.from_pretrained(final)
    batch = tok([PAIRS[0][0]], return_tensors="np")
    out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=8,
                         do_sample=False)
    assert tok.decode(np.asarray(out)[0], skip_special_tokens=True) == PAIRS[0][1]
    capsys.readouterr()
    assert main(["generate", "--model", str(final), "--prompt", PAIRS[1][0], "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == PAIRS[1][1] + "\n"  # the encoder-decoder run on the prompt as its source
    assert main(["train", "--model", str(final), "--out", str(tmp_path / "lora"), "--steps", "2", "--lr", "1e-2",
                 "--lora-rank", "2", "--lora-targets", "q", "v", *common]) == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "lora" / "final" / "adapter_config.json").read_text())
    assert (config["task_type"], config["modules_to_save"]) == ("SEQ_2_SEQ_LM", None)
    # merge-lora reads the task type: the merged seq2seq model gives the adapted model's logits
    assert main(["merge-lora", "--model", str(final), "--adapter", str(tmp_path / "lora" / "final"), "--out",
                 str(tmp_path / "merged"), "--dtype", "float32"]) == 0, capsys.readouterr().err
    merged = vkformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "merged", dtype="float32")
    adapted = load_adapter(vkformers.AutoModelForSeq2SeqLM.from_pretrained(final, dtype="float32"),
                           tmp_path / "lora" / "final")
    inputs = dict(attention_mask=batch["attention_mask"], decoder_input_ids=np.array([[0, 5, 7]]))
    want = adapted(batch["input_ids"], **inputs).logits.numpy()
    assert np.abs(want - model(batch["input_ids"], **inputs).logits.numpy()).max() > 1e-3 * np.abs(want).max()
    np.testing.assert_allclose(merged(batch["input_ids"], **inputs).logits.numpy(), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())


def test_a_byte_tokenizer_is_refused_for_seq2seq(tmp_path, capsys):
    folder = t5_folder(tmp_path)
    data = write_pairs(tmp_path / "train.jsonl", PAIRS)
    assert main(["train", "--task", "seq2seq", "--model", str(folder), "--from-scratch", "--tokenizer", "byte",
                 "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1", "--no-progress"]) == 1
    assert "drop --tokenizer byte" in capsys.readouterr().err
