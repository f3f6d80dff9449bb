"""Just enough SPIR-V reflection to check a dispatch before Vulkan sees it.

From a compiled kernel we learn its storage-buffer bindings (and which are
read-only, so the recorder knows what each dispatch writes), the size of its
push-constant block, its specialization-constant ids, its local size and the
capabilities it declares (what the device must support to run it).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = 0x07230203

# Opcodes and enums from the SPIR-V specification (section 3).
OP_CAPABILITY = 17
OP_EXECUTION_MODE = 16
OP_TYPE_INT = 21
OP_TYPE_FLOAT = 22
OP_TYPE_VECTOR = 23
OP_TYPE_ARRAY = 28
OP_TYPE_STRUCT = 30
OP_TYPE_POINTER = 32
OP_CONSTANT = 43
OP_VARIABLE = 59
OP_DECORATE = 71
OP_MEMBER_DECORATE = 72
EXECUTION_MODE_LOCAL_SIZE = 17
DECORATION_SPEC_ID = 1
DECORATION_ARRAY_STRIDE = 6
DECORATION_NON_WRITABLE = 24
DECORATION_BINDING = 33
DECORATION_DESCRIPTOR_SET = 34
DECORATION_OFFSET = 35
STORAGE_CLASS_UNIFORM = 2
STORAGE_CLASS_PUSH_CONSTANT = 9
STORAGE_CLASS_STORAGE_BUFFER = 12


@dataclass(frozen=True)
class Binding:
    index: int
    readonly: bool


@dataclass(frozen=True)
class KernelInterface:
    bindings: tuple[Binding, ...]
    push_constant_bytes: int
    spec_ids: tuple[int, ...]
    local_size: tuple[int, int, int] | None
    capabilities: tuple[int, ...] = ()  # OpCapability operands, in declaration order


class SpirvError(ValueError):
    pass


def reflect(code: bytes) -> KernelInterface:
    if len(code) < 20 or len(code) % 4:
        raise SpirvError("not a SPIR-V module: size is not a positive multiple of 4 bytes")
    words = struct.unpack(f"<{len(code) // 4}I", code)
    if words[0] != MAGIC:
        raise SpirvError("not a SPIR-V module: bad magic number")

    decorations: dict[int, dict[int, list[int]]] = {}
    member_decorations: dict[int, dict[int, dict[int, list[int]]]] = {}
    pointers: dict[int, tuple[int, int]] = {}  # id -> (storage class, pointee)
    structs: dict[int, list[int]] = {}
    scalar_bytes: dict[int, int] = {}
    constants: dict[int, int] = {}  # id -> value of 32-bit integer constants (array lengths)
    arrays: dict[int, tuple[int, int]] = {}  # id -> (element type, length constant id)
    variables: list[tuple[int, int, int]] = []  # (id, pointer type, storage class)
    local_size = None
    capabilities: list[int] = []

    i = 5
    while i < len(words):
        count, opcode = words[i] >> 16, words[i] & 0xFFFF
        if count == 0:
            raise SpirvError("corrupt SPIR-V: zero-length instruction")
        ops = words[i + 1 : i + count]
        if opcode == OP_CAPABILITY:
            capabilities.append(ops[0])
        elif opcode == OP_DECORATE:
            decorations.setdefault(ops[0], {})[ops[1]] = list(ops[2:])
        elif opcode == OP_MEMBER_DECORATE:
            member_decorations.setdefault(ops[0], {}).setdefault(ops[1], {})[ops[2]] = list(ops[3:])
        elif opcode == OP_TYPE_POINTER:
            pointers[ops[0]] = (ops[1], ops[2])
        elif opcode == OP_TYPE_STRUCT:
            structs[ops[0]] = list(ops[1:])
        elif opcode in (OP_TYPE_INT, OP_TYPE_FLOAT):
            scalar_bytes[ops[0]] = ops[1] // 8
        elif opcode == OP_TYPE_VECTOR:
            scalar_bytes[ops[0]] = scalar_bytes.get(ops[1], 4) * ops[2]
        elif opcode == OP_TYPE_ARRAY:
            arrays[ops[0]] = (ops[1], ops[2])
        elif opcode == OP_CONSTANT and len(ops) == 3:
            constants[ops[1]] = ops[2]
        elif opcode == OP_VARIABLE:
            variables.append((ops[1], ops[0], ops[2]))
        elif opcode == OP_EXECUTION_MODE and ops[1] == EXECUTION_MODE_LOCAL_SIZE:
            local_size = (ops[2], ops[3], ops[4])
        i += count

    for array, (element, length) in arrays.items():  # push blocks use arrays of scalars (std430 stride)
        stride = decorations.get(array, {}).get(DECORATION_ARRAY_STRIDE, [scalar_bytes.get(element, 4)])[0]
        scalar_bytes[array] = stride * constants.get(length, 1)

    readonly_by_index: dict[int, bool] = {}  # a binding declared twice (aliased views) is read-only if both are
    push_bytes = 0
    for var_id, ptr_type, storage in variables:
        pointee = pointers.get(ptr_type, (0, 0))[1]
        if storage in (STORAGE_CLASS_STORAGE_BUFFER, STORAGE_CLASS_UNIFORM):
            deco = decorations.get(var_id, {})
            if DECORATION_BINDING not in deco:
                continue
            if deco.get(DECORATION_DESCRIPTOR_SET, [0])[0] != 0:
                raise SpirvError("kernels must use descriptor set 0 only")
            members = member_decorations.get(pointee, {})
            readonly = DECORATION_NON_WRITABLE in deco or (
                bool(members) and all(DECORATION_NON_WRITABLE in m for m in members.values())
            )
            index = deco[DECORATION_BINDING][0]
            readonly_by_index[index] = readonly_by_index.get(index, True) and readonly
        elif storage == STORAGE_CLASS_PUSH_CONSTANT:
            # Push blocks hold 32-bit scalars (and vectors and arrays of them): size = last offset + last size.
            offsets = member_decorations.get(pointee, {})
            for member, member_type in enumerate(structs.get(pointee, [])):
                offset = offsets.get(member, {}).get(DECORATION_OFFSET, [0])[0]
                push_bytes = max(push_bytes, offset + scalar_bytes.get(member_type, 4))

    bindings = [Binding(index, readonly) for index, readonly in sorted(readonly_by_index.items())]
    if [b.index for b in bindings] != list(range(len(bindings))):
        raise SpirvError(f"bindings must be numbered 0..n-1, found {[b.index for b in bindings]}")
    spec_ids = tuple(sorted(d[DECORATION_SPEC_ID][0] for d in decorations.values() if DECORATION_SPEC_ID in d))
    return KernelInterface(tuple(bindings), push_bytes, spec_ids, local_size, tuple(capabilities))
