"""vkformers-moe's MiniMax-M3 (vkformers_moe/minimax_m3.py): the block-sparse selection matters on the fixture, and
the config readings transformers does (legacy names, refusals). Parity with transformers runs on the fixture
(test_decoder_parity, test_adamw_parity, test_generation)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vkformers_moe")

from vkformers.models.decoder import UnsupportedConfigError  # noqa: E402

FOLDER = Path(__file__).parent / "fixtures" / "minimax_m3_vl_text"
SMALL = dict(model_type="minimax_m3_vl_text", vocab_size=16, hidden_size=8, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=4, intermediate_size=4, num_local_experts=4,
             num_experts_per_tok=2, index_n_heads=2, index_head_dim=4, index_block_size=2)


def test_block_selection_drops_keys_and_changes_the_logits(monkeypatch):
    """The fixture's sparse layer keeps 3 blocks of 2 keys per query, so its 8-token rows lose keys; with the
    selection off (index_topk_blocks 100) the logits are no longer transformers'."""
    import vkformers_moe.minimax_m3 as m3
    from vkformers.models.loading import AutoModelForCausalLM
    from vkformers.models.safetensors_io import read_safetensors
    ref = {k: e.as_float() for k, e in read_safetensors(FOLDER / "reference.safetensors").items()}
    ids, mask = ref["input_ids"].astype(np.int64), ref["attention_mask"].astype(np.int64)
    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype="float32", requires_grad=False)
    kept = []
    select = m3.MinimaxM3Layer._select
    monkeypatch.setattr(m3.MinimaxM3Layer, "_select", lambda self, h, ctx: kept.append(select(self, h, ctx)) or
                        kept[-1])
    on = model(ids, attention_mask=mask).logits.numpy()
    (chosen, queries, keys), = kept  # one sparse layer
    causal = np.arange(keys)[None, :] <= queries[:, None]
    assert (causal & ~chosen.numpy().astype(bool)).any()  # earlier keys hidden from some query heads
    for layer in model.layers:
        layer.options = replace(layer.options, topk_blocks=100)
    off = model(ids, attention_mask=mask).logits.numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(on[real], ref["logits"][real], atol=1e-4)
    assert np.abs(off - ref["logits"])[real].max() > 0.1


def test_released_config_names_are_read():
    """sparse_attention_config / moe_layer_freq, as transformers' config class reads the released config.json."""
    from vkformers_moe.variants import decoder_spec
    config = {k: v for k, v in SMALL.items() if not k.startswith("index_")}
    spec = decoder_spec(dict(config, moe_layer_freq=[0, 1], sparse_attention_config=dict(
        sparse_attention_freq=[1, 0], sparse_num_index_heads=2, sparse_index_dim=4, sparse_block_size=2,
        sparse_topk_blocks=3, sparse_local_block=2)), "minimax_m3_vl_text")
    assert spec.make_layer.sparse == (True, False) and spec.moe.layers == (False, True)
    assert (spec.make_layer.index_heads, spec.make_layer.index_dim, spec.make_layer.block,
            spec.make_layer.topk_blocks, spec.make_layer.local_blocks) == (2, 4, 2, 3, 2)
    assert spec.norms.unit_offset and spec.moe.shared_swiglu_clip


def test_unsupported_indexer_options_are_refused():
    from vkformers_moe.variants import decoder_spec
    sparse = dict(SMALL, layer_types=["minimax_m3_sparse", "full_attention"])
    with pytest.raises(UnsupportedConfigError, match="index_head_dim"):  # narrower than the rotary table
        decoder_spec(dict(sparse, index_head_dim=2), "minimax_m3_vl_text")
    with pytest.raises(UnsupportedConfigError, match="index_n_heads"):
        decoder_spec(dict(sparse, index_n_heads=3), "minimax_m3_vl_text")
    with pytest.raises(UnsupportedConfigError, match="index_local_blocks"):
        decoder_spec(dict(sparse, index_local_blocks=4, index_topk_blocks=2), "minimax_m3_vl_text")
    decoder_spec(dict(SMALL, index_head_dim=2), "minimax_m3_vl_text")  # no sparse layer: no indexer to refuse



def test_the_multimodal_wrapper_config_builds_its_text_model():
    """minimax_m3_vl (text_config, weights under model.language_model.*): core's loading unwraps it."""
    from vkformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(dict(model_type="minimax_m3_vl", text_config=SMALL))
    assert model.config is SMALL or model.config == SMALL
