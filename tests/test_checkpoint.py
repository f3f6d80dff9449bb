"""Checkpoints: exact resume (same losses as an uninterrupted run), keep-last-K, and a save killed midway."""
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
from vkformers.training.checkpoint import CheckpointLoadError, checkpoints

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
