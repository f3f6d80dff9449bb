"""The Vulkan runtime: devices, buffers, kernels, recorded sequences (see vulkan.py)."""
from vkformers.runtime import dtypes
from vkformers.runtime.kernels import KernelDir, build_kernels, kernel_dirs
from vkformers.runtime.vulkan import Buffer, Device, Kernel, Sequence, describe_devices, get_device

__all__ = ["Buffer", "Device", "Kernel", "KernelDir", "Sequence", "build_kernels", "describe_devices", "dtypes",
           "get_device", "kernel_dirs"]
