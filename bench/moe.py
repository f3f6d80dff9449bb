"""Mixture-of-experts speed: a Mixtral-shaped model with random weights; greedy decode, a prompt's forward (prefill)
and a training step (forward + backward), each with the experts running only on the tokens that chose them
(experts mode "routed", vkformers_moe.block.set_experts_mode) and with every expert on every token ("dense"), in
the same run, beside transformers +
PyTorch CUDA (eager, its own weights: speed only) where a CUDA GPU is present.

A decode step skips the experts that no token chose (the small-m kernel reads none of their weights); a prefill or
training step packs the tokens' rows expert after expert into one matrix on the GPU and multiplies each expert's rows
only, about top_k / num_experts of the experts' dense work ("routed"); "listed" gives each expert its own list of
tokens instead, prefill and training only. Also the peak device memory of
a training step (bytes of live device buffers) in each mode.

    python bench/moe.py [--quick] [--dtype bfloat16] [--layers 8] [--new-tokens 32] [--prompt 512] [--json OUT]
                        [--experts 8] [--top-k 2] [--expert-size 5632] [--profile]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from common import profile_gpu, warm_up, write_results
from llama import DECODE_REPEATS, WARM_UP_SECONDS, random_weights, timed

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.runtime import vulkan
from vkformers.models.loading import AutoModelForCausalLM
from vkformers_moe import block as moe_block

# Mixtral's layout (8 experts, 2 per token) at TinyLlama's width.
MIXTRAL = dict(model_type="mixtral", hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048,
               num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
               tie_word_embeddings=False, hidden_act="silu")
# vkformers_moe.block.EXPERTS_MODES: every expert on every token; the tokens' rows of all experts packed into one
# matrix; one list of tokens per expert ([tokens, hidden] each).
MODES = ("dense", "routed", "listed")
QUICK = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000)


def bench_vkformers(config, weights, dtype, prompt, new_tokens, long_prompt, profile=False) -> dict:
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, dtype=dtype, requires_grad=True)
    params = [p for _, p in model.named_parameters()]
    model.eval()
    out = {}

    def train_step():
        """Forward, loss and backward (one submission: backward() computes the gradients before it returns;
        before 2026-12-02 it left them lazy, so this step, which never reads them, ran the forward and loss only).
        """
        for p in params:
            p.grad = None
        loss = model(long_prompt, labels=long_prompt).loss
        loss.backward()
        return loss.item()

    def train_peak_gib():
        """Device memory a training step adds to the weights: activations, gradients and the step's scratch (its
        recorded plan is dropped first, so that the step allocates what it holds)."""
        for p in params:
            p.grad = None
        lazy.clear_plan_cache()
        before = vulkan.buffer_memory()["live_bytes"]
        vulkan.reset_peak_buffer_memory()
        train_step()
        return (vulkan.buffer_memory()["peak_bytes"] - before) / 2**30

    # Two rounds, the modes in turn, each figure the faster of its two: the first measure of a process ran up to
    # 2x slow on the H200. Decoding (fewer than COMPACT_MIN_TOKENS tokens) is the same routed or listed.
    for name in list(MODES) * 2:
        moe_block.set_experts_mode(model, name)  # also drops the captured steps of the other mode's graph
        speeds = {}
        for batch in (1, 8) if name != "listed" else ():
            ids = prompt[:batch]
            generate = lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            warm_up(generate, WARM_UP_SECONDS)
            speeds[f"decode_b{batch}"] = batch * new_tokens / timed(generate, DECODE_REPEATS)
        with vkf.no_grad():
            step = lazy.StepCapture()  # from the third call a replay, without the Python graph
            seconds = timed(lambda: step.run(lambda: [model(long_prompt).logits[:, -1]], {"ids": long_prompt}), 5)
        speeds["prefill"] = long_prompt.size / seconds
        speeds["train"] = long_prompt.size / timed(train_step, 3)
        for measure, speed in speeds.items():
            key = f"{measure}_{name}_tok_s"
            out[key] = max(out.get(key, 0.0), speed)
        out[f"train_{name}_peak_gib"] = train_peak_gib()
    moe_block.set_experts_mode(model, "routed")
    if profile:  # profile_gpu records the step afresh (it clears the plan cache)
        profile_gpu(f"{dtype} train step {long_prompt.size} (routed)", train_step)
    return out


def bench_torch(config, dtype, prompt, new_tokens, long_prompt) -> dict:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    model = MixtralForCausalLM(MixtralConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model = model.to("cuda", torch_dtype)
    ids = torch.from_numpy(prompt.astype(np.int64)).cuda()
    long_ids = torch.from_numpy(long_prompt.astype(np.int64)).cuda()
    out = {}

    def train_step():
        model.zero_grad(set_to_none=True)
        model(long_ids, labels=long_ids).loss.backward()
        torch.cuda.synchronize()
    out["train_tok_s"] = long_prompt.size / timed(train_step, 3)
    model.eval()
    with torch.no_grad():
        for batch in (1, 8):
            def generate():
                model.generate(ids[:batch], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                torch.cuda.synchronize()
            warm_up(generate, WARM_UP_SECONDS)
            out[f"decode_b{batch}_tok_s"] = batch * new_tokens / timed(generate, DECODE_REPEATS)

        def prefill():
            model(long_ids).logits[:, -1].float().cpu()
        out["prefill_tok_s"] = long_prompt.size / timed(prefill, 5)
    model.to("cpu")
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model (lavapipe)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8, --quick 2)")
    parser.add_argument("--new-tokens", type=int, help="tokens per generate call (default 32, --quick 8)")
    parser.add_argument("--prompt", type=int, help="prefill and training tokens (default 512, --quick 128)")
    parser.add_argument("--experts", type=int, help="experts per layer (default 8): many experts, e.g. 64 with "
                        "--top-k 8 and --expert-size 1408, is where packing saves the most memory")
    parser.add_argument("--top-k", type=int, help="experts per token (default 2)")
    parser.add_argument("--expert-size", type=int, help="each expert's intermediate width (default 5632, --quick 1408)")
    parser.add_argument("--profile", action="store_true", help="also print the GPU time per kernel of a training "
                        "step (routed)")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    config = dict(MIXTRAL, **(QUICK if args.quick else {}))
    if args.layers:
        config["num_hidden_layers"] = args.layers
    for option, key in ((args.experts, "num_local_experts"), (args.top_k, "num_experts_per_tok"),
                        (args.expert_size, "intermediate_size")):
        if option:
            config[key] = option
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    weights = random_weights(AutoModelForCausalLM.from_config(config))
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, config["vocab_size"], (8, 16)).astype(np.int32)
    long_prompt = rng.integers(0, config["vocab_size"], (1, args.prompt or (128 if args.quick else 512)))
    long_prompt = long_prompt.astype(np.int32)
    try:
        import torch
        use_torch = torch.cuda.is_available()
    except ImportError:
        use_torch = False
    results = {"device": vkf.get_device().name, "config": config, "dtype": args.dtype,
               "vkformers": bench_vkformers(config, weights, args.dtype, prompt, new_tokens, long_prompt,
                                            args.profile)}
    if use_torch:
        results["torch"] = bench_torch(config, args.dtype, prompt, new_tokens, long_prompt)
    ours = results["vkformers"]
    for measure, unit in (("decode_b1", "tok/s"), ("decode_b8", "tok/s"), ("prefill", "tok/s"), ("train", "tok/s")):
        routed, dense = ours[f"{measure}_routed_tok_s"], ours[f"{measure}_dense_tok_s"]
        line = f"{args.dtype} {measure:9s}: routed {routed:9.1f} {unit}, dense {dense:9.1f} ({routed / dense:.2f}x)"
        if use_torch:
            ref = results["torch"][f"{measure}_tok_s"]
            line += f", transformers eager {ref:9.1f} ({routed / ref:.2f}x)"
        print(line, flush=True)
    print(f"{args.dtype} one list per expert: prefill {ours['prefill_listed_tok_s']:.1f} tok/s, train "
          f"{ours['train_listed_tok_s']:.1f} ({ours['train_routed_tok_s'] / ours['train_listed_tok_s']:.2f}x packed "
          f"/ listed); train step peak memory: packed {ours['train_routed_peak_gib']:.3f} GiB, listed "
          f"{ours['train_listed_peak_gib']:.3f}, dense {ours['train_dense_peak_gib']:.3f}", flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
