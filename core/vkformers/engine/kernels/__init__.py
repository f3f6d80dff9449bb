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
