"""State-space benchmark: Mamba-2 training tokens/s and generation tokens/s (vkformers-ssm).

The model is transformers' Mamba2Config defaults scaled to the 1.3B shape: 48 layers x hidden 2048 (expand 2:
4096 channels in 64 heads of 64, state 128, 8 groups, conv kernel 4, vocab 32768), random weights (N(0, 0.02),
norms 1, A_log log(1..16) cycled, D 1, dt_bias -4).
- Training: `--batch` x `--seq` random tokens per step (forward with labels, backward, AdamW lr 1e-4, weight decay
  0.01, clipping at 1.0), vkformers' Trainer step against transformers + PyTorch CUDA with torch.optim.AdamW. The
  reference reports which scan it ran: the mamba_ssm / causal_conv1d CUDA kernels when the image has them, else
  transformers' torch path (the chunked SSD in eager PyTorch).
- Generation: greedy, a `--prompt`-token prompt and `--new` new tokens at batch 1 and 8, both frameworks with their
  recurrent caches (vkformers: the decode step recorded once, then replayed and chained on the GPU).
Without CUDA (or with --no-torch) only vkformers runs.

    python bench/ssm.py [--dtype float32|bfloat16] [--layers 48] [--hidden 2048] [--batch 8] [--seq 2048] [--steps 3]
                        [--gradient-checkpointing]
    python bench/ssm.py --layers 1 --hidden 64 --batch 1 --seq 16 --steps 1 --new 4 --no-torch   # lavapipe
"""
from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from common import cuda_torch, write_results

from vkformers.models.loading import AutoModelForCausalLM
from vkformers.training import Trainer, TrainingConfig

LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0
PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


def mamba2_config(layers: int, hidden: int) -> dict:
    head_dim = 64 if hidden >= 256 else 8
    inner = 2 * hidden
    return dict(model_type="mamba2", vocab_size=32768, hidden_size=hidden, num_hidden_layers=layers, expand=2,
                head_dim=head_dim, num_heads=inner // head_dim, state_size=128, n_groups=8 if inner >= 8 * 64 else 1,
                conv_kernel=4, chunk_size=256, tie_word_embeddings=False, layer_norm_epsilon=1e-5,
                pad_token_id=1, bos_token_id=0, eos_token_id=2)


def random_weights(model, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = {}
    for name, slot in model.named_slots():
        if slot.tied_to is not None:
            continue
        if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
            weights[name] = np.ones(slot.shape, np.float32)
        elif name.endswith("A_log"):
            weights[name] = np.log(1.0 + np.arange(slot.shape[0]) % 16).astype(np.float32)
        elif name.endswith("dt_bias"):
            weights[name] = np.full(slot.shape, -4.0, np.float32)
        else:
            weights[name] = rng.standard_normal(slot.shape, dtype=np.float32) * 0.02
    return weights


def bench_vkformers(config, weights, dtype, batches, steps, prompts, new_tokens, checkpointing=False) -> dict:
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, dtype=dtype, requires_grad=True)
    if checkpointing:
        model.gradient_checkpointing_enable()
    trainer = Trainer(model, TrainingConfig(steps=steps + 2, batch_size=batches[0][0].shape[0],
                                            seq_len=batches[0][0].shape[1], lr=LR, schedule="constant",
                                            weight_decay=WEIGHT_DECAY, clip=CLIP, precision=PRECISION[dtype]),
                      train_batches=None)
    losses = [trainer.train_step([batches[i % len(batches)]]).loss for i in range(2)]  # records, then replays
    start = time.perf_counter()
    for i in range(steps):
        losses.append(trainer.train_step([batches[i % len(batches)]]).loss)
    seconds = (time.perf_counter() - start) / steps
    result = {"train_tok_s": batches[0][0].size / seconds, "step_s": seconds, "losses": losses}
    del trainer
    for batch, prompt in prompts.items():
        model.generate(prompt, max_new_tokens=2)
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens)
        result[f"generate_b{batch}_tok_s"] = batch * new_tokens / (time.perf_counter() - start)
    del model
    gc.collect()
    return result


def bench_torch(config, weights, dtype, batches, steps, prompts, new_tokens, checkpointing=False) -> dict:
    import torch
    import transformers
    from transformers import Mamba2Config, Mamba2ForCausalLM
    from transformers.utils import import_utils
    kernels = all(getattr(import_utils, f, lambda: False)() for f in ("is_mamba_2_ssm_available",
                                                                      "is_causal_conv1d_available"))
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    model = Mamba2ForCausalLM(Mamba2Config(**{k: v for k, v in config.items() if k != "model_type"}))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    model = model.to("cuda", torch_dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    data = [tuple(torch.from_numpy(a.astype(np.int64)).cuda() for a in b) for b in batches]

    def step(i):
        ids, labels = data[i % len(data)]
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step(i) for i in range(2)]
    start = time.perf_counter()
    for i in range(steps):
        losses.append(step(i))
    seconds = (time.perf_counter() - start) / steps
    result = {"train_tok_s": batches[0][0].size / seconds, "step_s": seconds, "losses": losses,
              "scan": ("mamba_ssm and causal_conv1d installed (their CUDA kernels)" if kernels
                       else "transformers' torch path (no mamba_ssm / causal_conv1d installed)"),
              "transformers": transformers.__version__}
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        for batch, prompt in prompts.items():
            ids = torch.from_numpy(prompt.astype(np.int64)).cuda()
            model.generate(ids, max_new_tokens=2, do_sample=False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            torch.cuda.synchronize()
            result[f"generate_b{batch}_tok_s"] = batch * new_tokens / (time.perf_counter() - start)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(PRECISION))
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="both frameworks recompute each layer in the backward (the chunked scan of a 2048-token "
                             "batch of 8 keeps ~1 GiB per layer of decay matrices otherwise)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    config = mamba2_config(args.layers, args.hidden)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        ids = rng.integers(3, config["vocab_size"], (args.batch, args.seq)).astype(np.int32)
        batches.append((ids, ids.copy()))
    prompts = {b: rng.integers(3, config["vocab_size"], (b, args.prompt)).astype(np.int32) for b in (1, 8)}
    weights = random_weights(AutoModelForCausalLM.from_config(config))
    results = {"config": config, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
               "gradient_checkpointing": args.gradient_checkpointing,
               "vkformers": bench_vkformers(config, weights, args.dtype, batches, args.steps, prompts, args.new,
                                            args.gradient_checkpointing)}
    torch = None if args.no_torch else cuda_torch()
    if torch is not None:
        gc.collect()
        results["torch"] = bench_torch(config, weights, args.dtype, batches, args.steps, prompts, args.new,
                                       args.gradient_checkpointing)
    for name in ("vkformers", "torch"):
        if name in results:
            r = results[name]
            extra = f" ({r['scan']})" if "scan" in r else ""
            print(f"{name}{extra}: train {r['train_tok_s']:.0f} tok/s; generate b1 {r['generate_b1_tok_s']:.1f}, "
                  f"b8 {r['generate_b8_tok_s']:.1f} tok/s")
    if torch is None:
        print("no CUDA reference (PyTorch with a CUDA GPU not found, or --no-torch)")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
