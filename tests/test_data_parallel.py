"""Data-parallel training over MPI: 2 ranks (processes under MPICH's mpiexec, sharing lavapipe) with batch B
against one process with batch 2B, ZeRO-1 against plain data parallelism, checkpoints, a rank dying, resume.

The ranks run tests/data_parallel_rank.py (test_training's TinyLM, 3 AdamW steps with warmup, clipping and
weight decay, a checkpoint every 2 steps) and exchange gradients through MPI itself: no mock collectives."""
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mpi4py")

from vkformers.training import distributed  # noqa: E402
from vkformers.training.checkpoint import OPTIMIZER_FILE, load_checkpoint  # noqa: E402
from vkformers.models.safetensors_io import read_safetensors  # noqa: E402
from vkformers.optim import AdamW  # noqa: E402
from test_training import tiny_data, tiny_model  # noqa: E402

RANK_SCRIPT = Path(__file__).parent / "data_parallel_rank.py"
STEPS = 3


def run(out: Path, batch: int, *flags, ranks: int = 1, timeout: float = 120, env=None):
    command = [sys.executable, str(RANK_SCRIPT), str(out), str(batch), str(STEPS), *flags]
    if ranks > 1:
        command = [distributed.find_mpiexec(), "-n", str(ranks), *command]
    env = {**distributed.launcher_environment(), distributed.SHARE_DEVICE_ENV: "1", **(env or {})}  # one device, shared
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def trained(out: Path, batch: int, *flags, ranks: int = 1):
    done = run(out, batch, *flags, ranks=ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("data_parallel")
    return root, {"one": trained(root / "one.npz", 4), "two": trained(root / "two.npz", 2, ranks=2),
                  "zero": trained(root / "zero.npz", 2, "--shard", ranks=2)}


def weights(result):
    return {k: v for k, v in result.items() if k.startswith("w.")}


def relative_error(a: dict, b: dict) -> float:
    """Over all weights at once: |a - b| / |a| (Euclidean norms)."""
    diff = np.sqrt(sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a))
    return diff / np.sqrt(sum(float(np.sum(a[k].astype(np.float64) ** 2)) for k in a))


def test_two_ranks_with_batch_b_match_one_rank_with_batch_2b(runs):
    _, r = runs
    one, two = r["one"], r["two"]
    assert int(two["step"]) == STEPS
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-6)
    np.testing.assert_allclose(two["norms"], one["norms"], rtol=1e-6)
    assert relative_error(weights(one), weights(two)) < 1e-6


def test_ranks_holding_different_numbers_of_targets_match_one_rank(tmp_path):
    """Prompts masked in every other row: the ranks' rows hold different numbers of targets, and the ranks
    together still give one process's loss and weights (the mean over all targets, not the mean of each rank's
    mean)."""
    one = trained(tmp_path / "one.npz", 4, "--masked")
    two = trained(tmp_path / "two.npz", 2, "--masked", ranks=2)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-6)
    assert relative_error(weights(one), weights(two)) < 1e-6


@pytest.mark.parametrize("grad_accum", ["1", "2"])
def test_an_epochs_tail_of_filler_on_one_rank_matches_one_rank(tmp_path, grad_accum):
    """9 sequences, 2 ranks of batch 2: the step that ends the epoch holds one sequence and filler rows, all of
    rank 1's rows filler (with 2 micro-batches a step, rank 0's second too); the ranks still give one process's
    losses, gradient norms and weights, and each epoch is ceil(9 / (4 x micro-batches)) steps."""
    one = trained(tmp_path / "one.npz", 4, "--tail", "--grad-accum", grad_accum)
    two = trained(tmp_path / "two.npz", 2, "--tail", "--grad-accum", grad_accum, ranks=2)
    assert np.isfinite(two["losses"]).all()
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-6)
    np.testing.assert_allclose(two["norms"], one["norms"], rtol=1e-6)
    assert relative_error(weights(one), weights(two)) < 1e-6
    # 3 steps: one epoch of 3 steps, or one of 2 steps and the first step of the next
    assert two["position"].tolist() == one["position"].tolist() == ([1, 0] if grad_accum == "1" else [1, 8])


def test_zero1_sharded_optimizer_state_equals_plain_data_parallel(runs):
    root, r = runs
    for key in weights(r["two"]):
        np.testing.assert_array_equal(r["zero"][key], r["two"][key], err_msg=key)
    np.testing.assert_array_equal(r["zero"]["losses"], r["two"]["losses"])
    # the gathered optimizer state is the plain run's, entry for entry
    plain = read_safetensors(root / "two" / "checkpoints" / "checkpoint-3" / OPTIMIZER_FILE)
    sharded = read_safetensors(root / "zero" / "checkpoints" / "checkpoint-3" / OPTIMIZER_FILE)
    assert sorted(plain) == sorted(sharded)
    for key in plain:
        np.testing.assert_array_equal(sharded[key].as_float(), plain[key].as_float(), err_msg=key)


def test_a_data_parallel_checkpoint_loads_into_a_single_device_run(runs):
    root, r = runs
    model = tiny_model(seed=1)  # other weights: all must be overwritten
    params = [t for _, t in model.named_parameters()]
    decay, no_decay = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    optimizer = AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    state = load_checkpoint(root / "zero" / "checkpoints" / "checkpoint-3", model=model, optimizer=optimizer)
    assert state["step"] == STEPS and state["data_parallel"]["world_size"] == 2
    for name, t in model.named_parameters():
        np.testing.assert_array_equal(t.numpy(), r["two"][f"w.{name}"], err_msg=name)
    assert all(optimizer.state[id(p)]["step"] == STEPS for p in params)
    assert not list((root / "zero" / "checkpoints").glob(".tmp-*"))  # written once, atomically


def test_gradients_in_bf16_train_close_to_fp32(runs, tmp_path):
    _, r = runs
    bf16 = trained(tmp_path / "bf16.npz", 2, "--comm", "bf16", ranks=2)
    np.testing.assert_allclose(bf16["losses"], r["two"]["losses"], rtol=1e-4)
    assert 0 < relative_error(weights(r["two"]), weights(bf16)) < 1e-2  # rounded, yet the same trajectory


def test_bf16_weights_track_one_rank_to_bf16_rounding_and_zero1_equals_plain(tmp_path):
    """bfloat16 gradients are rounded per rank before they are averaged (as in PyTorch DDP), so two ranks agree
    with one rank to bfloat16's resolution, not float32's; ZeRO-1 still changes nothing."""
    one = trained(tmp_path / "one.npz", 4, "--precision", "bf16")
    two = trained(tmp_path / "two.npz", 2, "--precision", "bf16", ranks=2)
    zero = trained(tmp_path / "zero.npz", 2, "--precision", "bf16", "--shard", ranks=2)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-4)
    assert relative_error(weights(one), weights(two)) < 1e-2
    for key in weights(two):
        np.testing.assert_array_equal(zero[key], two[key], err_msg=key)


def test_fp16_with_loss_scaling_and_zero1_tracks_one_rank(tmp_path):
    one = trained(tmp_path / "one.npz", 4, "--precision", "fp16")
    two = trained(tmp_path / "two.npz", 2, "--precision", "fp16", "--shard", ranks=2)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-4)
    assert relative_error(weights(one), weights(two)) < 1e-2


def test_a_rank_dying_stops_the_others_and_the_run_resumes(runs, tmp_path):
    root, r = runs
    out = tmp_path / "killed.npz"
    done = run(out, 2, "--shard", "--kill-rank", "1", ranks=2, timeout=60)  # rank 1 dies in step 3
    assert done.returncode != 0 and not out.exists()
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["checkpoint-2"]
    resumed = trained(out, 2, "--shard", "--resume", ranks=2)
    assert int(resumed["step"]) == STEPS and len(resumed["losses"]) == 1
    for key in weights(r["zero"]):
        np.testing.assert_array_equal(resumed[key], r["zero"][key], err_msg=key)


def test_a_rank_that_hangs_stops_the_run_after_the_timeout(tmp_path):
    started = time.monotonic()
    env = {distributed.TIMEOUT_ENV: "3"}
    done = run(tmp_path / "hung.npz", 2, "--hang-rank", "1", ranks=2, timeout=60, env=env)
    assert done.returncode != 0 and time.monotonic() - started < 45
    # the step's first collective: its loss targets, summed over the ranks before the forward
    assert "rank 0: no answer from the other ranks in the all-reduce of the loss targets for 3 s" in done.stderr


def test_an_aborting_rank_waits_until_the_launcher_has_read_its_message(monkeypatch):
    """MPICH's launcher stops reading a rank's stderr pipe when the abort arrives: the message must be read first."""
    read_end, write_end = os.pipe()
    taken = []

    def slow_launcher():
        time.sleep(0.3)
        taken.append(os.read(read_end, 1 << 16))

    class Comm:
        def Abort(self, code):
            self.unread_at_abort = distributed._unread_bytes(write_end)

    comm, reader = Comm(), threading.Thread(target=slow_launcher)
    with os.fdopen(write_end, "w", closefd=False) as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        reader.start()
        distributed.print_then_abort(comm, "rank 1: the reason")
    reader.join()
    assert comm.unread_at_abort == 0 and taken == [b"rank 1: the reason\n"]
    os.close(read_end), os.close(write_end)


def test_resuming_with_another_number_of_ranks_is_refused(runs, tmp_path):
    root, _ = runs
    shutil.copytree(root / "two" / "checkpoints" / "checkpoint-2", tmp_path / "one" / "checkpoints" / "checkpoint-2")
    done = run(tmp_path / "one.npz", 4, "--resume")
    assert done.returncode != 0
    assert "trained by 2 data-parallel rank(s), this run has 1" in done.stderr


def test_ranks_take_disjoint_rows_of_the_single_process_batches():
    data = tiny_data().subset(slice(0, 29))
    whole = distributed.Batches(data, 6, seed=3)
    parts = [distributed.ShardedBatches(data, 2, rank, 3, seed=3) for rank in range(3)]
    assert whole.steps_per_epoch(2) == parts[0].steps_per_epoch(2) == 3  # 29 sequences, 12 a step
    for _ in range(7):  # across two epochs' ends, where rank 2's rows of the last step are filler
        for (ids, labels), *rank_batches in zip(whole.next_step(2), *[p.next_step(2) for p in parts]):
            np.testing.assert_array_equal(np.concatenate([b[0] for b in rank_batches]), ids)
            np.testing.assert_array_equal(np.concatenate([b[1] for b in rank_batches]), labels)
        assert all(p.state_dict()["epoch"] == whole.epoch and p.cursor == whole.cursor for p in parts)
    assert distributed.partition([10, 40, 30, 20], 2) == [0, 0, 1, 1]


def test_cli_data_parallel_starts_the_ranks_and_matches_one_process(tmp_path, capsys):
    pytest.importorskip("vkformers_llama")
    from test_lora import tiny_llama_folder
    from vkformers.cli import main
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 40)
    common = ["--model", str(tiny_llama_folder(tmp_path / "config")), "--from-scratch", "--tokenizer", "byte",
              "--data", str(corpus), "--steps", "3", "--seq-len", "16", "--no-progress", "--eval-fraction", "0",
              "--lr", "1e-2"]
    assert main(["train", *common, "--out", str(tmp_path / "one"), "--batch-size", "4"]) == 0
    assert main(["train", *common, "--out", str(tmp_path / "two"), "--batch-size", "2", "--data-parallel", "2",
                 "--share-device", "--shard-optimizer", "--bucket-mb", "0.01"]) == 0
    one = read_safetensors(tmp_path / "one" / "final" / "model.safetensors")
    two = read_safetensors(tmp_path / "two" / "final" / "model.safetensors")
    assert sorted(one) == sorted(two)
    assert relative_error({k: e.as_float() for k, e in one.items()}, {k: e.as_float() for k, e in two.items()}) < 1e-6
    metrics = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 3  # written by rank 0 alone
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["checkpoint-3"]


def test_more_ranks_than_devices_is_refused_with_what_to_do(tmp_path, capfd, monkeypatch):
    pytest.importorskip("vkformers_llama")
    from test_lora import tiny_llama_folder
    from vkformers.cli import main
    from vkformers.runtime.vulkan import describe_devices
    monkeypatch.delenv(distributed.SHARE_DEVICE_ENV, raising=False)
    ranks = len(describe_devices()) + 1
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 40)
    assert main(["train", "--model", str(tiny_llama_folder(tmp_path / "config")), "--from-scratch", "--tokenizer",
                 "byte", "--data", str(corpus), "--steps", "1", "--seq-len", "16", "--no-progress",
                 "--out", str(tmp_path / "run"), "--batch-size", "1", "--data-parallel", str(ranks)]) != 0
    err = capfd.readouterr().err
    assert f"Vulkan device(s): start at most {ranks - 1} ranks per host" in err
    assert f"{distributed.SHARE_DEVICE_ENV}=1" in err


def test_open_mpi_is_allowed_to_start_ranks_as_root_and_a_choice_already_made_is_kept(monkeypatch):
    """Open MPI's mpiexec refuses root (a container's usual user) unless both variables say yes."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    env = distributed.launcher_environment({"PATH": "/bin", "OMPI_ALLOW_RUN_AS_ROOT": "0"})
    assert env == {"PATH": "/bin", "OMPI_ALLOW_RUN_AS_ROOT": "0", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert distributed.launcher_environment({"PATH": "/bin"}) == {"PATH": "/bin"}
