"""Exceptions raised by vkformers.

Every error vkformers raises on purpose derives from :class:`VkformersError`, so
callers can catch library errors without also catching programming mistakes.
"""
from __future__ import annotations


class VkformersError(Exception):
    """Base class of every error raised on purpose by vkformers."""


class UnknownArchitectureError(VkformersError, LookupError):
    """A Hugging Face ``model_type`` that no installed plugin registers.

    The message names the type, the closest known spellings and, when the
    plugin that provides the type is not installed, the ``pip install`` line.
    """


class DuplicateArchitectureError(VkformersError):
    """Two plugins register the same canonical architecture or alias spelling."""


class ArchitectureDeclarationError(VkformersError, ValueError):
    """A plugin's architecture declaration is malformed (no norm, an unknown kind or status, a wrapper that is
    not a NestedConfig, a model class that is not "package.module:ClassName")."""


LAVAPIPE_HINT = (
    "To run on the CPU, install Mesa's lavapipe driver and the Vulkan loader: "
    "`sudo apt-get install mesa-vulkan-drivers libvulkan1` (Debian/Ubuntu), "
    "`sudo dnf install mesa-vulkan-drivers vulkan-loader` (Fedora)."
)


class NoVulkanDeviceError(VkformersError, RuntimeError):
    """No Vulkan loader, no driver, or no physical device."""


class DeviceIndexError(VkformersError, IndexError):
    """A device index (argument or VKFORMERS_DEVICE) that names no device."""


class DeviceFeatureError(VkformersError, RuntimeError):
    """A kernel or dtype that needs a device feature (16-bit floats, 16-bit integers, ...) the device lacks."""


class KernelNotFoundError(VkformersError, FileNotFoundError):
    """A kernel whose compiled SPIR-V file is missing."""


class KernelBindingError(VkformersError, ValueError):
    """A dispatch whose buffers or push constants do not match the kernel."""


class BufferTooLargeError(VkformersError, ValueError):
    """A buffer larger than the device can bind (maxStorageBufferRange)."""


class RowBlocksError(VkformersError, AttributeError):
    """An op that reads a weight whole was given one held in blocks of rows (engine/row_blocks.py)."""


class OutOfDeviceMemoryError(VkformersError, MemoryError):
    """The device ran out of memory; the message names the buffer and its size."""


class ArgumentError(VkformersError, TypeError):
    """A call whose arguments contradict each other (an axis given both as ``dim=`` and ``axis=``)."""


class InputError(VkformersError, ValueError):
    """Model or generation inputs that the model cannot run: token ids outside the vocabulary, a mask of the wrong
    shape, a sequence longer than the position table, an invalid sampling setting. The message names the
    argument and what to change."""


class UnsafePathError(VkformersError, OSError):
    """A file vkformers would write is a symbolic link (or a hard link, for appends): writing would change a
    file outside the output folder, so the write is refused."""


class OutputFolderError(VkformersError, OSError):
    """An output folder that cannot be one: an existing file of that name, or a folder that cannot be created."""


class InvalidSettingError(VkformersError, ValueError):
    """An environment setting (VKFORMERS_*) whose value is not one the setting takes."""


class QuantizationError(VkformersError, ValueError):
    """A quantized weight used as it cannot be: an unsupported block type or quantization, a shape its blocks do
    not fit, or training or saving what is frozen in packed blocks."""
