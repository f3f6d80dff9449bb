// Tiled matmul: C[b] = alpha * op(A[b]) @ op(B[b]) (+ bias[col]) + beta * C[b], row-major,
// accumulated in float32 whatever the storage types (see engine/kernels/matmul.py).
//
// A workgroup computes a BM x BN tile of C; each invocation a TM x TN block of it
// in registers. K advances BK at a time: the next A and B tiles are loaded from
// global memory into registers while the current ones (in shared memory, stored
// k-major so the inner loop reads vec4s) are multiplied.
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
#include "common.glsl"

layout(constant_id = 0) const uint BM = 64;   // rows of C per workgroup
layout(constant_id = 1) const uint BN = 64;   // columns of C per workgroup
layout(constant_id = 2) const uint BK = 16;   // K step
layout(constant_id = 3) const uint TM = 4;    // rows per invocation (multiple of 4, at most MAX_T)
layout(constant_id = 4) const uint TN = 4;    // columns per invocation (multiple of 4, at most MAX_T)
layout(constant_id = 5) const uint TRANS_A = 0;
layout(constant_id = 6) const uint TRANS_B = 0;
layout(constant_id = 7) const uint HAS_BIAS = 0;
// constant_id 8: the workgroup size, which must be (BM / TM) * (BN / TN)
layout(local_size_x_id = 8) in;
layout(constant_id = 9) const uint GATE_MODE = 0;  // matmul_io.glsl: GATE_NONE, _ROWS, _DEPTH, _SPAN_ROWS, _SPAN_DEPTH
layout(constant_id = 10) const uint GROUP_ROWS = 0;  // matmul_io.glsl tile_of_workgroup: bands of tile rows
#include "matmul_io.glsl"

#define MAX_T 8       // register block bound (arrays below are sized for it)
#define MAX_LOADS 16  // bound on BM * BK / workgroup size (and BN * BK / workgroup size)

const uint THREADS = (BM / TM) * (BN / TN);
const uint LOADS_A = BM * BK / THREADS;
const uint LOADS_B = BN * BK / THREADS;
// Row pitch of the k-major shared tiles, padded by 4 floats against bank conflicts
// when a row of A (k contiguous) is stored transposed.
const uint PITCH_A = BM + 4;
const uint PITCH_B = BN + 4;
shared vec4 tile_a[BK * PITCH_A / 4];
shared vec4 tile_b[BK * PITCH_B / 4];

void store_shared_a(uint kk, uint row, float v) { tile_a[(kk * PITCH_A + row) / 4][row % 4] = v; }
void store_shared_b(uint kk, uint col, float v) { tile_b[(kk * PITCH_B + col) / 4][col % 4] = v; }

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uvec2 tile = tile_of_workgroup(GROUP_ROWS);
    const uint row0 = tile.y * BM, col0 = tile.x * BN;
    const uint z = gl_WorkGroupID.z;
    // A gated product (uniform over the workgroup): padding rows are not multiplied, zero K steps skipped;
    // a span moves the product to its rows (or K entries) of packed A, B and C.
    uint m_rows = m, k_end = k, shift_a = 0, shift_b = 0, shift_c = 0;
    if (GATE_MODE == GATE_ROWS && row0 >= gate_count(z)) k_end = 0;
    if (GATE_MODE == GATE_DEPTH) k_end = min(k, gate_count(z));
    if (GATE_MODE == GATE_SPAN_ROWS) {
        m_rows = span_count(z, m);
        if (row0 >= m_rows) return;  // uniform: no row of this block is the span's
        shift_a = span_start(z) * k;
        shift_c = span_start(z) * n;
    }
    if (GATE_MODE == GATE_SPAN_DEPTH) {
        k_end = span_count(z, k);
        shift_a = span_start(z) * m;
        shift_b = span_start(z) * n;
    }
    const uint base_a = off_a + z * stride_a + shift_a;
    const uint base_b = off_b + z * stride_b + shift_b;
    const uint tx = tid % (BN / TN), ty = tid / (BN / TN);

    float acc[MAX_T][MAX_T];
    for (uint i = 0; i < TM; ++i)
        for (uint j = 0; j < TN; ++j) acc[i][j] = 0.0;

    // Element e of a tile load: which (tile row or column, k) it is depends on
    // which index is contiguous in memory, so consecutive invocations read
    // consecutive addresses.
    float next_a[MAX_LOADS], next_b[MAX_LOADS];
    uint k0 = 0;
#define LOAD_TILES(K0)                                                                  \
    for (uint l = 0; l < LOADS_A; ++l) {                                                \
        uint e = tid + l * THREADS, r, kk;                                              \
        if (TRANS_A != 0) { kk = e / BM; r = e % BM; } else { r = e / BK; kk = e % BK; } \
        uint gr = row0 + r, gk = (K0) + kk;                                             \
        next_a[l] = (gr < m_rows && gk < k_end)                                             \
            ? load_a(base_a + (TRANS_A != 0 ? gk * m + gr : gr * k + gk)) : 0.0;        \
    }                                                                                   \
    for (uint l = 0; l < LOADS_B; ++l) {                                                \
        uint e = tid + l * THREADS, c, kk;                                              \
        if (TRANS_B != 0) { c = e / BK; kk = e % BK; } else { kk = e / BN; c = e % BN; } \
        uint gc = col0 + c, gk = (K0) + kk;                                             \
        next_b[l] = (gc < n && gk < k_end)                                                  \
            ? load_b(base_b + (TRANS_B != 0 ? gc * k + gk : gk * n + gc)) : 0.0;        \
    }

    if (k_end > 0) { LOAD_TILES(0) }
    for (; k0 < k_end; k0 += BK) {
        for (uint l = 0; l < LOADS_A; ++l) {
            uint e = tid + l * THREADS;
            if (TRANS_A != 0) store_shared_a(e / BM, e % BM, next_a[l]);
            else store_shared_a(e % BK, e / BK, next_a[l]);
        }
        for (uint l = 0; l < LOADS_B; ++l) {
            uint e = tid + l * THREADS;
            if (TRANS_B != 0) store_shared_b(e % BK, e / BK, next_b[l]);
            else store_shared_b(e / BN, e % BN, next_b[l]);
        }
        barrier();
        if (k0 + BK < k_end) { LOAD_TILES(k0 + BK) }  // in flight while we multiply

        for (uint kk = 0; kk < BK; ++kk) {
            vec4 a[MAX_T / 4], b[MAX_T / 4];
            for (uint i = 0; i < TM / 4; ++i) a[i] = tile_a[(kk * PITCH_A + ty * TM) / 4 + i];
            for (uint j = 0; j < TN / 4; ++j) b[j] = tile_b[(kk * PITCH_B + tx * TN) / 4 + j];
            for (uint i = 0; i < TM; ++i)
                for (uint j = 0; j < TN; ++j) acc[i][j] = fma(a[i / 4][i % 4], b[j / 4][j % 4], acc[i][j]);
        }
        barrier();
    }

    const uint base_c = off_c + z * stride_c + shift_c;
    for (uint i = 0; i < TM; ++i) {
        uint r = row0 + ty * TM + i;
        if (r >= m_rows) break;
        for (uint j = 0; j < TN; ++j) {
            uint c = col0 + tx * TN + j;
            if (c < n) store_c(base_c + r * n + c, c, acc[i][j]);
        }
    }
}
