// Products with a quantized weight W (packed blocks, quant_block.glsl), dequantized inside the product:
//   TRANS_W = 1:  C [m, n] = A [m, k] @ W^T, W [n, k]   (a Linear layer's forward, x @ W^T)
//   TRANS_W = 0:  C [m, n] = A [m, k] @ W,   W [k, n]   (its input gradient, dY @ W)
// A and C share the activation dtype (the variant); the sums are float32. W is never expanded to memory.
// MODE 0 (matvec, TRANS_W = 1, m = ROWS <= 8): a workgroup takes COLS columns of C for every row of A. Its
// invocations split k into units of 32 weights (quant_unit: whole 16-byte runs of packed data, each scale read
// once), consecutive invocations on consecutive units so that a subgroup reads W in one sweep; each unit's
// weights serve all ROWS rows of A, read 16 bytes at a time (A_VEC) or element by element; the sums meet in a
// subgroup reduction, then across subgroups in shared memory. SPLIT_K = 0 (a CPU device): an invocation per
// column walks all its units alone, with no reduction.
// MODE 1 (tiled): a BM x BN tile of C per workgroup, K in steps of BK; each step dequantizes its BK x BN slice
// of W into shared memory, where TM x TN register blocks multiply it; sizes past m, n or k read zeros, so no
// size needs to be a multiple of a tile.
//! variant f32 -DELEM_F32
//! variant f16 -DELEM_F16
//! variant bf16 -DELEM_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "transformer_common.glsl"

layout(constant_id = 0) const uint FORMAT = 0;   // quant_block.glsl QUANT_*
layout(constant_id = 1) const uint MODE = 0;     // 0: matvec, 1: tiled
layout(constant_id = 2) const uint TRANS_W = 1;
layout(constant_id = 3) const uint BM = 64;
layout(constant_id = 4) const uint BN = 64;
layout(constant_id = 5) const uint BK = 32;      // multiple of 8 (as BN)
layout(constant_id = 6) const uint TM = 4;       // at most MAX_T
layout(constant_id = 7) const uint TN = 4;       // at most MAX_T
layout(local_size_x_id = 8) in;                  // tiled: (BM / TM) * (BN / TN); matvec: any multiple of the subgroup
layout(constant_id = 9) const uint SPLIT_K = 1;  // matvec: 1: a workgroup per column; 0: an invocation per column
layout(constant_id = 10) const uint ROWS = 1;    // matvec: m, so that the per-row sums stay in registers
layout(constant_id = 11) const uint COLS = 1;    // matvec: columns of C per workgroup (SPLIT_K = 0: 1)
layout(constant_id = 12) const uint A_VEC = 0;   // matvec: A's offset is a whole number of 16-byte vectors
layout(constant_id = 13) const uint W_VEC = 0;   // W's byte offset is a multiple of 16 (16-byte loads of Q4_K, Q5_K)

layout(push_constant) uniform Push {
    uint m; uint n; uint k;
    uint off_a; uint off_w; uint off_c;  // off_w in bytes
    uint row_bytes;                      // bytes of one row of W
};
layout(binding = 0) readonly buffer A { ELEM_T a[]; };
layout(binding = 0) readonly buffer AVectors { uvec4 a_vec[]; };  // the same buffer, 16 bytes at a time
layout(binding = 1) readonly buffer Packed { uint packed_words[]; };
layout(binding = 1) readonly buffer PackedVectors { uvec4 packed_vec[]; };
#define QUANT_PACKED_VECTORS
layout(binding = 2) writeonly buffer C { ELEM_T c[]; };
#include "quant_block.glsl"

#define MAX_T 8

shared float tile_a[MODE == 1u ? BK * (BM + 1) : 1];  // k-major, padded against bank conflicts
shared float tile_w[MODE == 1u ? BK * (BN + 1) : 1];
// The matvec's per-subgroup sums: at most 32 subgroups (128 invocations in subgroups of 4 or more).
#define MAX_SUBGROUPS 32u
shared float matvec_partials[MODE == 0u ? MAX_SUBGROUPS * COLS * ROWS : 1];

// A[at .. at+7] (at a multiple of 8) as two vec4.
void load_a8(uint at, out vec4 lo, out vec4 hi) {
    if (A_VEC == 1u) {
#if defined(ELEM_F32)
        lo = uintBitsToFloat(a_vec[at >> 2]);
        hi = uintBitsToFloat(a_vec[(at >> 2) + 1u]);
#elif defined(ELEM_F16)
        uvec4 v = a_vec[at >> 3];
        lo = vec4(unpackHalf2x16(v.x), unpackHalf2x16(v.y));
        hi = vec4(unpackHalf2x16(v.z), unpackHalf2x16(v.w));
#else
        uvec4 v = a_vec[at >> 3];
        lo = uintBitsToFloat(uvec4(v.x << 16, v.x & 0xFFFF0000u, v.y << 16, v.y & 0xFFFF0000u));
        hi = uintBitsToFloat(uvec4(v.z << 16, v.z & 0xFFFF0000u, v.w << 16, v.w & 0xFFFF0000u));
#endif
    } else {
        lo = vec4(load_elem(a[at]), load_elem(a[at + 1u]), load_elem(a[at + 2u]), load_elem(a[at + 3u]));
        hi = vec4(load_elem(a[at + 4u]), load_elem(a[at + 5u]), load_elem(a[at + 6u]), load_elem(a[at + 7u]));
    }
}

// Columns col0 .. col0 + COLS - 1 of C for all ROWS rows: units first, first + stride, ... of each W row.
void matvec(uint col0, uint first, uint stride) {
    const uint units = k / 32u, per_block = quant_block_size() / 32u, block_bytes = quant_block_bytes();
    float acc[COLS * ROWS];
    [[unroll]] for (uint i = 0u; i < COLS * ROWS; ++i) acc[i] = 0.0;
    for (uint t = first; t < units; t += stride) {
        const uint block = t / per_block, u = t % per_block;
        const uint elem = block * quant_block_size();
        vec4 q[COLS * 8u], scale[COLS], offset[COLS];
        [[unroll]] for (uint j = 0u; j < COLS; ++j) {
            vec4 codes[8];
            // a column past n repeats the last one, computed and never written (no branch around the loads)
            quant_unit(off_w + min(col0 + j, n - 1u) * row_bytes + block * block_bytes, u, codes, scale[j], offset[j]);
            [[unroll]] for (uint i = 0u; i < 8u; ++i) q[8u * j + i] = codes[i];
        }
        [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
            [[unroll]] for (uint o = 0u; o < 4u; ++o) {
                vec4 lo, hi;
                load_a8(off_a + r * k + elem + quant_octet_start(u, o), lo, hi);
                const float a_sum = dot(lo + hi, vec4(1.0));
                [[unroll]] for (uint j = 0u; j < COLS; ++j)
                    acc[j * ROWS + r] += scale[j][o] * (dot(q[8u * j + 2u * o], lo) + dot(q[8u * j + 2u * o + 1u], hi))
                                         + offset[j][o] * a_sum;
            }
        }
    }
    if (SPLIT_K == 0u) {
        [[unroll]] for (uint i = 0u; i < COLS * ROWS; ++i)
            if (col0 + i / ROWS < n) c[off_c + (i % ROWS) * n + col0 + i / ROWS] = store_elem(acc[i]);
        return;
    }
    [[unroll]] for (uint i = 0u; i < COLS * ROWS; ++i) {
        float total = subgroupAdd(acc[i]);
        if (subgroupElect()) matvec_partials[gl_SubgroupID * COLS * ROWS + i] = total;
    }
    barrier();
    for (uint i = gl_LocalInvocationID.x; i < COLS * ROWS; i += gl_WorkGroupSize.x) {
        float total = 0.0;
        for (uint s = 0u; s < gl_NumSubgroups; ++s) total += matvec_partials[s * COLS * ROWS + i];
        if (col0 + i / ROWS < n) c[off_c + (i % ROWS) * n + col0 + i / ROWS] = store_elem(total);
    }
}

void tiled() {
    const uint tid = gl_LocalInvocationID.x, threads = (BM / TM) * (BN / TN);
    const uint row0 = gl_WorkGroupID.y * BM, col0 = gl_WorkGroupID.x * BN;
    const uint tx = tid % (BN / TN), ty = tid / (BN / TN);
    float acc[MAX_T][MAX_T];
    for (uint i = 0; i < TM; ++i)
        for (uint j = 0; j < TN; ++j) acc[i][j] = 0.0;

    for (uint k0 = 0; k0 < k; k0 += BK) {
        for (uint i = tid; i < BM * BK; i += threads) {
            uint r = i / BK, kk = i % BK;
            bool inside = row0 + r < m && k0 + kk < k;
            tile_a[kk * (BM + 1) + r] = inside ? load_elem(a[off_a + (row0 + r) * k + k0 + kk]) : 0.0;
        }
        // W's inner dimension (k for W^T, n for W) is a whole number of blocks, so of runs of 8.
        if (TRANS_W == 1u) {
            for (uint i = tid; i < BN * BK / 8u; i += threads) {
                uint r = i / (BK / 8u), kk = 8u * (i % (BK / 8u));
                vec4 lo = vec4(0.0), hi = vec4(0.0);
                if (col0 + r < n && k0 + kk < k) quant_row8(off_w, row_bytes, col0 + r, k0 + kk, lo, hi);
                for (uint e = 0u; e < 4u; ++e) {
                    tile_w[(kk + e) * (BN + 1) + r] = lo[e];
                    tile_w[(kk + 4u + e) * (BN + 1) + r] = hi[e];
                }
            }
        } else {
            for (uint i = tid; i < BN * BK / 8u; i += threads) {
                uint kk = i / (BN / 8u), cc = 8u * (i % (BN / 8u));
                vec4 lo = vec4(0.0), hi = vec4(0.0);
                if (k0 + kk < k && col0 + cc < n) quant_row8(off_w, row_bytes, k0 + kk, col0 + cc, lo, hi);
                for (uint e = 0u; e < 4u; ++e) {
                    tile_w[kk * (BN + 1) + cc + e] = lo[e];
                    tile_w[kk * (BN + 1) + cc + 4u + e] = hi[e];
                }
            }
        }
        barrier();
        for (uint kk = 0; kk < BK; ++kk) {
            float av[MAX_T], wv[MAX_T];
            for (uint i = 0; i < TM; ++i) av[i] = tile_a[kk * (BM + 1) + ty * TM + i];
            for (uint j = 0; j < TN; ++j) wv[j] = tile_w[kk * (BN + 1) + tx * TN + j];
            for (uint i = 0; i < TM; ++i)
                for (uint j = 0; j < TN; ++j) acc[i][j] += av[i] * wv[j];
        }
        barrier();
    }
    for (uint i = 0; i < TM; ++i) {
        uint row = row0 + ty * TM + i;
        if (row >= m) break;
        for (uint j = 0; j < TN; ++j) {
            uint col = col0 + tx * TN + j;
            if (col < n) c[off_c + row * n + col] = store_elem(acc[i][j]);
        }
    }
}

void main() {
    if (MODE == 0u && SPLIT_K == 0u) {
        const uint col = global_index();
        if (col < n) matvec(col, 0u, 1u);
    } else if (MODE == 0u) {
        const uint col0 = (gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x) * COLS;
        if (col0 < n) matvec(col0, gl_LocalInvocationID.x, gl_WorkGroupSize.x);  // uniform over the workgroup
    } else {
        tiled();
    }
}
