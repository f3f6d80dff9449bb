"""Matrix multiply launcher: ``C[b] = alpha * op(A[b]) @ op(B[b]) (+ bias) + beta * C[b]``.

Two kernels, chosen per call:

- ``matmul_coopmat`` (VK_KHR_cooperative_matrix): float16 or bfloat16 A and B,
  when the device offers that 16x16x16 -> float32 subgroup shape. Workgroup tile
  128 x 128, each of 8 subgroups owns 64 x 32 as 4 x 2 accumulators, K steps of
  64 (32 where shared memory is short).
- ``matmul`` (tiled, shared memory + register blocking): every dtype, every device.

Both accumulate in float32 and convert to C's dtype once, at the end. All
matrices are row-major and dense within a batch; ``bias`` (length n, broadcast
over rows) has C's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

from vkformers.engine.kernels import Operand, operand, require_elements
from vkformers.runtime import dtypes as dt

SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
INPUT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class TiledConfig:
    bm: int
    bn: int
    bk: int
    tm: int
    tn: int

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def shared_bytes(self) -> int:
        return 4 * self.bk * (self.bm + 4 + self.bn + 4)


# A GPU with 48 KiB of shared memory: 128 x 64 tiles, 8 x 4 per invocation (on the
# H200 8 x 8 per invocation ran 16x slower: the driver spills the accumulators).
TILED_LARGE = TiledConfig(bm=128, bn=64, bk=16, tm=8, tn=4)
# lavapipe (32 KiB) and small problems: 64 x 64 tiles, 4 x 4 per invocation.
TILED_SMALL = TiledConfig(bm=64, bn=64, bk=16, tm=4, tn=4)


@dataclass(frozen=True)
class CoopmatConfig:
    sg_rows: int = 2   # subgroups along M (each 64 rows)
    sg_cols: int = 4   # subgroups along N (each 32 columns)
    bk: int = 64       # K step (multiple of 16); on the H200 64 ran 1.5x faster than 32

    @property
    def bm(self) -> int:
        return 64 * self.sg_rows

    @property
    def bn(self) -> int:
        return 32 * self.sg_cols

    def shared_bytes(self) -> int:
        # Two tiles padded by 8 halves per row (the larger of the two layouts each),
        # plus a 16x16 float32 epilogue slice per subgroup.
        def tile(rows_cols: int) -> int:
            return 16 * max(rows_cols * (self.bk // 8 + 1), self.bk * (rows_cols // 8 + 1))
        return tile(self.bm) + tile(self.bn) + 1024 * self.sg_rows * self.sg_cols

    def check(self, subgroup: int) -> None:
        """Refuse a configuration the kernel cannot run: each invocation moves a whole
        number of 8-half chunks of each tile, at most MAX_CHUNKS (16) of them."""
        threads = self.sg_rows * self.sg_cols * subgroup
        for chunks in (self.bm * self.bk // 8, self.bn * self.bk // 8):
            if self.bk % 16 or chunks % threads or chunks // threads > 16:
                raise ValueError(f"matmul: {self} cannot run with subgroups of {subgroup}")


COOPMAT_DEFAULT = CoopmatConfig()
COOPMAT_SMALL_SHARED = CoopmatConfig(bk=32)  # devices with less than 45 KiB of shared memory


def coopmat_config(device) -> CoopmatConfig:
    shared = device.limits["max_compute_shared_memory_size"]
    return COOPMAT_DEFAULT if COOPMAT_DEFAULT.shared_bytes() <= shared else COOPMAT_SMALL_SHARED


def coopmat_supported(device, in_dtype) -> bool:
    """Whether ``device`` has the subgroup 16x16x16 ``in_dtype`` -> float32 cooperative matrix we use."""
    name = dt.as_dtype(in_dtype).name
    if name not in ("float16", "bfloat16"):
        return False
    if name == "bfloat16" and not device.features.get("shaderBFloat16CooperativeMatrix"):
        return False
    if name == "float16" and not device.features.get("shaderFloat16"):
        return False
    return any(s["m"] == 16 and s["n"] == 16 and s["k"] == 16 and s["a_type"] == name and s["b_type"] == name
               and s["c_type"] == "float32" and s["result_type"] == "float32" and s["scope"] == "subgroup"
               for s in device.cooperative_matrix_shapes)


def select_algorithm(device, in_dtype) -> str:
    """``"coopmat"`` where the device supports it for ``in_dtype``, else ``"tiled"``."""
    return "coopmat" if coopmat_supported(device, in_dtype) else "tiled"


def tiled_config(device, m: int, n: int) -> TiledConfig:
    big = device.limits["max_compute_shared_memory_size"] >= 48 * 1024 and not device.is_cpu
    return TILED_LARGE if big and m * n >= 256 * 256 else TILED_SMALL


def matmul(seq, a: Operand, b: Operand, c: Operand, *, m: int, n: int, k: int, batch: int = 1,
           trans_a: bool = False, trans_b: bool = False, stride_a: int | None = None,
           stride_b: int | None = None, stride_c: int | None = None, bias: Operand | None = None,
           alpha: float = 1.0, beta: float = 0.0, algorithm: str = "auto",
           tiled: TiledConfig | None = None, coopmat: CoopmatConfig | None = None) -> None:
    """Record ``C[b] = alpha * op(A[b]) @ op(B[b]) (+ bias) + beta * C[b]`` for b < batch into ``seq``.

    A is [m, k] ([k, m] when ``trans_a``), B is [k, n] ([n, k] when ``trans_b``),
    C is [m, n]; all row-major. Batch strides are in elements (default: dense).
    A and B share one dtype (float32, float16 or bfloat16); C is any of the three;
    ``bias`` (n elements) has C's dtype. ``beta == 0`` never reads C.
    ``algorithm``: "auto" (cooperative matrix when the device has it for the input
    dtype), "tiled" or "coopmat"; ``tiled``/``coopmat`` override tile configurations
    (benchmarks).
    """
    a, b, c = operand(a), operand(b), operand(c)
    bias = operand(bias) if bias is not None else None
    in_dtype, out_dtype = a.dtype.name, c.dtype.name
    if in_dtype not in INPUT_DTYPES or b.dtype.name != in_dtype:
        raise TypeError(f"matmul: A and B must both be float32, float16 or bfloat16, got {in_dtype} and {b.dtype.name}")
    if out_dtype not in INPUT_DTYPES:
        raise TypeError(f"matmul: C must be float32, float16 or bfloat16, got {out_dtype}")
    if bias is not None and bias.dtype.name != out_dtype:
        raise TypeError(f"matmul: bias must have C's dtype ({out_dtype}), got {bias.dtype.name}")
    if min(m, n, k, batch) < 1:
        raise ValueError(f"matmul: sizes must be positive, got m={m} n={n} k={k} batch={batch}")

    stride_a = m * k if stride_a is None else stride_a
    stride_b = k * n if stride_b is None else stride_b
    stride_c = m * n if stride_c is None else stride_c
    if batch == 1:
        stride_a = stride_b = stride_c = 0
    for x, size, stride, what in ((a, m * k, stride_a, "A"), (b, k * n, stride_b, "B"), (c, m * n, stride_c, "C")):
        require_elements(x, (batch - 1) * stride + size, f"matmul {what}")
    if bias is not None:
        require_elements(bias, n, "matmul bias")
    for value in (stride_a, stride_b, stride_c, a.offset, b.offset, c.offset, bias.offset if bias else 0):
        if not 0 <= value < 2**32:
            raise ValueError(f"matmul: offsets and strides must fit in 32 bits, got {value}")

    device = seq.device
    if algorithm == "auto":
        algorithm = select_algorithm(device, in_dtype)
    elif algorithm == "coopmat" and not coopmat_supported(device, in_dtype):
        raise ValueError(f"matmul: {device.name} has no {in_dtype} cooperative matrix")
    elif algorithm not in ("tiled", "coopmat"):
        raise ValueError(f"matmul: algorithm must be 'auto', 'tiled' or 'coopmat', not {algorithm!r}")

    variant = f"{SHORT[in_dtype]}_{SHORT[out_dtype]}"
    buffers = [a.buffer, b.buffer, c.buffer, (bias or c).buffer]
    push = [m, n, k, a.offset, b.offset, c.offset, bias.offset if bias else 0,
            stride_a, stride_b, stride_c, float(alpha), float(beta)]
    flags = [int(trans_a), int(trans_b), int(bias is not None)]

    if algorithm == "coopmat":
        cfg = coopmat or coopmat_config(device)
        subgroup = device.limits["subgroup_size"]
        cfg.check(subgroup)
        # 8 halves are staged at a time; whole-vector loads need the contiguous
        # dimension, the offset and the batch stride to be multiples of 8.
        inner_a, inner_b = (m if trans_a else k), (k if trans_b else n)
        aligned_a = int(inner_a % 8 == 0 and a.offset % 8 == 0 and stride_a % 8 == 0)
        aligned_b = int(inner_b % 8 == 0 and b.offset % 8 == 0 and stride_b % 8 == 0)
        spec = [cfg.sg_rows, cfg.sg_cols, cfg.bk, *flags, aligned_a, aligned_b,
                cfg.sg_rows * cfg.sg_cols * subgroup]
        groups = (-(-n // cfg.bn), -(-m // cfg.bm), batch)
        seq.dispatch(device.kernel("matmul_coopmat", variant), buffers, groups, push, spec)
        return

    cfg = tiled or tiled_config(device, m, n)
    spec = [cfg.bm, cfg.bn, cfg.bk, cfg.tm, cfg.tn, *flags, cfg.threads]
    groups = (-(-n // cfg.bn), -(-m // cfg.bm), batch)
    seq.dispatch(device.kernel("matmul", variant), buffers, groups, push, spec)
