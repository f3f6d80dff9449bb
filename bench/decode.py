"""Decode-step products: the weight reads of one token through the TinyLlama 1.1B shape.

One decode token multiplies a single row by every weight of the model: per layer the fused
q/k/v projection (with rotary and the cache write), o_proj with the residual, the gated
gate/up product and down_proj, then the lm_head; 2.07 GB of bfloat16 weights, each read
once, so the time is bound by memory bandwidth. This records that chain of
decode_matvec dispatches (shaders/common/decode_matvec.comp) over distinct weights (no
cache reuse across layers), replays it with GPU timestamps, and prints the time per token
and the bandwidth it reached, beside the same chain of torch.nn.functional.linear calls on
CUDA in the same run when PyTorch sees a GPU (numpy float32 matvecs on the CPU otherwise).

    python bench/decode.py [--dtype bfloat16] [--layers 22] [--sweep] [--breakdown] [--json OUT]

--sweep times every launch shape (subgroups per workgroup, vectors in flight per lane,
pairs of columns per subgroup, k split among the workgroup's subgroups)
instead of the default one only.
"""
from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

from common import cuda_torch, write_results

import vkformers as vkf
from vkformers.engine.kernels import decode as KD
from vkformers.runtime import dtypes as dt

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000
HEAD_DIM = HIDDEN // HEADS


def record_chain(device, dtype: str, layers: int, launch) -> tuple:
    """The decode products of one token as one timestamped sequence; returns (sequence, bytes of weights)."""
    buf = lambda n, name: device.buffer(n, dtype, name=name)  # contents do not matter for timing
    kv = KV_HEADS * HEAD_DIM
    x, h = buf(HIDDEN, "x"), buf(HIDDEN, "h")
    q, act = buf(HIDDEN, "q"), buf(FFN, "act")
    k_cache, v_cache = buf(KV_HEADS * 128 * HEAD_DIM, "k_cache"), buf(KV_HEADS * 128 * HEAD_DIM, "v_cache")
    positions = device.upload(np.zeros(1, np.int32))
    start = device.upload(np.zeros(1, np.uint32))
    inv_freq = device.upload(np.ones(HEAD_DIM // 2, np.float32))
    norm = buf(HIDDEN, "norm")
    logits = buf(VOCAB, "logits")
    seq = device.sequence(timestamps=True)
    for _ in range(layers):
        wq, wk, wv = buf(HIDDEN * HIDDEN, "wq"), buf(kv * HIDDEN, "wk"), buf(kv * HIDDEN, "wv")
        wo, wg, wu, wd = (buf(HIDDEN * HIDDEN, "wo"), buf(FFN * HIDDEN, "wg"), buf(FFN * HIDDEN, "wu"),
                          buf(HIDDEN * FFN, "wd"))
        KD.decode_matvec(seq, x, [wq, wk, wv], q, rows=1, k=HIDDEN, widths=[HIDDEN, kv, kv], mode="qkv",
                         norm_weight=norm, norm=True, out1=k_cache, out2=v_cache, positions=positions,
                         cache_start=start, inv_freq=inv_freq, head_dim=HEAD_DIM, rot_dim=HEAD_DIM,
                         kv_heads=KV_HEADS, capacity=128, launch=launch)
        KD.decode_matvec(seq, q, [wo], h, rows=1, k=HIDDEN, widths=[HIDDEN], residual=x, launch=launch)
        KD.decode_matvec(seq, h, [wg, wu], act, rows=1, k=HIDDEN, widths=[FFN, FFN], mode="gated",
                         norm_weight=norm, norm=True, launch=launch)
        KD.decode_matvec(seq, act, [wd], x, rows=1, k=FFN, widths=[HIDDEN], residual=h, launch=launch)
    head = buf(VOCAB * HIDDEN, "lm_head")
    KD.decode_matvec(seq, x, [head], logits, rows=1, k=HIDDEN, widths=[VOCAB], norm_weight=norm, norm=True,
                     launch=launch)
    return seq, layers * sum(product_bytes(dtype)) + VOCAB * HIDDEN * dt.as_dtype(dtype).itemsize


PRODUCTS = ("qkv + norm + rotary", "o_proj + residual", "gate/up + norm + act", "down + residual")


def product_bytes(dtype: str) -> list[int]:
    kv, size = KV_HEADS * HEAD_DIM, dt.as_dtype(dtype).itemsize
    return [(HIDDEN + 2 * kv) * HIDDEN * size, HIDDEN * HIDDEN * size, 2 * FFN * HIDDEN * size, FFN * HIDDEN * size]


def breakdown(seq, dtype: str, repeats: int) -> list[tuple[str, float, float]]:
    """(product, median microseconds per launch over the layers, GB/s) for each kind of product, then the lm_head."""
    per_op = []
    for _ in range(repeats):
        seq.replay()
        per_op.append([t for label, t in seq.timings()[1:] if label != "barrier"])
    per_op = np.median(np.array(per_op), axis=0)
    layers, head = per_op[:-1].reshape(-1, 4), per_op[-1]
    sizes = product_bytes(dtype) + [VOCAB * HIDDEN * dt.as_dtype(dtype).itemsize]
    times = list(np.median(layers, axis=0)) + [head]
    return [(name, t * 1e6, n / t * 1e-9) for name, t, n in zip(PRODUCTS + ("lm_head + norm",), times, sizes)]


def gpu_seconds(seq, repeats: int) -> tuple[float, float]:
    """Median GPU seconds of one replay (all recorded operations), and of its dispatches alone (no barriers)."""
    seq.replay()
    total, dispatches = [], []
    for _ in range(repeats):
        seq.replay()
        timings = seq.timings()[1:]
        total.append(sum(t for _, t in timings))
        dispatches.append(sum(t for label, t in timings if label != "barrier"))
    return float(np.median(total)), float(np.median(dispatches))


def torch_seconds(torch, dtype: str, layers: int, repeats: int) -> float:
    """The same products as torch linear calls on CUDA (no norm, rotary or cache write), per token."""
    from common import cuda_median
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    kv = KV_HEADS * HEAD_DIM
    make = lambda n, k: torch.empty(n, k, dtype=tdtype, device="cuda").normal_(0, 0.02)
    weights = [(make(HIDDEN + 2 * kv, HIDDEN), make(HIDDEN, HIDDEN), make(2 * FFN, HIDDEN), make(HIDDEN, FFN))
               for _ in range(layers)]
    head = make(VOCAB, HIDDEN)
    x = torch.randn(1, HIDDEN, dtype=tdtype, device="cuda")
    F = torch.nn.functional

    def token():
        h = x
        for wqkv, wo, wgu, wd in weights:
            F.linear(h, wqkv)
            h = h + F.linear(h, wo)
            gate, up = F.linear(h, wgu).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, wd)
        return F.linear(h, head)

    with torch.no_grad():
        return cuda_median(token, repeats)


def numpy_seconds(layers: int) -> float:
    """float32 matvecs in numpy on the CPU over the same shapes (only a sanity reference)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(HIDDEN, dtype=np.float32)
    shapes = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)]
    mats = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    start = time.perf_counter()
    for m in mats:
        m @ (x if m.shape[1] == HIDDEN else np.resize(x, FFN))
    return (time.perf_counter() - start) * layers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="also print each product's time and bandwidth")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    device = vkf.get_device()
    torch = cuda_torch()
    if torch is not None:
        ref, ref_name = torch_seconds(torch, args.dtype, args.layers, args.repeats), "torch CUDA linear"
    else:
        ref, ref_name = numpy_seconds(args.layers), "numpy float32 (CPU)"
    print(f"device: {device.name}; {args.layers} layers, {args.dtype}; reference {ref_name}: {ref * 1e3:.3f} ms/token")
    default = KD.launch_shape(device)
    shapes = [default]
    if args.sweep:
        shapes += [s for s in itertools.product((1, 2, 4, 8), (2, 4, 8), (1, 2), (0, 1))
                   if s != default and not (s[3] and s[0] == 1)]
    results = {"device": device.name, "dtype": args.dtype, "layers": args.layers, "reference": ref_name,
               "reference_ms": ref * 1e3, "runs": []}
    for shape in shapes:
        seq, nbytes = record_chain(device, args.dtype, args.layers, shape)
        total, dispatches = gpu_seconds(seq, args.repeats)
        run = {"launch": shape, "default": shape == default, "ms": total * 1e3, "dispatch_ms": dispatches * 1e3,
               "gbps": nbytes / dispatches * 1e-9, "ratio": ref / total}
        results["runs"].append(run)
        print(f"launch {shape}{' (default)' if shape == default else ''}: {total * 1e3:.3f} ms/token "
              f"(dispatches {dispatches * 1e3:.3f} ms, {run['gbps']:.0f} GB/s of weights), "
              f"ratio {run['ratio']:.2f} against the reference", flush=True)
        if args.breakdown:
            run["breakdown"] = breakdown(seq, args.dtype, args.repeats)
            for name, us, gbps in run["breakdown"]:
                print(f"    {name:22s} {us:8.1f} us  {gbps:6.0f} GB/s")
        del seq
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
