"""Architectures provided by vkformers-t5: encoder-decoders (table format: vkformers.models.registry.architectures_from_table)."""
from vkformers.models.registry import NestedConfig

# (name, kind, norm, moe, llama_layout, notes)
ARCHITECTURES = [
    ("t5",                  "encoder-decoder", "rms",   False, False, "T5-family; relative position bias; upstream claims HF forward-logit fixtures"),
    ("mt5",                 "encoder-decoder", "rms",   False, False, "T5-family; relative position bias"),
    ("umt5",                "encoder-decoder", "rms",   False, False, "T5-family; relative position bias"),
    ("switch_transformers", "encoder-decoder", "rms",   True,  False, "T5-family; relative position bias; upstream claims HF forward-logit fixtures"),
    ("t5_gemma_module",     "encoder-decoder", "rms",   False, True,  "native KV-cache generation; decoder module of t5gemma; runs the whole t5gemma config (encoder and decoder must share hidden_size and head_dim)"),
    ("bart",                "encoder-decoder", "layer", False, False, "BART-layout; upstream claims HF forward-logit fixtures"),
    ("mbart",               "encoder-decoder", "layer", False, False, "BART-layout"),
    ("marian",              "encoder-decoder", "layer", False, False, "not in upstream native dense-text-encoder set; BART-layout; sinusoidal positions"),
    ("fsmt",                "encoder-decoder", "layer", False, False, "not in upstream native dense-text-encoder set; BART-layout; sinusoidal positions"),
    ("plbart",              "encoder-decoder", "layer", False, False, "BART-layout"),
    ("mvp",                 "encoder-decoder", "layer", False, False, "BART-layout"),
    ("blenderbot",          "encoder-decoder", "layer", False, False, "BART-layout"),
    ("blenderbot-small",    "encoder-decoder", "layer", False, False, "not in upstream native dense-text-encoder set; BART-layout"),
    ("pegasus",             "encoder-decoder", "layer", False, False, "BART-layout; sinusoidal positions"),
    ("m2m_100",             "encoder-decoder", "layer", False, False, "BART-layout; sinusoidal positions"),
    ("bigbird_pegasus",     "encoder-decoder", "layer", False, False, "not in upstream native dense-text-encoder set; BART-layout; attention_type original_full only"),
    ("pegasus_x",           "encoder-decoder", "layer", False, False, "not in upstream native dense-text-encoder set; BART-layout; sinusoidal positions; inputs longer than one local attention block refused"),
]

# Other Hugging Face spellings that run as one of the architectures above.
# NESTED_TEXT_CONFIG / NestedConfig: a wrapper whose backbone is the nested config's model_type.
ALIASES = {
    "encoder-decoder": NestedConfig(("decoder",)),  # composite seq2seq wrapper handled by the Seq2Seq facade; encoder and decoder keep their own nested model_type
    "t5gemma":         "t5_gemma_module",  # decoder sub-config parsed as t5_gemma_module
}

# How far tests/test_seq2seq_parity.py proves each architecture against its transformers 5.24 fixture
# (tests/fixtures/seq2seq/<name>/); tests/test_verified_claims_seq2seq.py checks every claim has that proof.
#   verified:          logits, loss, every parameter gradient, one AdamW step and greedy tokens with the cache
#   forward-verified:  logits and loss
# Everything not listed stays "registered".
VERIFIED = ("t5", "mt5", "umt5", "bart", "mbart", "marian", "pegasus", "blenderbot-small", "blenderbot", "plbart",
            "m2m_100", "mvp", "fsmt", "switch_transformers",
            "pegasus_x", "bigbird_pegasus", "t5_gemma_module")
FORWARD_VERIFIED: tuple[str, ...] = ()
STATUSES: dict[str, str] = {**{name: "forward-verified" for name in FORWARD_VERIFIED},
                            **{name: "verified" for name in VERIFIED}}
