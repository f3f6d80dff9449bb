"""What a kernel needs from the device: every capability a shipped kernel declares maps to a feature the runtime
checks (or is one every device has), a kernel or dtype the device cannot run is refused with DeviceFeatureError
before anything reaches the driver, and each dtype's model trains and generates on a device with only that dtype's
16-bit features (DTYPE_FEATURES is enough)."""
import struct

import numpy as np
import pytest

from vkformers.engine import lazy
from vkformers.errors import DeviceFeatureError
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.runtime import kernels as kernel_files
from vkformers.runtime.spirv import reflect
from vkformers.runtime.vulkan import CAPABILITY_FEATURES, DTYPE_FEATURES, UNCHECKED_CAPABILITIES, Kernel

# every 16-bit feature: a device with only float32 lacks all of them
SIXTEEN_BIT = ("shaderFloat16", "shaderInt16", "storageBuffer16BitAccess", "uniformAndStorageBuffer16BitAccess",
               "storagePushConstant16", "shaderBFloat16Type", "shaderBFloat16DotProduct",
               "shaderBFloat16CooperativeMatrix")
TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-5,
            tie_word_embeddings=False)


def shipped_kernels() -> list:
    """The compiled kernels of core and of every installed plugin."""
    return sorted(p for d in kernel_files.kernel_dirs() for p in d.spirv.rglob("*.spv"))


def test_every_capability_of_a_shipped_kernel_is_checked_or_universal():
    files = shipped_kernels()
    assert len(files) > 100
    unknown = {}
    for path in files:
        for capability in reflect(path.read_bytes()).capabilities:
            if capability not in CAPABILITY_FEATURES and capability not in UNCHECKED_CAPABILITIES:
                unknown.setdefault(capability, path.name)
    assert not unknown, f"capabilities with no feature in CAPABILITY_FEATURES (capability: a kernel): {unknown}"


def test_reflection_reads_the_declared_capabilities():
    """A bfloat16 kernel declares 16-bit integers and 16-bit buffers; its float32 variant neither."""
    bf16 = reflect(kernel_files.find_spirv("rope", "bf16").read_bytes()).capabilities
    f32 = reflect(kernel_files.find_spirv("rope", "f32").read_bytes()).capabilities
    assert 22 in bf16 and 4433 in bf16  # Int16, StorageBuffer16BitAccess
    assert 1 in f32 and not {22, 4433, 9} & set(f32)


@pytest.fixture
def device_lacking(device, monkeypatch):
    """Make the device report ``features`` as missing, with its kernel table empty so that every kernel is looked
    up (and checked) again; both restored afterwards."""
    def lacking(*features):
        monkeypatch.setattr(device, "features", {**device.features, **{f: False for f in features}})
        monkeypatch.setattr(device, "_kernels", {})
        return device
    return lacking


def test_a_kernel_needing_a_missing_feature_is_refused(device_lacking):
    device = device_lacking("shaderInt16")
    with pytest.raises(DeviceFeatureError, match=r"lacks 16-bit integers \(shaderInt16\), which kernel rope.bf16 "
                                                 r"needs: load the model in float32"):
        device.kernel("rope", "bf16")
    assert device.kernel("rope", "f32").interface.capabilities  # what the device has still loads
    assert ("rope", "bf16") not in device._kernels


def test_a_third_party_kernel_with_an_unknown_capability_is_not_refused(device):
    """Capabilities outside the table (a plugin's own kernels) are the driver's to judge: no false refusal."""
    code = bytearray(kernel_files.find_spirv("rope", "f32").read_bytes())
    words = list(struct.unpack(f"<{len(code) // 4}I", code))
    i = 5
    while words[i] & 0xFFFF != 17:  # the first OpCapability (Shader): say it is one the table does not know
        i += words[i] >> 16
    words[i + 1] = 999_999
    kernel = Kernel("rope", "f32", kernel_files.find_spirv("rope", "f32"))
    kernel.__dict__["code"] = struct.pack(f"<{len(words)}I", *words)
    device.check_capabilities(kernel)


@pytest.mark.parametrize("dtype,missing,others", [("bfloat16", "shaderInt16", "float32 or float16"),
                                                  ("float16", "shaderFloat16", "float32 or bfloat16")])
def test_loading_a_model_in_a_dtype_the_device_lacks_is_refused(device_lacking, dtype, missing, others):
    device_lacking(missing)
    model = AutoModelForCausalLM.from_config(TINY)
    weights = {n: np.zeros(s.shape, np.float32) for n, s in model.named_slots() if s.tied_to is None}
    with pytest.raises(DeviceFeatureError, match=rf"cannot compute in {dtype}: it lacks {missing}; load the model "
                                                 rf"in {others}"):
        model.load_state_dict(weights, dtype=dtype)
    assert all(s.tensor is None for _, s in model.named_slots())  # refused before any upload


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_each_dtype_runs_with_only_its_own_features(device_lacking, dtype):
    """A training step (forward, loss, backward) and greedy generation, every kernel checked against a device
    that has DTYPE_FEATURES[dtype] and no other 16-bit feature."""
    device_lacking(*(f for f in SIXTEEN_BIT if f not in DTYPE_FEATURES[dtype]))
    model = AutoModelForCausalLM.from_config(TINY)
    rng = np.random.default_rng(0)
    weights = {n: (np.ones(s.shape, np.float32) if n.endswith("norm.weight")
                   else rng.standard_normal(s.shape).astype(np.float32) * 0.1)
               for n, s in model.named_slots() if s.tied_to is None}
    model.load_state_dict(weights, dtype=dtype)
    ids = rng.integers(0, TINY["vocab_size"], (2, 8)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    with lazy.deferred_backward():
        out = model(ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    grads = [p.grad.numpy() for _, p in model.named_parameters() if p.grad is not None]
    assert np.isfinite(out.loss.item()) and len(grads) == len(weights)
    assert all(np.isfinite(g).all() for g in grads) and any(np.abs(g).max() > 0 for g in grads)
    tokens = model.eval().generate(ids, attention_mask=mask, max_new_tokens=4)
    assert tokens.shape == (2, 12)
