"""Checkpoints: exact resume (same losses as an uninterrupted run), keep-last-K, a save killed midway, a full
disk, and resuming past damaged checkpoints."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from test_training import tiny_data, tiny_model
from vkformers.training import Batches, Trainer, TrainingConfig, latest_checkpoint
from vkformers.models.atomic import atomic_write
from vkformers.training import checkpoint as ckpt
from vkformers.training.checkpoint import CheckpointLoadError, CheckpointSaveError, checkpoints, verify_checkpoint

TESTS = Path(__file__).parent


def make_trainer(out, precision="fp32", steps=6, save_every=0, keep=2, model_seed=0):
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
    config = TrainingConfig(steps=steps, batch_size=4, seq_len=16, lr=1e-2, warmup=2, schedule="cosine",
                            precision=precision, save_every=save_every, keep=keep, seed=3, weight_decay=0.01)
    return Trainer(tiny_model(seed=model_seed, dtype=dtype, dropout=0.1), config, Batches(tiny_data(), 4, seed=3),
                   out_dir=out)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_continues_with_identical_losses(tmp_path, precision):
    full = make_trainer(tmp_path / "a", precision, save_every=3)
    reference = [r["loss"] for r in full.train()]
    resumed = make_trainer(tmp_path / "b", precision, model_seed=99)  # different weights: the checkpoint must win
    assert resumed.resume(tmp_path / "a" / "checkpoints" / "checkpoint-3").name == "checkpoint-3"
    assert resumed.step == 3
    after = [r["loss"] for r in resumed.train()]
    assert after == reference[3:]


def test_resume_from_the_step_that_ends_an_epoch_is_exact(tmp_path):
    """10 sequences, 2 micro-batches of 4 a step: an epoch is 2 steps, its second holding 2 sequences and 6 filler
    rows. The checkpoints saved after such a step are at the start of the next epoch, and resuming from them
    continues with the uninterrupted run's losses."""
    def trainer(out, model_seed=0):
        config = TrainingConfig(steps=5, batch_size=4, grad_accum=2, seq_len=16, lr=1e-2, warmup=1, save_every=2,
                                keep=0, seed=3)
        return Trainer(tiny_model(seed=model_seed, dropout=0.1), config,
                       Batches(tiny_data().subset(slice(0, 10)), 4, seed=3), out_dir=out)
    reference = [r["loss"] for r in trainer(tmp_path / "a").train()]
    for step in (2, 4):
        folder = tmp_path / "a" / "checkpoints" / f"checkpoint-{step}"
        state = json.loads((folder / "trainer_state.json").read_text())
        assert (state["epoch"], state["data_position"]["cursor"]) == (step // 2, 0)
        resumed = trainer(tmp_path / f"resumed-{step}", model_seed=99)
        resumed.resume(folder)
        assert [r["loss"] for r in resumed.train()] == reference[step:]


def test_keeps_the_last_k_and_writes_the_state(tmp_path):
    trainer = make_trainer(tmp_path, steps=5, save_every=1, keep=2)
    trainer.train()
    assert [step for step, _ in checkpoints(tmp_path / "checkpoints")] == [4, 5]
    folder = latest_checkpoint(tmp_path / "checkpoints")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "manifest.json", "model.safetensors",
                                                        "optimizer.safetensors", "trainer_state.json"]
    manifest = json.loads((folder / "manifest.json").read_text())["files"]
    assert sorted(manifest) == ["config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"]
    assert manifest["model.safetensors"]["size"] == (folder / "model.safetensors").stat().st_size
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["step"] == 5 and state["data_position"]["cursor"] > 0 and state["config"]["lr"] == 1e-2
    assert state["dropout_rng"]["bit_generator"] == "PCG64"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_resume_refuses_a_different_precision(tmp_path):
    make_trainer(tmp_path, steps=1, save_every=1).train()
    other = make_trainer(tmp_path, precision="bf16")
    with pytest.raises(CheckpointLoadError, match="precision"):
        other.resume()


KILLED_RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_checkpoint import make_trainer
    from vkformers.training import checkpoint

    def slow(path):  # make every file of a save take a while, and say which one
        print("WROTE", path, flush=True)
        time.sleep(0.5)

    checkpoint.after_file_written = slow
    make_trainer({out!r}, save_every=2).train()
""")


def test_a_save_killed_midway_leaves_the_previous_checkpoint_usable(tmp_path):
    out = tmp_path / "run"
    script = KILLED_RUN.format(tests=str(TESTS), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 240
        for line in proc.stdout:  # wait until the step-4 save has written its first file, then kill
            if ".tmp-checkpoint-4-" in line:
                break
            assert time.time() < deadline, "the training subprocess never reached the second save"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    root = out / "checkpoints"
    assert list(root.glob(".tmp-checkpoint-4-*")), "the kill should have interrupted the step-4 save"
    assert latest_checkpoint(root).name == "checkpoint-2"

    resumed = make_trainer(out, model_seed=7)
    assert resumed.resume().name == "checkpoint-2"
    after = [r["loss"] for r in resumed.train()]
    reference = [r["loss"] for r in make_trainer(tmp_path / "reference").train()]
    assert after == reference[2:]
    metrics = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3, 4, 5, 6]  # the killed run's steps 3-4 were replaced, not duplicated


def test_optimizer_state_round_trips(tmp_path):
    trainer = make_trainer(tmp_path, steps=2, save_every=2)
    trainer.train()
    other = make_trainer(tmp_path, steps=2)
    other.resume()
    a, b = trainer.optimizer.state_dict(), other.optimizer.state_dict()
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, steps=4, save_every=2)
    real = ckpt.write_safetensors

    def disk_full_at_step_4(path, tensors, **kwargs):
        if path.name == "optimizer.safetensors" and path.parent.name.startswith(".tmp-checkpoint-4-"):
            with atomic_write(path, "wb") as f:  # some bytes land, then the disk is full
                f.write(b"\0" * 4096)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, tensors, **kwargs)
    monkeypatch.setattr(ckpt, "write_safetensors", disk_full_at_step_4)
    with pytest.raises(CheckpointSaveError, match=r"could not save checkpoint .*checkpoint-4: writing "
                                                  r".*optimizer\.safetensors failed: No space left on device; "
                                                  r"the earlier checkpoint\(s\) checkpoint-2 are intact"):
        trainer.train()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-2"]  # no half folder, no temporary file
    assert verify_checkpoint(root / "checkpoint-2") is None
    metrics = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3, 4]
    monkeypatch.setattr(ckpt, "write_safetensors", real)  # space freed: resume from the kept checkpoint
    resumed = make_trainer(tmp_path, steps=4, model_seed=5)
    assert resumed.resume().name == "checkpoint-2" and resumed.step == 2


def cut_in_half(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    return len(data)


def test_resume_skips_damaged_checkpoints_and_says_why(tmp_path):
    reference = [r["loss"] for r in make_trainer(tmp_path / "reference").train()]
    out = tmp_path / "run"
    make_trainer(out, save_every=2, keep=3).train()
    root = out / "checkpoints"
    size = cut_in_half(root / "checkpoint-6" / "trainer_state.json")  # as a kill mid-copy would leave it
    optimizer = root / "checkpoint-4" / "optimizer.safetensors"
    data = bytearray(optimizer.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    optimizer.write_bytes(bytes(data))

    resumed = make_trainer(out, model_seed=7)
    assert resumed.resume().name == "checkpoint-2"
    assert [(folder.name, reason) for folder, reason in resumed.skipped_checkpoints] == [
        ("checkpoint-6", f"trainer_state.json has {size // 2:,} bytes, the manifest says {size:,} "
                         "(cut short or overwritten)"),
        ("checkpoint-4", "optimizer.safetensors does not match its SHA-256 in the manifest (changed since it "
                         "was saved)")]
    assert [r["loss"] for r in resumed.train()] == reference[2:]


def test_a_damaged_checkpoint_without_manifest_is_skipped(tmp_path):
    """Checkpoints saved before manifests existed are checked by their trainer state and files."""
    make_trainer(tmp_path, steps=4, save_every=2).train()
    newest = tmp_path / "checkpoints" / "checkpoint-4"
    for folder in (tmp_path / "checkpoints").iterdir():
        (folder / "manifest.json").unlink()
    cut_in_half(newest / "trainer_state.json")
    resumed = make_trainer(tmp_path, steps=4)
    assert resumed.resume().name == "checkpoint-2"
    (folder, reason), = resumed.skipped_checkpoints
    assert folder == newest and reason.startswith("trainer_state.json is not valid JSON")


def test_resume_refuses_a_damaged_folder_given_or_when_none_verifies(tmp_path):
    make_trainer(tmp_path, steps=2, save_every=2).train()
    folder = tmp_path / "checkpoints" / "checkpoint-2"
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointLoadError, match=r"checkpoint-2 is not an intact checkpoint: model.safetensors "
                                                  r"is missing"):
        make_trainer(tmp_path).resume(folder)
    with pytest.raises(CheckpointLoadError, match=r"no checkpoint in .* verifies: checkpoint-2: model.safetensors "
                                                  r"is missing"):
        make_trainer(tmp_path).resume()
    assert make_trainer(tmp_path / "empty").resume() is None  # nothing saved yet: a fresh start
