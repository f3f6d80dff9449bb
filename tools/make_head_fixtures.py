"""Write tests/fixtures/heads/<case>/: tiny random transformers task models and what transformers computes.

Each case is a 1-layer (encoders) or 2-layer (decoders), hidden-16 model of one architecture with one task head (sequence classification, token
classification, question answering), built from a config alone and re-initialised from a fixed seed, and a [3, 7]
batch: row 0 full, row 1 right-padded by 2, row 2 left-padded by 2 (pad ids, attention mask 0). reference.safetensors
holds the inputs, and for each label variant the logits, the loss and the gradients ("grad.<name>"): every
parameter's for "single" (under the names model.safetensors stores: Mixtral's fused experts split back), the head's for "multi" and "regression" (sequence heads; the same weights, through
problem_type), "clean": a [3, 7] batch without padding given without an attention mask (logits, loss, the head's
gradients), and the base
model's outputs ("base.last_hidden_state", "base.pooler_output", "base.hidden_states.<i>"); BF16_CASES also
hold the "single" variant run in bfloat16 ("bf16.logits", "bf16.loss", the head's "bf16.grad.<name>"). seq2seq-base/<name>
holds transformers' base encoder-decoder (T5Model, BartModel, MarianModel) outputs on the seq2seq parity fixtures'
weights. tests/test_heads_parity.py loads them with vkformers' AutoModel* classes and compares. Needs transformers and torch (CPU):

    python tools/make_head_fixtures.py            # every case
    python tools/make_head_fixtures.py --only bert-sequence
    python tools/make_head_fixtures.py --only xmod-token      # a spare case (SPARE_CASES), not stored
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.core_model_loading import revert_weight_conversion
from transformers import (AutoConfig, AutoModel, AutoModelForMultipleChoice, AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_encoder_fixtures import in_file_layout  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "heads"
BATCH, LENGTH, PAD_ROWS = 3, 7, 2
VOCAB, NUM_LABELS = 40, 3
ENCODER = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
               max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               classifier_dropout=0.0)
SMALL_ENCODER = dict(ENCODER, intermediate_size=16, max_position_embeddings=12)
ROBERTA_TOKENS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)
DISTILBERT = dict(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_position_embeddings=16,
                  dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, qa_dropout=0.0)
DECODER = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               intermediate_size=32, max_position_embeddings=32, pad_token_id=0, tie_word_embeddings=False,
               classifier_dropout=0.0)
BART = dict(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, classifier_dropout=0.0, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2)
T5 = dict(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
          relative_attention_num_buckets=4, relative_attention_max_distance=16, dropout_rate=0.0,
          classifier_dropout=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
# the appended cases: smaller still (the fixtures stay small)
SMALL_DECODER = dict(DECODER, num_hidden_layers=1, intermediate_size=16)

BF16_CASES = ("bert-sequence",)  # also run in bfloat16 (tests/test_heads_parity.py states the tolerance)
# the later cases at hidden 8 (repository size)
NARROW = dict(ENCODER, hidden_size=8, intermediate_size=8)
# DeBERTa-v3's layout: relative attention with buckets through the shared q/k projections, no absolute positions
DEBERTA_V3 = dict(NARROW, relative_attention=True, position_buckets=4, max_relative_positions=-1,
                  pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
                  type_vocab_size=0, pooler_dropout=0.0)

NARROW_T5 = dict(T5, d_model=8, d_kv=4, d_ff=8)
NARROW_BART = dict(BART, d_model=8, encoder_ffn_dim=8, decoder_ffn_dim=8, max_position_embeddings=8)
NARROW_DECODER = dict(SMALL_DECODER, hidden_size=8, intermediate_size=8)

XLM = dict(vocab_size=VOCAB, emb_dim=8, n_layers=1, n_heads=2, max_position_embeddings=16, dropout=0.0,
           attention_dropout=0.0, summary_first_dropout=0.0, pad_token_id=2, n_langs=1)
MODERNBERT = dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                  max_position_embeddings=16, pad_token_id=0, local_attention=4, global_attn_every_n_layers=1,
                  attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0, classifier_dropout=0.0)
GPT2 = dict(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_inner=8, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, pad_token_id=0, classifier_dropout=0.0)
FALCON = dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, new_decoder_architecture=False,
              multi_query=True, parallel_attn=True, bias=False, alibi=False, hidden_dropout=0.0, attention_dropout=0.0,
              pad_token_id=0)
GPT_NEOX = dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                max_position_embeddings=16, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0)
ALBERT = dict(NARROW, embedding_size=4, classifier_dropout_prob=0.0)
MOBILEBERT = dict(NARROW, embedding_size=8, true_hidden_size=8, intra_bottleneck_size=8, num_feedforward_networks=1)
FLAUBERT = dict(XLM, pre_norm=False, layerdrop=0.0)
XMOD = dict(NARROW, languages=["en_XX", "de_DE"], default_language="de_DE", **ROBERTA_TOKENS)
LUKE = dict(NARROW, **ROBERTA_TOKENS, entity_vocab_size=6, entity_emb_size=4)
IBERT = dict(NARROW, **ROBERTA_TOKENS, quant_mode=False)
XLNET = dict(vocab_size=VOCAB, d_model=8, n_layer=1, n_head=2, d_inner=8, dropout=0.0, summary_last_dropout=0.0,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)

AUTO = {"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification,
        "qa": AutoModelForQuestionAnswering, "choice": AutoModelForMultipleChoice}

# case name -> (model_type, config overrides, task)
CASES = {
    "bert-sequence": ("bert", ENCODER, "sequence"),
    "bert-token": ("bert", ENCODER, "token"),
    "bert-qa": ("bert", ENCODER, "qa"),
    "bert-choice": ("bert", ENCODER, "choice"),
    "roberta-sequence": ("roberta", dict(ENCODER, **ROBERTA_TOKENS), "sequence"),
    "roberta-token": ("roberta", dict(ENCODER, **ROBERTA_TOKENS), "token"),
    "distilbert-sequence": ("distilbert", DISTILBERT, "sequence"),
    "distilbert-qa": ("distilbert", DISTILBERT, "qa"),
    "electra-sequence": ("electra", dict(ENCODER, embedding_size=8), "sequence"),
    "electra-token": ("electra", dict(ENCODER, embedding_size=8), "token"),
    "deberta-v2-sequence": ("deberta-v2", DEBERTA_V3, "sequence"),
    "deberta-sequence": ("deberta", dict(NARROW, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                         position_biased_input=False, type_vocab_size=0, pooler_dropout=0.0),
                         "sequence"),
    "mpnet-sequence": ("mpnet", dict(NARROW, **ROBERTA_TOKENS), "sequence"),
    "gte-sequence": ("gte", dict(NARROW, pad_token_id=1), "sequence"),
    "llama-sequence": ("llama", NARROW_DECODER, "sequence"),
    "llama-token": ("llama", NARROW_DECODER, "token"),
    "qwen2-sequence": ("qwen2", NARROW_DECODER, "sequence"),
    "gemma-sequence": ("gemma", dict(NARROW_DECODER, head_dim=4), "sequence"),
    "bart-sequence": ("bart", NARROW_BART, "sequence"),
    # appended cases: heads under another prefix, seq2seq question answering, a mixture-of-experts base
    "t5-sequence": ("t5", NARROW_T5, "sequence"),
    "t5-qa": ("t5", NARROW_T5, "qa"),
    "llama-qa": ("llama", SMALL_DECODER, "qa"),
    # declared heads of the BERT and BART families, one task each (their heads are the ones above; mbart-qa
    # stands for BART question answering too: the same head on the same stacks, with pre-norm layers)
    "ernie-token": ("ernie", SMALL_ENCODER, "token"),
    "megatron-bert-qa": ("megatron-bert", SMALL_ENCODER, "qa"),
    "xlm-roberta-qa": ("xlm-roberta", dict(SMALL_ENCODER, **ROBERTA_TOKENS), "qa"),
    "camembert-token": ("camembert", dict(SMALL_ENCODER, **ROBERTA_TOKENS), "token"),
    "data2vec-text-qa": ("data2vec-text", dict(SMALL_ENCODER, **ROBERTA_TOKENS), "qa"),
    "roberta-choice": ("roberta", dict(SMALL_ENCODER, **ROBERTA_TOKENS), "choice"),
    "distilbert-choice": ("distilbert", dict(DISTILBERT, hidden_dim=16), "choice"),
    "mbart-qa": ("mbart", NARROW_BART, "qa"),
    "mixtral-sequence": ("mixtral", dict(SMALL_DECODER, num_local_experts=3,
                                         num_experts_per_tok=2), "sequence"),
    # appended at hidden 8: the T5s' token head on the encoder alone, mT5 and UMT5, question answering of more
    # decoders (Qwen2, a mixture of experts), the GPT-2 generation's token head (classifier), and the remaining
    # heads of the encoders the verification names
    "t5-token": ("t5", NARROW_T5, "token"),
    "mt5-token": ("mt5", dict(NARROW_T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False), "token"),
    "umt5-qa": ("umt5", dict(NARROW_T5, feed_forward_proj="gated-gelu"), "qa"),
    "umt5-sequence": ("umt5", dict(NARROW_T5, feed_forward_proj="gated-gelu"), "sequence"),
    "qwen2-qa": ("qwen2", NARROW_DECODER, "qa"),
    "qwen2-token": ("qwen2", NARROW_DECODER, "token"),
    "gemma-token": ("gemma", dict(NARROW_DECODER, head_dim=4), "token"),
    "qwen2-moe-qa": ("qwen2_moe", dict(NARROW_DECODER, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8,
                                       shared_expert_intermediate_size=8), "qa"),
    "gpt2-token": ("gpt2", dict(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_inner=8, n_positions=8, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, classifier_dropout=0.0), "token"),
    "distilbert-token": ("distilbert", dict(DISTILBERT, dim=8, hidden_dim=8, max_position_embeddings=8), "token"),
    "electra-qa": ("electra", dict(NARROW, embedding_size=4), "qa"),
    "deberta-v2-token": ("deberta-v2", DEBERTA_V3, "token"),
    "deberta-v2-qa": ("deberta-v2", DEBERTA_V3, "qa"),
    "deberta-v2-choice": ("deberta-v2", DEBERTA_V3, "choice"),
    "plbart-sequence": ("plbart", NARROW_BART, "sequence"),
    "mvp-qa": ("mvp", NARROW_BART, "qa"),
    "albert-sequence": ("albert", dict(NARROW, embedding_size=4, classifier_dropout_prob=0.0), "sequence"),
    "squeezebert-sequence": ("squeezebert", dict(NARROW, embedding_size=8, q_groups=2, k_groups=2, v_groups=2,
                                                 post_attention_groups=2, intermediate_groups=2, output_groups=2),
                             "sequence"),
    "rembert-token": ("rembert", dict(NARROW, input_embedding_size=4, output_embedding_size=4), "token"),
    "roberta-prelayernorm-sequence": ("roberta-prelayernorm", dict(NARROW, **ROBERTA_TOKENS), "sequence"),
    "xlm-roberta-xl-token": ("xlm-roberta-xl", dict(NARROW, **ROBERTA_TOKENS), "token"),
    "esm-token": ("esm", dict(NARROW, pad_token_id=1, mask_token_id=3, position_embedding_type="rotary",
                              token_dropout=False, emb_layer_norm_before=False), "token"),
    "mobilebert-sequence": ("mobilebert", dict(NARROW, embedding_size=8, true_hidden_size=8, intra_bottleneck_size=8,
                                               num_feedforward_networks=1), "sequence"),
    "roformer-qa": ("roformer", dict(NARROW, embedding_size=8), "qa"),
    "fnet-sequence": ("fnet", dict(NARROW, pad_token_id=3), "sequence"),
    "roc_bert-token": ("roc_bert", dict(NARROW, pronunciation_embed_dim=4, shape_embed_dim=4, pronunciation_vocab_size=8,
                                        shape_vocab_size=8), "token"),
    "big_bird-sequence": ("big_bird", dict(NARROW, attention_type="original_full"), "sequence"),
    "convbert-sequence": ("convbert", dict(NARROW, embedding_size=8, head_ratio=1, conv_kernel_size=3), "sequence"),
    # appended at hidden 8: the sequence-summary choice heads (ELECTRA: first token, projection, gelu; RoFormer and
    # ConvBERT: the last position), XLM's sequence head (FlauBERT's is the same), I-BERT (quantizer buffers in the
    # checkpoint), LUKE on words, Longformer (a window of 2 each side; global attention on the first token for
    # sequences, on the question's tokens, found by the separators, for answers and choices), ModernBERT (mean
    # pooling; the prediction head before the QA classifier), EuroBERT (late pooling), and fixtures of the decoders'
    # token and QA heads
    "electra-choice": ("electra", dict(NARROW, embedding_size=4), "choice"),
    "roformer-choice": ("roformer", dict(NARROW, embedding_size=8), "choice"),
    "xlm-sequence": ("xlm", XLM, "sequence"),
    "ibert-sequence": ("ibert", dict(NARROW, **ROBERTA_TOKENS, quant_mode=False), "sequence"),
    "luke-sequence": ("luke", dict(NARROW, **ROBERTA_TOKENS, entity_vocab_size=6, entity_emb_size=4), "sequence"),
    "modernbert-sequence": ("modernbert", dict(MODERNBERT, classifier_pooling="mean"), "sequence"),
    "modernbert-qa": ("modernbert", MODERNBERT, "qa"),
    "eurobert-sequence": ("eurobert", dict(NARROW_DECODER, mlp_bias=False), "sequence"),
    "longformer-sequence": ("longformer", dict(NARROW, **ROBERTA_TOKENS, attention_window=4), "sequence"),
    "longformer-qa": ("longformer", dict(NARROW, **ROBERTA_TOKENS, attention_window=4), "qa"),
    "longformer-choice": ("longformer", dict(NARROW, **ROBERTA_TOKENS, attention_window=4), "choice"),
    "albert-token": ("albert", dict(NARROW, embedding_size=4, classifier_dropout_prob=0.0), "token"),
    "gpt2-qa": ("gpt2", GPT2, "qa"),
    "mixtral-qa": ("mixtral", dict(NARROW_DECODER, num_local_experts=3, num_experts_per_tok=2), "qa"),
    "opt-qa": ("opt", dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, ffn_dim=8,
                           word_embed_proj_dim=8, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                           pad_token_id=1, enable_bias=True), "qa"),
    "falcon-token": ("falcon", FALCON, "token"),
    "gpt-neox-qa": ("gpt_neox", GPT_NEOX, "qa"),
    # every position a landmark (exact softmax attention, which transformers masks from a 0/1 mask), value conv 3
    "nystromformer-sequence": ("nystromformer", dict(NARROW, segment_means_seq_len=LENGTH, num_landmarks=LENGTH,
                                                     conv_kernel_size=3), "sequence"),
    "nystromformer-choice": ("nystromformer", dict(NARROW, segment_means_seq_len=LENGTH, num_landmarks=LENGTH,
                                                   conv_kernel_size=3), "choice"),
    "yoso-sequence": ("yoso", dict(NARROW, conv_window=3, **ROBERTA_TOKENS), "sequence"),
    # FunnelBaseModel (the encoder alone, its last block pooled) under the classifier; pad 0
    "funnel-sequence": ("funnel", dict(vocab_size=VOCAB, d_model=8, n_head=2, d_head=4, d_inner=8, block_sizes=[1, 1],
                                       num_decoder_layers=1, hidden_dropout=0.0, attention_dropout=0.0,
                                       activation_dropout=0.0, pad_token_id=0), "sequence"),
    # eager-only decoders, whose query rows that see no key (row 2's left padding) take a mean of the values that
    # the answer softmax over every position reads: BLOOM and MPT over all keys, GPT-Neo over its causal window
    "bloom-qa": ("bloom", dict(vocab_size=VOCAB, hidden_size=8, n_layer=2, n_head=2, hidden_dropout=0.0,
                               attention_dropout=0.0, pad_token_id=0), "qa"),
    "gpt-neo-qa": ("gpt_neo", dict(vocab_size=VOCAB, hidden_size=8, num_layers=2, num_heads=2, intermediate_size=8,
                                   attention_types=[[["global", "local"], 1]], window_size=3,
                                   max_position_embeddings=16, resid_dropout=0.0, embed_dropout=0.0,
                                   attention_dropout=0.0, pad_token_id=0), "qa"),
    "mpt-qa": ("mpt", dict(vocab_size=VOCAB, d_model=8, n_layers=2, n_heads=2, max_seq_len=16, expansion_ratio=1,
                           resid_pdrop=0.0, emb_pdrop=0.0, attn_config=dict(attn_pdrop=0), pad_token_id=0), "qa"),
    # Falcon-RW's ALiBi makes its sdpa mask a float one: the same mean there (one KV head)
    "falcon-alibi-qa": ("falcon", dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                       new_decoder_architecture=False, multi_query=True, parallel_attn=False,
                                       bias=True, alibi=True, hidden_dropout=0.0, attention_dropout=0.0,
                                       pad_token_id=0), "qa"),
    # appended at hidden 8, one layer: the other declared heads of these families, most used first
    "gpt2-sequence": ("gpt2", GPT2, "sequence"),
    "gpt-neox-token": ("gpt_neox", GPT_NEOX, "token"),
    "falcon-qa": ("falcon", FALCON, "qa"),
    "albert-qa": ("albert", ALBERT, "qa"),
    "albert-choice": ("albert", ALBERT, "choice"),
    "mobilebert-token": ("mobilebert", MOBILEBERT, "token"),
    "mobilebert-qa": ("mobilebert", MOBILEBERT, "qa"),
    "xlm-token": ("xlm", XLM, "token"),
    "xlm-qa": ("xlm", XLM, "qa"),
    "xlm-choice": ("xlm", XLM, "choice"),
    "flaubert-sequence": ("flaubert", FLAUBERT, "sequence"),
    "flaubert-token": ("flaubert", FLAUBERT, "token"),
    "flaubert-qa": ("flaubert", FLAUBERT, "qa"),
    "flaubert-choice": ("flaubert", FLAUBERT, "choice"),
    "xmod-sequence": ("xmod", XMOD, "sequence"),
    # appended at hidden 8, one layer: heads declared from transformers' table of them (tools/write_head_table.py)
    "modernbert-decoder-sequence": ("modernbert-decoder", dict(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=16, layer_types=["full_attention"], local_attention=4, pad_token_id=0,
        classifier_bias=True, tie_word_embeddings=False), "sequence"),
    "nomic_bert-sequence": ("nomic_bert", dict(NARROW, head_dim=4, pad_token_id=0), "sequence"),
    "esmc-token": ("esmc", dict(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=4, max_position_embeddings=16,
                                pad_token_id=1, mask_token_id=4, classifier_dropout=0.0), "token"),
    # XLNet's heads (the summary of the last position, padding or not)
    "xlnet-sequence": ("xlnet", XLNET, "sequence"),
    "xlnet-token": ("xlnet", XLNET, "token"),
    "xlnet-qa": ("xlnet", XLNET, "qa"),
    "xlnet-choice": ("xlnet", XLNET, "choice"),
}

# verified against transformers like the cases above, but not stored (repository size): written only when named
# with --only, and then tested like the others
SPARE_CASES = {
    "xmod-token": ("xmod", XMOD, "token"),
    "xmod-qa": ("xmod", XMOD, "qa"),
    "xmod-choice": ("xmod", XMOD, "choice"),
    "modernbert-token": ("modernbert", MODERNBERT, "token"),
    "modernbert-choice": ("modernbert", MODERNBERT, "choice"),
    "modernbert-mean-choice": ("modernbert", dict(MODERNBERT, classifier_pooling="mean"), "choice"),
    "eurobert-token": ("eurobert", dict(NARROW_DECODER, mlp_bias=False), "token"),
    "luke-token": ("luke", LUKE, "token"),
    "luke-qa": ("luke", LUKE, "qa"),
    "luke-choice": ("luke", LUKE, "choice"),
    "ibert-token": ("ibert", IBERT, "token"),
    "ibert-qa": ("ibert", IBERT, "qa"),
    "ibert-choice": ("ibert", IBERT, "choice"),
    "longformer-token": ("longformer", dict(NARROW, **ROBERTA_TOKENS, attention_window=4), "token"),
    "roformer-token": ("roformer", dict(NARROW, embedding_size=8), "token"),
    "diffllama-qa": ("diffllama", dict(NARROW_DECODER, num_key_value_heads=2), "qa"),
    "diffllama-token": ("diffllama", dict(NARROW_DECODER, num_key_value_heads=2), "token"),
    "biogpt-token": ("biogpt", dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=8, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, activation_dropout=0.0, layerdrop=0.0,
                                    pad_token_id=1), "token"),
    "gpt-bigcode-token": ("gpt_bigcode", dict(GPT2, multi_query=True), "token"),
}
CASES_AND_SPARE = {**CASES, **SPARE_CASES}


# cases whose inputs hold question / context separators
SEPARATED = ("longformer-qa", "longformer-choice")
# clean batches given to transformers with an all-ones attention mask, which means the same: transformers 5.24's
# ModernBertForMultipleChoice with mean pooling reads the mask without a default
CLEAN_WITH_MASK = ("modernbert-mean-choice",)
# appended cases whose base-model outputs no test reads: not written (repository size)
WITHOUT_BASE = ("electra-choice", "roformer-choice", "longformer-sequence", "longformer-qa", "longformer-choice",
                "modernbert-qa", "albert-token", "gpt2-qa", "mixtral-qa", "opt-qa", "falcon-token", "gpt-neox-qa",
                "ibert-sequence", "luke-sequence", "eurobert-sequence", "bloom-qa", "gpt-neo-qa", "mpt-qa",
                "falcon-alibi-qa") + tuple(n for n in list(CASES_AND_SPARE)[list(CASES_AND_SPARE).index("gpt2-sequence"):]
                                           if n != "xlnet-sequence")


def name_of(model) -> str:
    return getattr(model, "fixture_case", "")


def inputs(pad_id: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(5, VOCAB, (BATCH, LENGTH)).astype(np.int64)
    mask = np.ones((BATCH, LENGTH), np.int64)
    ids[1, -PAD_ROWS:], mask[1, -PAD_ROWS:] = pad_id, 0   # right padding
    ids[2, :PAD_ROWS], mask[2, :PAD_ROWS] = pad_id, 0     # left padding
    return ids, mask


def label_variants(task: str, rng: np.random.Generator, mask: np.ndarray) -> dict:
    if task == "sequence":
        return {"single": dict(labels=rng.integers(0, NUM_LABELS, BATCH)),
                "multi": dict(labels=rng.integers(0, 2, (BATCH, NUM_LABELS)).astype(np.float32)),
                "regression": dict(labels=rng.normal(size=(BATCH, NUM_LABELS)).astype(np.float32))}
    if task == "choice":
        return {"single": dict(labels=np.array([2, 0]))}
    if task == "token":
        labels = rng.integers(0, NUM_LABELS, (BATCH, LENGTH))
        labels[mask == 0] = -100
        labels[0, 3] = -100
        return {"single": dict(labels=labels)}
    return {"single": dict(start_positions=np.array([1, 3, 99]), end_positions=np.array([4, 3, 6]))}


def head_parameter(model, pname: str) -> bool:
    """Whether ``pname`` belongs to the task head, not to the base model (T5ForQuestionAnswering holds its stacks
    bare)."""
    return not pname.startswith(model.base_model_prefix + ".") and pname.split(".")[0] not in (
        "shared", "encoder", "decoder")


def place_separators(ids: np.ndarray, mask: np.ndarray, sep: int) -> None:
    """Three separators in each row's real tokens (the 2nd, 3rd and last): question, separators, context, as
    Longformer's question-answering and choice heads find the question by them."""
    for row in range(ids.shape[0]):
        real = np.flatnonzero(mask[row])
        ids[row, real[[1, 2, -1]]] = sep


def clean_run(model, config, task: str, rng: np.random.Generator) -> dict:
    """The "clean" variant: a batch without padding, given without an attention mask: inputs, logits, loss and
    the head's gradients (the padded batch's "single" variant holds every gradient)."""
    ids = rng.integers(5, VOCAB, (BATCH, LENGTH)).astype(np.int64)
    mask = np.ones_like(ids)
    if name_of(model) in SEPARATED:
        place_separators(ids, mask, config.sep_token_id)
    if config.is_encoder_decoder:
        ids[:, -1] = config.eos_token_id
    if task == "choice":
        ids, mask = ids[None], mask[None]
    labels = label_variants(task, rng, mask)["single"]
    if task == "token":
        labels["labels"][0, 3] = -100
    if task == "choice":
        labels = dict(labels=np.array([1]))
    model.config.problem_type = None
    model.zero_grad()
    given = {"attention_mask": torch.tensor(mask)} if name_of(model) in CLEAN_WITH_MASK else {}
    out = model(input_ids=torch.tensor(ids), **given, **{k: torch.tensor(v) for k, v in labels.items()})
    out.loss.backward()
    tensors = {"clean.input_ids": ids, "clean.loss": out.loss.detach().numpy().reshape(1)}
    tensors.update({f"clean.{k}": v for k, v in labels.items()})
    for field in ("start_logits", "end_logits") if task == "qa" else ("logits",):
        tensors[f"clean.{field}"] = getattr(out, field).detach().numpy()
    for pname, param in model.named_parameters():
        if param.grad is not None and head_parameter(model, pname):
            tensors[f"clean.grad.{pname}"] = param.grad.detach().contiguous().numpy()
    return tensors


def build(name: str) -> None:
    model_type, overrides, task = CASES_AND_SPARE[name]
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    # transformers' encoder QA heads are Linear(hidden, num_labels) split in two: num_labels is 2 there
    config = AutoConfig.for_model(model_type, num_labels=2 if task == "qa" else NUM_LABELS, **overrides)
    model = AUTO[task].from_config(config).float().eval()
    with torch.no_grad():  # larger weights than the default init, so that every gradient is clearly non-zero
        for param in model.parameters():
            if param.requires_grad:  # frozen tables keep their values (RoFormer's sinusoids)
                param.copy_(torch.randn_like(param) * 0.2)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    ids, mask = inputs(pad_id, rng)
    if name in SEPARATED:
        place_separators(ids, mask, config.sep_token_id)
    model.fixture_case = name
    if config.is_encoder_decoder:  # the sequence head reads each row's last eos token: every row ends with one
        last = np.where(mask.any(1), LENGTH - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
        ids[np.arange(BATCH), last] = config.eos_token_id
    if task == "choice":  # [2 questions, 3 choices, length]
        ids, mask = np.stack([ids, ids[::-1]]), np.stack([mask, mask[::-1]])
    tensors = {"input_ids": ids, "attention_mask": mask}
    with tempfile.TemporaryDirectory() as saved:  # the checkpoint's names, where transformers renames in memory (GTE)
        model.save_pretrained(saved)
        file_keys = set(load_file(str(Path(saved) / "model.safetensors")))
    renamed = file_keys != {n for n, _ in model.named_parameters()}
    for variant, labels in label_variants(task, rng, mask).items():
        model.config.problem_type = {"single": None, "multi": "multi_label_classification",
                                     "regression": "regression"}[variant] if task == "sequence" else None
        model.zero_grad()
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    **{k: torch.tensor(v) for k, v in labels.items()})
        out.loss.backward()
        for key, value in labels.items():
            tensors[f"{variant}.{key}"] = value
        tensors[f"{variant}.loss"] = out.loss.detach().numpy().reshape(1)
        if task == "qa":
            tensors[f"{variant}.start_logits"] = out.start_logits.detach().numpy()
            tensors[f"{variant}.end_logits"] = out.end_logits.detach().numpy()
        else:
            tensors[f"{variant}.logits"] = out.logits.detach().numpy()
        grads = {pname: param.grad for pname, param in model.named_parameters() if param.grad is not None}
        if renamed:  # gradients under the names of the checkpoint vkformers loads
            grads = in_file_layout(model, {n: grads.get(n, torch.zeros_like(p)) for n, p in model.named_parameters()},
                                   file_keys)
            buffers = {n for n, _ in model.named_buffers()}  # I-BERT's quantizer state: saved, never trained
            grads = {n: g for n, g in grads.items() if n not in buffers}
        else:
            grads = revert_weight_conversion(model, grads)  # under model.safetensors' names
        for pname, grad in grads.items():  # the other label variants: the head's gradients only
            if variant == "single" or head_parameter(model, pname):
                tensors[f"{variant}.grad.{pname}"] = grad.detach().contiguous().numpy()
    tensors.update(clean_run(model, config, task, rng))
    if name in BF16_CASES:  # the same weights in bfloat16: logits, loss and the head's gradients
        half = copy.deepcopy(model).to(torch.bfloat16)
        labels = {k.split(".", 1)[1]: torch.tensor(v) for k, v in tensors.items() if k.startswith("single.")
                  and k.split(".", 1)[1] in ("labels", "start_positions", "end_positions")}
        half.config.problem_type = None
        half.zero_grad(set_to_none=True)
        out = half(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), **labels)
        out.loss.backward()
        tensors["bf16.logits"] = out.logits.detach().float().numpy()
        tensors["bf16.loss"] = out.loss.detach().float().numpy().reshape(1)
        for pname, param in half.named_parameters():
            if not pname.startswith(half.base_model_prefix):
                tensors[f"bf16.grad.{pname}"] = param.grad.float().numpy()
    # T5ForQuestionAnswering holds no base model; WITHOUT_BASE: no test reads their base outputs
    base = getattr(model, model.base_model_prefix, None) if name not in WITHOUT_BASE else None
    if base is not None:
        flat = torch.tensor(ids.reshape(-1, LENGTH))
        extra = {"decoder_input_ids": model._shift_right(flat)} if model_type in ("t5", "mt5", "umt5") \
            and config.is_encoder_decoder else {}
        with torch.no_grad():
            out = base(input_ids=flat, attention_mask=torch.tensor(mask.reshape(-1, LENGTH)),
                       output_hidden_states=not config.is_encoder_decoder, **extra)
        tensors["base.last_hidden_state"] = out.last_hidden_state.numpy()
        if getattr(out, "pooler_output", None) is not None:
            tensors["base.pooler_output"] = out.pooler_output.numpy()
        if config.is_encoder_decoder:
            tensors["base.encoder_last_hidden_state"] = out.encoder_last_hidden_state.numpy()
        for i, hidden in enumerate(getattr(out, "hidden_states", None) or ()):
            tensors[f"base.hidden_states.{i}"] = hidden.numpy()
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    model.config.problem_type = None
    model.save_pretrained(folder)
    save_file({k: torch.tensor(np.ascontiguousarray(v)) for k, v in sorted(tensors.items())},
              str(folder / "reference.safetensors"))
    (folder / "meta.json").write_text(json.dumps({"case": name, "task": task, "model_type": model_type,
                                                  "class": type(model).__name__,
                                                  "transformers": transformers.__version__,
                                                  "torch": torch.__version__}, indent=1, sort_keys=True) + "\n")
    print(f"{name}: {type(model).__name__}, {sum((folder / f).stat().st_size for f in ('model.safetensors', 'reference.safetensors')) // 1024} KiB")


# encoder-decoder base models (AutoModel): the seq2seq parity fixtures' weights, transformers' T5Model / BartModel
SEQ2SEQ_BASE = ("t5", "bart", "marian")


def build_seq2seq_base(name: str) -> None:
    source = ROOT / "tests" / "fixtures" / "seq2seq" / name
    model = AutoModel.from_pretrained(source).float().eval()
    config = model.config
    rng = np.random.default_rng(1)
    ids, mask = inputs(config.pad_token_id, rng)
    decoder_ids = rng.integers(5, config.vocab_size, (BATCH, 5))
    tensors = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids}
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    decoder_input_ids=torch.tensor(decoder_ids), output_hidden_states=True)
    tensors["last_hidden_state"] = out.last_hidden_state.numpy()
    tensors["encoder_last_hidden_state"] = out.encoder_last_hidden_state.numpy()
    for stack in ("encoder", "decoder"):
        for i, hidden in enumerate(getattr(out, f"{stack}_hidden_states")):
            tensors[f"{stack}_hidden_states.{i}"] = hidden.numpy()
    folder = OUT / "seq2seq-base"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.tensor(np.ascontiguousarray(v)) for k, v in sorted(tensors.items())},
              str(folder / f"{name}.safetensors"), metadata={"class": type(model).__name__,
                                                             "transformers": transformers.__version__})
    print(f"seq2seq-base/{name}: {type(model).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names (seq2seq base models: seq2seq-base/NAME)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else list(CASES) + [f"seq2seq-base/{n}" for n in SEQ2SEQ_BASE]
    for name in names:
        if name.startswith("seq2seq-base/"):
            build_seq2seq_base(name.split("/", 1)[1])
        else:
            build(name)


if __name__ == "__main__":
    main()
