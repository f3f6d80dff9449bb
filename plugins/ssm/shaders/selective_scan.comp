// Selective scan, float32, one invocation per (batch row b, channel i) carrying the state h[i, :] (STATE):
//   a_t = exp(delta_t A[i, :]),  h_t = a_t h_{t-1} + delta_t B_t u_t,  y_t = C_t . h_t + D[i] u_t
// u, delta, y, du, ddelta: [batch, length, channels]; A [channels, STATE]; B, C [batch, length, groups, STATE],
// the channels split in `groups` equal runs, run g reading group g (Mamba-1: one group; Mamba-2: n_groups);
// D [channels]; h0, h_last [batch, channels, STATE]; checkpoints [batch, chunks, channels, STATE] hold the state
// before every CHUNK steps, from which the backward recomputes each chunk's states into its workspace.
//
// FORWARD   y, the last state and the checkpoints (h0: the state before u, a recurrent cache's; zeros without).
// BACKWARD  from dy: du, ddelta, and float32 partial sums the caller finishes: dA and dD per batch row
//           ([batch, channels, STATE], [batch, channels]), dB and dC per workgroup of channels
//           ([batch, length, groups * blocks, STATE] each: blocks workgroups per group). The initial state gets no
//           gradient.
// A dispatch covers the chunks first_chunk .. end_chunk - 1 (forward in time, backward in reverse): llvmpipe ends
// every loop of an invocation, silently, once its loops have run 65535 iterations in all, so the launcher splits a
// long scan in dispatches of fewer. Between two, the forward's state waits in the next chunk's checkpoint (or
// h_last after the last chunk); the backward's dL/dh in the workspace's last row, dA and dD in their outputs.
// Workgroups: x = groups * blocks (blocks = ceil(channels per group / 64)), y = batch rows; a workgroup's channels
// lie in one group. The backward's per-step sums go through shared memory by subgroup: subgroups of at least 4
// invocations (MAX_SUBGROUPS of them in a workgroup of 64).
//! variant forward -DFORWARD
//! variant backward -DBACKWARD
#version 450
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
layout(local_size_x = 64) in;

#define MAX_SUBGROUPS 16
layout(constant_id = 0) const uint STATE = 16;
layout(constant_id = 1) const uint CHUNK = 64;
layout(constant_id = 2) const bool HAS_INITIAL = false;

layout(binding = 0) readonly buffer U { float u[]; };
layout(binding = 1) readonly buffer Delta { float delta[]; };
layout(binding = 2) readonly buffer AMatrix { float A[]; };
layout(binding = 3) readonly buffer BMatrix { float Bm[]; };
layout(binding = 4) readonly buffer CMatrix { float Cm[]; };
layout(binding = 5) readonly buffer DVector { float Dv[]; };

#ifdef FORWARD
layout(binding = 6) readonly buffer Initial { float h0[]; };
layout(binding = 7) writeonly buffer Y { float y[]; };
layout(binding = 8) writeonly buffer Last { float h_last[]; };
layout(binding = 9) buffer Checkpoints { float checkpoints[]; };
layout(push_constant) uniform Push {
    uint batch; uint length; uint channels; uint chunks; uint groups; uint first_chunk; uint end_chunk;
    uint u_off; uint delta_off; uint a_off; uint b_off; uint c_off; uint d_off;
    uint h0_off; uint y_off; uint last_off; uint ckpt_off;
};

uint checkpoint_at(uint b, uint k, uint i) { return ckpt_off + ((b * chunks + k) * channels + i) * STATE; }

void main() {
    uint per_group = channels / groups, blocks = (per_group + 63) / 64;
    uint group = gl_WorkGroupID.x / blocks, within = (gl_WorkGroupID.x % blocks) * 64 + gl_LocalInvocationID.x;
    uint i = group * per_group + within, b = gl_WorkGroupID.y;
    if (within >= per_group) return;
    // a later dispatch resumes from the checkpoint the one before wrote
    uint start = first_chunk * CHUNK, end = min(end_chunk * CHUNK, length), resume = checkpoint_at(b, first_chunk, i);
    float h[STATE], a_row[STATE];
    for (uint n = 0; n < STATE; ++n) {
        float initial = HAS_INITIAL ? h0[h0_off + (b * channels + i) * STATE + n] : 0.0;
        h[n] = first_chunk > 0 ? checkpoints[resume + n] : initial;
        a_row[n] = A[a_off + i * STATE + n];
    }
    float d = Dv[d_off + i];
    for (uint t = start; t < end; ++t) {
        if (t % CHUNK == 0 && (t == 0 || t > start)) {
            uint base = checkpoint_at(b, t / CHUNK, i);
            for (uint n = 0; n < STATE; ++n) checkpoints[base + n] = h[n];
        }
        uint row = b * length + t;
        float ut = u[u_off + row * channels + i], dt = delta[delta_off + row * channels + i];
        float acc = d * ut;
        for (uint n = 0; n < STATE; ++n) {
            uint bc = (row * groups + group) * STATE + n;
            h[n] = exp(dt * a_row[n]) * h[n] + dt * Bm[b_off + bc] * ut;
            acc += Cm[c_off + bc] * h[n];
        }
        y[y_off + row * channels + i] = acc;
    }
    if (end_chunk < chunks) {
        uint base = checkpoint_at(b, end_chunk, i);
        for (uint n = 0; n < STATE; ++n) checkpoints[base + n] = h[n];
    } else {
        for (uint n = 0; n < STATE; ++n) h_last[last_off + (b * channels + i) * STATE + n] = h[n];
    }
}
#endif

#ifdef BACKWARD
layout(binding = 6) readonly buffer Checkpoints { float checkpoints[]; };
layout(binding = 7) readonly buffer DY { float dy[]; };
layout(binding = 8) writeonly buffer DU { float du[]; };
layout(binding = 9) writeonly buffer DDelta { float ddelta[]; };
layout(binding = 10) buffer DA { float dA[]; };
layout(binding = 11) buffer DD { float dD[]; };
layout(binding = 12) writeonly buffer DB { float dB[]; };
layout(binding = 13) writeonly buffer DC { float dC[]; };
// [batch, channels, CHUNK + 1, STATE]: a chunk's states, then dL/dh carried to the next dispatch
layout(binding = 14) buffer Workspace { float states[]; };
layout(push_constant) uniform Push {
    uint batch; uint length; uint channels; uint chunks; uint groups; uint first_chunk; uint end_chunk;
    uint u_off; uint delta_off; uint a_off; uint b_off; uint c_off; uint d_off;
    uint ckpt_off; uint dy_off; uint du_off; uint ddelta_off; uint da_off; uint dd_off; uint db_off; uint dc_off;
};

// per time step: the workgroup's sums over its channels of the dB and dC terms (2 STATE values)
shared float partial_sums[MAX_SUBGROUPS][2 * STATE];

void main() {
    uint per_group = channels / groups, blocks = (per_group + 63) / 64;
    uint group = gl_WorkGroupID.x / blocks, within = (gl_WorkGroupID.x % blocks) * 64 + gl_LocalInvocationID.x;
    uint b = gl_WorkGroupID.y, lane = gl_LocalInvocationID.x, partial = gl_WorkGroupID.x;
    bool live = within < per_group;
    // dead invocations compute on their group's first channel and contribute zeros to the shared sums
    uint i = group * per_group + (live ? within : 0), ic = i;
    // a dispatch after the first (which ends at the last chunk) resumes from what the one before left
    bool resumed = live && end_chunk < chunks;
    uint ws = (b * channels + ic) * (CHUNK + 1) * STATE, carry = ws + CHUNK * STATE;
    float a_row[STATE], g[STATE], dA_acc[STATE];
    for (uint n = 0; n < STATE; ++n) {
        a_row[n] = A[a_off + ic * STATE + n];
        g[n] = resumed ? states[carry + n] : 0.0;
        dA_acc[n] = resumed ? dA[da_off + (b * channels + i) * STATE + n] : 0.0;
    }
    float d = Dv[d_off + ic], dD_acc = resumed ? dD[dd_off + b * channels + i] : 0.0;
    for (int k = int(end_chunk) - 1; k >= int(first_chunk); --k) {
        uint start = uint(k) * CHUNK, end = min(start + CHUNK, length);
        uint ckpt = ckpt_off + ((b * chunks + uint(k)) * channels + ic) * STATE;
        // the chunk's states, from its checkpoint
        float h[STATE];
        for (uint n = 0; n < STATE; ++n) h[n] = checkpoints[ckpt + n];
        for (uint t = start; t < end; ++t) {
            uint row = b * length + t;
            float ut = u[u_off + row * channels + ic], dt = delta[delta_off + row * channels + ic];
            for (uint n = 0; n < STATE; ++n) {
                h[n] = exp(dt * a_row[n]) * h[n] + dt * Bm[b_off + (row * groups + group) * STATE + n] * ut;
                if (live) states[ws + (t - start) * STATE + n] = h[n];
            }
        }
        for (uint t = end; t-- > start;) {
            uint row = b * length + t;
            float ut = u[u_off + row * channels + ic], dt = delta[delta_off + row * channels + ic];
            float dyt = live ? dy[dy_off + row * channels + ic] : 0.0;
            float du_acc = d * dyt, ddt = 0.0;
            for (uint n = 0; n < STATE; ++n) {
                uint bc = (row * groups + group) * STATE + n;
                float bn = Bm[b_off + bc], cn = Cm[c_off + bc];
                float ht = states[ws + (t - start) * STATE + n];
                float h_prev = t == start ? checkpoints[ckpt + n] : states[ws + (t - 1 - start) * STATE + n];
                float an = exp(dt * a_row[n]);
                g[n] += dyt * cn;                          // dL/dh_t
                du_acc += g[n] * dt * bn;
                ddt += g[n] * (bn * ut + a_row[n] * an * h_prev);
                dA_acc[n] += g[n] * dt * an * h_prev;
                float sum_b = subgroupAdd(live ? g[n] * dt * ut : 0.0);
                float sum_c = subgroupAdd(live ? dyt * ht : 0.0);
                if (subgroupElect()) {
                    partial_sums[gl_SubgroupID][n] = sum_b;
                    partial_sums[gl_SubgroupID][STATE + n] = sum_c;
                }
                g[n] *= an;                                // on to h_{t-1}
            }
            dD_acc += dyt * ut;
            if (live) {
                du[du_off + row * channels + i] = du_acc;
                ddelta[ddelta_off + row * channels + i] = ddt;
            }
            barrier();
            for (uint k = lane; k < 2 * STATE; k += 64) {
                float total = 0.0;
                for (uint s = 0; s < gl_NumSubgroups; ++s) total += partial_sums[s][k];
                uint at = (row * groups * blocks + partial) * STATE + k % STATE;
                if (k < STATE) dB[db_off + at] = total; else dC[dc_off + at] = total;
            }
            barrier();
        }
    }
    if (live) {
        for (uint n = 0; n < STATE; ++n) dA[da_off + (b * channels + i) * STATE + n] = dA_acc[n];
        dD[dd_off + b * channels + i] = dD_acc;
        if (first_chunk > 0)
            for (uint n = 0; n < STATE; ++n) states[carry + n] = g[n];
    }
}
#endif
