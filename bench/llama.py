"""Llama benchmark: the 1.1B TinyLlama shape (--shape llama3-8b: Llama-3-8B's) with random weights, vkformers
against transformers + PyTorch CUDA.

Measures, for each dtype: prefill of 512 tokens (tokens/s, batch 1), generate with one new token after
prompts of 8 different lengths (100-127: a serving-like mix; prompt tokens/s) and greedy decode
(new tokens/s) at batch 1 and batch 8, with the same config and the same random weights
in both frameworks, in the same process, each after a few seconds of warm-up prefills. Without CUDA (or
--no-torch) only vkformers runs.

    python bench/llama.py [--shape tinyllama] [--dtypes bfloat16,float32] [--layers 22] [--new-tokens 64]
                          [--fused-ab] [--skinny-ab] [--no-torch] [--json OUT]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from common import LLAMA3_8B, profile_gpu, warm_up, write_results

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.engine.kernels import matmul as KM
from vkformers.engine.ops import decode as fused_decode
from vkformers.models.loading import AutoModelForCausalLM

TINYLLAMA = dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
SHAPES = {"tinyllama": TINYLLAMA, "llama3-8b": LLAMA3_8B}


def random_weights(model, seed=0, shared: bool = False) -> dict[str, np.ndarray]:
    """``shared``: slots of one shape share one array (every layer the same values), so that the host holds one
    layer's worth (the 8B shape)."""
    rng = np.random.default_rng(seed)
    weights, made = {}, {}
    for name, slot in model.named_slots():
        if slot.tied_to is not None:
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            weights[name] = np.ones(slot.shape, np.float32)
        elif shared and tuple(slot.shape) in made:
            weights[name] = made[tuple(slot.shape)]
        else:
            weights[name] = made[tuple(slot.shape)] = rng.standard_normal(slot.shape, dtype=np.float32) * 0.02
    return weights


WARM_UP_SECONDS = 3.0  # before each framework's first timing (see common.WARM_UP_SECONDS)
DECODE_REPEATS = 5  # generate calls timed per batch size (the median counts), in both frameworks
VARIED_LENGTHS = (100, 103, 109, 112, 117, 121, 124, 127)  # a serving-like mix: one new token after each prompt


def timed(fn, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after two untimed ones (single calls vary on a shared GPU host)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_vkformers(config, weights, dtype, prompt, new_tokens, profile=False, fused_ab=False,
                    skinny_ab=False) -> dict:
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, dtype=dtype, requires_grad=False)
    model.eval()
    out = {}
    with vkf.no_grad():
        first = np.ascontiguousarray(prompt[:1])
        warm_up(lambda: model(first).logits[:, -1].numpy(), WARM_UP_SECONDS)
        seconds = timed(lambda: model(first).logits[:, -1].numpy(), 5)
        out["prefill_tok_s"] = prompt.shape[1] / seconds
        # The same forward as a captured step: from the third call the plan replays without the Python graph.
        step = lazy.StepCapture()
        seconds = timed(lambda: step.run(lambda: [model(first).logits[:, -1]], {"ids": first}), 5)
        out["prefill_captured_tok_s"] = prompt.shape[1] / seconds
        # prompts of 8 different lengths in one bucket of generation.PREFILL_BUCKET, one new token each
        varied = [np.ascontiguousarray(prompt[:1, :n]) for n in VARIED_LENGTHS]
        seconds = timed(lambda: [model.generate(ids, max_new_tokens=1, do_sample=False) for ids in varied], 3)
        out["varied_prompts_tok_s"] = sum(VARIED_LENGTHS) / seconds
        for batch in (1, 8):
            ids = prompt[:batch, :16]
            seconds = timed(lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False),
                            DECODE_REPEATS)
            out[f"decode_b{batch}_tok_s"] = batch * new_tokens / seconds
            for fused in ((True, False) if fused_ab else ()):  # decoding with the fused kernels forced on, off
                fused_decode.enabled, default = fused, fused_decode.enabled
                seconds = timed(lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False), 1)
                fused_decode.enabled = default
                out[f"decode_b{batch}_{'fused' if fused else 'unfused'}_tok_s"] = batch * new_tokens / seconds
            if skinny_ab and batch > 1:  # the few-row products on the tile kernel instead of the skinny one
                KM.SKINNY_MAX_M, default = 0, KM.SKINNY_MAX_M
                lazy.clear_plan_cache()
                seconds = timed(lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False),
                                DECODE_REPEATS)
                KM.SKINNY_MAX_M = default
                lazy.clear_plan_cache()
                out[f"decode_b{batch}_tile_kernel_tok_s"] = batch * new_tokens / seconds
        if profile:
            profile_gpu(f"{dtype} prefill {prompt.shape[1]}", lambda: model(prompt[:1]).logits[:, -1].numpy())
            for batch in (1, 8):
                profile_gpu(f"{dtype} decode b{batch}, {new_tokens} tokens",
                            lambda: model.generate(prompt[:batch, :16], max_new_tokens=new_tokens, do_sample=False),
                            runs=1)
    return out


def bench_torch(config, weights, dtype, prompt, new_tokens) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    model = model.to("cuda", torch_dtype).eval()
    ids = torch.from_numpy(prompt.astype(np.int64)).cuda()
    out = {}

    def sync(x):
        torch.cuda.synchronize()
        return x

    with torch.no_grad():
        warm_up(lambda: sync(model(ids[:1]).logits[:, -1]), WARM_UP_SECONDS)
        out["prefill_tok_s"] = prompt.shape[1] / timed(lambda: sync(model(ids[:1]).logits[:, -1]), 5)
        seconds = timed(lambda: [sync(model.generate(ids[:1, :n], max_new_tokens=1, min_new_tokens=1,
                                                     do_sample=False)) for n in VARIED_LENGTHS], 3)
        out["varied_prompts_tok_s"] = sum(VARIED_LENGTHS) / seconds
        for batch in (1, 8):
            generate = lambda: sync(model.generate(ids[:batch, :16], max_new_tokens=new_tokens,
                                                   min_new_tokens=new_tokens, do_sample=False))
            seconds = timed(generate, DECODE_REPEATS)
            out[f"decode_b{batch}_tok_s"] = batch * new_tokens / seconds
    model.to("cpu")  # free the GPU for the next run
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--profile", action="store_true", help="also print GPU time per kernel")
    parser.add_argument("--fused-ab", action="store_true",
                        help="also time decoding with the fused decode kernels (engine/ops/decode.py) forced on and off "
                             "(by default they run on GPUs only)")
    parser.add_argument("--skinny-ab", action="store_true",
                        help="also time batched decoding with its few-row products on the cooperative-matrix tile "
                             "kernel instead of the skinny kernel (engine/kernels/matmul.py SKINNY_MAX_M = 0)")
    args = parser.parse_args(argv)
    config = dict(SHAPES[args.shape])
    config["num_hidden_layers"] = args.layers or config["num_hidden_layers"]
    weights = random_weights(AutoModelForCausalLM.from_config(config), shared=args.shape != "tinyllama")
    prompt = np.random.default_rng(1).integers(0, config["vocab_size"], (8, args.prompt_len)).astype(np.int32)
    use_torch = not args.no_torch
    if use_torch:
        try:
            import torch
            use_torch = torch.cuda.is_available()
        except ImportError:
            use_torch = False
    results = {"device": vkf.get_device().name, "config": config, "runs": {}}
    for dtype in args.dtypes.split(","):
        run = {"vkformers": bench_vkformers(config, weights, dtype, prompt, args.new_tokens, args.profile,
                                            args.fused_ab, args.skinny_ab)}
        if use_torch:
            run["torch"] = bench_torch(config, weights, dtype, prompt, args.new_tokens)
        results["runs"][dtype] = run
        for key, ours in run["vkformers"].items():
            ref = run.get("torch", {}).get(key)
            ratio = f" vs torch {ref:10.1f} = {ours / ref:5.2f}x" if ref else ""
            print(f"{dtype:9s} {key:16s} {ours:10.1f}{ratio}", flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
