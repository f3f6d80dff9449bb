"""Matmul benchmark: TFLOP/s of the vkformers kernels beside a reference from the same run.

float32 (tiled kernel), float16 and bfloat16 (cooperative-matrix kernel where the
device has it; fp32 accumulation; C in the input dtype, and also in float32), square sizes. Kernel
time comes from GPU timestamps (the median of several dispatches in one replay, after a second of
warm-up replays: see common.WARM_UP_SECONDS).
The reference is PyTorch on CUDA (float32 with TF32 off, float16, bfloat16) when
torch sees a GPU, else numpy float32 on the CPU; ratios are vkformers / reference.

    python bench/matmul.py [--quick] [--json OUT] [--sweep] [--layouts] [--decode-only] [--prefill]

--sweep also times alternative tile configurations at each size (with --layouts, for A @ B^T too); --layouts
the transposed layouts A @ B^T (a Linear layer's forward) and A^T @ B (its weight gradient) beside the same
PyTorch product.
The decode cases (y = x @ W^T, m = 1 and 8 rows of x, W [n, k] of 2048 x 2048 and
5632 x 2048, trans_b) report GB/s of weight bytes read: the small-m kernel (what
"auto" picks) and the large-m kernel for comparison, against the same-shape PyTorch
matmul and a device-to-device copy of the weight timed in the same run (CUDA), or
numpy on the CPU. --quick uses smaller decode shapes (m=1, n=1536, k=576 too).
--prefill (only): the products of a TinyLlama 1.1B prefill (x @ W^T for q, k, v, o, gate, up, down and
the lm_head) at m = 16 and 512 prompt tokens, each over distinct weights (no cache reuse): the kernel (tiles
and K split) that "auto" picks, the kernel for many rows (cooperative matrix in 128 x 128 tiles, unsplit,
or the tiled kernel), and the reference; then one prompt's products in all (22 layers and the lm_head).
With --quick only m = 16 (lavapipe).
--skinny (only): the products of a batched decode step of the Llama-3-8B shape (x @ W^T, m = 8 to 64 rows of x;
q/o 4096 x 4096, k/v 1024 x 4096, gate/up 14336 x 4096, down 4096 x 14336), bfloat16, each over distinct weights:
the weight bytes read per second by what "auto" picks, by the cooperative-matrix tile kernel as it would run the
product (its COOPMAT_SKINNY tile and K split), and by each workgroup shape of the skinny kernel in SKINNY_SHAPES
(with --skinny-tiles, each tile and K split of SKINNY_TILES too), beside PyTorch's x @ W.T; then the fastest of
each shape. --budget caps its seconds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from common import cuda_median, cuda_torch, replay_timings, write_results

from vkformers.engine.kernels.matmul import (
    COOPMAT_DEFAULT, CoopmatConfig, SkinnyConfig, TiledConfig, coopmat_config, matmul, prefers_skinny,
    select_algorithm, skinny_config, split_k)
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import get_device

DTYPES = ("float32", "float16", "bfloat16")


def random_buffer(device, shape, dtype, rng):
    x = rng.standard_normal(shape, dtype=np.float32)
    return device.upload(dt.to_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype), dtype=dtype)


def time_vkformers(device, size: int, dtype: str, repeats: int, out_dtype: str | None = None, **options) -> float:
    """Median seconds of one size^3 matmul (C in ``out_dtype``, default ``dtype``), from GPU timestamps."""
    rng = np.random.default_rng(0)
    a, b = random_buffer(device, (size, size), dtype, rng), random_buffer(device, (size, size), dtype, rng)
    c = device.buffer((size, size), out_dtype or dtype)
    seq = device.sequence(timestamps=True)
    for _ in range(repeats):
        matmul(seq, a, b, c, m=size, n=size, k=size, **options)
    return float(np.median([t for label, t in replay_timings(seq) if label.startswith("matmul")]))


def time_reference(size: int, dtype: str, repeats: int, trans_a: bool = False, trans_b: bool = False):
    """(seconds, name) of the reference matmul (op(x) @ op(y), transposed views as in PyTorch code)."""
    torch = cuda_torch()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
        x = torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype))
        y = torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype))
        op_x, op_y = (x.T if trans_a else x), (y.T if trans_b else y)
        return cuda_median(lambda: torch.matmul(op_x, op_y), repeats), f"torch {torch.cuda.get_device_name()}"
    x = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    times = []
    for _ in range(max(1, repeats // 2)):
        start = time.perf_counter()
        x @ x
        times.append(time.perf_counter() - start)
    return float(np.median(times)), "numpy float32 (CPU)"


DECODE_SHAPES = ((1, 2048, 2048), (8, 2048, 2048), (1, 5632, 2048), (8, 5632, 2048))
DECODE_SHAPES_QUICK = ((1, 1536, 576), (8, 1536, 576), (1, 2048, 2048))


def time_decode_vkformers(device, m: int, n: int, k: int, dtype: str, repeats: int, **options) -> float:
    """Median seconds of y[m, n] = x[m, k] @ W[n, k]^T (y in ``dtype``), from GPU timestamps."""
    rng = np.random.default_rng(0)
    x, w = random_buffer(device, (m, k), dtype, rng), random_buffer(device, (n, k), dtype, rng)
    y = device.buffer((m, n), dtype)
    seq = device.sequence(timestamps=True)
    for _ in range(repeats):
        matmul(seq, x, w, y, m=m, n=n, k=k, trans_b=True, **options)
    return float(np.median([t for label, t in replay_timings(seq) if label.startswith("matmul")]))


def time_decode_reference(m: int, n: int, k: int, dtype: str, repeats: int):
    """(matmul seconds, weight-copy seconds or None, name): PyTorch x @ W.T on CUDA and a
    device copy of W, else numpy float32 on the CPU."""
    torch = cuda_torch()
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = False
        x = torch.randn(m, k, device="cuda", dtype=getattr(torch, dtype))
        w = torch.randn(n, k, device="cuda", dtype=getattr(torch, dtype))
        copy = torch.empty_like(w)
        return (cuda_median(lambda: x @ w.T, repeats), cuda_median(lambda: copy.copy_(w), repeats),
                f"torch {torch.cuda.get_device_name()}")
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x @ w.T
        times.append(time.perf_counter() - start)
    return float(np.median(times)), None, "numpy float32 (CPU)"


def decode_runs(device, quick: bool) -> list[dict]:
    shapes = DECODE_SHAPES_QUICK if quick else DECODE_SHAPES
    repeats = 3 if quick else 20
    rows = []
    for m, n, k in shapes:
        for dtype in DTYPES:
            weight_bytes = n * k * dt.as_dtype(dtype).itemsize
            ref, copy, ref_name = time_decode_reference(m, n, k, dtype, repeats)
            ours = time_decode_vkformers(device, m, n, k, dtype, repeats)
            large_kernel = select_algorithm(device, dtype)
            large = time_decode_vkformers(device, m, n, k, dtype, max(1, repeats // 4), algorithm=large_kernel)
            row = {"m": m, "n": n, "k": k, "dtype": dtype, "kernel": select_algorithm(device, dtype, m),
                   "seconds": ours, "weight_gb_per_s": weight_bytes / ours / 1e9,
                   "large_m_kernel": large_kernel, "large_m_seconds": large,
                   "reference": ref_name, "reference_seconds": ref,
                   "reference_weight_gb_per_s": weight_bytes / ref / 1e9, "ratio": ref / ours}
            line = (f"decode m={m} {n}x{k} {dtype:8s} {row['kernel']:7s} {ours * 1e6:9.1f} us "
                    f"{row['weight_gb_per_s']:8.1f} GB/s   {large_kernel}: {large * 1e6:9.1f} us   "
                    f"{ref_name}: {ref * 1e6:9.1f} us {row['reference_weight_gb_per_s']:8.1f} GB/s   "
                    f"ratio {row['ratio']:.3f}")
            if copy is not None:
                # A copy reads and writes the weight: its bandwidth counts both.
                row["copy_gb_per_s"] = 2 * weight_bytes / copy / 1e9
                row["fraction_of_copy_bandwidth"] = row["weight_gb_per_s"] / row["copy_gb_per_s"]
                line += f"   copy {row['copy_gb_per_s']:7.1f} GB/s ({row['fraction_of_copy_bandwidth']:.2f})"
            rows.append(row)
            print(line, flush=True)
    return rows


PREFILL_PRODUCTS = {"q_proj": (2048, 2048, 1), "k_proj": (256, 2048, 1), "v_proj": (256, 2048, 1),
                    "o_proj": (2048, 2048, 1), "gate_proj": (5632, 2048, 1), "up_proj": (5632, 2048, 1),
                    "down_proj": (2048, 5632, 1), "lm_head": (32000, 2048, 0)}  # (n, k, per layer: 1 else 0)
PREFILL_LAYERS = 22


def time_products_vkformers(device, m: int, n: int, k: int, dtype: str, repeats: int, **options) -> float:
    """Seconds of one y[m, n] = x[m, k] @ W[n, k]^T from GPU timestamps: every kernel of the call (a split
    product has two), averaged over ``repeats`` calls on distinct weights."""
    rng = np.random.default_rng(0)
    x = random_buffer(device, (m, k), dtype, rng)
    weights = [random_buffer(device, (n, k), dtype, rng) for _ in range(repeats)]
    ys = [device.buffer((m, n), dtype) for _ in range(repeats)]
    seq = device.sequence(timestamps=True)
    for w, y in zip(weights, ys):
        matmul(seq, x, w, y, m=m, n=n, k=k, trans_b=True, **options)
    return sum(t for label, t in replay_timings(seq) if label.startswith("matmul")) / repeats


def prefill_runs(device, dtype: str = "bfloat16", quick: bool = False) -> list[dict]:
    rows = []
    repeats = 2 if quick else 8
    for m in (16,) if quick else (16, 512):
        totals = {"auto": 0.0, "large": 0.0, "reference": 0.0}
        large = select_algorithm(device, dtype)  # the kernel for many rows: coopmat (128 x 128, unsplit) or tiled
        for name, (n, k, per_layer) in PREFILL_PRODUCTS.items():
            kernel = select_algorithm(device, dtype, m, trans_b=True)
            cfg = coopmat_config(device, m, n) if kernel == "coopmat" else None
            splits = split_k(device, cfg, m, n, k, 1) if cfg else 1
            ours = time_products_vkformers(device, m, n, k, dtype, repeats)
            plain = time_products_vkformers(device, m, n, k, dtype, repeats, algorithm=large,
                                            coopmat=COOPMAT_DEFAULT if large == "coopmat" else None)
            ref, _, ref_name = time_decode_reference(m, n, k, dtype, repeats if quick else 20)
            count = PREFILL_LAYERS if per_layer else 1
            for key, seconds in (("auto", ours), ("large", plain), ("reference", ref)):
                totals[key] += count * seconds
            tile = f"{cfg.bm}x{cfg.bn} / {splits}" if cfg else kernel
            large_name = "128x128 unsplit" if large == "coopmat" else large
            rows.append({"m": m, "product": name, "n": n, "k": k, "dtype": dtype, "kernel": kernel, "tile": tile,
                         "seconds": ours, "large_m_kernel": large_name, "large_m_seconds": plain,
                         "reference": ref_name, "reference_seconds": ref, "ratio": ref / ours})
            print(f"prefill m={m:3d} {name:9s} {n:5d}x{k:4d} {dtype}: {tile:13s} {ours * 1e6:8.1f} us   "
                  f"{large_name} {plain * 1e6:8.1f} us   {ref_name}: {ref * 1e6:8.1f} us   "
                  f"ratio {ref / ours:.3f}", flush=True)
        rows.append({"m": m, "product": "prompt", "seconds": totals["auto"], "large_m_seconds": totals["large"],
                     "reference_seconds": totals["reference"], "ratio": totals["reference"] / totals["auto"]})
        print(f"prefill m={m:3d} all products of a prompt ({PREFILL_LAYERS} layers + lm_head): "
              f"{totals['auto'] * 1e3:.3f} ms   {large_name} {totals['large'] * 1e3:.3f} ms   "
              f"reference {totals['reference'] * 1e3:.3f} ms   ratio {totals['reference'] / totals['auto']:.3f}",
              flush=True)
    return rows


# Cooperative-matrix configurations the sweep tries (subgroups, bk, fragments per subgroup, bands of tile rows).
# m, n and k as specialization constants (spec_shape) were also swept on an H200: no gain.
COOPMAT_SWEEP = [CoopmatConfig(**kw) for kw in (
    dict(sg_rows=2, sg_cols=4, bk=64, frag_m=4, frag_n=2), dict(sg_rows=2, sg_cols=4, bk=64, frag_m=4, frag_n=2,
                                                             group_rows=16),
    dict(sg_rows=2, sg_cols=4, bk=32, frag_m=4, frag_n=4), dict(sg_rows=2, sg_cols=4, bk=32, frag_m=4, frag_n=4,
                                                             group_rows=16),
    dict(sg_rows=2, sg_cols=4, bk=32, frag_m=4, frag_n=4, group_rows=32),
    dict(sg_rows=2, sg_cols=4, bk=48, frag_m=4, frag_n=4, group_rows=16),
    dict(sg_rows=2, sg_cols=2, bk=32, frag_m=4, frag_n=4), dict(sg_rows=2, sg_cols=2, bk=32, frag_m=4, frag_n=4,
                                                             group_rows=16),
    dict(sg_rows=2, sg_cols=2, bk=32, frag_m=4, frag_n=4, group_rows=32),
    dict(sg_rows=4, sg_cols=2, bk=32, frag_m=4, frag_n=4, group_rows=16))]


SKINNY_PRODUCTS = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096),
                   "down_proj": (4096, 14336)}  # (n, k) of the Llama-3-8B shape (o_proj: q_proj's; up: gate's)
SKINNY_PRODUCTS_QUICK = {"q_proj": (256, 128)}
SKINNY_ROWS = (32, 64, 16, 8)  # the server's batch sizes first
# (sg_rows, sg_cols, frag_m, frag_n): tiles of 16 to 64 rows, 64 to 256 columns
SKINNY_TILES = ((1, 4, 1, 2), (1, 8, 1, 2), (1, 4, 1, 4), (2, 2, 1, 2), (1, 4, 2, 2), (1, 8, 2, 1), (2, 4, 1, 2),
                (1, 4, 2, 4), (2, 4, 2, 2), (2, 2, 2, 2), (1, 4, 4, 2), (1, 8, 4, 1), (4, 2, 1, 4))
SKINNY_BK = (64, 128, 256)
# The skinny kernel's workgroups: (frag_n, split, unroll), frag_m as m needs (shapes past 48 KiB are skipped).
SKINNY_SHAPES = tuple((frag_n, split, unroll) for frag_n in (1, 2) for split in (4, 8, 16) for unroll in (2, 4))


def skinny_candidates(device, m: int, n: int, k: int):
    """(config, splits) of SKINNY_TILES whose tile rows fit m closely, with K splits that bring the grid to one
    to four waves of ~132 workgroups."""
    shared, subgroup = device.limits["max_compute_shared_memory_size"], device.limits["subgroup_size"]
    for sg_rows, sg_cols, frag_m, frag_n in SKINNY_TILES:
        for bk in SKINNY_BK:
            cfg = CoopmatConfig(sg_rows=sg_rows, sg_cols=sg_cols, bk=bk, frag_m=frag_m, frag_n=frag_n)
            if not (m <= cfg.bm < 2 * max(m, 16)) or not _fits(cfg, subgroup, shared):
                continue
            grid = -(-m // cfg.bm) * -(-n // cfg.bn)
            for splits in (1, 2, 4, 8, 16):
                if splits == 1 or (grid * splits // 2 < 528 and -(-k // bk) // splits >= 2
                                   and 4 * m * n * splits <= 64 << 20):
                    yield cfg, splits


def skinny_kernel_candidates(device, m: int):
    """SkinnyConfigs of SKINNY_SHAPES that fit the device's shared memory."""
    shared = device.limits["max_compute_shared_memory_size"]
    for frag_n, split, unroll in SKINNY_SHAPES:
        cfg = SkinnyConfig(frag_m=min(4, -(-m // 16)), frag_n=frag_n, split=split, unroll=unroll)
        if cfg.shared_bytes() <= shared:
            yield cfg


def skinny_label(cfg: SkinnyConfig) -> str:
    return f"skinny {cfg.frag_m}x{cfg.frag_n} split {cfg.split} unroll {cfg.unroll}"


def skinny_runs(device, budget: float, quick: bool = False, dtype: str = "bfloat16",
                tiles: bool = False, row_counts=SKINNY_ROWS) -> list[dict]:
    """Weight GB/s of x[m, k] @ W[n, k]^T at the shapes of a batched decode step: what "auto" picks, the tile
    kernel, each skinny-kernel workgroup (and with ``tiles`` each tile and K split of the tile kernel)."""
    rng = np.random.default_rng(0)
    repeats, rows, began = (2 if quick else 6), [], time.perf_counter()
    shapes = SKINNY_PRODUCTS_QUICK if quick else SKINNY_PRODUCTS
    weights = {name: [random_buffer(device, (n, k), dtype, rng) for _ in range(repeats)]
               for name, (n, k) in shapes.items()}
    coopmat = select_algorithm(device, dtype) == "coopmat"
    warm = [2.0]  # seconds of warm-up replays: the GPU's clocks up once, then a few replays per configuration
    for m in row_counts:
        for name, (n, k) in shapes.items():
            x = random_buffer(device, (m, k), dtype, rng)
            ys = [device.buffer((m, n), dtype) for _ in range(repeats)]
            ref, _, ref_name = time_decode_reference(m, n, k, dtype, 20)
            gbs = lambda seconds: n * k * 2 / seconds / 1e9  # noqa: E731

            def timed(**options) -> float:
                seq = device.sequence(timestamps=True)
                for w, y in zip(weights[name], ys):
                    matmul(seq, x, w, y, m=m, n=n, k=k, trans_b=True, **options)
                labels = replay_timings(seq, warm[0])
                warm[0] = 0.05
                return sum(t for label, t in labels if label.startswith("matmul")) / repeats
            auto = timed()
            kernel = select_algorithm(device, dtype, m, trans_b=True)
            tile_cfg = coopmat_config(device, m, n, linear=True) if kernel == "coopmat" else None
            tile_name = (f"{tile_cfg.bm}x{tile_cfg.bn} bk {tile_cfg.bk} / {split_k(device, tile_cfg, m, n, k, 1)}"
                         if tile_cfg else kernel)
            tile = timed(algorithm="coopmat") if tile_cfg else auto
            skinny = skinny_config(device, m, n, k)
            auto_name = skinny_label(skinny) if kernel == "coopmat" and prefers_skinny(device, m, n, k) else tile_name
            best = (auto, "auto: " + auto_name)
            candidates = [(skinny_label(cfg), dict(algorithm="skinny", skinny=cfg))
                          for cfg in (skinny_kernel_candidates(device, m) if coopmat else ())]
            candidates += [(f"{cfg.bm}x{cfg.bn} ({cfg.sg_rows}x{cfg.sg_cols}) bk {cfg.bk} / {splits}",
                            dict(algorithm="coopmat", coopmat=cfg, splits=splits))
                           for cfg, splits in (skinny_candidates(device, m, n, k) if coopmat and tiles else ())]
            for label, options in candidates:
                if time.perf_counter() - began > budget:
                    break
                try:
                    seconds = timed(**options)
                except Exception as exc:  # a configuration the device refuses
                    print(f"skinny {label}: {exc}")
                    continue
                rows.append({"product": name, "m": m, "n": n, "k": k, "config": label, "seconds": seconds,
                             "weight_gb_per_s": gbs(seconds)})
                if seconds < best[0]:
                    best = (seconds, label)
            rows.append({"product": name, "m": m, "n": n, "k": k, "auto": auto_name, "auto_seconds": auto,
                         "auto_gb_per_s": gbs(auto), "tile": tile_name, "tile_seconds": tile,
                         "tile_gb_per_s": gbs(tile), "best": best[1], "best_seconds": best[0],
                         "best_gb_per_s": gbs(best[0]), "reference": ref_name, "reference_seconds": ref,
                         "reference_gb_per_s": gbs(ref)})
            print(f"skinny m={m:2d} {name:9s} {n:5d}x{k:5d}: auto {auto_name:22s} {gbs(auto):7.0f} GB/s   tile "
                  f"{tile_name} {gbs(tile):7.0f} GB/s   best "
                  f"{best[1]:32s} {gbs(best[0]):7.0f} GB/s   {ref_name}: {gbs(ref):7.0f} GB/s "
                  f"(best/reference {ref / best[0]:.2f})", flush=True)
    return rows


def _fits(cfg: CoopmatConfig, subgroup: int, shared: int) -> bool:
    try:
        cfg.check(subgroup)
    except ValueError:
        return False
    return cfg.shared_bytes(False, True) <= shared


def check_against_numpy(device, dtype, **options) -> float:
    """Largest error, relative to the largest |C|, of odd-shaped products (edges, a partial K
    step, both transposes) and one aligned product, against numpy in float32."""
    rng = np.random.default_rng(3)
    worst = 0.0
    cfg, limit = options.get("coopmat"), device.limits["max_compute_shared_memory_size"]
    for (m, n, k), trans_a, trans_b in (((1000, 1030, 520), False, False), ((777, 515, 300), True, True),
                                        ((1024, 1024, 1024), False, True)):
        if cfg is not None and cfg.shared_bytes(trans_a, trans_b) > limit:
            continue  # a tile too large for this layout's staging
        a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
        a_dev, b_dev = random_like(device, a, dtype), random_like(device, b, dtype)
        a_in, b_in = rounded(a, dtype), rounded(b, dtype)
        c = device.buffer((m, n), "float32")
        seq = device.sequence()
        matmul(seq, a_dev, b_dev, c, m=m, n=n, k=k, trans_a=trans_a, trans_b=trans_b, **options)
        seq.replay()
        want = (a_in.T if trans_a else a_in) @ (b_in.T if trans_b else b_in)
        worst = max(worst, float(np.abs(c.read() - want).max() / np.abs(want).max()))
    return worst


def rounded(x, dtype):
    return dt.from_bfloat16(dt.to_bfloat16(x)) if dtype == "bfloat16" else x.astype(dtype).astype(np.float32)


def random_like(device, x, dtype):
    return device.upload(dt.to_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype), dtype=dtype)


def tflops(size: int, seconds: float) -> float:
    return 2 * size**3 / seconds / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (lavapipe)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configurations")
    parser.add_argument("--layouts", action="store_true",
                        help="also time A @ B^T (a Linear layer) and A^T @ B (its weight gradient)")
    parser.add_argument("--decode-only", action="store_true", help="only the decode (small-m) cases")
    parser.add_argument("--prefill", action="store_true", help="only the products of a TinyLlama prefill")
    parser.add_argument("--skinny", action="store_true", help="only the products of an 8B batched decode step")
    parser.add_argument("--budget", type=float, default=400.0, help="--skinny: seconds of configurations at most")
    parser.add_argument("--skinny-tiles", action="store_true", help="--skinny: sweep the tile kernel's tiles too")
    parser.add_argument("--rows", default=",".join(map(str, SKINNY_ROWS)), help="--skinny: the rows of x")
    args = parser.parse_args()

    device = get_device()
    if args.skinny:
        print(f"device: {device.name}")
        write_results(args.json, {"device": device.name,
                                  "skinny": skinny_runs(device, args.budget, args.quick, tiles=args.skinny_tiles,
                                                        row_counts=[int(r) for r in args.rows.split(",")])})
        return
    if args.prefill:
        print(f"device: {device.name}")
        write_results(args.json, {"device": device.name, "prefill": prefill_runs(device, quick=args.quick)})
        return
    sizes = () if args.decode_only else (128, 256) if args.quick else (4096, 8192)
    repeats = 3 if args.quick else 10
    print(f"device: {device.name}")
    results = {"device": device.name, "runs": []}
    results["decode"] = decode_runs(device, args.quick)
    for size in sizes:
        for dtype in DTYPES:
            kernel = select_algorithm(device, dtype)
            ref, ref_name = time_reference(size, dtype, repeats)
            # C in the input dtype (as PyTorch); for the 16-bit kernels also C in float32.
            for out_dtype in dict.fromkeys((dtype, "float32")):
                ours = time_vkformers(device, size, dtype, repeats, out_dtype=out_dtype)
                row = {"size": size, "dtype": dtype, "out_dtype": out_dtype, "kernel": kernel,
                       "tflops": tflops(size, ours), "reference": ref_name,
                       "reference_tflops": tflops(size, ref), "ratio": ref / ours}
                results["runs"].append(row)
                print(f"{size:5d}^3 {dtype:8s} -> {out_dtype:8s} {kernel:7s} {row['tflops']:8.2f} TFLOP/s   "
                      f"{ref_name}: {row['reference_tflops']:8.2f} TFLOP/s   ratio {row['ratio']:.3f}", flush=True)

    if args.layouts:
        results["layouts"] = []
        for size in sizes:
            for dtype in DTYPES:
                for trans_a, trans_b, name in ((False, True, "A @ B^T"), (True, False, "A^T @ B")):
                    ref, ref_name = time_reference(size, dtype, repeats, trans_a, trans_b)
                    ours = time_vkformers(device, size, dtype, repeats, trans_a=trans_a, trans_b=trans_b)
                    row = {"size": size, "dtype": dtype, "layout": name, "tflops": tflops(size, ours),
                           "reference": ref_name, "reference_tflops": tflops(size, ref), "ratio": ref / ours}
                    results["layouts"].append(row)
                    print(f"{size:5d}^3 {dtype:8s} {name:8s} {row['tflops']:8.2f} TFLOP/s   {ref_name}: "
                          f"{row['reference_tflops']:8.2f} TFLOP/s   ratio {row['ratio']:.3f}", flush=True)

    if args.sweep:
        results["sweep"] = []
        # Sweeps on an H200 also tried 128 x 64 tiles with K steps of 8 and 32, 64 x 128,
        # 128 x 128 of 4 x 8 per invocation, 64 x 64 and 128 x 128 of 8 x 8: all slower.
        candidates = [("float32", dict(algorithm="tiled", tiled=cfg)) for cfg in (
            TiledConfig(128, 64, 16, 8, 4), TiledConfig(128, 64, 16, 8, 4, 8), TiledConfig(128, 64, 16, 8, 4, 16),
            TiledConfig(128, 128, 16, 8, 4), TiledConfig(128, 128, 16, 8, 4, 8))
            if cfg.shared_bytes() <= device.limits["max_compute_shared_memory_size"]]
        # A @ B, and with --layouts also A @ B^T (a Linear layer's forward: B staged as rows of K).
        layouts = [(False, "A @ B")] + ([(True, "A @ B^T")] if args.layouts else [])
        limit = device.limits["max_compute_shared_memory_size"]
        for dtype in ("float16", "bfloat16"):
            if select_algorithm(device, dtype) == "coopmat":
                candidates += [(dtype, dict(algorithm="coopmat", coopmat=cfg)) for cfg in COOPMAT_SWEEP]
        errors = {}  # each coopmat configuration checked against numpy once
        for size, (trans_b, layout), (dtype, options) in (
                (size, lay, c) for size in sizes for lay in layouts for c in candidates):
            cfg = options.get("tiled") or options.get("coopmat")
            if "coopmat" in options and cfg.shared_bytes(False, trans_b) > limit:
                continue  # its staged tiles do not fit in this layout
            try:
                if "coopmat" in options and (dtype, cfg) not in errors:
                    errors[dtype, cfg] = check_against_numpy(device, dtype, **options)
                seconds = time_vkformers(device, size, dtype, repeats, trans_b=trans_b, **options)
            except Exception as exc:  # a configuration the device refuses
                print(f"sweep {dtype} {options}: {exc}")
                continue
            error = errors.get((dtype, cfg))
            results["sweep"].append({"size": size, "dtype": dtype, "layout": layout, "config": repr(cfg),
                                     "tflops": tflops(size, seconds), "max_error": error})
            checked = "" if error is None else f"   max error vs numpy {error:.2e}"
            print(f"sweep {size}^3 {dtype:8s} {layout:8s} {cfg!r}: {tflops(size, seconds):8.2f} TFLOP/s{checked}",
                  flush=True)

    write_results(args.json, results)


if __name__ == "__main__":
    main()
