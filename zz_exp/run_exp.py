"""Throwaway: time experimental coopmat kernels beside the current one and torch."""
import json, os, sys, time
from pathlib import Path
import numpy as np
from vkformers.runtime.kernels import KernelDir, add_kernel_dir_provider
from vkformers.runtime.vulkan import get_device
from vkformers.runtime import dtypes as dt
from vkformers.engine.kernels.matmul import matmul, CoopmatConfig

HERE = Path(__file__).resolve().parent
add_kernel_dir_provider(lambda: [KernelDir("exp", None, HERE / "spv")])
d = get_device()
print(d.name, d.limits.get("subgroup_size"), flush=True)
out = {}
rng = np.random.default_rng(0)
data = {}
def bufs(size, dtype):
    if (size, dtype) not in data:
        x = rng.standard_normal((size, size), dtype=np.float32)
        y = rng.standard_normal((size, size), dtype=np.float32)
        if dtype == "bfloat16":
            xs, ys = dt.to_bfloat16(x), dt.to_bfloat16(y)
            xr, yr = dt.from_bfloat16(xs), dt.from_bfloat16(ys)
        else:
            xs, ys = x.astype(np.float16), y.astype(np.float16)
            xr, yr = xs.astype(np.float32), ys.astype(np.float32)
        data[(size, dtype)] = (d.upload(xs, dtype=dtype), d.upload(ys, dtype=dtype), xr, yr)
    return data[(size, dtype)]

def tf(size, s): return 2 * size**3 / s / 1e12

def check(c, xr, yr, size, label):
    got = c.read().reshape(size, size)
    if got.dtype == np.uint16: got = dt.from_bfloat16(got)
    got = got.astype(np.float32)
    rows = [0, 1, 129, size - 1]
    ref = xr[rows] @ yr
    err = float(np.abs(got[rows] - ref).max() / np.abs(ref).max())
    return err

def time_exp(variant, size, dtype, spec=(), bn=128):
    a, b, xr, yr = bufs(size, dtype)
    c = d.buffer((size, size), "float32")
    k = d.kernel("exp", variant)
    seq = d.sequence(timestamps=True)
    for _ in range(10):
        seq.dispatch(k, [a, b, c], (size // bn, size // 128, 1), [size, size, size], list(spec))
    seq.replay(); seq.replay()
    t = float(np.median([t for l, t in seq.timings()]))
    return tf(size, t), check(c, xr, yr, size, variant)

def time_cur(size, dtype, out_dtype, cfg=None):
    a, b, xr, yr = bufs(size, dtype)
    c = d.buffer((size, size), out_dtype)
    seq = d.sequence(timestamps=True)
    for _ in range(10):
        matmul(seq, a, b, c, m=size, n=size, k=size, algorithm="coopmat", coopmat=cfg)
    seq.replay(); seq.replay()
    t = float(np.median([t for l, t in seq.timings() if l.startswith("matmul")]))
    return tf(size, t), check(c, xr, yr, size, "cur")

def torch_ref(size, dtype):
    import torch
    x = torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype)); y = torch.randn_like(x)
    for _ in range(5): torch.matmul(x, y)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); torch.matmul(x, y); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    return tf(size, float(np.median(ts)))

def rec(name, fn):
    try:
        r = fn()
    except Exception as exc:
        r = f"ERROR {exc!r}"[:300]
    out[name] = r
    print(f"{name:40s} {r}", flush=True)

SIZES = (128,) if "--quick" in sys.argv else (8192, 4096)
for size in SIZES:
    rec(f"torch f16 {size}", lambda: torch_ref(size, "float16"))
    rec(f"torch bf16 {size}", lambda: torch_ref(size, "bfloat16"))
    rec(f"cur f16->f32 {size}", lambda: time_cur(size, "float16", "float32"))
    rec(f"cur f16->f16 {size}", lambda: time_cur(size, "float16", "float16"))
    rec(f"cur bf16->bf16 {size}", lambda: time_cur(size, "bfloat16", "bfloat16"))
    rec(f"cur f16->f32 bk64 {size}", lambda: time_cur(size, "float16", "float32", CoopmatConfig(2, 4, 64)))
    for v in ("base", "bk32", "sg41", "nopref", "nomss", "f16stage", "loopidx", "nounroll", "nocoh"):
        rec(f"exp {v} {size}", lambda: time_exp(v, size, "float16"))
    rec(f"exp big {size}", lambda: time_exp("big", size, "float16", bn=256))
    rec(f"exp specwg {size}", lambda: time_exp("specwg", size, "float16", [256, 256, 64]))
    rec(f"exp bf16 {size}", lambda: time_exp("bf16", size, "bfloat16"))
    rec(f"exp bf16bk32 {size}", lambda: time_exp("bf16bk32", size, "bfloat16"))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "exp.json"), "w"), indent=1)
