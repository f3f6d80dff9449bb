"""Kernel launchers: record one op's dispatches into a runtime Sequence.

A launcher knows nothing of tensors or autograd. It takes :class:`Operand`s
(a buffer plus an element offset, so views cost no copy), sizes and flags, checks
them, picks the kernel variant for the dtypes and the device, and calls
``seq.dispatch``. The engine's ops (forward and backward) call launchers.
"""
from __future__ import annotations

from dataclasses import dataclass

from vkformers.runtime.vulkan import Buffer

# Loop iterations one invocation may run in one dispatch, all its loops together: llvmpipe (lavapipe) ends every loop
# of an invocation, without a word, once they have run 65535. Launchers whose invocations walk a sequence step by
# step split it (across invocations or dispatches) to stay within this.
LOOP_ITERATIONS = 60000

# llvmpipe (lavapipe) puts at most 16 invocations in a subgroup of a compute shader (its widest vector is 512 bits)
# while it reports LP_NATIVE_VECTOR_WIDTH / 32 lanes: 32 or 64 for 1024 or 2048 bits.
LLVMPIPE_MAX_LANES = 16
INTEL_VENDOR_ID = 0x8086


def subgroup_lanes(device) -> int:
    """The invocations every subgroup of a kernel surely holds (in a workgroup of whole subgroups): the device's
    ``subgroup_size``, or fewer where the driver reports one size, which gl_SubgroupSize reads, and runs narrower
    subgroups under it. Vulkan allows that unless a pipeline requires full subgroups (kp's pipelines do not):
    gl_NumSubgroups and gl_SubgroupID then count the narrower subgroups, and a kernel whose lanes stride by
    gl_SubgroupSize skips the work of the lanes that are not there. llvmpipe runs at most LLVMPIPE_MAX_LANES;
    Intel's Mesa driver keeps gl_SubgroupSize at 32 for kernels older than SPIR-V 1.6 while it compiles each for
    8, 16 or 32 lanes (``min_subgroup_size`` up)."""
    size = int(device.limits["subgroup_size"])
    if getattr(device, "info", {}).get("driver_name") == "llvmpipe":
        return min(size, LLVMPIPE_MAX_LANES)
    if device.limits.get("vendor_id") == INTEL_VENDOR_ID:
        return min(size, int(device.limits.get("min_subgroup_size") or size))
    return size


def subgroups_are_full(device) -> bool:
    """Whether each subgroup of a kernel holds gl_SubgroupSize invocations (see :func:`subgroup_lanes`)."""
    return subgroup_lanes(device) == int(device.limits["subgroup_size"])


@dataclass(frozen=True)
class Operand:
    """``buffer`` seen from element ``offset`` on (elements of the buffer's dtype)."""

    buffer: Buffer
    offset: int = 0

    @property
    def dtype(self):
        return self.buffer.dtype

    @property
    def available(self) -> int:
        """Elements from the offset to the end of the buffer."""
        return self.buffer.count - self.offset


def operand(x) -> Operand:
    return x if isinstance(x, Operand) else Operand(x)


def require_elements(x: Operand, count: int, what: str) -> None:
    if count > x.available:
        raise ValueError(f"{what}: needs {count} elements from offset {x.offset}, "
                         f"buffer {x.buffer.name!r} has {x.available}")


def grid(count: int, local_size: int, max_x: int) -> tuple[int, int, int]:
    """Workgroups covering ``count`` invocations in a 2-D grid (common.glsl's global_index())."""
    groups = -(-count // local_size)
    x = min(groups, max_x)
    return (x, -(-groups // x), 1)
