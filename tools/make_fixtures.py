"""Write tests/fixtures/<name>/: tiny random Hugging Face causal LMs plus transformers' own outputs.

Each fixture is a 2-layer, hidden-32 model built from a config alone (no network, no downloads),
re-initialised from a fixed seed, and the outputs transformers computes for it: logits, loss,
every parameter's gradient, the parameters after one AdamW step, and a 12-token greedy
continuation with the logits of each step (llama, qwen2, gemma2 also: the parameters after a second
AdamW step, adamw2.<param>). llama_lora is a PEFT LoRA adapter on the llama fixture with PEFT's
outputs (build_lora). vkformers' tests load the model with vkformers and compare. See tests/fixtures/README.md for the layout. Needs transformers and torch (CPU):

    python tools/make_fixtures.py                       # every fixture, into tests/fixtures
    python tools/make_fixtures.py --only llama,qwen2    # just these (fixture names; llama_lora needs peft)
    python tools/make_fixtures.py --list                # names, model types, notes

Deterministic: one CPU thread, fixed seeds, sorted JSON, so re-running gives identical files
(for the same transformers and torch versions; meta.json records them).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from compact_adamw_fixtures import compact_file
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures"

# Sizes: small enough that ~50 fixtures (weights + gradients + AdamW result, all float32) stay
# near 12 MB, big enough that GQA (4 query heads over 2 KV heads), head_dim != hidden/heads and
# partial rotary still show.
VOCAB = 48
HIDDEN = 32
INTER = 24
LAYERS = 2
HEADS = 4
KV_HEADS = 2
MAX_POS = 128
LEARNED_POS = 24                 # position tables cost parameters: 24 >= 8 + 12 generated
PAD, BOS, EOS = 0, 1, 2          # token ids set in every config that has them
SEQ = 8
LEFT_PAD = 2
NEW_TOKENS = 12
INIT_STD = 0.2                   # matrices: N(0, 0.2); vectors (norms, biases): += N(0, 0.1)
VEC_STD = 0.1
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

TOK = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
# Llama-style config names (most modern decoders).
L = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
         initializer_range=0.2, **TOK)
SW = 4                           # sliding window smaller than the 8-token sequence
LAYERS_SF = ["sliding_attention", "full_attention"]
LAYERS_FS = ["full_attention", "sliding_attention"]
# transformers before 4.56 spells the dtype argument torch_dtype (the OpenLlama fixture is built with 4.49)
FLOAT32 = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}


@dataclass
class Spec:
    name: str                    # fixture folder
    model_type: str              # HF model_type
    overrides: dict
    notes: list = field(default_factory=list)
    model_class: str | None = None   # when AutoModelForCausalLM has no mapping for the type
    attn: str = "eager"              # transformers' attention implementation for the references
    adamw_steps: int = 1             # 2: also store adamw2.<param> (a second forward/backward + step)
    saved_model_type: str | None = None  # config.json's model_type when the config class writes another
    #                                      (GPT-SW3 is GPT2Config, which saves "gpt2")
    saved_names: bool = False        # grad./adamw. under the names save_pretrained writes, not the in-memory ones
    #                                  (mixture-of-experts: transformers 5 fuses the experts in memory, saves one
    #                                  module per expert)
    noisy_buffers: tuple = ()        # suffixes of buffers to perturb like 1-D parameters (routing biases, zero at init)
    loss_shifts_labels: bool = True  # False: the model's loss reads labels[t] for logits[t] (TrOCRForCausalLM), so
    #                                  the fixture passes the next-token targets (make_inputs' labels shifted left)
    prepare: object = None           # called with the model after reinit_: buffers a fixture sets (hash routing tables)
    transformers_major: int = 5      # the transformers release line that has the model (4: OpenLlama, removed in 5);
    #                                  a run builds only the specs of its own line (see tests/fixtures/README.md)
    reference_path: str | None = None  # where transformers has special kernels for the model (state-space scans):
    #                                    the code path that computed the reference, recorded in meta.json and the index
    padded_generate_uncached: str | None = None  # why transformers' cached decode is wrong on a padded batch for the
    #                                              model: the padded references then generate with use_cache=False
    #                                              (each step a full forward with the mask)
    generate_rows_apart: str | None = None  # why transformers' generate on a batch is wrong for the model: the padded
    #                                         references then generate each row of the padded batch alone (its pads and
    #                                         mask included) and stack them (tools/make_padded_references.py)


MAMBA1_PATH = ("transformers' torch path in float32: the sequential scan (mamba_selective_scan's fallback), the "
               "recurrent update for generation; not the mamba_ssm / causal_conv1d kernels")
# Mamba's config names (hidden 32, 2 layers); expand 3 gives 96 channels, state 8, dt rank 4.
MAMBA = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, state_size=8, expand=3, conv_kernel=4,
             time_step_rank=4, initializer_range=0.2, **TOK)


# hybrids (attention + state-space layers) on hidden 16 and MLP width 8 to keep their fixtures small; a Mamba-2
# mixer (Bamba's names): expand 2 -> 32 channels in 4 heads of 8, state 8 in 2 groups, chunk 4
HYBRID = dict(L, hidden_size=16, intermediate_size=8)
HYBRID_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                     mamba_expand=2, mamba_chunk_size=4)
MAMBA2_PATH = ("transformers' torch path in float32: the chunked SSD scan (mamba2_chunk_scan's fallback), the "
               "recurrent update for generation; not the mamba_ssm / causal_conv1d kernels")


def _gpt2_names(**kw):
    return dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=LEARNED_POS,
                n_inner=INTER, initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                **TOK, **kw)


SPECS = [
    # ---- the required set -------------------------------------------------------------------
    Spec("llama", "llama", dict(L), ["GQA 4q/2kv; untied lm_head; RMSNorm; SwiGLU; full rotary (rotate_half)."],
         adamw_steps=2),
    Spec("llama_rope_llama3", "llama", dict(L, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
        ["llama3 rope scaling; with head_dim 8 and theta 1e4 the 4 wavelengths (6.3, 63, 628, 6283) fall "
         "into all three bands (kept, smoothed, divided by factor) for original_max_position_embeddings 64."]),
    Spec("mistral", "mistral", dict(L, sliding_window=SW),
         ["sliding_window=4 (< 8-token sequence and < 20-token generation): every layer is sliding."]),
    Spec("qwen2", "qwen2", dict(L, use_sliding_window=True, sliding_window=SW, max_window_layers=1),
         ["q/k/v biases (always on in Qwen2); use_sliding_window with max_window_layers=1: layer 0 full, "
          "layer 1 sliding (window 4)."], adamw_steps=2),
    Spec("qwen2_rope_yarn", "qwen2", dict(L, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)),
        ["yarn rope scaling factor 4 (attention_factor 0.1*ln(4)+1 scales cos/sin); no sliding window."]),
    Spec("qwen3", "qwen3", dict(L, head_dim=16),
         ["per-head q/k RMSNorm before rope; head_dim 16 != hidden/heads (8): q_proj 32->64, o_proj 64->32."]),
    Spec("gemma", "gemma", dict(L, head_dim=16),
         ["embeddings scaled by sqrt(hidden) (computed in the hidden dtype); RMSNorm as x*(1+w); "
          "gelu_pytorch_tanh GeGLU; tied lm_head; head_dim 16."]),
    Spec("gemma2", "gemma2", dict(L, head_dim=16, sliding_window=SW, layer_types=LAYERS_SF,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                  final_logit_softcapping=2.0),
         ["layer 0 sliding (window 4), layer 1 full; attention and final logit soft-capping lowered to 2.0 "
          "so tanh capping is visible; query_pre_attn_scalar 24 (scale 24**-0.5, not head_dim 16); "
          "pre+post norms around attention and MLP; (1+w) RMSNorm; sqrt(hidden) embedding scale; tied."],
         adamw_steps=2),
    Spec("gemma3_text", "gemma3_text", dict(L, head_dim=16, sliding_window=SW, layer_types=LAYERS_SF,
                                            query_pre_attn_scalar=24),
         ["layer 0 sliding (window 4, rope theta 1e4), layer 1 full (rope theta 1e6); q/k norm; "
          "query_pre_attn_scalar 24; no soft-capping (config default None); sqrt(hidden) embedding scale; tied."]),
    Spec("phi3", "phi3", dict(L, sliding_window=SW),
         ["fused qkv_proj and gate_up_proj; GQA; sliding_window 4 (Phi-3 configs carry one)."]),
    Spec("phi3_longrope", "phi3", dict(L, original_max_position_embeddings=16, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.5, 2.0, 4.0],
        long_factor=[1.0, 3.0, 6.0, 12.0], original_max_position_embeddings=16)),
        ["longrope; original_max_position_embeddings 16, max_position_embeddings 128 -> attention factor "
         "sqrt(1+ln(8)/ln(16)) (set at the top level too: Phi3Config copies its top-level value, default 4096, "
         "over the one in rope_parameters). The 8-token forward uses short_factor. Rope picks long_factor when "
         "max(position_ids)+1 > 16, and Phi3ForCausalLM.generate DROPS THE KV CACHE and re-runs the whole "
         "sequence once the length reaches 17, so every greedy step equals a no-cache forward of the sequence "
         "so far: greedy_logits[k] (over 8+k tokens) uses short factors for k <= 8 and long factors for k >= 9."]),
    Spec("olmo", "olmo", dict(L, clip_qkv=1.0),
         ["non-parametric LayerNorm (no weight/bias); clip_qkv=1.0 clamps q,k,v (visible: projections have std ~1)."]),
    Spec("olmo2", "olmo2", dict(L),
         ["norm AFTER attention and MLP (post-norm on the branch output, before the residual add); "
          "q/k RMSNorm over the whole projection (hidden width), not per head."]),
    Spec("granite", "granite", dict(L, embedding_multiplier=2.0, logits_scaling=0.5, residual_multiplier=0.5,
                                    attention_multiplier=0.25),
         ["embedding_multiplier 2, residual_multiplier 0.5, attention_multiplier 0.25 (replaces head_dim**-0.5), "
          "logits divided by logits_scaling 0.5."]),
    Spec("cohere", "cohere", dict(L, logit_scale=0.5, use_qk_norm=True),
         ["parallel residual (attn and MLP both read one LayerNorm output); LayerNorm without bias; "
          "INTERLEAVED rotary (pairs 2i,2i+1), not rotate_half; logits multiplied by logit_scale (0.5 here; "
          "0.0625 in Command-R); use_qk_norm on (per-head LayerNorm, no bias); tied."]),
    Spec("stablelm", "stablelm", dict(L, use_qkv_bias=True),
         ["partial rotary 0.25 of head_dim 8 = 2 dims (default factor); q/k/v biases; LayerNorm with bias."]),
    Spec("stablelm_parallel", "stablelm", dict(L, num_attention_heads=2, num_key_value_heads=1, qk_layernorm=True,
                                               use_parallel_residual=True),
         ["StableLM-2-12B style: per-head q/k LayerNorm and parallel residual; 2 query heads over 1 KV head so "
          "head_dim is 16 and partial rotary 0.25 covers 4 dims (2 frequencies)."]),
    Spec("starcoder2", "starcoder2", dict(L, sliding_window=SW),
         ["biases everywhere (use_bias); LayerNorm; non-gated gelu_pytorch_tanh MLP (c_fc/c_proj); "
          "sliding_window 4; tied."]),
    Spec("gpt2", "gpt2", _gpt2_names(),
         ["Conv1D weights are stored [in, out] (transposed vs nn.Linear); fused c_attn; learned absolute "
          "positions (wpe) taken as arange, NOT from the attention mask; gelu_new; tied."]),
    Spec("gpt_neox", "gpt_neox", dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                      num_hidden_layers=LAYERS, num_attention_heads=2,
                                      max_position_embeddings=MAX_POS, initializer_range=0.2, **TOK),
         ["MHA only (no KV-head option); fused query_key_value laid out per head as [heads, 3, head_dim]; "
          "parallel residual; partial rotary 0.25 (2 heads -> head_dim 16 -> 4 rotary dims); biases; untied embed_out."]),
    Spec("phi", "phi", dict(L),
         ["parallel attention+MLP from ONE LayerNorm; partial rotary 0.5 (4 of 8 dims); biases everywhere "
          "including lm_head; GQA via num_key_value_heads; gelu_new MLP (fc1/fc2); final LayerNorm."]),
    Spec("opt", "opt", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, ffn_dim=INTER,
                            num_attention_heads=HEADS, max_position_embeddings=LEARNED_POS,
                            word_embed_proj_dim=HIDDEN, init_std=0.2, dropout=0.0, **TOK),
         ["learned positions with offset 2, computed from cumsum(attention_mask) (left padding shifts them); "
          "pre-LayerNorm; ReLU; biases; tied."]),
    Spec("opt_350m_style", "opt", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                       ffn_dim=INTER, num_attention_heads=HEADS, max_position_embeddings=LEARNED_POS,
                                       word_embed_proj_dim=16, do_layer_norm_before=False, init_std=0.2,
                                       dropout=0.0, **TOK),
         ["OPT-350m layout: word_embed_proj_dim 16 != hidden 32 (project_in/project_out, no bias) and "
          "post-LayerNorm (do_layer_norm_before=False, no final layer norm)."]),
    Spec("falcon", "falcon", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, ffn_hidden_size=INTER, max_position_embeddings=MAX_POS,
                                  initializer_range=0.2, **TOK),
         ["Falcon-7B layout (defaults): multi_query (1 KV head), parallel_attn with one input LayerNorm, "
          "no biases, rotary, fused query_key_value [q heads..., k, v]; tied."]),
    Spec("falcon_new_arch", "falcon", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                           num_attention_heads=HEADS, num_kv_heads=KV_HEADS,
                                           new_decoder_architecture=True, ffn_hidden_size=INTER,
                                           max_position_embeddings=MAX_POS, initializer_range=0.2, **TOK),
         ["Falcon-40B/180B layout: new_decoder_architecture, GQA 4q/2kv with query_key_value grouped per KV "
          "head as [kv, q_per_kv+2, head_dim]; two LayerNorms (ln_attn, ln_mlp) feeding the parallel branches."]),
    Spec("falcon_alibi", "falcon", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                        num_attention_heads=HEADS, alibi=True, multi_query=False,
                                        parallel_attn=False, bias=True, ffn_hidden_size=INTER,
                                        max_position_embeddings=MAX_POS, initializer_range=0.2, **TOK),
         ["Falcon-RW layout: ALiBi instead of rotary, MHA, sequential (non-parallel) block with "
          "post_attention_layernorm, biases.",
          "references from sdpa attention: transformers 5.24's eager Falcon adds ALiBi twice (in the scores "
          "and again through the mask), which neither sdpa nor the original model does"], attn="sdpa"),
    Spec("bloom", "bloom", dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                initializer_range=0.2, **TOK),
         ["ALiBi (slopes from the head count; positions from cumsum(attention_mask), so left padding is "
          "handled); LayerNorm right after the embedding (word_embeddings_layernorm); fused query_key_value "
          "per head [heads, 3, head_dim]; biases; 4*hidden GELU MLP (no intermediate_size knob); tied."]),
    # ---- further dense causal decoders -------------------------------------------------------
    Spec("openai-gpt", "openai-gpt", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                          n_positions=LEARNED_POS, initializer_range=0.2, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, **TOK),
         ["GPT-1: post-LayerNorm, no final LayerNorm, Conv1D weights [in, out], 4*hidden MLP, learned positions; tied."]),
    Spec("gpt_bigcode", "gpt_bigcode", _gpt2_names(),
         ["multi_query (1 KV head) with fused c_attn [q (hidden), k (head_dim), v (head_dim)]; nn.Linear "
          "(not Conv1D); learned positions; tied."]),
    Spec("gpt_neo", "gpt_neo", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                                    intermediate_size=INTER, max_position_embeddings=LEARNED_POS, window_size=SW,
                                    attention_types=[[["global", "local"], 1]], initializer_range=0.2,
                                    resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0, **TOK),
         ["attention scores are NOT scaled by head_dim**-0.5; layer 0 global, layer 1 local (window 4); "
          "q/k/v without bias, out_proj with bias; learned positions; tied."]),
    Spec("gptj", "gptj", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POS,
                              rotary_dim=4, n_inner=INTER, initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0,
                              attn_pdrop=0.0, **TOK),
         ["parallel residual from one LayerNorm; INTERLEAVED rotary on the first rotary_dim=4 of 8 dims; "
          "q/k/v/out without bias; lm_head with bias; untied."]),
    Spec("codegen", "codegen", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                    n_positions=MAX_POS, n_ctx=MAX_POS, rotary_dim=4, n_inner=INTER,
                                    initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                    bos_token_id=BOS, eos_token_id=EOS),
         ["GPT-J block, but qkv_proj is fused in mp_num=4 model-parallel chunks, each ordered [q, v, k] "
          "(note: v before k); interleaved rotary on rotary_dim=4; lm_head bias; untied."]),
    Spec("persimmon", "persimmon", dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                        max_position_embeddings=MAX_POS, initializer_range=0.2, **TOK),
         ["squared-ReLU MLP; per-head q/k LayerNorm; partial rotary 0.5; fused query_key_value per head "
          "[heads, 3, head_dim]; biases; MHA only."]),
    Spec("nemotron", "nemotron", dict(L, head_dim=8),
         ["LayerNorm1P (x normalised * (1+w) + b); squared-ReLU non-gated MLP; partial rotary 0.5; GQA."]),
    Spec("glm", "glm", dict(L, head_dim=8),
         ["INTERLEAVED partial rotary (0.5 of head_dim); fused gate_up_proj; q/k/v biases; GQA."]),
    Spec("glm4", "glm4", dict(L, head_dim=8),
         ["GLM + extra post_self_attn_layernorm / post_mlp_layernorm (sandwich norms); interleaved partial rotary."]),
    Spec("helium", "helium", dict(L, head_dim=8),
         ["Llama block but INTERLEAVED rotary (rotate pairs 2i,2i+1); RMSNorm multiplies the weight in float32."]),
    Spec("smollm3", "smollm3", dict(L, no_rope_layers=[1, 0]),
         ["NoPE: no_rope_layers=[1, 0] -> layer 0 uses rope, layer 1 has NO rotary embedding; tied."]),
    Spec("cohere2", "cohere2", dict(L, logit_scale=0.5, sliding_window=SW, layer_types=LAYERS_SF),
         ["layer 0 sliding (window 4) WITH interleaved rope, layer 1 full attention WITHOUT rope; parallel "
          "residual; LayerNorm without bias; logit_scale 0.5; tied."]),
    Spec("ernie4_5", "ernie4_5", dict(L, head_dim=8, use_bias=True),
         ["INTERLEAVED rotary; use_bias on (q/k/v/o and MLP); tied."]),
    Spec("apertus", "apertus", dict(L, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                           low_freq_factor=1.0, high_freq_factor=4.0,
                                                           original_max_position_embeddings=64)),
         ["xIELU activation with learnable alpha_p/alpha_n (non-gated up/down MLP); q/k RMSNorm; llama3 rope."]),
    Spec("arcee", "arcee", dict(L, head_dim=8), ["non-gated squared-ReLU MLP (up/down)."]),
    Spec("hunyuan_v1_dense", "hunyuan_v1_dense", dict(L, head_dim=8),
         ["q/k RMSNorm applied AFTER rotary (query_layernorm/key_layernorm)."]),
    Spec("olmo3", "olmo3", dict(L, sliding_window=SW, layer_types=LAYERS_SF),
         ["OLMo2 block (post-norms, whole-width q/k norm) with layer 0 sliding (window 4), layer 1 full."]),
    Spec("exaone4", "exaone4", dict(L, sliding_window=SW, layer_types=LAYERS_SF),
         ["post-norm like OLMo2 plus per-head q/k norm; layer 0 sliding WITH rope, layer 1 full attention "
          "WITHOUT rope (when sliding layers exist)."]),
    Spec("granite_swa", "granite_swa", dict(L, embedding_multiplier=2.0, logits_scaling=0.5,
                                            residual_multiplier=0.5, attention_multiplier=0.25,
                                            sliding_window=SW, layer_types=LAYERS_FS),
         ["granite multipliers plus layer 0 full, layer 1 sliding (window 4); tied."]),
    Spec("hyperclovax", "hyperclovax", dict(L, head_dim=8, embedding_multiplier=2.0, logits_scaling=0.5,
                                            residual_multiplier=0.5, attention_multiplier=0.25),
         ["granite multipliers plus post-norms (use_post_norm)."]),
    Spec("vaultgemma", "vaultgemma", dict(L, head_dim=16, sliding_window=SW, layer_types=LAYERS_SF,
                                          query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                          final_logit_softcapping=2.0),
         ["Gemma2 without the post-norms; soft-capping lowered to 2.0; layer 0 sliding; tied."]),
    Spec("nanochat", "nanochat", dict(L, final_logit_softcapping=2.0),
         ["parameter-free RMSNorm (incl. after the embedding and on q/k); squared-ReLU MLP; "
          "final logit soft-capping (lowered to 2.0)."]),
    Spec("ministral", "ministral", dict(L, head_dim=8, sliding_window=SW, layer_types=LAYERS_FS),
         ["Mistral with per-layer layer_types: layer 0 full, layer 1 sliding (window 4). head_dim must be given: "
          "MinistralConfig leaves it None and the attention fails on None**-0.5."]),
    Spec("ministral3", "ministral3", dict(L, head_dim=8, pad_token_id=PAD),
         ["default yarn rope with llama_4_scaling_beta (query scaling by position) kept from the config defaults."]),
    Spec("jais2", "jais2", dict(L, head_dim=8),
         ["LayerNorm with bias; non-gated squared-ReLU MLP with biases; attention biases."]),
    Spec("bitnet", "bitnet", dict(L),
         ["BitNet b1.58: weights ternarised and activations int8-quantised inside forward (straight-through "
          "gradients); extra sub-norms (attn_sub_norm, ffn_sub_norm) before o_proj/down_proj; relu2 GLU."]),
    Spec("biogpt", "biogpt", dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, intermediate_size=INTER, max_position_embeddings=LEARNED_POS,
                                  initializer_range=0.2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  **TOK),
         ["embeddings scaled by sqrt(hidden); learned positions offset 2 from cumsum(attention_mask); "
          "pre-LayerNorm; biases; tied output_projection."]),
    Spec("xglm", "xglm", dict(vocab_size=VOCAB, d_model=HIDDEN, num_layers=LAYERS, attention_heads=HEADS,
                              ffn_dim=INTER, max_position_embeddings=MAX_POS, init_std=0.2, dropout=0.0,
                              attention_dropout=0.0, **TOK),
         ["sinusoidal positions (offset 2, from cumsum(attention_mask) like fairseq); embeddings scaled by "
          "sqrt(d_model); biases; tied."]),
    Spec("trocr", "trocr", dict(vocab_size=VOCAB, d_model=HIDDEN, decoder_layers=LAYERS, decoder_attention_heads=HEADS,
                                decoder_ffn_dim=INTER, max_position_embeddings=LEARNED_POS, init_std=0.2, dropout=0.0,
                                **TOK),
         ["TrOCRForCausalLM (the decoder alone, no encoder states): post-LayerNorm block, layernorm_embedding after "
          "the learned positions (offset 2, arange, not from the mask), no final norm, gelu, biases, tied "
          "output_projection. The layers' encoder_attn (built since TrOCRForCausalLM sets is_decoder) is never run: "
          "no gradient. Its loss does not shift labels, so the reference labels are the next-token targets."],
         loss_shifts_labels=False),
    Spec("trocr_sinusoidal", "trocr", dict(vocab_size=VOCAB, d_model=HIDDEN, decoder_layers=LAYERS,
                                           decoder_attention_heads=HEADS, decoder_ffn_dim=INTER,
                                           max_position_embeddings=MAX_POS, use_learned_position_embeddings=False,
                                           scale_embedding=True, layernorm_embedding=False, activation_function="relu",
                                           cross_attention_hidden_size=16, init_std=0.2, dropout=0.0, **TOK),
         ["TrOCR with fixed fairseq sinusoidal positions counted over non-pad tokens (rows from pad + 1, pads the "
          "zero padding row: left padding is invisible), embeddings scaled by sqrt(d_model), no layernorm_embedding, "
          "relu; cross_attention_hidden_size 16 gives the unused encoder_attn k/v projections their own width. "
          "Labels as in trocr (next-token targets, not shifted inside)."],
         loss_shifts_labels=False),
    Spec("ctrl", "ctrl", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, dff=INTER,
                              n_positions=MAX_POS, initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, **TOK),
         ["sinusoidal positions ([sin | cos] halves); embeddings scaled by sqrt(n_embd); lm_head bias; tied."]),
    Spec("gpt_neox_japanese", "gpt_neox_japanese", dict(vocab_size=VOCAB, hidden_size=HIDDEN,
                                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                                        intermediate_multiple_size=2, max_position_embeddings=MAX_POS,
                                                        initializer_range=0.2, attention_dropout=0.0, **TOK),
         ["parallel residual; separate dense_bias added after the attention residual; no bias in qkv."]),
    Spec("mpt", "mpt", dict(vocab_size=VOCAB, d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS,
                            max_seq_len=LEARNED_POS, initializer_range=0.2, **TOK),
         ["ALiBi; no biases (no_bias); fused Wqkv [q,k,v]; LayerNorm without bias; GELU MLP of 4*d_model "
          "(transformers hard-codes 4x and ignores expansion_ratio); no position table; tied."]),
    Spec("deepseek_v2_dense", "deepseek_v2", dict(L, num_key_value_heads=HEADS, first_k_dense_replace=LAYERS, kv_lora_rank=16, q_lora_rank=24,
                                                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                  n_shared_experts=1, head_dim=4),
         ["MLA (multi-head latent attention) with every layer dense (first_k_dense_replace = num layers): "
          "q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa -> kv_a_layernorm -> kv_b_proj; rope only on "
          "qk_rope_head_dim (4) dims, interleaved layout; v_head_dim 8."]),
    Spec("minicpm3", "minicpm3", dict(L, num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                      qk_rope_head_dim=4, v_head_dim=8, head_dim=4, scale_emb=2.0, scale_depth=1.4, dim_model_base=16),
         ["MLA; embeddings * scale_emb; residual branches * scale_depth/sqrt(num_layers); "
          "logits computed on hidden / (hidden_size/dim_model_base); tied."]),
    Spec("youtu", "youtu", dict(L, num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=8),
         ["MLA (DeepSeek-V2-style attention) in a dense Llama block; rope_interleave; tied. CAUTION: with "
          "transformers 5.24, from_pretrained() on this folder re-initialises the tied embedding (its loader "
          "treats it as missing), so a reloaded model does NOT reproduce reference.safetensors; "
          "model.safetensors itself holds the weights the references were computed with."]),
    # ---- second pass: the remaining registered dense decoders ---------------------------------
    Spec("gpt-sw3", "gpt-sw3", _gpt2_names(activation_function="gelu"),
         ["GPT-SW3 is GPT2Config / GPT2LMHeadModel; config.json is written with model_type \"gpt-sw3\" (the "
          "registry's spelling; transformers' AutoConfig maps it back to GPT2Config) and exact-erf gelu "
          "(activation_function \"gelu\", as GPT-SW3 checkpoints use) instead of gpt2's gelu_new."],
         saved_model_type="gpt-sw3"),
    Spec("seed_oss", "seed_oss", dict(L, head_dim=16, attention_out_bias=True, attention_dropout=0.0,
                                      residual_dropout=0.0),
         ["Llama block with q/k/v biases (attention_bias, on by default) and attention_out_bias on here so the "
          "o_proj bias is visible (Seed-OSS-36B has it off); head_dim 16 != hidden/heads."]),
    Spec("cwm", "cwm", dict(L, head_dim=8, sliding_window=SW, layer_types=LAYERS_FS, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
         ["Llama block with per-layer layer_types (layer 0 full, layer 1 sliding, window 4) and llama3 rope "
          "(theta 1e4, original_max_position_embeddings 64 so all three bands show)."]),
    Spec("emu3_text_model", "emu3_text_model", dict(L, attention_bias=True, attention_dropout=0.0),
         ["Emu3's text decoder (Emu3ForCausalLM on Emu3TextConfig): a Llama block; attention_bias on (q/k/v/o). "
          "config_override_issues flags attention_bias only because Emu3TextConfig declares it as a plain class "
          "attribute, not a dataclass field; the model does have the four biases (see parameters)."],
         model_class="Emu3ForCausalLM"),
    Spec("cohere_compass_text", "cohere_compass_text", dict(
        L, logit_scale=0.5, sliding_window=SW, layer_types=LAYERS_SF,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0), "full_attention": None}),
         ["Cohere2 block (parallel residual from one bias-free LayerNorm, logit_scale 0.5 here, tied) with "
          "rotate_half (NOT interleaved) rotary from a rope dict per layer type: layer 0 sliding (window 4) with "
          "rope theta 1e4, layer 1 full attention with rope_parameters null = no rotary (NoPE). Text-only positions "
          "are equal on the three M-RoPE axes, so the multimodal rope is plain 1-D rope."]),
    Spec("modernbert-decoder", "modernbert-decoder", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=MAX_POS, layer_types=LAYERS_FS, local_attention=2 * SW,
        initializer_range=0.2, cls_token_id=BOS, sep_token_id=EOS, classifier_bias=True, **TOK),
         ["LayerNorm (no bias by default) right after the embedding; layer 0 has NO attention input norm "
          "(Identity), layer 1 does; fused Wi = [input | gate], act(input) * gate; MHA; layer 0 full attention "
          "(rope theta 160000), layer 1 sliding with window local_attention // 2 = 4 (rope theta 10000); "
          "prediction head lm_head = LayerNorm(gelu(dense(x))) (classifier_bias on here so its bias shows) before "
          "the tied `decoder` projection with bias."]),
    # removed in transformers 5: built with transformers 4.49 (transformers.models.deprecated.open_llama)
    Spec("open-llama", "open-llama", dict(
        {k: v for k, v in L.items() if k != "num_key_value_heads"}, hidden_dropout_prob=0.0,
        attention_dropout_prob=0.0),
         ["OpenLlamaForCausalLM (transformers 4.x only), the config's defaults: use_stable_embedding (a LayerNorm "
          "with bias, eps 1e-5, model.embed_layer_norm, right after the embedding) and shared_input_output_embedding "
          "(logits = hidden @ embed_tokens.weight^T, no lm_head, although tie_word_embeddings is false); MHA only "
          "(no num_key_value_heads); use_memory_efficient_attention on (it only matters in training mode: xformers' "
          "kernel, and transformers then drops the padding mask); dropouts set to 0 (the references run in eval "
          "mode, where they do nothing)."], transformers_major=4),
    # MoE families whose config can make every layer dense (like deepseek_v2_dense): only the dense layers
    Spec("hy_v3_dense", "hy_v3", dict(L, head_dim=16, attention_bias=True, mlp_layer_types=["dense", "dense"],
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
         ["Hunyuan V3 with every layer dense (mlp_layer_types all \"dense\"; real checkpoints have MoE layers "
          "after the first): per-head q/k RMSNorm before rotary, attention_bias on (q/k/v/o), head_dim 16."]),
    Spec("laguna_dense", "laguna", dict(L, head_dim=8, sliding_window=SW, layer_types=LAYERS_FS,
                                        num_attention_heads_per_layer=[4, 6], mlp_layer_types=["dense", "dense"],
                                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=16),
         ["Laguna with every layer dense (mlp_layer_types all \"dense\"; real checkpoints have MoE layers after "
          "the first): 4 query heads in layer 0, 6 in layer 1 (num_attention_heads_per_layer) over 2 KV heads; "
          "per-head q/k RMSNorm; softplus output gate per head (g_proj, gating=True) on the attention output "
          "before o_proj; layer 0 full attention with partial rotary 0.5 (theta 5e5), layer 1 sliding (window 4) "
          "with full rotary (theta 1e4) -- the config's default rope dict per layer type."]),
    Spec("laguna_gate_per_element", "laguna", dict(L, head_dim=8, gating="per-element",
                                                   mlp_layer_types=["dense", "dense"], num_experts=4,
                                                   num_experts_per_tok=2, moe_intermediate_size=16,
                                                   shared_expert_intermediate_size=16),
         ["laguna_dense's block with gating=\"per-element\" (g_proj gives one softplus gate per head and "
          "channel) and the defaults otherwise: full attention in both layers, 4 heads each."]),
    Spec("mistral4_dense", "mistral4", dict(
        L, num_key_value_heads=HEADS, first_k_dense_replace=LAYERS, kv_lora_rank=16, q_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1,
                             partial_rotary_factor=1 / 3)),
         ["Mistral 4 with every layer dense (first_k_dense_replace = num layers; real checkpoints have MoE "
          "layers): DeepSeek-V2 MLA (q_lora_rank 24, kv_lora_rank 16, nope 8 + rope 4 dims, v 8), interleaved "
          "rotary (rope_interleave), yarn factor 4 over original_max_position_embeddings 16 (mscale_all_dim 1 "
          "scales the softmax by (0.1 ln 4 + 1)^2) and Llama-4 query scaling 1 + 0.1 log(1 + floor(pos / 16)), "
          "so generation past position 16 shows it."], model_class="Mistral4ForCausalLM"),
    # hybrid: Gated DeltaNet linear attention + gated softmax attention
    Spec("qwen3_5_text", "qwen3_5_text", dict(L, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                              linear_conv_kernel_dim=4, linear_key_head_dim=8,
                                              linear_value_head_dim=8, linear_num_key_heads=2,
                                              linear_num_value_heads=4),
         ["layer 0 Gated DeltaNet (in_proj_qkv -> causal depthwise conv1d (kernel 4) + silu -> l2-normalised q/k, "
          "2 key heads shared by 4 value heads of dim 8; decay exp(-exp(A_log) softplus(a + dt_bias)), "
          "beta = sigmoid(b); delta-rule state update per token; RMSNorm(out) * silu(z) -> out_proj; padded "
          "positions zeroed on input); layer 1 softmax attention whose q_proj also yields a sigmoid output gate, "
          "(1+w) q/k RMSNorm, partial rotary 0.25 of head_dim 16; (1+w) RMSNorm everywhere else."]),
    Spec("olmo_hybrid", "olmo_hybrid", dict(L, layer_types=["linear_attention", "full_attention"],
                                            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=4,
                                            linear_num_key_heads=2, linear_num_value_heads=4,
                                            rope_parameters=dict(rope_type="default", rope_theta=None)),
         ["layer 0 pre-norm Gated DeltaNet: separate q/k/v_proj, each through its own causal depthwise conv (kernel "
          "4) + silu, l2-normalised q/k, 2 key heads of dim 8 shared by 4 value heads of dim 4; beta = 2 sigmoid(b) "
          "(linear_allow_neg_eigval), decay exp(-exp(A_log) softplus(a + dt_bias)); o_norm(out) (RMSNorm, eps "
          "1e-5) * silu(g_proj) -> o_proj. Layer 1 OLMo 2 attention block (post-norms, q/k RMSNorm over the whole "
          "projection) without rotary (rope_theta None, as in the released checkpoints). References under the "
          "saved names: transformers saves input_layernorm / post_attention_layernorm as attention_layer_norm / "
          "feedforward_layer_norm and splits linear_attn.conv1d into q/k/v_conv1d with torch.chunk, i.e. in three "
          "EQUAL parts; key and value widths are both 16 here, so the parts are the true q, k, v convs."],
         saved_names=True),
    # ---- mixture-of-experts decoders (vkformers-moe); references under the saved per-expert names -----------
    Spec("mixtral", "mixtral", dict(L, num_local_experts=4, num_experts_per_tok=2, sliding_window=SW),
         ["Mistral (sliding_window 4) whose MLP is a sparse MoE block in every layer: router block_sparse_moe.gate "
          "(softmax over 4 experts, top-2, renormalised), SwiGLU experts saved as experts.<e>.w1 (gate) / w3 (up) / "
          "w2 (down) (transformers 5 fuses them in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I])."],
         saved_names=True),
    Spec("qwen2_moe", "qwen2_moe", dict(L, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=20, mlp_only_layers=[0]),
         ["layer 0 dense (mlp_only_layers=[0], intermediate 24), layer 1 sparse: softmax router over 4 experts, top-2 "
          "NOT renormalised (norm_topk_prob False), experts of width 16, plus a shared expert (width 20) scaled by "
          "sigmoid(shared_expert_gate(x)); q/k/v biases (qkv_bias)."], saved_names=True),
    Spec("qwen3_moe", "qwen3_moe", dict(L, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                        norm_topk_prob=True),
         ["Qwen3 attention (per-head q/k RMSNorm, head_dim 16) with a sparse MoE block in every layer: softmax "
          "router over 4 experts, top-2 renormalised (norm_topk_prob), experts of width 16, no shared expert."],
         saved_names=True),
    Spec("olmoe", "olmoe", dict(L, num_experts=4, num_experts_per_tok=2, clip_qkv=1.0),
         ["OLMo-style attention (q/k RMSNorm over the whole projection, clip_qkv 1.0) with a sparse MoE block in "
          "every layer: softmax router over 4 experts, top-2 not renormalised (norm_topk_prob False)."],
         saved_names=True),
    Spec("granitemoe", "granitemoe", dict(L, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
                                          logits_scaling=0.5, residual_multiplier=0.5, attention_multiplier=0.25),
         ["Granite multipliers with a sparse MoE block in every layer: router block_sparse_moe.router.layer, softmax "
          "over the top-2 of 4 router logits; experts saved fused: input_linear.weight [E, 2I, H] ([gate | up]) and "
          "output_linear.weight [E, H, I]."], saved_names=True),
    Spec("flex_olmo", "flex_olmo", dict(L, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
         ["OLMo 2 block (norms after attention and MLP, q/k RMSNorm over the whole projection) with a sparse MoE "
          "block in every layer: softmax router over 4 experts, top-2 renormalised (norm_topk_prob)."],
         saved_names=True),
    Spec("hunyuan_v1_moe", "hunyuan_v1_moe", dict(L, head_dim=8, num_experts=4, moe_topk=2),
         ["HunYuan block (q/k RMSNorm after rotary) with a sparse MoE block in every layer: router mlp.gate.wg, "
          "softmax over 4 experts, top-2 renormalised, experts of width intermediate_size (24), plus an always-on "
          "shared_mlp of the same width."], saved_names=True),
    Spec("deepseek_v3", "deepseek_v3", dict(
        L, num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5),
         ["MLA (q_lora_rank 24, kv_lora_rank 16, nope 8 + rope 4 dims, v 8, interleaved rotary); layer 0 dense "
          "(first_k_dense_replace 1), layer 1 sparse: sigmoid router over 8 experts in 4 groups, the 2 groups with "
          "the largest top-2 sums of sigmoid + e_score_correction_bias (a buffer, perturbed here: zero at init) "
          "eligible, top-2 chosen on the biased scores, weighted by the unbiased ones renormalised (+1e-20) and "
          "scaled by routed_scaling_factor 2.5; one shared expert (shared_experts) of width 16."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("glm4_moe", "glm4_moe", dict(
        L, attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5),
         ["GLM-4.5: q/k/v biases, per-head q/k RMSNorm (use_qk_norm), rotate_half partial rotary 0.5; layer 0 dense, "
          "layer 1 DeepSeek-V3 router: sigmoid over 8 experts in 2 groups (1 eligible), e_score_correction_bias "
          "(buffer, perturbed), top-2 renormalised, scaled by 1.5; one shared expert."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("dots1", "dots1", dict(L, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                n_shared_experts=1, first_k_dense_replace=1, sliding_window=SW,
                                layer_types=LAYERS_SF),
         ["dots.llm1: Qwen3 attention (per-head q/k RMSNorm), layer 0 sliding (window 4) and dense, layer 1 full "
          "attention and sparse: DeepSeek-V3 router (sigmoid, e_score_correction_bias buffer perturbed, one group) "
          "over 4 experts, top-2 not renormalised (norm_topk_prob False); one shared expert."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("granitemoeshared", "granitemoeshared", dict(
        L, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=20, embedding_multiplier=2.0,
        logits_scaling=0.5, residual_multiplier=0.5, attention_multiplier=0.25),
         ["granitemoe plus an always-on shared MLP beside the sparse block: layers.<i>.shared_mlp.input_linear "
          "[2*20, 32] ([gate | up]) and output_linear [32, 20], added to the experts' output."], saved_names=True),
    Spec("granitemoe_swa", "granitemoe_swa", dict(
        L, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=20, embedding_multiplier=2.0,
        logits_scaling=0.5, residual_multiplier=0.5, attention_multiplier=0.25, sliding_window=SW,
        layer_types=LAYERS_FS, layer_rope_theta=[10000.0, 0]),
         ["granite_swa's attention (per-head sinks: softmax over the scores and one learned logit per head) with "
          "granitemoeshared's sparse block and shared MLP; layer 0 full attention with rotary, layer 1 sliding "
          "(window 4) without rotary (layer_rope_theta 0 = NoPE). No checkpoint conversion in transformers 5.24: "
          "the experts are saved fused as block_sparse_moe.experts.gate_up_proj [4, 2*24, 32] / down_proj."],
         saved_names=True),
    Spec("ernie4_5_moe", "ernie4_5_moe", dict(
        L, use_bias=True, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
        moe_num_shared_experts=1, moe_layer_start_index=1),
         ["ernie4_5's attention (interleaved rotary, use_bias); layer 0 dense, layer 1 sparse (moe_layer_start_index "
          "1): softmax router gate over 4 experts, top-2 chosen on scores + moe_statics.e_score_correction_bias (a "
          "gradient-free parameter [1, 4], random here), unbiased scores renormalised; shared_experts of width 16 "
          "with biases."], saved_names=True),
    Spec("cohere2_moe", "cohere2_moe", dict(
        L, head_dim=8, logit_scale=0.5, sliding_window=SW, layer_types=LAYERS_SF, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, mlp_layer_types=["dense", "sparse"], prefix_dense_intermediate_size=20),
         ["cohere2's block (parallel residual, LayerNorm without bias, logit_scale 0.5); layer 0 sliding (window 4) "
          "and dense (prefix_dense_intermediate_size 20, rotates), layer 1 full attention without rotary and sparse: "
          "softmax over the top-2 of 4 router logits, experts of width 24, one shared expert (width 24) averaged "
          "with them (shared_expert_combination_strategy average)."], saved_names=True),
    Spec("exaone_moe", "exaone_moe", dict(
        L, sliding_window=SW, layer_types=LAYERS_SF, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        n_group=2, topk_group=1),
         ["EXAONE MoE: pre-norm block with per-head q/k RMSNorm; layer 0 sliding (window 4, rotates) and dense, layer 1 "
          "full attention (no rotary) and sparse: DeepSeek-V3 router (sigmoid, e_score_correction_bias buffer saved as "
          "mlp.e_score_correction_bias, perturbed; 2 groups, 1 eligible), top-2 of 4 renormalised, scaled by 2.5; "
          "one shared expert of width 16."], saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("minimax_m2", "minimax_m2", dict(L, head_dim=8, rotary_dim=4, num_local_experts=4, num_experts_per_tok=2),
         ["MiniMax-M2: q/k RMSNorm over the whole projection, partial rotary (rotary_dim 4 of head_dim 8); sparse MoE "
          "block in every layer: sigmoid router over 4 experts, top-2 chosen with the e_score_correction_bias buffer "
          "(perturbed, zero at init), unbiased scores renormalised; experts saved as Mixtral's w1/w3/w2."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("solar_open", "solar_open", dict(
        {k: v for k, v in L.items() if k != "intermediate_size"}, head_dim=8, attention_bias=True, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0),
         ["Solar Open: Llama attention with q/k/v biases (o_proj none); a sparse block in every layer: DeepSeek-V3 "
          "router (sigmoid, e_score_correction_bias buffer perturbed, 2 groups of 2 experts, 1 eligible), top-2 of 4 "
          "renormalised (+1e-20), scaled by 2; one shared expert of width 16."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("mellum", "mellum", dict(
        L, head_dim=8, sliding_window=SW, layer_types=LAYERS_SF, mlp_layer_types=["dense", "sparse"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16),
         ["Mellum: Qwen3 attention (per-head q/k RMSNorm); layer 0 sliding (window 4, rope theta 1e4) and dense "
          "(width 24), layer 1 full attention (rope theta 5e5) and sparse: softmax router over 4 experts, top-2 "
          "renormalised (norm_topk_prob)."], saved_names=True),
    Spec("afmoe", "afmoe", dict(
        L, head_dim=8, sliding_window=SW, layer_types=LAYERS_SF, num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1, route_scale=1.5, mup_enabled=True),
         ["AFMoE: per-head q/k RMSNorm, attention output * sigmoid(gate_proj(x)) per channel, norms before and after "
          "attention and MLP, mup_enabled (embeddings * sqrt(32)); layer 0 sliding (window 4, rotary) and dense, "
          "layer 1 full (no rotary) and sparse: sigmoid router mlp.router.gate over 4 experts, top-2 chosen with the "
          "gradient-free parameter expert_bias (random here), renormalised, scaled by route_scale 1.5; one shared "
          "expert of width 16."], saved_names=True),
    Spec("dbrx", "dbrx", dict(vocab_size=VOCAB, d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS, max_seq_len=MAX_POS,
                              attn_config=dict(kv_n_heads=KV_HEADS, clip_qkv=1.0, rope_theta=10000.0),
                              ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2),
                              initializer_range=0.2, **TOK),
         ["DBRX: transformer.blocks.<i>.norm_attn_norm.{norm_1, attn, norm_2} (LayerNorm without bias), fused Wqkv "
          "[q | k | v] clamped to [-1, 1] (clip_qkv), GQA 4q/2kv, out_proj; ffn: softmax router ffn.router.layer over "
          "4 experts, top-2 divided by their 1-norm (moe_normalize_expert_weights 1), experts stacked as "
          "ffn.experts.mlp.w1 (gate) / v1 (up) / w2 (down, stored [I, H] per expert) of shape [4 * 16, 32]."],
         saved_names=True),
    Spec("aria_text", "aria_text", dict(L, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1),
         ["Aria's text decoder: Llama attention with a sparse block in every layer: router mlp.router over 4 experts, "
          "softmax over the top-2 logits (= renormalised top-k softmax); experts saved fused and transposed: "
          "mlp.experts.fc1.weight [E, H, 2I] ([gate | up]) and fc2.weight [E, I, H] (x @ W); shared_experts of width "
          "24."], saved_names=True),
    Spec("axk1", "axk1", dict(
        L, num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        n_group=2, topk_group=1, mlp_layer_types=["dense", "sparse"], routed_scaling_factor=2.5),
         ["A.X-K1: deepseek_v3's MLA and router (4 experts in 2 groups, 1 eligible, e_score_correction_bias buffer "
          "perturbed, top-2 renormalised, scaled by 2.5, one shared expert); layer 0 dense, layer 1 sparse, whose block "
          "output goes through an RMSNorm saved as layers.1.post_mlp_layernorm."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("axk2", "axk2", dict(
        L, num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        mlp_layer_types=["dense", "sparse"], routed_scaling_factor=2.5, index_topk=4, index_head_dim=8,
        index_n_heads=8, gated_norm_rank=8),
         ["A.X-K2: DeepSeek-V3.2's MLA with a DSA indexer (8 heads of 8, rotate_half rotary on the first 4 dims, "
          "LayerNorm'd key, relu scores weighted per head) keeping the index_topk 4 best keys of each query: fewer "
          "than the 8-token sequence and the 20-token generation, so keys are dropped. q_gate_proj (saved as "
          "q_b_proj) maps [q_a_layernorm(q_a) | q_a] to each head's query and a sigmoid gate on its attention output. "
          "input_layernorm (both layers) and post_attention_layernorm (sparse layer 1) are RMSNorms followed by a "
          "low-rank sigmoid gate (norm.weight, mlp.fc1 / fc2 saved as W_down / W_up, rank 8); layer 0 dense. Router: sigmoid, "
          "e_score_correction_bias buffer perturbed, no groups (n_group None, A.X-K2-Light), top-2 renormalised, "
          "scaled by 2.5, one shared expert. The indexer runs without gradient: its parameters are in "
          "params_without_grad."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("deepseek_v32", "deepseek_v32", dict(
        L, num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, index_topk=4,
        index_head_dim=8, index_n_heads=8),
         ["DeepSeek-V3.2 (an alias of deepseek_v3 in vkformers-moe, whose configs select the DSA layer): DeepSeek-V3's "
          "MLA (q_lora_rank 24, kv_lora_rank 16, nope 8 + rope 4, v 8, interleaved rotary) plus a DSA indexer (8 heads "
          "of 8, rotate_half rotary on the first 4 dims, LayerNorm'd key, relu scores weighted per head) keeping the "
          "index_topk 4 best keys of each query: fewer than the 8-token sequence and the 20-token generation, so "
          "keys are dropped. Layer 0 dense, layer 1 sparse: DeepSeek-V3's router (8 experts in 4 groups, 2 eligible, "
          "e_score_correction_bias perturbed, top-2 renormalised, scaled by 2.5, one shared expert). The indexer "
          "runs without gradient: its parameters are in params_without_grad."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("glm_moe_dsa", "glm_moe_dsa", dict(
        L, num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, index_topk=4, index_head_dim=8, index_n_heads=4,
        indexer_types=["full", "shared"]),
         ["GLM-5 (an alias of deepseek_v3 in vkformers-moe, whose configs select the DSA layer): DeepSeek-V3.2's "
          "MLA and DSA indexer (4 heads of 8, index_topk 4 of up to 20 keys), the indexer rotating interleaved pairs "
          "of its first 4 dims; layer 1 is an indexer_types 'shared' layer: no indexer, it reuses layer 0's key "
          "selection. Layer 0 dense, layer 1 sparse (4 experts, no groups, top-2 renormalised, scaled by 2.5, one "
          "shared expert, e_score_correction_bias perturbed); rms_norm_eps 1e-5 (the q_a / kv_a norms keep 1e-6)."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("phimoe", "phimoe", dict(L, num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                                  sliding_window=SW, router_jitter_noise=0.5),
         ["PhiMoE: LayerNorms with bias, q/k/v/o biases, lm_head bias, sliding_window 4; SparseMixer routing (eval "
          "form): expert 1 = argmax of the router logits, weighted by the softmax over the logits within the jitter "
          "threshold of it ((max - l) / max(|l|, max) <= 2 * router_jitter_noise, 0.5 here so it keeps some and drops "
          "some), expert 2 likewise among the rest; experts saved as block_sparse_moe.experts.<e>.w1/w3/w2."],
         saved_names=True),
    Spec("qwen3_5_moe_text", "qwen3_5_moe_text", dict(
        {k: v for k, v in L.items() if k != "intermediate_size"}, head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20),
         ["qwen3_5_text's hybrid decoder (layer 0 Gated DeltaNet, layer 1 softmax attention with a sigmoid output "
          "gate from q_proj) with a sparse block in both layers: softmax router mlp.gate over 4 experts, top-2 "
          "renormalised, experts of width 16 (saved one module per expert), plus a shared_expert of width 20 scaled by sigmoid(shared_expert_gate(x))."],
         saved_names=True),
    Spec("qwen3_next", "qwen3_next", dict(
        L, head_dim=16, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20,
        norm_topk_prob=False, mlp_only_layers=[0]),
         ["qwen3_5_text's hybrid decoder (layer 0 Gated DeltaNet, layer 1 softmax attention with a sigmoid output "
          "gate from q_proj) whose linear layer's projections are fused per key head: in_proj_qkvz ([q, k, v, z] of "
          "each of the 2 key heads and its 2 value heads) and in_proj_ba ([b, a] likewise). Layer 0 dense "
          "(mlp_only_layers [0], intermediate 24), layer 1 sparse: softmax router over 4 experts, top-2 NOT "
          "renormalised (norm_topk_prob False), experts of width 16, a shared_expert of width 20 scaled by "
          "sigmoid(shared_expert_gate(x))."], saved_names=True),
    Spec("llama4_text", "llama4_text", dict(
        L, head_dim=8, intermediate_size=16, intermediate_size_mlp=24, num_local_experts=4, num_experts_per_tok=2,
        interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=3, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1),
         ["Llama 4's text decoder. Layer 0: rotary (interleaved pairs) attention in chunks of 3 tokens "
          "(attention_chunk_size 3: key j visible to query i iff j <= i and j // 3 == i // 3, so the 8-token input "
          "and the 20-token generation span several chunks), q/k normalised after the rotation by a weightless "
          "RMS norm (use_qk_norm), dense MLP of intermediate_size_mlp 24. Layer 1: NoPE full attention whose "
          "queries are scaled by 1 + 0.1 log(1 + floor((pos + 1) / 4)) (attn_temperature_tuning, floor_scale 4, "
          "attn_scale 0.1), and a sparse block (interleave_moe_layer_step 2): top-2 of 4 router logits, each "
          "chosen expert's INPUT scaled by sigmoid(its logit), experts fused and transposed (x @ W), plus a "
          "shared_expert."], saved_names=True),
    Spec("longcat_flash", "longcat_flash", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_attention_heads=HEADS,
        max_position_embeddings=MAX_POS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4, v_head_dim=8,
        ffn_hidden_size=INTER, expert_ffn_hidden_size=16, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
        routed_scaling_factor=1.5, initializer_range=0.2, **TOK),
         ["LongCat-Flash: each of the 2 layers holds two sublayers, each MLA attention (q_lora_rank 24, kv_lora_rank "
          "16, nope 8 + rope 4 dims, v 8, interleaved rotary; q scaled by sqrt(32 / 24) and the normed kv latent by "
          "sqrt(32 / 16)) and a dense MLP (self_attn.<j>, mlps.<j>, input_layernorm.<j>, "
          "post_attention_layernorm.<j>), plus one sparse block (mlp) fed by the first sublayer's "
          "post-attention norm and added after the second sublayer: softmax router mlp.router.classifier over 4 "
          "experts and 2 zero-compute (identity) experts, top-2 chosen with the e_score_correction_bias buffer "
          "(perturbed), not renormalised, scaled by 1.5; an identity expert returns its input."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("gpt_oss", "gpt_oss", dict(L, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=SW,
                                    swiglu_limit=1.0),
         ["GPT-OSS: q/k/v/o biases, per-head attention sinks (softmax over the scores and one learned logit per "
          "head), layer 0 sliding (window 4) and layer 1 full (the default layer_types), the default yarn rope "
          "(factor 32 over original_max_position_embeddings 4096, theta 150000, truncate false). Sparse block in "
          "both layers: router mlp.router with a bias, softmax over the top-2 of 4 logits; experts fused and "
          "transposed (x @ W) with biases: gate_up_proj [4, 32, 2*24] whose columns alternate gate, up, "
          "gate_up_proj_bias, down_proj, down_proj_bias; clipped SwiGLU (up.clamp(-l, l) + 1) * g sigmoid(1.702 g), "
          "g = gate.clamp(max=l), with swiglu_limit l lowered from 7 to 1.0 so both clamps bind."],
         saved_names=True),
    Spec("mimo_v2_flash", "mimo_v2_flash", dict(
        L, num_key_value_heads=1, head_dim=12, v_head_dim=8, attention_bias=True, sliding_window=SW,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1,
        routed_scaling_factor=1.5),
         ["MiMo-V2-Flash: layer 0 full attention (1 KV head) with a dense MLP, layer 1 sliding (window 4) with twice "
          "the KV heads (2) and per-head attention sinks (saved as self_attn.attention_sink_bias), and a sparse block "
          "(the default layer_types / mlp_layer_types). q/k heads of head_dim 12, value heads of v_head_dim 8 scaled "
          "by attention_value_scale 0.707; q/k/v biases (attention_bias), o_proj without; rotary per layer type "
          "(rope theta 5e6 full, 1e4 sliding) on int(12 * 0.334) = 4 dims. Sparse block: DeepSeek-V3's router "
          "(sigmoid, e_score_correction_bias buffer perturbed, 4 experts in 2 groups, 1 eligible), top-2 renormalised, "
          "scaled by 1.5, no shared experts."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("minimax_m3_vl_text", "minimax_m3_vl_text", dict(
        L, head_dim=8, intermediate_size=16, dense_intermediate_size=INTER, shared_intermediate_size=12,
        num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5, swiglu_limit=1.0,
        layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "sparse"],
        index_n_heads=2, index_head_dim=12, index_block_size=2, index_topk_blocks=3, index_local_blocks=2),
         ["MiniMax-M3's text decoder (MiniMaxM3VLForCausalLM). (1 + w) RMSNorms everywhere (layers, final, per-head "
          "q/k norms before the rotation, the indexer's q/k norms); rotary over the whole head_dim 8 (transformers "
          "5.24 ignores rotary_dim, default 64, for this config class). Layer 0: lightning-indexer block-sparse "
          "attention (layer_types minimax_m3_sparse): per query, 2 indexer heads (one per KV group) score every "
          "earlier key (q_proj 2 x 12, k_proj 12, normed, rotary on their first 8 dims), the maxima over blocks of "
          "2 keys (index_block_size) pick the top-3 blocks (index_topk_blocks), the query's own block and the one "
          "before it always among them (index_local_blocks 2); keys of other blocks are hidden. The 8-token input "
          "has 4 blocks and the 20-token generation 10, so keys are dropped from query block 3 on (with "
          "index_topk_blocks raised to 100, nothing dropped, transformers' logits change by up to 3.05). Dense MLP "
          "(gate_up_proj [2*24, 32]). Layer 1: full attention; sparse block: sigmoid router over 4 experts, "
          "e_score_correction_bias buffer (perturbed) for choosing, top-2 renormalised, routed output scaled by "
          "1.5; experts fused [E, 2I, H] / [E, H, I]; shared_experts (gate_up_proj, width 12). Every GLU is the "
          "clipped SwiGLU (up.clamp(-l, l) + 1) * g sigmoid(1.702 g), g = gate.clamp(max=l), swiglu_limit l "
          "lowered to 1.0 so both clamps bind."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("glm5_next_text", "glm5_next_text", dict(
        L, num_hidden_layers=3, num_key_value_heads=HEADS, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=0, v_head_dim=8, layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
        indexer_types=["full", "full", "shared"], index_topk=4, index_kpool=2, index_head_dim=8, index_n_heads=8,
        linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=4, hc_mult=3, hc_sinkhorn_iters=3,
        mlp_layer_types=["dense", "sparse", "sparse"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        swiglu_limit=1.0),
         ["GLM-5.3-Flash's text decoder (transformers 5.24 has no causal LM class for it: Glm5NextTextModel plus an "
          "lm_head, built here by _glm5_next_text_lm). The residual stream is hc_mult 3 streams with DeepSeek-V4's "
          "hyper-connections (attn_hc / ffn_hc, saved hc_attn_fn / base / scale; 3 Sinkhorn iterations), collapsed "
          "by their mean before the final norm. Layer 0: Kimi Delta Attention (2 heads of 8; q/k/v_proj, causal "
          "conv of 4 saved as q/k/v_conv1d, per-key-channel decay -5 sigmoid(exp(A_log) (f_b(f_a(x)) + dt_bias)), "
          "beta sigmoid(b_proj), output RMS norm gated by sigmoid(g_b(g_a(x)))), dense MLP. Layers 1-2: NoPE MLA "
          "(q_lora_rank 24, kv_lora_rank 16, nope 8, v 8) with a DSA indexer over pools of index_kpool 2 keys "
          "(softmax-gated pool keys, 8 heads of 8): each query keeps its index_topk / 2 = 2 best complete visible "
          "pools plus the incomplete tail, so keys are dropped from the 8-token input on; layer 2 (indexer_types "
          "shared) reuses layer 1's choice. Sparse layers 1-2: DeepSeek-V3's router (4 experts in 2 groups, 1 "
          "eligible, e_score_correction_bias perturbed, top-2 renormalised, scaled by 2.5, one shared expert). Every "
          "SwiGLU clips gate (max 1) and up (+-1), swiglu_limit lowered to 1 so both bind. The indexer runs without "
          "gradient: its parameters are in params_without_grad."],
         model_class="Glm5NextTextForCausalLM", saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("deepseek_v4", "deepseek_v4", dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=1,
        head_dim=16, q_lora_rank=24, partial_rotary_factor=0.5, o_groups=2, o_lora_rank=8, sliding_window=SW,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3},
        index_n_heads=4, index_head_dim=8, index_topk=2, hc_mult=3, hc_sinkhorn_iters=3,
        mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=1.5, swiglu_limit=1.0,
        max_position_embeddings=MAX_POS, initializer_range=0.2, **TOK),
         ["DeepSeek-V4: the residual stream is hc_mult 3 parallel streams (mHC): before each attention and MLP a "
          "hyper-connection (attn_hc / ffn_hc: fn, base, scale) computes from the normed streams a collapse "
          "(sigmoid), an expansion (2 sigmoid) and a Sinkhorn-normalised (3 iterations) mixing matrix; a hyper head "
          "(hc_head) collapses the streams before the final norm. Attention: shared-KV MQA (one head of 16, keys = "
          "values: kv_proj, kv_norm), queries through q_a_proj, q_a_norm, q_b_proj and a weightless per-head RMS "
          "norm, interleaved rotary on the trailing 8 dims (undone on the output at the query's position), per-head "
          "sinks, sliding window 4, grouped output projection (2 groups of 2 heads to 8 each, o_a_proj, then "
          "o_b_proj). Layer 0 sliding only (rope theta 1e4); layer 1 CSA: compressed entries from overlapping "
          "windows of 2 + 2 tokens (softmax-gated, position_bias, kv_norm, rotary at the window start, theta 1.6e5), "
          "of which a lightning indexer (4 heads of 8, own compressor) keeps the top 2 per query; layer 2 HCA: one "
          "entry per 3 tokens, all causal ones visible. Sparse block in every layer: sqrt(softplus) scores over 4 "
          "experts, layer 0 routed by the hash table tid2eid[input_ids] (random distinct experts here; zero at "
          "init), layers 1-2 by top-2 of scores + e_score_correction_bias (perturbed); renormalised, scaled by 1.5; "
          "experts and the shared expert clip gate (max 1) and up (+-1) before silu(gate) * up. Saved with the "
          "reference checkpoint's names (attn.wq_a, ffn.experts.<e>.w1, hc_attn_fn, head, ...)."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",), prepare=lambda model: _hash_tables(model)),
    Spec("qwen4_exp_text", "qwen4_exp_text", dict(
        {k: v for k, v in L.items() if k != "intermediate_size"}, head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20, hc_count=3,
        hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16, ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=16, split_ngram_parts=2, indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
         ["Qwen4-Exp's text decoder (Qwen4ExpForCausalLM). The residual stream is hc_count 3 streams: before the "
          "attention and the MLP a gated residual (attn_hyper_connection / mlp_hyper_connection) RMS-normalises each "
          "stream ((1 + w) over 3 x 32), mixes them into the block input (mean of sigmoid(up(silu(down(.) / 3))) * "
          "streams) and adds the block output to each stream scaled by 2 sigmoid(block_inject_weight(.) / 3); "
          "hyper_connection_mixer collapses the streams instead of a final norm. Layer 0: Qwen3.5's Gated DeltaNet, "
          "preceded by PLE (ple_layer_ids [1]): hashed 2- and 3-gram embeddings (2 heads each over primes above 49, "
          "table stored as 2 shards), a key per stream and one value, sign-sqrt gated, plus a dilated (3) depthwise "
          "conv of kernel 3. Layer 1 (full_attention, run as indexed_attention): Qwen3.5's gated attention whose "
          "keys are chosen by the QSA indexer: 2 index heads of 8 and one raw key, keys averaged over blocks of 2 "
          "visible tokens, normed and rotated at the block start, relu scores summed over heads; each query keeps "
          "its top 2 complete blocks (budget 4) plus the incomplete tail. Sparse block in both layers: softmax "
          "router over 4 experts, top-2 renormalised, shared_expert of width 20 gated by sigmoid. The indexer runs "
          "without gradient: its parameters are in params_without_grad."],
         saved_names=True),
    # MoE layers of architectures vkformers-llama registers (their *_dense fixtures above cover the dense layers)
    Spec("deepseek_v2_moe", "deepseek_v2", dict(
        L, num_key_value_heads=HEADS, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, head_dim=4, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5),
         ["deepseek_v2_dense's MLA with layer 1 sparse (first_k_dense_replace 1): softmax router over 8 experts, "
          "group_limited_greedy (the 2 of 4 groups with the largest maximum eligible), top-2 not renormalised, scaled "
          "by routed_scaling_factor 1.5; one shared expert of width 16."], saved_names=True),
    Spec("mistral4_moe", "mistral4", dict(
        L, num_key_value_heads=HEADS, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1,
                             partial_rotary_factor=1 / 3)),
         ["mistral4_dense's attention with layer 1 sparse (first_k_dense_replace 1): softmax router over 8 experts "
          "in 2 groups (1 eligible, by top-2 sums), top-2 renormalised (+1e-20), scaled by 1.5; one shared expert."],
         model_class="Mistral4ForCausalLM", saved_names=True),
    Spec("hy_v3_moe", "hy_v3", dict(L, head_dim=16, attention_bias=True, mlp_layer_types=["dense", "sparse"],
                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                    num_shared_experts=1, router_scaling_factor=2.0),
         ["hy_v3_dense's attention with layer 1 sparse: sigmoid router mlp.router.gate over 4 experts, the buffer "
          "mlp.expert_bias (e_score_correction_bias in memory; perturbed here, zero at init) added for choosing, "
          "top-2 renormalised (+1e-20) and scaled by router_scaling_factor 2; shared_mlp of width 16."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("laguna_moe", "laguna", dict(L, head_dim=8, sliding_window=SW, layer_types=LAYERS_FS,
                                      num_attention_heads_per_layer=[4, 6], mlp_layer_types=["dense", "sparse"],
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=12, moe_routed_scaling_factor=1.5,
                                      moe_router_logit_softcapping=1.0),
         ["laguna_dense's attention with layer 1 sparse: router logits soft-capped (1.0 tanh(l / 1.0)), sigmoid over "
          "4 experts plus the gradient-free parameter e_score_correction_bias (saved as "
          "experts.e_score_correction_bias) for choosing, top-2 renormalised, routed output scaled by 1.5; shared "
          "expert (saved as shared_expert) of width 12."], saved_names=True),
    # ---- state-space models (vkformers-ssm) ------------------------------------------------------
    Spec("mamba", "mamba", MAMBA,
         ["Mamba-1: in_proj -> causal depthwise conv1d (kernel 4) + silu -> x_proj (dt rank 4, B, C of state 8) -> "
          "softplus(dt_proj) -> selective scan with D skip, times silu(z) -> out_proj; 96 channels (expand 3: two "
          "workgroups of the scan kernel); tied lm_head. Reference: transformers' torch path (slow forward, "
          "sequential scan; no mamba_ssm / causal_conv1d kernels on the CPU), float32. Padded positions are zeroed "
          "before in_proj and after the conv (attention_mask)."], adamw_steps=2, reference_path=MAMBA1_PATH),
    Spec("falcon_mamba", "falcon_mamba", dict(MAMBA, mixer_rms_eps=1e-6),
         ["Mamba-1 as the mamba fixture plus Falcon-Mamba's weightless RMSNorms (eps 1e-6) of dt, B and C before "
          "dt_proj and the scan. Reference: transformers' torch path, float32."], reference_path=MAMBA1_PATH),
    Spec("mamba2", "mamba2", dict(MAMBA, expand=3, num_heads=12, head_dim=8, n_groups=2, chunk_size=4),
         ["Mamba-2: in_proj -> [z | x B C | dt]; causal depthwise conv1d (kernel 4) + silu over x, B, C; 12 heads of "
          "8 channels with scalar A, D, dt (softplus(dt + dt_bias)); B and C (state 8) in 2 groups of 6 heads; gated "
          "RMSNorm over each group's 48 channels of y * silu(z); untied lm_head. Reference: transformers' torch "
          "path, float32: the chunked SSD scan (chunk_size 4, so the 8-token batch spans two chunks and generation "
          "steps through the recurrent update)."],
         reference_path="transformers' torch path in float32: the chunked SSD scan (mamba2_chunk_scan's fallback), the "
                        "recurrent update for generation; not the mamba_ssm / causal_conv1d kernels"),
    Spec("bamba", "bamba", dict(HYBRID, attn_layer_indices=[1], **HYBRID_MAMBA2),
         ["Bamba (hidden 16): layer 0 a Mamba-2 mixer (model.layers.0.mamba: 4 heads of 8 channels, B and C of state "
          "8 in 2 groups, chunk_size 4), layer 1 GQA attention (4q/2kv of 4 dims, rotary on half of each head: "
          "partial_rotary_factor "
          "0.5 fixed by BambaConfig); every layer input_layernorm, pre_ff_layernorm and a SwiGLU feed_forward; "
          "final_layernorm; untied lm_head. Reference: transformers' torch path in float32 (chunked SSD scan)."],
         reference_path=MAMBA2_PATH),
    Spec("falcon_h1", "falcon_h1", dict(HYBRID, num_hidden_layers=1, mamba_d_ssm=32, **HYBRID_MAMBA2,
                                        embedding_multiplier=1.5,
                                        lm_head_multiplier=0.7, key_multiplier=0.8, attention_in_multiplier=1.3,
                                        attention_out_multiplier=0.9, ssm_in_multiplier=1.2, ssm_out_multiplier=0.8,
                                        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.4], mlp_multipliers=[1.3, 0.7]),
         ["Falcon-H1 (hidden 16, one layer: every layer is alike): the layer runs a Mamba-2 mixer (mamba_d_ssm 32: 4 heads of 8 channels, B and C "
          "of state 8 in 2 groups, chunk_size 4; mamba_rms_norm off: y * silu(z), no gated norm) and GQA attention "
          "(4q/2kv of 4 dims) in parallel on the same normed input, then a SwiGLU feed_forward; every muP "
          "multiplier set away from 1 (embedding 1.5, lm_head 0.7, key 0.8, attention in 1.3 / out 0.9, ssm in 1.2 "
          "/ out 0.8, the five in_proj sections 1.1 0.9 1.2 0.8 1.4, MLP gate 1.3 / down 0.7). Reference: "
          "transformers' torch path in float32 (chunked SSD scan)."],
         reference_path=MAMBA2_PATH),
    Spec("nemotron_h", "nemotron_h", dict({k: v for k, v in HYBRID.items() if k != "num_hidden_layers"}, head_dim=4,
                                          layers_block_type=["linear_attention", "full_attention",
                                                                                 "mlp"],
                                          mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
                                          conv_kernel=4, chunk_size=4),
         ["Nemotron-H (hidden 16): three blocks, each norm -> one mixer -> residual: a Mamba-2 mixer (4 heads of 8 "
          "channels, B and C of state 8 in 2 groups, chunk_size 4; dt clamped below at time_step_min 0.001 in the "
          "chunked scan, not in the recurrent update, as transformers does), GQA attention without rotary (4q/2kv "
          "of 4 dims), a relu2 MLP (up_proj, down_proj); embedding without padding_idx; norm_f. Reference: "
          "transformers' torch path in float32 (chunked SSD scan)."],
         reference_path=MAMBA2_PATH),
    Spec("jamba", "jamba", dict(HYBRID, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, use_mamba_kernels=False,
                                mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4),
         ["Jamba (hidden 16): layer 0 a Mamba-1 mixer (32 channels, state 8, dt rank 4, RMSNorms with weights on dt, "
          "B and C) with a sparse feed_forward (router over 4 experts, softmax then top-2 left unnormalised), layer 1 "
          "GQA attention without rotary (4q/2kv of 4 dims) with a dense SwiGLU feed_forward; input_layernorm, "
          "pre_ff_layernorm, final_layernorm. Reference: transformers' torch path in float32 (mamba_selective_scan's "
          "fallback, its associative scan; the recurrent update for generation)."],
         saved_names=True, reference_path="transformers' torch path in float32: mamba_selective_scan's fallback "
                                           "(associative scan), the recurrent update for generation; not the "
                                           "mamba_ssm / causal_conv1d kernels"),
    Spec("granitemoehybrid", "granitemoehybrid",
         dict(HYBRID, shared_intermediate_size=8, num_local_experts=3, num_experts_per_tok=2,
              layer_types=["linear_attention", "full_attention"], mamba_n_heads=2, mamba_d_head=8, mamba_n_groups=1,
              mamba_d_state=4, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=4, embedding_multiplier=2.0,
              logits_scaling=1.5, residual_multiplier=0.5, attention_multiplier=0.3),
         ["GraniteMoeHybrid (hidden 16, expert and shared widths 8): layer 0 a Mamba-2 mixer (2 heads of 8 channels, "
          "state 4, one group, chunk_size 4), layer 1 GQA attention without rotary (position_embedding_type None, "
          "its default); each layer a block_sparse_moe (3 experts fused as input_linear / output_linear, top-2 "
          "softmax) plus the shared_mlp; Granite's multipliers (embedding 2, logits_scaling 1.5, residual 0.5, "
          "attention 0.3). Reference: transformers' torch path in float32 (chunked SSD scan)."],
         saved_names=True, reference_path=MAMBA2_PATH),
    Spec("lfm2", "lfm2", dict(HYBRID, hidden_size=12, num_attention_heads=2, num_key_value_heads=1,
                              intermediate_size=12, block_multiple_of=4, block_ffn_dim_multiplier=1.0,
                              layer_types=["conv", "full_attention"], conv_L_cache=3, conv_bias=True),
         ["LFM2 (hidden 12, to keep the fixture small): layer 0 a gated short-conv block (in_proj -> B, C, x; "
          "C * depthwise conv(B * x), kernel 3, no activation; conv_bias on: in_proj, conv and out_proj biases), layer 1 GQA attention (2q/1kv of 6 dims) "
          "with per-head q_layernorm / k_layernorm and out_proj; each layer operator_norm, ffn_norm and a SwiGLU "
          "feed_forward (w1, w3, w2) of width 8 (block_auto_adjust_ff_dim: 2/3 of 12, times 1.0, rounded up to a "
          "multiple of 4); embedding_norm as the final norm; tied lm_head. Reference: transformers' torch path in "
          "float32 (causal_conv1d's torch fallback)."],
         reference_path="transformers' torch path in float32: F.conv1d for the short convolution (causal_conv1d_fn's "
                        "fallback), its conv-state update for generation; not the causal_conv1d kernels"),
    Spec("lfm2_moe", "lfm2_moe", dict(HYBRID, hidden_size=12, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=8, moe_intermediate_size=4, num_experts=4,
                                      num_experts_per_tok=2, num_dense_layers=1, routed_scaling_factor=1.5,
                                      layer_types=["conv", "full_attention"], conv_L_cache=3),
         ["LFM2-MoE (hidden 12): layer 0 a gated short-conv block (kernel 3) with a dense SwiGLU feed_forward of "
          "width 8 (intermediate_size as is), layer 1 QK-normed GQA attention (2q/1kv of 6 dims) with the sparse "
          "feed_forward: sigmoid router over 4 experts of width 4, expert_bias (perturbed) for choosing only, top-2 "
          "renormalised (+1e-6) and scaled by 1.5; saved names experts.<e>.w1 / w3 / w2; tied lm_head. Reference: "
          "transformers' torch path in float32 (causal_conv1d's torch fallback)."],
         saved_names=True, noisy_buffers=("expert_bias",),
         reference_path="transformers' torch path in float32: F.conv1d for the short convolution (causal_conv1d_fn's "
                        "fallback), its conv-state update for generation; not the causal_conv1d kernels"),
    Spec("zamba", "zamba", dict(HYBRID, hidden_size=12, layers_block_type=["hybrid", "hybrid"],
                                num_attention_heads=2, num_key_value_heads=1, attention_head_dim=4, n_mamba_heads=2,
                                mamba_d_state=4, mamba_d_conv=4, mamba_expand=1, mamba_dt_rank=2, hidden_act="gelu",
                                use_mamba_kernels=False),
         ["Zamba (hidden 12, to keep the fixture small): two hybrid layers (transformers ties the shared block of "
          "one hybrid layer to nothing and fails), each running the shared transformer block (one set of weights, "
          "tied: saved once under layers.0.shared_transf) over RMSNorm([stream | token embeddings]) (width 24): GQA "
          "attention (2q/1kv of 4 dims, no rotary, scale (head_dim / 2)^-1/2), pre_ff_layernorm, a GeGLU "
          "feed_forward, no residual; the layer's linear, added to its Mamba layer's input. "
          "Mamba mixers with 2 heads of 6 channels (in_proj interleaving x and z per channel, per-head x_proj and "
          "dt_proj, state 4, dt rank 2). Reference: transformers' torch path in float32 (mamba_selective_scan's "
          "fallback, its associative scan; the recurrent update for generation)."],
         reference_path="transformers' torch path in float32: mamba_selective_scan's fallback (associative scan), the "
                        "recurrent update for generation; not the mamba_ssm / causal_conv1d kernels"),
    Spec("zamba2", "zamba2", dict(HYBRID, hidden_size=12, num_attention_heads=2, num_key_value_heads=2,
                                  layers_block_type=["hybrid", "hybrid"], n_mamba_heads=2, mamba_expand=1,
                                  mamba_ngroups=1, mamba_d_state=4, mamba_d_conv=4, chunk_size=4, num_mem_blocks=1,
                                  use_shared_attention_adapter=True, adapter_rank=2, use_mem_rope=True,
                                  use_mamba_kernels=False),
         ["Zamba2 (hidden 12: its attention is 2 x hidden wide whatever the heads): two hybrid layers running one shared transformer block (saved once, under "
          "layers.0.shared_transformer) over RMSNorm([stream | token embeddings]): attention of 2 heads of 12 "
          "(2 x hidden / heads) with rotary (use_mem_rope), scale (head_dim / 2)^-1/2, each use adding its own "
          "rank-2 adapters to q, k, v (linear_{q,k,v}_adapter_list.<use>) and to the fused gate_up_proj "
          "(gate_up_proj_adapter_list.<use>) of the GeGLU feed_forward; no residual inside the block; its output "
          "through the layer's linear into the input of the Mamba-2 layer (2 heads of 6 channels, state 4, one "
          "group, chunk_size 4, gated group norm, dt clamped at time_step_min in the chunked scan). Reference: "
          "transformers' torch path in float32 (chunked SSD scan)."],
         reference_path=MAMBA2_PATH),
    Spec("recurrent_gemma", "recurrent_gemma",
         dict({k: v for k, v in L.items() if k not in ("max_position_embeddings", "initializer_range")}, hidden_size=16, intermediate_size=8, lru_width=8, num_attention_heads=2, num_key_value_heads=1,
              block_types=["recurrent", "attention"], attention_window_size=SW, logits_soft_cap=3.0),
         ["RecurrentGemma (hidden 16): layer 0 Griffin's recurrent block (linear_y -> gelu_tanh; linear_x -> "
          "depthwise conv of width 4 with bias -> RG-LRU of width 8 in 2 head blocks: sigmoid input and recurrent "
          "gates, a = exp(-8 r softplus(recurrent_param)), h = a h + sqrt(1 - a^2) (i x), reset at position 0; "
          "linear_out(h * y)), layer 1 sliding-window attention (window 4, 2q/1kv of 8 dims, rotary on half of "
          "each head, o_proj bias); Gemma norms (1 + w), embeddings times sqrt(hidden) rounded to bfloat16, MLP "
          "of width intermediate_size / 2 with biases, logits soft-capped at 3; tied lm_head. Reference: "
          "transformers' torch path in float32 (its token-by-token scan)."],
         reference_path="transformers' torch path in float32: the RG-LRU's sequential scan and conv1d; no special "
                        "kernels"),    Spec("rwkv", "rwkv", dict(vocab_size=VOCAB, hidden_size=16, attention_hidden_size=16, intermediate_size=16,
                              num_hidden_layers=LAYERS, context_length=MAX_POS, use_cache=False, bos_token_id=BOS,
                              eos_token_id=EOS),
         ["RWKV-4 (hidden 16, channel mix of width 16): layer 0's pre_ln on the embeddings; each block ln1 -> time "
          "mix (token shift with time_mix_{key,value,receptance}; key, value, sigmoid(receptance); the WKV "
          "recurrence over -exp(time_decay) and time_first with the running-maximum scaling; output) and ln2 -> "
          "channel mix (token shift; sigmoid(receptance) * value(relu(key)^2)); ln_out; untied head. No attention "
          "mask is read: the padded row's pads run as tokens. use_cache off: its state's in-place updates break "
          "autograd, so the training forward runs without it (generate still caches). Reference: transformers' torch path in float32 "
          "(rwkv_linear_attention_cpu, token by token; no CUDA kernel on the CPU)."],
         reference_path="transformers' torch path in float32: rwkv_linear_attention_cpu (the token-by-token WKV "
                        "recurrence); not the fused CUDA kernel",
         generate_rows_apart="transformers' RWKV generate on a batch of 2 gives each row other tokens than that row "
                             "alone from the second new token on, unpadded too (its recurrent state is not carried "
                             "per row)"),
    Spec("xlstm", "xlstm", dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_heads=4,
                                qk_dim_factor=4.0, v_dim_factor=4.0, ffn_proj_factor=1.0, ffn_round_up_to_multiple_of=16,
                                output_logit_soft_cap=3.0, use_cache=False, **TOK),
         ["xLSTM (hidden 16, one block to keep the fixture small: its widths are 64): norm_mlstm -> mLSTM layer (q, k of 64 = hidden x qk_dim_factor 4, "
          "v and the output gate of 64, in 4 heads; input and forget gate pre-activations soft-capped at 15; the "
          "matrix-memory recurrence with the max stabiliser, denominator max(|q.n|, exp(-m)) + 1e-6; per-head "
          "layer norm; sigmoid output gate; out_proj) and norm_ffn -> SwiGLU ffn (proj_up_gate, proj_up of 16, "
          "proj_down); out_norm; logits soft-capped at 3; untied lm_head. The qk and v widths are multiples of 64 so "
          "that transformers' generation cache (sized from the config's rounded widths) fits its layers. The "
          "input gate biases (-10 at init: a write of e^-10) are set to N(0, 0.5) so the memory is not "
          "negligible. use_cache off for the training forward. No attention mask is read: the padded row's pads "
          "run as tokens. Reference: transformers' native path in float32 (mlstm_recurrent_sequence_native: the "
          "8-token batch is shorter than chunk_size 64; step_native for generation)."],
         prepare=lambda model: _xlstm_input_gates(model),
         reference_path="transformers' native path in float32: mlstm_recurrent_sequence_native (shorter than "
                        "chunk_size), mlstm_recurrent_step_native for generation; not the xlstm package's kernels"),    Spec("minimax", "minimax", dict(HYBRID, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                    layer_types=["linear_attention", "full_attention"], block_size=4,
                                    num_local_experts=4, num_experts_per_tok=2, linear_attn_alpha_factor=1.2,
                                    linear_attn_beta_factor=0.8, full_attn_alpha_factor=0.9,
                                    full_attn_beta_factor=1.1, mlp_alpha_factor=1.1, mlp_beta_factor=0.7),
         ["MiniMax (hidden 16): layer 0 lightning attention (qkv_proj -> silu, per head [q | k | v] of 8, zeroed at "
          "padded positions; out_t = sum_s exp(-slope_h (t - s)) (q_t . k_s) v_s in blocks of 4, so the 8-token "
          "batch spans two; RMSNorm (eps 1e-6), sigmoid(output_gate) gate, out_proj), layer 1 GQA attention "
          "(2q/1kv of 8 dims, rotary); every layer a Mixtral sparse block (router over 4 experts, softmax top-2 "
          "renormalised; saved names block_sparse_moe.experts.<e>.w1/w3/w2); residuals from the normed stream, "
          "h * alpha + f(h) * beta, with the factors away from 1 (linear 1.2 / 0.8, full 0.9 / 1.1, MLP 1.1 / 0.7). "
          "Reference: transformers' torch path in float32 (its blocked lightning attention, the recurrent step for "
          "generation)."],
         saved_names=True,
         padded_generate_uncached="transformers' cached decode step on a left-padded row differs from its own full "
                                  "forward (by 0.5 in the logits of the fixture's row 1; unpadded rows agree to 1e-6)",
         reference_path="transformers' torch path in float32: the blocked lightning attention (block_size 4) and its "
                        "token-by-token update for generation; no special kernels"),
]


def _variant(name: str, base: str, overrides: dict, notes: list) -> Spec:
    """A fixture on another's Spec with some config fields changed (a config option of its own to check)."""
    spec = next(s for s in SPECS if s.name == base)
    return dataclasses.replace(spec, name=name, overrides={**spec.overrides, **overrides}, notes=notes + spec.notes)


SPECS += [
    _variant("hunyuan_v1_dense-ntk-alpha", "hunyuan_v1_dense", dict(rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=1.0, alpha=1000.0)),
        ["rope_type dynamic with alpha 1000: HunYuan's fixed NTK-alpha scaling, base = theta * alpha ** (8 / 6) "
         "(transformers' HunYuanDenseV1RotaryEmbedding; the shared dynamic NTK would ignore alpha)."]),
    _variant("biogpt-layer-norm-eps", "biogpt", dict(layer_norm_eps=1.0),
             ["layer_norm_eps 1.0, which transformers never reads: BioGPT's LayerNorms keep torch's eps 1e-5."]),
    _variant("glm5_next_text-wide-v", "glm5_next_text", dict(v_head_dim=16),
             ["v_head_dim 16, wider than the qk head dim (nope 8 + rope 0): value heads of 16, o_proj 4 x 16 -> 32."]),
    _variant("falcon_h1-gated-norm", "falcon_h1", dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
             ["mamba_rms_norm with mamba_norm_before_gate: the mixer's output is RMS-normalised per group of "
              "channels, times mamba.norm.weight, then gated by silu(z)."]),
]


# ---- decoders transformers runs with another architecture's model under their own names -------------------------
# Smaller than L (hidden 16, 2 heads of 8 over 1 KV head): their parent's graph is checked at full size elsewhere.
TINY = dict(L, hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
SPECS += [
    Spec("exaone", "exaone", dict(TINY, num_hidden_layers=1),
         ["EXAONE 3: one layer of LlamaForCausalLM saved under its original names (transformers' conversion mapping, reversed by "
          "save_pretrained): transformer.wte / h.<i>.attn.attention.{q,k,v,out}_proj / ln_1 / ln_2 / "
          "mlp.c_fc_0 (gate), c_fc_1 (up), c_proj (down) / ln_f; rope theta 5e5."], saved_names=True),
    Spec("internlm3", "internlm3", dict(TINY, num_hidden_layers=1, head_dim=4, attention_bias=True, mlp_bias=True),
         ["InternLM3: LlamaForCausalLM; one layer; head_dim 4 (not hidden / heads); qkv_bias and bias (attention_bias, "
          "mlp_bias) on: q/k/v/o and MLP biases."]),
    Spec("iquestcoder", "iquestcoder", dict(TINY, num_hidden_layers=1, head_dim=6),
         ["IQuest-Coder: LlamaForCausalLM; one layer; head_dim 6 (not hidden / heads); untied."]),
    Spec("sarvam_moe", "sarvam_moe", dict(
        TINY, intermediate_size=8, attention_bias=True, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1),
         ["Sarvam-30B (hidden 16, experts of 8): Glm4MoeForCausalLM saved under Sarvam's names: "
          "model.word_embeddings, fused [q | k | v] attention.query_key_value (with biases), attention.dense, per-head query_layernorm / key_layernorm, "
          "mlp.gate.expert_bias (the e_score_correction_bias buffer, perturbed); full-head rotary; layer 0 dense, layer "
          "1 DeepSeek-V3 router (2 groups, 1 eligible) over 4 experts, top-2 renormalised, scaled by 2.5; one shared "
          "expert."], saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("sarvam_mla", "sarvam_mla", dict(
        {k: v for k, v in TINY.items() if k != "head_dim"}, intermediate_size=8, num_key_value_heads=2,
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5),
         ["Sarvam-105B: DeepseekV3ForCausalLM; hidden 16; MLA without a q LoRA (q_lora_rank None: one q_proj), "
          "kv_lora_rank 8, nope 8 + rope 4, v 8, interleaved rotary; layer 0 dense, layer 1 sigmoid router over 4 experts (one "
          "group), e_score_correction_bias perturbed, top-2 renormalised, scaled by 2.5; one shared expert."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("apertus1p5_text", "apertus1p5_text", dict(
        {k: v for k, v in TINY.items() if k != "head_dim"}, num_hidden_layers=1, vocab_size=VOCAB + 8, output_vocab_size=VOCAB, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64)),
         ["Apertus 1.5's text model: one Apertus layer (xIELU, q/k RMSNorm, llama3 rope) whose lm_head is pruned to "
          "output_vocab_size 48 rows while the embedding keeps vocab_size 56 (8 rows no text id looks up)."]),
    Spec("diffllama", "diffllama", dict(TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=4),
         ["DiffLlama: differential attention, 4 query heads of 4 over 2 KV heads (value halves: KV head 0 and 1); "
          "heads h and h + 2 paired, lambda from lambda_q1/k1/q2/k2 (random) and lambda_init 0.2 (layer 0), "
          "0.355 (layer 1); weightless RMS norm over each pair's 8 values."]),
    Spec("doge", "doge", dict({k: v for k, v in TINY.items() if k != "head_dim"}, keep_window_size=MAX_POS,
                              intermediate_size=8, tie_word_embeddings=True, num_hidden_layers=1, is_moe=True,
                              num_experts=16, num_experts_per_tok=4),
         ["Doge (hidden 16, one layer, 2 heads of 8 over 1 KV head): per-head q_norm / k_norm before rotary; dynamic mask "
          "attention, a score bias per key exp(A * softplus(dt_proj(values))) (A perturbed from its zeros), "
          "keep_window_size at the position table so no top-k masking; residuals scaled by input_residual and "
          "post_attention_residual (perturbed from ones); CDMoE: a SwiGLU MLP of width 8 plus 16 single-neuron experts "
          "(down_embed / up_embed) scored by product keys (router_gate's 2 x 4 logits, read through transformers' "
          "[2, tokens, 4] view), top-4 softmax-weighted; tied."]),
    Spec("kimi_linear", "kimi_linear", dict(
        {k: v for k, v in TINY.items() if k != "head_dim"}, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"], linear_num_heads=2, linear_head_dim=4, linear_conv_kernel_dim=4,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, intermediate_size=8, moe_intermediate_size=4,
        tie_word_embeddings=True),
         ["Kimi Linear (hidden 16): layer 0 Kimi Delta Attention (2 heads of 4; q/k/v_proj, causal depthwise convs of "
          "4 with silu, l2-normed q/k, beta = sigmoid(b_proj), per-key-channel decay -exp(A_log) * softplus(f_b(f_a(x)) "
          "+ dt_bias), output RMS-normed and gated by sigmoid(g_b(g_a(x)))) with a dense SwiGLU MLP of width 8; layer 1 MLA "
          "without rotary (no q LoRA, kv_lora_rank 8, nope 8 + an unrotated shared part of 4, v 8) with the sparse "
          "block_sparse_moe: sigmoid router over 4 experts of width 4 in 2 groups (1 eligible), e_score_correction_bias "
          "perturbed, top-2 renormalised, scaled by 2.5, one shared expert; tie_word_embeddings true, which "
          "KimiLinearForCausalLM ignores (its lm_head stays its own); saved names (q/k/v_conv1d, f_a/f_b_proj, "
          "dt_bias, A_log beside the projections; experts.<e>.w1 / w3 / w2). Reference: transformers' torch path in "
          "float32 (chunk_kimi_delta_attention's fallback, chunk 64)."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",),
         reference_path="transformers' torch path in float32: chunk_kimi_delta_attention and F.conv1d for prefill, "
                        "recurrent_kimi_delta_attention and the conv-state update for generation; not the fla kernels"),
    Spec("gemma3n_text", "gemma3n_text", dict(
        TINY, num_hidden_layers=2, intermediate_size=[8, 4], vocab_size_per_layer_input=VOCAB - 8,
        hidden_size_per_layer_input=4, laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=1,
        layer_types=["sliding_attention", "sliding_attention"], sliding_window=SW,
        activation_sparsity_pattern=[0.6, 0.0], final_logit_softcapping=3.0),
         ["Gemma 3n's text model (hidden 16, 2 layers with a sliding window of 4): AltUp over 2 streams "
          "(predict / correct coefficients, correct_output_scale), LAuReL of rank 4, per-layer inputs of width 4 "
          "(embed_tokens_per_layer of 40 rows: ids 40..47 read row 0), layer 1 reusing layer 0's keys and values "
          "(num_kv_shared_layers 1, no k/v projections of its own), MLP widths 8 / 4, layer 0's gate "
          "sparsified at 0.6, q/k norms, weightless v norm, scale 1, logits soft-capped at 3; tied."]),
    Spec("jetmoe", "jetmoe", dict(
        {k: v for k, v in TINY.items() if k not in ("head_dim", "num_attention_heads")}, num_hidden_layers=1,
        num_key_value_heads=2, kv_channels=4, intermediate_size=4, num_local_experts=4, num_experts_per_tok=2),
         ["JetMoE, one layer: mixture of attention heads (router over 4 query experts, top-2, softmax over the 2 "
          "logits; each expert 2 query heads of 4 over the shared kv_proj's 2 KV heads; output_linear per expert and "
          "a bias) and a sparse MLP (4 experts of width 4, top-2, fused input_linear [gate | up] / output_linear, "
          "bias); tied."]),
    Spec("gemma4_text", "gemma4_text", dict(
        TINY, num_hidden_layers=3, intermediate_size=8, num_key_value_heads=2, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, layer_types=["sliding_attention", "full_attention",
                                                                         "full_attention"],
        sliding_window=SW, num_kv_shared_layers=1, hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=4, use_double_wide_mlp=True,
        final_logit_softcapping=3.0),
         ["Gemma 4's text model (hidden 16, 3 layers: sliding window 4, full, full): head_dim 8 on the sliding layer "
          "(2 KV heads), 16 on the full ones (global_head_dim, 1 KV head: num_global_key_value_heads) whose values are "
          "their keys' projection (attention_k_eq_v), proportional rotary on a quarter of the full layers' dims; "
          "layer 2 reuses layer 1's keys and values (num_kv_shared_layers 1) and has the double-wide MLP (16); "
          "per-layer inputs of width 4; a MoE block beside every MLP (4 experts of width 4, top-2, router with its "
          "scale and per-expert scale, fused gate_up_proj / down_proj); q/k norms, weightless v norm, scale 1, "
          "layer_scalar buffers perturbed, logits soft-capped at 3; tied."],
         noisy_buffers=("layer_scalar",)),
    Spec("gemma4_unified_text", "gemma4_unified_text", dict(
        TINY, num_hidden_layers=3, intermediate_size=8, num_key_value_heads=2, global_head_dim=16,
        layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=SW,
        num_kv_shared_layers=1),
         ["Gemma 4's unified text model (hidden 16, 3 layers: sliding window 4, full, full): head_dim 8 on the sliding "
          "layer, 16 on the full ones (global_head_dim), 2 KV heads with their own v_proj (no attention_k_eq_v); "
          "layer 2 reuses layer 1's keys and values; no per-layer inputs or MoE block; q/k norms, weightless v norm, "
          "scale 1, layer_scalar buffers perturbed; tied."],
         noisy_buffers=("layer_scalar",)),
    Spec("lfm3", "lfm3", dict(TINY, num_hidden_layers=3, intermediate_size=8, sliding_window=SW, conv_L_cache=3,
                              layer_types=["conv", "sliding_attention", "full_attention"]),
         ["LFM3 (hidden 16): layer 0 LFM2's gated short-conv block (kernel 3), layer 1 sliding attention (window 4, "
          "default rotary, theta 1e4), layer 2 full attention (proportional rotary: theta 1e6 on half of the 8 "
          "head dims, the rest unrotated); attention 2q/1kv with per-head q_norm / k_norm, a sigmoid per-head gate "
          "on the layer input (saved as gate_proj, g_proj in memory), o_proj; every layer operator_norm, post_operator_norm, ffn_norm, post_ffn_norm "
          "(sandwich norms) and a SwiGLU feed_forward (w1, w3, w2) of width 8; embedding_norm as the final norm. "
          "Reference: transformers' torch path in float32 (causal_conv1d's torch fallback)."],
         saved_names=True,
         reference_path="transformers' torch path in float32: F.conv1d for the short convolution (causal_conv1d_fn's "
                        "fallback), its conv-state update for generation; not the causal_conv1d kernels"),
    Spec("cpmant", "cpmant", dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, dim_head=8, dim_ff=16,
                                  num_hidden_layers=2, prompt_types=3, prompt_length=2, segment_types=3,
                                  position_bias_num_buckets=8, position_bias_max_distance=16, **TOK),
         ["CPM-Ant (hidden 16, 2 heads of 8, GeGLU of width 16, 2 layers): 2 prompt tokens (of 3 x 2 extra embedding "
          "rows; the model reads rows vocab + 4 and vocab + 5) before the text, segment embeddings (prompt 0, text 2, "
          "id 0 counts as padding), bidirectional attention over the valid columns with a per-head bias from one "
          "table: 8 log buckets of key - query (max distance 16) within a segment, segment pairs across; labels not "
          "shifted; untied lm_head. Greedy generation as transformers' cached steps (each step's query over the "
          "stored keys)."]),
    Spec("dots3_note_text", "dots3_note_text", dict(
        L, hidden_size=16, intermediate_size=16, layer_types=["sliding_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse"], num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8,
        kv_lora_rank=8, head_dim=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, swa_num_attention_heads=1,
        swa_num_key_value_heads=1, swa_q_lora_rank=6, swa_kv_lora_rank=6, swa_head_dim=8, swa_qk_nope_head_dim=4,
        swa_v_head_dim=6, sliding_window=SW, index_topk=4, index_head_dim=8, index_n_heads=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=8, shared_experts_intermediate_size=4,
        n_shared_experts=1, routed_scaling_factor=1.5),
         ["dots3-note's text decoder (hidden 16): layer 0 sliding MLA (window 4; its own sizes: 1 head, q / kv LoRA "
          "ranks 6, nope 4 + rope 4, v 6; rope theta 5e4) with a dense SwiGLU, layer 1 indexed MLA (2 heads, ranks 8, "
          "nope 4 + rope 4, v 4; theta 8e7) whose GLM-5 indexer (8 heads of 8, interleaved rotary; 8 heads so that "
          "no two keys tie at a zero score, where torch.topk picks either) keeps 4 keys per query, with "
          "DeepSeek-V3's grouped sigmoid router (4 experts in 2 groups, top-1 group, top-2, scaled by 1.5) and a "
          "shared expert of width 4; every layer a rope-only key RMSNorm, LoRA latents scaled by "
          "sqrt(hidden / rank) and a per-head sigmoid gate g_proj; saved names (experts.<e>.*)."],
         saved_names=True, noisy_buffers=("e_score_correction_bias",)),
    Spec("xlnet", "xlnet", dict(vocab_size=VOCAB, d_model=16, n_layer=2, n_head=2, d_inner=16, ff_activation="gelu",
                                mem_len=12, dropout=0.0, **TOK),
         ["XLNet (d_model 16, 2 heads of 8, 2 layers, FFN 16 gelu): post-LN layers whose attention adds content "
          "(q + r_w_bias) k, relative positions (q + r_r_bias) through the sinusoid table of distances klen .. "
          "-qlen + 1 (Transformer-XL's relative shift) and no segment term without token types; the plain forward "
          "is the content stream, bidirectional, padded keys hidden from real queries (a padded query sees "
          "itself); labels not shifted; lm_loss tied to word_embedding with its own bias. Greedy generation as "
          "transformers' XLNetLMHeadModel: each step appends a dummy token 0 hidden by perm_mask from every "
          "query, predicts it through the query stream (mask_emb, target_mapping on the last position) and keeps "
          "every layer's inputs as mems (the last 12, mem_len), of which the last 2 are dropped and recomputed; "
          "attention_mask is not used by generate."],
         model_class="XLNetLMHeadModel", loss_shifts_labels=False),
]


SKIPPED = {
    # model_type: reason (not attempted)
    "code_llama": "tokenizer-only name; the model is llama",
    "mllama_text_model": "cross-attention layers to vision states; needs the vision model",
    "mra": "MRA's multi-resolution attention runs only through transformers' CUDA kernels: without them its "
           "mra2_attention returns zeros, so there is no reference to verify against",
    "exaone4_5_text": "not in this transformers",
    "gemma4_assistant": "Gemma 4's drafter for assisted generation: its forward takes the target model's "
                        "inputs_embeds and shared_kv_states, not token ids (transformers raises without them), so it "
                        "has no causal-LM run of its own; needs assisted decoding with gemma4_text",
    "gemma4_unified_assistant": "gemma4_unified's drafter, as gemma4_assistant: runs only on the target model's "
                                "inputs_embeds and shared_kv_states; needs assisted decoding with gemma4_unified_text",
}


def _xlstm_input_gates(model):
    """xLSTM's input-gate biases at N(0, 0.5) instead of -10 (+ noise), so that the memory's writes show."""
    g = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("igate_preact.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def reinit_(model):
    """Deterministic weights independent of each architecture's own _init_weights."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.ndim >= 2:
                p.copy_(noise * INIT_STD)
            else:
                p.add_(noise * VEC_STD)


def _hash_tables(model):
    """DeepSeek-V4's hash routing tables (tid2eid, zeros at init): distinct random experts for every token."""
    g = torch.Generator().manual_seed(4321)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            experts = model.config.n_routed_experts
            b.copy_(torch.stack([torch.randperm(experts, generator=g)[:b.shape[1]] for _ in range(b.shape[0])]))


def _glm5_next_text_lm():
    """GLM-5.3-Flash's text model with an lm_head: transformers 5.24 ships Glm5NextTextModel but no causal LM for it
    (only the multimodal Glm5NextForConditionalGeneration, whose text half is this)."""
    from torch import nn
    from transformers import GenerationMixin
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    from transformers.models.glm5_next import modeling_glm5_next as glm5

    class Glm5NextTextForCausalLM(glm5.Glm5NextPreTrainedModel, GenerationMixin):
        config_class = transformers.Glm5NextTextConfig
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

        def __init__(self, config):
            super().__init__(config)
            self.model = glm5.Glm5NextTextModel(config)
            self.vocab_size = config.vocab_size
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                    labels=None, use_cache=None, logits_to_keep=0, **kwargs):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
            logits = self.lm_head(out.last_hidden_state)
            loss = (self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size, **kwargs)
                    if labels is not None else None)
            return MoeCausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)

    return Glm5NextTextForCausalLM


LOCAL_MODEL_CLASSES = {"Glm5NextTextForCausalLM": _glm5_next_text_lm}  # causal LMs transformers does not ship


def make_inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g, dtype=torch.int64)
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    ids[1, :LEFT_PAD] = PAD
    mask[1, :LEFT_PAD] = 0
    labels = ids.masked_fill(mask == 0, -100)
    # The first real token of the padded row would be predicted by the last pad position, a query that
    # sees no key: eager attention averages all values there, other kernels return zeros. Keep it out
    # of the loss so loss and gradients compare attention semantics that all implementations share.
    labels[1, LEFT_PAD] = -100
    return ids, mask, labels


def check_overrides(config, overrides):
    """Name overrides that the config did not keep as given (typo, renamed, or normalised)."""
    issues = []
    fields = set(getattr(config, "__dataclass_fields__", {})) | set(getattr(config, "attribute_map", {}))
    for k, v in overrides.items():
        if fields and k not in fields:
            issues.append(f"{k}: not a field of {type(config).__name__}")
            continue
        try:
            got = getattr(config, k, None)
        except Exception:  # noqa: BLE001 a per-layer attribute: Gemma 4's (AmbiguousGlobalPerLayerAttributeError) or dots3-note's (RuntimeError)
            got = config.__dict__[k] if k in config.__dict__ else config.to_dict().get(k)
        if isinstance(v, dict) and hasattr(got, "to_dict"):  # a nested config (DBRX attn_config / ffn_config)
            got = got.to_dict()
        if isinstance(v, dict) and isinstance(got, dict):
            diff = {kk: got.get(kk) for kk, vv in v.items() if got.get(kk) != vv}
            if diff:
                issues.append(f"{k}: {diff}")
        elif got != v:
            issues.append(f"{k}: asked {v!r}, config has {got!r}")
    return issues


def _saved_layout(model, tensors: dict) -> dict:
    """{in-memory name: tensor} -> {saved name: tensor}, by the conversion save_pretrained applies."""
    from transformers.core_model_loading import revert_weight_conversion
    return {n: t.detach().float().contiguous().clone() for n, t in revert_weight_conversion(model, dict(tensors)).items()}


def _with_saved_names(model, ref: dict) -> dict:
    """The reference with grad./adamw./adamw2. tensors renamed (and split) as model.safetensors stores them."""
    out = {k: v for k, v in ref.items() if not k.startswith(("grad.", "adamw.", "adamw2."))}
    for kind in ("grad", "adamw", "adamw2"):
        named = {k[len(kind) + 1:]: v for k, v in ref.items() if k.startswith(kind + ".")}
        if named:
            out.update({f"{kind}.{n}": t for n, t in _saved_layout(model, named).items()})
    return out


def save_reference(ref: dict, folder: Path) -> None:
    """Write ``folder``/reference.safetensors, its adamw./adamw2. parameters stored as int16 steps from the
    folder's model.safetensors (tools/compact_adamw_fixtures.py: the form tests/fixture_cases.py reads)."""
    save_file(ref, str(folder / "reference.safetensors"))
    compact_file(folder / "reference.safetensors")


def publish(tmp: Path, out: Path, meta: dict) -> dict:
    """Write meta.json into the fixture's temporary folder, then move it into place in one rename (a failed
    build never leaves a half-written fixture)."""
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    tmp.rename(out)
    return meta


def init_and_save(model, spec, tmp: Path) -> Path:
    """Re-initialise ``model`` (reinit_, then the Spec's perturbed ``noisy_buffers`` and ``prepare``, if a Spec is
    given) and save it to ``tmp``."""
    reinit_(model)
    if spec is not None and spec.noisy_buffers:
        g = torch.Generator().manual_seed(4321)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith(spec.noisy_buffers):
                    b.add_(torch.randn(b.shape, generator=g, dtype=torch.float32) * VEC_STD)
    if spec is not None and spec.prepare is not None:
        with torch.no_grad():
            spec.prepare(model)
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    return tmp


def greedy_reference(model, prompt):
    """transformers' cached greedy continuation of ``prompt`` (NEW_TOKENS tokens, eos off) and its logits per step."""
    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               use_cache=True, eos_token_id=None, pad_token_id=PAD, bos_token_id=BOS,
                               num_beams=1, temperature=None, top_p=None, top_k=None)
    # generate() fills the eos_token_id=None above from model.generation_config (eos 2), and min_new_tokens
    # then masks token 2 out of every step: the tokens would be argmax over the others while output_logits
    # stay raw. Clear it for the call so the continuation is the plain argmax (generation_config.json is
    # already saved; fixtures whose raw argmax never hit token 2 are unchanged by this).
    saved_eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=gen_cfg,
                             output_logits=True, return_dict_in_generate=True)
    finally:
        model.generation_config.eos_token_id = saved_eos
    tokens = gen.sequences
    assert tokens.shape == (1, prompt.shape[1] + NEW_TOKENS), tokens.shape
    return tokens, torch.cat([step.float() for step in gen.logits], dim=0)


def build(spec: Spec, out_root: Path):
    out = out_root / spec.name
    if out.exists():
        shutil.rmtree(out)
    torch.manual_seed(0)
    config = CONFIG_MAPPING[spec.model_type](**spec.overrides)
    if spec.model_class:
        cls = getattr(transformers, spec.model_class, None) or LOCAL_MODEL_CLASSES[spec.model_class]()
        model = cls._from_config(config, attn_implementation=spec.attn, **FLOAT32)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=spec.attn, **FLOAT32)
    model = model.float().eval()
    issues = check_overrides(model.config, spec.overrides)
    tmp = init_and_save(model, spec, out_root / (spec.name + ".tmp"))
    if spec.saved_model_type:
        config_file = tmp / "config.json"
        saved = json.loads(config_file.read_text())
        saved["model_type"] = spec.saved_model_type
        config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        reloaded = transformers.AutoConfig.from_pretrained(tmp)
        if type(reloaded) is not type(config):
            raise RuntimeError(f"model_type {spec.saved_model_type!r} loads as {type(reloaded).__name__}")

    ids, mask, labels = make_inputs()
    if not spec.loss_shifts_labels:
        labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    params = dict(model.named_parameters())  # tied weights appear once, under their canonical name
    out_fwd = model(input_ids=ids, attention_mask=mask, labels=labels)
    logits = out_fwd.logits.detach().float()
    loss = out_fwd.loss
    loss.backward()
    ref = {
        "input_ids": ids.to(torch.int32),
        "attention_mask": mask.to(torch.int32),
        "labels": labels.to(torch.int32),
        "logits": logits.contiguous(),
        "loss": loss.detach().float().reshape(()),
    }
    no_grad = []
    for n, p in params.items():
        if p.grad is None:
            no_grad.append(n)
            ref[f"grad.{n}"] = torch.zeros_like(p.detach())
        else:
            ref[f"grad.{n}"] = p.grad.detach().float().contiguous().clone()

    with torch.no_grad():
        # Left padding: does the padded row's output equal that of the same tokens unpadded?
        alone = model(input_ids=ids[1:, LEFT_PAD:], attention_mask=mask[1:, LEFT_PAD:]).logits[0]
        pad_diff = (alone - logits[1, LEFT_PAD:]).abs().max().item()

        prompt = ids[:1]
        tokens, glogits = greedy_reference(model, prompt)
        assert glogits.shape == (NEW_TOKENS, logits.shape[-1]), glogits.shape
        argmax_ok = bool((glogits.argmax(-1) == tokens[0, SEQ:]).all())
        full = model(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits[0, SEQ - 1:-1]
        cache_diff = (full - glogits).abs().max().item()
        prefill_diff = (glogits[0] - logits[0, -1]).abs().max().item()
    ref["greedy_tokens"] = tokens.to(torch.int32)
    ref["greedy_logits"] = glogits.contiguous()

    opt = torch.optim.AdamW(list(params.values()), foreach=False, **ADAMW)
    opt.step()
    for n, p in params.items():
        ref[f"adamw.{n}"] = p.detach().float().contiguous().clone()
    if spec.adamw_steps == 2:
        # A second training step on the same batch: fresh gradients at the updated weights, then the
        # same optimizer (its moments and step count carry over).
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        for n, p in params.items():
            ref[f"adamw2.{n}"] = p.detach().float().contiguous().clone()

    for k, v in ref.items():
        if not torch.isfinite(v.float()).all():
            raise RuntimeError(f"non-finite values in {k}")
    if spec.saved_names:
        ref = _with_saved_names(model, ref)
        no_grad = sorted(_saved_layout(model, {n: params[n].detach() for n in no_grad})) if no_grad else []
    save_reference(ref, tmp)

    saved = set(load_file(str(tmp / "model.safetensors")).keys())
    tied = model.get_output_embeddings() is not None and model.get_input_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tied = tied or bool(getattr(config, "shared_input_output_embedding", False))  # OpenLlama: no lm_head at all
    softcap = getattr(config, "final_logit_softcapping", None)
    meta = {
        "fixture": spec.name,
        "model_type": spec.model_type,
        "model_class": type(model).__name__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "config_overrides": spec.overrides,
        "config_override_issues": issues,
        "attn_implementation": spec.attn,
        "init": f"after construction (torch.manual_seed(0)): params with ndim>=2 = N(0,{INIT_STD}), "
                f"1-D params += N(0,{VEC_STD}), generator seed 1234, named_parameters() order",
        "adamw": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                  "weight_decay": ADAMW["weight_decay"], "foreach": False},
        "generation": {"prompt": "input_ids[0] (unpadded)", "max_new_tokens": NEW_TOKENS, "do_sample": False,
                       "use_cache": True, "eos_token_id": None},
        "notes": spec.notes,
        "num_parameters": sum(p.numel() for p in params.values()),
        "parameters": list(params.keys()),
        "tied_word_embeddings": bool(tied),
        "final_logit_softcapping": softcap,
        "params_without_grad": no_grad,
        "saved_keys_not_parameters": sorted(saved - set(params)),
        "parameters_not_saved": sorted(set(params) - saved),
        "checks": {
            "loss": round(loss.item(), 6),
            "logits_std": round(logits[mask.bool()].std().item(), 4),
            "left_pad_invariant": pad_diff < 1e-4,
            "left_pad_max_abs_diff": float(f"{pad_diff:.3g}"),
            "greedy_logits_argmax_equals_tokens": argmax_ok,
            "greedy_logits_vs_no_cache_forward_max_abs_diff": float(f"{cache_diff:.3g}"),
            "greedy_first_step_vs_batch_logits_max_abs_diff": float(f"{prefill_diff:.3g}"),
        },
    }
    if spec.reference_path:
        meta["reference_path"] = spec.reference_path
    if not spec.loss_shifts_labels:
        meta["loss_shifts_labels"] = False  # labels[t] is the target of logits[t]
    if spec.saved_names:
        meta["reference_names"] = ("saved: grad./adamw. keys (and params_without_grad) use the names of "
                                   "model.safetensors (one tensor per expert), not named_parameters()")
    if spec.adamw_steps == 2:
        meta["adamw"]["second_step"] = "adamw2.<param>: a second forward/backward on the same batch, then step"
    return publish(tmp, out, meta)


# ---- LoRA (PEFT) on the llama fixture ----------------------------------------------------------
LORA_FIXTURE = "llama_lora"
LORA_BASE = "llama"
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
LORA_REFERENCE = "lora_reference.safetensors"
LORA_STD = 0.2                   # lora_A and lora_B ~ N(0, 0.2): B != 0, so the adapter changes the logits


def _lora_model_name(peft_name: str) -> str:
    """PEFT's in-memory name -> the base model's module path (what vkformers calls the parameter)."""
    name = peft_name[len("base_model.model."):] if peft_name.startswith("base_model.model.") else peft_name
    return name.replace(".default.", ".")


def build_lora(out_root: Path):
    """<out_root>/llama_lora/: a PEFT adapter on the llama fixture's model, and PEFT's outputs with it.

    Written: adapter_model.safetensors + adapter_config.json (PeftModel.save_pretrained), lora_reference.safetensors
    (inputs as in the llama fixture, logits, loss, grad.<lora param>, adamw.<lora param>), meta.json.
    The base weights are the llama fixture's (loaded from <out_root>/llama, so build that first).
    """
    from peft import LoraConfig, PeftModel, get_peft_model
    import peft

    base_dir = out_root / LORA_BASE
    if not (base_dir / "model.safetensors").is_file():
        raise RuntimeError(f"{base_dir} is missing: build the {LORA_BASE} fixture first")
    out = out_root / LORA_FIXTURE
    if out.exists():
        shutil.rmtree(out)
    tmp = out_root / (LORA_FIXTURE + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)

    def base_model():
        return AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                    dtype=torch.float32).float().eval()

    torch.manual_seed(0)
    model = get_peft_model(base_model(), LoraConfig(task_type="CAUSAL_LM", **LORA))
    g = torch.Generator().manual_seed(4321)
    lora_params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for _, p in lora_params.items():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * LORA_STD)
    # Recorded in adapter_config.json; PEFT would write the absolute path of base_dir.
    model.peft_config["default"].base_model_name_or_path = LORA_BASE
    model.save_pretrained(tmp)
    readme = tmp / "README.md"      # PEFT's model card template: not needed
    if readme.exists():
        readme.unlink()
    # PEFT keeps target_modules as a set and writes it in hash order (differs between runs): sort it so
    # the file is reproducible, otherwise unchanged (PEFT's own formatting: indent 2, sorted keys).
    config_file = tmp / "adapter_config.json"
    adapter_config = json.loads(config_file.read_text())
    adapter_config["target_modules"] = sorted(adapter_config["target_modules"])
    config_file.write_text(json.dumps(adapter_config, indent=2, sort_keys=True))

    ids, mask, labels = make_inputs()
    out_fwd = model(input_ids=ids, attention_mask=mask, labels=labels)
    logits = out_fwd.logits.detach().float()
    out_fwd.loss.backward()
    ref = {"input_ids": ids.to(torch.int32), "attention_mask": mask.to(torch.int32),
           "labels": labels.to(torch.int32), "logits": logits.contiguous(),
           "loss": out_fwd.loss.detach().float().reshape(())}
    for n, p in lora_params.items():
        ref[f"grad.{_lora_model_name(n)}"] = p.grad.detach().float().contiguous().clone()

    with torch.no_grad():
        base_logits = base_model()(input_ids=ids, attention_mask=mask).logits
        reloaded = PeftModel.from_pretrained(base_model(), tmp).eval()
        reload_logits = reloaded(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    adapter_effect = (logits - base_logits)[real].abs().max().item()
    reload_diff = (logits - reload_logits)[real].abs().max().item()
    if reload_diff > 1e-6:
        raise RuntimeError(f"the saved adapter, reloaded by PEFT, changes the logits by {reload_diff}")

    opt = torch.optim.AdamW(list(lora_params.values()), foreach=False, **ADAMW)
    opt.step()
    for n, p in lora_params.items():
        ref[f"adamw.{_lora_model_name(n)}"] = p.detach().float().contiguous().clone()
    for k, v in ref.items():
        if not torch.isfinite(v.float()).all():
            raise RuntimeError(f"non-finite values in {k}")
    # not "reference.safetensors": the decoder parity tests take every folder holding one for a model fixture
    save_file(ref, str(tmp / LORA_REFERENCE))

    meta = {
        "fixture": LORA_FIXTURE,
        "base_fixture": LORA_BASE,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "peft_version": peft.__version__,
        "lora_config": LORA,
        "init": f"lora_A and lora_B = N(0,{LORA_STD}), generator seed 4321, named_parameters() order "
                "(PEFT's default B = 0 would leave the logits unchanged)",
        "adamw": {"lr": ADAMW["lr"], "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"],
                  "weight_decay": ADAMW["weight_decay"], "foreach": False, "params": "LoRA parameters only"},
        "lora_parameters": [_lora_model_name(n) for n in lora_params],
        "peft_parameter_names": list(lora_params),
        "checks": {
            "loss": round(out_fwd.loss.item(), 6),
            "adapter_changes_logits_max_abs": float(f"{adapter_effect:.3g}"),
            "peft_reload_of_saved_adapter_logits_max_abs_diff": float(f"{reload_diff:.3g}"),
        },
    }
    return publish(tmp, out, meta)


def parse_fixture_args(argv, specs, default_out, extra_names=(), name_width=22):
    """The options every fixture script takes (--only, --out, --list, -v). Prints the list and returns None
    for --list; otherwise makes torch deterministic and returns (args, output folder, names asked for)."""
    ap = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated fixture names")
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--verbose", "-v", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args(argv)
    if args.list:
        for s in specs:
            print(f"{s.name:{name_width}s} {s.model_type:22s} {' '.join(s.notes)[:90]}")
        return None
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    only = [x for x in args.only.split(",") if x]
    unknown = set(only) - {s.name for s in specs} - set(extra_names)
    if unknown:
        ap.error(f"unknown fixture(s): {sorted(unknown)}")
    return args, out_root, only


def build_each(specs, only, out_root, build, summary, verbose=False):
    """build(spec, out_root) for every spec asked for; a failure removes its half-written folder and
    the rest go on. summary(meta) is the text after "ok". Returns ({name: meta}, {name: reason})."""
    built, failed = {}, {}
    width = max(len(s.name) for s in specs)
    for spec in specs:
        if only and spec.name not in only:
            continue
        try:
            meta = build(spec, out_root)
            built[spec.name] = meta
            print(f"ok    {spec.name:{width}s} {summary(meta)}")
        except Exception as e:  # record and go on
            tmp = out_root / (spec.name + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            failed[spec.name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(f"FAIL  {spec.name:{width}s} {failed[spec.name]}")
            if verbose:
                traceback.print_exc()
    return built, failed


def main(argv=None):
    parsed = parse_fixture_args(argv, SPECS, DEFAULT_OUT, extra_names={LORA_FIXTURE})
    if parsed is None:
        return 0
    args, out_root, only = parsed
    major = int(transformers.__version__.split(".")[0])
    other_line = {s.name: s.transformers_major for s in SPECS if s.transformers_major != major}
    if major != 5:
        other_line[LORA_FIXTURE] = 5  # built on the 5.x llama fixture
    asked_other = sorted(set(only) & set(other_line))
    if asked_other:
        print(f"{', '.join(asked_other)}: need transformers {other_line[asked_other[0]]}.x, this is "
              f"{transformers.__version__} (tests/fixtures/README.md says how to build them)", file=sys.stderr)
        return 2
    specs_here = [s for s in SPECS if s.name not in other_line]
    index_path = out_root / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    built, failed = index.get("built", {}), index.get("failed", {})
    if not only:  # a full run rewrites the index, but keeps the entries of the other release line's fixtures
        built = {n: e for n, e in built.items() if n in other_line}
        failed = {n: e for n, e in failed.items() if n in other_line}
    for spec in specs_here:
        if not only or spec.name in only:
            built.pop(spec.name, None)
            failed.pop(spec.name, None)
    new, new_failed = build_each(
        specs_here, only, out_root, build, verbose=args.verbose,
        summary=lambda meta: (f"loss={meta['checks']['loss']:.4f} std={meta['checks']['logits_std']} "
                              f"pad_inv={meta['checks']['left_pad_invariant']} "
                              f"cache_diff={meta['checks']['greedy_logits_vs_no_cache_forward_max_abs_diff']} "
                              f"issues={meta['config_override_issues']}"))
    specs = {spec.name: spec for spec in SPECS}
    for name, meta in new.items():
        built[name] = {"model_type": specs[name].model_type, "model_class": meta["model_class"],
                       "left_pad_invariant": meta["checks"]["left_pad_invariant"],
                       "tied_word_embeddings": meta["tied_word_embeddings"]}
        if specs[name].reference_path:
            built[name]["reference_path"] = specs[name].reference_path
        if specs[name].transformers_major != 5:  # the index's top-level versions are the main (5.x) run's
            built[name]["transformers_version"] = meta["transformers_version"]
            built[name]["torch_version"] = meta["torch_version"]
    for name, reason in new_failed.items():
        failed[name] = {"model_type": specs[name].model_type, "reason": reason}
    if LORA_FIXTURE not in other_line and (not only or LORA_FIXTURE in only):
        try:
            meta = build_lora(out_root)
            print(f"ok    {LORA_FIXTURE:22s} loss={meta['checks']['loss']:.4f} "
                  f"adapter_effect={meta['checks']['adapter_changes_logits_max_abs']} "
                  f"peft_reload_diff={meta['checks']['peft_reload_of_saved_adapter_logits_max_abs_diff']}")
        except Exception as e:
            tmp = out_root / (LORA_FIXTURE + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)
            print(f"FAIL  {LORA_FIXTURE:22s} {type(e).__name__}: {e}")
            if args.verbose:
                traceback.print_exc()
    versions = {"transformers_version": transformers.__version__, "torch_version": torch.__version__}
    if major != 5:
        versions = {k: index.get(k, v) for k, v in versions.items()}
    index = {**versions, "built": dict(sorted(built.items())), "failed": dict(sorted(failed.items())),
             "not_attempted": dict(sorted(SKIPPED.items()))}
    index_path.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
