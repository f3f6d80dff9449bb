"""The lazy graph and its realization: schedule, plan memory, record once, replay.

Tensor operations build a graph of :class:`Node`s (one kernel op each) whose
outputs are :class:`LazyBuffer`s. Nothing runs until something needs data
(``.numpy()``, ``.item()``, :func:`realize`). Then every pending node is
scheduled into one recorded :class:`~vkformers.runtime.vulkan.Sequence`.

The recorded plan is cached by the graph's *signature* (ops, attributes, shapes,
dtypes, which persistent buffers it reads and writes). A training loop builds
the same graph each step, so from the second step on realization is: copy the
new inputs into the plan's input buffers, one submit, read the results.
"""
from __future__ import annotations

import bisect
import functools
import gc
import itertools
import math
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, NamedTuple

import numpy as np

from vkformers.engine.kernels import Operand
from vkformers.errors import VkformersError
from vkformers.runtime import dtypes as dt
from vkformers.runtime.settings import bytes_setting, count_setting
from vkformers.runtime.vulkan import Buffer, Device, allocated_bytes, buffer_serial_mark, get_device


# ---------------------------------------------------------------- views

@functools.lru_cache(maxsize=4096)  # graph building asks for the same few shapes thousands of times
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class View(NamedTuple):
    """Where a tensor's elements lie in its base storage: shape, strides (elements) and offset. A named tuple: graph
    building makes thousands per forward, and plan signatures hash and compare them at C speed."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @staticmethod
    def dense(shape) -> "View":
        shape = tuple(map(int, shape))
        return View(shape, contiguous_strides(shape), 0)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def span(self) -> int:
        """Elements from the first to the last one the view covers (what must travel to read it)."""
        return sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + 1

    @property
    def is_contiguous(self) -> bool:
        dense = contiguous_strides(self.shape)
        return self.strides == dense or all(s == c for s, c, n in zip(self.strides, dense, self.shape) if n != 1)

    def reshape(self, shape) -> "View | None":
        """The same elements under a new shape, or None when that needs a copy."""
        if self.is_contiguous:
            return View(tuple(shape), contiguous_strides(tuple(shape)), self.offset)
        return None

    def permute(self, order) -> "View":
        return View(tuple(self.shape[i] for i in order), tuple(self.strides[i] for i in order), self.offset)

    def slice(self, dim: int, start: int, stop: int, step: int = 1) -> "View":
        shape, strides = list(self.shape), list(self.strides)
        shape[dim] = max(0, -(-(stop - start) // step))
        strides[dim] = self.strides[dim] * step
        return View(tuple(shape), tuple(strides), self.offset + start * self.strides[dim])

    def expand(self, shape) -> "View":
        """Broadcast to ``shape`` (numpy rules): new leading dims and size-1 dims get stride 0."""
        shape = tuple(shape)
        pad = len(shape) - len(self.shape)
        old_shape, old_strides = (1,) * pad + self.shape, (0,) * pad + self.strides
        strides = tuple(0 if o == 1 and n != 1 else s for o, s, n in zip(old_shape, old_strides, shape))
        return View(shape, strides, self.offset)


# ---------------------------------------------------------------- graph

class LazyBuffer:
    """One tensor's data: produced by a node (lazy) or held in a device buffer (realized)."""

    __slots__ = ("shape", "dtype", "device", "node", "index", "_base", "view", "buffer", "host", "persistent",
                 "refs", "replaces", "consumers", "__weakref__")

    def __init__(self, shape, dtype, device: Device, *, node=None, index=0, base=None, view=None,
                 buffer: Buffer | None = None, host: np.ndarray | None = None, persistent=False):
        self.shape = shape = tuple(map(int, shape))
        self.dtype = dt.as_dtype(dtype)
        self.device = device
        self.node = node            # producer, None once realized or for leaves
        self.index = index          # which output of the producer
        # owner of the storage (views point to it); None on a base itself, which a reference to itself would make
        # cyclic garbage: every graph would wait for the garbage collector (~7 ms per decode step of 22 layers)
        self._base = None if base is None or base is self else base
        self.view = view if view is not None else View(shape, contiguous_strides(shape), 0)
        self.buffer = buffer        # device storage, on bases only
        self.host = host            # data waiting to be uploaded (input leaves)
        self.persistent = persistent  # parameters and optimizer state keep their own buffer
        self.refs = 0               # live Tensors (and saved-for-backward uses) of this storage, on bases
        self.replaces = None        # for assignments: the previous version of the same storage
        # weak references to the nodes reading this storage while it is a node's unrealized output (kept on bases
        # only; realize() asks whether a node outside its schedule will read it). A list: a WeakSet per tensor
        # cost more to build and free than the rest of the tensor.
        self.consumers = None

    @property
    def base(self) -> "LazyBuffer":
        base = self._base
        return self if base is None else base

    @property
    def realized(self) -> bool:
        base = self.base
        return base.node is None and (base.buffer is not None or base.host is not None)

    def operand(self) -> Operand:
        return Operand(self.base.buffer, self.view.offset)

    def make_view(self, view: View) -> "LazyBuffer":
        return LazyBuffer(view.shape, self.dtype, self.device, base=self.base, view=view)

    def __repr__(self) -> str:
        state = "realized" if self.realized else f"lazy {self.base.node.op.name if self.base.node else '?'}"
        return f"<LazyBuffer {self.shape} {self.dtype.name} {state}>"


@dataclass(frozen=True)
class Arg:
    """An op's view of one input or output at emit time."""

    operand: Operand
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: dt.DType

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Node:
    """One op applied to inputs, producing ``len(outputs)`` lazy buffers."""

    __slots__ = ("op", "inputs", "outputs", "after", "waits_for", "__weakref__")

    def __init__(self, op, inputs: tuple[LazyBuffer, ...]):
        self.op = op
        self.inputs = inputs
        self.outputs: list[LazyBuffer] = []
        self.after: list[Node] = []  # extra ordering (an assignment waits for the readers of the old value)
        # buffers this node reads nothing of but is scheduled after (see :func:`scheduled_after`)
        self.waits_for: tuple[LazyBuffer, ...] = _waits[-1] if _waits else ()


_pending_assignments: list[LazyBuffer] = []
_waits: list[tuple] = []


@contextmanager
def scheduled_after(buffers: Iterable[LazyBuffer]):
    """Nodes created inside are scheduled after the nodes producing ``buffers``, though they do not read them.

    A recomputation in the backward pass (engine/checkpoint.py) reads only the saved layer input and the
    weights: without this it could be scheduled as early as the forward, and its activations would then
    stay alive through the whole backward, which is what recomputing them is meant to avoid."""
    pending = tuple(b for b in buffers if b is not None and b.base.node is not None)
    _waits.append((_waits[-1] if _waits else ()) + pending)
    try:
        yield
    finally:
        _waits.pop()


def persistent_buffer(host: np.ndarray, dtype: dt.DType, device: Device, name: str) -> LazyBuffer:
    """A lazy buffer over device storage of its own, written now from ``host`` (already in ``dtype``'s host
    layout): a parameter, optimizer state or packed quantized weight, updated in place afterwards."""
    buf = Buffer(device, host.shape, dtype, name=name)
    buf.write(host)
    return LazyBuffer(host.shape, dtype, device, buffer=buf, persistent=True)


def persistent_zeros(shape, dtype: dt.DType, device: Device, name: str) -> LazyBuffer:
    """persistent_buffer of zeros, filled on the device (no host copy: a KV block pool may take most of it)."""
    buf = Buffer(device, shape, dtype, name=name)
    device.run(lambda seq: seq.fill(buf))
    return LazyBuffer(tuple(shape), dtype, device, buffer=buf, persistent=True)


def create_node(op, inputs: Iterable[LazyBuffer], out_specs, device: Device, *, into=None):
    """Add a node to the graph; returns its output lazy buffers.

    ``into``: a persistent lazy buffer (or one per output, None for ordinary outputs) whose storage the
    output overwrites: an in-place update (assignments, optimizer steps, cache writes).
    """
    node = Node(op, tuple(inputs))
    reader = None
    for x in node.inputs:
        base = x._base or x
        if base.node is not None:  # an unrealized output: the only storage whose readers realize() asks about
            if reader is None:
                reader = weakref.ref(node)
            if base.consumers is None:
                base.consumers = [reader]
            else:
                base.consumers.append(reader)
    if into is None:  # the common case, kept short: graph building runs this for every node
        node.outputs = [LazyBuffer(shape, dtype, device, node=node, index=index)
                        for index, (shape, dtype) in enumerate(out_specs)]
        return node.outputs
    targets = into if isinstance(into, (list, tuple)) else [into] * len(out_specs)
    for index, ((shape, dtype), target) in enumerate(zip(out_specs, targets)):
        out = LazyBuffer(shape, dtype, device, node=node, index=index)
        if target is not None:
            out.buffer, out.persistent, out.replaces = target.base.buffer, True, target
            _pending_assignments.append(out)
        node.outputs.append(out)
    return node.outputs


# ---------------------------------------------------------------- building graphs

_gc_paused = False
_backward_deferrals = 0


@contextmanager
def deferred_backward():
    """Inside, ``Tensor.backward()`` leaves the gradients lazy, to be realized with what follows them (a
    trainer's clipping and update) in one submission. Outside it, and outside a :class:`capture`, backward()
    computes them before it returns, as PyTorch's does."""
    global _backward_deferrals
    _backward_deferrals += 1
    try:
        yield
    finally:
        _backward_deferrals -= 1


def capturing() -> bool:
    """Whether a :class:`capture` records the realizations now (a captured step must realize in one submission)."""
    return bool(_recorders)


def backward_deferred() -> bool:
    """Whether gradients stay lazy after backward(): inside :func:`deferred_backward` or a :class:`capture`
    (a captured step must realize in one submission)."""
    return _backward_deferrals > 0 or capturing()


@contextmanager
def building_graph():
    """Pause Python's cyclic garbage collector while a graph is built (a model's forward, a backward,
    an optimizer step) until the next realization has cut it. Building allocates thousands of small
    objects, and collections walking them took more than half the building time of a 22-layer step;
    once realize() has released the graph, refcounting frees almost all of them and the collector,
    switched back on there, finds little left to walk."""
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True
    try:
        yield
    except BaseException:  # no realization will follow
        _resume_gc()
        raise


def _resume_gc() -> None:
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.enable()


# ---------------------------------------------------------------- realization

class Plan:
    """A recorded sequence with the buffers it binds, reusable for graphs of the same signature."""

    def __init__(self, seq, node_buffers, input_buffers, output_slots, nbytes: int = 0):
        self.seq = seq
        self.node_buffers = node_buffers    # per scheduled node: its output buffers (None for views)
        self.input_buffers = input_buffers  # host-visible buffers of input leaves, in leaf order
        self.output_slots = output_slots    # (node index, output index) whose buffers user tensors keep
        self.bound: list = []               # weakrefs to lazy buffers bound by the last replay
        self.replays = 0
        self.nbytes = nbytes                # bytes of the buffers the plan made for itself (not parameters)
        self.key = None                     # its signature in the plan cache
        self.holders = weakref.WeakSet()    # captures replaying it: the cache keeps it while one lives
        self.memory: dict = {"nbytes": nbytes}  # what its buffers hold (see memory_report)
        # a weak reference to the capture whose values its input buffers hold (None: a realization's): graphs of
        # one signature share the plan, so another capture or realization of it may have written its own there
        self.inputs_owner = None

    def hold(self, holder) -> None:
        """``holder`` (a capture) replays this plan without the cache: the cache must not evict it meanwhile."""
        self.holders.add(holder)

    def release(self, holder) -> None:
        self.holders.discard(holder)


# The plan cache: recorded plans by graph signature, least recently used first. It keeps at most MAX_PLANS plans
# and MAX_PLAN_BYTES bytes of their own buffers (activations, inputs, workspaces), evicting the least recently used
# plan that no capture holds; the plan just used always stays. An evicted plan's buffers, descriptor sets and command
# buffer are freed as soon as nothing else holds them (tensors still holding its outputs keep those buffers).
MAX_PLANS = count_setting("VKFORMERS_PLAN_CACHE_PLANS", 64)
MAX_PLAN_BYTES = bytes_setting("VKFORMERS_PLAN_CACHE_BYTES", 2 << 30)
_plans: OrderedDict[_Signature, Plan] = OrderedDict()
_plan_bytes = 0  # sum of nbytes over _plans
stats = {"recorded": 0, "replayed": 0, "cleared": 0, "evicted": 0}


def plan_cache_info() -> dict:
    """The plan cache's size and bounds: plans, bytes (of their own buffers), max_plans, max_bytes."""
    return {"plans": len(_plans), "bytes": _plan_bytes, "max_plans": MAX_PLANS, "max_bytes": MAX_PLAN_BYTES}


def _cache_plan(key: _Signature, plan: Plan) -> None:
    global _plan_bytes
    plan.key = key
    _plans[key] = plan
    _plan_bytes += plan.nbytes
    _trim_plans(keep=plan)


def _touch_plan(plan: Plan) -> None:
    """Mark a cached plan as the most recently used."""
    if plan.key is not None and _plans.get(plan.key) is plan:
        _plans.move_to_end(plan.key)


def _trim_plans(keep: Plan | None = None) -> None:
    """Evict least recently used plans until the cache is within its bounds, sparing ``keep`` and held plans.
    An evicted plan submitted without waiting stays alive in the device's list of submits in flight until it ends."""
    global _plan_bytes
    for key in list(_plans):
        if len(_plans) <= MAX_PLANS and _plan_bytes <= MAX_PLAN_BYTES:
            return
        plan = _plans[key]
        if plan is keep or len(plan.holders):
            continue
        del _plans[key]
        _plan_bytes -= plan.nbytes
        stats["evicted"] += 1


def evict_plan(plan: Plan) -> None:
    """Drop ``plan`` from the plan cache now unless a capture holds it: a shape not expected again (a server's
    warm-up batch), whose buffers need not wait for the cache's bounds to push it out."""
    global _plan_bytes
    if plan.key is not None and _plans.get(plan.key) is plan and not len(plan.holders):
        del _plans[plan.key]
        _plan_bytes -= plan.nbytes
        stats["evicted"] += 1


def _schedule(targets: list[LazyBuffer]) -> list[Node]:
    """Unrealized nodes the targets need, dependencies first (assignments after their old value's readers).

    Both walks keep their own stacks: a deep graph (an 80-layer model's training step) would pass Python's
    recursion limit."""
    nodes: list[Node] = []
    seen: set[int] = set()
    for t in targets:  # depth first, each node after everything it waits for or reads
        root = t.base.node
        if root is None or id(root) in seen:
            continue
        seen.add(id(root))
        stack = [(root, itertools.chain(root.waits_for, root.inputs))]
        while stack:
            node, pending = stack[-1]
            for x in pending:
                child = x.base.node
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    stack.append((child, itertools.chain(child.waits_for, child.inputs)))
                    break
            else:
                stack.pop()
                nodes.append(node)
    replaced = {id(out.replaces.base) for node in nodes for out in node.outputs if out.replaces is not None}
    if not replaced:  # no assignment: the walk's order is the schedule
        return nodes
    readers: dict[int, list[Node]] = {}
    for node in nodes:
        for x in node.inputs:
            if id(x.base) in replaced:
                readers.setdefault(id(x.base), []).append(node)
    position = {id(node): i for i, node in enumerate(nodes)}
    in_order = True
    for i, node in enumerate(nodes):  # an assignment overwrites storage: every reader of each old value goes first
        node.after = [r for out in node.outputs if out.replaces is not None
                      for r in readers.get(id(out.replaces.base), []) if r is not node]
        in_order = in_order and all(position[id(r)] < i for r in node.after)
    if in_order:  # the walk already put them first (a decode step's cache writes): its order is the schedule
        return nodes

    def needs(node: Node):
        for x in (*node.waits_for, *node.inputs):
            if x.base.node is not None and id(x.base.node) in seen:
                yield x.base.node
        yield from node.after

    order, placed, visiting = [], set(), set()
    for root in nodes:
        if id(root) in placed:
            continue
        visiting.add(id(root))
        stack = [(root, needs(root))]
        while stack:
            node, pending = stack[-1]
            for other in pending:
                if id(other) in placed:
                    continue
                if id(other) in visiting:
                    raise RuntimeError("cycle in the tensor graph (an assignment reads its own result?)")
                visiting.add(id(other))
                stack.append((other, needs(other)))
                break
            else:
                stack.pop()
                placed.add(id(node))
                order.append(node)
    return order


def _read_later(lb: LazyBuffer, scheduled: set[int], wanted: dict[int, bool]) -> bool:
    """Whether a node outside ``scheduled`` that a later realization may run reads ``lb`` (a graph built on it)."""
    for ref in lb.consumers or ():
        node = ref()
        if node is not None and id(node) not in scheduled and _wanted(node, scheduled, wanted):
            return True
    return False


def _wanted(node: Node, scheduled: set[int], wanted: dict[int, bool]) -> bool:
    """Whether something can still ask for ``node``'s work: a live tensor (or a saved use) holds one of its outputs,
    or of a node reading them, and so on. The others are garbage that the collector has not freed yet (a node and
    its outputs refer to each other, and collection pauses while a graph is built): the dead end of a block
    recomputed for its gradients (gradient checkpointing), whose inputs then need no buffer of their own.
    ``wanted`` memoizes the answers of one realization."""
    if id(node) in wanted:
        return wanted[id(node)]
    seen, stack = {id(node)}, [node]
    while stack:
        n = stack.pop()
        for out in n.outputs:
            if out.refs > 0 or out.persistent:
                wanted[id(node)] = True
                return True
            for ref in out.consumers or ():
                reader = ref()
                if reader is None or id(reader) in scheduled or id(reader) in seen:
                    continue
                if wanted.get(id(reader)):
                    wanted[id(node)] = True
                    return True
                seen.add(id(reader))
                stack.append(reader)
    for n in seen:  # nothing reachable from them is wanted
        wanted[n] = False
    return False


class _Signature:
    """A graph's signature as a plan cache key, its hash computed once: a deep model's signature holds thousands of
    tuples, and a replayed step touches its plan in the cache every time (_touch_plan)."""
    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple):
        self.parts, self._hash = parts, hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _Signature) and self._hash == other._hash
                                 and self.parts == other.parts)


def _signature(order: list[Node], leaves: list[LazyBuffer], keep: set[int]) -> _Signature:
    index_of = {id(n): i for i, n in enumerate(order)}
    leaf_index = {id(lb): i for i, lb in enumerate(leaves)}
    parts = []
    for n in order:
        ins = []
        for x in n.inputs:
            base = x._base or x  # x.base without the property's call: thousands of inputs a realization
            producer = index_of.get(id(base.node)) if base.node is not None else None
            if producer is not None:
                src = ("n", producer, base.index)
            elif base.host is not None:
                src = ("in", leaf_index[id(base)], base.shape, base.dtype.name)
            else:
                src = ("buf", base.buffer.serial)
            ins.append((src, x.view, x.dtype.name))
        outs = tuple([(o.shape, o.dtype.name, o.buffer.serial if o.persistent else None, id(o) in keep)
                      for o in n.outputs])
        parts.append((n.op.key(), tuple(ins), outs))
    return _Signature(tuple(parts))


_before_assignments: list = []  # weak references: see computed_before_assignments


def computed_before_assignments(lb: LazyBuffer) -> None:
    """Leave ``lb`` (an unrealized result nothing else needs: the logits of a loss computed in chunks) uncomputed
    until it is read, unless a realization assigns to device storage (an optimizer step) while a tensor still
    holds it: it is then computed in that realization, before the assignment, from the values it was built on."""
    _before_assignments.append(weakref.ref(lb.base))


def realize(targets: Iterable[LazyBuffer], wait: bool = True) -> None:
    """Compute ``targets`` and every pending assignment, in one submit.

    ``wait=False``: return once submitted, so that the host builds the next part of a graph while the device runs
    this one (a long prompt's forward, realized every few layers). Later submits run after it, and results are read
    through a submit that waits, which waits for every earlier one too (Sequence.replay)."""
    targets = [t for t in targets if not t.realized]
    pending = [a for a in _pending_assignments if not a.realized]
    _pending_assignments.clear()
    if pending and _before_assignments:
        held = [lb for lb in (r() for r in _before_assignments) if lb is not None and lb.refs > 0 and not lb.realized]
        _before_assignments[:] = [weakref.ref(lb) for lb in held]
        targets += held
    if not targets and not pending:
        return
    order = _schedule(targets + pending)
    if not order:
        return
    device = order[0].outputs[0].device if order[0].outputs else get_device()

    leaves: list[LazyBuffer] = []
    seen_leaves: set[int] = set()
    for n in order:
        for x in n.inputs:
            if x.base.host is not None and id(x.base) not in seen_leaves:
                seen_leaves.add(id(x.base))
                leaves.append(x.base)
    # Outputs someone can still read get their own buffers; the rest may share by liveness.
    scheduled = {id(n) for n in order}
    wanted: dict[int, bool] = {}
    keep = {id(o) for n in order for o in n.outputs
            if o.refs > 0 or o.persistent or _read_later(o, scheduled, wanted)}
    keep |= {id(t.base) for t in targets}
    key = _signature(order, leaves, keep)
    plan = _plans.get(key)
    if plan is None:
        plan = _record(device, order, leaves, keep)
        stats["recorded"] += 1
        _cache_plan(key, plan)
    else:
        _plans.move_to_end(key)  # most recently used last
        _detach_previous_outputs(device, plan)
        stats["replayed"] += 1
    for recorder in _recorders:
        recorder.runs.append(Realization(plan, [leaf.host for leaf in leaves]))

    plan.seq.wait()  # its input buffers may still be read by its last submit
    for leaf, buf in zip(leaves, plan.input_buffers):
        buf.host[...] = leaf.host.reshape(buf.shape)
    plan.inputs_owner = None
    _run(plan, wait=wait)

    # Bind results, then cut the graph so its memory can go.
    for leaf, buf in zip(leaves, plan.input_buffers):
        leaf.host, leaf.buffer = None, buf
    plan.bound = [weakref.ref(leaf) for leaf in leaves]
    for n, buffers in zip(order, plan.node_buffers):
        for out, buf in zip(n.outputs, buffers):
            if buf is not None and id(out) in keep:
                out.buffer = buf
                if not out.persistent:
                    plan.bound.append(weakref.ref(out))
            out.node, out.replaces = None, None
        n.inputs, n.after, n.waits_for = (), [], ()
    _resume_gc()


def _detach_previous_outputs(device: Device, plan: Plan) -> None:
    """Tensors from this plan's last replay that are still alive get a copy before it runs again."""
    stale = [lb for lb in (r() for r in plan.bound) if lb is not None and lb.refs > 0]
    if not stale:
        return
    seq = device.sequence()
    for lb in stale:
        fresh = Buffer(device, lb.buffer.shape, lb.buffer.dtype, name=lb.buffer.name)
        seq.copy(lb.buffer, fresh)
        lb.buffer = fresh
    seq.replay()


def _record(device: Device, order: list[Node], leaves: list[LazyBuffer], keep: set[int]) -> Plan:
    mark = buffer_serial_mark()  # buffers made from here on are the plan's own
    seq = device.sequence(timestamps=bool(_profilers))
    input_buffers = []
    for leaf in leaves:
        buf = Buffer(device, leaf.shape, leaf.dtype, host_visible=True, name="input")
        seq.upload(buf)
        input_buffers.append(buf)
    leaf_buffer = {id(leaf): buf for leaf, buf in zip(leaves, input_buffers)}

    memory = MemoryPlan(order, keep) if MEMORY_PLANNER == "liveness" else None
    storage = memory.buffers(device) if memory else _exact_match_buffers(device, order, keep)
    node_buffers = []
    for n in order:
        node_buffers.append([out.buffer if out.buffer is not None else storage[id(out)] for out in n.outputs])

        def arg(lb: LazyBuffer) -> Arg:
            base = lb.base
            buf = storage.get(id(base)) or leaf_buffer.get(id(base)) or base.buffer
            return Arg(Operand(buf, lb.view.offset), lb.view.shape, lb.view.strides, lb.dtype)

        n.op.emit(seq, [arg(o) for o in n.outputs], [arg(x) for x in n.inputs])
    seq.record()
    output_slots = [(i, j) for i, n in enumerate(order) for j, o in enumerate(n.outputs) if id(o) in keep]
    own = [b for b in seq.buffers() if b.serial > mark]
    nbytes = sum(allocated_bytes(b.nbytes) for b in own)
    report = {"nbytes": nbytes, "inputs": sum(allocated_bytes(b.nbytes) for b in input_buffers)}
    if memory is not None:
        report.update(memory.report())
    report["other"] = nbytes - report["inputs"] - report.get("slots", 0) - report.get("outputs", 0)
    plan = Plan(seq, node_buffers, input_buffers, output_slots, nbytes)
    plan.memory = report
    return plan


# The memory planner: "liveness" shares buffers among the values of a plan that are never alive together, whatever
# their dtypes and sizes (MemoryPlan); "exact" only reuses a freed buffer of the same dtype and element count (the
# planner before it, kept to compare against).
MEMORY_PLANNER = "liveness"


def _exact_match_buffers(device: Device, order: list[Node], keep: set[int]) -> dict[int, Buffer]:
    last_use: dict[int, int] = {}
    for i, n in enumerate(order):
        for x in n.inputs:
            last_use[id(x.base)] = i
    free: dict[tuple, list[Buffer]] = {}
    storage: dict[int, Buffer] = {}
    for i, n in enumerate(order):
        for out in n.outputs:
            if out.buffer is None:
                pool = free.get((out.dtype.name, math.prod(out.shape)))
                storage[id(out)] = pool.pop() if pool and id(out) not in keep else Buffer(
                    device, out.shape, out.dtype, name=n.op.name)
        done = [x for x in {id(x.base): x.base for x in n.inputs}.values() if last_use.get(id(x)) == i]
        done += [o for o in n.outputs if id(o) not in last_use and o.buffer is None]
        for x in done:
            if id(x) in storage and id(x) not in keep:
                free.setdefault((x.dtype.name, math.prod(x.shape)), []).append(storage[id(x)])
    return storage


class MemoryPlan:
    """Where each intermediate value of a schedule lives: values that are never alive together share a slot (one
    allocation; a value of another dtype or a smaller size is an alias of it), so what is allocated follows the
    schedule's peak of live bytes rather than the sum of its distinct shapes.

    A value is alive from the node that writes it to the last node that reads it (views read their base). An op
    may let an output overwrite an input in place (``KernelOp.inplace``: pairs of output and input index) when
    that input is read by nothing after the node, covers its whole storage and has the output's dtype and size:
    the two are then one value. Slots are handed out largest value first, each value to the smallest slot free
    for its whole life (greedy by size); outputs someone keeps (``keep``) get buffers of their own."""

    def __init__(self, order: list[Node], keep: set[int]):
        last_use: dict[int, int] = {}
        for i, n in enumerate(order):
            for x in n.inputs:
                last_use[id(x.base)] = i
        self.values: dict[int, LazyBuffer] = {}   # id -> value (a node output the plan places)
        self.producer: dict[int, str] = {}
        self.kept: list[LazyBuffer] = []
        group: dict[int, int] = {}                # value -> its group (the value it was merged into)
        span: dict[int, list] = {}                # group -> [start, end, bytes]
        for i, n in enumerate(order):
            merged = self._in_place(n, i, last_use, group, keep)
            for j, out in enumerate(n.outputs):
                if out.buffer is not None:
                    continue
                if id(out) in keep:
                    self.kept.append(out)
                    continue
                self.values[id(out)], self.producer[id(out)] = out, n.op.name
                size = _value_bytes(out)
                end = last_use.get(id(out), i)
                g = merged.get(j)
                if g is None:
                    group[id(out)] = id(out)
                    span[id(out)] = [i, end, size]
                else:
                    group[id(out)] = g
                    span[g][1], span[g][2] = max(span[g][1], end), max(span[g][2], size)
        self.group, self.span = group, span
        self.steps = len(order)
        self.slot_of, self.slot_bytes = self._assign(span)

    @staticmethod
    def _in_place(n: Node, i: int, last_use, group, keep) -> dict[int, int]:
        """The outputs of ``n`` that may take an input's storage: output index -> that input's group."""
        merged: dict[int, int] = {}
        for j, k in getattr(n.op, "inplace", ()):
            out, x = n.outputs[j], n.inputs[k]
            base = x.base
            if (out.buffer is not None or id(out) in keep or id(base) not in group or last_use.get(id(base)) != i
                    or x.dtype != out.dtype or x.view.offset or not x.view.is_contiguous
                    or not math.prod(base.shape) == x.view.numel == math.prod(out.shape)
                    or any(y.base is base for m, y in enumerate(n.inputs) if m != k)
                    or group[id(base)] in merged.values()):
                continue
            merged[j] = group[id(base)]
        return merged

    @staticmethod
    def _assign(span: dict[int, list]) -> tuple[dict[int, int], list[int]]:
        slot_of: dict[int, int] = {}
        slot_bytes: list[int] = []
        slot_starts: list[list[int]] = []
        slot_ends: list[list[int]] = []
        by_size: list[int] = []  # slot indices, smallest capacity first
        for g, (start, end, size) in sorted(span.items(), key=lambda kv: (-kv[1][2], kv[1][0])):
            chosen = None
            for s in by_size:  # the smallest slot big enough and free from start to end
                if slot_bytes[s] < size:
                    continue
                starts, ends = slot_starts[s], slot_ends[s]
                at = bisect.bisect_right(starts, end)
                if at and ends[at - 1] >= start:
                    continue
                chosen = s
                break
            if chosen is None:
                chosen = len(slot_bytes)
                slot_bytes.append(size)
                slot_starts.append([])
                slot_ends.append([])
                bisect.insort(by_size, chosen, key=lambda s: slot_bytes[s])
            at = bisect.bisect_right(slot_starts[chosen], start)
            slot_starts[chosen].insert(at, start)
            slot_ends[chosen].insert(at, end)
            slot_of[g] = chosen
        return slot_of, slot_bytes

    def buffers(self, device: Device) -> dict[int, Buffer]:
        """A buffer per placed value and kept output: slots are allocated in the dtype and shape of their
        largest value, the others are aliases of them (one per dtype and size)."""
        roots: dict[int, Buffer] = {}
        views: dict[tuple, Buffer] = {}
        storage: dict[int, Buffer] = {}
        for vid, value in sorted(self.values.items(), key=lambda kv: -_value_bytes(kv[1])):
            slot = self.slot_of[self.group[vid]]
            key = (slot, value.dtype.name, math.prod(value.shape))  # one buffer for a value and its in-place result
            buf = views.get(key)
            if buf is None:
                root = roots.get(slot)
                if root is None:
                    buf = roots[slot] = Buffer(device, value.shape, value.dtype, name=self.producer[vid])
                else:
                    buf = root.alias(value.shape, value.dtype, name=self.producer[vid])
                views[key] = buf
            storage[vid] = buf
        for out in self.kept:
            storage[id(out)] = Buffer(device, out.shape, out.dtype, name=out.node.op.name)
        return storage

    def live_bytes(self) -> list[int]:
        """Bytes of the placed values alive at each step of the schedule (a lower bound of what slots take)."""
        delta = [0] * (self.steps + 1)
        for start, end, size in self.span.values():
            delta[start] += size
            delta[end + 1] -= size
        return list(itertools.accumulate(delta))[:-1]

    def report(self) -> dict:
        live = self.live_bytes() or [0]
        peak_step = max(range(len(live)), key=live.__getitem__)
        at_peak: dict[str, int] = {}
        largest = []
        for vid, value in self.values.items():
            start, end, size = self.span[self.group[vid]]
            if start <= peak_step <= end and self.group[vid] == vid:
                at_peak[self.producer[vid]] = at_peak.get(self.producer[vid], 0) + size
                largest.append((size, self.producer[vid], value.shape, value.dtype.name))
        largest = [(name, shape, dtype, size) for size, name, shape, dtype in sorted(largest, reverse=True)[:8]]
        return {"slots": sum(self.slot_bytes), "slot_count": len(self.slot_bytes), "values": len(self.values),
                "in_place": sum(1 for v, g in self.group.items() if v != g), "peak_live": max(live),
                "peak_step": peak_step, "steps": self.steps, "live_at_peak": at_peak, "largest_at_peak": largest,
                "outputs": sum(_value_bytes(o) for o in self.kept)}


def _value_bytes(lb: LazyBuffer) -> int:
    return allocated_bytes(math.prod(lb.shape) * lb.dtype.itemsize)


def memory_report(plan: Plan | None = None) -> dict:
    """What a recorded plan allocated for itself (default: the plan used last), in bytes: ``nbytes`` in all;
    ``inputs`` (host-visible input buffers), ``slots`` (intermediate values, shared by liveness), ``outputs``
    (results tensors keep), ``other`` (scratch and workspaces); ``peak_live`` (the most bytes of intermediate
    values alive at one step: what slots would take with no waste), ``live_at_peak`` (those bytes by the op that
    produced them), ``largest_at_peak`` (the largest of them: op, shape, dtype, bytes), ``slot_count``,
    ``values``, ``in_place`` (values written over an input). Under MEMORY_PLANNER "exact": nbytes, inputs and
    other (all the rest) only."""
    if plan is None:
        if not _plans:
            raise VkformersError("no plan recorded yet: run a step (realize something) first")
        plan = next(reversed(_plans.values()))
    return dict(plan.memory)


# ---------------------------------------------------------------- replaying a plan without its graph

@dataclass
class Realization:
    """One realization seen by :class:`capture`: the plan it ran and the host data of its input leaves,
    aligned with ``plan.input_buffers`` (the arrays themselves, as the leaves held them)."""

    plan: Plan
    inputs: list


_recorders: list = []


class capture:
    """Context manager listing the realizations that run inside it (``.runs``, :class:`Realization`).

    A caller that builds the same graph step after step (a decode step) can learn from it which plan
    its step ran and which input buffer received which of its arrays, then skip building the graph:
    write the next step's values into ``plan.input_buffers[i].host`` and :func:`replay` the plan.
    """

    def __enter__(self) -> "capture":
        self.runs: list[Realization] = []
        _recorders.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _recorders.remove(self)


def restore_constants(plan: Plan, owner, constant: list, constants: list) -> None:
    """Before ``owner`` (a capture) replays ``plan``: the values it observed in the inputs it replays as they are
    (``constant[i]``: whether input buffer i is one; ``constants``: their arrays in order) back into their
    buffers, where a realization or another capture of the same plan wrote its own since ``owner``'s last replay
    (prefill chunks of one shape and different padding share a plan and differ in such inputs)."""
    plan.seq.wait()  # the caller writes the plan's input buffers next
    if plan.inputs_owner is not None and plan.inputs_owner() is owner:
        return
    values = iter(constants)
    for is_constant, buf in zip(constant, plan.input_buffers):
        if is_constant:
            buf.host[...] = np.asarray(next(values)).reshape(buf.shape)
    plan.inputs_owner = weakref.ref(owner)  # weak: the plan must not keep the capture (which holds it) alive


def replay(plan: Plan, seq=None) -> None:
    """Run ``plan`` again on what its input buffers' host mirrors hold now (see :class:`capture`).

    Outputs live tensors still hold from its previous replay are copied away first, as in realize().
    ``seq``: run that sequence instead, one built from the plan's operations (``Sequence.extend``)."""
    _detach_previous_outputs(plan.seq.device, plan)
    _touch_plan(plan)
    _run(plan, seq)
    stats["replayed"] += 1


def _run(plan: Plan, seq=None, wait: bool = True) -> None:
    """Submit the plan's sequence (or ``seq``, built from its operations) and wait (unless not ``wait``); profilers
    get its timings (a profiled run always waits)."""
    seq = seq or plan.seq
    if wait or (_profilers and seq.timestamps):
        seq.replay()
    else:
        seq.submit()
    plan.replays += 1
    if _profilers and seq.timestamps:
        timings = seq.timings()
        for p in _profilers:
            p.add(timings)


# ---------------------------------------------------------------- replaying whole steps

_declarations: list = []  # per StepCapture observing a step: its inputs declared generated or derived


def generated_input(array: np.ndarray, regenerate) -> np.ndarray:
    """Declare ``array``, about to become a graph input as it is, as drawn once per step:
    ``regenerate()`` draws the next step's value and advances whatever state drawing it advances
    (optimizer step counters, a dropout generator). A :class:`StepCapture` replaying a step calls
    these in the order the step declared them instead of building the graph."""
    for declared in _declarations:
        declared.append(("generated", array, regenerate))
    return array


def derived_input(array: np.ndarray, source: np.ndarray, derive) -> np.ndarray:
    """Declare ``array``, about to become a graph input as it is, as ``derive(source)`` where ``source``
    is one of a :class:`StepCapture` step's named inputs (e.g. labels shifted by one token)."""
    for declared in _declarations:
        declared.append(("derived", array, (source, derive)))
    return array


@dataclass
class _Observed:
    plan: Plan
    roles: tuple       # per plan input buffer: ("input", name) | ("generated", i) | ("derived", i) | ("constant",)
    constants: list    # host arrays of the constant inputs
    declared: list     # (kind, array, how) as the step declared them
    sources: list      # per declared input: the named input a derived one comes from (else None)
    outputs: list      # (buffer, view, dtype) of the tensors the step returned
    shapes: dict       # shapes of the named inputs


class StepCapture:
    """Runs a step that builds the same graph every time (a training step, a fixed-shape forward)
    and, once two consecutive steps ran one identical plan, replays that plan without building it.

    ``run(build, inputs)``: ``inputs`` maps names to the numpy arrays ``build()`` turns into graph
    inputs as they are (``tensor(array)`` of a matching dtype keeps the array); ``build()`` returns the
    tensors to read and must realize in one submission. Every other input of the plan must be declared
    (:func:`generated_input`, :func:`derived_input`) or hold the same values in both observed steps; when
    that is not so the step is simply never replayed. Returns the tensors' values as numpy arrays.
    """

    def __init__(self):
        self.forget()

    def forget(self) -> None:
        if getattr(self, "previous", None) is not None:
            self.previous.plan.release(self)
        self.previous: _Observed | None = None
        self.ready = False
        self.readback = None

    def run(self, build, inputs: dict) -> list:
        if self.ready and all(self.previous.shapes[k] == np.shape(v) for k, v in inputs.items()):
            return self._replay(inputs)
        declared: list = []
        _declarations.append(declared)
        try:
            with capture() as seen:
                outs = build()
                realize([t.lazy for t in outs])
        finally:
            _declarations.remove(declared)
        current = self._observe(seen.runs, inputs, declared, outs)
        values = [t.numpy() for t in outs]
        previous, self.previous, self.readback = self.previous, current, None
        self.ready = current is not None and previous is not None and _same_step(previous, current)
        if previous is not None:
            previous.plan.release(self)
        if self.ready:  # replayed from now on without the cache: it must stay
            current.plan.hold(self)
        return values

    def _observe(self, runs, inputs, declared, outs) -> _Observed | None:
        if len(runs) != 1:  # several submissions (or none): no single plan to replay
            return None
        run = runs[0]
        named = {id(a): name for name, a in inputs.items()}
        declared_index = {id(a): i for i, (_, a, _) in enumerate(declared)}
        roles = []
        for a in run.inputs:
            if id(a) in named:
                roles.append(("input", named[id(a)]))
            elif id(a) in declared_index:
                i = declared_index[id(a)]
                roles.append((declared[i][0], i))
            else:
                roles.append(("constant",))
        sources = [named.get(id(how[0])) if kind == "derived" else None for kind, _, how in declared]
        if any(kind == "derived" and src is None for (kind, _, _), src in zip(declared, sources)):
            return None
        # Every named input must reach the graph as it is or through a declared derivation: a copy
        # made on its way in would look constant whenever two batches agree, and replay stale.
        used = {r[1] for r in roles if r[0] == "input"} | {src for src in sources if src is not None}
        if used != set(inputs) or {r[1] for r in roles if r[0] in ("generated", "derived")} != set(range(len(declared))):
            return None
        node_buffers = {id(b) for bufs in run.plan.node_buffers for b in bufs}
        outputs = []
        for t in outs:
            base = t.lazy.base
            if base.buffer is None or id(base.buffer) not in node_buffers:
                return None
            outputs.append((base.buffer, t.lazy.view, t.dtype))
        constants = [a for a, r in zip(run.inputs, roles) if r[0] == "constant"]
        return _Observed(run.plan, tuple(roles), constants, declared, sources, outputs,
                         {k: np.shape(v) for k, v in inputs.items()})

    def _replay(self, inputs: dict) -> list:
        seen = self.previous
        # Generated inputs are drawn in the order the step declared them, as building it would.
        values = [how() if kind == "generated" else how[1](inputs[source])
                  for (kind, _, how), source in zip(seen.declared, seen.sources)]
        restore_constants(seen.plan, self, [role[0] == "constant" for role in seen.roles], seen.constants)
        for role, buf in zip(seen.roles, seen.plan.input_buffers):
            if role[0] == "input":
                buf.host[...] = np.asarray(inputs[role[1]]).reshape(buf.shape)
            elif role[0] != "constant":
                buf.host[...] = np.asarray(values[role[1]]).reshape(buf.shape)
        replay(seen.plan)
        return self._read_outputs()

    def _read_outputs(self) -> list:
        if self.readback is None:
            self.readback = ViewReadback([(buf, view) for buf, view, _ in self.previous.outputs])
        return self.readback.read()


class ViewReadback:
    """Reads views of device buffers (a replayed plan's outputs) back to the host in one submission:
    a recorded copy of only the span each view covers (the last token's logits, not all of them)
    into a host-visible buffer, then numpy's view of it, bfloat16 widened as Tensor.numpy() does."""

    def __init__(self, views, seq=None):
        """``seq``: record the copies at the end of that sequence (read them with :meth:`values` after it ran)
        instead of into one of their own."""
        self.views = [view for _, view in views]
        device = views[0][0].device
        self.seq = seq or device.sequence()
        self.hosts = []
        for buf, view in views:
            count = view.span
            host = Buffer(device, (count,), buf.dtype, host_visible=True, name="readback")
            self.seq.copy(buf, host, nbytes=count * buf.dtype.itemsize, src_offset=view.offset * buf.dtype.itemsize)
            self.seq.download(host)
            self.hosts.append(host)

    def read(self) -> list:
        self.seq.replay()
        return self.values()

    def values(self) -> list:
        """The views as the last run of the sequence left them."""
        out = []
        for host, view in zip(self.hosts, self.views):
            flat = host.host.reshape(-1)
            x = np.lib.stride_tricks.as_strided(flat, shape=view.shape,
                                                strides=tuple(s * flat.itemsize for s in view.strides))
            if host.dtype is dt.bfloat16:  # widened straight from the mapped buffer: one pass over [batch, vocab]
                widened = x.astype(np.uint32)
                widened <<= 16
                out.append(widened.view(np.float32))
            else:
                out.append(x.copy())
        return out


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two host inputs hold the same values (the same array, or equal dtype, shape and contents)."""
    return a is b or (a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))


def _same_step(a: _Observed, b: _Observed) -> bool:
    return (a.plan is b.plan and a.roles == b.roles
            and [x[0] for x in a.declared] == [x[0] for x in b.declared] and a.sources == b.sources
            and [(id(buf), v) for buf, v, _ in a.outputs] == [(id(buf), v) for buf, v, _ in b.outputs]
            and all(same_values(x, y) for x, y in zip(a.constants, b.constants)))


_profilers: list = []


class profile:
    """Context manager adding up GPU time per kernel over every plan that runs inside it.

    Only plans recorded inside it carry timestamps, so clear the plan cache (or use fresh shapes) first.
    ``kernels`` maps a kernel name to [seconds, launches]; ``report()`` formats the largest."""

    def __enter__(self) -> "profile":
        self.kernels: dict[str, list] = {}
        self.replays = 0
        _profilers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _profilers.remove(self)

    def add(self, timings) -> None:
        self.replays += 1
        for label, seconds in timings:
            entry = self.kernels.setdefault(label, [0.0, 0])
            entry[0] += seconds
            entry[1] += 1

    @property
    def gpu_seconds(self) -> float:
        return sum(s for s, _ in self.kernels.values())

    def report(self, top: int = 15) -> str:
        total = self.gpu_seconds or 1.0
        rows = sorted(self.kernels.items(), key=lambda kv: -kv[1][0])[:top]
        lines = [f"GPU {self.gpu_seconds * 1e3:.2f} ms over {self.replays} replays"]
        lines += [f"  {name:40s} {s * 1e3:9.3f} ms {100 * s / total:5.1f}%  x{n}" for name, (s, n) in rows]
        return "\n".join(lines)


def clear_plan_cache() -> None:
    """Forget every recorded plan; steps captured from them (generation's decode step) are recorded again too."""
    global _plan_bytes
    _plans.clear()
    _plan_bytes = 0
    stats["cleared"] += 1
