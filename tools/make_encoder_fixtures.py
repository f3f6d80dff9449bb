"""Write tests/fixtures/encoders/<name>/: tiny random Hugging Face masked-LM encoders plus transformers' outputs.

Each fixture is a 2-layer, hidden-32 *ForMaskedLM model built from a config alone (no network),
re-initialised from a fixed seed (tools/make_fixtures.py's reinit_), and what transformers computes
for a [2, 8] batch whose second row is right-padded by 2: logits, the masked-LM loss, every
parameter's gradient and the parameters after one AdamW step. vkformers' tests
(tests/test_encoder_parity.py) load the folder with AutoModelForMaskedLM and compare. Layout:
tests/fixtures/encoders/README.md. Needs transformers and torch (CPU):

    python tools/make_encoder_fixtures.py                  # every fixture
    python tools/make_encoder_fixtures.py --only bert,esm  # just these
    python tools/make_encoder_fixtures.py --list

Deterministic: one CPU thread, fixed seeds, sorted JSON (meta.json records the versions).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import (ADAMW, build_each, parse_fixture_args, HEADS, HIDDEN, INIT_STD, INTER, LAYERS, SEQ, VEC_STD, VOCAB,  # noqa: E402
                           check_overrides, publish, reinit_, save_reference)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "encoders"
MAX_POS = 40
RIGHT_PAD = 2
FIRST_TOKEN = 5                   # inputs use ids FIRST_TOKEN..VOCAB-1: clear of pad/bos/eos/mask ids below 5
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
B = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
         intermediate_size=INTER, max_position_embeddings=MAX_POS, initializer_range=0.2, **NO_DROPOUT)
SMALL = dict(B, hidden_size=8, num_attention_heads=2, intermediate_size=8, max_position_embeddings=16)  # size budget
ROBERTA_TOK = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)


@dataclass
class Spec:
    name: str                    # fixture folder
    model_type: str              # HF model_type
    overrides: dict
    notes: list = field(default_factory=list)
    mask_token_id: int | None = None  # put this id into the inputs at a few labelled positions (ESM token dropout)
    model_class: str | None = None    # a transformers class to use instead of AutoModelForMaskedLM's choice
    loss_by_hand: bool = False        # the class's own loss is not the masked-LM one: cross-entropy on the logits
    key_mask_4d: bool = False         # give the model the additive key mask [B, 1, 1, T] (see model_mask)


def model_mask(spec, mask):
    """The attention mask given to the model: the 0/1 mask itself, or for ``key_mask_4d`` the additive key mask
    [B, 1, 1, T] (0 / float32 min) that transformers' get_extended_attention_mask builds and passes through as it is.
    The Nyströmformer needs it: the [B, 1, T, T] mask transformers 5 makes from a 0/1 mask cannot be added to its
    landmark scores [B, H, landmarks, T]."""
    if not getattr(spec, "key_mask_4d", False):
        return mask
    return (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min


SPECS = [
    Spec("bert", "bert", dict(B), ["post-LN; absolute positions arange(T); token types; GELU head tied to the "
                                   "word embeddings + cls.predictions.bias."]),
    Spec("roberta", "roberta", dict(B, **ROBERTA_TOK),
         ["positions from padding: cumsum(ids != pad) * (ids != pad) + pad (pad 1), so real tokens start at 2; "
          "head lm_head.dense -> gelu -> layer_norm -> tied decoder + lm_head.bias."]),
    Spec("xlm-roberta", "xlm-roberta", dict(B, **ROBERTA_TOK),
         ["RoBERTa; transformers names the tied weight lm_head.decoder.weight in named_parameters, the file holds it "
          "as roberta.embeddings.word_embeddings.weight (gradients here use the file's name)."]),
    Spec("camembert", "camembert", dict(B, **ROBERTA_TOK), ["RoBERTa (as xlm-roberta)."]),
    Spec("data2vec-text", "data2vec-text", dict(B, **ROBERTA_TOK), ["RoBERTa under the data2vec_text prefix."]),
    Spec("ernie", "ernie", dict(B), ["BERT under the ernie prefix (use_task_id off)."]),
    Spec("distilbert", "distilbert", dict(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                                          hidden_dim=INTER, max_position_embeddings=MAX_POS, dropout=0.0,
                                          attention_dropout=0.0, initializer_range=0.2),
         ["no token types; q_lin/k_lin/v_lin/out_lin, sa_layer_norm, ffn.lin1/lin2, output_layer_norm; head "
          "vocab_transform -> gelu -> vocab_layer_norm -> vocab_projector (tied, own bias); LayerNorm eps 1e-12."]),
    Spec("electra", "electra", dict(B, embedding_size=16),
         ["embeddings of width 16 (embedding_size) projected to 32 by embeddings_project; generator head "
          "generator_predictions.dense (32 -> 16) -> gelu -> LayerNorm -> generator_lm_head tied (16 -> 48)."]),
    Spec("albert", "albert", dict(B, embedding_size=16),
         ["factorised embeddings (16) mapped to hidden by encoder.embedding_hidden_mapping_in; ONE layer group "
          "shared by both layers (gradients of the shared block sum two uses); gelu_new; head predictions.dense "
          "(32 -> 16) -> gelu_new -> LayerNorm -> tied decoder + predictions.bias."]),
    Spec("roberta-prelayernorm", "roberta-prelayernorm", dict(B, **ROBERTA_TOK),
         ["pre-LN: attention.LayerNorm before self-attention, intermediate.LayerNorm before the MLP, final "
          "roberta_prelayernorm.LayerNorm; embeddings keep their LayerNorm."]),
    Spec("megatron-bert", "megatron-bert", dict(B),
         ["pre-LN BERT: no embedding LayerNorm, attention.ln / ln before the sublayers, encoder.ln at the end."]),
    Spec("xlm-roberta-xl", "xlm-roberta-xl", dict(B, **ROBERTA_TOK),
         ["pre-LN RoBERTa without embedding LayerNorm (attention.self_attn_layer_norm, LayerNorm, "
          "encoder.LayerNorm); type_vocab_size 1."]),
    Spec("rembert", "rembert", dict(B, input_embedding_size=16, output_embedding_size=40),
         ["input embeddings of width 16 mapped to 32 (encoder.embedding_hidden_mapping_in); UNTIED head "
          "cls.predictions.dense (32 -> 40) -> gelu -> LayerNorm -> decoder (40 -> 48, own bias)."]),
    Spec("roformer", "roformer", dict(B),
         ["no absolute positions: interleaved rotary (pairs 2i, 2i+1) on q and k from the sinusoid table "
          "encoder.embed_positions (a frozen parameter: restored to its sinusoids after the random re-init, "
          "no gradient, no AdamW update)."]),
    Spec("esm", "esm", dict(B, pad_token_id=1, mask_token_id=4, token_dropout=True, position_embedding_type="rotary",
                            emb_layer_norm_before=False),
         ["ESM-2 layout: rotate_half rotary on arange positions, query scaled before rotation; token dropout "
          "(mask token 4 appears in the inputs: its embedding is zeroed and the row rescaled by 0.88 / (1 - mask "
          "ratio)); embeddings zeroed at padding; pre-LN with emb_layer_norm_after; contact head unused by the "
          "MLM loss (no gradient)."], mask_token_id=4),
    Spec("esm_absolute", "esm", dict(B, pad_token_id=1, mask_token_id=4, token_dropout=False,
                                     position_embedding_type="absolute", emb_layer_norm_before=True),
         ["ESM-1b layout: absolute positions counted from padding (as RoBERTa), embedding LayerNorm, no token "
          "dropout."]),
    Spec("nomic_bert", "nomic_bert", dict(B),
         ["post-LN; bias-free q/k/v/o_proj; SwiGLU MLP (gate/up/down, no bias, silu); rotate_half rotary with "
          "rope_parameters (theta 1000); no position table; head transform act is hidden_act (silu), "
          "cls.predictions.transform.layer_norm."]),
    Spec("big_bird", "big_bird", dict(B, attention_type="original_full", sep_token_id=3),
         ["attention_type 'original_full' (block-sparse attention is not implemented by vkformers and refused): "
          "BERT under the bert prefix with gelu_new; pooler (bert.pooler) unused by the MLM loss."]),
    Spec("roc_bert", "roc_bert", dict(B, shape_vocab_size=10, pronunciation_vocab_size=12, shape_embed_dim=8,
                                      pronunciation_embed_dim=8),
         ["concat_input: map_inputs_layer([word; shape_embed(0); pronunciation_embed(0)]) + token types + "
          "positions -> LayerNorm; shape/pronunciation ids default to 0 = pad_token_id, so those tables get no "
          "gradient (nn.Embedding padding_idx)."]),
    Spec("jina_embeddings_v3", "jina_embeddings_v3", dict(B, **ROBERTA_TOK),
         ["post-LN; no position table: rotate_half rotary (rope theta 20000) on q and k; type_vocab_size 1; "
          "RoBERTa's lm_head (dense -> gelu -> layer_norm -> tied decoder + lm_head.bias); LayerNorm eps 1e-5."]),
    Spec("xlm", "xlm", dict(vocab_size=VOCAB, emb_dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                            max_position_embeddings=MAX_POS, dropout=0.0, attention_dropout=0.0),
         ["post-LN; parts in per-layer lists (attentions.i.q_lin, layer_norm1.i, ffns.i.lin1, layer_norm2.i); "
          "FFN 4 x emb_dim, gelu; hidden states zeroed at padding after the embeddings and every layer; head "
          "pred_layer.proj tied with its own bias; pad 2; one language (no lang embeddings)."]),
    Spec("flaubert", "flaubert", dict(vocab_size=VOCAB, emb_dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                                      max_position_embeddings=MAX_POS, dropout=0.0, attention_dropout=0.0,
                                      pre_norm=False, layerdrop=0.0),
         ["XLM's layout under flaubert (post-LN, as flaubert-base). pre_norm=True is not fixtured: transformers "
          "5.24's FlaubertModel fails on it (it indexes its EncoderDecoderCache per layer), so vkformers refuses it."]),
    Spec("eurobert", "eurobert", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=INTER,
                                      max_position_embeddings=MAX_POS, pad_token_id=1, bos_token_id=0,
                                      eos_token_id=2, mask_token_id=4, initializer_range=0.2),
         ["Llama layout, bidirectional: RMSNorm pre-norm, grouped-query attention (4 q heads, 2 kv heads), "
          "SwiGLU, rotate_half rotary; final model.norm; bare untied lm_head without bias."]),
    Spec("esmc", "esmc", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, intermediate_size=INTER, max_position_embeddings=MAX_POS,
                              initializer_range=0.2, mask_token_id=4),
         ["pre-LN (LayerNorm with bias), bias-free LayerNorms over the full q / k projections, rotary, SwiGLU, "
          "sublayer outputs divided by sqrt(2 / 36); final esmc.norm without bias; untied head dense -> gelu -> "
          "LayerNorm -> decoder (bias)."]),
    Spec("modernbert", "modernbert", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                          num_attention_heads=HEADS, intermediate_size=INTER,
                                          max_position_embeddings=MAX_POS, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2, cls_token_id=1, sep_token_id=2, local_attention=4,
                                          initializer_range=0.2),
         ["pre-LN without norm biases, layer 0 without attn_norm, fused Wqkv, GeGLU Wi = [input; gate]; "
          "layer 0 full attention (rope theta 160000), layer 1 sliding: keys with |i - j| <= local_attention / 2 "
          "= 2 (rope theta 10000); head dense -> gelu -> norm -> tied decoder (bias)."]),
    Spec("bert-generation", "bert-generation", dict(B, pad_token_id=0, bos_token_id=2, eos_token_id=1),
         ["BertGenerationDecoder with is_decoder=False (transformers maps no masked-LM class to bert-generation; "
          "this is its encoder + LM head, run bidirectionally): BERT without token types, head a bare tied "
          "lm_head.decoder whose bias is lm_head.bias. Its own loss shifts labels (causal LM), so the reference loss "
          "is the masked-LM one computed here from its logits: cross-entropy over labels != -100, no shift."],
         model_class="BertGenerationDecoder", loss_by_hand=True),
    Spec("deberta-v2", "deberta-v2", dict(SMALL, relative_attention=True, position_buckets=4, max_relative_positions=-1,
                                          pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
                                          position_biased_input=False, type_vocab_size=0, pad_token_id=0),
         ["DeBERTa-v3 layout: no absolute positions; disentangled attention q k^T + c2p + p2c over a LayerNorm'd "
          "table of relative-position embeddings (encoder.rel_embeddings, 2 x 4 rows) projected by the layer's own "
          "query/key projections (share_att_key); log buckets beyond +-2 (position_buckets 4, max_relative_positions "
          "= max_position_embeddings 16), clamped to the table; scale 1 / sqrt(4 * 3) (hidden 8, 2 heads); embeddings zeroed at padding "
          "after their LayerNorm; legacy head cls.predictions (BERT's). transformers masks padded query rows too; "
          "their logits are not compared."]),
    Spec("deberta-v2_unshared", "deberta-v2", dict(SMALL, num_hidden_layers=1, relative_attention=True,
                                                   max_relative_positions=3, pos_att_type=["c2p", "p2c"],
                                                   share_att_key=False, position_biased_input=True,
                                                   type_vocab_size=2, pad_token_id=0),
         ["DeBERTa-v2 layout, one layer: absolute positions and token types added to the embeddings; own "
          "pos_key_proj / pos_query_proj; no buckets, span max_relative_positions 3 (distances past it clamp to "
          "the table's ends); the table not normed."]),
    Spec("deberta", "deberta", dict(SMALL, num_hidden_layers=1, relative_attention=True, max_relative_positions=-1,
                                    pos_att_type=["c2p", "p2c"], position_biased_input=False, type_vocab_size=0,
                                    pad_token_id=0),
         ["DeBERTa (v1, deberta-base layout), one layer: bias-free in_proj holding [q_h; k_h; v_h] head by head, q_bias and "
          "v_bias; c2p through pos_proj (no bias), p2c through pos_q_proj; table of 2 x 16 rows "
          "(max_relative_positions = max_position_embeddings) of which the middle 2 x min(8, 16) are read; no "
          "absolute positions; legacy head cls.predictions."]),
    Spec("mpnet", "mpnet", dict(SMALL, num_hidden_layers=1, **ROBERTA_TOK),
         ["RoBERTa's embeddings (positions from padding 1, no token types) and lm_head; attention.attn.q/k/v/o, "
          "attention.LayerNorm; a per-head bias of T5-style bidirectional buckets (32, max distance 128) of key - "
          "query from encoder.relative_attention_bias (one layer here; every layer adds the same bias)."]),
    Spec("gte", "gte", dict(SMALL, num_hidden_layers=1, pad_token_id=1),
         ["one layer, post-LN; rotate_half rotary (rope theta 160000), no position table; one token type; fused "
          "biased attention.qkv_proj; bias-free mlp.up_gate_proj = [up; gate], down(gelu(gate) * up) with a biased "
          "down_proj; head lm_head.dense -> gelu -> lm_head.norm -> tied decoder with its own bias."]),
    Spec("ibert", "ibert", dict(SMALL, num_hidden_layers=1, max_position_embeddings=12, quant_mode=False,
                                **ROBERTA_TOK),
         ["one layer, quant_mode off: RoBERTa under the ibert prefix; the file also holds the quantizers' buffers "
          "(act_scaling_factor, x_min/x_max, weight_integer, ...), which the float forward never reads."]),
    Spec("squeezebert", "squeezebert", dict(SMALL, num_hidden_layers=1, embedding_size=8, q_groups=2, k_groups=4,
                                            v_groups=1, post_attention_groups=2, intermediate_groups=4,
                                            output_groups=2),
         ["one layer, BERT's post-LN block under transformer.encoder.layers whose projections are Conv1d of kernel 1 "
          "with channel groups (q 2, k 4, v 1, post_attention 2, intermediate 4, output 2; weights [out, in / "
          "groups, 1]); the pooler is unused by the MLM loss."]),
    Spec("xmod", "xmod", dict(SMALL, num_hidden_layers=1, languages=["en_XX", "de_DE"], default_language="de_DE",
                              **ROBERTA_TOK),
         ["one layer, XLM-R with language adapters: after the MLP's residual, LayerNorm, then the de_DE adapter "
          "(dense1 8 -> 4, gelu, dense2) plus the normed state, then the same LayerNorm again; the en_XX adapter runs "
          "on no rows: a zero gradient (so AdamW's weight decay still steps it)."]),
    Spec("fnet", "fnet", {k: v for k, v in dict(SMALL, num_hidden_layers=1).items()
                          if k not in ("num_attention_heads", "attention_probs_dropout_prob")},
         ["one layer: attention replaced by Re(FFT2) over positions and hidden (torch.fft.fftn), "
          "fourier.output.LayerNorm; embeddings (4 token types) LayerNorm'd then projected; gelu_new; pad 3. FNet "
          "reads no attention mask: the padded row's pad tokens mix into its real positions (the reference is what "
          "transformers computes so). Pooler unused."]),
    Spec("longformer", "longformer", dict(SMALL, attention_window=[4, 6], sep_token_id=2, **ROBERTA_TOK),
         ["two layers, RoBERTa's layout with sliding-window attention: keys within 2 (layer 0) and 3 (layer 1) "
          "positions on both sides; transformers pads the batch to a multiple of the window internally; no global "
          "attention, so the *_global projections get no gradient."]),
    Spec("mobilebert", "mobilebert", dict(SMALL, num_hidden_layers=1, embedding_size=4, intra_bottleneck_size=4,
                                          num_feedforward_networks=2),
         ["one layer: trigram embeddings of width 4 mapped to 8 (embedding_transformation), positions, token types, "
          "NoNorm; the block at width 4: input bottleneck, shared q/k bottleneck, v from the block input, attention "
          "output + NoNorm, one extra FFN, the last FFN, output bottleneck back to 8 (residual: the block input); "
          "relu; head transform with a LayerNorm, logits h @ [word_embeddings^T; cls.predictions.dense.weight] + "
          "cls.predictions.bias."]),
    Spec("luke", "luke", dict(SMALL, num_hidden_layers=1, entity_vocab_size=6, entity_emb_size=4, **ROBERTA_TOK),
         ["one layer, word tokens only: RoBERTa's layout under luke with an untied lm_head.decoder (own bias); the "
          "entity embeddings, entity-aware queries (w2e/e2w/e2e), entity prediction head and pooler do not run "
          "without entity inputs (no gradient)."]),
    Spec("convbert", "convbert", dict(SMALL, num_hidden_layers=1, embedding_size=4, conv_kernel_size=3),
         ["one layer: embeddings of width 4 projected to 8; head_ratio 2 leaves one attention head of size 4 beside "
          "one dynamic-convolution head (kernel 3: separable convolution of the input times the query -> softmax "
          "weights over 3 neighbours of conv_out_layer, zeros past the ends, padding not masked); generator head "
          "8 -> 4 tied."]),
    Spec("nystromformer", "nystromformer", dict(SMALL, segment_means_seq_len=SEQ, num_landmarks=4, conv_kernel_size=3),
         ["two layers, 4 landmarks (means of segments of 2) over the 8 positions: softmax(q kl^T) pinv(softmax(ql "
          "kl^T)) softmax(ql k^T + mask) v, pinv 6 Newton-Schulz steps from A^T / (largest column sum over the "
          "batch), plus a depthwise convolution (kernel 3 per head) of the values, padding not masked; positions "
          "from row 2 of an 18-row table; gelu_new. The model is given the additive key mask [2, 1, 1, 8] "
          "(key_mask_4d): transformers 5's own [2, 1, 8, 8] mask does not broadcast onto the landmark scores."],
         key_mask_4d=True),
    Spec("yoso", "yoso", dict(SMALL, conv_window=3, **ROBERTA_TOK),
         ["two layers, expectation mode (use_expectation, transformers' CPU path; LSH sampling needs its CUDA "
          "kernels): normalize((1 - acos(q^ k^T) / pi) ** 9 v) with unit q^, k^, gradients through YOSO's surrogate "
          "(dq = ((dY v^T) * E) k * 9 / 2, ...); no attention mask there (transformers' int(1 + mask / 10000) is 1 "
          "everywhere: the padded row's pad tokens are attended); plus a depthwise convolution (kernel 3 per head) of "
          "the values times the mask; positions from row 2 of an 18-row table; one token type."]),
    Spec("funnel", "funnel", dict(vocab_size=VOCAB, d_model=8, n_head=2, d_head=4, d_inner=8, block_sizes=[1, 1],
                                  block_repeats=[1, 2], num_decoder_layers=1, hidden_dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0),
         ["two blocks of one layer (the second's run twice: block_repeats 2), d_model 8, 2 heads of 4: the second "
          "block's first run attends from the 4 pooled positions ([CLS], then means of pairs) to all 8, its second "
          "within the 4; relative-shift attention through the sinusoid table of distances, token-type terms, "
          "[CLS] row and column without them, padded keys at -1e6; decoder: the 4 positions repeated to 8 plus the "
          "first block's output, one layer; lm_head tied to the word embeddings (own bias); gelu_new; no pad id (the "
          "batch pads with id 0, an ordinary token to the word embedding)."]),
]


def make_inputs(config, mask_token_id=None):
    """ids [2, 8] (row 1 right-padded by 2 with the pad id), mask, labels (-100 at padding and unlabelled
    positions), token types (two segments) when the model has them."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(FIRST_TOKEN, VOCAB, (2, SEQ), generator=g, dtype=torch.int64)
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    ids[1, SEQ - RIGHT_PAD:] = pad
    mask[1, SEQ - RIGHT_PAD:] = 0
    labelled = torch.rand((2, SEQ), generator=g) < 0.6
    labelled &= mask.bool()
    labels = torch.where(labelled, torch.randint(FIRST_TOKEN, VOCAB, (2, SEQ), generator=g), -100)
    if mask_token_id is not None:  # masked-LM inputs: a few labelled positions hold the mask token
        ids[0, 1] = ids[0, 4] = ids[1, 2] = mask_token_id
        labels[0, 1], labels[0, 4], labels[1, 2] = 7, 9, 11
    types = torch.zeros(2, SEQ, dtype=torch.int64)
    if getattr(config, "type_vocab_size", 0) and config.type_vocab_size >= 2:
        types[0, SEQ // 2:] = 1
        types[1, 3:SEQ - RIGHT_PAD] = 1
    return ids, mask, labels, types


def _restore_fixed_tables(model):
    """Tables that are fixed functions, not weights (RoFormer's sinusoids): back to their values after reinit_."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "create_weight") and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.weight.copy_(module.create_weight())


def _modern(name: str) -> str:
    """The file's TF-era spelling that transformers still writes for some models (ESM: LayerNorm.gamma / .beta)
    as transformers (and vkformers) load it: LayerNorm.weight / .bias."""
    if name.endswith("LayerNorm.gamma"):
        return name[:-len("gamma")] + "weight"
    if name.endswith("LayerNorm.beta"):
        return name[:-len("beta")] + "bias"
    return name


def in_file_layout(model, tensors: dict, file_keys: set) -> dict:
    """Per-parameter tensors (keyed like named_parameters()) as the checkpoint file lays them out: the model,
    holding them as its parameters, is saved by transformers itself, so renames, fused projections (NomicBERT's
    attn.Wqkv) and tied weights come out exactly as in model.safetensors (whose keys are ``file_keys``). Buffers
    the file also holds (ESM writes its rotary ``inv_freq`` under a literal '*' layer name) are left out."""
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad(), tempfile.TemporaryDirectory() as folder:
        for n, p in model.named_parameters():
            p.copy_(tensors[n])
        model.save_pretrained(folder)
        out = {_modern(k): v.clone() for k, v in load_file(str(Path(folder) / "model.safetensors")).items()
               if k in file_keys and not k.endswith("inv_freq")}
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return out


def build(spec: Spec, out_root: Path):
    out = out_root / spec.name
    if out.exists():
        shutil.rmtree(out)
    torch.manual_seed(0)
    config = CONFIG_MAPPING[spec.model_type](**spec.overrides)
    auto = getattr(transformers, spec.model_class) if spec.model_class else AutoModelForMaskedLM
    if spec.model_class:
        model = auto._from_config(config, attn_implementation="eager", dtype=torch.float32).float().eval()
    else:
        model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32).float().eval()
    issues = check_overrides(model.config, spec.overrides)
    reinit_(model)
    _restore_fixed_tables(model)

    tmp = out_root / (spec.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    # buffers the file also holds (I-BERT's quantizer state) are no parameters: no gradient, no AdamW step
    file_keys = set(load_file(str(tmp / "model.safetensors"))) - {n for n, _ in model.named_buffers()}
    params = dict(model.named_parameters())

    ids, mask, labels, types = make_inputs(model.config, spec.mask_token_id)
    has_types = any(n.endswith("token_type_embeddings.weight") for n in params)
    kwargs = dict(token_type_ids=types) if has_types else {}
    if spec.loss_by_hand:
        out_fwd = model(input_ids=ids, attention_mask=model_mask(spec, mask), **kwargs)
        out_fwd.loss = torch.nn.functional.cross_entropy(out_fwd.logits.reshape(-1, out_fwd.logits.shape[-1]),
                                                         labels.reshape(-1), ignore_index=-100)
    else:
        out_fwd = model(input_ids=ids, attention_mask=model_mask(spec, mask), labels=labels, **kwargs)
    logits = out_fwd.logits.detach().float()
    out_fwd.loss.backward()
    ref = {"input_ids": ids.to(torch.int32), "attention_mask": mask.to(torch.int32), "labels": labels.to(torch.int32),
           "logits": logits.contiguous(), "loss": out_fwd.loss.detach().float().reshape(())}
    if has_types:
        ref["token_type_ids"] = types.to(torch.int32)
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().float() for n, p in params.items()}
    without_grad = in_file_layout(model, {n: torch.full_like(p, float(p.grad is None)) for n, p in params.items()},
                                  file_keys)
    no_grad = sorted(n for n, t in without_grad.items() if bool((t == 1).all()))
    file_grads = in_file_layout(model, grads, file_keys)
    ref.update({f"grad.{n}": t.contiguous() for n, t in file_grads.items()})

    with torch.no_grad():  # the saved folder reproduces the logits when transformers reloads it
        reloaded = auto.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32).eval()
        reload_diff = (reloaded(input_ids=ids, attention_mask=model_mask(spec, mask), **kwargs).logits - logits)[mask.bool()].abs().max()

    opt = torch.optim.AdamW(list(params.values()), foreach=False, **ADAMW)
    opt.step()
    stepped = in_file_layout(model, {n: p.detach().clone() for n, p in params.items()}, file_keys)
    ref.update({f"adamw.{n}": t.contiguous() for n, t in stepped.items()})
    for k, v in ref.items():
        if not torch.isfinite(v.float()).all():
            raise RuntimeError(f"non-finite values in {k}")
    save_reference(ref, tmp)

    meta = {
        "fixture": spec.name,
        "model_type": spec.model_type,
        "model_class": type(model).__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "config_overrides": spec.overrides,
        "config_override_issues": issues,
        "attn_implementation": "eager",
        "init": f"after construction (torch.manual_seed(0)): params with ndim>=2 = N(0,{INIT_STD}), "
                f"1-D params += N(0,{VEC_STD}), generator seed 1234, named_parameters() order "
                "(tools/make_fixtures.reinit_); fixed sinusoid tables restored afterwards",
        "adamw": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                  "weight_decay": ADAMW["weight_decay"], "foreach": False},
        "notes": spec.notes,
        "num_parameters": sum(p.numel() for p in params.values()),
        "parameters": sorted(file_grads),
        "parameters_in_memory": sorted(params),
        "token_type_ids": has_types,
        "params_without_grad": sorted(no_grad),
        "checks": {
            "loss": round(out_fwd.loss.item(), 6),
            "logits_std": round(logits[mask.bool()].std().item(), 4),
            "labelled_positions": int((labels != -100).sum()),
            "reloaded_logits_max_abs_diff": float(f"{reload_diff.item():.3g}"),
        },
    }
    return publish(tmp, out, meta)


def main(argv=None):
    parsed = parse_fixture_args(argv, SPECS, DEFAULT_OUT, name_width=22)
    if parsed is None:
        return 0
    args, out_root, only = parsed
    _, failed = build_each(SPECS, only, out_root, build, verbose=args.verbose,
                           summary=lambda meta: (f"loss={meta['checks']['loss']:.4f} std={meta['checks']['logits_std']} "
                                                 f"reload_diff={meta['checks']['reloaded_logits_max_abs_diff']} issues={meta['config_override_issues']}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
