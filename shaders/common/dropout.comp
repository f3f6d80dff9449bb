// out[i] = keep(i) ? x[i] * scale : 0 over `count` contiguous elements, scale = 1 / (1 - p).
// keep(i) = philox(counter = (counter_base + i, stream), key = seed).x >= threshold
// (threshold = p * 2^32), a counter-based RNG in 32-bit integer math only (lavapipe has
// no 64-bit ints). seed and counter_base are read from seeds[seed_index], seeds[seed_index + 1]
// at run time, so a recorded step replays with a new seed; the backward pass runs the same
// dispatch on dy with the same seed and regenerates the same mask.
//! variant f32 -DDTYPE_F32
//! variant f16 -DDTYPE_F16
//! variant bf16 -DDTYPE_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
// Before common.glsl: its global_index() reads gl_WorkGroupSize, which is 1 until declared.
layout(local_size_x = 256) in;
#include "common.glsl"
#include "elementwise_storage.glsl"
#include "dropout_philox.glsl"

layout(binding = 0) readonly buffer Seeds { uint seeds[]; };
layout(binding = 1) readonly buffer X { STORAGE_T x[]; };
layout(binding = 2) writeonly buffer Out { STORAGE_T out_value[]; };

layout(push_constant) uniform Push {
    uint count;
    uint x_offset;
    uint out_offset;
    uint seed_index;
    uint threshold;
    float scale;
    uint stream;  // distinguishes dropout sites that share one seed
};

void main() {
    uint i = global_index();
    if (i >= count) return;
    uint seed = seeds[seed_index];
    uint counter_base = seeds[seed_index + 1];
    bool keep = philox2x32(uvec2(counter_base + i, stream), seed).x >= threshold;
    out_value[out_offset + i] = keep ? STORE(LOAD(x[x_offset + i]) * scale) : STORE(0.0);
}
