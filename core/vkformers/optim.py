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
        (_, grad, _, _, scalars) = ins
        master, exp_avg, exp_avg_sq, *copy = outs
        KA.adamw_step(seq, scalars.operand, master.operand, grad.operand, exp_avg.operand, exp_avg_sq.operand,
                      count=master.numel, model_copy=copy[0].operand if copy else None)


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

    def step(self) -> None:
        with lazy.building_graph():
            self._step()

    def _step(self) -> None:
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
                outs = node(AdamWKernel(), [master.lazy, p.grad.float().contiguous().lazy, st["exp_avg"].lazy,
                                            st["exp_avg_sq"].lazy, scalars.lazy],
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
