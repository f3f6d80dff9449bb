"""The CLI commands that exist so far: devices, doctor, build-kernels (architectures: test_registry.py)."""
import json

from vkformers.cli import main


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
