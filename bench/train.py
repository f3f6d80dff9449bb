"""Training benchmark: tokens/s and peak GPU memory of training steps on the 1.1B TinyLlama shape.

For each dtype (fp32, bf16) and mode (full fine-tuning; LoRA r=8 on q_proj/v_proj), times training
steps on a batch of `--batch` x `--seq` random tokens: forward with labels, backward, AdamW (lr 1e-4,
weight decay 0.01). vkformers runs its Trainer's step (gradient-norm clipping at 1.0 included; bf16 keeps
float32 master weights and moments unless --no-master-weights; --optim and --gradient-checkpointing as
`vkformers train`'s); transformers + PyTorch CUDA runs the same config and random
weights (bench/llama.py) in the same process with torch.optim.AdamW and clip_grad_norm_ (bf16: pure
bf16 parameters, torch.optim.AdamW updating them directly; LoRA: r=8 adapters added by forward hooks,
float32 like PEFT's). Without CUDA (or with --no-torch) only vkformers runs, and the output says so.

Peak memory: torch.cuda.max_memory_allocated for the reference; for vkformers the peak of the bytes
held by live device buffers (vkformers.runtime.vulkan.buffer_memory), both from before the model is
built, so weights, gradients, optimizer state and activations all count.

    python bench/train.py [--dtypes float32,bfloat16] [--modes full,lora] [--layers 22] [--batch 8] [--seq 512]
                          [--steps 5] [--optim adamw_8bit] [--no-master-weights] [--gradient-checkpointing]
                          [--json OUT]
    python bench/train.py --layers 1 --batch 1 --seq 16 --hidden 64   # tiny shape for lavapipe
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

from common import profile_gpu, write_results

import vkformers as vkf
from vkformers.engine import lazy
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.runtime import vulkan
from vkformers.training import LoraConfig, Trainer, TrainingConfig, apply_lora

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from llama import TINYLLAMA, random_weights  # noqa: E402  (bench/llama.py: the shared config and weights)

LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


def bench_vkformers(config, weights, dtype, mode, batches, steps, profile=False, **options) -> dict:
    """``options``: TrainingConfig's optim, master_weights, gradient_checkpointing."""
    gc.collect()
    start_bytes = vulkan.buffer_memory()["live_bytes"]
    vulkan.reset_peak_buffer_memory()
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, dtype=dtype, requires_grad=True)
    if mode == "lora":
        apply_lora(model, LoraConfig(**LORA))
    trainer = Trainer(model, TrainingConfig(steps=steps + 2, batch_size=batches[0][0].shape[0],
                                            seq_len=batches[0][0].shape[1], lr=LR, schedule="constant",
                                            weight_decay=WEIGHT_DECAY, clip=CLIP, precision=PRECISION[dtype],
                                            **options),
                      train_batches=None)
    losses = [trainer.train_step([batches[i % len(batches)]]).loss for i in range(2)]  # records, then replays
    built = lazy.stats["recorded"], 0
    start = time.perf_counter()
    for i in range(steps):
        losses.append(trainer.train_step([batches[i % len(batches)]]).loss)
    seconds = (time.perf_counter() - start) / steps
    recorded = lazy.stats["recorded"] - built[0]
    captured = trainer._capture.ready
    peak = vulkan.buffer_memory()["peak_bytes"] - start_bytes
    tokens = batches[0][0].size
    if profile:  # forget the captured step so that its plan is recorded again, with timestamps
        trainer._capture.forget()
        profile_gpu(f"{dtype} {mode} step", lambda: trainer.train_step([batches[0]]), runs=3)
    del trainer, model
    gc.collect()
    return {"tok_s": tokens / seconds, "step_s": seconds, "peak_gib": peak / 2**30,
            "first_loss": losses[0], "last_loss": losses[-1], "recordings_in_timed_steps": recorded,
            "replayed_without_building": captured}


def bench_torch(config, weights, dtype, mode, batches, steps) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    model = model.to("cuda", torch_dtype).train()
    if mode == "lora":
        model.requires_grad_(False)
        params = add_torch_lora(model)
    else:
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
        return loss.item()  # synchronises, as vkformers' step reads its loss

    losses = [step(i) for i in range(2)]
    start = time.perf_counter()
    for i in range(steps):
        losses.append(step(i))
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() - start_bytes
    del model, optimizer, params, data
    gc.collect()
    torch.cuda.empty_cache()
    return {"tok_s": batches[0][0].size / seconds, "step_s": seconds, "peak_gib": peak / 2**30,
            "first_loss": losses[0], "last_loss": losses[-1]}


def add_torch_lora(model) -> list:
    """LoRA on q_proj/v_proj by forward hooks: y += (x @ A.T @ B.T) * alpha / r, A, B float32 (PEFT's layout)."""
    import torch
    scaling = LORA["lora_alpha"] / LORA["r"]
    params = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in LORA["target_modules"]:
            continue
        a = torch.nn.Parameter(torch.randn(LORA["r"], module.in_features, device="cuda") / module.in_features ** 0.5)
        b = torch.nn.Parameter(torch.zeros(module.out_features, LORA["r"], device="cuda"))
        module.register_parameter("lora_A", a)
        module.register_parameter("lora_B", b)
        module.register_forward_hook(
            lambda m, inputs, out: out + ((inputs[0].float() @ m.lora_A.T @ m.lora_B.T) * scaling).to(out.dtype))
        params += [a, b]
    return params


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=0, help="shrink hidden (intermediate scales along) for a quick run")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 untimed)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--profile", action="store_true", help="also print GPU time per kernel")
    parser.add_argument("--optim", default="adamw", help="vkformers' optimizer (vkformers train --optim)")
    parser.add_argument("--no-master-weights", action="store_true",
                        help="bf16: vkformers updates the bfloat16 weights in place, as the PyTorch reference does")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="vkformers recomputes each layer")
    args = parser.parse_args(argv)
    options = dict(optim=args.optim, gradient_checkpointing=args.gradient_checkpointing)
    if args.no_master_weights:
        options["master_weights"] = False
    config = dict(TINYLLAMA, num_hidden_layers=args.layers)
    if args.hidden:
        heads = max(1, args.hidden // 64)
        config.update(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_attention_heads=heads,
                      num_key_value_heads=1)
    weights = random_weights(AutoModelForCausalLM.from_config(config))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, config["vocab_size"], (args.batch, args.seq)).astype(np.int32)
    batches = [(ids, ids.copy())]  # one batch, so first and last loss compare (it should fall)
    use_torch, why = not args.no_torch, "--no-torch"
    if use_torch:
        try:
            import torch
            use_torch, why = torch.cuda.is_available(), "no CUDA device"
        except ImportError:
            use_torch, why = False, "torch not installed"
    if not use_torch:
        print(f"reference (transformers + PyTorch CUDA) skipped: {why}", flush=True)
    results = {"device": vkf.get_device().name, "config": config, "batch": args.batch, "seq": args.seq,
               "steps": args.steps, "lora": LORA, "options": options, "reference": "torch" if use_torch else f"skipped ({why})",
               "runs": {}}
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            run = {"vkformers": bench_vkformers(config, weights, dtype, mode, batches, args.steps, args.profile,
                                                **options)}
            if use_torch:
                run["torch"] = bench_torch(config, weights, dtype, mode, batches, args.steps)
            results["runs"][f"{dtype}/{mode}"] = run
            ours, ref = run["vkformers"], run.get("torch")
            line = f"{dtype:9s} {mode:5s} {ours['tok_s']:10.1f} tok/s  peak {ours['peak_gib']:7.3f} GiB"
            if ref:
                line += (f"   torch {ref['tok_s']:10.1f} tok/s ({ours['tok_s'] / ref['tok_s']:.2f}x)"
                         f"  peak {ref['peak_gib']:7.3f} GiB")
            print(line + f"   loss {ours['first_loss']:.3f} -> {ours['last_loss']:.3f}"
                  f"   (re-recorded {ours['recordings_in_timed_steps']}x in timed steps; captured replay: "
                  f"{ours['replayed_without_building']})", flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
