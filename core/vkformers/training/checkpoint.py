"""Training checkpoints: written atomically, the last K kept, resumed exactly.

A checkpoint is a folder ``<out>/checkpoints/checkpoint-<step>/`` holding

- ``model.safetensors`` (every parameter in its stored dtype, bfloat16 bits exact) and ``config.json``,
  or for LoRA runs ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's format);
- ``optimizer.safetensors``: ``AdamW.state_dict()`` (moments, float32 masters, step counts);
- ``trainer_state.json``: step, data position, dropout RNG state, loss scale, the run's config.

Atomicity: everything is written into ``.tmp-checkpoint-<step>-<pid>/``, each file fsynced, the
folder fsynced, then renamed to its final name (one atomic ``rename``) and the parent fsynced. A
crash at any point leaves either the complete new checkpoint or none of it; stale temporary
folders are removed by the next save. Old checkpoints are renamed to ``.trash-...`` before being
deleted, so a half-deleted folder never looks like a checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from vkformers.engine.tensor import Tensor, parameter
from vkformers.errors import VkformersError
from vkformers.models.atomic import write_json_atomic
from vkformers.models.safetensors_io import read_safetensors, write_safetensors
from vkformers.runtime import dtypes as dt

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
NAME = re.compile(r"^checkpoint-(\d+)$")

# Test hook: called with each file's path right after it is written (tests make saving slow with it
# to kill a process mid-save). None in normal runs.
after_file_written: Callable[[Path], None] | None = None


class CheckpointLoadError(VkformersError, ValueError):
    """A checkpoint folder that does not fit the model or optimizer being resumed."""


def _written(path: Path) -> None:
    if after_file_written is not None:
        after_file_written(path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- tensors in and out

def _host_array(t: Tensor) -> tuple[np.ndarray, bool]:
    """(array to store, is bfloat16 bits) for one tensor, exact for every dtype."""
    array = t.numpy()
    if t.dtype is dt.bfloat16:
        return dt.to_bfloat16(array.astype(np.float32)), True
    return array, False


def model_tensors(model) -> tuple[dict[str, np.ndarray], set[str]]:
    tensors, bf16 = {}, set()
    for name, t in model.named_parameters():
        tensors[name], is_bf16 = _host_array(t)
        if is_bf16:
            bf16.add(name)
    return tensors, bf16


def write_into(t: Tensor, array: np.ndarray) -> None:
    """Overwrite a realized device tensor's storage in place (the Tensor object, and plans using it, stay)."""
    lazy = t.lazy
    if lazy.base is not lazy or not lazy.persistent or not lazy.realized or lazy.base.buffer is None:
        raise CheckpointLoadError("can only restore into realized parameters created with vkformers.parameter()")
    if tuple(array.shape) != t.shape:
        raise CheckpointLoadError(f"shape {tuple(array.shape)} does not fit a tensor of shape {t.shape}")
    host = dt.to_bfloat16(np.asarray(array, np.float32)) if t.dtype is dt.bfloat16 else \
        np.asarray(array, dtype=t.dtype.host)
    lazy.base.buffer.write(host)


def load_model_tensors(model, file: Path) -> None:
    """Restore every parameter of ``model`` from ``file`` in place (names and shapes must match)."""
    entries = read_safetensors(file)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(entries))
    if missing:
        raise CheckpointLoadError(f"{file} lacks {len(missing)} parameter(s) of the model: {', '.join(missing[:6])}")
    for name, t in params.items():
        write_into(t, entries[name].as_float())


# ---------------------------------------------------------------- optimizer state

def load_optimizer_state(optimizer, arrays: dict[str, np.ndarray]) -> None:
    """The inverse of ``AdamW.state_dict()``: moments, masters and step counts back into ``optimizer.state``.

    Keys are ``"<group>.<index>.<field>"``; the optimizer must hold the same parameters in the same order.
    """
    expected = {f"{gi}.{pi}": p for gi, g in enumerate(optimizer.param_groups) for pi, p in enumerate(g["params"])}
    saved = {k.rsplit(".", 1)[0] for k in arrays}
    unknown = sorted(saved - set(expected))
    if unknown:
        raise CheckpointLoadError(f"optimizer state has entries for parameters this optimizer lacks: {unknown[:4]}")
    for key, p in expected.items():
        if f"{key}.step" not in arrays:
            continue
        layout = {**optimizer.state_layout(p), "master": (p.shape, dt.float32)}
        present = {k.rsplit(".", 1)[1] for k in arrays if k.rsplit(".", 1)[0] == key} - {"step"}
        if present - set(layout) or (set(layout) - {"master"}) - present:
            raise CheckpointLoadError(f"optimizer state {key} holds {sorted(present)}, this optimizer keeps "
                                      f"{sorted(layout)} (resume with the same --optim)")
        fields = {}
        for name, (shape, dtype) in layout.items():
            array = arrays.get(f"{key}.{name}")
            if array is not None and tuple(array.shape) != shape:
                raise CheckpointLoadError(f"optimizer state {key}.{name} has shape {tuple(array.shape)}, "
                                          f"expected {shape}")
            fields[name] = None if array is None else parameter(
                np.asarray(array, np.float32 if dtype is dt.bfloat16 else dtype.host), dtype=dtype,
                requires_grad=False, name=name)
        if (fields["master"] is None) != (p.dtype is dt.float32):
            raise CheckpointLoadError(f"optimizer state {key}: float32 master present/absent does not fit a "
                                      f"{p.dtype.name} parameter (resume with the same --precision)")
        optimizer.state[id(p)] = {"step": int(np.asarray(arrays[f"{key}.step"]).reshape(-1)[0]), **fields}


# ---------------------------------------------------------------- folders

def checkpoints(root) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, folder), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = NAME.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root) -> Path | None:
    found = checkpoints(root)
    return found[-1][1] if found else None


def _remove(folder: Path) -> None:
    """Rename out of the checkpoint namespace first, then delete (a crash mid-delete leaves only trash)."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(root, step: int, *, model, optimizer, trainer_state: dict, keep: int = 2,
                    adapter: bool = False) -> Path:
    """Write checkpoint ``step`` atomically under ``root`` and keep only the newest ``keep``; returns its folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-checkpoint-*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(".trash-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-checkpoint-{step}-{os.getpid()}"
    tmp.mkdir()

    if adapter:
        from vkformers.training.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter
        save_adapter(model, tmp)
        _written(tmp / ADAPTER_WEIGHTS)
        _written(tmp / ADAPTER_CONFIG)
    else:
        tensors, bf16 = model_tensors(model)
        write_safetensors(tmp / MODEL_FILE, tensors, bfloat16=bf16, metadata={"format": "pt"})
        _written(tmp / MODEL_FILE)
        if getattr(model, "config", None):
            write_json_atomic(tmp / "config.json", model.config)
            _written(tmp / "config.json")
    write_safetensors(tmp / OPTIMIZER_FILE, optimizer.state_dict())
    _written(tmp / OPTIMIZER_FILE)
    write_json_atomic(tmp / STATE_FILE, trainer_state)  # last: its presence marks a complete folder
    _written(tmp / STATE_FILE)
    _fsync_dir(tmp)

    final = root / f"checkpoint-{step}"
    if final.exists():  # the same step saved again (after a resume): replace it
        _remove(final)
    os.rename(tmp, final)
    _fsync_dir(root)

    for _, old in checkpoints(root)[:-keep] if keep > 0 else []:
        _remove(old)
    return final


def load_checkpoint(folder, *, model, optimizer=None) -> dict:
    """Restore model (or adapter) weights and optimizer state in place; returns trainer_state.json's contents."""
    folder = Path(folder)
    state_file = folder / STATE_FILE
    if not state_file.is_file():
        raise CheckpointLoadError(f"{folder}: not a complete checkpoint (no {STATE_FILE})")
    state = json.loads(state_file.read_text())
    if (folder / MODEL_FILE).is_file():
        load_model_tensors(model, folder / MODEL_FILE)
    else:
        from vkformers.training.lora import ADAPTER_WEIGHTS
        if not (folder / ADAPTER_WEIGHTS).is_file():
            raise CheckpointLoadError(f"{folder}: neither {MODEL_FILE} nor {ADAPTER_WEIGHTS}")
        if not hasattr(model, "lora_config"):
            raise CheckpointLoadError(f"{folder} holds a LoRA adapter but the model has no LoRA layers")
        _load_adapter_in_place(model, folder / ADAPTER_WEIGHTS)
    if optimizer is not None:
        arrays = {k: e.as_float() for k, e in read_safetensors(folder / OPTIMIZER_FILE).items()}
        load_optimizer_state(optimizer, arrays)
    return state


def _load_adapter_in_place(model, file: Path) -> None:
    from vkformers.training.lora import PEFT_PREFIX, _peft_key_to_model
    arrays = {_peft_key_to_model(k): e.as_float() for k, e in read_safetensors(file).items()}
    params = dict(model.named_parameters())
    trainable = {n: t for n, t in params.items() if t.requires_grad}
    missing = sorted(set(trainable) - set(arrays))
    if missing:
        raise CheckpointLoadError(f"{file} lacks trained parameter(s): {', '.join(missing[:6])}")
    for name, array in arrays.items():
        if name not in params:
            raise CheckpointLoadError(f"{file}: {PEFT_PREFIX}{name} is not a parameter of this model")
        write_into(params[name], array)
