"""Tests need a Vulkan device (lavapipe on CPU is enough). Without one the run stops loudly."""
import pytest

from vkformers.errors import VkformersError
from vkformers.runtime.vulkan import get_device


def pytest_sessionstart(session):
    try:
        get_device()
    except VkformersError as exc:
        pytest.exit(f"vkformers tests need a Vulkan device and found none: {exc}", returncode=3)


@pytest.fixture(scope="session")
def device():
    return get_device()
