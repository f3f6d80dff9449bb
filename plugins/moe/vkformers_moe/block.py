"""The sparse mixture-of-experts feed-forward block, as a declared delta on the shared decoder.

A :class:`MoeSpec` describes one family's MoE layer (router, top-k selection, experts, shared
experts) under the checkpoint's own names; the llama plugin's decoder asks it, layer by layer,
for the block that replaces the dense MLP (``DecoderSpec.moe``). Mixtral, for instance, is
Mistral with ``MoeSpec(path="block_sparse_moe", expert_names=("w1", "w3", "w2"), ...)``.

Semantics (transformers 5): router logits = linear(x); scores = softmax or sigmoid of them;
the top-k experts are chosen on the scores (plus a selection-only bias, optionally within the
best expert groups); the chosen scores, optionally renormalised and scaled, weight the experts'
SwiGLU outputs; shared experts (optionally gated by sigmoid(linear(x))) are added. Gradients
reach the router only through the chosen scores, as in transformers.

Cost: an expert multiplies only the rows of the tokens that chose it. For a step of at least
COMPACT_MIN_TOKENS tokens (prefill, training) the block packs the tokens' rows expert after expert into one
[tokens x top_k, hidden] matrix (engine.ops.routing.PackedRoutes, on the GPU), each expert a span of it, runs every
expert's products over its span in one node (F.grouped_matmul, forward and backward) and sums each token's
rows back: about top_k / num_experts of the dense work, and activations of tokens x top_k rows. Experts that
the packed path cannot run (a custom ``run``, biases, unlike LoRA adapters) get a list of tokens each instead
(ExpertRoutes: a [tokens, hidden] buffer per expert, its first `count` rows used). A step of fewer tokens
(decoding) keeps the tokens in place and gates each expert's products whole: an expert no token chose is
skipped, reading none of its weights. Top-k is
one dispatch (vkformers.engine.ops.routing.topk_mask), so the whole block stays on the GPU (no read-back),
autograd gives its backward and captured decode steps replay it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkformers.engine import functional as F
from vkformers.errors import VkformersError
from vkformers.engine.tensor import Tensor
from vkformers.engine.ops.routing import (  # noqa: F401 (topk_mask re-exported)
    _HIDDEN, PACK_MAX_EXPERTS, ExpertRoutes, PackedRoutes, topk_mask)
from vkformers.models.layers import Linear, grouped_linear, linears_can_be_grouped
from vkformers.models.lazy_weights import LazyWeights
from vkformers.models.module import Module, add_param, get_param, join_path, place
from vkformers.models.decoder import make_norm

# How a block runs its experts (SparseMoeBlock.experts_mode; set_experts_mode sets it on a whole model):
# "routed": each expert on the tokens that chose it, their rows packed into one matrix where the experts allow it
#           (see the module docstring), else a list of rows per expert;
# "listed": as routed, always a list of rows per expert;
# "dense":  every expert on every token, weighted by zero where not chosen (the reference the others are tested
#           and measured against).
EXPERTS_MODES = ("routed", "listed", "dense")
# From this many tokens a step routes each expert's tokens to it (packed, or a list per expert); below it, the
# tokens stay in place and only the experts that no token chose are skipped (a decode step of a few tokens:
# routing would add dispatches per layer, and the rows fit one tile of the kernels anyway).
COMPACT_MIN_TOKENS = 64


@dataclass(frozen=True)
class MoeSpec:
    """One architecture's mixture-of-experts layer. Names are relative to the layer (``path``) or to the block."""

    num_experts: int
    top_k: int
    expert_size: int                          # each expert's intermediate width
    layers: tuple[bool, ...]                  # per decoder layer: sparse (True) or the dense MLP (False)
    hidden_act: str = "silu"
    path: str = "mlp"                         # the block, relative to the layer (Mixtral: block_sparse_moe)
    # -- router
    router: str = "gate"                      # linear [num_experts, hidden] ("<router>.weight")
    router_bias: bool = False
    router_softcap: float = 0.0               # logits = c tanh(logits / c) before scoring (Laguna); 0: none
    scoring: str = "softmax"                  # softmax | sigmoid | sparsemixer (PhiMoE, top-2, eval form)
    sparsemixer_eps: float = 0.0              # SparseMixer's jitter threshold (PhiMoE router_jitter_noise)
    selection_bias: str | None = None         # added to the scores for choosing only (DeepSeek-V3 e_score_correction_bias)
    selection_bias_is_parameter: bool = False  # a trained parameter (no gradient reaches it) rather than a buffer
    selection_bias_shape: tuple[int, ...] | None = None  # its stored shape; None: (num_experts,)
    num_groups: int = 1                       # group-limited choice: experts in num_groups groups, of which
    topk_groups: int = 1                      # the topk_groups best (by group_score) are eligible
    group_score: str = "top2_sum"             # top2_sum (DeepSeek-V3) | max (DeepSeek-V2)
    norm_topk: bool = False                   # divide the chosen weights by their sum
    norm_eps: float = 0.0                     # ... plus this (DeepSeek-V3: 1e-20)
    routed_scale: float = 1.0                 # multiply the chosen weights (routed_scaling_factor)
    # -- experts
    experts: str = "experts"                  # their container ("" for GraniteMoE's fused weights)
    fused_experts: tuple[str, str] | None = None  # (gate_up, down) 3-D weights [E, 2I, H] and [E, H, I] (GraniteMoE);
    #                                             None: one module per expert, experts.<e>.<gate|up|down>.weight
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # (gate, up, down)
    fused_transposed: bool = False            # fused_experts stored [E, H, 2I] and [E, I, H] (x @ W: Aria fc1 / fc2)
    fused_either_layout: bool = False         # a file may hold fused_experts the other way round: transposed at load
    #                                           when the shape says so (Qwen3-VL-MoE: released [E, H, 2I], transformers
    #                                           5.24 saves [E, 2I, H]; it reads both by shape, as here)
    fused_bias: tuple[str, str] | None = None  # biases of fused_experts, [E, 2I] and [E, H] (GPT-OSS gate_up_proj_bias,
    #                                            down_proj_bias), in the routed output like the weights
    gate_up_interleaved: bool = False         # fused gate_up columns alternate gate, up (GPT-OSS) instead of [gate | up]
    swiglu_clip: tuple[float, float] | None = None  # (alpha, limit): the experts' GLU is GPT-OSS's clipped SwiGLU,
    #                                           (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g), g = min(gate, limit)
    stacked_experts: bool = False             # expert_names are 2-D [E * I, hidden] weights, experts stacked on rows;
    #                                           the down one holds each expert's [I, hidden] (DBRX mlp.w1/v1/w2)
    scale_inputs: bool = False                # the routing weight scales each expert's input, not its output (Llama 4:
    #                                           an unchosen expert sees zeros, and its SwiGLU without biases gives 0)
    identity_experts: int = 0                 # zero-compute experts after the routed ones (LongCat): scored by the
    #                                           router like them, each returns its input
    identity_weights: tuple[str, ...] = ()    # projections transformers declares for them but never runs (LongCat
    #                                           gate_proj / up_proj): parameters, zeros when a checkpoint lacks them
    # -- shared experts (always on)
    shared: str | None = None                 # a SwiGLU MLP with the expert names above
    shared_size: int = 0
    shared_names: tuple[str, str, str] | None = None  # when they differ from expert_names
    shared_gate: str | None = None            # linear [1, hidden]: the shared output is scaled by its sigmoid
    shared_bias: bool = False                 # the shared experts' linears have biases (ERNIE 4.5 use_bias)
    shared_fused: bool = False                # shared_names are (gate_up, down): one [2 size, hidden] input linear
    shared_swiglu_clip: bool = False          # the shared experts' GLU is swiglu_clip's too (MiniMax-M3)
    output_scale: float = 1.0                 # the block's output (routed + shared) is multiplied by this (Cohere2
    #                                           MoE's "average" shared-expert combination: 0.5)
    output_bias: str | None = None            # a bias [hidden] added to the block's output (JetMoE mlp.bias)
    output_norm: str | None = None            # a norm (the decoder's kind) on the block's output, stored beside the
    #                                           block in the layer under this path (A.X-K1 post_mlp_layernorm)
    shared_in_layer: bool = False             # ``shared`` is relative to the decoder layer, beside the block
    #                                           (GraniteMoeShared: layers.<i>.shared_mlp next to block_sparse_moe)

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"unknown router scoring {self.scoring!r}; known: softmax, sigmoid, sparsemixer")
        if self.scoring == "sparsemixer" and self.top_k != 2:
            raise ValueError(f"sparsemixer routing chooses 2 experts, not top_k {self.top_k}")
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"unknown expert group score {self.group_score!r}; known: top2_sum, max")
        if self.num_experts % self.num_groups:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_groups} groups")
        if self.shared_fused and len(self.shared_names or ()) != 2:
            raise ValueError("shared_fused needs shared_names (gate_up, down)")
        if self.identity_experts and (self.num_groups > 1 or self.scoring == "sparsemixer"):
            raise ValueError("identity experts are not supported with expert groups or sparsemixer routing")
        if (self.fused_bias or self.gate_up_interleaved or self.swiglu_clip) and not self.fused_experts:
            raise ValueError("fused_bias, gate_up_interleaved and swiglu_clip need fused_experts")
        if self.shared_swiglu_clip and not (self.swiglu_clip and self.shared):
            raise ValueError("shared_swiglu_clip needs swiglu_clip and shared experts")
        if not 0 < self.top_k <= self.num_experts + self.identity_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts + self.identity_experts} experts")

    def block(self, spec, index: int) -> "SparseMoeBlock | None":
        """The hook the shared decoder calls (DecoderSpec.moe): this layer's block, or None for a dense MLP."""
        return SparseMoeBlock(self, spec.hidden_size, spec) if self.layers[index] else None


def clipped_swiglu(gate, up, clip: tuple[float, float]):
    """GPT-OSS's clipped SwiGLU (MoeSpec.swiglu_clip): (clamp(up, -limit, limit) + 1) * g sigmoid(alpha g),
    g = min(gate, limit)."""
    alpha, limit = clip
    # minimum/maximum rather than Tensor.clamp, whose backward multiplies two bool masks (unsupported)
    gate, up = gate.minimum(limit), up.maximum(-limit).minimum(limit)
    return gate * (gate * alpha).sigmoid() * (up + 1.0)


class SwiGLU(Module):
    """down(act(gate(x)) * up(x)): one expert, or the shared experts. ``fused``: names are (gate_up, down), one
    linear [2 inner, hidden] computing [gate | up] (GraniteMoE's input_linear / output_linear). ``clip``: the GLU is
    clipped_swiglu's instead."""

    def __init__(self, hidden: int, inner: int, names: tuple[str, ...], act: str, bias: bool = False,
                 fused: bool = False, clip: tuple[float, float] | None = None):
        super().__init__()
        self.inner, self.clip = inner, clip
        if fused:
            gate_up, down = names
            object.__setattr__(self, "projections", (place(self, gate_up, Linear(hidden, 2 * inner, bias=bias)),
                                                     None, place(self, down, Linear(inner, hidden, bias=bias))))
        else:
            gate, up, down = names
            object.__setattr__(self, "projections", (place(self, gate, Linear(hidden, inner, bias=bias)),
                                                     place(self, up, Linear(hidden, inner, bias=bias)),
                                                     place(self, down, Linear(inner, hidden, bias=bias))))
        self.act = F.activation(act)

    def forward(self, x, live_rows=None):
        """``live_rows``: rows of x at or past it are padding (Linear.forward): a routed expert's list."""
        gate, up, down = self.projections
        if up is None:
            both = gate(x, live_rows)
            g, u = both[..., :self.inner], both[..., self.inner:]
        else:
            g, u = gate(x, live_rows), up(x, live_rows)
        return down(clipped_swiglu(g, u, self.clip) if self.clip else self.act(g) * u, live_rows)


class SparseMoeBlock(Module):
    """Router, top-k choice, experts and shared experts of one layer, under the checkpoint's names."""

    def __init__(self, moe: MoeSpec, hidden: int, spec=None):
        super().__init__()
        self.moe, self.hidden, self.path = moe, hidden, moe.path
        self.experts_mode = "routed"
        scored = moe.num_experts + moe.identity_experts
        object.__setattr__(self, "router", place(self, moe.router, Linear(hidden, scored, bias=moe.router_bias)))
        bias_shape = moe.selection_bias_shape or (scored,)
        self.selection_bias = None  # a buffer: load_buffers fills it (zeros if the checkpoint lacks it)
        if moe.selection_bias and moe.selection_bias_is_parameter:
            add_param(self, moe.selection_bias, bias_shape)
        elif moe.selection_bias:
            self.selection_bias = Tensor(np.zeros(bias_shape, np.float32))
        if moe.stacked_experts:
            for name in moe.expert_names:
                add_param(self, join_path(moe.experts, name), (moe.num_experts * moe.expert_size, hidden))
            object.__setattr__(self, "expert_list", None)
        elif moe.fused_experts:
            for name, shape in zip(moe.fused_experts, self._fused_shapes()):
                add_param(self, join_path(moe.experts, name), shape)
            if moe.fused_bias:
                add_param(self, join_path(moe.experts, moe.fused_bias[0]), (moe.num_experts, 2 * moe.expert_size))
                add_param(self, join_path(moe.experts, moe.fused_bias[1]), (moe.num_experts, hidden))
            object.__setattr__(self, "expert_list", None)
        else:
            object.__setattr__(self, "expert_list", [
                place(self, join_path(moe.experts, str(e)),
                      SwiGLU(hidden, moe.expert_size, moe.expert_names, moe.hidden_act))
                for e in range(moe.num_experts)])
        # loaded and saved, never run (a zero gradient: _count_expert_gradients); load_state_dict supplies zeros
        # when a checkpoint lacks them
        self.unused_weights = tuple(join_path(moe.experts, str(e), name, "weight")
                                    for e in range(moe.num_experts, scored) for name in moe.identity_weights)
        for name in self.unused_weights:
            add_param(self, name, (moe.expert_size, hidden))
        shared = SwiGLU(hidden, moe.shared_size, moe.shared_names or moe.expert_names, moe.hidden_act,
                        bias=moe.shared_bias, fused=moe.shared_fused,
                        clip=moe.swiglu_clip if moe.shared_swiglu_clip else None) if moe.shared else None
        # layer_modules: placed by the decoder layer under these layer-relative paths (the block calls them)
        object.__setattr__(self, "layer_modules", {moe.shared: shared} if shared and moe.shared_in_layer else {})
        if shared is not None and not moe.shared_in_layer:
            place(self, moe.shared, shared)
        object.__setattr__(self, "shared", shared)
        if moe.output_bias:
            add_param(self, moe.output_bias, (hidden,))
        norm = make_norm(spec, hidden) if moe.output_norm else None
        if norm is not None:
            self.layer_modules[moe.output_norm] = norm
        object.__setattr__(self, "output_norm", norm)
        object.__setattr__(self, "shared_gate", place(self, moe.shared_gate, Linear(hidden, 1, bias=False))
                           if moe.shared_gate else None)
        self.act = F.activation(moe.hidden_act)

    def _fused_shapes(self):
        """The (gate_up, down) parameters' shapes: [E, 2I, H] and [E, H, I], or transposed (fused_transposed)."""
        e, i, h = self.moe.num_experts, self.moe.expert_size, self.hidden
        return ((e, h, 2 * i), (e, i, h)) if self.moe.fused_transposed else ((e, 2 * i, h), (e, h, i))

    def convert_checkpoint(self, arrays: LazyWeights, path: str) -> LazyWeights:
        """fused_either_layout: fused expert weights stored transposed against the parameters (and not square in
        their last two dims) are transposed (when read). Returns ``arrays``, or a copy with those replaced."""
        moe = self.moe
        if not (moe.fused_experts and moe.fused_either_layout):
            return arrays
        transposed = {}
        for name, want in zip(moe.fused_experts, self._fused_shapes()):
            key = join_path(path, moe.experts, name)
            have = arrays.shape(key) if key in arrays else ()
            if len(have) == 3 and have != want and have == (want[0], want[2], want[1]):
                transposed[key] = arrays.weight(key).converted(_swap_last_axes, shape=want)
        return arrays.updated(transposed)

    def load_buffers(self, arrays, prefix: str) -> None:
        """The selection bias, when the checkpoint stores it as a buffer (not a parameter)."""
        moe = self.moe
        if moe.selection_bias and not moe.selection_bias_is_parameter:
            name = f"{prefix}.{moe.selection_bias}"
            if name in arrays:
                self.selection_bias = Tensor(np.asarray(arrays[name], np.float32))

    # -- routing

    def routing_weights(self, x):
        """[tokens, experts] weights: the chosen experts' (renormalised, scaled) scores, zero elsewhere."""
        moe = self.moe
        logits = self.router(x).float()
        if moe.router_softcap:
            logits = (logits * (1.0 / moe.router_softcap)).tanh() * moe.router_softcap
        if moe.scoring == "sparsemixer":
            return self._sparsemixer(logits)
        scores = logits.softmax(-1) if moe.scoring == "softmax" else logits.sigmoid()
        choice = scores.detach()
        if moe.selection_bias:
            bias = (get_param(self, moe.selection_bias) if moe.selection_bias_is_parameter
                    else self.selection_bias).detach()
            choice = choice + bias.reshape(moe.num_experts + moe.identity_experts)
        if moe.num_groups > 1:
            choice = self._eligible(choice)
        chosen = topk_mask(choice, moe.top_k)
        weights = F.where(chosen, scores, 0.0)
        if moe.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + moe.norm_eps) if moe.norm_eps else \
                weights / weights.sum(-1, keepdim=True)
        if moe.routed_scale != 1.0:
            weights = weights * moe.routed_scale
        return weights

    def _sparsemixer(self, logits):
        """PhiMoE's SparseMixer as transformers evaluates it (no sampling): expert 1 is the argmax of the logits,
        weighted by the softmax over the logits l with (max - l) / max(|l|, max) <= 2 eps (the others masked out);
        expert 2 likewise among the logits without expert 1. Gradients reach the logits through both softmaxes."""
        eps2 = 2.0 * self.moe.sparsemixer_eps
        values = logits.detach()
        size = F.where(values >= 0.0, values, values * -1.0)  # |l|

        def choose(candidates):
            top = candidates.max(-1, keepdim=True)
            factor = F.where(size >= top, size, top)
            return candidates >= top, (top - values) / factor > eps2

        first, drop = choose(values)
        weights = F.where(first, F.where(drop, _HIDDEN, logits).softmax(-1), 0.0)
        second, drop = choose(F.where(first, _HIDDEN, values))
        masked = F.where(drop, _HIDDEN, F.where(first, _HIDDEN, logits))
        return weights + F.where(second, masked.softmax(-1), 0.0)

    def _eligible(self, choice):
        """The choice scores with the experts outside the topk_groups best groups never chosen (transformers masks
        them to -inf, or to 0 for softmax scores, which are positive: the same choice)."""
        moe = self.moe
        tokens, size = choice.shape[0], moe.num_experts // moe.num_groups
        grouped = choice.reshape(tokens, moe.num_groups, size)
        best = grouped.max(-1, keepdim=True)
        if moe.group_score == "top2_sum":  # the two largest scores of each group
            second = F.where(grouped >= best, _HIDDEN, grouped).max(-1, keepdim=True)
            best = best + second
        groups = topk_mask(best.reshape(tokens, moe.num_groups), moe.topk_groups)
        eligible = groups.reshape(tokens, moe.num_groups, 1).expand(tokens, moe.num_groups, size)
        return F.where(eligible.reshape(tokens, moe.num_experts), choice, _HIDDEN)

    # -- forward

    def _batched_experts(self, xs, product):
        """The experts' SwiGLU from stacked [E * I, H] or fused [E, ...] weights: ``product(a, w)`` multiplies by
        the [E, ., .] weights, xs being [E, tokens, hidden] (F.matmul, batched over the experts) or the packed
        [rows, hidden] (F.grouped_matmul over the experts' spans)."""
        moe = self.moe
        if moe.stacked_experts:
            shape = (moe.num_experts, moe.expert_size, self.hidden)
            gate, up, down = (get_param(self, join_path(moe.experts, n)).reshape(*shape) for n in moe.expert_names)
            return product(self._glu(product(xs, gate.transpose(-1, -2)), product(xs, up.transpose(-1, -2))), down)
        gate_up_name, down_name = moe.fused_experts
        gate_up = get_param(self, join_path(moe.experts, gate_up_name))
        down = get_param(self, join_path(moe.experts, down_name))
        if not moe.fused_transposed:
            gate_up, down = gate_up.transpose(-1, -2), down.transpose(-1, -2)
        both = product(xs, gate_up)
        if moe.fused_bias:
            both = both + get_param(self, join_path(moe.experts, moe.fused_bias[0])).reshape(moe.num_experts, 1, -1)
        if moe.gate_up_interleaved:
            gate, up = both[..., 0::2], both[..., 1::2]
        else:
            gate, up = both[..., :moe.expert_size], both[..., moe.expert_size:]
        out = product(self._glu(gate, up), down)
        if moe.fused_bias:
            out = out + get_param(self, join_path(moe.experts, moe.fused_bias[1])).reshape(moe.num_experts, 1, -1)
        return out

    def _glu(self, gate, up):
        """act(gate) * up, or GPT-OSS's clipped SwiGLU (MoeSpec.swiglu_clip)."""
        if self.moe.swiglu_clip is None:
            return self.act(gate) * up
        return clipped_swiglu(gate, up, self.moe.swiglu_clip)

    def experts_output(self, x, weights, run=None):
        """sum over experts e of weights[:, e] * expert_e(x) for x [tokens, hidden] and routing weights [tokens, E]
        (zero where not chosen), each expert run only where it is needed (see the module's docstring).
        ``run(expert, x, live_rows)``: how to run one module of expert_list (default: the module itself), for
        blocks whose experts differ (DeepSeek-V4's clipped SwiGLU)."""
        tokens, mode = x.shape[0], self.experts_mode
        if mode == "routed" and tokens >= COMPACT_MIN_TOKENS and run is None and self._packable():
            return self._packed_experts(x, weights)
        run = run or (lambda expert, rows, live: expert(rows, live))
        if mode == "dense":
            return self._dense_experts(x, weights, None, run)
        if tokens >= COMPACT_MIN_TOKENS:
            return self._routed_experts(x, weights, ExpertRoutes.of(weights), run)
        # tokens in place; an expert no token chose has no live rows (and scaled by zero adds nothing)
        return self._dense_experts(x, weights, F.live_rows_where_used(weights), run)

    def _dense_experts(self, x, weights, live_rows, run):
        """Every expert on every token, weighted by ``weights`` [tokens, E] (zero where not chosen)."""
        moe = self.moe
        tokens = x.shape[0]
        if self.expert_list is None:  # [E, ...] weights: one batched product over all experts
            xs = x.reshape(1, tokens, self.hidden).expand(moe.num_experts, tokens, self.hidden)
            per_expert = weights.transpose(0, 1).reshape(moe.num_experts, tokens, 1)
            if moe.scale_inputs:
                xs = xs * per_expert
            y = self._batched_experts(xs, lambda a, w: F.matmul(a, w, live_rows))  # [E, tokens, hidden]
            return (y if moe.scale_inputs else y * per_expert).sum(0)
        out = None
        for e, expert in enumerate(self.expert_list):
            live = None if live_rows is None else live_rows[e:e + 1]
            y = run(expert, x * weights[:, e:e + 1], live) if moe.scale_inputs else \
                run(expert, x, live) * weights[:, e:e + 1]
            out = y if out is None else out + y
        return out

    def _packable(self) -> bool:
        """Whether the packed path runs these experts: no biases (per-expert biases would need a gather per row
        that sums back over rows); per-expert modules grouped_linear can run, projection by projection."""
        moe = self.moe
        if moe.fused_bias or moe.num_experts > PACK_MAX_EXPERTS:
            return False
        if self.expert_list is None:
            return True
        projections = zip(*(expert.projections for expert in self.expert_list))
        return all(linears_can_be_grouped(linears) for linears in projections) and \
            all(expert.clip is None for expert in self.expert_list)

    def _packed_experts(self, x, weights):
        """Every expert on its span of the packed rows (PackedRoutes), each token's rows weighted and summed."""
        moe = self.moe

        def experts(rows, spans):
            if self.expert_list is None:
                return self._batched_experts(rows, lambda a, w: F.grouped_matmul(a, w, spans))
            gates, ups, downs = ([expert.projections[i] for expert in self.expert_list] for i in range(3))
            return grouped_linear(self.act(grouped_linear(rows, gates, spans)) * grouped_linear(rows, ups, spans),
                                  downs, spans)
        return PackedRoutes.of(weights, moe.top_k).weighted_sum(x, weights, experts, moe.scale_inputs)

    def _routed_experts(self, x, weights, routes: ExpertRoutes, run):
        """Each expert on its list of tokens (routes), the outputs put back in token order and weighted."""
        moe = self.moe
        scales = routes.gather_weights(weights) if moe.scale_inputs else None  # [E, tokens, 1], list order
        if self.expert_list is None:
            xs = routes.gather(x)  # [E, tokens, hidden]
            y = routes.scatter(self._batched_experts(xs * scales if moe.scale_inputs else xs,
                                                     lambda a, w: F.matmul(a, w, routes.counts)))
            if moe.scale_inputs:
                return y.sum(0)
            return (y * weights.transpose(0, 1).reshape(moe.num_experts, -1, 1)).sum(0)
        out = None
        for e, expert in enumerate(self.expert_list):
            xe = routes.gather_one(x, e)
            y = run(expert, xe * scales[e] if moe.scale_inputs else xe, routes.counts[e:e + 1])
            y = routes.scatter_one(y, e)
            y = y if moe.scale_inputs else y * weights[:, e:e + 1]
            out = y if out is None else out + y
        return out

    def _count_expert_gradients(self, out, routed_weights):
        """out (the routed experts' sum), with gradients given as transformers gives them where identity experts
        share the routing (LongCat): it keeps all experts' projections in one parameter, the identity experts'
        never-run rows included, and runs that parameter only when some token chose a routed expert. So every
        expert weight gets a gradient then (zeros for the unused ones), and none when every choice was an
        identity expert."""
        prefix = f"{self.moe.experts}."
        experts = [p for name, p in self.named_parameters() if name.startswith(prefix)]
        chose_routed = F.live_rows_where_used(routed_weights).sum()
        return F.gradient_use(out, used=[get_param(self, n) for n in self.unused_weights],
                              present_if=[(chose_routed, experts)])

    def forward(self, h):
        moe = self.moe
        lead = h.shape[:-1]
        x = h.reshape(-1, self.hidden)
        weights = self.routing_weights(x).cast(x.dtype)
        identity = None
        if moe.identity_experts:  # their weights, summed, scale the input itself
            identity = x * weights[:, moe.num_experts:].sum(-1, keepdim=True)
            weights = weights[:, :moe.num_experts]
        out = self.experts_output(x, weights)
        if identity is not None:
            out = self._count_expert_gradients(out, weights) + identity
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * self.shared_gate(x).sigmoid()
            out = out + shared
        if moe.output_scale != 1.0:
            out = out * moe.output_scale
        if moe.output_bias:
            out = out + get_param(self, moe.output_bias).cast(out.dtype)
        if self.output_norm is not None:
            out = self.output_norm(out)
        return out.reshape(*lead, self.hidden)


def set_experts_mode(model: Module, mode: str) -> int:
    """Run every mixture-of-experts block of ``model`` in ``mode`` (one of EXPERTS_MODES); returns how many blocks
    changed. The model's captured generate steps are dropped: they were recorded with the other mode's graph."""
    if mode not in EXPERTS_MODES:
        raise VkformersError(f"experts mode {mode!r} is not one of {', '.join(EXPERTS_MODES)}")
    blocks = [m for _, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.experts_mode = mode
    if hasattr(model, "forget_captures"):
        model.forget_captures()
    return len(blocks)


def _swap_last_axes(array) -> np.ndarray:
    """[E, a, b] -> [E, b, a], contiguous (a fused expert weight stored transposed)."""
    return np.ascontiguousarray(np.swapaxes(np.asarray(array), 1, 2))
