// KV-cache write: cache[o, start + t, :] = new[o, t, :] for the keys and the values of one layer,
// where `start` is read from a uint32 buffer on the GPU. A recorded decode step can then be
// replayed at every position: only the uploaded start changes, never the recorded commands.
//   new:   [outer, rows, inner]      (outer = batch * kv_heads, rows = new tokens, inner = head_dim)
//   cache: [outer, capacity, inner]  (capacity = max_len)
// Workgroups with z = 0 copy the keys, z = 1 the values. Rows that would land at or beyond
// `capacity` are dropped (the launcher checks sizes on the host; this only keeps memory safe).
// Elements are copied as raw bits: b32 serves float32, b16 serves float16 and bfloat16.
// PAGE_SIZE > 0: the cache is a pool of blocks [blocks, inner_heads, PAGE_SIZE, inner] (outer = batch *
// heads), and row r of sequence b lands in block start_buffer[table_offset + b * table_stride + r / PAGE_SIZE];
// `capacity` is then the sequence's logical capacity (table_stride * PAGE_SIZE). Block 0 is scratch: never
// written, so that a masked read of it (weight 0) never meets an infinity.
//! variant b32 -DELEM_T=uint
//! variant b16 -DELEM_T=uint16_t
#version 450
#extension GL_GOOGLE_include_directive : require
// Before common.glsl: its global_index() reads gl_WorkGroupSize, which is 1 until declared.
layout(local_size_x = 256) in;
#include "common.glsl"

layout(push_constant) uniform Push {
    uint count;        // outer * rows * inner: elements of one of k, v
    uint rows;
    uint inner;
    uint capacity;
    uint k_new_offset; uint v_new_offset;
    uint k_cache_offset; uint v_cache_offset;
    uint start_offset;  // element of `start_buffer` holding the first row to write
    uint heads;         // paged: the kv heads of a sequence (outer = sequences * heads)
    uint table_offset;  // paged: element of `start_buffer` where the block tables begin
    uint table_stride;  // paged: block table entries per sequence
};
layout(constant_id = 0) const uint PAGE_SIZE = 0;
layout(binding = 0) readonly buffer KNew { ELEM_T k_new[]; };
layout(binding = 1) readonly buffer VNew { ELEM_T v_new[]; };
layout(binding = 2) readonly buffer Start { uint start_buffer[]; };
layout(binding = 3) writeonly buffer KCache { ELEM_T k_cache[]; };
layout(binding = 4) writeonly buffer VCache { ELEM_T v_cache[]; };

void main() {
    uint i = global_index();
    if (i >= count) return;
    uint col = i % inner;
    uint row = (i / inner) % rows;
    uint outer = i / (inner * rows);
    uint target_row = start_buffer[start_offset] + row;
    if (target_row >= capacity) return;
    uint dst = (outer * capacity + target_row) * inner + col;
    if (PAGE_SIZE > 0u) {
        uint sequence = outer / heads, head = outer % heads;
        uint block = start_buffer[table_offset + sequence * table_stride + target_row / PAGE_SIZE];
        if (block == 0u) return;  // the scratch block (padding, rows that left) stays zero: masked reads of it are 0
        dst = ((block * heads + head) * PAGE_SIZE + target_row % PAGE_SIZE) * inner + col;
    }
    if (gl_WorkGroupID.z == 0u) {
        k_cache[k_cache_offset + dst] = k_new[k_new_offset + i];
    } else {
        v_cache[v_cache_offset + dst] = v_new[v_new_offset + i];
    }
}
