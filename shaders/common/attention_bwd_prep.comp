// Attention backward, step 1: delta[row] = sum_d d_out[row, d] * out[row, d], the
// softmax-gradient term each query row needs (flash-attention 2's D), minus the
// gradient of the row's logsumexp when has_d_lse: d lse / d score_j = p_j, so it enters dS = p (dP - delta)
// there (attention sinks use the logsumexp).
//! variant f32 -DT_F32
//! variant f16 -DT_F16
//! variant bf16 -DT_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "attention_common.glsl"
layout(local_size_x = 128) in;
layout(binding = 0) readonly buffer Out { T o[]; };
layout(binding = 1) readonly buffer DOut { T d_o[]; };
layout(binding = 2) writeonly buffer Delta { float delta[]; };
layout(binding = 3) readonly buffer DLse { float d_lse[]; };
layout(push_constant) uniform Push { uint rows, head_dim, o_off, d_o_off, d_lse_off, has_d_lse; };

void main() {
    uint row = global_index();
    if (row >= rows) return;
    float sum = 0.0;
    for (uint d = 0; d < head_dim; ++d)
        sum += LOAD(o[o_off + row * head_dim + d]) * LOAD(d_o[d_o_off + row * head_dim + d]);
    delta[row] = has_d_lse != 0u ? sum - d_lse[d_lse_off + row] : sum;
}
