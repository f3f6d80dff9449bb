"""``vkformers architectures``: list the architectures the installed plugins register."""
from __future__ import annotations

import argparse
import json
import sys

from vkformers.models.known_families import KNOWN_FAMILIES
from vkformers.models.plugins import registry
from vkformers.models.registry import STATUSES, Architecture, install_hint

EXIT_USAGE = 2  # same exit status argparse uses for bad arguments


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "architectures",
        help="list supported model architectures",
        description="List every Hugging Face model_type the installed plugins register, "
        "with its plugin, kind, verification status and aliases.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--family", metavar="F", help="only this family plugin (e.g. llama, bert)")
    parser.add_argument("--status", metavar="S", choices=STATUSES, help=f"only this status: {', '.join(STATUSES)}")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    reg = registry()
    family = _family_name(args.family) if args.family else None
    if family is not None and family not in reg.families():
        print(
            f"vkformers architectures: unknown family {args.family!r}; "
            f"installed families: {', '.join(reg.families()) or 'none'}"
            + _missing_families_hint(reg.families()),
            file=sys.stderr,
        )
        return EXIT_USAGE

    architectures = [
        a for a in reg.architectures()
        if (family is None or a.family == family) and (args.status is None or a.status == args.status)
    ]
    # Wrappers have no status of their own, so a --status filter leaves them out.
    wrappers = [w for w in reg.wrappers() if (family is None or w.family == family) and args.status is None]
    rows = [_architecture_row(a, reg.aliases_of(a.name)) for a in architectures]
    counts = _counts(architectures, rows, len(wrappers))

    if args.json:
        print(json.dumps({
            "architectures": rows,
            "wrappers": [{"model_type": w.spelling, "family": w.family, "backbone": w.target.describe()} for w in wrappers],
            "counts": counts,
        }, indent=2))
        return 0

    _print_table(rows)
    if wrappers:
        print("\nWrappers (the backbone comes from a nested config):")
        for wrapper in wrappers:
            print(f"  {wrapper.spelling:<24} {wrapper.family:<6} {wrapper.target.describe()}")
    print()
    print(_summary(counts))
    missing = _missing_families_hint(reg.families())
    if missing and family is None:
        print(missing.strip("; "))
    return 0


def _family_name(text: str) -> str:
    # Accept the distribution name too: "vkformers-llama" means "llama".
    return text.removeprefix("vkformers-")


def _architecture_row(architecture: Architecture, aliases: list[str]) -> dict:
    return {
        "name": architecture.name,
        "family": architecture.family,
        "kind": architecture.kind,
        "tasks": list(architecture.tasks),
        "status": architecture.status,
        "aliases": aliases,
        "traits": dict(architecture.traits),
        "notes": architecture.notes,
    }


def _counts(architectures: list[Architecture], rows: list[dict], wrapper_count: int) -> dict:
    counts = {
        "canonical": len(architectures),
        "spellings": len(architectures) + sum(len(row["aliases"]) for row in rows) + wrapper_count,
    }
    for status in STATUSES:
        counts[status] = sum(1 for a in architectures if a.status == status)
    return counts


def _summary(counts: dict) -> str:
    statuses = ", ".join(f"{counts[status]} {status}" for status in STATUSES)
    return f"{counts['canonical']} canonical, {counts['spellings']} spellings; {statuses}"


def _print_table(rows: list[dict]) -> None:
    header = ("architecture", "plugin", "kind", "status", "aliases")
    lines = [(r["name"], r["family"], r["kind"], r["status"], ", ".join(r["aliases"])) for r in rows]
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines)]
    for line in [header, *lines]:
        # The aliases column is last and left unpadded so that long lists do not pad every line.
        print(("  ".join(cell.ljust(width) for cell, width in zip(line[:-1], widths)) + "  " + line[-1]).rstrip())


def _missing_families_hint(installed: list[str]) -> str:
    missing = sorted(set(KNOWN_FAMILIES.values()) - set(installed))
    if not missing:
        return ""
    return "; not installed: " + ", ".join(f"vkformers-{f} ({install_hint(f)})" for f in missing)
