"""Data-parallel scaling: tokens/s of training steps on 1, 2, 4 and 8 GPUs, vkformers against PyTorch DDP.

Weak scaling, as data-parallel training runs: every rank trains on `--batch` x `--seq` random tokens per step, so
N ranks process N times the tokens of one. For each world size N and mode (full fine-tuning, LoRA r=8 on
q_proj/v_proj) this script starts N processes and reports global tokens/s, the speedup over N=1 and the scaling
efficiency (speedup / N; the issue's goal: speedup >= 1.8 at 2 GPUs and >= 3.4 at 4).

On one rank each framework trains as it does alone (vkformers' Trainer with its recorded step, plain PyTorch),
so the efficiency counts every cost of going parallel.

- vkformers: `mpiexec -n N` ranks of :class:`vkformers.training.distributed.DataParallelTrainer` (rank r on Vulkan
  device r; gradients all-reduced in fp32 or --grad-comm bf16; --shard-optimizer: ZeRO-1).
- reference: PyTorch DDP over NCCL (`torch.distributed.run`, one process per CUDA GPU) with transformers'
  LlamaForCausalLM, torch.optim.AdamW and clip_grad_norm_, or torch's ZeroRedundancyOptimizer with
  --shard-optimizer, in the same run on the same GPUs (skipped without torch/CUDA, and the output says so).

Both frameworks time `--steps` steps after 2 untimed ones, on identical random weights (every rank draws them
from the same seed) with lr 1e-4, weight decay 0.01 and clipping at 1.0; each rank synchronises its step by
reading the loss, and rank 0's median step time counts.

    python bench/data_parallel.py [--shape tinyllama|llama3-8b] [--ranks 1,2,4,8] [--modes full,lora]
                                  [--dtype bf16|fp32] [--batch 4] [--seq 512] [--steps 5] [--shard-optimizer]
                                  [--grad-comm bf16] [--no-torch] [--json OUT]
    python bench/data_parallel.py --ranks 1,2 --layers 1 --hidden 64 --batch 1 --seq 16 --no-torch --share-device
        # a tiny shape on one device (lavapipe), to check the script itself

The Llama-3-8B shape in full fine-tuning needs --shard-optimizer to fit (bf16 weights and gradients, 16 GB each,
plus float32 masters and moments, 96 GB, divided among the ranks), and each rank draws its float32 random weights
on the host (32 GB per rank).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vkformers.models.loading import AutoModelForCausalLM
from vkformers.runtime import vulkan
from vkformers.training import LoraConfig, Trainer, TrainingConfig, apply_lora, distributed, init_weights

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llama import TINYLLAMA  # noqa: E402  (bench/llama.py: the TinyLlama config)
from common import LLAMA3_8B, write_results  # noqa: E402
SHAPES = {"tinyllama": TINYLLAMA, "llama3-8b": LLAMA3_8B}
LR, WEIGHT_DECAY, CLIP, SEED = 1e-4, 0.01, 1.0, 0
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


def model_config(args) -> dict:
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    if args.hidden:
        heads = max(1, args.hidden // 64)
        config.update(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_attention_heads=heads,
                      num_key_value_heads=1)
    return config


def batch(config, args, rank: int):
    """This rank's tokens: a different random batch per rank, the same every step (the loss should fall)."""
    ids = np.random.default_rng([1, rank]).integers(0, config["vocab_size"], (args.batch, args.seq))
    return ids.astype(np.int32)


def report(args, result: dict) -> None:
    Path(args.result_file).write_text(json.dumps(result))


# ---------------------------------------------------------------- the ranks

def worker_vkformers(args) -> None:
    comm = distributed.Communicator()
    distributed.select_device(comm)
    config = model_config(args)
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    model = AutoModelForCausalLM.from_config(config)
    init_weights(model, seed=SEED, dtype=dtype)  # the same seed on every rank: identical weights
    model.train()
    if args.mode == "lora":
        apply_lora(model, LoraConfig(**LORA), seed=SEED)
    training = TrainingConfig(steps=args.steps + 2, batch_size=args.batch, seq_len=args.seq, lr=LR,
                              schedule="constant", weight_decay=WEIGHT_DECAY, clip=CLIP, precision=args.dtype)
    if comm.size == 1:  # the baseline is one device as it trains alone (recorded step, no read-back)
        trainer = Trainer(model, training, None)
    else:
        trainer = distributed.DataParallelTrainer(model, training, None, comm=comm, comm_dtype=args.grad_comm,
                                                  shard_optimizer=args.shard_optimizer)
    ids = batch(config, args, comm.rank)
    losses, times = [], []
    for i in range(args.steps + 2):
        comm.barrier()
        start = time.perf_counter()
        losses.append(trainer.train_step([(ids, ids)]).loss)  # reads the loss: the step is done on this rank
        comm.barrier()
        if i >= 2:
            times.append(time.perf_counter() - start)
    if comm.rank == 0:
        report(args, {"step_s": statistics.median(times), "first_loss": losses[0], "last_loss": losses[-1],
                      "device": vulkan.get_device().name, "peak_gib": vulkan.buffer_memory()["peak_bytes"] / 2**30})


def worker_torch(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaConfig, LlamaForCausalLM
    dist.init_process_group("nccl")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.manual_seed(SEED)  # identical weights on every rank (DDP also broadcasts rank 0's at wrap)
    config = model_config(args)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    model = model.to("cuda", {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]).train()
    if args.mode == "lora":
        model.requires_grad_(False)
        add_torch_lora(model)
    # the baseline is one GPU as it trains alone
    ddp = DistributedDataParallel(model, device_ids=[local]) if dist.get_world_size() > 1 else model
    params = [p for p in ddp.parameters() if p.requires_grad]
    if args.shard_optimizer and dist.get_world_size() > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR,
                                            weight_decay=WEIGHT_DECAY)
    else:
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    ids = torch.from_numpy(batch(config, args, rank).astype(np.int64)).cuda()
    losses, times = [], []
    for i in range(args.steps + 2):
        dist.barrier()
        start = time.perf_counter()
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)  # gradients are already averaged: the global norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises, as vkformers' step reads its loss
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - start)
    if rank == 0:
        report(args, {"step_s": statistics.median(times), "first_loss": losses[0], "last_loss": losses[-1],
                      "device": torch.cuda.get_device_name(local),
                      "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
    dist.destroy_process_group()


def add_torch_lora(model) -> None:
    """LoRA on q_proj/v_proj by forward hooks, float32 A and B (PEFT's layout), as bench/train.py adds it."""
    import torch
    scaling = LORA["lora_alpha"] / LORA["r"]
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in LORA["target_modules"]:
            continue
        module.register_parameter("lora_A", torch.nn.Parameter(
            torch.randn(LORA["r"], module.in_features, device="cuda") / module.in_features ** 0.5))
        module.register_parameter("lora_B", torch.nn.Parameter(torch.zeros(module.out_features, LORA["r"],
                                                                           device="cuda")))
        module.register_forward_hook(
            lambda m, inputs, out: out + ((inputs[0].float() @ m.lora_A.T @ m.lora_B.T) * scaling).to(out.dtype))


# ---------------------------------------------------------------- the driver

def worker_argv(args, mode: str, framework: str, result_file: str) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--worker", framework, "--mode", mode, "--result-file", result_file,
            "--shape", args.shape, "--dtype", args.dtype, "--batch", str(args.batch), "--seq", str(args.seq),
            "--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--grad-comm", args.grad_comm]
    return argv + (["--shard-optimizer"] if args.shard_optimizer else [])


def launch(args, framework: str, ranks: int, mode: str) -> dict | None:
    with tempfile.TemporaryDirectory() as folder:
        result_file = str(Path(folder) / "result.json")
        argv = worker_argv(args, mode, framework, result_file)
        env = dict(os.environ)
        if framework == "vkformers":
            command = [distributed.find_mpiexec(), "-n", str(ranks), sys.executable, *argv]
            if args.share_device:
                env[distributed.SHARE_DEVICE_ENV] = "1"
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                       *argv]
        done = subprocess.run(command, env=env, timeout=args.timeout)
        if done.returncode != 0 or not Path(result_file).is_file():
            print(f"{framework} on {ranks} rank(s), {mode}: failed (exit status {done.returncode})", flush=True)
            return None
        return json.loads(Path(result_file).read_text())


def torch_gpus(args) -> tuple[int, str]:
    if args.no_torch:
        return 0, "--no-torch"
    try:
        import torch
    except ImportError:
        return 0, "torch not installed"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count, "" if count else "no CUDA device"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tinyllama")
    parser.add_argument("--ranks", default="1,2,4,8", help="world sizes (those above the device count are skipped)")
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--layers", type=int, default=0, help="override the shape's layer count")
    parser.add_argument("--hidden", type=int, default=0, help="shrink hidden (intermediate scales along)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 untimed)")
    parser.add_argument("--grad-comm", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1 in both frameworks")
    parser.add_argument("--share-device", action="store_true", help="every vkformers rank on device 0 (testing)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launched run")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--worker", choices=("vkformers", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        (worker_vkformers if args.worker == "vkformers" else worker_torch)(args)
        return 0

    vulkan_devices = len(vulkan.describe_devices())
    cuda_devices, why = torch_gpus(args)
    if not cuda_devices:
        print(f"reference (PyTorch DDP) skipped: {why}", flush=True)
    results = {"shape": model_config(args), "dtype": args.dtype, "batch_per_rank": args.batch, "seq": args.seq,
               "steps": args.steps, "grad_comm": args.grad_comm, "shard_optimizer": args.shard_optimizer,
               "vulkan_devices": vulkan_devices, "cuda_devices": cuda_devices, "runs": {}}
    for mode in args.modes.split(","):
        base = {}
        for ranks in (int(r) for r in args.ranks.split(",")):
            if ranks > vulkan_devices and not args.share_device:
                print(f"{mode}: {ranks} ranks skipped: {vulkan_devices} Vulkan device(s)", flush=True)
                continue
            run = {}
            for framework in ("vkformers", "torch"):
                if framework == "torch" and ranks > cuda_devices:
                    continue
                measured = launch(args, framework, ranks, mode)
                if measured is None:
                    continue
                measured["tok_s"] = ranks * args.batch * args.seq / measured["step_s"]
                base.setdefault(framework, measured["tok_s"] if ranks == 1 else None)
                if base.get(framework):
                    measured["speedup"] = measured["tok_s"] / base[framework]
                    measured["efficiency"] = measured["speedup"] / ranks
                run[framework] = measured
            results["runs"][f"{mode}/{ranks}"] = run
            line = f"{mode:5s} {ranks} rank(s)"
            for framework, m in run.items():
                scaled = f" {m['speedup']:.2f}x ({m['efficiency']:.0%})" if "speedup" in m else ""
                line += f"   {framework} {m['tok_s']:10.1f} tok/s{scaled} loss {m['first_loss']:.3f}->" \
                        f"{m['last_loss']:.3f} peak {m['peak_gib']:.2f} GiB"
            print(line, flush=True)
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
