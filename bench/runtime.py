"""Runtime benchmark: replay latency, copy bandwidth, and what barriers cost in a dependent chain.

Every figure is printed beside a reference measured in the same run:
- replay latency: against the same operations submitted the way stock kp must
  (a fresh sequence recorded and evaluated each time), and, with --stock-kp DIR,
  against stock kp 0.9.0 itself in a subprocess;
- copy bandwidth: against a PyTorch CUDA device copy when torch sees a GPU, else
  a numpy copy on the CPU;
- dependent chain: barriers as the recorder places them, against no barriers.

    python bench/runtime.py [--quick] [--json OUT] [--stock-kp DIR]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from common import write_results

from vkformers.runtime.vulkan import get_device


def per_call(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds per call over ``repeats`` calls, in 5 batches."""
    for _ in range(warmup):
        fn()
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(max(1, repeats // 5)):
            fn()
        batches.append((time.perf_counter() - start) / max(1, repeats // 5))
    return float(np.median(batches))


def tiny_chain(device, count: int, barriers: str = "tracked"):
    """``count`` dependent tiny dispatches (each reads what the previous wrote)."""
    kernel = device.kernel("axpby", "u32")
    a, b = device.upload(np.ones(256, np.uint32)), device.upload(np.zeros(256, np.uint32))
    seq = device.sequence(barriers=barriers)
    for i in range(count):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        seq.dispatch(kernel, [src, dst], (1,), [256, 1, 1])
    return seq


def replay_latency(device, repeats: int) -> dict:
    results = {}
    for count in (0, 1, 100):
        seq = tiny_chain(device, count)
        results[f"replay_{count}_dispatch_us"] = per_call(seq.replay, repeats) * 1e6
    # Reference in the same process: what stock kp's API forces per step (record + eval every time).
    results["record_and_eval_1_dispatch_us"] = per_call(lambda: tiny_chain(device, 1).replay(), repeats // 4) * 1e6
    return results


STOCK_KP_SCRIPT = r"""
import time, numpy as np, kp, sys
spirv = open(sys.argv[1], 'rb').read()
mgr = kp.Manager()
a = mgr.tensor_t(np.ones(256, np.uint32)); b = mgr.tensor_t(np.zeros(256, np.uint32))
algo = mgr.algorithm([a, b], spirv, [1, 1, 1], np.zeros(0, np.uint32), np.array([256, 1, 1], np.uint32))
seq = mgr.sequence().record(kp.OpAlgoDispatch(algo, np.array([256, 1, 1], np.uint32)))
for _ in range(20): seq.eval()
times = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(200): seq.eval()
    times.append((time.perf_counter() - t) / 200)
print(np.median(times) * 1e6)
"""


def stock_kp_latency(device, stock_dir: str) -> float:
    """1-dispatch replay through unpatched kp 0.9.0, in a subprocess that imports it from ``stock_dir``."""
    spirv = str(device.kernel("axpby", "u32").path)
    env = {**os.environ, "PYTHONPATH": stock_dir}
    out = subprocess.run([sys.executable, "-c", STOCK_KP_SCRIPT, spirv], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def copy_bandwidth(device, nbytes: int) -> dict:
    kernel = device.kernel("copy")
    n_vec4 = nbytes // 16
    src, dst = device.buffer(nbytes // 4, "uint32", name="src"), device.buffer(nbytes // 4, "uint32", name="dst")
    groups = min(n_vec4 // 256, device.limits["max_compute_work_group_count_x"])
    y = -(-n_vec4 // (groups * 256))
    seq = device.sequence(timestamps=True)
    for _ in range(10):
        seq.dispatch(kernel, [src, dst], (groups, y), [n_vec4])
    seq.replay()
    seq.replay()
    gpu_seconds = np.median([t for label, t in seq.timings() if label == "copy"])
    ours = 2 * nbytes / gpu_seconds  # bytes read + written
    result = {"copy_bytes": nbytes, "copy_GBps": ours / 1e9}
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError
        a = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        ref = 2 * nbytes / (start.elapsed_time(end) / 1e3 / 10)
        result.update(reference="torch.cuda copy_", reference_GBps=ref / 1e9)
    except ImportError:
        a = np.ones(nbytes // 4, np.uint32)
        b = np.empty_like(a)
        ref = 2 * nbytes / per_call(lambda: np.copyto(b, a), 10)
        result.update(reference="numpy copyto (CPU)", reference_GBps=ref / 1e9)
    result["ratio"] = result["copy_GBps"] / result["reference_GBps"]
    return result


def barrier_cost(device, count: int, n: int, repeats: int) -> dict:
    kernel = device.kernel("axpby", "u32")
    bufs = [device.upload(np.ones(n, np.uint32), name=f"chain{i}") for i in range(2)]
    groups = (-(-n // 256),)
    out = {}
    for mode in ("tracked", "none"):
        seq = device.sequence(barriers=mode)
        for i in range(count):
            seq.dispatch(kernel, [bufs[i % 2], bufs[(i + 1) % 2]], groups, [n, 1, 1])
        out[f"chain_{mode}_us"] = per_call(seq.replay, repeats) * 1e6
    out["chain_dispatches"], out["chain_elements"] = count, n
    out["barrier_overhead"] = out["chain_tracked_us"] / out["chain_none_us"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (for a CPU device)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--stock-kp", metavar="DIR", help="a folder holding an unpatched kp 0.9.0 module")
    args = parser.parse_args(argv)
    device = get_device()
    repeats = 50 if args.quick or device.is_cpu else 1000
    copy_bytes = (32 << 20) if args.quick or device.is_cpu else (1 << 30)
    results = {"device": device.name}
    results.update(replay_latency(device, repeats))
    if args.stock_kp:
        results["stock_kp_replay_1_dispatch_us"] = stock_kp_latency(device, args.stock_kp)
    results.update(copy_bandwidth(device, copy_bytes))
    results.update(barrier_cost(device, 100, 1 << (14 if args.quick or device.is_cpu else 20), repeats // 10))

    print(f"device: {results['device']}")
    for count in (0, 1, 100):
        print(f"replay of a {count:>3}-dispatch sequence: {results[f'replay_{count}_dispatch_us']:9.1f} us")
    print(f"record + eval per step (stock kp's only way to change a dispatch), 1 dispatch: "
          f"{results['record_and_eval_1_dispatch_us']:.1f} us")
    if "stock_kp_replay_1_dispatch_us" in results:
        stock = results["stock_kp_replay_1_dispatch_us"]
        print(f"stock kp 0.9.0 eval of a 1-dispatch sequence: {stock:.1f} us "
              f"(ours {stock / results['replay_1_dispatch_us']:.1f}x faster)")
    print(f"copy {results['copy_bytes'] >> 20} MiB: {results['copy_GBps']:.1f} GB/s vs {results['reference']} "
          f"{results['reference_GBps']:.1f} GB/s = {results['ratio']:.2f}x")
    print(f"{results['chain_dispatches']} dependent dispatches of {results['chain_elements']} elements: "
          f"{results['chain_tracked_us']:.1f} us with barriers, {results['chain_none_us']:.1f} us without "
          f"({results['barrier_overhead']:.2f}x)")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
