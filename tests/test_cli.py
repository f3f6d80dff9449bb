"""The CLI commands devices, doctor, build-kernels and bench (architectures: test_registry.py; generate:
test_cli_generate.py; train: test_data.py, test_lora.py)."""
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
