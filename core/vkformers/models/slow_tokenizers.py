"""Checkpoints without ``tokenizer.json``: their "slow" tokenizer files rebuilt as transformers 5 builds them.

A checkpoint saved before fast tokenizers were common ships only the files of its slow tokenizer: ``vocab.txt``
(BERT's WordPiece), ``vocab.json`` + ``merges.txt`` (GPT-2's and RoBERTa's byte-level BPE) or a SentencePiece model
(``tokenizer.model``, ``spiece.model``, ``sentencepiece.bpe.model``). transformers picks the tokenizer class from
tokenizer_config.json's ``tokenizer_class`` (else config.json's, else the model_type's class) and that class builds a
``tokenizers.Tokenizer`` from the files and its settings (``do_lower_case``, ``add_prefix_space``, ``legacy``, ...).
:func:`load_slow_tokenizer` builds the same one for the classes in ``TOKENIZER_CLASSES``; any other class is refused
with what to do instead.

A SentencePiece ``.model`` file is a protobuf message; :func:`read_sentencepiece_model` reads the fields used here
(pieces, model type, byte fallback, special ids, normalizer settings) with a small wire-format reader, so neither
``sentencepiece`` nor ``protobuf`` is needed.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vkformers.errors import VkformersError
from vkformers.models.tokenizer_files import extra_special_tokens, read_json, token_text

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "spm.model")
SLOW_TOKENIZER_FILES = ("vocab.txt", "vocab.json", "merges.txt", *SENTENCEPIECE_FILES, "source.spm", "target.spm",
                        "added_tokens.json")
METASPACE = "\u2581"  # SentencePiece's spelling of a space
WRITE_TOKENIZER_JSON = ("write tokenizer.json with transformers: "
                        "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)")

# transformers' tokenizer classes (their "Fast" names too) -> how their files become a tokenizer
TOKENIZER_CLASSES = {
    **dict.fromkeys(("BertTokenizer", "DistilBertTokenizer", "ConvBertTokenizer", "ElectraTokenizer",
                     "MobileBertTokenizer", "SqueezeBertTokenizer", "LayoutLMTokenizer", "LxmertTokenizer"), "bert"),
    **dict.fromkeys(("DPRQuestionEncoderTokenizer", "DPRContextEncoderTokenizer"), "dpr"),
    "GPT2Tokenizer": "gpt2",
    **dict.fromkeys(("RobertaTokenizer", "BartTokenizer", "LongformerTokenizer", "LEDTokenizer", "MvpTokenizer"),
                    "roberta"),
    **dict.fromkeys(("LlamaTokenizer", "Phi3Tokenizer"), "llama"),
    "T5Tokenizer": "t5",
    "AlbertTokenizer": "albert",
    "XLMRobertaTokenizer": "xlm-roberta",
    "MarianTokenizer": "marian",
    "DebertaV2Tokenizer": "deberta-v2",
    "EsmTokenizer": "esm",
    "PegasusTokenizer": "pegasus",
    # transformers' generic tokenizer, built from a tokenizer.model's own settings
    **dict.fromkeys(("TokenizersBackend", "PreTrainedTokenizerFast"), "sentencepiece"),
}
# config.json model_type -> transformers' tokenizer class for it (where that class is one of the above)
MODEL_TYPE_CLASSES = {
    **dict.fromkeys(("align", "bark", "bert", "blip", "bros", "chinese_clip", "convbert", "distilbert", "electra",
                     "ernie", "flava", "git", "grounding-dino", "layoutlm", "megatron-bert", "mm-grounding-dino",
                     "nezha", "nomic_bert", "qdqbert", "realm", "retribert", "squeezebert", "tvp", "vilt",
                     "visual_bert", "mobilebert", "lxmert"), "BertTokenizer"),
    "dpr": "DPRQuestionEncoderTokenizer",
    **dict.fromkeys(("blip-2", "codegen", "dbrx", "emu3", "gpt2", "gpt_neo", "gptj", "instructblip",
                     "instructblipvideo", "jais2", "opt", "phi", "starcoder2"), "GPT2Tokenizer"),
    **dict.fromkeys(("bart", "bridgetower", "clap", "data2vec-text", "ibert", "led", "lilt", "longformer", "mega",
                     "mra", "mvp", "roberta", "roberta-prelayernorm"), "RobertaTokenizer"),
    **dict.fromkeys(("idefics", "idefics2"), "LlamaTokenizer"),
    **dict.fromkeys(("mt5", "musicgen", "musicgen_melody", "switch_transformers", "t5"), "T5Tokenizer"),
    **dict.fromkeys(("albert", "yoso"), "AlbertTokenizer"),
    "marian": "MarianTokenizer",
    "deberta-v2": "DebertaV2Tokenizer",
    "esm": "EsmTokenizer",
    **dict.fromkeys(("pegasus", "bigbird_pegasus"), "PegasusTokenizer"),
    **dict.fromkeys(("gte", "jina_embeddings_v3", "metaclip_2", "trocr", "xlm-roberta", "xmod"),
                    "XLMRobertaTokenizer"),
}

# model types transformers 5.24 gives its generic TokenizersBackend (TOKENIZER_MAPPING_NAMES; the Mistral family's
# MistralCommonBackend reads tekken.json only): their tokenizer_class names the class of the tokenizer.json they
# were saved with, and is overridden
BACKEND_MODEL_TYPES = frozenset({
    "EvollaModel", "arctic", "aria", "beam", "bigbird_pegasus", "camembertv2-base", "canary", "chatlm",
    "cohere_asr", "ernie4_5", "ernie4_5_moe", "flex_olmo", "fuyu", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "glm4v", "glm4v_moe", "glm_image", "glmasr", "got_ocr2", "gpt_bigcode", "gradium_phonon_tts", "granite",
    "granitemoe", "granitemoehybrid", "granitemoeshared", "h2ovl_chat", "hyperclovax", "hyperclovax_vlm",
    "internlm2", "internlm3", "iquestcoder", "jamba", "kimi_k25", "kimi_linear", "kosmos-2", "llava", "llava_next",
    "mimo_v2_flash", "minicpm3", "minicpm_ocr", "minicpmv", "minicpmv4_6", "minicpmv4_7", "minimax_m2", "ministral",
    "ministral3", "mistral", "mistral3", "mistral_large4", "mixtral", "modernbert", "modernbert-decoder", "molmo",
    "molmo2", "nemo_speechlm", "nemotron", "nvfp4", "nystromformer", "olmo2", "olmo3", "olmo_hybrid", "omniasr",
    "opencua", "openvla", "paddleocr_vl", "pegasus_x", "persimmon", "phi3", "phi3_v", "phimoe", "pix2struct",
    "pixtral", "pocket_tts", "smolvlm", "stablelm", "step3_vl", "umt5", "vipllava", "voxtral", "voxtral_realtime",
    "xlm-roberta-xl"})
# model types with no tokenizer class in transformers 5 (it falls back to TokenizersBackend), where a checkpoint
# without tokenizer_class ships a slow tokenizer
UNMAPPED_MODEL_TYPES = frozenset({"llama"})


class SlowTokenizerError(VkformersError, ValueError):
    """Slow tokenizer files that cannot be rebuilt (an unknown class, a malformed or missing file)."""


def slow_tokenizer_files(folder: Path) -> list[str]:
    return [name for name in SLOW_TOKENIZER_FILES if (Path(folder) / name).is_file()]


# -- SentencePiece .model files ---------------------------------------------------------------------------------
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece's piece types
UNIGRAM, BPE = 1, 2  # TrainerSpec.model_type


@dataclass
class SentencePieceModel:
    """The fields of a SentencePiece ModelProto that tokenizers are built from (defaults as sentencepiece's)."""
    pieces: list[tuple[str, float, int]] = field(default_factory=list)  # (piece, score, type) in id order
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    unk_piece: str = "<unk>"
    bos_piece: str = "<s>"
    eos_piece: str = "</s>"
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True
    precompiled_charsmap: bytes = b""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes):
    """(field number, value) of each field of a protobuf message: an int for varints, bytes otherwise."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"wire type {wire} of field {number}")
        if pos > len(data):
            raise ValueError(f"field {number} runs past the end")
        yield number, value


def _int32(value: int) -> int:
    """A varint holding a (possibly negative) int32, as protobuf writes it: 64-bit two's complement."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _parse_model(data: bytes) -> SentencePieceModel:
    model = SentencePieceModel()
    trainer, normalizer = b"", b""
    for number, value in _fields(data):
        if number == 1:  # ModelProto.pieces
            piece, score, kind = "", 0.0, NORMAL
            for sub, item in _fields(value):
                if sub == 1:
                    piece = item.decode("utf-8")
                elif sub == 2:
                    score = struct.unpack("<f", item)[0]
                elif sub == 3:
                    kind = item
            model.pieces.append((piece, score, kind))
        elif number == 2:  # trainer_spec (repeats of a message field merge: their bytes concatenate)
            trainer += value
        elif number == 3:  # normalizer_spec
            normalizer += value
    for number, value in _fields(trainer):
        if number == 3:
            model.model_type = value
        elif number == 35:
            model.byte_fallback = bool(value)
        elif number in (40, 41, 42, 43):
            setattr(model, {40: "unk_id", 41: "bos_id", 42: "eos_id", 43: "pad_id"}[number], _int32(value))
        elif number in (45, 46, 47):
            setattr(model, {45: "unk_piece", 46: "bos_piece", 47: "eos_piece"}[number], value.decode("utf-8"))
    for number, value in _fields(normalizer):
        if number == 2:
            model.precompiled_charsmap = bytes(value)
        elif number in (3, 4, 5):
            setattr(model, {3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}[number],
                    bool(value))
    return model


def read_sentencepiece_model(file: Path) -> SentencePieceModel:
    try:
        model = _parse_model(Path(file).read_bytes())
    except (ValueError, UnicodeDecodeError, struct.error) as exc:
        raise SlowTokenizerError(f"{file}: not a SentencePiece model ({exc}); {WRITE_TOKENIZER_JSON}") from None
    if not model.pieces:
        raise SlowTokenizerError(f"{file}: a SentencePiece model without pieces; {WRITE_TOKENIZER_JSON}")
    return model


def sentencepiece_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """transformers' merges of a SentencePiece BPE (``generate_merges``): every split of a piece into two pieces,
    ranked by the id of the merged piece (SentencePiece sorts its BPE pieces best first), then the shorter left
    half."""
    ranked = []
    for piece, piece_id in vocab.items():
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))
                  if piece[:cut] in vocab and piece[cut:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked += [(piece_id, len(left), len(right), left, right) for left, right in splits]
    ranked.sort(key=lambda merge: merge[:3])  # stable: a piece's own splits keep their order on ties
    return [(left, right) for *_, left, right in ranked]


# -- the tokenizer classes --------------------------------------------------------------------------------------
@dataclass
class SlowTokenizer:
    """A rebuilt tokenizer: the backend, the class's defaults for tokenizer_config.json's settings, and the
    post-processor the class sets once its special tokens have ids (None: the one the backend has stays)."""
    backend: object
    defaults: dict
    post_processor: Callable | None = None
    sentencepiece: SentencePieceModel | None = None
    added_user_defined: bool = True  # a SentencePiece model's user-defined pieces become added tokens
    added_raw: bool = False  # added_tokens_decoder's tokens match the text before the normalizer
    # the decoder the class sets once its special tokens are known (None: the backend's stays)
    decoder: Callable | None = None
    # files a save copies instead of writing tokenizer.json, which cannot hold a tokenizer with Python parts
    files: tuple[str, ...] = ()
    # (normalizer, pre-tokenizer) the class encodes text_target with (a translation model's target language)
    target_mode: tuple | None = None


def _setting(config: dict, name: str, default):
    """A setting the class reads as "None: its default" (others take ``config.get(name, default)`` as given)."""
    value = config.get(name)
    return default if value is None else value


def _read_json(file: Path):
    return read_json(file, SlowTokenizerError)


def _file(folder: Path, *names: str) -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise SlowTokenizerError(f"{folder}: no {' or '.join(names)} (and no tokenizer.json)")


def _bert(folder: Path, config: dict, *, lowercase: bool | None = None) -> SlowTokenizer:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    defaults = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                "mask_token": "[MASK]"}
    vocab_file = _file(folder, "vocab.txt")
    try:
        vocab = models.WordPiece.read_file(str(vocab_file))
    except Exception as exc:  # the Rust side raises a bare Exception on malformed files
        raise SlowTokenizerError(f"{vocab_file}: not a WordPiece vocabulary ({exc})") from None
    unk = token_text(_setting(config, "unk_token", defaults["unk_token"]))
    backend = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=bool(_setting(config, "tokenize_chinese_chars", True)),
        strip_accents=config.get("strip_accents"),
        lowercase=bool(_setting(config, "do_lower_case", True)) if lowercase is None else lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")

    def post_processor(tokenizer):
        cls, sep = tokenizer.cls_token, tokenizer.sep_token
        cls_id = 2 if tokenizer.cls_token_id is None else tokenizer.cls_token_id  # transformers' fallbacks
        sep_id = 3 if tokenizer.sep_token_id is None else tokenizer.sep_token_id
        return processors.TemplateProcessing(single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
                                             special_tokens=[(str(cls), cls_id), (str(sep), sep_id)])
    return SlowTokenizer(backend, defaults, post_processor)


def _esm(folder: Path, config: dict) -> SlowTokenizer:
    """transformers' EsmTokenizer (ESM-2 protein models; a Python tokenizer, no fast form): every token of vocab.txt
    is cut out wherever it stands (the residue letters among them), the text left between is split on whitespace,
    and a piece not in the vocabulary is the unknown token; ``<cls> A <eos>`` (pairs ``<cls> A <eos> B <eos>``),
    decoded joined by spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    vocab_file = _file(folder, "vocab.txt")
    try:
        tokens = [line.strip() for line in vocab_file.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as exc:
        raise SlowTokenizerError(f"{vocab_file}: not a text vocabulary ({exc})") from None
    vocab = {token: index for index, token in enumerate(tokens)}  # (a repeated line: its last id, as the class)
    unk = str(token_text(_setting(config, "unk_token", "<unk>")))
    if unk not in vocab:
        raise SlowTokenizerError(f"{vocab_file}: EsmTokenizer's vocabulary must hold the unknown token {unk!r}")
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_tokens([AddedToken(token, normalized=False) for token in dict.fromkeys(tokens) if token])
    defaults = {"unk_token": "<unk>", "cls_token": "<cls>", "pad_token": "<pad>", "mask_token": "<mask>",
                "eos_token": "<eos>"}

    def post_processor(tokenizer):
        cls, eos = tokenizer.cls_token, tokenizer.eos_token
        single = [cls, "$A"] + ([eos] if eos is not None else [])
        pair = [cls, "$A", eos, "$B", eos] if eos is not None else [cls, "$A", "$B"]  # (a pair needs eos there)
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[
            (token, tokenizer.backend.token_to_id(token)) for token in (cls, eos) if token is not None])
    return SlowTokenizer(backend, defaults, post_processor)


def _byte_level(folder: Path, config: dict, *, roberta: bool) -> SlowTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab_file, merges_file = _file(folder, "vocab.json"), folder / "merges.txt"
    if not merges_file.is_file():
        raise SlowTokenizerError(f"{folder}: vocab.json without merges.txt (a byte-level BPE needs both)")
    try:
        vocab, merges = models.BPE.read_file(str(vocab_file), str(merges_file))
    except Exception as exc:  # the Rust side raises a bare Exception on malformed files
        raise SlowTokenizerError(f"{vocab_file}, {merges_file}: not a BPE vocabulary ({exc})") from None
    backend = Tokenizer(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    add_prefix_space = bool(_setting(config, "add_prefix_space", False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    if not roberta:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
        return SlowTokenizer(backend, dict.fromkeys(("unk_token", "bos_token", "eos_token"), "<|endoftext|>"))
    defaults = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
                "pad_token": "<pad>", "mask_token": "<mask>"}
    trim_offsets = bool(_setting(config, "trim_offsets", True))

    def post_processor(tokenizer):
        return processors.RobertaProcessing((str(tokenizer.sep_token), tokenizer.sep_token_id),
                                            (str(tokenizer.cls_token), tokenizer.cls_token_id),
                                            trim_offsets=trim_offsets, add_prefix_space=add_prefix_space)
    return SlowTokenizer(backend, defaults, post_processor)


def _llama(folder: Path, config: dict) -> SlowTokenizer:
    """transformers 5's LlamaTokenizer: SentencePiece BPE with byte fallback, the dummy prefix a Metaspace
    pre-tokenizer puts before the text ("legacy": before each piece between added tokens too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    spm = read_sentencepiece_model(_file(folder, "tokenizer.model", *SENTENCEPIECE_FILES))
    if spm.model_type != BPE:
        raise SlowTokenizerError(f"{folder}: LlamaTokenizer needs a SentencePiece BPE model, this one is "
                                 f"{'unigram' if spm.model_type == UNIGRAM else spm.model_type}")
    vocab = {piece: index for index, (piece, _, _) in enumerate(spm.pieces)}
    backend = Tokenizer(models.BPE(vocab, sentencepiece_merges(vocab), fuse_unk=True, byte_fallback=True,
                                   dropout=None))
    add_prefix_space = bool(_setting(config, "add_prefix_space", True))
    if not add_prefix_space:
        scheme = "never"
    else:
        scheme = "always" if config.get("legacy", False) else "first"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if add_prefix_space else []))
    backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    defaults = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "padding_side": "left"}
    return SlowTokenizer(backend, defaults, sentencepiece=spm)


def _unigram_model(spm: SentencePieceModel, folder: Path, name: str, vocab: list, unk_id: int):
    from tokenizers import Tokenizer, models
    if spm.model_type != UNIGRAM:
        raise SlowTokenizerError(f"{folder}: {name} needs a SentencePiece unigram model, this one is "
                                 f"{'BPE' if spm.model_type == BPE else spm.model_type}")
    return Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False))


def _metaspace_pre_tokenizer(scheme: str):
    from tokenizers import pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                    pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme=scheme)])


def _t5(folder: Path, config: dict) -> SlowTokenizer:
    from tokenizers import decoders, normalizers, processors
    spm = read_sentencepiece_model(_file(folder, "spiece.model", *SENTENCEPIECE_FILES))
    extra_ids = int(_setting(config, "extra_ids", 100))
    # the sentinels <extra_id_N> follow the pieces, the last first
    vocab = [(piece, score) for piece, score, _ in spm.pieces]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(extra_ids - 1, -1, -1)]
    backend = _unigram_model(spm, folder, "T5Tokenizer", vocab, unk_id=2)
    if spm.precompiled_charsmap:
        backend.normalizer = normalizers.Precompiled(spm.precompiled_charsmap)
    backend.pre_tokenizer = _metaspace_pre_tokenizer("always")
    backend.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    defaults = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    if config.get("additional_special_tokens") is None and config.get("extra_special_tokens") is None:
        defaults["additional_special_tokens"] = [f"<extra_id_{i}>" for i in range(extra_ids)]

    def post_processor(tokenizer):
        return processors.TemplateProcessing(single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"],
                                             special_tokens=[("</s>", tokenizer.eos_token_id)])
    return SlowTokenizer(backend, defaults, post_processor, sentencepiece=spm)


def _albert(folder: Path, config: dict) -> SlowTokenizer:
    from tokenizers import decoders, normalizers, processors
    spm = read_sentencepiece_model(_file(folder, "spiece.model", *SENTENCEPIECE_FILES))
    backend = _unigram_model(spm, folder, "AlbertTokenizer", [(p, s) for p, s, _ in spm.pieces], unk_id=1)
    steps = [normalizers.Replace("``", '"'), normalizers.Replace("''", '"')]
    if not config.get("keep_accents", False):
        steps += [normalizers.NFKD(), normalizers.StripAccents()]
    if config.get("do_lower_case", True):
        steps.append(normalizers.Lowercase())
    if spm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spm.precompiled_charsmap))
    backend.normalizer = normalizers.Sequence(steps)
    scheme = "always" if config.get("add_prefix_space", True) else "never"
    backend.pre_tokenizer = _metaspace_pre_tokenizer(scheme)
    backend.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme=scheme)
    defaults = {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "<unk>", "sep_token": "[SEP]",
                "pad_token": "<pad>", "cls_token": "[CLS]", "mask_token": "[MASK]"}
    # set before transformers applies add_bos_token/add_eos_token, which then replace it
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", backend.token_to_id(token_text(_setting(config, "cls_token", "[CLS]")))),
                        ("[SEP]", backend.token_to_id(token_text(_setting(config, "sep_token", "[SEP]"))))])
    return SlowTokenizer(backend, defaults, sentencepiece=spm)


def _pegasus(folder: Path, config: dict) -> SlowTokenizer:
    """transformers 5's PegasusTokenizer over a ``spiece.model``: pad, eos, the two mask tokens and ``<unk_2>`` ..
    ``<unk_{offset - 1}>`` first (its converter's order, which names the masks the other way round from the class's
    defaults where the config names neither), then the model's pieces after its first two; the mask sentence token
    and those ``<unk_N>`` are the additional special tokens."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors
    spm = read_sentencepiece_model(_file(folder, "spiece.model", *SENTENCEPIECE_FILES))
    pad, eos = (str(token_text(_setting(config, name, default))) for name, default in
                (("pad_token", "<pad>"), ("eos_token", "</s>")))
    offset = int(_setting(config, "offset", 103))
    converter_mask = str(token_text(config.get("mask_token", "<mask_1>")))  # the converter's defaults
    converter_sent = str(token_text(config.get("mask_token_sent", "<mask_2>")))
    vocab = [(pad, 0.0), (eos, 0.0)] + ([(converter_mask, 0.0)] if converter_mask != "None" else [])
    if converter_sent not in ("None", converter_mask):
        vocab.append((converter_sent, 0.0))
    vocab += [(f"<unk_{i}>", -100.0) for i in range(2, offset)]
    vocab += [(piece, score) for piece, score, _ in spm.pieces[2:]]
    unk = str(token_text(_setting(config, "unk_token", "<unk>")))
    backend = _unigram_model(spm, folder, "PegasusTokenizer", vocab, unk_id=vocab.index((unk, 0.0), 1))
    steps = [normalizers.Precompiled(spm.precompiled_charsmap)] if spm.precompiled_charsmap else \
        [normalizers.Replace(Regex(r"\n"), " ")]
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(Regex(r" {2,}"), " ")])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    backend.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always", split=True)
    sentence_mask = _setting(config, "mask_token_sent", "<mask_1>")
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens")
    if not isinstance(extra, list) or sentence_mask is None or token_text(sentence_mask) not in map(token_text, extra):
        extra = [sentence_mask] if sentence_mask is not None else []
    else:
        extra = []
    defaults = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>", "mask_token": "<mask_2>",
                "additional_special_tokens": extra + [f"<unk_{i}>" for i in range(2, offset)]}

    def post_processor(tokenizer):
        eos_token = tokenizer.eos_token
        return processors.TemplateProcessing(single=f"$A {eos_token}", pair=f"$A $B {eos_token}",
                                             special_tokens=[(eos_token, tokenizer.eos_token_id)])
    return SlowTokenizer(backend, defaults, post_processor)


def _deberta_v2(folder: Path, config: dict) -> SlowTokenizer:
    """transformers 5's DebertaV2Tokenizer (DeBERTa-v2 and v3's spm.model): the model's pieces as a unigram model
    whose normalizer is the class's own (whitespace runs and controls to one space, NFC, trailing spaces cut; the
    .model's charsmap is not used), Metaspace words (``split_by_punct``: punctuation apart first)."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors
    spm = read_sentencepiece_model(_file(folder, "spm.model", *SENTENCEPIECE_FILES))
    vocab = [(piece, score) for piece, score, _ in spm.pieces]
    unk = str(token_text(_setting(config, "unk_token", "[UNK]")))
    unk_id = vocab.index((unk, 0.0)) if (unk, 0.0) in vocab else spm.unk_id  # as the class finds it
    backend = _unigram_model(spm, folder, "DebertaV2Tokenizer", vocab, unk_id=unk_id)
    steps = [normalizers.Lowercase()] if config.get("do_lower_case", False) else []
    steps += [normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "), normalizers.NFC(),
              normalizers.Strip(left=False, right=True)]
    backend.normalizer = normalizers.Sequence(steps)
    scheme = "always" if config.get("add_prefix_space", True) else "first"
    splits = [pre_tokenizers.Punctuation(behavior="isolated")] if config.get("split_by_punct", False) else []
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.Metaspace(replacement=METASPACE,
                                                                                         prepend_scheme=scheme)])
    backend.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme=scheme)
    defaults = {"bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "[UNK]", "sep_token": "[SEP]",
                "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}

    def post_processor(tokenizer):
        cls, sep = tokenizer.cls_token, tokenizer.sep_token
        return processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, tokenizer.cls_token_id or 0), (sep, tokenizer.sep_token_id or 0)])
    return SlowTokenizer(backend, defaults, post_processor, sentencepiece=spm)


def _xlm_roberta(folder: Path, config: dict) -> SlowTokenizer:
    """fairseq's vocabulary: <s> <pad> </s> <unk>, then the SentencePiece pieces after its own first three (so a
    piece's id is its SentencePiece id + 1), then <mask>."""
    from tokenizers import decoders, normalizers, processors
    spm = read_sentencepiece_model(_file(folder, "sentencepiece.bpe.model", *SENTENCEPIECE_FILES))
    defaults = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "cls_token": "<s>", "unk_token": "<unk>",
                "pad_token": "<pad>", "mask_token": "<mask>"}
    named = {name: token_text(_setting(config, name, value)) for name, value in defaults.items()}
    vocab = [(named[name], 0.0) for name in ("bos_token", "pad_token", "eos_token", "unk_token")]
    vocab += [(piece, score) for piece, score, _ in spm.pieces[3:]] + [(named["mask_token"], 0.0)]
    backend = _unigram_model(spm, folder, "XLMRobertaTokenizer", vocab, unk_id=3)
    if spm.precompiled_charsmap:
        backend.normalizer = normalizers.Precompiled(spm.precompiled_charsmap)
    scheme = "always" if config.get("add_prefix_space", True) else "never"
    backend.pre_tokenizer = _metaspace_pre_tokenizer(scheme)
    backend.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme=scheme)
    bos, eos = named["bos_token"], named["eos_token"]

    def post_processor(tokenizer):
        return processors.TemplateProcessing(single=[bos, "$A", eos], pair=[bos, "$A", eos, eos, "$B", eos],
                                             special_tokens=[(bos, tokenizer.bos_token_id),
                                                             (eos, tokenizer.eos_token_id)])
    return SlowTokenizer(backend, defaults, post_processor, sentencepiece=spm)


def _sentencepiece(folder: Path, config: dict) -> SlowTokenizer:
    """transformers 5's generic TokenizersBackend over a ``tokenizer.model``: the SentencePiece model's own
    settings (its normalizer spec, BPE merges ranked by piece score, user-defined pieces kept whole), so it encodes
    as SentencePiece does; ``legacy`` (default True) puts the dummy prefix before each piece between added tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    if not (folder / "tokenizer.model").is_file():
        raise SlowTokenizerError(f"{folder}: no tokenizer.model (transformers' generic tokenizer reads that file "
                                 f"only); {WRITE_TOKENIZER_JSON}")
    spm = read_sentencepiece_model(folder / "tokenizer.model")
    if spm.model_type not in (UNIGRAM, BPE):
        raise SlowTokenizerError(f"{folder / 'tokenizer.model'}: a SentencePiece model of type {spm.model_type} "
                                 f"(word or char), which transformers does not convert; {WRITE_TOKENIZER_JSON}")
    legacy = bool(config.get("legacy", True))
    if spm.model_type == BPE:
        vocab = {piece: index for index, (piece, _, _) in enumerate(spm.pieces)}
        decoder = config.get("added_tokens_decoder")
        if isinstance(decoder, dict) and decoder:  # added_tokens_decoder renames pieces (not onto a kept one)
            names = {int(index): token_text(token) for index, token in decoder.items()}
            kept = {token for token, index in vocab.items() if index not in names}
            vocab = {(names[i] if i in names and names[i] not in kept else token): i for token, i in vocab.items()}
        id_to_token = {index: token for token, index in vocab.items()}
    else:
        id_to_token = {index: piece for index, (piece, _, _) in enumerate(spm.pieces)}
    user_defined = [id_to_token[i] for i, (_, _, kind) in enumerate(spm.pieces) if kind == USER_DEFINED
                    and i in id_to_token]
    if spm.model_type == BPE:
        normal = {id_to_token[i]: (score, i) for i, (_, score, kind) in enumerate(spm.pieces)
                  if kind == NORMAL and i in id_to_token}
        ranked = sorted((-score, index, piece[:cut], piece[cut:]) for piece, (score, index) in normal.items()
                        for cut in range(1, len(piece)) if piece[:cut] in normal and piece[cut:] in normal)
        backend = Tokenizer(models.BPE(vocab, [(left, right) for *_, left, right in ranked], unk_token=spm.unk_piece,
                                       fuse_unk=True, byte_fallback=spm.byte_fallback, dropout=None,
                                       ignore_merges=bool(user_defined)))
    else:
        backend = Tokenizer(models.Unigram([(piece, score) for piece, score, _ in spm.pieces], unk_id=spm.unk_id,
                                           byte_fallback=spm.byte_fallback))
    steps = [normalizers.Precompiled(spm.precompiled_charsmap)] if spm.precompiled_charsmap else []
    if spm.remove_extra_whitespaces:  # spaces only: SentencePiece leaves newlines and tabs alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", METASPACE))
    if spm.add_dummy_prefix and legacy:  # Metaspace adds no prefix where the text starts with one; SentencePiece does
        steps.append(normalizers.Replace(Regex(f"\\A{METASPACE}"), METASPACE * 2))
    backend.normalizer = normalizers.Sequence(steps)
    splits = []
    if spm.add_dummy_prefix:
        splits.append(pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always" if legacy else "first",
                                               split=False))
    if user_defined:  # SentencePiece emits user-defined pieces whole and never merges them
        pattern = "|".join(re.escape(piece) for piece in sorted(user_defined, key=len, reverse=True))
        splits.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    if splits:
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
    steps = [decoders.Replace(METASPACE, " ")] + ([decoders.ByteFallback()] if spm.byte_fallback else [])
    if spm.add_dummy_prefix:
        steps += [decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    elif spm.byte_fallback:
        steps.append(decoders.Fuse())
    backend.decoder = decoders.Sequence(steps)
    backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    # transformers copies this tokenizer through its JSON, whose reader rounds some scores in the last digit
    backend = Tokenizer.from_str(backend.to_str())
    defaults = {}
    for name, index, piece in (("bos_token", spm.bos_id, spm.bos_piece), ("eos_token", spm.eos_id, spm.eos_piece),
                               ("unk_token", spm.unk_id, spm.unk_piece)):
        if index >= 0:
            defaults[name] = piece
    return SlowTokenizer(backend, defaults, sentencepiece=spm, added_user_defined=False,
                         added_raw=spm.add_dummy_prefix)


# -- Marian (opus-mt) ------------------------------------------------------------------------------------------
MARIAN_FILES = ("source.spm", "target.spm", "vocab.json")


class MarianPieces:
    """transformers' MarianTokenizer has no fast form: it cuts each text between added tokens with the source
    SentencePiece model (a leading ``>>lang<<`` code kept whole) and looks each piece up in vocab.json, where a
    span the model does not know is looked up by its text (it may be a target piece). As a custom pre-tokenizer
    this cuts the pieces (SentencePiece's whitespace rules, then its unigram model over each word) and a WordLevel
    model over vocab.json maps them, so the ids, offsets, padding and truncation are the backend's own."""

    def __init__(self, spm: SentencePieceModel):
        from tokenizers import Regex, models
        self.spm = spm
        # SentencePiece never matches its control and unknown pieces (<s>, <unk>) in text: they get names no text
        # holds (only the cut is used, not the ids)
        self.model = models.Unigram([(piece if kind not in (CONTROL, UNKNOWN) else f"\x00{index}", score)
                                     for index, (piece, score, kind) in enumerate(spm.pieces)],
                                    unk_id=spm.unk_id, byte_fallback=False)
        self.ends, self.runs = Regex(r"\A +| +\z"), Regex(" {2,}")

    def pre_tokenize(self, pretok) -> None:
        pretok.split(self._pieces)

    def _pieces(self, _, text) -> list:
        pieces = []
        original = text.original
        end = original.find("<<") if original.startswith(">>") else -1
        if end != -1 and str(text).startswith(original[:end + 2]):
            pieces.append(text[0:end + 2])
            if len(str(text)) == end + 2:
                return pieces
            text = text[end + 2:]
        if self.spm.remove_extra_whitespaces:  # spaces only: SentencePiece leaves newlines and tabs alone
            text.replace(self.ends, "")
            text.replace(self.runs, " ")
        if not str(text):
            return pieces
        if self.spm.escape_whitespaces:
            text.replace(" ", METASPACE)
        if self.spm.add_dummy_prefix:
            text.prepend(METASPACE)
        normalized = str(text)
        starts = [0] + [i for i, c in enumerate(normalized) if c == METASPACE and i > 0]
        for start, stop in zip(starts, starts[1:] + [len(normalized)]):
            word = normalized[start:stop]
            encoded, at = word.encode("utf-8"), start
            for token in self.model.tokenize(word):  # offsets in bytes of the word
                length = len(encoded[token.offsets[0]:token.offsets[1]].decode("utf-8"))
                pieces.append(text[at:at + length])
                at += length
        return pieces


class MarianText:
    """MarianTokenizer's decoding as a custom decoder: the text between special tokens decoded as the source
    SentencePiece model decodes pieces (leading spaces dropped until the first text, pieces it does not know kept
    as they are), each special token followed by a space, then every U+2581 a space and the ends stripped."""

    def __init__(self, spm: SentencePieceModel, specials):
        self.kinds = {piece: kind for piece, _, kind in spm.pieces}
        self.spm, self.specials = spm, set(specials)

    def _decode_pieces(self, pieces) -> str:
        text, at_start = "", self.spm.add_dummy_prefix
        for piece in pieces:
            kind = self.kinds.get(piece, UNKNOWN)
            if kind == UNKNOWN:
                surface = " \u2047 " if piece == self.spm.unk_piece else piece
            elif kind == CONTROL:
                surface = ""
            else:
                surface = (piece.lstrip(METASPACE) if at_start else piece).replace(METASPACE, " ")
            at_start = at_start and not surface
            text += surface
        return text

    def decode_chain(self, tokens: list[str]) -> list[str]:
        text, run = "", []
        for token in tokens:
            if token in self.specials:
                text += self._decode_pieces(run) + token + " "
                run = []
            else:
                run.append(token)
        text += self._decode_pieces(run)
        return [text.replace(METASPACE, " ").strip()]


def _marian(folder: Path, config: dict) -> SlowTokenizer:
    """transformers' MarianTokenizer (opus-mt translation models): source.spm cuts the text, target.spm the
    text_target, one vocab.json gives both their ids (see MarianPieces and MarianText)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    if config.get("separate_vocabs"):
        raise SlowTokenizerError(f"{folder}: a MarianTokenizer with separate source and target vocabularies "
                                 "(separate_vocabs); vkformers rebuilds Marian tokenizers of one shared vocab.json")
    source, target = (read_sentencepiece_model(_file(folder, name)) for name in ("source.spm", "target.spm"))
    for name, model in (("source.spm", source), ("target.spm", target)):
        if model.model_type != UNIGRAM or model.byte_fallback:
            raise SlowTokenizerError(f"{folder / name}: vkformers rebuilds MarianTokenizer over SentencePiece "
                                     "unigram models without byte fallback (as Marian trains them)")
    vocab = _read_json(_file(folder, "vocab.json"))
    unk = token_text(config.get("unk_token")) or "<unk>"
    if not isinstance(vocab, dict) or unk not in vocab:
        raise SlowTokenizerError(f"{folder / 'vocab.json'}: MarianTokenizer's vocabulary must map pieces to ids and "
                                 f"hold the unknown token {unk!r}")

    def cutting(model: SentencePieceModel) -> tuple:
        normalizer = normalizers.Precompiled(model.precompiled_charsmap) if model.precompiled_charsmap else None
        return normalizer, pre_tokenizers.PreTokenizer.custom(MarianPieces(model))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    backend.normalizer, backend.pre_tokenizer = cutting(source)
    # (the class named: a save writes the slow files, which a folder without config.json reads by it)
    defaults = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 512,
                "tokenizer_class": "MarianTokenizer"}

    def post_processor(tokenizer):
        eos = tokenizer.eos_token
        return processors.TemplateProcessing(single=["$A", eos], pair=["$A", "$B", eos],
                                             special_tokens=[(eos, tokenizer.eos_token_id)])

    def decoder(tokenizer):
        return decoders.Decoder.custom(MarianText(source, tokenizer.all_special_tokens))
    return SlowTokenizer(backend, defaults, post_processor, decoder=decoder, files=MARIAN_FILES,
                         target_mode=cutting(target))


BUILDERS = {"bert": _bert, "dpr": lambda folder, config: _bert(folder, config, lowercase=True),
            "gpt2": lambda folder, config: _byte_level(folder, config, roberta=False),
            "roberta": lambda folder, config: _byte_level(folder, config, roberta=True),
            "llama": _llama, "t5": _t5, "albert": _albert, "xlm-roberta": _xlm_roberta, "sentencepiece": _sentencepiece,
            "marian": _marian, "deberta-v2": _deberta_v2, "esm": _esm, "pegasus": _pegasus}
# DPR's tokenizers take do_lower_case but never hand it to BertTokenizer, whose default (lowercase) then holds


# -- added tokens -----------------------------------------------------------------------------------------------
ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(value, *, special: bool | None = None, normalized: bool | None = None):
    """A tokenizers.AddedToken of tokenizer_config.json's spelling (a string or a dict of its fields); ``special``
    and ``normalized`` override the spelling's where given."""
    from tokenizers import AddedToken
    fields = {k: v for k, v in value.items() if k in ADDED_TOKEN_FIELDS} if isinstance(value, dict) \
        else {"content": str(value), "special": bool(special)}
    for name, given in (("special", special), ("normalized", normalized)):
        if given is not None:
            fields[name] = given
    return AddedToken(**fields)


def _tokens_to_add(folder: Path, config: dict, slow: SlowTokenizer) -> list:
    """What transformers adds to the rebuilt tokenizer, in its order: tokenizer_config.json's added_tokens_decoder
    (else added_tokens.json) by id, the named special tokens, the additional special tokens, and a SentencePiece
    model's control (special) and user-defined (plain) pieces."""
    tokens, seen = [], set()
    raw = False if slow.added_raw else None  # matched before the normalizer: each piece gets its dummy prefix

    def add(token):
        if token.content not in seen:
            seen.add(token.content)
            tokens.append(token)

    decoder = config.get("added_tokens_decoder")
    named = {token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES} - {None}
    extra = extra_special_tokens(config)
    if isinstance(decoder, dict):  # even empty, it stands for added_tokens.json
        for index in sorted(decoder, key=int):
            add(_added_token(decoder[index], normalized=raw))
    elif (folder / "added_tokens.json").is_file():
        added = _read_json(folder / "added_tokens.json")
        # transformers marks special here the named tokens and tokenizer_config.json's own additional special
        # tokens, not those special_tokens_map.json adds
        own = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        specials = named | {token_text(t) for t in extra_special_tokens(own)}
        for content, _ in sorted(added.items(), key=lambda item: item[1]):
            add(_added_token({"content": content, "normalized": content not in specials},
                             special=content in specials, normalized=raw))
    by_content = {t.content: t for t in tokens}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if value is not None and token_text(value) not in by_content:
            add(_added_token(value, special=True))
    for value in extra:
        add(_added_token(value, special=True))
    if slow.sentencepiece is not None:
        for piece, _, kind in slow.sentencepiece.pieces:
            if kind == CONTROL or (kind == USER_DEFINED and slow.added_user_defined):
                add(_added_token({"content": piece, "normalized": False}, special=kind == CONTROL))
    return tokens


# -- entry point ------------------------------------------------------------------------------------------------
def tokenizer_class(config: dict, model_config: dict) -> str | None:
    """transformers' choice: tokenizer_config.json's tokenizer_class, else config.json's, else its model_type's;
    a model type of the generic TokenizersBackend overrides the class a checkpoint names."""
    named = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    model_type = model_config.get("model_type")
    if named:
        named = named if named == "PreTrainedTokenizerFast" else named.removesuffix("Fast")
        return "TokenizersBackend" if model_type in BACKEND_MODEL_TYPES else named
    if model_type in BACKEND_MODEL_TYPES or model_type in UNMAPPED_MODEL_TYPES:
        return "TokenizersBackend"
    return MODEL_TYPE_CLASSES.get(model_type)


def load_slow_tokenizer(folder: Path, config: dict, model_config: dict) -> SlowTokenizer:
    """The tokenizer transformers builds from ``folder``'s slow files, its special tokens added. ``config`` is
    tokenizer_config.json (with special_tokens_map.json), ``model_config`` config.json."""
    folder = Path(folder)
    present = slow_tokenizer_files(folder)
    if not set(present) - {"added_tokens.json"}:
        raise SlowTokenizerError(f"{folder}: no tokenizer.json, and none of {', '.join(SLOW_TOKENIZER_FILES[:-1])} "
                                 "(a tokenizer's files); point the tokenizer at the folder or repo that has them")
    name = tokenizer_class(config, model_config)
    kind = TOKENIZER_CLASSES.get(name)
    if kind is None:
        known = "no tokenizer_class in tokenizer_config.json and no model_type vkformers maps to one" \
            if name is None else f"tokenizer class {name}"
        raise SlowTokenizerError(
            f"{folder}: no tokenizer.json, only {', '.join(present)}, and {known}; vkformers rebuilds the slow "
            f"tokenizers of BertTokenizer, GPT2Tokenizer, RobertaTokenizer (and their aliases), LlamaTokenizer, "
            f"T5Tokenizer, AlbertTokenizer, XLMRobertaTokenizer, DebertaV2Tokenizer, PegasusTokenizer, "
            f"MarianTokenizer, EsmTokenizer and TokenizersBackend; "
            f"{WRITE_TOKENIZER_JSON}")
    slow = BUILDERS[kind](folder, config)
    full = {**slow.defaults, **config}
    slow.backend.add_tokens(_tokens_to_add(folder, full, slow))
    return slow


__all__ = ["SLOW_TOKENIZER_FILES", "SentencePieceModel", "SlowTokenizer", "SlowTokenizerError", "load_slow_tokenizer",
           "read_sentencepiece_model", "slow_tokenizer_files", "tokenizer_class"]
