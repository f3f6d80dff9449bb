"""Matrix multiply launcher: ``C[b] = alpha * op(A[b]) @ op(B[b]) (+ bias) + beta * C[b]``.

Four kernels, chosen per call:

- ``matmul_small_m``: m of at most SMALL_M_MAX rows (token-by-token decoding,
  ``x @ W^T``). Reads B once per 8 rows of A, 16 bytes at a time, one subgroup per
  column of C (trans_b) with a subgroup reduction over k: bound by the bytes of B.
- ``matmul_coopmat`` (VK_KHR_cooperative_matrix): float16 or bfloat16 A and B,
  when the device offers that 16x16x16 -> float32 subgroup shape. For a large C a
  workgroup tile of 128 x 256, each of 8 subgroups owning 64 x 64 as 4 x 4
  accumulators, K steps of 32; smaller tiles (and split K) where C has few tiles.
- ``matmul_skinny`` (VK_KHR_cooperative_matrix): ``x @ W^T`` of a few rows (a batched decode step; see
  :func:`prefers_skinny`): subgroups that split K, each staging its own fragments, no workgroup barrier in the loop.
- ``matmul`` (tiled, shared memory + register blocking): every dtype, every device.

Both accumulate in float32 and convert to C's dtype once, at the end. All
matrices are row-major and dense within a batch; ``bias`` (length n, broadcast
over rows) has C's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

from vkformers.engine.kernels import Operand, operand, require_elements, subgroup_lanes
from vkformers.runtime import dtypes as dt

SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
GATE_MODES = {"rows": 1, "depth": 2, "span_rows": 3, "span_depth": 4}  # the kernels' GATE_MODE (matmul_io.glsl)
SPAN_GATES = ("span_rows", "span_depth")
INPUT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class TiledConfig:
    bm: int
    bn: int
    bk: int
    tm: int
    tn: int
    group_rows: int = 0  # > 1: workgroups visit C in bands of this many tile rows (matmul_io.glsl)

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def shared_bytes(self) -> int:
        return 4 * self.bk * (self.bm + 4 + self.bn + 4)


# A GPU with 48 KiB of shared memory: 128 x 64 tiles, 8 x 4 per invocation (on the
# H200 8 x 8 per invocation ran 16x slower: the driver spills the accumulators).
TILED_LARGE = TiledConfig(bm=128, bn=64, bk=16, tm=8, tn=4)
# A C of at least LARGE_TILE_MIN_WORKGROUPS such tiles: 128 x 128, 512 invocations (bench/matmul.py --sweep on
# the H200, float32: 4096^3 36.5 against 34.8 TFLOP/s for 128 x 64, 8192^3 37.2 against 35.9).
TILED_HUGE = TiledConfig(bm=128, bn=128, bk=16, tm=8, tn=4)
# lavapipe (32 KiB) and small problems: 64 x 64 tiles, 4 x 4 per invocation.
TILED_SMALL = TiledConfig(bm=64, bn=64, bk=16, tm=4, tn=4)


@dataclass(frozen=True)
class CoopmatConfig:
    sg_rows: int = 2   # subgroups along M
    sg_cols: int = 4   # subgroups along N
    bk: int = 64       # K step (multiple of 16); on the H200 64 ran 1.5x faster than 32
    frag_m: int = 4    # 16x16 accumulators per subgroup along M
    frag_n: int = 2    # and along N
    spec_shape: bool = False  # m, n, k as specialization constants (one pipeline per shape)
    group_rows: int = 0  # > 1: workgroups visit C in bands of this many tile rows (matmul_io.glsl)

    @property
    def bm(self) -> int:
        return 16 * self.frag_m * self.sg_rows

    @property
    def bn(self) -> int:
        return 16 * self.frag_n * self.sg_cols

    def shared_bytes(self, trans_a: bool | None = None, trans_b: bool | None = None) -> int:
        # Two tiles staged in their global layout, rows padded by 8 halves (a layout not given: the larger),
        # plus a 16x16 float32 epilogue slice per subgroup.
        def tile(rows_cols: int, k_contiguous: bool | None) -> int:
            layouts = {True: rows_cols * (self.bk // 8 + 1), False: self.bk * (rows_cols // 8 + 1)}
            return 16 * (max(layouts.values()) if k_contiguous is None else layouts[k_contiguous])
        k_contiguous_a = None if trans_a is None else not trans_a
        return tile(self.bm, k_contiguous_a) + tile(self.bn, trans_b) + 1024 * self.sg_rows * self.sg_cols

    def check(self, subgroup: int) -> None:
        """Refuse a configuration the kernel cannot run: each invocation moves a whole
        number of 8-half chunks of each tile, at most MAX_CHUNKS (16) of them."""
        threads = self.sg_rows * self.sg_cols * subgroup
        for chunks in (self.bm * self.bk // 8, self.bn * self.bk // 8):
            if self.bk % 16 or chunks % threads or chunks // threads > 16:
                raise ValueError(f"matmul: {self} cannot run with subgroups of {subgroup}")


COOPMAT_DEFAULT = CoopmatConfig()
# A C of many tiles: 128 x 256 tiles, each subgroup 64 x 64 (4 x 4 accumulators), K steps of 32 (bench/matmul.py
# --sweep on the H200, 8192^3, A @ B: 280 TFLOP/s against 232 for the default 128 x 128 tile, fp16 and bf16
# alike). Measured only there (2048 tiles), so it is taken only for a C of at least LARGE_TILE_MIN_WORKGROUPS
# such tiles, where a GPU of ~130 compute units still runs several waves of them. Its tiles are visited in
# bands of 16 tile rows (two --sweep runs at 8192^3: +2 to +8% against row by row; 4096^3, whose 16 tile rows
# make one band: within 1%).
COOPMAT_LARGE = CoopmatConfig(sg_rows=2, sg_cols=4, bk=32, frag_m=4, frag_n=4, group_rows=16)
LARGE_TILE_MIN_WORKGROUPS = 512
COOPMAT_SMALL_SHARED = CoopmatConfig(bk=32)  # devices with less than 45 KiB of shared memory
# Smaller tiles for a C of few tiles (prefill of a short prompt, narrow projections): 64 x 128, 64 x 64,
# and for m <= 32 tiles of 32 or 16 rows, so that the rows past m are not multiplied.
COOPMAT_SMALLER = (CoopmatConfig(sg_rows=2, sg_cols=4, frag_m=2, frag_n=2),
                   CoopmatConfig(sg_rows=2, sg_cols=2, frag_m=2, frag_n=2))
COOPMAT_ROWS = {16: CoopmatConfig(sg_rows=1, sg_cols=4, frag_m=1, frag_n=2),
                32: CoopmatConfig(sg_rows=2, sg_cols=2, frag_m=1, frag_n=2)}
# x @ W^T for a few rows of x (a batched decode step): K steps of 128, and 128 columns a tile up to 32 rows
# (bench/matmul.py --skinny on the H200, the Llama-3-8B shape's products at m = 8 to 64: 1.1-2.0x the weight bytes
# per second of COOPMAT_ROWS and the 64 x 64 tile in K steps of 64; m = 8 above the small-m kernel, 1.2-3.3x).
COOPMAT_SKINNY = {16: CoopmatConfig(sg_rows=1, sg_cols=4, bk=128, frag_m=1, frag_n=2),
                  32: CoopmatConfig(sg_rows=1, sg_cols=4, bk=128, frag_m=2, frag_n=2),
                  64: CoopmatConfig(sg_rows=2, sg_cols=2, bk=128, frag_m=2, frag_n=2)}
# A skinny grid of at least this many tiles runs unsplit (the same sweep: 112 tiles, one wave on the H200's 132
# compute units, ran 1.2x faster unsplit than in two slices of K).
SKINNY_UNSPLIT_WORKGROUPS = 112
# Workgroups a GPU needs in flight (Vulkan does not say how many compute units it has; the H200 has 132):
# fewer tiles than this take smaller tiles, then split K (matmul_split_reduce.comp adds the slices).
FILL_WORKGROUPS = 128
MIN_SPLIT_STEPS = 4  # K steps per slice at least: each slice's loads overlap its multiplies
MAX_SPLIT_BYTES = 64 << 20  # float32 partial sums


def coopmat_config(device, m: int | None = None, n: int | None = None, batch: int = 1,
                   linear: bool = False) -> CoopmatConfig:
    """The default tile, or (given m and n) the largest tile whose grid still fills the GPU
    (``bench/matmul.py --prefill`` on the H200, x @ W^T with W 2048 x 2048: m = 512 took 32.5 us in 64 x 128
    tiles against 44.7 in 128 x 128; m = 16 13.1 us in 16 x 128 tiles with K in 8 slices, against 63.5).
    ``linear``: the product is x @ W^T (A as it is, B transposed), whose few-row tiles are COOPMAT_SKINNY."""
    shared = device.limits["max_compute_shared_memory_size"]
    if COOPMAT_DEFAULT.shared_bytes() > shared:
        return COOPMAT_SMALL_SHARED
    if m is None or n is None or device.is_cpu:
        return COOPMAT_DEFAULT
    subgroup = device.limits["subgroup_size"]
    skinny = next((cfg for limit, cfg in COOPMAT_SKINNY.items() if m <= limit), None) if linear else None
    if skinny is not None and _runs(skinny, subgroup, shared, (False, True)):
        return skinny
    rows = next((cfg for limit, cfg in COOPMAT_ROWS.items() if m <= limit), None)
    candidates = [rows] if rows else [COOPMAT_LARGE, COOPMAT_DEFAULT, *COOPMAT_SMALLER]
    usable = [cfg for cfg in candidates if _runs(cfg, subgroup, shared)] or [COOPMAT_DEFAULT]
    for cfg in usable:
        if _groups(cfg, m, n) * batch >= (LARGE_TILE_MIN_WORKGROUPS if cfg == COOPMAT_LARGE else FILL_WORKGROUPS):
            return cfg
    return usable[-1]


def split_k(device, cfg: CoopmatConfig, m: int, n: int, k: int, batch: int) -> int:
    """Slices of K for a grid of too few tiles (1: no split)."""
    grid = _groups(cfg, m, n) * batch
    fill = SKINNY_UNSPLIT_WORKGROUPS if cfg in COOPMAT_SKINNY.values() else FILL_WORKGROUPS
    if device.is_cpu or grid >= fill:
        return 1
    splits = min(-(-FILL_WORKGROUPS // grid), -(-k // cfg.bk) // MIN_SPLIT_STEPS,
                 MAX_SPLIT_BYTES // (4 * m * n * batch))
    return max(1, splits)


def _groups(cfg: CoopmatConfig | TiledConfig, m: int, n: int) -> int:
    return -(-m // cfg.bm) * -(-n // cfg.bn)


def _runs(cfg: CoopmatConfig, subgroup: int, shared: int, layout: tuple = (None, None)) -> bool:
    """Whether the device runs the tile: its staging fits shared memory (in the layout (trans_a, trans_b), or
    in either)."""
    try:
        cfg.check(subgroup)
    except ValueError:
        return False
    return cfg.shared_bytes(*layout) <= shared


def subgroup_size_is_fixed(device) -> bool:
    """Whether every subgroup of a kernel has ``subgroup_size`` lanes. The cooperative-matrix kernels (SPIR-V 1.6)
    lay their workgroups out in subgroups of that size, but SPIR-V 1.6 lets a driver pick any size between the
    device's min and max subgroup size (AMD: 32 or 64) unless the pipeline requires one, which kp's pipelines do
    not yet; so they run only where the two are equal (NVIDIA: 32), and elsewhere the portable kernels run."""
    low, high = device.limits.get("min_subgroup_size") or 0, device.limits.get("max_subgroup_size") or 0
    return not (low and high) or low == high


def coopmat_supported(device, in_dtype) -> bool:
    """Whether ``device`` has the subgroup 16x16x16 ``in_dtype`` -> float32 cooperative matrix we use, and a
    fixed subgroup size (:func:`subgroup_size_is_fixed`)."""
    name = dt.as_dtype(in_dtype).name
    if name not in ("float16", "bfloat16") or not subgroup_size_is_fixed(device):
        return False
    if name == "bfloat16" and not device.features.get("shaderBFloat16CooperativeMatrix"):
        return False
    if name == "float16" and not device.features.get("shaderFloat16"):
        return False
    return any(s["m"] == 16 and s["n"] == 16 and s["k"] == 16 and s["a_type"] == name and s["b_type"] == name
               and s["c_type"] == "float32" and s["result_type"] == "float32" and s["scope"] == "subgroup"
               for s in device.cooperative_matrix_shapes)


# Largest m that "auto" gives the small-m kernel. Its cost is reading B once per
# block of 8 rows of A (2 * m * n * k flops on the vector units for n * k elements of
# B read); a tile kernel wastes (tile rows - m) / tile rows of its work but is built
# for reuse. On a GPU, at m = 8 the small-m kernel does 8 float32 FMAs per bfloat16
# element of B read (~32 TFLOP/s at 4 TB/s, half the H200's vector rate), so beyond 8
# it stops being bound by memory while the 128-row cooperative-matrix tile is still
# mostly idle but has tensor cores: 8 is where the two meet. On lavapipe
# (n=1536, k=576, float32) the small-m kernel took 0.9 ms at m=1 and 3 ms at m=8
# against 38 ms for the tiled kernel (whose time hardly depends on m up to 64), so
# there the threshold could be higher; it is set by the GPU argument.
SMALL_M_MAX = 8
# A CPU device (lavapipe) keeps the small-m kernel further for x @ W^T (a Linear layer, trans_b): the rows
# of a short prompt. ``bench/matmul.py --prefill --quick`` (m = 16, bfloat16): a TinyLlama prompt's products
# took 37.2 s with the tiled kernel; B is read once per 8 rows either way, but the tiled kernel's 64-row tiles
# mostly multiply padding there. Other layouts keep the tiled kernel (it won for A @ B at m = 32-64).
SMALL_M_MAX_CPU_LINEAR = 32
# A GPU with a cooperative matrix for the dtype takes the 16-row tile of COOPMAT_SKINNY for x @ W^T from 5 rows on:
# at m = 8 it read the Llama-3-8B shape's weights 1.2-3.3x faster than the small-m kernel on the H200
# (bench/matmul.py --skinny), whose cost grows with m where the tile's does not.
SMALL_M_MAX_COOPMAT_LINEAR = 4


@dataclass(frozen=True)
class SkinnyConfig:
    """The skinny kernel's workgroup (matmul_skinny.comp): frag_m x frag_n 16x16 fragments of C, ``split``
    subgroups taking K in chunks of ``unroll`` 16-entry steps in turn."""
    frag_m: int = 1
    frag_n: int = 1
    split: int = 4
    unroll: int = 2

    def shared_bytes(self) -> int:
        # per subgroup: a chunk's staged fragments (16 rows of 48 bytes each), or its 16 x 16 float32 sums
        return self.split * max((self.frag_m + self.frag_n) * self.unroll * 16 * 48, 1024)


# x @ W^T of SKINNY_MIN_M (where the small-m kernel stops) to SKINNY_ALL_M rows takes the skinny kernel on a GPU with
# cooperative matrices, and of up to SKINNY_MAX_M rows where the tile kernel would split K into slices of at most
# SKINNY_SHORT_SLICE steps (:func:`prefers_skinny`; docs/benchmarks.md, runs M12-M13: at 8 rows the skinny kernel
# read every product of the Llama-3-8B shape faster, at 16 rows only those the tile kernel cuts into short slices, at
# 32 and 64 rows none: each subgroup then stages and multiplies two or four fragments of A per step).
SKINNY_MIN_M = SMALL_M_MAX_COOPMAT_LINEAR + 1
SKINNY_ALL_M = 8
SKINNY_MAX_M = 16
SKINNY_SHORT_SLICE = 8
# Subgroups a skinny product wants in flight (each with its chunk's loads): K is split among more subgroups per
# workgroup until the grid holds this many, as far as K's chunks, the workgroup's size and shared memory allow.
SKINNY_SUBGROUPS = 2048


def skinny_config(device, m: int, n: int, k: int, batch: int = 1) -> SkinnyConfig:
    """Fragments enough for m rows (up to 4), one column of fragments (16 rows of W: the fastest at 8 and 16 rows
    in run M12), and K split so that the grid holds about SKINNY_SUBGROUPS subgroups."""
    frag_m, frag_n, unroll = min(4, -(-m // 16)), 1, 2
    groups = -(-n // (16 * frag_n)) * -(-m // (16 * frag_m)) * batch
    chunks = max(1, k // (16 * unroll))
    max_split = device.limits.get("max_compute_work_group_invocations", 1024) // device.limits["subgroup_size"]
    shared = device.limits["max_compute_shared_memory_size"]
    split = 2
    while (split * 2 <= min(16, max_split, chunks) and groups * split < SKINNY_SUBGROUPS
           and SkinnyConfig(frag_m, frag_n, split * 2, unroll).shared_bytes() <= shared):
        split *= 2
    return SkinnyConfig(frag_m=frag_m, frag_n=frag_n, split=split, unroll=unroll)


def prefers_skinny(device, m: int, n: int, k: int, batch: int = 1) -> bool:
    """Whether "auto" gives x @ W^T of m rows (where :func:`skinny_applies`) to the skinny kernel rather than the
    tile kernel: SKINNY_MIN_M to SKINNY_ALL_M rows, or up to SKINNY_MAX_M where the tile kernel's K slices would
    be short."""
    if not SKINNY_MIN_M <= m <= SKINNY_MAX_M:
        return False
    if m <= SKINNY_ALL_M:
        return True
    tile = coopmat_config(device, m, n, batch, linear=True)
    splits = split_k(device, tile, m, n, k, batch)
    return splits > 1 and -(-k // tile.bk) <= SKINNY_SHORT_SLICE * splits


def skinny_applies(device, a: Operand, b: Operand, *, m: int, n: int, k: int, batch: int, stride_a: int,
                   stride_b: int, trans_a: bool, trans_b: bool, gated: bool) -> bool:
    """Whether the skinny kernel runs this product: x @ W^T (no gate) of float16 or bfloat16 with a cooperative
    matrix, n of 16 or more, k a multiple of 16, and A's and W's offsets and batch strides whole 8-element vectors."""
    return (trans_b and not trans_a and not gated and n >= 16 and k % 16 == 0
            and all(x % 8 == 0 for x in (a.offset, b.offset, stride_a, stride_b))
            and coopmat_supported(device, a.dtype.name) and not device.is_cpu)


def select_algorithm(device, in_dtype, m: int | None = None, trans_a: bool = False, trans_b: bool = False) -> str:
    """``"small_m"`` for m <= SMALL_M_MAX (when ``m`` is given; on a CPU device up to SMALL_M_MAX_CPU_LINEAR
    for x @ W^T; with a cooperative matrix for x @ W^T up to SMALL_M_MAX_COOPMAT_LINEAR); else ``"coopmat"``
    where the device supports it for ``in_dtype``, else ``"tiled"``."""
    coopmat = coopmat_supported(device, in_dtype)
    limit = SMALL_M_MAX_COOPMAT_LINEAR if coopmat and trans_b and not trans_a and not device.is_cpu else SMALL_M_MAX
    if m is not None and m <= limit:
        return "small_m"
    if m is not None and device.is_cpu and trans_b and not trans_a and m <= SMALL_M_MAX_CPU_LINEAR:
        return "small_m"
    return "coopmat" if coopmat else "tiled"


@dataclass(frozen=True)
class SmallMConfig:
    """Shape of the small-m kernel's workgroups.

    trans_b: each subgroup computes ``rows_per_subgroup`` columns of C at a time,
    a workgroup ``rows_per_wg`` of them (sized for threads / subgroup subgroups
    taking one block each); ``unroll`` vectors of B per lane are loaded per step.
    Not trans_b: ``rows_per_wg`` columns per workgroup, threads / rows_per_wg
    threads splitting k for each.
    """
    threads: int
    rows_per_wg: int
    rows_per_subgroup: int = 1
    unroll: int = 2

    def check(self, trans_b: bool, subgroup: int, lanes: int) -> None:
        """``lanes``: what each subgroup surely holds of the device's ``subgroup`` (kernels.subgroup_lanes). Fewer:
        trans_b's lanes stride over k by gl_SubgroupSize, so the workgroup must be one subgroup whose every
        invocation is there (at most ``lanes`` threads), its lanes then counted from the workgroup's size."""
        if not (1 <= self.rows_per_subgroup <= 4 and 1 <= self.unroll <= 4
                and self.rows_per_wg % self.rows_per_subgroup == 0
                and (trans_b or self.threads % self.rows_per_wg == 0)):
            raise ValueError(f"matmul: small-m configuration {self} is not valid")
        if trans_b and lanes < subgroup and self.threads > lanes:
            raise ValueError(f"matmul: small-m configuration {self} needs subgroups of {subgroup} lanes whole; "
                             f"this device runs them {lanes} wide: at most {lanes} threads")


def small_m_config(device, m: int, n: int, trans_b: bool) -> SmallMConfig:
    """trans_b on a GPU: 256 threads, one subgroup per column of C for m < 4 and per 2
    columns from m = 4 on (each vector of A loaded from cache then serves two rows of
    B: at m = 8 that halves the cache traffic, 8 vectors of A per vector of B); the
    workgroup halved (down to 64 threads) while there would be fewer than ~256
    workgroups, so that small n still spreads over every compute unit. lavapipe: one
    subgroup (8 lanes) per workgroup, 4 columns at a time, 8 per workgroup (the best
    of the shapes measured: fewer, longer workgroups suit a CPU). A device whose subgroups may hold fewer
    invocations than gl_SubgroupSize (kernels.subgroup_lanes) gets workgroups of one subgroup of the lanes it
    surely runs, as SmallMConfig.check requires.
    Not trans_b: 16 (32 for wide C) consecutive columns per workgroup, the 256 threads
    splitting k."""
    subgroup, lanes = device.limits["subgroup_size"], subgroup_lanes(device)
    if not trans_b:
        return SmallMConfig(threads=256, rows_per_wg=32 if n >= 8192 else 16)
    if device.is_cpu:
        return SmallMConfig(threads=lanes, rows_per_wg=8, rows_per_subgroup=4, unroll=1)
    if lanes < subgroup:
        per_subgroup = 2 if m >= 4 else 1
        return SmallMConfig(threads=lanes, rows_per_wg=per_subgroup, rows_per_subgroup=per_subgroup)
    per_subgroup = 2 if m >= 4 else 1
    threads = 256
    while threads > max(subgroup, 64) and n * subgroup // (threads * per_subgroup) < 256:
        threads //= 2
    return SmallMConfig(threads=threads, rows_per_wg=max(1, threads // subgroup) * per_subgroup,
                        rows_per_subgroup=per_subgroup)


def tiled_config(device, m: int, n: int, batch: int = 1) -> TiledConfig:
    big = device.limits["max_compute_shared_memory_size"] >= 48 * 1024 and not device.is_cpu
    if big and _groups(TILED_HUGE, m, n) * batch >= LARGE_TILE_MIN_WORKGROUPS \
            and device.limits.get("max_compute_work_group_invocations", 0) >= TILED_HUGE.threads:
        return TILED_HUGE
    return TILED_LARGE if big and m * n >= 256 * 256 else TILED_SMALL


def matmul(seq, a: Operand, b: Operand, c: Operand, *, m: int, n: int, k: int, batch: int = 1,
           trans_a: bool = False, trans_b: bool = False, stride_a: int | None = None,
           stride_b: int | None = None, stride_c: int | None = None, bias: Operand | None = None,
           alpha: float = 1.0, beta: float = 0.0, algorithm: str = "auto",
           tiled: TiledConfig | None = None, coopmat: CoopmatConfig | None = None,
           small_m: SmallMConfig | None = None, skinny: SkinnyConfig | None = None, splits: int | None = None,
           gate: Operand | None = None, gate_mode: str = "rows", write_group=None) -> None:
    """Record ``C[b] = alpha * op(A[b]) @ op(B[b]) (+ bias) + beta * C[b]`` for b < batch into ``seq``.

    A is [m, k] ([k, m] when ``trans_a``), B is [k, n] ([n, k] when ``trans_b``),
    C is [m, n]; all row-major. Batch strides are in elements (default: dense).
    A and B share one dtype (float32, float16 or bfloat16); C is any of the three;
    ``bias`` (n elements) has C's dtype. ``beta == 0`` never reads C.
    ``algorithm``: "auto" (the small-m kernel for m <= SMALL_M_MAX, the skinny kernel for x @ W^T of a few rows
    where :func:`skinny_applies` and :func:`prefers_skinny`, else cooperative matrix when the device has it
    for the input dtype, else tiled), "small_m", "skinny", "tiled" or "coopmat"; ``tiled``/``coopmat``/``small_m``/
    ``skinny`` override configurations (benchmarks), ``splits`` the
    slices of K of the cooperative-matrix kernel (default: :func:`split_k` unless ``coopmat`` is given).
    ``gate`` (float32, one count per batch product from its offset on) marks what a product may skip, by
    ``gate_mode`` (a mixture-of-experts expert run on the few rows of tokens that chose it):
    "rows": the rows of A and C at or past gate[b] are padding, whose results are not used; a kernel skips the
    blocks of rows that start there (storing the epilogue of a zero product: bias + beta * C), and with a gate
    of 0 reads none of the product's A and B. "depth": the sum over K stops at gate[b] (the weight gradient of
    a rows-gated product, over its live rows); the entries past it are not read (the small-m kernel, which has
    no depth gate, is not used for these). Span gates hold a pair (start, count) per product, gate[2b] and
    gate[2b + 1]: "span_rows" (A not transposed) computes C rows start.. start+count-1 from the same rows of A
    and writes no other row of C; "span_depth" (A transposed, B not) sums K entries start.. start+count-1 only.
    Products over rows packed for many products (a mixture of experts' tokens, one span per expert); the
    small-m kernel and split K take no spans. ``write_group``: Sequence.dispatch's (span-rows products into one
    C, each writing its own rows, need no barrier between them).
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
    if gate is not None:
        gate = operand(gate)
        if gate.dtype.name != "float32":
            raise TypeError(f"matmul: the gate must be float32, not {gate.dtype.name}")
        require_elements(gate, 2 * batch if gate_mode in SPAN_GATES else batch, "matmul gate")
    if gate_mode not in GATE_MODES:
        raise ValueError(f"matmul: gate_mode must be one of {', '.join(GATE_MODES)}, not {gate_mode!r}")
    gate_spec = GATE_MODES[gate_mode] if gate is not None else 0
    for value in (stride_a, stride_b, stride_c, a.offset, b.offset, c.offset, bias.offset if bias else 0):
        if not 0 <= value < 2**32:
            raise ValueError(f"matmul: offsets and strides must fit in 32 bits, got {value}")

    span = gate is not None and gate_mode in SPAN_GATES
    if span and (trans_a != (gate_mode == "span_depth") or (gate_mode == "span_depth" and trans_b)):
        raise ValueError(f"matmul: a {gate_mode} gate needs " + ("A not transposed" if gate_mode == "span_rows"
                                                                  else "A transposed and B not"))
    if span and splits not in (None, 1):
        raise ValueError("matmul: a product with a span gate is not split over K")
    device = seq.device
    not_small_m = gate is not None and gate_mode != "rows"  # the small-m kernel has only the rows gate
    def skinny_ok() -> bool:
        return skinny_applies(device, a, b, m=m, n=n, k=k, batch=batch, stride_a=stride_a, stride_b=stride_b,
                              trans_a=trans_a, trans_b=trans_b, gated=gate is not None)
    if algorithm == "auto":
        algorithm = select_algorithm(device, in_dtype, m, trans_a, trans_b)
        if not_small_m and algorithm == "small_m":  # the tile kernels take these
            algorithm = select_algorithm(device, in_dtype)
        if algorithm == "coopmat" and prefers_skinny(device, m, n, k, batch) and skinny_ok():
            algorithm = "skinny"
    elif algorithm == "small_m" and not_small_m:
        raise ValueError(f"matmul: the small-m kernel has no {gate_mode} gate")
    elif algorithm == "coopmat" and not coopmat_supported(device, in_dtype):
        raise ValueError(f"matmul: {device.name} has no {in_dtype} cooperative matrix")
    elif algorithm == "skinny" and not skinny_ok():
        raise ValueError("matmul: the skinny kernel takes x @ W^T of float16 or bfloat16 on a GPU with cooperative "
                         "matrices, no gate, n >= 16, k a multiple of 16, offsets and strides multiples of 8")
    elif algorithm not in ("tiled", "coopmat", "small_m", "skinny"):
        raise ValueError(f"matmul: algorithm must be 'auto', 'small_m', 'skinny', 'tiled' or 'coopmat', "
                         f"not {algorithm!r}")

    variant = f"{SHORT[in_dtype]}_{SHORT[out_dtype]}"
    buffers = [a.buffer, b.buffer, c.buffer, (bias or c).buffer, (gate or c).buffer]
    gate_offset = gate.offset if gate else 0
    push = [m, n, k, a.offset, b.offset, c.offset, bias.offset if bias else 0,
            stride_a, stride_b, stride_c, float(alpha), float(beta), gate_offset]
    flags = [int(trans_a), int(trans_b), int(bias is not None)]

    if algorithm == "small_m":
        _dispatch_small_m(seq, variant, buffers, push, m=m, n=n, k=k, batch=batch, trans_a=trans_a,
                          trans_b=trans_b, has_bias=bias is not None, offset_a=a.offset, offset_b=b.offset,
                          stride_a=stride_a, stride_b=stride_b, cfg=small_m, gate_mode=gate_spec)
        return

    if algorithm == "skinny":
        cfg = skinny or skinny_config(device, m, n, k, batch)
        subgroup = device.limits["subgroup_size"]
        if cfg.shared_bytes() > device.limits["max_compute_shared_memory_size"]:
            raise ValueError(f"matmul: {cfg} needs more shared memory than {device.name} has")
        spec = [cfg.frag_m, cfg.frag_n, cfg.split, cfg.unroll, int(bias is not None), subgroup, cfg.split * subgroup]
        groups = (-(-n // (16 * cfg.frag_n)), -(-m // (16 * cfg.frag_m)), batch)
        seq.dispatch(device.kernel("matmul_skinny", variant), buffers, groups, push, spec, write_group=write_group)
        return

    if algorithm == "coopmat":
        cfg = coopmat or coopmat_config(device, m, n, batch, linear=trans_b and not trans_a)
        subgroup = device.limits["subgroup_size"]
        cfg.check(subgroup)
        splits = splits or (1 if coopmat or span else split_k(device, cfg, m, n, k, batch))
        # 8 halves are staged at a time; whole-vector loads need the contiguous
        # dimension, the offset and the batch stride to be multiples of 8.
        inner_a, inner_b = (m if trans_a else k), (k if trans_b else n)
        aligned_a = int(inner_a % 8 == 0 and a.offset % 8 == 0 and stride_a % 8 == 0)
        aligned_b = int(inner_b % 8 == 0 and b.offset % 8 == 0 and stride_b % 8 == 0)
        split = splits > 1  # the bias goes to the second pass then, not into the partial sums
        spec = [cfg.sg_rows, cfg.sg_cols, cfg.bk, int(trans_a), int(trans_b), int(bias is not None and not split),
                aligned_a, aligned_b, cfg.sg_rows * cfg.sg_cols * subgroup, cfg.frag_m, cfg.frag_n,
                *([m, n, k] if cfg.spec_shape else [0, 0, 0]), splits, gate_spec, cfg.group_rows]
        groups = (-(-n // cfg.bn), -(-m // cfg.bm), batch * splits)
        if not split:
            seq.dispatch(device.kernel("matmul_coopmat", variant), buffers, groups, push, spec, write_group=write_group)
            return
        # Split K: float32 partial products per slice into a scratch buffer, then one pass adds them up.
        partials = seq.scratch(batch * splits * m * n, "float32", name="matmul split-k partials")
        partial_push = [m, n, k, a.offset, b.offset, 0, 0, stride_a, stride_b, m * n, 1.0, 0.0, gate_offset]
        seq.dispatch(device.kernel("matmul_coopmat", f"{SHORT[in_dtype]}_f32"),
                     [a.buffer, b.buffer, partials, partials, (gate.buffer if gate else partials)], groups,
                     partial_push, spec)
        reduce_push = [m, n, splits, 0, 0, c.offset, bias.offset if bias else 0, m * n, 0, stride_c,
                       float(alpha), float(beta), 0]
        seq.dispatch(device.kernel("matmul_split_reduce", SHORT[out_dtype]),
                     [partials, partials, c.buffer, (bias or c).buffer, c.buffer], (-(-m * n // 256), batch),
                     reduce_push,
                     [256, int(bias is not None)])
        return

    cfg = tiled or tiled_config(device, m, n, batch)
    spec = [cfg.bm, cfg.bn, cfg.bk, cfg.tm, cfg.tn, *flags, cfg.threads, gate_spec, cfg.group_rows]
    groups = (-(-n // cfg.bn), -(-m // cfg.bm), batch)
    seq.dispatch(device.kernel("matmul", variant), buffers, groups, push, spec, write_group=write_group)


def _dispatch_small_m(seq, variant, buffers, push, *, m, n, k, batch, trans_a, trans_b, has_bias,
                      offset_a, offset_b, stride_a, stride_b, cfg: SmallMConfig | None, gate_mode: int) -> None:
    device = seq.device
    cfg = cfg or small_m_config(device, m, n, trans_b)
    cfg.check(trans_b, device.limits["subgroup_size"], subgroup_lanes(device))
    block_m = min(m, 8)
    # Whole 16-byte loads need every row of the k-contiguous operand to start on a
    # vector: k, the offset and the batch stride multiples of the vector's elements.
    per_vector = 4 if variant.startswith("f32") else 8
    def aligned(offset, stride):
        return int(k % per_vector == 0 and offset % per_vector == 0 and stride % per_vector == 0)
    aligned_a = aligned(offset_a, stride_a) if not trans_a else 0
    aligned_b = aligned(offset_b, stride_b) if trans_b else 0
    rows_per_wg = cfg.rows_per_wg
    max_groups = device.limits["max_compute_work_group_count_x"]
    while -(-n // rows_per_wg) > max_groups:  # very wide C: more columns per workgroup
        rows_per_wg *= 2
    spec = [block_m, rows_per_wg, cfg.rows_per_subgroup, int(trans_a), int(trans_b), int(has_bias),
            aligned_a, aligned_b, cfg.threads, cfg.unroll, gate_mode]
    groups = (-(-n // rows_per_wg), -(-m // block_m), batch)
    seq.dispatch(device.kernel("matmul_small_m", variant), buffers, groups, push, spec)
