"""State-space benchmark: Mamba-2 forward, training and generation tokens/s (vkformers-ssm).

The model is transformers' Mamba2Config defaults scaled to the 1.3B shape: 48 layers x hidden 2048 (expand 2:
4096 channels in 64 heads of 64, state 128, 8 groups, conv kernel 4, chunks of 256, vocab 32768), random weights
(N(0, 0.02) drawn once into a pool of 2^24 values, each weight the pool from its own offset on, repeated to its
size: drawing and rounding 1.5 billion values would take longer than the benchmark; norms 1, A_log log(1..16)
cycled, D 1, dt_bias -4), the same in both frameworks.
- Forward: the logits of `--batch` x `--seq` random tokens (prefill and training run the chunked scan), vkformers'
  step captured and replayed, transformers without gradients.
- Training: one step on those tokens (forward with labels, backward, AdamW lr 1e-4, weight decay 0.01, clipping at
  1.0), vkformers' Trainer step against transformers + PyTorch CUDA with torch.optim.AdamW. The reference reports
  which scan it ran: the mamba_ssm / causal_conv1d CUDA kernels when the image has them, else transformers' torch
  path (the chunked SSD in eager PyTorch, which keeps ~1.2 GiB a layer for each 2048-token row: from batch 2 on,
  its 48 layers do not fit a 141 GB GPU; when its step runs out of memory it is timed again with transformers'
  gradient checkpointing, and the output says so).
- Generation: greedy, a `--prompt`-token prompt and `--new` new tokens at batch 1 and 8, both frameworks with their
  recurrent caches (vkformers: the decode step recorded once, then replayed and chained on the GPU); `--new 0`
  leaves it out.
Without CUDA (or with --no-torch) only vkformers runs. Each phase prints its seconds as it ends. `--profile` also
prints vkformers' GPU time per kernel of the forward and of a training step's forward and backward (no optimizer),
each recorded afresh with timestamps (bench/common.py's profile_gpu).

    python bench/ssm.py [--dtype float32|bfloat16] [--layers 48] [--hidden 2048] [--batch 4] [--seq 2048]
                        [--steps 2] [--gradient-checkpointing] [--profile]
    python bench/ssm.py --layers 1 --hidden 64 --batch 1 --seq 16 --steps 1 --new 4 --no-torch   # lavapipe
"""
from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from common import cuda_torch, profile_gpu, write_results

from vkformers import no_grad
from vkformers.engine import lazy
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.runtime.dtypes import to_bfloat16
from vkformers.training import Trainer, TrainingConfig

LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0
PRECISION = {"float32": "fp32", "bfloat16": "bf16"}
POOL = 1 << 24       # random values every weight is cut from
FORWARD_RUNS = 3     # timed forwards (after the two that record the step and the one that replays it first)
START = time.perf_counter()


def phase(name: str, since: float) -> float:
    """Print how long ``name`` took and the run's time so far; returns now."""
    now = time.perf_counter()
    print(f"[{now - START:6.1f} s] {name}: {now - since:.1f} s", flush=True)
    return now


def mamba2_config(layers: int, hidden: int) -> dict:
    head_dim = 64 if hidden >= 256 else 8
    inner = 2 * hidden
    return dict(model_type="mamba2", vocab_size=32768, hidden_size=hidden, num_hidden_layers=layers, expand=2,
                head_dim=head_dim, num_heads=inner // head_dim, state_size=128, n_groups=8 if inner >= 8 * 64 else 1,
                conv_kernel=4, chunk_size=256, tie_word_embeddings=False, layer_norm_epsilon=1e-5,
                pad_token_id=1, bos_token_id=0, eos_token_id=2)


def random_weights(model, dtype: str, seed=0) -> dict[str, np.ndarray]:
    """Host arrays in the dtype's host form (bfloat16: its bit patterns, uint16), which both frameworks load as
    they are."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal(POOL, dtype=np.float32) * np.float32(0.02)
    pool = to_bfloat16(pool) if dtype == "bfloat16" else pool

    def host(values):
        return to_bfloat16(values) if dtype == "bfloat16" else values

    weights = {}
    for name, slot in model.named_slots():
        if slot.tied_to is not None:
            continue
        if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
            weights[name] = host(np.ones(slot.shape, np.float32))
        elif name.endswith("A_log"):
            weights[name] = host(np.log(1.0 + np.arange(slot.shape[0]) % 16).astype(np.float32))
        elif name.endswith("dt_bias"):
            weights[name] = host(np.full(slot.shape, -4.0, np.float32))
        else:
            start = int(rng.integers(POOL // 2))  # a run of at least half the pool, repeated to the size
            weights[name] = np.resize(pool[start:], int(np.prod(slot.shape))).reshape(slot.shape)
    return weights


def profile_vkformers(model, ids, dtype) -> None:
    """GPU time per kernel of the forward (logits of the last token) and of a step's forward and backward."""
    params = [p for _, p in model.named_parameters()]
    tokens = f"{ids.shape[0]} x {ids.shape[1]}"
    with no_grad():
        profile_gpu(f"{dtype} forward {tokens}", lambda: model(ids).logits[:, -1].numpy())

    def train_step():
        for p in params:
            p.grad = None
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.item()
    profile_gpu(f"{dtype} forward and backward {tokens}", train_step)
    for p in params:
        p.grad = None
    lazy.clear_plan_cache()


def bench_vkformers(config, weights, dtype, batches, steps, prompts, new_tokens, checkpointing=False,
                    profile=False) -> dict:
    since = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, dtype=dtype, requires_grad=True)
    if checkpointing:
        model.gradient_checkpointing_enable()
    since = phase("vkformers: load", since)
    ids = batches[0][0]
    capture = lazy.StepCapture()  # the first two calls record the step, the third replays it
    with no_grad():
        def forward():
            return capture.run(lambda: [model(ids).logits[:, -1]], {"ids": ids})
        for _ in range(3):
            forward()
        start = time.perf_counter()
        for _ in range(FORWARD_RUNS):
            forward()
        result = {"forward_tok_s": ids.size * FORWARD_RUNS / (time.perf_counter() - start)}
    capture.forget()
    since = phase("vkformers: forward", since)
    trainer = Trainer(model, TrainingConfig(steps=steps + 2, batch_size=ids.shape[0], seq_len=ids.shape[1], lr=LR,
                                            schedule="constant", weight_decay=WEIGHT_DECAY, clip=CLIP,
                                            precision=PRECISION[dtype]),
                      train_batches=None)
    losses = [trainer.train_step([batches[i % len(batches)]]).loss for i in range(2)]  # records, then replays
    start = time.perf_counter()
    for i in range(steps):
        losses.append(trainer.train_step([batches[i % len(batches)]]).loss)
    seconds = (time.perf_counter() - start) / steps
    result.update({"train_tok_s": ids.size / seconds, "step_s": seconds, "losses": losses})
    del trainer
    gc.collect()
    since = phase("vkformers: training", since)
    if profile:
        profile_vkformers(model, ids, dtype)
        since = phase("vkformers: profile", since)
    for batch, prompt in prompts.items():
        model.generate(prompt, max_new_tokens=2)
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens)
        result[f"generate_b{batch}_tok_s"] = batch * new_tokens / (time.perf_counter() - start)
    phase("vkformers: generation", since)
    return result


def bench_torch(config, weights, dtype, batches, steps, prompts, new_tokens, checkpointing=False) -> dict:
    import torch
    import transformers
    from transformers import Mamba2Config, Mamba2ForCausalLM
    from transformers.utils import import_utils
    since = time.perf_counter()
    kernels = all(getattr(import_utils, f, lambda: False)() for f in ("is_mamba_2_ssm_available",
                                                                      "is_causal_conv1d_available"))
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    with torch.device("cuda"):  # initialised on the GPU, then overwritten: the CPU would take longer
        model = Mamba2ForCausalLM(Mamba2Config(**{k: v for k, v in config.items() if k != "model_type"}))
    model = model.to(torch_dtype)
    host = {k: torch.from_numpy(v).view(torch.bfloat16) if v.dtype == np.uint16 else torch.from_numpy(v)
            for k, v in weights.items()}
    model.load_state_dict(host, strict=False)
    del host
    if checkpointing:
        model.gradient_checkpointing_enable()
    result = {"scan": ("mamba_ssm and causal_conv1d installed (their CUDA kernels)" if kernels
                       else "transformers' torch path (no mamba_ssm / causal_conv1d installed)"),
              "transformers": transformers.__version__, "torch": torch.__version__}
    since = phase("torch: load", since)
    data = [tuple(torch.from_numpy(a.astype(np.int64)).cuda() for a in b) for b in batches]
    ids = data[0][0]
    model.eval()
    def forward():
        model(input_ids=ids, use_cache=False).logits[:, -1].float().cpu()
    try:
        with torch.no_grad():
            for _ in range(2):
                forward()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(FORWARD_RUNS):
                forward()
            torch.cuda.synchronize()
        result["forward_tok_s"] = ids.numel() * FORWARD_RUNS / (time.perf_counter() - start)
    except torch.OutOfMemoryError as exc:  # the torch path's scan at batch 8 x 2048: reported, not fatal
        result["forward_tok_s"], result["forward_note"] = None, f"out of memory ({str(exc).splitlines()[0]})"
        torch.cuda.empty_cache()
    since = phase("torch: forward", since)
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    def step(i):
        batch_ids, labels = data[i % len(data)]
        loss = model(input_ids=batch_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def train(with_checkpointing: bool):
        if with_checkpointing:
            model.gradient_checkpointing_enable()
        losses = [step(0)]  # untimed: PyTorch records nothing, one warm step suffices
        start = time.perf_counter()
        for i in range(steps):
            losses.append(step(i + 1))
        seconds = (time.perf_counter() - start) / steps
        result.update({"train_tok_s": ids.numel() / seconds, "step_s": seconds, "losses": losses,
                       "train_checkpointing": with_checkpointing})

    def out_of_memory(with_checkpointing: bool) -> str | None:
        try:
            train(with_checkpointing)
        except torch.OutOfMemoryError as exc:
            return str(exc).splitlines()[0]
        return None

    failed = out_of_memory(checkpointing)
    if failed and not checkpointing:  # retried outside the handler, whose traceback holds the failed step's tensors
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        result["train_note"] = "out of memory without gradient checkpointing; timed with it"
        failed = out_of_memory(True)
    if failed:  # reported, not fatal: vkformers' figures are printed all the same
        result["train_tok_s"], result["train_note"] = None, f"out of memory ({failed})"
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()  # the moments go before generation
    gc.collect()
    torch.cuda.empty_cache()
    since = phase("torch: training", since)
    model.eval()
    with torch.no_grad():
        for batch, prompt in prompts.items():
            prompt_ids = torch.from_numpy(prompt.astype(np.int64)).cuda()
            model.generate(prompt_ids, max_new_tokens=2, do_sample=False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(prompt_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            torch.cuda.synchronize()
            result[f"generate_b{batch}_tok_s"] = batch * new_tokens / (time.perf_counter() - start)
    phase("torch: generation", since)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(PRECISION))
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2, help="timed training steps, after two untimed ones")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64, help="new tokens per generate (0: no generation)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="both frameworks recompute each layer in the backward (transformers' torch path "
                             "keeps ~1.2 GiB a layer per 2048-token row otherwise, vkformers ~0.3 GiB)")
    parser.add_argument("--profile", action="store_true",
                        help="also print vkformers' GPU time per kernel of the forward and of a training step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    since = time.perf_counter()
    config = mamba2_config(args.layers, args.hidden)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        ids = rng.integers(3, config["vocab_size"], (args.batch, args.seq)).astype(np.int32)
        batches.append((ids, ids.copy()))
    prompts = {b: rng.integers(3, config["vocab_size"], (b, args.prompt)).astype(np.int32)
               for b in ((1, 8) if args.new > 0 else ())}
    weights = random_weights(AutoModelForCausalLM.from_config(config), args.dtype)
    phase("weights", since)
    results = {"config": config, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
               "gradient_checkpointing": args.gradient_checkpointing,
               "vkformers": bench_vkformers(config, weights, args.dtype, batches, args.steps, prompts, args.new,
                                            args.gradient_checkpointing, args.profile)}
    gc.collect()
    lazy.clear_plan_cache()  # the plans' buffers go back before PyTorch allocates
    torch = None if args.no_torch else cuda_torch()
    if torch is not None:
        results["torch"] = bench_torch(config, weights, args.dtype, batches, args.steps, prompts, args.new,
                                       args.gradient_checkpointing)
    print(f"Mamba-2 {args.layers} x {args.hidden}, {args.dtype}, batch {args.batch} x {args.seq}"
          + (", gradient checkpointing" if args.gradient_checkpointing else "") + ":")
    for name in ("vkformers", "torch"):
        if name in results:
            r = results[name]
            train = ("" if r.get("train_tok_s") is None else f"{r['train_tok_s']:.0f} tok/s") + (
                f" ({r['train_note']})" if "train_note" in r else "")
            generate = "".join(f"; generate b{b} {r[f'generate_b{b}_tok_s']:.1f} tok/s" for b in prompts)
            forward = (f"{r['forward_tok_s']:.0f} tok/s" if r.get("forward_tok_s") is not None
                       else r.get("forward_note", "not run"))
            print(f"  {name}: forward {forward}; train {train}{generate}"
                  + (f" ({r['scan']})" if "scan" in r else ""))
    if torch is None:
        print("no CUDA reference (PyTorch with a CUDA GPU not found, or --no-torch)")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
