"""Turn a compiled float16 cooperative-matrix kernel into its bfloat16 twin, in place.

No GLSL compiler we ship knows GL_EXT_bfloat16, but SPIR-V does (SPV_KHR_bfloat16):
bfloat16 is ``OpTypeFloat 16 BFloat16KHR``. A kernel written so that its only
16-bit float type is the element type of its cooperative matrices (loads and
stores of raw 16-bit patterns go through integer types) becomes a bfloat16
kernel by re-declaring that one type and adding the capabilities:

    spirv-dis -> rewrite -> spirv-as -> spirv-val

The build step runs this (``//! postprocess bf16_* ../../tools/spirv_bf16.py`` in
the shader); it refuses a kernel that uses 16-bit floats anywhere else, where the
rewrite would silently change arithmetic.

    python tools/spirv_bf16.py KERNEL.spv
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from vkformers.runtime.kernels import _compiler_env, glslang_command

FLOAT16_TYPE = re.compile(r"^\s*(%\w+) = OpTypeFloat 16\s*$", re.M)
CAPABILITIES = "OpCapability BFloat16TypeKHR\nOpCapability BFloat16CooperativeMatrixKHR\n"
EXTENSION = 'OpExtension "SPV_KHR_bfloat16"\n'


def spirv_tool(name: str) -> list[str]:
    return [str(Path(glslang_command()[0]).parent / name)]


def run_tool(name: str, args: list[str], stdin: str | None = None) -> str:
    command = spirv_tool(name)
    result = subprocess.run([*command, *args], input=stdin, capture_output=True, text=True,
                            env=_compiler_env(command))
    if result.returncode != 0:
        raise SystemExit(f"{name} failed: {result.stdout}{result.stderr}")
    return result.stdout


# Instructions that only move 16-bit values around (or multiply cooperative
# matrices, or count their elements), and conversions to or from the 16-bit type (OpFConvert rounds to the
# type it names, so under bfloat16 it rounds to bfloat16, as meant); any other use
# of a 16-bit float (arithmetic, constants) would change meaning under bfloat16,
# so the rewrite refuses it.
MOVES = {"OpTypeFloat", "OpTypeVector", "OpTypeArray", "OpTypeRuntimeArray", "OpTypePointer", "OpTypeStruct",
         "OpTypeCooperativeMatrixKHR", "OpVariable", "OpLoad", "OpStore", "OpAccessChain",
         "OpInBoundsAccessChain", "OpBitcast", "OpCompositeConstruct", "OpCompositeExtract", "OpVectorShuffle",
         "OpCooperativeMatrixLoadKHR", "OpCooperativeMatrixStoreKHR", "OpCooperativeMatrixMulAddKHR", "OpPhi",
         "OpFConvert", "OpCooperativeMatrixLengthKHR"}
INSTRUCTION = re.compile(r"^\s*(?:(%\w+) = )?(Op\w+)(.*)$")


def check_only_moved(text: str, half: str) -> None:
    """Fail unless every value whose type involves the 16-bit float ``half`` is only moved."""
    tainted = {half}  # the type, types built from it, and values of those types
    for line in text.splitlines():
        match = INSTRUCTION.match(line)
        if not match:
            continue
        result, opcode, operands = match.groups()
        used = set(re.findall(r"%\w+", operands)) & tainted
        if not used:
            continue
        if opcode not in MOVES:
            raise SystemExit(f"16-bit float used by {opcode}, which bfloat16 would change: {line.strip()}")
        if result and opcode.startswith("OpType"):
            tainted.add(result)
        elif result and operands.split()[0] in tainted:  # a value of a tainted type
            tainted.add(result)


def to_bfloat16(text: str) -> str:
    """Disassembled float16 kernel -> disassembled bfloat16 kernel."""
    types = FLOAT16_TYPE.findall(text)
    if len(types) != 1:
        raise SystemExit(f"expected one 16-bit float type, found {len(types)}")
    check_only_moved(text, types[0])
    text = FLOAT16_TYPE.sub(lambda m: f"{m.group(1)} = OpTypeFloat 16 BFloat16KHR", text)
    text = re.sub(r"^\s*OpCapability Float16\s*$\n", "", text, flags=re.M)  # no float16 left
    # Module order: capabilities, then extensions (the kernel already declares
    # SPV_KHR_cooperative_matrix), then the rest.
    return re.sub(r"^(\s*OpExtension)", lambda m: CAPABILITIES + EXTENSION + m.group(1), text, count=1, flags=re.M)


def main(path: str) -> None:
    text = run_tool("spirv-dis", ["--raw-id", path])
    rewritten = to_bfloat16(text)
    run_tool("spirv-as", ["--target-env", "vulkan1.3", "-o", path, "-"], stdin=rewritten)
    run_tool("spirv-val", ["--target-env", "vulkan1.3", path])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
