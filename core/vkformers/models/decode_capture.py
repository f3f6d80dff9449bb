"""Decode steps that ``generate`` replays without the model's Python forward (models/generation.py).

``DecodeCapture`` watches the first decode steps and, once two ran the same recorded plan, replays that plan
for every later token with new ids, positions and cache bounds written into its inputs. Greedy decoding
chains several such steps in one submission (``run_chain``): the GPU chooses each step's token from the
step before (shaders/common/decode_next_token.comp). ``capture_key`` says when a capture may serve a
later ``generate`` call too. The same machinery replays a prompt's forward (prefill) when later calls bring
prompts of the same shape without padding (``tokens`` = the prompt's length).
"""
from __future__ import annotations

import numpy as np

from vkformers.engine import lazy
from vkformers.engine.kernels import Operand
from vkformers.engine.kernels import decode as KD
from vkformers.engine.ops import decode as fused_decode
from vkformers.models.cache import KVCache
from vkformers.runtime.vulkan import Buffer


def to_scores(logits: np.ndarray) -> np.ndarray:
    """Logits as float32 (no copy when they are: readbacks hand over arrays of their own)."""
    return logits.astype(np.float32, copy=False)


def capture_key(model, cache: KVCache):
    """What a recorded decode step depends on beyond its per-step inputs, or None when a parameter has pending
    (unrealized) updates: the graph would then contain them, and the recorded plan does not."""
    params = model.parameters() if hasattr(model, "parameters") else []
    if any(p.lazy.base.node is not None for p in params):
        return None
    return (id(cache), tuple(id(p.lazy.base.buffer) for p in params), getattr(model, "training", False),
            fused_decode.enabled, lazy.stats["cleared"])


class DecodeCapture:
    """Decode steps replayed without running the model's Python forward.

    Every decode step builds the same graph, and the engine replays one recorded plan for it; what
    remains per token is building that graph in Python, which costs far more than the GPU work of a
    small model. So generate watches the decode steps (``observe``): once two consecutive ones ran
    the same plan as a single realization, with the step's token ids, positions and cache inputs
    landing in the same input buffers, and every other input (rotary tables, constants) holding
    the same values in both, later steps (``run``) write their ids, positions and cache inputs into
    those buffers, replay the plan and read the logits, with no graph at all.

    The inputs are recognised by identity: the model must make its input tensors from the very
    int32 arrays it is given (``Tensor(np.asarray(ids, np.int32))`` does), and the cache records the
    arrays of its own. A step whose inputs cannot all be found is simply not captured. A cache of recurrent
    states (a state-space model's) has no bounds (``step_hosts`` (None, None)): its step reads states that it
    overwrites in place, persistent buffers like the KV cache's, so ids alone change between steps.
    """

    def __init__(self, cache: KVCache, tokens: int = 1, across_positions: bool = False):
        self.cache = cache
        self.tokens = tokens   # per step: 1 for decode; a prompt's length for a captured prefill (no chains)
        # True: the forward follows stored tokens of any count (a draft's verification), and two observations
        # confirm its plan only at different counts: a graph that depends on the count (stored keys sliced to it)
        # then never confirms, where two forwards at one count would replay it at every other
        self.across_positions = across_positions
        self.previous = None   # the last observed step: (plan, roles, constants, logits buffer, view)
        self.observed_at = None  # the cache's position after the last observed step
        self.ready = False
        self.readback = None   # lazy.ViewReadback of the logits
        self.chains = {}       # steps -> _Chain, recorded on first use
        self.replays = 0       # forwards run by replay (run and run_chain calls that replayed)

    def forget(self) -> None:
        """An uncaptured forward ran (e.g. a recomputation): the plan's other inputs may be stale."""
        if self.previous is not None:
            self.previous[0].release(self)
        self.previous, self.ready, self.readback, self.chains = None, False, None, {}
        self.observed_at = None

    def observe(self, runs, step_ids: np.ndarray, step_positions: np.ndarray, last, rows=None) -> None:
        """``rows`` (int32, one per batch row, or None): the array of an input that picks which position's
        logits ``last`` holds (a prompt padded to a reusable length: its last real token)."""
        current = self._describe(runs, step_ids, step_positions, last, rows)
        previous, self.previous = self.previous, current
        moved = self.observed_at != self.cache.position
        self.observed_at = self.cache.position
        if previous is not None:
            previous[0].release(self)
        if self._confirms(previous, current) and (moved or not self.across_positions):
            self.ready = True
        if self.ready and current is not None:
            current[0].hold(self)  # replayed without the plan cache: the cache must keep it

    @staticmethod
    def _confirms(previous, current) -> bool:
        """Whether two consecutive steps ran the same plan with the same roles, output and constants."""
        if current is None or previous is None:
            return False
        plan, roles, constants, buffer, view = current
        if plan is not previous[0] or roles != previous[1] or buffer is not previous[3] or view != previous[4]:
            return False
        # an input made inside the forward that changed between steps: only the Python forward knows it
        return all(lazy.same_values(a, b) for a, b in zip(constants, previous[2]))

    def _describe(self, runs, step_ids, step_positions, last, rows=None):
        if len(runs) != 1:  # the step realized more than once (or not at all): no single plan to replay
            return None
        run = runs[0]
        step_bounds, step_mask = self.cache.step_hosts
        known = {id(step_ids): "ids", id(step_positions): "positions"}
        if step_bounds is not None:  # a recurrent state cache has none: its step reads no position
            known[id(step_bounds)] = "bounds"
        if step_mask is not None:
            known[id(step_mask)] = "mask"
        gathered = getattr(self.cache, "gather_host", None)  # a paged chunked prefill's block tables
        if gathered is not None:
            known[id(gathered)] = "tables"
        if rows is not None:
            known[id(rows)] = "rows"
        roles = tuple(known.get(id(a), "constant") for a in run.inputs)
        # ids must be found (a copy of them could look constant when a token repeats); positions may be
        # unused (ALiBi) or copied, which the constancy check catches as they grow by one every step
        if "ids" not in roles or ("bounds" in roles) != (step_bounds is not None) or ("mask" in roles) != (step_mask is not None) \
                or ("rows" in roles) != (rows is not None):
            return None
        constants = [a for a, role in zip(run.inputs, roles) if role == "constant"]
        lb = last.lazy
        if lb.base.buffer is None or lb.base.buffer not in [b for bufs in run.plan.node_buffers for b in bufs]:
            return None
        return run.plan, roles, constants, lb.base.buffer, lb.view

    def run(self, step_ids: np.ndarray, step_positions: np.ndarray, rows=None,
            key_padding_mask=None) -> np.ndarray | None:
        """One decode step by replay: the logits as float32 [batch, vocab], or None when it cannot (the
        cache's mask changed kind): then the caller runs the forward. ``rows``: as for observe;
        ``key_padding_mask``: a captured prefill's prompt mask [batch, tokens] (1 = token), stored in the cache."""
        plan, _, _, buffer, view = self.previous
        if not self._write_step(step_ids, step_positions, rows, key_padding_mask):
            return None
        lazy.replay(plan)
        self.replays += 1
        self.cache.advance(self.tokens)
        if self.readback is None:
            self.readback = lazy.ViewReadback([(buffer, view)])
        return to_scores(self.readback.read()[0])

    def run_chain(self, step_ids: np.ndarray, step_positions: np.ndarray, steps: int):
        """``steps`` greedy decode steps in one submission, the GPU choosing each step's input token from the
        step before (decode_next_token.comp, numpy's argmax rule): (the last step's logits as float32
        [batch, vocab], the steps - 1 tokens chosen in between as a list of [batch] int64 arrays), or None when
        the cache's mask changed kind (then the caller runs the forward). A key padding mask needs no update between
        the chained steps: the cache's mask holds ones past the stored tokens (KVCache.reset), so the one uploaded
        with the first step already covers the new tokens."""
        if self.tokens != 1:
            raise ValueError("only decode steps of one token chain")
        if steps > getattr(self.cache, "lookahead", steps):  # a paged cache holds blocks only that far ahead
            return None
        if not self._write_step(step_ids, step_positions):
            return None
        plan = self.previous[0]
        chain = self.chains.get(steps) or self._record_chain(steps)
        lazy.replay(plan, chain.seq)
        self.replays += 1
        self.cache.advance(1)
        for _ in range(steps - 1):  # the host's account of the cache: the chained tokens are stored
            self.cache.step_arrays(1)
            self.cache.advance(1)
        logits = to_scores(chain.logits.values()[0])
        history = chain.history.host.reshape(steps - 1, -1).astype(np.int64)
        return logits, list(history)

    def choose(self, step_ids: np.ndarray, step_positions: np.ndarray) -> np.ndarray | None:
        """One decode step by replay whose greedy tokens the GPU chooses (decode_next_token.comp, numpy's argmax
        rule): [batch] int64, read back instead of the logits; None as for run."""
        if self.tokens != 1:
            raise ValueError("only decode steps of one token choose on the GPU")
        if not self._write_step(step_ids, step_positions):
            return None
        chosen = self.chains.get("choose") or self._record_chain(1, choose=True)
        lazy.replay(self.previous[0], chosen.seq)
        self.replays += 1
        self.cache.advance(1)
        return chosen.history.host.reshape(-1).astype(np.int64)

    def _write_step(self, step_ids: np.ndarray, step_positions: np.ndarray, rows=None,
                    key_padding_mask=None) -> bool:
        """This step's ids, positions, cache bounds (and mask) into the plan's input buffers (the constants as
        observed, where another forward of the plan wrote others); False, forgetting the capture, when the cache's
        mask changed kind."""
        plan, roles, constants = self.previous[:3]
        bounds, mask = self.cache.step_arrays(self.tokens, key_padding_mask)
        # a step reading no bounds attends to nothing (a model of recurrent states only): no mask reaches it
        if (mask is not None) != ("mask" in roles) and "bounds" in roles:
            self.forget()
            return False
        lazy.restore_constants(plan, self, [role == "constant" for role in roles], constants)
        values = {"ids": step_ids, "positions": step_positions, "bounds": bounds, "mask": mask, "rows": rows}
        for role, target in zip(roles, plan.input_buffers):
            if role == "tables":  # the rows' first blocks, as many as the recorded gather read
                target.host[...] = self.cache.gather_tables(target.count // self.cache.batch).reshape(target.shape)
            elif role != "constant":
                target.host[...] = values[role].reshape(target.shape)
        return True

    def _record_chain(self, steps: int, choose: bool = False) -> "_Chain":
        """``choose``: a single step whose tokens the GPU chooses and the host reads (its logits are not read);
        the kernel also writes them into the step's ids (and advances its positions and bounds), inputs that the
        next replay overwrites."""
        plan, roles, _, buffer, view = self.previous
        inputs = {role: target for role, target in zip(roles, plan.input_buffers) if role != "constant"}
        batch, vocab = view.shape
        device = plan.seq.device
        chosen = steps - 1 + int(choose)
        history = Buffer(device, (chosen * batch,), "int32", host_visible=True, name="chained tokens")
        # a cache without bounds (recurrent states) gets a scratch pair for the kernel to count in
        bounds = inputs.get("bounds") or Buffer(device, (2,), "uint32", name="chained bounds")
        seq = device.sequence(timestamps=plan.seq.timestamps).extend(plan.seq, others=False)
        for step in range(steps):
            seq.extend(plan.seq, uploads=False)
            if step < chosen:
                KD.next_token(seq, Operand(buffer, view.offset), inputs["ids"], bounds, history,
                              rows=batch, vocab=vocab, row_stride=view.strides[0], step=step,
                              positions=inputs.get("positions"))
        logits = None if choose else lazy.ViewReadback([(buffer, view)], seq)
        seq.download(history)
        self.chains["choose" if choose else steps] = chain = _Chain(seq, logits, history)
        return chain


class _Chain:
    """A recorded sequence of chained decode steps, with the readback of its last logits and chosen tokens."""

    def __init__(self, seq, logits, history):
        self.seq, self.logits, self.history = seq, logits, history
