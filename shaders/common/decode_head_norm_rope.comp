// The tail of a decode step's q/k/v projections for models with QK-norm (Qwen3, OLMo-2 per head): each q
// and k head is RMS-normalised over its head_dim values (weight [head_dim]; 1 + weight with NORM_OFFSET),
// rotated (rotary_pair / rotate_pair, rope_angle.glsl), and stored: q into q_out [rows, heads, 1, head_dim],
// k into the KV cache at slot cache_start[0]; the workgroup of a k head also copies that head of v into its
// cache. One workgroup per (row, head) of q and k; one invocation per pair of dims (head_dim <= 2 * 128).
// The products themselves are decode_matvec.comp's (plain mode, the attention norm folded in).
//! variant f32 -DELEM_F32
//! variant f16 -DELEM_F16
//! variant bf16 -DELEM_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "transformer_common.glsl"
#include "rope_angle.glsl"
layout(local_size_x = 128) in;

layout(constant_id = 0) const uint INTERLEAVED = 0;
layout(constant_id = 1) const uint NORM_OFFSET = 0;
// A paged cache: pools of blocks [blocks, kv_heads, PAGE_SIZE, head_dim], row r's slot through its block table
// (capacity / PAGE_SIZE entries at cache_start[start_offset + 2 + r * ...]); block 0 (scratch) is never written.
layout(constant_id = 2) const uint PAGE_SIZE = 0;

layout(binding = 0) readonly buffer QIn { ELEM_T q_in[]; };      // [rows, heads * head_dim]
layout(binding = 1) readonly buffer KIn { ELEM_T k_in[]; };      // [rows, kv_heads * head_dim]
layout(binding = 2) readonly buffer VIn { ELEM_T v_in[]; };      // [rows, kv_heads * head_dim]
layout(binding = 3) readonly buffer QNorm { ELEM_T q_weight[]; };
layout(binding = 4) readonly buffer KNorm { ELEM_T k_weight[]; };
layout(binding = 5) readonly buffer Positions { int positions[]; };
layout(binding = 6) readonly buffer InvFreq { float inv_freq[]; };
layout(binding = 7) readonly buffer CacheStart { uint cache_start[]; };
layout(binding = 8) writeonly buffer QOut { ELEM_T q_out[]; };
layout(binding = 9) writeonly buffer KCache { ELEM_T k_cache[]; };
layout(binding = 10) writeonly buffer VCache { ELEM_T v_cache[]; };

layout(push_constant) uniform Push {
    uint heads; uint kv_heads; uint head_dim; uint rot_dim; uint capacity;
    float eps; float attention_scaling;
    uint q_offset; uint k_offset; uint v_offset; uint q_weight_offset; uint k_weight_offset;
    uint positions_offset; uint inv_freq_offset; uint start_offset;
};

void main() {
    uint row = gl_WorkGroupID.x / (heads + kv_heads);
    uint head = gl_WorkGroupID.x % (heads + kv_heads);
    bool is_q = head < heads;
    if (!is_q) head -= heads;
    uint i = gl_LocalInvocationID.x;
    bool in_head = i < head_dim / 2;
    int freq;
    uvec2 dims = rotary_pair(in_head ? i : 0, rot_dim, INTERLEAVED != 0, freq);
    uint base = is_q ? q_offset + (row * heads + head) * head_dim : k_offset + (row * kv_heads + head) * head_dim;
    vec2 x = vec2(0.0);
    if (in_head) {
        x = is_q ? vec2(load_elem(q_in[base + dims.x]), load_elem(q_in[base + dims.y]))
                 : vec2(load_elem(k_in[base + dims.x]), load_elem(k_in[base + dims.y]));
    }
    float rstd = inversesqrt(workgroup_sum(dot(x, x)) / float(head_dim) + eps);  // every invocation takes part
    if (!in_head) return;
    vec2 w = is_q ? vec2(load_elem(q_weight[q_weight_offset + dims.x]), load_elem(q_weight[q_weight_offset + dims.y]))
                  : vec2(load_elem(k_weight[k_weight_offset + dims.x]), load_elem(k_weight[k_weight_offset + dims.y]));
    if (NORM_OFFSET != 0) w += 1.0;
    vec2 y = x * rstd * w;
    if (freq >= 0) {
        float angle = float(positions[positions_offset + row]) * inv_freq[inv_freq_offset + freq];
        y = rotate_pair(y, angle, attention_scaling);
    }
    if (is_q) {
        uint at = (row * heads + head) * head_dim;
        q_out[at + dims.x] = store_elem(y.x);
        q_out[at + dims.y] = store_elem(y.y);
        return;
    }
    uint slot = ((row * kv_heads + head) * capacity + cache_start[start_offset]) * head_dim;
    if (PAGE_SIZE > 0u) {
        uint position = cache_start[start_offset];
        uint block = cache_start[start_offset + 2u + row * (capacity / PAGE_SIZE) + position / PAGE_SIZE];
        if (block == 0u) return;
        slot = ((block * kv_heads + head) * PAGE_SIZE + position % PAGE_SIZE) * head_dim;
    }
    uint v_base = v_offset + (row * kv_heads + head) * head_dim;
    k_cache[slot + dims.x] = store_elem(y.x);
    k_cache[slot + dims.y] = store_elem(y.y);
    v_cache[slot + dims.x] = v_in[v_base + dims.x];
    v_cache[slot + dims.y] = v_in[v_base + dims.y];
}
