// Skinny cooperative-matrix matmul: C[b] = alpha * A[b] @ W[b]^T (+ bias[col]) + beta * C[b] for a few rows
// of A (a batched decode step), float16 or bfloat16 A and W, float32 accumulators. W is [n, k], row-major.
//
// The tile kernel (matmul_coopmat.comp) stages tiles in shared memory between workgroup barriers; a skinny
// grid leaves it one workgroup per compute unit, waiting at its barriers with few bytes in flight. Here a
// workgroup owns 16 FRAG_N columns of C (rows of W) and 16 FRAG_M rows, and its SPLIT subgroups work alone:
// each takes chunks of 16 UNROLL entries of K in turn, loads its rows of W and A for the chunk as 16-byte
// vectors (consecutive lanes along a row), copies them into its own slice of shared memory (rows of A past m
// as zeros) and multiplies the fragments read back from there while the next chunk's vectors load, with
// subgroup barriers only. (Fragments loaded
// straight from memory with coopMatLoad ran 2-7x slower on an H100: the driver reads them a few bytes a lane.)
// The subgroups' float32 sums meet in shared memory once, at the end, added in subgroup order (deterministic).
//
// Columns past n: a fragment reaching past n is moved back to W's last 16 rows and stores only its columns that
// no other fragment has (n >= 16).
//
// The launcher requires n >= 16, k a multiple of 16, and the offsets and batch strides of A and W in whole
// 8-element vectors; no gate (the tile kernels take gated products).
//
// bfloat16: the bf16_* variants compile this very source and the build step rewrites the 16-bit float type of
// the A and B matrices to bfloat16 (tools/spirv_bf16.py), as for matmul_coopmat.comp.
//! target vulkan1.3
//! variant f16_f32 -DOUT_F32
//! variant f16_f16 -DOUT_F16
//! variant f16_bf16 -DOUT_BF16
//! variant bf16_f32 -DOUT_F32
//! variant bf16_f16 -DOUT_F16
//! variant bf16_bf16 -DOUT_BF16
//! postprocess bf16_* ../../tools/spirv_bf16.py
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#define MATMUL_INPUTS_AS_WORDS
#define OUT_F16_AS_BITS
#include "common.glsl"

layout(constant_id = 0) const uint FRAG_M = 1;   // 16-row fragments of A (and C) per workgroup
layout(constant_id = 1) const uint FRAG_N = 2;   // 16-column fragments of C (16 rows of W each) per workgroup
layout(constant_id = 2) const uint SPLIT = 4;    // subgroups per workgroup, taking K's chunks in turn
layout(constant_id = 3) const uint UNROLL = 2;   // 16-entry steps of K per chunk
layout(constant_id = 4) const uint HAS_BIAS = 0;
layout(constant_id = 5) const uint SUBGROUP = 32;  // the device's subgroup size (fixed: the launcher's check)
// constant_id 6: the workgroup size, SPLIT subgroups
layout(local_size_x_id = 6) in;
#include "matmul_io.glsl"

// A subgroup's slice of shared memory holds the chunk's fragments, W's then A's, each UNROLL steps of 16 rows of
// 2 uvec4s (16 halves) and one uvec4 of padding, so that the 16-byte row reads of a 16x16 load fall in distinct
// banks; at the end, one 16x16 float32 fragment of its sums (64 uvec4s).
const uint PITCH = 3;
const uint FRAGMENT_WORDS = 16 * PITCH;
const uint SLICE = (FRAG_N + FRAG_M) * UNROLL * FRAGMENT_WORDS > 64 ? (FRAG_N + FRAG_M) * UNROLL * FRAGMENT_WORDS : 64;
shared uvec4 scratch[SPLIT * SLICE];

#define FRAGMENT_A coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA>
#define FRAGMENT_B coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB>
#define ACCUMULATOR coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

// Where step u of staged fragment f (W's j: f = j; A's i: f = FRAG_N + i) starts in this subgroup's slice.
uint staged(uint f, uint u) { return gl_SubgroupID * SLICE + (f * UNROLL + u) * FRAGMENT_WORDS; }

// A chunk of STEPS (a constant) 16-entry steps of K from K0, in three parts. LOAD_CHUNK: lane q's vectors into
// WORDS_W and WORDS_A (row (q / VECTORS) % 16 of fragment q / (16 VECTORS), vector q % VECTORS of the row's
// 2 STEPS: 16 halves a step; zeros for rows of A past m). STAGE_CHUNK: those vectors into the subgroup's slice.
// MULTIPLY_STAGED: the fragments read back (W's as columns of W^T) and multiplied.
#define VECTORS(STEPS) (2 * (STEPS))
#define W_LOADS(STEPS) ((FRAG_N * 16 * VECTORS(STEPS) + SUBGROUP - 1) / SUBGROUP)
#define A_LOADS(STEPS) ((FRAG_M * 16 * VECTORS(STEPS) + SUBGROUP - 1) / SUBGROUP)
#define LOAD_CHUNK(WORDS_W, WORDS_A, K0, STEPS)                                                                  \
    [[unroll]] for (uint l = 0; l < W_LOADS(STEPS); ++l) {                                                       \
        const uint q = lane + l * SUBGROUP, f = q / (16 * VECTORS(STEPS)), r = (q / VECTORS(STEPS)) % 16;        \
        WORDS_W[l] = uvec4(0u);                                                                                  \
        if (f < FRAG_N)                                                                                          \
            WORDS_W[l] = b_data[(base_b + (min(col0 + 16 * f, n - 16) + r) * k + (K0)) / 8 + q % VECTORS(STEPS)]; \
    }                                                                                                            \
    [[unroll]] for (uint l = 0; l < A_LOADS(STEPS); ++l) {                                                       \
        const uint q = lane + l * SUBGROUP, row = row0 + q / VECTORS(STEPS);                                     \
        WORDS_A[l] = uvec4(0u);                                                                                  \
        if (q < FRAG_M * 16 * VECTORS(STEPS) && row < m)                                                         \
            WORDS_A[l] = a_data[(base_a + row * k + (K0)) / 8 + q % VECTORS(STEPS)];                             \
    }
#define STAGE_CHUNK(WORDS_W, WORDS_A, STEPS)                                                                     \
    subgroupMemoryBarrierShared();                                                                               \
    subgroupBarrier(); /* the previous chunk's fragments are read */                                             \
    [[unroll]] for (uint l = 0; l < W_LOADS(STEPS); ++l) {                                                       \
        const uint q = lane + l * SUBGROUP, f = q / (16 * VECTORS(STEPS)), r = (q / VECTORS(STEPS)) % 16;        \
        const uint v = q % VECTORS(STEPS);                                                                       \
        if (f < FRAG_N) scratch[staged(f, v / 2) + r * PITCH + v % 2] = WORDS_W[l];                              \
    }                                                                                                            \
    [[unroll]] for (uint l = 0; l < A_LOADS(STEPS); ++l) {                                                       \
        const uint q = lane + l * SUBGROUP, f = q / (16 * VECTORS(STEPS)), r = (q / VECTORS(STEPS)) % 16;        \
        const uint v = q % VECTORS(STEPS);                                                                       \
        if (f < FRAG_M) scratch[staged(FRAG_N + f, v / 2) + r * PITCH + v % 2] = WORDS_A[l];                     \
    }                                                                                                            \
    subgroupMemoryBarrierShared();                                                                               \
    subgroupBarrier();
#define MULTIPLY_STAGED(STEPS)                                                                                   \
    [[unroll]] for (uint u = 0; u < (STEPS); ++u) {                                                              \
        FRAGMENT_A fa[FRAG_M];                                                                                   \
        [[unroll]] for (uint i = 0; i < FRAG_M; ++i)                                                             \
            coopMatLoad(fa[i], scratch, staged(FRAG_N + i, u), PITCH, gl_CooperativeMatrixLayoutRowMajor);       \
        [[unroll]] for (uint j = 0; j < FRAG_N; ++j) {                                                           \
            FRAGMENT_B fb;                                                                                       \
            coopMatLoad(fb, scratch, staged(j, u), PITCH, gl_CooperativeMatrixLayoutColumnMajor);                \
            [[unroll]] for (uint i = 0; i < FRAG_M; ++i) acc[i][j] = coopMatMulAdd(fa[i], fb, acc[i][j]);        \
        }                                                                                                        \
    }

void main() {
    const uint col0 = gl_WorkGroupID.x * 16 * FRAG_N, row0 = gl_WorkGroupID.y * 16 * FRAG_M;
    const uint base_a = off_a + gl_WorkGroupID.z * stride_a;
    const uint base_b = off_b + gl_WorkGroupID.z * stride_b;
    const uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;

    ACCUMULATOR acc[FRAG_M][FRAG_N];
    [[unroll]] for (uint i = 0; i < FRAG_M; ++i)
        [[unroll]] for (uint j = 0; j < FRAG_N; ++j) acc[i][j] = ACCUMULATOR(0.0);

    // Whole chunks of UNROLL steps in turn, the next chunk's vectors loaded while the current one is multiplied;
    // then the steps left over one at a time.
    const uint steps = k / 16, chunks = steps / UNROLL;
    uvec4 words_w[W_LOADS(UNROLL)], words_a[A_LOADS(UNROLL)];
    if (sg < chunks) { LOAD_CHUNK(words_w, words_a, sg * 16 * UNROLL, UNROLL) }
    for (uint chunk = sg; chunk < chunks; chunk += SPLIT) {
        STAGE_CHUNK(words_w, words_a, UNROLL)
        if (chunk + SPLIT < chunks) { LOAD_CHUNK(words_w, words_a, (chunk + SPLIT) * 16 * UNROLL, UNROLL) }
        MULTIPLY_STAGED(UNROLL)
    }
    for (uint step = chunks * UNROLL + sg; step < steps; step += SPLIT) {
        uvec4 step_w[W_LOADS(1)], step_a[A_LOADS(1)];
        LOAD_CHUNK(step_w, step_a, step * 16, 1)
        STAGE_CHUNK(step_w, step_a, 1)
        MULTIPLY_STAGED(1)
    }

    // The subgroups' sums of each fragment of C, added in subgroup order, then the epilogue.
    const uint base_c = off_c + gl_WorkGroupID.z * stride_c;
    const uint tid = gl_LocalInvocationID.x;
    subgroupMemoryBarrierShared();
    subgroupBarrier();  // this subgroup's staged fragments are read: its slice takes its sums
    [[unroll]] for (uint i = 0; i < FRAG_M; ++i)
        [[unroll]] for (uint j = 0; j < FRAG_N; ++j) {
            coopMatStore(acc[i][j], scratch, sg * SLICE, 4, gl_CooperativeMatrixLayoutRowMajor);
            barrier();
            const uint w_row = min(col0 + 16 * j, n - 16);
            for (uint e = tid; e < 256; e += gl_WorkGroupSize.x) {
                float total = 0.0;
                [[unroll]] for (uint s = 0; s < SPLIT; ++s) total += uintBitsToFloat(scratch[s * SLICE + e / 4][e % 4]);
                // A fragment moved back from past n holds columns that another fragment stores.
                const uint row = row0 + 16 * i + e / 16, col = w_row + e % 16;
                if (row < m && col >= col0 + 16 * j) store_c(base_c + row * n + col, col, total);
            }
            barrier();
        }
}
