"""Bad input raises a named, explanatory error; it never crashes the process."""
import os
import subprocess
import sys

import numpy as np
import pytest

from vkformers.errors import (
    BufferTooLargeError,
    DeviceIndexError,
    KernelBindingError,
    KernelNotFoundError,
    NoVulkanDeviceError,
    OutOfDeviceMemoryError,
)
from vkformers.runtime import vulkan
from vkformers.runtime.kernels import find_spirv
from vkformers.runtime.spirv import SpirvError, reflect

NO_DRIVER_ENV = {**os.environ, "VK_ICD_FILENAMES": "/nonexistent/icd.json", "VK_DRIVER_FILES": "/nonexistent/icd.json"}


def test_missing_spirv_file(device):
    with pytest.raises(KernelNotFoundError, match=r"no_such_kernel.*build-kernels"):
        device.kernel("no_such_kernel")
    with pytest.raises(KernelNotFoundError, match="variant 'f64'"):
        device.kernel("axpby", "f64")


def test_binding_count_mismatch(device):
    x = device.upload(np.zeros(4, np.uint32))
    with pytest.raises(KernelBindingError, match="2 storage-buffer binding.*1 buffer"):
        device.sequence().dispatch(device.kernel("axpby", "u32"), [x], (1,), [4, 1, 1])


def test_push_constant_size_mismatch(device):
    x, y = device.upload(np.zeros(4, np.uint32)), device.upload(np.zeros(4, np.uint32))
    with pytest.raises(KernelBindingError, match="12 bytes of push constants; 8"):
        device.sequence().dispatch(device.kernel("axpby", "u32"), [x, y], (1,), [4, 1])


def test_workgroup_count_out_of_range(device):
    x, y = device.upload(np.zeros(4, np.uint32)), device.upload(np.zeros(4, np.uint32))
    with pytest.raises(KernelBindingError, match="workgroup count"):
        device.sequence().dispatch(device.kernel("axpby", "u32"), [x, y], (0,), [4, 1, 1])


def test_buffer_over_max_storage_buffer_range(device):
    too_many = device.max_buffer_bytes // 4 + 1
    with pytest.raises(BufferTooLargeError, match=r"'huge'.*maxStorageBufferRange"):
        device.buffer(too_many, "float32", name="huge")


def test_out_of_device_memory_names_the_buffer(device, monkeypatch):
    def fail(*args):
        raise RuntimeError("vk::Device::allocateMemory: ErrorOutOfDeviceMemory")
    monkeypatch.setattr(device, "_manager", type("M", (), {"tensor_t": staticmethod(fail)})())
    with pytest.raises(OutOfDeviceMemoryError, match=r"'weights'.*4,000 bytes"):
        vulkan.Buffer(device, 1000, "float32", name="weights")


def test_corrupt_spirv():
    with pytest.raises(SpirvError, match="magic"):
        reflect(b"\x00" * 64)
    with pytest.raises(SpirvError):
        reflect(b"abc")


def test_aliased_binding_is_written_if_any_view_writes():
    """The coopmat matmul declares C twice (16-bit elements and 16-byte vectors; the second write-only): one
    binding, which the recorder must treat as written."""
    for variant in ("f16_f16", "bf16_bf16", "f16_f32"):
        iface = reflect(find_spirv("matmul_coopmat", variant).read_bytes())
        assert [b.index for b in iface.bindings] == [0, 1, 2, 3, 4]
        assert [b.readonly for b in iface.bindings] == [True, True, False, True, True]


def test_push_block_ending_in_an_array_is_sized_by_its_length():
    """copy_strided's push block: shape[6], src_stride[6], src_offset, dst_offset, dst_stride[6] (20 uints)."""
    assert reflect(find_spirv("copy_strided", "b32").read_bytes()).push_constant_bytes == 80


def test_bad_device_index(monkeypatch):
    with pytest.raises(DeviceIndexError, match="index 99 does not exist; devices are 0: "):
        vulkan.get_device(99)
    monkeypatch.setenv("VKFORMERS_DEVICE", "gpu0")
    with pytest.raises(DeviceIndexError, match="VKFORMERS_DEVICE='gpu0'"):
        vulkan.get_device()


def test_no_vulkan_device_says_how_to_install_lavapipe():
    code = "from vkformers.runtime.vulkan import get_device; get_device()"
    result = subprocess.run([sys.executable, "-c", code], env=NO_DRIVER_ENV, capture_output=True, text=True)
    assert result.returncode != 0
    assert "NoVulkanDeviceError" in result.stderr and "mesa-vulkan-drivers" in result.stderr


def test_suite_fails_loudly_without_a_device(tmp_path):
    (tmp_path / "test_any.py").write_text("def test_nothing():\n    pass\n")
    conftest = os.path.join(os.path.dirname(__file__), "conftest.py")
    (tmp_path / "conftest.py").write_text(open(conftest).read())
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            env=NO_DRIVER_ENV, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "need a Vulkan device" in result.stdout + result.stderr
    assert "mesa-vulkan-drivers" in result.stdout + result.stderr


def test_no_device_error_is_a_library_error():
    assert issubclass(NoVulkanDeviceError, RuntimeError)
