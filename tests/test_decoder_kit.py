"""The decoder kit's public interface (vkformers.models.decoder): a variant amends one sub-spec, the layer builds
only what the spec asks for, and a plugin's block fills the MLP slot of the layers it chooses."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vkformers.engine import lazy
from vkformers.engine.tensor import Tensor
from vkformers.models.decoder import DecoderForCausalLM, DecoderSpec
from vkformers.models.layers import Linear
from vkformers.models.module import Module
from vkformers.training.trainer import init_weights

SPEC = DecoderSpec(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                   intermediate_size=24, max_position_embeddings=64)
CONFIG = {"vocab_size": 32, "hidden_size": 16, "num_attention_heads": 2, "head_dim": 8, "rope_theta": 10000.0,
          "max_position_embeddings": 64}


class Doubled(Module):
    """A plugin's MLP block under its own name in the layer: 2 * proj(x)."""

    path = "ffn"

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = Linear(hidden, hidden, bias=False)

    def forward(self, h):
        return self.proj(h) * 2.0


class OddLayers:
    """Fills the MLP slot (MLPBlocks) of the odd layers; the even ones keep the dense MLP."""

    def block(self, spec: DecoderSpec, index: int):
        return Doubled(spec.hidden_size) if index % 2 else None


def model_of(spec: DecoderSpec) -> DecoderForCausalLM:
    class KitModel(DecoderForCausalLM):
        decoder_spec = staticmethod(lambda config, name: spec)

    model = KitModel(CONFIG, "kit")
    init_weights(model, seed=0)
    return model


def test_amend_changes_one_sub_spec_and_leaves_the_parent():
    spec = SPEC.amend("attention", windows=(4, 0), q_norm="q_norm", k_norm="k_norm")
    assert spec.attention.windows == (4, 0) and SPEC.attention.windows == () and SPEC.attention.q_norm is None
    assert spec.mlp is SPEC.mlp and spec.norms is SPEC.norms
    with pytest.raises(ValueError, match="DecoderSpec.mla is not set"):
        SPEC.amend("mla", norm_eps=1e-6)


def test_the_layer_builds_the_parameters_its_sub_specs_name():
    names = {name for name, _ in model_of(SPEC.amend("mlp", kind="plain", up_proj="fc1", down_proj="fc2"))
             .named_slots()}
    assert {"model.layers.0.mlp.fc1.weight", "model.layers.0.mlp.fc2.weight"} <= names
    assert not any("gate_proj" in name for name in names)
    fused = model_of(replace(SPEC, attention=replace(SPEC.attention, qkv_proj="qkv_proj")))
    assert {name for name, _ in fused.named_slots() if ".self_attn." in name and name.startswith("model.layers.0")} \
        == {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight"}


def test_a_block_in_the_mlp_slot_replaces_that_layers_dense_mlp():
    model = model_of(replace(SPEC, moe=OddLayers()))
    names = {name for name, _ in model.named_slots()}
    assert "model.layers.1.ffn.proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(name.startswith("model.layers.1.mlp.") for name in names)
    x = np.random.default_rng(1).standard_normal((1, 3, 16)).astype(np.float32)
    weight = dict(model.named_parameters())["model.layers.1.ffn.proj.weight"].numpy()
    np.testing.assert_allclose(model.layers[1].mlp(Tensor(x)).numpy(), 2.0 * x @ weight.T, rtol=1e-5, atol=1e-6)
    logits = model(np.array([[1, 2, 3, 4]], np.int32)).logits
    assert logits.shape == (1, 4, 32) and np.isfinite(logits.numpy()).all()


def test_blind_rows_get_the_mean_of_the_values_and_a_captured_step_derives_them_from_each_mask():
    """attention.blind_rows fills the query rows that see no key (left padding) and only those; a captured
    forward replays with another batch's padding as a built one computes it."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 32, size=(2, 6)).astype(np.int32) for _ in range(3)]
    masks = [np.array([[1] * 6, [0, 0, 1, 1, 1, 1]], np.int32), np.array([[1] * 6, [0, 0, 1, 1, 1, 1]], np.int32),
             np.array([[0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]], np.int32)]
    zero = model_of(SPEC.amend("attention", windows=(2, 0))).eval()
    model = model_of(SPEC.amend("attention", windows=(2, 0), blind_rows="all")).eval()
    plain = zero(ids[2], attention_mask=masks[2]).logits.numpy()
    filled = model(ids[2], attention_mask=masks[2]).logits.numpy()
    blind = np.cumsum(masks[2], axis=1) == 0
    np.testing.assert_array_equal(plain[~blind], filled[~blind])
    assert np.abs(plain[blind] - filled[blind]).min() > 0  # a mean of the values, not the kernel's zeros

    step, forwards, original = lazy.StepCapture(), [], model.forward
    model.forward = lambda *a, **k: forwards.append(1) or original(*a, **k)
    replayed = [step.run(lambda: [model(i, attention_mask=m).logits], {"ids": i, "mask": m})[0]
                for i, m in zip(ids, masks)]
    assert len(forwards) == 2  # the third batch replayed the plan
    np.testing.assert_allclose(replayed[2], filled, atol=1e-6)
