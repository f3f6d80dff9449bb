"""The fixtures keep their AdamW references as int16 steps (tests/fixtures/README.md): a full float32 copy of a
parameter that has a base to step from costs the repository's size budget for nothing."""
from pathlib import Path

from fixture_cases import ADAMW_STEPS
from vkformers.models.safetensors_io import read_header

FIXTURES = Path(__file__).parent / "fixtures"


def _shapes(path: Path) -> dict:
    return {k: v["shape"] for k, v in read_header(path)[0].items() if k != "__metadata__"} if path.is_file() else {}


def test_adamw_references_are_stored_as_steps():
    full = []
    for ref in sorted(FIXTURES.rglob("*reference.safetensors")):
        stored = _shapes(ref)
        weights = _shapes(ref.parent / "model.safetensors")
        for kind, base_kind in ADAMW_STEPS:
            for key, shape in stored.items():
                if not key.startswith(kind + "."):
                    continue
                name = key[len(kind) + 1:]
                base = weights.get(name) if base_kind is None else (
                    stored.get(f"{base_kind}.{name}") or stored.get(f"{base_kind}_delta.{name}"))
                if base == shape:
                    full.append(f"{ref.relative_to(FIXTURES)}: {key}")
    assert not full, ("float32 AdamW references that could be steps (run tools/compact_adamw_fixtures.py): "
                      + ", ".join(full[:5]) + (f" and {len(full) - 5} more" if len(full) > 5 else ""))
