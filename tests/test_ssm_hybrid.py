"""vkformers-ssm's hybrids (Mamba mixers on the decoder kit) beyond the parity fixtures: gradient checkpointing,
a second generate from fresh states, the 16-bit path, and the config options they refuse by name. Their parity
with transformers is tests/test_decoder_parity.py, test_generation.py, test_adamw_parity.py and
test_padded_parity.py on tests/fixtures/bamba, falcon_h1, nemotron_h, jamba, granitemoehybrid, lfm2, zamba and zamba2."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vkformers.models.loading import AutoModelForCausalLM, load_config
from vkformers.models.safetensors_io import read_safetensors
from vkformers_ssm.variants import UnsupportedConfigError, bamba, falcon_h1, granitemoehybrid, nemotron_h

FIXTURES = Path(__file__).parent / "fixtures"
HYBRIDS = ["bamba", "falcon_h1", "nemotron_h", "jamba", "granitemoehybrid", "lfm2", "zamba", "zamba2"]


# The shared blocks of Zamba and Zamba2 read the token embeddings inside checkpointed layers: the embedding's gradient sums the
# same terms in another order under checkpointing, equal to float32 rounding, not bit for bit
REORDERED_SUMS = {"zamba": {"model.embed_tokens.weight"}, "zamba2": {"model.embed_tokens.weight"}}


def _config(name: str) -> dict:
    return load_config(FIXTURES / name)


@pytest.mark.parametrize("name", HYBRIDS)
def test_gradient_checkpointing_gives_the_same_gradients(name):
    ids = np.random.default_rng(1).integers(3, 48, (2, 10)).astype(np.int32)
    grads = []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name_ in grads[0]:
        if name_ in REORDERED_SUMS.get(name, ()):
            np.testing.assert_allclose(grads[1][name_], grads[0][name_], rtol=1e-5, atol=1e-7, err_msg=name_)
        else:
            np.testing.assert_array_equal(grads[0][name_], grads[1][name_], err_msg=name_)


@pytest.mark.parametrize("name", ["falcon_h1", "jamba", "lfm2", "zamba", "zamba2"])
def test_a_second_generate_starts_from_fresh_states(name):
    """The mixers' states live on the KV cache and restart at its position 0: two calls give transformers' tokens."""
    reference = read_safetensors(FIXTURES / name / "reference.safetensors")
    want = reference["greedy_tokens"].as_float().astype(np.int64)
    prompt = reference["input_ids"].as_float().astype(np.int32)[:1]
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")
    for _ in range(2):
        np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=want.shape[1] - prompt.shape[1]), want)


def test_bfloat16_follows_float32():
    ids = np.random.default_rng(4).integers(3, 48, (2, 9)).astype(np.int32)
    full = AutoModelForCausalLM.from_pretrained(FIXTURES / "bamba", dtype="float32")(ids).logits.numpy()
    half = AutoModelForCausalLM.from_pretrained(FIXTURES / "bamba", dtype="bfloat16")(ids).logits.float().numpy()
    assert np.abs(half - full).max() <= 0.05 * np.abs(full).max()
    assert (half.argmax(-1) == full.argmax(-1)).mean() >= 0.9


def test_refused_options_name_themselves():
    with pytest.raises(UnsupportedConfigError, match="time_step_limit"):
        bamba({**_config("bamba"), "time_step_limit": [0.0, 1.0]})
    with pytest.raises(UnsupportedConfigError, match="projectors_bias"):
        falcon_h1({**_config("falcon_h1"), "projectors_bias": True})
    with pytest.raises(UnsupportedConfigError, match="mixture-of-experts"):
        nemotron_h({**_config("nemotron_h"), "layers_block_type": ["linear_attention", "moe"]})
    with pytest.raises(UnsupportedConfigError, match="num_local_experts"):
        granitemoehybrid({**_config("granitemoehybrid"), "num_local_experts": 0})


def test_nemotron_h_reads_the_legacy_pattern():
    config = {k: v for k, v in _config("nemotron_h").items() if k != "layers_block_type"}
    spec = nemotron_h({**config, "hybrid_override_pattern": "M*-"})
    assert spec.extra["block_types"] == ("mamba", "attention", "mlp")
