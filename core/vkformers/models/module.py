"""``Module``: parameters and submodules with Hugging Face names, like ``torch.nn.Module``.

A model is built from its config first, with parameter *slots* (name, shape);
``load_state_dict`` then fills every slot from checkpoint arrays, so weights are
uploaded once and never allocated twice. ``named_parameters()`` yields the HF
names (``model.layers.0.self_attn.q_proj.weight``). A weight too large for one device buffer is a RowBlocks
(engine/row_blocks.py) under its one name; ``parameters()`` gives its blocks, the tensors an optimizer updates.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np

from vkformers.engine.checkpoint import checkpoint
from vkformers.engine.lazy import building_graph, capturing
from vkformers.engine.quantized import QuantizedArray, QuantizedTensor
from vkformers.engine.row_blocks import RowBlocks, device_tensors, upload_packed
from vkformers.engine.tensor import Tensor, parameter, weight_parameter
from vkformers.errors import VkformersError
from vkformers.models.inputs import IGNORE_INDEX, InputLimits, check_model_inputs, forward_arguments
from vkformers.models.lazy_weights import LazyWeights
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import get_device


class CheckpointError(VkformersError, ValueError):
    """Weights that do not fit the model: missing, unexpected or misshapen tensors, or a bad file."""


class GradientCheckpointingError(VkformersError, ValueError):
    """gradient_checkpointing_enable() on a model whose layer loop does not recompute its layers."""


@dataclass
class Slot:
    """A parameter the model declares before the weights arrive."""

    shape: tuple[int, ...]
    dtype: dt.DType | None = None  # None: the model's dtype
    tensor: Tensor | QuantizedTensor | RowBlocks | None = None
    tied_to: str | None = None     # another parameter's full name (tied embeddings)
    # its readers take a RowBlocks (a Linear's or an Embedding's weight): held in blocks of rows where one device
    # buffer cannot hold it (engine/row_blocks.py); any other parameter that large is refused at load
    row_blocks: bool = False

    def upload(self, array, dtype, requires_grad: bool, name: str):
        """The device tensor of ``array`` for this slot: packed blocks stay packed; a weight whose readers take
        row blocks may become a RowBlocks."""
        if isinstance(array, QuantizedArray):  # frozen
            return upload_packed(array, dtype, name) if self.row_blocks else \
                QuantizedTensor.upload(array, dtype=dtype, name=name)
        make = weight_parameter if self.row_blocks else parameter
        return make(np.asarray(array), dtype=dtype, requires_grad=requires_grad, name=name)


class ModelConfig(dict):
    """A model's config.json: a dict whose keys also read and set as attributes (``model.config.vocab_size``), as
    transformers' PretrainedConfig does; nested configs (``text_config``) likewise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key, value in self.items():
            if type(value) is dict:
                self[key] = ModelConfig(value)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the config has no {name!r}") from None

    def __setattr__(self, name, value):
        self[name] = value

    def __delattr__(self, name):
        try:
            del self[name]
        except KeyError:
            raise AttributeError(f"the config has no {name!r}") from None

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, ModelConfig) else v for k, v in self.items()}


def _dtype_name(value) -> str:
    """A dtype or device as a name: vkformers.bfloat16 -> "bfloat16", torch.float16 -> "float16", "cuda:0" as is."""
    return str(getattr(value, "name", value)).removeprefix("torch.")


# A forward built in Python that no backward needs and no capture records is submitted every few layers without
# waiting: the host builds the next layers while the device runs the last ones, instead of the device idling until
# the whole graph is built. Each part is a plan with its own workspace (about SUBMIT_WORKSPACE_FACTOR x tokens x
# hidden bytes), so only streams of SUBMIT_MIN_TOKENS tokens or more are split, into parts of SUBMIT_MIN_LAYERS layers
# or more, and into no more parts than keep the added workspace within SUBMIT_WORKSPACE_BYTES.
SUBMIT_MIN_TOKENS = 128
SUBMIT_MIN_LAYERS = 4
SUBMIT_WORKSPACE_FACTOR = 16
SUBMIT_WORKSPACE_BYTES = 256 << 20


class Module:
    supports_gradient_checkpointing = False  # True on models whose layer loop goes through call_layer()
    gradient_checkpointing = False  # (also for subclasses that skip Module.__init__)

    def __init__(self):
        object.__setattr__(self, "_slots", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", False)

    # -- declaration

    def param(self, name: str, shape, dtype=None, row_blocks: bool = False) -> None:
        """Declare a parameter slot; ``self.<name>`` is its Tensor once loaded (``row_blocks``: see Slot)."""
        self._slots[name] = Slot(tuple(int(s) for s in shape), dt.as_dtype(dtype) if dtype else None,
                                 row_blocks=row_blocks)

    def __setattr__(self, name, value):
        if name in ("config", "generation_config") and type(value) is dict:  # attribute access too
            value = ModelConfig(value)
        if isinstance(value, Module):
            self._modules[name] = value
        elif isinstance(value, (Tensor, QuantizedTensor, RowBlocks)) and name in self._slots:
            self._slots[name].tensor = value
            return
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        slots = self.__dict__.get("_slots", {})
        if name in slots:
            slot = slots[name]
            if slot.tensor is None:
                raise CheckpointError(f"parameter {name!r} of {type(self).__name__} has not been loaded")
            return slot.tensor
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def add(self, name: str, module: "Module") -> "Module":
        """Register a child under a name that may not be an identifier ("0", "1", ... in a ModuleList)."""
        self._modules[name] = module
        return module

    # -- traversal

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_slots(self) -> Iterator[tuple[str, Slot]]:
        for path, module in self.named_modules():
            for name, slot in module._slots.items():
                yield (f"{path}.{name}" if path else name), slot

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) of every loaded parameter; a tied parameter appears once, under its owner's name; a
        weight in row blocks as its RowBlocks."""
        for name, slot in self.named_slots():
            if slot.tensor is not None and slot.tied_to is None:
                yield name, slot.tensor

    def parameters(self) -> list[Tensor]:
        """The device tensors of the parameters (a weight in row blocks: its blocks), as an optimizer takes them."""
        return device_tensors(t for _, t in self.named_parameters())

    # -- dtype (transformers' model.to(...), half(), bfloat16(), float())

    def to(self, *args, dtype=None, device=None) -> "Module":
        """transformers' ``model.to(...)``: a dtype ("bfloat16", vkformers.bfloat16, a torch dtype) converts the
        weights as from_pretrained(dtype=...) would have loaded them (LoRA adapters stay float32); a device other
        than the Vulkan one ("cuda", "cpu") is refused, since every model runs on the Vulkan device
        (VKFORMERS_DEVICE selects it)."""
        dtype = None if dtype is None else _dtype_name(dtype)
        for value in (*args, device):
            name = None if value is None else _dtype_name(value)
            if name in dt.ALL or name in dt.ALIASES:
                dtype = name
            elif name is not None and name.split(":")[0] not in ("vulkan", "auto"):
                raise VkformersError(f"{type(self).__name__}.to({value!r}): vkformers runs every model on the Vulkan "
                                     "device (VKFORMERS_DEVICE selects it); leave the device out")
        if dtype is not None:
            self._convert_weights(dt.as_dtype(dtype))
        return self

    def half(self) -> "Module":
        return self.to(dtype="float16")

    def bfloat16(self) -> "Module":
        return self.to(dtype="bfloat16")

    def float(self) -> "Module":
        return self.to(dtype="float32")

    def _convert_weights(self, dtype: dt.DType) -> None:
        if not isinstance(getattr(self, "dtype", None), dt.DType):
            raise VkformersError(f"{type(self).__name__}: only a model converts its weights' dtype")
        if dtype.name not in ("float32", "float16", "bfloat16"):
            raise VkformersError(f"a model computes in float32, float16 or bfloat16, not {dtype.name}")
        get_device().require_dtype(dtype)
        adapters = {f"{path}.{part}." for path, module in self.named_modules() if hasattr(module, "merge_and_unwrap")
                    for part in ("lora_A", "lora_B")}
        slots = dict(self.named_slots())
        if any(is_packed(slot.tensor) for slot in slots.values()):
            raise VkformersError("a model with quantized weights computes in the dtype it was loaded with; load it "
                                 "again with dtype=...")
        for name, slot in slots.items():
            if slot.tensor is None or slot.tied_to is not None or name.startswith(tuple(adapters)):
                continue
            target = slot.dtype or dtype
            if slot.tensor.dtype is not target:
                slot.tensor = slot.upload(slot.tensor.numpy(), target, slot.tensor.requires_grad, name)
        for slot in slots.values():  # ties follow their owners
            if slot.tied_to is not None:
                slot.tensor = slots[slot.tied_to].tensor
        self.dtype = dtype
        if hasattr(self, "forget_captures"):
            self.forget_captures()

    def resize_rows(self, name: str, rows: int, *, mean_resizing: bool = True, std: float = 0.02) -> Tensor:
        """Give parameter ``name`` (of this module) ``rows`` rows along its first axis: the rows it has are kept,
        new ones start at the mean of the old ones (transformers' mean_resizing; else normal(0, std), seed 0),
        rows past ``rows`` go. Returns the new tensor (same dtype and requires_grad)."""
        slot, old = self._slots[name], getattr(self, name)
        if is_packed(old):
            raise CheckpointError(f"{name}: a quantized weight cannot be resized; load the model dequantized")
        values = old.numpy().astype(np.float32)
        have = values.shape[0]
        if rows > have:
            fresh = (np.broadcast_to(values.mean(0), (rows - have, *values.shape[1:])) if mean_resizing else
                     np.random.default_rng(0).normal(0.0, std, (rows - have, *values.shape[1:])))
            values = np.concatenate([values, fresh.astype(np.float32)])
        slot.shape = (rows, *slot.shape[1:])
        slot.tensor = slot.upload(values[:rows], old.dtype, old.requires_grad, name)
        return slot.tensor

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """transformers' name; the decoders of the decoder kit resize (models/decoder/model.py)."""
        raise VkformersError(f"{getattr(self, 'architecture_name', type(self).__name__)}: resize_token_embeddings is "
                             "not supported for this architecture; the causal decoders have it")

    def print_trainable_parameters(self) -> None:
        """PEFT's line: trainable values, all values, and the trainable share."""
        trainable, total = self.num_parameters(only_trainable=True), self.num_parameters()
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || "
              f"trainable%: {100 * trainable / max(total, 1):.4f}")

    def merge_and_unload(self) -> "Module":
        """PEFT's name: fold every adapter layer into its base weight and unwrap it (models/lora.py's LoraLinear
        does the folding: ``merge_and_unwrap``); returns the plain model."""
        for name, module in list(self.named_modules()):
            if hasattr(module, "merge_and_unwrap"):
                module.merge_and_unwrap(name)
        self.__dict__.pop("lora_config", None)
        return self

    def unload(self) -> "Module":
        """PEFT's name: drop every adapter layer's adapter, unmerged (models/lora.py's LoraLinear.unwrap); returns
        the base model."""
        for _, module in list(self.named_modules()):
            if hasattr(module, "merge_and_unwrap"):
                module.unwrap()
        self.__dict__.pop("lora_config", None)
        forget = getattr(self, "forget_captures", None)
        if forget is not None:
            forget()
        return self

    @contextmanager
    def disable_adapter(self):
        """PEFT's context: inside it every LoRA layer computes its base layer alone (a reference model without
        moving weights); recorded generate steps are dropped on the way in and out, since their graphs differ."""
        layers = [m for _, m in self.named_modules() if hasattr(m, "adapter_disabled")]
        forget = getattr(self, "forget_captures", None)
        if forget is not None:
            forget()
        for layer in layers:
            layer.adapter_disabled = True
        try:
            yield self
        finally:
            for layer in layers:
                layer.adapter_disabled = False
            if forget is not None:
                forget()

    def num_parameters(self, only_trainable: bool = False) -> int:
        """How many values the parameters hold (a tied parameter once; a quantized weight by its logical shape),
        as transformers counts them; ``only_trainable``: those that require gradients."""
        return sum(int(np.prod(t.shape)) for t in self.parameters()
                   if not only_trainable or getattr(t, "requires_grad", False))

    def train(self, mode: bool = True) -> "Module":
        for _, module in self.named_modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    # -- gradient checkpointing (transformers' names)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """Keep only each layer's input for the backward pass and recompute the layer there (in training mode,
        with gradients recorded): less activation memory for one more forward per step; the gradients are
        bit-identical. ``gradient_checkpointing_kwargs`` is accepted for transformers' signature and ignored."""
        if not self.supports_gradient_checkpointing:
            raise GradientCheckpointingError(
                f"{type(self).__name__} does not support gradient checkpointing; train without it")
        self._set_gradient_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self._set_gradient_checkpointing(False)

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.gradient_checkpointing

    def _set_gradient_checkpointing(self, on: bool) -> None:
        for _, module in self.named_modules():
            object.__setattr__(module, "gradient_checkpointing", on)

    def layer_parts(self, x, layers: int) -> int:
        """Into how many parts a forward through ``layers`` layers of the stream ``x`` [batch, tokens, hidden] is
        submitted (see SUBMIT_MIN_TOKENS; the shared layer loops call submit_part after each layer); 1: realized
        once, when its result is read."""
        if x.requires_grad or capturing() or len(x.shape) != 3:
            return 1
        tokens = x.shape[0] * x.shape[1]
        if tokens < SUBMIT_MIN_TOKENS:
            return 1
        part_bytes = SUBMIT_WORKSPACE_FACTOR * tokens * x.shape[2] * x.dtype.itemsize
        return max(1, min(layers // SUBMIT_MIN_LAYERS, 1 + SUBMIT_WORKSPACE_BYTES // part_bytes))

    def layers_per_part(self, x, layers: int) -> int:
        """How many of ``layers`` layers go in one part of a forward submitted in parts (layer_parts)."""
        return -(-layers // self.layer_parts(x, layers))

    @staticmethod
    def submit_part(x, done: int, layers: int, per_part: int) -> None:
        """In a layer loop, after ``done`` of ``layers`` layers: submit the stream ``x`` without waiting where a part
        ends (per_part from layers_per_part), so that the device runs it while the host builds the next layers."""
        if done % per_part == 0 and done < layers:
            x.realize(wait=False)

    def call_layer(self, layer, x, *args, **kwargs):
        """``layer(x, *args, **kwargs)``, recomputed in the backward pass when gradient checkpointing is on
        (engine/checkpoint.py); the shared layer loops call their layers through this."""
        if self.gradient_checkpointing and self.training:
            return checkpoint(lambda h: layer(h, *args, **kwargs), x)
        return layer(x, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        limits = self.input_limits()
        if limits is not None:  # a model: its inputs are checked before any graph is built
            check_model_inputs(limits, forward_arguments(self, args, kwargs))
        with building_graph():
            return self.forward(*args, **kwargs)

    def input_limits(self) -> InputLimits | None:
        """What a model's inputs may hold (its vocabulary, position table, ...), checked on every call; None for
        a layer, whose inputs its model has checked."""
        return None

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    # -- weights

    def tie(self, name: str, to: str) -> None:
        """Make parameter ``name`` (full name) share ``to``'s tensor (tied input/output embeddings)."""
        slots = dict(self.named_slots())
        slots[name].tied_to = to

    def load_state_dict(self, arrays: Mapping[str, np.ndarray], dtype="float32", strict: bool = True,
                        requires_grad: bool = True, ignore=()) -> None:
        """Upload every slot's array (converted to its dtype). Names are checked both ways and shapes must match
        before anything is uploaded. ``arrays`` may be a LazyWeights (what from_pretrained passes): each tensor is
        then read, uploaded and dropped in turn, so host memory holds about one tensor at a time. A model (a module
        with a ``dtype``) then computes in ``dtype``, as from_pretrained sets it."""
        dtype = dt.as_dtype(dtype)
        get_device().require_dtype(dtype)
        arrays = LazyWeights.of(arrays)
        slots = dict(self.named_slots())
        missing = [n for n, s in slots.items() if n not in arrays and s.tied_to is None]
        if missing:
            raise CheckpointError(f"the checkpoint lacks {len(missing)} tensor(s) the model needs: "
                                  f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        unexpected = [n for n in arrays if n not in slots and not any(n.endswith(i) for i in ignore)]
        if strict and unexpected:
            raise CheckpointError(f"the checkpoint has {len(unexpected)} tensor(s) this model does not use: "
                                  f"{', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        loaded = [(name, slot) for name, slot in slots.items() if slot.tied_to is None]  # a tie shares its owner's
        for name, slot in loaded:  # the shapes known unread, before any upload
            _check_shape(name, arrays.known_shape(name), slot)
        for name, slot in loaded:
            target = slot.dtype or dtype
            array = arrays.read_for(name, target)
            _check_shape(name, array.shape, slot)
            slot.tensor = slot.upload(array, target, requires_grad, name)
            del array  # its host copy goes before the next tensor is read
        for name, slot in slots.items():  # ties resolve after their owners load
            if slot.tied_to is not None and slot.tensor is None:
                slot.tensor = slots[slot.tied_to].tensor
        if isinstance(getattr(self, "dtype", None), dt.DType):  # a model: it computes in its weights' dtype
            self.dtype = dtype

    def loss_target_count(self, labels) -> int:
        """How many targets this model's loss averages over for a batch's ``labels`` (as forward takes them):
        integer labels not -100, float ones (regression, multi-label) not NaN. Models that shift labels say so. The
        trainer weights each micro-batch's mean loss by its share of the step's targets."""
        labels = labels.numpy() if isinstance(labels, Tensor) else np.asarray(labels)
        if not np.issubdtype(labels.dtype, np.integer):
            return int((~np.isnan(labels)).sum())
        return int((labels != IGNORE_INDEX).sum())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter as float32 numpy arrays (float16 stays float16; quantized weights dequantized), under
        HF names."""
        return {name: t.numpy() for name, t in self.named_parameters()}


def _check_shape(name: str, shape, slot: Slot) -> None:
    if shape is not None and tuple(shape) != slot.shape:
        raise CheckpointError(f"tensor {name}: checkpoint shape {tuple(shape)}, model expects {slot.shape}")


# -- dotted Hugging Face paths (shared by the family plugins, which build modules under their checkpoints' names)

def is_packed(weight) -> bool:
    """Whether a parameter is packed quantized blocks, whole or in row blocks."""
    return isinstance(weight, QuantizedTensor) or (isinstance(weight, RowBlocks) and weight.quantized)


def join_path(*parts: str) -> str:
    """The dotted path of ``parts``, skipping empty ones: ``join_path("mlp", "", "gate")`` is ``"mlp.gate"``."""
    return ".".join(part for part in parts if part)


def _container(root: Module, parents: list[str]) -> Module:
    """The module at ``parents`` under ``root``, adding plain container modules where there are none yet."""
    node = root
    for part in parents:
        node = node._modules[part] if part in node._modules else node.add(part, Module())
    return node


def place(root: Module, path: str, module: Module) -> Module:
    """Attach ``module`` under a dotted HF path, creating plain container modules on the way; returns it."""
    *parents, name = path.split(".")
    return _container(root, parents).add(name, module)


def add_param(root: Module, path: str, shape) -> None:
    """Declare a parameter under a dotted HF path (a lone tensor such as ``self_attn.sinks``)."""
    *parents, name = path.split(".")
    _container(root, parents).param(name, shape)


def get_param(root: Module, path: str):
    """The parameter at a dotted HF path under ``root`` (its Tensor once loaded)."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        node = node._modules[part]
    return getattr(node, name)
