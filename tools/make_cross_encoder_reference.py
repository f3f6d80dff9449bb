"""Write tests/fixtures/cross_encoder/: two tiny random cross-encoders saved by sentence-transformers' CrossEncoder
(``save_pretrained``: the transformers checkpoint, modules.json, config_sentence_transformers.json naming the
activation, the tokenizer with ``max_length`` as its model_max_length) and what its ``predict`` and ``rank`` return
for them, for tests/test_cross_encoder.py and tests/test_serve_rerank.py:

* ``bert-reranker``: a BertForSequenceClassification with one label (a reranker, as
  cross-encoder/ms-marco-MiniLM-L6-v2: Sigmoid by default; the classifier on the pooler), a WordPiece tokenizer
  (token_type_ids), max_length 24 (the longest pairs truncated, longest first);
* ``xlm-roberta-nli``: an XLMRobertaForSequenceClassification with three NLI labels (Identity by default; the
  classifier's dense and out_proj on the first token), a Unigram tokenizer with XLM-R's pair template
  (``<s> A </s></s> B </s>``), max_length 32 (batches padded to a multiple of 16 by vkformers).

reference.json holds the pairs (of 7 to 37 words: padded batches), each model's token counts per pair, and
predict's scores in batches of 4 (length-sorted by sentence-transformers, so padded) with the default activation,
with ``activation_fn`` Identity (the logits: bert-reranker) or Sigmoid (xlm-roberta-nli), with ``apply_softmax``
(xlm-roberta-nli), one pair alone, and the reranker's ``rank`` results (all, ``top_k``, ``return_documents``). Scores
are float32 written as JSON numbers (exact). Deterministic (one CPU thread, fixed seeds). Needs
sentence-transformers, transformers and torch (CPU):

    /tmp/tfvenv/bin/python tools/make_cross_encoder_reference.py
"""
from __future__ import annotations

import json
import re
import shutil
import string
import tempfile
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import CrossEncoder
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import (BertConfig, BertForSequenceClassification, BertTokenizerFast, XLMRobertaConfig,
                          XLMRobertaForSequenceClassification, XLMRobertaTokenizerFast)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "cross_encoder"
CORPUS = ["the quick brown fox jumps over the lazy dog", "paris is the capital and largest city of france",
          "berlin is the capital of germany and well known for its museums",
          "gpus run compute shaders through vulkan on many devices",
          "a reranker scores each query and document together", "the weather is lovely today and it is sunny",
          "he drove to the stadium to watch the football match"]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital and largest city of france",
             "berlin is the capital of germany",
             "the quick brown fox jumps over the lazy dog while gpus run compute shaders through vulkan on many "
             "devices and the weather is lovely today",
             "france",
             "the capital of france is paris and the capital of germany is berlin"]
PAIRS = [[QUERY, d] for d in DOCUMENTS] + [
    ["the weather is lovely today", "it is sunny"],
    ["a reranker scores each query and document together, the quick brown fox jumps over the lazy dog and he "
     "drove to the stadium to watch the football match", "paris is the capital and largest city of france"]]
BATCH = 4
ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               initializer_range=0.3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
NLI_LABELS = {0: "contradiction", 1: "entailment", 2: "neutral"}


def words() -> list[str]:
    return sorted({word for text in CORPUS for word in re.findall(r"\w+", text)})


def wordpiece() -> BertTokenizerFast:
    """A WordPiece tokenizer over the corpus' words, letters and continuation letters (a vocabulary written out,
    not trained: the trainers' ties fall differently from run to run)."""
    letters = string.ascii_lowercase + string.digits
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.punctuation, *letters,
             *(f"##{c}" for c in letters), *(w for w in words() if len(w) > 1)]
    backend = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return BertTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                             sep_token="[SEP]", mask_token="[MASK]", do_lower_case=True, model_max_length=512)


def unigram() -> XLMRobertaTokenizerFast:
    """A SentencePiece-style Unigram tokenizer (as XLM-R's): the corpus' words after the word mark, then single
    letters, which spell the words it lacks."""
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("<mask>", 0.0), ("\u2581", -4.0)]
    pieces += [(f"\u2581{w}", -2.0 - len(w) / 10) for w in words()]
    pieces += [(c, -6.0) for c in string.ascii_lowercase + string.digits + string.punctuation]
    backend = Tokenizer(models.Unigram(pieces, unk_id=3))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    return XLMRobertaTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                   cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                   model_max_length=64)


def build(name: str, model, tokenizer, max_length: int | None) -> CrossEncoder:
    """The transformers model and tokenizer loaded by CrossEncoder and saved by it into OUT/name."""
    with tempfile.TemporaryDirectory() as raw:
        model.save_pretrained(raw)
        tokenizer.save_pretrained(raw)
        cross_encoder = CrossEncoder(raw, max_length=max_length, device="cpu")
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    cross_encoder.save_pretrained(str(folder))
    (folder / "README.md").unlink(missing_ok=True)  # the generated model card: nothing the tests read
    return CrossEncoder(str(folder), device="cpu")  # as saved


def scores(array) -> list:
    return np.asarray(array, np.float32).tolist()


def token_counts(cross_encoder: CrossEncoder) -> list[int]:
    tokenizer = cross_encoder.tokenizer
    return [len(tokenizer(q, d, truncation="longest_first", max_length=cross_encoder.max_seq_length)["input_ids"])
            for q, d in PAIRS]


def main() -> None:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    bert_tokenizer, xlmr_tokenizer = wordpiece(), unigram()
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(bert_tokenizer), max_position_embeddings=64,
                                                    num_labels=1, **ENCODER))
    reranker = build("bert-reranker", bert, bert_tokenizer, max_length=24)
    torch.manual_seed(1)
    xlmr = XLMRobertaForSequenceClassification(XLMRobertaConfig(
        vocab_size=len(xlmr_tokenizer), max_position_embeddings=66, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        type_vocab_size=1, num_labels=3, id2label=NLI_LABELS, label2id={v: k for k, v in NLI_LABELS.items()},
        classifier_dropout=0.0, **ENCODER))
    nli = build("xlm-roberta-nli", xlmr, xlmr_tokenizer, max_length=32)
    reference = {
        "meta": {"sentence_transformers": sentence_transformers.__version__, "transformers": transformers.__version__,
                 "torch": torch.__version__, "batch_size": BATCH},
        "pairs": PAIRS, "query": QUERY, "documents": DOCUMENTS,
        "bert-reranker": {
            "max_length": reranker.max_seq_length, "token_counts": token_counts(reranker),
            "predict": scores(reranker.predict(PAIRS, batch_size=BATCH)),
            "logits": scores(reranker.predict(PAIRS, batch_size=BATCH, activation_fn=torch.nn.Identity())),
            "single": float(reranker.predict(PAIRS[5])),
            "rank": reranker.rank(QUERY, DOCUMENTS, batch_size=BATCH),
            "rank_top_2_documents": reranker.rank(QUERY, DOCUMENTS, top_k=2, return_documents=True)},
        "xlm-roberta-nli": {
            "max_length": nli.max_seq_length, "token_counts": token_counts(nli),
            "predict": scores(nli.predict(PAIRS, batch_size=BATCH)),
            "softmax": scores(nli.predict(PAIRS, batch_size=BATCH, apply_softmax=True)),
            "sigmoid": scores(nli.predict(PAIRS, batch_size=BATCH, activation_fn=torch.nn.Sigmoid())),
            "single": scores(nli.predict(PAIRS[5]))},
    }
    (OUT / "reference.json").write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    for name in ("bert-reranker", "xlm-roberta-nli"):
        print(name, reference[name]["max_length"], reference[name]["token_counts"], reference[name]["predict"])


if __name__ == "__main__":
    main()
