// Fused attention forward on cooperative matrices (VK_KHR_cooperative_matrix): the same
// operation, bindings and push constants as attention_fwd.comp, for float16 or bfloat16
// q, k, v, out, with float32 scores, softmax and accumulators.
//
// A workgroup owns BLOCK_ROWS query rows, 16 per subgroup; its subgroups share key and
// value tiles of BLOCK_COLS rows staged in shared memory as raw 16-bit words. Each
// subgroup keeps its slice of q as A fragments in registers.
//
// KHR cooperative matrices do not say which lane holds which element, so the softmax
// cannot run on the accumulators: each 16 x BLOCK_COLS score tile goes to shared memory,
// where the subgroup's lanes apply the score rule and masks (attention_score.glsl, as the
// scalar kernel) with SUBGROUP_SIZE / 16 lanes per row. For the same reason the output
// accumulators cannot be rescaled row by row as an online softmax would, so there are
// two passes over the keys: the first finds each row's maximum and sum, the second
// multiplies the final probabilities (rounded to the storage type) by V. That is 1.5x the
// tensor-core work of one pass, and none of it leaves the tensor cores.
//
// ONE_PASS (FlashAttention-2's order; the default): one pass with an online softmax. Each tile's
// scores still go through shared memory, but the output accumulators are rescaled in place: the
// row of each accumulator element is found once by loading a matrix of row indices into
// an accumulator of the same shape (element i of a lane holds the same (row, column) in
// every such matrix), so each element reads its row's factor from shared memory. K and V
// tiles are staged together, once; causal workgroups start with the last (longest) blocks.
//
// TUNING bits (variants the forward sweep times; production picks them in CoopmatTiles):
// PREFETCH: each thread loads its part of the next K/V tile into registers, all loads at once,
// before the current tile is multiplied (as matmul_coopmat.comp), so the tile's memory latency
// hides behind the products instead of stalling the workgroup between its two barriers.
// BATCHED_STAGING: the same loads into registers, all issued before any is stored, but for the
// current tile (no overlap with the products, fewer registers): tells a serialised staging loop
// (one memory round trip per row chunk) from latency that only overlap hides.
// LAZY_RESCALE (one pass): the accumulators are rescaled only in tiles where a row maximum of
// the subgroup moved (for random scores about min(1, 16 / t) of the t-th tiles; fewer where an
// early key dominates).
// REG_SOFTMAX (one pass): where the device's accumulator layout has the form engine/kernels/coopmat_layout.py
// checks (measured on the device, passed as ROW_SLOTS, ROW_LANE_MASK, SLOT_WORD*), the scores never leave their
// accumulators: each lane applies the score rule to its elements (their rows and columns known from a matrix of
// indices loaded once), row maxima and sums come from subgroup shuffles among the lanes sharing a row, and the
// output accumulators are rescaled per element by their row's factor, all in registers.
// P_IN_REGS (with REG_SOFTMAX, where A operands lay their elements out as accumulators do): the probabilities
// become the A operands of P V element by element; without it they go through this subgroup's shared memory once
// (stored from the accumulators, rounded to 16 bits, loaded as A).
// DOUBLE_BUFFER (one pass): two K/V tile buffers in shared memory; the next tile is loaded into registers before
// the current one is used and stored into the other buffer after, so one workgroup barrier per tile instead of two.
// ABLATION (the forward sweep only; wrong results): leave out a part of the work to see what
// it costs, see ABLATE_* below.
//
// bfloat16: as matmul_coopmat.comp, the source only declares 16-bit floats as the element
// type of its matrices (probabilities and outputs are written as 16-bit patterns), and the
// build step rewrites that type for the bf16 variant.
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
#extension GL_KHR_shader_subgroup_vote : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

// Storage as 16-bit patterns (attention_common.glsl's T would declare float16_t).
#define ATTENTION_BITS_ONLY
#include "attention_common.glsl"

layout(binding = 0) readonly buffer Q { uvec4 q[]; };
layout(binding = 1) readonly buffer K { uvec4 k[]; };
layout(binding = 2) readonly buffer V { uvec4 v[]; };
layout(binding = 3) readonly buffer Mask { uint mask_words[]; };
layout(binding = 4) readonly buffer Slopes { float alibi_slopes[]; };
layout(binding = 5) readonly buffer KvLen { uint kv_len_words[]; };
layout(binding = 6) writeonly buffer Out { uint16_t o[]; };
layout(binding = 7) writeonly buffer Lse { float lse[]; };

layout(push_constant) uniform Push {
    uint q_off, k_off, v_off, o_off, lse_off, mask_off, slopes_off, kv_len_off;  // elements; q/k/v multiples of 8
    uint heads, kv_heads, q_len, kv_len;
    uint kv_stride;
    uint mask_stride;
    int q_offset;
    uint window;
    float scale, softcap;
};

#include "attention_score.glsl"

layout(constant_id = 8) const uint SUBGROUP_SIZE = 32;
layout(local_size_x_id = 9) in;

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

layout(constant_id = 10) const bool ONE_PASS = false;
layout(constant_id = 11) const uint TUNING = 0;    // bits: PREFETCH, LAZY_RESCALE, BATCHED_STAGING, ...
layout(constant_id = 12) const uint ABLATION = 0;  // ABLATE_*: the forward sweep only
// The accumulators' layout (REG_SOFTMAX; coopmat_layout.glsl).
layout(constant_id = 13) const uint ROW_SLOTS = 1;
layout(constant_id = 14) const uint ROW_LANE_MASK = 0;
layout(constant_id = 15) const uint SLOT_WORD0 = 0;
layout(constant_id = 16) const uint SLOT_WORD1 = 0;
layout(constant_id = 17) const uint SLOT_WORD2 = 0;
layout(constant_id = 18) const uint SLOT_WORD3 = 0;
#include "coopmat_layout.glsl"
const uint PREFETCH = 1, LAZY_RESCALE = 2, BATCHED_STAGING = 4, REG_SOFTMAX = 8, P_IN_REGS = 16, DOUBLE_BUFFER = 32;
// (Selects, not && or ||: glslang makes those of specialization constants run-time values, and then emits a
// constant `!` of them that refers to nothing.)
const bool DOUBLE = ONE_PASS ? (TUNING & DOUBLE_BUFFER) != 0u : false;
const bool PREFETCHING = DOUBLE ? false : (TUNING & PREFETCH) != 0u, LAZY = ONE_PASS ? (TUNING & LAZY_RESCALE) != 0u : false;
const bool BATCHED = DOUBLE ? false : (TUNING & (PREFETCH | BATCHED_STAGING)) == BATCHED_STAGING;  // PREFETCH wins
const bool REG = ONE_PASS ? (ABLATION == 0u ? (TUNING & REG_SOFTMAX) != 0u : false) : false;
const bool P_REGS = REG ? (TUNING & P_IN_REGS) != 0u : false;
const float LOG2E = 1.4426950408889634, LN2 = 0.6931471805599453;
// Each leaves out one part of the one-pass kernel's work per key tile:
const uint ABLATE_SOFTMAX = 1;        // P = S rounded (no score rule, maximum, exp or rescale); S still via shared memory
const uint ABLATE_MAX_RESCALE = 2;    // P = exp(score): no row maximum, no rescale of the accumulators
const uint ABLATE_S_ROUND_TRIP = 3;   // only the two products: S stays in accumulators, P is a fragment of q
const uint ABLATE_STAGING = 4;        // K/V tiles neither loaded nor staged, no workgroup barrier (a fixed tile)
const uint ABLATE_KV_LOADS = 5;       // K/V tiles neither loaded nor staged, the two workgroup barriers kept
const uint ABLATE_ALL_BUT_PRODUCTS = 6;  // 3 and 4: the products on a fixed tile
const bool PRODUCTS_ONLY = ABLATION == ABLATE_S_ROUND_TRIP || ABLATION == ABLATE_ALL_BUT_PRODUCTS;
const bool FIXED_TILE = ABLATION == ABLATE_STAGING || ABLATION == ABLATE_KV_LOADS || ABLATION == ABLATE_ALL_BUT_PRODUCTS;
const bool TILE_BARRIERS = ABLATION != ABLATE_STAGING && ABLATION != ABLATE_ALL_BUT_PRODUCTS;

const uint SUBGROUPS = BLOCK_ROWS / 16;
const uint WG_THREADS = SUBGROUPS * SUBGROUP_SIZE;
const uint D_FRAGS = HEAD_DIM / 16, C_FRAGS = BLOCK_COLS / 16;
const uint PITCH = HEAD_DIM / 8 + 1;              // uvec4s per staged q/k/v row (8 halves of padding)
const uint LANES_PER_ROW = SUBGROUP_SIZE >= 16 ? SUBGROUP_SIZE / 16 : 1;  // REG runs with fewer
const uint SCORES_PER_LANE = BLOCK_COLS / LANES_PER_ROW;  // a multiple of 8: whole uvec4s of probabilities
// Rows of scores and of the output block padded by one uvec4: the 16 rows a store or load touches start in
// different banks (unpadded rows of 32 floats all start in bank 0).
const uint S_PITCH = BLOCK_COLS / 4 + 1;           // uvec4s per row of float scores
const uint O_PITCH = 5;                            // uvec4s per row of a 16 x 16 float output block
const uint S_WORDS = 16 * S_PITCH;                 // one subgroup's float scores, in uvec4s
const uint P_PITCH = BLOCK_COLS / 8 + 1;           // uvec4s per row of 16-bit probabilities
const uint SG_WORDS = S_WORDS + 16 * P_PITCH;
const uint Q_WORDS = BLOCK_ROWS * PITCH;
// One shared array: the K tile, the V tile (DOUBLE: twice), then each subgroup's scores and probabilities
// (REG with P_IN_REGS: none); q is staged from its start once, before any of them is used (REG: with the matrix
// of element indices after it). REG's output blocks go through the tile space at the end.
const uint TILE_WORDS = 2 * BLOCK_COLS * PITCH;
const uint K_AT = 0, V_AT = BLOCK_COLS * PITCH, S_AT = (1 + ((TUNING / DOUBLE_BUFFER) & 1u)) * TILE_WORDS;
// (Sizes from integer bits only: glslang misorders spec-constant selects on booleans.)
const uint REG_BIT = (TUNING / REG_SOFTMAX) & 1u, P_REGS_BIT = REG_BIT & (TUNING / P_IN_REGS);
const uint IDX_AT = Q_WORDS;
const uint STAGE_WORDS = Q_WORDS + 64 * REG_BIT;
const uint LOOP_WORDS = S_AT + (1 - P_REGS_BIT) * SUBGROUPS * SG_WORDS;
const uint OUT_WORDS = SUBGROUPS * 16 * O_PITCH;
const uint SMEM_WORDS0 = STAGE_WORDS > LOOP_WORDS ? STAGE_WORDS : LOOP_WORDS;
const uint SMEM_WORDS = SMEM_WORDS0 > OUT_WORDS ? SMEM_WORDS0 : OUT_WORDS;
shared uvec4 scratch[SMEM_WORDS];
shared float row_factor[BLOCK_ROWS];  // ONE_PASS: each row's rescale of this tile, at the end 1 / sum
// PREFETCH, BATCHED_STAGING: a K or V tile is TILE_CHUNKS uvec4s, CHUNKS_PER_THREAD of them per thread.
const uint TILE_CHUNKS = BLOCK_COLS * (HEAD_DIM / 8);
const uint CHUNKS_PER_THREAD = (TILE_CHUNKS + WG_THREADS - 1) / WG_THREADS;

// scores = q k^T into this subgroup's score space: k's rows are the columns of B, i.e. B is K read column-major.
#define SCORES()                                                                                        \
    [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {                                                     \
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> s =                           \
            coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);                     \
        [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {                                                 \
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> kf;                             \
            coopMatLoad(kf, scratch, k_at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutColumnMajor); \
            s = coopMatMulAdd(qf[d], kf, s);                                                            \
        }                                                                                               \
        coopMatStore(s, scratch, s_base + c * 4, S_PITCH, gl_CooperativeMatrixLayoutRowMajor);          \
    }
// acc += p v, p from this subgroup's probabilities.
#define PV()                                                                                            \
    [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {                                                     \
        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> pf;                                 \
        coopMatLoad(pf, scratch, p_base + c * 2, P_PITCH, gl_CooperativeMatrixLayoutRowMajor);          \
        [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {                                                 \
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> vf;                             \
            coopMatLoad(vf, scratch, v_at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor); \
            acc[d] = coopMatMulAdd(pf, vf, acc[d]);                                                     \
        }                                                                                               \
    }

// Rows [row0, row0 + BLOCK_COLS) of a [rows, HEAD_DIM] matrix at uvec4 `base` into scratch at `at`; zeros past `rows`.
#define STAGE_ROWS(at, src, base, row0, rows)                                                    \
    for (uint i = gl_LocalInvocationID.x; i < TILE_CHUNKS; i += WG_THREADS) {                   \
        uint r = i / (HEAD_DIM / 8), c = i % (HEAD_DIM / 8);                                        \
        scratch[(at) + r * PITCH + c] = (row0) + r < (rows) ? src[(base) + ((row0) + r) * (HEAD_DIM / 8) + c] : uvec4(0); \
    }
// PREFETCH, BATCHED_STAGING: the same rows into this thread's registers `regs`, every load issued before any is used ...
#define FETCH_ROWS(regs, src, base, row0, rows)                                                  \
    [[unroll]] for (uint l = 0; l < CHUNKS_PER_THREAD; ++l) {                                    \
        uint i = gl_LocalInvocationID.x + l * WG_THREADS, r = i / (HEAD_DIM / 8), c = i % (HEAD_DIM / 8); \
        regs[l] = i < TILE_CHUNKS && (row0) + r < (rows) ? src[(base) + ((row0) + r) * (HEAD_DIM / 8) + c] : uvec4(0); \
    }
// ... and from them into scratch at `at`.
#define PUT_ROWS(at, regs)                                                                       \
    [[unroll]] for (uint l = 0; l < CHUNKS_PER_THREAD; ++l) {                                    \
        uint i = gl_LocalInvocationID.x + l * WG_THREADS;                                        \
        if (i < TILE_CHUNKS) scratch[(at) + i / (HEAD_DIM / 8) * PITCH + i % (HEAD_DIM / 8)] = regs[l]; \
    }

float row_max(float x) {
    [[unroll]] for (uint s = 1; s < LANES_PER_ROW; s *= 2) x = max(x, subgroupShuffleXor(x, s));
    return x;
}
float row_sum(float x) {
    [[unroll]] for (uint s = 1; s < LANES_PER_ROW; s *= 2) x += subgroupShuffleXor(x, s);
    return x;
}

void main() {
    // ONE_PASS and causal: the longest rows first, so that the short ones fill the tail of the dispatch.
    const uint block = ONE_PASS && CAUSAL ? gl_NumWorkGroups.x - 1u - gl_WorkGroupID.x : gl_WorkGroupID.x;
    const uint q0 = block * BLOCK_ROWS, head = gl_WorkGroupID.y, batch = gl_WorkGroupID.z;
    const uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    const uint kv_count = kv_len;
    const int q_base = q_offset < 0 ? int(kv_count) - int(q_len) : q_offset;
    const uint kv_head = head / (heads / kv_heads);
    const uint q_row_base = (batch * heads + head) * q_len;
    const uint kv_row_base = (batch * kv_heads + kv_head) * kv_stride;
    const uint kv_rows_end = kv_row_base + kv_count;
    // This lane's row of the subgroup's 16 and its columns of each score tile.
    const uint my_row = lane / LANES_PER_ROW, my_col0 = (lane % LANES_PER_ROW) * SCORES_PER_LANE;
    const uint qi = q0 + sg * 16 + my_row;
    const int qpos = q_base + int(qi);
    const bool row_valid = qi < q_len;
    const uint s_base = S_AT + sg * SG_WORDS, p_base = s_base + S_WORDS;

    // Stage q (rows past q_len are zeros) and keep this subgroup's fragments; REG: also the matrix of element
    // indices (r * 16 + c at (r, c)), whose accumulator tells each lane the row and column of its elements.
    for (uint i = gl_LocalInvocationID.x; i < BLOCK_ROWS * (HEAD_DIM / 8); i += WG_THREADS) {
        uint r = i / (HEAD_DIM / 8), c = i % (HEAD_DIM / 8);
        scratch[r * PITCH + c] = q0 + r < q_len ? q[q_off / 8 + (q_row_base + q0 + r) * (HEAD_DIM / 8) + c] : uvec4(0);
    }
    if (REG) {
        for (uint i = gl_LocalInvocationID.x; i < 64u; i += WG_THREADS)
            scratch[IDX_AT + i] = floatBitsToUint(vec4(4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3));
    }
    barrier();
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> qf[D_FRAGS];
    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d)
        coopMatLoad(qf[d], scratch, sg * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
    // REG: the row (of the subgroup's 16) of each of this lane's slots, the column of each of its elements.
    uint slot_row[ROW_SLOTS], col_word[COL_WORDS];
    if (REG) {
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> index_matrix;
        coopMatLoad(index_matrix, scratch, IDX_AT, 4, gl_CooperativeMatrixLayoutRowMajor);
        COOPMAT_LAYOUT_DECODE(index_matrix, slot_row, col_word)
    }
    barrier();  // scratch becomes tile and score space
    // ONE_PASS: the row of each element of an accumulator, as the accumulator of a matrix of row indices.
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> row_of =
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    if (ONE_PASS && !REG) {
        for (uint e = lane; e < 256u; e += SUBGROUP_SIZE) scratch[s_base + e / 4][e % 4] = floatBitsToUint(float(e / 16u));
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        coopMatLoad(row_of, scratch, s_base, 4, gl_CooperativeMatrixLayoutRowMajor);
        subgroupBarrier();
    }

    // Keys any row of the workgroup can see, and those of this subgroup's rows.
    const int first_pos = q_base + int(q0), last_pos = q_base + int(min(q0 + BLOCK_ROWS, q_len)) - 1;
    const uint key_end = CAUSAL ? uint(clamp(last_pos + 1, 0, int(kv_count))) : kv_count;
    uint key_begin = window > 0u ? uint(clamp(first_pos - int(window) + 1, 0, int(key_end))) : 0u;
    key_begin -= key_begin % BLOCK_COLS;
    const int sg_first = q_base + int(q0 + sg * 16), sg_last = sg_first + 15;
    const bool sg_rows_valid = q0 + sg * 16 + 16 <= q_len;

    float m = NEG_INF, l = 0.0;
    // REG: each slot's running maximum (in log2 units) and this lane's part of its sum.
    float slot_m[ROW_SLOTS], slot_l[ROW_SLOTS];
    [[unroll]] for (uint r = 0; r < ROW_SLOTS; ++r) { slot_m[r] = NEG_INF; slot_l[r] = 0.0; }
    const float scale_log2 = scale * LOG2E;
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[D_FRAGS];
    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d)
        acc[d] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    // ABLATE_S_ROUND_TRIP: the scores, summed over the tiles so that their products are not optimised away.
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> kept[C_FRAGS];
    [[unroll]] for (uint c = 0; c < C_FRAGS; ++c)
        kept[c] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    uvec4 next_k[CHUNKS_PER_THREAD], next_v[CHUNKS_PER_THREAD];

    for (uint pass = ONE_PASS ? 1 : 0; pass < 2; ++pass) {
        if ((PREFETCHING || DOUBLE) && !FIXED_TILE && key_begin < key_end) {
            FETCH_ROWS(next_k, k, k_off / 8, kv_row_base + key_begin, kv_rows_end)
            if (pass == 1) { FETCH_ROWS(next_v, v, v_off / 8, kv_row_base + key_begin, kv_rows_end) }
        }
        if (DOUBLE && !FIXED_TILE && key_begin < key_end) {  // the first tile into buffer 0
            PUT_ROWS(K_AT, next_k)
            PUT_ROWS(V_AT, next_v)
            barrier();
        }
        uint buffer_at = 0;  // DOUBLE: the buffer this tile is in
        for (uint key0 = key_begin; key0 < key_end; key0 += BLOCK_COLS) {
            const uint k_at = buffer_at + K_AT, v_at = buffer_at + V_AT;
            const bool more = key0 + BLOCK_COLS < key_end;
            if (DOUBLE) {
                if (more && !FIXED_TILE) {  // in flight while this tile is used
                    FETCH_ROWS(next_k, k, k_off / 8, kv_row_base + key0 + BLOCK_COLS, kv_rows_end)
                    FETCH_ROWS(next_v, v, v_off / 8, kv_row_base + key0 + BLOCK_COLS, kv_rows_end)
                }
            } else {
                if (TILE_BARRIERS) barrier();  // the previous tiles are no longer read
                if (PREFETCHING && !FIXED_TILE) {
                    PUT_ROWS(K_AT, next_k)
                    if (pass == 1) { PUT_ROWS(V_AT, next_v) }
                } else if (BATCHED && !FIXED_TILE) {
                    FETCH_ROWS(next_k, k, k_off / 8, kv_row_base + key0, kv_rows_end)
                    if (pass == 1) { FETCH_ROWS(next_v, v, v_off / 8, kv_row_base + key0, kv_rows_end) }
                    PUT_ROWS(K_AT, next_k)
                    if (pass == 1) { PUT_ROWS(V_AT, next_v) }
                } else if (!FIXED_TILE) {
                    STAGE_ROWS(K_AT, k, k_off / 8, kv_row_base + key0, kv_rows_end)
                    if (pass == 1) { STAGE_ROWS(V_AT, v, v_off / 8, kv_row_base + key0, kv_rows_end) }
                }
                if (TILE_BARRIERS) barrier();
                if (PREFETCHING && !FIXED_TILE && more) {  // in flight while this tile is used
                    FETCH_ROWS(next_k, k, k_off / 8, kv_row_base + key0 + BLOCK_COLS, kv_rows_end)
                    if (pass == 1) { FETCH_ROWS(next_v, v, v_off / 8, kv_row_base + key0 + BLOCK_COLS, kv_rows_end) }
                }
            }
          // The tile's work; `continue` leaves it (DOUBLE: for the next tile's store and the barrier below).
          do {
            // Uniform per subgroup: a tile wholly after its last row (causal) or before its window.
            if ((CAUSAL && int(key0) > sg_last) || (window > 0u && int(key0 + BLOCK_COLS) <= sg_first - int(window) + 1))
                continue;

            if (REG) {  // scores, softmax and probabilities in registers
                coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> sc[C_FRAGS];
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                    sc[c] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
                    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> kf;
                        coopMatLoad(kf, scratch, k_at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutColumnMajor);
                        sc[c] = coopMatMulAdd(qf[d], kf, sc[c]);
                    }
                }
                // Scores in log2 units (exp2 below); invisible keys are -inf.
                const bool checks = !sg_rows_valid || HAS_MASK || key0 + BLOCK_COLS > kv_count
                                 || (CAUSAL && int(key0 + BLOCK_COLS) - 1 > sg_first)
                                 || (window > 0u && int(key0) <= sg_last - int(window));
                float tile_max[ROW_SLOTS];
                [[unroll]] for (uint r = 0; r < ROW_SLOTS; ++r) tile_max[r] = NEG_INF;
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                    [[unroll]] for (uint i = 0; i < ACC_ELEMS; ++i) {
                        const uint r = slot_of(i);
                        float x = sc[c][i];
                        if (checks || HAS_SOFTCAP || HAS_ALIBI) {
                            const uint kpos = key0 + c * 16 + COOPMAT_COL(col_word, i), row = q0 + sg * 16 + slot_row[r];
                            const int pos = q_base + int(row);
                            float slope;
                            const bool visible = !checks || (row < q_len && kpos < kv_count && key_visible(pos, kpos, batch));
                            x = visible ? attention_score(x, pos, kpos, head, slope) * LOG2E : NEG_INF;
                        } else {
                            x *= scale_log2;
                        }
                        sc[c][i] = x;
                        tile_max[r] = max(tile_max[r], x);
                    }
                }
                float shift[ROW_SLOTS], rescale[ROW_SLOTS], part[ROW_SLOTS];
                bool moved = false;
                [[unroll]] for (uint r = 0; r < ROW_SLOTS; ++r) {
                    const float new_m = max(slot_m[r], row_lanes_max(tile_max[r]));
                    shift[r] = new_m == NEG_INF ? 0.0 : new_m;  // all masked so far: exp(-inf) = 0, not NaN
                    rescale[r] = exp2(slot_m[r] - shift[r]);
                    moved = moved || rescale[r] != 1.0;
                    slot_m[r] = new_m;
                    part[r] = 0.0;
                }
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> pf[C_FRAGS];
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                    [[unroll]] for (uint i = 0; i < ACC_ELEMS; ++i) {
                        const uint r = slot_of(i);
                        const float p = exp2(sc[c][i] - shift[r]);
                        part[r] += p;
                        if (P_REGS) pf[c][i] = float16_t(operand_value(p));
                        else sc[c][i] = p;
                    }
                }
                [[unroll]] for (uint r = 0; r < ROW_SLOTS; ++r) slot_l[r] = slot_l[r] * rescale[r] + part[r];
                // Uniform per subgroup: LAZY skips the rescale while no row maximum of the subgroup moved.
                if (!(LAZY && !subgroupAny(moved))) {
                    [[unroll]] for (uint i = 0; i < ACC_ELEMS; ++i) {
                        const float f = rescale[slot_of(i)];
                        [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) acc[d][i] *= f;
                    }
                }
                if (!P_REGS) {  // P through this subgroup's shared memory: float32, then 16-bit, then A operands
                    subgroupBarrier();  // the previous tile's P is no longer read
                    [[unroll]] for (uint c = 0; c < C_FRAGS; ++c)
                        coopMatStore(sc[c], scratch, s_base + c * 4, S_PITCH, gl_CooperativeMatrixLayoutRowMajor);
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    for (uint e = lane; e < 16u * (BLOCK_COLS / 8); e += SUBGROUP_SIZE) {  // 8 of row e / (BLOCK_COLS / 8)
                        const uint row = e / (BLOCK_COLS / 8), col = e % (BLOCK_COLS / 8) * 8;
                        const vec4 a = uintBitsToFloat(scratch[s_base + row * S_PITCH + col / 4]);
                        const vec4 b = uintBitsToFloat(scratch[s_base + row * S_PITCH + col / 4 + 1]);
                        scratch[p_base + row * P_PITCH + col / 8] =
                            uvec4(to_bits(a.x) | (to_bits(a.y) << 16), to_bits(a.z) | (to_bits(a.w) << 16),
                                  to_bits(b.x) | (to_bits(b.y) << 16), to_bits(b.z) | (to_bits(b.w) << 16));
                    }
                    subgroupMemoryBarrierShared();
                    subgroupBarrier();
                    [[unroll]] for (uint c = 0; c < C_FRAGS; ++c)
                        coopMatLoad(pf[c], scratch, p_base + c * 2, P_PITCH, gl_CooperativeMatrixLayoutRowMajor);
                }
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) {
                    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> vf;
                        coopMatLoad(vf, scratch, v_at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
                        acc[d] = coopMatMulAdd(pf[c], vf, acc[d]);
                    }
                }
                continue;
            }

            if (PRODUCTS_ONLY) {  // ablation: S never leaves the accumulators, P is a fragment of q
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c)
                    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> kf;
                        coopMatLoad(kf, scratch, k_at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutColumnMajor);
                        kept[c] = coopMatMulAdd(qf[d], kf, kept[c]);
                    }
                [[unroll]] for (uint c = 0; c < C_FRAGS; ++c)
                    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> vf;
                        coopMatLoad(vf, scratch, v_at + c * 16 * PITCH + d * 2, PITCH, gl_CooperativeMatrixLayoutRowMajor);
                        acc[d] = coopMatMulAdd(qf[c % D_FRAGS], vf, acc[d]);
                    }
                continue;
            }

            SCORES()
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            if (ABLATION == ABLATE_SOFTMAX) {  // ablation: the raw scores rounded are the probabilities
                [[unroll]] for (uint j = 0; j < SCORES_PER_LANE; j += 8) {
                    vec4 a = uintBitsToFloat(scratch[s_base + my_row * S_PITCH + (my_col0 + j) / 4]);
                    vec4 b = uintBitsToFloat(scratch[s_base + my_row * S_PITCH + (my_col0 + j) / 4 + 1]);
                    scratch[p_base + my_row * P_PITCH + (my_col0 + j) / 8] =
                        uvec4(to_bits(a.x) | (to_bits(a.y) << 16), to_bits(a.z) | (to_bits(a.w) << 16),
                              to_bits(b.x) | (to_bits(b.y) << 16), to_bits(b.z) | (to_bits(b.w) << 16));
                }
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                PV()
                continue;
            }

            // This lane's scores, with the score rule; invisible keys are -inf.
            const bool checks = !row_valid || HAS_MASK || key0 + BLOCK_COLS > kv_count
                             || (CAUSAL && int(key0 + BLOCK_COLS) - 1 > sg_first)
                             || (window > 0u && int(key0) <= sg_last - int(window));
            float sc[SCORES_PER_LANE];
            float tile_max = NEG_INF;
            [[unroll]] for (uint j = 0; j < SCORES_PER_LANE; j += 4) {
                vec4 raw = uintBitsToFloat(scratch[s_base + my_row * S_PITCH + (my_col0 + j) / 4]);
                [[unroll]] for (uint t = 0; t < 4; ++t) {
                    uint kpos = key0 + my_col0 + j + t;
                    float slope;
                    bool visible = !checks || (row_valid && kpos < kv_count && key_visible(qpos, kpos, batch));
                    sc[j + t] = visible ? attention_score(raw[t], qpos, kpos, head, slope) : NEG_INF;
                    tile_max = max(tile_max, sc[j + t]);
                }
            }
            if (pass == 0) {  // online maximum and sum
                float new_m = max(m, row_max(tile_max));
                float shift = new_m == NEG_INF ? 0.0 : new_m;  // all masked so far: exp(-inf) = 0, not NaN
                float part = 0.0;
                [[unroll]] for (uint j = 0; j < SCORES_PER_LANE; ++j) part += exp(sc[j] - shift);
                l = l * exp(m - shift) + row_sum(part);
                m = new_m;
                continue;
            }
            if (ONE_PASS) {  // online softmax: unnormalised probabilities, the accumulators rescaled below
                const bool rescaled = ABLATION != ABLATE_MAX_RESCALE;
                float new_m = rescaled ? max(m, row_max(tile_max)) : 0.0;
                float shift = new_m == NEG_INF ? 0.0 : new_m;  // all masked so far: exp(-inf) = 0, not NaN
                float part = 0.0;
                [[unroll]] for (uint j = 0; j < SCORES_PER_LANE; ++j) {
                    sc[j] = exp(sc[j] - shift);
                    part += sc[j];
                }
                float rescale = rescaled ? exp(m - shift) : 1.0;
                l = l * rescale + row_sum(part);
                m = new_m;
                [[unroll]] for (uint j = 0; j < SCORES_PER_LANE; j += 8) {
                    uvec4 packed;
                    [[unroll]] for (uint t = 0; t < 4; ++t)
                        packed[t] = to_bits(sc[j + 2 * t]) | (to_bits(sc[j + 2 * t + 1]) << 16);
                    scratch[p_base + my_row * P_PITCH + (my_col0 + j) / 8] = packed;
                }
                // Uniform per subgroup: LAZY skips the rescale while no row maximum of the subgroup moved.
                const bool rescale_now = rescaled && !(LAZY && subgroupAll(rescale == 1.0));
                if (rescale_now && lane % LANES_PER_ROW == 0u) row_factor[sg * 16 + my_row] = rescale;
                subgroupMemoryBarrierShared();
                subgroupBarrier();
                if (rescale_now) {
                    [[unroll]] for (int i = 0; i < row_of.length(); ++i) {
                        float f = row_factor[sg * 16 + uint(row_of[i])];
                        [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) acc[d][i] *= f;
                    }
                }
            } else {  // probabilities (final: divided by the row's sum) as 16-bit patterns
                const float shift = m == NEG_INF ? 0.0 : m, inv = l > 0.0 ? 1.0 / l : 0.0;
                [[unroll]] for (uint j = 0; j < SCORES_PER_LANE; j += 8) {
                    uvec4 packed;
                    [[unroll]] for (uint t = 0; t < 4; ++t)
                        packed[t] = to_bits(exp(sc[j + 2 * t] - shift) * inv) | (to_bits(exp(sc[j + 2 * t + 1] - shift) * inv) << 16);
                    scratch[p_base + my_row * P_PITCH + (my_col0 + j) / 8] = packed;
                }
                subgroupMemoryBarrierShared();
                subgroupBarrier();
            }
            PV()
          } while (false);
            if (DOUBLE) {  // the next tile into the other buffer; one barrier for both buffers' hand-over
                if (more && !FIXED_TILE) {
                    PUT_ROWS(TILE_WORDS - buffer_at + K_AT, next_k)
                    PUT_ROWS(TILE_WORDS - buffer_at + V_AT, next_v)
                }
                barrier();
                buffer_at = TILE_WORDS - buffer_at;
            }
        }
    }

    if (PRODUCTS_ONLY) {  // ablation: keep the score products alive
        [[unroll]] for (uint c = 0; c < C_FRAGS; ++c) acc[c % D_FRAGS] = acc[c % D_FRAGS] + kept[c];
    }
    uint out_base = s_base;  // this subgroup's 16 x 16 float block for the output
    if (REG) {  // divide by the row sums (the lanes of a row add up their parts); lse
        float inv[ROW_SLOTS];
        [[unroll]] for (uint r = 0; r < ROW_SLOTS; ++r) {
            const float total = row_lanes_sum(slot_l[r]);
            inv[r] = total > 0.0 ? 1.0 / total : 0.0;
            const uint row = q0 + sg * 16 + slot_row[r];
            if (row < q_len && row_lanes_leader())
                lse[lse_off + q_row_base + row] = total > 0.0 ? slot_m[r] * LN2 + log(total) : NEG_INF;
        }
        [[unroll]] for (uint i = 0; i < ACC_ELEMS; ++i) {
            const float f = inv[slot_of(i)];
            [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) acc[d][i] *= f;
        }
        if (!DOUBLE) barrier();  // every subgroup is done with the tiles: the output goes through their space
        out_base = sg * 16 * O_PITCH;
    } else if (ONE_PASS) {  // divide by the row sums
        subgroupBarrier();
        if (lane % LANES_PER_ROW == 0u) row_factor[sg * 16 + my_row] = l > 0.0 ? 1.0 / l : 0.0;
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        [[unroll]] for (int i = 0; i < row_of.length(); ++i) {
            float f = row_factor[sg * 16 + uint(row_of[i])];
            [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) acc[d][i] *= f;
        }
    }
    // Out, 16 x 16 at a time through this subgroup's score space; lse from the first pass (or the only one).
    [[unroll]] for (uint d = 0; d < D_FRAGS; ++d) {
        subgroupBarrier();
        coopMatStore(acc[d], scratch, out_base, O_PITCH, gl_CooperativeMatrixLayoutRowMajor);
        subgroupMemoryBarrierShared();
        subgroupBarrier();
        for (uint e = lane; e < 256u; e += SUBGROUP_SIZE) {  // element (e / 16, e % 16) of the block
            uint row = q0 + sg * 16 + e / 16;
            if (row < q_len)
                o[o_off + (q_row_base + row) * HEAD_DIM + d * 16 + e % 16] =
                    uint16_t(to_bits(uintBitsToFloat(scratch[out_base + (e / 16) * O_PITCH + e % 16 / 4][e % 4])));
        }
    }
    if (!REG && row_valid && lane % LANES_PER_ROW == 0u)
        lse[lse_off + q_row_base + qi] = l > 0.0 ? m + log(l) : NEG_INF;
}
