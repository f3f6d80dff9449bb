"""Data-parallel training over MPI (mpi4py, ``pip install 'vkformers[mpi]'``): one process per Vulkan device.

Every rank holds the whole model and trains on its own rows of each global batch (:class:`ShardedBatches`:
rank r takes rows ``[r*B, (r+1)*B)`` of the batch of ``world*B`` rows that one process would take), so N ranks
with batch B follow the same trajectory as one rank with batch N*B, up to float32 reduction order.

A step: forward and backward of the rank's micro-batches (one submission), the gradients read back in
buckets of ``bucket_mb`` megabytes and averaged across ranks (a non-blocking all-reduce per bucket starts as
soon as the bucket is read, so the transfer of one bucket overlaps the read-back of the next; the backward pass
itself runs in one submission and cannot yet overlap with communication), then clipping and AdamW on the GPU.
``comm_dtype="bf16"`` sends the gradients as bfloat16 (half the bytes; each hop's partial sum is rounded).

ZeRO-1 (``shard_optimizer=True``): each rank keeps AdamW moments (and float32 masters of 16-bit weights) for its
share of the parameters only (whole tensors, balanced by size), updates them, and an all-gather sends every
rank the updated weights. Checkpoints are written by rank 0 alone, atomically, with the optimizer state
gathered to the layout a single-device run loads.

A rank that dies ends the run through the launcher (MPICH's mpiexec ends every rank); one that stops answering is
caught by the step's collectives, which wait at most ``$VKFORMERS_DATA_PARALLEL_TIMEOUT`` seconds and then abort.
"""
from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

try:  # Unix: how much of a pipe is still unread
    import fcntl
    import termios
except ImportError:
    fcntl = termios = None

from vkformers.engine import lazy
from vkformers.engine.tensor import tensor
from vkformers.errors import VkformersError
from vkformers.models.atomic import refuse_symlinks_below
from vkformers.optim import AdamW
from vkformers.runtime import dtypes as dt
from vkformers.runtime.vulkan import DEVICE_ENV, describe_devices
from vkformers.training import checkpoint as ckpt
from vkformers.training.data import Batches, DataError
from vkformers.training.trainer import Trainer, _int32_pair, target_shares

SHARE_DEVICE_ENV = "VKFORMERS_DATA_PARALLEL_SHARE_DEVICE"  # 1: every rank of a host on one device (testing)
TIMEOUT_ENV = "VKFORMERS_DATA_PARALLEL_TIMEOUT"  # seconds a rank waits for the others in a step's collective
COMM_DTYPES = ("fp32", "bf16")
# environment variables by which MPI launchers give a process its world size (MPICH/Hydra, Open MPI, PMIx, MVAPICH)
WORLD_SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")


class DistributedError(VkformersError, RuntimeError):
    """Data-parallel training cannot start or go on (mpi4py missing, too few devices, a different world size)."""


def _mpi():
    try:
        from mpi4py import MPI  # the optional [mpi] extra
    except ImportError:
        raise DistributedError("data-parallel training needs mpi4py and an MPI library: pip install "
                               "'vkformers[mpi]' (mpi4py with MPICH's wheel)") from None
    return MPI


def launched_world_size() -> int:
    """The world size an MPI launcher gave this process (1 when started without one)."""
    for name in WORLD_SIZE_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def find_mpiexec() -> str:
    """mpiexec beside this Python (MPICH's wheel installs it there), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.is_file() else shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise DistributedError("no mpiexec found: pip install 'vkformers[mpi]' (MPICH's wheel brings mpiexec) or "
                               "put an MPI installation's mpiexec on PATH")
    return found


def _unread_bytes(fd: int) -> int:
    """Bytes written to the pipe ``fd`` that its reader has not taken yet; 0 when ``fd`` is not a pipe or the
    platform cannot tell."""
    try:
        if termios is None or not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def print_then_abort(comm, message: str, wait_s: float = 2.0) -> None:
    """Print ``message`` on stderr and end every rank with MPI's Abort. The launcher reads a rank's stderr through
    a pipe and stops reading it once the abort arrives, so the message could be lost; wait (at most ``wait_s``)
    until the launcher has taken every byte of it first."""
    print(message, file=sys.stderr, flush=True)
    deadline = time.monotonic() + wait_s
    while _unread_bytes(sys.stderr.fileno()) and time.monotonic() < deadline:
        time.sleep(1e-3)
    comm.Abort(1)


def launcher_environment(environ=None) -> dict:
    """The environment mpiexec starts under. Open MPI's launcher refuses to run as root unless told twice, and root
    is the usual user in a container: allow it there (MPICH ignores the variables; a value already set is kept)."""
    env = dict(os.environ if environ is None else environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def launch(world_size: int, argv: list[str]) -> int:
    """Run ``vkformers <argv>`` as ``world_size`` processes on this machine under mpiexec; their exit status.
    MPICH's launcher ends every rank when one fails, so a crashed rank cannot leave the others waiting."""
    code = "import sys; from vkformers.cli import main; sys.exit(main())"
    return subprocess.call([find_mpiexec(), "-n", str(world_size), sys.executable, "-c", code, *argv],
                           env=launcher_environment())


def _bf16_sum(inbuf, inoutbuf, datatype) -> None:
    """MPI reduction of bfloat16 bit patterns: widen, add in float32, round to nearest even."""
    a = np.frombuffer(inbuf, np.uint16)
    b = np.frombuffer(inoutbuf, np.uint16)
    b[:] = dt.to_bfloat16(dt.from_bfloat16(a) + dt.from_bfloat16(b))


class Communicator:
    """The ranks of a run (an mpi4py communicator, COMM_WORLD by default) and the collectives training uses.

    ``timeout_s`` (default ``$VKFORMERS_DATA_PARALLEL_TIMEOUT`` or 600): a collective of a step that other ranks do
    not join within it (a rank hung, or its host gone without the launcher noticing) aborts the whole run
    with a message naming the wait, instead of hanging; the run resumes from its last checkpoint."""

    def __init__(self, comm=None, timeout_s: float | None = None):
        self.MPI = _mpi()
        self.timeout_s = float(os.environ.get(TIMEOUT_ENV, "600")) if timeout_s is None else timeout_s
        self.comm = comm if comm is not None else self.MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        self.local_rank = node.Get_rank()
        node.Free()
        self._bf16_op = None

    def start_mean(self, flat: np.ndarray, comm_dtype: str = "fp32"):
        """Begin averaging a float32 vector across ranks; returns a handle for :meth:`finish_mean`."""
        if comm_dtype == "bf16":
            if self._bf16_op is None:
                self._bf16_op = self.MPI.Op.Create(_bf16_sum, commute=True)
            buffer = dt.to_bfloat16(flat)
            request = self.comm.Iallreduce(self.MPI.IN_PLACE, [buffer, self.MPI.UINT16_T], op=self._bf16_op)
        else:
            buffer = np.ascontiguousarray(flat, np.float32)
            request = self.comm.Iallreduce(self.MPI.IN_PLACE, [buffer, self.MPI.FLOAT], op=self.MPI.SUM)
        return request, buffer

    def wait(self, request, what: str) -> None:
        """Wait for a non-blocking collective; past ``timeout_s``, say which and abort every rank."""
        deadline, pause = time.monotonic() + self.timeout_s, 1e-5
        while not request.Test():
            if time.monotonic() > deadline:
                print_then_abort(self.comm, f"vkformers: rank {self.rank}: no answer from the other ranks in {what} "
                                 f"for {self.timeout_s:g} s (a rank hung or its host is gone): stopping the run; "
                                 f"resume it from its last checkpoint ({TIMEOUT_ENV} sets the wait)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def total(self, value: int) -> int:
        """The sum of an integer over the ranks."""
        buffer = np.array([value], np.int64)
        self.wait(self.comm.Iallreduce(self.MPI.IN_PLACE, [buffer, self.MPI.INT64_T], op=self.MPI.SUM),
                  "the all-reduce of the loss targets")
        return int(buffer[0])

    def finish_mean(self, handle) -> np.ndarray:
        request, buffer = handle
        self.wait(request, "the gradient all-reduce")
        total = dt.from_bfloat16(buffer) if buffer.dtype == np.uint16 else buffer
        return total / np.float32(self.size)

    def all_gather_flat(self, mine: np.ndarray, counts: list[int]) -> np.ndarray:
        """Every rank's vector (``counts[r]`` elements from rank r; float32, or uint16 bfloat16 bit patterns),
        concatenated in rank order."""
        kind = self.MPI.UINT16_T if mine.dtype == np.uint16 else self.MPI.FLOAT
        out = np.empty(sum(counts), mine.dtype)
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        self.wait(self.comm.Iallgatherv(np.ascontiguousarray(mine), [out, counts, displacements, kind]),
                  "the all-gather of the updated weights")
        return out

    def abort_on_error(self, message: str) -> None:
        """Print ``message`` and end every rank: a rank that just returned would wait in MPI's finalization while
        the others wait for it in the next collective."""
        print_then_abort(self.comm, message)

    def broadcast(self, value, root: int = 0):
        return self.comm.bcast(value, root=root)

    def gather(self, value, root: int = 0):
        return self.comm.gather(value, root=root)

    def barrier(self) -> None:
        self.comm.Barrier()


def select_device(comm: Communicator) -> int:
    """Point this rank at its Vulkan device (``$VKFORMERS_DEVICE`` = local rank) before any device is made;
    with ``$VKFORMERS_DATA_PARALLEL_SHARE_DEVICE=1`` every rank keeps ``$VKFORMERS_DEVICE`` (or 0)."""
    if os.environ.get(SHARE_DEVICE_ENV) == "1":
        return int(os.environ.get(DEVICE_ENV, "0"))
    count = len(describe_devices())
    if comm.local_rank >= count:
        raise DistributedError(f"rank {comm.rank} is local rank {comm.local_rank} on its host, which has {count} "
                               f"Vulkan device(s): start at most {count} ranks per host, or set "
                               f"{SHARE_DEVICE_ENV}=1 to run several ranks on one device (for testing)")
    os.environ[DEVICE_ENV] = str(comm.local_rank)
    return comm.local_rank


class ShardedBatches(Batches):
    """This rank's rows of the batches a single process would draw with ``batch_size * world_size``.

    The order depends only on (seed, epoch, cursor), as in :class:`Batches`; the position saved in a
    checkpoint is the global one, and resuming needs the same world size. The filler rows of an epoch's last
    batches (:class:`Batches`) are those of the single process's batch: the ranks after the last sequence take
    filler alone, which weighs nothing in the step (``DataParallelTrainer`` counts every rank's targets)."""

    def __init__(self, dataset, batch_size: int, rank: int, world_size: int, seed: int = 0, shuffle: bool = True):
        super().__init__(dataset, batch_size * world_size, seed=seed, shuffle=shuffle)
        self.rank_batch_size, self.rank, self.world_size = batch_size, rank, world_size

    def _batch(self, rows, real):
        mine = slice(self.rank * self.rank_batch_size, (self.rank + 1) * self.rank_batch_size)
        return super()._batch(rows[mine], real[mine])

    def state_dict(self) -> dict:
        return {**super().state_dict(), "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("world_size", 1)
        if saved != self.world_size:
            raise DataError(f"the checkpoint was trained by {saved} data-parallel rank(s), this run has "
                            f"{self.world_size}: resume with the same number of ranks (--data-parallel {saved})")
        super().load_state_dict(state)


def partition(sizes: list[int], world_size: int) -> list[int]:
    """The owning rank of each tensor: largest first, each to the least loaded rank (ties: the lower rank)."""
    owner, load = [0] * len(sizes), [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + sizes[i]
    return owner


class _OptimizerState:
    """The checkpoint side of a sharded AdamW: every parameter's position in the full optimizer, this rank's
    state (``state_dict`` gives only the owned entries, keyed as a single-device AdamW keys them)."""

    def __init__(self, param_groups, optimizer: AdamW):
        self.param_groups, self.optimizer = param_groups, optimizer
        self.state = optimizer.state  # the same dict: loading fills it

    def state_layout(self, p):
        return self.optimizer.state_layout(p)

    def keeps_master(self, p) -> bool:
        return self.optimizer.keeps_master(p)

    def state_dict(self) -> dict:
        return AdamW.state_dict(self)


class DataParallelTrainer(Trainer):
    """:class:`Trainer` on one rank of a data-parallel run; give it :class:`ShardedBatches`.

    ``comm_dtype``: "fp32" or "bf16" gradient communication. ``shard_optimizer``: ZeRO-1.
    ``bucket_mb``: megabytes of gradients per all-reduce."""

    def __init__(self, model, config, train_batches, *, comm: Communicator, comm_dtype: str = "fp32",
                 shard_optimizer: bool = False, bucket_mb: float = 25.0, **kwargs):
        if comm_dtype not in COMM_DTYPES:
            raise DistributedError(f"gradient communication dtype must be one of {', '.join(COMM_DTYPES)}, "
                                   f"got {comm_dtype!r}")
        self.comm, self.comm_dtype, self.shard_optimizer = comm, comm_dtype, shard_optimizer
        self.bucket_elements = max(1, int(bucket_mb * 2 ** 20 / 4))
        super().__init__(model, config, train_batches, **kwargs)
        self.writes_outputs = comm.rank == 0

    def make_optimizer(self, groups):
        self.full_groups = groups
        if not self.shard_optimizer:
            return super().make_optimizer(groups)
        params = [p for g in groups for p in g["params"]]
        owners = partition([p.numel() for p in params], self.comm.size)
        self.owner = {id(p): r for p, r in zip(params, owners)}
        self.by_rank = [[p for p in params if self.owner[id(p)] == r] for r in range(self.comm.size)]
        mine = [{**g, "params": [p for p in g["params"] if self.owner[id(p)] == self.comm.rank]} for g in groups]
        return super().make_optimizer(mine)  # empty groups stay: group indices keep their meaning

    def checkpoint_optimizer(self):
        return _OptimizerState(self.full_groups, self.optimizer) if self.shard_optimizer else self.optimizer

    def saves_checkpoints(self) -> bool:
        return self.out_dir is not None  # every rank: the optimizer shards are gathered to rank 0

    # -- one step

    def train_step(self, micro_batches):
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        self._capture.forget()  # the step reads gradients back mid-way: no recorded replay
        scale = tensor(np.float32(self.scaler.scale)) if self.scaler is not None else None
        batches = [_int32_pair(*mb) for mb in micro_batches]
        total = self._forward_backward(batches, scale, self._loss_shares(batches))
        total = self._average_gradients(total)
        stats_vector, factor = self._statistics(total, scale)
        if self.scaler is None:
            self._apply_update(factor)
            stats = stats_vector.numpy()
            lazy.realize([])
        else:  # fp16: every rank sees the same averaged gradients, so all skip or all update
            stats = stats_vector.numpy()
            if stats[2] == 1.0:
                self._apply_update(factor)
                lazy.realize([])
        del stats_vector, factor
        if self.shard_optimizer and (self.scaler is None or stats[2] == 1.0):
            self._gather_parameters()
        for p in self.params:
            p.grad = None
        return self._step_result(stats, lr)

    def _loss_shares(self, micro_batches) -> np.ndarray:
        """Each micro-batch's share of the loss targets of every rank's step, times the world size (the gradients
        are then averaged): the ranks together compute the mean over all their targets, as one process with
        every row would."""
        counts = self._target_counts(micro_batches)
        total = self.comm.total(int(counts.sum()))
        return target_shares(counts * self.comm.size, total)

    def _average_gradients(self, total):
        """Read the gradients back in buckets, average each across ranks (non-blocking, overlapping the next
        read-back), put the means back as the gradients; returns the loss averaged across ranks."""
        with_grad = [p for p in self.params if p.grad is not None]
        lazy.realize([total.lazy] + [p.grad.lazy for p in with_grad])
        loss = self.comm.start_mean(total.numpy().reshape(1).astype(np.float32))
        buckets, current, filled = [], [], 0
        for p in reversed(with_grad):  # the order backward finishes them: the output end first
            current.append(p)
            filled += p.numel()
            if filled >= self.bucket_elements:
                buckets.append(current)
                current, filled = [], 0
        if current:
            buckets.append(current)
        pending = []
        for bucket in buckets:
            flat = np.concatenate([p.grad.numpy().reshape(-1).astype(np.float32, copy=False) for p in bucket])
            pending.append((bucket, self.comm.start_mean(flat, self.comm_dtype)))
        for bucket, handle in pending:
            flat, offset = self.comm.finish_mean(handle), 0
            for p in bucket:
                grad = flat[offset:offset + p.numel()].reshape(p.shape)
                p.grad = tensor(grad, dtype=p.grad.dtype, device=p.device)
                offset += p.numel()
        return tensor(self.comm.finish_mean(loss).reshape(()), device=total.device)

    def _gather_parameters(self) -> None:
        """ZeRO-1: every rank's updated shard to every rank (as bfloat16 when every trained weight is one, exactly;
        else float32)."""
        mine = self.by_rank[self.comm.rank]
        flat = np.concatenate([p.numpy().reshape(-1).astype(np.float32, copy=False) for p in mine]) if mine \
            else np.zeros(0, np.float32)
        as_bf16 = all(p.dtype is dt.bfloat16 for p in self.params)
        counts = [sum(p.numel() for p in params) for params in self.by_rank]
        everything = self.comm.all_gather_flat(dt.to_bfloat16(flat) if as_bf16 else flat, counts)
        everything, offset = dt.from_bfloat16(everything) if as_bf16 else everything, 0
        for rank, params in enumerate(self.by_rank):
            for p in params:
                if rank != self.comm.rank:
                    ckpt.write_into(p, everything[offset:offset + p.numel()].reshape(p.shape))
                offset += p.numel()

    # -- checkpoints

    def save_checkpoint(self) -> Path:
        """Rank 0 writes the checkpoint (atomically, as a single-device run does); every rank learns its folder."""
        if self.out_dir is None:
            raise VkformersError("save_checkpoint needs an out_dir")
        state = self.checkpoint_optimizer()
        if self.shard_optimizer:
            shards = self.comm.gather(state.state_dict())
            if self.comm.rank == 0:
                merged = {k: v for shard in shards for k, v in shard.items()}
                state = SimpleNamespace(state_dict=lambda: merged)
        folder, error = None, None
        if self.comm.rank == 0:
            try:
                root = refuse_symlinks_below(self.out_dir, self.out_dir / "checkpoints")
                folder = ckpt.save_checkpoint(root, self.step, model=self.model, optimizer=state,
                                              trainer_state=self.trainer_state(), keep=self.config.keep,
                                              adapter=hasattr(self.model, "lora_config"),
                                              spare=self.last_good_checkpoint)
            except Exception as exc:
                error = exc
        folder, message = self.comm.broadcast((folder, None if error is None else str(error)))
        if error is not None:
            raise error
        if message is not None:
            raise ckpt.CheckpointSaveError(f"rank 0 could not save the checkpoint: {message}")
        self.last_checkpoint = Path(folder)
        if not self.history or np.isfinite(self.history[-1].get("loss", np.nan)):
            self.last_good_checkpoint = self.last_checkpoint
        return self.last_checkpoint

    def trainer_state(self) -> dict:
        return {**super().trainer_state(),
                "data_parallel": {"world_size": self.comm.size, "comm_dtype": self.comm_dtype,
                                  "shard_optimizer": self.shard_optimizer}}

    def resume(self, folder=None):
        """As :meth:`Trainer.resume`, with rank 0 choosing the checkpoint so that every rank loads the same one."""
        if folder is None:
            chosen = None
            if self.comm.rank == 0 and self.out_dir is not None:
                chosen, self.skipped_checkpoints = ckpt.newest_verified_checkpoint(self.out_dir / "checkpoints")
            chosen = self.comm.broadcast(None if chosen is None else str(chosen))
            if chosen is None:
                return None
            folder = chosen
        loaded = super().resume(folder)
        if self.shard_optimizer:  # keep this rank's shard of the state just loaded
            for p in [p for g in self.full_groups for p in g["params"]]:
                if self.owner[id(p)] != self.comm.rank:
                    self.optimizer.state.pop(id(p), None)
        return loaded
