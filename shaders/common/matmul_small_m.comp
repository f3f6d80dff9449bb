// Small-m matmul (token-by-token decoding): C[b] = alpha * op(A[b]) @ op(B[b]) (+ bias[col]) + beta * C[b]
// for m of 1 to 8 (more rows run as blocks of BLOCK_M), accumulated in float32
// (see engine/kernels/matmul.py). Every element of B is read once per block of
// BLOCK_M rows, so the kernel is bound by reading B (the weight) from memory.
//
// Two mappings, chosen by TRANS_B:
// - TRANS_B = 1 (B is [n, k], k contiguous: y = x @ W^T with W row-major), the decoding case.
//   A workgroup owns ROWS_PER_WG columns of C (rows of B). Each subgroup takes
//   ROWS_PER_SUBGROUP of them at a time; its lanes stride over k in 16-byte vectors
//   (4 float32 or 8 16-bit values), so a subgroup reads a whole row of B in
//   consecutive, coalesced 16-byte loads. Every lane keeps BLOCK_M x ROWS_PER_SUBGROUP
//   partial sums; subgroupAdd combines them (no shared memory, no barrier).
// - TRANS_B = 0 (B is [k, n], n contiguous): a workgroup owns ROWS_PER_WG columns of C;
//   thread t takes column t % ROWS_PER_WG and every (WG / ROWS_PER_WG)-th k, so
//   consecutive threads read consecutive elements of a row of B; the k slices are
//   summed through shared memory.
// GATE_MODE (matmul_io.glsl): GATE_ROWS skips a block of rows at or past the product's gate, storing
// the epilogue of a zero product and reading nothing (a mixture-of-experts expert that no token of the
// step chose has a gate of 0). No GATE_DEPTH: the launcher gives depth-gated products to the tile kernels.
// A and B are bound as raw 16-byte words (uvec4) and decoded here: a whole vector
// where ALIGNED_A / ALIGNED_B say every row starts on a 16-byte boundary, else
// element by element (one 32-bit word each), with checks at the end of k.
// Variants: <A and B storage>_<C storage>. Bias has C's storage type.
//! variant f32_f32 -DIN_F32 -DOUT_F32
//! variant f32_f16 -DIN_F32 -DOUT_F16
//! variant f32_bf16 -DIN_F32 -DOUT_BF16
//! variant f16_f32 -DIN_F16 -DOUT_F32
//! variant f16_f16 -DIN_F16 -DOUT_F16
//! variant f16_bf16 -DIN_F16 -DOUT_BF16
//! variant bf16_f32 -DIN_BF16 -DOUT_F32
//! variant bf16_f16 -DIN_BF16 -DOUT_F16
//! variant bf16_bf16 -DIN_BF16 -DOUT_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

layout(constant_id = 0) const uint BLOCK_M = 8;            // rows of A (and C) per workgroup
layout(constant_id = 1) const uint ROWS_PER_WG = 8;        // columns of C per workgroup
layout(constant_id = 2) const uint ROWS_PER_SUBGROUP = 1;  // TRANS_B = 1: columns of C a subgroup does at once (launcher: 1 to 4)
layout(constant_id = 3) const uint TRANS_A = 0;
layout(constant_id = 4) const uint TRANS_B = 1;
layout(constant_id = 5) const uint HAS_BIAS = 0;
layout(constant_id = 6) const uint ALIGNED_A = 0;  // rows of A start on 16 bytes and k is a whole number of vectors
layout(constant_id = 7) const uint ALIGNED_B = 0;  // the same for rows of B (TRANS_B = 1)
// constant_id 8: the workgroup size
layout(local_size_x_id = 8) in;
layout(constant_id = 9) const uint UNROLL = 2;     // TRANS_B = 1: vectors per lane in flight per row
layout(constant_id = 10) const uint GATE_MODE = 0;

#define MATMUL_INPUTS_AS_WORDS
#include "matmul_io.glsl"

#if defined(IN_F32)
#define VECTOR_F32
#elif defined(IN_F16)
#define VECTOR_F16
#endif
#include "vector16.glsl"

// Element e (counted in elements from the start of the buffer), one 32-bit word read.
float element(bool from_a, uint e) {
#if defined(IN_F32)
    return uintBitsToFloat(from_a ? a_data[e >> 2][e & 3] : b_data[e >> 2][e & 3]);
#else
    uint word = from_a ? a_data[e >> 3][(e >> 1) & 3] : b_data[e >> 3][(e >> 1) & 3];
    uint bits = (word >> ((e & 1) * 16)) & 0xFFFFu;
#if defined(IN_F16)
    return unpackHalf2x16(bits).x;
#else
    return uintBitsToFloat(bits << 16);
#endif
#endif
}

// Elements kk .. kk + PER_VECTOR - 1 of op(A) row `row`, zeros past k.
Vector vector_a(uint base_a, uint row, uint kk) {
    if (ALIGNED_A != 0 && TRANS_A == 0) return decode(a_data[(base_a + row * k + kk) / PER_VECTOR]);
    Vector x;
    for (uint j = 0; j < PER_VECTOR; ++j) {
        uint kj = kk + j;
        x.v[j / 4][j % 4] = kj < k ? element(true, base_a + (TRANS_A != 0 ? kj * m + row : row * k + kj)) : 0.0;
    }
    return x;
}

// Elements kk .. kk + PER_VECTOR - 1 of row `col` of B ([n, k]), zeros past k.
Vector vector_b(uint base_b, uint col, uint kk) {
    if (ALIGNED_B != 0) return decode(b_data[(base_b + col * k + kk) / PER_VECTOR]);
    Vector x;
    for (uint j = 0; j < PER_VECTOR; ++j)
        x.v[j / 4][j % 4] = kk + j < k ? element(false, base_b + col * k + kk + j) : 0.0;
    return x;
}

// ---------------------------------------------------------------- TRANS_B = 1

void rows_of_b(uint base_a, uint base_b, uint base_c, uint row0) {
    // Lanes of this subgroup: fewer than gl_SubgroupSize in a last, partial subgroup
    // (a workgroup smaller than, or not a multiple of, the device's subgroup).
    const uint lanes = min(gl_SubgroupSize, gl_WorkGroupSize.x - gl_SubgroupID * gl_SubgroupSize);
    const uint lane = gl_SubgroupInvocationID;
    const uint vectors = (k + PER_VECTOR - 1) / PER_VECTOR;
    const uint blocks = ROWS_PER_WG / ROWS_PER_SUBGROUP;
    // Subgroups take blocks of ROWS_PER_SUBGROUP columns in turn: the launcher sizes the
    // workgroup for one block each, but a device may run other subgroup sizes.
    for (uint block = gl_SubgroupID; block < blocks; block += gl_NumSubgroups) {
        const uint col0 = gl_WorkGroupID.x * ROWS_PER_WG + block * ROWS_PER_SUBGROUP;
        if (col0 >= n) break;
        float acc[BLOCK_M][ROWS_PER_SUBGROUP];
        [[unroll]] for (uint i = 0; i < BLOCK_M; ++i)
            [[unroll]] for (uint r = 0; r < ROWS_PER_SUBGROUP; ++r) acc[i][r] = 0.0;

        // Each step a lane loads UNROLL vectors of each of its rows of B (all in
        // flight at once), then the matching vectors of A, cached, for every row.
        for (uint q0 = lane; q0 < vectors; q0 += UNROLL * lanes) {
            Vector w[UNROLL][ROWS_PER_SUBGROUP];
            [[unroll]] for (uint u = 0; u < UNROLL; ++u)
                [[unroll]] for (uint r = 0; r < ROWS_PER_SUBGROUP; ++r)
                    if (q0 + u * lanes < vectors && col0 + r < n)
                        w[u][r] = vector_b(base_b, col0 + r, (q0 + u * lanes) * PER_VECTOR);
            [[unroll]] for (uint u = 0; u < UNROLL; ++u) {
                uint q = q0 + u * lanes;
                if (q >= vectors) break;
                [[unroll]] for (uint i = 0; i < BLOCK_M; ++i) {
                    if (row0 + i >= m) break;
                    Vector x = vector_a(base_a, row0 + i, q * PER_VECTOR);
                    [[unroll]] for (uint r = 0; r < ROWS_PER_SUBGROUP; ++r)
                        if (col0 + r < n) acc[i][r] += vector_dot(x, w[u][r]);
                }
            }
        }

        // Lane i * ROWS_PER_SUBGROUP + r (mod lanes) stores C[row0 + i, col0 + r].
        [[unroll]] for (uint i = 0; i < BLOCK_M; ++i)
            [[unroll]] for (uint r = 0; r < ROWS_PER_SUBGROUP; ++r) {
                float total = subgroupAdd(acc[i][r]);
                uint slot = i * ROWS_PER_SUBGROUP + r;
                if (lane == slot % lanes && row0 + i < m && col0 + r < n)
                    store_c(base_c + (row0 + i) * n + col0 + r, col0 + r, total);
            }
    }
}

// ---------------------------------------------------------------- TRANS_B = 0

shared float partial[gl_WorkGroupSize.x * BLOCK_M];

void columns_of_b(uint base_a, uint base_b, uint base_c, uint row0) {
    const uint tid = gl_LocalInvocationID.x;
    const uint slices = gl_WorkGroupSize.x / ROWS_PER_WG;  // threads per column, over k
    const uint local_col = tid % ROWS_PER_WG, slice = tid / ROWS_PER_WG;
    const uint col = gl_WorkGroupID.x * ROWS_PER_WG + local_col;
    float sums[BLOCK_M];
    for (uint i = 0; i < BLOCK_M; ++i) sums[i] = 0.0;
    if (col < n && slice < slices) {
        for (uint kk = slice; kk < k; kk += slices) {
            float w = element(false, base_b + kk * n + col);
            for (uint i = 0; i < BLOCK_M; ++i) {
                if (row0 + i >= m) break;
                uint row = row0 + i;
                sums[i] = fma(element(true, base_a + (TRANS_A != 0 ? kk * m + row : row * k + kk)), w, sums[i]);
            }
        }
    }
    for (uint i = 0; i < BLOCK_M; ++i) partial[tid * BLOCK_M + i] = sums[i];
    barrier();
    // Thread t sums the slices of (row t / ROWS_PER_WG, column t % ROWS_PER_WG).
    for (uint t = tid; t < BLOCK_M * ROWS_PER_WG; t += gl_WorkGroupSize.x) {
        uint i = t / ROWS_PER_WG, c = t % ROWS_PER_WG;
        uint out_col = gl_WorkGroupID.x * ROWS_PER_WG + c;
        if (row0 + i >= m || out_col >= n) continue;
        float total = 0.0;
        for (uint s = 0; s < slices; ++s) total += partial[(s * ROWS_PER_WG + c) * BLOCK_M + i];
        store_c(base_c + (row0 + i) * n + out_col, out_col, total);
    }
}

void main() {
    const uint base_a = off_a + gl_WorkGroupID.z * stride_a;
    const uint base_b = off_b + gl_WorkGroupID.z * stride_b;
    const uint base_c = off_c + gl_WorkGroupID.z * stride_c;
    const uint row0 = gl_WorkGroupID.y * BLOCK_M;
    if (GATE_MODE == GATE_ROWS && row0 >= gate_count(gl_WorkGroupID.z)) {  // uniform over the workgroup
        for (uint t = gl_LocalInvocationID.x; t < BLOCK_M * ROWS_PER_WG; t += gl_WorkGroupSize.x) {
            uint i = t / ROWS_PER_WG, col = gl_WorkGroupID.x * ROWS_PER_WG + t % ROWS_PER_WG;
            if (row0 + i < m && col < n) store_c(base_c + (row0 + i) * n + col, col, 0.0);
        }
        return;
    }
    if (TRANS_B != 0) rows_of_b(base_a, base_b, base_c, row0);
    else columns_of_b(base_a, base_b, base_c, row0);
}
