// dst[i] = convert(src[i]) between float32, float16 and bfloat16 storage.
//! variant f32_f16 -DSRC_F32 -DDST_F16
//! variant f16_f32 -DSRC_F16 -DDST_F32
//! variant f32_bf16 -DSRC_F32 -DDST_BF16
//! variant bf16_f32 -DSRC_BF16 -DDST_F32
//! variant f16_bf16 -DSRC_F16 -DDST_BF16
//! variant bf16_f16 -DSRC_BF16 -DDST_F16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;

#if defined(SRC_F32)
#define SRC_T float
#define LOAD(v) (v)
#elif defined(SRC_F16)
#define SRC_T float16_t
#define LOAD(v) float(v)
#else
#define SRC_T uint16_t
#define LOAD(v) bf16_to_f32(v)
#endif

#if defined(DST_F32)
#define DST_T float
#define STORE(v) (v)
#elif defined(DST_F16)
#define DST_T float16_t
#define STORE(v) float16_t(v)
#else
#define DST_T uint16_t
#define STORE(v) f32_to_bf16(v)
#endif

layout(binding = 0) readonly buffer Src { SRC_T src[]; };
layout(binding = 1) writeonly buffer Dst { DST_T dst[]; };
layout(push_constant) uniform Push { uint n; };

void main() {
    uint i = global_index();
    if (i < n) dst[i] = STORE(LOAD(src[i]));
}
