"""``vkformers devices``: the Vulkan devices, their limits, features, cooperative-matrix shapes and memory."""
from __future__ import annotations

import json

from vkformers.runtime.vulkan import describe_devices

GIB = 1 << 30
SHOWN_LIMITS = ("max_storage_buffer_range", "max_compute_shared_memory_size", "max_push_constants_size",
                "max_compute_work_group_invocations", "subgroup_size", "min_subgroup_size", "max_subgroup_size",
                "timestamp_period_ps")


def add_parser(subparsers):
    parser = subparsers.add_parser("devices", help="list Vulkan devices")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--extensions", action="store_true", help="also list every device extension")
    parser.set_defaults(func=run)
    return parser


def summarize(info: dict, with_extensions: bool = False) -> dict:
    """The parts of a device description that users act on (the patched kp enables every listed feature)."""
    out = {key: info.get(key) for key in ("name", "type", "api_version", "driver_name", "driver_info")}
    out["limits"] = {key: info["limits"][key] for key in SHOWN_LIMITS if key in info["limits"]}
    out["features"] = sorted(name for name, on in info["supported_features"].items() if on)
    out["cooperative_matrix"] = info["cooperative_matrix"]
    out["memory_heaps"] = info["memory_heaps"]
    if with_extensions:
        out["extensions"] = info["extensions"]
    return out


def run(args) -> int:
    devices = [summarize(info, args.extensions) for info in describe_devices()]
    if args.json:
        print(json.dumps({"devices": devices}, indent=2))
        return 0
    for index, d in enumerate(devices):
        print(f"[{index}] {d['name']}  ({d['type']}, Vulkan {d['api_version']}, {d['driver_name']} {d['driver_info']})")
        for heap in d["memory_heaps"]:
            kind = "device-local" if heap["device_local"] else "host"
            budget = f", budget {heap['budget'] / GIB:.1f} GiB, used {heap['usage'] / GIB:.2f} GiB" if heap["budget"] else ""
            print(f"    memory heap: {heap['size'] / GIB:.1f} GiB {kind}{budget}")
        print("    limits: " + ", ".join(f"{k}={v}" for k, v in d["limits"].items()))
        print("    features: " + (", ".join(d["features"]) or "none"))
        shapes = sorted({f"{s['a_type']}x{s['b_type']}->{s['result_type']} {s['m']}x{s['n']}x{s['k']}"
                         for s in d["cooperative_matrix"] if s["scope"] == "subgroup"})
        print("    cooperative matrix: " + (", ".join(shapes) if shapes else "none"))
        if args.extensions:
            print("    extensions: " + ", ".join(d["extensions"]))
    return 0
