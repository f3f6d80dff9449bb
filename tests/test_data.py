"""Data pipeline: readers, errors naming file and line, prompt masking, packing, seeded resumable batches."""
import json

import numpy as np
import pytest

from vkformers.training import data as D
from vkformers.training.data import (Batches, ByteTokenizer, DataError, PackedDataset, Record, load_dataset,
                                     read_records, tokenize_records)

TOK = ByteTokenizer()


def write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def test_text_files_are_documents_followed_by_eos(tmp_path):
    write(tmp_path / "a.txt", "abc")
    write(tmp_path / "b.txt", "de")
    ds = load_dataset([tmp_path], TOK, seq_len=3)
    assert ds.num_tokens == 7  # "abc" EOS "de" EOS
    np.testing.assert_array_equal(ds.input_ids, [[97, 98, 99], [256, 100, 101]])
    np.testing.assert_array_equal(ds.labels, ds.input_ids)


def test_jsonl_text_column_and_prompt_masking(tmp_path):
    f = write(tmp_path / "d.jsonl", json.dumps({"body": "hi"}) + "\n\n" + json.dumps({"body": "yo"}) + "\n")
    assert [r.text for r in read_records(f, text_column="body")] == ["hi", "yo"]
    f = write(tmp_path / "p.jsonl", json.dumps({"q": "ab", "a": "c"}) + "\n")
    tokens, labels = tokenize_records(read_records(f, prompt_column="q", completion_column="a"), TOK)
    np.testing.assert_array_equal(tokens, [97, 98, 99, 256])
    np.testing.assert_array_equal(labels, [-100, -100, 99, 256])


def test_a_utf8_byte_order_mark_is_not_part_of_the_data(tmp_path):
    f = write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + json.dumps({"text": "hi"}).encode() + b"\n")
    assert [r.text for r in read_records(f)] == ["hi"]
    f = write(tmp_path / "bom.txt", b"\xef\xbb\xbfab")
    assert [r.text for r in read_records(f)] == ["ab"]


def test_all_prompt_sequences_are_dropped():
    tokens, labels = tokenize_records([Record("x", prompt="p" * 7)], TOK)  # 7 prompt + x + EOS
    ds = PackedDataset(tokens, labels, 3)
    assert len(ds) == 1  # [p p p] and [p p p] have nothing to learn; [p x EOS] stays
    np.testing.assert_array_equal(ds.labels[0], [-100, 120, 256])


@pytest.mark.parametrize("name, content, message", [
    ("empty.txt", "", r"empty\.txt: the file is empty"),
    ("blank.jsonl", "\n\n", r"blank\.jsonl: the file is empty"),
    ("latin.txt", b"ok\nline two caf\xe9\n", r"latin\.txt:2: not UTF-8 text \(byte 0xe9 at column 13\)"),
    ("latin.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', r"latin\.jsonl:2: not UTF-8"),
    ("col.jsonl", '{"text": "a"}\n{"content": "b"}\n', r"col\.jsonl:2: no column 'text' \(columns: content\)"),
    ("bad.jsonl", '{"text": "a"}\n{"text": \n', r"bad\.jsonl:2: not valid JSON"),
    ("num.jsonl", '{"text": 5}\n', r"num\.jsonl:1: column 'text' holds int, not text"),
])
def test_bad_data_names_the_file_and_line(tmp_path, name, content, message):
    f = write(tmp_path / name, content)
    with pytest.raises(DataError, match=message):
        list(read_records(f))


def test_missing_paths_and_too_little_data(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_dataset([tmp_path / "nope.txt"], TOK, 8)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="no data files"):
        load_dataset([tmp_path / "empty_dir"], TOK, 8)
    write(tmp_path / "short.txt", "abc")
    with pytest.raises(DataError, match="no full sequence of 64"):
        load_dataset([tmp_path / "short.txt"], TOK, 64)
    two = load_dataset([tmp_path / "short.txt"], TOK, 2)  # "abc" and EOS: fewer sequences than one batch
    ids, labels = next(Batches(two, 4, shuffle=False))  # both, then filler rows without targets
    np.testing.assert_array_equal(ids, two.input_ids[[0, 1, 0, 1]])
    np.testing.assert_array_equal(labels, np.concatenate([two.labels, np.full((2, 2), -100)]))
    with pytest.raises(DataError, match="no sequence to train on"):
        Batches(two.subset(slice(0, 0)), 4)


def test_batches_follow_the_seed_and_resume_exactly():
    ds = PackedDataset(np.arange(100, dtype=np.int32), np.arange(100, dtype=np.int32), 5)  # 20 sequences
    a = Batches(ds, 3, seed=1)
    first = [next(a)[0][:, 0].tolist() for _ in range(10)]  # runs into the second epoch (7 batches each)
    again = Batches(ds, 3, seed=1)
    assert [next(again)[0][:, 0].tolist() for _ in range(10)] == first
    assert [next(Batches(ds, 3, seed=2))[0][:, 0].tolist()] != first[:1]
    half = Batches(ds, 3, seed=1)
    for _ in range(8):
        next(half)
    state = half.state_dict()
    assert state["epoch"] == 1
    resumed = Batches(ds, 3, seed=99)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [next(resumed)[0][:, 0].tolist() for _ in range(2)] == first[8:10]


def targets_per_sequence(batches, count, n):
    """How often each of ``n`` sequences (told apart by their first token, ``5 * index``) carries its labels in
    ``count`` batches; every other row's labels must be all -100."""
    seen = np.zeros(n, int)
    for ids, labels, *_ in batches[:count]:
        for row_ids, row_labels in zip(ids, labels):
            if (row_labels == -100).all():
                continue
            np.testing.assert_array_equal(row_labels, row_ids)  # a real row keeps its own labels
            seen[row_ids[0] // 5] += 1
    return seen


@pytest.mark.parametrize("batch_size, micro_batches, steps", [(3, 1, 7), (4, 1, 5), (3, 2, 4), (4, 3, 2), (8, 4, 1)])
def test_an_epoch_visits_every_sequence_once_and_ends_on_a_whole_step(batch_size, micro_batches, steps):
    """20 sequences: each epoch takes every one once, as transformers' Trainer does (no batch dropped), in
    ceil(20 / (batch size x micro-batches)) steps; the last batches are filled up with rows that carry only -100."""
    ds = PackedDataset(np.arange(100, dtype=np.int32), np.arange(100, dtype=np.int32), 5)
    batches = Batches(ds, batch_size, seed=4)
    assert batches.steps_per_epoch(micro_batches) == steps
    for epoch in range(2):
        taken = [batches.next_step(micro_batches) for _ in range(steps)]
        assert batches.state_dict()["epoch"] == epoch + 1 and batches.state_dict()["cursor"] == 0
        flat = [b for step in taken for b in step]
        assert all(ids.shape == (batch_size, 5) and labels.shape == (batch_size, 5) for ids, labels in flat)
        assert targets_per_sequence(flat, len(flat), 20).tolist() == [1] * 20
        real_rows = [int((labels != -100).any(1).sum()) for _, labels in flat]
        assert real_rows == sorted(real_rows, reverse=True) and sum(real_rows) == 20  # filler only at the end
        order = [int(ids[0, 0]) // 5 for ids, labels in flat[:1]]
        assert order == [int(np.random.default_rng([4, epoch]).permutation(20)[0])]


def test_resuming_at_an_epochs_tail_is_exact():
    """A position saved after the step that ends an epoch (its filler included) resumes to the same batches."""
    ds = PackedDataset(np.arange(100, dtype=np.int32), np.arange(100, dtype=np.int32), 5)  # 20 sequences
    reference = Batches(ds, 3, seed=7)
    steps = [reference.next_step(2) for _ in range(8)]  # 4 steps an epoch, the 4th with 2 real rows and 4 filler
    for saved_after in (3, 4, 5):
        run = Batches(ds, 3, seed=7)
        for _ in range(saved_after):
            run.next_step(2)
        state = json.loads(json.dumps(run.state_dict()))
        assert (state["epoch"], state["cursor"]) == ((0, 18) if saved_after == 3 else (1, 6 * (saved_after - 4)))
        resumed = Batches(ds, 3, seed=0)
        resumed.load_state_dict(state)
        for expected in steps[saved_after:]:
            for (ids, labels), (want_ids, want_labels) in zip(resumed.next_step(2), expected):
                np.testing.assert_array_equal(ids, want_ids)
                np.testing.assert_array_equal(labels, want_labels)
    legacy = Batches(ds, 3, seed=7)  # a position at the end of an epoch not yet turned over
    legacy.load_state_dict({"epoch": 0, "cursor": 24, "seed": 7, "batch_size": 3, "num_sequences": 20})
    np.testing.assert_array_equal(legacy.next_step(2)[0][0], steps[4][0][0])
    with pytest.raises(DataError, match="same data"):
        Batches(ds.subset(slice(0, 10)), 3).load_state_dict(state)


def test_split_holds_out_the_tail():
    ds = PackedDataset(np.arange(100, dtype=np.int32), np.arange(100, dtype=np.int32), 10)
    train, held = ds.split(0.2)
    assert len(train) == 8 and len(held) == 2 and held.input_ids[0, 0] == 80
    assert ds.split(0.0) == (ds, None)


def test_parquet_columns(tmp_path):
    import pyarrow as pa  # the parquet extra; CI installs it (a missing extra fails, never skips)
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": ["a", "b"], "completion": ["x", "y"]}), tmp_path / "t.parquet")
    records = list(read_records(tmp_path / "t.parquet", prompt_column="prompt", completion_column="completion"))
    assert [(r.prompt, r.text) for r in records] == [("a", "x"), ("b", "y")]
    with pytest.raises(DataError, match=r"t\.parquet: no column 'text' \(columns: prompt, completion\)"):
        list(read_records(tmp_path / "t.parquet"))


def test_hub_dataset_split_files_come_from_the_cache(tmp_path, monkeypatch):
    snapshot = tmp_path / "snapshot"
    for rel in ("data/train-00000-of-00002.jsonl", "data/train-00001-of-00002.jsonl",
                "data/test-00000-of-00001.jsonl", "pretraining_notes.txt", "README.md"):
        (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
        write(snapshot / rel, '{"text": "x"}\n')
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snapshot)
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    files = D.hf_dataset_files("org/corpus", "train")
    assert [f.relative_to(snapshot).as_posix() for f in files] == ["data/train-00000-of-00002.jsonl",
                                                                   "data/train-00001-of-00002.jsonl"]
    assert calls[0][0] == "org/corpus" and calls[0][1]["repo_type"] == "dataset"
    assert "*train*.parquet" in calls[0][1]["allow_patterns"]
    with pytest.raises(DataError, match="no parquet/jsonl/txt files for split 'validation'"):
        D.hf_dataset_files("org/corpus", "validation")


CHAT_TOKENIZER = __import__("pathlib").Path(__file__).parent / "data" / "pipeline"  # a BPE with a chat template
CONVERSATION = [{"role": "system", "content": "answer in one short line"}, {"role": "user", "content": "Hello?"},
                {"role": "assistant", "content": "Paris is the capital."}, {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": "Once upon a time."}]


def test_conversations_train_through_the_chat_template(tmp_path):
    """A "messages" row is the chat template's text: every token in the loss by default, with assistant_only_loss
    only the assistant turns (their text and closing token), then EOS."""
    from vkformers.models.loading import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": CONVERSATION[:3]}) + "\n")
    records = list(D.read_records(f))
    assert [r.messages for r in records] == [CONVERSATION, CONVERSATION[:3]]
    tokens, labels = D.tokenize_records(records[:1], tokenizer)
    rendered = tokenizer.apply_chat_template(CONVERSATION, return_dict=False)
    assert tokens.tolist() == rendered and rendered[-1] == tokenizer.eos_token_id  # the template ends in EOS
    assert (labels == tokens).all()
    tokens, labels = D.tokenize_records(records[:1], tokenizer, assistant_only_loss=True)
    kept = [int(t) for t, label in zip(tokens, labels) if label != D.IGNORE_INDEX]
    assert tokenizer.decode(kept) == "Paris is the capital.<|end|>Once upon a time.<|end|>"
    dataset = D.load_dataset([f], tokenizer, 8, assistant_only_loss=True)
    assert (dataset.labels != D.IGNORE_INDEX).any()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: message 0 must have a text 'role' and 'content'"):
        list(D.read_records(bad))
    with pytest.raises(DataError, match="no assistant message"):
        D.tokenize_records([Record("", None, "x:1", CONVERSATION[:2])], tokenizer, assistant_only_loss=True)
    with pytest.raises(DataError, match="needs a tokenizer with a chat template"):
        D.tokenize_records(records[:1], ByteTokenizer())


def test_a_conversation_is_the_templates_tokens_alone_with_no_eos_added():
    """As TRL's SFT: EOS ends plain text, while a conversation is what the chat template renders (its own end-of-turn
    tokens end it); so nothing is trained after a trailing user turn with assistant_only_loss."""
    from vkformers.models.loading import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # ends in a newline
    rendered = tokenizer.apply_chat_template(CONVERSATION, return_dict=False)
    assert rendered[-1] != tokenizer.eos_token_id
    tokens, labels = D.tokenize_records([Record("", None, "x:1", CONVERSATION)], tokenizer)
    assert tokens.tolist() == rendered and (labels == tokens).all()
    trailing = CONVERSATION[:4]  # ends with the user's "Why?"
    tokens, labels = D.tokenize_records([Record("", None, "x:1", trailing)], tokenizer, assistant_only_loss=True)
    assert tokens.tolist() == tokenizer.apply_chat_template(trailing, return_dict=False)
    kept = [int(t) for t, label in zip(tokens, labels) if label != D.IGNORE_INDEX]
    assert tokenizer.decode(kept) == "Paris is the capital.<|end|>\n"
    text, _ = D.tokenize_records([Record("Hello", None, "x:2")], tokenizer)
    assert text[-1] == tokenizer.eos_token_id  # plain text still ends in EOS


def test_without_packing_each_record_is_a_padded_sequence_with_the_loss_of_the_record_alone(tmp_path):
    """one_per_record: each document cut at seq_len and padded after its end, the padding out of the loss; a
    causal LM's loss over a padded row equals its loss over the record alone (its tokens never see the padding)."""
    from vkformers.models.loading import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
    f = tmp_path / "docs.jsonl"
    texts = ["Paris is the capital of France.", "Hello", "Once upon a time there was a small model. " * 4]
    f.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    dataset = D.load_dataset([f], tokenizer, 16, packing=False)
    pairs = list(D.tokenize_each(D.read_records(f), tokenizer))
    assert len(dataset) == 3 and dataset.input_ids.shape == (3, 16)
    for row, (ids, labels) in enumerate(pairs):
        n = min(len(ids), 16)
        assert dataset.input_ids[row, :n].tolist() == ids[:16].tolist()
        assert (dataset.input_ids[row, n:] == tokenizer.pad_token_id).all()
        assert (dataset.labels[row, n:] == D.IGNORE_INDEX).all()
        assert dataset.labels[row, :n].tolist() == labels[:n].tolist()
    model = AutoModelForCausalLM.from_pretrained(CHAT_TOKENIZER, requires_grad=False)
    ids, labels = pairs[1]  # "Hello": padded after
    assert len(ids) < 16 and len(pairs[2][0]) > 16  # (the third is cut)
    alone = float(model(input_ids=ids[None].astype(np.int64), labels=labels[None].astype(np.int64)).loss.numpy())
    padded = float(model(input_ids=dataset.input_ids[1:2].astype(np.int64),
                         labels=dataset.labels[1:2].astype(np.int64)).loss.numpy())
    assert abs(alone - padded) <= 1e-6 * abs(alone)
