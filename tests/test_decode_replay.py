"""Which models' decode steps generate and a server replay (models/decode_capture.py), which generate builds in
Python every token, and which layers take the fused decode kernels.

A decode step replays when everything it reads besides the weights derives, on the device, from the inputs a
captured step rewrites (the token ids, the positions, the cache's bounds and mask). Gemma 3n's and Gemma 4's
per-layer ids and Llama 4-style query scaling (Ministral 3, Mistral 4) derive on the device, so their steps replay:
transformers' greedy tokens from the third forward on, a left-padded batch's tokens as the Python forward chooses
them, and a server's staggered requests as generate gives each alone. Every other architecture with a fixture
replays too, unless NOT_REPLAYED names it with why. Layers with output norms (Gemma 2 and 3, EXAONE 4), sinks
(gpt-oss) or a query scale (Ministral 3) run the fused decode kernels, with the composed layers' tokens."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_recurrent_generate import _load, assert_generate_replays
from test_serve_recurrent import serve_staggered

from vkformers.engine.ops import decode as fused_decode
from vkformers.models import generation
from vkformers.models.decoder.layer import DecoderLayer
from vkformers.models.loading import AutoModelForCausalLM

FIXTURES = Path(__file__).parent / "fixtures"
DERIVED_ON_DEVICE = ["gemma3n_text", "gemma4_text", "gemma4_unified_text", "ministral3", "mistral4_dense",
                     "mistral4_moe"]
# architectures whose decode step reads what only the Python forward computes each token
NOT_REPLAYED = {
    "axk2": "DeepSeek-V3.2's sparse attention: the key selection is read back and masked on the host",
    "cpmant": "each step's bias and mask are built on the host",
    "deepseek_v32": "DeepSeek-V3.2's sparse attention (axk2)",
    "deepseek_v4": "hash routing and the compressed entries read host token ids and positions",
    "diffllama": "its two attention calls read the cache's stored keys outside the captured decode attention",
    "doge": "its biases read every cached value, outside the captured decode attention",
    "dots3_note_text": "DeepSeek-V3.2's sparse attention (axk2)",
    "glm5_next_text": "the recurrent state and the indexer's pooled keys live on the cache object",
    "glm5_next_text-wide-v": "the recurrent state and the indexer's pooled keys live on the cache object",
    "glm_moe_dsa": "DeepSeek-V3.2's sparse attention (axk2)",
    "llama4_text": "the chunk mask and the temperature are built on the host from the position",
    "minimax_m3_vl_text": "its indexer keys grow on the cache object; the masks are built from the position",
    "qwen4_exp_text": "its per-layer embeddings hash each step's token ids on the host",
}


def left_padded_tokens(model, ids) -> np.ndarray:
    """10 greedy tokens of ``ids`` as a batch whose first row is left-padded by 3."""
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    return model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[])


@pytest.mark.parametrize("name", DERIVED_ON_DEVICE)
def test_generate_replays_the_decode_step(name, monkeypatch):
    model, ids, want = _load(name)
    assert_generate_replays(model, ids, want)
    replayed = left_padded_tokens(model, ids)
    monkeypatch.setattr(model, "capture_decode", False, raising=False)
    np.testing.assert_array_equal(left_padded_tokens(model, ids), replayed)


def test_every_other_decoder_replays_its_decode_step():
    """The decoder fixtures (those with greedy tokens) replay their decode steps, but for NOT_REPLAYED."""
    building = set()
    for folder in sorted(FIXTURES.iterdir()):
        if not (folder / "reference.safetensors").is_file() or not (folder / "config.json").is_file():
            continue
        config = json.loads((folder / "config.json").read_text())
        try:
            model = AutoModelForCausalLM.from_config(config)
        except Exception:  # noqa: BLE001  (an encoder, a seq2seq model: not a causal LM of this loader)
            continue
        if hasattr(model, "replays_decode") and not model.replays_decode():
            building.add(folder.name)
    assert building == set(NOT_REPLAYED)


def test_query_scaled_layers_take_the_fused_decode_kernels(tmp_path, monkeypatch):
    """Ministral 3's layers scale their rotated queries by position (here past every 4th position, so the scale moves
    while decoding) and still take the fused decode kernels: the same tokens as the composed layers."""
    folder = tmp_path / "ministral3"
    shutil.copytree(FIXTURES / "ministral3", folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["original_max_position_embeddings"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32", requires_grad=False)
    assert all(layer._fused_decode_plan() is not None for layer in model.layers)
    ids = np.random.default_rng(2).integers(3, int(config["vocab_size"]), (2, 6)).astype(np.int32)
    fused = model.generate(ids, max_new_tokens=12, eos_token_id=[])  # positions 6..17: the scale moves at 8, 12, 16
    monkeypatch.setattr(fused_decode, "enabled", False)
    model.forget_captures()
    np.testing.assert_array_equal(model.generate(ids, max_new_tokens=12, eos_token_id=[]), fused)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "exaone4", "gpt_oss"])
def test_post_normed_and_sink_layers_take_the_fused_decode_kernels(name, monkeypatch):
    """Gemma 2's and 3's layers normalize the attention's and the MLP's outputs before the residual (EXAONE 4's only
    those, no input norms), gpt-oss's weigh the attention by a sink logit per head: their decode steps still run the
    fused kernels (the output norms and additions after the fused products, the sinks on the decode attention's
    lse), with transformers' greedy tokens, and the same tokens as the composed layers from a left-padded batch."""
    model, ids, want = _load(name)
    fused, real = [], DecoderLayer._decode_fused
    monkeypatch.setattr(DecoderLayer, "_decode_fused",
                        lambda self, x, ctx: (lambda out: fused.append(out is not None) or out)(real(self, x, ctx)))
    prompt, new = ids[:1], want.shape[1] - ids.shape[1]
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=new, eos_token_id=[]), want)
    assert fused and all(fused)
    tokens = left_padded_tokens(model, ids)
    monkeypatch.setattr(fused_decode, "enabled", False)
    model.forget_captures()
    np.testing.assert_array_equal(left_padded_tokens(model, ids), tokens)


@pytest.mark.parametrize("kv_blocks", [None, 64])
@pytest.mark.parametrize("name", ["gemma3n_text", "ministral3", "gpt_oss", "exaone4"])
def test_a_server_replays_their_steps_with_generates_tokens(name, kv_blocks):
    """Staggered requests to a server (contiguous or paged caches) get the tokens generate gives each alone, the
    decode steps replayed (Gemma 3n's per-layer ids and Ministral 3's query scale from the device; gpt-oss's sinks
    and EXAONE 4's output norms in the fused kernels)."""
    scheduler = serve_staggered(name, kv_blocks)
    assert scheduler.metrics.replayed_steps > scheduler.metrics.steps // 2


@pytest.mark.parametrize("name", DERIVED_ON_DEVICE)
def test_prompts_padded_to_a_bucket_keep_transformers_tokens(name, monkeypatch):
    """A GPU pads prompts on the right to a multiple of PREFILL_BUCKET (forced here) where the padding changes no
    real token's logits, which replaying decode steps makes these models claim (prompt_padding_is_exact): their
    tokens stay transformers'."""
    monkeypatch.setattr(generation, "PREFILL_BUCKET", {"gpu": 32, "cpu": 32})
    model, ids, want = _load(name)
    assert model.prompt_padding_is_exact(ids.shape[1], 32)
    np.testing.assert_array_equal(model.generate(ids[:1], max_new_tokens=want.shape[1] - ids.shape[1],
                                                 eos_token_id=[]), want)
    assert set(model._held_prefill[1]) == {(32, True)}  # the prompt ran padded to 32 columns
