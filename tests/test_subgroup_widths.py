"""Kernels at subgroup widths other than the CI device's 8 lanes (AMD runs 64 or 32, Intel 8, 16 or 32, NVIDIA and
Apple 32), and the launchers' choices for a device whose subgroups hold fewer invocations than it reports.

lavapipe takes its width from LP_NATIVE_VECTOR_WIDTH (bits) when it creates its device, so each width runs in a
subprocess: a subset of the kernel tests, chosen to reach every kernel whose lanes or subgroups are counted (the
small-m product, the fused decode, the quantized matvec, the decode attention, the workgroup reductions, the
selective scan) and greedy generation through them. 128 and 512 bits give subgroups of 4 and 16 lanes, run as such.
2048 makes lavapipe report 64 lanes while llvmpipe still puts at most 16 invocations in a subgroup: gl_SubgroupSize
reads 64 and gl_NumSubgroups counts the 16-wide ones, as on Intel's Mesa driver (it reports 32 and may run 8 or 16);
the launchers then keep the small-m product to one subgroup of 16 and compose the decode step from the ordinary ops
(kernels.subgroup_lanes). No width of lavapipe runs more than 16 lanes side by side (docs/guide.md, "Adding or
changing a kernel").
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import vkformers as vkf
from vkformers.engine.kernels import INTEL_VENDOR_ID, LLVMPIPE_MAX_LANES, subgroup_lanes, subgroups_are_full
from vkformers.engine.kernels import decode as KD
from vkformers.engine.kernels.matmul import SmallMConfig, small_m_config
from vkformers.engine.ops import decode as fused_ops
from vkformers.engine.ops.decode import fusable

TESTS = Path(__file__).resolve().parent

# The tests each width runs (pytest node ids, relative to tests/): every one passes at 4, 16 and 64 lanes.
SUBSET = {
    "all": [
        "test_subgroup_widths.py::test_the_device_reports_the_width_asked",
        "test_matmul.py::test_small_m_every_dtype_pair[float32-bfloat16]",
        "test_matmul.py::test_small_m_transposes[False-True-float16]",
        "test_matmul.py::test_small_m_configurations",
        "test_matmul.py::test_small_m_gate_skips_products[float32-True]",
        "test_matmul.py::test_batched_with_strides_and_offsets[float32]",
        "test_quant.py::test_matvec_batches_tails_and_offsets[q4_k]",
        "test_attention.py::test_decode_over_several_tiles",
        "test_paged_cache.py::test_paged_decode_attention_skips_tiles_of_scratch_padding[float16]",
        "test_decode_fused.py::test_head_norm_rope_write_normalises_each_head[16-8-True-True-float32]",
        "test_kernels_reduce.py::test_softmax_forward",
        "test_kernels_transformer.py::test_rms_norm_forward",
        "test_kernels_transformer.py::test_cross_entropy_vocab_50k_with_ignored_rows[float32]",
        "test_ssm_scan.py::test_forward_and_last_state_match_numpy",
        "test_generation.py::test_cached_greedy_equals_uncached_recomputation",
        "test_generation.py::test_fixture_greedy_tokens[qwen3]",
        "test_generation.py::test_fixture_greedy_tokens[bamba]",
    ],
    # The fused decode kernel where it runs (subgroups as wide as reported).
    "full": [
        "test_decode_fused.py::test_fused_linear_with_norm_bias_and_residual[this device-3-520-37-float32]",
        "test_decode_fused.py::test_fused_linear_with_norm_bias_and_residual"
        "[GPU shape, k split, 2 pairs-8-256-130-float16]",
        "test_decode_fused.py::test_fused_qkv_rotates_and_writes_the_cache"
        "[GPU shape, k split, 2 pairs-16-8-False-float32]",
        "test_quant.py::test_fused_decode_with_quantized_weights[(4, 2, 2, 1)-q4_k]",
    ],
}
WIDTHS = {128: 4, 512: 16, 2048: 64}  # LP_NATIVE_VECTOR_WIDTH bits: the subgroup size lavapipe reports


def fake_device(size, low=None, high=None, *, vendor=0, driver="", cpu=False):
    return SimpleNamespace(name="fake", is_cpu=cpu, info={"driver_name": driver},
                           limits={"subgroup_size": size, "min_subgroup_size": low or size,
                                   "max_subgroup_size": high or size, "vendor_id": vendor})


def test_subgroup_lanes_of_the_drivers_that_run_narrower_subgroups():
    assert subgroup_lanes(fake_device(32, vendor=0x10DE)) == 32  # NVIDIA
    assert subgroup_lanes(fake_device(64, 32, 64, vendor=0x1002)) == 64  # AMD: wave64, as reported
    assert subgroup_lanes(fake_device(32, 8, 32, vendor=INTEL_VENDOR_ID)) == 8  # compiled for 8, 16 or 32 lanes
    assert subgroup_lanes(fake_device(32, 16, 32, vendor=INTEL_VENDOR_ID)) == 16
    assert subgroup_lanes(fake_device(64, driver="llvmpipe", cpu=True)) == LLVMPIPE_MAX_LANES == 16
    assert subgroup_lanes(fake_device(8, driver="llvmpipe", cpu=True)) == 8
    assert subgroups_are_full(fake_device(64, 32, 64, vendor=0x1002))
    assert not subgroups_are_full(fake_device(32, 8, 32, vendor=INTEL_VENDOR_ID))


def test_small_m_product_takes_one_whole_subgroup_where_subgroups_are_narrower():
    """x @ W^T's lanes stride over k by gl_SubgroupSize: where subgroups may hold fewer invocations the workgroup is
    one subgroup of the lanes surely there (so gl_SubgroupSize covers them all), and a larger one is refused."""
    nvidia, intel = fake_device(32, vendor=0x10DE), fake_device(32, 8, 32, vendor=INTEL_VENDOR_ID)
    lavapipe = fake_device(64, driver="llvmpipe", cpu=True)
    assert small_m_config(nvidia, 1, 4096, trans_b=True).threads == 256  # unchanged where subgroups are full
    assert small_m_config(intel, 1, 4096, trans_b=True) == SmallMConfig(threads=8, rows_per_wg=1)
    assert small_m_config(intel, 6, 4096, trans_b=True) == SmallMConfig(threads=8, rows_per_wg=2, rows_per_subgroup=2)
    assert small_m_config(lavapipe, 1, 64, trans_b=True).threads == 16
    assert small_m_config(intel, 1, 4096, trans_b=False).threads == 256  # no subgroup operations: any size
    with pytest.raises(ValueError, match="at most 8 threads"):
        SmallMConfig(threads=16, rows_per_wg=1).check(True, 32, 8)
    SmallMConfig(threads=16, rows_per_wg=1).check(False, 32, 8)
    SmallMConfig(threads=256, rows_per_wg=8).check(True, 32, 32)


def test_fused_decode_is_not_used_where_subgroups_are_narrower(device, monkeypatch):
    """The fused decode kernel's lanes stride over k by gl_SubgroupSize: on a device whose subgroups may hold fewer
    invocations, fusable refuses even when fusion is forced on, and the launcher refuses the kernel."""
    monkeypatch.setattr(fused_ops, "enabled", True)
    x, w = vkf.tensor(np.zeros((1, 1, 64), np.float32)), vkf.tensor(np.zeros((8, 64), np.float32))
    with vkf.no_grad():
        assert fusable(x, [w])
        # a device reporting 32 lanes that runs kernels narrower: llvmpipe (16 wide) or Intel's driver (8 wide up);
        # only the choice is asked, nothing runs
        monkeypatch.setitem(device.limits, "subgroup_size", 32)
        monkeypatch.setitem(device.limits, "vendor_id", INTEL_VENDOR_ID)
        monkeypatch.setitem(device.limits, "min_subgroup_size", 8)
        assert not subgroups_are_full(device)
        assert not fusable(x, [w])
        x_buffer, w_buffer = device.upload(np.zeros(64, np.float32)), device.upload(np.zeros(8 * 64, np.float32))
        with pytest.raises(ValueError, match="narrower than the 32 lanes"):
            KD.decode_matvec(device.sequence(), x_buffer, [w_buffer], device.upload(np.zeros(8, np.float32)), rows=1,
                             k=64, widths=[8])


def test_the_device_reports_the_width_asked(device):
    """(Run by test_kernels_at_subgroup_width in its subprocesses.) lavapipe took LP_NATIVE_VECTOR_WIDTH."""
    bits = os.environ.get("LP_NATIVE_VECTOR_WIDTH")
    if bits is None or device.info.get("driver_name") != "llvmpipe":
        pytest.skip("checks a lavapipe subprocess given LP_NATIVE_VECTOR_WIDTH")
    assert device.limits["subgroup_size"] == int(bits) // 32
    assert subgroup_lanes(device) == min(int(bits) // 32, LLVMPIPE_MAX_LANES)


@pytest.mark.parametrize("bits", WIDTHS, ids=lambda bits: f"{WIDTHS[bits]} lanes")
def test_kernels_at_subgroup_width(device, bits):
    if device.info.get("driver_name") != "llvmpipe":
        pytest.skip("LP_NATIVE_VECTOR_WIDTH sets lavapipe's subgroup size; a GPU has its own (run the kernel tests "
                    "there as they are)")
    full = min(WIDTHS[bits], LLVMPIPE_MAX_LANES) == WIDTHS[bits]
    ids = SUBSET["all"] + (SUBSET["full"] if full else [])
    env = dict(os.environ, LP_NATIVE_VECTOR_WIDTH=str(bits))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids], cwd=TESTS,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " failed" not in run.stdout and " error" not in run.stdout
