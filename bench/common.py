"""What the benchmarks share: the PyTorch CUDA reference (when this machine has one) and result files."""
from __future__ import annotations

import json

import numpy as np


def cuda_torch():
    """The torch module when it sees a CUDA GPU, else None (the benchmark then uses its CPU reference)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def cuda_median(fn, repeats: int) -> float:
    """Median seconds of ``fn`` on the GPU, timed with CUDA events after 3 warm-up calls."""
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def write_results(path: str | None, results) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def profile_gpu(name: str, fn, runs: int = 2) -> None:
    """Print wall time against GPU time per kernel for ``fn`` (a vkformers step): the plan cache is
    cleared so that the plans are recorded with timestamps, then ``fn`` runs ``runs`` times."""
    import time

    from vkformers.engine import lazy
    lazy.clear_plan_cache()
    with lazy.profile() as prof:
        fn()  # records the plans, with timestamps since a profile is active
        prof.kernels.clear()
        prof.replays = 0
        start = time.perf_counter()
        for _ in range(runs):
            fn()
        wall = (time.perf_counter() - start) / runs
    gpu = prof.gpu_seconds / runs
    print(f"[profile] {name}: wall {wall * 1e3:.2f} ms, GPU {gpu * 1e3:.2f} ms per run "
          f"(host and submit overhead {max(wall - gpu, 0) * 1e3:.2f} ms)")
    print(prof.report())
