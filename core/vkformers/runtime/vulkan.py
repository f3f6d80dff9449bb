"""The Vulkan runtime: devices, buffers, kernels and recorded sequences.

This is the only module in vkformers that imports kp (Kompute). It needs kp
built with vkformers' patch (kp/README.md): global barriers, device features,
a fence-reusing submit path and region copies.

The model of execution: a :class:`Sequence` is a list of operations (kernel
dispatches, copies, fills, uploads, downloads). It is recorded into one Vulkan
command buffer once, with a barrier wherever an operation reads or overwrites a
buffer that an earlier operation since the last barrier wrote (or, for writes,
read), and then replayed any number of times with one submit each.
"""
from __future__ import annotations

import itertools
import math
import os
import struct
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Sequence as Seq

import numpy as np

from vkformers.errors import (
    LAVAPIPE_HINT,
    BufferTooLargeError,
    DeviceFeatureError,
    DeviceIndexError,
    KernelBindingError,
    NoVulkanDeviceError,
    OutOfDeviceMemoryError,
)
from vkformers.runtime import dtypes as dt
from vkformers.runtime.kernels import find_spirv
from vkformers.runtime.settings import count_setting
from vkformers.runtime.spirv import KernelInterface, reflect

try:
    import kp
except ImportError as exc:  # the loader (libvulkan.so.1) or kp itself is missing
    kp = None
    _KP_IMPORT_ERROR = exc
else:
    _KP_IMPORT_ERROR = None

DEVICE_ENV = "VKFORMERS_DEVICE"
# The kp patch level (kp/vkformers.patch) this runtime needs: from 5 the Vulkan 1.0 features (shaderInt16, which the
# bfloat16 kernels declare) are enabled and reported.
KP_PATCH = 5
KP_BYTES_LIMIT = 1 << 32  # kp sizes buffers with uint32
# Kernel bindings (kp algorithms: one descriptor set over one kernel's buffers) a device keeps for reuse, least
# recently used dropped first. A binding goes anyway when one of its buffers does; a recorded sequence keeps its
# own until it goes. The compiled pipelines they share (kp's cache) are keyed by kernel configuration, never by shape.
MAX_BINDINGS = count_setting("VKFORMERS_BINDING_CACHE", 16384)

# VkComponentTypeKHR values, for naming cooperative-matrix shapes.
COMPONENT_TYPES = {0: "float16", 1: "float32", 2: "float64", 3: "int8", 4: "int16", 5: "int32",
                   6: "int64", 7: "uint8", 8: "uint16", 9: "uint32", 10: "uint64", 1000141000: "bfloat16"}
SCOPES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue-family"}

# What to do without a feature: 16-bit buffers and arithmetic serve the 16-bit dtypes only.
_USE_FLOAT32 = "load the model in float32 (dtype='float32', or --dtype float32)"
_UPDATE_DRIVER = "update the GPU driver (`vkformers doctor` shows what the device has)"
# The device feature each SPIR-V capability a kernel declares needs (numbers from the SPIR-V specification), what
# it is, and what a user can do without it. The patched kp enables every one of these the device supports.
CAPABILITY_FEATURES: dict[int, tuple[str, str, str]] = {
    9: ("shaderFloat16", "16-bit float arithmetic", "load the model in bfloat16 or float32"),
    10: ("shaderFloat64", "64-bit floats", _UPDATE_DRIVER),
    11: ("shaderInt64", "64-bit integers", _UPDATE_DRIVER),
    12: ("shaderBufferInt64Atomics", "64-bit atomics", _UPDATE_DRIVER),
    22: ("shaderInt16", "16-bit integers", _USE_FLOAT32),
    39: ("shaderInt8", "8-bit integers", _UPDATE_DRIVER),
    4433: ("storageBuffer16BitAccess", "16-bit values in buffers", _USE_FLOAT32),
    4434: ("uniformAndStorageBuffer16BitAccess", "16-bit values in uniform buffers", _USE_FLOAT32),
    4435: ("storagePushConstant16", "16-bit push constants", _USE_FLOAT32),
    4448: ("storageBuffer8BitAccess", "8-bit values in buffers", _UPDATE_DRIVER),
    4449: ("uniformAndStorageBuffer8BitAccess", "8-bit values in uniform buffers", _UPDATE_DRIVER),
    4450: ("storagePushConstant8", "8-bit push constants", _UPDATE_DRIVER),
    5116: ("shaderBFloat16Type", "bfloat16 arithmetic", _UPDATE_DRIVER),
    5117: ("shaderBFloat16DotProduct", "bfloat16 dot products", _UPDATE_DRIVER),
    5118: ("shaderBFloat16CooperativeMatrix", "bfloat16 cooperative matrices", _UPDATE_DRIVER),
    5345: ("vulkanMemoryModel", "the Vulkan memory model", _UPDATE_DRIVER),
    5346: ("vulkanMemoryModelDeviceScope", "the Vulkan memory model at device scope", _UPDATE_DRIVER),
    6016: ("shaderIntegerDotProduct", "integer dot products", _UPDATE_DRIVER),
    6017: ("shaderIntegerDotProduct", "integer dot products", _UPDATE_DRIVER),
    6018: ("shaderIntegerDotProduct", "integer dot products", _UPDATE_DRIVER),
    6019: ("shaderIntegerDotProduct", "integer dot products", _UPDATE_DRIVER),
    6022: ("cooperativeMatrix", "cooperative matrices", _UPDATE_DRIVER),
    6033: ("shaderBufferFloat32AtomicAdd", "float atomic add", _UPDATE_DRIVER),
}
# Capabilities every Vulkan compute device has (Shader), or whose support the device reports outside its features:
# subgroup operations (VkPhysicalDeviceSubgroupProperties, which kp does not report).
UNCHECKED_CAPABILITIES = frozenset({1, 61, 62, 63, 64, 65, 66, 67, 68})
# The features that every kernel of a model computing in a 16-bit dtype may need (float32 needs none of these).
DTYPE_FEATURES = {"float32": (), "bfloat16": ("storageBuffer16BitAccess", "shaderInt16"),
                  "float16": ("storageBuffer16BitAccess", "shaderFloat16")}


def _require_kp():
    if kp is None:
        raise NoVulkanDeviceError(f"cannot load the Vulkan runtime (kp): {_KP_IMPORT_ERROR}. {LAVAPIPE_HINT}")
    if not is_patched_kp():
        raise NoVulkanDeviceError(
            f"kp {kp_version()} lacks the vkformers patch (level {KP_PATCH}: barriers, device features); "
            "reinstall it with `bash scripts/setup.sh` (see kp/README.md)"
        )
    return kp


def is_patched_kp() -> bool:
    return kp is not None and getattr(kp, "vkformers_patch", 0) >= KP_PATCH


def kp_version() -> str | None:
    return getattr(kp, "__version__", None) if kp is not None else None


def describe_devices() -> list[dict]:
    """Properties, limits, supported features, cooperative-matrix shapes and memory of every device."""
    module = _require_kp()
    try:
        devices = module.describe_devices()
    except RuntimeError as exc:
        raise NoVulkanDeviceError(f"no Vulkan driver answered ({exc}). {LAVAPIPE_HINT}") from exc
    for info in devices:
        _name_coopmat_shapes(info)
    return devices


def _name_coopmat_shapes(info: dict) -> None:
    for shape in info.get("cooperative_matrix", []):
        for key in ("a_type", "b_type", "c_type", "result_type"):
            shape[key] = COMPONENT_TYPES.get(shape[key], str(shape[key]))
        shape["scope"] = SCOPES.get(shape["scope"], str(shape["scope"]))


# ---------------------------------------------------------------- devices

_devices: dict[int, "Device"] = {}
_devices_lock = threading.Lock()


def device_index_from_env() -> int:
    raw = os.environ.get(DEVICE_ENV, "0")
    try:
        return int(raw)
    except ValueError:
        raise DeviceIndexError(f"{DEVICE_ENV}={raw!r} is not a device index (an integer)") from None


def get_device(index: int | None = None) -> "Device":
    """The process-wide :class:`Device` for ``index`` (default: $VKFORMERS_DEVICE, else 0)."""
    index = device_index_from_env() if index is None else index
    with _devices_lock:
        if index not in _devices:
            _devices[index] = Device(index)
        return _devices[index]


class Device:
    """One Vulkan device (a kp.Manager). Create it through :func:`get_device`: one per process."""

    def __init__(self, index: int):
        module = _require_kp()
        available = describe_devices()
        if not available:
            raise NoVulkanDeviceError(f"the Vulkan loader found no device. {LAVAPIPE_HINT}")
        if not isinstance(index, int) or not 0 <= index < len(available):
            names = ", ".join(f"{i}: {d['name']}" for i, d in enumerate(available))
            raise DeviceIndexError(f"Vulkan device index {index!r} does not exist; devices are {names}")
        self.index = index
        self._manager = module.Manager(index)
        self.info = self._manager.describe()
        _name_coopmat_shapes(self.info)
        self.limits: dict = self.info["limits"]
        self.features: dict = self.info["enabled_features"]
        self._kernels: dict[tuple, Kernel] = {}
        self._pipelines: OrderedDict[tuple, object] = OrderedDict()  # kernel bindings, least recently used first
        self._pipeline_keys: dict[int, set] = {}  # buffer serial -> keys of the bindings over that buffer
        self._staging = None  # host tensor reused by small reads and writes
        self._in_flight: list[Sequence] = []  # submitted without waiting (Sequence.submit), not yet waited for

    def _staging_tensor(self, words: int | np.ndarray, name: str):
        """A host-visible tensor of at least ``words`` 32-bit words (or holding the uint32 array ``words``), and
        whether it is the reused one: reads and writes of up to STAGING_REUSE_BYTES share one (allocating host
        memory took ~3 ms of a 64 KB read on the H200); larger ones get their own, freed by the caller and
        created from the data itself (a write's data is copied once)."""
        data = words if isinstance(words, np.ndarray) else None
        count = words.size if data is not None else words
        if count * 4 > STAGING_REUSE_BYTES:
            initial = data if data is not None else np.empty(count, np.uint32)
            return _allocate(self, initial, kp.TensorTypes.host, f"{name} (staging)", count * 4), False
        if self._staging is None or self._staging.size() < count:
            size = max(count, 16 * 1024)
            self._staging = _allocate(self, np.empty(size, np.uint32), kp.TensorTypes.host, "staging", size * 4)
        if data is not None:
            self._staging.data()[:count] = data
        return self._staging, True

    def __repr__(self) -> str:
        return f"<vkformers.Device {self.index}: {self.name}>"

    @property
    def name(self) -> str:
        return self.info["name"]

    @property
    def is_cpu(self) -> bool:
        return self.info["type"] == "cpu"

    @property
    def max_buffer_bytes(self) -> int:
        return min(int(self.limits["max_storage_buffer_range"]), KP_BYTES_LIMIT - 4)

    def memory(self) -> dict:
        """The largest device-local memory heap, queried now: ``size``, and ``budget`` and ``usage`` (what this
        process may allocate in all, and holds; 0 where the driver lacks VK_EXT_memory_budget) in bytes."""
        heaps = self._manager.describe()["memory_heaps"]
        local = [h for h in heaps if h["device_local"]] or heaps
        heap = max(local, key=lambda h: h["size"])
        return {"size": int(heap["size"]), "budget": int(heap["budget"]), "usage": int(heap["usage"])}

    @property
    def cooperative_matrix_shapes(self) -> list[dict]:
        return self.info["cooperative_matrix"] if self.features.get("cooperativeMatrix") else []

    # -- buffers, kernels, sequences

    def buffer(self, shape_or_count, dtype="float32", *, host_visible: bool = False, name: str = "buffer") -> "Buffer":
        return Buffer(self, shape_or_count, dtype, host_visible=host_visible, name=name)

    def upload(self, array: np.ndarray, dtype=None, *, host_visible: bool = False, name: str = "buffer") -> "Buffer":
        array = np.asarray(array)
        buf = Buffer(self, array.shape, dtype or dt.as_dtype(array.dtype), host_visible=host_visible, name=name)
        buf.write(array)
        return buf

    def kernel(self, name: str, variant: str | None = None) -> "Kernel":
        key = (name, variant)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = Kernel(name, variant, find_spirv(name, variant))
            self.check_capabilities(kernel)
            self._kernels[key] = kernel
        return kernel

    def check_capabilities(self, kernel: "Kernel") -> None:
        """Raise DeviceFeatureError if ``kernel`` declares a capability whose feature this device lacks: a driver
        may reject such a shader, crash, or run it wrongly."""
        for capability in kernel.interface.capabilities:
            feature, what, remedy = CAPABILITY_FEATURES.get(capability, (None, "", ""))
            if feature is not None and not self.features.get(feature):
                raise DeviceFeatureError(f"{self.name} lacks {what} ({feature}), which kernel {kernel!s} needs: "
                                         f"{remedy}")

    def supports_dtype(self, dtype) -> bool:
        """Whether the kernels of a model computing in ``dtype`` can run here (DTYPE_FEATURES)."""
        return all(self.features.get(f) for f in DTYPE_FEATURES.get(dt.as_dtype(dtype).name, ()))

    def require_dtype(self, dtype) -> None:
        """Raise DeviceFeatureError, before any weight is uploaded, if the device cannot compute in ``dtype``."""
        name = dt.as_dtype(dtype).name
        missing = [f for f in DTYPE_FEATURES.get(name, ()) if not self.features.get(f)]
        if missing:
            others = [d for d in DTYPE_FEATURES if d != name and self.supports_dtype(d)]
            raise DeviceFeatureError(f"{self.name} cannot compute in {name}: it lacks {', '.join(missing)}; load the "
                                     f"model in {' or '.join(others)} (dtype=..., or --dtype)")

    def sequence(self, *, timestamps: bool = False, barriers: str = "tracked") -> "Sequence":
        return Sequence(self, timestamps=timestamps, barriers=barriers)

    def settle(self) -> None:
        """Wait for every sequence submitted without waiting (Sequence.submit)."""
        while self._in_flight:
            self._in_flight[0].wait()

    def run(self, build) -> "Sequence":
        """Record the operations that ``build(seq)`` adds and run them once."""
        seq = self.sequence()
        build(seq)
        seq.replay()
        return seq

    def _pipeline(self, kernel: "Kernel", buffers: tuple["Buffer", ...], groups, spec, push_words: int):
        """The kp algorithm (a descriptor set over ``buffers``) of one dispatch; kp (our patch) shares the compiled
        pipeline among all algorithms of one kernel and configuration."""
        key = (kernel.path, tuple(b.serial for b in buffers), groups, spec, push_words)
        algo = self._pipelines.get(key)
        if algo is not None:
            self._pipelines.move_to_end(key)
            return algo
        algo = self._manager.algorithm(
            [b._tensor for b in buffers], kernel.code, list(groups),
            np.asarray(spec, dtype=np.uint32), np.zeros(push_words, dtype=np.uint32))
        self._pipelines[key] = algo
        for b in buffers:
            self._pipeline_keys.setdefault(b.serial, set()).add(key)
        while len(self._pipelines) > max(MAX_BINDINGS, 1):
            self._drop_pipeline(next(iter(self._pipelines)))
        return algo

    def _drop_pipeline(self, key: tuple) -> None:
        # Only this cache's reference goes: kp frees the descriptor set when no recorded operation holds it any
        # more (a recorded sequence waits for its last submission before it lets go), never under a running one.
        self._pipelines.pop(key, None)
        for serial in key[1]:
            keys = self._pipeline_keys.get(serial)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._pipeline_keys[serial]

    def _forget_buffer(self, serial: int) -> None:
        """A buffer went: drop the bindings over it."""
        for key in self._pipeline_keys.pop(serial, ()):
            self._drop_pipeline(key)

    def cache_sizes(self) -> dict:
        """Entries of this device's caches: kernel bindings (descriptor sets), kernels, kp's shared pipelines."""
        return {"bindings": len(self._pipelines), "kernels": len(self._kernels),
                "pipelines": int(kp.shared_pipelines())}


# ---------------------------------------------------------------- buffers

_buffer_serials = itertools.count()
_buffer_bytes = {"live": 0, "peak": 0}  # Buffer allocations of this process (staging copies excluded)


def _count_buffer_bytes(delta: int) -> None:
    _buffer_bytes["live"] += delta
    _buffer_bytes["peak"] = max(_buffer_bytes["peak"], _buffer_bytes["live"])


def buffer_serial_mark() -> int:
    """A number above the serial of every Buffer made before this call and below that of every one made after."""
    return next(_buffer_serials)


def allocated_bytes(nbytes: int) -> int:
    """The bytes a Buffer of ``nbytes`` allocates (whole 32-bit words, at least one), as buffer_memory() counts."""
    return max(1, -(-nbytes // 4)) * 4


def buffer_memory() -> dict:
    """Bytes held by live Buffers now and at most since the last reset_peak_buffer_memory() (all devices)."""
    return {"live_bytes": _buffer_bytes["live"], "peak_bytes": _buffer_bytes["peak"]}


def reset_peak_buffer_memory() -> None:
    _buffer_bytes["peak"] = _buffer_bytes["live"]

class Buffer:
    """A device buffer of ``count`` elements of ``dtype``, stored as 32-bit words.

    ``host_visible=False`` (default): device-local memory only, for weights,
    activations and optimizer state; ``write``/``read`` go through a temporary
    staging buffer. ``host_visible=True``: a device buffer with a permanent host
    mirror (``.host``), for inputs and outputs moved every replay with
    ``Sequence.upload`` / ``Sequence.download``.
    """

    def __init__(self, device: Device, shape_or_count, dtype="float32", *, host_visible=False, name="buffer"):
        self.device = device
        self.dtype = dt.as_dtype(dtype)
        self.shape = (shape_or_count,) if isinstance(shape_or_count, (int, np.integer)) else tuple(shape_or_count)
        self.count = int(math.prod(self.shape))
        self.nbytes = self.count * self.dtype.itemsize
        self.name = name
        self.host_visible = host_visible
        self.serial = next(_buffer_serials)  # unique for the process's life, unlike id()
        if self.nbytes > device.max_buffer_bytes:
            raise BufferTooLargeError(
                f"buffer {name!r} needs {self.nbytes:,} bytes, more than this device can bind in one buffer "
                f"(maxStorageBufferRange {device.max_buffer_bytes:,} bytes on {device.name}); split it"
            )
        words = allocated_bytes(self.nbytes) // 4
        kind = kp.TensorTypes.device if host_visible else kp.TensorTypes.storage
        self._tensor = _allocate(device, np.empty(words, dtype=np.uint32), kind, name, self.nbytes)
        self._root = None  # the Buffer owning the storage of an alias (None on that Buffer: no cycle)
        weakref.finalize(self, Device._forget_buffer, device, self.serial)
        _count_buffer_bytes(words * 4)
        weakref.finalize(self, _count_buffer_bytes, -words * 4)

    @property
    def root(self) -> "Buffer":
        """The Buffer that owns this one's storage: itself, or what it is an alias of."""
        return self._root or self

    def alias(self, shape_or_count, dtype="float32", *, name: str | None = None) -> "Buffer":
        """A Buffer over this one's storage from its first byte, as ``shape_or_count`` elements of ``dtype`` (at
        most this buffer's bytes): the memory planner gives values that are never alive together one allocation.
        Barriers see an alias and its root as one buffer; the alias keeps the storage alive."""
        root = self.root
        alias = Buffer._over(root, root.device, shape_or_count, dtype, root.name if name is None else name)
        if alias.nbytes > allocated_bytes(root.nbytes):
            raise ValueError(f"an alias of {alias.nbytes:,} bytes does not fit buffer {root.name!r} "
                             f"({root.nbytes:,} bytes)")
        return alias

    @staticmethod
    def _over(root: "Buffer | None", device: Device, shape_or_count, dtype, name: str) -> "Buffer":
        """A Buffer over ``root``'s storage (None: a storage made later, see Sequence.scratch), with the
        attributes of __init__ in its order (so that Python shares their layout), its own serial and bindings."""
        buf = object.__new__(Buffer)
        buf.device, buf.dtype = device, dt.as_dtype(dtype)
        buf.shape = (shape_or_count,) if isinstance(shape_or_count, (int, np.integer)) else tuple(shape_or_count)
        buf.count = int(math.prod(buf.shape))
        buf.nbytes = buf.count * buf.dtype.itemsize
        buf.name = name
        buf.host_visible = False
        buf.serial = next(_buffer_serials)
        buf._tensor = None if root is None else root._tensor
        buf._root = root
        weakref.finalize(buf, Device._forget_buffer, device, buf.serial)
        return buf

    def __repr__(self) -> str:
        return f"<Buffer {self.name!r} {self.shape} {self.dtype.name}>"

    @property
    def host(self) -> np.ndarray:
        """The host mirror as a writable numpy array (host-visible buffers only)."""
        if not self.host_visible:
            raise TypeError(f"buffer {self.name!r} is device-only; create it with host_visible=True")
        words = self._tensor.data()
        return words.view(np.uint8)[: self.nbytes].view(self.dtype.host).reshape(self.shape)

    def write(self, array: np.ndarray) -> None:
        """Copy ``array`` (same element count) into the buffer now."""
        data = np.ascontiguousarray(array, dtype=self.dtype.host).reshape(-1)
        if data.size != self.count:
            raise ValueError(f"buffer {self.name!r} holds {self.count} elements, got an array of {data.size}")
        if self.host_visible:
            self.host.reshape(-1)[:] = data
            self.device.run(lambda seq: seq.upload(self))
            return
        staging, reused = self.device._staging_tensor(_as_words(data), self.name)
        seq = self.device.sequence()
        seq._copy_tensor(staging, self, self.nbytes)
        seq.replay()
        if not reused:
            staging.destroy()

    def read(self, start: int = 0, count: int | None = None) -> np.ndarray:
        """The buffer's contents as a numpy array of its shape (bfloat16 as uint16 bits); with ``start`` or
        ``count``, only elements start .. start + count, flat (a view's span: only those bytes travel)."""
        whole = start == 0 and count in (None, self.count)
        count = self.count - start if count is None else count
        if not 0 <= start <= start + count <= self.count:
            raise ValueError(f"buffer {self.name!r}: elements {start}..{start + count} outside 0..{self.count}")
        if self.host_visible:
            self.device.run(lambda seq: seq.download(self))
            return self.host.copy() if whole else self.host.reshape(-1)[start:start + count].copy()
        size = self.dtype.itemsize
        first, last = start * size // 4 * 4, -(-(start + count) * size // 4) * 4  # whole 32-bit words
        staging, reused = self.device._staging_tensor(max(1, (last - first) // 4), self.name)
        seq = self.device.sequence()
        seq._copy_tensor(self, staging, last - first, src_offset=first)
        seq.replay()
        skip = start * size - first
        out = staging.data().view(np.uint8)[skip:skip + count * size].view(self.dtype.host).copy()
        if not reused:
            staging.destroy()
        return out.reshape(self.shape) if whole else out


STAGING_REUSE_BYTES = 16 << 20


def _as_words(data: np.ndarray) -> np.ndarray:
    raw = data.view(np.uint8)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
    return raw.view(np.uint32)


def _allocate(device: Device, words: np.ndarray, kind, name: str, nbytes: int):
    try:
        return device._manager.tensor_t(words, kind)
    except RuntimeError as exc:
        if "OutOfDeviceMemory" in str(exc) or "OutOfHostMemory" in str(exc):
            raise OutOfDeviceMemoryError(
                f"out of {'host' if 'Host' in str(exc) else 'device'} memory allocating buffer {name!r} "
                f"({nbytes:,} bytes) on {device.name}"
            ) from exc
        raise


# ---------------------------------------------------------------- kernels

@dataclass
class Kernel:
    """A compiled compute shader and what reflection says about its interface."""

    name: str
    variant: str | None
    path: Path

    @cached_property
    def code(self) -> bytes:
        return self.path.read_bytes()

    @cached_property
    def interface(self) -> KernelInterface:
        return reflect(self.code)

    def __str__(self) -> str:
        return f"{self.name}.{self.variant}" if self.variant else self.name

    def __repr__(self) -> str:
        return f"<Kernel {self}>"


def _push_words(values) -> np.ndarray:
    """Push constants as raw 32-bit words: Python ints as int32/uint32 bits, floats as float32 bits. Packed in one
    call: recording a plan converts thousands of them."""
    floats = [isinstance(v, (float, np.floating)) for v in values]
    items = [float(v) if f else int(v) & 0xFFFFFFFF for v, f in zip(values, floats)]
    try:
        packed = struct.pack("<" + "".join("f" if f else "I" for f in floats), *items)
    except OverflowError:  # a float beyond float32's range: numpy rounds it to infinity, as a float32 cast does
        return np.array([np.float32(v).view(np.uint32) if f else v for v, f in zip(items, floats)], np.uint32)
    return np.frombuffer(packed, np.uint32).copy()


# ---------------------------------------------------------------- sequences

@dataclass
class _Op:
    label: str
    reads: tuple
    writes: tuple
    make: object  # () -> kp op
    kind: str = "dispatch"
    group: object = None  # Sequence.dispatch's write_group


@dataclass
class Sequence:
    """Operations recorded once into one command buffer and replayed with one submit each.

    ``barriers="tracked"`` (default) inserts a global barrier only where an
    operation depends on an earlier one (RAW, WAR, WAW on a buffer);
    ``"always"`` puts one before every operation; ``"none"`` omits them (only
    for measuring what barriers cost: results are then undefined on a GPU).
    """

    device: Device
    timestamps: bool = False
    barriers: str = "tracked"
    _ops: list = field(default_factory=list)
    _seq: object = None
    _labels: list = field(default_factory=list)
    _keep: list = field(default_factory=list)
    _scratch: list = field(default_factory=list)  # the aliases scratch() handed out, their storage made by record()

    def __post_init__(self):
        if self.barriers not in ("tracked", "always", "none"):
            raise ValueError(f"barriers must be 'tracked', 'always' or 'none', not {self.barriers!r}")

    # -- building

    def dispatch(self, kernel: Kernel, buffers: Seq[Buffer], groups, push: Seq = (), spec: Seq = (),
                 write_group=None) -> "Sequence":
        """Run ``kernel`` over ``groups`` workgroups with ``buffers`` bound to bindings 0..n-1.

        ``write_group`` (any object): dispatches given the same one write disjoint parts of the buffers they share
        and read nothing another of them writes (a mixture of experts' products, each into its own rows of one
        output), so no barrier is put between them: they may run at the same time on a GPU."""
        iface = kernel.interface
        buffers = tuple(buffers)
        if len(buffers) != len(iface.bindings):
            raise KernelBindingError(
                f"kernel {kernel.name} has {len(iface.bindings)} storage-buffer binding(s); "
                f"{len(buffers)} buffer(s) were given")
        for b in buffers:
            if b.device is not self.device:
                raise KernelBindingError(f"buffer {b.name!r} belongs to another device")
        push_words = _push_words(push)
        if push_words.nbytes != iface.push_constant_bytes:
            raise KernelBindingError(
                f"kernel {kernel.name} takes {iface.push_constant_bytes} bytes of push constants; "
                f"{push_words.nbytes} were given")
        if len(spec) > len(iface.spec_ids):
            raise KernelBindingError(
                f"kernel {kernel.name} has {len(iface.spec_ids)} specialization constant(s); {len(spec)} were given")
        limit = self.device.limits
        groups = tuple(int(g) for g in (tuple(groups) + (1, 1, 1))[:3])
        maxima = (limit["max_compute_work_group_count_x"], limit["max_compute_work_group_count_y"],
                  limit["max_compute_work_group_count_z"])
        if any(g < 1 or g > m for g, m in zip(groups, maxima)):
            raise KernelBindingError(f"kernel {kernel.name}: workgroup count {groups} outside 1..{maxima}")
        spec = tuple(int(np.asarray(s, dtype=np.float32).view(np.uint32)) if isinstance(s, float) else int(s)
                     for s in spec)
        reads = tuple(b for b, info in zip(buffers, iface.bindings))
        writes = tuple(b for b, info in zip(buffers, iface.bindings) if not info.readonly)

        device = self.device  # not self: the closure, kept in self._ops, would make the sequence cyclic garbage

        def make():
            algo = device._pipeline(kernel, buffers, groups, spec, len(push_words))
            return kp.OpAlgoDispatch(algo, push_words)

        self._add(_Op(f"{kernel.name}.{kernel.variant}" if kernel.variant else kernel.name, reads, writes, make,
                      group=write_group))
        return self

    def copy(self, src: Buffer, dst: Buffer, nbytes: int | None = None, src_offset: int = 0, dst_offset: int = 0):
        """Copy bytes between buffers on the device."""
        nbytes = min(src.nbytes, dst.nbytes) if nbytes is None else nbytes
        self._add(_Op("copy", (src,), (dst,),
                      lambda: kp.OpBufferCopy(src._tensor, dst._tensor, src_offset, dst_offset, nbytes), "transfer"))
        return self

    def fill(self, dst: Buffer, word: int = 0, nbytes: int | None = None, offset: int = 0):
        """Fill ``nbytes`` (a multiple of 4) of ``dst`` with a repeated 32-bit word (0 zeroes)."""
        nbytes = -(-dst.nbytes // 4) * 4 if nbytes is None else nbytes
        self._add(_Op("fill", (), (dst,), lambda: kp.OpBufferFill(dst._tensor, word & 0xFFFFFFFF, offset, nbytes),
                      "transfer"))
        return self

    def upload(self, buf: Buffer):
        """At this point of each replay, copy ``buf.host`` to the device (per-replay inputs and scalars)."""
        self._require_host_visible(buf)
        self._add(_Op("upload", (), (buf,), lambda: kp.OpTensorSyncDevice([buf._tensor]), "transfer"))
        return self

    def download(self, buf: Buffer):
        """At this point of each replay, copy the device buffer to ``buf.host``."""
        self._require_host_visible(buf)
        self._add(_Op("download", (buf,), (), lambda: kp.OpTensorSyncLocal([buf._tensor]), "transfer"))
        return self

    def extend(self, other: "Sequence", *, uploads: bool = True, others: bool = True) -> "Sequence":
        """Append ``other``'s operations (its uploads, the rest, or both): one command buffer can then run a
        recorded step several times (generation chains decode steps so)."""
        other._make_scratch()
        for op in other._ops:
            if (uploads if op.label == "upload" else others):
                self._add(op)
        return self

    def scratch(self, shape_or_count, dtype="float32", *, name: str = "scratch") -> Buffer:
        """A workspace for the operations added next (partial sums a second pass adds up): every scratch buffer of
        a sequence lies over one allocation, made when the sequence is recorded and as large as the largest one
        asked for. Barriers order the uses (one op's writes wait for the previous op's reads); an operation that
        needs two workspaces at once asks for one and splits it by offsets."""
        if self._seq is not None:
            raise RuntimeError("this sequence was already recorded; build a new one")
        buf = Buffer._over(None, self.device, shape_or_count, dtype, name)
        self._scratch.append(buf)
        return buf

    def _make_scratch(self) -> None:
        """Allocate the storage of the scratch buffers handed out (once; every one becomes an alias of it)."""
        if not self._scratch or self._scratch[0]._tensor is not None:
            return
        root = Buffer(self.device, max(allocated_bytes(b.nbytes) // 4 for b in self._scratch), "uint32", name="scratch")
        for b in self._scratch:
            b._tensor, b._root = root._tensor, root
        self._keep.append(root)

    def _copy_tensor(self, src, dst, nbytes, src_offset: int = 0):
        # one-shot copies between a Buffer and a bare staging tensor
        src_t = src._tensor if isinstance(src, Buffer) else src
        dst_t = dst._tensor if isinstance(dst, Buffer) else dst
        self._keep.extend([src_t, dst_t])
        self._add(_Op("copy", (), (), lambda: kp.OpBufferCopy(src_t, dst_t, src_offset, 0, -(-nbytes // 4) * 4),
                      "transfer"))

    def _require_host_visible(self, buf: Buffer):
        if not buf.host_visible:
            raise TypeError(f"buffer {buf.name!r} has no host mirror; create it with host_visible=True")

    def _add(self, op: _Op):
        if self._seq is not None:
            raise RuntimeError("this sequence was already recorded; build a new one")
        self._ops.append(op)

    def buffers(self) -> list[Buffer]:
        """The buffers whose storage its operations bind, each once (the root of an alias)."""
        seen = {}
        for op in self._ops:
            for b in (*op.reads, *op.writes):
                seen.setdefault(id(b.root), b.root)
        return list(seen.values())

    # -- recording and replay

    @property
    def num_barriers(self) -> int:
        """Barriers between operations (the leading one not counted)."""
        return self._labels.count("barrier") - 1

    def record(self) -> "Sequence":
        """Record the operations into a command buffer (done by the first replay)."""
        if self._seq is not None:
            return self
        self._make_scratch()
        kp_ops, labels = [], []
        # since the last barrier: buffer id -> the write groups (None: no group) of the ops that wrote / used it
        written: dict[int, set] = {}
        touched: dict[int, set] = {}
        # A leading barrier orders this replay after earlier submits (which may still
        # be running after submit()), and gives an empty sequence something to run.
        kp_ops.append(kp.OpGlobalBarrier())
        labels.append("barrier")
        for op in self._ops:
            reads = {id(b.root) for b in op.reads}  # aliases of one storage are one buffer here
            writes = {id(b.root) for b in op.writes}
            # RAW, WAR and WAW hazards since the last barrier, except among ops of one write group (whose
            # bindings may name a buffer the group writes without reading what another member wrote)
            same = {op.group} if op.group is not None else set()
            needed = any(written.get(i, set()) - same for i in reads) or any(
                (written.get(i, set()) | touched.get(i, set())) - same for i in writes)
            if self.barriers == "always" or (self.barriers == "tracked" and needed):
                kp_ops.append(kp.OpGlobalBarrier())
                labels.append("barrier")
                written, touched = {}, {}
            kp_ops.append(op.make())
            labels.append(op.label)
            for i in writes:
                written.setdefault(i, set()).add(op.group)
            for i in reads | writes:
                touched.setdefault(i, set()).add(op.group)
        seq = self.device._manager.sequence(0, len(kp_ops) if self.timestamps else 0)
        for kp_op in kp_ops:
            seq.record(kp_op)
        self._seq, self._labels = seq, labels
        self._keep.extend(kp_ops)  # ops hold the push-constant data the command buffer uses
        return self

    def replay(self) -> "Sequence":
        """Submit the recorded command buffer and wait for it, and so for every earlier submit (its leading
        barrier orders it after them): those still counted in flight are waited for too."""
        self.wait()
        self.record()
        self._seq.eval()
        self.device.settle()
        return self

    def submit(self) -> "Sequence":
        """Submit without waiting: the host goes on (building the next part of a graph) while the device runs it.
        Until it is waited for (:meth:`wait`, or any later :meth:`replay`, which waits for every earlier submit) the
        device holds it, so its buffers live on; results are read only after a wait."""
        self.wait()  # a sequence runs once at a time
        self.record()
        self._seq.eval_async()
        self.device._in_flight.append(self)
        return self

    def wait(self) -> "Sequence":
        """Wait for this sequence's last :meth:`submit` (nothing when none is in flight)."""
        if self.in_flight:
            self._seq.eval_await()
            self.device._in_flight[:] = [s for s in self.device._in_flight if s is not self]
        return self

    @property
    def in_flight(self) -> bool:
        return any(s is self for s in self.device._in_flight)  # by identity: sequences compare as dataclasses

    def timings(self) -> list[tuple[str, float]]:
        """(label, seconds) per recorded operation of the last replay (needs timestamps=True)."""
        if not self.timestamps:
            raise RuntimeError("create the sequence with timestamps=True")
        ticks = np.asarray(self._seq.get_timestamps(), dtype=np.float64)
        period_s = self.device.limits["timestamp_period_ps"] * 1e-12
        return [(label, float(t) * period_s) for label, t in zip(self._labels, np.diff(ticks))]
