"""Store the fixtures' AdamW references as fixed-point steps instead of full float32 copies of every parameter.

A reference's ``adamw.<p>`` (the parameter after one torch AdamW step) and ``adamw2.<p>`` (after a second) become

    adamw_delta.<p>        int16, the step from the preceding parameter in units of
    adamw_delta_scale.<p>  float32 scalar (max |step| / 32767 of the tensor)

with ``adamw.<p> = float32(base) + float32(adamw_delta.<p>) * adamw_delta_scale.<p>`` in float32, the base being
``<p>`` of the fixture's model.safetensors, and the same for ``adamw2_delta.<p>`` on top of ``adamw.<p>``.
A step is about the learning rate (1e-2) in every element, so its absolute rounding here is ~1.5e-7, far below
the 1e-5 (plus a gradient-noise term) that the tests allow; float16 would round it by up to ~4e-6, too close.

Each tensor is checked: its largest reconstruction error must be at most TOLERANCE / MARGIN, and a tensor that
did not move (a parameter without gradient, which a test compares exactly) must come back bit for bit. A tensor
that fails, or has no base of the same name and shape, stays float32 under its old key.

    python tools/compact_adamw_fixtures.py [FOLDER...]    # default: every reference under tests/fixtures

The fixture writers call ``compact_file`` on the reference they just saved, so regeneration gives this layout.
Only numpy and safetensors are needed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
# The smallest bound any test applies to an AdamW reference element (tests/test_adamw_parity.py,
# test_training_parity.py's ATOL, test_encoder_parity.py, test_seq2seq_parity.py, test_lora_parity.py).
TOLERANCE = 1e-5
MARGIN = 10.0
LEVELS = 32767
# (stored step kind, the kind whose parameters it starts from; None: the model's weights)
STEPS = (("adamw", None), ("adamw2", "adamw"))


def expand(base: np.ndarray, delta: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The parameter a stored step gives (tests/fixture_cases.py's read_reference computes the same)."""
    return base.astype(np.float32) + delta.astype(np.float32) * np.float32(scale)


def encode(base: np.ndarray, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    step = after.astype(np.float64) - base.astype(np.float64)
    largest = float(np.abs(step).max()) if step.size else 0.0
    scale = np.float32(largest / LEVELS)
    q = np.zeros(step.shape, np.int16) if scale == 0 else np.clip(np.rint(step / np.float64(scale)), -LEVELS, LEVELS).astype(np.int16)
    return q, np.array(scale, np.float32)


def compact(ref: dict, weights: dict, stats: dict | None = None, label: str = "") -> dict:
    """``ref`` with every adamw./adamw2. tensor that passes the check stored as a step; ``stats`` collects
    bytes before/after, the worst error / tolerance ratio and the tensors kept float32 (with why)."""
    stats = stats if stats is not None else {}
    stats.setdefault("before", 0)
    stats.setdefault("after", 0)
    stats.setdefault("worst", (0.0, ""))
    stats.setdefault("kept", [])
    out = dict(ref)
    # Parameters as the tests will reconstruct them, so a second step starts from the first's reconstruction.
    rebuilt = {None: weights}
    for kind, base_kind in STEPS:
        rebuilt[kind] = {}
        for key in [k for k in ref if k.startswith(kind + ".")]:
            name = key[len(kind) + 1:]
            after = ref[key]
            stats["before"] += after.nbytes
            base = rebuilt[base_kind].get(name)
            why = None
            if after.dtype != np.float32:
                why = f"stored as {after.dtype}"
            elif base is None or base.shape != after.shape:
                why = "no base of that name and shape"
            if why is None:
                q, scale = encode(base, after)
                got = expand(base, q, scale)
                error = float(np.abs(got.astype(np.float64) - after.astype(np.float64)).max()) if after.size else 0.0
                if not np.isfinite(got).all():
                    why = "not finite"
                elif np.array_equal(base, after) and not np.array_equal(got, after):
                    why = "unmoved but not reconstructed exactly"
                elif error * MARGIN > TOLERANCE:
                    why = f"error {error:.2g} not {MARGIN:g}x below {TOLERANCE:g}"
            if why is not None:
                stats["kept"].append(f"{label}{key}: {why}")
                stats["after"] += after.nbytes
                rebuilt[kind][name] = after
                continue
            del out[key]
            out[f"{kind}_delta.{name}"] = q
            out[f"{kind}_delta_scale.{name}"] = scale
            stats["after"] += q.nbytes + scale.nbytes
            ratio = error / TOLERANCE
            if ratio >= stats["worst"][0]:
                stats["worst"] = (ratio, label + key)
            rebuilt[kind][name] = got
    return out


def compact_file(path: Path, stats: dict | None = None) -> dict:
    """Rewrite one reference file in place (its base: model.safetensors in the same folder)."""
    path = Path(path)
    stats = stats if stats is not None else {}
    ref = load_file(str(path))
    if not any(k.startswith(tuple(kind + "." for kind, _ in STEPS)) for k in ref):
        return stats
    model = path.parent / "model.safetensors"
    weights = {k: v for k, v in load_file(str(model)).items()} if model.is_file() else {}
    with open(path, "rb") as f:  # keep the header's metadata, if any
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    out = compact(ref, weights, stats, label=f"{path.parent.name}/{path.name}: ")
    if out.keys() != ref.keys():
        save_file(out, str(path), metadata=header.get("__metadata__"))
    return stats


def main(argv: list[str]) -> int:
    folders = [Path(a) for a in argv] or [FIXTURES]
    files = sorted({p for f in folders for p in ([f] if f.is_file() else f.rglob("*reference.safetensors"))})
    stats: dict = {}
    size_before = sum(p.stat().st_size for p in files)
    for p in files:
        compact_file(p, stats)
    size_after = sum(p.stat().st_size for p in files)
    if "before" not in stats:
        print("no AdamW references found")
        return 0
    print(f"{len(files)} reference files: {size_before} -> {size_after} bytes")
    print(f"adamw/adamw2 tensors: {stats['before']} -> {stats['after']} bytes")
    ratio, key = stats["worst"]
    print(f"worst reconstruction error / {TOLERANCE:g}: {ratio:.3g} ({key})")
    print(f"kept float32: {len(stats['kept'])}")
    for line in stats["kept"]:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
