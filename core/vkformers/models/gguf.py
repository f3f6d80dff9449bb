"""Import llama.cpp ``.gguf`` files: config, float32 weights under Hugging Face names, and the tokenizer.

A GGUF file holds what a Hugging Face checkpoint spreads over config.json, model.safetensors, tokenizer.json
and tokenizer_config.json, in llama.cpp's spelling. :func:`load_gguf` turns it back::

    config, arrays, tokenizer = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    # config: a config.json dict (model_type "llama"); arrays: HF name -> float32 numpy;
    # tokenizer: a vkformers PreTrainedTokenizer (token ids identical to llama.cpp's vocabulary)

Reading uses the ``gguf`` package (llama.cpp's own Python reader, ``pip install 'vkformers[gguf]'``), whose
``gguf.quants.dequantize`` expands every quantisation it knows (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
the K-quants, ...) to float32. Three things llama.cpp changed on the way in are undone here:

- tensor names: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (:data:`LLAMA_TENSOR_NAMES`);
- llama.cpp's converter reorders the rows of q_proj/k_proj of llama models so that each head's rotary pairs are
  adjacent (GGML's "normal" RoPE rotates neighbours, HF's rotates the two halves); :func:`unpermute_rotary_rows`
  restores HF's half-split order;
- the tokenizer: a byte-level BPE ("gpt2") or SentencePiece ("llama") vocabulary rebuilt as a ``tokenizers``
  Tokenizer, with the control tokens as special tokens, BOS/EOS/PAD and the chat template.

Only the llama architecture is mapped so far (SmolLM, Llama 1-3, Mistral, TinyLlama are written as llama).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from vkformers.engine.quantized import GGUF_FORMATS, QuantizationError, QuantizedArray
from vkformers.errors import VkformersError
from vkformers.models.config_check import model_dtype
from vkformers.models.module import CheckpointError
from vkformers.models.tokenizer import PreTrainedTokenizer

INSTALL_HINT = "reading .gguf files needs the gguf package: pip install 'vkformers[gguf]' (or pip install gguf)"

# llama.cpp's per-layer tensor names (after "blk.N.") and the Hugging Face names (after "model.layers.N.").
LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensor types read as float arrays; the others are blocks (kept packed unless dequantize=True).
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# Tensors llama.cpp derives from the config (llama 3's rope frequency factors): the config carries them already.
DERIVED_TENSORS = {"rope_freqs.weight"}

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# How byte-level vocabularies split text before BPE ("tokenizer.ggml.pre"); None: GPT-2's split.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
BYTE_LEVEL_SPLITS = {
    "default": None, "gpt2": None, "gpt-2": None,
    "smollm": "digits", "starcoder": "digits", "refact": "digits",  # GPT-2's split after each digit stands alone
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def is_gguf_file(name_or_path) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise VkformersError(INSTALL_HINT) from None
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


# -- metadata -------------------------------------------------------------------------------------------------
def _field_value(field):
    """A metadata value as Python (str, int, float, bool or a list of them); works on every gguf >= 0.10."""
    from gguf import GGUFValueType
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


def config_from_metadata(meta: dict, tensor_names) -> dict:
    """The config.json a transformers llama checkpoint of this model has."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise VkformersError(f"GGUF architecture {arch!r} is not supported yet (vkformers maps 'llama' GGUF files)")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "intermediate_size": get("feed_forward_length"),
        "head_dim": get("attention.key_length", hidden // heads),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "vocab_size": get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or None,
    }
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn") and get("rope.scaling.factor"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor")}
        if get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[name] = meta[f"tokenizer.ggml.{key}"]
    return config


# -- tensors --------------------------------------------------------------------------------------------------
def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for names with no HF twin."""
    stem, _, suffix = gguf_name.rpartition(".")
    if gguf_name in DERIVED_TENSORS or suffix not in ("weight", "bias"):
        return None
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if layer and layer.group(2) in LLAMA_LAYER_NAMES:
        return f"model.layers.{layer.group(1)}.{LLAMA_LAYER_NAMES[layer.group(2)]}.{suffix}"
    if stem in LLAMA_TENSOR_NAMES:
        return f"{LLAMA_TENSOR_NAMES[stem]}.{suffix}"
    return None


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


def packed_tensor(tensor) -> QuantizedArray:
    """A quantized reader tensor as its packed blocks (no expansion), for a block type the kernels read."""
    fmt = tensor.tensor_type.name.lower()
    if fmt not in GGUF_FORMATS or len(tensor.shape) != 2:
        raise QuantizationError(
            f"GGUF tensor {tensor.name}: block type {tensor.tensor_type.name} is not supported quantized "
            f"(supported: {', '.join(f.upper() for f in GGUF_FORMATS)}); load with dequantize=True to expand it")
    rows, cols = (int(d) for d in reversed(tensor.shape))
    return QuantizedArray(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1), fmt, (rows, cols))


def read_tensors(reader, config: dict, *, keep_quantized: bool = False) -> dict[str, np.ndarray]:
    """HF name -> float32 array; with ``keep_quantized``, block-quantized tensors as QuantizedArray (packed)."""
    arrays, unknown = {}, []
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            if tensor.name not in DERIVED_TENSORS:
                unknown.append(tensor.name)
            continue
        keep = keep_quantized and tensor.tensor_type.name not in FLOAT_TYPES
        array = packed_tensor(tensor) if keep else dequantize_tensor(tensor)
        rows = array.packed if keep else array  # packed rows hold whole blocks: they reorder like float rows
        if ".attn_q." in tensor.name:
            rows = unpermute_rotary_rows(rows, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            rows = unpermute_rotary_rows(rows, config["num_key_value_heads"])
        if keep:
            array.packed = rows
        else:
            array = rows
        arrays[name] = array
    if unknown:
        raise CheckpointError(f"GGUF tensors with no Hugging Face name: {', '.join(unknown[:8])}"
                              + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else ""))
    return arrays


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


def _byte_level_model(meta: dict):
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    tokens = meta["tokenizer.ggml.tokens"]
    # Converters write the vocabulary in the byte alphabet already; respell the odd token written as raw text.
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    model = models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False)
    split = BYTE_LEVEL_SPLITS.get(meta.get("tokenizer.ggml.pre", "default"))
    if split is None:
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits":
        pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
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
    from tokenizers import decoders, models, normalizers
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
    from tokenizers import AddedToken, Tokenizer

    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{name_or_path}: the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    if kind == "gpt2":
        model, normalizer, pre, decoder, post = _byte_level_model(meta)
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
    return PreTrainedTokenizer(backend, config, name_or_path=name_or_path)


# -- entry points ---------------------------------------------------------------------------------------------
def load_gguf(path, *, tokenizer: bool = True, dequantize: bool = True):
    """``(config, arrays, tokenizer)`` of a GGUF file: a config.json dict, float32 numpy arrays under HF
    names (q/k rows restored to HF's rotary order), and a PreTrainedTokenizer (None with tokenizer=False).
    ``dequantize=False``: block-quantized tensors come as QuantizedArray, packed as in the file."""
    reader = _reader(path)
    meta = read_metadata(reader)
    config = config_from_metadata(meta, {t.name for t in reader.tensors})
    arrays = read_tensors(reader, config, keep_quantized=not dequantize)
    if config["vocab_size"] is None:
        config["vocab_size"] = int(arrays["model.embed_tokens.weight"].shape[0])
    return config, arrays, tokenizer_from_metadata(meta, name_or_path=str(path)) if tokenizer else None


def load_gguf_tokenizer(path):
    """Only the tokenizer of a GGUF file (no tensor is expanded)."""
    return tokenizer_from_metadata(read_metadata(_reader(path)), name_or_path=str(path))


def load_gguf_model(auto_class, path, *, dtype="float32", requires_grad: bool = True, dequantize: bool = False):
    """``AutoModel*.from_pretrained("file.gguf")``: the model ``auto_class`` builds from the GGUF's config,
    with its weights (``dtype="auto"``: float32). As llama.cpp, block-quantized tensors stay in their block
    format on the device (frozen; ``dtype`` is then the activations'); ``dequantize=True`` expands every one
    to ``dtype`` (with "auto", float32: the exact value of every dequantised weight)."""
    config, arrays, _ = load_gguf(path, tokenizer=False, dequantize=dequantize)
    model = auto_class.from_config(config)
    target = model_dtype(config, dtype)
    model.load_state_dict(arrays, dtype=target, requires_grad=requires_grad,
                          ignore=getattr(model, "ignored_checkpoint_keys", ()))
    model.name_or_path = str(path)
    return model.eval()


__all__ = ["LLAMA_LAYER_NAMES", "LLAMA_TENSOR_NAMES", "config_from_metadata", "dequantize_tensor", "hf_tensor_name",
           "is_gguf_file", "load_gguf", "load_gguf_model", "load_gguf_tokenizer", "packed_tensor",
           "permute_rotary_rows",
           "read_metadata", "tokenizer_from_metadata", "unpermute_rotary_rows"]
