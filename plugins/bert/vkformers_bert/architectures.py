"""Architectures provided by vkformers-bert: bidirectional encoders (table format: vkformers.models.registry.architectures_from_table)."""
from vkformers.models.registry import NESTED_TEXT_CONFIG

# (name, kind, norm, moe, llama_layout, notes)
ARCHITECTURES = [
    ("bert",                 "encoder", "layer", False, False, "BERT-family; upstream claims HF forward-logit fixtures"),
    ("albert",               "encoder", "layer", False, False, "BERT-family"),
    ("big_bird",             "encoder", "layer", False, False, "BERT-family; attention_type original_full only"),
    ("roc_bert",             "encoder", "layer", False, False, "causality per config; BERT-family"),
    ("rembert",              "encoder", "layer", False, False, "BERT-family"),
    ("electra",              "encoder", "layer", False, False, "BERT-family"),
    ("ernie",                "encoder", "layer", False, False, "BERT-family"),
    ("bert-generation",      "encoder", "layer", False, False, "causality per config; BERT-family"),
    ("megatron-bert",        "encoder", "layer", False, False, "causality per config; BERT-family"),
    ("nomic_bert",           "encoder", "layer", False, False, "BERT-family"),
    ("jina_embeddings_v3",   "encoder", "layer", False, False, "BERT-family"),
    ("roformer",             "encoder", "layer", False, False, "BERT-family"),
    ("distilbert",           "encoder", "layer", False, False, "BERT-family"),
    ("roberta",              "encoder", "layer", False, False, "BERT-family"),
    ("roberta-prelayernorm", "encoder", "layer", False, False, "BERT-family"),
    ("camembert",            "encoder", "layer", False, False, "BERT-family"),
    ("xlm-roberta",          "encoder", "layer", False, False, "BERT-family"),
    ("xlm-roberta-xl",       "encoder", "layer", False, False, "BERT-family"),
    ("data2vec-text",        "encoder", "layer", False, False, "BERT-family"),
    ("xlm",                  "encoder", "layer", False, False, "BERT-family"),
    ("flaubert",             "encoder", "layer", False, False, "BERT-family"),
    ("eurobert",             "encoder", "rms",   False, True,  ""),
    ("esm",                  "encoder", "layer", False, False, "BERT-family"),
    ("esmc",                 "encoder", "layer", False, False, "full-projection QK norm"),
    ("modernbert",           "encoder", "layer", False, False, ""),
]

# Other Hugging Face spellings that run as one of the architectures above.
# NESTED_TEXT_CONFIG / NestedConfig: a wrapper whose backbone is the nested config's model_type.
ALIASES = {
    "modernvbert": NESTED_TEXT_CONFIG,  # no explicit dispatcher arm; handled by the generic text_config fallback
}

# How far tests/test_encoder_parity.py proves each architecture (tests/fixtures/encoders/); the rest stay
# "registered". verified: logits, loss, every gradient and one AdamW step match transformers.
VERIFIED: tuple[str, ...] = (
    "bert", "roberta", "xlm-roberta", "camembert", "data2vec-text", "ernie", "distilbert", "electra", "albert",
    "roberta-prelayernorm", "megatron-bert", "xlm-roberta-xl", "rembert", "roformer", "esm", "nomic_bert",
    "big_bird", "roc_bert", "jina_embeddings_v3", "xlm", "flaubert", "eurobert", "esmc", "modernbert",
    "bert-generation",
)
FORWARD_VERIFIED: tuple[str, ...] = ()
STATUSES: dict[str, str] = {**{name: "forward-verified" for name in FORWARD_VERIFIED},
                            **{name: "verified" for name in VERIFIED}}
