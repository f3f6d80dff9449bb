"""Doge, Kimi Linear, Gemma 3n and Gemma 4 beyond their parity fixtures (tests/test_decoder_parity.py and the others
on tests/fixtures/doge, kimi_linear, gemma3n_text, gemma4_text): gradient checkpointing, the config options they
refuse by name, and Gemma 4's saved buffers and continuous batching."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpoint_checks import assert_checkpointing_keeps_gradients
from test_serve_recurrent import serve_staggered

from vkformers.engine import lazy
from vkformers.models.decoder import UnsupportedConfigError
from vkformers.models.loading import AutoModelForCausalLM, load_config

pytest.importorskip("vkformers_moe")

from vkformers_llama.variants import doge, gemma3n_text  # noqa: E402
from vkformers_moe.variants import gemma4_text, gemma4_unified_text, kimi_linear  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
# Gemma 3n's and Gemma 4's layers read the per-layer inputs and the shared keys and values inside checkpointed layers: their
# gradients sum the same terms in another order, equal to float32 rounding
REORDERED = {"gemma3n_text", "gemma4_text"}


@pytest.mark.parametrize("name", ["doge", "kimi_linear", "gemma3n_text", "gemma4_text"])
def test_gradient_checkpointing_gives_the_same_gradients(name):
    ids = np.random.default_rng(1).integers(3, 48, (2, 10)).astype(np.int32)
    reordered = (lambda param: (1e-5, 1e-6)) if name in REORDERED else None
    assert_checkpointing_keeps_gradients(lambda: AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32"),
                                         ids, reordered)


@pytest.mark.parametrize("variant, name, change", [
    (doge, "doge", dict(sliding_window=4)),
    (doge, "doge", dict(keep_window_size=64)),
    (doge, "doge", dict(output_router_logits=True)),
    (doge, "doge", dict(num_experts_per_tok=17)),
    (kimi_linear, "kimi_linear", dict(num_key_value_heads=1)),
    (gemma3n_text, "gemma3n_text", dict(num_kv_shared_layers=2)),
    (gemma3n_text, "gemma3n_text", dict(activation_sparsity_pattern=[0.5])),
    (gemma4_text, "gemma4_text", dict(use_bidirectional_attention="all")),
    (gemma4_text, "gemma4_text", dict(per_layer_config={"1": {"sliding_window": 2}})),
    (gemma4_text, "gemma4_text", dict(per_layer_config={"1": {"num_key_value_heads": 3}})),
    (gemma4_text, "gemma4_text", dict(num_kv_shared_layers=2)),
    (gemma4_unified_text, "gemma4_unified_text", dict(enable_moe_block=True)),
    (gemma4_unified_text, "gemma4_unified_text", dict(use_bidirectional_attention="all")),
])
def test_unsupported_options_are_refused_by_name(variant, name, change):
    config = dict(load_config(FIXTURES / name), **change)
    with pytest.raises(UnsupportedConfigError):
        variant(config)


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4_unified_text"])
def test_gemma4_saves_its_layer_scalars(name, tmp_path):
    """layer_scalar is a checkpoint buffer, not a parameter: save_pretrained writes it back, so a reload (ours or
    transformers') computes the same logits."""
    ids = np.random.default_rng(2).integers(3, 48, (1, 6)).astype(np.int32)
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32")
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    original = load_file(str(FIXTURES / name / "model.safetensors"))
    assert set(saved) == set(original)
    for i in range(3):
        np.testing.assert_array_equal(saved[f"model.layers.{i}.layer_scalar"], original[f"model.layers.{i}.layer_scalar"])
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32")
    np.testing.assert_array_equal(again(ids).logits.numpy(), model(ids).logits.numpy())


@pytest.mark.parametrize("kv_blocks", [None, 64])
def test_gemma4_serves_staggered_requests_as_generate_alone(kv_blocks):
    """Continuous batching of Gemma 4 (rows placed into a running batch, per-layer head sizes padded into one cache,
    the sharing layers reading their source's slot) gives each request the tokens generate gives it alone."""
    serve_staggered("gemma4_text", kv_blocks)



@pytest.mark.parametrize("name", ["gemma3n_text", "gemma4_text"])
def test_a_replayed_step_looks_up_the_per_layer_inputs_of_its_own_ids(name):
    """The per-layer embeddings read ids derived from the token ids on the device: a step replayed after two steps
    on one batch (lazy.StepCapture, as the trainer replays) computes the next batch's loss."""
    rng = np.random.default_rng(3)
    first, second = (rng.integers(3, 48, (2, 8)).astype(np.int32) for _ in range(2))
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype="float32", requires_grad=False)
    step = lazy.StepCapture()
    losses = [step.run(lambda: [model(ids, labels=ids).loss], {"ids": ids})[0] for ids in (first, first, second)]
    assert step.ready
    np.testing.assert_allclose(losses[2], model(second, labels=second).loss.numpy(), rtol=1e-6)

