"""Fused attention: forward, backward and KV-cache decode (flash-attention style).

Layout: q, out, d_q, d_out are [batch, heads, q_len, head_dim]; k, v, d_k, d_v are
[batch, kv_heads, kv_len, head_dim] (a decode cache: [batch, kv_heads, max_len, head_dim]);
all row-major, all of one storage dtype (float32, float16 or bfloat16); math in float32.
Query head h reads kv head ``h // (heads // kv_heads)`` (GQA / MQA).

Semantics, as transformers' eager attention:

- ``score = scale * q.k``; with ``softcap > 0``: ``softcap * tanh(score / softcap)`` (Gemma 2);
  with ALiBi slopes (float32 [heads]): ``+ slope[h] * (key_pos - query_pos)``. That is
  BLOOM's ``slope * key_pos`` shifted by a per-row constant, so outputs equal HF's
  (for contiguous padding); only the stored log-sum-exp differs by ``slope * query_pos``.
- Query i has absolute position ``p = q_offset + i``; ``q_offset`` defaults to
  ``kv_len - q_len`` (prefill of new tokens after a cache). Causal: sees keys ``<= p``.
  Sliding window ``w > 0``: also ``p - key_pos < w``, i.e. the last ``w`` positions
  including itself (transformers' Mistral / Gemma 2 ``kv_idx > q_idx - sliding_window``).
  The window applies with or without ``causal``.
- ``key_padding_mask`` (uint8 or bool [batch, kv_len], decode: [batch, max_len]):
  1 attends, 0 is masked, as HF's 2-D ``attention_mask``.
- A query that sees no key at all gets output 0 and log-sum-exp -inf (HF's eager
  attention would average all values there); its gradients are 0.
- ``lse`` (float32 [batch, heads, q_len]) is the natural log of the softmax denominator
  (with the maximum folded in); the backward pass needs it.

Nothing of size q_len x kv_len is ever stored: scores are recomputed in the backward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from vkformers.engine.kernels import LOOP_ITERATIONS, Operand, grid, operand, require_elements
from vkformers.engine.kernels.coopmat_layout import coopmat_layout
from vkformers.engine.kernels.matmul import coopmat_supported

FLOAT_VARIANTS = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
MASK_DTYPES = ("uint8", "bool")
DEFAULT_Q_OFFSET = -1  # the kernels compute kv_len - q_len (on the GPU, so decode replays follow kv_len)


@dataclass(frozen=True)
class Tiles:
    """A workgroup owns ``rows`` rows with ``lanes`` threads each and streams ``cols`` rows per tile."""

    rows: int
    cols: int
    lanes: int

    @property
    def threads(self) -> int:
        return self.rows * self.lanes


def forward_shared_bytes(t: Tiles, head_dim: int) -> int:
    return 4 * ((t.rows + t.cols) * (head_dim + 1) + t.rows * t.cols + 2 * t.rows * t.lanes)


def backward_shared_bytes(t: Tiles, head_dim: int) -> int:
    return 4 * (2 * (t.rows + t.cols) * (head_dim + 1) + 2 * t.rows * t.cols + 2 * t.cols)


# Preferred first. Lanes must divide head_dim and cols; the first that fits the device's shared memory wins.
FORWARD_TILES = [Tiles(32, 32, 8), Tiles(16, 32, 8), Tiles(16, 16, 8), Tiles(16, 8, 8), Tiles(8, 8, 8),
                 Tiles(16, 16, 4), Tiles(8, 8, 4), Tiles(8, 8, 2), Tiles(8, 8, 1), Tiles(4, 4, 1)]
BACKWARD_TILES = [Tiles(16, 16, 8), Tiles(16, 8, 8), Tiles(8, 8, 8), Tiles(4, 8, 8),
                  Tiles(16, 16, 4), Tiles(8, 8, 4), Tiles(8, 8, 2), Tiles(8, 8, 1), Tiles(4, 4, 1), Tiles(2, 2, 1)]
# The fallback decode (attention_fwd.comp, q_len 1) has one query row per workgroup: all threads share it.
DECODE_TILES = [Tiles(1, 64, 64), Tiles(1, 64, 32), Tiles(1, 32, 32), Tiles(1, 64, 16), Tiles(1, 16, 16),
                Tiles(1, 32, 8), Tiles(1, 8, 8), Tiles(1, 8, 4), Tiles(1, 8, 2), Tiles(1, 8, 1), Tiles(1, 2, 1)]

# attention_decode.comp: keys per tile (= threads per workgroup) and query heads per workgroup at most.
DECODE_KEYS = {"gpu": 128, "cpu": 64}
DECODE_MAX_HEADS = 8
# Workgroups a decode step's attention aims for when it splits the cache (flash-decoding): enough to
# fill a GPU's compute units with one new token; a CPU runs few threads and gains nothing from more.
DECODE_TARGET_WORKGROUPS = {"gpu": 256, "cpu": 4}


@dataclass(frozen=True)
class DecodeTiles:
    """attention_decode.comp: ``rows`` query heads of one KV head per workgroup, tiles of ``cols`` keys."""

    rows: int
    cols: int
    lanes: int = 1

    @property
    def threads(self) -> int:
        return self.cols


def pick_tiles(device, head_dim: int, candidates: list[Tiles], shared_bytes) -> Tiles:
    limit = int(device.limits["max_compute_shared_memory_size"])
    max_threads = int(device.limits.get("max_compute_work_group_invocations", 1024))
    for t in candidates:
        if head_dim % t.lanes == 0 and t.cols % t.lanes == 0 and t.threads <= max_threads \
                and shared_bytes(t, head_dim) <= limit:
            return t
    raise ValueError(f"attention: no tile size fits head_dim {head_dim} in {limit} bytes of shared memory")


# Parts of the one-pass kernel's work per key tile that a CoopmatTiles(ablation=...) leaves out (attention_fwd_coopmat's
# ABLATE_* constants). Only bench/attention.py --forward-sweep uses them, to see where the time goes: the results
# are wrong.
ABLATIONS = {"no softmax": 1, "no max/rescale": 2, "products only": 3, "no K/V staging": 4,
             "no K/V loads, barriers kept": 5, "products only, no K/V staging": 6}


@dataclass(frozen=True)
class CoopmatTiles:
    """attention_fwd_coopmat: ``rows`` query rows per workgroup (16 per subgroup), key tiles of ``cols``.
    ``one_pass``: one pass over the keys with an online softmax (FlashAttention-2's order); else the first
    kernel's two passes (row maxima and sums, then the final probabilities times V). ``prefetch``: the next K/V
    tile is loaded into registers while the current one is used. ``batched_staging`` (not with prefetch): the
    current tile's loads all issued before any is stored to shared memory. ``lazy_rescale`` (one pass): the accumulators are
    rescaled only when a row maximum of the subgroup moved. ``reg_softmax`` (one pass): scores, softmax and rescale
    in registers, on the device's measured accumulator layout (:mod:`coopmat_layout`; only where it has the form the
    kernel uses). ``p_in_regs`` (with reg_softmax, where the A operand's layout is the accumulator's): the
    probabilities become A operands without shared memory. ``double_buffer`` (one pass, not with prefetch or
    batched_staging): two K/V tile buffers, the next tile stored into the other one while this one is used, one
    workgroup barrier per tile. ``ablation`` (a value of ABLATIONS; benchmarks only, wrong results): a part of the
    one-pass kernel's work left out."""

    rows: int
    cols: int
    one_pass: bool = True
    prefetch: bool = False
    lazy_rescale: bool = False
    ablation: int = 0
    batched_staging: bool = False
    reg_softmax: bool = False
    p_in_regs: bool = False
    double_buffer: bool = False

    def fits(self, subgroup: int) -> bool:
        """Whole subgroups of 16 rows; the shared-memory softmax: each row's lanes take whole uvec4s of
        probabilities (subgroups of 16 lanes or more); the options only in the combinations the kernel has."""
        if self.rows % 16 or self.cols % 16 or subgroup < 8 or subgroup & (subgroup - 1):
            return False
        if not self.reg_softmax and (subgroup % 16 or (self.cols // (subgroup // 16)) % 8):
            return False
        return (self.one_pass or not (self.lazy_rescale or self.ablation or self.reg_softmax or self.double_buffer)) \
            and not (self.prefetch and self.batched_staging) \
            and not (self.double_buffer and (self.prefetch or self.batched_staging)) \
            and not (self.reg_softmax and self.ablation) and (self.reg_softmax or not self.p_in_regs) \
            and self.ablation in (0, *ABLATIONS.values())

    def threads(self, subgroup: int) -> int:
        return self.rows // 16 * subgroup

    @property
    def tuning(self) -> int:
        """attention_fwd_coopmat's TUNING bits."""
        return int(self.prefetch) | 2 * int(self.lazy_rescale) | 4 * int(self.batched_staging) \
            | 8 * int(self.reg_softmax) | 16 * int(self.p_in_regs) | 32 * int(self.double_buffer)

    def shared_bytes(self, head_dim: int, subgroup: int) -> int:
        pitch = 16 * (head_dim // 8 + 1)  # bytes per staged row
        scores = (self.rows // 16) * (16 * (self.cols * 4 + 16) + 16 * 16 * (self.cols // 8 + 1))  # padded rows
        if self.reg_softmax and self.p_in_regs:
            scores = 0
        tiles = (2 if self.double_buffer else 1) * 2 * self.cols * pitch
        # q is staged once where the K and V tiles and the scores go later (reg_softmax: with a 16 x 16 float matrix
        # after it); the output blocks go through the same space; one float per row of rescale factors.
        stage = self.rows * pitch + (16 * 16 * 4 if self.reg_softmax else 0)
        out = (self.rows // 16) * 16 * 5 * 16
        return max(stage, tiles + scores, out) + 4 * self.rows

    def runs_on(self, device, dtype: str) -> bool:
        """Whether the device's accumulator layout allows the options (reg_softmax, p_in_regs)."""
        if not self.reg_softmax:
            return True
        layout = coopmat_layout(device, dtype)
        return layout is not None and (layout.a_matches_accumulator or not self.p_in_regs)


# Preferred first; the first that fits the device's shared memory wins. One pass (it rounds once, the two-pass kernel
# twice: bf16 max error 7.8e-3 against 1.2e-2 on the H200), 64 x 32 up to head dim 64 and 128 x 32 above: on the
# H200, 64 x 32 is 10-17% faster than 128 x 32 at head dim 64, and 3-13% slower at 128 (bench/attention.py
# --forward-sweep, seq 2048 and 8192; with 48 KiB, 128 x 32 fits head dims up to 128, 64 x 32 up to 256).
COOPMAT_SMALL_HEAD_TILES = [CoopmatTiles(64, 32), CoopmatTiles(128, 32), CoopmatTiles(32, 32), CoopmatTiles(64, 16),
                            CoopmatTiles(32, 16), CoopmatTiles(16, 16)]
COOPMAT_LARGE_HEAD_TILES = [CoopmatTiles(128, 32), CoopmatTiles(64, 32), CoopmatTiles(32, 32), CoopmatTiles(64, 16),
                            CoopmatTiles(32, 16), CoopmatTiles(16, 16)]
COOPMAT_SMALL_HEAD_MAX = 64
# Preferred first where the device's measured accumulator layout lets the probabilities go straight into A operands
# (:mod:`coopmat_layout`): the register softmax with double-buffered K/V tiles, 128 x 32, else (head dim 256) 64 x 16,
# then single-buffered (the fastest variants of run A10 in docs/benchmarks.md).
COOPMAT_REGISTER_TILES = [CoopmatTiles(128, 32, reg_softmax=True, p_in_regs=True, double_buffer=True),
                          CoopmatTiles(64, 16, reg_softmax=True, p_in_regs=True, double_buffer=True),
                          CoopmatTiles(128, 32, reg_softmax=True, p_in_regs=True),
                          CoopmatTiles(64, 32, reg_softmax=True, p_in_regs=True)]
# Elsewhere the shared-memory softmax, with these options on the shapes above where they fit, then without them
# (each tile's loads issued before any is stored).
COOPMAT_FORWARD_OPTIONS: dict = dict(batched_staging=True)
# Every one-pass shape (tests run each); 64 x 64 (fits 48 KiB up to head dim 64) only for the forward sweep, with
# PREFETCH: half the workgroup barriers per key of 64 x 32.
COOPMAT_WIDE_KEY_TILES = CoopmatTiles(64, 64)
COOPMAT_FORWARD_TILES = COOPMAT_LARGE_HEAD_TILES + [COOPMAT_WIDE_KEY_TILES]
# The two-pass kernel, kept selectable (tiles=CoopmatTiles(..., one_pass=False)).
COOPMAT_TWO_PASS_TILES = [CoopmatTiles(64, 32, False), CoopmatTiles(32, 32, False), CoopmatTiles(64, 16, False),
                          CoopmatTiles(32, 16, False), CoopmatTiles(16, 16, False)]


def coopmat_forward_candidates(head_dim: int) -> list[CoopmatTiles]:
    """The one-pass tile shapes for ``head_dim``, preferred first."""
    return COOPMAT_SMALL_HEAD_TILES if head_dim <= COOPMAT_SMALL_HEAD_MAX else COOPMAT_LARGE_HEAD_TILES


def _coopmat_forward_possible(device, dtype: str, head_dim: int, offsets) -> bool:
    subgroup = int(device.limits["subgroup_size"])
    return dtype in ("float16", "bfloat16") and coopmat_supported(device, dtype) and subgroup in (8, 16, 32, 64) \
        and not head_dim % 16 and head_dim <= 256 and not any(o % 8 for o in offsets)


def coopmat_forward_tiles(device, dtype: str, head_dim: int, *offsets: int,
                          candidates: list[CoopmatTiles] | None = None) -> CoopmatTiles | None:
    """Tiles for the cooperative-matrix forward kernel, or None where it cannot run: a float16/bfloat16
    cooperative matrix on the device, head_dim a multiple of 16 (at most 256), q/k/v offsets on
    8-element boundaries, and tiles that fit the device's shared memory."""
    if not _coopmat_forward_possible(device, dtype, head_dim, offsets):
        return None
    subgroup = int(device.limits["subgroup_size"])
    limit = int(device.limits["max_compute_shared_memory_size"])
    if candidates is None:
        shapes = coopmat_forward_candidates(head_dim)
        candidates = COOPMAT_REGISTER_TILES + [replace(t, **COOPMAT_FORWARD_OPTIONS) for t in shapes] + shapes
    return next((t for t in candidates if t.fits(subgroup) and t.shared_bytes(head_dim, subgroup) <= limit
                 and t.runs_on(device, dtype)), None)


@dataclass(frozen=True)
class CoopmatBackwardTiles(CoopmatTiles):
    """attention_bwd_coopmat: ``rows`` owned rows per workgroup (16 per subgroup), streamed tiles of ``cols``.
    ``reg_softmax``: P and dS computed on the accumulators' elements (where the device's measured layout allows it);
    ``p_in_regs`` (with it): P and dS become A operands without shared memory. ``double_buffer``: two buffers of
    streamed tiles, the next ones loaded into registers while the current ones are used. No other option applies."""

    def shared_bytes(self, head_dim: int, subgroup: int) -> int:
        pitch = 16 * (head_dim // 8 + 1)  # bytes per staged row
        per_subgroup = 2 * 16 * self.cols * 4 + 2 * 16 * 16 * (self.cols // 8 + 1)  # q.k, dO.v; P, dS
        if self.reg_softmax and self.p_in_regs:
            per_subgroup = 16 * 16 * 4  # the output blocks only
        buffers = 2 if self.double_buffer else 1
        return buffers * (2 * self.cols * pitch + 2 * 4 * self.cols) + (self.rows // 16) * per_subgroup

    def fits(self, subgroup: int) -> bool:
        # The owned rows are staged where the two streamed tiles go; each lane takes whole uvec4s of P and dS (the
        # register softmax: any subgroup of 8 lanes or more).
        if self.rows % 16 or self.cols % 16 or self.rows > 2 * self.cols or subgroup < 8 or subgroup & (subgroup - 1):
            return False
        if self.prefetch or self.lazy_rescale or self.batched_staging or self.ablation \
                or not self.one_pass or (self.p_in_regs and not self.reg_softmax):
            return False
        return self.reg_softmax or (subgroup % 16 == 0 and (self.cols // (subgroup // 16)) % 8 == 0)


COOPMAT_BACKWARD_TILES = [CoopmatBackwardTiles(64, 32), CoopmatBackwardTiles(32, 32), CoopmatBackwardTiles(32, 16),
                          CoopmatBackwardTiles(16, 16)]
# Options the automatic choice puts on the tiles above where the device can run them, preferred first, each list then
# followed by the plain tiles: P and dS in registers and straight into A operands, else in registers but through
# shared memory (run A11; bench/attention.py --backward-sweep times them).
COOPMAT_BACKWARD_OPTIONS: list[dict] = [dict(reg_softmax=True, p_in_regs=True), dict(reg_softmax=True)]
# Each subgroup keeps its owned rows (2 x head_dim / 16 fragments) and both gradients' accumulators in registers.
COOPMAT_BACKWARD_MAX_HEAD_DIM = 128
# Up to this head_dim the first option's tiles come double-buffered first: past it the registers holding the next
# tiles cost more than the overlap gains (docs/benchmarks.md, run A12).
COOPMAT_BACKWARD_DOUBLE_BUFFER_MAX_HEAD_DIM = 64


def coopmat_backward_tiles(device, dtype: str, head_dim: int, *offsets: int,
                           candidates: list[CoopmatBackwardTiles] | None = None) -> CoopmatBackwardTiles | None:
    """Tiles for the cooperative-matrix backward kernel, or None where it cannot run: as
    :func:`coopmat_forward_tiles`, with head_dim at most COOPMAT_BACKWARD_MAX_HEAD_DIM."""
    if head_dim > COOPMAT_BACKWARD_MAX_HEAD_DIM or not _coopmat_forward_possible(device, dtype, head_dim, offsets):
        return None
    subgroup = int(device.limits["subgroup_size"])
    limit = int(device.limits["max_compute_shared_memory_size"])
    if candidates is None:
        candidates = [replace(t, **options) for options in COOPMAT_BACKWARD_OPTIONS for t in COOPMAT_BACKWARD_TILES] \
            + COOPMAT_BACKWARD_TILES
        if head_dim <= COOPMAT_BACKWARD_DOUBLE_BUFFER_MAX_HEAD_DIM:
            candidates = [replace(t, double_buffer=True) for t in candidates[:len(COOPMAT_BACKWARD_TILES)]] \
                + candidates
    return next((t for t in candidates if t.fits(subgroup) and t.shared_bytes(head_dim, subgroup) <= limit
                 and t.runs_on(device, dtype)), None)


def _check_given_coopmat_tiles(device, tiles: CoopmatTiles, dtype: str, head_dim: int, offsets, algorithm: str,
                               backward: bool) -> None:
    """Cooperative-matrix tiles a caller chose (tests, benchmarks) pass the checks of the automatic choice: the
    kernels stage whole tiles and 16-row fragments, and would read or write out of bounds otherwise."""
    kind = "backward" if backward else "forward"
    if algorithm == "scalar":
        raise ValueError(f"attention: cooperative-matrix tiles {tiles} given with algorithm='scalar'")
    if backward and not isinstance(tiles, CoopmatBackwardTiles):
        raise TypeError(f"attention: the cooperative-matrix backward takes CoopmatBackwardTiles, not {tiles}")
    possible = _coopmat_forward_possible(device, dtype, head_dim, offsets) \
        and (not backward or head_dim <= COOPMAT_BACKWARD_MAX_HEAD_DIM)
    if not possible:
        raise ValueError(f"attention: the cooperative-matrix {kind} cannot run {dtype} head_dim {head_dim} with "
                         f"offsets {tuple(offsets)} on {device.name}")
    subgroup = int(device.limits["subgroup_size"])
    limit = int(device.limits["max_compute_shared_memory_size"])
    if tiles.rows % 16 or tiles.cols % 16 or tiles.shared_bytes(head_dim, subgroup) > limit \
            or not tiles.fits(subgroup) or not tiles.runs_on(device, dtype):
        raise ValueError(f"attention: {tiles} cannot run the cooperative-matrix {kind} for head_dim {head_dim} "
                         f"with subgroups of {subgroup} in {limit} bytes of shared memory")


_placeholders: dict[int, object] = {}


def _placeholder(device):
    """A tiny buffer bound where an optional input (mask, slopes, kv_len) is absent."""
    if id(device) not in _placeholders:
        _placeholders[id(device)] = device.buffer(4, "uint32", name="attention placeholder")
    return _placeholders[id(device)]


@dataclass
class _Flags:
    """The options forward, backward and decode share, checked once."""

    mask: Operand | None
    slopes: Operand | None
    window: int
    softcap: float
    causal: bool
    q_offset: int

    def spec(self) -> list[int]:
        return [int(self.causal), int(self.mask is not None), int(self.slopes is not None), int(self.softcap > 0)]

    def bindings(self, device):
        return [(self.mask or Operand(_placeholder(device))).buffer,
                (self.slopes or Operand(_placeholder(device))).buffer]


def _check_flags(*, batch, heads, kv_heads, q_len, kv_len, mask_len, head_dim, causal, key_padding_mask,
                 window, softcap, alibi_slopes, q_offset) -> _Flags:
    for name, value in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("q_len", q_len),
                        ("head_dim", head_dim)):
        if int(value) < 1:
            raise ValueError(f"attention: {name} must be >= 1, got {value}")
    if heads % kv_heads:
        raise ValueError(f"attention: heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if window < 0 or softcap < 0:
        raise ValueError("attention: window and softcap must be >= 0 (0 disables them)")
    if q_offset is None:
        q_offset = DEFAULT_Q_OFFSET
        if kv_len is not None and q_len > kv_len and causal:
            raise ValueError(f"attention: causal with q_len {q_len} > kv_len {kv_len} needs an explicit q_offset")
    elif q_offset < 0:
        raise ValueError(f"attention: q_offset must be >= 0, got {q_offset}")
    mask = operand(key_padding_mask) if key_padding_mask is not None else None
    if mask is not None:
        if mask.dtype.name not in MASK_DTYPES:
            raise TypeError(f"attention: key_padding_mask must be uint8 or bool, not {mask.dtype.name}")
        require_elements(mask, batch * mask_len, "attention key_padding_mask")
    slopes = operand(alibi_slopes) if alibi_slopes is not None else None
    if slopes is not None:
        if slopes.dtype.name != "float32":
            raise TypeError(f"attention: alibi_slopes must be float32, not {slopes.dtype.name}")
        require_elements(slopes, heads, "attention alibi_slopes")
    return _Flags(mask, slopes, int(window), float(softcap), bool(causal), int(q_offset))


def _variant(*operands: Operand) -> str:
    names = {x.dtype.name for x in operands}
    if len(names) != 1 or next(iter(names)) not in FLOAT_VARIANTS:
        raise TypeError(f"attention: q, k, v, out (and gradients) must share one dtype of "
                        f"{', '.join(FLOAT_VARIANTS)}; got {sorted(names)}")
    return FLOAT_VARIANTS[names.pop()]


def _check_float32(x: Operand, count: int, what: str) -> None:
    if x.dtype.name != "float32":
        raise TypeError(f"attention: {what} must be float32, not {x.dtype.name}")
    require_elements(x, count, f"attention {what}")


def _record_forward(seq, q, k, v, out, lse, flags: _Flags, tiles: Tiles | CoopmatTiles | DecodeTiles, *, batch, heads, kv_heads,
                    q_len, kv_len, kv_stride, head_dim, scale, kv_len_buffer: Operand | None, splits: int = 1,
                    page_size: int = 0, mask_stride: int | None = None):
    device = seq.device
    variant = _variant(q, k, v, out)
    final_lse = lse
    if splits > 1:  # flash-decoding: slices write partials to a workspace, then one merge
        lse = Operand(seq.scratch(batch * heads * splits * (head_dim + 2), "float32", name="attention partials"))
    kv_len_source = kv_len_buffer or Operand(_placeholder(device))
    buffers = [q.buffer, k.buffer, v.buffer, *flags.bindings(device), kv_len_source.buffer, out.buffer, lse.buffer]
    push = [q.offset, k.offset, v.offset, out.offset, lse.offset,
            flags.mask.offset if flags.mask else 0, flags.slopes.offset if flags.slopes else 0, kv_len_source.offset,
            heads, kv_heads, q_len, kv_len or 0, kv_stride, kv_stride if mask_stride is None else mask_stride,
            flags.q_offset, flags.window,
            float(scale), float(flags.softcap)]
    if isinstance(tiles, CoopmatTiles):  # prefill only: kv_len pushed, one split (attention_forward checks)
        subgroup = int(device.limits["subgroup_size"])
        spec = [head_dim, tiles.rows, tiles.cols, 1, *flags.spec(), subgroup, tiles.threads(subgroup),
                int(tiles.one_pass), tiles.tuning, tiles.ablation]
        if tiles.reg_softmax:
            spec += coopmat_layout(device, q.dtype.name).spec()
        seq.dispatch(device.kernel("attention_fwd_coopmat", variant), buffers, (-(-q_len // tiles.rows), heads, batch),
                     push=push, spec=spec)
        return
    spec = [head_dim, tiles.rows, tiles.cols, tiles.lanes, *flags.spec(), int(kv_len_buffer is not None),
            tiles.threads, splits]
    if isinstance(tiles, DecodeTiles):  # attention_decode.comp: x the slice, y the group of query heads
        seq.dispatch(device.kernel("attention_decode", variant), buffers, (splits, heads // tiles.rows, batch),
                     push=push, spec=spec + [int(page_size)])
    elif splits > 1 or (kv_len_buffer is not None and q_len == 1):
        seq.dispatch(device.kernel("attention_fwd", variant), buffers,
                     (splits if splits > 1 else -(-q_len // tiles.rows), heads, batch), push=push + [0, kv_stride, 0],
                     spec=spec)
    else:
        # a length read on the GPU may reach the capacity: the dispatches cover it (those past the length see no
        # key), split for llvmpipe's loop limit on a CPU device only
        keys = kv_len if kv_len_buffer is None else kv_stride
        step = forward_keys_per_dispatch(tiles, head_dim) if kv_len_buffer is None or device.is_cpu else keys
        for key_lo in range(0, keys, step):
            seq.dispatch(device.kernel("attention_fwd", variant), buffers, (-(-q_len // tiles.rows), heads, batch),
                         push=push + [key_lo, key_lo + step, int(key_lo > 0)], spec=spec)
    if splits > 1:
        seq.dispatch(device.kernel("attention_decode_combine", variant), [lse.buffer, out.buffer, final_lse.buffer],
                     (1, heads, batch), push=[heads, splits, head_dim, out.offset, final_lse.offset])


def forward_keys_per_dispatch(tiles: Tiles, head_dim: int) -> int:
    """Keys (whole tiles) one dispatch of attention_fwd.comp takes so that an invocation's loops stay within
    LOOP_ITERATIONS (llvmpipe ends them, without a word, after 65535): an upper bound of a tile's iterations, every
    loop counted as if none were unrolled (a loop of n trips costs n + 1)."""
    cols, dims, lanes = tiles.cols // tiles.lanes, head_dim // tiles.lanes, tiles.lanes
    load = -(-tiles.cols * head_dim // tiles.threads) + 1
    per_tile = 1 + 2 * load + 3 * (cols + 1) + head_dim * (cols + 2) + 1 + 2 * (lanes + 1) + (dims + 1) \
        + tiles.cols * (dims + 2) + 1
    fixed = -(-tiles.rows * head_dim // tiles.threads) + 1 + 3 * (dims + 1)  # q tile, acc, resume, output
    return max(1, (LOOP_ITERATIONS - fixed) // per_tile) * tiles.cols


def backward_units_per_dispatch(tiles: Tiles, head_dim: int, head_count: int) -> int:
    """Streamed tiles (units) one dispatch of attention_bwd.comp takes within LOOP_ITERATIONS, counted as
    :func:`forward_keys_per_dispatch` counts; ``head_count``: the query heads a workgroup walks (each costs its
    loop's tests)."""
    cols, dims = tiles.cols // tiles.lanes, head_dim // tiles.lanes
    load = -(-tiles.cols * head_dim // tiles.threads) + 1
    per_unit = 1 + 2 * load + (-(-tiles.cols // tiles.threads) + 1) + 2 * (cols + 1) + head_dim * (cols + 2) + 1 \
        + tiles.cols * (2 * dims + 3) + 1
    fixed = 2 * (-(-tiles.rows * head_dim // tiles.threads) + 1) + 2 * (dims + 1) + 2 * head_count + 1
    return max(1, (LOOP_ITERATIONS - fixed) // per_unit)


def attention_forward(seq, q, k, v, out, lse, *, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                      head_dim: int, scale: float, causal: bool = True, key_padding_mask: Operand | None = None,
                      window: int = 0, softcap: float = 0.0, alibi_slopes: Operand | None = None,
                      q_offset: int | None = None, tiles: Tiles | CoopmatTiles | None = None,
                      algorithm: str = "auto") -> None:
    """Record ``out = softmax(scores) @ v`` and ``lse`` (float32 [batch, heads, q_len]) into ``seq``.

    ``algorithm``: "auto" (the cooperative-matrix kernel where :func:`coopmat_forward_tiles` allows,
    else the scalar one), "scalar" or "coopmat". The cooperative-matrix kernel rounds the softmax
    probabilities to the storage type before multiplying by v, as flash attention does. ``tiles``: a
    :class:`CoopmatTiles` picks its variant (one pass or two, prefetch, lazy rescale) and tile shape."""
    q, k, v, out, lse = map(operand, (q, k, v, out, lse))
    flags = _check_flags(batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, mask_len=kv_len,
                         head_dim=head_dim, causal=causal, key_padding_mask=key_padding_mask, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, q_offset=q_offset)
    if kv_len < 1:
        raise ValueError(f"attention: kv_len must be >= 1, got {kv_len}")
    for x, rows, what in ((q, heads * q_len, "q"), (out, heads * q_len, "out"),
                          (k, kv_heads * kv_len, "k"), (v, kv_heads * kv_len, "v")):
        require_elements(x, batch * rows * head_dim, f"attention {what}")
    _check_float32(lse, batch * heads * q_len, "lse")
    if algorithm not in ("auto", "scalar", "coopmat"):
        raise ValueError(f"attention: algorithm must be 'auto', 'scalar' or 'coopmat', not {algorithm!r}")
    if isinstance(tiles, CoopmatTiles):
        _check_given_coopmat_tiles(seq.device, tiles, q.dtype.name, head_dim, (q.offset, k.offset, v.offset),
                                   algorithm, backward=False)
    if tiles is None and algorithm != "scalar":
        tiles = coopmat_forward_tiles(seq.device, q.dtype.name, head_dim, q.offset, k.offset, v.offset)
        if tiles is None and algorithm == "coopmat":
            raise ValueError(f"attention: the cooperative-matrix kernel cannot run {q.dtype.name} head_dim {head_dim} "
                             f"on {seq.device.name}")
    tiles = tiles or pick_tiles(seq.device, head_dim, FORWARD_TILES, forward_shared_bytes)
    _record_forward(seq, q, k, v, out, lse, flags, tiles, batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len,
                    kv_len=kv_len, kv_stride=kv_len, head_dim=head_dim, scale=scale, kv_len_buffer=None)


def attention_decode(seq, q, k_cache, v_cache, out, *, batch: int, heads: int, kv_heads: int, kv_len: int | None,
                     max_len: int, head_dim: int, scale: float, kv_len_buffer: Operand | None = None,
                     key_padding_mask: Operand | None = None, window: int = 0, softcap: float = 0.0,
                     alibi_slopes: Operand | None = None, lse: Operand | None = None,
                     splits: int | None = None, tiles: Tiles | None = None,
                     heads_per_workgroup: int | None = None, keys_per_tile: int | None = None,
                     page_size: int = 0, q_len: int = 1) -> None:
    """One new query per sequence (q, out: [batch, heads, 1, head_dim]) against the first
    ``kv_len`` entries of a cache of capacity ``max_len`` ([batch, kv_heads, max_len, head_dim]).

    ``q_len`` > 1 (q, out: [batch, heads, q_len, head_dim]; ``lse`` [batch, heads, q_len]): the last q_len
    tokens' queries, at positions kv_len - q_len .. kv_len - 1, each causal (a draft verified after the cache).
    The general forward kernel runs them, in one workgroup per block of queries, kv_len read from
    ``kv_len_buffer`` (required) as for one query, so that the step replays at every position. Not paged.

    Paged (``page_size`` > 0): k_cache and v_cache are pools of blocks [blocks, kv_heads, page_size, head_dim], and
    each sequence's block table (max_len / page_size uint32 entries: logical block -> pool block) follows kv_len
    in ``kv_len_buffer`` (required); the mask and positions stay logical. Only the vectorised kernel runs paged.

    With ``kv_len_buffer`` (a uint32 element, e.g. of a host-visible buffer uploaded in the
    sequence), the kernel reads kv_len there at every replay, so one recorded decode step
    serves every position; ``kv_len`` is then ignored. The query sits at position
    kv_len - 1 (its own key must already be in the cache). ``key_padding_mask`` is
    [batch, max_len]. ``lse`` (float32 [batch, heads]) is optional.

    attention_decode.comp runs it: a workgroup takes one or more query heads of one KV head and reads each
    cached key and value once for all of them. ``splits`` > 1 divides the cache among
    that many workgroups per head group (flash-decoding) and merges their partial softmaxes in a second
    dispatch; default: enough for DECODE_TARGET_WORKGROUPS, at most one per 4 tiles of capacity (a short cache
    is not worth the merge's dispatch) and 64. ``keys_per_tile`` (the workgroup's threads, one key each when
    scoring; default DECODE_KEYS): on a GPU a tile costs round trips to memory more than arithmetic, so fewer, larger
    tiles: 128 (H200, the sweep below: cache 80 in 7.7 us against 8.7 with 64 keys, cache 4096 in 25.3 against
    26.9; the heads-per-workgroup figures below are 64-key tiles); lavapipe: 64 (kv_len 80 in 313 against 628 us). ``heads_per_workgroup``: how many query heads
    of a KV head one workgroup takes (at most DECODE_MAX_HEADS, dividing the group). Default: 1, or 2 on a GPU for
    caches of 1024 entries or more: sharing K/V among more heads lengthens each workgroup's serial work more
    than it saves reads (H200, bf16, 32 heads on 4 KV heads, ``bench/attention.py --decode-only --decode-sweep
    --kv-heads 4``: cache 80 in 11.0 / 13.6 / 17.4 / 26.6 us with 1 / 2 / 4 / 8 heads per workgroup, cache 4096 in
    48.3 / 34.3 / 39.0 / 55.7 us; lavapipe: 1 fastest at both). Where K/V rows are not whole 16-byte vectors
    (head_dim, offsets), or with ``tiles``, the general forward kernel runs instead, one query head per workgroup.
    """
    q, k_cache, v_cache, out = map(operand, (q, k_cache, v_cache, out))
    if q_len > 1:
        _record_queries_after_cache(seq, q, k_cache, v_cache, out, lse, batch=batch, heads=heads, kv_heads=kv_heads,
                                    q_len=q_len, max_len=max_len, head_dim=head_dim, scale=scale,
                                    kv_len_buffer=kv_len_buffer, key_padding_mask=key_padding_mask, window=window,
                                    softcap=softcap, alibi_slopes=alibi_slopes, page_size=page_size, tiles=tiles)
        return
    if kv_len_buffer is None:
        if kv_len is None or not 1 <= kv_len <= max_len:
            raise ValueError(f"attention_decode: kv_len must be in 1..max_len ({max_len}), got {kv_len}")
    else:
        kv_len_buffer = operand(kv_len_buffer)
        if kv_len_buffer.dtype.name not in ("uint32", "int32"):
            raise TypeError(f"attention_decode: kv_len_buffer must be uint32, not {kv_len_buffer.dtype.name}")
        require_elements(kv_len_buffer, 1, "attention_decode kv_len_buffer")
        kv_len = None
    flags = _check_flags(batch=batch, heads=heads, kv_heads=kv_heads, q_len=1, kv_len=kv_len, mask_len=max_len,
                         head_dim=head_dim, causal=True, key_padding_mask=key_padding_mask, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, q_offset=None)
    cache_rows = page_size if page_size else batch * max_len  # paged: at least one block
    if page_size and (kv_len_buffer is None or max_len % page_size):
        raise ValueError(f"attention_decode: a paged cache needs kv_len_buffer and max_len ({max_len}) a multiple of "
                         f"page_size ({page_size})")
    if page_size:
        require_elements(kv_len_buffer, 1 + batch * (max_len // page_size), "attention_decode block tables")
    for x, count, what in ((q, batch * heads, "q"), (out, batch * heads, "out"),
                           (k_cache, kv_heads * cache_rows, "k_cache"), (v_cache, kv_heads * cache_rows, "v_cache")):
        require_elements(x, count * head_dim, f"attention_decode {what}")
    if lse is None:
        lse = Operand(seq.device.buffer(batch * heads, "float32", name="attention_decode lse"))
    lse = operand(lse)
    _check_float32(lse, batch * heads, "lse")
    if splits is not None and int(splits) < 1:
        raise ValueError(f"attention_decode: splits must be >= 1, got {splits}")
    args = dict(batch=batch, heads=heads, kv_heads=kv_heads, q_len=1, kv_len=kv_len, kv_stride=max_len,
                head_dim=head_dim, scale=scale, kv_len_buffer=kv_len_buffer)
    per_vector = _per_vector(q.dtype.name)
    keys_per_tile = keys_per_tile or DECODE_KEYS["cpu" if seq.device.is_cpu else "gpu"]
    if keys_per_tile not in (32, 64, 128, 256):
        raise ValueError(f"attention_decode: keys_per_tile must be 32, 64, 128 or 256, got {keys_per_tile}")
    if tiles is None and _vector_rows(head_dim, per_vector, keys_per_tile) \
            and k_cache.offset % per_vector == 0 and v_cache.offset % per_vector == 0:
        group = heads // kv_heads
        group_heads = heads_per_workgroup or (2 if group % 2 == 0 and max_len >= 1024 and not seq.device.is_cpu
                                              else 1)
        if group % group_heads or group_heads > DECODE_MAX_HEADS:
            raise ValueError(f"attention_decode: heads_per_workgroup {group_heads} must divide the {group} query "
                             f"heads of a KV head and be at most {DECODE_MAX_HEADS}")
        workgroups = batch * heads // group_heads
        if splits is None:
            target = DECODE_TARGET_WORKGROUPS["cpu" if seq.device.is_cpu else "gpu"]
            splits = max(1, min(64, max_len // (4 * keys_per_tile), target // workgroups))
        if page_size:
            args.update(kv_stride=max_len // page_size, mask_stride=max_len)
        _record_forward(seq, q, k_cache, v_cache, out, lse, flags, DecodeTiles(group_heads, keys_per_tile), **args,
                        splits=int(splits), page_size=int(page_size))
        return
    if page_size:
        raise ValueError(f"attention_decode: a paged cache needs head_dim ({head_dim}) and the K/V offsets in whole "
                         "16-byte vectors")
    splits = max(1, min(32, max_len // 256)) if splits is None else int(splits)
    tiles = tiles or pick_tiles(seq.device, head_dim, DECODE_TILES, forward_shared_bytes)
    _record_forward(seq, q, k_cache, v_cache, out, lse, flags, tiles, **args, splits=splits)


def _record_queries_after_cache(seq, q, k_cache, v_cache, out, lse, *, batch, heads, kv_heads, q_len, max_len,
                                head_dim, scale, kv_len_buffer, key_padding_mask, window, softcap, alibi_slopes,
                                page_size, tiles) -> None:
    """attention_decode's ``q_len`` > 1: the scalar forward kernel over the cache's capacity, kv_len read on the
    GPU, the keys split over dispatches as a prefill's are (llvmpipe's loop limit)."""
    if kv_len_buffer is None or page_size:
        raise ValueError("attention_decode: several queries need kv_len_buffer, and no paged cache")
    kv_len_buffer = operand(kv_len_buffer)
    if kv_len_buffer.dtype.name not in ("uint32", "int32"):
        raise TypeError(f"attention_decode: kv_len_buffer must be uint32, not {kv_len_buffer.dtype.name}")
    require_elements(kv_len_buffer, 1, "attention_decode kv_len_buffer")
    flags = _check_flags(batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=None, mask_len=max_len,
                         head_dim=head_dim, causal=True, key_padding_mask=key_padding_mask, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, q_offset=None)
    for x, count, what in ((q, batch * heads * q_len, "q"), (out, batch * heads * q_len, "out"),
                           (k_cache, batch * kv_heads * max_len, "k_cache"),
                           (v_cache, batch * kv_heads * max_len, "v_cache")):
        require_elements(x, count * head_dim, f"attention_decode {what}")
    if lse is None:
        lse = Operand(seq.device.buffer(batch * heads * q_len, "float32", name="attention_decode lse"))
    lse = operand(lse)
    _check_float32(lse, batch * heads * q_len, "lse")
    if tiles is not None and type(tiles) is not Tiles:
        raise ValueError(f"attention_decode: several queries run on the scalar kernel's Tiles, not {tiles!r}")
    tiles = tiles or pick_tiles(seq.device, head_dim, FORWARD_TILES, forward_shared_bytes)
    _record_forward(seq, q, k_cache, v_cache, out, lse, flags, tiles, batch=batch, heads=heads, kv_heads=kv_heads,
                    q_len=q_len, kv_len=None, kv_stride=max_len, head_dim=head_dim, scale=scale,
                    kv_len_buffer=kv_len_buffer)


def _per_vector(dtype_name: str) -> int:
    return 4 if dtype_name == "float32" else 8  # elements of a 16-byte vector


def _vector_rows(head_dim: int, per_vector: int, keys_per_tile: int) -> bool:
    return head_dim % per_vector == 0 and head_dim // per_vector <= keys_per_tile


def paged_decode_fits(device, head_dim: int, dtype_name: str) -> bool:
    """Whether attention_decode can read a paged cache of ``head_dim`` rows in ``dtype_name`` on ``device`` (with
    its default tiles): only the vectorised kernel pages, and it needs rows of whole 16-byte vectors."""
    per_vector = _per_vector(dtype_name)
    return _vector_rows(int(head_dim), per_vector, DECODE_KEYS["cpu" if device.is_cpu else "gpu"])


def attention_backward(seq, q, k, v, out, d_out, lse, d_q, d_k, d_v, *, batch: int, heads: int, kv_heads: int,
                       q_len: int, kv_len: int, head_dim: int, scale: float, causal: bool = True,
                       key_padding_mask: Operand | None = None, window: int = 0, softcap: float = 0.0,
                       alibi_slopes: Operand | None = None, q_offset: int | None = None,
                       tiles: Tiles | CoopmatBackwardTiles | None = None, d_lse: Operand | None = None,
                       algorithm: str = "auto") -> None:
    """Record the gradients d_q, d_k, d_v of :func:`attention_forward` (same flags) into ``seq``.

    Three dispatches, all deterministic: delta = rowsum(d_out * out) [- d_lse]; dK/dV per key block
    (summed over the query heads of a GQA group inside one workgroup); dQ per query block.
    ``d_lse`` (float32, one per query row): the gradient reaching the forward's logsumexp, if any.
    ``algorithm``: "auto" (the coopmat kernel where it can run), "scalar" or "coopmat" (where
    :func:`coopmat_backward_tiles` allows). The cooperative-matrix kernel rounds P and dS to the storage
    type before its products, as flash attention does.
    """
    q, k, v, out, d_out, lse, d_q, d_k, d_v = map(operand, (q, k, v, out, d_out, lse, d_q, d_k, d_v))
    flags = _check_flags(batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, mask_len=kv_len,
                         head_dim=head_dim, causal=causal, key_padding_mask=key_padding_mask, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, q_offset=q_offset)
    variant = _variant(q, k, v, out, d_out, d_q, d_k, d_v)
    q_rows, kv_rows = batch * heads * q_len, batch * kv_heads * kv_len
    for x, rows, what in ((q, q_rows, "q"), (out, q_rows, "out"), (d_out, q_rows, "d_out"), (d_q, q_rows, "d_q"),
                          (k, kv_rows, "k"), (v, kv_rows, "v"), (d_k, kv_rows, "d_k"), (d_v, kv_rows, "d_v")):
        require_elements(x, rows * head_dim, f"attention {what}")
    _check_float32(lse, q_rows, "lse")
    device = seq.device
    if algorithm not in ("auto", "scalar", "coopmat"):
        raise ValueError(f"attention: algorithm must be 'auto', 'scalar' or 'coopmat', not {algorithm!r}")
    if isinstance(tiles, CoopmatTiles):
        _check_given_coopmat_tiles(device, tiles, q.dtype.name, head_dim, (q.offset, k.offset, v.offset, d_out.offset),
                                   algorithm, backward=True)
    if tiles is None and algorithm in ("auto", "coopmat"):
        tiles = coopmat_backward_tiles(device, q.dtype.name, head_dim, q.offset, k.offset, v.offset, d_out.offset)
        if tiles is None and algorithm == "coopmat":
            raise ValueError(f"attention: the cooperative-matrix backward cannot run {q.dtype.name} head_dim "
                             f"{head_dim} on {device.name}")
    tiles = tiles or pick_tiles(device, head_dim, BACKWARD_TILES, backward_shared_bytes)

    if d_lse is not None:
        d_lse = operand(d_lse)
        _check_float32(d_lse, q_rows, "d_lse")
    delta = seq.scratch(q_rows, "float32", name="attention delta")
    seq.dispatch(device.kernel("attention_bwd_prep", variant), [out.buffer, d_out.buffer, delta,
                                                                (d_lse or out).buffer],
                 grid(q_rows, 128, device.limits["max_compute_work_group_count_x"]),
                 push=[q_rows, head_dim, out.offset, d_out.offset, d_lse.offset if d_lse else 0, int(d_lse is not None)])

    coopmat = isinstance(tiles, CoopmatBackwardTiles)
    kernel = device.kernel("attention_bwd_coopmat" if coopmat else "attention_bwd", variant)
    inputs = [q.buffer, k.buffer, v.buffer, d_out.buffer, lse.buffer, delta, *flags.bindings(device)]

    def push(grad1: Operand, grad2: Operand):
        return [q.offset, k.offset, v.offset, d_out.offset, lse.offset,
                flags.mask.offset if flags.mask else 0, flags.slopes.offset if flags.slopes else 0,
                grad1.offset, grad2.offset, heads, kv_heads, q_len, kv_len, kv_len, flags.q_offset, flags.window,
                float(scale), float(flags.softcap)]

    def spec(compute_dq: bool):
        if coopmat:
            subgroup = int(device.limits["subgroup_size"])
            layout = coopmat_layout(device, q.dtype.name).spec() if tiles.reg_softmax else []
            return [head_dim, tiles.rows, tiles.cols, 1, *flags.spec(), int(compute_dq), tiles.rows // 16 * subgroup,
                    subgroup, tiles.tuning, *layout]
        return [head_dim, tiles.rows, tiles.cols, tiles.lanes, *flags.spec(), int(compute_dq), tiles.threads]

    if coopmat:
        seq.dispatch(kernel, [*inputs, d_k.buffer, d_v.buffer], (-(-kv_len // tiles.rows), kv_heads, batch),
                     push=push(d_k, d_v), spec=spec(False))
        seq.dispatch(kernel, [*inputs, d_q.buffer, d_q.buffer], (-(-q_len // tiles.rows), heads, batch),
                     push=push(d_q, d_q), spec=spec(True))
        return
    # Units: the streamed tiles of every query head a workgroup takes (dK/dV: the group's heads, dQ: one).
    group = heads // kv_heads
    for grads, rows, units, head_count, compute_dq in (((d_k, d_v), kv_len, -(-q_len // tiles.cols) * group, group,
                                                        False),
                                                       ((d_q, d_q), q_len, -(-kv_len // tiles.cols), 1, True)):
        step = backward_units_per_dispatch(tiles, head_dim, head_count)
        for unit_lo in range(0, units, step):
            seq.dispatch(kernel, [*inputs, grads[0].buffer, grads[1].buffer],
                         (-(-rows // tiles.rows), heads if compute_dq else kv_heads, batch),
                         push=push(*grads) + [unit_lo, unit_lo + step, int(unit_lo > 0)], spec=spec(compute_dq))
