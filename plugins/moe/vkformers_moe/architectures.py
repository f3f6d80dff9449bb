"""Architectures provided by vkformers-moe: mixture-of-experts causal decoders (table format: vkformers.models.registry.architectures_from_table)."""
from vkformers.models.registry import NESTED_TEXT_CONFIG, NestedConfig

# (name, kind, norm, moe, llama_layout, notes)
ARCHITECTURES = [
    ("dbrx",               "causal-decoder", "layer", True, False, "native KV-cache generation; upstream claims HF forward-logit fixtures"),
    ("llama4_text",        "causal-decoder", "rms",   True, True,  "chunked attention; NoPE layers"),
    ("mixtral",            "causal-decoder", "rms",   True, True,  "native KV-cache generation; upstream claims HF forward-logit fixtures"),
    ("phimoe",             "causal-decoder", "layer", True, True,  "native KV-cache generation; SparseMixer routing"),
    ("aria_text",          "causal-decoder", "rms",   True, True,  ""),
    ("afmoe",              "causal-decoder", "rms",   True, True,  ""),
    ("qwen2_moe",          "causal-decoder", "rms",   True, True,  "native KV-cache generation"),
    ("qwen3_moe",          "causal-decoder", "rms",   True, True,  "native KV-cache generation"),
    ("qwen3_next",         "causal-decoder", "rms",   True, True,  "native KV-cache generation; hybrid Gated-DeltaNet/full-attention schedule"),
    ("qwen3_5_moe_text",   "causal-decoder", "rms",   True, True,  "native KV-cache generation; hybrid Gated-DeltaNet/full-attention schedule; upstream claims 2-step AdamW parity"),
    ("qwen4_exp_text",     "causal-decoder", "rms",   True, True,  "native KV-cache generation; DeltaNet + sparse QSA + GR/hyper-connection streams + PLE (composed from engine ops, qwen4_exp.py); upstream claims 2-step AdamW parity"),
    ("dots1",              "causal-decoder", "rms",   True, True,  "Qwen3-style attention"),
    ("mellum",             "causal-decoder", "rms",   True, True,  "parsed via Qwen3 geometry"),
    ("gpt_oss",            "causal-decoder", "rms",   True, True,  "native KV-cache generation; clipped SwiGLU (gpt_oss_swiglu shader); alternating sliding/full attention; upstream claims 2-step AdamW parity"),
    ("glm4_moe",           "causal-decoder", "rms",   True, True,  ""),
    ("glm5_next_text",     "causal-decoder", "rms",   True, True,  "native KV-cache generation; KDA linear attention + DSA sparse attention + mHC (parsed via DeepSeek-V3.2 contract; composed from engine ops, glm5_next.py)"),
    ("mimo_v2_flash",      "causal-decoder", "rms",   True, True,  "native KV-cache generation"),
    ("deepseek_v3",        "causal-decoder", "rms",   True, True,  "MLA + grouped-sigmoid MoE"),
    ("deepseek_v4",        "causal-decoder", "rms",   True, False, "native KV-cache generation; HCA/CSA compressed attention + mHC + hyper head (composed from engine ops, deepseek_v4.py); upstream claims 2-step AdamW parity"),
    ("axk1",               "causal-decoder", "rms",   True, True,  "DeepSeek-V3-derived (MLA)"),
    ("axk2",               "causal-decoder", "rms",   True, True,  "DeepSeek-V3.2-derived (MLA + DSA)"),
    ("longcat_flash",      "causal-decoder", "rms",   True, True,  "MLA via Youtu/DeepSeek normalization; zero/identity experts"),
    ("solar_open",         "causal-decoder", "rms",   True, True,  "native KV-cache generation"),
    ("ernie4_5_moe",       "causal-decoder", "rms",   True, True,  ""),
    ("hunyuan_v1_moe",     "causal-decoder", "rms",   True, True,  ""),
    ("granitemoe",         "causal-decoder", "rms",   True, True,  ""),
    ("granitemoeshared",   "causal-decoder", "rms",   True, True,  ""),
    ("granitemoe_swa",     "causal-decoder", "rms",   True, True,  ""),
    ("cohere2_moe",        "causal-decoder", "layer", True, True,  ""),
    ("olmoe",              "causal-decoder", "rms",   True, True,  ""),
    ("flex_olmo",          "causal-decoder", "rms",   True, True,  ""),
    ("minimax_m2",         "causal-decoder", "rms",   True, True,  "native KV-cache generation; upstream claims 2-step AdamW parity"),
    ("minimax_m3_vl_text", "causal-decoder", "rms",   True, True,  "native KV-cache generation; Lightning-indexer block-sparse attention; GPT-OSS clipped SwiGLU; upstream claims 2-step AdamW parity"),
    ("exaone_moe",         "causal-decoder", "rms",   True, True,  ""),
]

# Other Hugging Face spellings that run as one of the architectures above.
# NESTED_TEXT_CONFIG / NestedConfig: a wrapper whose backbone is the nested config's model_type.
ALIASES = {
    "llama4":                 "llama4_text",  # multimodal wrapper; text_config
    "aria":                   "aria_text",  # multimodal wrapper; text_config
    "qwen3_vl_moe_text":      "qwen3_moe",  # normalized to qwen3_moe
    "qwen3_vl_moe":           "qwen3_moe",  # multimodal wrapper; text_config
    "qwen3_omni_moe_text":    "qwen3_moe",  # normalized to qwen3_moe
    "qwen3_omni_moe_thinker": NESTED_TEXT_CONFIG,  # typically qwen3_omni_moe_text -> qwen3_moe
    "qwen3_omni_moe":         NestedConfig(("thinker_config", "text_config")),  # resolves thinker_config.text_config dynamically; typically qwen3_omni_moe_text -> qwen3_moe
    "qwen3_5_moe":            "qwen3_5_moe_text",  # multimodal wrapper; text_config
    "qwen4_exp":              "qwen4_exp_text",  # wrapper; text_config
    "glm4v_moe_text":         "glm4_moe",  # GLM-4.5V text; mRoPE reduced
    "glm4v_moe":              "glm4_moe",  # multimodal wrapper; text_config parsed as glm4v_moe_text
    "glm46v":                 NESTED_TEXT_CONFIG,  # explicit dispatcher arm
    "glm4_moe_lite":          "deepseek_v3",  # GLM-4.7-Flash-style MLA+MoE; defaults normalized onto DeepSeek-V3 contract
    "glm5_next":              "glm5_next_text",  # wrapper; text_config
    "deepseek_v32":           "deepseek_v3",  # DeepSeek-V3.2: DeepSeek-V3 contract plus DSA indexer attached by package loader
    "kimi_k2":                "deepseek_v3",  # normalized to deepseek_v3
    "kimi_k25":               NESTED_TEXT_CONFIG,  # typically kimi_k2 -> deepseek_v3; upstream claims 2-step AdamW parity
    "glm_moe_dsa":            "deepseek_v3",  # GLM-5 MoE-DSA: normalized to deepseek_v32 then DeepSeek-V3 contract
    "minimax_m3_vl":          "minimax_m3_vl_text",  # wrapper; text_config; model.language_model.* prefix
}

# How far the parity tests prove each architecture against its transformers fixture (tests/fixtures/<name>/);
# tests/test_verified_claims.py checks every claim here has that proof, run by CI.
#   verified:          logits, loss, every parameter gradient (test_decoder_parity.py), one AdamW step
#                      (test_adamw_parity.py) and greedy tokens with the KV cache (test_generation.py)
#   forward-verified:  logits and loss
# Everything not listed stays "registered".
VERIFIED: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "flex_olmo", "hunyuan_v1_moe",
                            "deepseek_v3", "glm4_moe", "dots1", "granitemoeshared", "ernie4_5_moe",
                            "cohere2_moe", "exaone_moe", "minimax_m2", "solar_open", "mellum", "afmoe",
                            "dbrx", "aria_text", "axk1", "axk2", "phimoe", "qwen3_5_moe_text",
                            "qwen3_next", "llama4_text", "longcat_flash", "granitemoe_swa", "glm5_next_text",
                            "gpt_oss", "mimo_v2_flash", "minimax_m3_vl_text", "deepseek_v4",
                            "qwen4_exp_text")
FORWARD_VERIFIED: tuple[str, ...] = ()
STATUSES: dict[str, str] = {**{name: "forward-verified" for name in FORWARD_VERIFIED},
                            **{name: "verified" for name in VERIFIED}}
