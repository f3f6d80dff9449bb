"""Fused AdamW step (shaders/common/adamw.comp), torch.optim.AdamW semantics (amsgrad=False,
maximize=False): decoupled weight decay, bias correction, eps added after sqrt(v_hat).

Per-step scalars live in a small uint32 buffer (``ADAMW_SCALAR_WORDS`` words) that the host
fills with :func:`adamw_scalars` before each replay (make it ``host_visible`` and
``seq.upload`` it at the start of the recorded step), so a recorded step replays with a new
step count or learning rate. The bias corrections are computed there in float64, as torch
does in Python.
"""
from __future__ import annotations

import math

import numpy as np

from vkformers.engine.kernels.transformer_args import (
    checked, element_groups, fits_uint32, overlaps, positive)

ADAMW_SCALAR_WORDS = 12  # layout: adamw.comp's word indices


def adamw_scalars(*, lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 1e-2, grad_scale: float = 1.0) -> np.ndarray:
    """The scalars buffer contents (uint32 words) for optimizer step ``step`` (1 for the first).

    grad_scale multiplies the gradient first (e.g. 1/loss_scale or a clipping factor).
    """
    if not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"adamw step must be an int >= 1, got {step!r}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"adamw betas must be in [0, 1), got {beta1}, {beta2}")
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2 = 1.0 - beta2 ** step
    floats = [lr, beta1, beta2, eps, weight_decay, 0.0, 1.0 - beta1, 1.0 - beta2, lr / bias_correction1,
              math.sqrt(bias_correction2), 1.0 - lr * weight_decay, grad_scale]
    words = np.asarray(floats, dtype=np.float32).view(np.uint32).copy()
    words[5] = step
    return words


GRAD_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
STATE_TYPES = {"float32": "", "bfloat16": "_s_bf16", "uint8": "_s_q8"}  # moment storage -> variant suffix
QUANTIZED_BLOCK_SIZES = (256, 2048)  # bitsandbytes' blockwise optimizer block sizes


def adamw_step(seq, scalars, param, grad, exp_avg, exp_avg_sq, *, count: int, model_copy=None, grad_factor=None,
               absmax=None, qmap=None, block_size: int = 256):
    """Update param (float32 [count], or bfloat16 without a float32 master: read widened, written back rounded to
    nearest even), exp_avg and exp_avg_sq in place from grad ([count], float32, float16 or bfloat16, read as it
    is stored).

    The moments are float32, bfloat16, or uint8 codes of 8-bit blockwise states: then ``absmax`` is a pair of
    float32 [ceil(count / block_size)] operands (each block's absolute maximum of m and of v, updated too) and
    ``qmap`` a float32 [512] operand (the signed then the unsigned quantization map, ascending; optim.py).
    scalars: uint32 [ADAMW_SCALAR_WORDS] (adamw_scalars). model_copy: optional float16 or bfloat16 [count] that
    receives the updated parameters. grad_factor: optional float32 element the gradient is multiplied by
    (computed on the GPU: gradient clipping, loss unscaling), besides the scalars' grad_scale.
    """
    positive(count=count)
    fits_uint32("adamw_step", count)
    scalars = checked(scalars, "uint32", ADAMW_SCALAR_WORDS, "adamw scalars")
    param = checked(param, ("float32", "bfloat16"), count, "adamw param")
    grad = checked(grad, tuple(GRAD_TYPES), count, "adamw grad")
    exp_avg = checked(exp_avg, tuple(STATE_TYPES), count, "adamw exp_avg")
    exp_avg_sq = checked(exp_avg_sq, exp_avg.dtype.name, count, "adamw exp_avg_sq")
    quantized = exp_avg.dtype.name == "uint8"
    blocks = -(-count // block_size)
    if quantized:
        if block_size not in QUANTIZED_BLOCK_SIZES:
            raise ValueError(f"adamw_step: 8-bit states need a block size in {QUANTIZED_BLOCK_SIZES}, got {block_size}")
        if absmax is None or qmap is None:
            raise ValueError("adamw_step: 8-bit states need absmax and qmap")
        absmax = [checked(a, "float32", blocks, f"adamw absmax {which}") for a, which in zip(absmax, "mv")]
        qmap = checked(qmap, "float32", 512, "adamw qmap")
    if grad_factor is not None:
        grad_factor = checked(grad_factor, "float32", 1, "adamw grad_factor")
    if model_copy is not None:
        if param.dtype.name != "float32":
            raise ValueError("adamw_step: a model copy needs a float32 master as param")
        model_copy = checked(model_copy, ("float16", "bfloat16"), count, "adamw model_copy")
    if param.dtype.name == "bfloat16" and grad.dtype.name not in ("float32", "bfloat16"):
        raise TypeError(f"adamw_step: a {grad.dtype.name} gradient with bfloat16 parameters")
    states = {"param": (param, count), "exp_avg": (exp_avg, count), "exp_avg_sq": (exp_avg_sq, count),
              "grad": (grad, count), "grad_factor": (grad_factor, 1), "model_copy": (model_copy, count)}
    if quantized:
        states.update(absmax_m=(absmax[0], blocks), absmax_v=(absmax[1], blocks))
    names = [name for name, (x, _) in states.items() if x is not None]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if overlaps(*states[a], *states[b]):
                raise ValueError(f"adamw_step: {a} and {b} overlap")
    buffers = [scalars.buffer, param.buffer, grad.buffer, exp_avg.buffer, exp_avg_sq.buffer,
               (grad_factor or param).buffer]
    variant, copy_offset = f"g_{GRAD_TYPES[grad.dtype.name]}", 0
    if model_copy is not None:
        variant += "_c_" + GRAD_TYPES[model_copy.dtype.name]
        if grad.dtype.name != "float32" and grad.dtype != model_copy.dtype:
            raise TypeError(f"adamw_step: a {grad.dtype.name} gradient with a {model_copy.dtype.name} model copy")
        buffers.append(model_copy.buffer)
        copy_offset = model_copy.offset
    if param.dtype.name == "bfloat16":
        variant += "_p_bf16"
    variant += STATE_TYPES[exp_avg.dtype.name]
    push = [count, scalars.offset, param.offset, grad.offset, exp_avg.offset, exp_avg_sq.offset,
            copy_offset, grad_factor.offset if grad_factor else 0]
    spec = [int(grad_factor is not None)]
    groups = element_groups(seq, count)
    if quantized:  # one workgroup of 256 invocations per block
        buffers += [absmax[0].buffer, absmax[1].buffer, qmap.buffer]
        push += [absmax[0].offset, absmax[1].offset, qmap.offset]
        spec.append(block_size // 256)
        groups = element_groups(seq, blocks * 256)
    seq.dispatch(seq.device.kernel("adamw", variant), buffers, groups, push=push, spec=spec)
