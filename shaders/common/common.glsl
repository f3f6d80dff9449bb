// Shared helpers for vkformers kernels: element types and conversions.
#ifndef VKFORMERS_COMMON_GLSL
#define VKFORMERS_COMMON_GLSL

#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types : require

// bfloat16 is stored as its 16-bit pattern: the top half of a float32.
float bf16_to_f32(uint16_t bits) { return uintBitsToFloat(uint(bits) << 16); }

// float32 -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN.
uint16_t f32_to_bf16(float x) {
    if (isnan(x)) return uint16_t(0x7FC0);
    uint u = floatBitsToUint(x);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Index of this invocation over a 2-D grid of workgroups (x fastest), so that a
// 1-D problem larger than maxComputeWorkGroupCount.x * local size still fits.
// A macro, not a function: gl_WorkGroupSize is only known after the kernel's
// `layout(local_size_x = ...) in;`, which usually follows this include.
#define global_index() (gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x)

#endif
