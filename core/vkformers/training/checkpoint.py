"""Training checkpoints: written atomically, the last K kept, verified and resumed exactly.

A checkpoint is a folder ``<out>/checkpoints/checkpoint-<step>/`` holding

- ``model.safetensors`` (every parameter in its stored dtype, bfloat16 bits exact) and ``config.json``,
  or for LoRA runs ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's format);
- ``optimizer.safetensors``: ``AdamW.state_dict()`` (moments, float32 masters, step counts);
- ``trainer_state.json``: step, data position, dropout RNG state, loss scale, the run's config;
- ``manifest.json``, written last: every other file's size and SHA-256, so that a checkpoint damaged
  after it was saved (a truncated or edited file) is detected before it is resumed.

Atomicity: everything is written into ``.tmp-checkpoint-<step>-<pid>/``, each file fsynced, the
folder fsynced, then renamed to its final name (one atomic ``rename``) and the parent fsynced. A
crash, or a failed write (a full disk), at any point leaves either the complete new checkpoint or
none of it, and the previous checkpoints as they were; stale temporary folders are removed by the
next save. Old checkpoints are renamed to ``.trash-...`` before being deleted, so a half-deleted
folder never looks like a checkpoint.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from vkformers.engine.row_blocks import RowBlocks
from vkformers.engine.tensor import Tensor, parameter
from vkformers.errors import VkformersError
from vkformers.models.atomic import make_folder, write_json_atomic
from vkformers.models.safetensors_io import read_safetensors, write_safetensors
from vkformers.runtime import dtypes as dt
from vkformers.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, _peft_key_to_model, save_adapter

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
NAME = re.compile(r"^checkpoint-(\d+)$")

# Test hook: called with each file's path right after it is written (tests make saving slow with it
# to kill a process mid-save). None in normal runs.
after_file_written: Callable[[Path], None] | None = None


class CheckpointLoadError(VkformersError, ValueError):
    """A checkpoint folder that does not fit the model or optimizer being resumed, or fails verification."""


class CheckpointSaveError(VkformersError, OSError):
    """A checkpoint could not be written (a full disk, say); the message names the file, and the
    previous checkpoints are left intact."""


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


def write_into(t: Tensor | RowBlocks, array: np.ndarray) -> None:
    """Overwrite a realized device tensor's storage in place (the Tensor object, and plans using it, stay); a
    weight in row blocks, block by block."""
    if isinstance(t, RowBlocks):
        if tuple(array.shape) != t.shape:
            raise CheckpointLoadError(f"shape {tuple(array.shape)} does not fit a tensor of shape {t.shape}")
        for part, (a, b) in zip(t.parts, t.spans):
            write_into(part, array[a:b])
        return
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
        if (fields["master"] is None) == optimizer.keeps_master(p):
            raise CheckpointLoadError(f"optimizer state {key}: float32 master present/absent does not fit a "
                                      f"{p.dtype.name} parameter (resume with the same --precision and "
                                      "--no-master-weights)")
        optimizer.state[id(p)] = {"step": int(np.asarray(arrays[f"{key}.step"]).reshape(-1)[0]), **fields}


# ---------------------------------------------------------------- folders

def checkpoints(root) -> list[tuple[int, Path]]:
    """Checkpoint folders under ``root`` (those with a trainer state or a manifest) as (step, folder), oldest
    first. Whether each one is intact is :func:`verify_checkpoint`'s question."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = NAME.match(child.name)
        if match and ((child / STATE_FILE).is_file() or (child / MANIFEST_FILE).is_file()):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root) -> Path | None:
    found = checkpoints(root)
    return found[-1][1] if found else None


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(folder: Path) -> dict:
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    return {"format": 1, "files": {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}}


def verify_checkpoint(folder) -> str | None:
    """None if ``folder`` is an intact checkpoint, else why not (one phrase, e.g. "optimizer.safetensors has
    1,024 bytes, the manifest says 4,096"). Checks the manifest's sizes and hashes when there is one (older
    checkpoints have none: then the trainer state must parse and the weight files exist)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "not a folder"
    manifest_file = folder / MANIFEST_FILE
    if manifest_file.is_file():
        try:
            files = json.loads(manifest_file.read_text())["files"]
            expected = {str(name): (int(e["size"]), str(e["sha256"])) for name, e in files.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{MANIFEST_FILE} is damaged ({type(exc).__name__}: {exc})"
        for name, (size, digest) in expected.items():
            file = folder / name
            if not file.is_file():
                return f"{name} is missing"
            actual = file.stat().st_size
            if actual != size:
                return f"{name} has {actual:,} bytes, the manifest says {size:,} (cut short or overwritten)"
            if _sha256(file) != digest:
                return f"{name} does not match its SHA-256 in the manifest (changed since it was saved)"
    if not (folder / STATE_FILE).is_file():
        return f"no {STATE_FILE}"
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        if not isinstance(state, dict) or "step" not in state or "config" not in state:
            return f"{STATE_FILE} lacks the step or the run's config"
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{STATE_FILE} is not valid JSON ({exc})"
    if not (folder / MODEL_FILE).is_file() and not (folder / ADAPTER_WEIGHTS).is_file():
        return f"neither {MODEL_FILE} nor {ADAPTER_WEIGHTS}"
    if not (folder / OPTIMIZER_FILE).is_file():
        return f"no {OPTIMIZER_FILE}"
    return None


def newest_verified_checkpoint(root) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` that verifies, and the newer ones skipped as (folder, reason).
    Raises :class:`CheckpointLoadError` when there are checkpoints but none verifies."""
    skipped = []
    for _, folder in reversed(checkpoints(root)):
        reason = verify_checkpoint(folder)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    if skipped:
        raise CheckpointLoadError(f"no checkpoint in {root} verifies: "
                                  + "; ".join(f"{folder.name}: {reason}" for folder, reason in skipped)
                                  + " (start afresh in another --out, or without --resume after removing them)")
    return None, []


def _delete(path: Path) -> None:
    """Delete a folder, or only the link if ``path`` is one (never what it points at)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _remove(folder: Path) -> None:
    """Rename out of the checkpoint namespace first, then delete (a crash mid-delete leaves only trash)."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    os.rename(folder, trash)
    _delete(trash)


def save_checkpoint(root, step: int, *, model, optimizer, trainer_state: dict, keep: int = 2,
                    adapter: bool = False, spare=None) -> Path:
    """Write checkpoint ``step`` atomically under ``root`` and keep only the newest ``keep`` (and ``spare``,
    a folder not to delete: the last good one of a run going wrong); returns its folder.

    A failed write raises :class:`CheckpointSaveError` naming the file; nothing of the new checkpoint stays
    and the older ones are untouched."""
    root = make_folder(root)
    final = root / f"checkpoint-{step}"
    tmp = root / f".tmp-checkpoint-{step}-{os.getpid()}"
    writing = tmp
    try:
        for stale in [*root.glob(".tmp-checkpoint-*"), *root.glob(".trash-*")]:  # left by a killed save
            _delete(stale)
        tmp.mkdir()  # fails on anything already there, a link included

        if adapter:
            writing = tmp / ADAPTER_WEIGHTS
            save_adapter(model, tmp)
            _written(tmp / ADAPTER_WEIGHTS)
            _written(tmp / ADAPTER_CONFIG)
        else:
            tensors, bf16 = model_tensors(model)
            writing = tmp / MODEL_FILE
            write_safetensors(writing, tensors, bfloat16=bf16, metadata={"format": "pt"})
            _written(writing)
            if getattr(model, "config", None):
                writing = tmp / "config.json"
                write_json_atomic(writing, model.config)
                _written(writing)
        writing = tmp / OPTIMIZER_FILE
        write_safetensors(writing, optimizer.state_dict())
        _written(writing)
        writing = tmp / STATE_FILE
        write_json_atomic(writing, trainer_state)
        _written(writing)
        writing = tmp / MANIFEST_FILE
        write_json_atomic(writing, _manifest(tmp))  # last: it vouches for every file above
        _written(writing)
        _fsync_dir(tmp)

        writing = final
        if final.exists() or final.is_symlink():  # the same step saved again (after a resume): replace it
            _remove(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, VkformersError):  # a link where a file would go: its own message says it all
            raise
        kept = [f.name for _, f in checkpoints(root) if f != final]
        raise CheckpointSaveError(
            f"could not save checkpoint {final}: writing {exc.filename or writing} failed: {exc.strerror or exc}; "
            + (f"the earlier checkpoint(s) {', '.join(kept)} are intact" if kept else "no earlier checkpoint exists")
            + (" (free some disk space, then resume)" if exc.errno == errno.ENOSPC else "")) from exc

    for _, old in checkpoints(root)[:-keep] if keep > 0 else []:
        if spare is None or old != Path(spare):
            _remove(old)
    return final


def load_checkpoint(folder, *, model, optimizer=None, verify: bool = True) -> dict:
    """Restore model (or adapter) weights and optimizer state in place; returns trainer_state.json's contents.
    The folder is verified first (:func:`verify_checkpoint`) unless ``verify=False`` (already done)."""
    folder = Path(folder)
    reason = verify_checkpoint(folder) if verify else None
    if reason is not None:
        raise CheckpointLoadError(f"{folder} is not an intact checkpoint: {reason}")
    state = json.loads((folder / STATE_FILE).read_text())
    if (folder / MODEL_FILE).is_file():
        load_model_tensors(model, folder / MODEL_FILE)
    else:
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
