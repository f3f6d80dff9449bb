"""The CLI commands devices, doctor, build-kernels and bench, errors as one line (--debug), a closed stdout,
and train's option checks (architectures: test_registry.py; generate: test_cli_generate.py; train end to end:
test_lora.py, test_training.py)."""
import json
import os
import subprocess
import sys

import pytest

from vkformers.cli import devices, main
from vkformers.errors import DeviceIndexError


def test_devices_json(capsys):
    assert main(["devices", "--json"]) == 0
    devices = json.loads(capsys.readouterr().out)["devices"]
    assert devices and {"name", "type", "limits", "features", "cooperative_matrix", "memory_heaps"} <= set(devices[0])
    assert devices[0]["limits"]["max_storage_buffer_range"] > 0


def test_doctor_passes_on_this_machine(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["verdict"].startswith("OK")
    assert {c["check"] for c in report["checks"]} >= {"vulkan loader", "kp runtime", "driver", "dispatch"}


def test_build_kernels_is_incremental(capsys):
    assert main(["build-kernels"]) == 0
    assert "compiled 0 kernel(s)" in capsys.readouterr().out


def test_bench_times_products_and_a_model(tmp_path, capsys):
    """`vkformers bench --quick`: checked products in every dtype this device stores, and a model's tokens/s."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["dtype"] for r in results["matmul"]][0] == "float32"
    for r in results["matmul"]:
        assert r["tflops"] > 0 and r["numpy_float32_tflops"] > 0
        assert r["max_relative_error"] < 1e-4, r  # float32 accumulation of exactly representable inputs
    model = results["model"]
    assert model["new_tokens"] == 8 and model["decode_tok_s"] > 0 and model["prefill_tok_s"] > 0
    assert "decode batch 1" in capsys.readouterr().out


def test_bench_says_a_missing_model_before_timing_anything(tmp_path, capsys):
    assert main(["bench", "--quick", "--model", str(tmp_path / "none")]) == 1
    captured = capsys.readouterr()
    assert "matmul" not in captured.out
    assert captured.err == f"vkformers bench: error: {tmp_path / 'none'}: no such file or folder\n"


@pytest.mark.parametrize("command", ["generate", "serve", "merge-lora"])
def test_an_adapter_folder_is_checked_before_the_model_loads(tmp_path, capsys, command):
    """The model named is missing too (serve: the bundled one, whose folder serve looks at first): the error is the
    adapter's, so it was checked first."""
    import socket
    extra = {"generate": ["--prompt", "hi"], "merge-lora": ["--out", str(tmp_path / "merged")]}.get(command, [])
    if command == "serve":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            extra = ["--port", str(probe.getsockname()[1])]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    model = (["--model", str(tmp_path / "no-model")] if command != "serve" else []) + ["--adapter", str(adapter)]
    assert main([command, *model, *extra]) == 1
    assert capsys.readouterr().err == (f"vkformers {command}: error: {adapter}: no adapter_config.json (not a PEFT "
                                       "adapter folder)\n")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                                            "target_modules": ["q_proj"]}))
    assert main([command, *model, *extra]) == 1
    assert capsys.readouterr().err == (f"vkformers {command}: error: {adapter}: no adapter_model.safetensors "
                                       "(nor adapter_model.bin)\n")
    assert not (tmp_path / "merged").exists()


# ---------------------------------------------------------------- errors, --debug, a closed stdout

def failing(exc):
    def run(args):
        raise exc
    return run


def test_an_unexpected_error_is_one_line_with_a_hint(monkeypatch, capsys):
    monkeypatch.delenv("VKFORMERS_DEBUG", raising=False)
    monkeypatch.setattr(devices, "run", failing(ValueError("bad value\non two lines")))
    assert main(["devices"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("vkformers devices: error: ValueError: bad value on two lines (rerun with --debug")


def test_a_vkformers_error_shows_its_message_only(monkeypatch, capsys):
    monkeypatch.delenv("VKFORMERS_DEBUG", raising=False)
    monkeypatch.setattr(devices, "run", failing(DeviceIndexError("no device 7; this machine has 1")))
    assert main(["devices"]) == 1
    assert capsys.readouterr().err == "vkformers devices: error: no device 7; this machine has 1\n"


@pytest.mark.parametrize("how", ["--debug first", "--debug after the command", "VKFORMERS_DEBUG=1"])
def test_debug_shows_the_traceback(monkeypatch, capsys, how):
    monkeypatch.delenv("VKFORMERS_DEBUG", raising=False)
    monkeypatch.setattr(devices, "run", failing(OSError(28, "No space left on device")))
    argv = {"--debug first": ["--debug", "devices"], "--debug after the command": ["devices", "--debug"],
            "VKFORMERS_DEBUG=1": ["devices"]}[how]
    if how.startswith("VKFORMERS"):
        monkeypatch.setenv("VKFORMERS_DEBUG", "1")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in run" in err
    assert "vkformers devices: error: OSError: [Errno 28] No space left on device" in err and "rerun" not in err


def test_a_closed_stdout_ends_quietly(monkeypatch, capsys):
    import vkformers.cli
    detached = []  # not the real dup2 onto fd 1: under `pytest -s` that would silence the test run itself
    monkeypatch.setattr(vkformers.cli, "_detach_stdout", lambda: detached.append(True))
    monkeypatch.setattr(devices, "run", failing(BrokenPipeError(32, "Broken pipe")))
    assert main(["devices"]) == 141
    assert capsys.readouterr().err == "" and detached == [True]


def test_architectures_json_into_a_closed_pipe_exits_quietly():
    """`vkformers architectures --json | head`: the reader is gone before the first write."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; from vkformers.cli import main; "
                               "sys.exit(main(['architectures', '--json']))"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == 141


# ---------------------------------------------------------------- vkformers train: options checked by argparse

TRAIN = ["train", "--model", "m", "--out", "o", "--data", "d.txt"]


@pytest.mark.parametrize("option, value, message", [
    ("--batch-size", "0", "argument --batch-size: must be a whole number >= 1, got 0"),
    ("--steps", "-3", "argument --steps: must be a whole number >= 1, got -3"),
    ("--grad-accum", "0", "argument --grad-accum: must be a whole number >= 1, got 0"),
    ("--lora-rank", "0", "argument --lora-rank: must be a whole number >= 1, got 0"),
    ("--seq-len", "1", "argument --seq-len: must be a whole number >= 2, got 1"),
    ("--lr", "0", "argument --lr: must be a finite number > 0, got 0"),
    ("--lr", "nan", "argument --lr: must be a finite number > 0, got nan"),
    ("--lr", "fast", "argument --lr: must be a number, got 'fast'"),
    ("--weight-decay", "-0.1", "argument --weight-decay: must be a finite number >= 0, got -0.1"),
    ("--eval-fraction", "1", "argument --eval-fraction: must be a finite number in [0, 1), got 1"),
    ("--lora-dropout", "1.5", "argument --lora-dropout: must be a finite number in [0, 1), got 1.5"),
    ("--min-lr-ratio", "2", "argument --min-lr-ratio: must be a finite number in [0, 1], got 2"),
    ("--keep", "-1", "argument --keep: must be a whole number >= 0, got -1"),
    ("--batch-size", "2.5", "argument --batch-size: must be a whole number, got '2.5'"),
])
def test_train_options_out_of_range_are_usage_errors(capsys, option, value, message):
    with pytest.raises(SystemExit) as exit_:
        main([*TRAIN, option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"vkformers train: error: {message}" and "Traceback" not in err


def test_train_refuses_an_out_that_is_a_file(tmp_path, capsys):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    assert main(["train", "--model", "m", "--out", str(existing), "--data", "d.txt"]) == 1
    assert capsys.readouterr().err == (f"vkformers train: error: {existing} exists and is not a folder; give a "
                                       "folder for the output (it is created if missing)\n")
    assert existing.read_text() == "keep me"


def test_train_refuses_an_out_that_cannot_be_created_before_loading(tmp_path, capsys):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    assert main(["train", "--model", "m", "--out", str(existing / "run"), "--data", "d.txt"]) == 1
    assert capsys.readouterr().err == (f"vkformers train: error: cannot create the output folder {existing / 'run'}: "
                                       f"{existing} is not a folder this user may write in; choose another output "
                                       "folder\n")


def test_a_folder_that_cannot_be_made_is_an_output_folder_error(tmp_path):
    from vkformers.errors import OutputFolderError
    from vkformers.models.atomic import make_folder
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputFolderError, match=r"cannot create the folder .*file/run \(Not a directory\): choose "):
        make_folder(tmp_path / "file" / "run")
