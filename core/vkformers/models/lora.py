"""LoRA adapters, saved and loaded in PEFT's format.

``apply_lora(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))`` turns
every targeted ``layers.Linear`` into a :class:`LoraLinear` (in place):

    y = base(x) + dropout(x) @ lora_A.weight.T @ lora_B.weight.T * scaling

with scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). The layer keeps its own weight/bias
slots, so the base weights keep their Hugging Face names (``...q_proj.weight``) and the
adapters appear as ``...q_proj.lora_A.weight`` / ``...q_proj.lora_B.weight``. Base weights are
frozen (``requires_grad=False``) and may stay bfloat16/float16; the adapters are float32.

Serving several adapters on one base (``vkformers serve --adapter NAME=DIR``): :func:`serve_adapters` turns every
layer any of them targets into a :class:`ServedLoraLinear`, which holds all their A matrices stacked in one
[columns, in] weight and their B matrices side by side in one [out, columns] weight, and adds

    ((x @ A_all.T) * row_scales) @ B_all.T

where ``row_scales`` [batch, 1, columns] holds, in each batch row, the scaling of the adapter that row's request
asked for on that adapter's columns and zeros elsewhere (:class:`AdapterSelector`). Rows with other adapters, or
none, share the batch and its decode step.

Files, as PEFT writes them: ``adapter_config.json`` and ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_A.weight`` (and ``base_model.model.<path>.weight`` for
``modules_to_save``), so ``peft.PeftModel.from_pretrained`` loads what we save and vice versa. A folder without
``adapter_model.safetensors`` may hold ``adapter_model.bin`` instead (``torch.save``'d, the default of PEFT < 0.4),
read as PEFT does when there is no safetensors file, by models/torch_pickle.py; we always write safetensors.

Wherever an adapter folder is taken, a hub repo id is too (``PeftModel.from_pretrained(model, "org/some-lora")``):
:func:`resolve_adapter` fetches only its adapter files into the HF cache, as models/hub.py fetches checkpoints.
"""
from __future__ import annotations

import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.function import no_grad
from vkformers.engine.tensor import Tensor, parameter, weight_parameter
from vkformers.errors import VkformersError
from vkformers.models.layers import Linear, UpdatedLinear
from vkformers.models.module import Module
from vkformers.models.atomic import write_json_atomic
from vkformers.models.hub import fetch_repo, is_path_name, local_path
from vkformers.models.safetensors_io import TensorEntry, write_safetensors
from vkformers.models.torch_pickle import read_weight_file
from vkformers.runtime import dtypes as dt

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_ADAPTER_WEIGHTS = "adapter_model.bin"  # PEFT < 0.4's torch.save; read where there is no safetensors
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
ADAPTER_HUB_OPTIONS = ("subfolder", "revision", "token", "cache_dir", "local_files_only")  # resolve_adapter's

# PEFT's default target_modules per model_type (peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), so
# that LoraConfig() without targets adapts the layers PEFT's would; another model type, which PEFT refuses without
# target_modules, takes q_proj/v_proj (most decoders' names).
DEFAULT_TARGETS = {
    "t5": ["q", "v"], "mt5": ["q", "v"], "bart": ["q_proj", "v_proj"], "gpt2": ["c_attn"],
    "bloom": ["query_key_value"], "blip-2": ["q", "v", "q_proj", "v_proj"], "opt": ["q_proj", "v_proj"],
    "gptj": ["q_proj", "v_proj"], "gpt_neox": ["query_key_value"], "gpt_neo": ["q_proj", "v_proj"],
    "bert": ["query", "value"], "roberta": ["query", "value"], "xlm-roberta": ["query", "value"],
    "electra": ["query", "value"], "deberta-v2": ["query_proj", "value_proj"], "deberta": ["in_proj"],
    "layoutlm": ["query", "value"], "llama": ["q_proj", "v_proj"], "llama4": ["q_proj", "v_proj"],
    "chatglm": ["query_key_value"], "gpt_bigcode": ["c_attn"], "mpt": ["Wqkv"],
    "RefinedWebModel": ["query_key_value"], "RefinedWeb": ["query_key_value"], "falcon": ["query_key_value"],
    "btlm": ["c_proj", "c_attn"], "codegen": ["qkv_proj"], "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"], "stablelm": ["q_proj", "v_proj"], "phi": ["q_proj", "v_proj", "fc1", "fc2"],
    "gemma": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"], "gemma3_text": ["q_proj", "v_proj"],
    "gemma4": r".*language_model\..*\.(q_proj|v_proj)", "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"], "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "rwkv": ["key", "value", "receptance", "output"],
    "rwkv7": ["r_proj", "k_proj", "v_proj", "o_proj", "key", "value"],
}
FALLBACK_TARGETS = ["q_proj", "v_proj"]
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every Linear layer but the output one
# PEFT LoraConfig fields read from and written to adapter_config.json beside the basic ones
PEFT_FIELDS = ("exclude_modules", "layers_to_transform", "layers_pattern", "init_lora_weights", "inference_mode",
               "fan_in_fan_out", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern")


class LoraError(VkformersError, ValueError):
    """An adapter that does not fit the model, or a LoRA configuration that targets nothing."""


@dataclass
class LoraConfig:
    r: int = 8
    lora_alpha: float = 8  # PEFT's default (scaling 1 at its default r)
    lora_dropout: float = 0.0
    target_modules: list[str] | str | None = None  # None: the family's default; str: a regex on full names
    use_rslora: bool = False
    modules_to_save: list[str] | None = None
    base_model_name_or_path: str | None = None
    bias: str = "none"
    task_type: str = "CAUSAL_LM"
    # PEFT's other fields, with its defaults: which targets (exclude_modules: names or a regex left out;
    # layers_to_transform: only the layers of these indices, counted in layers_pattern's list), the adapters'
    # init (True: B zero; "gaussian": A ~ N(0, 1/r); False: B random too, as PEFT's for tests), and the variants
    # vkformers refuses (DoRA, fan_in_fan_out, a LoRA bias, per-module patterns)
    exclude_modules: list[str] | str | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    init_lora_weights: bool | str = True
    inference_mode: bool = False
    fan_in_fan_out: bool = False
    use_dora: bool = False
    lora_bias: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # other PEFT fields read from a file, written back unchanged

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """LoraError for a PEFT option vkformers does not implement (a one-line message naming it; from_peft_dict
        names the file instead)."""
        where = "LoraConfig"
        for name in ("use_dora", "fan_in_fan_out", "lora_bias"):
            if getattr(self, name):
                raise LoraError(f"{where}: {name}={getattr(self, name)!r} is not supported by vkformers; leave it out")
        if self.rank_pattern or self.alpha_pattern:
            raise LoraError(f"{where}: per-module rank_pattern/alpha_pattern are not supported; leave them out")
        if self.init_lora_weights not in (True, False, "gaussian"):
            raise LoraError(f"{where}: init_lora_weights={self.init_lora_weights!r} is not supported; vkformers "
                            "initialises adapters as PEFT's True (the default), 'gaussian' or False")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_peft_dict(self) -> dict:
        targets = self.target_modules
        return {**self.extra, "peft_type": "LORA", "task_type": self.task_type, "r": self.r,
                "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": sorted(targets) if isinstance(targets, list) else targets,
                **({"exclude_modules": self.exclude_modules} if self.exclude_modules is not None else {}),
                "use_rslora": self.use_rslora,
                "modules_to_save": self.modules_to_save, "bias": self.bias,
                "base_model_name_or_path": self.base_model_name_or_path, "fan_in_fan_out": False,
                "inference_mode": True, "init_lora_weights": self.init_lora_weights, "use_dora": False,
                "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": self.layers_to_transform,
                "layers_pattern": self.layers_pattern}

    @classmethod
    def from_peft_dict(cls, d: dict, where: str = "adapter config") -> "LoraConfig":
        if d.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"{where}: peft_type {d.get('peft_type')!r}; vkformers loads LORA adapters only")
        for unsupported in ("target_parameters", "trainable_token_indices", "layer_replication", "use_qalora"):
            if d.get(unsupported):
                raise LoraError(f"{where}: {unsupported}={d[unsupported]!r} is not supported by vkformers")
        if d.get("bias", "none") != "none":
            raise LoraError(f"{where}: bias={d['bias']!r} is not supported (only 'none')")
        known = {"r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "modules_to_save",
                 "base_model_name_or_path", "bias", "task_type", *PEFT_FIELDS}
        targets, excluded = d.get("target_modules"), d.get("exclude_modules")
        fields = {name: d[name] for name in PEFT_FIELDS if d.get(name) is not None}
        # the fields a file holds at their defaults and to_peft_dict leaves out then: kept to be written back
        unset = {k: d[k] for k in ("exclude_modules", "lora_bias") if k in d and not d[k]}
        if isinstance(excluded, (list, tuple, set)):
            fields["exclude_modules"] = list(excluded)
        try:
            return cls(r=int(d["r"]), lora_alpha=d.get("lora_alpha", 8), lora_dropout=d.get("lora_dropout", 0.0),
                       target_modules=list(targets) if isinstance(targets, (list, tuple, set)) else targets,
                       use_rslora=bool(d.get("use_rslora", False)), modules_to_save=d.get("modules_to_save"),
                       base_model_name_or_path=d.get("base_model_name_or_path"), bias=d.get("bias", "none"),
                       task_type=d.get("task_type") or "CAUSAL_LM", **fields,
                       extra={**{k: v for k, v in d.items() if k not in known and k != "peft_type"}, **unset})
        except LoraError as exc:
            raise LoraError(str(exc).replace("LoraConfig:", f"{where}:", 1)) from None


class LoraLinear(Linear):
    """A ``Linear`` with a trainable low-rank update.

    :func:`apply_lora` turns existing ``Linear`` objects into this class *in place* (``wrap``) rather
    than swapping in new objects: model plugins keep plain references to their layers (dicts of
    parts, attributes), and those must see the adapter too. The weight/bias slots are untouched, so
    the base keeps its Hugging Face names; ``lora_A``/``lora_B`` become child modules.
    """

    @classmethod
    def wrap(cls, linear: Linear, r: int, scaling: float, dropout: float = 0.0) -> "LoraLinear":
        if isinstance(linear, LoraLinear):
            raise LoraError("this layer already carries a LoRA adapter")
        linear.__class__ = cls
        linear.r, linear.scaling, linear.dropout = r, scaling, dropout
        linear.lora_A = Linear(linear.in_features, r, bias=False)
        linear.lora_B = Linear(r, linear.out_features, bias=False)
        return linear

    def unwrap(self) -> Linear:
        """Back to a plain ``Linear`` (the adapter is dropped; merge it into the weight first to keep it)."""
        for name in ("lora_A", "lora_B"):
            del self._modules[name]
            del self.__dict__[name]
        for name in ("r", "scaling", "dropout"):
            del self.__dict__[name]
        self.__class__ = Linear
        return self

    def init_adapter(self, rng: np.random.Generator, how: bool | str = True) -> None:
        """PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(in)) ("gaussian": N(0, 1/r)), B = 0 (the model
        starts unchanged); ``how`` False: B drawn as A is (the adapter changes the model from the start)."""
        bound = 1.0 / math.sqrt(self.in_features)
        if how == "gaussian":
            a = rng.normal(0.0, 1.0 / self.r, (self.r, self.in_features)).astype(np.float32)
        else:
            a = rng.uniform(-bound, bound, (self.r, self.in_features)).astype(np.float32)
        b_bound = 1.0 / math.sqrt(self.r)  # (nn.Linear's own init of B, which PEFT's False keeps)
        b = np.zeros((self.out_features, self.r), np.float32) if how is not False else \
            rng.uniform(-b_bound, b_bound, (self.out_features, self.r)).astype(np.float32)
        self.lora_A.weight = parameter(a, dtype=dt.float32, name="lora_A")
        self.lora_B.weight = parameter(b, dtype=dt.float32, name="lora_B")

    adapter_disabled = False  # Module.disable_adapter: the base layer alone

    def forward(self, x, live_rows=None):
        """``live_rows``: as Linear's (a mixture-of-experts expert's list of tokens); the adapter's products
        skip the same padding rows."""
        y = super().forward(x, live_rows)
        if self.adapter_disabled:
            return y
        h = F.dropout(x, self.dropout, training=self.training).float()
        update = F.linear(F.linear(h, self.lora_A.weight, live_rows=live_rows), self.lora_B.weight,
                          live_rows=live_rows) * self.scaling
        return y + update.cast(y.dtype)

    def merged_weight(self) -> np.ndarray:
        """W + scaling * B @ A in float32 (numpy)."""
        a, b = self.lora_A.weight.numpy().astype(np.float32), self.lora_B.weight.numpy().astype(np.float32)
        return self.weight.numpy().astype(np.float32) + self.scaling * (b @ a)

    def merge_and_unwrap(self, name: str) -> Linear:
        """Fold the adapter into the base weight (W += scaling * B @ A, in the weight's dtype) and unwrap: what
        Module.merge_and_unload does to each adapter layer (``name``: the layer's full name)."""
        merged = weight_parameter(self.merged_weight(), dtype=self.weight.dtype,
                                  requires_grad=self.weight.requires_grad, name=f"{name}.weight")
        linear = self.unwrap()
        linear.weight = merged
        return linear


# ---------------------------------------------------------------- finding and replacing modules

def _model_type(model) -> str | None:
    return (getattr(model, "config", None) or {}).get("model_type")


def _is_all_linear(target_modules) -> bool:
    return isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR


def resolve_targets(model, target_modules, config: LoraConfig | None = None) -> list[str]:
    """Full names of the Linear modules a PEFT-style ``target_modules`` selects.

    A list matches a module whose name equals an entry or ends with "." + entry; a string is a
    regular expression matched against the whole name (PEFT's rules); "all-linear" is every Linear layer but the
    output layer (the model's ``lm_head``), as PEFT reads it. ``config``'s exclude_modules, modules_to_save and
    layers_to_transform then narrow the choice as PEFT's check_target_module_exists does.
    """
    if target_modules is None:
        target_modules = DEFAULT_TARGETS.get(_model_type(model), FALLBACK_TARGETS)
    linears = [name for name, m in model.named_modules()
               if type(m) is Linear and name and not re.search(r"\.lora_[AB]$", name)]
    if _is_all_linear(target_modules):
        output, wanted = getattr(model, "lm_head", None), set(linears)
        chosen = [name for name, m in model.named_modules() if name in wanted and m is not output]
    elif isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        chosen = [n for n in linears if pattern.fullmatch(n)]
    else:
        chosen = [n for n in linears if any(n == t or n.endswith("." + t) for t in target_modules)]
    if config is not None:
        chosen = [n for n in chosen if not _excluded(config, n) and _in_chosen_layers(config, target_modules, n)]
    if not chosen:
        suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise LoraError(f"LoRA target_modules {target_modules!r} match no Linear layer of this model; "
                        f"its Linear layers end in: {', '.join(suffixes) or 'none'}")
    return chosen


def _excluded(config: LoraConfig, name: str) -> bool:
    """PEFT leaves out exclude_modules (names, or a regex on full names) and the modules trained whole."""
    excluded = config.exclude_modules
    if isinstance(excluded, str) and re.fullmatch(excluded, name):
        return True
    if isinstance(excluded, list) and any(name == e or name.endswith("." + e) for e in excluded):
        return True
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in config.modules_to_save or [])


def _in_chosen_layers(config: LoraConfig, target_modules, name: str) -> bool:
    """PEFT's layers_to_transform: for a list of target names matched by suffix, the layer index (the first
    numbered segment, or the one after layers_pattern) must be one of them."""
    indices = config.layers_to_transform
    if indices is None or indices == [] or not isinstance(target_modules, list) or name in target_modules:
        return True
    patterns = [config.layers_pattern] if isinstance(config.layers_pattern, str) else config.layers_pattern
    if not patterns:
        found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        found = next((m for m in (re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name) for p in patterns) if m),
                     None)
    if found is None:
        return False
    index = int(found["idx"])
    return index == indices if isinstance(indices, int) else index in indices


def apply_lora(model: Module, config: LoraConfig, *, seed: int = 0, init: bool = True) -> Module:
    """Wrap the targeted Linear layers (in place), freeze everything but adapters and modules_to_save."""
    if config.r < 1:
        raise LoraError(f"LoRA rank must be >= 1, got {config.r}")
    if config.bias != "none":
        raise LoraError(f"LoRA bias={config.bias!r} is not supported (only 'none')")
    names = resolve_targets(model, config.target_modules, config)
    if config.target_modules is None or _is_all_linear(config.target_modules):  # saved as PEFT saves it: the names
        config.target_modules = sorted({n.rsplit(".", 1)[-1] for n in names})
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = getattr(model, "name_or_path", None)
    for t in model.parameters():
        t.requires_grad = False
    rng = np.random.default_rng(seed)
    modules = dict(model.named_modules())
    for name in names:
        layer = LoraLinear.wrap(modules[name], config.r, config.scaling, config.lora_dropout)
        if init:
            layer.init_adapter(rng, config.init_lora_weights)
        layer.lora_A.training = layer.lora_B.training = layer.training
    for name in saved_module_names(model, config):
        module = dict(model.named_modules())[name]
        for _, t in module.named_parameters():
            t.requires_grad = True
    model.lora_config = config
    return model


def saved_module_names(model: Module, config: LoraConfig) -> list[str]:
    """Full names of the modules ``modules_to_save`` selects (trained fully and saved with the adapter)."""
    wanted = config.modules_to_save or []
    return [n for n, _ in model.named_modules() if n and any(n == w or n.endswith("." + w) for w in wanted)]


def trainable_parameters(model: Module) -> list[tuple[str, Tensor]]:
    return [(n, t) for n, t in model.named_parameters() if t.requires_grad]


# ---------------------------------------------------------------- saving, loading, merging

def adapter_parameter_names(model: Module) -> list[str]:
    """Model-side names of what an adapter file holds: every lora_A/lora_B, then modules_to_save's parameters."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            names += [f"{name}.lora_A.weight", f"{name}.lora_B.weight"]
    for name in saved_module_names(model, model.lora_config):
        names += [f"{name}.{p}" for p, _ in dict(model.named_modules())[name].named_slots()]
    return names


def adapter_state_dict(model: Module) -> dict[str, np.ndarray]:
    """PEFT-named adapter tensors (float32) and modules_to_save weights (their stored dtype)."""
    slots = dict(model.named_slots())
    return {PEFT_PREFIX + name: slots[name].tensor.numpy() for name in adapter_parameter_names(model)}


def save_adapter(model: Module, folder) -> None:
    """adapter_model.safetensors + adapter_config.json, as ``PeftModel.save_pretrained`` writes them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = adapter_state_dict(model)
    write_safetensors(folder / ADAPTER_WEIGHTS, {k: v.astype(np.float32) if v.dtype != np.float16 else v
                                                 for k, v in tensors.items()}, metadata={"format": "pt"})
    write_json_atomic(folder / ADAPTER_CONFIG, model.lora_config.to_peft_dict())


def resolve_adapter(name_or_path, *, subfolder: str | None = None, revision: str | None = None, token=None,
                    cache_dir=None, local_files_only: bool = False) -> Path:
    """The local folder of an adapter: a folder as is (``subfolder`` inside it), else a hub repo id whose
    adapter_config.json and adapter_model.safetensors are fetched into the HF cache, adapter_model.bin only where it
    has no safetensors (PEFT's ``subfolder``, ``revision``, ``token``, ``cache_dir``, ``local_files_only``). A path
    that does not exist and is no repo id comes back absolute (resolved again, it stays a path: Path drops a leading
    "./"), for the reader to say what is missing."""
    path = local_path(name_or_path)
    inside = subfolder.strip("/") + "/" if subfolder else ""
    if path.exists():
        return path / inside
    if is_path_name(name_or_path):
        return path.absolute() / inside
    snapshot = fetch_repo(str(name_or_path), [inside + ADAPTER_CONFIG, inside + ADAPTER_WEIGHTS],
                          fallback_patterns=[inside + PICKLED_ADAPTER_WEIGHTS],
                          needs_fallback=lambda folder: not (folder / inside / ADAPTER_WEIGHTS).is_file(),
                          what="adapter", revision=revision, cache_dir=cache_dir, token=token,
                          local_files_only=local_files_only)
    return snapshot / inside


def read_adapter_config(folder) -> LoraConfig:
    """``folder``: an adapter folder or hub repo id (:func:`resolve_adapter`)."""
    folder = resolve_adapter(folder)
    file = folder / ADAPTER_CONFIG
    if not file.is_file():
        raise LoraError(f"{folder}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    try:
        return LoraConfig.from_peft_dict(json.loads(file.read_text()), where=str(file))
    except (json.JSONDecodeError, KeyError) as exc:
        raise LoraError(f"{file}: not a valid adapter config ({exc})") from None


def adapter_weights_file(folder) -> Path:
    """The adapter's weights: adapter_model.safetensors, else adapter_model.bin (safetensors first, as PEFT)."""
    folder = resolve_adapter(folder)
    for name in (ADAPTER_WEIGHTS, PICKLED_ADAPTER_WEIGHTS):
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    raise LoraError(f"{folder}: no {ADAPTER_WEIGHTS} (nor {PICKLED_ADAPTER_WEIGHTS})")


def read_adapter_weights(file: Path) -> dict[str, TensorEntry]:
    """An adapter weights file's tensors under the model's names (lora_A.weight, ...), memory-mapped."""
    return {_peft_key_to_model(k): e for k, e in read_weight_file(file).items()}


def check_adapter_folder(folder) -> LoraConfig:
    """The adapter's config, its weights file present: what a command checks before it spends minutes loading the
    base model (whether the weights fit the model is checked when they load)."""
    folder = resolve_adapter(folder)
    config = read_adapter_config(folder)
    adapter_weights_file(folder)
    return config


def _peft_key_to_model(key: str) -> str:
    """base_model.model.X.lora_A[.default].weight -> X.lora_A.weight (also accepts names without the prefix)."""
    key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    return re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", key)


def load_adapter_weights(model: Module, folder) -> None:
    """Fill the adapters and modules_to_save of a LoRA-wrapped model from an adapter folder or hub repo id (checked
    both ways)."""
    file = adapter_weights_file(folder)
    arrays = {k: e.as_float() for k, e in read_adapter_weights(file).items()}
    expected = adapter_parameter_names(model)
    missing = sorted(set(expected) - set(arrays))
    unexpected = sorted(set(arrays) - set(expected))
    if missing or unexpected:
        raise LoraError(f"{file} does not fit this model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    slots = dict(model.named_slots())
    for name in expected:
        array, slot = arrays[name], slots[name]
        if tuple(array.shape) != slot.shape:
            raise LoraError(f"{file}: {name} has shape {tuple(array.shape)}, the model expects {slot.shape}")
        old = slot.tensor
        dtype = old.dtype if old is not None else dt.float32
        slot.tensor = slot.upload(np.asarray(array, np.float32), dtype,
                                  old.requires_grad if old is not None else True, name)


def load_adapter(model: Module, folder, *, trainable: bool = False, **hub) -> Module:
    """Wrap ``model`` as the adapter folder (or hub repo id) says and load its weights (for inference unless
    ``trainable``); ``hub``: :func:`resolve_adapter`'s options (``subfolder``, ``revision``, ``token``, ...).

    This is what ``from_pretrained(..., adapter=PATH)`` calls after loading the base model.
    """
    folder = resolve_adapter(folder, **hub)
    config = read_adapter_config(folder)
    apply_lora(model, config, init=False)
    load_adapter_weights(model, folder)
    if not trainable:
        for t in model.parameters():
            t.requires_grad = False
    return model


def get_peft_model(model: Module, config: LoraConfig) -> Module:
    """PEFT's name for :func:`apply_lora`: the model, its targeted layers wrapped in place (save_pretrained then
    writes the adapter, merge_and_unload folds it in)."""
    return apply_lora(model, config)


class PeftModel:
    """PEFT's loader: ``PeftModel.from_pretrained(base_model, adapter_folder_or_repo_id, is_trainable=False)`` is
    :func:`load_adapter` (the base model, wrapped in place), with PEFT's hub options."""

    @staticmethod
    def from_pretrained(model: Module, model_id, is_trainable: bool = False, *, subfolder: str | None = None,
                        revision: str | None = None, token=None, cache_dir=None,
                        local_files_only: bool = False) -> Module:
        return load_adapter(model, model_id, trainable=is_trainable, subfolder=subfolder, revision=revision,
                            token=token, cache_dir=cache_dir, local_files_only=local_files_only)


def merge_lora(model: Module) -> Module:
    """Fold every adapter into its base weight (W += scaling * B @ A) and unwrap; returns the plain model
    (``model.merge_and_unload()``, PEFT's name)."""
    return model.merge_and_unload()


# ---------------------------------------------------------------- several adapters served on one base

class AdapterSelector:
    """The adapters :func:`serve_adapters` put on a model, and which of them each row of the next forward takes.

    Adapter 0 is the base model; adapter ``k`` (1-based) is ``names[k - 1]``, its rank ``ranks[k - 1]`` columns of
    every ServedLoraLinear from ``offsets[k - 1]`` on. ``scales`` (set by :meth:`selecting`): the [batch, 1, columns]
    float32 tensor the layers multiply their low-rank products by; None outside it, where the layers compute the
    base model alone."""

    def __init__(self, names, ranks, scalings):
        self.names, self.ranks, self.scalings = list(names), [int(r) for r in ranks], [float(s) for s in scalings]
        self.offsets = [sum(self.ranks[:k]) for k in range(len(self.ranks))]
        self.columns = sum(self.ranks)
        self.scales: Tensor | None = None

    def row_scales(self, adapters) -> np.ndarray:
        """[rows, 1, columns] float32: each row's adapter's scaling on its columns (adapter 0: none)."""
        scales = np.zeros((len(adapters), 1, self.columns), np.float32)
        for row, adapter in enumerate(adapters):
            if adapter:
                start = self.offsets[adapter - 1]
                scales[row, 0, start:start + self.ranks[adapter - 1]] = self.scalings[adapter - 1]
        return scales

    @contextmanager
    def selecting(self, scales: Tensor):
        """Forwards inside read ``scales`` (a persistent tensor: a recorded plan replays with what it holds then)."""
        held, self.scales = self.scales, scales
        try:
            yield
        finally:
            self.scales = held


class ServedLoraLinear(UpdatedLinear):
    """A ``Linear`` with the adapters of an :class:`AdapterSelector` beside it, unmerged, each batch row taking its
    own (see the module's docstring). Wraps in place, as LoraLinear does; the base weight keeps its slot."""

    @classmethod
    def wrap(cls, linear: Linear, selector: AdapterSelector, a: np.ndarray, b: np.ndarray,
             name: str) -> "ServedLoraLinear":
        linear.__class__ = cls
        linear.selector, linear.layer_name = selector, name
        linear.adapters_A = Linear(linear.in_features, a.shape[0], bias=False)
        linear.adapters_B = Linear(a.shape[0], linear.out_features, bias=False)
        linear.adapters_A.weight = parameter(a, dtype=dt.float32, requires_grad=False, name=f"{name}.adapters_A")
        linear.adapters_B.weight = parameter(b, dtype=dt.float32, requires_grad=False, name=f"{name}.adapters_B")
        return linear

    def forward(self, x, live_rows=None):
        if live_rows is not None and self.selector.scales is not None:
            self._refuse_rows()
        return super().forward(x, live_rows)

    def row_update(self, x):
        """Each row's adapter's low-rank product (None outside AdapterSelector.selecting)."""
        scales = self.selector.scales
        if scales is None:
            return None
        if x.ndim != 3 or x.shape[0] != scales.shape[0]:
            self._refuse_rows()
        low = F.linear(x.float(), self.adapters_A.weight) * scales
        return F.linear(low, self.adapters_B.weight).cast(x.dtype)

    def _refuse_rows(self):
        raise LoraError(f"{self.layer_name} reads rows that are not one batch row per request (a mixture of "
                        "experts' tokens), so adapters cannot differ by request there; serve such an adapter "
                        "merged into the weights (--adapter DIR), one per server")


def serve_adapters(model: Module, folders: dict) -> AdapterSelector:
    """Put the PEFT LoRA adapters of ``folders`` (name -> folder or hub repo id) on ``model`` side by side, unmerged,
    for a server whose requests each pick one (or none) by name: every layer some adapter targets becomes a
    ServedLoraLinear. Refused: a model that carries adapters already, adapters with modules_to_save (whole modules
    trained: rows of one batch cannot differ in them), weights that do not fit the model, and adapters on layers that
    run on other rows than one per request (a mixture's experts, on lists of tokens)."""
    if any(isinstance(m, (LoraLinear, ServedLoraLinear)) for _, m in model.named_modules()):
        raise LoraError("the model carries LoRA layers already: merge them first (merge_lora)")
    local = {name: resolve_adapter(folder) for name, folder in folders.items()}
    configs = {name: read_adapter_config(folder) for name, folder in local.items()}
    weights: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for name, folder in folders.items():
        config = configs[name]
        if config.modules_to_save:
            raise LoraError(f"adapter {name!r} ({folder}) trains whole modules ({', '.join(config.modules_to_save)}), "
                            "which the rows of one batch cannot differ in; serve it merged (--adapter DIR) instead")
        if config.r < 1:
            raise LoraError(f"adapter {name!r} ({folder}): rank {config.r}; it must be >= 1")
        file = adapter_weights_file(local[name])
        arrays = {k: e.as_float() for k, e in read_adapter_weights(file).items()}
        targets = resolve_targets(model, config.target_modules)
        expected = {f"{t}.lora_{x}.weight" for t in targets for x in "AB"}
        missing, unexpected = sorted(expected - set(arrays)), sorted(set(arrays) - expected)
        if missing or unexpected:
            raise LoraError(f"{file} does not fit this model: missing {missing[:4]}, unexpected {unexpected[:4]}")
        modules = dict(model.named_modules())
        weights[name] = {}
        for target in targets:
            a, b = arrays[f"{target}.lora_A.weight"], arrays[f"{target}.lora_B.weight"]
            layer = modules[target]
            if a.shape != (config.r, layer.in_features) or b.shape != (layer.out_features, config.r):
                raise LoraError(f"{file}: {target} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, the model "
                                f"expects ({config.r}, {layer.in_features}) and ({layer.out_features}, {config.r})")
            weights[name][target] = (np.asarray(a, np.float32), np.asarray(b, np.float32))
    names = list(folders)
    selector = AdapterSelector(names, [configs[n].r for n in names], [configs[n].scaling for n in names])
    targeted = {t for held in weights.values() for t in held}
    for layer_name, layer in [(n, m) for n, m in model.named_modules() if n in targeted]:
        a = np.zeros((selector.columns, layer.in_features), np.float32)
        b = np.zeros((layer.out_features, selector.columns), np.float32)
        for name, offset, rank in zip(names, selector.offsets, selector.ranks):
            if layer_name in weights[name]:
                a[offset:offset + rank], b[:, offset:offset + rank] = weights[name][layer_name]
        ServedLoraLinear.wrap(layer, selector, a, b, layer_name)
    # a layer run on other rows than one per request refuses them as its forward builds (ServedLoraLinear): found
    # by a forward of a few tokens now (its graph never runs), not by a server's first request for the adapter,
    # which would fail every request of its batch
    with no_grad(), selector.selecting(Tensor(selector.row_scales([1]))):
        model(np.zeros((1, 2), np.int32))
    return selector
