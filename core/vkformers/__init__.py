"""vkformers: train and run Hugging Face Transformer models on any GPU through Vulkan."""
from vkformers import models  # noqa: F401  (installs the plugin kernel directories)
from vkformers.errors import VkformersError
from vkformers.runtime import Buffer, Device, Sequence, dtypes, get_device
from vkformers.runtime.dtypes import bfloat16, bool_, float16, float32, int32, uint8

__version__ = "0.1.0"

_ENGINE = {"Tensor", "tensor", "parameter", "full", "ones", "zeros", "no_grad"}
_MODELS = {"AutoModelForCausalLM": "loading", "AutoModelForMaskedLM": "loading", "AutoModelForSeq2SeqLM": "loading",
           "AutoTokenizer": "tokenizer"}


def __getattr__(name):
    # The engine and the model classes load on first use, so the runtime and the registry work without them.
    if name in _ENGINE:
        from vkformers.engine import function, tensor
        return getattr(tensor if hasattr(tensor, name) else function, name)
    if name in _MODELS:
        import importlib
        return getattr(importlib.import_module(f"vkformers.models.{_MODELS[name]}"), name)
    raise AttributeError(f"module 'vkformers' has no attribute {name!r}")


__all__ = ["Buffer", "Device", "Sequence", "VkformersError", "bfloat16", "bool_", "dtypes", "float16", "float32",
           "get_device", "int32", "uint8", *sorted(_ENGINE), *sorted(_MODELS)]
