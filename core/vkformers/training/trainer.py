"""The training loop: one recorded submission per optimizer step.

Each step builds, lazily, the forward and backward of every micro-batch (gradient accumulation),
the global gradient norm (a sum of squares over all gradients, on the GPU), the clipping factor
``min(1, clip / norm)`` (applied as a tensor multiply, so it needs no host round trip) and the
AdamW update. Reading a small vector of step statistics (loss, norm, an all-finite flag) realizes
all of it in one submission; from the third step on the engine replays the recorded plan
(``engine.lazy.stats["recorded"]`` stays put).

Mixed precision (``precision="bf16"|"fp16"``): the model's weights are 16-bit, AdamW keeps float32
master weights and moments (bf16 with ``master_weights=False``: none, the bfloat16 weights are updated in place,
as torch.optim.AdamW updates a bfloat16 model). For fp16 a dynamic loss scale multiplies the loss before backward and
divides the gradients after. Whether a step overflowed is only known once the gradients exist, and
AdamW updates its state in place, so fp16 steps run in **two submissions**: the first computes loss,
gradients and the overflow flag (read with the loss); only when the gradients are finite does the
second apply the (unscaled, clipped) update. Overflowing steps are skipped and the scale halves;
after ``scale_growth_interval`` good steps it doubles (torch.amp.GradScaler's policy). fp32 and
bf16 steps stay one submission; a non-finite loss there stops the run with
:class:`NonFiniteLossError` before anything more is saved, so the last checkpoint stays good.
"""
from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from vkformers.engine import lazy
from vkformers.engine.function import no_grad
from vkformers.engine.ops import nn as nn_ops
from vkformers.engine.ops.nn import dropout_rng_state, set_dropout_rng_state
from vkformers.engine.ops.elementwise import where
from vkformers.engine.tensor import Tensor, parameter, tensor
from vkformers.errors import OutputFolderError, VkformersError
from vkformers.models.atomic import make_folder, open_for_append, refuse_symlinks_below, write_bytes_atomic, \
    write_text_atomic
from vkformers.models import lora
from vkformers.models.layers import Embedding, RMSNorm
from vkformers.models.loading import save_pretrained
from vkformers.models.quantize import refuse_quantized
from vkformers.optim import OPTIMIZERS, AdamW
from vkformers.runtime import dtypes as dt
from vkformers.training import checkpoint as ckpt
from vkformers.training.schedules import SCHEDULES, lr_factor

PRECISIONS = {"fp32": dt.float32, "bf16": dt.bfloat16, "fp16": dt.float16}
FLOAT32_MAX = float(np.finfo(np.float32).max)
PLOT_HINT = ("no loss_curve.png: drawing it needs matplotlib (pip install 'vkformers[plot]'); "
             "metrics.jsonl has every step")


class NonFiniteLossError(VkformersError, FloatingPointError):
    """The loss or the gradients became NaN/inf; the run stopped and nothing after the last checkpoint was saved."""


class TrainingConfigError(VkformersError, ValueError):
    """A training setting out of its range (a batch size of 0, a negative learning rate...)."""


class VocabularyMismatchError(VkformersError, ValueError):
    """Token ids the model's embedding has no row for: the tokenizer does not belong to the model."""


@dataclass
class TrainingConfig:
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-4
    schedule: str = "cosine"
    warmup: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    clip: float = 1.0               # global gradient-norm clipping; 0 turns it off
    grad_accum: int = 1
    eval_every: int = 0             # 0: evaluate only at the end (when there is held-out data)
    eval_batches: int = 8
    save_every: int = 0             # 0: no intermediate checkpoints
    keep: int = 2
    precision: str = "fp32"
    seed: int = 0
    loss_scale: float = 2.0 ** 16   # fp16 only: initial dynamic loss scale
    scale_growth_interval: int = 2000
    optim: str = "adamw"            # optim.OPTIMIZERS: adamw | adamw_bf16_states | adamw_8bit
    gradient_checkpointing: bool = False  # recompute each layer in the backward pass (less activation memory)
    master_weights: bool = True     # bf16: float32 masters of the weights (False: updated in place, 4 bytes less each)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise TrainingConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.schedule not in SCHEDULES:
            raise TrainingConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        at_least = {"steps": 0, "batch_size": 1, "seq_len": 2, "grad_accum": 1, "warmup": 0, "eval_every": 0,
                    "eval_batches": 1, "save_every": 0, "keep": 0, "seed": 0, "scale_growth_interval": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise TrainingConfigError(f"{name} must be a whole number >= {low}, got {value!r}")
        for name, ok, what in (("lr", lambda v: v > 0, "> 0"), ("weight_decay", lambda v: v >= 0, ">= 0"),
                               ("clip", lambda v: v >= 0, ">= 0 (0: off)"), ("eps", lambda v: v > 0, "> 0"),
                               ("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
                               ("loss_scale", lambda v: v > 0, "> 0")):
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.floating)) or not math.isfinite(value) or not ok(value):
                raise TrainingConfigError(f"{name} must be a finite number {what}, got {value!r}")
        self.betas = tuple(self.betas)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise TrainingConfigError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.master_weights and self.precision != "bf16":
            raise TrainingConfigError(f"training without master weights updates bfloat16 weights in place; precision "
                                      f"{self.precision} needs --precision bf16 (or keep the master weights)")
        if self.optim not in OPTIMIZERS:
            raise TrainingConfigError(f"optim must be one of {', '.join(OPTIMIZERS)}, got {self.optim!r}")


@dataclass
class StepResult:
    step: int                 # optimizer steps done after this one (1 for the first)
    loss: float
    grad_norm: float
    lr: float
    skipped: bool = False     # fp16 overflow: no update applied
    loss_scale: float | None = None


class LossScaler:
    """Dynamic loss scaling (torch.amp.GradScaler's policy): halve on overflow, double after N good steps."""

    def __init__(self, scale: float = 2.0 ** 16, growth_interval: int = 2000, growth: float = 2.0,
                 backoff: float = 0.5, min_scale: float = 2.0 ** -24):
        self.scale, self.growth_interval, self.growth, self.backoff = float(scale), growth_interval, growth, backoff
        self.min_scale, self.good_steps = min_scale, 0

    def update(self, finite: bool) -> None:
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale, self.good_steps = self.scale * self.growth, 0
        else:
            self.scale, self.good_steps = self.scale * self.backoff, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def init_weights(model, *, seed: int = 0, std: float | None = None, dtype="float32") -> None:
    """Random weights for training from scratch: normal(0, std) matrices, ones for norms, zeros for biases. Without
    ``std``, as transformers initialises the model: each matrix's own std where the model's family declares one
    (``initial_std(name)``: T5's scaled normals), else the config's ``initializer_range`` (``init_std``: BART's
    spelling), else 0.02. As transformers does too, an embedding's ``padding_idx`` row starts at zero, and so does
    the weight of an RMS norm that scales by 1 + weight (Gemma's, Qwen3.5's)."""
    config = getattr(model, "config", None) or {}
    default = float(config.get("initializer_range", config.get("init_std", 0.02))) if std is None else std
    declared = getattr(model, "initial_std", None) if std is None else None
    zero_rows, zero_norms = {}, set()
    for path, module in model.named_modules():
        weight = f"{path}.weight" if path else "weight"
        if isinstance(module, Embedding) and module.padding_idx is not None:
            zero_rows[weight] = module.padding_idx
        if isinstance(module, RMSNorm) and module.unit_offset:
            zero_norms.add(weight)
    slots = list(model.named_slots())
    for name, slot in slots:  # a padding row of a table tied to another: the owner's row
        if slot.tied_to is not None and name in zero_rows:
            zero_rows[slot.tied_to] = zero_rows[name]
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, slot in slots:
        if slot.tied_to is not None:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias" or name in zero_norms:
            arrays[name] = np.zeros(slot.shape, np.float32)
        elif len(slot.shape) == 1:  # norm weights
            arrays[name] = np.ones(slot.shape, np.float32)
        else:
            scale = declared(name) if declared is not None else None
            arrays[name] = (rng.standard_normal(slot.shape) * (default if scale is None else scale)).astype(np.float32)
            if name in zero_rows:
                arrays[name][zero_rows[name]] = 0.0
    model.load_state_dict(arrays, dtype=dtype)


def _int32_pair(ids, labels, *mask):
    """Batch arrays as the arrays the model takes in as they are (separate objects, even for ids == labels): int32
    ids, labels (float labels of a regression or multi-label head stay float32) and the attention mask if given."""
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    labels = np.ascontiguousarray(labels, dtype=np.float32 if np.asarray(labels).dtype.kind == "f" else np.int32)
    return (ids, labels.copy() if labels is ids else labels) + tuple(np.ascontiguousarray(m, np.int32) for m in mask)


def target_shares(counts: np.ndarray, total: float) -> np.ndarray:
    """``counts / total`` as float32 (each micro-batch's share of ``total`` loss targets); equal shares where
    there are no targets at all (the loss is then not finite, and the step says so)."""
    if total <= 0:
        return np.full(len(counts), 1.0 / len(counts), np.float32)
    return (np.asarray(counts, np.float64) / total).astype(np.float32)


def _forward(model, batch):
    """``model(input_ids, labels=..., attention_mask=..., token_type_ids=...)`` for a batch of (input_ids, labels[,
    attention_mask[, token_type_ids]])."""
    input_ids, labels, *rest = batch
    return model(input_ids, labels=labels, **dict(zip(("attention_mask", "token_type_ids"), rest)))


class Trainer:
    """Train ``model`` (whose parameters with ``requires_grad`` are trained) on ``train_batches``.

    ``train_batches``: a :class:`~vkformers.training.data.Batches` (or anything iterable with
    ``state_dict``/``load_state_dict``) yielding (input_ids, labels) numpy arrays, or (input_ids, labels,
    attention_mask) for padded batches (a task head's labels: one per sequence, float for regression), with
    token_type_ids fourth for text pairs (question answering on a BERT-style model). Where it has
    ``next_step(micro_batches)`` each step takes its ``grad_accum`` micro-batches from it (Batches ends each epoch
    on a step); a micro-batch without targets takes no part in the step.
    ``eval_batches``: a list of such tuples for the held-out loss.
    ``out_dir``: where checkpoints/, metrics.jsonl, loss_curve.png and final/ go (None: nothing written).
    """

    def __init__(self, model, config: TrainingConfig, train_batches, *, eval_batches=None, out_dir=None,
                 progress: bool = False, run_info: dict | None = None):
        self.model, self.config, self.train_batches = model, config, train_batches
        self.eval_batches = eval_batches or []
        self.out_dir = check_output_folder(out_dir) if out_dir is not None else None
        self.progress, self.run_info = progress, run_info or {}
        self.writes_outputs = True  # metrics.jsonl and loss_curve.png (in a data-parallel run: rank 0 only)
        if getattr(model, "lora_config", None) is None:
            refuse_quantized(model, "full fine-tuning", "quantized weights are frozen in their packed blocks; train "
                             "LoRA adapters on top of them (models.lora.apply_lora, or --lora-rank)")
        self.params = [t for t in model.parameters() if t.requires_grad]
        if not self.params:
            raise VkformersError("nothing to train: no parameter of the model requires grad")
        if getattr(getattr(model, "spec", None), "shift_labels", True) is False:  # TrOCRForCausalLM
            raise VkformersError(f"{getattr(model, 'architecture_name', 'this model')}: its loss reads labels[t] for "
                                 "logits[t] (transformers does not shift them), but the Trainer's batches hold labels "
                                 "aligned with input_ids for a loss that shifts them")
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]  # biases and norm weights, as HF's Trainer does
        groups = [{"params": g, "weight_decay": wd} for g, wd in ((decay, config.weight_decay), (no_decay, 0.0)) if g]
        self.optimizer = self.make_optimizer(groups)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        # Create moments (and float32 masters of 16-bit weights) now: created inside the first step they
        # would read each weight back mid-graph, splitting step 1 into many submissions and recordings.
        self.optimizer.init_state()
        self.scaler = LossScaler(config.loss_scale, config.scale_growth_interval) if config.precision == "fp16" \
            else None
        self.vocab_size = model_vocab_size(model)
        for input_ids, *_ in self.eval_batches:
            check_token_ids(input_ids, self.vocab_size, "the held-out data")
        self.step, self.tokens_seen, self.last_checkpoint = 0, 0, None
        # the newest checkpoint saved after a step with a finite loss (an fp16 run can save one whose step
        # overflowed and was skipped: its weights are the previous step's, but what follows may be broken)
        self.last_good_checkpoint = None
        self.skipped_checkpoints: list[tuple[Path, str]] = []  # by resume(): newer ones that failed verification
        self.loss_curve_file: Path | None = None  # written by train() when matplotlib is installed
        self.history: list[dict] = []
        # Constant one-hot masks that pack the step's statistics into one vector (one read per step).
        self._slots = [parameter(np.eye(3, dtype=bool)[i], requires_grad=False, name="stat_slot") for i in range(3)]
        self._capture = lazy.StepCapture()
        nn_ops.manual_seed(config.seed)

    def make_optimizer(self, groups):
        """The AdamW that updates ``groups`` (a data-parallel trainer with sharded state keeps its shard)."""
        c = self.config
        return AdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps, master_weights=c.master_weights,
                     **OPTIMIZERS[c.optim])

    # -- one step

    def current_lr(self, step: int | None = None) -> float:
        c = self.config
        return c.lr * lr_factor(self.step if step is None else step, schedule=c.schedule, warmup=c.warmup,
                                total=c.steps, min_ratio=c.min_lr_ratio)

    def _next_micro_batches(self):
        step = getattr(self.train_batches, "next_step", None)  # Batches: each epoch ends on a whole step
        batches = step(self.config.grad_accum) if step is not None else \
            [next(self.train_batches) for _ in range(self.config.grad_accum)]
        for input_ids, *_ in batches:  # cheap on the host; an id past the embedding would train on garbage
            check_token_ids(input_ids, self.vocab_size, "the training data")
        return batches

    def _pack(self, loss: Tensor, norm: Tensor, finite: Tensor) -> Tensor:
        """[loss, norm, finite] as one float32 vector (``where``, so a NaN in one slot stays in that slot)."""
        out = finite.reshape(1).expand(3)
        out = where(self._slots[1], norm.reshape(1), out)
        return where(self._slots[0], loss.reshape(1), out)

    def train_step(self, micro_batches) -> StepResult:
        """Forward/backward every micro-batch, clip, update; returns the step's statistics.

        Without fp16 loss scaling the whole step is one submission, and from the third step on
        (same shapes) it replays the recorded plan without building the graph in Python
        (engine.lazy.StepCapture): inputs are the batches, the optimizer's per-step scalars
        and dropout seeds are drawn as the graph would draw them."""
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        if self.scaler is None:
            batches = [_int32_pair(*mb) for mb in micro_batches]
            inputs = {f"{what}{i}": a for i, mb in enumerate(batches) for what, a in zip(("ids", "labels", "mask", "types"), mb)}
            inputs["shares"] = shares = self._loss_shares(batches)

            def build():  # one submission: the update rides along with reading the statistics
                stats_vector, factor = self._build_step(batches, None, shares)
                self._apply_update(factor)
                return [stats_vector]
            stats = self._capture.run(build, inputs)[0]
        else:  # fp16: read the overflow flag first, update only if the gradients are finite
            self._capture.forget()
            scale = tensor(np.float32(self.scaler.scale))  # an input, so plans replay
            stats_vector, factor = self._build_step(micro_batches, scale, self._loss_shares(micro_batches))
            stats = stats_vector.numpy()
            if stats[2] == 1.0:
                self._apply_update(factor)
                lazy.realize([])
            del stats_vector, factor
        self.optimizer.zero_grad()
        return self._step_result(stats, lr)

    def _step_result(self, stats, lr: float) -> StepResult:
        """The step's statistics [loss, norm, finite] read back: the loss scale's policy, the stop on a
        non-finite loss, the step count."""
        loss_value, norm_value, ok = float(stats[0]), float(stats[1]), stats[2] == 1.0
        result = StepResult(self.step + 1, loss_value, norm_value, lr,
                            skipped=not ok and self.scaler is not None,
                            loss_scale=self.scaler.scale if self.scaler else None)
        if self.scaler is not None:
            self.scaler.update(ok)
            if self.scaler.scale < self.scaler.min_scale:
                raise NonFiniteLossError(self._stop_message(result, "the fp16 loss scale underflowed "
                                                                    f"({self.scaler.scale:g}) after repeated overflows"))
        elif not ok:
            raise NonFiniteLossError(self._stop_message(result, f"loss {loss_value} / gradient norm {norm_value} "
                                                                "is not finite"))
        self.step += 1
        return result

    def _build_step(self, micro_batches, scale, shares):
        """The step's graph up to the update: the statistics vector [loss, norm, finite], and the factor
        (clipping, unscaling; None for neither) the update applies to the parameters' gradients."""
        return self._statistics(self._forward_backward(micro_batches, scale, shares), scale)

    def _loss_shares(self, micro_batches) -> np.ndarray:
        """Each micro-batch's share of the step's loss targets (float32), by which its mean loss is weighted:
        the step's loss is the mean over all its targets and its gradients those of one batch of every row,
        however masked prompts or padding spread the targets among micro-batches (as transformers' Trainer
        counts ``num_items_in_batch``)."""
        counts = self._target_counts(micro_batches)
        return target_shares(counts, counts.sum())

    def _target_counts(self, micro_batches) -> np.ndarray:
        """How many targets each micro-batch's loss averages over (float64)."""
        return np.array([self.model.loss_target_count(labels) for _, labels, *_ in micro_batches], np.float64)

    def _forward_backward(self, micro_batches, scale, shares: np.ndarray) -> Tensor:
        """Every micro-batch's forward and backward (the gradients accumulate), each loss weighted by its
        ``shares`` entry; returns the step's loss."""
        total = None
        weights = tensor(shares)  # an input: a replayed step takes the next step's shares
        with lazy.deferred_backward():  # realized with the clip and the update, one submission
            for index, batch in enumerate(micro_batches):
                weight = weights[index]
                # a micro-batch without targets (filler at an epoch's end) has the mean loss 0/0: it weighs nothing
                loss = where(weight > 0, _forward(self.model, batch).loss.float() * weight, 0.0)
                (loss * scale if scale is not None else loss).backward()
                total = loss if total is None else total + loss
                del loss
        return total

    def _statistics(self, total: Tensor, scale):
        """The statistics vector and update factor of :meth:`_build_step` from the loss and gradients."""
        c = self.config
        with no_grad():
            sum_sq = None
            for p in self.params:  # global norm: one reduction per gradient, summed on the GPU
                if p.grad is None:
                    continue
                s = p.grad.float().square().sum()  # a 16-bit gradient widened on the way (not kept)
                sum_sq = s if sum_sq is None else sum_sq + s
            norm = sum_sq.sqrt()
            # "x <= FLT_MAX" is false for inf and NaN alike
            finite = where(sum_sq <= FLOAT32_MAX, 1.0, 0.0) * where(total.abs() <= FLOAT32_MAX, 1.0, 0.0)
            unscale = 1.0 / scale if scale is not None else None
            if unscale is not None:
                norm = norm * unscale
            factor = (c.clip / (norm + 1e-6)).clamp(max=1.0) if c.clip > 0 else None
            if unscale is not None:
                factor = unscale if factor is None else factor * unscale
            stats_vector = self._pack(total.detach(), norm, finite)
        return stats_vector, factor

    def _apply_update(self, factor) -> None:
        """AdamW on the gradients times ``factor`` (clipping, unscaling), which the update kernel applies as it
        reads each gradient: no scaled copy of the gradients is made."""
        with no_grad():
            self.optimizer.step(grad_factor=factor.float().reshape(1) if factor is not None else None)

    def _stop_message(self, result: StepResult, what: str) -> str:
        good = self.last_good_checkpoint
        message = f"step {result.step}: {what}; training stopped. "
        message += (f"Last good checkpoint: {good} (resume from it, --resume {good}, with a lower --lr, --clip, or "
                     "--precision bf16/fp32)" if good else
                     "No good checkpoint was saved (start again with a lower --lr, --clip, or --precision bf16/fp32)")
        if self.out_dir is not None:
            message += f"; the metrics of the steps run are in {self.out_dir / 'metrics.jsonl'}"
        return message

    # -- evaluation

    def evaluate(self) -> float | None:
        """Mean loss over the held-out batches (one submission), or None without held-out data."""
        if not self.eval_batches:
            return None
        self.model.eval()
        with no_grad():
            total = None
            for batch in self.eval_batches[: self.config.eval_batches]:
                loss = _forward(self.model, batch).loss.float()
                total = loss if total is None else total + loss
            value = total.item() / min(len(self.eval_batches), self.config.eval_batches)
        self.model.train()
        return value

    # -- checkpoints

    def trainer_state(self) -> dict:
        return {"format": 1, "step": self.step, "epoch": getattr(self.train_batches, "epoch", 0),
                "data_position": self.train_batches.state_dict(), "dropout_rng": dropout_rng_state(),
                "lr": self.current_lr(), "loss_scale": self.scaler.state_dict() if self.scaler else None,
                "tokens_seen": self.tokens_seen, "config": asdict(self.config), "run": self.run_info}

    def checkpoint_optimizer(self):
        """What a checkpoint's optimizer state is read into and written from (``state_dict()``, ``param_groups``,
        ``state``, ``state_layout``): the optimizer, or a view of every rank's shard in a sharded run."""
        return self.optimizer

    def saves_checkpoints(self) -> bool:
        """Whether :meth:`train` calls :meth:`save_checkpoint` (every rank of a data-parallel run takes part)."""
        return self.out_dir is not None

    def save_checkpoint(self) -> Path:
        if self.out_dir is None:
            raise VkformersError("save_checkpoint needs an out_dir")
        root = refuse_symlinks_below(self.out_dir, self.out_dir / "checkpoints")
        self.last_checkpoint = ckpt.save_checkpoint(
            root, self.step, model=self.model, optimizer=self.checkpoint_optimizer(),
            trainer_state=self.trainer_state(), keep=self.config.keep, adapter=hasattr(self.model, "lora_config"),
            spare=self.last_good_checkpoint)
        if not self.history or math.isfinite(self.history[-1].get("loss", math.nan)):
            self.last_good_checkpoint = self.last_checkpoint
        return self.last_checkpoint

    def resume(self, folder=None) -> Path | None:
        """Continue from ``folder`` (default: the newest checkpoint in out_dir that verifies); None if there is
        none. Newer checkpoints that fail verification (cut short, damaged) are skipped and listed, with
        the reason, in ``skipped_checkpoints``; a ``folder`` given that fails raises CheckpointLoadError."""
        self.skipped_checkpoints = []
        if folder is None:
            if self.out_dir is None:
                return None
            folder, self.skipped_checkpoints = ckpt.newest_verified_checkpoint(self.out_dir / "checkpoints")
            if folder is None:
                return None
        else:
            folder = Path(folder)
            reason = ckpt.verify_checkpoint(folder)
            if reason is not None:
                raise ckpt.CheckpointLoadError(f"{folder} is not an intact checkpoint: {reason}")
        saved_state = json.loads((folder / ckpt.STATE_FILE).read_text())
        saved = saved_state["config"]
        ranks = (saved_state.get("data_parallel") or {}).get("world_size", 1)
        if ranks != getattr(self.train_batches, "world_size", 1):
            raise ckpt.CheckpointLoadError(f"{folder} was trained by {ranks} data-parallel rank(s), this run has "
                                           f"{getattr(self.train_batches, 'world_size', 1)}; resume with the same "
                                           "number of ranks (its weights load into any run: load_checkpoint)")
        for key in ("precision", "batch_size", "seq_len", "grad_accum", "master_weights"):
            if saved.get(key, True if key == "master_weights" else None) != getattr(self.config, key):
                raise ckpt.CheckpointLoadError(f"{folder} was trained with {key}={saved.get(key)!r}, this run has "
                                               f"{getattr(self.config, key)!r}; resume with the same setting")
        state = ckpt.load_checkpoint(folder, model=self.model, optimizer=self.checkpoint_optimizer(), verify=False)
        self._capture.forget()  # loading may have replaced the tensors the recorded step updates
        self.step, self.tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
        self.train_batches.load_state_dict(state["data_position"])
        set_dropout_rng_state(state["dropout_rng"])
        if self.scaler and state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])
        self.last_checkpoint = self.last_good_checkpoint = folder
        if self.out_dir is not None and self.writes_outputs and (self.out_dir / "metrics.jsonl").is_file():
            # forget steps to be redone
            self.history = [m for m in _read_metrics(self.out_dir / "metrics.jsonl") if m["step"] <= self.step]
            _write_metrics(self.out_dir / "metrics.jsonl", self.history)
        return folder

    # -- the loop

    def train(self) -> list[dict]:
        """Run until ``config.steps``; returns the metrics of every step of this run (also in metrics.jsonl)."""
        c = self.config
        metrics_file = None
        if self.out_dir is not None and self.writes_outputs:
            make_folder(self.out_dir)
            metrics_file = open_for_append(self.out_dir / "metrics.jsonl")
        bar = _progress_bar(c.steps, self.step, self.progress)
        done: list[dict] = []
        try:
            started, start_tokens = time.perf_counter(), self.tokens_seen
            while self.step < c.steps:
                batch = self._next_micro_batches()
                tokens = sum(int(ids.size) for ids, *_ in batch)
                step_start = time.perf_counter()
                result = self.train_step(batch)
                now = time.perf_counter()
                self.tokens_seen += tokens
                record = {"step": result.step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                          "tokens": self.tokens_seen, "tokens_per_s": tokens / max(now - step_start, 1e-9),
                          "elapsed_s": now - started}
                if self.scaler:
                    record.update(loss_scale=result.loss_scale, skipped=result.skipped)
                last = self.step == c.steps
                if self.eval_batches and ((c.eval_every and self.step % c.eval_every == 0) or last):
                    record["eval_loss"] = self.evaluate()
                done.append(record)
                self.history.append(record)
                if metrics_file:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()
                if bar is not None:
                    rate = (self.tokens_seen - start_tokens) / max(now - started, 1e-9)
                    post = {"loss": f"{result.loss:.4f}", "tok/s": f"{rate:,.0f}"}
                    if "eval_loss" in record:
                        post["eval"] = f"{record['eval_loss']:.4f}"
                    if result.skipped:
                        post["skipped"] = "overflow"
                    bar.set_postfix(post, refresh=False)
                    bar.update(1)
                if self.saves_checkpoints() and c.save_every and (self.step % c.save_every == 0 or last):
                    self.save_checkpoint()
        except BaseException:
            self._close(bar, metrics_file)
            try:  # the curve of the steps run so far, without hiding why the run stopped
                self._write_loss_curve()
            except Exception:
                pass
            raise
        self._close(bar, metrics_file)
        self._write_loss_curve()
        return done

    @staticmethod
    def _close(bar, metrics_file) -> None:
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()

    def _write_loss_curve(self) -> None:
        if self.out_dir is not None and self.writes_outputs and self.history:
            path = self.out_dir / "loss_curve.png"
            self.loss_curve_file = path if write_loss_curve(path, self.history) else None

    def save_final(self, folder=None, *, merge: bool = False) -> Path:
        """The trained model as ``save_pretrained`` writes it, or the PEFT adapter (merged into the model if asked)."""
        folder = Path(folder) if folder is not None else self.out_dir / "final"
        if self.out_dir is not None and folder.is_relative_to(self.out_dir):  # out/final, not a link out of it
            refuse_symlinks_below(self.out_dir, folder)
        if merge and hasattr(self.model, "lora_config"):
            lora.merge_lora(self.model)
        save_pretrained(self.model, folder)  # a model with adapters: the adapter
        return folder


# ---------------------------------------------------------------- metrics, progress, loss curve

def _read_metrics(file: Path) -> list[dict]:
    if not file.is_file():
        return []
    out = []
    for line in file.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return out


def _write_metrics(file: Path, records: list[dict]) -> None:
    write_text_atomic(file, "".join(json.dumps(r) + "\n" for r in records))


def _progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm  # huggingface_hub's dependency; loaded only when a bar is shown
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc="train")


def write_loss_curve(path, history: list[dict]) -> bool:
    """The training loss per step and the held-out loss, with axes, ticks and a legend (matplotlib, Agg
    canvas). Only finite points are drawn (fp16 steps that overflowed, a run that diverged: left out, counted
    in the title).
    Returns False, writing nothing, when matplotlib is not installed (``pip install 'vkformers[plot]'``)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # the optional [plot] extra
        from matplotlib.figure import Figure
    except ImportError:
        return False
    train = [(m["step"], m["loss"]) for m in history if _finite(m.get("loss"))]
    held_out = [(m["step"], m["eval_loss"]) for m in history if _finite(m.get("eval_loss"))]
    figure = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas, whatever pyplot's backend is: no window, no global state
    axes = figure.add_subplot()
    if train:
        axes.plot(*zip(*train), color="tab:blue", linewidth=1.2, label="training loss")
    if held_out:
        axes.plot(*zip(*held_out), color="tab:red", marker="o", markersize=4, linewidth=1, label="held-out loss")
    skipped = len(history) - len(train)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("cross-entropy loss (nats per token)")
    axes.set_title("loss curve" + (f" ({skipped} step(s) with a non-finite loss not drawn)" if skipped else ""))
    axes.grid(True, color="0.9")
    if train or held_out:
        axes.legend()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    write_bytes_atomic(path, buffer.getvalue())
    return True


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def model_vocab_size(model) -> int | None:
    """The number of token ids the model's embedding has rows for (config's vocab_size), if it says."""
    config = getattr(model, "config", None) or {}
    size = config.get("vocab_size") if hasattr(config, "get") else None
    return int(size) if isinstance(size, (int, np.integer)) and size > 0 else None


def check_token_ids(input_ids, vocab_size: int | None, what: str = "the data") -> None:
    """:class:`VocabularyMismatchError` when ``input_ids`` hold an id the model has no embedding row for."""
    if vocab_size is None or np.size(input_ids) == 0:
        return
    largest = int(np.max(input_ids))
    if largest >= vocab_size:
        raise VocabularyMismatchError(
            f"{what} holds token id {largest:,} but the model's vocabulary has {vocab_size:,} ids "
            f"(0-{vocab_size - 1:,}): "
            "the tokenizer does not belong to this model; use the model's own tokenizer (leave out --tokenizer), "
            f"or a model whose vocab_size is at least {largest + 1:,}")


def check_output_folder(path) -> Path:
    """``path`` if it can be an output folder (missing, or a folder); :class:`OutputFolderError` if it names
    something else, such as an existing file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputFolderError(f"{path} exists and is not a folder; give a folder for the output "
                                "(it is created if missing)")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OutputFolderError(f"cannot create the output folder {path}: {existing} is not a folder this user may "
                                "write in; choose another output folder")
    return path
