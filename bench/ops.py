"""Op benchmarks: the replay overhead of a 200-op graph, then matmul and attention (bench/matmul.py,
bench/attention.py, run as subprocesses with the same flags).

Replay overhead: 200 dependent elementwise ops on 4096 elements recorded as one sequence
(one submit) against the same ops pre-recorded one per sequence and submitted in turn
(200 submits), in this process on the same device; plus the same graph built from
tensors through the engine (plan-cache hit, input upload, readback).

    python bench/ops.py [--quick] [--json OUT] [--skip-kernels]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from common import write_results

import vkformers as vkf
from vkformers.engine.kernels import elementwise as K

HERE = os.path.dirname(os.path.abspath(__file__))


def chain(x, ops: int):
    for _ in range(ops // 2):
        x = x * 1.0001 + 0.001
    return x


def seconds_per_call(fn, repeats: int) -> float:
    fn()  # records the plans / warms up
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def replay_overhead(ops: int, repeats: int) -> dict:
    """The same ops as one recorded sequence, and as one pre-recorded sequence per op submitted in turn."""
    device = vkf.get_device()
    n = 4096
    buffers = [device.upload(np.ones(n, np.float32), name=f"x{i}") for i in range(2)]

    def record(seq, i):  # op i: ping-pong between two buffers, each op reading the last one's output
        src, dst = buffers[i % 2], buffers[(i + 1) % 2]
        K.unary(seq, "mul_scalar", src, None, dst, (n,), scalars=(1.0001,))

    whole = device.sequence()
    for i in range(ops):
        record(whole, i)
    singles = []
    for i in range(ops):
        seq = device.sequence()
        record(seq, i)
        singles.append(seq)

    def one_at_a_time():
        for seq in singles:
            seq.replay()

    data = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    return {"graph_ops": ops,
            "one_sequence_ms": seconds_per_call(whole.replay, repeats) * 1e3,
            "one_at_a_time_ms": seconds_per_call(one_at_a_time, repeats) * 1e3,
            "engine_graph_ms": seconds_per_call(lambda: chain(vkf.tensor(data), ops).numpy(), repeats) * 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (lavapipe)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--skip-kernels", action="store_true", help="only the replay-overhead measurement")
    args = parser.parse_args(argv)
    results = {"device": vkf.get_device().name, "replay": replay_overhead(200, 5 if args.quick else 20)}
    r = results["replay"]
    r["speedup"] = r["one_at_a_time_ms"] / r["one_sequence_ms"]
    print(f"device: {results['device']}")
    print(f"{r['graph_ops']} dependent elementwise ops: {r['one_sequence_ms']:.2f} ms as one replayed sequence, "
          f"{r['one_at_a_time_ms']:.2f} ms submitted one at a time ({r['speedup']:.1f}x); through the engine "
          f"(tensors, plan cache, upload and readback): {r['engine_graph_ms']:.2f} ms")
    if not args.skip_kernels:
        for name in ("matmul", "attention"):
            out = f"{args.json}.{name}.json" if args.json else os.devnull
            flags = (["--quick"] if args.quick else []) + ["--json", out]
            subprocess.run([sys.executable, os.path.join(HERE, f"{name}.py"), *flags], check=True)
            if args.json:
                with open(out) as f:
                    results[name] = json.load(f)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
