// Products with a quantized weight W (packed blocks, quant_block.glsl), dequantized inside the product:
//   TRANS_W = 1:  C [m, n] = A [m, k] @ W^T, W [n, k]   (a Linear layer's forward, x @ W^T)
//   TRANS_W = 0:  C [m, n] = A [m, k] @ W,   W [k, n]   (its input gradient, dY @ W)
// A and C share the activation dtype (the variant); the sums are float32. W is never expanded to memory.
// MODE 0 (matvec, TRANS_W = 1, m = ROWS): a workgroup per column of C, its invocations splitting k four
// elements at a time, every row of A served by each dequantized group (SPLIT_K = 0: an invocation per column).
// MODE 1 (tiled): a BM x BN tile of C per workgroup, K in steps of BK; each step dequantizes its BK x BN slice
// of W into shared memory, where TM x TN register blocks multiply it; sizes past m, n or k read zeros, so no
// size needs to be a multiple of a tile.
//! variant f32 -DELEM_F32
//! variant f16 -DELEM_F16
//! variant bf16 -DELEM_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "transformer_common.glsl"

layout(constant_id = 0) const uint FORMAT = 0;   // quant_block.glsl QUANT_*
layout(constant_id = 1) const uint MODE = 0;     // 0: matvec, 1: tiled
layout(constant_id = 2) const uint TRANS_W = 1;
layout(constant_id = 3) const uint BM = 64;
layout(constant_id = 4) const uint BN = 64;
layout(constant_id = 5) const uint BK = 32;      // multiple of 4
layout(constant_id = 6) const uint TM = 4;       // at most MAX_T
layout(constant_id = 7) const uint TN = 4;       // at most MAX_T
layout(local_size_x_id = 8) in;                  // tiled: (BM / TM) * (BN / TN); matvec: any multiple of the subgroup
layout(constant_id = 9) const uint SPLIT_K = 1;  // matvec: 1: a workgroup per column; 0: an invocation per column
layout(constant_id = 10) const uint ROWS = 1;    // matvec: m, so that the per-row sums stay in registers

layout(push_constant) uniform Push {
    uint m; uint n; uint k;
    uint off_a; uint off_w; uint off_c;  // off_w in bytes
    uint row_bytes;                      // bytes of one row of W
};
layout(binding = 0) readonly buffer A { ELEM_T a[]; };
layout(binding = 1) readonly buffer Packed { uint packed_words[]; };
layout(binding = 2) writeonly buffer C { ELEM_T c[]; };
#include "quant_block.glsl"

#define MAX_T 8

shared float tile_a[BK * (BM + 1)];  // k-major, padded against bank conflicts
shared float tile_w[BK * (BN + 1)];

// One invocation per column, walking its row of W alone: on a CPU device (lavapipe) each invocation then
// streams one row, and no reduction is needed.
void matvec_by_column() {
    const uint col = global_index();
    if (col >= n) return;
    float acc[ROWS];
    for (uint r = 0; r < ROWS; ++r) acc[r] = 0.0;
    for (uint kk = 0; kk < k; kk += 4u) {
        vec4 w = quant_row4(off_w, row_bytes, col, kk);
        for (uint r = 0; r < ROWS; ++r) {
            uint at = off_a + r * k + kk;
            acc[r] += w.x * load_elem(a[at]) + w.y * load_elem(a[at + 1u]) + w.z * load_elem(a[at + 2u])
                      + w.w * load_elem(a[at + 3u]);
        }
    }
    for (uint r = 0; r < ROWS; ++r) c[off_c + r * n + col] = store_elem(acc[r]);
}

void matvec() {
    const uint col = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    if (col >= n) return;  // uniform over the workgroup
    float acc[ROWS];
    for (uint r = 0; r < ROWS; ++r) acc[r] = 0.0;
    for (uint kk = 4u * gl_LocalInvocationID.x; kk < k; kk += 4u * gl_WorkGroupSize.x) {
        vec4 w = quant_row4(off_w, row_bytes, col, kk);
        for (uint r = 0; r < ROWS; ++r) {
            uint at = off_a + r * k + kk;
            acc[r] += w.x * load_elem(a[at]) + w.y * load_elem(a[at + 1u]) + w.z * load_elem(a[at + 2u])
                      + w.w * load_elem(a[at + 3u]);
        }
    }
    for (uint r = 0; r < ROWS; ++r) {
        float total = workgroup_sum(acc[r]);
        if (gl_LocalInvocationID.x == 0u) c[off_c + r * n + col] = store_elem(total);
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
        // W's inner dimension (k for W^T, n for W) is a whole number of blocks, so of groups of 4.
        if (TRANS_W == 1u) {
            for (uint i = tid; i < BN * BK / 4u; i += threads) {
                uint r = i / (BK / 4u), kk = 4u * (i % (BK / 4u));
                vec4 w = col0 + r < n && k0 + kk < k ? quant_row4(off_w, row_bytes, col0 + r, k0 + kk) : vec4(0.0);
                for (uint e = 0u; e < 4u; ++e) tile_w[(kk + e) * (BN + 1) + r] = w[e];
            }
        } else {
            for (uint i = tid; i < BN * BK / 4u; i += threads) {
                uint kk = i / (BN / 4u), cc = 4u * (i % (BN / 4u));
                vec4 w = k0 + kk < k && col0 + cc < n ? quant_row4(off_w, row_bytes, k0 + kk, col0 + cc) : vec4(0.0);
                for (uint e = 0u; e < 4u; ++e) tile_w[kk * (BN + 1) + cc + e] = w[e];
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
    if (MODE == 0u && SPLIT_K == 0u) matvec_by_column();
    else if (MODE == 0u) matvec();
    else tiled();
}
