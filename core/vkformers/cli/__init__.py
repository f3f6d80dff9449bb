"""The ``vkformers`` command line: one module per subcommand, each with add_parser().

Errors reach the user as one line, ``vkformers COMMAND: error: ...``, and a non-zero exit status; the
traceback only with ``--debug`` (before or after the command) or ``VKFORMERS_DEBUG=1``.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from vkformers.cli import (architectures, bench, build_kernels, devices, doctor, embed, generate, merge_lora, serve,
                           train)
from vkformers.errors import VkformersError

COMMANDS = (devices, doctor, architectures, build_kernels, generate, serve, train, merge_lora, embed, bench)
DEBUG_ENV = "VKFORMERS_DEBUG"
DEBUG_HELP = f"show the traceback of an error (also: {DEBUG_ENV}=1)"
EXIT_ERROR = 1
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a tool ended by SIGPIPE (`... | head`)
EXIT_INTERRUPTED = 128 + 2   # SIGINT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vkformers", description="Hugging Face Transformers on any Vulkan GPU")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for command in COMMANDS:
        command.add_parser(subparsers)
    for subparser in subparsers.choices.values():  # `vkformers train ... --debug` works too
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def debug_requested(args) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def describe(exc: BaseException) -> str:
    """One line for an error: a VkformersError's own message; anything else its type and message, and
    how to see where it came from."""
    text = " ".join(str(exc).split())  # one line, whatever the message holds
    if isinstance(exc, VkformersError):
        return text or type(exc).__name__
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to start the same command again (train's ranks)
    debug = debug_requested(args)
    try:
        status = args.func(args) or 0
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not as a warning at exit
        return status
    except BrokenPipeError:
        _detach_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"vkformers {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            traceback.print_exc()
        line = f"vkformers {args.command}: error: {describe(exc)}"
        if not isinstance(exc, VkformersError) and not debug:
            line += f" (rerun with --debug, or {DEBUG_ENV}=1, for the traceback)"
        print(line, file=sys.stderr)
        return EXIT_ERROR


def _detach_stdout() -> None:
    """Point stdout at /dev/null so that Python's flush at exit does not fail again on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured in tests)
        pass
