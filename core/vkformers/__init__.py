"""vkformers: train and run Hugging Face Transformer models on any GPU through Vulkan."""
from vkformers import models  # noqa: F401  (installs the plugin kernel directories)
from vkformers.errors import VkformersError
from vkformers.runtime import Buffer, Device, Sequence, dtypes, get_device
from vkformers.runtime.dtypes import bfloat16, float16, float32, int32, uint8

__version__ = "0.1.0"

__all__ = ["Buffer", "Device", "Sequence", "VkformersError", "bfloat16", "dtypes", "float16", "float32",
           "get_device", "int32", "uint8"]
