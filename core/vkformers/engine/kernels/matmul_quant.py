"""Products and row lookups with a quantized weight (shaders/common/matmul_quant.comp, embedding.comp's quant
variants), dequantizing the packed blocks as they are read (shaders/common/quant_block.glsl).

- :func:`matmul_quant`: ``C = A @ W^T`` (W [n, k], a Linear layer's forward) or ``C = A @ W`` (W [k, n], its
  input gradient). Up to MATVEC_MAX_ROWS rows of A take the matvec kernel (a workgroup per MATVEC_COLS
  columns of C, its invocations on consecutive 32-weight units of W), more the tiled kernel, which dequantizes
  a BK x BN slice of W per step into shared memory; float16 or bfloat16 activations on a device with their
  cooperative matrices take matmul_coopmat.comp's quant variants instead, which dequantize W's tile as they
  stage it in shared memory and multiply on the matrix units.
- :func:`embedding_quant`: rows of a quantized table picked by token ids.

A and C have one activation dtype (float32, float16 or bfloat16); sums are float32. The packed operand is a
uint8 buffer whose offset is in bytes; its rows are ``format.row_bytes(cols)`` long.
"""
from __future__ import annotations

from dataclasses import dataclass

from vkformers.engine.kernels import Operand, grid, operand, require_elements
from vkformers.engine.kernels.matmul import coopmat_config, coopmat_supported
from vkformers.engine.kernels.transformer_args import element_groups, fits_uint32

ACTIVATION_VARIANTS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
MATVEC_MAX_ROWS = 8  # rows of A per matvec dispatch on a GPU
# A CPU device (lavapipe) takes the matvec kernel for up to CPU_MATVEC_MAX rows, CPU_MATVEC_ROWS per dispatch:
# there the tiled kernel took 11 s for a 49152 x 576 Q4_1 weight whatever m up to its 64-row tile, the matvec
# 0.4 s at m = 1 and 1.6 s at m = 8.
CPU_MATVEC_ROWS = 32
CPU_MATVEC_MAX = 256
MATVEC_THREADS = 64  # per workgroup on a GPU (at most 128: the kernel sums at most 32 subgroups)
MATVEC_COLS = 2     # columns of C per matvec workgroup on a GPU: each unit of A read serves them all
CPU_MATVEC_THREADS = 64


@dataclass(frozen=True)
class QuantTileConfig:
    bm: int = 64
    bn: int = 64
    bk: int = 32
    tm: int = 4
    tn: int = 4

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def check(self) -> None:
        if self.bk % 8 or self.bn % 8 or self.tm > 8 or self.tn > 8 or self.bm % self.tm or self.bn % self.tn:
            raise ValueError(f"matmul_quant: tile configuration {self} is not valid")


QUANT_TILE = QuantTileConfig()


def _packed(w, fmt, rows: int, cols: int, what: str) -> Operand:
    w = operand(w)
    if w.dtype.name != "uint8":
        raise TypeError(f"{what}: the packed weight must be a uint8 buffer, not {w.dtype.name}")
    if cols % fmt.block:
        raise ValueError(f"{what}: {fmt.name} rows hold whole blocks of {fmt.block}, got {cols} columns")
    if w.offset % 4:
        raise ValueError(f"{what}: the packed weight must start on a 4-byte word, offset {w.offset}")
    require_elements(w, rows * fmt.row_bytes(cols), what)
    return w


def _activations(a: Operand, c: Operand, what: str) -> str:
    if a.dtype.name not in ACTIVATION_VARIANTS or c.dtype.name != a.dtype.name:
        raise TypeError(f"{what}: A and C must share one of float32, float16, bfloat16; got "
                        f"{a.dtype.name} and {c.dtype.name}")
    return ACTIVATION_VARIANTS[a.dtype.name]


def matmul_quant(seq, a, w, c, fmt, *, m: int, n: int, k: int, trans_w: bool = True, algorithm: str = "auto",
                 tile: QuantTileConfig | None = None, split_k: bool | None = None) -> None:
    """Record ``C [m, n] = A [m, k] @ W^T`` (``trans_w``: W [n, k]) or ``A @ W`` (W [k, n]) into ``seq``; W
    packed in ``fmt`` (engine.quantized.QuantFormat). ``algorithm``: "auto" (matvec up to MATVEC_MAX_ROWS rows,
    CPU_MATVEC_MAX on a CPU device; else coopmat where the device has the activations' cooperative matrix, else
    tiled), "matvec" (trans_w only; in blocks of rows), "tiled" or "coopmat". ``tile``
    overrides the tiled kernel's configuration, ``split_k`` the matvec's layout (default: by device)."""
    a, c = operand(a), operand(c)
    variant = _activations(a, c, "matmul_quant")
    if min(m, n, k) < 1:
        raise ValueError(f"matmul_quant: sizes must be positive, got m={m} n={n} k={k}")
    w_rows, w_cols = (n, k) if trans_w else (k, n)
    w = _packed(w, fmt, w_rows, w_cols, "matmul_quant W")
    require_elements(a, m * k, "matmul_quant A")
    require_elements(c, m * n, "matmul_quant C")
    fits_uint32("matmul_quant", max(m * k, m * n, w.offset + w_rows * fmt.row_bytes(w_cols)))
    device = seq.device
    if algorithm == "auto":
        if trans_w and m <= (CPU_MATVEC_MAX if device.is_cpu else MATVEC_MAX_ROWS):
            algorithm = "matvec"
        else:
            algorithm = "coopmat" if coopmat_supported(device, a.dtype) else "tiled"
    if algorithm == "matvec" and not trans_w:
        raise ValueError("matmul_quant: the matvec kernel takes A @ W^T only")
    if algorithm == "coopmat" and not coopmat_supported(device, a.dtype):
        raise ValueError(f"matmul_quant: {device.name} has no {a.dtype.name} cooperative matrix")
    if algorithm not in ("matvec", "tiled", "coopmat"):
        raise ValueError(f"matmul_quant: algorithm must be 'auto', 'matvec', 'tiled' or 'coopmat', not {algorithm!r}")
    if algorithm == "coopmat":
        _coopmat(seq, a, w, c, fmt, m=m, n=n, k=k, trans_w=trans_w, row_bytes=fmt.row_bytes(w_cols))
        return
    buffers = [a.buffer, w.buffer, c.buffer]
    kernel = device.kernel("matmul_quant", variant)
    cfg = tile or QUANT_TILE
    cfg.check()
    if algorithm == "matvec":
        # A GPU splits each column's k over a workgroup (coalesced reads of W); a CPU device gives each
        # invocation a whole column (on lavapipe 10x faster: no reduction, one row streamed per invocation).
        by_column = device.is_cpu if split_k is None else not split_k
        cols = 1 if by_column else MATVEC_COLS
        threads = CPU_MATVEC_THREADS if by_column else MATVEC_THREADS
        max_x = device.limits["max_compute_work_group_count_x"]
        groups = grid(n, threads, max_x) if by_column else grid(-(-n // cols), 1, max_x)
        step = CPU_MATVEC_ROWS if device.is_cpu else MATVEC_MAX_ROWS
        per_vector = 4 if variant == "f32" else 8  # elements of A in 16 bytes
        for first in range(0, m, step):  # blocks of rows, each reading W once
            rows = min(step, m - first)
            a_offset = a.offset + first * k
            push = [rows, n, k, a_offset, w.offset, c.offset + first * n, fmt.row_bytes(w_cols)]
            spec = [fmt.shader_id, 0, 1, cfg.bm, cfg.bn, cfg.bk, cfg.tm, cfg.tn, threads, int(not by_column),
                    rows, cols, int(a_offset % per_vector == 0), int(w.offset % 16 == 0)]
            seq.dispatch(kernel, buffers, groups, push, spec)
        return
    push = [m, n, k, a.offset, w.offset, c.offset, fmt.row_bytes(w_cols)]
    groups = (-(-n // cfg.bn), -(-m // cfg.bm), 1)
    spec = [fmt.shader_id, 1, int(trans_w), cfg.bm, cfg.bn, cfg.bk, cfg.tm, cfg.tn, cfg.threads, 1, 1, 1, 0, 0]
    seq.dispatch(kernel, buffers, groups, push, spec)


def _coopmat(seq, a: Operand, w: Operand, c: Operand, fmt, *, m: int, n: int, k: int, trans_w: bool,
             row_bytes: int) -> None:
    """matmul_coopmat.comp's quant variant: the cooperative-matrix tile product with W dequantized as its tile is
    staged (off_b: W's byte offset, stride_b: its row bytes; one product, so no batch stride is needed)."""
    device = seq.device
    cfg = coopmat_config(device, m, n)
    subgroup = device.limits["subgroup_size"]
    cfg.check(subgroup)
    aligned_a = int(k % 8 == 0 and a.offset % 8 == 0)
    push = [m, n, k, a.offset, w.offset, c.offset, 0, 0, row_bytes, 0, 1.0, 0.0, 0]
    spec = [cfg.sg_rows, cfg.sg_cols, cfg.bk, 0, int(trans_w), 0, aligned_a, 1, cfg.sg_rows * cfg.sg_cols * subgroup,
            cfg.frag_m, cfg.frag_n, 0, 0, 0, 1, 0, cfg.group_rows, fmt.shader_id]
    variant = "f16_f16_quant" if a.dtype.name == "float16" else "bf16_bf16_quant"
    seq.dispatch(device.kernel("matmul_coopmat", variant), [a.buffer, w.buffer, c.buffer, c.buffer, c.buffer],
                 (-(-n // cfg.bn), -(-m // cfg.bm), 1), push, spec)


def embedding_quant(seq, table, ids, out, fmt, *, count: int, dim: int, vocab: int) -> None:
    """out [count, dim] = rows of the packed table [vocab, dim] picked by int32 ids (a zero row for an id
    outside [0, vocab))."""
    ids, out = operand(ids), operand(out)
    table = _packed(table, fmt, vocab, dim, "embedding_quant table")
    if ids.dtype.name != "int32":
        raise TypeError(f"embedding_quant: ids must be int32, not {ids.dtype.name}")
    if out.dtype.name not in ACTIVATION_VARIANTS:
        raise TypeError(f"embedding_quant: out must be float32, float16 or bfloat16, not {out.dtype.name}")
    require_elements(ids, count, "embedding_quant ids")
    require_elements(out, count * dim, "embedding_quant out")
    fits_uint32("embedding_quant", max(count * dim, table.offset + vocab * fmt.row_bytes(dim)))
    kernel = seq.device.kernel("embedding", "quant_" + ACTIVATION_VARIANTS[out.dtype.name])
    seq.dispatch(kernel, [ids.buffer, table.buffer, out.buffer], element_groups(seq, count * dim // 4),
                 push=[count, dim, vocab, ids.offset, table.offset, out.offset, -1],  # -1: no padding_idx
                 spec=[fmt.shader_id, fmt.row_bytes(dim)])
