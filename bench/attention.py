"""Attention kernel benchmark: fused forward, forward + backward, and KV-cache decode.

Times come from GPU timestamps (the recorded dispatches of one replay, median of several
replays). Each figure is printed beside a reference measured in the same run:
torch.nn.functional.scaled_dot_product_attention in the same dtype when PyTorch sees a
CUDA GPU (timed with CUDA events; its outputs also check ours at full size), else numpy
(float32, CPU) at the same shape, which is only a sanity reference.

    python bench/attention.py [--quick] [--json OUT] [--seq 2048] [--heads 32] [--head-dim 128]
                              [--decode-only] [--decode-sweep] [--kv-heads N] [--forward-sweep [--rounds 2]]

--forward-sweep times every variant once per round, the rounds one after the other in the same run, and says per
variant whether the rounds agree on its gain over the default (the same side of it by more than 2% each time), so
that one run decides what would otherwise take two.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np

from common import WARM_UP_SECONDS, cuda_median, cuda_torch, warm_up, write_results

from vkformers.engine.kernels.attention import (
    ABLATIONS, COOPMAT_BACKWARD_TILES, COOPMAT_FORWARD_TILES, COOPMAT_TWO_PASS_TILES, COOPMAT_WIDE_KEY_TILES,
    DECODE_TILES, CoopmatTiles, coopmat_forward_candidates,
    attention_backward, attention_decode, attention_forward, coopmat_backward_tiles, coopmat_forward_tiles)
from vkformers.engine.kernels.coopmat_layout import coopmat_layout
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import get_device

torch = cuda_torch()
HAVE_CUDA = torch is not None
FEATURES = ("softcap", "window", "alibi", "all")  # decode rows of models with these options


def gpu_seconds(seq, repeats: int, warm_up_seconds: float = WARM_UP_SECONDS) -> float:
    """Median GPU time of one replay (every recorded operation after the leading barrier), after warm-up."""
    warm_up(seq.replay, warm_up_seconds)
    times = []
    for _ in range(repeats):
        seq.replay()
        times.append(sum(t for _, t in seq.timings()[1:]))
    return float(np.median(times))


def to_device(device, x: np.ndarray, dtype: str):
    if dtype == "bfloat16":
        return device.upload(dt.to_bfloat16(x.astype(np.float32)), dtype="bfloat16")
    return device.upload(x.astype(dt.as_dtype(dtype).host))


def as_float32(array, dtype):
    return dt.from_bfloat16(array) if dtype == "bfloat16" else array.astype(np.float32)


def numpy_attention_seconds(q, k, v, scale) -> float:
    """float32 causal attention in numpy (CPU), one pass: only a sanity reference."""
    start = time.perf_counter()
    s = scale * q @ k.transpose(0, 1, 3, 2)
    s += np.triu(np.full(s.shape[-2:], -np.inf, np.float32), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    _ = (s / s.sum(-1, keepdims=True)) @ v
    return time.perf_counter() - start


def bench_prefill(device, dtype: str, seq_len: int, heads: int, head_dim: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    shape = (1, heads, seq_len, head_dim)
    q, k, v, d_out = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    scale = head_dim ** -0.5
    bufs = [to_device(device, x, dtype) for x in (q, k, v, d_out)]
    out, d_q, d_k, d_v = (device.buffer(shape, dtype, name=n) for n in ("out", "d_q", "d_k", "d_v"))
    lse = device.buffer(shape[:3], "float32", name="lse")
    sizes = dict(batch=1, heads=heads, kv_heads=heads, q_len=seq_len, kv_len=seq_len, head_dim=head_dim,
                 scale=scale, causal=True)

    forward = device.sequence(timestamps=True)
    attention_forward(forward, *bufs[:3], out, lse, **sizes)
    both = device.sequence(timestamps=True)
    attention_forward(both, *bufs[:3], out, lse, **sizes)
    attention_backward(both, *bufs[:3], out, bufs[3], lse, d_q, d_k, d_v, **sizes, algorithm="scalar")
    fwd_s, both_s = gpu_seconds(forward, repeats), gpu_seconds(both, repeats)
    flops = 4 * heads * seq_len * seq_len * head_dim / 2  # causal: half the score matrix
    result = {"dtype": dtype, "seq": seq_len, "heads": heads, "head_dim": head_dim,
              "forward_ms": fwd_s * 1e3, "forward_tflops": flops / fwd_s * 1e-12,
              "fwd_bwd_ms": both_s * 1e3, "fwd_bwd_tflops": 3.5 * flops / both_s * 1e-12}
    # The cooperative-matrix backward where the device has one ("auto" picks it there; the line above is the
    # scalar kernel, asked for by name).
    coopmat_grads = None
    if coopmat_backward_tiles(device, dtype, head_dim, 0, 0, 0, 0) is not None:
        coopmat_grads = [device.buffer(shape, dtype, name=n) for n in ("d_q", "d_k", "d_v")]
        both_coopmat = device.sequence(timestamps=True)
        attention_forward(both_coopmat, *bufs[:3], out, lse, **sizes)
        attention_backward(both_coopmat, *bufs[:3], out, bufs[3], lse, *coopmat_grads, **sizes, algorithm="coopmat")
        seconds = gpu_seconds(both_coopmat, repeats)
        result.update(fwd_bwd_coopmat_ms=seconds * 1e3, fwd_bwd_coopmat_tflops=3.5 * flops / seconds * 1e-12)

    if HAVE_CUDA:
        tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        tq, tk, tv, tdo = (torch.from_numpy(x).cuda().to(tdtype) for x in (q, k, v, d_out))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with torch.no_grad():
            result["torch_forward_ms"] = cuda_median(lambda: sdpa(tq, tk, tv, is_causal=True), repeats) * 1e3
        leaves = [x.detach().requires_grad_() for x in (tq, tk, tv)]

        def fwd_bwd():
            for x in leaves:
                x.grad = None
            sdpa(*leaves, is_causal=True).backward(tdo)

        result["torch_fwd_bwd_ms"] = cuda_median(fwd_bwd, repeats) * 1e3
        # Full-size agreement with PyTorch (float32 math on the same rounded inputs).
        ref = [x.detach().float().requires_grad_() for x in leaves]
        ref_out = sdpa(*ref, is_causal=True)
        ref_out.backward(tdo.float())
        compared = [("out", out, ref_out), ("d_q", d_q, ref[0].grad), ("d_k", d_k, ref[1].grad),
                    ("d_v", d_v, ref[2].grad)]
        if coopmat_grads:
            compared += [(f"coopmat_{name}", ours, theirs) for (name, _, theirs), ours in zip(compared[1:], coopmat_grads)]
        for name, ours, theirs in compared:
            diff = np.abs(as_float32(ours.read(), dtype) - theirs.detach().cpu().numpy()).max()
            result[f"max_abs_diff_{name}_vs_torch_fp32"] = float(diff)
        result["reference"] = "torch sdpa (CUDA, same dtype)"
    else:
        result["torch_forward_ms"] = numpy_attention_seconds(q, k, v, scale) * 1e3
        result["reference"] = "numpy float32 forward (CPU)"
    result["forward_ratio"] = result["torch_forward_ms"] / result["forward_ms"]
    if "torch_fwd_bwd_ms" in result:
        result["fwd_bwd_ratio"] = result["torch_fwd_bwd_ms"] / result["fwd_bwd_ms"]
        if "fwd_bwd_coopmat_ms" in result:
            result["fwd_bwd_coopmat_ratio"] = result["torch_fwd_bwd_ms"] / result["fwd_bwd_coopmat_ms"]
    return result


def tuning_words(tiles) -> list[str]:
    """The tuning options ``tiles`` carries, as the sweeps name them."""
    return [k.replace("_", "-") for k in ("prefetch", "batched_staging", "lazy_rescale", "reg_softmax", "p_in_regs",
                                          "double_buffer") if getattr(tiles, k)]


def forward_variants(device, dtype: str, head_dim: int) -> list:
    """(name, tiles) of the cooperative-matrix forward kernels the device can run at ``head_dim``: the two-pass kernel
    at its automatic tiles; the automatic choice ("default"); the one-pass kernel with the softmax through shared
    memory at its leading shapes, with each tuning option; the register softmax (where the device's measured layout
    allows it) with each option and shape; then the ablations, each the shared-memory one-pass kernel less one part of
    its work."""
    two_pass = coopmat_forward_tiles(device, dtype, head_dim, 0, 0, 0, candidates=COOPMAT_TWO_PASS_TILES)
    default = coopmat_forward_tiles(device, dtype, head_dim, 0, 0, 0)
    plain = coopmat_forward_tiles(device, dtype, head_dim, 0, 0, 0, candidates=coopmat_forward_candidates(head_dim))
    if two_pass is None or default is None or plain is None:
        return []
    limit = int(device.limits["max_compute_shared_memory_size"])
    subgroup = int(device.limits["subgroup_size"])
    runs = lambda t: t.fits(subgroup) and t.shared_bytes(head_dim, subgroup) <= limit and t.runs_on(device, dtype)
    shape = lambda t: f"{t.rows}x{t.cols}"
    named = lambda t: " ".join([f"one-pass {shape(t)}"] + tuning_words(t))
    variants = [(f"two-pass {shape(two_pass)}", two_pass), (named(default) + " (default)", default)]
    variants += [(named(t) + " shared-memory softmax", t) for t in COOPMAT_FORWARD_TILES[:2]
                 if t != default and runs(t)]
    for options in (dict(prefetch=True), dict(batched_staging=True), dict(lazy_rescale=True),
                    dict(prefetch=True, lazy_rescale=True), dict(double_buffer=True),
                    dict(reg_softmax=True), dict(reg_softmax=True, p_in_regs=True),
                    dict(reg_softmax=True, p_in_regs=True, lazy_rescale=True),
                    dict(reg_softmax=True, p_in_regs=True, prefetch=True),
                    dict(reg_softmax=True, p_in_regs=True, double_buffer=True),
                    dict(reg_softmax=True, double_buffer=True)):
        tiles = replace(plain, **options)
        if tiles != default and runs(tiles):
            variants.append((named(tiles), tiles))
    wide = replace(COOPMAT_WIDE_KEY_TILES, prefetch=True, lazy_rescale=True)
    if runs(wide):
        variants.append((named(wide), wide))
    # The register softmax frees the score space: other shapes fit (128 x 64 up to head dim 128; 64 x 16 double
    # buffered at head dim 256).
    for rows, cols in ((64, 32), (128, 32), (64, 64), (128, 64), (64, 16)):
        for options in (dict(reg_softmax=True, p_in_regs=True),
                        dict(reg_softmax=True, p_in_regs=True, double_buffer=True)):
            tiles = CoopmatTiles(rows, cols, **options)
            if (rows, cols) != (plain.rows, plain.cols) and tiles != default and runs(tiles):
                variants.append((named(tiles), tiles))
    variants += [(f"ablation {shape(plain)}: {what}", replace(plain, ablation=value))
                 for what, value in ABLATIONS.items()]
    return variants


def bench_forward_sweep(device, dtype: str, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                        repeats: int, rounds: int = 2) -> list[dict]:
    """Causal forward of each cooperative-matrix variant (and the scalar kernel where none runs), beside SDPA, timed
    once per round (all variants, then all again), so that the rounds of one run can agree or not."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, heads, seq_len, head_dim), dtype=np.float32)
    k, v = (rng.standard_normal((1, kv_heads, seq_len, head_dim), dtype=np.float32) for _ in range(2))
    bufs = [to_device(device, x, dtype) for x in (q, k, v)]
    out = device.buffer(q.shape, dtype, name="out")
    lse = device.buffer(q.shape[:3], "float32", name="lse")
    sizes = dict(batch=1, heads=heads, kv_heads=kv_heads, q_len=seq_len, kv_len=seq_len, head_dim=head_dim,
                 scale=head_dim ** -0.5, causal=True)
    torch_ms, ref = None, None
    if HAVE_CUDA:
        tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        tq, tk, tv = (torch.from_numpy(x).cuda().to(tdtype) for x in (q, k, v))
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                          enable_gqa=heads != kv_heads)
        with torch.no_grad():
            torch_ms = cuda_median(sdpa, repeats) * 1e3
            group = heads // kv_heads
            ref = torch.nn.functional.scaled_dot_product_attention(
                tq.float(), tk.float().repeat_interleave(group, 1), tv.float().repeat_interleave(group, 1),
                is_causal=True).cpu().numpy()
            torch_diff = float(np.abs(sdpa().float().cpu().numpy() - ref).max())  # PyTorch's own error in dtype
    flops = 4 * heads * seq_len * seq_len * head_dim / 2
    where = f"{dtype:9s} seq {seq_len} heads {heads}/{kv_heads} d {head_dim} causal forward"
    # Record each variant once (a variant the driver refuses, e.g. out of registers, is reported and left out) and
    # check its output against SDPA once.
    recorded = []
    for name, tiles in forward_variants(device, dtype, head_dim) or [("scalar", None)]:
        try:
            seq = device.sequence(timestamps=True)
            attention_forward(seq, *bufs, out, lse, **sizes, tiles=tiles,
                              algorithm="scalar" if tiles is None else "auto")
            seq.replay()
        except Exception as error:  # noqa: BLE001
            print(f"{where}, {name}: failed: {type(error).__name__}: {error}")
            continue
        diff = None if ref is None else float(np.abs(as_float32(out.read(), dtype) - ref).max())
        recorded.append((name, tiles, seq, diff))
    times = {name: [] for name, *_ in recorded}
    for round_index in range(rounds):
        for name, tiles, seq, diff in recorded:
            times[name].append(gpu_seconds(seq, repeats, warm_up_seconds=0.3))
    default_name = next((name for name, *_ in recorded if name.endswith("(default)")), None)
    rows = []
    for name, tiles, seq, diff in recorded:
        seconds = float(np.median(times[name]))
        r = {"dtype": dtype, "seq": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
             "variant": name, "tuning": None if tiles is None else tiles.tuning, "forward_ms": seconds * 1e3,
             "forward_ms_rounds": [t * 1e3 for t in times[name]], "forward_tflops": flops / seconds * 1e-12}
        if default_name and name != default_name and not name.startswith("ablation"):
            gains = [d / t for d, t in zip(times[default_name], times[name])]  # > 1: faster than the default
            r["gain_vs_default_rounds"] = gains
            r["rounds_agree"] = ("faster" if min(gains) > 1.02 else "slower" if max(gains) < 0.98 else "no")
        if torch_ms is not None:
            r.update(torch_forward_ms=torch_ms, forward_ratio=torch_ms / r["forward_ms"],
                     max_abs_diff_vs_torch_fp32=diff, torch_max_abs_diff_vs_fp32=torch_diff)
        rows.append(r)
        rounds_text = "/".join(f"{t:.3f}" for t in r["forward_ms_rounds"])
        line = f"{where}, {name:56s}: {r['forward_ms']:.3f} ms (rounds {rounds_text}; {r['forward_tflops']:.1f} TFLOP/s"
        if "gain_vs_default_rounds" in r:
            line += ", vs default " + "/".join(f"{g:.3f}x" for g in r["gain_vs_default_rounds"])
            line += f" agree: {r['rounds_agree']}"
        if torch_ms is not None:
            line += (f", sdpa {torch_ms:.3f} ms, ratio {r['forward_ratio']:.3f}, max diff "
                     f"{r['max_abs_diff_vs_torch_fp32']:.1e} (sdpa's {torch_diff:.1e})")
        print(line + ")")
    return rows


def backward_variants(device, dtype: str, head_dim: int) -> list:
    """(name, tiles) of the cooperative-matrix backward kernels the device can run at ``head_dim``: the automatic
    tiles ("default"), each option on them and on the other shapes."""
    default = coopmat_backward_tiles(device, dtype, head_dim, 0, 0, 0, 0)
    if default is None:
        return []
    variants = [(" ".join([f"{default.rows}x{default.cols}", *tuning_words(default), "(default)"]), default)]
    for t in COOPMAT_BACKWARD_TILES[:2]:
        for options in ({}, dict(reg_softmax=True), dict(reg_softmax=True, p_in_regs=True), dict(double_buffer=True),
                        dict(reg_softmax=True, p_in_regs=True, double_buffer=True)):
            tiles = replace(t, **options)
            if tiles != default and coopmat_backward_tiles(device, dtype, head_dim, 0, 0, 0, 0, candidates=[tiles]):
                variants.append((" ".join([f"{t.rows}x{t.cols}", *tuning_words(tiles)]), tiles))
    return variants


def bench_backward_sweep(device, dtype: str, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                         repeats: int, rounds: int = 2) -> list[dict]:
    """Causal backward of each cooperative-matrix backward variant after the automatic forward, beside SDPA's
    forward + backward, timed once per round as the forward sweep."""
    rng = np.random.default_rng(0)
    q, d_out = (rng.standard_normal((1, heads, seq_len, head_dim), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, kv_heads, seq_len, head_dim), dtype=np.float32) for _ in range(2))
    bufs = [to_device(device, x, dtype) for x in (q, k, v, d_out)]
    out = device.buffer(q.shape, dtype, name="out")
    lse = device.buffer(q.shape[:3], "float32", name="lse")
    grads = [device.buffer(x.shape, dtype, name=n) for x, n in ((q, "d_q"), (k, "d_k"), (v, "d_v"))]
    sizes = dict(batch=1, heads=heads, kv_heads=kv_heads, q_len=seq_len, kv_len=seq_len, head_dim=head_dim,
                 scale=head_dim ** -0.5, causal=True)
    forward = device.sequence(timestamps=True)
    attention_forward(forward, *bufs[:3], out, lse, **sizes)
    forward.replay()
    where = f"{dtype:9s} seq {seq_len} heads {heads}/{kv_heads} d {head_dim} causal backward"
    torch_ms, refs = None, None
    if HAVE_CUDA:
        tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        leaves = [torch.from_numpy(x).cuda().to(tdtype).requires_grad_() for x in (q, k, v)]
        tdo = torch.from_numpy(d_out).cuda().to(tdtype)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd_bwd():
            for x in leaves:
                x.grad = None
            sdpa(*leaves, is_causal=True, enable_gqa=heads != kv_heads).backward(tdo)

        torch_ms = cuda_median(fwd_bwd, repeats) * 1e3
        group = heads // kv_heads
        ref = [x.detach().float().requires_grad_() for x in leaves]
        sdpa(ref[0], ref[1].repeat_interleave(group, 1), ref[2].repeat_interleave(group, 1),
             is_causal=True).backward(tdo.float())
        refs = [x.grad.cpu().numpy() for x in ref]
        fwd_bwd()
        torch_diffs = [float(np.abs(x.grad.float().cpu().numpy() - r).max()) for x, r in zip(leaves, refs)]
    recorded = []
    for name, tiles in backward_variants(device, dtype, head_dim):
        try:
            seq = device.sequence(timestamps=True)
            attention_backward(seq, *bufs[:3], out, bufs[3], lse, *grads, **sizes, tiles=tiles, algorithm="coopmat")
            seq.replay()
        except Exception as error:  # noqa: BLE001
            print(f"{where}, {name}: failed: {type(error).__name__}: {error}")
            continue
        diffs = None if refs is None else [float(np.abs(as_float32(g.read(), dtype) - r).max())
                                           for g, r in zip(grads, refs)]
        recorded.append((name, tiles, seq, diffs))
    fwd_times, times = [], {name: [] for name, *_ in recorded}
    for _ in range(rounds):
        fwd_times.append(gpu_seconds(forward, repeats, warm_up_seconds=0.3))
        for name, tiles, seq, diffs in recorded:
            times[name].append(gpu_seconds(seq, repeats, warm_up_seconds=0.3))
    fwd_ms = float(np.median(fwd_times)) * 1e3
    flops = 2.5 * 4 * heads * seq_len * seq_len * head_dim / 2  # causal; backward = 2.5 forwards
    default_name = recorded[0][0] if recorded else None
    rows = []
    for name, tiles, seq, diffs in recorded:
        bwd_ms = float(np.median(times[name])) * 1e3
        r = {"dtype": dtype, "seq": seq_len, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
             "variant": name, "tuning": getattr(tiles, "tuning", None), "backward_ms": bwd_ms,
             "backward_ms_rounds": [t * 1e3 for t in times[name]], "backward_tflops": flops / bwd_ms * 1e-9,
             "forward_ms": fwd_ms, "fwd_bwd_ms": fwd_ms + bwd_ms}
        line = (f"{where}, {name:36s}: {bwd_ms:.3f} ms (rounds {'/'.join(f'{t:.3f}' for t in r['backward_ms_rounds'])};"
                f" {r['backward_tflops']:.1f} TFLOP/s; with the forward {r['fwd_bwd_ms']:.3f} ms")
        if name != default_name:
            gains = [d / t for d, t in zip(times[default_name], times[name])]
            r.update(gain_vs_default_rounds=gains,
                     rounds_agree="faster" if min(gains) > 1.02 else "slower" if max(gains) < 0.98 else "no")
            line += ", vs default " + "/".join(f"{g:.3f}x" for g in gains) + f" agree: {r['rounds_agree']}"
        if torch_ms is not None:
            r.update(torch_fwd_bwd_ms=torch_ms, fwd_bwd_ratio=torch_ms / r["fwd_bwd_ms"],
                     max_abs_diff_dq_dk_dv_vs_torch_fp32=diffs, torch_max_abs_diff_dq_dk_dv_vs_fp32=torch_diffs)
            line += (f", sdpa fwd+bwd {torch_ms:.3f} ms, ratio {r['fwd_bwd_ratio']:.3f}, max diff d_q/d_k/d_v "
                     + "/".join(f"{x:.1e}" for x in diffs) + " (sdpa's " + "/".join(f"{x:.1e}" for x in torch_diffs)
                     + ")")
        rows.append(r)
        print(line + ")")
    return rows


def print_layouts(device) -> None:
    """The measured accumulator layout (the register softmax runs only where it has the form it needs)."""
    for dtype in ("float16", "bfloat16"):
        layout = coopmat_layout(device, dtype)
        print(f"cooperative-matrix layout {dtype}: "
              + ("none usable (no register softmax)" if layout is None else
                 f"{layout.row_slots} rows per lane, lanes sharing a row: mask {layout.row_lane_mask}, slots "
                 f"{layout.slots}, A operands as accumulators: {layout.a_matches_accumulator}"))


def bench_decode(device, dtype: str, kv_len: int, heads: int, kv_heads: int, head_dim: int, repeats: int,
                 general: bool = False, heads_per_workgroup: int | None = None,
                 keys_per_tile: int | None = None, features: str = "") -> dict:
    """``general``: the fallback forward kernel with one query row (for K/V rows that are not whole 16-byte
    vectors). ``features``: "softcap", "window", "alibi" or "all": the options of a Gemma 2, Mistral or BLOOM
    model, run by the same decode kernel as the plain path."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, heads, 1, head_dim), dtype=np.float32)
    k, v = (rng.standard_normal((1, kv_heads, kv_len, head_dim), dtype=np.float32) for _ in range(2))
    out = device.buffer(q.shape, dtype, name="out")
    on = lambda name: features in (name, "all")
    options = dict(softcap=50.0 if on("softcap") else 0.0, window=kv_len // 2 if on("window") else 0,
                   alibi_slopes=device.upload((2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32))
                   if on("alibi") else None)
    seq = device.sequence(timestamps=True)
    attention_decode(seq, *(to_device(device, x, dtype) for x in (q, k, v)), out, batch=1, heads=heads,
                     kv_heads=kv_heads, kv_len=kv_len, max_len=kv_len, head_dim=head_dim, scale=head_dim ** -0.5,
                     tiles=DECODE_TILES[0] if general else None, heads_per_workgroup=heads_per_workgroup,
                     keys_per_tile=keys_per_tile, **options)
    seconds = gpu_seconds(seq, repeats)
    cache_bytes = 2 * kv_heads * kv_len * head_dim * dt.as_dtype(dtype).itemsize
    result = {"dtype": dtype, "kv_len": kv_len, "heads": heads, "kv_heads": kv_heads, "general": general,
              "features": features,
              "heads_per_workgroup": heads_per_workgroup, "keys_per_tile": keys_per_tile,
              "decode_us": seconds * 1e6, "decode_cache_gbps": cache_bytes / seconds * 1e-9}
    if HAVE_CUDA:
        tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        tq, tk, tv = (torch.from_numpy(x).cuda().to(tdtype) for x in (q, k, v))
        group = heads // kv_heads
        tk, tv = tk.repeat_interleave(group, 1), tv.repeat_interleave(group, 1)
        with torch.no_grad():
            result["torch_decode_us"] = cuda_median(
                lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv), repeats) * 1e6
        result["decode_ratio"] = result["torch_decode_us"] / result["decode_us"]
    return result


def print_prefill(r: dict, dtype: str, seq_len: int, heads: int, head_dim: int, results: dict) -> None:
    results["prefill"].append(r)
    line = (f"{dtype:9s} seq {seq_len} heads {heads} d {head_dim} causal: forward {r['forward_ms']:.3f} ms "
            f"({r['forward_tflops']:.1f} TFLOP/s, ref {r['torch_forward_ms']:.3f} ms, ratio {r['forward_ratio']:.3f})")
    if "fwd_bwd_ratio" in r:
        line += (f"; fwd+bwd (scalar backward) {r['fwd_bwd_ms']:.3f} ms ({r['fwd_bwd_tflops']:.1f} TFLOP/s, "
                 f"ref {r['torch_fwd_bwd_ms']:.3f} ms, ratio {r['fwd_bwd_ratio']:.3f})")
    else:
        line += f"; fwd+bwd (scalar backward) {r['fwd_bwd_ms']:.3f} ms"
    if "fwd_bwd_coopmat_ms" in r:
        line += f"; fwd+bwd with the coopmat backward {r['fwd_bwd_coopmat_ms']:.3f} ms"
        if "fwd_bwd_coopmat_ratio" in r:
            line += f" (ratio {r['fwd_bwd_coopmat_ratio']:.3f})"
    print(line)
    diffs = {k: v for k, v in r.items() if k.startswith("max_abs_diff")}
    if diffs:
        print("          " + ", ".join(f"{k[13:]} {v:.2e}" for k, v in diffs.items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke test)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=0,
                        help="decode: KV heads (default heads / 4); --forward-sweep: only these KV heads (default both "
                             "heads and heads / 4)")
    parser.add_argument("--dtypes", default="float16,float32,bfloat16")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill (forward, backward) rows")
    parser.add_argument("--forward-sweep", action="store_true",
                        help="only the causal forward of each cooperative-matrix variant, tile shape and tuning "
                             "option, and the ablations (the default kernel less one part of its work: wrong "
                             "results, for where the time goes), bf16 (or --dtypes), at seq 2048 and 8192 (or --seq), "
                             "head dims 64 and 128 (or --head-dims), MHA and GQA (4 query heads per KV head; or "
                             "--kv-heads), beside SDPA")
    parser.add_argument("--backward-sweep", action="store_true",
                        help="only the causal backward of each cooperative-matrix backward variant (after the "
                             "automatic forward), bf16 (or --dtypes), at seq 2048 and 8192 (or --seq), head dims 64 "
                             "and 128 (or --head-dims), MHA and GQA (or --kv-heads), beside SDPA's forward + backward")
    parser.add_argument("--rounds", type=int, default=2,
                        help="--forward-sweep: time every variant this many times, all variants per round")
    parser.add_argument("--head-dims", default="64,128", help="--forward-sweep: head dims")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="decode: also time each number of query heads per workgroup and tile size")
    args = parser.parse_args(argv)
    device = get_device()
    seq_len, heads, repeats = (256, 4, 3) if args.quick else (args.seq, args.heads, 10)
    print(f"device: {device.name}; reference: {'torch CUDA sdpa' if HAVE_CUDA else 'numpy CPU'}")
    results = {"device": device.name, "prefill": [], "decode": [], "forward_sweep": [], "backward_sweep": []}
    if args.forward_sweep or args.backward_sweep:
        print_layouts(device)
        seqs = [256] if args.quick else ([args.seq] if args.seq != 2048 else [2048, 8192])
        dtypes = [d for d in args.dtypes.split(",") if d != "float32"] if args.dtypes != parser.get_default("dtypes") \
            else ["bfloat16"]
        for dtype in dtypes:
            for seq_len in seqs:
                for head_dim in (int(d) for d in args.head_dims.split(",")):
                    for kv_heads in ([args.kv_heads] if args.kv_heads else [heads, heads // 4]):
                        sweep = bench_backward_sweep if args.backward_sweep else bench_forward_sweep
                        results["backward_sweep" if args.backward_sweep else "forward_sweep"] += sweep(
                            device, dtype, seq_len, heads, max(1, kv_heads), head_dim, repeats, args.rounds)
        write_results(args.json, results)
        return 0
    for dtype in args.dtypes.split(","):
        if not args.decode_only:
            print_prefill(bench_prefill(device, dtype, seq_len, heads, args.head_dim, repeats), dtype, seq_len, heads,
                          args.head_dim, results)
        # a long cache, then a short one (a decode step of a short chat), each by attention_decode.comp (plain, and
        # with soft-capping, a sliding window of half the cache, ALiBi, or all three) and by the forward kernel with
        # one query row (the fallback, general=True); --decode-sweep also times attention_decode.comp with each
        # number of query heads per workgroup
        kv_heads = args.kv_heads or max(1, heads // 4)
        group = heads // kv_heads
        sweep = ([(h, keys) for keys in (64, 128) for h in range(1, 9) if group % h == 0] if args.decode_sweep
                 else [(None, None)])
        for kv_len in (256 if args.quick else 4096, 80):
            runs = [(False, h, "") for h in sweep] + [(False, (None, None), f) for f in FEATURES] \
                + [(True, (None, None), "")]
            for general, (per_group, keys), features in runs:
                d = bench_decode(device, dtype, kv_len, heads, kv_heads, args.head_dim, repeats, general, per_group,
                                 keys, features)
                results["decode"].append(d)
                what = (", fallback forward kernel" if general else f", {features}" if features else
                        f", {per_group} heads per workgroup, {keys}-key tiles" if per_group else "")
                print(f"          decode kv_len {d['kv_len']} (kv_heads {d['kv_heads']}{what}): "
                      f"{d['decode_us']:.1f} us, {d['decode_cache_gbps']:.0f} GB/s of cache"
                      + (f" (torch {d['torch_decode_us']:.1f} us, ratio {d['decode_ratio']:.3f})"
                         if "decode_ratio" in d else ""))
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
