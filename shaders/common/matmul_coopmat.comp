// Cooperative-matrix matmul (VK_KHR_cooperative_matrix): the same operation and
// interface as matmul.comp, for float16 (or bfloat16) A and B, float32 accumulators.
//
// A workgroup of SG_ROWS x SG_COLS subgroups computes a (64 SG_ROWS) x (32 SG_COLS)
// tile of C; each subgroup 64 x 32 as FRAG_M x FRAG_N 16x16 accumulators. Tiles of
// A and B are staged in shared memory in their global layout (whichever index is
// contiguous stays contiguous, loaded 8 halves at a time, rows padded by 8 halves), and
// coopMatLoad reads them row- or column-major accordingly; the next K tile is
// loaded into registers while the current one is multiplied. Tiles at the edges
// of C or K are loaded element by element with bounds checks (zeros outside).
// The epilogue goes through shared memory so it can bounds-check, add bias and
// beta * C, and convert.
//
// bfloat16: no GLSL compiler we have knows GL_EXT_bfloat16, so the bf16_* variants
// compile this very source (16-bit floats appear only in the A and B matrix types)
// and the build step rewrites that type to bfloat16 (tools/spirv_bf16.py).
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
#define MATMUL_INPUTS_AS_WORDS
#define OUT_F16_AS_BITS
#include "common.glsl"

layout(constant_id = 0) const uint SG_ROWS = 2;
layout(constant_id = 1) const uint SG_COLS = 4;
layout(constant_id = 2) const uint BK = 32;    // multiple of 16
layout(constant_id = 3) const uint TRANS_A = 0;
layout(constant_id = 4) const uint TRANS_B = 0;
layout(constant_id = 5) const uint HAS_BIAS = 0;
layout(constant_id = 6) const uint ALIGNED_A = 0;  // 8-element vector loads of A are aligned
layout(constant_id = 7) const uint ALIGNED_B = 0;
// constant_id 8: workgroup size = SG_ROWS * SG_COLS * subgroup size
layout(local_size_x_id = 8) in;
#include "matmul_io.glsl"

#define FRAG_M 4
#define FRAG_N 2
#define MAX_CHUNKS 8  // bound on uvec4 loads per invocation per tile
const uint BM = 16 * FRAG_M * SG_ROWS;
const uint BN = 16 * FRAG_N * SG_COLS;

// A staged tile is OUTER rows of INNER contiguous halves, pitch INNER / 8 + 1 uvec4.
// Non-transposed A: BM rows of BK; transposed A: BK rows of BM (same for B with BN).
const uint PITCH_A = (TRANS_A != 0 ? BM : BK) / 8 + 1;
const uint PITCH_B = (TRANS_B != 0 ? BK : BN) / 8 + 1;
const uint TILE_A_WORDS = (TRANS_A != 0 ? BK : BM) * PITCH_A;
const uint TILE_B_WORDS = (TRANS_B != 0 ? BN : BK) * PITCH_B;
// Staged as f16vec4 (two per uvec4 loaded), the matrices' own component type
// (staging raw uvec4s measured the same on the H200).
#define STAGE_T f16vec4
#define STAGE_PER_WORD 2
shared STAGE_T tile_a[TILE_A_WORDS * STAGE_PER_WORD];
shared STAGE_T tile_b[TILE_B_WORDS * STAGE_PER_WORD];
shared float stage_c[SG_ROWS * SG_COLS * 256];  // epilogue: one 16x16 accumulator per subgroup

void stage_a(uint word, uvec4 v) {
    tile_a[2 * word] = f16vec4(unpackFloat2x16(v.x), unpackFloat2x16(v.y));
    tile_a[2 * word + 1] = f16vec4(unpackFloat2x16(v.z), unpackFloat2x16(v.w));
}
void stage_b(uint word, uvec4 v) {
    tile_b[2 * word] = f16vec4(unpackFloat2x16(v.x), unpackFloat2x16(v.y));
    tile_b[2 * word + 1] = f16vec4(unpackFloat2x16(v.z), unpackFloat2x16(v.w));
}

// Half number e of a matrix stored as uvec4s, for loads that are not whole aligned vectors.
uint half_bits(bool from_a, uint e) {
    uint word = from_a ? a_data[e >> 3][(e >> 1) & 3] : b_data[e >> 3][(e >> 1) & 3];
    return (word >> ((e & 1) * 16)) & 0xFFFFu;
}

// 8 halves of row `outer`, columns inner..inner+7, of a dense [outer_n, inner_n] matrix at `base`.
uvec4 load_chunk(bool from_a, bool aligned, uint base, uint outer, uint inner, uint outer_n, uint inner_n) {
    if (outer >= outer_n) return uvec4(0);
    uint e = base + outer * inner_n + inner;
    if (aligned && inner + 8 <= inner_n) return from_a ? a_data[e >> 3] : b_data[e >> 3];
    uvec4 v = uvec4(0);
    for (uint j = 0; j < 8 && inner + j < inner_n; ++j) v[j >> 1] |= half_bits(from_a, e + j) << ((j & 1) * 16);
    return v;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint threads = gl_WorkGroupSize.x;
    const uint row0 = gl_WorkGroupID.y * BM, col0 = gl_WorkGroupID.x * BN;
    const uint base_a = off_a + gl_WorkGroupID.z * stride_a;
    const uint base_b = off_b + gl_WorkGroupID.z * stride_b;
    const uint sg = gl_SubgroupID;
    const uint sg_row = sg / SG_COLS, sg_col = sg % SG_COLS;
    const uint chunks_a = TILE_A_WORDS / PITCH_A * (PITCH_A - 1);  // uvec4s of data in a tile
    const uint chunks_b = TILE_B_WORDS / PITCH_B * (PITCH_B - 1);

    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[FRAG_M][FRAG_N];
    for (uint i = 0; i < FRAG_M; ++i)
        for (uint j = 0; j < FRAG_N; ++j) acc[i][j] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);

    uvec4 next_a[MAX_CHUNKS], next_b[MAX_CHUNKS];
    // Chunk q of a tile is (row q / (PITCH - 1), uvec4 q % (PITCH - 1)) of the staged layout.
#define LOAD_TILES(K0)                                                                           \
    for (uint l = 0; l * threads < chunks_a; ++l) {                                              \
        uint q = tid + l * threads, o = q / (PITCH_A - 1), i = 8 * (q % (PITCH_A - 1));           \
        next_a[l] = TRANS_A != 0 ? load_chunk(true, ALIGNED_A != 0, base_a, (K0) + o, row0 + i, k, m) \
                                 : load_chunk(true, ALIGNED_A != 0, base_a, row0 + o, (K0) + i, m, k); \
    }                                                                                            \
    for (uint l = 0; l * threads < chunks_b; ++l) {                                              \
        uint q = tid + l * threads, o = q / (PITCH_B - 1), i = 8 * (q % (PITCH_B - 1));           \
        next_b[l] = TRANS_B != 0 ? load_chunk(false, ALIGNED_B != 0, base_b, col0 + o, (K0) + i, n, k) \
                                 : load_chunk(false, ALIGNED_B != 0, base_b, (K0) + o, col0 + i, k, n); \
    }

    LOAD_TILES(0)
    for (uint k0 = 0; k0 < k; k0 += BK) {
        for (uint l = 0; l * threads < chunks_a; ++l) {
            uint q = tid + l * threads;
            stage_a(q / (PITCH_A - 1) * PITCH_A + q % (PITCH_A - 1), next_a[l]);
        }
        for (uint l = 0; l * threads < chunks_b; ++l) {
            uint q = tid + l * threads;
            stage_b(q / (PITCH_B - 1) * PITCH_B + q % (PITCH_B - 1), next_b[l]);
        }
        barrier();
        if (k0 + BK < k) { LOAD_TILES(k0 + BK) }  // in flight while we multiply

        const uint S = STAGE_PER_WORD;  // staged elements per uvec4 of 8 halves
        for (uint kk = 0; kk < BK; kk += 16) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> fa[FRAG_M];
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> fb[FRAG_N];
            for (uint i = 0; i < FRAG_M; ++i) {
                uint r = sg_row * 16 * FRAG_M + 16 * i;
                if (TRANS_A != 0) coopMatLoad(fa[i], tile_a, S * (kk * PITCH_A + r / 8), S * PITCH_A, gl_CooperativeMatrixLayoutColumnMajor);
                else coopMatLoad(fa[i], tile_a, S * (r * PITCH_A + kk / 8), S * PITCH_A, gl_CooperativeMatrixLayoutRowMajor);
            }
            for (uint j = 0; j < FRAG_N; ++j) {
                uint c = sg_col * 16 * FRAG_N + 16 * j;
                if (TRANS_B != 0) coopMatLoad(fb[j], tile_b, S * (c * PITCH_B + kk / 8), S * PITCH_B, gl_CooperativeMatrixLayoutColumnMajor);
                else coopMatLoad(fb[j], tile_b, S * (kk * PITCH_B + c / 8), S * PITCH_B, gl_CooperativeMatrixLayoutRowMajor);
            }
            for (uint i = 0; i < FRAG_M; ++i)
                for (uint j = 0; j < FRAG_N; ++j) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);
        }
        barrier();
    }

    // Epilogue: each subgroup stages one 16x16 float accumulator at a time in its
    // slice of stage_c, then writes it out with bounds checks.
    const uint base_c = off_c + gl_WorkGroupID.z * stride_c;
    const uint lanes = gl_SubgroupSize, lane = gl_SubgroupInvocationID;
    for (uint i = 0; i < FRAG_M; ++i) {
        for (uint j = 0; j < FRAG_N; ++j) {
            coopMatStore(acc[i][j], stage_c, sg * 256, 16, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            uint r0 = row0 + sg_row * 16 * FRAG_M + 16 * i, c0 = col0 + sg_col * 16 * FRAG_N + 16 * j;
            for (uint e = lane; e < 256; e += lanes) {
                uint r = r0 + e / 16, c = c0 + e % 16;
                if (r < m && c < n) store_c(base_c + r * n + c, c, stage_c[sg * 256 + e]);
            }
            subgroupBarrier();
        }
    }
}
