// Throwaway experiment: fixed-size coopmat GEMM, A [M,K] and B [K,N] row-major, C f32 [M,N].
//! target vulkan1.3
//! variant base -DBK=64 -DSGR=2
//! variant bk32 -DBK=32 -DSGR=2
//! variant sg41 -DBK=64 -DSGR=4
//! variant specwg -DBK=64 -DSGR=2 -DSPEC_WG
//! variant nopref -DBK=64 -DSGR=2 -DNO_PREFETCH
//! variant nomss -DBK=64 -DSGR=2 -DNO_MSS
//! variant f16stage -DBK=64 -DSGR=2 -DF16_STAGE
//! variant loopidx -DBK=64 -DSGR=2 -DSPEC_LOOPS
//! variant big -DBK=32 -DSGR=2 -DBN_=256
//! variant nounroll -DBK=64 -DSGR=2 -DNO_UNROLL
//! variant bf16 -DBK=64 -DSGR=2
//! variant bf16bk32 -DBK=32 -DSGR=2
//! postprocess bf16* ../../tools/spirv_bf16.py
#version 450
#extension GL_KHR_cooperative_matrix : require
#ifndef NO_MSS
#extension GL_KHR_memory_scope_semantics : require
#endif
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#ifdef NO_UNROLL
#define UNROLL
#else
#define UNROLL [[unroll]]
#endif
#ifdef NO_MSS
#define SCOPE 3
#else
#define SCOPE gl_ScopeSubgroup
#endif
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types : require

#ifdef SPEC_WG
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint SPEC_THREADS = 256;
#else
layout(local_size_x = 256) in;
#endif
layout(constant_id = 2) const uint SPEC_BK = BK;

layout(binding = 0) readonly buffer MatA { uvec4 a_data[]; };
layout(binding = 1) readonly buffer MatB { uvec4 b_data[]; };
layout(binding = 2) writeonly buffer MatC { float c_data[]; };
layout(push_constant) uniform Push { uint m, n, k; };

#ifndef BN_
#define BN_ 128
#endif
const uint BM = 128, BN = BN_, THREADS = 256;
const uint SGC = 8 / SGR;
const uint WM = BM / SGR, WN = BN / SGC, FM = WM / 16, FN = WN / 16;
const uint PA = BK / 8 + 1, PB = BN / 8 + 1;             // pitches in uvec4 (8 halves)
const uint LOADS_A = BM * BK / 8 / THREADS, LOADS_B = BK * BN / 8 / THREADS;
#ifdef F16_STAGE
#define ST f16vec4
#define S 2
shared f16vec4 tile_a[BM * PA * 2];
shared f16vec4 tile_b[BK * PB * 2];
void put_a(uint w, uvec4 v) { tile_a[2*w] = f16vec4(unpackFloat2x16(v.x), unpackFloat2x16(v.y)); tile_a[2*w+1] = f16vec4(unpackFloat2x16(v.z), unpackFloat2x16(v.w)); }
void put_b(uint w, uvec4 v) { tile_b[2*w] = f16vec4(unpackFloat2x16(v.x), unpackFloat2x16(v.y)); tile_b[2*w+1] = f16vec4(unpackFloat2x16(v.z), unpackFloat2x16(v.w)); }
#else
#define S 1
shared uvec4 tile_a[BM * PA];
shared uvec4 tile_b[BK * PB];
void put_a(uint w, uvec4 v) { tile_a[w] = v; }
void put_b(uint w, uvec4 v) { tile_b[w] = v; }
#endif

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint row0 = gl_WorkGroupID.y * BM, col0 = gl_WorkGroupID.x * BN;
    const uint sg = gl_SubgroupID, sr = sg / SGC, sc = sg % SGC;
    const uint k8 = k / 8, n8 = n / 8;
#ifdef SPEC_LOOPS
    const uint threads = gl_WorkGroupSize.x;
#else
    const uint threads = THREADS;
#endif
    coopmat<float, SCOPE, 16, 16, gl_MatrixUseAccumulator> acc[FM][FN];
    UNROLL for (uint i = 0; i < FM; ++i)
        UNROLL for (uint j = 0; j < FN; ++j) acc[i][j] = coopmat<float, SCOPE, 16, 16, gl_MatrixUseAccumulator>(0.0);

    uvec4 ra[LOADS_A], rb[LOADS_B];
#define FETCH(K0) \
    UNROLL for (uint l = 0; l * threads < BM * BK / 8; ++l) { uint q = tid + l * threads; \
        ra[l] = a_data[(row0 + q / (BK / 8)) * k8 + (K0) / 8 + q % (BK / 8)]; } \
    UNROLL for (uint l = 0; l * threads < BK * BN / 8; ++l) { uint q = tid + l * threads; \
        rb[l] = b_data[((K0) + q / (BN / 8)) * n8 + col0 / 8 + q % (BN / 8)]; }
#define STAGE() \
    UNROLL for (uint l = 0; l * threads < BM * BK / 8; ++l) { uint q = tid + l * threads; put_a(q / (BK / 8) * PA + q % (BK / 8), ra[l]); } \
    UNROLL for (uint l = 0; l * threads < BK * BN / 8; ++l) { uint q = tid + l * threads; put_b(q / (BN / 8) * PB + q % (BN / 8), rb[l]); }

#ifndef NO_PREFETCH
    FETCH(0)
#endif
    for (uint k0 = 0; k0 < k; k0 += BK) {
#ifdef NO_PREFETCH
        FETCH(k0)
#endif
        STAGE()
        barrier();
#ifndef NO_PREFETCH
        if (k0 + BK < k) { FETCH(k0 + BK) }
#endif
        UNROLL for (uint kk = 0; kk < BK; kk += 16) {
            coopmat<float16_t, SCOPE, 16, 16, gl_MatrixUseA> fa[FM];
            coopmat<float16_t, SCOPE, 16, 16, gl_MatrixUseB> fb[FN];
            UNROLL for (uint i = 0; i < FM; ++i)
                coopMatLoad(fa[i], tile_a, S * ((sr * WM + 16 * i) * PA + kk / 8), S * PA, gl_CooperativeMatrixLayoutRowMajor);
            UNROLL for (uint j = 0; j < FN; ++j)
                coopMatLoad(fb[j], tile_b, S * (kk * PB + (sc * WN + 16 * j) / 8), S * PB, gl_CooperativeMatrixLayoutRowMajor);
            UNROLL for (uint i = 0; i < FM; ++i)
                UNROLL for (uint j = 0; j < FN; ++j) acc[i][j] = coopMatMulAdd(fa[i], fb[j], acc[i][j]);
        }
        barrier();
    }
    UNROLL for (uint i = 0; i < FM; ++i)
        UNROLL for (uint j = 0; j < FN; ++j)
            coopMatStore(acc[i][j], c_data, (row0 + sr * WM + 16 * i) * n + col0 + sc * WN + 16 * j, n, gl_CooperativeMatrixLayoutRowMajor);
}
