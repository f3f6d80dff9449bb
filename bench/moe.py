"""Mixture-of-experts decoding: a Mixtral-shaped model with random weights, greedy decode with and without skipping
the experts that no token of a step chose (vkformers_moe.block.GATE_UNCHOSEN_EXPERTS), in the same run, beside
transformers + PyTorch CUDA (eager, its own weights: speed only) where a CUDA GPU is present.

Outside autograd the experts' products are gated: the small-m kernel (up to 8 rows of a decode step) reads none of
an unchosen expert's weights, so a step reads about top_k / num_experts of the expert weights (plus the shared
layers) instead of all of them.

    python bench/moe.py [--quick] [--dtype bfloat16] [--layers 8] [--new-tokens 32] [--json OUT]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from common import warm_up, write_results
from llama import DECODE_REPEATS, WARM_UP_SECONDS, random_weights, timed

import vkformers as vkf
from vkformers.models.loading import AutoModelForCausalLM
from vkformers_moe import block as moe_block

# Mixtral's layout (8 experts, 2 per token) at TinyLlama's width.
MIXTRAL = dict(model_type="mixtral", hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048,
               num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
               tie_word_embeddings=False, hidden_act="silu")
QUICK = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=1000)


def bench_vkformers(config, weights, dtype, prompt, new_tokens) -> dict:
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, dtype=dtype, requires_grad=False)
    model.eval()
    out = {}
    for gated in (True, False):
        moe_block.GATE_UNCHOSEN_EXPERTS = gated
        for batch in (1, 8):
            ids = prompt[:batch]
            generate = lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            warm_up(generate, WARM_UP_SECONDS)
            seconds = timed(generate, DECODE_REPEATS)
            out[f"decode_b{batch}_{'gated' if gated else 'dense'}_tok_s"] = batch * new_tokens / seconds
    moe_block.GATE_UNCHOSEN_EXPERTS = True
    return out


def bench_torch(config, dtype, prompt, new_tokens) -> dict:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    model = MixtralForCausalLM(MixtralConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model = model.to("cuda", torch_dtype).eval()
    ids = torch.from_numpy(prompt.astype(np.int64)).cuda()
    out = {}
    with torch.no_grad():
        for batch in (1, 8):
            def generate():
                model.generate(ids[:batch], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                torch.cuda.synchronize()
            warm_up(generate, WARM_UP_SECONDS)
            out[f"decode_b{batch}_tok_s"] = batch * new_tokens / timed(generate, DECODE_REPEATS)
    model.to("cpu")
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model (lavapipe)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8, --quick 2)")
    parser.add_argument("--new-tokens", type=int, help="tokens per generate call (default 32, --quick 8)")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    config = dict(MIXTRAL, **(QUICK if args.quick else {}))
    if args.layers:
        config["num_hidden_layers"] = args.layers
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    weights = random_weights(AutoModelForCausalLM.from_config(config))
    prompt = np.random.default_rng(1).integers(0, config["vocab_size"], (8, 16)).astype(np.int32)
    try:
        import torch
        use_torch = torch.cuda.is_available()
    except ImportError:
        use_torch = False
    results = {"device": vkf.get_device().name, "config": config, "dtype": args.dtype,
               "vkformers": bench_vkformers(config, weights, args.dtype, prompt, new_tokens)}
    if use_torch:
        results["torch"] = bench_torch(config, args.dtype, prompt, new_tokens)
    ours = results["vkformers"]
    for batch in (1, 8):
        gated, dense = ours[f"decode_b{batch}_gated_tok_s"], ours[f"decode_b{batch}_dense_tok_s"]
        line = f"{args.dtype} decode b{batch}: gated {gated:9.1f} tok/s, dense {dense:9.1f} ({gated / dense:.2f}x)"
        if use_torch:
            ref = results["torch"][f"decode_b{batch}_tok_s"]
            line += f", transformers eager {ref:9.1f} ({gated / ref:.2f}x)"
        print(line, flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
