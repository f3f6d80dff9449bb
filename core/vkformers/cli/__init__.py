"""The ``vkformers`` command line: one module per subcommand, each with add_parser()."""
from __future__ import annotations

import argparse
import sys

from vkformers.cli import architectures, bench, build_kernels, devices, doctor, generate, merge_lora, train
from vkformers.errors import VkformersError

COMMANDS = (devices, doctor, architectures, build_kernels, generate, train, merge_lora, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vkformers", description="Hugging Face Transformers on any Vulkan GPU")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except VkformersError as exc:
        print(f"vkformers {args.command}: error: {exc}", file=sys.stderr)
        return 1
