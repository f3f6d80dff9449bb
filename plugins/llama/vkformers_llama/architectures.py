"""Architectures provided by vkformers-llama: dense causal decoders (no mixture of experts) (table format: vkformers.models.registry.architectures_from_table)."""
from vkformers.models.registry import NESTED_TEXT_CONFIG, NestedConfig

# (name, kind, norm, moe, llama_layout, notes)
ARCHITECTURES = [
    ("openai-gpt",          "causal-decoder", "layer", False, False, ""),
    ("gpt2",                "causal-decoder", "layer", False, False, "native KV-cache generation; upstream claims HF forward-logit fixtures"),
    ("gpt-sw3",             "causal-decoder", "layer", False, False, ""),
    ("gpt_bigcode",         "causal-decoder", "layer", False, False, ""),
    ("falcon",              "causal-decoder", "layer", False, False, ""),
    ("bloom",               "causal-decoder", "layer", False, False, "ALiBi"),
    ("mpt",                 "causal-decoder", "layer", False, False, "ALiBi"),
    ("codegen",             "causal-decoder", "layer", False, False, ""),
    ("ctrl",                "causal-decoder", "layer", False, False, "sinusoidal positions"),
    ("gpt_neo",             "causal-decoder", "layer", False, False, ""),
    ("gpt_neox",            "causal-decoder", "layer", False, False, ""),
    ("gpt_neox_japanese",   "causal-decoder", "layer", False, False, ""),
    ("persimmon",           "causal-decoder", "layer", False, False, ""),
    ("gptj",                "causal-decoder", "layer", False, False, ""),
    ("phi",                 "causal-decoder", "layer", False, False, ""),
    ("opt",                 "causal-decoder", "layer", False, False, ""),
    ("biogpt",              "causal-decoder", "layer", False, False, ""),
    ("trocr",               "causal-decoder", "layer", False, False, "TrOCRForCausalLM: the decoder alone (vision encoder not native)"),
    ("xglm",                "causal-decoder", "layer", False, False, "sinusoidal positions"),
    ("stablelm",            "causal-decoder", "layer", False, True,  "native KV-cache generation"),
    ("llama",               "causal-decoder", "rms",   False, True,  "native KV-cache generation; upstream claims HF forward-logit fixtures"),
    ("open-llama",          "causal-decoder", "rms",   False, True,  "native KV-cache generation"),
    ("bitnet",              "causal-decoder", "rms",   False, True,  "relu2 + projection sub-norms"),
    ("emu3_text_model",     "causal-decoder", "rms",   False, True,  ""),
    ("arcee",               "causal-decoder", "rms",   False, True,  ""),
    ("mistral",             "causal-decoder", "rms",   False, True,  "native KV-cache generation; upstream claims HF forward-logit fixtures"),
    ("laguna",              "causal-decoder", "rms",   False, True,  ""),
    ("ministral",           "causal-decoder", "rms",   False, True,  ""),
    ("ministral3",          "causal-decoder", "rms",   False, True,  ""),
    ("jais2",               "causal-decoder", "layer", False, True,  "native KV-cache generation"),
    ("qwen2",               "causal-decoder", "rms",   False, True,  "native KV-cache generation; upstream claims HF forward-logit fixtures"),
    ("qwen3",               "causal-decoder", "rms",   False, True,  "native KV-cache generation"),
    ("qwen3_5_text",        "causal-decoder", "rms",   False, True,  "native KV-cache generation; hybrid Gated-DeltaNet/full-attention schedule; upstream claims 2-step AdamW parity"),
    ("phi3",                "causal-decoder", "rms",   False, False, "native KV-cache generation; upstream claims 2-step AdamW parity"),
    ("glm",                 "causal-decoder", "rms",   False, True,  ""),
    ("glm4",                "causal-decoder", "rms",   False, True,  ""),
    ("deepseek_v2",         "causal-decoder", "rms",   False, True,  "MLA"),
    ("minicpm3",            "causal-decoder", "rms",   False, True,  "MLA"),
    ("mistral4",            "causal-decoder", "rms",   False, True,  "native KV-cache generation; upstream claims 2-step AdamW parity"),
    ("youtu",               "causal-decoder", "rms",   False, True,  "MLA (DeepSeek-style)"),
    ("ernie4_5",            "causal-decoder", "rms",   False, True,  ""),
    ("hunyuan_v1_dense",    "causal-decoder", "rms",   False, True,  "DynamicNTKAlpha RoPE"),
    ("gemma",               "causal-decoder", "rms",   False, True,  "native KV-cache generation"),
    ("gemma2",              "causal-decoder", "rms",   False, True,  "pre+post sublayer norms; logit softcapping"),
    ("gemma3_text",         "causal-decoder", "rms",   False, True,  "pre+post sublayer norms; QK-norm"),
    ("vaultgemma",          "causal-decoder", "rms",   False, True,  ""),
    ("granite",             "causal-decoder", "rms",   False, True,  "native KV-cache generation"),
    ("granite_swa",         "causal-decoder", "rms",   False, True,  ""),
    ("hyperclovax",         "causal-decoder", "rms",   False, True,  ""),
    ("apertus",             "causal-decoder", "rms",   False, True,  "xIELU activation"),
    ("hy_v3",               "causal-decoder", "rms",   False, True,  ""),
    ("helium",              "causal-decoder", "rms",   False, True,  ""),
    ("cohere",              "causal-decoder", "layer", False, True,  ""),
    ("cohere2",             "causal-decoder", "layer", False, True,  ""),
    ("cohere_compass_text", "causal-decoder", "layer", False, True,  ""),
    ("smollm3",             "causal-decoder", "rms",   False, True,  ""),
    ("olmo",                "causal-decoder", "layer", False, True,  "parameter-free LayerNorm"),
    ("olmo2",               "causal-decoder", "rms",   False, True,  ""),
    ("olmo3",               "causal-decoder", "rms",   False, True,  ""),
    ("olmo_hybrid",         "causal-decoder", "rms",   False, True,  "native KV-cache generation; hybrid Gated-DeltaNet/full-attention schedule"),
    ("exaone4",             "causal-decoder", "rms",   False, True,  ""),
    ("nemotron",            "causal-decoder", "layer", False, True,  ""),
    ("seed_oss",            "causal-decoder", "rms",   False, True,  ""),
    ("cwm",                 "causal-decoder", "rms",   False, True,  "native KV-cache generation"),
    ("nanochat",            "causal-decoder", "rms",   False, True,  "parameter-free RMSNorm"),
    ("starcoder2",          "causal-decoder", "layer", False, False, "native KV-cache generation"),
    ("modernbert-decoder",  "causal-decoder", "layer", False, False, ""),
]

# Other Hugging Face spellings that run as one of the architectures above.
# NESTED_TEXT_CONFIG / NestedConfig: a wrapper whose backbone is the nested config's model_type.
ALIASES = {
    "code_llama":           "llama",  # historical Code Llama spelling; Llama parser
    "mllama_text_model":    "llama",  # Mllama text-only: cross-attention layers skipped, self-attention layers run on Llama graph
    "mllama":               "llama",  # multimodal wrapper; text_config parsed as mllama_text_model
    "emu3":                 "emu3_text_model",  # multimodal wrapper; text_config
    "fuyu":                 "persimmon",  # text_config (or legacy root fields) parsed as Persimmon
    "mistral3":             "mistral",  # multimodal wrapper; text_config parsed with Mistral parser
    "qwen2_vl_text":        "qwen2",  # mRoPE reduced to 1-D RoPE for text-only
    "qwen2_5_vl_text":      "qwen2",  # mRoPE reduced to 1-D RoPE for text-only
    "qwen2_vl":             "qwen2",  # multimodal wrapper; text_config parsed as Qwen2-VL text
    "qwen2_5_vl":           "qwen2",  # multimodal wrapper; text_config parsed as Qwen2-VL text
    "qwen2_5_omni_text":    "qwen2",  # parsed with Qwen2-VL text parser
    "qwen3_vl_text":        "qwen3",  # normalized to qwen3
    "qwen3_vl":             "qwen3",  # multimodal wrapper; text_config
    "qwen3_5":              "qwen3_5_text",  # multimodal wrapper; text_config
    "phi4_multimodal":      "phi3",  # root config normalized to phi3; image/audio towers preserved, not executed; upstream claims 2-step AdamW parity
    "glm4v_text":           "glm4",  # GLM4V text: full-head RoPE, mRoPE reduced to 1-D
    "glm4v":                "glm4",  # multimodal wrapper; text_config parsed as glm4v_text
    "glm_ocr_text":         "glm4",  # parsed with GLM4V text parser
    "glm_ocr":              "glm4",  # multimodal wrapper; text_config parsed with GLM4V text parser
    "hunyuan_vl_text":      "hunyuan_v1_dense",  # mRoPE reduced; tied embeddings default
    "hunyuan_vl":           "hunyuan_v1_dense",  # multimodal wrapper; text_config parsed as hunyuan_vl_text
    "gemma3":               "gemma3_text",  # multimodal wrapper; text_config
    "exaone4_5_text":       "exaone4",  # legacy spelling normalized to exaone4
    "exaone4_5":            NESTED_TEXT_CONFIG,  # typically exaone4_5_text/exaone4 -> exaone4
    "cohere_compass":       "cohere_compass_text",  # wrapper; text_config
    "cohere2_vision":       NestedConfig(("text_config",), (("logit_scale", 1.0),)),  # its lm_head does not scale logits
    # Cosmos3-Omni's language model is saved at the file's root, with Diffusers attention names
    "cosmos3_omni":         NestedConfig(("text_config",), renames=(
        (r"^(layers|embed_tokens|norm)\.", r"model.language_model.\1."),
        *((rf"\.self_attn\.{old}\.", f".self_attn.{new}.") for old, new in (
            ("to_q", "q_proj"), ("to_k", "k_proj"), ("to_v", "v_proj"), ("to_out", "o_proj"), ("norm_q", "q_norm"),
            ("norm_k", "k_norm"))))),
    "got_ocr2":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "aya_vision":           NestedConfig(("text_config",), (("logit_scale", 1.0),)),  # its lm_head does not scale logits
    "llava":                NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "llava_next":           NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "llava_next_video":     NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "llava_onevision":      NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "video_llava":          NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "video_llama_3":        NESTED_TEXT_CONFIG,  # explicit dispatcher arm
    "vipllava":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "idefics2":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "idefics3":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "smolvlm":              NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "qwen2_audio":          NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "voxtral":              NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "fast_vlm":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "internvl":             NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "janus":                NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "ovis2":                NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "paligemma":            NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "deepseek_vl":          NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "deepseek_vl_hybrid":   NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "paddleocr_vl_text":    "llama",  # parsed on Llama contract (use_bias mapped to attention/mlp bias; mRoPE reduced)
    "paddleocr_vl":         NESTED_TEXT_CONFIG,  # generic wrapper arm; legacy flat root config falls back to paddleocr_vl_text -> llama
    "audioflamingo3":       NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "qwen3_asr":            NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "granite_speech":       NestedConfig(("text_config",), (("logits_scaling", 1.0),)),  # its lm_head skips logits_scaling
    "granite_speech_plus":  NestedConfig(("text_config",), (("logits_scaling", 1.0),)),  # its lm_head skips logits_scaling
    "granite4_vision_text": "granite",  # normalized to granite
    "granite4_vision":      NESTED_TEXT_CONFIG,  # typically granite4_vision_text -> granite
    "glmasr":               NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "musicflamingo":        NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
    "vibevoice_asr":        NESTED_TEXT_CONFIG,  # generic multimodal/speech wrapper; non-text towers not run
}

# How far the parity tests prove each architecture against its transformers fixture (tests/fixtures/<name>/);
# tests/test_verified_claims.py checks every claim here has that proof, run by CI.
#   verified:          logits, loss, every parameter gradient (test_decoder_parity.py), one AdamW step
#                      (test_adamw_parity.py) and greedy tokens with the KV cache (test_generation.py)
#   forward-verified:  logits and loss
# Everything not listed stays "registered".
VERIFIED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo", "olmo2",
            "granite", "cohere", "stablelm", "starcoder2", "gpt2", "gpt_neox", "phi", "opt", "falcon", "bloom",
            "apertus", "arcee", "biogpt", "bitnet", "codegen", "cohere2", "ctrl", "ernie4_5", "exaone4", "glm",
            "glm4", "gpt_bigcode", "gpt_neo", "gpt_neox_japanese", "gptj", "granite_swa", "helium",
            "hunyuan_v1_dense", "hyperclovax", "jais2", "minicpm3", "ministral", "ministral3", "mpt", "nanochat",
            "nemotron", "olmo3", "openai-gpt", "persimmon", "smollm3", "vaultgemma", "xglm", "youtu",
            "gpt-sw3", "seed_oss", "cwm", "emu3_text_model", "cohere_compass_text",
            "modernbert-decoder", "qwen3_5_text", "trocr", "olmo_hybrid",
            "open-llama",  # its fixture is built with transformers 4.49 (removed in 5)
            # mixture-of-experts layers from vkformers-moe (fixtures *_moe; the *_dense ones cover dense-only configs)
            "deepseek_v2", "hy_v3", "laguna", "mistral4")
FORWARD_VERIFIED: tuple[str, ...] = ()
STATUSES: dict[str, str] = {**{name: "forward-verified" for name in FORWARD_VERIFIED},
                            **{name: "verified" for name in VERIFIED}}
