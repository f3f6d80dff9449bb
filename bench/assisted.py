"""Assisted generation benchmark: greedy decoding at batch 1 with and without prompt-lookup drafts
(``generate(prompt_lookup_num_tokens=N)``), random weights of the TinyLlama shape (--shape llama3-8b: Llama-3-8B's),
vkformers against transformers + PyTorch CUDA doing the same in the same process.

The prompt is a random segment repeated (an input-grounded task: a summary or a code edit copies spans of its
input); a model with random weights then mostly continues with what it has seen, so drafts are often kept. The
figures that carry over to real models are the cost of a verification forward against a decode step and the
tokens per forward; the acceptance itself depends on the model and the text. Also timed: a replayed forward of T
tokens after 256 stored ones (T = 1 is a decode step), the verification's cost by draft length.

    python bench/assisted.py [--shape tinyllama | llama3-8b | small] [--dtype bfloat16] [--lookup 10]
                             [--new-tokens 128] [--no-torch]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from common import LLAMA3_8B, write_results
from llama import TINYLLAMA, random_weights, timed

import vkformers as vkf
from vkformers.models.decode_capture import capture_key
from vkformers.models.loading import AutoModelForCausalLM

SHAPES = {"tinyllama": TINYLLAMA, "llama3-8b": LLAMA3_8B,
          # a check that the script runs, on a CPU device
          "small": dict(TINYLLAMA, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=4096)}
REPEATS = 3  # generate calls timed per measure (the median counts)
SEGMENT, COPIES = 64, 4  # the prompt: a random segment of SEGMENT tokens, COPIES times
STORED = 256  # tokens a timed verification forward comes after
DRAFTS = (1, 2, 4, 8, 16, 32)


class Progress(dict):
    """A dict of results that prints each as it comes (a run cut by a time limit keeps what it measured)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        print(f"  ({self.name} {key}: {value})", flush=True)


def forward_costs(model, prompt: np.ndarray) -> dict:
    """Seconds of a replayed forward of T tokens after STORED stored ones, for T in DRAFTS (the cache cropped back
    after each, as a verification's rejected tokens are)."""
    cache = model._generation_cache(1, STORED + max(DRAFTS) + 1, chunks_replay=True)
    ids = np.ascontiguousarray(prompt[:, :STORED]).astype(np.int64)
    mask = np.ones((1, STORED), np.int64)
    model(ids, attention_mask=mask, cache=cache)
    key = capture_key(model, cache)
    costs = {}
    for tokens in DRAFTS:
        draft = np.ascontiguousarray(prompt[:, :tokens])  # (any tokens: the cost is the same)
        positions = np.arange(STORED, STORED + tokens, dtype=np.int32)[None]
        full_mask = np.ones((1, STORED + tokens), np.int64)

        def verify():
            model._forward_tokens(cache, draft, positions, full_mask, key)
            cache.crop(STORED)
        costs[tokens] = timed(verify, REPEATS)
    return costs


def bench_vkformers(config, weights, dtype, prompt, new_tokens, lookup) -> dict:
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, dtype=dtype, requires_grad=False)
    model.eval()
    out = Progress("vkformers")
    # eos_token_id=[] (no end token) rather than min_new_tokens, which keeps every step's choice on the host
    # (the end tokens suppressed there), so that greedy decoding runs as it does for a user: chained on the GPU
    with vkf.no_grad():
        plain = model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=[], do_sample=False)
        seconds = timed(lambda: model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=[],
                                               do_sample=False), REPEATS)
        out["greedy_tok_s"] = new_tokens / seconds
        assisted = model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=[], do_sample=False,
                                  prompt_lookup_num_tokens=lookup)
        seconds = timed(lambda: model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=[],
                                               do_sample=False, prompt_lookup_num_tokens=lookup), REPEATS)
        stats = model.assisted_stats
        out["lookup_tok_s"] = new_tokens / seconds
        out["same_tokens"] = bool(np.array_equal(plain, assisted))
        out["accepted_of_drafted"] = f"{stats.accepted}/{stats.drafted}"
        out["tokens_per_forward"] = new_tokens / max(stats.forwards, 1)
        out["replayed_of_forwards"] = f"{stats.replayed}/{stats.forwards}"
        out["forward_ms"] = {t: round(s * 1e3, 2) for t, s in forward_costs(model, prompt).items()}
    return out


def bench_torch(config, weights, dtype, prompt, new_tokens, lookup) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    model = model.to("cuda", torch_dtype).eval()
    ids = torch.from_numpy(prompt.astype(np.int64)).cuda()
    out = Progress("torch")

    def run(**options):
        result = model.generate(ids, max_new_tokens=new_tokens, eos_token_id=[], do_sample=False,
                                **options)
        torch.cuda.synchronize()
        return result
    with torch.no_grad():
        out["greedy_tok_s"] = new_tokens / timed(run, REPEATS)
        out["lookup_tok_s"] = new_tokens / timed(lambda: run(prompt_lookup_num_tokens=lookup), REPEATS)
    model.to("cpu")
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run")
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    config = dict(SHAPES[args.shape])
    config["num_hidden_layers"] = args.layers or config["num_hidden_layers"]
    weights = random_weights(AutoModelForCausalLM.from_config(config), shared=args.shape != "tinyllama")
    segment = np.random.default_rng(1).integers(0, config["vocab_size"], (1, SEGMENT))
    prompt = np.ascontiguousarray(np.tile(segment, (1, COPIES))).astype(np.int64)
    results = {"device": vkf.get_device().name, "config": config, "prompt_tokens": prompt.shape[1],
               "vkformers": bench_vkformers(config, weights, args.dtype, prompt, args.new_tokens, args.lookup)}
    if not args.no_torch:
        try:
            import torch
            if torch.cuda.is_available():
                results["torch"] = bench_torch(config, weights, args.dtype, prompt, args.new_tokens, args.lookup)
        except ImportError:
            pass
    ours, ref = results["vkformers"], results.get("torch", {})
    print(f"device {results['device']}, {args.shape}, {args.dtype}, prompt {prompt.shape[1]}, {args.new_tokens} new")
    for key, value in ours.items():
        against = f"  torch {ref[key]:8.1f} = {value / ref[key]:5.2f}x" if key in ref else ""
        shown = f"{value:8.1f}" if isinstance(value, float) else str(value)
        print(f"  {key:22s} {shown}{against}", flush=True)
    if "torch" in results:
        print(f"  lookup / greedy: vkformers {ours['lookup_tok_s'] / ours['greedy_tok_s']:.2f}x, "
              f"torch {ref['lookup_tok_s'] / ref['greedy_tok_s']:.2f}x")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
