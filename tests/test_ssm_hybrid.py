"""vkformers-ssm's hybrids (Mamba mixers on the decoder kit) beyond the parity fixtures: gradient checkpointing,
a second generate from fresh states, the 16-bit path, and the config options they refuse by name. Their parity
with transformers is tests/test_decoder_parity.py, test_generation.py, test_adamw_parity.py and
test_padded_parity.py on tests/fixtures/bamba, falcon_h1, nemotron_h, jamba, granitemoehybrid, lfm2, lfm2_moe, lfm3, zamba, zamba2 and
recurrent_gemma."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from checkpoint_checks import assert_checkpointing_keeps_gradients

from vkformers.models.loading import AutoModelForCausalLM, load_config
from vkformers.models.safetensors_io import read_safetensors
from vkformers.training.trainer import init_weights
from vkformers_ssm.variants import (UnsupportedConfigError, bamba, falcon_h1, granitemoehybrid, nemotron_h,
                                   recurrent_gemma, zamba, zamba2)

FIXTURES = Path(__file__).parent / "fixtures"
HYBRIDS = ["bamba", "falcon_h1", "nemotron_h", "jamba", "granitemoehybrid", "lfm2", "lfm2_moe", "lfm3", "zamba", "zamba2",
           "recurrent_gemma", "rwkv", "xlstm", "minimax"]


# The shared blocks of Zamba and Zamba2 read the token embeddings inside checkpointed layers: the embedding's gradient sums the
# same terms in another order under checkpointing, equal to float32 rounding, not bit for bit
REORDERED_SUMS = {"zamba": {"model.embed_tokens.weight"}, "zamba2": {"model.embed_tokens.weight"}}


def _config(name: str) -> dict:
    return load_config(FIXTURES / name)


@pytest.mark.parametrize("name", HYBRIDS)
def test_gradient_checkpointing_gives_the_same_gradients(name):
    ids = np.random.default_rng(1).integers(3, 48, (2, 10)).astype(np.int32)
    reordered = REORDERED_SUMS.get(name, ())
    assert_checkpointing_keeps_gradients(lambda: AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32"), ids,
                                         lambda param: (1e-5, 1e-7) if param in reordered else None)


@pytest.mark.parametrize("name", ["falcon_h1", "jamba", "lfm2", "lfm3", "zamba", "zamba2", "recurrent_gemma", "rwkv", "xlstm",
                                  "minimax"])
def test_a_second_generate_starts_from_fresh_states(name):
    """The mixers' states live on the KV cache and restart at its position 0: two calls give transformers' tokens."""
    reference = read_safetensors(FIXTURES / name / "reference.safetensors")
    want = reference["greedy_tokens"].as_float().astype(np.int64)
    prompt = reference["input_ids"].as_float().astype(np.int32)[:1]
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")
    for _ in range(2):
        np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=want.shape[1] - prompt.shape[1],
                                                     eos_token_id=[]), want)  # eos off, as the reference


@pytest.mark.parametrize("name", ["bamba", "lfm2", "zamba", "zamba2", "recurrent_gemma", "rwkv", "xlstm", "minimax"])
def test_bfloat16_follows_float32(name):
    ids = np.random.default_rng(4).integers(3, 48, (2, 9)).astype(np.int32)
    full = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")(ids).logits.numpy()
    half = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="bfloat16")(ids).logits.float().numpy()
    assert np.abs(half - full).max() <= 0.05 * np.abs(full).max()
    assert (half.argmax(-1) == full.argmax(-1)).mean() >= 0.9


def test_refused_options_name_themselves():
    with pytest.raises(UnsupportedConfigError, match="time_step_limit"):
        bamba({**_config("bamba"), "time_step_limit": [0.0, 1.0]})
    with pytest.raises(UnsupportedConfigError, match="projectors_bias"):
        falcon_h1({**_config("falcon_h1"), "projectors_bias": True})
    with pytest.raises(UnsupportedConfigError, match="mixture-of-experts"):
        nemotron_h({**_config("nemotron_h"), "layers_block_type": ["linear_attention", "moe"]})
    with pytest.raises(UnsupportedConfigError, match="rope_parameters"):
        recurrent_gemma({**_config("recurrent_gemma"), "rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(UnsupportedConfigError, match="hidden_mamba_act"):
        zamba({**_config("zamba"), "hidden_mamba_act": "gelu"})
    with pytest.raises(UnsupportedConfigError, match="use_long_context"):
        zamba2({**_config("zamba2"), "use_long_context": True})
    with pytest.raises(UnsupportedConfigError, match="num_key_value_heads"):
        zamba2({**_config("zamba2"), "num_key_value_heads": 1})
    with pytest.raises(UnsupportedConfigError, match="num_local_experts"):
        granitemoehybrid({**_config("granitemoehybrid"), "num_local_experts": 0})


def test_nemotron_h_reads_the_legacy_pattern():
    config = {k: v for k, v in _config("nemotron_h").items() if k != "layers_block_type"}
    spec = nemotron_h({**config, "hybrid_override_pattern": "M*-"})
    assert spec.extra["block_types"] == ("mamba", "attention", "mlp")


def test_zamba2_blocks_alternate_and_keep_each_use_adapters():
    """num_mem_blocks 2 over four hybrid layers: layers 0 and 1 own the two blocks, 2 and 3 run them again (tied);
    each block's adapter lists hold the entries of its own uses (transformers' Zamba2 layout)."""
    config = {**_config("zamba2"), "num_hidden_layers": 4, "layers_block_type": ["hybrid"] * 4, "num_mem_blocks": 2}
    model = AutoModelForCausalLM.from_config(config)
    names = {name for name, _ in model.named_slots()}
    owned = {name for name, slot in model.named_slots() if slot.tied_to is None}
    block = "model.layers.{}.shared_transformer.self_attn.linear_q_adapter_list.{}.0.weight"
    assert {block.format(0, 0), block.format(0, 2), block.format(1, 1), block.format(1, 3)} <= owned
    assert block.format(0, 1) not in names and block.format(1, 2) not in names
    assert not any(".2.shared_transformer." in n or ".3.shared_transformer." in n for n in owned)
    init_weights(model, std=0.2)
    slots = dict(model.named_slots())
    assert slots[block.format(2, 2)].tensor is slots[block.format(0, 2)].tensor  # tied to layer 0's
    assert slots[block.format(3, 3)].tensor is slots[block.format(1, 3)].tensor
    ids = np.random.default_rng(2).integers(3, 48, (1, 6)).astype(np.int32)
    assert np.isfinite(model(ids).logits.numpy()).all()


def test_zamba_mamba_layers_keep_transformers_names():
    """A Zamba layer without the shared block holds its norm and mixer directly under the layer (transformers'
    ZambaMambaDecoderLayer); the fixture's layers are all hybrid (transformers fails with a single one)."""
    config = {**_config("zamba"), "num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "hybrid"]}
    names = {name for name, _ in AutoModelForCausalLM.from_config(config).named_slots()}
    assert {"model.layers.0.input_layernorm.weight", "model.layers.0.mamba.x_proj_weight",
            "model.layers.0.mamba.in_proj.weight", "model.layers.1.mamba_decoder.mamba.D",
            "model.layers.1.shared_transf.self_attn.q_proj.weight", "model.layers.2.linear.weight"} <= names
    assert not any(n.startswith("model.layers.0.") and ("shared" in n or "mamba_decoder" in n) for n in names)
