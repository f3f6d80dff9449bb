"""matmul launcher and kernels against numpy float64 references.

Inputs are rounded to their storage dtype first and the reference is computed in
float64 from those rounded values, so the error measured is the kernel's own:
float32 accumulation plus one rounding of the output. Tolerance, as a fraction of
the largest reference magnitude: 1e-5 for float32 C, 1e-3 for float16 C
(2^-11 relative rounding), 8e-3 for bfloat16 C (2^-8). The same tests run
whichever kernel the device selects (tiled on lavapipe, cooperative matrix for
float16/bfloat16 on a GPU that has it), and the tiled kernel explicitly as well.
The small-m kernel (m <= 8, decoding) has its own tests at the end, with the same
tolerances: it also accumulates in float32 and rounds C once.
"""
import numpy as np
import pytest

from vkformers.engine.kernels import Operand, subgroup_lanes
from vkformers.engine.kernels import matmul as KM
from vkformers.engine.kernels.matmul import SMALL_M_MAX, SmallMConfig, coopmat_supported, matmul, select_algorithm
from vkformers.runtime import dtypes as dt

DTYPES = ("float32", "float16", "bfloat16")
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` as the storage dtype would hold it (float64 values)."""
    if dtype == "bfloat16":
        return dt.from_bfloat16(dt.to_bfloat16(x.astype(np.float32))).astype(np.float64)
    return x.astype(dtype).astype(np.float64)


def storage(x: np.ndarray, dtype: str) -> np.ndarray:
    return dt.to_bfloat16(x.astype(np.float32)) if dtype == "bfloat16" else x.astype(dtype)


def from_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    return (dt.from_bfloat16(x) if dtype == "bfloat16" else x).astype(np.float64)


def upload(device, values: np.ndarray, dtype: str, offset: int = 0) -> Operand:
    """Buffer holding ``values`` (flattened) from element ``offset`` on, with junk before and after."""
    flat = values.reshape(-1)
    junk = np.full(offset, 7.0)
    data = np.concatenate([junk, flat, np.full(3, -5.0)])
    return Operand(device.upload(storage(data, dtype), dtype=dtype), offset)


def check(got: np.ndarray, ref: np.ndarray, out_dtype: str) -> None:
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(got - ref).max() / scale
    assert err <= TOLERANCE[out_dtype], f"max error {err:.3g} x max|ref| exceeds {TOLERANCE[out_dtype]}"


def run_case(device, m, n, k, *, in_dtype="float32", out_dtype="float32", batch=1, trans_a=False,
             trans_b=False, bias=False, alpha=1.0, beta=0.0, offsets=(0, 0, 0, 0), pad=(0, 0, 0),
             algorithm="auto", small_m=None, splits=None, coopmat=None, tiled=None, skinny=None, seed=0):
    rng = np.random.default_rng(seed)
    shape_a, shape_b = ((k, m) if trans_a else (m, k)), ((n, k) if trans_b else (k, n))
    # Batch strides with optional padding between matrices (non-dense batches).
    stride_a, stride_b, stride_c = m * k + pad[0], k * n + pad[1], m * n + pad[2]
    a = rounded(rng.standard_normal((batch, stride_a)), in_dtype)
    b = rounded(rng.standard_normal((batch, stride_b)), in_dtype)
    c0 = rounded(rng.standard_normal((batch, stride_c)), out_dtype)
    bias_values = rounded(rng.standard_normal(n), out_dtype)

    ops = [upload(device, x, d, o) for x, d, o in ((a, in_dtype, offsets[0]), (b, in_dtype, offsets[1]),
                                                   (c0, out_dtype, offsets[2]))]
    bias_op = upload(device, bias_values, out_dtype, offsets[3]) if bias else None
    seq = device.sequence()
    matmul(seq, *ops, m=m, n=n, k=k, batch=batch, trans_a=trans_a, trans_b=trans_b,
           stride_a=stride_a if batch > 1 else None, stride_b=stride_b if batch > 1 else None,
           stride_c=stride_c if batch > 1 else None, bias=bias_op, alpha=alpha, beta=beta, algorithm=algorithm,
           small_m=small_m, splits=splits, coopmat=coopmat, tiled=tiled, skinny=skinny)
    seq.replay()

    c_buf = ops[2]
    got_all = from_storage(c_buf.buffer.read().reshape(-1), out_dtype)
    got = got_all[offsets[2]: offsets[2] + batch * stride_c].reshape(batch, stride_c)
    for i in range(batch):
        op_a = a[i, : m * k].reshape(shape_a)
        op_b = b[i, : k * n].reshape(shape_b)
        ref = alpha * ((op_a.T if trans_a else op_a) @ (op_b.T if trans_b else op_b))
        if bias:
            ref = ref + bias_values
        ref = ref + beta * c0[i, : m * n].reshape(m, n)
        check(got[i, : m * n].reshape(m, n), ref, out_dtype)
        # Padding between batch matrices and the junk around C are untouched.
        np.testing.assert_array_equal(got[i, m * n:], c0[i, m * n:])
    np.testing.assert_array_equal(got_all[: offsets[2]], rounded(np.full(offsets[2], 7.0), out_dtype))


def algorithms(device, in_dtype):
    """The selected kernel, plus the tiled one when the device selects another."""
    chosen = select_algorithm(device, in_dtype)
    return ["auto"] if chosen == "tiled" else ["auto", "tiled"]


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_odd_shape_every_dtype_pair(device, in_dtype, out_dtype):
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 37, 53, 29, in_dtype=in_dtype, out_dtype=out_dtype, algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_one_by_one_by_one(device, in_dtype):
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 1, 1, 1, in_dtype=in_dtype, algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False), (True, True)])
def test_transposes(device, in_dtype, trans_a, trans_b):
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 45, 71, 83, in_dtype=in_dtype, trans_a=trans_a, trans_b=trans_b, algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_several_tiles_and_k_steps(device, in_dtype):
    """More than one workgroup tile each way and many K steps, with ragged edges."""
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 133, 150, 90, in_dtype=in_dtype, algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_aligned_tiles(device, in_dtype):
    """Sizes that are multiples of every tile (the vector-load path of the coopmat kernel)."""
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 128, 128, 64, in_dtype=in_dtype, algorithm=algorithm)
        run_case(device, 128, 128, 64, in_dtype=in_dtype, trans_a=True, trans_b=True, algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_inner_and_edge_workgroups_mixed(device, in_dtype, trans_a, trans_b):
    """Aligned sizes where some workgroup tiles are whole and others ragged, and K ends
    in a partial step: the coopmat kernel's unchecked loads, checked loads and both
    epilogues (direct float32 store with alpha; staged with bias and beta) in one call."""
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 200, 296, 200, in_dtype=in_dtype, trans_a=trans_a, trans_b=trans_b, alpha=0.5,
                 algorithm=algorithm)
        run_case(device, 136, 264, 72, in_dtype=in_dtype, out_dtype=in_dtype, trans_a=trans_a, trans_b=trans_b,
                 bias=True, beta=1.0, algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
def test_sixteen_bit_c_of_whole_tiles(device, in_dtype, out_dtype):
    """16-bit C: whole tiles go through the coopmat kernel's 8-values-per-store epilogue (C aligned to 8
    elements, no bias, beta 0), ragged tiles and an unaligned C through the element-wise one."""
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 256, 264, 64, in_dtype=in_dtype, out_dtype=out_dtype, alpha=0.5, algorithm=algorithm)
        run_case(device, 128, 256, 48, in_dtype=in_dtype, out_dtype=out_dtype, batch=2, pad=(8, 16, 8),
                 offsets=(8, 16, 8, 0), trans_b=True, algorithm=algorithm)
        run_case(device, 128, 128, 32, in_dtype=in_dtype, out_dtype=out_dtype, offsets=(0, 0, 3, 0),
                 algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_batched_with_strides_and_offsets(device, in_dtype):
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 19, 24, 40, in_dtype=in_dtype, batch=3, pad=(5, 8, 3), offsets=(3, 8, 5, 2),
                 algorithm=algorithm)
        # Aligned to 8 elements everywhere: whole-vector loads with batches and offsets.
        run_case(device, 32, 48, 64, in_dtype=in_dtype, out_dtype="float32", batch=2, pad=(8, 16, 0),
                 offsets=(8, 16, 4, 0), trans_b=True, algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_bias_alpha_and_beta_accumulation(device, in_dtype, out_dtype):
    for algorithm in algorithms(device, in_dtype):
        run_case(device, 21, 34, 17, in_dtype=in_dtype, out_dtype=out_dtype, bias=True, alpha=0.5, beta=1.0,
                 offsets=(1, 2, 3, 4), algorithm=algorithm)


def test_beta_zero_ignores_nan_in_c(device):
    a = device.upload(np.ones((4, 3), np.float32))
    b = device.upload(np.ones((3, 5), np.float32))
    c = device.upload(np.full((4, 5), np.nan, np.float32))
    device.run(lambda seq: matmul(seq, a, b, c, m=4, n=5, k=3))
    np.testing.assert_array_equal(c.read(), np.full((4, 5), 3.0, np.float32))


def test_gradient_accumulation_replayed(device):
    """beta=1 replayed: C grows by A @ B each replay."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((20, 30)).astype(np.float32), rng.standard_normal((30, 10)).astype(np.float32)
    a, b, c = device.upload(x), device.upload(y), device.upload(np.zeros((20, 10), np.float32))
    seq = device.sequence()
    matmul(seq, a, b, c, m=20, n=10, k=30, beta=1.0)
    for _ in range(3):
        seq.replay()
    check(c.read().astype(np.float64), 3 * (x.astype(np.float64) @ y), "float32")


def test_coopmat_needs_a_fixed_subgroup_size():
    """A device whose subgroups may be 32 or 64 lanes (AMD) keeps the portable kernels: the cooperative-matrix
    kernels' workgroups are laid out for subgroup_size lanes and kp's pipelines do not require a size."""
    from types import SimpleNamespace
    shape = dict(m=16, n=16, k=16, a_type="float16", b_type="float16", c_type="float32", result_type="float32",
                 scope="subgroup")

    def device(low, high):
        return SimpleNamespace(features={"shaderFloat16": True}, cooperative_matrix_shapes=[shape],
                               limits={"subgroup_size": 64, "min_subgroup_size": low, "max_subgroup_size": high})
    assert coopmat_supported(device(32, 32), "float16")
    assert not coopmat_supported(device(32, 64), "float16")
    assert coopmat_supported(device(0, 0), "float16")  # a driver that does not report the range


def test_coopmat_selected_when_the_device_has_it(device):
    shapes = device.cooperative_matrix_shapes
    def offered(name):
        return any(s["m"] == s["n"] == s["k"] == 16 and s["a_type"] == s["b_type"] == name
                   and s["result_type"] == "float32" and s["scope"] == "subgroup" for s in shapes)
    assert select_algorithm(device, "float32") == "tiled"
    assert select_algorithm(device, "float16") == ("coopmat" if offered("float16") else "tiled")
    bf16 = offered("bfloat16") and device.features.get("shaderBFloat16CooperativeMatrix")
    assert select_algorithm(device, "bfloat16") == ("coopmat" if bf16 else "tiled")


@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
def test_split_k(device, in_dtype):
    """Cooperative-matrix products of few tiles split K into slices whose float32 partial sums a second pass
    adds up (with bias, alpha, beta, batches and ragged K, where a slice may even be empty). Without a
    cooperative matrix for the dtype the kernel is refused, so there is nothing to split."""
    if not coopmat_supported(device, in_dtype):
        with pytest.raises(ValueError, match="cooperative matrix"):
            run_case(device, 16, 64, 256, in_dtype=in_dtype, algorithm="coopmat", splits=2)
        return
    # m = 16 and 24 pick the 16- and 32-row tiles and split K by themselves (one tile of C, 16 K steps).
    assert KM.split_k(device, KM.coopmat_config(device, 16, 64), 16, 64, 1024, 1) > 1
    run_case(device, 16, 64, 1024, in_dtype=in_dtype, trans_b=True, algorithm="coopmat")
    run_case(device, 24, 40, 1000, in_dtype=in_dtype, out_dtype=in_dtype, trans_b=True, bias=True,
             alpha=0.5, beta=1.0, algorithm="coopmat")
    for splits in (2, 3, 5):  # 200 = 64 + 64 + 64 + 8: with 3 and 5 slices the last ones are short or empty
        run_case(device, 45, 71, 200, in_dtype=in_dtype, trans_a=True, algorithm="coopmat", splits=splits)
    run_case(device, 19, 24, 160, in_dtype=in_dtype, out_dtype="float32", batch=3, pad=(5, 8, 3),
             offsets=(3, 8, 5, 2), bias=True, beta=1.0, algorithm="coopmat", splits=2)


@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
def test_coopmat_large_tile(device, in_dtype):
    """The 128 x 256 tile of large products (4 x 4 accumulators per subgroup): whole tiles (unchecked loads,
    direct stores), edges in every layout, and the general epilogue (bias, beta, 16-bit C, batches)."""
    large = KM.COOPMAT_LARGE
    if not coopmat_supported(device, in_dtype):
        with pytest.raises(ValueError, match="cooperative matrix"):
            run_case(device, 16, 64, 256, in_dtype=in_dtype, algorithm="coopmat", coopmat=large)
        return
    run_case(device, 256, 512, 96, in_dtype=in_dtype, algorithm="coopmat", coopmat=large)
    for trans_a, trans_b in ((False, False), (True, False), (False, True), (True, True)):
        run_case(device, 200, 300, 520, in_dtype=in_dtype, trans_a=trans_a, trans_b=trans_b, algorithm="coopmat",
                 coopmat=large)
    run_case(device, 77, 150, 40, in_dtype=in_dtype, out_dtype=in_dtype, batch=2, pad=(8, 16, 3),
             offsets=(8, 16, 5, 2), bias=True, alpha=0.5, beta=1.0, algorithm="coopmat", coopmat=large)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_tiles_visited_in_bands_of_rows(device, in_dtype):
    """group_rows: workgroups take C's tiles in bands of 3 tile rows, column by column (the last band has
    fewer rows); every tile is still computed (a missed one would keep C's old values: beta = 1)."""
    tiled = KM.TiledConfig(64, 64, 16, 4, 4, group_rows=3)
    run_case(device, 64 * 7 + 5, 64 * 4 + 3, 40, in_dtype=in_dtype, batch=2, beta=1.0, algorithm="tiled",
             tiled=tiled)
    if not coopmat_supported(device, in_dtype):
        return
    for cfg in (KM.CoopmatConfig(group_rows=3), KM.CoopmatConfig(sg_rows=2, sg_cols=2, bk=48, frag_m=4, frag_n=4,
                                                                 group_rows=5)):
        run_case(device, cfg.bm * 7 + 5, cfg.bn * 4 + 3, 100, in_dtype=in_dtype, out_dtype=in_dtype, batch=2,
                 beta=1.0, algorithm="coopmat", coopmat=cfg)
        run_case(device, cfg.bm * 11, cfg.bn * 3, 96, in_dtype=in_dtype, algorithm="coopmat", coopmat=cfg)


@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
def test_coopmat_k_steps_of_48(device, in_dtype):
    """A K step of 48 (3 fragments; K = 8192 ends on a partial step) in the 128 x 256 tile: whole tiles, an
    edge, and K not a multiple of the step, in the layouts whose staged tiles fit the device."""
    cfg = KM.CoopmatConfig(sg_rows=2, sg_cols=4, bk=48, frag_m=4, frag_n=4)
    if not coopmat_supported(device, in_dtype):
        with pytest.raises(ValueError, match="cooperative matrix"):
            run_case(device, 16, 64, 256, in_dtype=in_dtype, algorithm="coopmat", coopmat=cfg)
        return
    limit = device.limits["max_compute_shared_memory_size"]
    for trans_a, trans_b in ((False, False), (True, False), (False, True), (True, True)):
        if cfg.shared_bytes(trans_a, trans_b) > limit:
            continue
        run_case(device, 256, 512, 200, in_dtype=in_dtype, trans_a=trans_a, trans_b=trans_b, algorithm="coopmat",
                 coopmat=cfg)
        run_case(device, 200, 300, 520, in_dtype=in_dtype, out_dtype=in_dtype, trans_a=trans_a, trans_b=trans_b,
                 algorithm="coopmat", coopmat=cfg)


def test_coopmat_tiles_fill_the_gpu():
    """Tile and split choice on a GPU with 32-wide subgroups (pure arithmetic, no device needed): a C of many
    tiles takes the 128 x 256 tile unsplit; fewer tiles take smaller ones, then slices of K."""
    class Gpu:
        is_cpu = False
        limits = {"max_compute_shared_memory_size": 48 * 1024, "subgroup_size": 32}
    gpu = Gpu()
    big = KM.coopmat_config(gpu, 4096, 4096)
    assert (big.bm, big.bn) == (128, 256) and KM.split_k(gpu, big, 4096, 4096, 4096, 1) == 1
    assert KM.coopmat_config(gpu, 2048, 4096) == KM.COOPMAT_DEFAULT  # 256 tiles of 128 x 256: too few for it
    mid = KM.coopmat_config(gpu, 512, 2048)  # 64 tiles of 128 x 128: too few
    assert mid.bm * mid.bn < 128 * 128 and KM._groups(mid, 512, 2048) >= KM.FILL_WORKGROUPS
    short = KM.coopmat_config(gpu, 16, 2048)
    assert short.bm == 16
    splits = KM.split_k(gpu, short, 16, 2048, 2048, 1)
    assert splits * KM._groups(short, 16, 2048) >= KM.FILL_WORKGROUPS
    assert -(-2048 // short.bk) // splits >= KM.MIN_SPLIT_STEPS
    assert KM.split_k(gpu, short, 16, 2048, 128, 1) == 1  # two K steps: nothing to split


def test_skinny_linear_products_take_the_few_row_tiles():
    """x @ W^T of 8 to 64 rows (a batched decode step) on a GPU with 48 KiB of shared memory (pure arithmetic):
    the COOPMAT_SKINNY tile of the rows, K split to bring a grid of few tiles towards one wave, a grid of
    SKINNY_UNSPLIT_WORKGROUPS tiles or more unsplit; other layouts keep the COOPMAT_ROWS tiles."""
    class Gpu:
        is_cpu = False
        limits = {"max_compute_shared_memory_size": 48 * 1024, "subgroup_size": 32}
    gpu = Gpu()
    for m, limit in ((8, 16), (16, 16), (24, 32), (32, 32), (48, 64), (64, 64)):
        cfg = KM.coopmat_config(gpu, m, 4096, linear=True)
        assert cfg == KM.COOPMAT_SKINNY[limit] and cfg.shared_bytes(False, True) <= 48 * 1024
    assert KM.coopmat_config(gpu, 32, 4096) == KM.COOPMAT_ROWS[32]  # not x @ W^T: the staging of either layout
    q, gate = KM.COOPMAT_SKINNY[32], KM.COOPMAT_SKINNY[16]
    assert KM.split_k(gpu, q, 32, 4096, 4096, 1) == 4  # 32 tiles
    assert KM.split_k(gpu, gate, 16, 14336, 4096, 1) == 1  # 112 tiles
    assert KM.split_k(gpu, q, 32, 1024, 4096, 1) == 8  # 8 tiles: K steps of 128, at least 4 per slice


@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
def test_skinny_kernel(device, in_dtype):
    """The skinny kernel (x @ W^T of a few rows, W's fragments read straight from memory by subgroups that split
    K): rows past m staged as zeros, a last column fragment past n, K in whole chunks and leftover steps, every
    workgroup shape, 16-bit C, bias, alpha, beta and batches. Without a cooperative matrix it is refused."""
    if not KM.skinny_applies(device, operand_of(device, in_dtype), operand_of(device, in_dtype), m=8, n=64,
                             k=256, batch=1, stride_a=0, stride_b=0, trans_a=False, trans_b=True, gated=False):
        with pytest.raises(ValueError, match="skinny kernel"):
            run_case(device, 8, 64, 256, in_dtype=in_dtype, trans_b=True, algorithm="skinny")
        return
    for m, n, k in ((5, 64, 256), (8, 4096 + 48, 1040), (16, 40, 16), (17, 100, 528), (32, 256, 4096),
                    (48, 72, 208), (64, 512, 320)):
        run_case(device, m, n, k, in_dtype=in_dtype, trans_b=True, algorithm="skinny")
    for frag_m, frag_n, split, unroll in ((1, 1, 1, 1), (2, 4, 4, 1), (1, 2, 4, 4), (4, 1, 2, 2), (2, 2, 8, 1)):
        cfg = KM.SkinnyConfig(frag_m=frag_m, frag_n=frag_n, split=split, unroll=unroll)
        run_case(device, 40, 96, 1104, in_dtype=in_dtype, out_dtype=in_dtype, trans_b=True, bias=True, alpha=0.5,
                 beta=1.0, algorithm="skinny", skinny=cfg)
    for out_dtype in DTYPES:
        run_case(device, 12, 48, 160, in_dtype=in_dtype, out_dtype=out_dtype, batch=3, trans_b=True, bias=True,
                 beta=1.0, pad=(8, 16, 5), offsets=(8, 16, 3, 1), algorithm="skinny")


def operand_of(device, dtype: str, count: int = 8) -> Operand:
    return Operand(device.upload(storage(np.zeros(count), dtype), dtype=dtype))


@pytest.mark.parametrize("in_dtype", ["float16", "bfloat16"])
def test_skinny_kernel_reads_no_row_of_a_past_m(device, in_dtype):
    """The skinny kernel stages zeros for the rows of its fragments past m: NaN in A's buffer past m reaches no
    element of C. Selected by "auto" for x @ W^T of SKINNY_MIN_M to SKINNY_MAX_M rows where it applies."""
    m, n, k = 6, 48, 64
    rng = np.random.default_rng(1)
    a = rounded(rng.standard_normal((m, k)), in_dtype)
    w = rounded(rng.standard_normal((n, k)), in_dtype)
    padded = np.concatenate([a, np.full((16 - m, k), np.nan)])
    a_op = Operand(device.upload(storage(padded, in_dtype), dtype=in_dtype))
    w_op = Operand(device.upload(storage(w, in_dtype), dtype=in_dtype))
    applies = KM.skinny_applies(device, a_op, w_op, m=m, n=n, k=k, batch=1, stride_a=0, stride_b=0,
                                trans_a=False, trans_b=True, gated=False)
    for algorithm in (["auto", "skinny"] if applies else ["auto"]):
        c = device.buffer((m, n), "float32")
        seq = device.sequence()
        matmul(seq, a_op, w_op, c, m=m, n=n, k=k, trans_b=True, algorithm=algorithm)
        seq.replay()
        check(c.read().reshape(m, n).astype(np.float64), a @ w.T, "float32")


def test_skinny_kernel_by_shape():
    """The skinny kernel on a GPU with 32-wide subgroups (pure arithmetic): taken for x @ W^T of 5 to 8 rows, and of
    up to 16 where the tile kernel would cut K into short slices (the Llama-3-8B shape's q_proj and k_proj, not its
    gate_proj, unsplit, nor down_proj, in long slices); its workgroup: fragments of A enough for m, one column of
    fragments, and K split until the grid holds about SKINNY_SUBGROUPS subgroups, within K's chunks, 16 subgroups
    and shared memory."""
    class Gpu:
        is_cpu = False
        limits = {"max_compute_shared_memory_size": 48 * 1024, "subgroup_size": 32,
                  "max_compute_work_group_invocations": 1024}
    gpu = Gpu()
    shapes = {"q": (4096, 4096), "k": (1024, 4096), "gate": (14336, 4096), "down": (4096, 14336)}
    assert all(KM.prefers_skinny(gpu, m, n, k) for m in (5, 8) for n, k in shapes.values())
    assert [KM.prefers_skinny(gpu, 16, n, k) for n, k in shapes.values()] == [True, True, False, False]
    assert not any(KM.prefers_skinny(gpu, m, n, k) for m in (4, 17, 32) for n, k in shapes.values())
    assert KM.skinny_config(gpu, 8, 4096, 4096) == KM.SkinnyConfig(frag_m=1, frag_n=1, split=8, unroll=2)
    assert KM.skinny_config(gpu, 8, 1024, 4096).split == 16
    assert KM.skinny_config(gpu, 16, 14336, 4096).split == 4
    assert KM.skinny_config(gpu, 8, 4096, 64).split == 2  # two chunks of K
    big = KM.skinny_config(gpu, 64, 64, 4096)
    assert big.frag_m == 4 and big.shared_bytes() <= 48 * 1024 < KM.SkinnyConfig(4, 1, big.split * 2).shared_bytes()


def test_tiled_tiles_by_size():
    """The tiled kernel's tile on a GPU with 48 KiB of shared memory (pure arithmetic): 128 x 128 tiles of 512
    invocations for a C of at least 512 of them (batches count), 128 x 64 below, 64 x 64 for a small C, and
    never more invocations than the device allows."""
    class Gpu:
        is_cpu = False
        limits = {"max_compute_shared_memory_size": 48 * 1024, "max_compute_work_group_invocations": 1024}
    gpu = Gpu()
    assert KM.tiled_config(gpu, 4096, 4096) == KM.TILED_HUGE
    assert KM.tiled_config(gpu, 2048, 2048) == KM.TILED_LARGE  # 256 tiles of 128 x 128
    assert KM.tiled_config(gpu, 2048, 2048, batch=2) == KM.TILED_HUGE
    assert KM.tiled_config(gpu, 128, 256) == KM.TILED_SMALL
    gpu.limits["max_compute_work_group_invocations"] = 256
    assert KM.tiled_config(gpu, 4096, 4096) == KM.TILED_LARGE


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_tiled_kernel_in_each_tile(device, in_dtype):
    """Each tile the launcher chooses, explicitly (a device picks only some of them by itself): edges, both
    transposes, a 16-bit C and the full epilogue."""
    for tiled in (KM.TILED_SMALL, KM.TILED_LARGE, KM.TILED_HUGE):
        if tiled.threads > device.limits["max_compute_work_group_invocations"] \
                or tiled.shared_bytes() > device.limits["max_compute_shared_memory_size"]:
            continue
        run_case(device, 300, 260, 40, in_dtype=in_dtype, trans_a=True, trans_b=True, algorithm="tiled",
                 tiled=tiled)
        run_case(device, 256, 384, 33, in_dtype=in_dtype, out_dtype=in_dtype, batch=2, bias=True, beta=0.5,
                 algorithm="tiled", tiled=tiled)


def test_rejects_bad_arguments(device):
    a = device.upload(np.zeros((4, 4), np.float32))
    h = device.upload(np.zeros((4, 4), np.float16))
    seq = device.sequence()
    with pytest.raises(TypeError):
        matmul(seq, a, h, a, m=4, n=4, k=4)
    with pytest.raises(ValueError):
        matmul(seq, a, a, a, m=4, n=4, k=5)
    with pytest.raises(TypeError):
        matmul(seq, a, a, a, m=4, n=4, k=4, bias=h)


# ---------------------------------------------------------------- small-m kernel (decoding)
# Sizes: k = 29 (not a multiple of 4 or 8: element-by-element loads and a ragged
# end of k), k = 40 / 64 with offsets that are multiples of 8 (whole 16-byte loads),
# n odd so the last workgroup is partly empty.

def small_m_algorithms(m):
    """"auto" selects the small-m kernel for these m; also ask for it explicitly."""
    return ["auto", "small_m"] if m <= SMALL_M_MAX else ["small_m"]


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_small_m_every_dtype_pair(device, in_dtype, out_dtype):
    # (Each m, k pair compiles its own pipeline: pairs rather than the full product.)
    for m, n, k in ((1, 37, 29), (2, 53, 64), (7, 53, 64), (8, 37, 29)):
        run_case(device, m, n, k, in_dtype=in_dtype, out_dtype=out_dtype, trans_b=True, seed=m)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, True), (True, False)])
def test_small_m_transposes(device, in_dtype, trans_a, trans_b):
    for m in (1, 7):
        for algorithm in small_m_algorithms(m):
            run_case(device, m, 45, 83, in_dtype=in_dtype, trans_a=trans_a, trans_b=trans_b, algorithm=algorithm)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("trans_b", [True, False])
def test_small_m_bias_alpha_beta_offsets(device, in_dtype, trans_b):
    # Offsets not on 16 bytes (element-by-element loads) ...
    run_case(device, 8, 35, 29, in_dtype=in_dtype, out_dtype=in_dtype, trans_b=trans_b, bias=True,
             alpha=0.5, beta=1.0, offsets=(1, 3, 5, 7))
    # ... and on 16 bytes with k a multiple of 8 (whole-vector loads), C and bias unaligned.
    run_case(device, 2, 35, 40, in_dtype=in_dtype, out_dtype="float32", trans_b=trans_b, bias=True,
             alpha=-2.0, beta=1.0, offsets=(8, 16, 3, 1))
    # k a multiple of 8 but A's offset not: A element by element, B whole vectors.
    run_case(device, 1, 35, 40, in_dtype=in_dtype, trans_b=trans_b, offsets=(3, 8, 0, 0))


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("trans_b", [True, False])
def test_small_m_batched_with_strides(device, in_dtype, trans_b):
    for m in (1, 8):
        run_case(device, m, 21, 40, in_dtype=in_dtype, batch=3, trans_b=trans_b, pad=(5, 8, 3),
                 offsets=(3, 8, 5, 2), bias=True, beta=1.0)
        # Every row on 16 bytes: whole-vector loads in every batch.
        run_case(device, m, 21, 40, in_dtype=in_dtype, batch=2, trans_b=trans_b, pad=(8, 16, 1),
                 offsets=(8, 16, 4, 0))


@pytest.mark.parametrize("trans_b", [True, False])
def test_small_m_more_rows_than_a_block(device, trans_b):
    """m > 8 asked for explicitly runs as blocks of 8 rows (the last one partial)."""
    run_case(device, 11, 30, 50, in_dtype="bfloat16", out_dtype="float32", trans_b=trans_b, bias=True,
             beta=1.0, algorithm="small_m")
    run_case(device, 17, 9, 64, trans_b=trans_b, algorithm="small_m")


@pytest.mark.parametrize("config", [
    SmallMConfig(threads=64, rows_per_wg=8, rows_per_subgroup=1, unroll=4),
    SmallMConfig(threads=32, rows_per_wg=12, rows_per_subgroup=3, unroll=3),  # subgroups take several blocks
    SmallMConfig(threads=256, rows_per_wg=2, rows_per_subgroup=2, unroll=1),  # more subgroups than blocks
])
def test_small_m_configurations(device, config):
    """Workgroup shapes other than the device's default, including the unrolled main
    loop with k long enough to run it (k = 517 float32: 130 vectors). A device that runs
    subgroups narrower than it reports refuses those of more threads than it surely runs."""
    if config.threads > subgroup_lanes(device) < device.limits["subgroup_size"]:
        with pytest.raises(ValueError, match="lanes whole"):
            run_case(device, 1, 47, 517, trans_b=True, algorithm="small_m", small_m=config)
        return
    for m in (1, 5):
        run_case(device, m, 47, 517, in_dtype="float32", trans_b=True, bias=True, beta=1.0,
                 algorithm="small_m", small_m=config)
        run_case(device, m, 47, 1024, in_dtype="float16", trans_b=True, algorithm="small_m", small_m=config)


def test_small_m_selection(device):
    for m in range(1, SMALL_M_MAX + 1):
        assert select_algorithm(device, "float32", m) == "small_m"
        assert select_algorithm(device, "bfloat16", m) == "small_m"
    assert select_algorithm(device, "float32", SMALL_M_MAX + 1) == select_algorithm(device, "float32")
    assert select_algorithm(device, "float16", 64) == select_algorithm(device, "float16")
    # x @ W^T for a short prompt: a CPU device keeps the small-m kernel up to SMALL_M_MAX_CPU_LINEAR rows
    linear = select_algorithm(device, "bfloat16", KM.SMALL_M_MAX_CPU_LINEAR, trans_b=True)
    assert linear == ("small_m" if device.is_cpu else select_algorithm(device, "bfloat16"))
    assert select_algorithm(device, "float32", KM.SMALL_M_MAX_CPU_LINEAR + 1, trans_b=True) == \
        select_algorithm(device, "float32")


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_small_m_several_row_blocks(device, in_dtype):
    """More rows than one block of 8 (a short prompt on a CPU device), ragged, with bias and beta."""
    run_case(device, 27, 47, 520, in_dtype=in_dtype, trans_b=True, bias=True, beta=1.0, alpha=0.5,
             algorithm="small_m")
    run_case(device, 32, 24, 64, in_dtype=in_dtype, out_dtype="float32", trans_b=True, algorithm="small_m")


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
def test_small_m_gate_skips_products(device, in_dtype, trans_b):
    """A gated small-m product: where the gate is zero the product counts as zero (C = bias + beta * C) and
    its A and B are never read (they hold NaN here); elsewhere the gate changes nothing."""
    m, n, k, batch = 3, 40, 24, 3
    rng = np.random.default_rng(5)
    a = rounded(rng.standard_normal((batch, m, k)), in_dtype)
    b = rounded(rng.standard_normal((batch, n, k) if trans_b else (batch, k, n)), in_dtype)
    a[1], b[1] = np.nan, np.nan
    c0, bias = rng.standard_normal((batch, m, n)), rng.standard_normal(n)
    ops = [upload(device, x, d) for x, d in ((a, in_dtype), (b, in_dtype), (c0, "float32"), (bias, "float32"))]
    gate = Operand(device.upload(np.array([7.0, 1.0, 0.0, 2.0], np.float32)), 1)  # products 0, 1, 2: 1, 0, 2
    seq = device.sequence()
    matmul(seq, *ops[:3], m=m, n=n, k=k, batch=batch, trans_b=trans_b, bias=ops[3], beta=0.5,
           algorithm="small_m", gate=gate)
    seq.replay()
    got = ops[2].buffer.read()[: batch * m * n].reshape(batch, m, n).astype(np.float64)
    for z in range(batch):
        product = 0.0 if z == 1 else a[z] @ (b[z].T if trans_b else b[z])
        check(got[z], product + bias + 0.5 * c0[z], "float32")


GATED_KERNELS = [("tiled", dict(tiled=KM.TILED_SMALL)), ("coopmat", dict(coopmat=KM.COOPMAT_DEFAULT, splits=1)),
                 ("coopmat", dict(coopmat=KM.COOPMAT_DEFAULT, splits=3)), ("small_m", {})]


def _gated_case(device, algorithm, options, in_dtype, mode, m, k, counts, trans_a=False, poison=None):
    """A batch of products with a gate per product: returns (got, a, b, bias, c0) as float64 arrays.
    ``poison(z)``: an index of A[z] (as stored) to fill with NaN: entries the kernel must not read."""
    n, batch = 40, len(counts)
    rng = np.random.default_rng(11)
    a = rounded(rng.standard_normal((batch, k, m) if trans_a else (batch, m, k)), in_dtype)
    clean = a.copy()
    for z in range(batch if poison else 0):
        a[z][poison(z)] = np.nan
    b = rounded(rng.standard_normal((batch, k, n)), in_dtype)
    c0, bias = rng.standard_normal((batch, m, n)), rng.standard_normal(n)
    ops = [upload(device, x, d) for x, d in ((a, in_dtype), (b, in_dtype), (c0, "float32"), (bias, "float32"))]
    gate = Operand(device.upload(np.array([9.0, *counts], np.float32)), 1)
    seq = device.sequence()
    matmul(seq, *ops[:3], m=m, n=n, k=k, batch=batch, trans_a=trans_a, bias=ops[3], beta=0.5, algorithm=algorithm,
           gate=gate, gate_mode=mode, **options)
    seq.replay()
    got = ops[2].buffer.read()[: batch * m * n].reshape(batch, m, n).astype(np.float64)
    return got, (np.swapaxes(clean, 1, 2) if trans_a else clean), b, bias, c0


def _no_coopmat(device, in_dtype, algorithm) -> bool:
    """True (after checking that asking for it is refused) where the device has no such cooperative matrix."""
    if algorithm != "coopmat" or coopmat_supported(device, in_dtype):
        return False
    with pytest.raises(ValueError, match="cooperative matrix"):
        run_case(device, 16, 64, 256, in_dtype=in_dtype, algorithm="coopmat")
    return True


@pytest.mark.parametrize("algorithm, options", GATED_KERNELS)
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
def test_row_gate_skips_the_row_blocks_past_the_count(device, algorithm, options, in_dtype):
    """gate_mode "rows": a block of rows that starts at or past its product's count is not multiplied (it
    stores bias + beta * C, as for a zero product; its rows of A hold NaN here and are never read); every other
    row is the full product. Counts 0 (an expert no token chose), inside the first block, past it, all rows."""
    if _no_coopmat(device, in_dtype, algorithm):
        return
    m, k = (6, 24) if algorithm == "small_m" else (300, 72)
    block = min(m, 8) if algorithm == "small_m" else (options.get("tiled") or options.get("coopmat")).bm
    counts = [0, 3, block + 1, m] if algorithm == "small_m" else [0, 3, 130, m]

    def skipped(z):
        return np.arange(m) // block * block >= counts[z]
    got, a, b, bias, c0 = _gated_case(device, algorithm, options, in_dtype, "rows", m, k, counts, poison=skipped)
    for z in range(len(counts)):
        full, skip = a[z] @ b[z] + bias + 0.5 * c0[z], skipped(z)
        assert not np.isnan(got[z]).any()
        if (~skip).any():
            check(got[z][~skip], full[~skip], "float32")
        if skip.any():
            check(got[z][skip], (bias + 0.5 * c0[z])[skip], "float32")


@pytest.mark.parametrize("algorithm, options", [k for k in GATED_KERNELS if k[0] != "small_m"])
@pytest.mark.parametrize("trans_a", [False, True])
def test_depth_gate_sums_k_up_to_the_count(device, algorithm, options, trans_a):
    """gate_mode "depth" (a row-limited product's weight gradient, A^T @ dC): the sum over K stops at the count,
    whole K steps skipped and the entries past it in the last one not read (they hold NaN here)."""
    in_dtype = "float16"
    if _no_coopmat(device, in_dtype, algorithm):
        return
    m, k = 70, 200
    counts = [0, 1, 64, 150, k]

    def past_count(z):  # A's K entries past the count: rows of A^T (trans_a) or columns of A
        if trans_a:
            return np.arange(k) >= counts[z]
        return (slice(None), np.arange(k) >= counts[z])
    got, a, b, bias, c0 = _gated_case(device, algorithm, options, in_dtype, "depth", m, k, counts, trans_a,
                                      poison=past_count)
    for z, count in enumerate(counts):
        assert not np.isnan(got[z]).any()
        check(got[z], a[z][:, :count] @ b[z][:count] + bias + 0.5 * c0[z], "float32")


def test_depth_gated_products_avoid_the_small_m_kernel(device):
    """The small-m kernel has no depth gate: "auto" gives such a product of few rows to a tile kernel (the result
    is exact), and asking for it by name is refused."""
    got, a, b, bias, c0 = _gated_case(device, "auto", {}, "float32", "depth", 4, 40, [10, 40])
    for z, count in enumerate([10, 40]):
        check(got[z], a[z][:, :count] @ b[z][:count] + bias + 0.5 * c0[z], "float32")
    with pytest.raises(ValueError, match="no depth gate"):
        _gated_case(device, "small_m", {}, "float32", "depth", 4, 40, [10, 40])


SPANS = [(0, 0), (0, 130), (130, 3), (133, 150), (283, 10)]  # rows 293.. belong to no span


@pytest.mark.parametrize("algorithm, options", [k for k in GATED_KERNELS[:2]] + [("auto", {})])
@pytest.mark.parametrize("in_dtype", ["float32", "float16"])
def test_span_rows_gate_multiplies_each_products_rows_of_packed_matrices(device, algorithm, options, in_dtype):
    """gate_mode "span_rows" (a mixture of experts' packed token rows, one span per expert): product z writes
    C rows start.. start+count-1 = those rows of A @ B[z] (+ bias + beta C), and no other row; A's rows outside
    every span hold NaN and are never read. One batched call (A and C shared, stride 0), spans of 0 rows, of
    part of a block, and running past a block edge."""
    if _no_coopmat(device, in_dtype, algorithm):
        return
    rows, k, n, experts = 300, 72, 40, len(SPANS)
    rng = np.random.default_rng(5)
    a = rounded(rng.standard_normal((rows, k)), in_dtype)
    covered = np.zeros(rows, bool)
    for start, count in SPANS:
        covered[start:start + count] = True
    a_poisoned = a.copy()
    a_poisoned[~covered] = np.nan
    b = rounded(rng.standard_normal((experts, k, n)), in_dtype)
    c0, bias = rounded(rng.standard_normal((rows, n)), "float32"), rng.standard_normal(n)
    ops = [upload(device, x, d) for x, d in ((a_poisoned, in_dtype), (b, in_dtype), (c0, "float32"), (bias, "float32"))]
    gate = Operand(device.upload(np.array([7.0, *np.ravel(SPANS)], np.float32)), 1)
    seq = device.sequence()
    matmul(seq, *ops[:3], m=rows, n=n, k=k, batch=experts, stride_a=0, stride_b=k * n, stride_c=0, bias=ops[3],
           beta=0.5, algorithm=algorithm, gate=gate, gate_mode="span_rows", **options)
    seq.replay()
    got = ops[2].buffer.read()[: rows * n].reshape(rows, n).astype(np.float64)
    want = c0.copy()
    for z, (start, count) in enumerate(SPANS):
        span = slice(start, start + count)
        want[span] = a[span] @ b[z] + bias + 0.5 * c0[span]
    check(got[covered], want[covered], "float32")
    np.testing.assert_array_equal(got[~covered], c0[~covered])


@pytest.mark.parametrize("algorithm, options", [k for k in GATED_KERNELS[:2]] + [("auto", {})])
def test_span_depth_gate_sums_each_products_k_entries(device, algorithm, options):
    """gate_mode "span_depth" (the weight gradient of span-rows products, A^T @ dC over a span of rows): product
    z sums K entries start.. start+count-1 of A ([K, M], transposed) and B ([K, N]); the entries outside every
    span hold NaN and are never read. A span of 0 entries gives bias + beta C."""
    in_dtype = "float16"
    if _no_coopmat(device, in_dtype, algorithm):
        return
    rows, m, n, experts = 300, 48, 40, len(SPANS)
    rng = np.random.default_rng(6)
    a, b = (rounded(rng.standard_normal((rows, width)), in_dtype) for width in (m, n))
    covered = np.zeros(rows, bool)
    for start, count in SPANS:
        covered[start:start + count] = True
    a_poisoned, b_poisoned = a.copy(), b.copy()
    a_poisoned[~covered] = np.nan
    b_poisoned[~covered] = np.nan
    c0, bias = rng.standard_normal((experts, m, n)), rng.standard_normal(n)
    ops = [upload(device, x, d) for x, d in ((a_poisoned, in_dtype), (b_poisoned, in_dtype), (c0, "float32"),
                                             (bias, "float32"))]
    gate = Operand(device.upload(np.array([7.0, *np.ravel(SPANS)], np.float32)), 1)
    seq = device.sequence()
    matmul(seq, *ops[:3], m=m, n=n, k=rows, batch=experts, trans_a=True, stride_a=0, stride_b=0, stride_c=m * n,
           bias=ops[3], beta=0.5, algorithm=algorithm, gate=gate, gate_mode="span_depth", **options)
    seq.replay()
    got = ops[2].buffer.read()[: experts * m * n].reshape(experts, m, n).astype(np.float64)
    for z, (start, count) in enumerate(SPANS):
        span = slice(start, start + count)
        check(got[z], a[span].T @ b[span] + bias + 0.5 * c0[z], "float32")


WHOLE_TILE_SPANS = [(0, 0), (0, 260), (260, 3), (263, 300), (563, 30)]  # blocks wholly inside a span, and ragged


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("algorithm", ["coopmat", "tiled"])
def test_span_gates_on_whole_tiles(device, algorithm, out_dtype):
    """Span products whose blocks lie wholly inside a span (the coopmat kernel's unchecked loads and direct
    epilogues: C written 8 16-bit values or a 16x16 float32 fragment at a time) beside ragged ones, at span
    starts that are not multiples of a tile: span_rows, then span_depth over the same spans."""
    in_dtype = "bfloat16" if out_dtype == "bfloat16" else "float16"
    if _no_coopmat(device, in_dtype, algorithm):
        return
    rows, k, n = 600, 128, 256
    experts = len(WHOLE_TILE_SPANS)
    rng = np.random.default_rng(7)
    a = rounded(rng.standard_normal((rows, k)), in_dtype)
    b = rounded(rng.standard_normal((experts, k, n)), in_dtype)
    gate = Operand(device.upload(np.array([7.0, *np.ravel(WHOLE_TILE_SPANS)], np.float32)), 1)
    ops = [upload(device, x, d) for x, d in ((a, in_dtype), (b, in_dtype), (np.zeros((rows, n)), out_dtype))]
    seq = device.sequence()
    matmul(seq, *ops, m=rows, n=n, k=k, batch=experts, stride_a=0, stride_b=k * n, stride_c=0, alpha=0.5,
           algorithm=algorithm, gate=gate, gate_mode="span_rows")
    seq.replay()
    got = from_storage(ops[2].buffer.read().reshape(-1), out_dtype)[: rows * n].reshape(rows, n)
    for z, (start, count) in enumerate(WHOLE_TILE_SPANS):
        span = slice(start, start + count)
        if count:
            check(got[span].astype(np.float64), 0.5 * (a[span] @ b[z]), out_dtype)
    np.testing.assert_array_equal(got[593:], 0.0)  # rows in no span
    # span_depth: the weight gradient's shape, [k, n] per expert = a[span]^T @ c[span], in whole tiles
    c = rounded(rng.standard_normal((rows, n)), in_dtype)
    ops = [upload(device, x, d) for x, d in ((a, in_dtype), (c, in_dtype), (np.zeros((experts, k, n)), out_dtype))]
    seq = device.sequence()
    matmul(seq, *ops, m=k, n=n, k=rows, batch=experts, trans_a=True, stride_a=0, stride_b=0, stride_c=k * n,
           algorithm=algorithm, gate=gate, gate_mode="span_depth")
    seq.replay()
    got = from_storage(ops[2].buffer.read().reshape(-1), out_dtype)[: experts * k * n].reshape(experts, k, n)
    for z, (start, count) in enumerate(WHOLE_TILE_SPANS):
        span = slice(start, start + count)
        check(got[z].astype(np.float64), a[span].T @ c[span], out_dtype)


def test_span_gates_are_checked(device):
    a = device.upload(np.zeros((8, 8), np.float32))
    gate = device.upload(np.zeros(2, np.float32))
    for kwargs, message in ((dict(gate_mode="span_rows", trans_a=True), "A not transposed"),
                            (dict(gate_mode="span_depth"), "A transposed and B not"),
                            (dict(gate_mode="span_depth", trans_a=True, trans_b=True), "A transposed and B not"),
                            (dict(gate_mode="span_rows", algorithm="small_m"), "no span_rows gate"),
                            (dict(gate_mode="span_rows", splits=2), "not split")):
        with pytest.raises(ValueError, match=message):
            matmul(device.sequence(), a, a, a, m=8, n=8, k=8, gate=gate, **kwargs)
    with pytest.raises(ValueError, match="gate"):  # a span is a pair per product
        matmul(device.sequence(), a, a, a, m=8, n=8, k=8, gate=device.upload(np.zeros(1, np.float32)),
               gate_mode="span_rows")


def test_gate_mode_is_checked(device):
    a = device.upload(np.zeros((4, 4), np.float32))
    gate = device.upload(np.ones(1, np.float32))
    with pytest.raises(ValueError, match="gate_mode"):
        matmul(device.sequence(), a, a, a, m=4, n=4, k=4, gate=gate, gate_mode="columns")


def test_small_m_rejects_bad_configuration(device):
    a = device.upload(np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError):
        matmul(device.sequence(), a, a, a, m=4, n=4, k=4, trans_b=True, algorithm="small_m",
               small_m=SmallMConfig(threads=64, rows_per_wg=6, rows_per_subgroup=4))
