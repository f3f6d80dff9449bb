// Rotary position embedding on x [batch, heads, seq, head_dim] (ELEM_T; any strides over batch, heads and seq, so
// that a projection's [batch, seq, heads, head_dim] output is read as it lies), positions int32 [batch, seq],
// inv_freq float32 [rot_dim / 2]; out is dense. The first rot_dim dims of each head rotate
// in pairs by angle = position * inv_freq[i]; the rest pass through (partial rotary).
//   half layout (HF rotate_half): pair (i, i + rot_dim/2)
//   INTERLEAVED (GPT-J):          pair (2i, 2i + 1)
// cos and sin are multiplied by attention_scaling (yarn / longrope), as HF does.
// INVERSE rotates by -angle: the backward pass (dx = R(-angle) dy, the same scaling).
// Works in place (out bound to x) when IN_PLACE skips the pass-through copy.
//! variant f32 -DELEM_F32
//! variant f16 -DELEM_F16
//! variant bf16 -DELEM_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "transformer_common.glsl"
#include "rope_angle.glsl"
layout(local_size_x = 256) in;

layout(constant_id = 0) const bool INTERLEAVED = false;
layout(constant_id = 1) const bool INVERSE = false;
layout(constant_id = 2) const bool IN_PLACE = false;

layout(binding = 0) readonly buffer X { ELEM_T x[]; };
layout(binding = 1) readonly buffer Positions { int positions[]; };
layout(binding = 2) readonly buffer InvFreq { float inv_freq[]; };
layout(binding = 3) writeonly buffer Out { ELEM_T out_x[]; };
layout(push_constant) uniform Push {
    uint vectors;  // batch * heads * seq
    uint heads; uint seq_len; uint head_dim; uint rot_dim;
    float attention_scaling;
    uint x_offset; uint positions_offset; uint inv_freq_offset; uint out_offset;
    uint x_stride_batch; uint x_stride_head; uint x_stride_seq;  // elements
};

void main() {
    uint half_rot = rot_dim / 2;
    uint per_vector = half_rot + (IN_PLACE ? 0 : head_dim - rot_dim);  // invocations per head vector
    uint i = global_index();
    if (i >= vectors * per_vector) return;
    uint v = i / per_vector;
    uint j = i - v * per_vector;
    uint base = v * head_dim;
    uint s = v % seq_len;
    uint b = v / (seq_len * heads);
    uint h = (v / seq_len) % heads;
    uint x_base = x_offset + b * x_stride_batch + h * x_stride_head + s * x_stride_seq;
    if (j >= half_rot) {  // pass-through dims (out-of-place only)
        uint d = rot_dim + (j - half_rot);
        out_x[out_offset + base + d] = x[x_base + d];
        return;
    }
    // float32 product, as HF: position_ids.float() * inv_freq.
    float angle = float(positions[positions_offset + b * seq_len + s]) * inv_freq[inv_freq_offset + j];
    vec2 cs = cos_sin(angle) * attention_scaling;
    float sn = INVERSE ? -cs.y : cs.y;
    uint d1 = INTERLEAVED ? 2 * j : j;
    uint d2 = INTERLEAVED ? 2 * j + 1 : j + half_rot;
    float x1 = load_elem(x[x_base + d1]);
    float x2 = load_elem(x[x_base + d2]);
    out_x[out_offset + base + d1] = store_elem(x1 * cs.x - x2 * sn);
    out_x[out_offset + base + d2] = store_elem(x2 * cs.x + x1 * sn);
}
