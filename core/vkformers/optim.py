"""Optimizers with ``torch.optim`` semantics, updating parameters in place on the device.

``AdamW.step()`` adds one fused kernel per parameter to the pending graph: it
reads the gradient and rewrites the parameter and its moments in place. Nothing
runs until the next realization (``loss.item()``), so forward, backward and the
update form one recorded step. Per-step scalars (learning rate, bias
corrections) travel as a small input uploaded with the step, so replays of the
step stay valid as the step count and schedule move.

Parameters stored as float16/bfloat16 get a float32 master copy; the kernel
updates the master and writes the rounded copy into the parameter. With
``master_weights=False`` bfloat16 parameters are updated in place instead (the update
computed in float32, the result rounded to nearest even), as torch.optim.AdamW and
bitsandbytes update bfloat16 weights: 4 bytes per parameter less, and an update smaller than
half a bfloat16 step of the weight is lost.

Optimizer-state memory (``state_dtype``): the moments m and v are float32 (8 bytes per parameter), bfloat16
(4 bytes) or 8-bit blockwise states as bitsandbytes' ``AdamW8bit`` (2 bytes plus 8 per block of 256):
each block of m is stored as indices into a signed dynamic quantization map scaled by the block's absolute
maximum, v likewise with the unsigned map (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
2022). As in bitsandbytes, tensors smaller than ``min_8bit_size`` elements keep float32 states.
"""
from __future__ import annotations

import numpy as np

from vkformers.engine import lazy
from vkformers.engine.function import KernelOp, node
from vkformers.engine.kernels import adamw as KA
from vkformers.engine.tensor import Tensor, parameter, tensor
from vkformers.errors import VkformersError
from vkformers.runtime import dtypes as dt


class AdamWKernel(KernelOp):
    """Inputs: master, grad, exp_avg, exp_avg_sq, scalars[, factor][, qmap]; outputs: master, exp_avg,
    exp_avg_sq[, 16-bit model copy][, absmax of m, absmax of v] (block_size > 0: 8-bit states)."""

    name = "adamw"

    def emit(self, seq, outs, ins):
        (_, grad, _, _, scalars, *extra) = ins
        factor = extra[0].operand if self.has_factor else None
        qmap = extra[-1].operand if self.block_size else None
        master, exp_avg, exp_avg_sq, *rest = outs
        copy = rest[0].operand if self.has_copy else None
        absmax = [a.operand for a in rest[-2:]] if self.block_size else None
        KA.adamw_step(seq, scalars.operand, master.operand, grad.operand, exp_avg.operand, exp_avg_sq.operand,
                      count=master.numel, model_copy=copy, grad_factor=factor, absmax=absmax, qmap=qmap,
                      block_size=self.block_size or 256)


def _update_grad(p: Tensor) -> Tensor:
    """p's gradient as the update reads it: in its own dtype (the kernel widens 16-bit values) unless it is
    neither float32 nor p's storage type."""
    grad = p.grad
    if grad.dtype is not dt.float32 and (p.dtype is dt.float32 or grad.dtype is not p.dtype):
        grad = grad.float()
    return grad.contiguous()


class OptimizerConfigError(VkformersError, ValueError):
    """An optimizer option out of range (state dtype, block size)."""


STATE_DTYPES = ("float32", "bfloat16", "int8")


def dynamic_map(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' ``create_dynamic_map``: 256 ascending float32 values in [-1, 1] (signed) or [0, 1].

    Each exponent 10^-6 .. 10^0 gets a linear run of fractions (the means of consecutive points of
    linspace(0.1, 1)), twice as many per decade as the one below; plus 0 and 1."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        boundaries = np.linspace(0.1, 1, items, dtype=np.float32)
        means = (boundaries[:-1] + boundaries[1:]) / np.float32(2.0)
        decade = np.float32(10.0 ** (-(max_exponent_bits - 1) + i))
        data += (decade * means).tolist()
        if signed:
            data += (-decade * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))
    return np.sort(np.asarray(data, np.float32))


QUANTIZATION_MAPS = np.concatenate([dynamic_map(True), dynamic_map(False)])  # as adamw.comp's qmap reads them
ZERO_CODE = int(np.flatnonzero(QUANTIZATION_MAPS[:256] == 0.0)[0])  # a fresh m: zero (any code is, with absmax 0)


class AdamW:
    """torch.optim.AdamW. ``state_dtype``: how m and v are stored, "float32" (torch's), "bfloat16" or "int8"
    (8-bit blockwise, ``block_size`` 256 or 2048 elements per absmax, for tensors of at least ``min_8bit_size``
    elements). ``master_weights``: float32 masters of 16-bit parameters (else bfloat16 parameters are updated in
    place; float16 ones need masters). The update itself is computed in float32 in every case."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 *, state_dtype: str = "float32", block_size: int = 256, min_8bit_size: int = 4096,
                 master_weights: bool = True):
        if state_dtype not in STATE_DTYPES:
            raise OptimizerConfigError(f"AdamW state_dtype must be one of {', '.join(STATE_DTYPES)}, "
                                       f"got {state_dtype!r}")
        if block_size not in KA.QUANTIZED_BLOCK_SIZES:
            raise OptimizerConfigError(f"AdamW block_size must be one of {KA.QUANTIZED_BLOCK_SIZES} "
                                       f"(bitsandbytes' blockwise sizes), got {block_size!r}")
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[int, dict] = {}
        self.state_dtype, self.block_size, self.min_8bit_size = state_dtype, block_size, int(min_8bit_size)
        self.master_weights = bool(master_weights)
        if not self.master_weights:
            if any(p.dtype is dt.float16 for g in self.param_groups for p in g["params"]):
                raise OptimizerConfigError("AdamW without master weights updates bfloat16 parameters in place; "
                                           "float16 ones need float32 masters (train in bfloat16, or keep "
                                           "master_weights)")
        self._qmap = None  # QUANTIZATION_MAPS on the device, made with the first 8-bit state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_layout(self, p: Tensor) -> dict:
        """{name: (shape, dtype)} of p's moment tensors (the float32 master aside), as this optimizer keeps them."""
        kind = self.state_dtype
        if kind == "int8" and p.numel() < self.min_8bit_size:
            kind = "float32"
        if kind != "int8":
            return {name: (p.shape, dt.as_dtype(kind)) for name in ("exp_avg", "exp_avg_sq")}
        blocks = -(-p.numel() // self.block_size)
        return {"exp_avg": ((p.numel(),), dt.uint8), "exp_avg_sq": ((p.numel(),), dt.uint8),
                "exp_avg_absmax": ((blocks,), dt.float32), "exp_avg_sq_absmax": ((blocks,), dt.float32)}

    def _state(self, p: Tensor) -> dict:
        st = self.state.get(id(p))
        if st is None:
            st = {"step": 0}
            for name, (shape, dtype) in self.state_layout(p).items():
                zeros = np.zeros(shape, np.float32 if dtype is dt.bfloat16 else dtype.host)
                if dtype is dt.uint8 and name == "exp_avg":  # the code of 0.0 in the signed map
                    zeros[...] = ZERO_CODE
                st[name] = parameter(zeros, dtype=dtype, requires_grad=False, name=name)
            st["master"] = (parameter(p.numpy().astype(np.float32), requires_grad=False, name="master")
                            if self.keeps_master(p) else None)
            self.state[id(p)] = st
        return st

    def keeps_master(self, p: Tensor) -> bool:
        """Whether ``p`` is updated through a float32 master copy (16-bit parameters, unless master_weights is
        off)."""
        return p.dtype is not dt.float32 and self.master_weights

    def _quantization_maps(self, device) -> Tensor:
        if self._qmap is None:
            self._qmap = parameter(QUANTIZATION_MAPS, requires_grad=False, device=device, name="adamw_qmap")
        return self._qmap

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
                quantized = "exp_avg_absmax" in st
                if quantized:  # the absmax pair is updated in place too; the maps are read
                    targets += [st["exp_avg_absmax"], st["exp_avg_sq_absmax"]]
                    factor.append(self._quantization_maps(p.device).lazy)
                kernel = AdamWKernel(has_factor=grad_factor is not None, has_copy=st["master"] is not None,
                                     block_size=self.block_size if quantized else 0)
                outs = node(kernel, [master.lazy, _update_grad(p).lazy, st["exp_avg"].lazy,
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
        """Create moments (and float32 masters where kept) now rather than inside the first step, so that the first
        step's graph does not read weights back in the middle."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state(p)

    def state_dict(self) -> dict:
        """Moments (and masters) as numpy arrays plus step counts, keyed by parameter position
        (training/checkpoint.py's load_optimizer_state is the inverse). bfloat16 moments come widened to float32
        (exactly), 8-bit ones as their uint8 codes beside float32 absmax arrays."""
        out = {}
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                st = self.state.get(id(p))
                if st is None:
                    continue
                key = f"{gi}.{pi}"
                out[f"{key}.step"] = np.array(st["step"], np.int64)
                for name, value in st.items():
                    if name != "step" and value is not None:
                        out[f"{key}.{name}"] = value.numpy()
        return out


class AdamW8bit(AdamW):
    """bitsandbytes' ``AdamW8bit``: AdamW with 8-bit blockwise moments (``AdamW(..., state_dtype="int8")``)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 *, block_size: int = 256, min_8bit_size: int = 4096):
        super().__init__(params, lr, betas, eps, weight_decay, state_dtype="int8", block_size=block_size,
                         min_8bit_size=min_8bit_size)


# ``vkformers train --optim``: name -> AdamW keyword arguments (``--no-master-weights`` adds master_weights=False)
OPTIMIZERS = {"adamw": {}, "adamw_bf16_states": {"state_dtype": "bfloat16"}, "adamw_8bit": {"state_dtype": "int8"}}
