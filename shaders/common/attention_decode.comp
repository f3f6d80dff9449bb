// Decode attention: one new query per sequence against a KV cache, for HEADS query heads that share
// one KV head (GQA/MQA), so each key and value row is read once for all of them.
// Workgroup (x: slice of the cache, y: group of HEADS query heads, z: batch) streams tiles of KEYS
// keys with an online softmax:
//   scores: thread t scores key t of the tile against every head (its K row read as 16-byte vectors);
//   p @ V:  thread t owns vector t % VECTORS of a V row and walks rows t / VECTORS, + KEY_STEP, ...;
//           the partial sums of the threads that own one vector are added up at the end.
// SPLITS > 1 divides the keys among workgroups (flash-decoding): each writes its unnormalised output,
// running max and sum to the float32 `lse` binding and attention_decode_combine.comp merges them.
// The bindings, push constants and specialization constants are attention_fwd.comp's, except that K
// and V are read as raw 16-byte words (head_dim and the K/V offsets whole vectors: the launcher checks).
// PAGE_SIZE > 0: a paged cache. K and V are pools of blocks [blocks, kv_heads, PAGE_SIZE, head_dim] and each
// sequence's block table (kv_stride entries: its logical block j -> a pool block) follows kv_len in the
// kv_len buffer; key positions (and the mask, mask_stride per row) stay logical. Tiles wholly in the scratch block
// (masked padding) are skipped.
//! variant f32 -DT_F32
//! variant f16 -DT_F16
//! variant bf16 -DT_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "attention_common.glsl"
#if defined(T_F32)
#define VECTOR_F32
#elif defined(T_F16)
#define VECTOR_F16
#endif
#include "vector16.glsl"

layout(binding = 0) readonly buffer Q { T q[]; };
layout(binding = 1) readonly buffer K { uvec4 k_words[]; };
layout(binding = 2) readonly buffer V { uvec4 v_words[]; };
layout(binding = 3) readonly buffer Mask { uint mask_words[]; };
layout(binding = 4) readonly buffer Slopes { float alibi_slopes[]; };
layout(binding = 5) readonly buffer KvLen { uint kv_len_words[]; };
layout(binding = 6) writeonly buffer Out { T o[]; };
layout(binding = 7) writeonly buffer Lse { float lse[]; };

layout(push_constant) uniform Push {
    uint q_off, k_off, v_off, o_off, lse_off, mask_off, slopes_off, kv_len_off;
    uint heads, kv_heads, q_len, kv_len;
    uint kv_stride;    // rows per (batch, kv head): the cache capacity; paged: block table entries per sequence
    uint mask_stride;
    int q_offset;      // negative: the query sits at kv_len - 1
    uint window;
    float scale, softcap;
};

#include "attention_score.glsl"

layout(constant_id = 8) const bool KV_LEN_FROM_BUFFER = false;
layout(local_size_x_id = 9) in;  // = BLOCK_COLS
layout(constant_id = 10) const uint SPLITS = 1;
layout(constant_id = 11) const uint PAGE_SIZE = 0;

const uint HEADS = BLOCK_ROWS;                  // query heads of this workgroup
const uint KEYS = BLOCK_COLS;                   // keys per tile = threads
const uint VECTORS = HEAD_DIM / PER_VECTOR;     // 16-byte vectors per K/V row (<= KEYS)
const uint KEY_STEP = KEYS / VECTORS;           // V rows the threads cover at once
const uint V_BATCH = 8;                         // V rows a thread loads at once

shared vec4 q_tile[HEADS * HEAD_DIM / 4];
shared float p_tile[HEADS * KEYS];
shared float max_part[HEADS * KEYS];            // per subgroup (at most KEYS of them)
shared float sum_part[HEADS * KEYS];
shared vec4 sum_tile[KEYS * VECS];              // the final reduction of one head's output

// Thread `owned` (< VECTORS) adds up its vector of one head's output and stores it: normalised into `o`
// (and the row's logsumexp), or with SPLITS > 1 unnormalised with the running max and sum.
void store_head(uint row, uint split, uint owned, float running_max, float running_sum) {
    Vector total;
    [[unroll]] for (uint j = 0; j < VECS; ++j) {
        total.v[j] = vec4(0.0);
        [[unroll]] for (uint r = 0; r < KEY_STEP; ++r) total.v[j] += sum_tile[(r * VECTORS + owned) * VECS + j];
    }
    if (SPLITS > 1u) {
        uint at = lse_off + (row * SPLITS + split) * (HEAD_DIM + 2u);
        [[unroll]] for (uint j = 0; j < VECS; ++j)
            [[unroll]] for (uint e = 0; e < 4; ++e) lse[at + owned * PER_VECTOR + j * 4 + e] = total.v[j][e];
        if (owned == 0u) { lse[at + HEAD_DIM] = running_max; lse[at + HEAD_DIM + 1u] = running_sum; }
        return;
    }
    // A row that sees no key at all gets output 0 and lse -inf.
    float inv = running_sum > 0.0 ? 1.0 / running_sum : 0.0;
    [[unroll]] for (uint j = 0; j < VECS; ++j)
        [[unroll]] for (uint e = 0; e < 4; ++e) o[o_off + row * HEAD_DIM + owned * PER_VECTOR + j * 4 + e] = STORE(total.v[j][e] * inv);
    if (owned == 0u) lse[lse_off + row] = running_sum > 0.0 ? running_max + log(running_sum) : NEG_INF;
}

// The row of key `key` of (batch, kv_head) in K and V, in rows of HEAD_DIM elements.
uint key_row(uint batch, uint kv_head, uint key) {
    if (PAGE_SIZE == 0u) return (batch * kv_heads + kv_head) * kv_stride + key;
    uint block = kv_len_words[kv_len_off + 1u + batch * kv_stride + key / PAGE_SIZE];
    return (block * kv_heads + kv_head) * PAGE_SIZE + key % PAGE_SIZE;
}

// Paged: whether keys key0 .. end - 1 of the sequence all sit in the scratch block 0, which holds only masked
// columns (a left-padded row's padding): such a tile adds nothing, and is skipped whole.
bool scratch_tile(uint batch, uint key0, uint end) {
    for (uint j = key0 / PAGE_SIZE; j <= (end - 1u) / PAGE_SIZE; ++j)
        if (kv_len_words[kv_len_off + 1u + batch * kv_stride + j] != 0u) return false;
    return true;
}

void main() {
    const uint split = gl_WorkGroupID.x, head0 = gl_WorkGroupID.y * HEADS, batch = gl_WorkGroupID.z;
    const uint t = gl_LocalInvocationID.x, sg = gl_SubgroupID;
    const uint kv_count = KV_LEN_FROM_BUFFER ? kv_len_words[kv_len_off] : kv_len;
    const int qpos = q_offset < 0 ? int(kv_count) - 1 : q_offset;
    const uint kv_head = head0 / (heads / kv_heads);
    const uint k_base = k_off / PER_VECTOR, v_base = v_off / PER_VECTOR;

    // q rows of the group are contiguous: element i of the group is q[row0 * HEAD_DIM + i]
    const uint q_first = q_off + (batch * heads + head0) * HEAD_DIM;
    [[unroll]] for (uint i0 = 0; i0 < HEADS * HEAD_DIM; i0 += KEYS) {
        uint i = i0 + t;
        if (i < HEADS * HEAD_DIM) q_tile[i / 4][i % 4] = LOAD(q[q_first + i]);
    }

    uint key_end = CAUSAL ? uint(clamp(qpos + 1, 0, int(kv_count))) : kv_count;
    uint key_begin = window > 0u ? uint(clamp(qpos - int(window) + 1, 0, int(key_end))) : 0u;
    key_begin -= key_begin % KEYS;
    if (SPLITS > 1u) {  // this workgroup's slice, in whole tiles
        uint tiles_per_split = (key_end - key_begin + KEYS * SPLITS - 1u) / (KEYS * SPLITS);
        key_begin = min(key_end, key_begin + split * tiles_per_split * KEYS);
        key_end = min(key_end, key_begin + tiles_per_split * KEYS);
    }

    float running_max[HEADS], running_sum[HEADS];
    Vector acc[HEADS];
    [[unroll]] for (uint g = 0; g < HEADS; ++g) {
        running_max[g] = NEG_INF;
        running_sum[g] = 0.0;
        [[unroll]] for (uint j = 0; j < VECS; ++j) acc[g].v[j] = vec4(0.0);
    }
    const uint owned = t % VECTORS, first_row = t / VECTORS;
    const bool pv_thread = t < KEY_STEP * VECTORS;

    for (uint key0 = key_begin; key0 < key_end; key0 += KEYS) {
        // (uniform over the workgroup: its sequence and tile)
        if (PAGE_SIZE > 0u && scratch_tile(batch, key0, min(key0 + KEYS, key_end))) continue;
        barrier();  // q_tile written; the previous tile's p, maxima and sums read
        const uint key = key0 + t, count = min(KEYS, key_end - key0);
        // Every load of the tile's first pass is issued before any is used (the tile costs round trips to
        // memory, not arithmetic): this thread's K row, and its first V_BATCH rows of V for the p @ V pass.
        uvec4 k_row[VECTORS], v_rows[V_BATCH];
        [[unroll]] for (uint vi = 0; vi < VECTORS; ++vi)
            k_row[vi] = k_words[k_base + key_row(batch, kv_head, min(key, key_end - 1u)) * VECTORS + vi];
        [[unroll]] for (uint i = 0; i < V_BATCH; ++i)
            v_rows[i] = v_words[v_base + key_row(batch, kv_head, key0 + min(first_row + i * KEY_STEP, count - 1u)) * VECTORS
                                + owned];
        float s[HEADS];
        [[unroll]] for (uint g = 0; g < HEADS; ++g) s[g] = 0.0;
        [[unroll]] for (uint vi = 0; vi < VECTORS; ++vi) {
            Vector kv = decode(k_row[vi]);
            [[unroll]] for (uint g = 0; g < HEADS; ++g)
                [[unroll]] for (uint j = 0; j < VECS; ++j) s[g] += dot(kv.v[j], q_tile[(g * HEAD_DIM) / 4 + vi * VECS + j]);
        }
        const bool visible = key < key_end && key_visible(qpos, key, batch);
        [[unroll]] for (uint g = 0; g < HEADS; ++g) {
            float slope;
            s[g] = visible ? attention_score(s[g], qpos, key, head0 + g, slope) : NEG_INF;
            float m = subgroupMax(s[g]);
            if (subgroupElect()) max_part[g * KEYS + sg] = m;
        }
        barrier();
        float rescale[HEADS];
        [[unroll]] for (uint g = 0; g < HEADS; ++g) {
            float new_max = running_max[g];
            for (uint j = 0; j < gl_NumSubgroups; ++j) new_max = max(new_max, max_part[g * KEYS + j]);
            float shift = new_max == NEG_INF ? 0.0 : new_max;  // all masked so far: exp(-inf) = 0, never NaN
            float p = exp(s[g] - shift);
            p_tile[g * KEYS + t] = p;
            float part = subgroupAdd(p);
            if (subgroupElect()) sum_part[g * KEYS + sg] = part;
            rescale[g] = exp(running_max[g] - shift);
            running_max[g] = new_max;
        }
        barrier();
        [[unroll]] for (uint g = 0; g < HEADS; ++g) {
            float tile_sum = 0.0;
            for (uint j = 0; j < gl_NumSubgroups; ++j) tile_sum += sum_part[g * KEYS + j];
            running_sum[g] = running_sum[g] * rescale[g] + tile_sum;
            [[unroll]] for (uint j = 0; j < VECS; ++j) acc[g].v[j] *= rescale[g];
        }
        if (pv_thread) {
            for (uint c0 = first_row; c0 < count; c0 += KEY_STEP * V_BATCH) {
                if (c0 != first_row)  // the next batch of rows, all loads before any use
                    [[unroll]] for (uint i = 0; i < V_BATCH; ++i)
                        v_rows[i] = v_words[v_base + key_row(batch, kv_head, key0 + min(c0 + i * KEY_STEP, count - 1u))
                                            * VECTORS + owned];
                [[unroll]] for (uint i = 0; i < V_BATCH; ++i) {
                    uint c = c0 + i * KEY_STEP;
                    if (c >= count) break;
                    Vector vv = decode(v_rows[i]);
                    [[unroll]] for (uint g = 0; g < HEADS; ++g) {
                        float p = p_tile[g * KEYS + c];
                        [[unroll]] for (uint j = 0; j < VECS; ++j) acc[g].v[j] += p * vv.v[j];
                    }
                }
            }
        }
    }

    [[unroll]] for (uint g = 0; g < HEADS; ++g) {  // add up the threads that own one vector, head by head
        barrier();
        if (pv_thread) [[unroll]] for (uint j = 0; j < VECS; ++j) sum_tile[t * VECS + j] = acc[g].v[j];
        barrier();
        if (t < VECTORS) store_head(batch * heads + head0 + g, split, t, running_max[g], running_sum[g]);
    }
}
