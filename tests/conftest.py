"""Tests need a Vulkan device (lavapipe on CPU is enough). Without one the run stops loudly."""
import pytest

from vkformers.engine.kernels import subgroups_are_full
from vkformers.engine.ops import decode as fused_decode
from vkformers.errors import VkformersError
from vkformers.models import generation
from vkformers.runtime.vulkan import get_device


def pytest_sessionstart(session):
    try:
        get_device()
    except VkformersError as exc:
        pytest.exit(f"vkformers tests need a Vulkan device and found none: {exc}", returncode=3)
    # Decode with the fused kernels, as on a GPU, also where they are off by default (a CPU device: lavapipe in
    # CI), so that the parity and generation tests check them against transformers.
    if fused_decode.enabled is None:
        fused_decode.enabled = True
    # Likewise chain greedy decode steps (GPU-chosen tokens between them) as on a GPU: every decoder's cached
    # greedy tokens then check the chained path too.
    if generation.CHAIN_STEPS is None:
        generation.CHAIN_STEPS = 8


@pytest.fixture(scope="session")
def device():
    return get_device()


@pytest.fixture
def fused_decode_kernel(device):
    """Skips a test of the fused decode kernel where it is refused: a device whose subgroups may hold fewer lanes than
    it reports (lavapipe at LP_NATIVE_VECTOR_WIDTH 1024 or 2048; tests/test_subgroup_widths.py checks the refusal)."""
    if not subgroups_are_full(device):
        pytest.skip(f"{device.name} runs subgroups narrower than {device.limits['subgroup_size']} lanes: "
                    "the fused decode kernel is not used there")
