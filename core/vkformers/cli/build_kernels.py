"""``vkformers build-kernels``: compile the GLSL kernels of core and every installed plugin to SPIR-V."""
from __future__ import annotations

from vkformers.runtime.kernels import build_kernels, kernel_dirs


def add_parser(subparsers):
    parser = subparsers.add_parser("build-kernels", help="compile GLSL kernels to SPIR-V (the install step runs it)")
    parser.add_argument("--force", action="store_true", help="recompile everything, not only what changed")
    parser.set_defaults(func=run)
    return parser


def run(args) -> int:
    build_kernels(kernel_dirs(), force=args.force)
    return 0
