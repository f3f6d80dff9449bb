"""Import llama.cpp ``.gguf`` files: config, float32 weights under Hugging Face names, and the tokenizer.

A GGUF file holds what a Hugging Face checkpoint spreads over config.json, model.safetensors, tokenizer.json
and tokenizer_config.json, in llama.cpp's spelling. :func:`load_gguf` turns it back::

    config, arrays, tokenizer = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    # config: a config.json dict (model_type "llama"); arrays: HF name -> float32 numpy;
    # tokenizer: a vkformers PreTrainedTokenizer (token ids identical to llama.cpp's vocabulary)

Reading uses the ``gguf`` package (llama.cpp's own Python reader, ``pip install 'vkformers[gguf]'``), whose
``gguf.quants.dequantize`` expands every quantisation it knows (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
the K-quants, ...) to float32. What llama.cpp changed on the way in is undone through the plugins' tables:

- each family plugin declares, per GGUF ``general.architecture``, a :class:`GGUFArchitecture` (hook
  ``vkformers_gguf_architectures``): the HF ``model_type``, the config built from the metadata keys, the tensor
  names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; experts stacked in one 3-D
  ``ffn_gate_exps`` split per expert) and the converter's tensor changes (:class:`TensorTransform`), such as
  llama's q/k row order (GGML's "normal" RoPE rotates neighbours, HF's the two halves:
  :func:`unpermute_rotary_rows`, :data:`LLAMA_ROTARY_TRANSFORMS`). This module is the generic reader;
- the tokenizer: a byte-level BPE ("gpt2") or SentencePiece ("llama") vocabulary rebuilt as a ``tokenizers``
  Tokenizer, with the control tokens as special tokens, BOS/EOS/PAD and the chat template.

A file whose architecture no installed plugin maps raises UnknownArchitectureError listing the mapped ones.

A model split by llama.cpp's ``gguf-split`` (``NAME-00001-of-00003.gguf``, ...: the first part holds the metadata,
every part its own tensors) is read whole from any of its parts (:func:`gguf_parts`). ``resolve_gguf_file`` finds a
GGUF file in a folder or a hub repo (transformers' ``from_pretrained(repo, gguf_file=NAME)``), fetching that file
alone with its other parts; ``gguf_file_of_tag`` picks a repo's file by its quantization tag (llama.cpp's
``-hf org/repo:Q4_K_M``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from vkformers.engine.quantized import GGUF_FORMATS, QuantizationError, QuantizedArray
from vkformers.errors import UnknownArchitectureError, VkformersError
from vkformers.models.config_check import model_dtype
from vkformers.models.hub import HubError, fetch_repo, is_path_name, local_path
from vkformers.models.lazy_weights import LazyWeights, Weight
from vkformers.models.module import CheckpointError
from vkformers.models.plugins import plugin_manager
from vkformers.models.tokenizer import PreTrainedTokenizer

INSTALL_HINT = "reading .gguf files needs the gguf package: pip install 'vkformers[gguf]' (or pip install gguf)"

# Tensor types read as float arrays; the others are blocks (kept packed unless dequantize=True).
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# Tensors llama.cpp derives from the config (llama 3's rope frequency divisors): a plugin's config function reads
# them back (GGUFMetadata.tensor); they are no weight.
DERIVED_TENSORS = ("rope_freqs",)
# The global tensors most architectures share (GGUF stem -> HF stem).
DECODER_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's gguf-split: every part holds these keys (the first also all other metadata) and is named
# NAME-%05d-of-%05d.gguf (its number from 1, then the count).
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT = "split.no", "split.count", "split.tensors.count"
SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})(?P<suffix>\.gguf)", re.IGNORECASE)

# the fill-in-the-middle tokens' keys (llama.cpp's, then the older names it still reads), by the role
# PreTrainedTokenizer.fim_token_ids gives them (models/fill_in_middle.py)
GGUF_FIM_KEYS = {"prefix": ("fim_pre_token_id", "prefix_token_id"), "suffix": ("fim_suf_token_id", "suffix_token_id"),
                 "middle": ("fim_mid_token_id", "middle_token_id"), "pad": ("fim_pad_token_id",),
                 "repo": ("fim_rep_token_id",), "separator": ("fim_sep_token_id",)}

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# How byte-level vocabularies split text before BPE ("tokenizer.ggml.pre", as llama.cpp's converter names the
# model's pre-tokenizer): the steps of the Hugging Face tokenizer's pre-tokenizer, in order. ("split", regex):
# isolate the regex's matches; ("digits", each): digits apart (each one alone, or in runs); ("punctuation",): runs
# of punctuation apart; ("bytes", regex): the byte alphabet, after GPT-2's split where regex is true. A name not
# here is refused: another split gives other tokens than the model's.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT2 = (("bytes", True),)
_DIGITS_GPT2 = (("digits", True), ("bytes", True))  # GPT-2's split after each digit stands alone
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
BYTE_LEVEL_SPLITS = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2,
    "olmo": _GPT2, "mpt": _GPT2,  # GPT-NeoX's tokenizer
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2, "command-r": _DIGITS_GPT2,
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"),
                    (("split", _LLAMA3_SPLIT), ("bytes", False))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), (("split", _QWEN2_SPLIT), ("bytes", False))),
    "falcon": (("punctuation",), ("bytes", True), ("digits", False), ("split", "[0-9][0-9][0-9]")),
    "deepseek-coder": (("split", "[\r\n]"), ("split", r"\s?\p{L}+"), ("split", r"\s?\p{P}+"), ("split", _CJK),
                       ("digits", True), ("bytes", False)),
}


def is_gguf_file(name_or_path) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def _gguf(hint: str = INSTALL_HINT):
    try:
        import gguf  # the optional [gguf] extra: imported only when a GGUF file is read or written
    except ImportError:
        raise VkformersError(hint) from None
    return gguf


def _reader(path):
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return _gguf().GGUFReader(str(path))
    except VkformersError:
        raise
    except Exception as exc:  # the reader raises ValueError/struct.error/... on foreign or truncated files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


# -- split files (llama.cpp's gguf-split) -----------------------------------------------------------------------
def split_part_names(name: str) -> list[str]:
    """The names of every part of the split GGUF whose part ``name`` names, in order (``m-00002-of-00003.gguf`` ->
    ``m-00001-of-00003.gguf``, ``m-00002-...``, ``m-00003-...``; a folder before it kept); ``[name]`` for a name
    that is no part's."""
    found = SPLIT_NAME.fullmatch(str(name))
    if found is None or not 1 <= int(found["no"]) <= int(found["count"]):
        return [str(name)]
    count = int(found["count"])
    return [f"{found['prefix']}-{i:05d}-of-{count:05d}{found['suffix']}" for i in range(1, count + 1)]


def _split_keys(reader, path: Path) -> tuple[int, int, int] | None:
    """(split.no, split.count, split.tensors.count) of a part of a split GGUF; None for a whole file."""
    fields = reader.fields
    if SPLIT_COUNT not in fields or _field_value(fields[SPLIT_COUNT]) <= 1:
        return None
    if SPLIT_NO not in fields or SPLIT_TENSORS_COUNT not in fields:
        raise CheckpointError(f"{path}: a part of a split GGUF without {SPLIT_NO} or {SPLIT_TENSORS_COUNT}; "
                              "download the file again")
    return (int(_field_value(fields[SPLIT_NO])), int(_field_value(fields[SPLIT_COUNT])),
            int(_field_value(fields[SPLIT_TENSORS_COUNT])))


def _part_paths(path: Path, no: int, count: int) -> list[Path]:
    """The paths of every part of the split GGUF ``path`` is part ``no`` (from 0) of, by gguf-split's names."""
    found = SPLIT_NAME.fullmatch(path.name)
    if found is None or (int(found["no"]), int(found["count"])) != (no + 1, count):
        raise CheckpointError(f"{path}: part {no + 1} of a GGUF split into {count} files, but not named as "
                              f"gguf-split names it (NAME-{no + 1:05d}-of-{count:05d}.gguf), so its other parts "
                              "cannot be found; give it back that name")
    return [path.parent / name for name in split_part_names(path.name)]


class SplitReader:
    """The parts of a split GGUF read as one file: the first part's metadata (``fields``), every part's tensors
    (``tensors``, each memory-mapped from its own file), and the part files (``paths``)."""

    def __init__(self, readers: list, paths: list[Path]):
        self.fields = readers[0].fields
        self.tensors = [tensor for reader in readers for tensor in reader.tensors]
        self.paths = paths


def _open(path):
    """The reader of the GGUF model at ``path``: a whole file's, or a :class:`SplitReader` over every part of a split
    one (``path`` any part), each part checked to be there, numbered as its name says and the tensors all there."""
    path = Path(path).expanduser()
    reader = _reader(path)
    split = _split_keys(reader, path)
    if split is None:
        return reader
    no, count, _ = split
    paths = _part_paths(path, no, count)
    missing = [part.name for part in paths if not part.is_file()]
    if missing:
        raise CheckpointError(f"{path}: a GGUF split into {count} files, and {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}; download every part "
                              "into the same folder")
    readers = []
    for index, part in enumerate(paths):
        part_reader = reader if index == no else _reader(part)
        keys = _split_keys(part_reader, part)
        if keys is None or keys[:2] != (index, count):
            said = "no split keys" if keys is None else f"{SPLIT_NO}={keys[0]}, {SPLIT_COUNT}={keys[1]}"
            raise CheckpointError(f"{part}: not part {index + 1} of {count} of this split GGUF ({said}); download "
                                  "the parts of one file again")
        readers.append(part_reader)
    total = _split_keys(readers[0], paths[0])[2]
    found = sum(len(r.tensors) for r in readers)
    if found != total:
        raise CheckpointError(f"{paths[0]}: {SPLIT_TENSORS_COUNT} says {total} tensors, the {count} parts hold "
                              f"{found}; a part is from another file or damaged: download the parts again")
    whole = SplitReader(readers, paths)
    names = [tensor.name for tensor in whole.tensors]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise CheckpointError(f"{paths[0]}: tensor {twice[0]} is in several parts of the split GGUF; download the "
                              "parts again")
    return whole


def _metadata_reader(path):
    """The reader of the file holding a GGUF model's metadata: ``path``, or the first part of the split GGUF it is a
    part of (the other parts need not be there)."""
    path = Path(path).expanduser()
    reader = _reader(path)
    split = _split_keys(reader, path)
    if split is None or split[0] == 0:
        return reader
    return _reader(_part_paths(path, split[0], split[1])[0])


def gguf_parts(path) -> list[Path]:
    """The files of the GGUF model at ``path``: ``[path]``, or every part of the split GGUF it is any part of, in
    order (CheckpointError naming the parts missing, or a part that belongs elsewhere)."""
    reader = _open(path)
    return list(reader.paths) if isinstance(reader, SplitReader) else [Path(path).expanduser()]


# -- from a folder or a hub repo ------------------------------------------------------------------------------
def _check_gguf_file_name(gguf_file) -> str:
    name = str(gguf_file).replace("\\", "/")
    if not is_gguf_file(name) or name.startswith("/") or ".." in name.split("/"):
        raise VkformersError(f"gguf_file={gguf_file!r}: name a .gguf file inside the folder or hub repo (such as "
                             "'model.Q4_K_M.gguf' or 'sub/model-00001-of-00002.gguf')")
    return name


def resolve_gguf_file(name_or_path, gguf_file: str, *, all_parts: bool = True, revision: str | None = None,
                      cache_dir=None, token=None, local_files_only: bool = False) -> Path:
    """transformers' ``from_pretrained(folder_or_repo, gguf_file=NAME)``: the path of file NAME inside a local folder,
    or of a hub repo fetched into the HF cache alone (models/hub.py's options), with the other parts of a split GGUF
    (``all_parts=False``: only the first part, which holds the metadata; its path is returned)."""
    name = _check_gguf_file_name(gguf_file)
    names = split_part_names(name) if all_parts else split_part_names(name)[:1]
    path = local_path(name_or_path)
    if path.is_dir():
        file = path / (name if all_parts else names[0])
        if not file.is_file():
            raise CheckpointError(f"{path}: no {file.relative_to(path)} in this folder")
        return file
    if path.exists() or is_gguf_file(name_or_path):
        raise VkformersError(f"{name_or_path} with gguf_file={gguf_file!r}: gguf_file names a file inside a folder or "
                             "hub repo; pass a .gguf file alone, without gguf_file")
    if is_path_name(name_or_path):
        raise CheckpointError(f"{name_or_path}: no such folder")
    folder = fetch_repo(str(name_or_path), [_literal_pattern(n) for n in names], what="GGUF repo",
                        revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise HubError(f"hub repo {name_or_path!r}{f' (revision {revision})' if revision else ''} has no "
                       f"{', '.join(missing)}; check the file name in the repo's file list")
    return folder / (name if all_parts else names[0])


def _literal_pattern(name: str) -> str:
    """``name`` as an fnmatch pattern matching itself alone (the hub's allow_patterns)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def parse_repo_tag(name) -> tuple[str, str] | None:
    """(repo id, tag) of llama.cpp's ``-hf`` spelling ``org/repo:TAG``; None for any other name (a local path
    first: a file or folder of that name is taken as it is)."""
    text = str(name)
    found = re.fullmatch(r"([\w.-]+/[\w.-]+):([\w.-]+)", text)
    if found is None or local_path(text).exists():
        return None
    return found[1], found[2]


def gguf_file_of_tag(repo_id: str, tag: str, *, revision: str | None = None, token=None) -> str:
    """The GGUF file of hub repo ``repo_id`` that llama.cpp's ``-hf repo_id:TAG`` runs: the one whose name holds
    ``tag`` in any case (of a split GGUF, its first part; a vision projector ``mmproj`` file is never the model).
    Where several hold it, the one where it stands alone (``Q2_K`` picks ``m.Q2_K.gguf`` over ``m.Q2_K_L.gguf``); a
    tag none or several hold is a VkformersError listing the repo's GGUF files."""
    from huggingface_hub import constants, list_repo_files  # slow to import: only for a hub name
    try:
        files = list_repo_files(repo_id, revision=revision, token=token)
    except Exception as exc:  # huggingface_hub raises many types; all mean "could not list it"
        mode = "offline (HF_HUB_OFFLINE is set): " if constants.HF_HUB_OFFLINE else ""
        raise HubError(f"{repo_id}:{tag}: {mode}the repo's files could not be listed to pick the file of tag {tag!r} "
                       f"({type(exc).__name__}: {exc}); name the file instead (gguf_file= or --gguf-file)") from None
    models = sorted(f for f in files if is_gguf_file(f) and "mmproj" not in f.rsplit("/", 1)[-1].lower()
                    and split_part_names(f)[0] == f)
    held = [f for f in models if tag.lower() in f.rsplit("/", 1)[-1].lower()]
    alone = [f for f in held if re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])",
                                          f.rsplit("/", 1)[-1], re.IGNORECASE)]
    if len(held) == 1 or len(alone) == 1:
        return held[0] if len(held) == 1 else alone[0]
    listing = ", ".join(models) or "none"
    if not held:
        raise VkformersError(f"{repo_id}:{tag}: no GGUF file of the repo has {tag!r} in its name (its GGUF files: "
                             f"{listing}); give one of their quantization tags")
    raise VkformersError(f"{repo_id}:{tag}: several GGUF files of the repo have {tag!r} in their names "
                         f"({', '.join(held)}); give a longer tag, or the file as --gguf-file NAME")


# -- metadata -------------------------------------------------------------------------------------------------
def _field_value(field):
    """A metadata value as Python (str, int, float, bool or a list of them); works on every gguf >= 0.10."""
    from gguf import GGUFValueType  # the optional [gguf] extra (see _gguf)
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if not field.data:
            return []
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    part = field.parts[field.data[0]]
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    value = part[0].item()
    return bool(value) if kind == GGUFValueType.BOOL else value


def read_metadata(reader) -> dict:
    return {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


@dataclass(frozen=True)
class TensorTransform:
    """What llama.cpp's converter did to a tensor, undone: ``function(array, config)`` takes the array in HF's
    dimension order (as in the file) and returns HF's. ``reorders_rows``: a pure permutation of whole rows,
    which applies to packed blocks as well; any other transform expands a quantized tensor first."""

    function: Callable[[np.ndarray, dict], np.ndarray]
    reorders_rows: bool = False
    inverse: Callable[[np.ndarray, dict], np.ndarray] | None = None  # HF's array -> the file's (for writing)


@dataclass(frozen=True)
class GGUFArchitecture:
    """How the files of one GGUF ``general.architecture`` map to a Hugging Face ``model_type``.

    ``config(metadata)`` builds config.json from a :class:`GGUFMetadata` (``metadata.common_config()`` has
    the keys decoders share). ``layer_tensors`` maps the stem after ``blk.N.`` (``attn_q``) to the HF name
    after ``<layer_prefix>.N.`` (``self_attn.q_proj``); a name with ``{expert}`` splits a 3-D expert tensor
    (``ffn_gate_exps``) into one HF tensor per expert. ``tensors`` maps the global stems. ``transforms`` (by
    GGUF stem) undo the converter's changes. ``skipped``: stems with no HF twin (derived or duplicated data).
    ``applies(metadata)``: whether this entry reads the file, for a GGUF name shared by several (llama with
    experts is Mixtral); None: always (tried after those with a test). ``metadata(config)``: the inverse of
    ``config``, the keys (after ``<arch>.``) llama.cpp needs to run the model; None: not written as GGUF.
    """

    name: str
    model_type: str
    hf_class: str
    config: Callable[["GGUFMetadata"], dict]
    layer_tensors: Mapping[str, str]
    tensors: Mapping[str, str] = field(default_factory=lambda: dict(DECODER_TENSORS))
    layer_prefix: str = "model.layers"
    transforms: Mapping[str, TensorTransform] = field(default_factory=dict)
    skipped: tuple[str, ...] = DERIVED_TENSORS
    applies: Callable[["GGUFMetadata"], bool] | None = None
    metadata: Callable[[dict], dict] | None = None

    def gguf_name(self, hf_name: str) -> tuple[str, str] | None:
        """The inverse of :meth:`hf_name`: ``model.layers.3.self_attn.q_proj.weight`` -> (``blk.3.attn_q.weight``,
        ``attn_q``); None for a name the tables do not hold (experts included)."""
        stem, _, suffix = hf_name.rpartition(".")
        layer = re.fullmatch(re.escape(self.layer_prefix) + r"\.(\d+)\.(.+)", stem)
        if layer:
            found = [g for g, hf in self.layer_tensors.items() if hf == layer.group(2)]
            return (f"blk.{layer.group(1)}.{found[0]}.{suffix}", found[0]) if found else None
        found = [g for g, hf in self.tensors.items() if hf == stem and g not in self.skipped]
        return (f"{found[0]}.{suffix}", found[0]) if found else None

    def hf_name(self, gguf_name: str) -> tuple[str, str] | None:
        """``blk.3.attn_q.weight`` -> (``model.layers.3.self_attn.q_proj.weight``, ``attn_q``); None for a
        name with no HF twin. An expert tensor's name keeps its ``{expert}`` field."""
        stem, _, suffix = gguf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        if layer and layer.group(2) in self.layer_tensors:
            hf = self.layer_tensors[layer.group(2)]
            return f"{self.layer_prefix}.{layer.group(1)}.{hf}.{suffix}", layer.group(2)
        if stem in self.tensors:
            return f"{self.tensors[stem]}.{suffix}", stem
        return None

    def is_skipped(self, gguf_name: str) -> bool:
        stem = gguf_name.rpartition(".")[0]
        return stem in self.skipped or stem.partition(".")[2].partition(".")[2] in self.skipped


class GGUFMetadata:
    """A file's metadata, read by the keys of its architecture (``get("block_count")`` reads
    ``<arch>.block_count``), with the HF-order shapes of its tensors."""

    def __init__(self, values: dict, tensor_shapes: Mapping[str, tuple[int, ...]],
                 read_tensor: Callable[[str], np.ndarray] | None = None):
        self.values = values
        self.architecture = values.get("general.architecture")
        self.tensor_shapes = dict(tensor_shapes)
        self._read_tensor = read_tensor

    def tensor(self, name: str) -> np.ndarray | None:
        """A tensor's values (float32), for config llama.cpp keeps as data (llama 3's rope_freqs); None when the
        file has no such tensor or only its metadata was given."""
        if self._read_tensor is None or name not in self.tensor_shapes:
            return None
        return self._read_tensor(name)

    def get(self, key: str, default=None):
        return self.values.get(f"{self.architecture}.{key}", default)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensor_shapes

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.tensor_shapes.get(name)

    def common_config(self) -> dict:
        """The config keys a llama-like decoder reads, from the metadata every llama.cpp decoder writes (with
        rope_scaling where the file has a linear or YaRN one)."""
        hidden = self.get("embedding_length")
        heads = self.get("attention.head_count")
        ffn = self.get("feed_forward_length")
        if not ffn and self.shape("blk.0.ffn_up.weight"):
            ffn = self.shape("blk.0.ffn_up.weight")[0]
        config = {
            "hidden_size": hidden,
            "num_hidden_layers": self.get("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.get("attention.head_count_kv", heads),
            "intermediate_size": ffn,
            "head_dim": self.get("attention.key_length", hidden // heads if hidden and heads else None),
            "max_position_embeddings": self.get("context_length", 2048),
            "rms_norm_eps": self.get("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": self.get("rope.freq_base", 10000.0),
            "hidden_act": "silu",
            "tie_word_embeddings": not self.has_tensor("output.weight"),
            "vocab_size": self.get("vocab_size") or len(self.values.get("tokenizer.ggml.tokens") or []) or None,
        }
        if self.rope_scaling():
            config["rope_scaling"] = self.rope_scaling()
        return config

    def rope_scaling(self) -> dict | None:
        scaling = self.get("rope.scaling.type")
        if scaling not in ("linear", "yarn") or not self.get("rope.scaling.factor"):
            return None
        rope = {"rope_type": scaling, "factor": self.get("rope.scaling.factor")}
        if self.get("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = self.get("rope.scaling.original_context_length")
        return rope


def common_metadata(config: dict) -> dict:
    """The inverse of :meth:`GGUFMetadata.common_config`: the metadata keys (after ``<arch>.``) of a llama-like
    decoder's config, as llama.cpp's converter writes them."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}  # transformers 4 / 5 spellings
    values = {
        "block_count": config["num_hidden_layers"],
        "context_length": config.get("max_position_embeddings", 2048),
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": config.get("num_key_value_heads") or heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-5)),
        "rope.freq_base": float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        "rope.dimension_count": head_dim,
        "vocab_size": config["vocab_size"],
    }
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("linear", "yarn"):
        values.update({"rope.scaling.type": kind, "rope.scaling.factor": float(rope["factor"])})
        if rope.get("original_max_position_embeddings"):
            values["rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
    elif kind != "default":
        raise CheckpointError(f"rope_scaling of type {kind!r} is not written as GGUF metadata by vkformers; save "
                              "the model dequantized as safetensors instead")
    return values


def gguf_architectures() -> list[GGUFArchitecture]:
    """Every GGUF mapping the installed plugins declare (hook ``vkformers_gguf_architectures``)."""
    return [entry for entries in plugin_manager().hook.vkformers_gguf_architectures() for entry in entries]


def gguf_architecture(metadata: GGUFMetadata) -> GGUFArchitecture:
    """The entry that reads this file; UnknownArchitectureError naming the mapped ones when none does."""
    entries = [e for e in gguf_architectures() if e.name == metadata.architecture]
    for entry in sorted(entries, key=lambda e: e.applies is None):
        if entry.applies is None or entry.applies(metadata):
            return entry
    mapped = sorted({e.name for e in gguf_architectures()})
    raise UnknownArchitectureError(
        f"GGUF architecture {metadata.architecture!r} is not mapped by any installed vkformers plugin (mapped: "
        f"{', '.join(mapped) or 'none'}); install the plugin of that family or convert the model to safetensors")


def config_from_metadata(meta: dict, tensor_shapes, read_tensor: Callable[[str], np.ndarray] | None = None) -> dict:
    """The config.json a transformers checkpoint of this model has (``tensor_shapes``: name -> HF-order shape,
    or only the names; ``read_tensor``: a tensor's values by name, for config kept as data)."""
    if not isinstance(tensor_shapes, Mapping):
        tensor_shapes = {name: () for name in tensor_shapes}
    metadata = GGUFMetadata(meta, tensor_shapes, read_tensor)
    entry = gguf_architecture(metadata)
    config = {"architectures": [entry.hf_class], "model_type": entry.model_type, **entry.config(metadata)}
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[name] = meta[f"tokenizer.ggml.{key}"]
    return config


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (for the dense entry of
    ``architecture``); None for names with no HF twin."""
    entries = [e for e in gguf_architectures() if e.name == architecture]
    entry = next((e for e in entries if e.applies is None), entries[0] if entries else None)
    if entry is None:
        gguf_architecture(GGUFMetadata({"general.architecture": architecture}, {}))  # raises the named error
    found = entry.hf_name(gguf_name)
    return None if found is None or entry.is_skipped(gguf_name) else found[0]


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reordering of q/k rows: per head, HF's [first half | second half] of the
    rotary dimension becomes interleaved pairs (h0, h(d/2), h1, h(d/2+1), ...). Kept for tests and writers."""
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of :func:`permute_rotary_rows`: interleaved pairs back to HF's half-split rows."""
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _unpermute_queries(weight: np.ndarray, config: dict) -> np.ndarray:
    return unpermute_rotary_rows(weight, config["num_attention_heads"])


def _unpermute_keys(weight: np.ndarray, config: dict) -> np.ndarray:
    return unpermute_rotary_rows(weight, config["num_key_value_heads"])


# llama.cpp permutes attn_q/attn_k of the architectures it runs with GGML's adjacent-pair RoPE while HF
# rotates half-split pairs (llama, Mistral and Mixtral written as llama); these undo it, packed blocks too.
def _permute_queries(weight: np.ndarray, config: dict) -> np.ndarray:
    return permute_rotary_rows(weight, config["num_attention_heads"])


def _permute_keys(weight: np.ndarray, config: dict) -> np.ndarray:
    return permute_rotary_rows(weight, config["num_key_value_heads"])


LLAMA_ROTARY_TRANSFORMS = {
    "attn_q": TensorTransform(_unpermute_queries, reorders_rows=True, inverse=_permute_queries),
    "attn_k": TensorTransform(_unpermute_keys, reorders_rows=True, inverse=_permute_keys)}


def dequantize_tensor(tensor) -> np.ndarray:
    """A reader tensor as float32 numpy in HF's shape (GGUF lists dimensions innermost first)."""
    gguf = _gguf()
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise VkformersError(f"GGUF tensor {tensor.name}: quantisation {tensor.tensor_type.name} cannot be "
                             f"expanded by gguf {getattr(gguf, '__version__', '')} (upgrade the gguf package)") from None
    return np.array(values, dtype=np.float32).reshape(shape)  # a copy: the reader's arrays map the file


def check_packable(tensor) -> None:
    """QuantizationError where :func:`packed_tensor` cannot keep ``tensor``'s blocks."""
    if tensor.tensor_type.name.lower() not in GGUF_FORMATS or len(tensor.shape) not in (2, 3):
        raise QuantizationError(
            f"GGUF tensor {tensor.name}: block type {tensor.tensor_type.name} is not supported quantized "
            f"(supported: {', '.join(f.upper() for f in GGUF_FORMATS)}); load with dequantize=True to expand it")


def packed_tensor(tensor) -> QuantizedArray:
    """A quantized reader tensor as its packed blocks (no expansion), for a block type the kernels read; a 3-D
    (expert) tensor comes as one QuantizedArray of all its experts' rows, split by :func:`read_tensors`."""
    check_packable(tensor)
    fmt = tensor.tensor_type.name.lower()
    dims = [int(d) for d in reversed(tensor.shape)]
    rows, cols = int(np.prod(dims[:-1])), dims[-1]
    return QuantizedArray(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1), fmt, (rows, cols))


def read_tensors(reader, config: dict, *, keep_quantized: bool = False, entry: GGUFArchitecture | None = None
                 ) -> dict[str, np.ndarray]:
    """HF name -> float32 array; with ``keep_quantized``, block-quantized tensors as QuantizedArray (packed)."""
    return dict(tensor_weights(reader, config, keep_quantized=keep_quantized, entry=entry))


def tensor_weights(reader, config: dict, *, keep_quantized: bool = False, entry: GGUFArchitecture | None = None
                   ) -> LazyWeights:
    """:func:`read_tensors`, each tensor read (expanded or packed, transformed, an expert's rows taken) only when
    it is looked up (models/lazy_weights.py)."""
    if entry is None:
        entry = gguf_architecture(GGUFMetadata(read_metadata(reader), _tensor_shapes(reader)))
    weights, unknown = {}, []
    for tensor in reader.tensors:
        found = entry.hf_name(tensor.name)
        if found is None or entry.is_skipped(tensor.name):
            if not entry.is_skipped(tensor.name):
                unknown.append(tensor.name)
            continue
        name, stem = found
        transform = entry.transforms.get(stem)
        keep = (keep_quantized and tensor.tensor_type.name not in FLOAT_TYPES
                and (transform is None or transform.reorders_rows))
        if keep:
            check_packable(tensor)  # before anything is read
        dims = tuple(int(d) for d in reversed(tensor.shape))
        if "{expert}" not in name:
            shape = (int(np.prod(dims[:-1])), dims[-1]) if keep else dims if transform is None or \
                transform.reorders_rows else None
            weights[name] = Weight(shape, partial(_read_tensor, tensor, config, transform, keep))
            continue
        experts = dims[0] if len(dims) == 3 else 1
        shape = dims[1:] if len(dims) == 3 and transform is None else None
        for e in range(experts):
            weights[name.format(expert=e)] = Weight(shape, partial(_read_expert, tensor, e, experts, config,
                                                                   transform, keep))
    if unknown:
        raise CheckpointError(f"GGUF tensors with no Hugging Face name in the {entry.name!r} mapping: "
                              f"{', '.join(unknown[:8])}" + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else ""))
    return LazyWeights(weights)


def _read_tensor(tensor, config: dict, transform: TensorTransform | None, keep: bool):
    """One tensor of the file as its HF weight: packed blocks (rows reordered) or float32."""
    if keep:
        array = packed_tensor(tensor)
        if transform is not None:
            array.packed = transform.function(array.packed, config)
        return array
    array = dequantize_tensor(tensor)
    if transform is not None:
        array = np.ascontiguousarray(transform.function(array, config), dtype=np.float32)
    return array


def _read_expert(tensor, expert: int, experts: int, config: dict, transform: TensorTransform | None, keep: bool):
    """Expert ``expert``'s rows of a 3-D expert tensor; only its own rows are read where no transform needs the
    whole tensor."""
    if len(tensor.shape) == 3 and transform is None:
        if keep:
            return packed_tensor(_Rows(tensor, expert))
        return dequantize_tensor(_Rows(tensor, expert))
    array = _read_tensor(tensor, config, transform, keep)
    if not keep:
        return np.ascontiguousarray(array[expert])
    rows, cols = array.shape[0] // experts, array.shape[1]
    return QuantizedArray(np.ascontiguousarray(array.packed[expert * rows:(expert + 1) * rows]), array.format,
                          (rows, cols))


class _Rows:
    """The rows of one expert of a 3-D reader tensor, as a 2-D reader tensor (what dequantize_tensor and
    packed_tensor read)."""

    def __init__(self, tensor, expert: int):
        self.name, self.tensor_type = tensor.name, tensor.tensor_type
        self.shape = tensor.shape[:2]   # GGUF order, innermost first
        self.data = tensor.data[expert]


def _tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


# -- tokenizer ------------------------------------------------------------------------------------------------
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of every byte-level BPE vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_model(meta: dict, name_or_path: str = ""):
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors  # loaded only for a GGUF's tokenizer
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    tokens = meta["tokenizer.ggml.tokens"]
    # Converters write the vocabulary in the byte alphabet already; respell the odd token written as raw text. An
    # added token (control or user-defined: GPT-NeoX's runs of spaces) keeps its text, which tokenizer_from_metadata
    # matches whole, so that it finds its own id.
    types = meta.get("tokenizer.ggml.token_type") or []
    vocab = {}
    for index, token in enumerate(tokens):
        added = index < len(types) and types[index] in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        if not added and not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    model = models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False)
    name = meta.get("tokenizer.ggml.pre", "default")
    if name not in BYTE_LEVEL_SPLITS:
        raise VkformersError(f"{name_or_path}: the GGUF tokenizer splits text as {name!r}, which vkformers does not "
                             "know (its tokens would differ from the model's); use the model's Hugging Face "
                             "tokenizer (--tokenizer REPO_OR_FOLDER, or AutoTokenizer.from_pretrained(REPO))")
    make = {"split": lambda regex: pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            "digits": lambda each: pre_tokenizers.Digits(individual_digits=each),
            "punctuation": lambda: pre_tokenizers.Punctuation("contiguous"),
            "bytes": lambda regex: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex)}
    pre = pre_tokenizers.Sequence([make[kind](*args) for kind, *args in BYTE_LEVEL_SPLITS[name]])
    return model, None, pre, decoders.ByteLevel(), processors.ByteLevel(trim_offsets=False)


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps scores, not merges: every split of a piece into two known pieces is a merge,
    ranked by the merged piece's score (higher first), as sentencepiece applies them."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for token, score, kind in zip(tokens, scores, types):
        if kind not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_model(meta: dict):
    from tokenizers import decoders, models, normalizers  # loaded only for a GGUF's tokenizer
    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab, _sentencepiece_merges(tokens, scores, types), unk_token=unk, fuse_unk=True,
                       byte_fallback=any(t == TOKEN_BYTE for t in types))
    # SentencePiece writes spaces as U+2581 and (by default) starts the text with one.
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    decoder = decoders.Sequence(decode + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return model, normalizer, None, decoder, None


def tokenizer_from_metadata(meta: dict, *, name_or_path: str = ""):
    """The vkformers tokenizer a GGUF's ``tokenizer.*`` metadata describes."""
    from tokenizers import AddedToken, Tokenizer  # loaded only for a GGUF's tokenizer

    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{name_or_path}: the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    if kind == "gpt2":
        model, normalizer, pre, decoder, post = _byte_level_model(meta, name_or_path)
    elif kind == "llama":
        model, normalizer, pre, decoder, post = _sentencepiece_model(meta)
    else:
        raise VkformersError(f"{name_or_path}: GGUF tokenizer model {kind!r} is not supported "
                             "(vkformers reads 'gpt2' byte-level BPE and 'llama' SentencePiece)")
    backend = Tokenizer(model)
    for part, value in (("normalizer", normalizer), ("pre_tokenizer", pre), ("decoder", decoder),
                        ("post_processor", post)):
        if value is not None:
            setattr(backend, part, value)
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    # Control tokens (<|im_start|>, <s>, ...) must match whole and decode away with skip_special_tokens;
    # user-defined ones match whole but are text.
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_CONTROL]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)

    config = {"model_max_length": meta.get(f"{meta.get('general.architecture')}.context_length")}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is not None and 0 <= index < len(tokens):
            config[name] = tokens[index]
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise, never to byte-level ones.
    config["add_bos_token"] = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    config["add_eos_token"] = meta.get("tokenizer.ggml.add_eos_token", False)
    named = {key.split(".", 2)[2]: value for key, value in meta.items() if key.startswith("tokenizer.chat_template.")}
    if named:
        config["chat_template"] = [{"name": n, "template": t} for n, t in named.items()]
        if "tokenizer.chat_template" in meta:
            config["chat_template"].insert(0, {"name": "default", "template": meta["tokenizer.chat_template"]})
    elif "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    tokenizer = PreTrainedTokenizer(backend, config, name_or_path=name_or_path)
    for role, keys in GGUF_FIM_KEYS.items():
        index = next((meta[f"tokenizer.ggml.{key}"] for key in keys if f"tokenizer.ggml.{key}" in meta), None)
        if index is not None and 0 <= index < len(tokens):  # (llama.cpp writes -1 for none)
            tokenizer.fim_token_ids[role] = int(index)
    return tokenizer


# -- entry points ---------------------------------------------------------------------------------------------
def load_gguf(path, *, tokenizer: bool = True, dequantize: bool = True):
    """``(config, arrays, tokenizer)`` of a GGUF file: a config.json dict, float32 numpy arrays under HF
    names (q/k rows restored to HF's rotary order), and a PreTrainedTokenizer (None with tokenizer=False).
    ``dequantize=False``: block-quantized tensors come as QuantizedArray, packed as in the file. Every tensor is
    read here; :func:`gguf_weights` reads each when it is used."""
    config, weights, tok = _load_gguf(path, tokenizer=tokenizer, dequantize=dequantize)
    return config, dict(weights), tok


def _load_gguf(path, *, tokenizer: bool, dequantize: bool):
    reader = _open(path)
    meta = read_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    metadata = GGUFMetadata(meta, _tensor_shapes(reader))
    entry = gguf_architecture(metadata)
    config = config_from_metadata(meta, metadata.tensor_shapes, lambda name: dequantize_tensor(by_name[name]))
    arrays = tensor_weights(reader, config, keep_quantized=not dequantize, entry=entry)
    if config.get("vocab_size") is None and "token_embd.weight" in metadata.tensor_shapes:
        config["vocab_size"] = metadata.tensor_shapes["token_embd.weight"][0]
    return config, arrays, tokenizer_from_metadata(meta, name_or_path=str(path)) if tokenizer else None


def gguf_weights(path, *, dequantize: bool = True) -> tuple[dict, LazyWeights]:
    """``(config, weights)`` of a GGUF file as :func:`load_gguf` gives them, each tensor read only when it is
    looked up: a model loads one tensor at a time."""
    config, weights, _ = _load_gguf(path, tokenizer=False, dequantize=dequantize)
    return config, weights


def load_gguf_tokenizer(path):
    """Only the tokenizer of a GGUF file (no tensor is expanded; of a split GGUF, the first part alone is read)."""
    return tokenizer_from_metadata(read_metadata(_metadata_reader(path)), name_or_path=str(path))


def load_gguf_model(auto_class, path, *, dtype="float32", requires_grad: bool = True, dequantize: bool = False):
    """``AutoModel*.from_pretrained("file.gguf")``: the model ``auto_class`` builds from the GGUF's config,
    with its weights (``dtype="auto"``: float32). As llama.cpp, block-quantized tensors stay in their block
    format on the device (frozen; ``dtype`` is then the activations'); ``dequantize=True`` expands every one
    to ``dtype`` (with "auto", float32: the exact value of every dequantised weight)."""
    config, arrays = gguf_weights(path, dequantize=dequantize)
    model = auto_class.from_config(config)
    target = model_dtype(config, dtype)
    arrays, strict = auto_class.fit_checkpoint(model, arrays, f"at {path}")
    model.load_state_dict(arrays, dtype=target, requires_grad=requires_grad, strict=strict,
                          ignore=getattr(model, "ignored_checkpoint_keys", ()))
    model.name_or_path = str(path)
    return model.eval()


__all__ = ["DECODER_TENSORS", "GGUFArchitecture", "GGUF_FIM_KEYS", "GGUFMetadata", "LLAMA_ROTARY_TRANSFORMS",
           "SPLIT_COUNT", "SPLIT_NO", "SPLIT_TENSORS_COUNT", "SplitReader", "TensorTransform", "common_metadata",
           "config_from_metadata",
           "dequantize_tensor", "gguf_architecture", "gguf_architectures", "gguf_file_of_tag", "gguf_parts",
           "gguf_weights", "hf_tensor_name", "is_gguf_file", "load_gguf", "load_gguf_model", "load_gguf_tokenizer",
           "packed_tensor", "parse_repo_tag", "permute_rotary_rows", "read_metadata", "resolve_gguf_file",
           "split_part_names", "tensor_weights", "tokenizer_from_metadata", "unpermute_rotary_rows"]
