"""Write tests/fixtures/seq2seq/<name>/: tiny random Hugging Face encoder-decoders plus transformers' own outputs.

Each fixture is a *ForConditionalGeneration model (d_model 32, 2 encoder + 2 decoder layers, 4 heads,
feed-forward 24, vocab 48, float32, eager attention) built from a config alone (no network), re-initialised
from a fixed seed (tools/make_fixtures.py's reinit_), saved with save_pretrained, and the outputs
transformers computes for it: logits and loss for labels, every parameter's gradient, the parameters
after one AdamW step, and an 8-token greedy continuation (eos disabled). vkformers' tests
(tests/test_seq2seq_parity.py) load the folder with AutoModelForSeq2SeqLM and compare. Layout:
tests/fixtures/seq2seq/README.md. Needs transformers and torch (CPU):

    python tools/make_seq2seq_fixtures.py                    # every fixture, into tests/fixtures/seq2seq
    python tools/make_seq2seq_fixtures.py --only t5,bart     # just these
    python tools/make_seq2seq_fixtures.py --list

Deterministic: one CPU thread, fixed seeds, sorted JSON (meta.json records the versions).
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from make_fixtures import (ADAMW, build_each, parse_fixture_args, BOS, EOS, HEADS, HIDDEN, INIT_STD, INTER, LAYERS, PAD, VEC_STD, VOCAB,  # noqa: E402
                           check_overrides, publish, reinit_, save_reference)
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForSeq2SeqLM, GenerationConfig  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "seq2seq"

SEQ = 8                          # encoder tokens
RIGHT_PAD = 2                    # row 1: 6 tokens then 2 pads
TARGET = 6                       # label tokens
NEW_TOKENS = 8
POSITIONS = 24                   # learned position tables: >= 8 encoder and 1 + 8 decoder positions
FINAL_LOGITS_BIAS_STD = 0.1      # BART-style final_logits_bias buffers (zeros by default) get noise, so they show

TOK = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
# BART-style config names
B = dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
         encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=INTER, decoder_ffn_dim=INTER,
         max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
         init_std=0.2, **TOK)
# T5-style config names
T = dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTER, num_layers=LAYERS,
         num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
         relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=PAD, **TOK)

# Smaller T5-style sizes for the newer fixtures (the size budget): d_model 8, 2 heads, 2 encoder / 1 decoder layers
SMALL_VOCAB = 24  # the newer fixtures' vocabulary (inputs and labels 3..23)
T_SMALL = dict(T, vocab_size=SMALL_VOCAB, d_model=8, d_kv=4, num_heads=2, d_ff=12, num_decoder_layers=1)

# Smaller BART-style sizes (the size budget): d_model 8, 2 heads, feed-forward 12, 1 encoder / 1 decoder layer
B_SMALL = dict(B, vocab_size=SMALL_VOCAB, d_model=8, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=12,
               decoder_ffn_dim=12, encoder_layers=1, decoder_layers=1)

# T5Gemma stack (T5GemmaModuleConfig) names: GQA 4 query / 2 key-value heads, windows and soft-capping that show
G = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
         num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HIDDEN // HEADS, max_position_embeddings=128,
         sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=2.0,
         dropout_rate=0.0, **TOK)


def nllb_moe_top2_experts(model) -> None:
    """transformers 5.24's NllbMoeExperts.forward one-hot encodes the router's top-1 *mask* instead of the chosen
    experts' indices, so it runs expert_1 on each token's first choice and expert_0 on its second, whatever the
    router chose. Replaced here by the mixture the router's combining weights describe (fairseq's): each expert on the
    tokens whose weight for it is nonzero, output times that weight (times 1 - moe_token_dropout in eval mode),
    summed. The router, capacity and everything else stay transformers'."""
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeExperts

    def forward(self, hidden_states, router_mask, router_probs):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            rows = torch.nonzero(router_probs[:, e] != 0).flatten()
            if rows.numel() == 0:
                continue
            y = self[f"expert_{e}"](hidden_states[rows]) * router_probs[rows, e, None]
            if self.moe_token_dropout > 0:
                y = self.token_dropout(y) if self.training else y * (1 - self.moe_token_dropout)
            out.index_add_(0, rows, y.to(hidden_states.dtype))
        return out

    for module in model.modules():
        if isinstance(module, NllbMoeExperts):
            module.forward = forward.__get__(module)


REFERENCE_FIXES = {"nllb_moe_top2_experts": nllb_moe_top2_experts}


def apply_reference_fix(model, spec) -> None:
    if spec.reference_fix:
        REFERENCE_FIXES[spec.reference_fix](model)


@dataclass
class Spec:
    name: str                    # fixture folder
    model_type: str              # HF model_type
    overrides: dict
    notes: list = field(default_factory=list)
    labels_shifted_here: bool = False  # pass decoder_input_ids = prepare_decoder_input_ids_from_labels(labels):
    #                                    FSMT's forward shifts input_ids, not labels, when they are missing
    untied_lm_head: bool = False  # write a distinct lm_head.weight into the checkpoint and reload: transformers
    #                               5.24 ties T5's lm_head unless the checkpoint holds a different one (T5 v1.1)
    forward_kwargs: dict = field(default_factory=dict)  # extra arguments of the reference forward (use_cache)
    reference_fix: str = ""  # a key of REFERENCE_FIXES: a transformers bug corrected in the reference model
    global_tokens: tuple = ()  # (row, position) pairs with global attention: the reference forward takes a
    #                            global_attention_mask (saved in reference.safetensors); greedy decoding does not
    text_only: tuple = ()  # parameter prefixes of modules a text-only forward never runs (T5Gemma 2's vision
    #                        tower): kept in the checkpoint, left out of the reference's parameters


SPECS = [
    Spec("t5", "t5", dict(T), ["original T5: ReLU feed-forward, lm_head tied to shared with the d_model**-0.5 "
                               "rescale; relative position bias from 8 buckets (max_distance 16) in layer 0, "
                               "shared by the other layers; no attention scaling."]),
    Spec("mt5", "mt5", dict(T), ["mT5: gated-gelu; transformers 5.24 ties lm_head and never rescales mT5's output."]),
    Spec("umt5", "umt5", dict(T, tie_word_embeddings=False),
         ["umT5: every layer has its own relative_attention_bias; gated-gelu; untied lm_head (distinct in the "
          "checkpoint, as in T5 v1.1 / flan-t5 / umT5 releases), no output rescale (scale_decoder_outputs false)."],
         untied_lm_head=True),
    Spec("switch_transformers", "switch_transformers",
         dict(T, num_experts=4, expert_capacity=3, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
         ["Switch Transformers: T5 with layer 1 of each stack a sparse top-1 mixture of 4 relu experts (router "
          "softmax in float32, output times the chosen probability); expert_capacity 3 per sequence, so some of "
          "the 8 encoder / 6 decoder tokens overflow and skip the feed-forward; tied lm_head with the rescale; "
          "the loss is the cross-entropy only (no output_router_logits). Router jitter noise applies only in "
          "training mode, so not here."]),
    Spec("t5gemma", "t5gemma", dict(encoder=dict(G, layer_types=["full_attention", "sliding_attention"]),
                                    decoder=dict(G), vocab_size=VOCAB, dropout_rate=0.0),
         ["T5Gemma (T5GemmaForConditionalGeneration): Gemma 2 stacks with (1 + w) RMSNorms before and after each "
          "sublayer, rotary self-attention (bidirectional in the encoder), GQA 4 query / 2 key-value heads (cross-"
          "attention too), query_pre_attn_scalar 24, attention and final soft-capping lowered to 2.0, sliding window "
          "4 (encoder: layer 1, |i - j| <= 4; decoder: layer 0, i - 4 < j <= i), GeGLU (gelu_pytorch_tanh), "
          "embeddings scaled by sqrt(hidden); separate encoder / decoder embeddings, lm_head.out_proj tied to the "
          "decoder's. Labels shift with decoder.bos_token_id first. Reference forward with use_cache=False: the "
          "decoder then ignores the pad decoder tokens (shifted -100 labels), as transformers does when training "
          "(in eval with its cache it would not)."], forward_kwargs=dict(use_cache=False)),
    Spec("bart", "bart", dict(B, decoder_start_token_id=EOS),
         ["post-LN; learned positions with offset 2; layernorm_embedding; gelu; final_logits_bias; tied."]),
    Spec("mbart", "mbart", dict(B, decoder_start_token_id=EOS),
         ["pre-LN with final encoder/decoder layer_norm; layernorm_embedding; learned positions offset 2; labels "
          "shift with the last non-pad token wrapped to the front (mBART's language id)."]),
    Spec("marian", "marian", dict(B, decoder_vocab_size=VOCAB, decoder_start_token_id=PAD, scale_embedding=True,
                                  activation_function="swish"),
         ["post-LN; fixed sinusoidal positions (sin | cos halves, from 0), a frozen parameter; scale_embedding; "
          "swish; no layernorm_embedding; final_logits_bias."]),
    Spec("pegasus", "pegasus", dict(B, decoder_start_token_id=PAD, scale_embedding=True),
         ["pre-LN with final layer_norm; fixed sinusoidal positions (frozen parameter); scale_embedding."]),
    Spec("pegasus_x", "pegasus_x", dict(B, decoder_start_token_id=PAD, num_global_tokens=2, block_size=16,
                                        stagger_local_blocks=True),
         ["PEGASUS-X with one local block covering the input: block_size 16 with staggered odd layers (shifted by "
          "8), so the 8 input tokens stay in one block and block-local attention is full attention over [2 global "
          "tokens; input]; global tokens have their own pre-attention norm; pre-LN; sinusoidal positions "
          "(fairseq formula, from 0); no attention biases; scale_embedding; no final_logits_bias."]),
    Spec("bigbird_pegasus", "bigbird_pegasus", dict(B, attention_type="original_full", decoder_start_token_id=PAD),
         ["BigBird-Pegasus with attention_type original_full (block_sparse is refused): pre-LN; learned positions "
          "from 0; scale_embedding (default true); gelu_new; no q/k/v/o biases (use_bias false, the default), fc1/fc2 "
          "with biases; each stack ends in a norm named layernorm_embedding; the encoder's self-attention is "
          "self_attn.self.query/key/value + self_attn.output, the decoder's BART's; final_logits_bias; tied."]),
    Spec("blenderbot-small", "blenderbot-small", dict(B, decoder_start_token_id=BOS),
         ["post-LN; learned positions without offset; layernorm_embedding (decoder: on the token embeddings "
          "before the positions are added)."]),
    Spec("blenderbot", "blenderbot", dict(B, decoder_start_token_id=BOS),
         ["pre-LN with final layer_norm; learned positions without offset; no layernorm_embedding."]),
    Spec("plbart", "plbart", dict(B, decoder_start_token_id=EOS),
         ["BART layout with scale_embedding (default true); labels shift with the last non-pad token wrapped."]),
    Spec("mvp", "mvp", dict(B, decoder_start_token_id=EOS),
         ["MVP without prompts (use_prompt false): the BART layout."]),
    Spec("m2m_100", "m2m_100", dict(B, decoder_start_token_id=EOS),
         ["pre-LN with final layer_norm; fairseq sinusoidal positions (offset 2, padding row zero) counted over "
          "non-pad tokens from input_ids; scale_embedding; relu; no final_logits_bias."]),
    Spec("fsmt", "fsmt", dict({k: v for k, v in B.items() if k != "vocab_size"}, src_vocab_size=VOCAB + 8,
                              tgt_vocab_size=VOCAB, langs=["en", "de"], decoder_start_token_id=EOS),
         ["FSMT: post-LN, no layernorm_embedding, no final_logits_bias; separate source (56) and target (48) "
          "vocabularies, untied output_projection; positions over non-pad tokens read from embed_positions.weight, "
          "which transformers 5.24 trains (a parameter; re-initialised here like the others, so the checkpoint's "
          "table is what counts); scale_embedding; relu. decoder_input_ids = prepare_decoder_input_ids_from_labels(labels) (last non-pad "
          "label wrapped first), so the shifted -100s are pad decoder tokens the decoder self-attention ignores."],
         labels_shifted_here=True),
    Spec("led", "led", dict({k: v for k, v in B_SMALL.items() if k != "max_position_embeddings"}, attention_window=4,
                            max_encoder_position_embeddings=16, max_decoder_position_embeddings=POSITIONS,
                            decoder_start_token_id=EOS),
         ["LED: BART's post-LN layers under led., learned positions from 0 (encoder table 16 rows, decoder 24), "
          "layernorm_embedding, final_logits_bias; the encoder's Longformer self-attention with attention_window 4 "
          "(keys within 2 of the query); the reference forward takes a global_attention_mask (row 0 token 0, row 1 "
          "token 4: they attend to every key through query/key/value_global, every query attends to them); greedy "
          "decoding runs without one (local attention only). d_model 8, 2 heads, 1 encoder / 1 decoder layer."],
         global_tokens=((0, 0), (1, 4))),
    Spec("nllb-moe", "nllb-moe", dict(B_SMALL, encoder_layers=2, num_experts=3, encoder_sparse_step=2,
                                      decoder_sparse_step=1, moe_eval_capacity_token_fraction=0.5,
                                      moe_token_dropout=0.2, scale_embedding=True, decoder_start_token_id=EOS),
         ["NLLB-MoE: M2M-100's pre-LN layers (cross_attention, ff_layer_norm names), fairseq sinusoidal positions, "
          "scaled embeddings; encoder layer 1 and decoder layer 0 are top-2 mixtures of 3 fc1/fc2 experts with "
          "biases (router.classifier, float32 softmax); moe_eval_capacity_token_fraction 0.5, so an expert keeps 8 "
          "of the encoder's 16 tokens (6 of the decoder's 12) and some choices are dropped; the encoder's pad tokens "
          "are not routed; experts' output times 1 - moe_token_dropout (0.8, eval mode). Reference: transformers "
          "5.24 with NllbMoeExperts.forward corrected (nllb_moe_top2_experts: 5.24 runs expert_1 and expert_0 "
          "whatever the router chose). d_model 8, 2 heads, 2 encoder / 1 decoder layers."],
         reference_fix="nllb_moe_top2_experts"),
    Spec("prophetnet", "prophetnet", dict(vocab_size=SMALL_VOCAB, hidden_size=8, encoder_ffn_dim=12, decoder_ffn_dim=12,
                                          num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=2,
                                          num_decoder_attention_heads=2, ngram=2, num_buckets=8,
                                          relative_max_distance=16, max_position_embeddings=16, eps=0.1,
                                          dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                          init_std=0.2, decoder_start_token_id=PAD, **TOK),
         ["ProphetNet: post-LN encoder and decoder with learned positions from pad + 1 and embeddings_layer_norm; "
          "the decoder runs the main stream and 2 predicting streams (ngram_embeddings plus the next position's "
          "embedding) through n-gram self-attention, whose relative bias (8 buckets, max distance 16) is a projection "
          "of each query's hidden state (relative_pos_embeddings) picked by bucket; the logits are predicting stream "
          "0's, the loss is over both streams with label smoothing eps 0.1; tied word_embeddings. d_model 8, 2 "
          "heads, 1 encoder / 1 decoder layer; vocabulary 24, position table 16 rows."]),
    Spec("longt5", "longt5", dict(T_SMALL, encoder_attention_type="local", local_radius=2, num_layers=1),
         ["LongT5 with local encoder attention: local_radius 2 (blocks of 3 tokens seeing their neighbour blocks, "
          "masked to |i - j| <= 2) with layer 0's relative bias (8 buckets, max_distance 16); decoder as T5's; "
          "relu; tied lm_head with the d_model**-0.5 rescale; d_model 8, 2 heads, 1 encoder / 1 decoder layer."]),
    Spec("longt5_tglobal", "longt5", dict(T_SMALL, encoder_attention_type="transient-global", local_radius=2,
                                          global_block_size=4, feed_forward_proj="gated-gelu"),
         ["LongT5 with transient-global encoder attention: local_radius 2 and global_block_size 4, so the 8 input "
          "tokens make 2 aggregate tokens (row 1, 6 tokens: its last 2 are orphans that join block 0, and global "
          "block 1 is masked); layer 0's relative and global relative bias tables shared by both encoder layers, "
          "each layer its own global_input_layer_norm; gated-gelu; d_model 8, 2 heads, 2 encoder / 1 decoder "
          "layers."]),
]


# T5Gemma 2 text stack (T5Gemma2TextConfig / T5Gemma2DecoderConfig names): Gemma 3 layers, GQA 2 query / 1 key-value
# heads, a sliding then a full layer with their own rotary bases, final soft-capping
G2 = dict(vocab_size=SMALL_VOCAB, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1, head_dim=4, max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=6,
          final_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention"],
          rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                           "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}, **TOK)
# the smallest SigLIP tower T5Gemma2's encoder builds (its weights are in the checkpoint; a text forward skips them)
SIGLIP_TINY = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                   patch_size=4, num_channels=3)
SPECS.append(Spec(
    "t5gemma2", "t5gemma2",
    dict(encoder=dict(text_config=dict(G2), vision_config=dict(SIGLIP_TINY), mm_tokens_per_image=1,
                      boi_token_index=SMALL_VOCAB + 1, eoi_token_index=5, image_token_index=SMALL_VOCAB + 2),
         decoder=dict(G2), image_token_index=SMALL_VOCAB + 2, vocab_size=SMALL_VOCAB, dropout_rate=0.0,
         attention_dropout=0.0),
    ["T5Gemma 2's text model (T5Gemma2ForConditionalGeneration without pixel_values): Gemma 3 stacks with (1 + w) "
     "RMSNorms before and after each sublayer, per-head q_norm/k_norm, rotary self-attention with one base per layer "
     "type (sliding 1e4, full 1e6), GQA 2 query / 1 key-value heads, query_pre_attn_scalar 6, sliding window 4 "
     "(encoder layer 0 bidirectional: keys i - 1 .. i + 2, transformers' split of the window; decoder layer 0: "
     "i - 4 < j <= i); the decoder's merged attention (one softmax over its own keys and the encoder's, the same "
     "q/k/v/o projections, k_norm on the encoder keys, no rotary there); one embedding table shared by encoder, "
     "decoder and lm_head.out_proj, scaled by sqrt(hidden), the eoi token (id 5 here) reading eoi_embedding "
     "unscaled; final soft-capping 2.0; no pad masking beyond the attention_mask. The vision tower and projector "
     "(tiny SigLIP) are in the checkpoint but not in the reference's parameters: a text forward never runs them. "
     "d_model 8, 2 encoder / 2 decoder layers, vocabulary 24."],
    text_only=("model.encoder.vision_tower.", "model.encoder.multi_modal_projector.")))


# transformers' EncoderDecoderModel of two tiny BERTs: the decoder causal with cross-attention (BertLMHeadModel)
BERT_TINY = dict(model_type="bert", vocab_size=SMALL_VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=12, max_position_embeddings=24, type_vocab_size=2, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, pad_token_id=PAD)
SPECS.append(Spec(
    "bert2bert", "encoder-decoder",
    dict(encoder=dict(BERT_TINY), decoder=dict(BERT_TINY, is_decoder=True, add_cross_attention=True),
         decoder_start_token_id=BOS, pad_token_id=PAD, vocab_size=SMALL_VOCAB),
    ["EncoderDecoderModel (bert2bert): a BertModel encoder (with its pooler, which the loss never reaches: no "
     "gradient) and a BertLMHeadModel decoder (is_decoder: causal self-attention; add_cross_attention: "
     "crossattention.self.query/key/value + crossattention.output.dense/LayerNorm after it, post-LN) whose "
     "cls.predictions.decoder ties to its own word embeddings; labels shift with decoder_start_token_id 1, -100 -> "
     "pad; the loss is EncoderDecoderModel's cross-entropy over labels != -100. hidden 8, 2 heads, 1 layer each, "
     "vocabulary 24, 24 positions."]))


GPT2_TINY = dict(model_type="gpt2", vocab_size=SMALL_VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=24,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **TOK)
SPECS.append(Spec(
    "bert2gpt2", "encoder-decoder",
    dict(encoder=dict(BERT_TINY, hidden_size=12), decoder=dict(GPT2_TINY, is_decoder=True, add_cross_attention=True),
         decoder_start_token_id=BOS, pad_token_id=PAD, vocab_size=SMALL_VOCAB),
    ["EncoderDecoderModel (bert2gpt2): a BertModel encoder of hidden 12 (pooler without gradient), enc_to_dec_proj "
     "mapping its states to the decoder's width 8, and a GPT2LMHeadModel decoder "
     "with add_cross_attention: after the self-attention, ln_cross_attn then crossattention (q_attn from the decoder, "
     "c_attn [k | v] from the encoder's states, c_proj; Conv1D weights), pre-LN; lm_head tied to wte; labels shift "
     "with decoder_start_token_id 1 and the shifted pad tokens are hidden from the decoder. 2 heads, 1 layer each, "
     "vocabulary 24, 24 positions."]))


def make_inputs(vocab: int = VOCAB):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, SEQ), generator=g, dtype=torch.int64)
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    ids[1, SEQ - RIGHT_PAD:] = PAD
    mask[1, SEQ - RIGHT_PAD:] = 0
    labels = torch.randint(3, vocab, (2, TARGET), generator=g, dtype=torch.int64)
    labels[0, 3] = -100                      # an ignored label in the middle: its shifted decoder input is pad
    labels[1, TARGET - 2:] = -100            # a shorter target (ignored tail)
    return ids, mask, labels


def clean_generation_config(config) -> GenerationConfig:
    """Plain greedy decoding: no forced/suppressed tokens, no eos, no length rules."""
    return GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=0, do_sample=False, num_beams=1,
                            use_cache=True, eos_token_id=None, pad_token_id=PAD, bos_token_id=BOS,
                            decoder_start_token_id=getattr(config, "decoder_start_token_id", None),  # T5Gemma: none
                            forced_bos_token_id=None,
                            forced_eos_token_id=None, temperature=None, top_p=None, top_k=None)


def build(spec: Spec, out_root: Path):
    out = out_root / spec.name
    if out.exists():
        shutil.rmtree(out)
    tmp = out_root / (spec.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    torch.manual_seed(0)
    config = CONFIG_MAPPING[spec.model_type](**spec.overrides)
    model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model = model.float().eval()
    issues = check_overrides(model.config, spec.overrides)
    apply_reference_fix(model, spec)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    reinit_(model)
    with torch.no_grad():
        for n, p in model.named_parameters():  # fixed tables (sinusoidal positions) keep their values
            if n in frozen:
                p.copy_(frozen[n])
        if hasattr(model, "final_logits_bias"):
            g = torch.Generator().manual_seed(99)
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=g) *
                                          FINAL_LOGITS_BIAS_STD)
    model.save_pretrained(tmp)
    if spec.untied_lm_head:
        weights = load_file(str(tmp / "model.safetensors"))
        g = torch.Generator().manual_seed(77)
        weights["lm_head.weight"] = torch.randn(weights["shared.weight"].shape, generator=g) * INIT_STD
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForSeq2SeqLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
        model = model.float().eval()
        apply_reference_fix(model, spec)
        if model.lm_head.weight is model.get_input_embeddings().weight:
            raise RuntimeError("lm_head is still tied after writing a distinct one")

    ids, mask, labels = make_inputs(spec.overrides.get("vocab_size", VOCAB))
    params = {n: p for n, p in model.named_parameters() if not n.startswith(spec.text_only or ("\0",))}
    extra = {}
    if spec.labels_shifted_here:
        extra["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels.clone())
    if spec.global_tokens:
        extra["global_attention_mask"] = torch.zeros_like(ids)
        for row, position in spec.global_tokens:
            extra["global_attention_mask"][row, position] = 1
    fwd = model(input_ids=ids, attention_mask=mask, labels=labels, **extra, **spec.forward_kwargs)
    logits = fwd.logits.detach().float()
    fwd.loss.backward()
    ref = {"input_ids": ids.to(torch.int32), "attention_mask": mask.to(torch.int32),
           "labels": labels.to(torch.int32), "logits": logits.contiguous(),
           **({"global_attention_mask": extra["global_attention_mask"].to(torch.int32)} if spec.global_tokens else {}),
           "loss": fwd.loss.detach().float().reshape(())}
    no_grad = []
    for n, p in params.items():
        if p.grad is None:
            no_grad.append(n)
            ref[f"grad.{n}"] = torch.zeros_like(p.detach())
        else:
            ref[f"grad.{n}"] = p.grad.detach().float().contiguous().clone()

    with torch.no_grad():
        prompt = ids[:1]
        saved_config, model.generation_config = model.generation_config, clean_generation_config(model.config)
        try:
            gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 generation_config=clean_generation_config(model.config), output_logits=True,
                                 return_dict_in_generate=True)
        finally:
            model.generation_config = saved_config
        tokens = gen.sequences
        glogits = torch.cat([step.float() for step in gen.logits], dim=0)
        assert tokens.shape == (1, 1 + NEW_TOKENS), tokens.shape
        argmax_ok = bool((glogits.argmax(-1) == tokens[0, 1:]).all())
        full = model(input_ids=prompt, decoder_input_ids=tokens).logits[0, :-1]
        cache_diff = (full - glogits).abs().max().item()
    ref["greedy_tokens"] = tokens.to(torch.int32)
    ref["greedy_logits"] = glogits.contiguous()

    trainable = [p for p in params.values() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=False, **ADAMW)
    opt.step()
    for n, p in params.items():
        ref[f"adamw.{n}"] = p.detach().float().contiguous().clone()
    for k, v in ref.items():
        if not torch.isfinite(v.float()).all():
            raise RuntimeError(f"non-finite values in {k}")
    save_reference(ref, tmp)

    saved = set(load_file(str(tmp / "model.safetensors")).keys())
    meta = {
        "fixture": spec.name,
        "model_type": spec.model_type,
        "model_class": type(model).__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "config_overrides": spec.overrides,
        "config_override_issues": issues,
        "attn_implementation": "eager",
        "reference_fix": spec.reference_fix or None,
        "text_only_left_out": list(spec.text_only),
        "init": f"after construction (torch.manual_seed(0)): params with ndim>=2 = N(0,{INIT_STD}), 1-D params "
                f"+= N(0,{VEC_STD}), generator seed 1234, named_parameters() order; frozen parameters (fixed "
                f"sinusoidal tables) restored; final_logits_bias = N(0,{FINAL_LOGITS_BIAS_STD}) (seed 99)"
                + ("; lm_head.weight = N(0,0.2) (seed 77) written into the checkpoint, model reloaded"
                   if spec.untied_lm_head else ""),
        "adamw": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                  "weight_decay": ADAMW["weight_decay"], "foreach": False, "params": "those with requires_grad"},
        "generation": {"prompt": "input_ids[0:1] (unpadded)", "max_new_tokens": NEW_TOKENS, "do_sample": False,
                       "use_cache": True, "eos_token_id": None, "forced_bos/eos": None,
                       "decoder_start_token_id": getattr(model.config, "decoder_start_token_id", None)},
        "notes": spec.notes,
        "num_parameters": sum(p.numel() for p in params.values()),
        "parameters": list(params.keys()),
        "params_without_grad": no_grad,
        "params_frozen": [n for n, p in params.items() if not p.requires_grad],  # the rest are trainable; a
        #                 trainable one without grad (an expert no token chose) gets zeros and AdamW skips it
        "saved_keys_not_parameters": sorted(saved - set(params)),
        "parameters_not_saved": sorted(set(params) - saved),
        "checks": {
            "loss": round(fwd.loss.item(), 6),
            "logits_std": round(logits.std().item(), 4),
            "greedy_logits_argmax_equals_tokens": argmax_ok,
            "greedy_logits_vs_no_cache_forward_max_abs_diff": float(f"{cache_diff:.3g}"),
        },
    }
    return publish(tmp, out, meta)


def main(argv=None):
    parsed = parse_fixture_args(argv, SPECS, DEFAULT_OUT, name_width=18)
    if parsed is None:
        return 0
    args, out_root, only = parsed
    _, failed = build_each(SPECS, only, out_root, build, verbose=args.verbose,
                           summary=lambda meta: (f"loss={meta['checks']['loss']:.4f} std={meta['checks']['logits_std']} "
                                                 f"cache_diff={meta['checks']['greedy_logits_vs_no_cache_forward_max_abs_diff']} "
                                                 f"issues={meta['config_override_issues']}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
