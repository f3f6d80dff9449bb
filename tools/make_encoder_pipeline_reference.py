"""Write tests/data/pipeline_encoder/: tiny random BERT checkpoints (a sequence classifier with named labels, a masked
LM, a token tagger, an NLI classifier) over one WordPiece tokenizer, and what transformers' ``text-classification``,
``fill-mask``, ``feature-extraction``, ``token-classification`` and ``zero-shot-classification`` pipelines return
for them, for tests/test_pipelines.py.

    /tmp/tfvenv/bin/python tools/make_encoder_pipeline_reference.py
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (AutoTokenizer, BertConfig, BertForMaskedLM, BertForSequenceClassification,
                          BertForTokenClassification, BertModel, pipeline)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "pipeline_encoder"
CORPUS = ["the quick brown fox jumps over the lazy dog", "paris is the capital of france",
          "gpus run compute shaders through vulkan", "this movie was great and i loved it",
          "this movie was terrible and i hated it", "once upon a time there was a small model"] * 30
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = ["this movie was great", "paris is the capital of france", "the lazy dog"]
PAIR = {"text": "this movie was great", "text_pair": "i hated it"}
MASKED = ["paris is the [MASK] of france", "the quick [MASK] fox [MASK] over"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TAGS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
NLI = {0: "contradiction", 1: "neutral", 2: "entailment"}
ENTITY_TEXTS = ["paris is the capital of france", "once upon a time the quickest fox jumped over vulkanized shaders"]


def tokenizer_files():
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=SPECIALS))
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                           special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return backend


def main():
    backend = tokenizer_files()
    config = dict(vocab_size=backend.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, initializer_range=0.3)
    torch.manual_seed(0)
    folders = {"classifier": BertForSequenceClassification(BertConfig(**config, num_labels=3, id2label=LABELS,
                                                                      label2id={v: k for k, v in LABELS.items()})),
               "masked": BertForMaskedLM(BertConfig(**config)), "base": BertModel(BertConfig(**config)),
               "tagger": BertForTokenClassification(BertConfig(**config, num_labels=5, id2label=TAGS,
                                                               label2id={v: k for k, v in TAGS.items()})),
               "nli": BertForSequenceClassification(BertConfig(**config, num_labels=3, id2label=NLI,
                                                               label2id={v: k for k, v in NLI.items()}))}
    for name, model in folders.items():
        model.save_pretrained(OUT / name)
        backend.save(str(OUT / name / "tokenizer.json"))
        (OUT / name / "tokenizer_config.json").write_text(json.dumps(
            {"do_lower_case": True, "clean_up_tokenization_spaces": True, "pad_token": "[PAD]", "unk_token": "[UNK]",
             "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]", "model_max_length": 64}) + "\n")
    load = lambda name: AutoTokenizer.from_pretrained(OUT / name)  # noqa: E731
    classify = pipeline("text-classification", model=str(OUT / "classifier"), tokenizer=load("classifier"))
    fill = pipeline("fill-mask", model=str(OUT / "masked"), tokenizer=load("masked"))
    features = pipeline("feature-extraction", model=str(OUT / "base"), tokenizer=load("base"))
    tagger = pipeline("token-classification", model=str(OUT / "tagger"), tokenizer=load("tagger"))
    zero_shot = pipeline("zero-shot-classification", model=str(OUT / "nli"), tokenizer=load("nli"))
    cases = [
        ("text-classification", "classifier", TEXTS[0], {}),
        ("text-classification", "classifier", TEXTS, {}),
        ("text-classification", "classifier", TEXTS[0], {"top_k": None}),
        ("text-classification", "classifier", TEXTS, {"top_k": 2}),
        ("text-classification", "classifier", PAIR, {}),
        ("text-classification", "classifier", TEXTS[1], {"function_to_apply": "sigmoid", "top_k": 3}),
        ("text-classification", "classifier", TEXTS, {"batch_size": 3}),
        ("fill-mask", "masked", MASKED[0], {}),
        ("fill-mask", "masked", MASKED[1], {"top_k": 3}),
        ("fill-mask", "masked", MASKED, {"top_k": 2}),
        ("fill-mask", "masked", MASKED[0], {"targets": ["capital", "dog", "vulkan"]}),
        ("feature-extraction", "base", TEXTS[2], {}),
        ("feature-extraction", "base", TEXTS[:2], {}),
        ("token-classification", "tagger", ENTITY_TEXTS[0], {}),
        ("token-classification", "tagger", ENTITY_TEXTS[1], {"ignore_labels": []}),
        ("token-classification", "tagger", ENTITY_TEXTS, {"aggregation_strategy": "simple"}),
        ("token-classification", "tagger", ENTITY_TEXTS[1], {"aggregation_strategy": "first"}),
        ("token-classification", "tagger", ENTITY_TEXTS[1], {"aggregation_strategy": "average"}),
        ("token-classification", "tagger", ENTITY_TEXTS[1], {"aggregation_strategy": "max", "ignore_labels": ["O"]}),
        ("zero-shot-classification", "nli", TEXTS[0], {"candidate_labels": ["movie", "capital", "dog"]}),
        ("zero-shot-classification", "nli", TEXTS, {"candidate_labels": "movie, capital", "multi_label": True}),
        ("zero-shot-classification", "nli", TEXTS[1], {"candidate_labels": ["france"],
                                                       "hypothesis_template": "the text is about {}"}),
    ]
    pipes = {"text-classification": classify, "fill-mask": fill, "feature-extraction": features,
             "token-classification": tagger, "zero-shot-classification": zero_shot}
    results = []
    for task, folder, inputs, kwargs in cases:
        out = pipes[task](inputs, **kwargs)
        results.append({"task": task, "folder": folder, "inputs": inputs, "kwargs": kwargs, "output": out})
        print(task, str(out)[:200])
    import transformers
    (OUT / "outputs.json").write_text(json.dumps({"transformers_version": transformers.__version__,
                                                  "cases": results}, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
