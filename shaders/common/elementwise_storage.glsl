// The storage type of one dispatch, chosen by the kernel variant's define:
// DTYPE_F32, DTYPE_F16, DTYPE_BF16 (computed in fp32) or DTYPE_I32 (computed in int).
// STORAGE_T is the buffer element; LOAD/STORE convert to and from VALUE_T.
#ifndef VKFORMERS_ELEMENTWISE_STORAGE_GLSL
#define VKFORMERS_ELEMENTWISE_STORAGE_GLSL

#if defined(DTYPE_F32)
#define STORAGE_T float
#define LOAD(v) (v)
#define STORE(x) (x)
#elif defined(DTYPE_F16)
#define STORAGE_T float16_t
#define LOAD(v) float(v)
#define STORE(x) float16_t(x)
#elif defined(DTYPE_BF16)
#define STORAGE_T uint16_t
#define LOAD(v) bf16_to_f32(v)
#define STORE(x) f32_to_bf16(x)
#elif defined(DTYPE_I32)
#define STORAGE_T int
#define LOAD(v) (v)
#define STORE(x) (x)
#define VALUE_IS_INT 1
#else
#error "define one of DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_I32"
#endif

#ifdef VALUE_IS_INT
#define VALUE_T int
#else
#define VALUE_T float
#endif

#endif
