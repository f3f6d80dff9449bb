"""What the benchmarks share: the PyTorch CUDA reference (when this machine has one) and result files."""
from __future__ import annotations

import json
import threading
import time

import numpy as np

# Llama-3-8B's shape.
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu")

# The H200 lowers its clocks when idle and raises them over the first second or so of load: the same 512-token
# prefill replay took 52 ms right after loading and 14 ms three seconds later, and a 4096^3 fp16 matmul timed
# after an idle pause (numpy checks) ran at 40 TFLOP/s against 229 warm. So every timing runs after a warm-up,
# in both frameworks, and neither pays for the other's clock ramp.
WARM_UP_SECONDS = 1.0


def warm_up(fn, seconds: float = WARM_UP_SECONDS) -> None:
    """Run ``fn`` repeatedly for ``seconds`` (untimed)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()


def replay_timings(seq, seconds: float = WARM_UP_SECONDS) -> list[tuple[str, float]]:
    """GPU timestamps (label, seconds) of one replay of ``seq`` after ``seconds`` of warm-up replays."""
    warm_up(seq.replay, seconds)
    seq.replay()
    return seq.timings()


def cuda_torch():
    """The torch module when it sees a CUDA GPU, else None (the benchmark then uses its CPU reference)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def cuda_median(fn, repeats: int, warm_up_seconds: float = WARM_UP_SECONDS) -> float:
    """Median seconds of ``fn`` on the GPU, timed with CUDA events after ``warm_up_seconds`` of calls."""
    import torch

    def call_and_wait():
        fn()
        torch.cuda.synchronize()
    warm_up(call_and_wait, warm_up_seconds)
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


def run_clients(client, jobs: list) -> float:
    """Seconds for one thread per job, each running ``client(job)``, all started together and joined."""
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start
