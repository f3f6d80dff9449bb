"""GGUF files of every mapped architecture: the tiny fixtures (tests/fixtures/<name>) written as llama.cpp's converter
would (tests/data/gguf/<case>.<type>.gguf, tools/make_gguf_fixtures.py), read through the plugins' GGUF tables.

- F32 file, ``dequantize=True``: the logits of the fixture's reference (transformers on the original checkpoint)
  within the decoder parity tolerance (1e-4 absolute, over the attended positions).
- The same file kept as is (``dequantize=False``; every tensor F32): the same logits.
- "Q8_0" file (matrices of whole Q8_0 rows quantized, the rest F16 or F32): every expanded weight within its
  block rounding of the F32 file's (1/100 of the tensor's largest magnitude: Q8_0's step is 1/127 of a block's),
  under the same HF names; kept packed, the logits of the same file expanded (``dequantize=True``) within 2e-3
  absolute (the packed product's float32 accumulation order against the expanded one).

qwen2's fixture uses a sliding window on its second layer, which a qwen2 GGUF cannot express (llama.cpp writes no
per-layer windows for it): its reference is the fixture checkpoint run by vkformers without the window.

tests/data/gguf/transformers_check.json records transformers' own GGUF loader on the same F32 files (its weights
against the fixture's, by HF name; its logits against the reference); where it reads the architecture its
weights are checked here to be the fixture's, an independent check of the name tables.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vkformers.errors import UnknownArchitectureError
from vkformers.models import gguf as vkgguf
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.models.safetensors_io import read_safetensors

gguf = pytest.importorskip("gguf", reason=vkgguf.INSTALL_HINT)

DATA = Path(__file__).parent / "data" / "gguf"
FIXTURES = Path(__file__).parent / "fixtures"
CASES = {"llama": ("llama", "llama"), "llama3_rope": ("llama_rope_llama3", "llama"), "mistral": ("mistral", "mistral"), "mixtral": ("mixtral", "mixtral"),
         "qwen2": ("qwen2", "qwen2"), "qwen3": ("qwen3", "qwen3"), "qwen2moe": ("qwen2_moe", "qwen2_moe"),
         "qwen3moe": ("qwen3_moe", "qwen3_moe"), "gemma": ("gemma", "gemma"), "gemma2": ("gemma2", "gemma2"),
         "gemma3": ("gemma3_text", "gemma3_text"), "phi3": ("phi3", "phi3"),
         "phi3_longrope": ("phi3_longrope", "phi3"),
         "starcoder2": ("starcoder2", "starcoder2"), "gpt2": ("gpt2", "gpt2"), "falcon": ("falcon", "falcon"),
         "falcon_new_arch": ("falcon_new_arch", "falcon"),
         "deepseek2": ("deepseek_v2_moe", "deepseek_v2")}  # case: (fixture, model_type the GGUF maps to)
LOGITS_ATOL = 1e-4
PACKED_ATOL = 2e-3
NOT_EXPRESSIBLE = {"qwen2": {"use_sliding_window": False, "sliding_window": None,
                               "layer_types": ["full_attention", "full_attention"]}}


def reference(case: str):
    folder = FIXTURES / CASES[case][0]
    ref = {k: e.as_float() for k, e in read_safetensors(folder / "reference.safetensors").items()}
    ids, mask = ref["input_ids"].astype(np.int32), ref["attention_mask"].astype(np.int32)
    if case in NOT_EXPRESSIBLE:
        config = {**json.loads((folder / "config.json").read_text()), **NOT_EXPRESSIBLE[case]}
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict({k: e.as_float() for k, e in read_safetensors(folder / "model.safetensors").items()},
                              requires_grad=False)
        return ids, mask, model.eval()(ids, attention_mask=mask).logits.numpy()
    return ids, mask, ref["logits"]


def logits(path: Path, ids, mask, *, dequantize: bool) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32", dequantize=dequantize, requires_grad=False)
    return model(ids, attention_mask=mask).logits.numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_f32_gguf_gives_the_reference_logits(case):
    ids, mask, want = reference(case)
    path = DATA / f"{case}.F32.gguf"
    config, _, _ = vkgguf.load_gguf(path, tokenizer=False)
    assert config["model_type"] == CASES[case][1]
    attended = mask.astype(bool)
    for dequantize in (True, False):
        got = logits(path, ids, mask, dequantize=dequantize)
        assert got.shape == want.shape
        error = np.abs(got - want)[attended].max()
        assert error <= LOGITS_ATOL, (case, dequantize, error)


@pytest.mark.parametrize("case", list(CASES))
def test_q8_0_gguf_kept_packed_matches_its_expansion(case):
    ids, mask, _ = reference(case)
    path = DATA / f"{case}.Q8_0.gguf"
    _, packed_arrays, _ = vkgguf.load_gguf(path, tokenizer=False, dequantize=False)
    assert any(isinstance(a, vkgguf.QuantizedArray) for a in packed_arrays.values())
    _, exact, _ = vkgguf.load_gguf(DATA / f"{case}.F32.gguf", tokenizer=False)
    _, expanded_arrays, _ = vkgguf.load_gguf(path, tokenizer=False)
    assert set(expanded_arrays) == set(exact) == set(packed_arrays)
    for name, weight in exact.items():
        assert expanded_arrays[name].shape == weight.shape, name
        assert np.abs(expanded_arrays[name] - weight).max() <= np.abs(weight).max() / 100, name
    attended = mask.astype(bool)
    expanded = logits(path, ids, mask, dequantize=True)
    packed = logits(path, ids, mask, dequantize=False)
    assert np.abs(packed - expanded)[attended].max() <= PACKED_ATOL, case


def test_transformers_reads_the_same_model_from_the_files():
    """Where transformers' GGUF loader reads the architecture, its weights under the HF names are the fixture's
    (exact, but for Gemma's norms: the float32 round trip 1 + w - 1), or, where it keeps experts fused under
    other names, its logits are the reference's. It reads Mixtral's llama file as a dense llama, Qwen2-MoE's
    dense first layer not at all, and keeps the new Falcon's QKV in llama.cpp's [q | k | v] order (a 40B-style
    Falcon with several KV heads), so those three confirm nothing."""
    record = json.loads((DATA / "transformers_check.json").read_text())
    confirmed = {case for case, r in record.items() if isinstance(r, dict) and (
        (r["weights_max_abs_diff"] <= 1e-7 and not r["weights_missing"]) or r["logits_max_abs_diff"] <= LOGITS_ATOL)}
    assert confirmed == set(CASES) - {"gemma", "deepseek2", "mixtral", "qwen2moe", "falcon_new_arch"}, sorted(confirmed)


def test_unmapped_architecture_names_it_and_the_mapped_ones():
    with pytest.raises(UnknownArchitectureError, match=r"'mamba' is not mapped .*mapped: .*deepseek2.*gemma3.*qwen3moe"):
        vkgguf.config_from_metadata({"general.architecture": "mamba"}, set())


def test_every_mapped_architecture_is_declared_by_the_plugin_that_runs_it():
    from vkformers.models.plugins import registry
    names = {entry.name for entry in vkgguf.gguf_architectures()}
    assert names >= {"llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma", "gemma2", "gemma3", "phi3",
                     "starcoder2", "gpt2", "falcon", "deepseek2"}
    for entry in vkgguf.gguf_architectures():
        assert registry().resolve({"model_type": entry.model_type}).name == entry.model_type


def test_a_gguf_mapping_names_an_architecture_its_plugin_declares():
    from vkformers.errors import ArchitectureDeclarationError
    from vkformers.models.family import Family
    family = Family("demo", kind="causal-decoder", norm="rms")
    family.architecture("demo_lm", variant=lambda config: None)
    family.gguf(vkgguf.GGUFArchitecture("demo", "demo_lm", "DemoForCausalLM", lambda m: m.common_config(), {}))
    assert [e.model_type for e in family.gguf_architectures()] == ["demo_lm"]
    with pytest.raises(ArchitectureDeclarationError, match="maps to 'llama', which the plugin does not declare"):
        family.gguf(vkgguf.GGUFArchitecture("llama", "llama", "LlamaForCausalLM", lambda m: {}, {}))
    with pytest.raises(ArchitectureDeclarationError, match="takes GGUFArchitecture entries, not dict"):
        family.gguf({"llama": "llama"})


def test_a_tensor_the_mapping_lacks_is_named(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_embedding_length(4)
    writer.add_head_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.ones((4, 4), np.float32))
    writer.add_tensor("blk.0.mystery.weight", np.ones((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(vkgguf.CheckpointError, match=r"no Hugging Face name in the 'qwen3' mapping: blk\.0\.mystery"):
        vkgguf.load_gguf(path, tokenizer=False)


def test_llama_3_1_rope_freqs_become_its_rope_config():
    """Llama 3.1 8B's rope (factor 8, low 1, high 4 over 8192 positions, theta 5e5, head_dim 128): llama.cpp keeps
    it as rope_freqs alone; the config derived from them gives the same divisor for each of the 64 frequencies."""
    from vkformers_llama.gguf_tables import llama3_rope_divisors
    inv_freq = 500000.0 ** (-np.arange(0, 128, 2) / 128)
    divisors = llama3_rope_divisors(inv_freq, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    meta = {"general.architecture": "llama", "llama.embedding_length": 4096, "llama.attention.head_count": 32,
            "llama.rope.freq_base": 500000.0, "llama.context_length": 131072, "llama.block_count": 1}
    config = vkgguf.config_from_metadata(meta, {"rope_freqs.weight": (64,), "output.weight": (1, 1)},
                                         lambda name: divisors)
    rope = config["rope_scaling"]
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    got = llama3_rope_divisors(inv_freq, 8.0, rope["low_freq_factor"], rope["high_freq_factor"],
                               rope["original_max_position_embeddings"])
    np.testing.assert_allclose(got, divisors, rtol=1e-5)
    assert 1 < (divisors > 1.001).sum() - (divisors > 7.999).sum()  # several blended frequencies: the fit ran
