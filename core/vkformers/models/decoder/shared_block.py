"""A shared transformer block (Zamba, Zamba2): one set of attention and MLP weights that several layers run.

    out = mlp(norm'(attention(norm([stream | token embeddings]))))      no residual inside

The block is a :class:`DecoderLayer` whose attention reads the concatenation of the residual stream and the
token embeddings (``AttentionSpec.in_width``, ``Context.embeddings``); each layer that runs it holds its own
instance under its own path, and ``DecoderSpec.shared_modules`` ties every instance's parameters to the first
one's, so the checkpoint holds them once and their gradients sum over the uses. Zamba2 adds low-rank adapters
per use, ``up(down(h))`` added to the q, k, v projections and to the fused gate_up projection; they are stored in
the owner's lists (``linear_q_adapter_list.<use>``, ``gate_up_proj_adapter_list.<use>``), one entry per use of
that block, so each instance builds the entries of every use of its block and runs its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from vkformers.engine import functional as F
from vkformers.models.decoder.layer import Context, DecoderLayer
from vkformers.models.layers import Linear
from vkformers.models.module import Module, join_path, place


@dataclass(frozen=True)
class SharedAdapters:
    """Per-use low-rank adapters of a shared block: ``rank``, and the uses (the ordinals among the layers that run
    the block's weights) whose entries the block's lists hold; the entries of other uses are identities."""

    rank: int
    uses: tuple[int, ...]
    attention: bool = True       # q, k, v adapters (linear_{q,k,v}_adapter_list)
    mlp: bool = True             # gate_up adapter (gate_up_proj_adapter_list)


class LowRank(Module):
    """up(down(x)), saved as torch's Sequential: ``0`` the down projection, ``1`` the up projection."""

    def __init__(self, width_in: int, rank: int, width_out: int):
        super().__init__()
        object.__setattr__(self, "steps", (self.add("0", Linear(width_in, rank, bias=False)),
                                           self.add("1", Linear(rank, width_out, bias=False))))

    def forward(self, x):
        down, up = self.steps
        return up(down(x))


class _Adapted(Module):
    """A projection plus its adapter, both reading the same input (the parameters stay where they were placed)."""

    def __init__(self, projection, adapter):
        super().__init__()
        object.__setattr__(self, "refs", (projection, adapter))

    def forward(self, x):
        projection, adapter = self.refs
        return projection(x) + adapter(x)


class SharedTransformerBlock(DecoderLayer):
    """The block at one use: ``use`` its ordinal among the layers that run shared blocks, ``adapters`` its
    :class:`SharedAdapters` (None: none). The spec's attention has ``in_width`` = 2 x hidden; its norms are
    ``attn_in_norm`` (over the concatenation) and ``mlp_in_norm``; the MLP is the kit's."""

    def __init__(self, spec, index: int, use: int = 0, adapters: SharedAdapters | None = None):
        super().__init__(spec, index)
        if adapters is None:
            return
        if use not in adapters.uses:
            raise ValueError(f"shared block: use {use} is not one of its adapters' uses {adapters.uses}")
        a, m = spec.attention, spec.mlp
        width_in = a.in_width or spec.hidden_size
        targets = []
        if adapters.attention:
            widths = {"q": spec.num_heads * spec.head_dim, "k": spec.num_kv_heads * spec.head_dim,
                      "v": spec.num_kv_heads * spec.head_dim}
            targets += [(role, join_path(a.path, f"linear_{role}_adapter_list"), width_in, widths[role])
                        for role in ("q", "k", "v")]
        if adapters.mlp:
            if "gate_up" not in self.parts:
                raise ValueError("shared block: MLP adapters need the fused gate_up projection (MLPSpec.gate_up_proj)")
            targets.append(("gate_up", join_path(m.path, "gate_up_proj_adapter_list"), spec.hidden_size,
                            2 * spec.intermediate_size))
        for role, path, width, out in targets:
            entries = {u: place(self, join_path(path, str(u)), LowRank(width, adapters.rank, out))
                       for u in adapters.uses}
            self.parts[role] = _Adapted(self.parts[role], entries[use])

    def forward(self, x, ctx: Context):
        h = self.parts["attn_in_norm"](F.cat([x, ctx.embeddings.cast(x.dtype)], -1))
        return self.mlp(self.parts["mlp_in_norm"](self.attention(h, ctx)))

    def _fused_decode_plan(self):
        return None  # adapters and the wide input are not what the fused decode kernels compose
