"""The selective scan as an engine op (plugins/ssm/shaders/selective_scan.comp), float32.

    a_t = exp(delta_t A),  h_t = a_t h_{t-1} + delta_t B_t u_t,  y_t = C_t . h_t + D u_t

per batch row and channel, with a state of ``state`` values per channel. Mamba-1 shares B and C across all
channels; Mamba-2 splits the channels in ``groups`` equal runs, each with its own B and C (and gives every channel
of a head that head's delta and A). ``selective_scan`` returns y and the last
state (a recurrent cache's next state); the same kernel with one time step is the generation update. The
backward recomputes the states from checkpoints kept every ``CHUNK`` steps, so it stores
[batch, length / CHUNK, channels, state] floats rather than every step's state.

A long scan runs as several dispatches, each over a run of chunks: llvmpipe (lavapipe) ends every loop of a shader
invocation, without a word, once the invocation's loops have run 65535 iterations in all, and each step costs about
``state`` of them. ``_chunks_per_dispatch`` keeps an invocation's iterations within core's ``LOOP_ITERATIONS``,
counting every loop of the shader as run, none unrolled.
"""
from __future__ import annotations

from vkformers.engine.function import Function, KernelOp, node, wrap
from vkformers.engine.kernels import LOOP_ITERATIONS
from vkformers.engine.kernels.transformer_args import checked, positive
from vkformers.errors import VkformersError
from vkformers.runtime import dtypes as dt

MAX_STATE = 256  # the backward's shared sums (16 subgroups x 2 x state floats) stay within 32 KiB
CHUNK = 64       # time steps between two checkpoints of the state
GROUP = 64       # channels per workgroup (the shader's local size)
MAX_SUBGROUPS = 16  # the shader's bound on the subgroups of a workgroup


class StateSizeError(VkformersError, ValueError):
    """A state larger than the selective-scan kernel keeps per channel."""


def _blocks(channels, groups):
    """Workgroups per group of channels."""
    return -(-(channels // groups) // GROUP)


def _loop_iterations(state: int, chunks: int, backward: bool) -> int:
    """An upper bound on the loop iterations (each loop's trips and its final test) of one invocation of the
    shader over ``chunks`` chunks of CHUNK steps: the loops over the state, over the steps and over the chunks."""
    per_state = state + 1
    if not backward:  # the first state, and per step the update, per chunk a checkpoint, at the end the state
        return 2 * per_state + chunks * (CHUNK * (per_state + 1) + per_state) + 2
    sums = -(-2 * state // GROUP)  # the per-step sums: its loop, and in each trip one over the subgroups
    per_step = 2 * per_state + (sums + 1) + sums * (MAX_SUBGROUPS + 1) + 2  # recompute, gradient, sums, two steps
    return 3 * per_state + chunks * (per_state + CHUNK * per_step + 3) + 1


def _chunks_per_dispatch(state: int, backward: bool) -> int:
    """The most chunks one dispatch covers within LOOP_ITERATIONS (at least one; MAX_STATE's fits)."""
    fit = 1
    while _loop_iterations(state, fit + 1, backward) <= LOOP_ITERATIONS:
        fit += 1
    return fit


def _dispatches(length: int, state: int, backward: bool):
    """(first chunk, end chunk) of each dispatch, in time order."""
    chunks = -(-length // CHUNK)
    step = _chunks_per_dispatch(state, backward)
    return [(k, min(k + step, chunks)) for k in range(0, chunks, step)]


def _launch_forward(seq, u, delta, A, B, C, D, h0, y, h_last, checkpoints, *, batch, length, channels, state,
                    groups):
    positive(batch=batch, length=length, channels=channels, state=state, groups=groups)
    chunks = -(-length // CHUNK)
    seq_sizes = batch * length * channels
    u, delta = (checked(v, "float32", seq_sizes, f"selective_scan {n}") for v, n in ((u, "u"), (delta, "delta")))
    A = checked(A, "float32", channels * state, "selective_scan A")
    B, C = (checked(v, "float32", batch * length * groups * state, f"selective_scan {n}")
            for v, n in ((B, "B"), (C, "C")))
    D = checked(D, "float32", channels, "selective_scan D")
    y = checked(y, "float32", seq_sizes, "selective_scan y")
    h_last = checked(h_last, "float32", batch * channels * state, "selective_scan h_last")
    checkpoints = checked(checkpoints, "float32", batch * chunks * channels * state, "selective_scan checkpoints")
    h0 = None if h0 is None else checked(h0, "float32", batch * channels * state, "selective_scan h0")
    ops = [u, delta, A, B, C, D, h0 or u, y, h_last, checkpoints]
    for first, end in _dispatches(length, state, backward=False):
        seq.dispatch(seq.device.kernel("selective_scan", "forward"), [o.buffer for o in ops],
                     (groups * _blocks(channels, groups), batch, 1),
                     push=[batch, length, channels, chunks, groups, first, end, *(o.offset for o in ops)],
                     spec=[state, CHUNK, int(h0 is not None)])


def _launch_backward(seq, u, delta, A, B, C, D, checkpoints, dy, du, ddelta, dA, dD, dB, dC, workspace, *, batch,
                     length, channels, state, groups):
    chunks = -(-length // CHUNK)
    ins = [u, delta, A, B, C, D, checkpoints, dy]
    outs = [du, ddelta, dA, dD, dB, dC]
    ops = [checked(o, "float32", 1, "selective_scan_backward") for o in ins + outs]
    workspace = checked(workspace, "float32", batch * channels * (CHUNK + 1) * state, "selective_scan workspace")
    for first, end in reversed(_dispatches(length, state, backward=True)):
        seq.dispatch(seq.device.kernel("selective_scan", "backward"), [o.buffer for o in ops] + [workspace.buffer],
                     (groups * _blocks(channels, groups), batch, 1),
                     push=[batch, length, channels, chunks, groups, first, end, *(o.offset for o in ops)],
                     spec=[state, CHUNK, 0])


def _sizes(u, A, B):
    batch, length, channels = u.shape
    return dict(batch=batch, length=length, channels=channels, state=A.shape[1], groups=B.shape[2])


class SelectiveScanKernel(KernelOp):
    name = "selective_scan"

    def emit(self, seq, outs, ins):
        u, delta, A, B, C, D, *h0 = ins
        y, h_last, checkpoints = outs
        _launch_forward(seq, *(v.operand for v in (u, delta, A, B, C, D)), h0[0].operand if h0 else None,
                        y.operand, h_last.operand, checkpoints.operand, **_sizes(u, A, B))


class SelectiveScanBackwardKernel(KernelOp):
    name = "selective_scan_backward"

    def emit(self, seq, outs, ins):
        _launch_backward(seq, *(v.operand for v in ins), *(v.operand for v in outs), **_sizes(ins[0], ins[2], ins[3]))


class SelectiveScanFn(Function):
    def forward(self, u, delta, A, B, C, D, h0):
        batch, length, channels = u.shape
        state = A.shape[1]
        ins = [u, delta, A, B, C, D] + ([h0] if h0 is not None else [])
        y, h_last, checkpoints = node(SelectiveScanKernel(), ins, [
            (u.shape, dt.float32), ((batch, channels, state), dt.float32),
            ((batch, -(-length // CHUNK), channels, state), dt.float32)])
        self.saved = (u, delta, A, B, C, D, checkpoints)
        return y, h_last

    def backward(self, gy, g_last):
        if g_last is not None:
            raise NotImplementedError("selective_scan: no gradient flows through the last state (a cache's)")
        u, delta, A, B, C, D, checkpoints = self.saved
        batch, length, channels = u.shape
        state, groups = A.shape[1], B.shape[2]
        partials = groups * _blocks(channels, groups)
        outs = node(SelectiveScanBackwardKernel(), [u, delta, A, B, C, D, checkpoints, gy.lazy], [
            (u.shape, dt.float32), (u.shape, dt.float32), ((batch, channels, state), dt.float32),
            ((batch, channels), dt.float32), ((batch, length, partials, state), dt.float32),
            ((batch, length, partials, state), dt.float32), ((batch, channels, CHUNK + 1, state), dt.float32)])
        du, ddelta, dA, dD, dB, dC, _ = (wrap(o) for o in outs)
        dB, dC = (v.reshape(batch, length, groups, partials // groups, state).sum(3) for v in (dB, dC))
        return du, ddelta, dA.sum(0), dB, dC, dD.sum(0), None


def selective_scan(u, delta, A, B, C, D, initial_state=None):
    """y [batch, length, channels] and the last state [batch, channels, state] of the scan (module docstring), all
    float32: u, delta [batch, length, channels]; A [channels, state]; B, C [batch, length, state] (one group) or
    [batch, length, groups, state] (the channels split in ``groups`` equal runs); D [channels]; ``initial_state``
    [batch, channels, state] (zeros when None; it gets no gradient)."""
    batch, length, channels = u.shape
    state = A.shape[-1]
    grouped = len(B.shape) == 4
    groups = B.shape[2] if grouped else 1
    if channels % groups:
        raise ValueError(f"selective_scan: {channels} channels do not split in {groups} groups")
    if state > MAX_STATE:
        raise StateSizeError(f"selective_scan: state size {state} is above the kernel's {MAX_STATE}; "
                             "use a model with a smaller state_size")
    bc_shape = (batch, length, groups, state) if grouped else (batch, length, state)
    expected = {"delta": (u.shape, delta), "A": ((channels, state), A), "B": (bc_shape, B), "C": (bc_shape, C),
                "D": ((channels,), D)}
    if initial_state is not None:
        expected["initial_state"] = ((batch, channels, state), initial_state)
    for name, (shape, value) in expected.items():
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"selective_scan: {name} must be {tuple(shape)}, got {tuple(value.shape)}")
    if not grouped:
        B, C = B.reshape(batch, length, 1, state), C.reshape(batch, length, 1, state)
    args = [v.float() for v in (u, delta, A, B, C, D)]
    h0 = None if initial_state is None else initial_state.detach().float()
    return SelectiveScanFn.apply(*args, h0)
