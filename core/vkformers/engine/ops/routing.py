"""Mixture-of-experts routing on the GPU: the top-k choice, and each expert's tokens, so that an expert multiplies
those rows only (vkformers-moe's sparse block, and Switch Transformers in vkformers-t5).

``topk_mask(values, k)`` marks the k largest entries of each row with ``shaders/common/moe_topk.comp``: one
dispatch where k rounds of max and masking took four each.

``ExpertRoutes.of(weights)`` runs ``shaders/common/moe_routes.comp`` on the routing weights
[tokens, experts] (zero where a token did not choose an expert). The block then gathers each list's rows of the
input (row s of expert e is token ``token_of_slot[e, s]``; the rows past the list are zeros), runs the expert
with ``live_rows`` = the list's length (the matmul kernels skip the blocks of rows past it, forward and backward),
and puts the outputs back in token order (zeros for the tokens that did not choose it). Both moves are gathers
(F.gather_rows) whose gradient is the opposite gather, so autograd, training and captured replays work as on the
dense block, and nothing is read back to the host.

``PackedRoutes.of(weights, top_k)`` (``shaders/common/moe_pack.comp``) packs all experts' rows into one
[tokens * top_k, width] matrix instead, expert after expert, with each expert's span of rows (F.grouped_matmul):
activations of tokens x top_k rows in all, where the lists above hold tokens rows per expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkformers.engine.function import KernelOp, node, wrap
from vkformers.engine.ops.elementwise import where
from vkformers.engine.ops.nn import gather_rows
from vkformers.runtime import dtypes as dt

if TYPE_CHECKING:  # annotations only: engine/tensor.py sits above the ops
    from vkformers.engine.tensor import Tensor

TOPK_MAX_ENTRIES = 1024  # moe_topk.comp's MAX_N: a row it stages in shared memory
_HIDDEN = -3.0e38  # a score that never wins the max


class TopkMaskKernel(KernelOp):
    name = "moe_topk"

    def emit(self, seq, outs, ins):
        (mask,), (values,) = outs, ins
        n = values.shape[-1]
        rows = values.numel // n if n else 0
        if rows == 0:  # an empty tensor: nothing to choose
            return
        v, m = values.operand, mask.operand
        x = min(rows, seq.device.limits["max_compute_work_group_count_x"])
        seq.dispatch(seq.device.kernel("moe_topk"), [v.buffer, m.buffer], (x, -(-rows // x), 1),
                     push=[rows, n, self.k, v.offset, m.offset], spec=[TOPK_MAX_ENTRIES])


def topk_mask(values, k: int):
    """A boolean mask of the k largest entries along the last axis (no gradient). Ties go to the lower index,
    so each row has exactly k (torch.topk's choice); rows longer than TOPK_MAX_ENTRIES take k rounds of max and
    masking instead, where a tie at the k-th value selects every tied entry (random weights never tie)."""
    values = values.detach()
    n = values.shape[-1]
    if n <= TOPK_MAX_ENTRIES:
        mask = node(TopkMaskKernel(k=int(k)), [values.float().lazy], [(values.shape, dt.float32)])[0]
        return wrap(mask) > 0.5
    chosen, remaining = None, values
    for _ in range(k):
        hit = remaining >= remaining.max(-1, keepdim=True)
        chosen = where(hit, 1.0, 0.0) if chosen is None else where(hit, 1.0, chosen)
        remaining = where(hit, _HIDDEN, remaining)
    return chosen > 0.5


class ExpertRoutesKernel(KernelOp):
    name = "moe_routes"

    def emit(self, seq, outs, ins):
        (routes, counts), (weights,) = outs, ins
        tokens, experts = weights.shape
        w, r, c = weights.operand, routes.operand, counts.operand
        seq.dispatch(seq.device.kernel("moe_routes"), [w.buffer, r.buffer, c.buffer], (experts, 1, 1),
                     push=[tokens, experts, w.offset, r.offset, c.offset])


@dataclass(frozen=True)
class ExpertRoutes:
    """int32 [experts, tokens] maps (-1: none) and float32 [experts] list lengths; ``stacked_*`` count rows of
    the [experts * tokens] stack of all lists (see moe_routes.comp); ``routes`` all four maps, [4, experts, tokens]."""

    routes: Tensor
    token_of_slot: Tensor
    slot_of_token: Tensor
    stacked_token_of_slot: Tensor
    stacked_slot_of_token: Tensor
    counts: Tensor

    @classmethod
    def of(cls, weights) -> "ExpertRoutes":
        tokens, experts = weights.shape
        if tokens < 1 or experts < 1:
            raise ValueError(f"ExpertRoutes: routing weights of shape {weights.shape} list no tokens or experts")
        routes, counts = node(ExpertRoutesKernel(), [weights.detach().float().lazy],
                              [((4, experts, tokens), dt.int32), ((experts,), dt.float32)])
        maps = wrap(routes)
        return cls(maps, maps[0], maps[1], maps[2], maps[3], wrap(counts))

    @property
    def experts(self) -> int:
        return self.token_of_slot.shape[0]

    @property
    def tokens(self) -> int:
        return self.token_of_slot.shape[1]

    def gather(self, x):
        """x [tokens, width] -> [experts, tokens, width]: each expert's rows, in its list's order."""
        return gather_rows(x, self.token_of_slot, self.stacked_slot_of_token)

    def scatter(self, y):
        """y [experts, tokens, width] in list order -> the same in token order, zero where a token did not choose."""
        rows = self.experts * self.tokens
        return gather_rows(y.reshape(rows, y.shape[-1]), self.stacked_slot_of_token,
                             self.stacked_token_of_slot.reshape(rows))

    def gather_one(self, x, expert: int):
        """x [tokens, width] -> [tokens, width]: expert ``expert``'s rows (one module per expert)."""
        return gather_rows(x, self.token_of_slot[expert], self.slot_of_token[expert])

    def scatter_one(self, y, expert: int):
        """gather_one's inverse: y [tokens, width] in list order -> token order, zero where not chosen."""
        return gather_rows(y, self.slot_of_token[expert], self.token_of_slot[expert])

    def gather_weights(self, weights):
        """weights [tokens, experts] -> [experts, tokens, 1]: each list's routing weights (scale_inputs)."""
        rows = self.experts * self.tokens
        by_expert = weights.transpose(0, 1).reshape(rows, 1)
        return gather_rows(by_expert, self.stacked_token_of_slot, self.stacked_slot_of_token.reshape(rows))


class PackRoutesKernel(KernelOp):
    name = "moe_pack"

    def emit(self, seq, outs, ins):
        (weights, routes, counts) = ins
        tokens, experts = weights.shape
        groups = max(1, -(-tokens // 256))
        seq.dispatch(seq.device.kernel("moe_pack"), [x.operand.buffer for x in (*ins, *outs)], (groups, 1, 1),
                     push=[tokens, experts, self.top_k, *(x.operand.offset for x in (*ins, *outs))],
                     spec=[PACK_MAX_EXPERTS])


PACK_MAX_EXPERTS = 1024  # moe_pack.comp's shared array of span starts


@dataclass(frozen=True)
class PackedRoutes:
    """Each expert's tokens as one span of a packed [tokens * top_k, width] matrix (see moe_pack.comp for the maps).
    ``spans`` float32 [experts, 2] (start, count) goes to F.grouped_matmul."""

    spans: Tensor
    token_of_row: Tensor
    pair_of_row: Tensor
    row_of_pair: Tensor
    flat_of_row: Tensor
    row_of_flat: Tensor

    @classmethod
    def of(cls, weights, top_k: int) -> "PackedRoutes":
        """For routing weights [tokens, experts] with at most ``top_k`` nonzeros per row (a top-k choice's)."""
        tokens, experts = weights.shape
        if experts > PACK_MAX_EXPERTS:
            raise ValueError(f"PackedRoutes: at most {PACK_MAX_EXPERTS} experts, got {experts}")
        if tokens * top_k > 2**24:  # spans are float32 (the matmul gates): exact row numbers up to 2^24
            raise ValueError(f"PackedRoutes: {tokens} tokens x top {top_k} exceed 2^24 packed rows; split the batch")
        lists = ExpertRoutes.of(weights)
        rows = tokens * top_k
        w = weights.detach().float()
        outs = node(PackRoutesKernel(top_k=int(top_k)), [w.lazy, lists.routes.lazy, lists.counts.lazy],
                    [((experts, 2), dt.float32), ((rows,), dt.int32), ((rows,), dt.int32), ((top_k, tokens), dt.int32),
                     ((rows,), dt.int32), ((tokens, experts), dt.int32)])
        return cls(*(wrap(o) for o in outs))

    @property
    def tokens(self) -> int:
        return self.row_of_pair.shape[1]

    def gather(self, x):
        """x [tokens, width] -> [tokens * top_k, width]: each packed row its token's row (zeros past the packed
        ones). The gradient sums each token's top_k rows."""
        return gather_rows(x, self.token_of_row, self.row_of_pair)

    def gather_weights(self, weights):
        """weights [tokens, experts] -> [tokens * top_k, 1]: each packed row's routing weight."""
        return gather_rows(weights.reshape(-1, 1), self.flat_of_row, self.row_of_flat.reshape(-1))

    def combine(self, y):
        """y [tokens * top_k, width] -> [tokens, width]: the sum of each token's rows."""
        per_choice = gather_rows(y, self.row_of_pair, self.pair_of_row)  # [top_k, tokens, width]
        return per_choice.sum(0)

    def weighted_sum(self, x, weights, experts, scale_inputs: bool = False):
        """sum over e of weights[:, e] * expert_e(x) for x [tokens, width]: ``experts(rows, spans)`` runs every
        expert on its span of the packed rows; ``scale_inputs``: the weights scale each expert's input instead
        of its output."""
        rows = self.gather(x)  # rows past the packed ones are zeros
        scale = self.gather_weights(weights)
        y = experts(rows * scale if scale_inputs else rows, self.spans)
        return self.combine(y if scale_inputs else y * scale)
