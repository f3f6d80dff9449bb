"""Learning-rate schedules: pure functions of the optimizer step.

``lr_factor(step, ...)`` is the multiplier applied to every parameter group's
base learning rate before optimizer step ``step`` (0 for the first update), with
the semantics of transformers' ``get_{constant,linear,cosine}_schedule_with_warmup``:
a linear warmup from 0 over ``warmup`` steps, then constant, a linear decay to
``min_ratio`` at ``total``, or a half cosine to ``min_ratio`` at ``total``.
Being pure functions of the step, schedules need no state in a checkpoint.
"""
from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, schedule: str = "constant", warmup: int = 0, total: int = 1,
              min_ratio: float = 0.0) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if step < 0:
        raise ValueError(f"schedule step must be >= 0, got {step}")
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def learning_rate(step: int, base_lr: float, **schedule) -> float:
    """base_lr * lr_factor(step, **schedule)."""
    return base_lr * lr_factor(step, **schedule)
