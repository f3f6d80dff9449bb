// Shared pieces of the attention kernels: storage types, the specialization
// constants every attention kernel takes, and the score rule (scale, softcap,
// ALiBi, causal / sliding-window / padding masks) so forward and backward agree.
//
// The score rule itself is in attention_score.glsl (it needs the kernel's bindings).
#ifndef VKFORMERS_ATTENTION_COMMON_GLSL
#define VKFORMERS_ATTENTION_COMMON_GLSL

// Storage element type of q, k, v, out and their gradients; math is float32.
// (ATTENTION_BITS_ONLY: the kernel handles storage as raw bits itself.)
#if defined(ATTENTION_BITS_ONLY)
#elif defined(T_F32)
#define T float
#define LOAD(x) (x)
#define STORE(x) (x)
#elif defined(T_F16)
#define T float16_t
#define LOAD(x) float(x)
#define STORE(x) float16_t(x)
#else
#define T uint16_t
#define LOAD(x) bf16_to_f32(x)
#define STORE(x) f32_to_bf16(x)
#endif

layout(constant_id = 0) const uint HEAD_DIM = 64;
layout(constant_id = 1) const uint BLOCK_ROWS = 16;   // rows a workgroup owns (queries, or keys in dK/dV)
layout(constant_id = 2) const uint BLOCK_COLS = 16;   // rows of the tile streamed through shared memory
layout(constant_id = 3) const uint LANES = 8;         // threads per owned row; divides HEAD_DIM and BLOCK_COLS
layout(constant_id = 4) const bool CAUSAL = true;
layout(constant_id = 5) const bool HAS_MASK = false;
layout(constant_id = 6) const bool HAS_ALIBI = false;
layout(constant_id = 7) const bool HAS_SOFTCAP = false;
// constant_id 8 is kernel specific; 9 is the workgroup size (= BLOCK_ROWS * LANES).

const uint THREADS = BLOCK_ROWS * LANES;
const uint ROW_STRIDE = HEAD_DIM + 1;          // padded shared rows: lanes reading one column hit different banks
const uint DIMS_PER_LANE = HEAD_DIM / LANES;   // output columns lane j owns: j, j + LANES, ...
const uint COLS_PER_LANE = BLOCK_COLS / LANES; // streamed rows lane j scores: j, j + LANES, ...

#define NEG_INF uintBitsToFloat(0xFF800000u)

#endif
