"""vkformers.engine.rope_scaling against transformers' own numbers (tests/data/rope_reference.json,
written by tools/make_rope_reference.py), so this test needs neither transformers nor torch."""
import json
from pathlib import Path

import numpy as np
import pytest

from vkformers.engine.rope_scaling import rope_parameters, rotary_dim

REFERENCE = json.loads((Path(__file__).parent / "data" / "rope_reference.json").read_text())
CASES = {case["name"]: case for case in REFERENCE["cases"]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers(name):
    case = CASES[name]
    inv_freq, scaling = rope_parameters(case["config"], case["seq_len"])
    expected = np.asarray(case["inv_freq"], dtype=np.float64)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == expected.shape
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-6, atol=0)
    assert scaling == pytest.approx(case["attention_scaling"], rel=1e-6)
    assert rotary_dim(case["config"]) == 2 * len(expected)


def test_every_scaling_type_is_covered():
    types = set()
    for case in REFERENCE["cases"]:
        scaling = case["config"].get("rope_parameters") or case["config"].get("rope_scaling") or {}
        types.add(scaling.get("rope_type", scaling.get("type", "default")))
    assert types >= {"default", "linear", "dynamic", "llama3", "yarn", "longrope"}


def test_dynamic_and_longrope_depend_on_seq_len():
    dynamic = CASES["dynamic_long"]["config"]
    assert np.array_equal(rope_parameters(dynamic, None)[0], rope_parameters(dynamic, 4096)[0])
    assert not np.array_equal(rope_parameters(dynamic, 4096)[0], rope_parameters(dynamic, 4097)[0])
    longrope = CASES["longrope_long"]["config"]
    assert not np.array_equal(rope_parameters(longrope, 4096)[0], rope_parameters(longrope, 4097)[0])


def test_clear_errors():
    with pytest.raises(ValueError, match="not supported"):
        rope_parameters({"hidden_size": 64, "num_attention_heads": 2, "rope_scaling": {"type": "nope"}})
    nested = {"hidden_size": 64, "num_attention_heads": 2, "max_position_embeddings": 64,
              "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="layer_type"):
        rope_parameters(nested)
    full, _ = rope_parameters(nested, layer_type="full_attention")
    sliding, _ = rope_parameters(nested, layer_type="sliding_attention")
    assert full[1] < sliding[1]
