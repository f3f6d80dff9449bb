"""Quantized weights: a Llama model whose Linear weights stay in packed blocks, against the same model in bfloat16.

For each weight format (bfloat16, then each block format given), with the same shape in the same process:
- greedy decode at batch 1 (new tokens/s), and the share of the memory-bandwidth bound it reaches (the bytes of
  every weight a token reads, over --bandwidth-gbs);
- a 512-token prefill at batch 1 (tokens/s);
- the device memory the model's buffers take (the runtime's buffer accounting).
Embeddings, norms and the LM head stay bfloat16 in every format, as from_pretrained(quantization=...) leaves them.

Random weights are drawn for a few rows and tiled over each matrix (packed once, then repeated block rows), so the
host neither draws nor quantizes billions of values: the timings do not depend on the values.

    python bench/quant.py [--formats q4_k,q8_0] [--layers 32] [--new-tokens 64] [--json OUT]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from common import warm_up, write_results
from llama import timed

import vkformers as vkf
from vkformers.engine.quantized import QuantizedArray, quant_format, quantize
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.quantize import quantizable_weights
from vkformers.runtime import vulkan

# Llama-3-8B's shape.
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu")
SAMPLE_ROWS = 64  # rows drawn per matrix, then tiled
REPEATS = 5


def tiled_weights(model, fmt: str | None, seed=0) -> dict:
    """Every slot's weights from SAMPLE_ROWS random rows repeated; Linear weights packed in ``fmt`` (None: float)."""
    rng = np.random.default_rng(seed)
    packed_names = set(quantizable_weights(model)) if fmt else set()
    weights = {}
    for name, slot in model.named_slots():
        if slot.tied_to is not None:
            continue
        shape = tuple(slot.shape)
        if name.endswith("norm.weight") or "layernorm" in name:
            weights[name] = np.ones(shape, np.float32)
            continue
        rows = min(SAMPLE_ROWS, shape[0])
        sample = rng.standard_normal((rows, *shape[1:]), dtype=np.float32) * 0.02
        repeat = -(-shape[0] // rows)
        if name in packed_names:
            block_rows = quantize(sample, quant_format(fmt))
            weights[name] = QuantizedArray(np.tile(block_rows, (repeat, 1))[:shape[0]], fmt, shape)
        else:
            weights[name] = np.tile(sample, (repeat,) + (1,) * (len(shape) - 1))[:shape[0]]
    return weights


def weight_bytes_per_token(model, fmt: str | None) -> int:
    """Bytes of every weight a decode step reads: the packed Linear weights, the rest bfloat16 (the embedding
    table reads one row)."""
    packed_names = set(quantizable_weights(model)) if fmt else set()
    total = 0
    for name, slot in model.named_slots():
        if slot.tied_to is not None:
            continue
        shape = tuple(slot.shape)
        if "embed_tokens" in name:
            total += shape[-1] * 2
        elif name in packed_names:
            total += shape[0] * quant_format(fmt).row_bytes(shape[1])
        else:
            total += int(np.prod(shape)) * 2
    return total


def bench_format(config, fmt: str | None, prompt, new_tokens, bandwidth_gbs: float) -> dict:
    before = vulkan.buffer_memory()["live_bytes"]
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tiled_weights(model, fmt), dtype="bfloat16", requires_grad=False)
    model.eval()
    out = {"weights_gib": (vulkan.buffer_memory()["live_bytes"] - before) / 2**30}
    with vkf.no_grad():
        first = np.ascontiguousarray(prompt[:1])
        warm_up(lambda: model(first).logits[:, -1].numpy(), 2.0)
        out["prefill_tok_s"] = prompt.shape[1] / timed(lambda: model(first).logits[:, -1].numpy(), REPEATS)
        ids = np.ascontiguousarray(prompt[:1, :16])
        generate = lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
        warm_up(generate, 2.0)
        out["decode_b1_tok_s"] = new_tokens / timed(generate, REPEATS)
    bound = bandwidth_gbs * 1e9 / weight_bytes_per_token(model, fmt)
    out["decode_b1_bound_tok_s"] = bound
    out["decode_b1_of_bound"] = out["decode_b1_tok_s"] / bound
    model.forget_captures()  # its plans go with it when the function returns
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="q4_k,q8_0", help="block formats to compare with bfloat16")
    parser.add_argument("--layers", type=int, default=LLAMA3_8B["num_hidden_layers"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0,
                        help="the device's memory bandwidth for the decode bound (H200: 4800)")
    parser.add_argument("--quick", action="store_true", help="a small shape (hidden 512, 2 layers) for a CPU device")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    config = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    if args.quick:
        config.update(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096)
    prompt = np.random.default_rng(1).integers(0, config["vocab_size"], (1, args.prompt_len)).astype(np.int32)
    device = vulkan.get_device()
    print(f"device: {device.name}; Llama shape hidden {config['hidden_size']}, {config['num_hidden_layers']} layers")
    results = {"device": device.name, "config": config, "formats": {}}
    base = None
    for fmt in [None, *[f for f in args.formats.split(",") if f]]:
        name = fmt or "bfloat16"
        r = bench_format(config, fmt, prompt, args.new_tokens, args.bandwidth_gbs)
        results["formats"][name] = r
        base = base or r
        print(f"{name:9s} weights {r['weights_gib']:6.2f} GiB | decode b1 {r['decode_b1_tok_s']:8.1f} tok/s "
              f"({r['decode_b1_tok_s'] / base['decode_b1_tok_s']:.2f}x bf16; {100 * r['decode_b1_of_bound']:.0f}% "
              f"of the {r['decode_b1_bound_tok_s']:.0f} tok/s bound) | prefill {args.prompt_len} "
              f"{r['prefill_tok_s']:9.1f} tok/s ({r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x bf16)", flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
