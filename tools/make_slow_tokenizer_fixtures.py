"""Write tests/fixtures/slow_tokenizers/: tokenizers saved only as their "slow" files (vocab.txt; vocab.json +
merges.txt; a SentencePiece .model), each with what transformers' AutoTokenizer returns for them, for
tests/test_slow_tokenizers.py to compare vkformers' reading of the same files with exactly.

The vocabularies are trained here on a small built-in corpus, so the folder stays small (no network):

* ``wordpiece/vocab.txt``: a WordPiece vocabulary of the corpus's characters, a few suffixes and its words;
* ``bytelevel/vocab.json`` + ``merges.txt``: a byte-level BPE (GPT-2's alphabet);
* ``llama/tokenizer.model``: a SentencePiece BPE with byte fallback, as Llama 2 ships;
* ``t5/spiece.model``, ``albert/spiece.model``, ``xlmr/sentencepiece.bpe.model``: SentencePiece unigram models with
  T5's, ALBERT's and XLM-R's special pieces, normalized by a small custom rule table (a real ``nmt_nfkc`` map is
  240 KB), so the precompiled charsmap is exercised too;
* ``esm/vocab.txt``: ESM-2's 33 tokens;
* ``pegasus/spiece.model``: a unigram model with PEGASUS's special pieces (no <s>);
* ``deberta/spm.model``: a unigram model with DeBERTa-v3's special pieces;
* ``marian/source.spm`` + ``target.spm`` + ``vocab.json``: an opus-mt layout (two unigram models, one vocabulary of
  both's pieces and two language codes; the target corpus holds characters the source model never saw).

Each folder's ``expected.json`` holds variants: a tokenizer_config.json (and config.json) to write beside the files,
and for each text what ``AutoTokenizer.from_pretrained(folder)`` gives (the call's dict, ``decode`` with and without
``skip_special_tokens``), the named special tokens and the vocabulary sizes, the padding side, and a few calls on the
file's ``inputs`` (truncated, without special tokens, a padded batch, a chat template where the variant has one).

    /tmp/tfvenv/bin/pip install sentencepiece protobuf   # to train the .model files and let transformers read them
    /tmp/tfvenv/bin/python tools/make_slow_tokenizer_fixtures.py   # -> tests/fixtures/slow_tokenizers/

Made with transformers 5.24.0, tokenizers 0.23.3 and sentencepiece 0.2.3 (recorded in each expected.json); a
rerun with the same versions writes the same bytes.
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "slow_tokenizers"

CORPUS = """The quick brown fox jumps over the lazy dog. Hello world! Hello tokens, hello sentences.
A tokenizer splits text into pieces; the model reads their ids. Numbers like 12345, 3.14 and 1,000 appear too.
Café, naïve, résumé and Ünïcödé words keep their accents. Straße über alles. Don't, it's, we'll, they're.
東京は日本の首都です。中文文本也在这里。한국어 문장도 있습니다.
Emoji 😀 and rockets 🚀 show up in chats. E-mail me at user@example.com or visit http://example.com today.
Line one
line two	with a tab. UPPER lower MiXeD case. `` quoted '' text. The capital of France is Paris.
GPUs run shaders; Vulkan compute is portable. Training and inference share the same weights.
""".splitlines()

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and   multiple   spaces  ",
    "Café naïve résumé Ünïcödé",
    "東京は日本の首都です。",
    "emoji 😀 and 🚀 rockets",
    "line one\nline two\n\nthree\ttab",
    "unknown ☃ ⚛ ꙮ chars",
    "don't it's we'll",
    "numbers 12345 3.14 1,000",
    "",
    " ",
    "UPPER lower MiXeD",
    "special [MASK] [CLS] <mask> <s> </s> <|endoftext|> <extra_id_0> inside",
    "added <new> <ent> <ent2> <tool> <pad> tokens",
    "e-mail: user@example.com http://example.com",
    "ＦＵＬＬ　ｗｉｄｔｈ ﬁ ligature",
    "\u00a0non-breaking\u2009thin space",
    "中文 mixed English 한국어",
    "`` quoted '' text",
    "a",
]
PAIRS = [("How are you?", "I am fine."), ("Café", "東京"), ("first  text", " second text ")]

CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '[' + message['role'] + '] ' + message['content'] "
                 "+ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}")
CHAT = [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": "Café 東京"},
        {"role": "user", "content": "line one\nline two"}]
BATCH = ["Hello world!", "The quick brown fox jumps over the lazy dog."]

# a small NFKC-like rule table for the unigram models: full-width letters and the ideographic space, a ligature
NORMALIZATION_RULES = ([(0xFF21 + i, 0x41 + i) for i in range(26)] + [(0xFF41 + i, 0x61 + i) for i in range(26)]
                       + [(0x3000, 0x20), (0xFB01, (0x66, 0x69)), (0x00A0, 0x20)])


WORDPIECE_SIZE = 300


def write_wordpiece_vocab(folder: Path) -> None:
    """A WordPiece vocabulary picked by hand (the trainer breaks ties differently from run to run): the specials,
    every character of the corpus (cased and lowercased) alone and as a "##" continuation, a few suffixes and then
    the corpus's words (and their lowercase forms), most frequent first, up to 300 tokens."""
    from collections import Counter

    from tokenizers import normalizers, pre_tokenizers
    normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
    split = pre_tokenizers.BertPreTokenizer()
    words = Counter(word for line in CORPUS for word, _ in split.pre_tokenize_str(normalizer.normalize_str(line)))
    chars = sorted({c for word in words for c in word} | {c.lower() for word in words for c in word})
    suffixes = ["##s", "##ing", "##ed", "##er", "##ly", "##en", "##ts", "##ent", "##ers"]
    words.update(word.lower() for line in CORPUS for word, _ in split.pre_tokenize_str(normalizer.normalize_str(line)))
    frequent = [w for w, _ in sorted(words.items(), key=lambda item: (-item[1], item[0])) if len(w) > 1]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars), *suffixes, *frequent]
    vocab = list(dict.fromkeys(vocab))[:WORDPIECE_SIZE]
    assert len(vocab) == WORDPIECE_SIZE, len(vocab)  # the added tokens of VARIANTS follow at 300
    (folder / "vocab.txt").write_text("".join(f"{token}\n" for token in vocab), encoding="utf-8")


def train_byte_level(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=256 + len(specials) + 250, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS * 4, trainer)
    backend.model.save(str(folder))


def train_sentencepiece(path: Path, corpus=CORPUS, **options) -> None:
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus * 4), model_writer=model, num_threads=1,
                                   minloglevel=2, **options)
    # the trainer records its inputs' paths (the scratch rule table): cleared, so a rerun writes the same bytes
    from sentencepiece import sentencepiece_model_pb2
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.getvalue())
    proto.normalizer_spec.ClearField("normalization_rule_tsv")
    path.write_bytes(proto.SerializeToString())


def rule_table(folder: Path) -> str:
    def spell(target):
        return " ".join(f"{c:X}" for c in (target if isinstance(target, tuple) else (target,)))
    file = folder / "rules.tsv"
    file.write_text("".join(f"{source:X}\t{spell(target)}\n" for source, target in NORMALIZATION_RULES))
    return str(file)


def build_sources(out: Path, scratch: Path) -> None:
    """The slow files of each folder (only these are kept in the fixture)."""
    for name in ("wordpiece", "bytelevel", "llama", "t5", "albert", "xlmr", "marian", "deberta", "esm", "pegasus"):
        (out / name).mkdir(parents=True, exist_ok=True)
    write_wordpiece_vocab(out / "wordpiece")
    train_byte_level(out / "bytelevel")
    rules = rule_table(scratch)
    common = {"character_coverage": 1.0, "hard_vocab_limit": False}
    train_sentencepiece(out / "llama" / "tokenizer.model", model_type="bpe", vocab_size=400, byte_fallback=True,
                        normalization_rule_name="identity", remove_extra_whitespaces=False,
                        user_defined_symbols=["<tool>"], **common)
    train_sentencepiece(out / "t5" / "spiece.model", model_type="unigram", vocab_size=200, pad_id=0, eos_id=1,
                        unk_id=2, bos_id=-1, normalization_rule_tsv=rules, **common)
    train_sentencepiece(out / "albert" / "spiece.model", model_type="unigram", vocab_size=200, pad_id=0, unk_id=1,
                        bos_id=-1, eos_id=-1, control_symbols=["[CLS]", "[SEP]", "[MASK]"],
                        normalization_rule_tsv=rules, **common)
    train_sentencepiece(out / "xlmr" / "sentencepiece.bpe.model", model_type="unigram", vocab_size=200,
                        normalization_rule_tsv=rules, **common)
    write_marian(out / "marian", rules, common)
    # PEGASUS's layout: <pad> </s> <unk> first, no <s> (its converter keeps the pieces after the first two)
    train_sentencepiece(out / "pegasus" / "spiece.model", model_type="unigram", vocab_size=200, pad_id=0, eos_id=1,
                        unk_id=2, bos_id=-1, normalization_rule_tsv=rules, **common)
    (out / "esm" / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n", encoding="utf-8")
    # DeBERTa-v3's layout: [PAD] [CLS] [SEP] [UNK] first, [MASK] added after the pieces (added_tokens.json)
    train_sentencepiece(out / "deberta" / "spm.model", model_type="unigram", vocab_size=200, pad_id=0, bos_id=1,
                        eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]", eos_piece="[SEP]",
                        unk_piece="[UNK]", normalization_rule_tsv=rules, **common)


# Marian (opus-mt): a source and a target SentencePiece model, one vocab.json of both's pieces; a target-language
# corpus of its own (another alphabet's letters too, and a character the source model never saw)
MARIAN_TARGET_CORPUS = [line.lower()[::-1] + " ☃ σ λ ω" for line in CORPUS]
MARIAN_CODES = [">>fra<<", ">>deu<<"]
# ESM-2's vocabulary: the special tokens, the amino-acid letters (and ambiguity codes), gap symbols, a null token
ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]


def write_marian(folder: Path, rules: str, common: dict) -> None:
    train_sentencepiece(folder / "source.spm", model_type="unigram", vocab_size=200, normalization_rule_tsv=rules,
                        **common)
    train_sentencepiece(folder / "target.spm", model_type="unigram", vocab_size=180, normalization_rule_tsv=rules,
                        corpus=MARIAN_TARGET_CORPUS, **common)
    from sentencepiece import sentencepiece_model_pb2
    pieces = []
    for name in ("source.spm", "target.spm"):
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString((folder / name).read_bytes())
        pieces += [p.piece for p in proto.pieces if p.type == 1]  # normal pieces, as Marian's vocab lists them
    vocab = list(dict.fromkeys(["</s>", "<unk>", *MARIAN_CODES, *pieces, "<pad>"]))
    (folder / "vocab.json").write_text(json.dumps({piece: i for i, piece in enumerate(vocab)}, ensure_ascii=False))


# variants: (folder, name, tokenizer_config.json or None, config.json or None, extra files {name: content}[, files
# renamed {name: new name}])
ADDED = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
VARIANTS = [
    ("wordpiece", "bert_uncased", {"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                                   "model_max_length": 512}, None, {}),
    ("wordpiece", "bert_cased", {"tokenizer_class": "BertTokenizerFast", "do_lower_case": False,
                                 "clean_up_tokenization_spaces": True}, None, {}),
    ("wordpiece", "bert_keep_accents_no_cjk_split", {"do_lower_case": True, "strip_accents": False,
                                                      "tokenize_chinese_chars": False},
     {"model_type": "bert"}, {}),
    ("wordpiece", "distilbert_by_model_type", {"do_lower_case": True}, {"model_type": "distilbert"}, {}),
    ("wordpiece", "distilbert_class", {"tokenizer_class": "DistilBertTokenizer", "strip_accents": True,
                                       "do_lower_case": False}, None, {}),
    ("wordpiece", "electra_added_tokens", {"tokenizer_class": "ElectraTokenizer", "do_lower_case": True,
                                           "added_tokens_decoder": {
                                               "0": {**ADDED, "content": "[PAD]", "special": True},
                                               "300": {**ADDED, "content": "<new>", "special": True},
                                               "301": {**ADDED, "content": "hello world", "special": False,
                                                       "normalized": True}}},
     None, {}),
    ("wordpiece", "bert_added_tokens_json", {"tokenizer_class": "BertTokenizer", "do_lower_case": False},
     None, {"added_tokens.json": {"<ent>": 300, "<ent2>": 301},
            "special_tokens_map.json": {"additional_special_tokens": ["<ent>"]}}),
    # special_tokens_map.json: over a config saved before added_tokens_decoder its tokens win and its extra tokens
    # are appended; beside one with added_tokens_decoder it is not read
    ("wordpiece", "bert_special_tokens_map_wins", {"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                                                   "pad_token": "[PAD]", "extra_special_tokens": ["[MASK]"]},
     None, {"special_tokens_map.json": {"pad_token": {**ADDED, "content": "[UNK]"}, "sep_token": "[SEP]",
                                        "extra_special_tokens": ["hello", "[MASK]"]}}),
    ("wordpiece", "bert_special_tokens_map_unread", {"tokenizer_class": "BertTokenizer", "do_lower_case": True,
                                                     "added_tokens_decoder": {
                                                         "0": {**ADDED, "content": "[PAD]", "special": True}}},
     None, {"special_tokens_map.json": {"pad_token": "[UNK]", "additional_special_tokens": ["hello"]}}),
    ("bytelevel", "gpt2", {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>",
                           "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, None, {}),
    ("bytelevel", "gpt2_prefix_space_by_model_type", {"add_prefix_space": True}, {"model_type": "gpt2"}, {}),
    ("bytelevel", "opt_like_bos", {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": True, "bos_token": "</s>",
                                   "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>"}, None, {}),
    ("bytelevel", "roberta", {"tokenizer_class": "RobertaTokenizer"}, None, {}),
    ("bytelevel", "roberta_by_model_type", {"add_prefix_space": True, "trim_offsets": False},
     {"model_type": "roberta"}, {}),
    ("bytelevel", "bart_class", {"tokenizer_class": "BartTokenizer"}, None,
     {"special_tokens_map.json": {"mask_token": {"content": "<mask>", "lstrip": True, "normalized": False,
                                                 "rstrip": False, "single_word": False}}}),
    ("llama", "llama_non_legacy", {"tokenizer_class": "LlamaTokenizer", "legacy": False}, None, {}),
    ("llama", "llama_legacy", {"tokenizer_class": "LlamaTokenizerFast", "legacy": True, "add_bos_token": True,
                               "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                               "chat_template": CHAT_TEMPLATE}, None, {}),
    ("llama", "llama_default_no_prefix", {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False}, None, {}),
    ("llama", "llama_eos_pad_added", {"tokenizer_class": "LlamaTokenizer", "add_eos_token": True,
                                      "pad_token": "<pad>", "added_tokens_decoder": {
                                          "400": {**ADDED, "content": "<pad>", "special": True}}},
     None, {}),
    # as Llama 2 checkpoints saved by transformers 4 spell it
    ("llama", "llama_2_config", {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": None, "legacy": None,
                                 "add_bos_token": True, "add_eos_token": False, "pad_token": None,
                                 "clean_up_tokenization_spaces": False, "model_max_length": 4096,
                                 "padding_side": "right", "use_default_system_prompt": False,
                                 "sp_model_kwargs": {}, "added_tokens_decoder": {
                                     "0": {**ADDED, "content": "<unk>", "special": True},
                                     "1": {**ADDED, "content": "<s>", "special": True},
                                     "2": {**ADDED, "content": "</s>", "special": True}}},
     {"model_type": "llama"}, {}),
    ("marian", "marian", {"tokenizer_class": "MarianTokenizer", "source_lang": "en", "target_lang": "de"},
     {"model_type": "marian"}, {}),
    ("marian", "marian_by_model_type", None, {"model_type": "marian"}, {}),
    ("deberta", "deberta_v3", {"tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False, "vocab_type": "spm"},
     None, {"added_tokens.json": {"[MASK]": 172},
            "special_tokens_map.json": {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "[UNK]",
                                        "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                                        "mask_token": "[MASK]"}}),
    ("deberta", "deberta_v2_lower_punct_no_prefix", {"tokenizer_class": "DebertaV2TokenizerFast",
                                                     "do_lower_case": True, "split_by_punct": True,
                                                     "add_prefix_space": False}, None, {}),
    ("deberta", "deberta_by_model_type", None, {"model_type": "deberta-v2"}, {}),
    ("esm", "esm2", {"tokenizer_class": "EsmTokenizer", "model_max_length": 1024}, None,
     {"special_tokens_map.json": {"cls_token": "<cls>", "eos_token": "<eos>", "mask_token": "<mask>",
                                  "pad_token": "<pad>", "unk_token": "<unk>"}}),
    ("esm", "esm_by_model_type", None, {"model_type": "esm"}, {}),
    ("pegasus", "pegasus_default_masks", {"tokenizer_class": "PegasusTokenizer"}, None, {}),
    ("pegasus", "pegasus_large_config", {"tokenizer_class": "PegasusTokenizer", "mask_token": "<mask_2>",
                                         "mask_token_sent": "<mask_1>", "offset": 103, "model_max_length": 512},
     {"model_type": "pegasus"}, {}),
    ("pegasus", "pegasus_small_offset_by_model_type", {"offset": 6}, {"model_type": "pegasus"}, {}),
    ("t5", "t5", {"tokenizer_class": "T5Tokenizer"}, None, {}),
    ("t5", "t5_few_extra_ids", {"tokenizer_class": "T5Tokenizer", "extra_ids": 3}, None, {}),
    ("albert", "albert", {"tokenizer_class": "AlbertTokenizer", "do_lower_case": True, "keep_accents": False}, None,
     {}),
    ("albert", "albert_cased_accents", {"do_lower_case": False, "keep_accents": True}, {"model_type": "albert"},
     {}),
    ("xlmr", "xlm_roberta", {"tokenizer_class": "XLMRobertaTokenizer"}, None, {}),
    ("xlmr", "xlm_roberta_by_model_type", {}, {"model_type": "xlm-roberta"}, {}),
    # settings written as null: what each class makes of None
    ("albert", "albert_nulls", {"tokenizer_class": "AlbertTokenizer", "do_lower_case": None, "keep_accents": None,
                                "add_prefix_space": None}, None, {}),
    ("xlmr", "xlm_roberta_null_prefix_space", {"tokenizer_class": "XLMRobertaTokenizer", "add_prefix_space": None},
     None, {}),
    ("llama", "generic_null_legacy", {"tokenizer_class": "TokenizersBackend", "legacy": None}, {"model_type": "llama"},
     {}),
    # transformers' generic TokenizersBackend: a llama model_type without tokenizer_class, a Mistral whose
    # tokenizer_class says LlamaTokenizer (overridden), a unigram model under the generic class
    ("llama", "generic_llama_model_type", None, {"model_type": "llama"}, {}),
    ("llama", "generic_mistral_llama_class", {"tokenizer_class": "LlamaTokenizer", "legacy": False,
                                              "add_bos_token": True, "pad_token": "<pad>", "added_tokens_decoder": {
                                                  "0": {**ADDED, "content": "<unk>", "special": True},
                                                  "1": {**ADDED, "content": "<s>", "special": True},
                                                  "2": {**ADDED, "content": "</s>", "special": True},
                                                  "400": {**ADDED, "content": "<pad>", "special": True}}},
     {"model_type": "mistral"}, {}),
    ("t5", "generic_unigram", {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"},
     {"model_type": "llama"}, {}, {"spiece.model": "tokenizer.model"}),
]


def variant_folder(sources: Path, folder: str, tokenizer_config, config, extra, into: Path, renamed=None) -> Path:
    into.mkdir(parents=True)
    for file in (sources / folder).iterdir():
        if file.name != "expected.json":
            shutil.copy(file, into / (renamed or {}).get(file.name, file.name))
    if tokenizer_config is not None:
        (into / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if config is not None:
        (into / "config.json").write_text(json.dumps(config))
    for name, content in extra.items():
        (into / name).write_text(json.dumps(content))
    return into


# texts only one folder's variants encode: Marian's language codes (a code leads the text it is in)
FOLDER_TEXTS = {"esm": ["MKTAYIAKQRQISFVKSHFSRQ", "M K T", "mkta lower case", "MKT<mask>AYI<mask>", "<cls>MKT<eos>",
                        "MKTXBUZO.-<null_1>J", "AB<cls>"],
                "marian": [">>fra<< Hello world!", ">>deu<<Café", "Hello >>fra<< world", ">>xx<< not a code",
                           ">>fra<<", "☃ σ λ unknown", "a  ▁b ▁ c"]}


def expectations(path: Path, folder: str = "") -> dict:
    from transformers import AutoTokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(path))
    assert not (path / "tokenizer.json").exists()
    rows = []
    for text in TEXTS + FOLDER_TEXTS.get(folder, []) + PAIRS:
        encoded = tok(*text) if isinstance(text, tuple) else tok(text)
        ids = encoded["input_ids"]
        rows.append({"text": list(text) if isinstance(text, tuple) else text,
                     "encoding": {key: list(value) for key, value in encoded.items()},
                     "decode": tok.decode(ids), "decode_skip": tok.decode(ids, skip_special_tokens=True)})
    calls = {"truncated": dict(tok(TEXTS[1], truncation=True, max_length=6)),
             "no_special_tokens": dict(tok(TEXTS[1], add_special_tokens=False))}
    if tok.pad_token is not None:
        calls["batch_padded"] = dict(tok(BATCH, padding=True))
        # a sequence-to-sequence batch: the targets' ids as labels; targets alone, truncated to max_target_length
        calls["text_target"] = dict(tok(BATCH, text_target=BATCH[::-1], padding=True))
        calls["text_target_only"] = dict(tok(text_target=TEXTS[1], max_target_length=5, padding="max_length"))
    if tok.chat_template:
        calls["chat_text"] = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        calls["chat_ids"] = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    named = {name: getattr(tok, name) for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                                                   "cls_token", "mask_token")}
    return {"class": type(tok).__name__, "len": len(tok), "vocab_size": tok.vocab_size,
            "special_tokens": {k: v for k, v in named.items() if v is not None},
            "special_token_ids": {k: tok.convert_tokens_to_ids(v) for k, v in named.items() if v is not None},
            "padding_side": tok.padding_side,
            "model_max_length": tok.model_max_length if tok.model_max_length < 1e20 else None,
            "calls": calls, "rows": rows}


def main():
    import sentencepiece
    import tokenizers
    import transformers
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        build_sources(args.out, scratch)
        by_folder: dict[str, list] = {}
        for folder, name, tokenizer_config, config, extra, *renamed in VARIANTS:
            renamed = renamed[0] if renamed else {}
            path = variant_folder(args.out, folder, tokenizer_config, config, extra, scratch / name, renamed)
            result = expectations(path, folder)
            by_folder.setdefault(folder, []).append({"name": name, "tokenizer_config": tokenizer_config,
                                                     "config": config, "files": extra, "renamed": renamed,
                                                     **result})
            print(f"{name}: {result['class']}, {result['len']} tokens")
    versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                "sentencepiece": sentencepiece.__version__}
    for folder, variants in by_folder.items():
        lines = [json.dumps(v, ensure_ascii=False, sort_keys=True, separators=(",", ":")) for v in variants]
        inputs = {"long_text": TEXTS[1], "batch": BATCH, "chat": CHAT}
        text = ('{"versions": ' + json.dumps(versions, sort_keys=True) + ',\n "inputs": '
                + json.dumps(inputs, ensure_ascii=False, sort_keys=True) + ',\n "variants": [\n'
                + ",\n".join(lines) + "\n]}\n")
        (args.out / folder / "expected.json").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
