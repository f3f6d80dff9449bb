"""Export a quantized decoder as a llama.cpp ``.gguf`` file: ``model.save_pretrained(folder)`` of a model whose
weights are packed blocks writes ``folder/model.gguf`` with config.json and the tokenizer files beside it.

The packed blocks are written as they are (no requantization: the bytes read from a GGUF come back identical),
float tensors in their dtype. Names, the converter's tensor changes and the metadata come from the same
:class:`~vkformers.models.gguf.GGUFArchitecture` tables the reader uses, read backwards
(:meth:`GGUFArchitecture.gguf_name`, :attr:`TensorTransform.inverse`, :attr:`GGUFArchitecture.metadata`); an
architecture whose entry has no ``metadata`` is not written. The tokenizer: the ``tokenizer.*`` keys of the GGUF
the model came from, copied, or a byte-level BPE ``tokenizer.json`` spelled as llama.cpp's "gpt2" vocabulary.
NF4 has no GGUF block type and is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vkformers.errors import QuantizationError, VkformersError
from vkformers.models.atomic import write_json_atomic
from vkformers.models.gguf import (_LLAMA3_SPLIT, _QWEN2_SPLIT, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED,
                                   TOKEN_USER_DEFINED, GGUFArchitecture, _field_value, _gguf, _metadata_reader,
                                   gguf_architectures, is_gguf_file, read_metadata, tokenizer_from_metadata)
from vkformers.models.module import CheckpointError, Module, is_packed
from vkformers.models.tokenizer import PreTrainedTokenizer, load_tokenizer_folder
from vkformers.runtime import dtypes as dt

WRITE_HINT = ("saving a quantized model writes a GGUF file, which needs the gguf package: "
              "pip install 'vkformers[gguf]' (or pip install gguf)")
GGUF_FILE = "model.gguf"
# The pre-tokenizer name llama.cpp gives each split of byte-level vocabularies the reader knows.
_SPLIT_NAMES = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


def writable_entry(config: dict) -> GGUFArchitecture:
    """The GGUF table entry that writes this model_type; QuantizationError naming the writable ones if none."""
    model_type = config.get("model_type")
    entries = [e for e in gguf_architectures() if e.metadata is not None]
    for entry in entries:
        if entry.model_type == model_type:
            return entry
    raise QuantizationError(
        f"save_pretrained of a quantized {model_type!r} model: no GGUF writer for that architecture (written: "
        f"{', '.join(sorted({e.model_type for e in entries})) or 'none'}); load it with dequantize=True or "
        "without quantization= to save float safetensors")


def _refuse_nf4(model: Module) -> None:
    nf4 = [name for name, t in model.named_parameters() if is_packed(t) and t.format.name == "nf4"]
    if nf4:
        raise QuantizationError(
            f"save_pretrained refused: {len(nf4)} weight(s) are NF4 ({nf4[0]}, ...), which GGUF has no block type "
            "for; load without quantization= (or dequantize) to save float safetensors, or quantize to a GGUF "
            "block format (quantization='q4_k', 'q8_0', 'q4_0', ...)")


def _file_tensors(model: Module, entry: GGUFArchitecture, config: dict):
    """(GGUF name, array, raw GGML type or None) of every parameter, in the file's layout."""
    gguf = _gguf(WRITE_HINT)
    unnamed = []
    for name, tensor in model.named_parameters():
        found = entry.gguf_name(name)
        if found is None:
            unnamed.append(name)
            continue
        gguf_name, stem = found
        transform = entry.transforms.get(stem)
        if transform is not None and transform.inverse is None:
            raise CheckpointError(f"{name}: the {entry.name!r} GGUF table cannot redo the converter's change to "
                                  f"{stem}; save the model dequantized as safetensors instead")
        redo = (lambda a: transform.inverse(a, config)) if transform is not None else (lambda a: a)
        if is_packed(tensor):
            if transform is not None and not transform.reorders_rows:
                raise CheckpointError(f"{name}: packed {tensor.format.name} blocks cannot take the {stem} change")
            packed = np.ascontiguousarray(redo(tensor.packed_numpy().astype(np.uint8, copy=False)))
            yield gguf_name, packed, gguf.GGMLQuantizationType[tensor.format.name.upper()]
            continue
        array = np.ascontiguousarray(redo(tensor.numpy()))
        if tensor.dtype is dt.bfloat16:
            yield gguf_name, dt.to_bfloat16(array.astype(np.float32)), gguf.GGMLQuantizationType.BF16
        elif tensor.dtype is dt.float16:
            yield gguf_name, array.astype(np.float16), None
        else:
            yield gguf_name, array.astype(np.float32), None
    if unnamed:
        raise CheckpointError(f"tensors with no GGUF name in the {entry.name!r} table: {', '.join(unnamed[:4])}"
                              + (" ..." if len(unnamed) > 4 else ""))


def _value_type(value):
    from gguf import GGUFValueType  # the optional [gguf] extra (see _gguf)
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, (int, np.integer)):
        return GGUFValueType.UINT32  # llama.cpp reads counts and lengths as uint32
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    raise CheckpointError(f"GGUF metadata value {value!r} ({type(value).__name__}) has no GGUF type")


# -- tokenizer --------------------------------------------------------------------------------------------------
def _copied_tokenizer_fields(path) -> tuple[list, dict]:
    """The ``tokenizer.*`` fields of a GGUF file as (key, value, type, sub type), and their values."""
    fields, values = [], {}
    reader = _metadata_reader(path)  # of a split GGUF, its first part
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            value = _field_value(field)
            fields.append((key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None))
            values[key] = value
    return fields, values


def _pre_name(pre_tokenizer: dict | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level pre-tokenizer the reader rebuilds the same way."""
    steps = (pre_tokenizer or {}).get("pretokenizers") or [pre_tokenizer or {}]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and steps[0].get("pattern", {}).get("Regex") in _SPLIT_NAMES:
        return _SPLIT_NAMES[steps[0]["pattern"]["Regex"]]
    raise VkformersError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}) has no llama.cpp name "
                         "vkformers knows; save the model dequantized as safetensors instead")


def tokenizer_gguf_fields(tokenizer: PreTrainedTokenizer, vocab_size: int | None = None) -> list:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" vocabulary: (key, value, type, sub type) fields; the
    token list padded with unused ``[PAD<i>]`` tokens to the model's ``vocab_size``, as llama.cpp's converter
    does (llama.cpp wants one token per embedding row)."""
    from gguf import GGUFValueType  # the optional [gguf] extra (see _gguf)
    data = json.loads(tokenizer.backend.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise VkformersError(f"the tokenizer ({model.get('type')} model) is not a byte-level BPE vocabulary, the one "
                             "kind vkformers writes into GGUF; pass the model's GGUF-sourced tokenizer or save it "
                             "dequantized as safetensors")
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    if vocab_size is not None and size > vocab_size:
        raise VkformersError(f"the tokenizer has {size} tokens, more than the model's vocab_size {vocab_size}; "
                             "pass the model's own tokenizer")
    tokens = [f"[PAD{i}]" for i in range(max(size, vocab_size or 0))]
    types = [TOKEN_UNUSED] * len(tokens)
    for token, index in vocab.items():
        tokens[index], types[index] = token, TOKEN_NORMAL
    for added in data.get("added_tokens") or []:
        types[added["id"]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    S, U32, ARR = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.ARRAY
    fields = [("tokenizer.ggml.model", "gpt2", S, None), ("tokenizer.ggml.pre", _pre_name(data.get("pre_tokenizer")), S, None),
              ("tokenizer.ggml.tokens", tokens, ARR, S), ("tokenizer.ggml.token_type", types, ARR, GGUFValueType.INT32),
              ("tokenizer.ggml.merges", merges, ARR, S)]
    for attribute, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("unk_token_id", "unknown_token_id"), ("pad_token_id", "padding_token_id")):
        index = getattr(tokenizer, attribute)
        if index is not None:
            fields.append((f"tokenizer.ggml.{key}", int(index), U32, None))
    for flag in ("add_bos_token", "add_eos_token"):
        fields.append((f"tokenizer.ggml.{flag}", bool(tokenizer.config.get(flag, False)), GGUFValueType.BOOL, None))
    template = tokenizer.chat_template
    if isinstance(template, list):
        for named in template:
            key = "tokenizer.chat_template" if named["name"] == "default" else f"tokenizer.chat_template.{named['name']}"
            fields.append((key, named["template"], S, None))
    elif template:
        fields.append(("tokenizer.chat_template", template, S, None))
    return fields


def _tokenizer_source(model: Module, tokenizer: PreTrainedTokenizer | None):
    """(GGUF fields, PreTrainedTokenizer) of the tokenizer to save: the one given, else the model's source's."""
    vocab_size = getattr(model, "config", {}).get("vocab_size")
    if tokenizer is not None:
        return tokenizer_gguf_fields(tokenizer, vocab_size), tokenizer
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    if is_gguf_file(source) and source.is_file():
        fields, values = _copied_tokenizer_fields(source)
        meta = {**read_metadata(_metadata_reader(source)), **values}
        return fields, tokenizer_from_metadata(meta, name_or_path=str(source))
    if source.is_dir() and (source / "tokenizer.json").is_file():
        tokenizer = load_tokenizer_folder(source)
        return tokenizer_gguf_fields(tokenizer, vocab_size), tokenizer
    raise VkformersError("save_pretrained of a quantized model writes a GGUF file, which carries the tokenizer: "
                         f"none was found beside the model's source {str(source)!r}; pass tokenizer=")


# -- entry point ------------------------------------------------------------------------------------------------
def save_gguf(model: Module, folder, *, tokenizer: PreTrainedTokenizer | None = None) -> Path:
    """``folder/model.gguf`` (packed blocks as they are, float tensors in their dtype, llama.cpp's metadata and
    tokenizer), config.json and the tokenizer files beside it; ``from_pretrained(folder)`` reads it back."""
    _refuse_nf4(model)
    gguf = _gguf(WRITE_HINT)
    config = dict(getattr(model, "config", {}))
    entry = writable_entry(config)
    metadata = entry.metadata(config)
    tensors = list(_file_tensors(model, entry, config))
    token_fields, tokenizer = _tokenizer_source(model, tokenizer)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / GGUF_FILE
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), entry.name)
    try:
        writer.add_name(folder.name or entry.model_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value in metadata.items():
            writer.add_key_value(f"{entry.name}.{key}", value, _value_type(value))
        for key, value, kind, sub_kind in token_fields:
            if not (isinstance(value, list) and not value):  # GGUF has no empty arrays (a vocabulary without merges)
                writer.add_key_value(key, value, kind, sub_type=sub_kind)
        for name, array, raw_type in tensors:
            writer.add_tensor(name, array, raw_dtype=raw_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    config["torch_dtype"] = getattr(model, "dtype", dt.float32).name
    if "dtype" in config:  # transformers 5's spelling, read first by dtype="auto"
        config["dtype"] = config["torch_dtype"]
    write_json_atomic(folder / "config.json", config)
    return path


__all__ = ["GGUF_FILE", "WRITE_HINT", "save_gguf", "tokenizer_gguf_fields", "writable_entry"]
