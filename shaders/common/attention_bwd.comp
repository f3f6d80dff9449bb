// Attention backward, step 2 (flash-attention 2 style; scores are recomputed from q, k
// and the forward's log-sum-exp, nothing of size q_len x kv_len is stored).
//   COMPUTE_DQ = false: one workgroup per (key block, kv head, batch) owns rows of K and V
//     and streams the query tiles of every query head sharing that kv head:
//     dV += P^T dO, dK += scale * dS^T Q   (GQA sums stay inside one workgroup: deterministic).
//   COMPUTE_DQ = true: one workgroup per (query block, head, batch) owns rows of Q and dO and
//     streams key tiles: dQ += scale * dS K.
// with P = exp(score - lse), dS = P * (dO.v - delta) * (softcap's tanh derivative).
// Both read the pair (owned rows A1, A2) x (streamed rows B1, B2): A1.B1 = q.k, A2.B2 = dO.v.
// A workgroup's streamed tiles, head after head, are numbered units; one dispatch takes units
// [unit_lo, unit_hi): llvmpipe ends an invocation's loops after 65535 iterations, so the launcher splits
// them into dispatches run in order, each after the first adding to the gradients (`accumulate`).
//! variant f32 -DT_F32
//! variant f16 -DT_F16
//! variant bf16 -DT_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "attention_common.glsl"

layout(binding = 0) readonly buffer Q { T q[]; };
layout(binding = 1) readonly buffer K { T k[]; };
layout(binding = 2) readonly buffer V { T v[]; };
layout(binding = 3) readonly buffer DOut { T d_o[]; };
layout(binding = 4) readonly buffer Lse { float lse[]; };
layout(binding = 5) readonly buffer Delta { float delta[]; };
layout(binding = 6) readonly buffer Mask { uint mask_words[]; };
layout(binding = 7) readonly buffer Slopes { float alibi_slopes[]; };
// dK/dV pass: dK, dV. dQ pass: dQ twice (the second binding is never written).
layout(binding = 8) buffer Grad1 { T grad1[]; };  // read back with accumulate
layout(binding = 9) buffer Grad2 { T grad2[]; };

layout(push_constant) uniform Push {
    uint q_off, k_off, v_off, d_o_off, lse_off, mask_off, slopes_off, grad1_off, grad2_off;
    uint heads, kv_heads, q_len, kv_len, mask_stride;
    int q_offset;
    uint window;
    float scale, softcap;
    uint unit_lo, unit_hi, accumulate;
};

#include "attention_score.glsl"

layout(constant_id = 8) const bool COMPUTE_DQ = false;
layout(local_size_x_id = 9) in;

shared float own1[BLOCK_ROWS * ROW_STRIDE];     // dK/dV: K,  dQ: Q
shared float own2[BLOCK_ROWS * ROW_STRIDE];     // dK/dV: V,  dQ: dO
shared float stream1[BLOCK_COLS * ROW_STRIDE];  // dK/dV: Q,  dQ: K
shared float stream2[BLOCK_COLS * ROW_STRIDE];  // dK/dV: dO, dQ: V
shared float stream_lse[BLOCK_COLS];            // dK/dV only: per streamed query
shared float stream_delta[BLOCK_COLS];
shared float p_tile[BLOCK_ROWS * BLOCK_COLS];
shared float ds_tile[BLOCK_ROWS * BLOCK_COLS];

// Rows [row0, row0 + BLOCK_ROWS or COLS) of a [rows, HEAD_DIM] matrix at `base` into shared memory.
#define LOAD_TILE(dst, src, src_off, base, row0, rows, block)                                  \
    for (uint i = gl_LocalInvocationID.x; i < block * HEAD_DIM; i += THREADS) {               \
        uint r = i / HEAD_DIM, d = i % HEAD_DIM;                                              \
        dst[r * ROW_STRIDE + d] = row0 + r < rows ? LOAD(src[src_off + (base + row0 + r) * HEAD_DIM + d]) : 0.0; \
    }

void main() {
    const uint block0 = gl_WorkGroupID.x * BLOCK_ROWS, head_or_kv = gl_WorkGroupID.y, batch = gl_WorkGroupID.z;
    const uint tid = gl_LocalInvocationID.x, row = tid / LANES, lane = tid % LANES;
    const uint group = heads / kv_heads;
    const int q_base = q_offset < 0 ? int(kv_len) - int(q_len) : q_offset;
    const uint own = block0 + row;

    float acc1[DIMS_PER_LANE], acc2[DIMS_PER_LANE];
    for (uint t = 0; t < DIMS_PER_LANE; ++t) { acc1[t] = 0.0; acc2[t] = 0.0; }

    // Owned rows, and the streamed range: (first query head, head count, streamed begin / end).
    uint kv_head, head_first, head_count, stream_begin, stream_end, own_count;
    float own_lse = 0.0, own_delta = 0.0;
    if (COMPUTE_DQ) {
        const uint head = head_or_kv;
        kv_head = head / group; head_first = head; head_count = 1u; own_count = q_len;
        const uint q_rows = (batch * heads + head) * q_len;
        LOAD_TILE(own1, q, q_off, q_rows, block0, q_len, BLOCK_ROWS)
        LOAD_TILE(own2, d_o, d_o_off, q_rows, block0, q_len, BLOCK_ROWS)
        if (own < q_len) { own_lse = lse[lse_off + q_rows + own]; own_delta = delta[q_rows + own]; }
        const int first_pos = q_base + int(block0), last_pos = q_base + int(min(block0 + BLOCK_ROWS, q_len)) - 1;
        stream_end = CAUSAL ? uint(clamp(last_pos + 1, 0, int(kv_len))) : kv_len;
        stream_begin = window > 0u ? uint(clamp(first_pos - int(window) + 1, 0, int(stream_end))) : 0u;
    } else {
        kv_head = head_or_kv; head_first = kv_head * group; head_count = group; own_count = kv_len;
        const uint kv_rows = (batch * kv_heads + kv_head) * kv_len;
        LOAD_TILE(own1, k, k_off, kv_rows, block0, kv_len, BLOCK_ROWS)
        LOAD_TILE(own2, v, v_off, kv_rows, block0, kv_len, BLOCK_ROWS)
        // Queries that can see a key of this block: causal needs pos >= first key,
        // the window needs pos < last key + window.
        const int last_key = int(min(block0 + BLOCK_ROWS, kv_len)) - 1;
        stream_begin = CAUSAL ? uint(clamp(int(block0) - q_base, 0, int(q_len))) : 0u;
        stream_end = window > 0u ? uint(clamp(last_key + int(window) - q_base, int(stream_begin), int(q_len))) : q_len;
    }
    stream_begin -= stream_begin % BLOCK_COLS;

    const uint head_units = ((COMPUTE_DQ ? kv_len : q_len) + BLOCK_COLS - 1u) / BLOCK_COLS;
    for (uint h = 0u; h < head_count; ++h) {
        const uint head = head_first + h;
        const uint q_rows = (batch * heads + head) * q_len;
        const uint kv_rows = (batch * kv_heads + kv_head) * kv_len;
        const uint first_unit = h * head_units;  // this head's units within [unit_lo, unit_hi)
        const uint last_unit = first_unit + head_units;
        const uint begin = max(stream_begin, (clamp(unit_lo, first_unit, last_unit) - first_unit) * BLOCK_COLS);
        const uint end = min(stream_end, (clamp(unit_hi, first_unit, last_unit) - first_unit) * BLOCK_COLS);
        for (uint col0 = begin; col0 < end; col0 += BLOCK_COLS) {
            barrier();  // the previous tile is no longer read
            if (COMPUTE_DQ) {
                LOAD_TILE(stream1, k, k_off, kv_rows, col0, kv_len, BLOCK_COLS)
                LOAD_TILE(stream2, v, v_off, kv_rows, col0, kv_len, BLOCK_COLS)
            } else {
                LOAD_TILE(stream1, q, q_off, q_rows, col0, q_len, BLOCK_COLS)
                LOAD_TILE(stream2, d_o, d_o_off, q_rows, col0, q_len, BLOCK_COLS)
                for (uint i = tid; i < BLOCK_COLS; i += THREADS) {
                    bool valid = col0 + i < q_len;
                    stream_lse[i] = valid ? lse[lse_off + q_rows + col0 + i] : NEG_INF;
                    stream_delta[i] = valid ? delta[q_rows + col0 + i] : 0.0;
                }
            }
            barrier();

            float qk[COLS_PER_LANE], dov[COLS_PER_LANE];
            for (uint u = 0; u < COLS_PER_LANE; ++u) { qk[u] = 0.0; dov[u] = 0.0; }
            for (uint d = 0; d < HEAD_DIM; ++d) {
                float a1 = own1[row * ROW_STRIDE + d], a2 = own2[row * ROW_STRIDE + d];
                for (uint u = 0; u < COLS_PER_LANE; ++u) {
                    uint at = (lane + u * LANES) * ROW_STRIDE + d;
                    qk[u] += a1 * stream1[at];
                    dov[u] += a2 * stream2[at];
                }
            }
            for (uint u = 0; u < COLS_PER_LANE; ++u) {
                uint col = col0 + lane + u * LANES;
                uint qi = COMPUTE_DQ ? own : col, kpos = COMPUTE_DQ ? col : own;
                float row_lse = COMPUTE_DQ ? own_lse : stream_lse[lane + u * LANES];
                float row_delta = COMPUTE_DQ ? own_delta : stream_delta[lane + u * LANES];
                int qpos = q_base + int(qi);
                float p = 0.0, ds = 0.0;
                // lse = -inf marks a query that sees no key: all its gradients are 0.
                if (qi < q_len && kpos < kv_len && row_lse != NEG_INF && key_visible(qpos, kpos, batch)) {
                    float cap_slope;
                    float s = attention_score(qk[u], qpos, kpos, head, cap_slope);
                    p = exp(s - row_lse);
                    ds = p * (dov[u] - row_delta) * cap_slope;
                }
                p_tile[row * BLOCK_COLS + lane + u * LANES] = p;
                ds_tile[row * BLOCK_COLS + lane + u * LANES] = ds;
            }
            barrier();

            for (uint c = 0; c < BLOCK_COLS; ++c) {
                float ds = ds_tile[row * BLOCK_COLS + c];
                for (uint t = 0; t < DIMS_PER_LANE; ++t) acc1[t] += ds * stream1[c * ROW_STRIDE + lane + t * LANES];
                if (!COMPUTE_DQ) {
                    float p = p_tile[row * BLOCK_COLS + c];
                    for (uint t = 0; t < DIMS_PER_LANE; ++t) acc2[t] += p * stream2[c * ROW_STRIDE + lane + t * LANES];
                }
            }
        }
    }

    if (own >= own_count) return;
    if (COMPUTE_DQ) {
        const uint at = ((batch * heads + head_or_kv) * q_len + own) * HEAD_DIM;
        for (uint t = 0; t < DIMS_PER_LANE; ++t) {
            const uint i = grad1_off + at + lane + t * LANES;
            grad1[i] = STORE(accumulate != 0u ? LOAD(grad1[i]) + acc1[t] * scale : acc1[t] * scale);
        }
    } else {
        const uint at = ((batch * kv_heads + kv_head) * kv_len + own) * HEAD_DIM;
        for (uint t = 0; t < DIMS_PER_LANE; ++t) {
            const uint i1 = grad1_off + at + lane + t * LANES, i2 = grad2_off + at + lane + t * LANES;
            grad1[i1] = STORE(accumulate != 0u ? LOAD(grad1[i1]) + acc1[t] * scale : acc1[t] * scale);
            grad2[i2] = STORE(accumulate != 0u ? LOAD(grad2[i2]) + acc2[t] : acc2[t]);
        }
    }
}
