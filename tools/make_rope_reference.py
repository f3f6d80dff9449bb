"""Write tests/data/rope_reference.json: transformers' own RoPE frequencies for a set of configs.

tests/test_rope_scaling.py compares vkformers.engine.rope_scaling against this file, so CI
needs neither transformers nor torch. Regenerate after changing CASES (needs both):

    python tools/make_rope_reference.py            # writes tests/data/rope_reference.json
"""
from __future__ import annotations

import json
from pathlib import Path

import transformers
from transformers import GPTNeoXConfig, HunYuanDenseV1Config, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import HunYuanDenseV1RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "rope_reference.json"
BASE = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 4096}
LONG_FACTOR = [1.0 + 0.25 * i for i in range(32)]
SHORT_FACTOR = [1.0 + 0.01 * i for i in range(32)]

# (name, config.json dict, seq_len). 4.x style: rope_theta / rope_scaling at the top level;
# 5.x style: rope_parameters.
CASES = [
    ("default_4x", {**BASE, "rope_theta": 10000.0}, None),
    ("default_5x_theta_1e6", {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, None),
    ("default_partial_neox", {**BASE, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}, None),
    ("linear_4x_type", {**BASE, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}, None),
    ("linear_5x", {**BASE, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.5}}, None),
    ("dynamic_short", {**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 100),
    ("dynamic_long", {**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 10000),
    ("dynamic_partial_long", {**BASE, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}, 20000),
    # HunYuan reads "dynamic" with an alpha as fixed NTK-alpha scaling (any seq_len); other models ignore alpha
    ("dynamic_ntk_alpha_hunyuan", {**BASE, "model_type": "hunyuan_v1_dense", "head_dim": 64, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0, "alpha": 1000.0}}, 10000),
    ("dynamic_alpha_ignored_llama", {**BASE, "model_type": "llama", "rope_scaling": {
        "rope_type": "dynamic", "factor": 2.0, "alpha": 1000.0}}, 10000),
    ("llama3_4x", {**BASE, "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0,
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, None),
    ("llama3_5x_factor32", {**BASE, "head_dim": 64, "max_position_embeddings": 131072,
                            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192}}, None),
    ("yarn_qwen_style", {**BASE, "max_position_embeddings": 32768, "rope_theta": 1e6,
                         "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 32768}}, None),
    ("yarn_deepseek_mscale", {**BASE, "head_dim": 64, "max_position_embeddings": 163840, "rope_theta": 10000.0,
                              "rope_scaling": {"type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                                               "mscale": 1.0, "mscale_all_dim": 1.0,
                                               "original_max_position_embeddings": 4096}}, None),
    ("yarn_mscale_0707_no_truncate", {**BASE, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 16, "beta_slow": 2,
        "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False, "original_max_position_embeddings": 4096}}, None),
    ("yarn_attention_factor_partial", {**BASE, "partial_rotary_factor": 0.5, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "attention_factor": 1.3,
        "original_max_position_embeddings": 2048}}, None),
    ("longrope_short", {**BASE, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                        "rope_theta": 10000.0, "rope_scaling": {"type": "longrope", "long_factor": LONG_FACTOR,
                                                               "short_factor": SHORT_FACTOR}}, 4096),
    ("longrope_long", {**BASE, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                       "rope_theta": 10000.0, "rope_scaling": {"type": "longrope", "long_factor": LONG_FACTOR,
                                                              "short_factor": SHORT_FACTOR}}, 4097),
    ("longrope_5x_factor", {**BASE, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 250000.0, "factor": 16.0, "long_factor": LONG_FACTOR,
        "short_factor": SHORT_FACTOR, "original_max_position_embeddings": 2048}}, 9000),
]


def reference(config: dict, seq_len):
    if config.get("model_type") == "hunyuan_v1_dense":  # its own rotary module (NTK alpha), static frequencies
        rotary = HunYuanDenseV1RotaryEmbedding(HunYuanDenseV1Config(**config))
        return rotary.inv_freq, rotary.attention_scaling
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    partial = "partial_rotary_factor" in config
    if rope_type == "default" and partial:  # models compute the default themselves; GPT-NeoX's honours partial
        return GPTNeoXRotaryEmbedding.compute_default_rope_parameters(GPTNeoXConfig(**config), seq_len=seq_len)
    if rope_type == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(LlamaConfig(**config), seq_len=seq_len)
    hf_config = (Phi3Config if rope_type == "longrope" else LlamaConfig)(**config)
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, seq_len=seq_len)


def main():
    cases = []
    for name, config, seq_len in CASES:
        inv_freq, scaling = reference(config, seq_len)
        cases.append({"name": name, "config": config, "seq_len": seq_len,
                      "inv_freq": [float(v) for v in inv_freq.tolist()], "attention_scaling": float(scaling)})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"transformers": transformers.__version__, "cases": cases}, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
