"""From a Hugging Face checkpoint (local folder or hub repo id) to a model, and back.

``AutoModelForCausalLM.from_pretrained(path_or_repo, dtype=...)`` reads
``config.json``, resolves ``model_type`` through the registry (aliases and
wrappers included), asks the family plugin for its model class, and uploads the
safetensors weights (single file or sharded) in the requested dtype, one tensor at a
time: each is read from the memory-mapped file, converted, uploaded and dropped
(models/lazy_weights.py), so host memory holds about one tensor, not the model.
Without safetensors, PyTorch's pickled weights (``pytorch_model.bin``, sharded or
not, or one ``.pt``/``.pth``) are read by an unpickler that only rebuilds tensors
(models/torch_pickle.py): nothing in the file is run. Remote code is never executed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from vkformers.errors import QuantizationError, VkformersError
from vkformers.models.atomic import write_json_atomic
from vkformers.models.config_check import check_config_fields, check_config_object, model_dtype
from vkformers.models.gguf import (gguf_weights, is_gguf_file, load_gguf_model, load_gguf_tokenizer,
                                   resolve_gguf_file)
from vkformers.models.generation_settings import generation_config_of
from vkformers.models.gguf_write import GGUF_FILE, save_gguf
from vkformers.models.heads import HEAD_MODELS, TaskModel, head_config
# re-exported: loaders of other checkpoints (sentence-transformers, encoder-decoder) take them from here
from vkformers.models.hub import HUB_PATTERNS, HUB_PICKLE_PATTERNS, HubError, push_saved, resolve_checkpoint  # noqa: F401
from vkformers.models.lazy_weights import LazyWeights
from vkformers.models.lora import ADAPTER_HUB_OPTIONS, LoraError, ServedLoraLinear, load_adapter, save_adapter
from vkformers.models.module import CheckpointError, Module
from vkformers.models.plugins import plugin_manager, registry
from vkformers.models.prequantized import PrequantizedFormat, checkpoint_quantization
from vkformers.models.quantize import (CheckpointQuantizer, bitsandbytes_nf4_weights, quantized_weight_names,
                                       transformers_quantization)
from vkformers.models.safetensors_io import write_safetensors
from vkformers.models.tokenizer import PreTrainedTokenizer, load_tokenizer_folder
from vkformers.models.torch_pickle import PICKLE_SUFFIXES, read_weight_file
from vkformers.runtime import dtypes as dt

@dataclass
class CausalLMOutput:
    logits: object = None
    loss: object = None
    hidden_states: tuple | None = None  # output_hidden_states=True: the embeddings, then each layer's output


def load_config(folder: Path) -> dict:
    file = folder / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    config = _decode_floats(read_json(file))
    check_config_object(config, str(file))
    return config


GENERATION_CONFIG = "generation_config.json"


def load_generation_config(folder: Path) -> dict | None:
    """A checkpoint's generation_config.json (what generate decodes with by default: eos ids, sampling settings,
    forced tokens; models/generation_settings.py), or None where it has none."""
    file = folder / GENERATION_CONFIG
    if not file.is_file():
        return None
    value = _decode_floats(read_json(file))
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: a generation config is a JSON object; fix or re-download the file")
    return value


def _loaded_from(model: Module, folder: Path, name_or_path) -> Module:
    """``model`` as from_pretrained returns it: named, with the checkpoint's generation config."""
    model.name_or_path = str(name_or_path)
    generation = load_generation_config(folder)
    if generation is not None:
        model.generation_config = generation
    return model


_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _decode_floats(value):
    """transformers 5 writes a non-finite float of a config as {"__float__": "Infinity"} (JSON has no such number):
    the float it stands for, anywhere in the config."""
    if isinstance(value, dict):
        if len(value) == 1 and value.get("__float__") in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value["__float__"]]
        return {k: _decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value


def read_json(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON ({exc}); fix or re-download the file") from None


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files, as transformers picks them: safetensors (sharded, model.safetensors, any
    .safetensors), else pickled PyTorch weights (sharded, pytorch_model.bin, the one .bin/.pt/.pth)."""
    if (folder / "model.safetensors.index.json").is_file():
        return _index_shards(folder / "model.safetensors.index.json")
    if (folder / "model.safetensors").is_file():  # the one file transformers reads; others may sit beside it
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if (folder / "pytorch_model.bin.index.json").is_file():
        return _index_shards(folder / "pytorch_model.bin.index.json")
    if (folder / "pytorch_model.bin").is_file():
        return [folder / "pytorch_model.bin"]
    pickled = sorted(f for suffix in PICKLE_SUFFIXES for f in folder.glob("*" + suffix))
    if len(pickled) > 1:
        raise CheckpointError(f"{folder}: several PyTorch weight files ({', '.join(f.name for f in pickled)}) "
                              "and no pytorch_model.bin; name the model's pytorch_model.bin or move the others")
    if pickled:
        return pickled
    raise CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin")


def _index_shards(index: Path) -> list[Path]:
    """The shards a ``*.index.json`` lists, each checked to lie inside its folder and to be there."""
    folder = index.parent
    listing = read_json(index)
    weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise CheckpointError(f"{index}: no \"weight_map\" object (tensor name -> shard file); fix or "
                              "re-download the file")
    shards = sorted(set(weight_map.values()))
    root = folder.resolve()
    outside = [s for s in shards if not (folder / s).resolve().is_relative_to(root)]
    if outside:
        raise CheckpointError(f"{index}: shard {outside[0]!r} lies outside the model folder {folder}; "
                              "vkformers reads shards only from inside it")
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise CheckpointError(f"{folder}: shards listed in {index.name} are missing: {', '.join(missing)}")
    return [folder / s for s in shards]


def read_weights(folder: Path, convert=None, prequantized: PrequantizedFormat | None = None,
                 keep_packed: bool = True) -> LazyWeights:
    """Every tensor of the checkpoint, read when it is looked up (memory-mapped; bfloat16 and float8 widened to
    float32 exactly): nothing is read here. A pre-quantized checkpoint's weights (``prequantized``,
    models/prequantized.py) are dequantized or kept packed as each is read; ``convert`` (a CheckpointQuantizer)
    packs each as it is read."""
    entries = {}
    for file in weight_files(folder):
        entries.update(read_weight_file(file))  # memory-mapped: nothing is read yet
    weights = LazyWeights({name: entry.weight() for name, entry in entries.items()} if prequantized is None else
                          prequantized.weights(entries, keep_packed=keep_packed))
    return weights if convert is None else convert.converted(weights)


# Where multimodal wrappers keep their language model's weights, as transformers 5.24 saves them (the original
# releases' layouts): model.language_model.* and lm_head.* (LLaVA-style 5.x), language_model.model.* and
# language_model.lm_head.* (4.x, Mistral 3, InternVL, ...), model.text_model.* (Idefics 2/3, SmolVLM),
# text_model.model.* and text_model.lm_head.* (Emu3); renamed to the
# text model's own names. Kimi-K2.5: transformers writes its decoder layers as language_model.model.blocks.* (its
# vision tower's blocks <-> layers rename reversed over the whole file) and reads them back as layers.
WRAPPER_PREFIXES = (("model.language_model.", "model."), ("language_model.model.blocks.", "model.layers."),
                    ("language_model.model.", "model."), ("model.text_model.", "model."), ("text_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head."), ("text_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def language_model_weights(arrays) -> LazyWeights:
    """A wrapper checkpoint's language-model weights under the text model's names; the vision or audio tower and
    projector are left out (vkformers runs the text model). Wrappers that save the language model under its own
    names (model.*, lm_head.*) beside top-level towers (visual.*, audio_tower.*, mlp_AR.*: Qwen2-VL, Qwen2.5-VL,
    the Qwen3-Omni thinker, PaddleOCR-VL) keep those names. Only names change: nothing is read."""
    arrays = LazyWeights.of(arrays)
    nested = tuple(prefix for prefix, _ in WRAPPER_PREFIXES if prefix != "lm_head.")
    if not any(name.startswith(nested) for name in arrays):
        return arrays.filtered(lambda name: name.startswith(("model.", "lm_head.")))
    return arrays.renamed(_language_model_name)


def _language_model_name(name: str) -> str | None:
    for prefix, replacement in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return None


# transformers' attention implementations: vkformers picks its own kernels, and every one computes the same
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def transformers_loading_options(options: dict, dtype):
    """Take transformers' from_pretrained options out of ``options``; returns the dtype. ``torch_dtype`` (its name
    before ``dtype``, a string or a torch dtype's name) stands for ``dtype``; ``device_map`` may be None, "auto" or
    "vulkan" (the model goes to the one Vulkan device the process uses: VKFORMERS_DEVICE); ``attn_implementation``
    and ``low_cpu_mem_usage`` change nothing here (weights are read one tensor at a time anyway)."""
    torch_dtype = options.pop("torch_dtype", None)
    if torch_dtype is not None:
        name = str(torch_dtype).removeprefix("torch.")
        if dtype not in ("float32", name):
            raise VkformersError(f"dtype={dtype!r} and torch_dtype={torch_dtype!r}: give one of them")
        dtype = name
    device_map = options.pop("device_map", None)
    if device_map not in (None, "auto", "vulkan"):
        raise VkformersError(f"device_map={device_map!r}: vkformers puts the whole model on one Vulkan device "
                             "(VKFORMERS_DEVICE selects it); leave device_map out or pass 'auto'")
    implementation = options.pop("attn_implementation", None)
    if implementation is not None and implementation not in ATTENTION_IMPLEMENTATIONS:
        raise VkformersError(f"attn_implementation={implementation!r}: not one of transformers' "
                             f"({', '.join(ATTENTION_IMPLEMENTATIONS)}); leave it out")
    options.pop("low_cpu_mem_usage", None)
    return dtype


class AutoTokenizer:
    @classmethod
    def from_pretrained(cls, name_or_path, *, revision: str | None = None, cache_dir=None,
                        padding_side: str | None = None, token=None, local_files_only: bool = False,
                        gguf_file: str | None = None, **unused) -> PreTrainedTokenizer:
        """The tokenizer of a checkpoint folder, a hub repo id (through the HF cache; HF_HUB_OFFLINE honoured)
        or a ``.gguf`` file; ``gguf_file``: a .gguf file of the folder or repo (fetched alone; of a split GGUF, only
        the first part, which holds the tokenizer)."""
        if gguf_file is not None:
            name_or_path = resolve_gguf_file(name_or_path, gguf_file, all_parts=False, revision=revision,
                                             cache_dir=cache_dir, token=token, local_files_only=local_files_only)
        if is_gguf_file(name_or_path):
            tokenizer = load_gguf_tokenizer(name_or_path)
        else:
            folder = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir, token=token,
                                        local_files_only=local_files_only)
            tokenizer = load_tokenizer_folder(folder, name_or_path=str(name_or_path))
        if padding_side is not None:
            tokenizer.padding_side = padding_side
        return tokenizer


class AutoModelClass:
    """What every ``AutoModel*`` class shares: ``task`` names the model class the family plugin gives
    (``vkformers_model_class`` hook), or the core head model (``models/heads.py``) put on the plugin's base."""

    task = "causal-lm"

    @classmethod
    def from_pretrained(cls, name_or_path, *, dtype="float32", revision: str | None = None, cache_dir=None,
                        trust_remote_code: bool = False, requires_grad: bool = True, adapter=None,
                        quantization: str | None = None, dequantize: bool = False, token=None,
                        local_files_only: bool = False, adapter_kwargs: dict | None = None,
                        gguf_file: str | None = None, **head_options):
        """``quantization`` ("nf4", "q4_0", "q4_1", "q8_0", "q4_k"): pack the Linear weights of a safetensors
        checkpoint while loading (models/quantize.py). A checkpoint published pre-quantized (FP8, GPTQ, AWQ:
        models/prequantized.py) loads as it is. A GGUF file keeps its block formats unless ``dequantize=True``;
        ``gguf_file`` (transformers' name) picks one in a folder or hub repo, fetched alone with the other parts
        of a split GGUF (``revision``, ``token``, ``cache_dir``, ``local_files_only`` apply).
        Quantized weights are frozen (LoRA trains on top of them). The task heads take
        transformers' ``num_labels``, ``id2label``, ``label2id``, ``problem_type`` and ``ignore_mismatched_sizes``
        (a stored head of another shape is replaced by a new one). transformers' loading options are taken
        too (``transformers_loading_options``): ``torch_dtype`` for ``dtype``, and ``device_map``,
        ``attn_implementation`` and ``low_cpu_mem_usage`` where they ask for nothing vkformers does otherwise, and
        ``quantization_config`` / ``load_in_4bit`` / ``load_in_8bit`` (models/quantize.py's
        transformers_quantization). ``adapter``: a PEFT LoRA adapter folder or hub repo id put on the model, fetched
        with this call's ``token``, ``cache_dir`` and ``local_files_only``; ``adapter_kwargs`` (transformers' name)
        gives its own ``revision``, ``subfolder`` or any of those."""
        if trust_remote_code:
            raise VkformersError("vkformers never runs code from a checkpoint (trust_remote_code=True refused)")
        dtype = transformers_loading_options(head_options, dtype)
        quantization, dtype = transformers_quantization(head_options, quantization, dtype)
        unknown = sorted(set(head_options) - ({"num_labels", "id2label", "label2id", "problem_type",
                                               "ignore_mismatched_sizes"} if cls.task in HEAD_MODELS else set()))
        if unknown:
            raise VkformersError(f"{cls.__name__}.from_pretrained() takes no {unknown[0]}=")
        adapter_hub = {"token": token, "cache_dir": cache_dir, "local_files_only": local_files_only,
                       **(adapter_kwargs or {})}
        unknown = sorted(set(adapter_hub) - set(ADAPTER_HUB_OPTIONS))
        if unknown:
            raise VkformersError(f"adapter_kwargs={{{unknown[0]!r}: ...}}: the adapter's hub options are "
                                 f"{', '.join(ADAPTER_HUB_OPTIONS)}")
        if gguf_file is not None:
            name_or_path = resolve_gguf_file(name_or_path, gguf_file, revision=revision, cache_dir=cache_dir,
                                             token=token, local_files_only=local_files_only)
        if is_gguf_file(name_or_path):  # llama.cpp file: config, weights and tokenizer in one
            if quantization is not None:
                raise QuantizationError(f"quantization={quantization!r} applies to safetensors checkpoints; a GGUF "
                                        "file keeps its own block formats (dequantize=True expands them)")
            options = {k: v for k, v in head_options.items() if k != "ignore_mismatched_sizes"}
            model = load_gguf_model(cls.with_options(options), name_or_path, dtype=dtype,
                                    requires_grad=requires_grad, dequantize=dequantize)
        else:
            model = cls._from_folder(name_or_path, dtype, revision, cache_dir, requires_grad, quantization,
                                     head_options, dequantize, {"token": token, "local_files_only": local_files_only})
        if adapter is not None:  # a PEFT LoRA adapter: applied on top, base weights frozen
            load_adapter(model, adapter, **adapter_hub)
        return model.eval()

    @classmethod
    def with_options(cls, head_options: dict):
        """This class with ``from_config`` taking the head options (``num_labels``, ...) as given."""
        if not head_options:
            return cls
        return type(cls.__name__, (cls,), {"from_config": classmethod(
            lambda klass, config: cls.from_config(config, **head_options))})

    @classmethod
    def fit_checkpoint(cls, model: Module, weights, source: str = "",
                       ignore_mismatched_sizes: bool = False) -> tuple[LazyWeights, bool]:
        """The checkpoint's tensors under the model's names, and whether every tensor must be used. A base model or
        head model reads a checkpoint saved with or without the base-model prefix (``bert.``, ``model.``), as
        transformers does, and leaves out the tensors of another task's head; a head the checkpoint lacks is
        freshly initialised (``complete_head``). Only names change: nothing is read."""
        weights = LazyWeights.of(weights)
        prefix = getattr(model, "base_model_prefix", None)
        if cls.task == "causal-lm" or prefix is None:
            return weights, True
        if prefix and not any(name.startswith(prefix + ".") for name in weights):
            ours, own = getattr(model, "_base_rename", None) or (prefix + ".", "")
            if own and any(name.startswith(own) for name in weights):  # the base's usual prefix ("model.")
                weights = weights.renamed(lambda name: ours + name[len(own):] if name.startswith(own) else name)
            else:  # saved from a base model
                weights = weights.renamed(lambda name: f"{prefix}.{name}")
        if isinstance(model, TaskModel):  # a new head: initialised fresh
            weights = model.complete_head(weights, source, ignore_mismatched_sizes)
        elif hasattr(model, "complete_head"):  # a pooler the checkpoint lacks
            weights = model.complete_head(weights, source)
        return weights, False

    @classmethod
    def _from_folder(cls, name_or_path, dtype, revision, cache_dir, requires_grad, quantization,
                     head_options=None, dequantize: bool = False, hub: dict | None = None) -> Module:
        folder = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir, **(hub or {}))
        config = load_config(folder)
        head_options = dict(head_options or {})
        ignore_mismatched = bool(head_options.pop("ignore_mismatched_sizes", False))
        model = cls.from_config(config, **head_options)
        if (folder / GGUF_FILE).is_file() and not list(folder.glob("*.safetensors")):
            # a quantized model's save_pretrained: config.json for the model, its weights packed in model.gguf
            if quantization is not None:
                raise QuantizationError(f"quantization={quantization!r} applies to safetensors checkpoints; "
                                        f"{folder / GGUF_FILE} keeps its own block formats (dequantize=True expands them)")
            _, weights = gguf_weights(folder / GGUF_FILE, dequantize=dequantize)
            weights, strict = cls.fit_checkpoint(model, weights, f"at {name_or_path}", ignore_mismatched)
            model.load_state_dict(weights, dtype=model_dtype(config, dtype), requires_grad=requires_grad,
                                  strict=strict, ignore=getattr(model, "ignored_checkpoint_keys", ()))
            return _loaded_from(model, folder, name_or_path)
        plain = registry().backbone_config(config) is config  # else a multimodal wrapper
        quantizer = CheckpointQuantizer(model, quantization) if quantization is not None and plain else None
        prequantized = checkpoint_quantization(config)  # FP8, GPTQ, AWQ: dequantized or kept packed as read
        keep_packed = quantization is None or str(quantization).lower() == "q4_1"
        # nothing is read until load_state_dict uploads each tensor in turn
        weights = bitsandbytes_nf4_weights(read_weights(folder, convert=quantizer, prequantized=prequantized,
                                                        keep_packed=keep_packed))
        if quantizer is not None:
            quantizer.warn_kept()
        if plain:
            weights, strict = cls.fit_checkpoint(model, weights, f"at {name_or_path}", ignore_mismatched)
            model.load_state_dict(weights, dtype=model_dtype(config, dtype), requires_grad=requires_grad,
                                  strict=strict, ignore=getattr(model, "ignored_checkpoint_keys", ()))
        else:  # a multimodal wrapper: its language model runs
            for pattern, replacement in registry().checkpoint_renames(config):
                weights = weights.renamed(partial(re.sub, pattern, replacement))
            weights = language_model_weights(weights)
            if quantization is not None:
                quantizer = CheckpointQuantizer(model, quantization)
                weights = quantizer.converted(weights)
                quantizer.warn_kept()
            weights, strict = cls.fit_checkpoint(model, weights, f"at {name_or_path}", ignore_mismatched)
            try:
                model.load_state_dict(weights, dtype=model_dtype(config, dtype), strict=strict,
                                      requires_grad=requires_grad, ignore=getattr(model, "ignored_checkpoint_keys", ()))
            except CheckpointError as exc:
                raise CheckpointError(
                    f"model_type {config['model_type']!r} (a multimodal wrapper run as its "
                    f"{model.config['model_type']!r} language model): its language-model weights are not laid out "
                    f"as vkformers reads them: {exc}") from None
        return _loaded_from(model, folder, name_or_path)

    @classmethod
    def from_config(cls, config: dict, **head_options) -> Module:
        """The model of ``config``'s architecture, randomly initialised; a multimodal wrapper's config builds its
        language model (``model.config`` is then the nested text config). A task head takes ``num_labels``,
        ``id2label``, ``label2id`` and ``problem_type`` over the config's."""
        check_config_object(config)
        architecture = registry().resolve(config)
        spelling = registry().spelling(config["model_type"])  # an alias or a wrapper offers its own task heads
        backbone = registry().backbone_config(config)
        check_config_fields(backbone, "config" if backbone is config else "config (its nested text model)")
        config = backbone
        head_model = HEAD_MODELS.get(cls.task)
        task = "base" if head_model is not None else cls.task
        model_class = plugin_manager().hook.vkformers_model_class(architecture=architecture, task=task)
        if model_class is None:
            what = cls.task if head_model is None else f"{cls.task} (it needs the base model)"
            raise VkformersError(
                f"architecture {architecture.name!r} (plugin vkformers-{architecture.family}, status "
                f"{architecture.status}) has no {what} implementation yet")
        if head_model is not None:
            return head_model(head_config(config, **head_options), architecture, model_class, spelling)
        model = model_class(config, architecture)
        model.config = config
        if hasattr(model, "generate"):  # as transformers: a generation config even without generation_config.json
            model.generation_config = generation_config_of(config)
        return model


class AutoModel(AutoModelClass):
    """The base model of any architecture whose plugin gives one (transformers' AutoModel): ``last_hidden_state``,
    ``pooler_output`` where the architecture has a pooler, ``hidden_states`` with ``output_hidden_states=True``.
    Its parameters keep the base-model prefix of the task models (``bert.embeddings...``), so its weights load
    into any of them; it reads checkpoints saved with or without that prefix."""

    task = "base"


class AutoModelForCausalLM(AutoModelClass):
    task = "causal-lm"


class AutoModelForMaskedLM(AutoModelClass):
    task = "masked-lm"


class AutoModelForSeq2SeqLM(AutoModelClass):
    task = "seq2seq-lm"


class AutoModelForSequenceClassification(AutoModelClass):
    """A base model with transformers' sequence-classification head (``models/heads.py``)."""

    task = "sequence-classification"


class AutoModelForTokenClassification(AutoModelClass):
    task = "token-classification"


class AutoModelForQuestionAnswering(AutoModelClass):
    task = "question-answering"


class AutoModelForMultipleChoice(AutoModelClass):
    task = "multiple-choice"


def save_pretrained(model: Module, folder, *, dtype=None, tokenizer: PreTrainedTokenizer | None = None) -> None:
    """config.json and model.safetensors (HF names, tied weights stored once) that transformers loads. A model with
    quantized weights is written as ``folder/model.gguf`` instead (models/gguf_write.py: its blocks as they are,
    with the tokenizer, ``tokenizer`` or its source's, inside and beside it); NF4 is refused. A model with LoRA
    adapters writes the adapter, as PEFT's ``PeftModel.save_pretrained`` does (merge_lora first for a whole
    checkpoint). A model serving adapters side by side (serve_adapters) is refused: its adapters are their folders'
    and the base's file would hold them."""
    if any(isinstance(m, ServedLoraLinear) for _, m in model.named_modules()):
        raise LoraError("save_pretrained of a model serving adapters side by side: the adapters are their folders "
                        "already; save the base model before serve_adapters, or load_adapter one and merge_lora it")
    if getattr(model, "lora_config", None) is not None:
        if dtype is not None:
            raise LoraError("save_pretrained(dtype=...) of a model with LoRA adapters: the adapter is written in "
                            "float32, as PEFT writes it; drop dtype= (or merge_lora(model) first for a whole model)")
        save_adapter(model, folder)
        return
    if quantized_weight_names(model):
        if dtype is not None:
            raise QuantizationError("save_pretrained(dtype=...) of a quantized model: its packed blocks are written "
                                    "as they are; drop dtype=")
        save_gguf(model, folder, tokenizer=tokenizer)
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = dt.as_dtype(dtype) if dtype else getattr(model, "dtype", dt.float32)
    tensors, bf16 = {}, set()
    for name, tensor in model.named_parameters():
        array = tensor.numpy()
        if target is dt.bfloat16:
            tensors[name], _ = dt.to_bfloat16(array.astype(np.float32)), bf16.add(name)
        else:
            tensors[name] = array.astype(target.host)
    for path, module in model.named_modules():  # checkpoint buffers that are not parameters (the load_buffers side)
        if hasattr(module, "saved_buffers"):
            tensors.update(module.saved_buffers(path))  # float32 arrays, as transformers keeps such buffers
    write_safetensors(folder / "model.safetensors", tensors, bfloat16=bf16, metadata={"format": "pt"})
    config = dict(getattr(model, "config", {}))
    config["torch_dtype"] = target.name
    write_json_atomic(folder / "config.json", config)
    if isinstance(getattr(model, "generation_config", None), dict) and hasattr(model, "generate"):
        write_json_atomic(folder / GENERATION_CONFIG, dict(model.generation_config))


def push_to_hub(model: Module, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                token=None, create_pr: bool = False, revision: str | None = None,
                commit_description: str | None = None, dtype=None, tokenizer: PreTrainedTokenizer | None = None):
    """What :func:`save_pretrained` writes (the model, or its LoRA adapter as PEFT pushes one), uploaded to the hub
    repo ``repo_id`` in one commit (created where missing, ``private`` or not), as transformers' push_to_hub does;
    huggingface_hub's CommitInfo (``.commit_url``)."""
    what = "adapter" if getattr(model, "lora_config", None) is not None else \
        getattr(model, "architecture_name", None) or type(model).__name__
    return push_saved(partial(save_pretrained, model, dtype=dtype, tokenizer=tokenizer), repo_id,
                      commit_message=commit_message or f"Upload {what}", private=private, token=token,
                      create_pr=create_pr, revision=revision, commit_description=commit_description)


Module.save_pretrained = save_pretrained
Module.push_to_hub = push_to_hub
