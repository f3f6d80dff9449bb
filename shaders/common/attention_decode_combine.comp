// Split-K decoding, step 2: merge the per-slice partial results of attention_fwd.comp
// (SPLITS > 1) into out and lse. One workgroup per (head, batch); slice s holds
// [unnormalised acc (head_dim), running max, running sum] in float32.
//! variant f32 -DT_F32
//! variant f16 -DT_F16
//! variant bf16 -DT_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "attention_common.glsl"
layout(local_size_x = 128) in;
layout(binding = 0) readonly buffer Partial { float partial[]; };
layout(binding = 1) writeonly buffer Out { T o[]; };
layout(binding = 2) writeonly buffer Lse { float lse[]; };
layout(push_constant) uniform Push { uint heads, splits, head_dim, o_off, lse_off; };

void main() {
    const uint row = gl_WorkGroupID.z * heads + gl_WorkGroupID.y;  // (batch, head), q_len = 1
    const uint stride = head_dim + 2u, base = row * splits * stride;
    float max_all = NEG_INF;
    for (uint s = 0; s < splits; ++s) max_all = max(max_all, partial[base + s * stride + head_dim]);
    float shift = max_all == NEG_INF ? 0.0 : max_all;  // empty slices hold max -inf, sum 0
    float total = 0.0;
    for (uint s = 0; s < splits; ++s)
        total += exp(partial[base + s * stride + head_dim] - shift) * partial[base + s * stride + head_dim + 1u];
    float inv = total > 0.0 ? 1.0 / total : 0.0;
    for (uint d = gl_LocalInvocationID.x; d < head_dim; d += gl_WorkGroupSize.x) {
        float acc = 0.0;
        for (uint s = 0; s < splits; ++s)
            acc += exp(partial[base + s * stride + head_dim] - shift) * partial[base + s * stride + d];
        o[o_off + row * head_dim + d] = STORE(acc * inv);
    }
    if (gl_LocalInvocationID.x == 0u) lse[lse_off + row] = total > 0.0 ? max_all + log(total) : NEG_INF;
}
