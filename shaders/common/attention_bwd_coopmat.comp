// Attention backward, step 2, on cooperative matrices (VK_KHR_cooperative_matrix): the same
// operation, bindings and push constants as attention_bwd.comp, for float16 or bfloat16
// tensors, with float32 scores and accumulators.
//   COMPUTE_DQ = false: a workgroup owns BLOCK_ROWS keys (16 per subgroup, kept with their
//     values as A fragments in registers) and streams tiles of BLOCK_COLS queries of every
//     query head of its kv head: dV += P^T dO, dK += dS^T Q.
//   COMPUTE_DQ = true: a workgroup owns BLOCK_ROWS queries (and their rows of dO) and streams
//     key tiles: dQ += dS K.
// Per tile a subgroup computes A1 B1^T (= q.k) and A2 B2^T (= dO.v) for its 16 owned rows,
// stores both to shared memory, and its lanes (SUBGROUP_SIZE / 16 per row) apply the score
// rule (attention_score.glsl, as the scalar kernel): P = exp(score - lse),
// dS = P * (dO.v - delta) * (softcap's tanh derivative). P and dS go back to shared memory in
// the storage type (as flash attention rounds them) and are multiplied by the streamed tiles.
//
// REG_SOFTMAX (TUNING; where the device's accumulator layout allows it, as attention_fwd_coopmat.comp): q.k
// and dO.v stay in their accumulators; each lane computes P and dS for its elements (their rows and columns
// known from a matrix of indices loaded once). P_IN_REGS: P and dS become A operands element by element, else they
// go through this subgroup's shared memory once (stored from the accumulators, rounded to 16 bits, loaded as A).
//
// DOUBLE_BUFFER (TUNING): two buffers of streamed tiles; each thread loads its part of the next tiles into registers
// before the current ones are used and stores them into the other buffer after, so one workgroup barrier per tile
// instead of two, and the loads' latency hides behind the products.
//
// bfloat16: as attention_fwd_coopmat.comp, 16-bit floats appear only as the element type of
// the matrices (and conversions to it); the build step rewrites that type for the bf16 variant.
//! target vulkan1.3
//! variant f16 -DT_F16
//! variant bf16 -DT_BF16
//! postprocess bf16 ../../tools/spirv_bf16.py
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#define ATTENTION_BITS_ONLY
#include "attention_common.glsl"

layout(binding = 0) readonly buffer Q { uvec4 q[]; };
layout(binding = 1) readonly buffer K { uvec4 k[]; };
layout(binding = 2) readonly buffer V { uvec4 v[]; };
layout(binding = 3) readonly buffer DOut { uvec4 d_o[]; };
layout(binding = 4) readonly buffer Lse { float lse[]; };
layout(binding = 5) readonly buffer Delta { float delta[]; };
layout(binding = 6) readonly buffer Mask { uint mask_words[]; };
layout(binding = 7) readonly buffer Slopes { float alibi_slopes[]; };
// dK/dV pass: dK, dV. dQ pass: dQ twice (the second binding is never written).
layout(binding = 8) writeonly buffer Grad1 { uint16_t grad1[]; };
layout(binding = 9) writeonly buffer Grad2 { uint16_t grad2[]; };

layout(push_constant) uniform Push {
    uint q_off, k_off, v_off, d_o_off, lse_off, mask_off, slopes_off, grad1_off, grad2_off;  // q/k/v/d_o: multiples of 8
    uint heads, kv_heads, q_len, kv_len, mask_stride;
    int q_offset;
    uint window;
    float scale, softcap;
};

#include "attention_score.glsl"

layout(constant_id = 8) const bool COMPUTE_DQ = false;
layout(local_size_x_id = 9) in;
layout(constant_id = 10) const uint SUBGROUP_SIZE = 32;
layout(constant_id = 11) const uint TUNING = 0;  // bits: REG_SOFTMAX, P_IN_REGS, DOUBLE_BUFFER (as the forward's)
// The accumulators' layout (REG_SOFTMAX; coopmat_layout.glsl).
layout(constant_id = 12) const uint ROW_SLOTS = 1;
layout(constant_id = 13) const uint ROW_LANE_MASK = 0;
layout(constant_id = 14) const uint SLOT_WORD0 = 0;
layout(constant_id = 15) const uint SLOT_WORD1 = 0;
layout(constant_id = 16) const uint SLOT_WORD2 = 0;
layout(constant_id = 17) const uint SLOT_WORD3 = 0;
#include "coopmat_layout.glsl"
const uint REG_SOFTMAX = 8, P_IN_REGS = 16, DOUBLE_BUFFER = 32;
const bool REG = (TUNING & REG_SOFTMAX) != 0u;
const bool P_REGS = REG ? (TUNING & P_IN_REGS) != 0u : false;
const bool DOUBLE = (TUNING & DOUBLE_BUFFER) != 0u;
// (Sizes from integer bits only: glslang misorders spec-constant selects on booleans.)
const uint BUFFERS = 1 + ((TUNING / DOUBLE_BUFFER) & 1u);
#define POS_INF uintBitsToFloat(0x7F800000u)

// to_bits: a float as the storage type's bits (round to nearest even). operand_value: the value those bits hold, as
// a float, so that converting it to an A operand's element is exact whatever rounding the driver's conversion uses
// (SPIR-V leaves that to the implementation): P and dS round as they do through shared memory.
#if defined(T_F16)
uint to_bits(float x) { return packHalf2x16(vec2(x, 0.0)) & 0xFFFFu; }
float operand_value(float x) { return unpackHalf2x16(to_bits(x)).x; }
#else
uint to_bits(float x) { return uint(f32_to_bf16(x)); }
float operand_value(float x) { return uintBitsToFloat(to_bits(x) << 16); }
#endif

const uint D_FRAGS = HEAD_DIM / 16, C_FRAGS = BLOCK_COLS / 16;
const uint ROW_WORDS = HEAD_DIM / 8;               // uvec4s of data per row of q/k/v/dO
const uint PITCH = ROW_WORDS + 1;                  // per staged row (8 halves of padding)
const uint LANES_PER_ROW = SUBGROUP_SIZE >= 16 ? SUBGROUP_SIZE / 16 : 1;  // REG runs with fewer
const uint SCORES_PER_LANE = BLOCK_COLS / LANES_PER_ROW;  // a multiple of 8
const uint S_WORDS = 16 * BLOCK_COLS / 4;          // one subgroup's 16 x BLOCK_COLS floats, in uvec4s
const uint P_PITCH = BLOCK_COLS / 8 + 1;           // uvec4s per row of 16-bit P or dS
// (REG with P_IN_REGS: only the output blocks, 16 x 16 floats; the index matrix before the loop.)
const uint P_REGS_BIT = (TUNING / REG_SOFTMAX) & (TUNING / P_IN_REGS) & 1u;
const uint SG_WORDS = P_REGS_BIT * 64 + (1 - P_REGS_BIT) * (2 * S_WORDS + 2 * 16 * P_PITCH);
// Streamed tile 1 at 0, tile 2 at STREAM2 (DOUBLE: the second buffer from TILE_WORDS); before the loop the owned
// rows are staged here in turn.
const uint STREAM2 = BLOCK_COLS * PITCH, TILE_WORDS = 2 * BLOCK_COLS * PITCH;
shared uvec4 tiles[BUFFERS * TILE_WORDS];
shared uvec4 scratch[(BLOCK_ROWS / 16) * SG_WORDS];  // per subgroup: q.k, dO.v (float), P, dS (16-bit)
shared float stream_lse[BUFFERS * BLOCK_COLS];       // dK/dV pass: per streamed query (DOUBLE: per buffer)
shared float stream_delta[BUFFERS * BLOCK_COLS];
// DOUBLE: a streamed tile is TILE_CHUNKS uvec4s, CHUNKS_PER_THREAD of them per thread; and COLS_PER_THREAD values of
// lse and delta.
const uint WG_THREADS = (BLOCK_ROWS / 16) * SUBGROUP_SIZE;
const uint TILE_CHUNKS = BLOCK_COLS * ROW_WORDS, CHUNKS_PER_THREAD = (TILE_CHUNKS + WG_THREADS - 1) / WG_THREADS;
const uint COLS_PER_THREAD = (BLOCK_COLS + WG_THREADS - 1) / WG_THREADS;

// Rows [row0, row0 + count) of the [.., HEAD_DIM] rows at uvec4 `base` into tiles[at..]; zeros from row `rows` on.
#define STAGE(at, src, base, row0, count, rows)                                                   \
    for (uint i = gl_LocalInvocationID.x; i < (count) * ROW_WORDS; i += gl_WorkGroupSize.x) {     \
        uint r = i / ROW_WORDS, c = i % ROW_WORDS;                                                \
        tiles[(at) + r * PITCH + c] = (row0) + r < (rows) ? src[(base) + ((row0) + r) * ROW_WORDS + c] : uvec4(0); \
    }

// DOUBLE: the same rows into this thread's registers `regs`, every load issued before any is used ...
#define FETCH(regs, src, base, row0, rows)                                                        \
    [[unroll]] for (uint l = 0; l < CHUNKS_PER_THREAD; ++l) {                                     \
        uint i = gl_LocalInvocationID.x + l * WG_THREADS, r = i / ROW_WORDS, c = i % ROW_WORDS;   \
        regs[l] = i < TILE_CHUNKS && (row0) + r < (rows) ? src[(base) + ((row0) + r) * ROW_WORDS + c] : uvec4(0); \
    }
// ... and from them into tiles[at..].
#define PUT(at, regs)                                                                             \
    [[unroll]] for (uint l = 0; l < CHUNKS_PER_THREAD; ++l) {                                     \
        uint i = gl_LocalInvocationID.x + l * WG_THREADS;                                         \
        if (i < TILE_CHUNKS) tiles[(at) + i / ROW_WORDS * PITCH + i % ROW_WORDS] = regs[l];       \
    }
// The dK/dV pass's lse (REG: +inf for a query that sees no key, so that P = exp(score - inf) = 0) and delta of the
// streamed queries [col0, col0 + BLOCK_COLS) of the rows at q_rows, into buffer `at` of stream_lse and stream_delta.
#define STAGE_LSE(at, q_rows, col0)                                                               \
    for (uint i = gl_LocalInvocationID.x; i < BLOCK_COLS; i += WG_THREADS) {                      \
        bool valid = (col0) + i < q_len;                                                          \
        const float x = valid ? lse[lse_off + (q_rows) + (col0) + i] : NEG_INF;                  \
        stream_lse[(at) + i] = REG && x == NEG_INF ? POS_INF : x;                                 \
        stream_delta[(at) + i] = valid ? delta[(q_rows) + (col0) + i] : 0.0;                      \
    }

void main() {
    const uint block0 = gl_WorkGroupID.x * BLOCK_ROWS, head_or_kv = gl_WorkGroupID.y, batch = gl_WorkGroupID.z;
    const uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint group = heads / kv_heads;
    const int q_base = q_offset < 0 ? int(kv_len) - int(q_len) : q_offset;
    // This lane's owned row (of the subgroup's 16) and its columns of each streamed tile.
    const uint my_row = lane / LANES_PER_ROW, my_col0 = (lane % LANES_PER_ROW) * SCORES_PER_LANE;
    const uint sg_row0 = block0 + sg * 16, own = sg_row0 + my_row;
    const uint s_base = sg * SG_WORDS, dp_base = s_base + S_WORDS, p_base = dp_base + S_WORDS;
    const uint ds_base = p_base + 16 * P_PITCH;

    // Owned rows: (q, dO) or (k, v), as A fragments.
    uint kv_head, head_first, head_count, stream_begin, stream_end, own_count, own_base;
    float own_lse = NEG_INF, own_delta = 0.0;
    // (One declarator per declaration: glslang drops the matrix use from a second one.)
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> own1[D_FRAGS];
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> own2[D_FRAGS];
    if (COMPUTE_DQ) {
        const uint head = head_or_kv;
        kv_head = head / group; head_first = head; head_count = 1u; own_count = q_len;
        own_base = (batch * heads + head) * q_len;
        STAGE(0, q, q_off / 8 + own_base * ROW_WORDS, block0, BLOCK_ROWS, q_len)
        barrier();
        [[unroll]] for (uint d = 0; d < D_FRAGS; ++d)
            coopMatLoad(own1[d], tiles, sg * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
        barrier();
        STAGE(0, d_o, d_o_off / 8 + own_base * ROW_WORDS, block0, BLOCK_ROWS, q_len)
        barrier();
        [[unroll]] for (uint d = 0; d < D_FRAGS; ++d)
            coopMatLoad(own2[d], tiles, sg * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
        if (own < q_len) { own_lse = lse[lse_off + own_base + own]; own_delta = delta[own_base + own]; }
        const int first_pos = q_base + int(block0), last_pos = q_base + int(min(block0 + BLOCK_ROWS, q_len)) - 1;
        stream_end = CAUSAL ? uint(clamp(last_pos + 1, 0, int(kv_len))) : kv_len;
        stream_begin = window > 0u ? uint(clamp(first_pos - int(window) + 1, 0, int(stream_end))) : 0u;
    } else {
        kv_head = head_or_kv; head_first = kv_head * group; head_count = group; own_count = kv_len;
        own_base = (batch * kv_heads + kv_head) * kv_len;
        STAGE(0, k, k_off / 8 + own_base * ROW_WORDS, block0, BLOCK_ROWS, kv_len)
        barrier();
        [[unroll]] for (uint d = 0; d < D_FRAGS; ++d)
            coopMatLoad(own1[d], tiles, sg * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
        barrier();
        STAGE(0, v, v_off / 8 + own_base * ROW_WORDS, block0, BLOCK_ROWS, kv_len)
        barrier();
        [[unroll]] for (uint d = 0; d < D_FRAGS; ++d)
            coopMatLoad(own2[d], tiles, sg * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
        // Queries that can see a key of this block: causal needs pos >= first key, the window pos < last key + window.
        const int last_key = int(min(block0 + BLOCK_ROWS, kv_len)) - 1;
        stream_begin = CAUSAL ? uint(clamp(int(block0) - q_base, 0, int(q_len))) : 0u;
        stream_end = window > 0u ? uint(clamp(last_key + int(window) - q_base, int(stream_begin), int(q_len))) : q_len;
    }
    stream_begin -= stream_begin % BLOCK_COLS;

    // REG: the row (of the subgroup's 16) of each of this lane's slots, the column of each of its elements, from the
    // matrix of element indices; the dQ pass also each slot's lse (+inf where the query sees no key: P = 0) and delta.
    uint slot_row[ROW_SLOTS], col_word[COL_WORDS];
    float slot_lse[ROW_SLOTS], slot_delta[ROW_SLOTS];
    if (REG) {
        for (uint i = lane; i < 64u; i += SUBGROUP_SIZE)
            scratch[s_base + i] = floatBitsToUint(vec4(4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3));
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> index_matrix;
        coopMatLoad(index_matrix, scratch, s_base, 4, gl_CooperativeMatrixLayoutRowMajor);
        COOPMAT_LAYOUT_DECODE(index_matrix, slot_row, col_word)
        subgroupBarrier();
        [[unroll]] for (uint r = 0; r < ROW_SLOTS; ++r) {
            const uint row = sg_row0 + slot_row[r];
            const float x = COMPUTE_DQ && row < q_len ? lse[lse_off + own_base + row] : NEG_INF;
            slot_lse[r] = x == NEG_INF ? POS_INF : x;
            slot_delta[r] = COMPUTE_DQ && row < q_len ? delta[own_base + row] : 0.0;
        }
    }

    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc1[D_FRAGS];
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc2[D_FRAGS];
    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
        acc1[d] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
        acc2[d] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    }

    const uint kv_rows = (batch * kv_heads + kv_head) * kv_len;
    uint at = 0u, lse_at = 0u;  // the buffer of the current tiles (DOUBLE: 0 or TILE_WORDS) and of its lse, delta
    if (DOUBLE && stream_begin < stream_end) {  // the first tiles, straight into buffer 0
        barrier();  // the owned rows are no longer read
        const uint q_rows = (batch * heads + head_first) * q_len;
        if (COMPUTE_DQ) {
            STAGE(0, k, k_off / 8 + kv_rows * ROW_WORDS, stream_begin, BLOCK_COLS, kv_len)
            STAGE(STREAM2, v, v_off / 8 + kv_rows * ROW_WORDS, stream_begin, BLOCK_COLS, kv_len)
        } else {
            STAGE(0, q, q_off / 8 + q_rows * ROW_WORDS, stream_begin, BLOCK_COLS, q_len)
            STAGE(STREAM2, d_o, d_o_off / 8 + q_rows * ROW_WORDS, stream_begin, BLOCK_COLS, q_len)
            STAGE_LSE(0, q_rows, stream_begin)
        }
        barrier();
    }
    for (uint head = head_first; head < head_first + head_count; ++head) {
        const uint q_rows = (batch * heads + head) * q_len;
        for (uint col0 = stream_begin; col0 < stream_end; col0 += BLOCK_COLS) {
            if (!DOUBLE) {
                barrier();  // the previous tiles (or the owned rows) are no longer read
                if (COMPUTE_DQ) {
                    STAGE(0, k, k_off / 8 + kv_rows * ROW_WORDS, col0, BLOCK_COLS, kv_len)
                    STAGE(STREAM2, v, v_off / 8 + kv_rows * ROW_WORDS, col0, BLOCK_COLS, kv_len)
                } else {
                    STAGE(0, q, q_off / 8 + q_rows * ROW_WORDS, col0, BLOCK_COLS, q_len)
                    STAGE(STREAM2, d_o, d_o_off / 8 + q_rows * ROW_WORDS, col0, BLOCK_COLS, q_len)
                    STAGE_LSE(0, q_rows, col0)
                }
                barrier();
            }
            // DOUBLE: the next tiles (this head's next columns, else the next head's first) into registers now.
            const bool last_col = col0 + BLOCK_COLS >= stream_end;
            const uint next_col = last_col ? stream_begin : col0 + BLOCK_COLS;
            const uint next_q_rows = last_col ? q_rows + q_len : q_rows;  // (the next head's rows follow)
            const bool more = DOUBLE && !(last_col && head + 1u == head_first + head_count);
            uvec4 next1[CHUNKS_PER_THREAD], next2[CHUNKS_PER_THREAD];
            float next_lse[COLS_PER_THREAD], next_delta[COLS_PER_THREAD];
            if (more) {
                if (COMPUTE_DQ) {
                    FETCH(next1, k, k_off / 8 + kv_rows * ROW_WORDS, next_col, kv_len)
                    FETCH(next2, v, v_off / 8 + kv_rows * ROW_WORDS, next_col, kv_len)
                } else {
                    FETCH(next1, q, q_off / 8 + next_q_rows * ROW_WORDS, next_col, q_len)
                    FETCH(next2, d_o, d_o_off / 8 + next_q_rows * ROW_WORDS, next_col, q_len)
                    [[unroll]] for (uint l = 0; l < COLS_PER_THREAD; ++l) {
                        const uint i = gl_LocalInvocationID.x + l * WG_THREADS;
                        const bool valid = i < BLOCK_COLS && next_col + i < q_len;
                        next_lse[l] = valid ? lse[lse_off + next_q_rows + next_col + i] : NEG_INF;
                        next_delta[l] = valid ? delta[next_q_rows + next_col + i] : 0.0;
                    }
                }
            }
          // (A `continue` below leaves this block, not the loop: DOUBLE still stores the next tiles.)
          do {
            // Uniform per subgroup: a tile none of whose (query, key) pairs is visible (causal, window).
            if (COMPUTE_DQ) {
                const int first = q_base + int(sg_row0), last = first + 15;  // owned query positions
                if ((CAUSAL && int(col0) > last) || (window > 0u && int(col0 + BLOCK_COLS) <= first - int(window) + 1))
                    continue;
            } else {
                const int first = q_base + int(col0), last = first + int(BLOCK_COLS) - 1;  // streamed query positions
                if ((CAUSAL && last < int(sg_row0)) || (window > 0u && first - int(sg_row0 + 15) >= int(window)))
                    continue;
            }

            if (REG) {  // P and dS on the accumulators' elements
                coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> sc[C_FRAGS];
                coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> dp[C_FRAGS];
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                    sc[c] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
                    dp[c] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
                    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
                        coopMatLoad(b, tiles, at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutColumnMajor);
                        sc[c] = coopMatMulAdd(own1[d], b, sc[c]);
                        coopMatLoad(b, tiles, at + STREAM2 + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutColumnMajor);
                        dp[c] = coopMatMulAdd(own2[d], b, dp[c]);
                    }
                }
                // Every (query, key) pair of the tile visible (no per-element checks)?
                const int own_first = int(sg_row0), col_first = int(col0);
                const bool checks = HAS_MASK || (COMPUTE_DQ
                    ? sg_row0 + 16 > q_len || col0 + BLOCK_COLS > kv_len
                      || (CAUSAL && col_first + int(BLOCK_COLS) - 1 > q_base + own_first)
                      || (window > 0u && col_first <= q_base + own_first + 15 - int(window))
                    : sg_row0 + 16 > kv_len || col0 + BLOCK_COLS > q_len
                      || (CAUSAL && q_base + col_first < own_first + 15)
                      || (window > 0u && q_base + col_first + int(BLOCK_COLS) - 1 - own_first >= int(window)));
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> pf[C_FRAGS];
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> dsf[C_FRAGS];
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                    [[unroll]] for (uint i = 0; i < ACC_ELEMS; ++i) {
                        const uint r = slot_of(i), col = c * 16 + COOPMAT_COL(col_word, i);
                        const uint qi = COMPUTE_DQ ? sg_row0 + slot_row[r] : col0 + col;
                        const uint kpos = COMPUTE_DQ ? col0 + col : sg_row0 + slot_row[r];
                        const float row_lse = COMPUTE_DQ ? slot_lse[r] : stream_lse[lse_at + col];
                        const float row_delta = COMPUTE_DQ ? slot_delta[r] : stream_delta[lse_at + col];
                        const int qpos = q_base + int(qi);
                        float p = 0.0, ds = 0.0;
                        if (!checks || (qi < q_len && kpos < kv_len && key_visible(qpos, kpos, batch))) {
                            float cap_slope;
                            p = exp(attention_score(sc[c][i], qpos, kpos, head, cap_slope) - row_lse);
                            ds = p * (dp[c][i] - row_delta) * cap_slope;
                        }
                        if (P_REGS) {
                            pf[c][i] = float16_t(operand_value(p));
                            dsf[c][i] = float16_t(operand_value(ds));
                        } else {
                            sc[c][i] = p;
                            dp[c][i] = ds;
                        }
                    }
                }
                if (!P_REGS) {  // through this subgroup's shared memory: float32, then 16-bit, then A operands
                    [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                        coopMatStore(sc[c], scratch, s_base + c * 4, BLOCK_COLS / 4, gl_CooperativeMatrixLayoutRowMajor);
                        coopMatStore(dp[c], scratch, dp_base + c * 4, BLOCK_COLS / 4, gl_CooperativeMatrixLayoutRowMajor);
                    }
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    for (uint e = lane; e < 16u * (BLOCK_COLS / 8); e += SUBGROUP_SIZE) {  // 8 of row e / (BLOCK_COLS / 8)
                        const uint row = e / (BLOCK_COLS / 8), col = e % (BLOCK_COLS / 8) * 8;
                        [[unroll]] for (uint h = 0; h < 2; ++h) {
                            const uint from = h == 0u ? s_base : dp_base, to = h == 0u ? p_base : ds_base;
                            const vec4 a = uintBitsToFloat(scratch[from + (row * BLOCK_COLS + col) / 4]);
                            const vec4 b = uintBitsToFloat(scratch[from + (row * BLOCK_COLS + col) / 4 + 1]);
                            scratch[to + row * P_PITCH + col / 8] =
                                uvec4(to_bits(a.x) | (to_bits(a.y) << 16), to_bits(a.z) | (to_bits(a.w) << 16),
                                      to_bits(b.x) | (to_bits(b.y) << 16), to_bits(b.z) | (to_bits(b.w) << 16));
                        }
                    }
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                        coopMatLoad(pf[c], scratch, p_base + c * 2, P_PITCH, gl_CooperativeMatrixLayoutRowMajor);
                        coopMatLoad(dsf[c], scratch, ds_base + c * 2, P_PITCH, gl_CooperativeMatrixLayoutRowMajor);
                    }
                }
                // acc1 += dS B1 (dK: dS^T Q, dQ: dS K); dK/dV pass also acc2 += P^T dO. B read row-major.
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
                        coopMatLoad(b, tiles, at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
                        acc1[d] = coopMatMulAdd(dsf[c], b, acc1[d]);
                        if (!COMPUTE_DQ) {
                            coopMatLoad(b, tiles, at + STREAM2 + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
                            acc2[d] = coopMatMulAdd(pf[c], b, acc2[d]);
                        }
                    }
                }
                if (!P_REGS) subgroupBarrier();  // scratch is rewritten by the next tile
                continue;
            }

            // A1 B1^T and A2 B2^T: the streamed rows are the columns of B (B read column-major).
            [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> s =
                    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
                coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> dp =
                    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
                [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
                    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
                    coopMatLoad(b, tiles, at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutColumnMajor);
                    s = coopMatMulAdd(own1[d], b, s);
                    coopMatLoad(b, tiles, at + STREAM2 + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutColumnMajor);
                    dp = coopMatMulAdd(own2[d], b, dp);
                }
                coopMatStore(s, scratch, s_base + c * 4, BLOCK_COLS / 4, gl_CooperativeMatrixLayoutRowMajor);
                coopMatStore(dp, scratch, dp_base + c * 4, BLOCK_COLS / 4, gl_CooperativeMatrixLayoutRowMajor);
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();

            // This lane's P and dS as 16-bit patterns, 8 columns (one uvec4) at a time.
            [[unroll]] for (uint j = 0; j < SCORES_PER_LANE; j += 8) {
                uvec4 p_bits = uvec4(0), ds_bits = uvec4(0);
                [[unroll]] for (uint h = 0; h < 2; ++h) {
                    const uint e0 = my_row * BLOCK_COLS + my_col0 + j + 4 * h;
                    const vec4 raw = uintBitsToFloat(scratch[s_base + e0 / 4]);
                    const vec4 dov = uintBitsToFloat(scratch[dp_base + e0 / 4]);
                    [[unroll]] for (uint t = 0; t < 4; ++t) {
                        const uint col = my_col0 + j + 4 * h + t;
                        const uint qi = COMPUTE_DQ ? own : col0 + col, kpos = COMPUTE_DQ ? col0 + col : own;
                        const float row_lse = COMPUTE_DQ ? own_lse : stream_lse[lse_at + col];
                        const float row_delta = COMPUTE_DQ ? own_delta : stream_delta[lse_at + col];
                        const int qpos = q_base + int(qi);
                        float p = 0.0, ds = 0.0;
                        // lse = -inf marks a query that sees no key: all its gradients are 0.
                        if (qi < q_len && kpos < kv_len && row_lse != NEG_INF && key_visible(qpos, kpos, batch)) {
                            float cap_slope;
                            p = exp(attention_score(raw[t], qpos, kpos, head, cap_slope) - row_lse);
                            ds = p * (dov[t] - row_delta) * cap_slope;
                        }
                        const uint word = 2 * h + t / 2, shift = (t & 1u) * 16u;
                        p_bits[word] |= to_bits(p) << shift;
                        ds_bits[word] |= to_bits(ds) << shift;
                    }
                }
                scratch[p_base + my_row * P_PITCH + (my_col0 + j) / 8] = p_bits;
                scratch[ds_base + my_row * P_PITCH + (my_col0 + j) / 8] = ds_bits;
            }
            subgroupMemoryBarrierShared();
            subgroupBarrier();

            // acc1 += dS B1 (dK: dS^T Q, dQ: dS K); dK/dV pass also acc2 += P^T dO. B read row-major.
            [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> dsf;
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> pf;
                coopMatLoad(dsf, scratch, ds_base + c * 2, P_PITCH, gl_CooperativeMatrixLayoutRowMajor);
                if (!COMPUTE_DQ) coopMatLoad(pf, scratch, p_base + c * 2, P_PITCH, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
                    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
                    coopMatLoad(b, tiles, at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
                    acc1[d] = coopMatMulAdd(dsf, b, acc1[d]);
                    if (!COMPUTE_DQ) {
                        coopMatLoad(b, tiles, at + STREAM2 + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
                        acc2[d] = coopMatMulAdd(pf, b, acc2[d]);
                    }
                }
            }
            subgroupBarrier();  // scratch is rewritten by the next tile
          } while (false);
            if (DOUBLE) {  // the next tiles into the other buffer; one barrier for both buffers' hand-over
                const uint other = TILE_WORDS - at, other_lse = BLOCK_COLS - lse_at;
                if (more) {
                    PUT(other, next1)
                    PUT(other + STREAM2, next2)
                    if (!COMPUTE_DQ) {
                        [[unroll]] for (uint l = 0; l < COLS_PER_THREAD; ++l) {
                            const uint i = gl_LocalInvocationID.x + l * WG_THREADS;
                            if (i < BLOCK_COLS) {
                                stream_lse[other_lse + i] = REG && next_lse[l] == NEG_INF ? POS_INF : next_lse[l];
                                stream_delta[other_lse + i] = next_delta[l];
                            }
                        }
                    }
                }
                barrier();
                at = other;
                lse_at = other_lse;
            }
        }
    }

    // Gradients, 16 x 16 at a time through this subgroup's score space: grad1 = scale * acc1, grad2 = acc2.
#define WRITE_GRAD(acc, grad, grad_off, factor)                                                      \
    subgroupBarrier();                                                                             \
    coopMatStore(acc, scratch, s_base, 4, gl_CooperativeMatrixLayoutRowMajor);                     \
    subgroupMemoryBarrierShared();                                                                 \
    subgroupBarrier();                                                                             \
    for (uint e = lane; e < 256u; e += SUBGROUP_SIZE) {  /* element (e / 16, e % 16) of the block */ \
        if (sg_row0 + e / 16 < own_count)                                                          \
            grad[grad_off + (own_base + sg_row0 + e / 16) * HEAD_DIM + d * 16 + e % 16] =          \
                uint16_t(to_bits((factor) * uintBitsToFloat(scratch[s_base + e / 4][e % 4])));     \
    }
    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
        WRITE_GRAD(acc1[d], grad1, grad1_off, scale)
        if (!COMPUTE_DQ) { WRITE_GRAD(acc2[d], grad2, grad2_off, 1.0) }
    }
}
