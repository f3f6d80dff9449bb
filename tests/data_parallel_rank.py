"""One rank of tests/test_data_parallel.py's runs (a script, started alone or under mpiexec).

    python data_parallel_rank.py OUT.npz BATCH STEPS [--shard] [--comm bf16] [--precision bf16|fp16] [--resume]
                                 [--kill-rank R | --hang-rank R] [--masked] [--tail] [--grad-accum K]

Trains test_training's TinyLM for STEPS steps on the tiny byte corpus, checkpointing every 2 steps into
OUT's folder; rank 0 writes the losses and final weights to OUT.npz. --masked: the first 12 labels of every
other row are -100 (a prompt), so that ranks' rows hold different numbers of targets. --tail: the first 9
sequences only, so that the step ending the epoch holds filler rows (a rank's micro-batches may be all filler); the
rank's epoch position is written too. --grad-accum K: K micro-batches a step. Started alone it is the
single-device reference (batch BATCH); under mpiexec -n N each rank takes BATCH rows of every global batch of
N*BATCH.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from test_training import tiny_data, tiny_model  # noqa: E402

from vkformers.training import Batches, Trainer, TrainingConfig  # noqa: E402
from vkformers.training import distributed  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("batch", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--comm", default="fp32")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank dies in the middle of step 3")
    parser.add_argument("--hang-rank", type=int, default=-1, help="this rank stops answering in step 3")
    parser.add_argument("--masked", action="store_true", help="mask the first 12 labels of every other row")
    parser.add_argument("--bucket-mb", type=float, default=0.01)  # small: several buckets even for TinyLM
    parser.add_argument("--tail", action="store_true", help="train on the first 9 sequences only")
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args()
    world = distributed.launched_world_size()
    comm = distributed.Communicator() if world > 1 else None
    if comm is not None:
        distributed.select_device(comm)
    config = TrainingConfig(steps=args.steps, batch_size=args.batch, seq_len=16, lr=1e-2, warmup=1, clip=1.0,
                            weight_decay=0.1, save_every=2, keep=0, precision=args.precision,
                            grad_accum=args.grad_accum)
    model = tiny_model(dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.precision])
    data = tiny_data()
    if args.tail:
        data = data.subset(slice(0, 9))
    if args.masked:
        data.labels = data.labels.copy()
        data.labels[::2, :12] = -100
    folder = args.out.with_suffix("")
    if comm is None:
        trainer = Trainer(model, config, Batches(data, args.batch, seed=0), out_dir=folder)
    else:
        trainer = distributed.DataParallelTrainer(
            model, config, distributed.ShardedBatches(data, args.batch, comm.rank, comm.size, seed=0),
            out_dir=folder, comm=comm, comm_dtype=args.comm, shard_optimizer=args.shard, bucket_mb=args.bucket_mb)
    if comm is not None and comm.rank == args.kill_rank:
        step = trainer.train_step

        def dying(batch):
            if trainer.step == 2:
                os._exit(9)
            return step(batch)
        trainer.train_step = dying
    if comm is not None and comm.rank == args.hang_rank:
        step = trainer.train_step

        def hanging(batch):
            if trainer.step == 2:
                time.sleep(600)
            return step(batch)
        trainer.train_step = hanging
    if args.resume:
        trainer.resume()
    history = trainer.train()
    if comm is None or comm.rank == 0:
        weights = {f"w.{name}": t.numpy() for name, t in model.named_parameters()}
        np.savez(args.out, losses=np.array([h["loss"] for h in history]),
                 norms=np.array([h["grad_norm"] for h in history]), step=trainer.step,
                 position=[trainer.train_batches.epoch, trainer.train_batches.cursor], **weights)


if __name__ == "__main__":
    main()
