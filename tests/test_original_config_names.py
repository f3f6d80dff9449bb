"""Architectures whose original releases spell config options otherwise than transformers saves them (its
attribute_map and config conversions): each variant reads the original spelling to the model of the saved one."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vkformers.engine.rope_scaling import rope_parameters
from vkformers_llama.variants import VARIANTS as DENSE
from vkformers_moe.variants import VARIANTS as SPARSE

FIXTURES = Path(__file__).parent / "fixtures"


def saved_config(name: str, **changes) -> dict:
    return {**json.loads((FIXTURES / name / "config.json").read_text()), **changes}


def as_original(config: dict, names: dict) -> dict:
    """``config`` with the options in ``names`` (original spelling -> saved spelling) under their original names."""
    out = dict(config)
    for original, saved in names.items():
        out[original] = out.pop(saved)
    return out


def rope_tables(spec, config):
    return [rope_parameters(c, 32, layer_type=t)[0] for c, t in spec.positions.rope_configs or [(config, None)]]


def assert_same_model(variant, saved: dict, original: dict):
    a, b = variant(saved), variant(original)
    assert a.amend("positions", rope_configs=()) == b.amend("positions", rope_configs=())
    for x, y in zip(rope_tables(a, saved), rope_tables(b, original), strict=True):
        np.testing.assert_array_equal(x, y)
    return b


# non-default values, so that a spelling the variant ignored would show
CASES = {
    "exaone": (DENSE, dict(rms_norm_eps=1e-3, hidden_act="gelu"),
               dict(num_layers="num_hidden_layers", layer_norm_epsilon="rms_norm_eps",
                    activation_function="hidden_act")),
    "internlm3": (DENSE, {}, dict(qkv_bias="attention_bias", bias="mlp_bias")),
    "sarvam_moe": (SPARSE, {}, dict(num_experts="n_routed_experts", num_shared_experts="n_shared_experts",
                                    use_qkv_bias="attention_bias")),
    "sarvam_mla": (SPARSE, {}, dict(num_experts="n_routed_experts", num_shared_experts="n_shared_experts")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_original_spellings_build_the_saved_configs_model(name):
    variants, changes, names = CASES[name]
    saved = saved_config(name, **changes)
    spec = assert_same_model(variants[name], saved, as_original(saved, names))
    if name == "exaone":
        assert (spec.num_layers, spec.norms.eps, spec.hidden_act) == (1, 1e-3, "gelu")
    if name == "internlm3":
        assert spec.attention.q_bias and spec.attention.o_bias and spec.mlp.bias
    if name.startswith("sarvam"):
        assert (spec.moe.num_experts, spec.moe.shared_size) == (4, 8)
    if name == "sarvam_moe":
        assert spec.attention.q_bias


def test_exaone_rotates_with_theta_5e5_when_its_config_names_none():
    saved = saved_config("exaone", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    original = {k: v for k, v in saved.items() if k != "rope_parameters"}
    assert_same_model(DENSE["exaone"], saved, original)


def test_sarvam_mla_reads_deepseek_yarn_as_yarn():
    yarn = dict(factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                mscale_all_dim=1.0)
    saved = saved_config("sarvam_mla", rope_parameters=dict(yarn, rope_type="yarn", rope_theta=10000.0))
    original = {k: v for k, v in saved.items() if k != "rope_parameters"}
    original["rope_scaling"] = dict(yarn, type="deepseek_yarn", rope_theta=10000.0)
    spec = assert_same_model(SPARSE["sarvam_mla"], saved, original)
    assert spec.attention.scales[0] > spec.head_dim ** -0.5  # YaRN's mscale reached the softmax scale
