"""Reading PyTorch checkpoints (``pytorch_model.bin``, ``*.pt``, ``*.pth``) without torch and without running them.

``torch.save`` (torch >= 1.6) writes a zip: ``<archive>/data.pkl`` pickles the state dict, each tensor as a call of
``torch._utils._rebuild_tensor_v2`` on a storage named by key (a persistent id), and ``<archive>/data/<key>`` holds
each storage's bytes, uncompressed. As torch's ``weights_only`` loader does, the unpickler here resolves only the
few globals a state dict names (an OrderedDict, the tensor and parameter rebuilders, the storage classes, the
float8 dtypes) to functions of this module; any other global is refused before anything is called, so nothing
a file names is ever imported or run. Each tensor is a strided numpy view of the memory-mapped storage, read (and
copied contiguous) only when it is uploaded: the same entries ``read_safetensors`` gives, so loading downstream is
unchanged. Tensors saved as views of one storage (tied weights, slices, transposes) each read their own values.
"""
from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from vkformers.models.module import CheckpointError
from vkformers.models.safetensors_io import NUMPY_OF, TensorEntry, read_safetensors

# torch's typed storage classes -> the safetensors dtype code of their elements
STORAGE_CODES = {"FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
                 "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
                 "ByteStorage": "U8", "BoolStorage": "BOOL"}
V3_DTYPE_CODES = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}  # saved on untyped storage with a dtype
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")  # torch.save'd files, as checkpoints and PEFT name them
CONVERT = "re-save it with torch >= 1.6 (torch.save) or convert it to safetensors"


class PickledTensor(TensorEntry):
    """A tensor of a PyTorch checkpoint: a strided view of its storage, copied contiguous when read."""

    def as_float(self) -> np.ndarray:
        return _contiguous(super().as_float())

    def as_bfloat16(self) -> np.ndarray:
        return _contiguous(super().as_bfloat16())


def _contiguous(array: np.ndarray) -> np.ndarray:
    return array if array.flags.c_contiguous else array.copy()  # np.ascontiguousarray makes a scalar 1-D


class _StorageType:
    """A storage class named by data.pkl: ``code`` its elements' dtype, None for untyped (bytes) storage."""

    def __init__(self, code: str | None):
        self.code = code


class _DType:
    def __init__(self, code: str):
        self.code = code


class _Storage:
    """One storage's bytes (memory-mapped) and its elements' dtype code (None: untyped)."""

    def __init__(self, data: np.ndarray, code: str | None):
        self.data, self.code = data, code


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storage_bytes):
        super().__init__(file)
        self.storage_bytes, self.storages = storage_bytes, {}

    def find_class(self, module: str, name: str):
        qualified = f"{module}.{name}"
        if qualified == "collections.OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name in REBUILDERS:
            return REBUILDERS[name]
        if module == "torch" and name in STORAGE_CODES:
            return _StorageType(STORAGE_CODES[name])
        if qualified == "torch.storage.UntypedStorage":
            return _StorageType(None)
        if module == "torch" and name in V3_DTYPE_CODES:
            return _DType(V3_DTYPE_CODES[name])
        raise CheckpointError(f"the file holds objects other than tensors (it names {qualified}); vkformers "
                              "rebuilds only tensors and ran nothing. Convert it to safetensors")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[4], int)):
            raise CheckpointError(f"data.pkl names a storage as {pid!r}, not as torch.save does")
        _, storage_type, key, _location, numel = pid
        if key not in self.storages:
            data = self.storage_bytes(str(key))
            nbytes = numel * (1 if storage_type.code is None else np.dtype(NUMPY_OF[storage_type.code]).itemsize)
            if not 0 <= nbytes <= data.size:
                raise CheckpointError(f"storage {key} is shorter than its {numel} elements (truncated or corrupt)")
            self.storages[key] = _Storage(data[:nbytes], storage_type.code)
        return self.storages[key]


def _tensor(storage, offset, size, stride, code) -> PickledTensor:
    """The tensor torch rebuilds as ``storage[offset:]`` seen through ``size`` and ``stride`` (in elements)."""
    if not isinstance(storage, _Storage) or code is None:
        raise CheckpointError("a tensor of the checkpoint is not rebuilt from a storage as torch.save writes it")
    size, stride = tuple(size), tuple(stride)
    if not (isinstance(offset, int) and offset >= 0 and len(size) == len(stride)
            and all(isinstance(n, int) and n >= 0 for n in size + stride)):
        raise CheckpointError(f"a tensor of the checkpoint has a bad layout (offset {offset}, size {list(size)}, "
                              f"stride {list(stride)})")
    dtype = np.dtype(NUMPY_OF[code])
    flat = storage.data[:storage.data.size - storage.data.size % dtype.itemsize].view(dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
    if last >= flat.size:  # as_strided checks nothing: a view past the storage would read other memory
        raise CheckpointError(f"a tensor of size {list(size)} at offset {offset} reaches past its storage of "
                              f"{flat.size} elements (truncated or corrupt)")
    array = np.lib.stride_tricks.as_strided(flat[offset:], size, [s * dtype.itemsize for s in stride],
                                            writeable=False)
    return PickledTensor(array, code)


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    return _tensor(storage, offset, size, stride, getattr(storage, "code", None))


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    """torch's rebuilder for dtypes without a typed storage class (float8): untyped bytes and a dtype."""
    if not isinstance(dtype, _DType):
        raise CheckpointError("a tensor of the checkpoint names no dtype vkformers reads")
    return _tensor(storage, offset, size, stride, dtype.code)


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    return data


REBUILDERS = {"_rebuild_tensor_v2": _rebuild_tensor_v2, "_rebuild_tensor_v3": _rebuild_tensor_v3,
              "_rebuild_parameter": _rebuild_parameter, "_rebuild_parameter_with_state": _rebuild_parameter}


def read_torch_checkpoint(path) -> dict[str, PickledTensor]:
    """Every tensor of a ``torch.save``'d state dict (name -> tensor), memory-mapped: nothing is read yet."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a zip checkpoint of torch >= 1.6 (the legacy torch.save format or "
                              f"another file); {CONVERT}")
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in members if name.endswith("data.pkl") and name.count("/") == 1]
        if any(name.endswith("/constants.pkl") or "/code/" in name for name in members):
            raise CheckpointError(f"{path}: a TorchScript archive, not a state dict; save the model's "
                                  f"state_dict() with torch.save or convert it to safetensors")
        if len(pickles) != 1:
            raise CheckpointError(f"{path}: a zip without one <archive>/data.pkl: not a torch.save checkpoint; "
                                  f"{CONVERT}")
        prefix = pickles[0][:-len("data.pkl")]
        if prefix + "byteorder" in members and archive.read(prefix + "byteorder") != b"little":
            raise CheckpointError(f"{path}: saved on a big-endian machine; convert it to safetensors there")
        pickled = archive.read(pickles[0])
    mapped = np.memmap(path, dtype=np.uint8, mode="r")

    def storage_bytes(key: str) -> np.ndarray:
        info = members.get(f"{prefix}data/{key}")
        if info is None:
            raise CheckpointError(f"storage {key} is missing from the archive (truncated or corrupt)")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"storage {key} is compressed; torch.save never compresses: {CONVERT}")
        header = bytes(mapped[info.header_offset:info.header_offset + 30])
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise CheckpointError(f"corrupt zip entry for storage {key}")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        start = info.header_offset + 30 + name_length + extra_length
        if start + info.file_size > mapped.size:
            raise CheckpointError(f"storage {key} runs past the end of the file (truncated or corrupt)")
        return mapped[start:start + info.file_size]

    try:
        state = _Unpickler(io.BytesIO(pickled), storage_bytes).load()
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except Exception as exc:  # a malformed pickle raises anything from struct.error to IndexError
        raise CheckpointError(f"{path}: corrupt data.pkl ({type(exc).__name__}: {exc}); {CONVERT}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, PickledTensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path}: not a state dict (a dict of name -> tensor); save model.state_dict() "
                              "or convert it to safetensors")
    return dict(state)


def read_weight_file(file) -> dict[str, TensorEntry]:
    """One weight file's tensors (name -> entry), memory-mapped: a ``torch.save``'d state dict by its suffix
    (``.bin``, ``.pt``, ``.pth``), else safetensors."""
    return read_torch_checkpoint(file) if Path(file).suffix in PICKLE_SUFFIXES else read_safetensors(file)
