"""Which lane holds which element of a 16 x 16 cooperative matrix, measured on the device.

VK_KHR_cooperative_matrix does not say how a subgroup's lanes share a matrix's elements, so a kernel that needs a
row's elements (a softmax over the scores of a query) must go through shared memory, unless it knows. This module
measures it once per device and dtype (``coopmat_layout.comp``: the matrix of r * 16 + c loaded as an A operand and
as a float32 accumulator, every lane's elements read back) and says whether the layout has the shape that the
attention kernels' register softmax can use:

- each lane holds elements of ``row_slots`` rows, and element index i is in the same slot (the lane's rows in
  ascending order) in every lane, so a kernel can find it at compile time (``slot_words``);
- the lanes that share a row are ``lane ^ m`` for every m made of the bits of ``row_lane_mask`` (subgroup shuffles
  reduce over them), and between them they hold each of the row's 16 elements once;
- ``a_matches_accumulator``: element i of a lane is the same (row, column) in an A operand as in an accumulator,
  so probabilities computed in an accumulator become an A operand element by element.

Mesa lavapipe 26 (subgroups of 8, cooperative matrices lowered to vectors): each lane holds two columns, all 16 rows,
A and accumulator alike (row_slots 16, row_lane_mask 7).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine.kernels.matmul import coopmat_supported
from vkformers.runtime import dtypes as dt

SIZE = 16
MAX_ELEMENTS = 64  # per lane, as coopmat_layout.comp writes them
ACC_AT = 64 + 64 * 64


@dataclass(frozen=True)
class CoopmatLayout:
    """The layout of a 16 x 16 accumulator (float32) on a device, in the form the attention kernels use."""

    elements: int                 # per lane
    row_slots: int                # rows each lane holds
    row_lane_mask: int            # lanes lane ^ m, m made of these bits, share the lane's rows
    slots: tuple[int, ...]        # the slot of each element index (the same in every lane)
    a_matches_accumulator: bool   # A operands (16-bit) lay their elements out as accumulators do

    @property
    def slot_words(self) -> list[int]:
        """The slots packed 4 bits per element, 8 elements per word, 4 words (kernels' SLOT_WORD0..3)."""
        words = [0, 0, 0, 0]
        for i, slot in enumerate(self.slots):
            words[i // 8] |= slot << (4 * (i % 8))
        return words

    def spec(self) -> list[int]:
        """The kernels' specialization constants ROW_SLOTS, ROW_LANE_MASK, SLOT_WORD0..3."""
        return [self.row_slots, self.row_lane_mask, *self.slot_words]


def analyse(a_cells, acc_cells) -> CoopmatLayout | None:
    """The layout from each lane's (row, column) per element index (``[lane][i] -> (r, c)``) of an A operand and an
    accumulator, or None where the accumulator's does not have the form the kernels use (see the module)."""
    lanes = len(acc_cells)
    elements = len(acc_cells[0])
    if lanes & (lanes - 1) or elements * lanes != SIZE * SIZE or elements > 32 \
            or any(len(cells) != elements for cells in acc_cells):
        return None
    if sorted(cell for cells in acc_cells for cell in cells) != [(r, c) for r in range(SIZE) for c in range(SIZE)]:
        return None  # not every element once
    rows = [sorted({r for r, _ in cells}) for cells in acc_cells]
    slots = [tuple(rows[lane].index(r) for r, _ in cells) for lane, cells in enumerate(acc_cells)]
    if any(s != slots[0] for s in slots) or max(slots[0]) >= 16:
        return None
    # The lanes sharing lane 0's rows span a mask; every lane's sharers must be exactly its xor-orbit under it.
    mask = 0
    for lane in range(lanes):
        if rows[lane] == rows[0]:
            mask |= lane
    orbit = [m for m in range(lanes) if m & ~mask == 0]
    for lane in range(lanes):
        sharers = sorted(other for other in range(lanes) if rows[other] == rows[lane])
        if sharers != sorted(lane ^ m for m in orbit):
            return None
        # Each row held by the orbit's lanes, in the same slot, 16 columns between them.
        for slot, row in enumerate(rows[lane]):
            columns = sorted(c for other in sharers for (r, c), s in zip(acc_cells[other], slots[0])
                             if s == slot and r == row)
            if columns != list(range(SIZE)):
                return None
    a_matches = len(a_cells) == lanes and all(list(a) == list(c) for a, c in zip(a_cells, acc_cells))
    return CoopmatLayout(elements, len(rows[0]), mask, slots[0], a_matches)


_layouts: dict[tuple[int, str], CoopmatLayout | None] = {}


def coopmat_layout(device, dtype: str) -> CoopmatLayout | None:
    """The measured layout of ``device``'s 16 x 16 cooperative matrices of ``dtype`` (float16 or bfloat16), or None
    where the device has none or their layout does not have the form the kernels use. Measured once per device."""
    key = (id(device), dtype)
    if key not in _layouts:
        try:
            _layouts[key] = _measure(device, dtype) if coopmat_supported(device, dtype) else None
        except RuntimeError:  # a driver that cannot build or run the probe: no layout, the shared-memory paths run
            _layouts[key] = None
    return _layouts[key]


def _measure(device, dtype: str) -> CoopmatLayout | None:
    subgroup = int(device.limits["subgroup_size"])
    matrix = np.arange(SIZE * SIZE, dtype=np.float32)
    bits = dt.to_bfloat16(matrix) if dtype == "bfloat16" else matrix.astype(np.float16).view(np.uint16)
    halves = device.upload(np.ascontiguousarray(bits).view(np.uint32), name="coopmat layout halves")
    floats = device.upload(matrix, name="coopmat layout floats")
    result = device.buffer(ACC_AT + 64 * 64, "float32", name="coopmat layout result")
    seq = device.sequence()
    seq.dispatch(device.kernel("coopmat_layout", "bf16" if dtype == "bfloat16" else "f16"),
                 [halves, floats, result], (1, 1, 1), spec=[subgroup])
    seq.replay()
    out = result.read()
    a_len, acc_len = int(out[0]), int(out[1])
    if not 0 < acc_len <= MAX_ELEMENTS or not 0 < a_len <= MAX_ELEMENTS:
        return None

    def cells(at: int, count: int):
        values = out[at: at + 64 * subgroup].reshape(subgroup, 64)[:, :count].astype(np.int64)
        return [[(int(v) // SIZE, int(v) % SIZE) for v in lane] for lane in values]

    return analyse(cells(64, a_len), cells(ACC_AT, acc_len))
