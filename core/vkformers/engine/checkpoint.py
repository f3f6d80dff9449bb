"""Gradient checkpointing: keep a block's inputs for the backward pass, recompute the block there.

``checkpoint(fn, *inputs)`` runs ``fn`` (a layer) as usual but lets go of everything the layer's operations saved
for their backward; only the inputs stay. The returned tensors carry one :class:`Checkpoint` function whose
backward runs ``fn`` again on the saved inputs, with gradients recorded, and differentiates that graph.
``checkpoint_sum(fn, pieces)`` does so for the sum of ``fn`` over pieces, one piece at a time in the backward
(a loss over chunks of tokens: models/lm_loss.py).

Why the gradients are bit-identical to an ordinary backward:

- both forwards run with gradients recorded and the same ``requires_grad`` flags on the inputs, so every op
  picks the same kernel and configuration (the fused decode kernels, for one, are chosen only without them);
- dropout calls in the recomputation reuse the seed tensors the first forward drew (ops/nn.py's seed tapes):
  the same masks, and the dropout generator does not move;
- the layer's internal gradients flow through the same backward functions; only the sums into the layer's
  input and weights are formed inside the block (two-term sums are the same in any order).

A block may read tensors computed outside it that need gradients (they become parents of the Checkpoint and
the recomputation's backward stops at them). If several blocks read one such tensor (an encoder output every
decoder layer attends to, a bias shared by all layers), its gradient is summed block by block rather than in
the ordinary backward's order, which can change its last bits: the encoder-decoder models therefore do not
offer checkpointing (Module.supports_gradient_checkpointing).

Memory: the first forward's internals are read only by the next op of that forward, so the memory planner
(lazy._record) recycles them at once. The recomputation's nodes wait for the gradient of the block's output
(lazy.scheduled_after): they run just before that block's backward, not with the forward, and one block's
activations are alive at a time.
"""
from __future__ import annotations

from vkformers.engine.function import Function, enable_grad, function_serial, grad_enabled, no_grad
from vkformers.engine.lazy import scheduled_after
from vkformers.engine.ops.nn import recording_dropout_seeds, replaying_dropout_seeds
from vkformers.engine.tensor import Tensor, backpropagate


class Checkpoint(Function):
    """The outputs of a block whose backward recomputes it. Parents: the block's tensor inputs, then every
    tensor requiring grad that the block reads besides them (its weights), found in the first forward's graph."""

    def forward(self, *lazies, block, input_count, outputs, seeds):
        self.block, self.input_count, self.seeds = block, input_count, seeds
        self.input_flags = tuple(p.requires_grad for p in self.parents[:input_count])
        self.saved = tuple(lazies[:input_count])  # held: the planner keeps them for the backward
        return tuple(outputs)

    def backward(self, *grads):
        waits = [g.lazy for g in grads if g is not None and g.lazy.base.node is not None]
        with enable_grad(), scheduled_after(waits), replaying_dropout_seeds(self.seeds):
            inputs = [Tensor._from_lazy(lb, requires_grad=flag) for lb, flag in zip(self.saved, self.input_flags)]
            outs = _as_tuple(self.block(*inputs))
            roots = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            sink: dict = {}
            conditions: dict = {}
            if roots:
                backpropagate(roots, sink, boundary=self.parents[self.input_count:], conditions=conditions)
        weights = self.parents[self.input_count:]
        self.gradient_conditions = list(conditions.values())  # handed to the outer pass, as GradientUse's
        _weight_grads_first([sink.get(id(t)) for t in inputs], [sink[id(w)] for w in weights if id(w) in sink], waits)
        return tuple(sink.get(id(t)) if needs else None for t, needs in zip(inputs + list(weights), self.needs_grad))

    def release(self) -> None:
        super().release()
        self.block, self.seeds = None, ()


def checkpoint(block, *inputs: Tensor):
    """``block(*inputs)`` whose internals are recomputed in the backward pass instead of kept.

    ``block`` takes and returns tensors (one or a tuple); anything else it needs it holds itself (a closure over
    the layer and its context). It must compute the same graph when called again: no host reads of its own
    results and no state it changes. Without gradient recording this is just ``block(*inputs)``."""
    if not grad_enabled():
        return block(*inputs)
    detached = [Tensor._from_lazy(x.lazy, requires_grad=x.requires_grad) for x in inputs]
    start = function_serial()
    with recording_dropout_seeds() as seeds:
        out = block(*detached)
    outs = _as_tuple(out)
    functions, weights = _graph_between(outs, detached, start)
    for f in functions:  # nothing of the block's internals is kept for the backward
        f.release()
    if not weights and not any(x.requires_grad for x in detached):
        return out
    results = Checkpoint.apply(*inputs, *weights, block=block, input_count=len(inputs),
                               outputs=[o.lazy for o in outs], seeds=seeds)
    return results if isinstance(out, (tuple, list)) else results[0]


class CheckpointedSum(Function):
    """The sum of a block over pieces (:func:`checkpoint_sum`). Parents: every piece's inputs, then the tensors
    requiring grad that the block reads besides them (its weights)."""

    def forward(self, *lazies, block, arity, total, seeds):
        self.block, self.arity, self.seeds = block, arity, seeds
        self.input_count = arity * len(seeds)
        self.input_flags = tuple(p.requires_grad for p in self.parents[:self.input_count])
        self.saved = tuple(lazies[:self.input_count])  # held: the planner keeps them for the backward
        return total

    def backward(self, g):
        weights = self.parents[self.input_count:]
        waits = [g.lazy] if g.lazy.base.node is not None else []
        input_grads, sums, conditions = [], {}, {}
        for i, seeds in enumerate(self.seeds):
            at = slice(i * self.arity, (i + 1) * self.arity)
            with enable_grad(), scheduled_after(waits), replaying_dropout_seeds(seeds):
                inputs = [Tensor._from_lazy(lb, requires_grad=flag)
                          for lb, flag in zip(self.saved[at], self.input_flags[at])]
                out = self.block(*inputs)
                sink: dict = {}
                if out.requires_grad:
                    backpropagate([(out, g)], sink, boundary=weights, conditions=conditions)
            # added up piece after piece in float32 (16-bit gradients would round at every piece), each sum
            # written over the one before
            for w in weights:
                d = sink.get(id(w))
                if d is not None:
                    sums[id(w)] = d.float().contiguous() if id(w) not in sums else sums[id(w)] + d.float()
            input_grads += [sink.get(id(t)) for t in inputs]
            # the next piece is recomputed only once this one's gradients are formed: one piece alive at a time
            waits = [t.lazy for t in (g, *input_grads[at], *sums.values())
                     if t is not None and t.lazy.base.node is not None]
        self.gradient_conditions = list(conditions.values())
        grads = (*input_grads, *(sums[id(w)].cast(w.dtype) if id(w) in sums else None for w in weights))
        return tuple(d if needs else None for d, needs in zip(grads, self.needs_grad))

    def release(self) -> None:
        super().release()
        self.block, self.seeds = None, ()


def checkpoint_sum(block, pieces) -> Tensor:
    """``block(*pieces[0]) + block(*pieces[1]) + ...`` (each piece a tuple of tensors, the results of one shape),
    each piece's internals recomputed in the backward pass instead of kept, one piece at a time: piece i + 1's
    backward (its recomputation first) is scheduled after piece i's gradients, and the weights' gradients are
    added up as the pieces go. Checkpointing each piece on its own (:func:`checkpoint`) would leave their order to
    the scheduler, which may recompute every piece, or form every piece's weight gradient, before adding any up.
    ``block`` as :func:`checkpoint`'s."""
    pieces = [tuple(p) for p in pieces]
    if not grad_enabled():
        outs = [block(*p) for p in pieces]
    else:
        detached = [[Tensor._from_lazy(x.lazy, requires_grad=x.requires_grad) for x in p] for p in pieces]
        start = function_serial()
        outs, seeds = [], []
        for inputs in detached:
            with recording_dropout_seeds() as drawn:
                outs.append(block(*inputs))
            seeds.append(drawn)
        functions, weights = _graph_between(outs, [x for p in detached for x in p], start)
        for f in functions:
            f.release()
    with no_grad():
        total = outs[0]
        for out in outs[1:]:
            total = total + out
    if not grad_enabled() or (not weights and not any(x.requires_grad for p in pieces for x in p)):
        return total
    return CheckpointedSum.apply(*(x for p in pieces for x in p), *weights, block=block, arity=len(pieces[0]),
                                 total=total.lazy, seeds=seeds)


def _weight_grads_first(input_grads, weight_grads, waits) -> None:
    """Schedule the block's weight gradients before the gradients of its inputs. Only an optimizer step reads
    the weight gradients, so the scheduler would otherwise put their products last, keeping every block's
    recomputed activations alive to the end; the block below recomputes after its input gradient, so this way
    one block's activations are freed before the next block's exist. Only nodes of this recomputation (those
    scheduled after ``waits``) get the extra order: an input gradient that is the output gradient passed
    through belongs to the block above."""
    if not waits:
        return
    for g in input_grads:
        producer = g.lazy.base.node if g is not None else None
        if producer is None or not all(any(w is x for x in producer.waits_for) for w in waits):
            continue
        first = tuple(w.lazy for w in weight_grads if w.lazy.base.node not in (None, producer))
        producer.waits_for = producer.waits_for + first


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _graph_between(outs, inputs, start: int):
    """The block's own functions (created after serial ``start``) from ``outs`` back to ``inputs``, and the
    other tensors requiring grad they read (weights, and results computed before the block, such as an
    encoder's output a decoder layer attends to), each once, in the order a depth-first walk meets them."""
    stop = {id(x) for x in inputs}
    functions, weights, seen = [], [], set()
    stack = [o._ctx for o in outs if o._ctx is not None and o._ctx.serial >= start]
    while stack:
        f = stack.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        functions.append(f)
        for p in f.parents:
            if p is None or id(p) in stop or id(p) in seen or not p.requires_grad:
                continue
            if p._ctx is not None and p._ctx.serial >= start:
                stack.append(p._ctx)
            else:
                seen.add(id(p))
                weights.append(p)
    return functions, weights
