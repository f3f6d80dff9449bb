"""Fused attention kernels (forward, backward, decode) against a float64 numpy reference
of the semantics documented in vkformers.engine.kernels.attention.

Tolerances (absolute, values and gradients of order 1): float32 1e-5 forward and 1e-4
backward (sums over up to kv_len * head_dim products); float16 3e-3 and bfloat16 2e-2
(one rounding of the result to the storage type, relative to an exact reference computed
from the same rounded inputs). The cooperative-matrix forward kernel (chosen by "auto" for
float16/bfloat16 on devices that have it) also rounds the probabilities to the storage type
before multiplying by v: at most 2^-11 (float16) or 2^-8 (bfloat16) of sum_j p_j |v_j|, i.e.
1.5e-3 and 1.2e-2 for |v| <= 3, inside the same tolerances.
"""
from dataclasses import dataclass, replace

import numpy as np
import pytest

from vkformers.engine.kernels import Operand
from vkformers.engine.kernels import attention as attention_kernels
from vkformers.engine.kernels.attention import (
    ABLATIONS, COOPMAT_BACKWARD_TILES, COOPMAT_FORWARD_TILES, COOPMAT_TWO_PASS_TILES,
    DECODE_TILES, CoopmatBackwardTiles, CoopmatTiles, Tiles, attention_backward, attention_decode, attention_forward,
    coopmat_backward_tiles, coopmat_forward_candidates, coopmat_forward_tiles)
from vkformers.engine.kernels.coopmat_layout import CoopmatLayout, analyse, coopmat_layout
from vkformers.engine.kernels.matmul import coopmat_supported
from vkformers.runtime import dtypes as dt

FORWARD_TOL = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}
BACKWARD_TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}


@dataclass(frozen=True)
class Case:
    batch: int = 2
    heads: int = 4
    kv_heads: int = 4
    q_len: int = 33
    kv_len: int = 33
    head_dim: int = 64
    causal: bool = True
    mask: bool = False
    window: int = 0
    softcap: float = 0.0
    alibi: bool = False
    scale: float | None = None
    q_offset: int | None = None

    @property
    def position0(self) -> int:
        return self.kv_len - self.q_len if self.q_offset is None else self.q_offset

    @property
    def the_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale


# ------------------------------------------------------------ float64 reference

def visibility(case: Case, mask):
    qpos = case.position0 + np.arange(case.q_len)[:, None]
    kpos = np.arange(case.kv_len)[None, :]
    visible = np.ones((case.batch, case.q_len, case.kv_len), bool)
    if case.causal:
        visible &= kpos <= qpos
    if case.window:
        visible &= qpos - kpos < case.window
    if mask is not None:
        visible &= mask[:, None, :].astype(bool)
    return visible[:, None], (kpos - qpos).astype(np.float64)


def reference(case: Case, q, k, v, mask, slopes, d_out=None):
    group = case.heads // case.kv_heads
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    raw = case.the_scale * q @ kk.transpose(0, 1, 3, 2)
    cap_slope = np.ones_like(raw)
    scores = raw
    if case.softcap:
        t = np.tanh(raw / case.softcap)
        scores, cap_slope = case.softcap * t, 1 - t * t
    visible, relative = visibility(case, mask)
    if slopes is not None:
        scores = scores + slopes[None, :, None, None] * relative
    scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(-1, keepdims=True)
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.where(visible, np.exp(scores - shift), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1)
    out = p @ vv
    lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1)), -np.inf)[..., 0]
    if d_out is None:
        return out, lse
    d_p = d_out @ vv.transpose(0, 1, 3, 2)
    d_s = p * (d_p - (d_out * out).sum(-1, keepdims=True)) * cap_slope
    d_q = case.the_scale * d_s @ kk
    fold = lambda x: x.reshape(case.batch, case.kv_heads, group, case.kv_len, case.head_dim).sum(2)
    d_k = fold(case.the_scale * d_s.transpose(0, 1, 3, 2) @ q)
    d_v = fold(p.transpose(0, 1, 3, 2) @ d_out)
    return out, lse, d_q, d_k, d_v


# ------------------------------------------------------------ helpers

def rounded(x, dtype):
    """x rounded to the storage dtype (as float64) and its host representation for upload."""
    if dtype == "bfloat16":
        bits = dt.to_bfloat16(x.astype(np.float32))
        return dt.from_bfloat16(bits).astype(np.float64), bits
    host = x.astype(dt.as_dtype(dtype).host)
    return host.astype(np.float64), host


def as_float(array, dtype):
    return dt.from_bfloat16(array).astype(np.float64) if dtype == "bfloat16" else array.astype(np.float64)


def make_inputs(case: Case, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.batch, case.heads, case.q_len, case.head_dim))
    k = rng.standard_normal((case.batch, case.kv_heads, case.kv_len, case.head_dim))
    v = rng.standard_normal((case.batch, case.kv_heads, case.kv_len, case.head_dim))
    d_out = rng.standard_normal((case.batch, case.heads, case.q_len, case.head_dim))
    mask = None
    if case.mask:  # left padding on batch 0 (its first queries see nothing when causal), holes on batch 1
        mask = np.ones((case.batch, case.kv_len), np.uint8)
        mask[0, : min(3, case.kv_len - 1)] = 0
        mask[-1, 1::4] = 0
    slopes = 2.0 ** (-8.0 * np.arange(1, case.heads + 1) / case.heads) if case.alibi else None
    return [rounded(x, dtype) for x in (q, k, v, d_out)], mask, slopes


def flags(case: Case, device, mask, slopes):
    return dict(batch=case.batch, heads=case.heads, kv_heads=case.kv_heads, q_len=case.q_len, kv_len=case.kv_len,
                head_dim=case.head_dim, scale=case.the_scale, causal=case.causal, window=case.window,
                softcap=case.softcap, q_offset=case.q_offset,
                key_padding_mask=None if mask is None else device.upload(mask),
                alibi_slopes=None if slopes is None else device.upload(slopes.astype(np.float32)))


def upload_at(device, host, dtype, offset):
    """``host`` placed at element ``offset`` of a larger buffer (exercises Operand offsets)."""
    flat = host.reshape(-1)
    padded = np.concatenate([np.zeros(offset, flat.dtype), flat, np.zeros(3, flat.dtype)])
    return Operand(device.upload(padded, dtype=dtype), offset)


def run_case(device, case: Case, dtype="float32", backward=True, offset=0, tiles=None, backward_algorithm="auto",
             backward_tiles=None):
    """Forward (and backward) of ``case`` against the numpy reference; ``tiles`` for both passes unless
    ``backward_tiles`` is given."""
    rounded_inputs, mask, slopes = make_inputs(case, dtype)
    (q, q_host), (k, k_host), (v, v_host), (d_out, d_out_host) = rounded_inputs
    shape_q, shape_kv = q.shape, k.shape
    q_buf, k_buf, v_buf = (upload_at(device, x, dtype, offset) for x in (q_host, k_host, v_host))
    out = device.buffer(shape_q, dtype, name="out")
    lse = device.buffer(shape_q[:3], "float32", name="lse")
    kw = dict(flags(case, device, mask, slopes), tiles=tiles)
    seq = device.sequence()
    attention_forward(seq, q_buf, k_buf, v_buf, out, lse, **kw)
    grads = None
    if backward:
        d_out_buf = device.upload(d_out_host, dtype=dtype)
        grads = [device.buffer(s, dtype, name=n) for s, n in ((shape_q, "d_q"), (shape_kv, "d_k"), (shape_kv, "d_v"))]
        if backward_tiles is not None:
            kw["tiles"] = backward_tiles
        attention_backward(seq, q_buf, k_buf, v_buf, out, d_out_buf, lse, *grads, **kw, algorithm=backward_algorithm)
    seq.replay()

    expected = reference(case, q, k, v, mask, slopes, d_out if backward else None)
    tol = FORWARD_TOL[dtype]
    np.testing.assert_allclose(as_float(out.read(), dtype), expected[0], atol=tol, rtol=tol)
    got_lse = lse.read().astype(np.float64)
    np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(expected[1]))
    finite = np.isfinite(expected[1])
    np.testing.assert_allclose(got_lse[finite], expected[1][finite], atol=tol, rtol=tol)
    if backward:
        # The kernel's backward starts from its own forward output (rounded to dtype): so does the reference's delta.
        tol = BACKWARD_TOL[dtype]
        for name, buf, want in zip(("d_q", "d_k", "d_v"), grads, expected[2:]):
            np.testing.assert_allclose(as_float(buf.read(), dtype), want, atol=tol, rtol=tol, err_msg=name)


# ------------------------------------------------------------ tests

CASES = {
    "causal": Case(),
    "not_causal_hd80": Case(causal=False, head_dim=80, q_len=7, kv_len=33),
    "padding_mask": Case(mask=True, q_len=17, kv_len=17),
    "padding_mask_not_causal": Case(mask=True, causal=False, q_len=9, kv_len=20),
    "gqa": Case(heads=4, kv_heads=2, q_len=20, kv_len=20),
    "mqa": Case(heads=4, kv_heads=1, batch=1, q_len=19, kv_len=19),
    "sliding_window": Case(window=5, q_len=29, kv_len=29),
    "softcap": Case(softcap=2.0, scale=0.5, q_len=16, kv_len=16),
    "alibi": Case(alibi=True, q_len=18, kv_len=18),
    "custom_scale": Case(scale=0.3, causal=False, q_len=5, kv_len=11, batch=1),
    "chunked_prefill": Case(q_len=7, kv_len=33),
    "explicit_q_offset": Case(q_len=7, kv_len=33, q_offset=10, window=6, mask=True),
    "single_query": Case(q_len=1, kv_len=1, batch=1),
    "single_query_long_kv": Case(q_len=1, kv_len=33, heads=2, kv_heads=1),
    "everything": Case(heads=4, kv_heads=2, mask=True, window=9, softcap=3.0, alibi=True, q_len=21, kv_len=21,
                       head_dim=80),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_float32(device, name):
    run_case(device, CASES[name], "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_forward_and_backward_half_types(device, dtype):
    run_case(device, Case(heads=4, kv_heads=2, q_len=23, kv_len=23, mask=True), dtype)


# Half-type forward cases (head_dim a multiple of 16): the cooperative-matrix kernel where the device
# has it, so every flag and edge (several query blocks, partial key tiles, fully masked rows) is checked there.
HALF_FORWARD_CASES = {
    "causal_multi_block": Case(batch=1, heads=2, kv_heads=1, q_len=100, kv_len=100, head_dim=128),
    "not_causal_hd80": Case(causal=False, head_dim=80, q_len=7, kv_len=33),
    "padding_mask": Case(mask=True, q_len=45, kv_len=45),
    "sliding_window": Case(window=13, q_len=90, kv_len=90, batch=1),
    "softcap_alibi": Case(softcap=2.0, scale=0.5, alibi=True, q_len=40, kv_len=40),
    "chunked_prefill_offset": Case(q_len=20, kv_len=70, q_offset=40, window=30, mask=True),
    "head_dim_256": Case(batch=1, heads=2, kv_heads=2, q_len=35, kv_len=35, head_dim=256),
    "head_dim_16_mqa": Case(batch=1, heads=4, kv_heads=1, q_len=50, kv_len=50, head_dim=16),
    "not_causal_more_queries": Case(causal=False, q_len=40, kv_len=25, batch=1),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(HALF_FORWARD_CASES))
def test_half_type_forward(device, dtype, name):
    run_case(device, HALF_FORWARD_CASES[name], dtype, backward=False)


# Every head dim a model uses, causal or not, GQA, odd lengths, padding masks: each cooperative-matrix forward variant.
VARIANT_CASES = {**HALF_FORWARD_CASES, **{
    f"head_dim_{d}_{'causal' if causal else 'not_causal'}": Case(heads=4, kv_heads=2, q_len=67, kv_len=67, head_dim=d,
                                                                 causal=causal, mask=True)
    for d in (64, 80, 96, 128, 256) for causal in (True, False)}}
# Each production variant of the cooperative-matrix forward: the options a CoopmatTiles may carry.
FORWARD_VARIANTS = {"two_pass": dict(one_pass=False), "two_pass_prefetch": dict(one_pass=False, prefetch=True),
                    "one_pass": {}, "one_pass_prefetch": dict(prefetch=True),
                    "one_pass_batched_staging": dict(batched_staging=True),
                    "one_pass_lazy_rescale": dict(lazy_rescale=True),
                    "one_pass_prefetch_lazy_rescale": dict(prefetch=True, lazy_rescale=True),
                    "one_pass_double_buffer": dict(double_buffer=True),
                    # The register softmax (where the device's measured layout allows it), P through shared memory
                    # or straight into A operands, with each staging option.
                    "one_pass_reg_softmax": dict(reg_softmax=True),
                    "one_pass_reg_softmax_p_in_regs": dict(reg_softmax=True, p_in_regs=True),
                    "one_pass_reg_softmax_p_in_regs_lazy_rescale": dict(reg_softmax=True, p_in_regs=True,
                                                                        lazy_rescale=True),
                    "one_pass_reg_softmax_p_in_regs_prefetch": dict(reg_softmax=True, p_in_regs=True, prefetch=True),
                    "one_pass_reg_softmax_double_buffer": dict(reg_softmax=True, double_buffer=True),
                    "one_pass_reg_softmax_p_in_regs_double_buffer": dict(reg_softmax=True, p_in_regs=True,
                                                                         double_buffer=True)}


def variant_candidates(variant: str, head_dim: int) -> list[CoopmatTiles]:
    options = FORWARD_VARIANTS[variant]
    shapes = COOPMAT_TWO_PASS_TILES if options.get("one_pass", True) is False else coopmat_forward_candidates(head_dim)
    return [replace(t, **options) for t in shapes]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
@pytest.mark.parametrize("name", list(VARIANT_CASES))
def test_coopmat_forward_variants(device, dtype, variant, name):
    """Each cooperative-matrix forward (the two-pass kernel and the one-pass online softmax, each tuning option) at the
    tiles the device would pick for it; refused by name where the device has no cooperative matrix for the dtype."""
    case = VARIANT_CASES[name]
    candidates = variant_candidates(variant, case.head_dim)
    tiles = coopmat_forward_tiles(device, dtype, case.head_dim, 0, 0, 0, candidates=candidates)
    if tiles is None:
        with pytest.raises(ValueError, match="cooperative-matrix forward"):
            run_case(device, case, dtype, backward=False, tiles=candidates[-1])
        return
    assert tiles.one_pass == variant.startswith("one_pass") and tiles.prefetch == ("prefetch" in variant)
    assert tiles.lazy_rescale == ("lazy_rescale" in variant) and tiles.ablation == 0
    assert tiles.batched_staging == ("batched_staging" in variant)
    assert (tiles.reg_softmax, tiles.p_in_regs) == ("reg_softmax" in variant, "p_in_regs" in variant)
    assert tiles.double_buffer == ("double_buffer" in variant)
    run_case(device, case, dtype, backward=False, tiles=tiles)


REG_OPTIONS = [dict(reg_softmax=True), dict(reg_softmax=True, p_in_regs=True, double_buffer=True)]


@pytest.mark.parametrize("tiles", COOPMAT_FORWARD_TILES + COOPMAT_TWO_PASS_TILES
                         + [replace(t, prefetch=True, lazy_rescale=True) for t in COOPMAT_FORWARD_TILES]
                         + [replace(t, batched_staging=True) for t in COOPMAT_FORWARD_TILES]
                         + [replace(t, double_buffer=True) for t in COOPMAT_FORWARD_TILES]
                         + [replace(t, **o) for o in REG_OPTIONS
                            for t in COOPMAT_FORWARD_TILES + [CoopmatTiles(128, 64)]]
                         + [replace(t, prefetch=True) for t in COOPMAT_TWO_PASS_TILES])
@pytest.mark.parametrize("name", ["causal_multi_block", "chunked_prefill_offset", "head_dim_96_causal"])
def test_coopmat_forward_every_tile_shape(device, tiles, name):
    """Each tile shape of both forward variants, with and without the tuning options (the automatic choice takes only
    the first that fits), operands at an 8-element offset; a shape the device cannot run is refused by name."""
    case = VARIANT_CASES[name]
    runs = coopmat_forward_tiles(device, "bfloat16", case.head_dim, 8, 8, 8, candidates=[tiles]) is not None
    if not runs:
        with pytest.raises(ValueError, match="cooperative-matrix forward"):
            run_case(device, case, "bfloat16", backward=False, offset=8, tiles=tiles)
        return
    run_case(device, case, "bfloat16", backward=False, offset=8, tiles=tiles)


def test_coopmat_forward_default_tiles():
    """One pass; 64 x 32 up to head dim 64, 128 x 32 above where it fits 48 KiB of shared memory (up to 128), else
    64 x 32; ablations only for the one-pass kernel, and only the listed ones."""
    fitting = lambda head_dim: next(t for t in coopmat_forward_candidates(head_dim)
                                    if t.fits(32) and t.shared_bytes(head_dim, 32) <= 48 * 1024)
    assert [fitting(d) for d in (32, 64, 80, 128, 256)] == [CoopmatTiles(64, 32)] * 2 + [CoopmatTiles(128, 32)] * 2 \
        + [CoopmatTiles(64, 32)]
    assert all(t.one_pass and t.tuning == 0 and t.ablation == 0 for t in coopmat_forward_candidates(128))
    assert all(CoopmatTiles(64, 32, ablation=a).fits(32) for a in ABLATIONS.values())
    assert not CoopmatTiles(64, 32, one_pass=False, ablation=1).fits(32)
    assert not CoopmatTiles(64, 32, one_pass=False, lazy_rescale=True).fits(32)
    assert not CoopmatTiles(64, 32, prefetch=True, batched_staging=True).fits(32)
    assert not CoopmatTiles(64, 32, ablation=max(ABLATIONS.values()) + 1).fits(32)


def test_coopmat_backward_option_combinations():
    """The backward takes only the register softmax, P in registers (with it) and double buffering; P in registers
    leaves only the output blocks in each subgroup's shared memory, double buffering doubles the streamed tiles."""
    assert CoopmatBackwardTiles(64, 32, reg_softmax=True, p_in_regs=True).fits(32)
    assert CoopmatBackwardTiles(64, 32, reg_softmax=True).fits(8) and not CoopmatBackwardTiles(64, 32).fits(8)
    assert CoopmatBackwardTiles(64, 32, double_buffer=True).fits(32)
    for options in (dict(p_in_regs=True), dict(prefetch=True), dict(lazy_rescale=True), dict(batched_staging=True)):
        assert not CoopmatBackwardTiles(64, 32, **options).fits(32)
    reg = CoopmatBackwardTiles(64, 32, reg_softmax=True, p_in_regs=True)
    assert reg.shared_bytes(128, 32) < CoopmatBackwardTiles(64, 32).shared_bytes(128, 32)
    assert reg.tuning == 8 | 16
    double = replace(reg, double_buffer=True)
    assert double.tuning == 8 | 16 | 32 and double.shared_bytes(128, 32) <= 48 * 1024
    assert double.shared_bytes(128, 32) - reg.shared_bytes(128, 32) == 2 * 32 * 16 * 17 + 2 * 4 * 32


def test_coopmat_forward_option_combinations():
    """The register softmax and double buffering only with one pass, without ablations, double buffering without the
    other staging options, P in registers only with the register softmax; the register softmax alone runs with
    subgroups of 8 (its lanes need not split rows)."""
    assert CoopmatTiles(64, 32, reg_softmax=True, p_in_regs=True, double_buffer=True, lazy_rescale=True).fits(32)
    assert CoopmatTiles(64, 32, reg_softmax=True).fits(8) and not CoopmatTiles(64, 32).fits(8)
    assert not CoopmatTiles(64, 32, one_pass=False, reg_softmax=True).fits(32)
    assert not CoopmatTiles(64, 32, one_pass=False, double_buffer=True).fits(32)
    assert not CoopmatTiles(64, 32, reg_softmax=True, ablation=1).fits(32)
    assert not CoopmatTiles(64, 32, p_in_regs=True).fits(32)
    assert not CoopmatTiles(64, 32, double_buffer=True, prefetch=True).fits(32)
    assert not CoopmatTiles(64, 32, double_buffer=True, batched_staging=True).fits(32)
    assert CoopmatTiles(64, 32, reg_softmax=True, p_in_regs=True, double_buffer=True).tuning == 8 | 16 | 32
    # Shared memory: no score space with P in registers, two tile buffers with double buffering.
    plain, reg = CoopmatTiles(128, 64), CoopmatTiles(128, 64, reg_softmax=True, p_in_regs=True)
    assert reg.shared_bytes(128, 32) <= 48 * 1024 < plain.shared_bytes(128, 32)
    assert replace(reg, double_buffer=True).shared_bytes(128, 32) > 48 * 1024
    assert CoopmatTiles(64, 32, reg_softmax=True, p_in_regs=True, double_buffer=True).shared_bytes(128, 32) <= 48 * 1024


def fake_coopmat_device(subgroup=32):
    from types import SimpleNamespace
    shape = dict(m=16, n=16, k=16, a_type="float16", b_type="float16", c_type="float32", result_type="float32",
                 scope="subgroup")
    return SimpleNamespace(features={"shaderFloat16": True}, cooperative_matrix_shapes=[shape], name="fake",
                           limits={"subgroup_size": subgroup, "max_compute_shared_memory_size": 48 * 1024})


@pytest.mark.parametrize("layout", ["none", "a_differs", "a_matches"])
def test_coopmat_forward_options_where_the_layout_allows(monkeypatch, layout):
    """The automatic forward tiles take the register softmax (P straight into A operands, double-buffered 128 x 32,
    64 x 16 at head dim 256) only where the device's measured layout allows it; else the shared-memory softmax with
    COOPMAT_FORWARD_OPTIONS (batched staging). Subgroups of 8 run only the register softmax."""
    measured = {"none": None, "a_differs": CoopmatLayout(8, 2, 3, (0, 0, 1, 1, 0, 0, 1, 1), False),
                "a_matches": CoopmatLayout(8, 2, 3, (0, 0, 1, 1, 0, 0, 1, 1), True)}[layout]
    monkeypatch.setattr(attention_kernels, "coopmat_layout", lambda device, dtype: measured)
    device = fake_coopmat_device()
    register = layout == "a_matches"
    for head_dim, shape in ((64, (128, 32) if register else (64, 32)), (128, (128, 32)),
                            (256, (64, 16) if register else (64, 32))):
        tiles = coopmat_forward_tiles(device, "float16", head_dim, 0, 0, 0)
        assert (tiles.reg_softmax, tiles.p_in_regs, tiles.double_buffer) == (register,) * 3, head_dim
        assert tiles.batched_staging == (not register) and (tiles.rows, tiles.cols) == shape, head_dim
    reg_only = coopmat_forward_tiles(device, "float16", 128, 0, 0, 0,
                                     candidates=[CoopmatTiles(64, 32, reg_softmax=True)])
    assert (reg_only is None) == (layout == "none")
    assert (coopmat_forward_tiles(fake_coopmat_device(8), "float16", 128, 0, 0, 0) is None) == (not register)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["none", "a_differs", "a_matches"])
def test_coopmat_backward_options_where_the_layout_allows(monkeypatch, layout, head_dim):
    """The automatic backward tiles (64 x 32 where they fit) take P and dS straight into A operands where the layout
    allows it, the register softmax through shared memory where only a layout was measured, else neither; the first
    have double-buffered streamed tiles up to head_dim 64 only."""
    measured = {"none": None, "a_differs": CoopmatLayout(8, 2, 3, (0, 0, 1, 1, 0, 0, 1, 1), False),
                "a_matches": CoopmatLayout(8, 2, 3, (0, 0, 1, 1, 0, 0, 1, 1), True)}[layout]
    monkeypatch.setattr(attention_kernels, "coopmat_layout", lambda device, dtype: measured)
    tiles = coopmat_backward_tiles(fake_coopmat_device(), "float16", head_dim, 0, 0, 0, 0)
    assert (tiles.rows, tiles.cols) == (64, 32)
    assert (tiles.reg_softmax, tiles.p_in_regs) == {"none": (False, False), "a_differs": (True, False),
                                                    "a_matches": (True, True)}[layout]
    assert tiles.double_buffer == (head_dim <= 64 and layout == "a_matches")


def mma_layout(lane, i):
    """(row, column) of accumulator element i of ``lane`` as in m16n8k16 tensor-core fragments, two n8 halves."""
    return lane // 4 + 8 * ((i // 2) % 2), 2 * (lane % 4) + i % 2 + 8 * (i // 4)


def test_coopmat_layout_analysis():
    """The layouts the register softmax can use: tensor-core fragments (two rows per lane, quads share them), a lane
    per column (all rows per lane, as lavapipe), a column per lane of one half of the rows (RDNA-like); refused:
    element orders that differ between lanes, a lane holding an element twice."""
    mma = [[mma_layout(lane, i) for i in range(8)] for lane in range(32)]
    got = analyse(mma, mma)
    assert got == CoopmatLayout(8, 2, 3, (0, 0, 1, 1, 0, 0, 1, 1), True)
    assert got.slot_words == [0b0001_0001_0000_0000_0001_0001_0000_0000, 0, 0, 0]
    assert got.spec() == [2, 3, got.slot_words[0], 0, 0, 0]
    transposed_a = [[(c, r) for r, c in lane] for lane in mma]
    assert analyse(transposed_a, mma).a_matches_accumulator is False
    columns = [[(i % 8 + 8 * (i // 16), lane + 8 * ((i // 8) % 2)) for i in range(32)] for lane in range(8)]
    got = analyse(columns, columns)
    assert (got.row_slots, got.row_lane_mask, got.a_matches_accumulator) == (16, 7, True)
    assert got.slots[:10] == (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
    halves = [[(2 * i + lane // 16, lane % 16) for i in range(8)] for lane in range(32)]
    assert (analyse(halves, halves).row_slots, analyse(halves, halves).row_lane_mask) == (8, 15)
    shuffled = [lane[::-1] if n == 5 else lane for n, lane in enumerate(mma)]
    assert analyse(shuffled, shuffled) is None
    doubled = [lane[:-1] + lane[:1] if n == 0 else lane for n, lane in enumerate(mma)]
    assert analyse(doubled, doubled) is None


def test_coopmat_layout_measured(device):
    """Where the device has cooperative matrices, its measured layout (if usable) covers each lane's share."""
    for dtype in ("float16", "bfloat16"):
        layout = coopmat_layout(device, dtype)
        if not coopmat_supported(device, dtype):
            assert layout is None
        elif layout is not None:
            assert layout.elements * int(device.limits["subgroup_size"]) == 256
            assert 1 <= layout.row_slots <= 16 and len(layout.slots) == layout.elements


# Half-type backward cases: the forward's with head_dim <= 128 (the cooperative-matrix backward's limit): GQA sums
# over several heads, partial and skipped tiles, fully masked rows, and every score flag.
HALF_BACKWARD_CASES = {name: case for name, case in HALF_FORWARD_CASES.items() if case.head_dim <= 128}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(HALF_BACKWARD_CASES))
def test_half_type_backward(device, dtype, name):
    run_case(device, HALF_BACKWARD_CASES[name], dtype)


# The cooperative-matrix backward's variants: P and dS through shared memory, or on the accumulators' elements
# (where the device's measured layout allows it), then through shared memory or straight into A operands; one
# buffer of streamed tiles or two.
BACKWARD_VARIANTS = {"shared_softmax": {}, "reg_softmax": dict(reg_softmax=True),
                     "reg_softmax_p_in_regs": dict(reg_softmax=True, p_in_regs=True),
                     "shared_softmax_double_buffer": dict(double_buffer=True),
                     "reg_softmax_p_in_regs_double_buffer": dict(reg_softmax=True, p_in_regs=True, double_buffer=True)}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", list(BACKWARD_VARIANTS))
@pytest.mark.parametrize("name", list(HALF_BACKWARD_CASES))
def test_coopmat_backward(device, dtype, variant, name):
    """Each variant of the cooperative-matrix backward, asked for by name, at the tiles the device would pick for
    it; refused by name where the device has no cooperative matrix for the dtype or no layout for the variant."""
    case = HALF_BACKWARD_CASES[name]
    candidates = [replace(t, **BACKWARD_VARIANTS[variant]) for t in COOPMAT_BACKWARD_TILES]
    tiles = coopmat_backward_tiles(device, dtype, case.head_dim, 0, 0, 0, 0, candidates=candidates)
    if tiles is None:
        with pytest.raises(ValueError, match="cooperative-matrix backward"):
            run_case(device, case, dtype, backward_algorithm="coopmat", backward_tiles=candidates[-1])
        return
    assert (tiles.reg_softmax, tiles.p_in_regs) == ("reg_softmax" in variant, "p_in_regs" in variant)
    assert tiles.double_buffer == ("double_buffer" in variant)
    run_case(device, case, dtype, backward_algorithm="coopmat", backward_tiles=tiles)


@pytest.mark.parametrize("tiles", COOPMAT_BACKWARD_TILES + [replace(t, reg_softmax=True, p_in_regs=True)
                                                          for t in COOPMAT_BACKWARD_TILES]
                         + [replace(t, reg_softmax=True, p_in_regs=True, double_buffer=True)
                            for t in COOPMAT_BACKWARD_TILES])
@pytest.mark.parametrize("name", ["causal_multi_block", "chunked_prefill_offset"])
def test_coopmat_backward_every_tile_shape(device, tiles, name):
    """Each tile shape of the cooperative-matrix backward (the automatic choice takes only the first that fits),
    with the operands at an 8-element offset; a shape the device cannot run is refused by name."""
    case = HALF_BACKWARD_CASES[name]
    runs = coopmat_backward_tiles(device, "float16", case.head_dim, 8, 8, 8, 0, candidates=[tiles]) is not None
    if not runs:
        with pytest.raises(ValueError, match="cooperative-matrix backward"):
            run_case(device, case, "float16", offset=8, backward_algorithm="coopmat", backward_tiles=tiles)
        return
    run_case(device, case, "float16", offset=8, backward_algorithm="coopmat", backward_tiles=tiles)


def test_given_coopmat_tiles_are_checked(device):
    """Tiles a caller chooses pass the automatic choice's checks (the kernels would stage out of bounds)."""
    case = Case(q_len=20, kv_len=20)
    with pytest.raises(TypeError, match="CoopmatBackwardTiles"):
        run_case(device, case, "float16", backward_algorithm="coopmat", backward_tiles=CoopmatTiles(64, 32))
    with pytest.raises(ValueError, match="algorithm='scalar'"):
        run_case(device, case, "float16", backward_algorithm="scalar", backward_tiles=CoopmatBackwardTiles(64, 32))
    with pytest.raises(ValueError, match="cooperative-matrix backward"):  # owned rows overflow the staging
        run_case(device, case, "float16", backward_algorithm="coopmat", backward_tiles=CoopmatBackwardTiles(64, 16))
    with pytest.raises(ValueError, match="cooperative-matrix forward"):  # not a multiple of 16 rows
        run_case(device, case, "float16", backward=False, tiles=CoopmatTiles(24, 32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_coopmat_backward_selected_when_the_device_has_it(device, dtype):
    tiles = coopmat_backward_tiles(device, dtype, 128, 0, 0, 0, 0)
    assert (tiles is not None) == coopmat_supported(device, dtype)
    assert coopmat_backward_tiles(device, dtype, 256, 0, 0, 0, 0) is None   # head_dim over 128
    assert coopmat_backward_tiles(device, dtype, 72, 0, 0, 0, 0) is None    # head_dim not a multiple of 16
    assert coopmat_backward_tiles(device, dtype, 128, 0, 0, 0, 4) is None   # d_out not on an 8-element boundary
    assert coopmat_backward_tiles(device, "float32", 128, 0, 0, 0, 0) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_coopmat_forward_selected_when_the_device_has_it(device, dtype):
    tiles = coopmat_forward_tiles(device, dtype, 128, 0, 0, 0)
    assert (tiles is not None) == coopmat_supported(device, dtype)
    assert coopmat_forward_tiles(device, dtype, 72, 0, 0, 0) is None       # head_dim not a multiple of 16
    assert coopmat_forward_tiles(device, dtype, 128, 0, 4, 0) is None      # k not on an 8-element boundary
    assert coopmat_forward_tiles(device, "float32", 128, 0, 0, 0) is None


def test_operand_offsets(device):
    run_case(device, Case(batch=1, heads=2, kv_heads=1, q_len=9, kv_len=9), "float32", offset=5)


@pytest.mark.parametrize("tiles", [Tiles(4, 8, 4), Tiles(8, 4, 2)])
def test_small_tiles_skip_blocks_outside_the_window(device, tiles):
    # Many blocks per row: exercises the causal / window block ranges in all three kernels.
    run_case(device, Case(batch=1, heads=2, kv_heads=1, q_len=37, kv_len=45, window=7, mask=True, head_dim=16),
             tiles=tiles)


def test_large_head_dim_forward(device):
    run_case(device, Case(batch=1, heads=1, kv_heads=1, q_len=7, kv_len=7, head_dim=256), "float32")


def test_forward_of_more_keys_than_one_invocation_may_loop_over(device):
    """llvmpipe (lavapipe) ends an invocation's loops after 65535 iterations in all: a query row walking 20000 keys
    of head_dim 64 in one dispatch stopped short, leaving later keys out. The keys now go in several dispatches."""
    case = Case(batch=1, heads=1, kv_heads=1, q_len=4, kv_len=20000, causal=False)
    assert attention_kernels.forward_keys_per_dispatch(
        attention_kernels.pick_tiles(device, 64, attention_kernels.FORWARD_TILES,
                                     attention_kernels.forward_shared_bytes), 64) < case.kv_len
    run_case(device, case, backward=False)


@pytest.mark.parametrize("q_len,kv_len", [(4, 6000), (6000, 4)])
def test_backward_of_longer_rows_than_one_invocation_may_loop_over(device, q_len, kv_len):
    """As above for the backward at head_dim 128 (tiles of 8 rows on lavapipe): dQ walking 6000 keys, dK/dV walking
    6000 queries, stopped short in one dispatch."""
    run_case(device, Case(batch=1, heads=1, kv_heads=1, q_len=q_len, kv_len=kv_len, head_dim=128, causal=False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [
    Case(heads=4, kv_heads=2, mask=True, window=40, softcap=3.0, alibi=True, q_len=50, kv_len=90, head_dim=80),
    Case(mask=True, q_len=70, kv_len=70, heads=2, kv_heads=2),  # batch 0's first rows see no key in early tiles
    Case(causal=False, mask=True, q_len=9, kv_len=75, heads=2, kv_heads=1, batch=2)], ids=["everything", "causal",
                                                                                          "not_causal"])
def test_split_into_dispatches_of_one_tile(device, monkeypatch, case, dtype):
    """Each forward dispatch resumes from the previous one's out and lse (as its backward reads them); each backward
    dispatch after the first adds to the gradients, its tiles crossing from one query head of a group to the next."""
    monkeypatch.setattr(attention_kernels, "forward_keys_per_dispatch", lambda tiles, head_dim: tiles.cols)
    monkeypatch.setattr(attention_kernels, "backward_units_per_dispatch", lambda tiles, head_dim, heads: 1)
    run_case(device, case, dtype, tiles=Tiles(8, 8, 4))


def test_causal_with_long_query_needs_offset(device):
    buf = device.buffer(64, "float32")
    with pytest.raises(ValueError, match="q_offset"):
        attention_forward(device.sequence(), buf, buf, buf, buf, buf, batch=1, heads=1, kv_heads=1, q_len=4,
                          kv_len=2, head_dim=4, scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        attention_forward(device.sequence(), buf, buf, buf, buf, buf, batch=1, heads=3, kv_heads=2, q_len=1,
                          kv_len=1, head_dim=4, scale=1.0)


def decode_setup(device, case: Case, max_len: int, dtype="float32"):
    (q, _), (k, _), (v, _), _ = make_inputs(case, dtype)[0]
    cache = lambda x: np.concatenate(
        [x, np.random.default_rng(9).standard_normal(x.shape[:2] + (max_len - x.shape[2], x.shape[3]))], axis=2)
    k_cache, v_cache = cache(k), cache(v)  # garbage past kv_len must be ignored
    return q, k, v, [device.upload(x.astype(np.float32)) for x in (q[:, :, -1:], k_cache, v_cache)]


@pytest.mark.parametrize("general, keys", [(False, 64), (False, 128), (True, None)],
                         ids=["decode_kernel_64_keys", "decode_kernel_128_keys", "forward_kernel"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, splits", [(4, 2, 64, 1), (4, 1, 80, 3), (2, 2, 256, 5),
                                                                (12, 1, 32, 2)])
def test_decode_equals_last_row_of_forward(device, heads, kv_heads, head_dim, splits, general, keys):
    """general: the forward kernel with one query row (the fallback where K/V rows are not whole vectors)."""
    case = Case(heads=heads, kv_heads=kv_heads, head_dim=head_dim, q_len=33, kv_len=33, window=20, alibi=True)
    q, k, v, (q_last, k_cache, v_cache) = decode_setup(device, case, max_len=40)
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    out = device.buffer((case.batch, heads, 1, head_dim), "float32")
    lse = device.buffer((case.batch, heads), "float32")
    seq = device.sequence()
    attention_decode(seq, q_last, k_cache, v_cache, out, batch=case.batch, heads=heads, kv_heads=kv_heads,
                     kv_len=33, max_len=40, head_dim=head_dim, scale=case.the_scale, window=20,
                     alibi_slopes=device.upload(slopes.astype(np.float32)), lse=lse, splits=splits,
                     tiles=DECODE_TILES[-1] if general else None, keys_per_tile=keys)
    seq.replay()
    expected, expected_lse = reference(case, q, k, v, None, slopes)
    np.testing.assert_allclose(out.read(), expected[:, :, -1:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse.read(), expected_lse[:, :, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keys", [64, 128])
@pytest.mark.parametrize("splits, window", [(1, 0), (2, 0), (1, 150)])
def test_decode_over_several_tiles(device, keys, splits, window):
    """A cache of 300 keys: several tiles per workgroup (the online softmax across them), split or not, and a
    sliding window that starts inside a tile."""
    case = Case(heads=4, kv_heads=2, q_len=300, kv_len=300, window=window, softcap=5.0)
    q, k, v, (q_last, k_cache, v_cache) = decode_setup(device, case, max_len=320)
    out = device.buffer((case.batch, case.heads, 1, case.head_dim), "float32")
    lse = device.buffer((case.batch, case.heads), "float32")
    seq = device.sequence()
    attention_decode(seq, q_last, k_cache, v_cache, out, batch=case.batch, heads=case.heads, kv_heads=case.kv_heads,
                     kv_len=300, max_len=320, head_dim=case.head_dim, scale=case.the_scale, window=window,
                     softcap=case.softcap, lse=lse, splits=splits, keys_per_tile=keys)
    seq.replay()
    expected, expected_lse = reference(case, q, k, v, None, None)
    np.testing.assert_allclose(out.read(), expected[:, :, -1:], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse.read(), expected_lse[:, :, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keys", [64, 128])
@pytest.mark.parametrize("splits, heads, softcap", [(1, 4, 0.0), (4, 4, 0.0), (None, 4, 2.0), (1, 12, 2.0),
                                                    (3, 20, 0.0)])
def test_decode_replays_with_kv_len_from_a_buffer(device, splits, heads, softcap, keys):
    """20 heads on 2 KV heads: 10 per KV head, two workgroups of 5 each. splits None: the default."""
    case = Case(heads=heads, kv_heads=2, q_len=33, kv_len=33, mask=True, softcap=softcap)
    max_len = 48
    q, k, v, (_, k_cache, v_cache) = decode_setup(device, case, max_len)
    mask = np.ones((case.batch, max_len), np.uint8)
    mask[0, :3] = 0
    q_now = device.buffer((case.batch, case.heads, 1, case.head_dim), "float32", host_visible=True)
    kv_len = device.buffer(1, "uint32", host_visible=True, name="kv_len")
    out = device.buffer((case.batch, case.heads, 1, case.head_dim), "float32")
    seq = device.sequence().upload(kv_len).upload(q_now)
    attention_decode(seq, q_now, k_cache, v_cache, out, batch=case.batch, heads=case.heads, kv_heads=case.kv_heads,
                     kv_len=None, max_len=max_len, head_dim=case.head_dim, scale=case.the_scale,
                     kv_len_buffer=kv_len, key_padding_mask=device.upload(mask), splits=splits, keys_per_tile=keys,
                     softcap=case.softcap)
    for length in (1, 2, 17, 33):  # one recording, replayed as the cache grows
        kv_len.host[:] = length
        q_now.host[:] = q[:, :, length - 1: length].astype(np.float32)
        seq.replay()
        step = replace(case, q_len=length, kv_len=length)
        want = reference(step, q[:, :, :length], k[:, :, :length], v[:, :, :length], mask[:, :length], None)[0]
        np.testing.assert_allclose(out.read(), want[:, :, -1:], atol=1e-5, rtol=1e-5, err_msg=f"kv_len {length}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("softcap, window, alibi, mask", [(s, w, a, m) for s in (0.0, 3.0) for w in (0, 50)
                                                          for a in (False, True) for m in (False, True)])
def test_decode_kernel_every_feature_combination(device, dtype, softcap, window, alibi, mask):
    """Soft-capping, a sliding window, ALiBi and a padding mask are options of the decode kernel (specialization and
    push constants), alone and together: a cache of 200 keys in tiles of 64, split in two, 8 heads on 2 KV heads
    (two per workgroup)."""
    case = Case(heads=8, kv_heads=2, q_len=200, kv_len=200, window=window, softcap=softcap, alibi=alibi, mask=mask)
    rounded_inputs, mask_host, slopes = make_inputs(case, dtype)
    (q, q_host), (k, k_host), (v, v_host), _ = rounded_inputs
    out = device.buffer((case.batch, case.heads, 1, case.head_dim), dtype)
    lse = device.buffer((case.batch, case.heads), "float32")
    seq = device.sequence()
    attention_decode(seq, device.upload(np.ascontiguousarray(q_host[:, :, -1:]), dtype=dtype),
                     device.upload(k_host, dtype=dtype), device.upload(v_host, dtype=dtype), out, batch=case.batch,
                     heads=case.heads, kv_heads=case.kv_heads, kv_len=200, max_len=200, head_dim=case.head_dim,
                     scale=case.the_scale, window=window, softcap=softcap, lse=lse, splits=2, keys_per_tile=64,
                     heads_per_workgroup=2, key_padding_mask=None if mask_host is None else device.upload(mask_host),
                     alibi_slopes=None if slopes is None else device.upload(slopes.astype(np.float32)))
    seq.replay()
    expected, expected_lse = reference(case, q, k, v, mask_host, slopes)
    tol = FORWARD_TOL[dtype]
    np.testing.assert_allclose(as_float(out.read(), dtype), expected[:, :, -1:], atol=tol, rtol=tol)
    np.testing.assert_allclose(lse.read(), expected_lse[:, :, -1], atol=tol, rtol=tol)
