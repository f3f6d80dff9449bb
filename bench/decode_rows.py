"""Batched decode products: ``decode_matvec`` at several rows over the Llama-3-8B shape's products, bfloat16.

Records the four fused products of a decode step (q/k/v + norm + rotary + cache write, o_proj + residual, gate/up +
norm + activation, down + residual) over 8 layers of distinct weights at each row count and launch shape, replays
them with a timestamp after every op, and prints the weights' GB/s per product and over the layer; then torch
``x @ W.T`` over the same shapes on CUDA when PyTorch sees a GPU (each product over one set of weights, repeated).
Where the fused kernel stops paying against the cooperative-matrix tiles is read off these figures
(engine/ops/decode.py FUSED_DENSE_MAX_BYTES).

    python bench/decode_rows.py [--rows 8,4,2] [--layers 8] [--shapes default,4x2x2x0,...]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from quant import SWEEP_PRODUCTS, product_bytes, record_products, sweep_weights, time_products

from vkformers.runtime import vulkan

SHAPES = ("default", "4x4x1x0", "4x2x2x0", "4x4x2x0", "4x1x4x0", "8x2x2x0", "4x2x2x1", "4x1x2x0")


def line(tag: str, seconds) -> str:
    sizes = product_bytes(None)
    cells = "  ".join(f"{n / t * 1e-9:6.0f}" for n, t in zip(sizes, seconds))
    return f"  {tag:20s} {cells} | layer {sum(sizes) / sum(seconds) * 1e-9:6.0f} GB/s {sum(seconds) * 1e6:7.1f} us"


def torch_seconds(torch, rows: int) -> np.ndarray:
    seconds = []
    for _, _, k, widths in SWEEP_PRODUCTS:
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for n in widths]
        for _ in range(5):
            [x @ w.T for w in ws]
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(50):
            [x @ w.T for w in ws]
        end.record()
        torch.cuda.synchronize()
        seconds.append(begin.elapsed_time(end) / 50 * 1e-3)
    return np.array(seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8,4,2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="launch shapes: default, or subgroups x in flight x pairs x split k")
    args = parser.parse_args(argv)
    device = vulkan.get_device()
    weights = sweep_weights(device, None, args.layers)
    print(f"device: {device.name}; GB/s of weights per product ({', '.join(p[0] for p in SWEEP_PRODUCTS)}) and "
          f"over the layer", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        print(f"rows {rows}")
        for shape in args.shapes.split(","):
            launch = None if shape == "default" else tuple(int(v) for v in shape.split("x"))
            try:
                seq = record_products(device, None, weights, launch, rows)
                print(line(f"fused {shape}", time_products(seq, 5, 0.5)), flush=True)
            except Exception as exc:  # a shape the device refuses
                print(f"  fused {shape}: failed: {str(exc).splitlines()[0][:100]}", flush=True)
    try:
        import torch
        if torch.cuda.is_available():
            for rows in (int(r) for r in args.rows.split(",")):
                print(f"torch rows {rows}")
                print(line("x @ W.T", torch_seconds(torch, rows)), flush=True)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
