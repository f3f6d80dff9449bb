// out[i] = convert(x[strided index of i]): a view made contiguous (contiguous(), to(dtype)).
// The output is contiguous from out_offset; the input has any strides and offset,
// over up to 6 dims. With DST_STRIDED the output is written through dst_stride too
// (a part of a concatenation lands in its slice of the result). b32/b16/b8 copy raw elements of one size (any dtype of that
// size); the other variants convert: between float dtypes (fp32 in between),
// float -> int32 truncates toward zero, anything -> bool is (x != 0).
//! variant b32 -DSRC_B32 -DDST_B32
//! variant b16 -DSRC_B16 -DDST_B16
//! variant b8 -DSRC_B8 -DDST_B8
//! variant f32_f16 -DSRC_F32 -DDST_F16
//! variant f32_bf16 -DSRC_F32 -DDST_BF16
//! variant f16_f32 -DSRC_F16 -DDST_F32
//! variant f16_bf16 -DSRC_F16 -DDST_BF16
//! variant bf16_f32 -DSRC_BF16 -DDST_F32
//! variant bf16_f16 -DSRC_BF16 -DDST_F16
//! variant f32_i32 -DSRC_F32 -DDST_I32
//! variant f32_bool -DSRC_F32 -DDST_BOOL
//! variant f16_i32 -DSRC_F16 -DDST_I32
//! variant f16_bool -DSRC_F16 -DDST_BOOL
//! variant bf16_i32 -DSRC_BF16 -DDST_I32
//! variant bf16_bool -DSRC_BF16 -DDST_BOOL
//! variant i32_f32 -DSRC_I32 -DDST_F32
//! variant i32_f16 -DSRC_I32 -DDST_F16
//! variant i32_bf16 -DSRC_I32 -DDST_BF16
//! variant bool_f32 -DSRC_BOOL -DDST_F32
//! variant bool_f16 -DSRC_BOOL -DDST_F16
//! variant bool_bf16 -DSRC_BOOL -DDST_BF16
//! variant i32_bool -DSRC_I32 -DDST_BOOL
//! variant bool_i32 -DSRC_BOOL -DDST_I32
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_shader_8bit_storage : require
// Before common.glsl: its global_index() reads gl_WorkGroupSize, which is 1 until declared.
layout(local_size_x = 256) in;
#include "common.glsl"

layout(constant_id = 0) const uint NDIM = 1;  // dims after the launcher coalesced them, 1..MAX_DIMS
layout(constant_id = 1) const bool DST_STRIDED = false;
#define MAX_DIMS 6

// Source element type, and the value it is read as (VALUE_T: float for floats, int for int32/bool).
#if defined(SRC_B32)
#define SRC_T uint
#elif defined(SRC_B16)
#define SRC_T uint16_t
#elif defined(SRC_B8)
#define SRC_T uint8_t
#elif defined(SRC_F32)
#define SRC_T float
#define VALUE_T float
#define LOAD(v) (v)
#elif defined(SRC_F16)
#define SRC_T float16_t
#define VALUE_T float
#define LOAD(v) float(v)
#elif defined(SRC_BF16)
#define SRC_T uint16_t
#define VALUE_T float
#define LOAD(v) bf16_to_f32(v)
#elif defined(SRC_I32)
#define SRC_T int
#define VALUE_T int
#define LOAD(v) (v)
#elif defined(SRC_BOOL)
#define SRC_T uint8_t
#define VALUE_T int
#define LOAD(v) (uint(v) != 0u ? 1 : 0)
#endif

#if defined(DST_B32) || defined(DST_B16) || defined(DST_B8)
#define DST_T SRC_T
#define CONVERT(v) (v)
#elif defined(DST_F32)
#define DST_T float
#define CONVERT(v) float(LOAD(v))
#elif defined(DST_F16)
#define DST_T float16_t
#define CONVERT(v) float16_t(float(LOAD(v)))
#elif defined(DST_BF16)
#define DST_T uint16_t
#define CONVERT(v) f32_to_bf16(float(LOAD(v)))
#elif defined(DST_I32)
#define DST_T int
#define CONVERT(v) int(LOAD(v))
#elif defined(DST_BOOL)
#define DST_T uint8_t
#define CONVERT(v) uint8_t(LOAD(v) != VALUE_T(0) ? 1u : 0u)  // NaN -> 1, as bool(nan)
#endif

layout(binding = 0) readonly buffer Src { SRC_T src[]; };
layout(binding = 1) writeonly buffer Dst { DST_T dst[]; };

layout(push_constant) uniform Push {
    uint shape[MAX_DIMS];
    uint src_stride[MAX_DIMS];
    uint src_offset;
    uint dst_offset;
    uint dst_stride[MAX_DIMS];  // read only with DST_STRIDED
};

void main() {
    uint count = 1;
    for (uint d = 0; d < NDIM; ++d) count *= shape[d];
    uint i = global_index();
    if (i >= count) return;
    uint src_index = src_offset;
    uint dst_index = dst_offset;
    uint rest = i;
    for (uint d = NDIM - 1; d > 0; --d) {  // innermost dim first; dim 0 needs no division
        uint coord = rest % shape[d];
        src_index += coord * src_stride[d];
        if (DST_STRIDED) dst_index += coord * dst_stride[d];
        rest /= shape[d];
    }
    src_index += rest * src_stride[0];
    dst_index = DST_STRIDED ? dst_index + rest * dst_stride[0] : dst_offset + i;
    dst[dst_index] = CONVERT(src[src_index]);
}
