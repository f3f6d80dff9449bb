"""AutoTokenizer: tokenizer.json + tokenizer_config.json of a small byte-level BPE trained here (no network)."""
import json
import shutil
import threading

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vkformers.models.loading import AutoTokenizer
from vkformers.models.tokenizer import TokenizerError

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens",
          "a chat template renders messages", "numbers 12345 and café naïve"] * 20

# ChatML with the helpers transformers gives templates: raise_exception, bos_token, a loop control.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(folder, **config):
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "unk_token": "<unk>",
                "pad_token": "<pad>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}
    settings.update(config)
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture()
def tok(folder):
    return AutoTokenizer.from_pretrained(folder)


def test_special_tokens_and_bos(tok):
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert [tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id] == [0, 1, 2, 3]
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]  # add_bos_token from the config
    assert tok.encode("hello world", add_special_tokens=False) == ids[1:]
    # special tokens in the text stay whole
    marked = tok.encode("<|im_start|>hello<|im_end|>", add_special_tokens=False)
    assert marked[0] == tok.convert_tokens_to_ids("<|im_start|>") and marked[-1] == 5
    assert set(tok.all_special_ids) >= {0, 1, 2, 3, 4, 5}


def test_add_bos_and_eos_flags(tmp_path):
    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "t", add_bos_token=False, add_eos_token=True))
    ids = tok.encode("hello")
    assert ids[0] != tok.bos_token_id and ids[-1] == tok.eos_token_id
    # no flag in the config: the tokenizer.json's own post-processor (none here: nothing added)
    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "u", add_bos_token=None))
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize("text", ["the quick brown fox", "numbers 12345 and café naïve", "  spaces\n\nand\ttabs ",
                                  "unseen: 日本語 😀", ""])
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == "<s>" + text  # transformers' default keeps special tokens
    assert tok.decode(np.array(ids), skip_special_tokens=True) == text


def test_batch_call_left_and_right_padding(tok):
    texts = ["hello", "the quick brown fox jumps"]
    short, long = (tok.encode(t) for t in texts)
    right = tok(texts, padding=True, return_tensors="np")
    assert right["input_ids"].shape == (2, len(long)) and right["input_ids"].dtype == np.int64
    assert right.input_ids[0].tolist() == short + [tok.pad_token_id] * (len(long) - len(short))
    assert right.attention_mask[0].tolist() == [1] * len(short) + [0] * (len(long) - len(short))
    left = tok(texts, padding=True, padding_side="left", return_tensors="np")
    pad = len(long) - len(short)
    assert left["input_ids"][0].tolist() == [tok.pad_token_id] * pad + short
    assert left["attention_mask"][0].tolist() == [0] * pad + [1] * len(short)
    assert left["input_ids"][1].tolist() == long and left["attention_mask"][1].all()
    # padding_side set on the tokenizer (as from_pretrained(padding_side=...) does)
    tok.padding_side = "left"
    assert tok(texts, padding=True, return_tensors="np")["input_ids"].tolist() == left["input_ids"].tolist()
    assert tok.batch_decode(left["input_ids"], skip_special_tokens=True) == texts
    # max_length padding and truncation
    fixed = tok(texts, padding="max_length", max_length=12, truncation=True, return_tensors="np")
    assert fixed["input_ids"].shape == (2, 12)
    # one text without return_tensors: plain lists, like transformers
    single = tok("hello")
    assert single["input_ids"] == short and single["attention_mask"] == [1] * len(short)
    assert tok("hello", return_tensors="np")["input_ids"].shape == (1, len(short))


def test_padding_needs_a_pad_token(tmp_path):
    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "t", pad_token=None))
    with pytest.raises(TokenizerError, match="pad token"):
        tok(["a", "bb cc"], padding=True)
    tok.pad_token = tok.eos_token
    assert tok(["a", "bb cc"], padding=True, return_tensors="np")["input_ids"][0, -1] == tok.eos_token_id
    with pytest.raises(TokenizerError, match="padding"):
        tok(["a", "bb cc"], return_tensors="np")


def test_chat_template(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, tokenize=False) == text[:-len("<|im_start|>assistant\n")]
    # tokenized: the template wrote <s> itself, so BOS is not added again (transformers 5 returns the dict)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="np")
    assert out["input_ids"].tolist() == [tok.encode(text, add_special_tokens=False)]
    assert out["input_ids"][0, 0] == tok.bos_token_id and out["input_ids"][0, 1] != tok.bos_token_id
    assert tok.apply_chat_template(messages, return_dict=False) == tok.encode(
        tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    # a batch of conversations, padded
    batch = tok.apply_chat_template([messages, messages[1:]], padding=True, return_tensors="np")
    assert batch["input_ids"].shape[0] == 2
    # continue_final_message leaves the last turn open
    draft = messages + [{"role": "assistant", "content": "Hi"}]
    assert tok.apply_chat_template(draft, continue_final_message=True, tokenize=False).endswith("assistant\nHi")
    # raise_exception from the template
    with pytest.raises(TokenizerError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_chat_template_helpers_and_files(tmp_path):
    folder = write_tokenizer(tmp_path / "t", chat_template=None)
    tok = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    # chat_template.jinja (transformers >= 4.43 saves it beside the config) with strftime_now, tojson, namespace
    (folder / "chat_template.jinja").write_text(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }} {{ strftime_now('%Y') | length }} {{ messages[0] | tojson }}\n"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}")
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "<b>&"}, {"role": "user", "content": "two"}],
                                   tokenize=False)
    assert text == '2 4 {"role": "user", "content": "<b>&"}\n[<b>&]'  # tojson does not HTML-escape
    # several named templates, as tokenizer_config.json may list them
    tok.chat_template = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "D"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="tool_use", tokenize=False) == "T"


def test_chat_template_keyword_arguments_are_template_variables(tok):
    """transformers passes apply_chat_template's further keyword arguments to the template (Qwen3's
    enable_thinking): they reach it, and stand over the special tokens' names."""
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
    hello = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(hello, chat_template=template, tokenize=False) == "<s>hello"
    assert tok.apply_chat_template(hello, chat_template=template, tokenize=False,
                                   enable_thinking=False) == "<s>hello<think></think>"
    assert tok.apply_chat_template(hello, chat_template=template, tokenize=False, bos_token="[B]") == "[B]hello"
    assert tok.apply_chat_template(hello, chat_template=template, enable_thinking=False, return_dict=False) == \
        tok.encode("<s>hello<think></think>", add_special_tokens=False)


def test_missing_tokenizer_json(tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"no-tokenizer: no tokenizer\.json"):
        AutoTokenizer.from_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(b"\0")  # a slow tokenizer's file, but no class to rebuild it with
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json, only tokenizer\.model, and no tokenizer_class"):
        AutoTokenizer.from_pretrained(folder)


def test_repo_id_through_the_hf_cache_offline(tmp_path, folder, monkeypatch):
    """A repo id resolves through resolve_checkpoint: here a hand-made HF cache entry, with the hub offline."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--tiny-org--tiny-tok"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    tok = AutoTokenizer.from_pretrained("tiny-org/tiny-tok", cache_dir=tmp_path / "cache", padding_side="left")
    assert tok.padding_side == "left" and tok.decode(tok.encode("hello"), skip_special_tokens=True) == "hello"
    from vkformers.models.loading import HubError
    with pytest.raises(HubError, match="offline"):
        AutoTokenizer.from_pretrained("tiny-org/absent", cache_dir=tmp_path / "cache")


def test_clean_up_tokenization_spaces_as_transformers():
    """tokenizer_config.json's clean_up_tokenization_spaces drops the space a word-level tokenizer leaves before
    punctuation and contractions when decoding (an argument overrides it); a BPE vocabulary keeps its text, as
    transformers skips the clean-up there."""
    from vkformers.models.tokenizer import PreTrainedTokenizer
    words = ["hello", ",", "world", ".", "it", "'s", "n't", "[UNK]"]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    word_level.decoder = None
    ids = word_level.encode("hello , world . it 's").ids
    assert PreTrainedTokenizer(word_level, {}).decode(ids) == "hello , world . it 's"
    cleaned = PreTrainedTokenizer(word_level, {"clean_up_tokenization_spaces": True})
    assert cleaned.decode(ids) == "hello, world. it's"
    assert cleaned.decode(ids, clean_up_tokenization_spaces=False) == "hello , world . it 's"
    assert cleaned.batch_decode([ids, ids[:2]]) == ["hello, world. it's", "hello,"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["hello , world ."], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe_ids = bpe.encode("hello , world .").ids
    assert PreTrainedTokenizer(bpe, {"clean_up_tokenization_spaces": True}).decode(bpe_ids) == "hello , world ."


def test_add_tokens_and_special_tokens_as_transformers(tmp_path):
    """add_special_tokens names a new pad token and extra specials, add_tokens adds text tokens (a token already
    there gets no new id); they are matched whole, take the next ids, decode, and survive save_pretrained."""
    from vkformers.models.tokenizer import PreTrainedTokenizer
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["hello world, a tool call"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizer(backend, {"eos_token": None})
    size = len(tok)
    assert tok.pad_token is None
    assert tok.add_special_tokens({"pad_token": "<pad>", "additional_special_tokens": ["<|tool|>"]}) == 2
    assert tok.pad_token == "<pad>" and tok.pad_token_id == size and tok.additional_special_tokens == ["<|tool|>"]
    assert tok.add_tokens(["<think>", "<think>"]) == 1
    tok.add_tokens("<pad>")
    assert len(tok) == size + 3 and tok.pad_token_id == size
    ids = tok.encode("hello<|tool|>world <think>")
    assert tok.convert_tokens_to_ids(["<|tool|>", "<think>"]) == [size + 1, size + 2]
    assert size + 1 in ids and size + 2 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "helloworld <think>"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert (again.pad_token_id, again.additional_special_tokens, again.encode("hello<|tool|>world <think>")) == (
        size, ["<|tool|>"], ids)
    with pytest.raises(TokenizerError, match="'tool_token' is not one of"):
        tok.add_special_tokens({"tool_token": "<t>"})
    with pytest.raises(TokenizerError, match="add_special_tokens takes a dict"):
        tok.add_special_tokens("<pad>")


def test_text_target_refusals(tok, tmp_path):
    """Neither text nor text_target is an error; a tokenizer class whose target mode sets another language's
    tokens (transformers' MarianTokenizer, NLLB, mBART, ...) refuses text_target rather than encode it as text."""
    with pytest.raises(TokenizerError, match="give text, text_target or both"):
        tok()
    assert tok(text_target="hello world")["input_ids"] == tok("hello world")["input_ids"]
    nllb = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "nllb", tokenizer_class="NllbTokenizerFast"))
    assert nllb("hello world")["input_ids"] == tok("hello world")["input_ids"]
    with pytest.raises(TokenizerError, match="NllbTokenizer encodes targets with the target language's tokens"):
        nllb("hello", text_target="world")


def test_calls_from_threads_keep_their_own_padding_and_truncation(tok):
    """A call sets the backend's padding and truncation for itself only: calls from other threads at the same time
    (a server's requests) see neither. Threads alternate truncated, padded and plain calls many times over."""
    text, short = CORPUS[0], CORPUS[1]
    plain = tok(text)["input_ids"]
    cut = tok(text, truncation=True, max_length=3)["input_ids"]
    padded = tok([text, short], padding=True)["input_ids"]
    tokens = tok.tokenize(text)
    assert len(cut) == 3 < len(plain) and len(padded[1]) == len(padded[0])
    wrong = []

    def call(kind: int) -> None:
        for _ in range(300):
            if kind == 0 and tok(text)["input_ids"] != plain:
                wrong.append("plain")
            elif kind == 1 and tok(text, truncation=True, max_length=3)["input_ids"] != cut:
                wrong.append("truncated")
            elif kind == 2 and tok([text, short], padding=True)["input_ids"] != padded:
                wrong.append("padded")
            elif kind == 3 and tok.tokenize(text) != tokens:
                wrong.append("tokenize")
    threads = [threading.Thread(target=call, args=(kind % 4,)) for kind in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong, f"{len(wrong)} calls saw another thread's settings: {sorted(set(wrong))}"
