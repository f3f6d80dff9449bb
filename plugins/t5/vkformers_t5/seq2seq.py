"""One encoder-decoder for every architecture of the family, configured by a :class:`Seq2SeqSpec`.

``model(input_ids, attention_mask=None, decoder_input_ids=None, labels=None)`` follows
transformers' *ForConditionalGeneration: with labels and no decoder inputs the decoder reads the
labels shifted right (decoder_start_token_id first, -100 replaced by pad; mBART/PLBart wrap the
last non-pad label to the front instead), and the loss is the mean cross-entropy over labels !=
-100 (no shift). ``generate`` (core's Seq2SeqGenerationMixin) decodes greedily (or samples) with a decoder
self-attention KV cache; the encoder runs once and each layer's cross-attention keys/values are computed once.

Attention: the fused kernel (``F.scaled_dot_product_attention``) wherever it fits: BART-style
self-attention and every cross-attention. T5's relative position bias is an additive term the kernel
does not take, so T5 self-attention is composed from engine ops (q k^T + bias, softmax, @ v) and
autograd gives its backward, the bias table's gradient included. The bias is looked up once per
stack from layer 0's table and shared by the layers (umT5: each layer its own table). T5Gemma's encoder
sliding-window layers (a bidirectional window, which the kernel does not take) are composed the same way.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial

import numpy as np

from vkformers.engine import functional as F
from vkformers.engine.ops.cache import write_kv
from vkformers.engine.ops.routing import PackedRoutes, topk_mask
from vkformers.engine.rope_scaling import rope_parameters
from vkformers.engine.tensor import Tensor, tensor
from vkformers.errors import VkformersError
from vkformers.models.cache import EncoderDecoderCache
from vkformers.models.inputs import InputLimits, id_array
from vkformers.models.layers import (Embedding, LayerNorm, Linear, ModuleList, RMSNorm, grouped_linear,
                                     linears_can_be_grouped)
from vkformers.models.lazy_weights import LazyWeights, Weight
from vkformers.models.module import Module, add_param, get_param
from vkformers.models.seq2seq_generation import Seq2SeqGenerationMixin
from vkformers.runtime import dtypes as dt

from vkformers_t5.variants import (Seq2SeqSpec, UnsupportedConfigError, fairseq_table, relative_buckets, seq2seq_spec,
                                   sinusoidal_table, transient_global_blocks)

IGNORE_INDEX = -100
MASKED = -1e9  # additive score of a hidden key in the composed attention (exp underflows to exactly 0)

# Hugging Face parameter names of the two layouts. Layer paths are relative to a layer; {ffn} is the
# index of T5's feed-forward sub-layer (1 in the encoder, 2 in the decoder, after cross-attention).
LAYOUTS = {
    "t5": dict(shared="shared", encoder="encoder", decoder="decoder", layers="block", positions=None,
               embed_norm=None, final_norm="final_layer_norm",
               self_attn="layer.0.SelfAttention", self_norm="layer.0.layer_norm",
               cross_attn="layer.1.EncDecAttention", cross_norm="layer.1.layer_norm",
               ffn="layer.{ffn}.DenseReluDense", ffn_norm="layer.{ffn}.layer_norm",
               q="q", k="k", v="v", o="o", up="wi", gate="wi_0", gated_up="wi_1", down="wo", lm_head="lm_head"),
    "bart": dict(shared="model.shared", encoder="model.encoder", decoder="model.decoder", layers="layers",
                 positions="embed_positions", embed_norm="layernorm_embedding", final_norm="layer_norm",
                 self_attn="self_attn", self_norm="self_attn_layer_norm",
                 cross_attn="encoder_attn", cross_norm="encoder_attn_layer_norm",
                 ffn="", ffn_norm="final_layer_norm",
                 q="q_proj", k="k_proj", v="v_proj", o="out_proj", up="fc1", gate=None, gated_up=None, down="fc2",
                 lm_head="lm_head"),
}
# Switch Transformers: T5's names, the feed-forward module is "mlp" (sparse ones: mlp.router / mlp.experts)
LAYOUTS["switch"] = dict(LAYOUTS["t5"], ffn="layer.{ffn}.mlp")
# FSMT: BART's layer names, no shared table (each stack its own vocabulary), the head inside the decoder
LAYOUTS["fsmt"] = dict(LAYOUTS["bart"], shared=None, lm_head="model.decoder.output_projection")
# BigBird-Pegasus: each stack's last norm is named layernorm_embedding; the encoder's self-attention is BigBird's
# (q/k/v under self_attn.self, the output projection self_attn.output), the decoder's BART's
LAYOUTS["bigbird_pegasus"] = dict(LAYOUTS["bart"], embed_norm=None, final_norm="layernorm_embedding",
                                  encoder_self_attn=dict(q="self.query", k="self.key", v="self.value", o="output"))
# T5Gemma: Gemma 2 layers (a norm before and after each sublayer), no shared table, the head under lm_head.out_proj
LAYOUTS["t5gemma"] = dict(LAYOUTS["bart"], shared=None, positions=None, embed_norm=None, final_norm="norm",
                          self_norm="pre_self_attn_layernorm", cross_attn="cross_attn",
                          cross_norm="pre_cross_attn_layernorm", ffn="mlp", ffn_norm="pre_feedforward_layernorm",
                          self_post_norm="post_self_attn_layernorm", cross_post_norm="post_cross_attn_layernorm",
                          ffn_post_norm="post_feedforward_layernorm", o="o_proj", up=None, gate="gate_proj",
                          gated_up="up_proj", down="down_proj", lm_head="lm_head.out_proj")
# T5Gemma 2: the encoder's text stack under encoder.text_model (checkpoints store it under encoder, which
# transformers renames as it loads), one table for both stacks and the head, the vision tower's weights skipped
LAYOUTS["t5gemma2"] = dict(LAYOUTS["t5gemma"], encoder="model.encoder.text_model", tie_to_encoder_embeddings=True,
                           checkpoint_renames=((r"^model\.encoder\.(embed_tokens|layers|norm)\.",
                                                r"model.encoder.text_model.\1."),),
                           ignored_prefixes=("model.encoder.vision_tower.", "model.encoder.multi_modal_projector."))

# LongT5: T5's names; the encoder's self-attention module is named after its kind
LAYOUTS["longt5"] = dict(LAYOUTS["t5"], encoder_self_attn_path="layer.0.LocalSelfAttention")
LAYOUTS["longt5_tglobal"] = dict(LAYOUTS["t5"], encoder_self_attn_path="layer.0.TransientGlobalSelfAttention")

# LED: BART's names under the led prefix; the encoder's self-attention is Longformer's
LAYOUTS["led"] = dict(LAYOUTS["bart"], shared="led.shared", encoder="led.encoder", decoder="led.decoder",
                      encoder_self_attn=dict(q="longformer_self_attn.query", k="longformer_self_attn.key",
                                             v="longformer_self_attn.value", o="output"),
                      encoder_global_attn=dict(q="longformer_self_attn.query_global",
                                               k="longformer_self_attn.key_global",
                                               v="longformer_self_attn.value_global"))

# NLLB-MoE: BART's names with M2M-100's layers renamed; a sparse layer's ffn holds router.classifier and
# experts.expert_<e>.fc1/fc2
LAYOUTS["nllb_moe"] = dict(LAYOUTS["bart"], cross_attn="cross_attention", cross_norm="cross_attention_layer_norm",
                           ffn="ffn", ffn_norm="ff_layer_norm")

# ProphetNet: one word_embeddings table, post-LN layers with a feed_forward module, no final norms
LAYOUTS["prophetnet"] = dict(LAYOUTS["bart"], shared="prophetnet.word_embeddings", encoder="prophetnet.encoder",
                             decoder="prophetnet.decoder", embed_tokens="word_embeddings",
                             positions="position_embeddings", embed_norm="embeddings_layer_norm", final_norm=None,
                             cross_attn="cross_attn", cross_norm="cross_attn_layer_norm", ffn="feed_forward",
                             ffn_norm="feed_forward_layer_norm", q="query_proj", k="key_proj", v="value_proj",
                             o="out_proj", up="intermediate", down="output")

# Checkpoint tensors that are not parameters: BART's final_logits_bias (a buffer, read by load_state_dict),
# fixed sinusoidal tables (recomputed from the config), and a bias table old T5 checkpoints carry in
# cross-attention that transformers ignores too.
IGNORED_CHECKPOINT_KEYS = ("final_logits_bias", "embed_positions.weight", "embed_positions.weights",
                           "EncDecAttention.relative_attention_bias.weight")


@dataclass
class Seq2SeqLMOutput:
    logits: object = None
    loss: object = None
    encoder_last_hidden_state: object = None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def place(root: Module, path: str, module: Module) -> Module:
    """Attach ``module`` under a dotted HF path, creating plain container modules on the way."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        node = node._modules[part] if part in node._modules else node.add(part, Module())
    return node.add(name, module)


def make_norm(spec: Seq2SeqSpec) -> Module:
    if spec.norm == "rms":
        return RMSNorm(spec.d_model, eps=spec.norm_eps, unit_offset=spec.norm_unit_offset)
    return LayerNorm(spec.d_model, eps=spec.norm_eps)


# ---------------------------------------------------------------- attention

class Attention(Module):
    """q/k/v/o projections; self-attention (optionally with T5's relative bias table) or cross-attention.
    ``kv_heads`` < ``heads``: grouped-query attention (k and v have kv_heads heads)."""

    def __init__(self, spec: Seq2SeqSpec, names: dict, heads: int, bias_table: bool, kv_heads: int | None = None,
                 transient_global: bool = False, longformer_global: bool = False, ngram: bool = False):
        super().__init__()
        kv_heads = kv_heads or heads
        inner = heads * spec.head_dim
        bias = spec.linear_bias if spec.attention_bias is None else spec.attention_bias
        object.__setattr__(self, "proj", {})
        for role, width in (("q", inner), ("k", kv_heads * spec.head_dim), ("v", kv_heads * spec.head_dim)):
            self.proj[role] = place(self, names[role], Linear(spec.d_model, width, bias=bias))
        self.proj["o"] = place(self, names["o"], Linear(inner, spec.d_model, bias=bias))
        self.heads, self.kv_heads, self.head_dim, self.softcap = heads, kv_heads, spec.head_dim, spec.attn_softcap
        self.scale = spec.head_dim ** -0.5 if spec.attention_scale is None else spec.attention_scale
        table = self.add("relative_attention_bias", Embedding(spec.relative_buckets, heads)) if bias_table else None
        object.__setattr__(self, "table", table)
        # LongT5's transient-global attention: the aggregate tokens' norm, and (with the bias) their own bias table
        global_table = self.add("global_relative_attention_bias", Embedding(spec.relative_buckets, heads)) \
            if transient_global and bias_table else None
        global_norm = self.add("global_input_layer_norm", make_norm(spec)) if transient_global else None
        object.__setattr__(self, "global_table", global_table)
        # ProphetNet's n-gram self-attention: each query's relative bias for every bucket and head
        object.__setattr__(self, "relative_proj", place(self, "relative_pos_embeddings", Linear(
            spec.d_model, spec.ngram_buckets * heads, bias=True)) if ngram else None)
        # LED: the global tokens' own query/key/value projections (Longformer's *_global)
        object.__setattr__(self, "global_proj", {
            role: place(self, names["encoder_global_attn"][role], Linear(spec.d_model, inner, bias=bias))
            for role in ("q", "k", "v")} if longformer_global else None)
        object.__setattr__(self, "global_norm", global_norm)
        # T5Gemma 2: per-head norms of queries and keys
        object.__setattr__(self, "head_norms", {
            role: self.add(f"{role}_norm", RMSNorm(spec.head_dim, eps=spec.norm_eps, unit_offset=spec.norm_unit_offset))
            for role in ("q", "k")} if spec.qk_norm else {})

    def split(self, role: str, x):
        batch, length, _ = x.shape
        heads = self.heads if role == "q" else self.kv_heads
        out = self.proj[role](x).reshape(batch, length, heads, self.head_dim)
        if role in self.head_norms:
            out = self.head_norms[role](out)
        return out.permute(0, 2, 1, 3)

    def attend(self, q, k, v, *, causal: bool, bias=None, key_padding_mask=None, window: int = 0):
        """[B, H, Tq, D]. With ``bias`` (relative positions and masks already added in) the attention is
        composed from engine ops; without, the fused kernel runs."""
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, causal=causal, scale=self.scale,
                                                  key_padding_mask=key_padding_mask, window=window,
                                                  softcap=self.softcap)
        if k.shape[1] != q.shape[1]:  # grouped heads: each key/value head serves heads / kv_heads query heads
            k, v = (_repeat_heads(t, q.shape[1]) for t in (k, v))
        scores = q @ k.transpose(-1, -2)
        if self.scale != 1.0:
            scores = scores * self.scale
        if self.softcap:
            scores = (scores * (1.0 / self.softcap)).tanh() * self.softcap
        return (scores + bias).softmax(-1) @ v

    def merge(self, out):
        batch, heads, length, dim = out.shape
        return self.proj["o"](out.permute(0, 2, 1, 3).reshape(batch, length, heads * dim))


def _repeat_heads(t, heads: int):
    """[B, KVH, S, D] -> [B, heads, S, D], each key/value head repeated for its group of query heads."""
    batch, kv_heads, length, dim = t.shape
    return t.unsqueeze(2).expand(batch, kv_heads, heads // kv_heads, length, dim).contiguous().reshape(
        batch, heads, length, dim)


# ---------------------------------------------------------------- Switch Transformers' sparse feed-forward

def router_logits(router: Linear, x):
    """A router's logits in float32 whatever the model's dtype: transformers casts the classifier to its
    router_dtype (float32) and the input with it."""
    return F.linear(x.float(), router.weight.float(), router.bias.float() if router.has_bias else None)


PACK_MIN_TOKENS = 64  # from this many tokens a call packs each expert's tokens (SwitchMoE); fewer stay in place


class Experts(Module):
    """A sparse feed-forward's router (mlp.router.classifier) and experts (experts.expert_<e> with up and down
    projections), what Switch Transformers' and NLLB-MoE's share."""

    def __init__(self, spec: Seq2SeqSpec, names: dict, ffn: int, bias: bool):
        super().__init__()
        object.__setattr__(self, "router", place(self, "router.classifier",
                                                 Linear(spec.d_model, spec.num_experts, bias=spec.router_bias)))
        object.__setattr__(self, "experts", [
            (place(self, f"experts.expert_{e}.{names['up']}", Linear(spec.d_model, ffn, bias=bias)),
             place(self, f"experts.expert_{e}.{names['down']}", Linear(ffn, spec.d_model, bias=bias)))
            for e in range(spec.num_experts)])
        self.act = F.activation(spec.activation)

    def gradients_where_used(self, out, rows_per_expert):
        """out, with an expert's parameters given a gradient only where it ran on some token (float32 [E] counts):
        transformers runs one module per expert, and only those a token was routed to."""
        return F.gradient_use(out, present_if=[(rows_per_expert[e:e + 1], up.parameters() + down.parameters())
                                               for e, (up, down) in enumerate(self.experts)])


class SwitchMoE(Experts):
    """Top-1 mixture of relu experts (mlp.router.classifier, mlp.experts.expert_<e>.wi/wo), composed from
    engine ops so that autograd gives the backward and cached decode steps replay.

    router probabilities = softmax(classifier(x)) in float32; each token picks its most probable expert;
    per sequence (one forward call), an expert keeps the first expert_capacity tokens that chose it (a
    running count: the chosen one-hot times an upper-triangular ones matrix); a kept token's output is its
    expert's output times that probability, a dropped token's is zero. Gradients reach the router through the
    chosen probability only, as in transformers. A call of PACK_MIN_TOKENS tokens or more (the encoder, a
    training batch) packs each expert's tokens into its span of one matrix (engine.ops.routing.PackedRoutes,
    F.grouped_matmul), so every expert runs on its tokens only; a shorter one (decoding) runs every expert on
    every token, except that an expert no token of the call chose is skipped (its products get no live rows,
    F.linear): a decoding step of one token per row reads the weights of as many experts as there are rows.
    An expert no token was kept for gets no gradient (None), as transformers' loop over the experts hit."""

    def __init__(self, spec: Seq2SeqSpec, names: dict, ffn: int):
        super().__init__(spec, names, ffn, bias=False)
        self.capacity = spec.expert_capacity

    def forward(self, h):
        probs = router_logits(self.router, h).softmax(-1)                # [B, T, E]
        chosen = probs.detach()
        onehot = F.where(topk_mask(chosen, 1), 1.0, 0.0)                 # argmax's: a tie goes to the lower index
        length = h.shape[1]
        if self.capacity < length:  # running count of the tokens that chose each expert, in sequence order
            upper = tensor(np.triu(np.ones((length, length), np.float32)))
            count = (onehot.permute(0, 2, 1) @ upper).permute(0, 2, 1)   # [B, T, E]
            onehot = onehot * F.where(count <= float(self.capacity), 1.0, 0.0)
        weight = (probs * onehot).cast(h.dtype)                          # nonzero only at a kept choice
        tokens = h.shape[0] * length
        ups, downs = ([expert[i] for expert in self.experts] for i in (0, 1))
        if tokens >= PACK_MIN_TOKENS and linears_can_be_grouped(ups) and linears_can_be_grouped(downs):
            weights = weight.reshape(tokens, -1)
            routes = PackedRoutes.of(weights, 1)
            out = routes.weighted_sum(
                h.reshape(tokens, -1), weights,
                lambda rows, spans: grouped_linear(self.act(grouped_linear(rows, ups, spans)), downs, spans))
            return self.gradients_where_used(out, routes.spans[:, 1]).reshape(h.shape)
        live = F.live_rows_where_used(weight)                            # per expert: every row or none
        out = None
        for e, (up, down) in enumerate(self.experts):
            y = down(self.act(up(h, live[e:e + 1])), live[e:e + 1]) * weight[:, :, e:e + 1]
            out = y if out is None else out + y
        return self.gradients_where_used(out, live)


class Top2MoE(Experts):
    """NLLB-MoE's sparse feed-forward (router.classifier, experts.expert_<e>.fc1/fc2 with biases), composed from
    engine ops like SwitchMoE. Over the call's tokens flattened in order: router probabilities softmax(classifier(x))
    in float32; each token's first and second most probable experts (pad tokens of the encoder take none unless
    route_padding); an expert keeps at most ceil(fraction * tokens) of them, first choices before second ones
    (a running count, only where the capacity can be reached); the two weights are the chosen probabilities
    normalised to sum 1 (before the drops, or after: a dropped choice then gives its share to the other); the
    output is the weighted sum of the chosen experts' outputs times output_scale. Gradients reach the router
    through the chosen probabilities; an expert no token was kept for gets no gradient."""

    def __init__(self, spec: Seq2SeqSpec, names: dict, ffn: int):
        super().__init__(spec, names, ffn, bias=True)
        self.spec = spec

    def forward(self, h, token_mask: np.ndarray | None = None):
        spec = self.spec
        batch, length, width = h.shape
        tokens = batch * length
        x = h.reshape(tokens, width)
        probs = router_logits(self.router, x).softmax(-1)                 # [N, E]
        chosen = probs.detach()
        first = F.where(topk_mask(chosen, 1), 1.0, 0.0)                    # ties go to the lower index (argmax's)
        second = F.where(topk_mask(chosen, 2), 1.0, 0.0) - first
        if token_mask is not None and not spec.moe_route_padding:
            routed = tensor(token_mask.reshape(tokens, 1).astype(np.float32))
            first, second = first * routed, second * routed
        if spec.moe_normalize_before_dropping:
            weight1, weight2 = self._normalized(probs, first, second)
        capacity = math.ceil(spec.moe_capacity_fraction * tokens) if spec.moe_capacity_fraction > 0 else \
            spec.expert_capacity
        if capacity < tokens:  # an expert's slots: its first choices in token order, then its second ones
            count1 = F.cumsum_rows(first)
            count2 = F.cumsum_rows(second) + first.sum(0, keepdim=True)
            first = first * F.where(count1 <= float(capacity), 1.0, 0.0)
            second = second * F.where(count2 <= float(capacity), 1.0, 0.0)
        if not spec.moe_normalize_before_dropping:
            weight1, weight2 = self._normalized(probs, first, second)
        weight = (weight1 * first + weight2 * second).cast(h.dtype)       # [N, E]
        if tokens >= PACK_MIN_TOKENS:
            out, rows_per_expert = self._packed(x, weight)
            return self._output(out, rows_per_expert).reshape(batch, length, width)
        live = F.live_rows_where_used(weight)                             # per expert: every row or none
        out = None
        for e, (up, down) in enumerate(self.experts):
            y = down(self.act(up(x, live[e:e + 1])), live[e:e + 1]) * weight[:, e:e + 1]
            out = y if out is None else out + y
        return self._output(out, live).reshape(batch, length, width)

    def _packed(self, x, weight):
        """The experts on their own tokens only: the rows packed expert by expert (PackedRoutes, F.grouped_matmul),
        each row's expert biases picked by a one-hot of its expert (its routing weight's column, packed alike).
        Also returns each expert's row count."""
        experts = len(self.experts)
        routes = PackedRoutes.of(weight, 2)
        # 1 + expert: rows past the packed ones gather 0. Products leave those rows unwritten, so they are selected
        # away (forward and backward) before anything that sums over rows, as a bias's gradient does
        number = np.arange(1, experts + 1, dtype=np.float32)
        index = routes.gather_weights(tensor(np.broadcast_to(number, (x.shape[0], experts)).copy()))  # [R, 1]
        packed = index > 0.5
        onehot = F.where((index - tensor(number[None])).abs() < 0.5, 1.0, 0.0).cast(x.dtype)

        def biases(linears):
            return F.cat([linear.bias.reshape(1, -1) for linear in linears], 0)          # [E, out]

        def run(rows, spans):
            ups, downs = ([expert[i] for expert in self.experts] for i in (0, 1))
            hidden = F.grouped_matmul(rows, [up.weight.transpose(0, 1) for up in ups], spans) + onehot @ biases(ups)
            hidden = self.act(F.where(packed, hidden, 0.0))
            out = F.grouped_matmul(hidden, [down.weight.transpose(0, 1) for down in downs], spans) + \
                onehot @ biases(downs)
            return F.where(packed, out, 0.0)
        return routes.weighted_sum(x, weight, run), routes.spans[:, 1]

    def _output(self, out, rows):
        """out times output_scale, each expert's parameters given a gradient only where it ran on some token
        (``rows``: float32 [E], the rows each expert ran on)."""
        if self.spec.moe_output_scale != 1.0:
            out = out * self.spec.moe_output_scale
        return self.gradients_where_used(out, rows)

    @staticmethod
    def _normalized(probs, first, second):
        """[N, 1] each: the chosen probabilities over their sum (a token with no choice left: 0 and 0)."""
        p1, p2 = (probs * first).sum(-1, keepdim=True), (probs * second).sum(-1, keepdim=True)
        none = 1.0 - (first + second).sum(-1, keepdim=True).clamp(0.0, 1.0)
        denominator = p1 + p2 + none
        return p1 / denominator, p2 / denominator


# ---------------------------------------------------------------- one layer

class Block(Module):
    """Self-attention, cross-attention (decoder), feed-forward; pre-LN or post-LN residuals."""

    def __init__(self, spec: Seq2SeqSpec, names: dict, decoder: bool, index: int):
        super().__init__()
        self.spec, self.decoder, self.index = spec, decoder, index
        heads = spec.decoder_heads if decoder else spec.encoder_heads
        kv_heads = spec.decoder_kv_heads if decoder else spec.encoder_kv_heads
        ffn = spec.decoder_ffn if decoder else spec.encoder_ffn
        windows = spec.decoder_windows if decoder else spec.encoder_windows
        self.window = windows[index] if windows else 0
        self.local_relative = bool(self.window and spec.relative_buckets and not decoder)
        self.longformer = bool(self.window and spec.encoder_global_attention and not decoder)  # LED's encoder
        has_table = bool(spec.relative_buckets) and (spec.relative_bias_every_layer or index == 0)
        self_names = names if decoder else {**names, **names.get("encoder_self_attn", {})}
        self_path = names["self_attn"] if decoder else names.get("encoder_self_attn_path", names["self_attn"])
        self.transient_global = bool(spec.transient_global_block) and not decoder
        self.merged = decoder and spec.merged_cross_attention  # T5Gemma 2: no cross-attention block
        self.rope_type = spec.rope_layer_types[1 if decoder else 0][index] if spec.rope_layer_types else None
        cross = decoder and not self.merged and spec.cross_attention
        refs = dict(
            self_attn=place(self, self_path, Attention(spec, self_names, heads, has_table, kv_heads,
                                                       self.transient_global,
                                                       spec.encoder_global_attention and not decoder,
                                                       bool(spec.ngram) and decoder)),
            self_norm=place(self, names["self_norm"], make_norm(spec)),
            cross_attn=(place(self, names["cross_attn"], Attention(spec, names, heads, False, kv_heads))
                        if cross else None),
            cross_norm=place(self, names["cross_norm"], make_norm(spec)) if cross else None,
        )
        post = {"self": "self_post_norm", "cross": "cross_post_norm", "ffn": "ffn_post_norm"}
        for part, name in post.items():  # Gemma 2's sandwich: a norm on each sublayer's output too
            wanted = spec.sublayer_post_norm and (cross or part != "cross")
            refs[name] = place(self, names[name], make_norm(spec)) if wanted else None
        sub = names["ffn"].format(ffn=2 if decoder else 1)
        sparse = spec.decoder_sparse if decoder else spec.encoder_sparse
        sparse_block = Top2MoE if spec.moe_top2 else SwitchMoE
        refs["moe"] = place(self, sub, sparse_block(spec, names, ffn)) if sparse and sparse[index] else None
        if refs["moe"] is not None:
            refs["gate"] = refs["up"] = refs["down"] = None
        elif spec.gated_ffn:
            refs["gate"] = place(self, _join(sub, names["gate"]), Linear(spec.d_model, ffn, bias=spec.linear_bias))
            refs["up"] = place(self, _join(sub, names["gated_up"]), Linear(spec.d_model, ffn, bias=spec.linear_bias))
        else:
            refs["gate"] = None
            refs["up"] = place(self, _join(sub, names["up"]), Linear(spec.d_model, ffn, bias=spec.linear_bias))
        if refs["moe"] is None:
            refs["down"] = place(self, _join(sub, names["down"]), Linear(ffn, spec.d_model, bias=spec.linear_bias))
        refs["ffn_norm"] = place(self, names["ffn_norm"].format(ffn=2 if decoder else 1), make_norm(spec))
        refs["global_norm"] = place(self, "global_self_attn_layer_norm", make_norm(spec)) \
            if spec.global_tokens and not decoder else None
        for name, module in refs.items():
            object.__setattr__(self, name, module)
        self.act = F.activation(spec.activation)

    def _residual(self, x, norm, f, post_norm=None):
        if post_norm is not None:
            return x + post_norm(f(norm(x)))
        if self.spec.pre_norm:
            return x + f(norm(x))
        return norm(x + f(x))

    def feed_forward(self, h, ctx: "StackContext"):
        if isinstance(self.moe, Top2MoE):  # NLLB-MoE: the encoder's pad tokens are not routed
            return self.moe(h, None if self.decoder else ctx.key_padding_array)
        if self.moe is not None:
            return self.moe(h)
        if self.gate is not None:
            return self.down(self.act(self.gate(h)) * self.up(h))
        return self.down(self.act(self.up(h)))

    def self_attention(self, h, ctx: "StackContext"):
        attn = self.self_attn
        if attn.relative_proj is not None:
            return self._ngram_self_attention(h, ctx)
        q, k, v = attn.split("q", h), attn.split("k", h), attn.split("v", h)
        if ctx.rope is not None:
            q, k = ctx.rotate(q, self.rope_type), ctx.rotate(k, self.rope_type)
        if self.merged:
            return attn.merge(self._merged_attention(attn, q, k, v, ctx))
        if self.local_relative:
            return attn.merge(self._local_attention(attn, h, q, k, v, ctx))
        if self.longformer:
            return attn.merge(self._longformer_attention(attn, h, q, k, v, ctx))
        bias = ctx.bias(self)
        cache = ctx.cache
        if cache is None:
            out = attn.attend(q, k, v, causal=self.decoder, bias=bias, key_padding_mask=ctx.key_padding_mask,
                              window=self.window)
        elif bias is None:  # fused kernel over the cached keys (prefill or one-token decode)
            out = cache.attend(self.index, q, k, v, scale=attn.scale, window=self.window,
                                         softcap=attn.softcap)
        else:  # store the new keys, then the composed attention over the whole cache: the causal part of the
            # bias hides the rows not written yet, and every decode step has the same shapes (its plan replays)
            keys, values = cache.keys[self.index], cache.values[self.index]
            write_kv(keys, values, k, v, ctx.cache_start)
            out = attn.attend(q, keys, values, causal=True, bias=bias)
        return attn.merge(out)

    def _merged_attention(self, attn, q, k, v, ctx: "StackContext"):
        """T5Gemma 2's decoder: one softmax over its own keys (causal, within the layer's window; the cache's rows
        once stored there) and the encoder's (k_norm without rotary, computed once when generating), composed so that
        the mask of both parts is one additive term."""
        cross_k, cross_v = ctx.cross_keys_values(self.index, attn)
        if ctx.cache is not None:
            keys, values = ctx.cache.keys[self.index], ctx.cache.values[self.index]
            write_kv(keys, values, k, v, ctx.cache_start)
            k, v = keys, values
        return attn.attend(q, F.cat([k, cross_k.cast(k.dtype)], 2), F.cat([v, cross_v.cast(v.dtype)], 2),
                           causal=False, bias=ctx.merged_bias(self.window))

    def _local_attention(self, attn, h, q, k, v, ctx: "StackContext"):
        """LongT5's encoder: the keys within the layer's window, in blocks (F.banded_attention), with layer 0's
        relative bias; transient-global adds the blocks' aggregate tokens (their normed sum) as keys every query
        sees, with their own bias."""
        extra_keys = extra_values = extra_bias = None
        if self.transient_global and ctx.global_members is not None:
            members = ctx.global_members  # [1, G, T] without padding: the same blocks in every row
            if members.shape[0] != h.shape[0]:
                members = members.expand(h.shape[0], *members.shape[1:]).contiguous()
            aggregates = attn.global_norm(members.cast(h.dtype) @ h)     # [B, G, D]
            extra_keys, extra_values = attn.split("k", aggregates), attn.split("v", aggregates)
            extra_bias = ctx.side_bias()
        return F.banded_attention(q, k, v, self.window, scale=attn.scale, band_bias=ctx.band_bias(self.window),
                                  key_mask=None if ctx.key_padding_array is None else ctx.key_padding_array != 0,
                                  extra_keys=extra_keys, extra_values=extra_values, extra_bias=extra_bias)

    def _ngram_self_attention(self, h, ctx: "StackContext"):
        """ProphetNet: h holds the main stream's T rows, then each predicting stream's. The main stream attends
        causally to itself; stream k to the main stream's keys (ctx.ngram_masks) and to its own key at its
        position; each with a relative bias projected from the query's hidden state (ctx.ngram_relative)."""
        attn = self.self_attn
        batch, length, heads = h.shape[0], ctx.length, attn.heads
        streams = h.shape[1] // length - 1
        q, k, v = attn.split("q", h) * attn.scale, attn.split("k", h), attn.split("v", h)
        relative = attn.relative_proj(h)                                   # [B, (1 + n) T, K * H]
        buckets = relative.shape[-1] // heads
        main_keys, main_values = k[:, :, :length], v[:, :, :length]
        if ctx.cache is not None:  # store the main keys; a step (one token) then reads every stored one (later rows
            # masked), a prompt its own
            keys, values = ctx.cache.keys[self.index], ctx.cache.values[self.index]
            write_kv(keys, values, main_keys, main_values, ctx.cache_start)
            if not ctx.ngram_prefill:
                main_keys, main_values = keys, values
        # main stream: relative [B, T, K, H] -> [B, H, T, K], picked by bucket
        main_relative = relative[:, :length].reshape(batch, length, buckets, heads).permute(0, 3, 1, 2)
        scores = q[:, :, :length] @ main_keys.transpose(-1, -2) + ctx.ngram_relative(main_relative, 0) + \
            ctx.ngram_masks[0].cast(h.dtype)
        outs = [scores.softmax(-1) @ main_values]
        if streams:
            # predicting streams: transformers lays their relative projection out as [B, T, n, H, K] and reads it
            # as [B, n, H, T, K] (a reshape, not a transpose: for T > 1 a row takes another position's values)
            stream_relative = relative[:, length:].reshape(batch, streams, length, buckets, heads)
            stream_relative = stream_relative.permute(0, 2, 1, 4, 3).contiguous().reshape(
                batch, streams, heads, length, buckets)
            for stream in range(streams):
                rows = slice(length * (1 + stream), length * (2 + stream))
                keys = F.cat([main_keys, k[:, :, rows]], 2)
                values = F.cat([main_values, v[:, :, rows]], 2)
                scores = q[:, :, rows] @ keys.transpose(-1, -2) + \
                    ctx.ngram_relative(stream_relative[:, stream], 1) + ctx.ngram_masks[1 + stream].cast(h.dtype)
                outs.append(scores.softmax(-1) @ values)
        return attn.merge(F.cat(outs, 2))

    def _longformer_attention(self, attn, h, q, k, v, ctx: "StackContext"):
        """LED's encoder (Longformer): each query sees the keys within the window (F.banded_attention) other than
        global tokens and padding, and every global token's key; a global token's row is instead its attention over
        every non-pad key through query/key/value_global. Memory linear in the length (times the global tokens)."""
        real = None if ctx.key_padding_array is None else ctx.key_padding_array != 0
        if ctx.longformer_global is None:
            return F.banded_attention(q, k, v, self.window, scale=attn.scale, key_mask=real)
        local = ~ctx.longformer_global if real is None else real & ~ctx.longformer_global
        select = ctx.global_select.cast(h.dtype)                          # [B, 1, G, T]: each slot's token
        out = F.banded_attention(q, k, v, self.window, scale=attn.scale, key_mask=local,
                                 extra_keys=select @ k, extra_values=select @ v,
                                 extra_bias=ctx.global_slot_bias.cast(h.dtype))
        batch, length, _ = h.shape
        slots = select.shape[2]

        def split(role, x):
            return attn.global_proj[role](x).reshape(batch, x.shape[1], attn.heads, attn.head_dim).permute(0, 2, 1, 3)
        rows = select.reshape(batch, slots, length) @ h                  # [B, G, D]: the global tokens
        scores = (split("q", rows) @ split("k", h).transpose(-1, -2)) * attn.scale + \
            ctx.global_key_bias.cast(h.dtype)
        everywhere = scores.softmax(-1) @ split("v", h)                   # [B, H, G, D]
        placed = select.transpose(-1, -2) @ everywhere                   # [B, H, T, D]: zero off the global rows
        return out * (1.0 - ctx.global_rows_mask.cast(h.dtype)) + placed

    def cross_attention(self, h, ctx: "StackContext"):
        attn = self.cross_attn
        k, v = ctx.cross_keys_values(self.index, attn)
        out = attn.attend(attn.split("q", h), k, v, causal=False, key_padding_mask=ctx.encoder_padding_mask)
        return attn.merge(out)

    def forward(self, x, ctx: "StackContext"):
        norm = self.self_norm
        if self.global_norm is not None:  # PEGASUS-X: the global tokens (first rows) have their own norm
            rows = ctx.global_rows
            norm = lambda h: self.global_norm(h) * rows + self.self_norm(h) * (1.0 - rows)  # noqa: E731
        x = self._residual(x, norm, lambda h: self.self_attention(h, ctx), self.self_post_norm)
        if self.cross_attn is not None and ctx.encoder_states is not None:  # as transformers, only given them
            x = self._residual(x, self.cross_norm, lambda h: self.cross_attention(h, ctx), self.cross_post_norm)
        return self._residual(x, self.ffn_norm, lambda h: self.feed_forward(h, ctx), self.ffn_post_norm)


# ---------------------------------------------------------------- a stack's per-forward state

class StackContext:
    """What the layers of one stack share in one forward pass: masks, relative position bias, cache."""

    def __init__(self, stack: "Stack", length: int, key_padding: np.ndarray | None, past: int = 0, cache=None,
                 encoder_states=None, encoder_mask: np.ndarray | None = None, global_mask: np.ndarray | None = None):
        self.stack, self.length, self.past, self.cache = stack, length, past, cache
        # LED: the tokens with global attention (bool [B, T]; a pad token never has it), None when there are none
        if global_mask is not None and key_padding is not None:
            global_mask = global_mask * (key_padding != 0)
        self.longformer_global = global_mask.astype(bool) if global_mask is not None and global_mask.any() else None
        self.global_rows_mask = self.global_key_bias = None
        if self.longformer_global is not None:
            self.global_rows_mask = tensor(self.longformer_global[:, None, :, None].astype(np.float32))
            real = np.ones_like(self.longformer_global) if key_padding is None else key_padding != 0
            self.global_key_bias = tensor(np.where(real, 0.0, MASKED).astype(np.float32)[:, None, None, :])
            # the global tokens in slots (row b's first count[b] slots, in order) and the empty slots' mask
            count = self.longformer_global.sum(1)
            select = np.zeros((len(count), 1, int(count.max()), self.longformer_global.shape[1]), np.float32)
            for row in range(len(count)):
                positions = np.nonzero(self.longformer_global[row])[0]
                select[row, 0, np.arange(len(positions)), positions] = 1.0
            self.global_select = tensor(select)
            slots = np.arange(select.shape[2])[None, :] < count[:, None]
            self.global_slot_bias = tensor(np.where(slots, 0.0, MASKED).astype(np.float32)[:, None, None, :])
        self.encoder_states, self.encoder_mask = encoder_states, encoder_mask
        self._merged_bias = {}
        self.key_padding_mask = None if key_padding is None else tensor(key_padding.astype(bool))
        self.encoder_padding_mask = None
        if encoder_mask is not None and not encoder_mask.all():
            self.encoder_padding_mask = tensor(encoder_mask.astype(bool))
        self.cache_start = tensor(np.array([past], np.uint32)) if cache is not None else None
        # ProphetNet's prompt into an empty cache (ProphetNetForCausalLM's generate): every stream over the prompt, as
        # without a cache (its padding masked), the main stream's keys stored; a later cached step runs stream 0 alone
        self.ngram_prefill = bool(stack.spec.ngram and stack.decoder and cache is not None and past == 0
                                  and length > 1)
        # keys the self-attention sees: the new tokens after the stored ones, or the whole cache
        self.key_length = cache.max_len if cache is not None and not self.ngram_prefill else past + length
        self._additive = None
        if stack.spec.relative_buckets:
            if stack.decoder:  # causal: key j hidden from query i when j > i (absolute positions)
                query = past + np.arange(length)
                keys = np.arange(self.key_length)
                self._additive = np.where(keys[None, :] > query[:, None], MASKED, 0.0).astype(np.float32)
            elif key_padding is not None:
                self._additive = np.where(key_padding[:, None, None, :] != 0, 0.0, MASKED).astype(np.float32)
        self._shared_bias = None
        self._window_bias = {}
        self._band_bias = {}
        self._side = None
        self.global_members = None  # LongT5 transient-global: [B, G, T] one-hot of each token's global block
        if stack.spec.transient_global_block and not stack.decoder:
            self._global_mask = np.ones((1, length), np.int64) if key_padding is None else key_padding.astype(np.int64)
            self._global_blocks = transient_global_blocks(self._global_mask, stack.spec.transient_global_block)
            blocks, held = self._global_blocks
            if held.shape[1]:
                members = blocks[:, None, :] == np.arange(held.shape[1])[None, :, None]
                self.global_members = tensor(members.astype(np.float32))
        self.key_padding_array = key_padding
        # rotary self-attention, positions past, past + 1, ...: layer type (None: every layer) -> (inv_freq, scaling)
        self.rope = None
        if stack.spec.rope:
            config = stack.spec.rope[1 if stack.decoder else 0]
            types = stack.spec.rope_layer_types[1 if stack.decoder else 0] if stack.spec.rope_layer_types else (None,)
            self.rope = {}
            for kind in sorted(set(types), key=str):
                inv_freq, scaling = rope_parameters(config, past + length, layer_type=kind)
                self.rope[kind] = (tensor(inv_freq), scaling)
        self._positions = None
        self.ngram_masks = None
        if stack.spec.ngram and stack.decoder:
            self._ngram_setup()
        self.global_rows = None  # PEGASUS-X encoder: 1 on the global token rows, 0 on the input's
        if stack.spec.global_tokens and not stack.decoder:
            rows = (np.arange(length) < stack.spec.global_tokens).astype(np.float32)
            self.global_rows = tensor(rows[None, :, None])

    def _ngram_setup(self):
        """ProphetNet: each stream's additive mask and relative buckets (one-hot [T, K, S]) over its keys; the
        predicting streams' keys are the main stream's (or the cache's) then their own T; padding (key_padding) masks
        the main stream's keys in every stream. A cached step (one token) runs stream 0 only, over every stored main
        key up to its position and whatever the padding, as transformers' cached step does."""
        spec, length, past = self.stack.spec, self.length, self.past
        stepping = self.cache is not None and not self.ngram_prefill
        main_keys = self.key_length
        query = past + np.arange(length)
        keys = np.arange(main_keys)

        def onehot(buckets):
            return tensor((buckets[:, None, :] == np.arange(spec.ngram_buckets)[None, :, None]).astype(np.float32))

        def buckets(query_positions, key_length):
            return relative_buckets(query_positions, key_length, bidirectional=False, num_buckets=spec.ngram_buckets,
                                    max_distance=spec.ngram_max_distance)
        causal = np.where(keys[None, :] > query[:, None], MASKED, 0.0)
        masks, own = [causal], np.where(np.eye(length, dtype=bool), 0.0, MASKED)
        streams = 1 if stepping else spec.ngram
        for stream in range(streams):
            if stepping:  # transformers' cached step: every stored main key
                hidden = causal
            else:  # stream k sees the main keys j <= i - k (and key 0 always)
                hidden = np.where((keys[None, :] - query[:, None] >= 1 - stream) & (keys[None, :] != 0), MASKED, 0.0)
            masks.append(np.concatenate([hidden, own], axis=1))
        if self.key_padding_array is not None and not stepping:  # [B, 1, T, keys]: padded main keys hidden too
            padded = np.where(self.key_padding_array != 0, 0.0, MASKED)[:, None, None, :]
            masks = [m[None, None] + np.concatenate([padded, np.zeros((*padded.shape[:3], m.shape[-1] - main_keys))], -1)
                     for m in masks]
        self.ngram_masks = [tensor(m.astype(np.float32)) for m in masks]
        # main: key - query; predicting streams: (key - 1) - query over the main keys, key - query over their own
        self._ngram_onehot = [onehot(buckets(query, main_keys)),
                              onehot(np.concatenate([buckets(query + 1, main_keys), buckets(query, length)[:, -length:]
                                                     if not stepping else np.zeros((length, length), np.int32)],
                                                    axis=1))]
        self.streams = streams

    def ngram_relative(self, relative, kind: int):
        """[B, H, T, K] per-query relative values -> [B, H, T, S]: each key's bucket's (kind 0: main, 1: stream)."""
        batch, heads, length, buckets = relative.shape
        onehot = self._ngram_onehot[kind].cast(relative.dtype)               # [T, K, S]
        rows = relative.permute(2, 0, 1, 3).reshape(length, batch * heads, buckets)
        picked = rows @ onehot                                               # [T, B * H, S]
        return picked.reshape(length, batch, heads, -1).permute(1, 2, 0, 3)

    def rotate(self, x, layer_type: str | None = None):
        """Rotary embedding of q or k [B, H, T, D] at positions past, past + 1, ... (every row alike), with the
        rotary parameters of ``layer_type`` where they differ by layer type."""
        if self._positions is None:
            rows = np.broadcast_to(self.past + np.arange(self.length, dtype=np.int32), (x.shape[0], self.length))
            self._positions = tensor(np.ascontiguousarray(rows))
        inv_freq, scaling = self.rope[layer_type]
        return F.rope(x, self._positions, inv_freq, attention_scaling=scaling)

    def bias(self, block: Block):
        """The additive attention term of a self-attention layer ([.., H, Tq, Tk]: relative position bias
        plus the masks), or None when the layer runs the fused kernel."""
        spec = self.stack.spec
        if not spec.relative_buckets:
            if block.window and not self.stack.decoder:  # bidirectional window: composed (the kernel's is causal)
                return self.encoder_window_bias(block.window)
            return None
        if spec.relative_bias_every_layer:
            return self._position_bias(block.self_attn.table)
        if self._shared_bias is None:  # layer 0's table, shared by every layer of the stack
            self._shared_bias = self._position_bias(self.stack.layers[0].self_attn.table)
        return self._shared_bias

    def band_bias(self, window: int):
        """LongT5's local attention: layer 0's relative bias in F.banded_attention's layout [1, H, L, 3L] (by the
        query's place in its block of L = window + 1 and the key's place in the three blocks)."""
        if window not in self._band_bias:
            spec, block = self.stack.spec, window + 1
            buckets = relative_buckets(np.arange(block) + block, 3 * block, bidirectional=True,
                                       num_buckets=spec.relative_buckets, max_distance=spec.relative_max_distance)
            values = F.embedding(tensor(buckets), self.stack.layers[0].self_attn.table.weight)  # [L, 3L, H]
            self._band_bias[window] = values.permute(2, 0, 1).reshape(1, -1, block, 3 * block)
        return self._band_bias[window]

    def side_bias(self):
        """LongT5 transient-global: the aggregate tokens' bias, from layer 0's table (shared by the layers)."""
        if self._side is None:
            self._side = self._side_bias(self.stack.layers[0].self_attn.global_table)
        return self._side

    def _side_bias(self, table: Embedding):
        """LongT5: [B, H, T, G], the bias of each token's query for each aggregate token: the bucket of (global
        block - the token's block) from ``table``, and MASKED where a real token meets an empty global block."""
        spec = self.stack.spec
        blocks, held = self._global_blocks
        count = held.shape[1]
        buckets = np.stack([relative_buckets(row, count, bidirectional=True, num_buckets=spec.relative_buckets,
                                             max_distance=spec.relative_max_distance) for row in blocks])
        batch, length = blocks.shape
        values = F.embedding(tensor(buckets.reshape(batch * length, count)), table.weight)  # [B*T, G, H]
        bias = values.reshape(batch, length, count, -1).permute(0, 3, 1, 2)               # [B, H, T, G]
        real = self._global_mask != 0
        allowed = real[:, :, None] == held[:, None, :]  # transformers: the token's mask equals the block's use
        return bias + tensor(np.where(allowed, 0.0, MASKED).astype(np.float32)[:, None], dtype=bias.dtype)

    def merged_bias(self, window: int):
        """T5Gemma 2's merged attention, [B or 1, 1, T, K + S]: over the decoder's K keys, 0 where key j <= query i
        (absolute positions) and, with a window, j > i - window; over the encoder's S keys, 0 where not padding."""
        if window not in self._merged_bias:
            query = self.past + np.arange(self.length)
            keys = np.arange(self.key_length)
            allowed = keys[None, :] <= query[:, None]
            if window:
                allowed &= keys[None, :] > query[:, None] - window
            own = np.where(allowed, 0.0, MASKED).astype(np.float32)[None, None]          # [1, 1, T, K]
            mask = self.encoder_mask
            sources = self.encoder_states.shape[1]
            encoder = np.zeros((1, 1, self.length, sources), np.float32) if mask is None else \
                np.broadcast_to(np.where(mask != 0, 0.0, MASKED).astype(np.float32)[:, None, None, :],
                                (mask.shape[0], 1, self.length, sources))
            own = np.broadcast_to(own, (encoder.shape[0], 1, self.length, self.key_length))
            self._merged_bias[window] = tensor(np.ascontiguousarray(np.concatenate([own, encoder], axis=-1)))
        return self._merged_bias[window]

    def encoder_window_bias(self, window: int):
        """[B or 1, 1, T, T]: 0 where |i - j| <= window (T5Gemma 2: key j from i - ((window + 1) // 2 - 1) to
        i + window // 2) and key j is not padding, else MASKED."""
        if window not in self._window_bias:
            index = np.arange(self.length)
            offset = index[None, :] - index[:, None]  # key - query
            if self.stack.spec.encoder_window_split:
                allowed = (offset > -((window + 1) // 2)) & (offset <= window // 2)
            else:
                allowed = np.abs(offset) <= window
            if self.key_padding_array is not None:
                allowed = allowed[None, None] & (self.key_padding_array[:, None, None, :] != 0)
            self._window_bias[window] = tensor(np.where(allowed, 0.0, MASKED).astype(np.float32))
        return self._window_bias[window]

    def _position_bias(self, table: Embedding):
        spec = self.stack.spec
        query = self.past + np.arange(self.length)
        buckets = relative_buckets(query, self.key_length, bidirectional=not self.stack.decoder,
                                   num_buckets=spec.relative_buckets, max_distance=spec.relative_max_distance)
        values = F.embedding(tensor(buckets), table.weight)                      # [Tq, Tk, H]
        heads = values.shape[-1]
        bias = values.permute(2, 0, 1).reshape(1, heads, *buckets.shape)        # [1, H, Tq, Tk]
        if self._additive is not None:
            bias = bias + tensor(self._additive, dtype=bias.dtype)
        return bias

    def cross_keys_values(self, index: int, attn: Attention):
        """Cross-attention keys and values of one decoder layer: from the encoder output, or from the cache
        (computed there once per generation)."""
        cross = getattr(self.cache, "cross", None)
        if cross:
            return cross[index]
        return attn.split("k", self.encoder_states), attn.split("v", self.encoder_states)


# ---------------------------------------------------------------- encoder / decoder stacks

class Stack(Module):
    def __init__(self, spec: Seq2SeqSpec, names: dict, decoder: bool):
        super().__init__()
        self.spec, self.decoder = spec, decoder
        count = spec.decoder_layers if decoder else spec.encoder_layers
        vocab = spec.source_vocab_size if spec.source_vocab_size and not decoder else spec.vocab_size
        pad = spec.pad_token_id if spec.pad_embedding_frozen else None  # transformers' nn.Embedding(padding_idx)
        refs = dict(embed_tokens=place(self, names.get("embed_tokens", "embed_tokens"),
                                       Embedding(vocab, spec.d_model, pad)),
                    embed_positions=None, embed_norm=None, final_norm=None)
        # ProphetNet's decoder: one embedding per predicting stream
        refs["ngram_embeddings"] = place(self, "ngram_embeddings", Embedding(spec.ngram, spec.d_model)) \
            if spec.ngram and decoder else None
        if spec.positions == "learned":
            refs["embed_positions"] = place(self, names["positions"],
                                            Embedding(self.learned_rows() + spec.position_offset, spec.d_model))
        elif spec.positions == "fairseq" and spec.fairseq_table_trained:
            refs["embed_positions"] = place(self, names["positions"], Embedding(self.fairseq_rows(), spec.d_model))
        if spec.embed_norm:
            refs["embed_norm"] = place(self, names["embed_norm"], make_norm(spec))
        refs["layers"] = place(self, names["layers"], ModuleList(Block(spec, names, decoder, i) for i in range(count)))
        if spec.final_norm:
            refs["final_norm"] = place(self, names["final_norm"], make_norm(spec))
        refs["embed_global"] = place(self, "embed_global", Embedding(spec.global_tokens, spec.d_model)) \
            if spec.global_tokens and not decoder else None
        if spec.eoi_token_id is not None:  # T5Gemma 2: the eoi token's own embedding
            add_param(self, f"{names.get('embed_tokens', 'embed_tokens')}.eoi_embedding", (spec.d_model,))
        for name, module in refs.items():
            object.__setattr__(self, name, module)
        self.names_embed = names.get("embed_tokens", "embed_tokens")
        self.position_table = None
        self.recorded = None  # a list while the base model collects hidden states (output_hidden_states=True)
        if spec.positions == "sinusoidal":
            self.position_table = Tensor(sinusoidal_table(spec.max_positions, spec.d_model))
        elif spec.positions == "fairseq_from_zero":
            self.position_table = Tensor(fairseq_table(spec.max_positions, spec.d_model, None))
        elif spec.positions == "fairseq" and not spec.fairseq_table_trained:
            self.position_table = Tensor(fairseq_table(self.fairseq_rows(), spec.d_model, spec.pad_token_id))

    def max_length(self) -> int | None:
        """Tokens per sequence the position table has rows for; None for relative positions (T5), no table."""
        spec = self.spec
        if spec.positions == "learned":  # row = position + offset (ProphetNet's predicting streams read the next)
            return self.learned_rows() - (1 if self.ngram_embeddings is not None else 0)
        if spec.positions == "fairseq":  # row = pad + 1 + position
            return self.fairseq_rows() - 1 - spec.pad_token_id
        if spec.positions in ("sinusoidal", "fairseq_from_zero"):
            return spec.max_positions - spec.position_offset
        return None

    def learned_rows(self) -> int:
        spec = self.spec
        return spec.encoder_max_positions if spec.encoder_max_positions and not self.decoder else spec.max_positions

    def fairseq_rows(self) -> int:
        spec = self.spec
        return spec.max_positions + spec.position_offset + spec.pad_token_id + 1

    def positions(self, ids: np.ndarray, past: int) -> np.ndarray:
        """Row of the position table for every token (int32 [B, T])."""
        spec = self.spec
        batch, length = ids.shape
        if spec.positions == "fairseq":  # count only non-pad tokens; pads take the (zero) padding row
            real = (ids != spec.pad_token_id).astype(np.int64)
            if spec.fairseq_past_unmasked:
                return (np.cumsum(real, axis=1) * real + spec.pad_token_id + past).astype(np.int32)
            return ((np.cumsum(real, axis=1) + past) * real + spec.pad_token_id).astype(np.int32)
        rows = past + np.arange(length) + spec.position_offset
        return np.broadcast_to(rows, (batch, length)).astype(np.int32)

    def embed(self, ids: np.ndarray, past: int):
        spec = self.spec
        x = F.embedding(tensor(ids.astype(np.int32)), self.embed_tokens.weight,  # nn.Embedding(padding_idx)
                        padding_idx=self.embed_tokens.padding_idx)
        if spec.embed_scale != 1.0:
            x = x * spec.embed_scale
        if spec.eoi_token_id is not None and (ids == spec.eoi_token_id).any():  # replaced, unscaled
            eoi = tensor((ids == spec.eoi_token_id).astype(np.float32)[..., None], dtype=x.dtype)
            row = get_param(self, f"{self.names_embed}.eoi_embedding").reshape(1, 1, -1).cast(x.dtype)
            x = x * (1.0 - eoi) + eoi * row
        norm_first = self.decoder and spec.decoder_embed_norm_first
        if norm_first:
            x = self.embed_norm(x)
        table = self.embed_positions.weight if self.embed_positions is not None else self.position_table
        if table is not None:
            # pads read the table's padding row (position pad_token_id), which a trained table keeps out of the gradient
            rows = F.embedding(tensor(self.positions(ids, past)), table,
                               padding_idx=spec.pad_token_id if spec.fairseq_table_trained else None)
            x = x + rows.cast(x.dtype)  # fixed tables: float32
        if self.embed_norm is not None and not norm_first:
            x = self.embed_norm(x)
        return x

    def forward(self, ids: np.ndarray, ctx: StackContext):
        x = self.embed(ids, ctx.past)
        if self.embed_global is not None:
            x = self.prepend_global(x)
        if self.ngram_embeddings is not None:  # ProphetNet: the main stream's rows, then each predicting stream's
            x = F.cat([x] + self.predicting_streams(ids, ctx), 1)
        for layer in self.layers:
            if self.recorded is not None:  # transformers' hidden_states: each layer's input, then the output
                self.recorded.append(x)
            x = layer(x, ctx)
        if self.embed_global is not None:
            x = x[:, self.spec.global_tokens:]
        x = self.final_norm(x) if self.final_norm is not None else x
        if self.recorded is not None:
            self.recorded.append(x)
        return x

    def predicting_streams(self, ids: np.ndarray, ctx: StackContext) -> list:
        """ProphetNet: stream k's inputs, ngram_embeddings[k - 1] plus the next position's embedding (normed)."""
        batch, length = ids.shape
        table = self.embed_positions.weight
        rows = F.embedding(tensor(self.positions(ids, ctx.past) + 1), table,
                           padding_idx=self.spec.pad_token_id)                       # [B, T, D]
        weight = self.ngram_embeddings.weight
        streams = []
        for stream in range(ctx.streams):
            row = (stream - 1) % weight.shape[0]  # transformers indexes ngram_embeddings[k - 1]
            streams.append(self.embed_norm(rows + weight[row:row + 1].reshape(1, 1, -1)))
        return streams

    def prepend_global(self, x):
        """[global tokens; x] along the sequence."""
        batch = x.shape[0]
        count = self.spec.global_tokens
        ids = np.broadcast_to(np.arange(count, dtype=np.int32), (batch, count))
        glob = F.embedding(tensor(np.ascontiguousarray(ids)), self.embed_global.weight)  # [B, G, D]
        return F.cat([glob, x], 1)


# ---------------------------------------------------------------- the model

class Seq2SeqForConditionalGeneration(Seq2SeqGenerationMixin, Module):
    """An encoder-decoder of any architecture in :data:`vkformers_t5.variants.VARIANTS`."""

    ignored_checkpoint_keys = IGNORED_CHECKPOINT_KEYS
    needs_encoder = True  # False: a decoder alone (ProphetNetForCausalLM), which may lack cross-attention

    def __init__(self, config: dict, architecture):
        super().__init__()
        name = getattr(architecture, "name", architecture)
        spec = seq2seq_spec(config, name)
        if self.needs_encoder and not spec.cross_attention:
            raise UnsupportedConfigError(f"{name}: add_cross_attention=False (a decoder without the encoder) is not an "
                                         "encoder-decoder; AutoModelForCausalLM loads it (ProphetNetForCausalLM)")
        self.config, self.architecture_name, self.spec = config, name, spec
        self.dtype = dt.float32
        names = self.names = LAYOUTS[spec.layout]
        refs = dict(
            shared=place(self, names["shared"], Embedding(spec.vocab_size, spec.d_model)) if names["shared"] else None,
            encoder=place(self, names["encoder"], Stack(spec, names, decoder=False)),
            decoder=place(self, names["decoder"], Stack(spec, names, decoder=True)),
            lm_head=place(self, names["lm_head"], Linear(spec.d_model, spec.vocab_size, bias=False)),
        )
        for key, module in refs.items():
            object.__setattr__(self, key, module)
        # the table the head ties to: the shared one, or (FSMT: no shared table) the decoder's
        embed = names.get("embed_tokens", "embed_tokens")
        self.head_tie_target = f"{names['shared']}.weight" if names["shared"] else \
            f"{names['decoder']}.{embed}.weight"
        if names.get("tie_to_encoder_embeddings"):  # T5Gemma 2: the encoder's table serves the decoder and the head
            self.head_tie_target = f"{names['encoder']}.{embed}.weight"
            self.tie(f"{names['decoder']}.{embed}.weight", self.head_tie_target)
            if spec.eoi_token_id is not None:
                self.tie(f"{names['decoder']}.{embed}.eoi_embedding", f"{names['encoder']}.{embed}.eoi_embedding")
        if names["shared"]:
            for stack in ("encoder", "decoder"):
                self.tie(f"{names[stack]}.{embed}.weight", self.head_tie_target)
        self.tie(f"{names['lm_head']}.weight", self.head_tie_target)
        self.logits_bias = None

    def initial_std(self, name: str) -> float | None:
        """The std transformers draws a weight from when the model is made from scratch: T5's scale-aware normals
        (T5PreTrainedModel._init_weights, by ``initializer_factor``); None for the other families (the config's
        ``init_std``)."""
        if self.spec.layout != "t5":
            return None
        factor, spec = float(self.config.get("initializer_factor", 1.0)), self.spec
        parts = name.split(".")
        leaf = parts[-2] if len(parts) > 1 else name
        if leaf in ("shared", "lm_head") or name.endswith("router.classifier.weight"):
            return factor
        if leaf == "q":
            return factor * (spec.d_model * spec.head_dim) ** -0.5
        if leaf in ("k", "v", "wi", "wi_0", "wi_1") or leaf.endswith("relative_attention_bias"):
            return factor * spec.d_model ** -0.5
        if leaf == "o":
            return factor * (spec.encoder_heads * spec.head_dim) ** -0.5
        if leaf == "wo":
            return factor * spec.encoder_ffn ** -0.5
        return None

    def load_state_dict(self, arrays, *args, **kwargs):
        """Ties lm_head to the shared embedding unless the checkpoint holds a different one (transformers 5
        does the same), and reads final_logits_bias, a buffer rather than a parameter."""
        arrays = LazyWeights.of(arrays)
        if self.spec.fairseq_table_trained:  # FSMT checkpoints may leave out the (sinusoidal) position tables
            for stack in (self.encoder, self.decoder):
                name = f"{self.names['encoder' if stack is self.encoder else 'decoder']}.{self.names['positions']}.weight"
                if name not in arrays:
                    rows, d = stack.fairseq_rows(), self.spec.d_model
                    arrays = arrays.updated({name: Weight((rows, d), partial(fairseq_table, rows, d,
                                                                             self.spec.pad_token_id))})
        renames, skipped = self.names.get("checkpoint_renames", ()), self.names.get("ignored_prefixes", ())
        if renames or skipped:  # T5Gemma 2: the text stack's stored names; the vision tower, which text never runs
            arrays = arrays.renamed(partial(_stored_name, renames, skipped))
        shared, head_name = self.head_tie_target, f"{self.names['lm_head']}.weight"
        head = dict(self.named_slots()).get(head_name)  # None in the base model, which has no LM head
        distinct = head_name in arrays and shared in arrays and not np.array_equal(
            np.asarray(arrays[head_name]), np.asarray(arrays[shared]))  # both read, compared, dropped
        if head is not None:
            head.tied_to = shared if self.spec.tie_lm_head and not distinct else None
        super().load_state_dict(arrays, *args, **kwargs)
        self.logits_bias = None
        if self.spec.final_logits_bias and "final_logits_bias" in arrays:
            bias = np.asarray(arrays["final_logits_bias"], np.float32).reshape(-1)
            if bias.any():
                self.logits_bias = tensor(bias, dtype=kwargs.get("dtype", args[0] if args else "float32"))

    def input_limits(self) -> InputLimits:
        spec = self.spec
        return InputLimits(vocab_size=spec.source_vocab_size or spec.vocab_size, decoder_vocab_size=spec.vocab_size,
                           label_classes=spec.vocab_size, max_length=self.encoder.max_length(),
                           decoder_max_length=self.decoder.max_length(), labels_like="decoder_input_ids",
                           one_dimensional_ok=True)

    # -- pieces

    def encode(self, input_ids, attention_mask=None, global_attention_mask=None):
        """The encoder's last hidden state [B, S, d_model]. ``global_attention_mask`` (LED): 1 on the tokens with
        global attention."""
        ids = id_array(input_ids)
        global_mask = self._global_mask(ids, global_attention_mask)
        mask = None if attention_mask is None else id_array(attention_mask)
        if mask is None and self.spec.encoder_pads_masked:
            mask = (ids != self.spec.pad_token_id).astype(np.int64)
        padding = mask if mask is not None and not mask.all() else None
        length, spec = ids.shape[1], self.spec
        if spec.global_tokens:  # PEGASUS-X: global tokens first, never masked
            fits = spec.local_block // 2 if spec.stagger_blocks else spec.local_block
            if length > fits:
                raise VkformersError(f"{self.architecture_name}: {length} input tokens do not fit one local attention "
                                     f"block ({fits} with block_size {spec.local_block}"
                                     f"{' and staggered blocks' if spec.stagger_blocks else ''}); block-local "
                                     "attention over several blocks is not implemented")
            if padding is not None:
                padding = np.concatenate([np.ones((ids.shape[0], spec.global_tokens), np.int64), padding], axis=1)
            length += spec.global_tokens
        return self.encoder(ids, StackContext(self.encoder, length, padding, global_mask=global_mask))

    def _global_mask(self, ids: np.ndarray, global_attention_mask) -> np.ndarray | None:
        if global_attention_mask is None:
            return None
        if not self.spec.encoder_global_attention:
            raise VkformersError(f"{self.architecture_name}: global_attention_mask is only taken by an encoder with "
                                 "Longformer attention (LED); leave it out")
        mask = id_array(global_attention_mask)
        if mask.shape != ids.shape:
            raise VkformersError(f"global_attention_mask has shape {list(mask.shape)}; give one like input_ids "
                                 f"{list(ids.shape)}")
        return mask

    def decode(self, decoder_ids, encoder_states, encoder_mask=None, cache: EncoderDecoderCache | None = None,
               all_streams: bool = False, decoder_mask: np.ndarray | None = None):
        """Logits [B, T, vocab] for decoder tokens given the encoder output (and cache, when generating).
        ProphetNet: predicting stream 0's; ``all_streams``: every stream's, [B, ngram, T, vocab]; ``decoder_mask``
        (ProphetNet): 0 on the decoder tokens no stream attends to."""
        x = self._decoder_rows(decoder_ids, encoder_states, encoder_mask, cache, decoder_mask)
        if self.spec.ngram:
            length = id_array(decoder_ids).shape[1]
            x = x[:, length:].contiguous() if all_streams else x[:, length:2 * length]
            if all_streams:
                x = x.reshape(x.shape[0], -1, length, x.shape[-1])
        if self.spec.output_scale != 1.0:
            x = x * self.spec.output_scale
        logits = self.lm_head(x)
        if self.logits_bias is not None:
            logits = logits + self.logits_bias
        if self.spec.final_softcap:
            logits = (logits * (1.0 / self.spec.final_softcap)).tanh() * self.spec.final_softcap
        return logits

    def decoder_hidden_states(self, decoder_ids, encoder_states, encoder_mask=None, cache=None):
        """The decoder's last hidden state [B, T, d_model] (after its final norm), what the LM head reads
        (ProphetNet: the main stream's, as its base model returns)."""
        x = self._decoder_rows(decoder_ids, encoder_states, encoder_mask, cache)
        length = id_array(decoder_ids).shape[1]
        return x[:, :length] if self.spec.ngram else x

    def _decoder_rows(self, decoder_ids, encoder_states, encoder_mask=None, cache=None, decoder_mask=None):
        """The decoder's output rows (ProphetNet: the main stream's T rows, then each predicting stream's)."""
        ids = id_array(decoder_ids)
        past = cache.position if cache is not None else 0
        if self.spec.ngram and past and ids.shape[1] != 1:
            raise VkformersError(f"{self.architecture_name}: a cached decoder step after the first takes one token "
                                 "per row")
        padding = None
        if self.spec.decoder_pad_keys_masked and cache is None and (ids == self.spec.pad_token_id).any():
            padding = (ids != self.spec.pad_token_id).astype(np.int64)
        if decoder_mask is not None and not decoder_mask.all():
            if not self.spec.ngram:
                raise VkformersError(f"{self.architecture_name}: a decoder mask with zeros is not supported")
            padding = decoder_mask.astype(np.int64)
        ctx = StackContext(self.decoder, ids.shape[1], padding, past=past, cache=cache,
                           encoder_states=encoder_states, encoder_mask=encoder_mask)
        x = self.decoder(ids, ctx)
        if cache is not None:
            cache.advance(ids.shape[1])
        return x

    def shift_right(self, labels: np.ndarray) -> np.ndarray:
        """Decoder inputs from labels (transformers' shift_tokens_right / _shift_right)."""
        spec = self.spec
        labels = np.where(labels == IGNORE_INDEX, spec.pad_token_id, labels)
        shifted = np.empty_like(labels)
        shifted[:, 1:] = labels[:, :-1]
        if spec.shift == "wrap_last":  # mBART / PLBart: the last non-pad token (the language id) comes first
            last = (labels != spec.pad_token_id).sum(axis=1) - 1
            shifted[:, 0] = labels[np.arange(labels.shape[0]), last]
        else:
            if spec.decoder_start_token_id is None:
                raise VkformersError(f"{self.architecture_name}: config has no decoder_start_token_id to shift "
                                     "labels with")
            shifted[:, 0] = spec.decoder_start_token_id
        return shifted

    def decoder_inputs(self, ids: np.ndarray, decoder_input_ids=None, labels: np.ndarray | None = None) -> np.ndarray:
        """decoder_input_ids as given, else the labels shifted right, else (BART) the input shifted right."""
        if decoder_input_ids is not None:
            return id_array(decoder_input_ids)
        if labels is not None:
            return self.shift_right(labels)
        if self.spec.decoder_inputs_from_input_ids:  # BART: denoising input = the input shifted right
            return self.shift_right(ids)
        raise VkformersError(f"{self.architecture_name}: give decoder_input_ids or labels")

    # -- forward

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, labels=None,
                decoder_attention_mask=None, encoder_outputs=None, global_attention_mask=None):
        ids = id_array(input_ids)
        mask = None if attention_mask is None else id_array(attention_mask)
        if decoder_attention_mask is not None and not id_array(decoder_attention_mask).all():
            raise VkformersError("decoder_attention_mask with zeros is not supported (the decoder attends causally "
                                 "to every decoder token)")
        label_array = None if labels is None else id_array(labels)
        decoder_ids = self.decoder_inputs(ids, decoder_input_ids, label_array)
        encoder_states = encoder_outputs if encoder_outputs is not None else \
            self.encode(ids, mask, global_attention_mask)
        if self.spec.ngram and label_array is not None:
            streams = self.decode(decoder_ids, encoder_states, mask, all_streams=True)   # [B, n, T, V]
            return Seq2SeqLMOutput(logits=streams[:, 0], loss=self._ngram_loss(streams, label_array),
                                   encoder_last_hidden_state=encoder_states)
        logits = self.decode(decoder_ids, encoder_states, mask)
        loss = None
        if label_array is not None:
            loss = F.cross_entropy(logits.float(), tensor(label_array.astype(np.int32)), ignore_index=IGNORE_INDEX)
        return Seq2SeqLMOutput(logits=logits, loss=loss, encoder_last_hidden_state=encoder_states)

    def _ngram_loss(self, streams, labels: np.ndarray):
        """ProphetNet: the mean cross-entropy over every stream's labels (the same ones; streams past the first
        ignored with disable_ngram_loss), mixed with eps label smoothing: (1 - eps) nll + eps / V * the mean over
        the counted rows of -sum(log p)."""
        batch, count, length, vocab = streams.shape
        targets = np.full((count, batch, length), IGNORE_INDEX, np.int64)
        targets[:count if self.spec.ngram_loss else 1] = labels
        logits = streams.float().permute(1, 0, 2, 3).reshape(count * batch, length, vocab)
        targets = targets.reshape(count * batch, length)
        loss = F.cross_entropy(logits, tensor(targets.astype(np.int32)), ignore_index=IGNORE_INDEX)
        eps = self.spec.label_smoothing
        if eps > 0.0:
            counted = (targets != IGNORE_INDEX).astype(np.float32)
            smooth = -(F.log_softmax(logits, -1).sum(-1) * tensor(counted)).sum() * (1.0 / counted.sum())
            loss = loss * (1.0 - eps) + smooth * (eps / vocab)
        return loss

    # -- generation (Seq2SeqGenerationMixin's loop)

    generation_encoder_inputs = ("global_attention_mask",)

    def default_pad_token_id(self) -> int:
        return self.spec.pad_token_id

    def generation_encoder_states(self, ids: np.ndarray, mask: np.ndarray, global_attention_mask=None):
        return self.encode(ids, mask, global_attention_mask).realize()

    def generation_cache(self, batch: int, max_len: int, encoder_states, mask: np.ndarray) -> EncoderDecoderCache:
        spec = self.spec
        cache = EncoderDecoderCache(spec.decoder_layers, batch, spec.decoder_kv_heads or spec.decoder_heads,
                                    spec.head_dim, max_len, self.dtype, self.decoder.embed_tokens.weight.device,
                                    encoder_states, mask)
        # T5Gemma 2's merged attention reads the encoder's keys through its self-attention projections
        cache.fill_cross([tuple((layer.self_attn if layer.merged else layer.cross_attn).split(role, encoder_states)
                                for role in ("k", "v")) for layer in self.decoder.layers])
        return cache

    def generation_step(self, ids: np.ndarray, encoder_states, mask: np.ndarray, cache: EncoderDecoderCache):
        return self.decode(ids, encoder_states, mask, cache=cache)


def _stored_name(renames, skipped, name: str) -> str | None:
    """A checkpoint tensor's name after ``renames`` (regex, replacement); None for one under ``skipped``."""
    if name.startswith(skipped):
        return None
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    return name
