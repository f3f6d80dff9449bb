"""Optimizers with ``torch.optim`` semantics, updating parameters in place on the device.

``AdamW.step()`` adds one fused kernel per parameter to the pending graph: it
reads the gradient and rewrites the parameter and its moments in place. Nothing
runs until the next realization (``loss.item()``), so forward, backward and the
update form one recorded step. Per-step scalars (learning rate, bias
corrections) travel as a small input uploaded with the step, so replays of the
step stay valid as the step count and schedule move.

Parameters stored as float16/bfloat16 get a float32 master copy; the kernel
updates the master and writes the rounded copy into the parameter.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine import lazy
from vkformers.engine.function import KernelOp, node
from vkformers.engine.kernels import adamw as KA
from vkformers.engine.tensor import Tensor, parameter, tensor
from vkformers.runtime import dtypes as dt


class AdamWKernel(KernelOp):
    name = "adamw"

    def emit(self, seq, outs, ins):
        (_, grad, _, _, scalars, *factor) = ins
        master, exp_avg, exp_avg_sq, *copy = outs
        KA.adamw_step(seq, scalars.operand, master.operand, grad.operand, exp_avg.operand, exp_avg_sq.operand,
                      count=master.numel, model_copy=copy[0].operand if copy else None,
                      grad_factor=factor[0].operand if factor else None)


def _update_grad(p: Tensor) -> Tensor:
    """p's gradient as the update reads it: in its own dtype (the kernel widens 16-bit values) unless it is
    neither float32 nor p's storage type."""
    grad = p.grad
    if grad.dtype is not dt.float32 and (p.dtype is dt.float32 or grad.dtype is not p.dtype):
        grad = grad.float()
    return grad.contiguous()


class AdamW:
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[int, dict] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _state(self, p: Tensor) -> dict:
        st = self.state.get(id(p))
        if st is None:
            zeros = np.zeros(p.shape, np.float32)
            st = {"step": 0, "exp_avg": parameter(zeros, requires_grad=False, name="exp_avg"),
                  "exp_avg_sq": parameter(zeros, requires_grad=False, name="exp_avg_sq"),
                  "master": None if p.dtype is dt.float32 else
                  parameter(p.numpy().astype(np.float32), requires_grad=False, name="master")}
            self.state[id(p)] = st
        return st

    def step(self, grad_factor: Tensor | None = None) -> None:
        """One update of every parameter with a gradient. ``grad_factor`` (a float32 tensor of one element,
        e.g. a clipping factor computed on the GPU): the gradients are multiplied by it as the kernel reads
        them, with no scaled copy of each (an extension of torch's signature)."""
        if grad_factor is not None and (grad_factor.dtype is not dt.float32 or grad_factor.numel() != 1):
            raise ValueError(f"AdamW.step: grad_factor must be one float32 element, got {grad_factor.dtype.name} "
                             f"{grad_factor.shape}")
        with lazy.building_graph():
            self._step(grad_factor)

    def _step(self, grad_factor) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            uniform = len({st["step"] for st in states}) == 1  # the usual case: one scalars input per group
            if uniform:
                advance = self._advance(group, states)
                shared = tensor(lazy.generated_input(advance(), advance), dtype=dt.uint32, device=params[0].device)
            for p, st in zip(params, states):
                scalars = shared if uniform else tensor(self._advance(group, [st])(), dtype=dt.uint32, device=p.device)
                master = st["master"] if st["master"] is not None else p
                targets = [master, st["exp_avg"], st["exp_avg_sq"]] + ([p] if st["master"] is not None else [])
                factor = [] if grad_factor is None else [grad_factor.reshape(1).lazy]
                outs = node(AdamWKernel(), [master.lazy, _update_grad(p).lazy, st["exp_avg"].lazy,
                                            st["exp_avg_sq"].lazy, scalars.lazy, *factor],
                            [(t.shape, t.dtype) for t in targets], into=[t.lazy for t in targets])
                for t, out in zip(targets, outs):
                    t._set_lazy(out)

    @staticmethod
    def _scalars(group, step: int) -> np.ndarray:
        beta1, beta2 = group["betas"]
        return KA.adamw_scalars(lr=group["lr"], step=step, beta1=beta1, beta2=beta2, eps=group["eps"],
                                weight_decay=group["weight_decay"])

    def _advance(self, group, states):
        """Counts one more step for every parameter of the group and returns that step's scalars; a
        replayed training step (engine.lazy.StepCapture) calls it instead of building the update."""
        def advance() -> np.ndarray:
            for st in states:
                st["step"] += 1
            return self._scalars(group, states[0]["step"])
        return advance

    def init_state(self) -> None:
        """Create moments (and float32 masters) now rather than inside the first step, so that the first
        step's graph does not read weights back in the middle."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state(p)

    def state_dict(self) -> dict:
        """Moments (and masters) as numpy arrays plus step counts, keyed by parameter position
        (training/checkpoint.py's load_optimizer_state is the inverse)."""
        out = {}
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                st = self.state.get(id(p))
                if st is None:
                    continue
                key = f"{gi}.{pi}"
                out[f"{key}.step"] = np.array(st["step"], np.int64)
                for name in ("exp_avg", "exp_avg_sq", "master"):
                    if st[name] is not None:
                        out[f"{key}.{name}"] = st[name].numpy()
        return out
