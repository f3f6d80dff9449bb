"""``vkformers bench``: how fast this device runs vkformers, against numpy on this machine's CPU.

Two parts, both with nothing but the installed package:
- matrix products of n x n x n (GPU time from timestamps) for each input dtype the device runs, checked against
  numpy and timed against numpy's float32 product of the same size;
- a causal LM's prefill and cached greedy decode (wall time, tokens/s): ``--model`` (a folder, hub id or .gguf),
  else a small random Llama.
The repository's ``bench/`` scripts go further (PyTorch CUDA references, the TinyLlama shape, attention); their
figures are in docs/benchmarks.md.
"""
from __future__ import annotations

import json
import time

import numpy as np

from vkformers.cli.model_option import MODEL_SPELLINGS, add_gguf_file_option, resolve_model
from vkformers.engine.function import no_grad
from vkformers.engine.kernels import matmul as KM
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import get_device
from vkformers.training import init_weights

# A small random Llama (GQA, SwiGLU, RoPE) for when no --model is given; --quick halves it.
RANDOM_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=512, intermediate_size=1408,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=8192,
                    max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0)


def add_parser(subparsers):
    parser = subparsers.add_parser("bench", help="time matrix products and a model's prefill and decode")
    parser.add_argument("--model", help=f"{MODEL_SPELLINGS} (default: a small random Llama)")
    add_gguf_file_option(parser)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="the model's dtype (default float32)")
    parser.add_argument("--size", type=int, default=1024, help="n of the n x n x n matrix products")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.set_defaults(func=run)
    return parser


def _median(times) -> float:
    return float(np.median(times))


def _matmul_dtypes(device) -> list[str]:
    """float32, and the 16-bit inputs the device can compute in (cooperative-matrix kernels where it has them, else
    widened to float32 in the tiled kernel)."""
    return [name for name in ("float32", "float16", "bfloat16") if device.supports_dtype(name)]


def bench_matmul(device, n: int, dtype: str, repeats: int) -> dict:
    """GPU seconds of one n x n x n product (float32 accumulation and output) against numpy float32."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, n, n), dtype=np.float32)
    if dtype == "bfloat16":
        a_host, b_host = dt.to_bfloat16(a), dt.to_bfloat16(b)
        a_exact, b_exact = dt.from_bfloat16(a_host), dt.from_bfloat16(b_host)
    else:
        a_host, b_host = a.astype(dt.as_dtype(dtype).host), b.astype(dt.as_dtype(dtype).host)
        a_exact, b_exact = a_host.astype(np.float32), b_host.astype(np.float32)
    a_dev, b_dev = device.upload(a_host, dtype=dtype), device.upload(b_host, dtype=dtype)
    c_dev = device.buffer((n, n), "float32", name="bench c")
    seq = device.sequence(timestamps=True)
    KM.matmul(seq, a_dev, b_dev, c_dev, m=n, n=n, k=n)
    seq.replay()
    times = []
    for _ in range(repeats):
        seq.replay()
        times.append(sum(t for _, t in seq.timings()[1:]))
    seconds = _median(times)
    want = a_exact.astype(np.float64) @ b_exact.astype(np.float64)
    error = float(np.abs(c_dev.read().reshape(n, n) - want).max() / max(1.0, np.abs(want).max()))
    numpy_times = []
    for _ in range(max(1, repeats // 2)):
        start = time.perf_counter()
        a @ b
        numpy_times.append(time.perf_counter() - start)
    numpy_seconds = _median(numpy_times)
    flops = 2.0 * n ** 3
    return {"dtype": dtype, "n": n, "tflops": flops / seconds * 1e-12, "numpy_float32_tflops": flops / numpy_seconds * 1e-12,
            "ratio_to_numpy": numpy_seconds / seconds, "max_relative_error": error}


def _random_model(config: dict, dtype: str):
    model = AutoModelForCausalLM.from_config(config)
    init_weights(model, seed=0, dtype=dtype)  # normal(0, initializer_range) matrices, ones for norms
    return model.eval()


def bench_model(model, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    """Prefill (the whole prompt, its last logits read back) and cached greedy decode at batch 1, in tokens/s."""
    ids = np.random.default_rng(1).integers(3, max(4, vocab - 1), (1, prompt_len)).astype(np.int32)
    with no_grad():
        model(ids).logits[:, -1].numpy()  # records the prefill plan
        start = time.perf_counter()
        model(ids).logits[:, -1].numpy()
        prefill = time.perf_counter() - start
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)  # records the decode plans
        start = time.perf_counter()
        out = model.generate(ids[:, :8], max_new_tokens=new_tokens, do_sample=False)
        decode = time.perf_counter() - start
    generated = out.shape[1] - 8
    return {"prompt_len": prompt_len, "prefill_tok_s": prompt_len / prefill,
            "new_tokens": int(generated), "decode_tok_s": generated / decode}


def run(args) -> int:
    model_name = resolve_model(args.model, args.gguf_file)  # a hub repo's GGUF file fetched: its local path
    device = get_device()
    n = 256 if args.quick else args.size
    repeats = 3 if args.quick else 10
    print(f"device: {device.name} ({device.info['type']})")
    results = {"device": device.name, "matmul": [], "model": None}
    if model_name:  # loaded first: a wrong --model is said before minutes of timing
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=args.dtype, requires_grad=False)
        name = args.model
    else:
        config = dict(RANDOM_LLAMA, num_hidden_layers=2, hidden_size=256, intermediate_size=704) if args.quick \
            else RANDOM_LLAMA
        model = _random_model(config, args.dtype)
        name = (f"random Llama (hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
                f"vocab {config['vocab_size']})")
    for dtype in _matmul_dtypes(device):
        r = bench_matmul(device, n, dtype, repeats)
        results["matmul"].append(r)
        print(f"matmul {n}^3 {dtype:9s} {r['tflops']:8.3f} TFLOP/s  (numpy float32 {r['numpy_float32_tflops']:.3f}, "
              f"{r['ratio_to_numpy']:.2f}x; max relative error {r['max_relative_error']:.1e})")
    vocab = int(model.config.get("vocab_size", 32000))
    prompt_len, new_tokens = (16, 8) if args.quick else (args.prompt_len, args.new_tokens)
    m = bench_model(model, prompt_len, new_tokens, vocab)
    results["model"] = dict(m, name=name, dtype=args.dtype)
    print(f"{name} {args.dtype}: prefill {m['prompt_len']} tokens {m['prefill_tok_s']:.1f} tok/s, "
          f"decode batch 1 {m['decode_tok_s']:.1f} tok/s ({m['new_tokens']} new tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
