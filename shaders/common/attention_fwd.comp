// Fused attention forward (flash-attention style): out = softmax(score(q k^T)) v and the
// log-sum-exp of each query row. One workgroup per (query block, head, batch); key/value
// tiles stream through shared memory with an online softmax, so no q_len x kv_len matrix
// exists anywhere. LANES threads own one query row: each scores COLS_PER_LANE keys of a
// tile and accumulates DIMS_PER_LANE output columns. Also serves KV-cache decoding
// (q_len = 1, kv_len read from a buffer, K/V rows strided by the cache capacity), where
// SPLITS > 1 splits the cache among workgroups (flash-decoding): workgroup x then takes
// one slice of the keys and writes its unnormalised partial result, running max and sum
// to the float32 `lse` binding; attention_decode_combine.comp merges the slices.
// [key_lo, key_hi) bounds the keys of one dispatch: llvmpipe ends an invocation's loops after 65535 iterations,
// so the launcher splits a long key axis into dispatches run in order; with `resume` a dispatch starts from the
// previous one's out and lse (its running max lse and sum 1 hold out * 1 = the weighted sum so far).
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
layout(binding = 3) readonly buffer Mask { uint mask_words[]; };
layout(binding = 4) readonly buffer Slopes { float alibi_slopes[]; };
layout(binding = 5) readonly buffer KvLen { uint kv_len_words[]; };
layout(binding = 6) buffer Out { T o[]; };  // read back with resume
layout(binding = 7) buffer Lse { float lse[]; };  // read back with resume

layout(push_constant) uniform Push {
    uint q_off, k_off, v_off, o_off, lse_off, mask_off, slopes_off, kv_len_off;
    uint heads, kv_heads, q_len, kv_len;
    uint kv_stride;    // rows per (batch, kv head) in K/V: kv_len, or the cache capacity
    uint mask_stride;  // mask elements per batch row
    int q_offset;      // absolute position of query 0; negative: kv_len - q_len
    uint window;       // sliding window (0: none)
    float scale, softcap;
    uint key_lo, key_hi, resume;  // this dispatch's keys (SPLITS == 1)
};

#include "attention_score.glsl"

layout(constant_id = 8) const bool KV_LEN_FROM_BUFFER = false;
layout(local_size_x_id = 9) in;
layout(constant_id = 10) const uint SPLITS = 1;

shared float q_tile[BLOCK_ROWS * ROW_STRIDE];
shared float kv_tile[BLOCK_COLS * ROW_STRIDE];   // K, then V, of the current key block
shared float p_tile[BLOCK_ROWS * BLOCK_COLS];
shared float row_max_part[THREADS];
shared float row_sum_part[THREADS];

void load_kv_tile(bool values, uint kv_base, uint key0, uint kv_count) {
    for (uint i = gl_LocalInvocationID.x; i < BLOCK_COLS * HEAD_DIM; i += THREADS) {
        uint row = i / HEAD_DIM, d = i % HEAD_DIM;
        float x = 0.0;
        if (key0 + row < kv_count) {
            uint at = kv_base + (key0 + row) * HEAD_DIM + d;
            x = values ? LOAD(v[v_off + at]) : LOAD(k[k_off + at]);
        }
        kv_tile[row * ROW_STRIDE + d] = x;
    }
}

void main() {
    const uint q0 = SPLITS > 1u ? 0u : gl_WorkGroupID.x * BLOCK_ROWS, head = gl_WorkGroupID.y, batch = gl_WorkGroupID.z;
    const uint tid = gl_LocalInvocationID.x, row = tid / LANES, lane = tid % LANES;
    const uint kv_count = KV_LEN_FROM_BUFFER ? kv_len_words[kv_len_off] : kv_len;
    const int q_base = q_offset < 0 ? int(kv_count) - int(q_len) : q_offset;
    const uint kv_head = head / (heads / kv_heads);
    const uint q_row_base = (batch * heads + head) * q_len;
    const uint kv_base = (batch * kv_heads + kv_head) * kv_stride * HEAD_DIM;
    const uint qi = q0 + row;
    const bool row_valid = qi < q_len;
    const int qpos = q_base + int(qi);

    for (uint i = tid; i < BLOCK_ROWS * HEAD_DIM; i += THREADS) {
        uint r = i / HEAD_DIM, d = i % HEAD_DIM;
        q_tile[r * ROW_STRIDE + d] = q0 + r < q_len ? LOAD(q[q_off + (q_row_base + q0 + r) * HEAD_DIM + d]) : 0.0;
    }

    // Keys any row of this block can see: causal ends at the last row's position,
    // the window starts at the first row's position - window + 1.
    const int first_pos = q_base + int(q0), last_pos = q_base + int(min(q0 + BLOCK_ROWS, q_len)) - 1;
    uint key_end = CAUSAL ? uint(clamp(last_pos + 1, 0, int(kv_count))) : kv_count;
    uint key_begin = window > 0u ? uint(clamp(first_pos - int(window) + 1, 0, int(key_end))) : 0u;
    key_begin -= key_begin % BLOCK_COLS;
    if (SPLITS > 1u) {  // this workgroup's slice, in whole tiles
        uint tiles_per_split = (key_end - key_begin + BLOCK_COLS * SPLITS - 1u) / (BLOCK_COLS * SPLITS);
        key_begin = min(key_end, key_begin + gl_WorkGroupID.x * tiles_per_split * BLOCK_COLS);
        key_end = min(key_end, key_begin + tiles_per_split * BLOCK_COLS);
    }

    if (SPLITS == 1u) {  // key_lo is a whole number of tiles
        key_begin = max(key_begin, key_lo);
        key_end = min(key_end, key_hi);
    }

    float running_max = NEG_INF, running_sum = 0.0;
    float acc[DIMS_PER_LANE];
    for (uint t = 0; t < DIMS_PER_LANE; ++t) acc[t] = 0.0;
    if (resume != 0u && row_valid) {
        float before = lse[lse_off + q_row_base + qi];
        if (before != NEG_INF) {  // -inf: no key seen yet, nothing to resume
            running_max = before;
            running_sum = 1.0;
            for (uint t = 0; t < DIMS_PER_LANE; ++t)
                acc[t] = LOAD(o[o_off + (q_row_base + qi) * HEAD_DIM + lane + t * LANES]);
        }
    }
    barrier();  // lane 0 overwrites the lse that every lane of its row read

    for (uint key0 = key_begin; key0 < key_end; key0 += BLOCK_COLS) {
        barrier();  // the previous tile's V and p are no longer read
        load_kv_tile(false, kv_base, key0, kv_count);
        barrier();

        float s[COLS_PER_LANE];
        for (uint u = 0; u < COLS_PER_LANE; ++u) s[u] = 0.0;
        for (uint d = 0; d < HEAD_DIM; ++d) {
            float qd = q_tile[row * ROW_STRIDE + d];
            for (uint u = 0; u < COLS_PER_LANE; ++u) s[u] += qd * kv_tile[(lane + u * LANES) * ROW_STRIDE + d];
        }
        float tile_max = NEG_INF;
        for (uint u = 0; u < COLS_PER_LANE; ++u) {
            uint kpos = key0 + lane + u * LANES;
            float slope;
            s[u] = row_valid && kpos < kv_count && key_visible(qpos, kpos, batch)
                 ? attention_score(s[u], qpos, kpos, head, slope) : NEG_INF;
            tile_max = max(tile_max, s[u]);
        }
        row_max_part[tid] = tile_max;
        barrier();

        float new_max = running_max;
        for (uint j = 0; j < LANES; ++j) new_max = max(new_max, row_max_part[row * LANES + j]);
        // Everything masked so far: subtract 0 so that exp(-inf - m) is 0, never NaN.
        float shift = new_max == NEG_INF ? 0.0 : new_max;
        float part = 0.0;
        for (uint u = 0; u < COLS_PER_LANE; ++u) {
            float p = exp(s[u] - shift);
            p_tile[row * BLOCK_COLS + lane + u * LANES] = p;
            part += p;
        }
        row_sum_part[tid] = part;
        barrier();  // scores are done with K: V may overwrite it
        load_kv_tile(true, kv_base, key0, kv_count);
        barrier();

        float tile_sum = 0.0;
        for (uint j = 0; j < LANES; ++j) tile_sum += row_sum_part[row * LANES + j];
        float rescale = exp(running_max - shift);
        running_sum = running_sum * rescale + tile_sum;
        running_max = new_max;
        for (uint t = 0; t < DIMS_PER_LANE; ++t) acc[t] *= rescale;
        for (uint c = 0; c < BLOCK_COLS; ++c) {
            float p = p_tile[row * BLOCK_COLS + c];
            for (uint t = 0; t < DIMS_PER_LANE; ++t) acc[t] += p * kv_tile[c * ROW_STRIDE + lane + t * LANES];
        }
    }

    if (!row_valid) return;
    if (SPLITS > 1u) {
        uint at = lse_off + ((batch * heads + head) * SPLITS + gl_WorkGroupID.x) * (HEAD_DIM + 2u);
        for (uint t = 0; t < DIMS_PER_LANE; ++t) lse[at + lane + t * LANES] = acc[t];
        if (lane == 0u) { lse[at + HEAD_DIM] = running_max; lse[at + HEAD_DIM + 1u] = running_sum; }
        return;
    }
    // A row that sees no key at all gets output 0 and lse -inf.
    float inv = running_sum > 0.0 ? 1.0 / running_sum : 0.0;
    for (uint t = 0; t < DIMS_PER_LANE; ++t)
        o[o_off + (q_row_base + qi) * HEAD_DIM + lane + t * LANES] = STORE(acc[t] * inv);
    if (lane == 0u)
        lse[lse_off + q_row_base + qi] = running_sum > 0.0 ? running_max + log(running_sum) : NEG_INF;
}
