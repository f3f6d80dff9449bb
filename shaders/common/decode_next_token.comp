// Greedy choice between chained decode steps (models/generation.py): the next token of each row is the
// argmax of its logits (the lowest index among equal maxima, as numpy's argmax), written where the next
// step reads its input ids and into the step's row of the chosen-token history; the step's positions
// and cache bounds ([start, end]) advance by one. One workgroup per row.
//! variant f32 -DELEM_F32
//! variant f16 -DELEM_F16
//! variant bf16 -DELEM_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "transformer_common.glsl"

layout(local_size_x_id = 0) in;  // as many threads as the device allows (up to 1024): one row is one workgroup
layout(binding = 0) readonly buffer Logits { ELEM_T logits[]; };
layout(binding = 1) buffer Ids { int ids[]; };
layout(binding = 2) buffer Positions { int positions[]; };
layout(binding = 3) buffer Bounds { uint bounds[]; };
layout(binding = 4) writeonly buffer History { int history[]; };
layout(push_constant) uniform Push {
    uint vocab, row_stride, logits_offset, ids_offset, positions_offset, bounds_offset, history_offset;
    uint has_positions;
};

const uint IN_FLIGHT = 8;  // loads a thread issues before comparing: the scan is bound by their latency
shared float best_values[gl_WorkGroupSize.x];
shared uint best_indices[gl_WorkGroupSize.x];

bool better(float value, uint index, float best, uint best_index) {
    return value > best || (value == best && index < best_index);
}

void main() {
    const uint row = gl_WorkGroupID.x, tid = gl_LocalInvocationID.x, threads = gl_WorkGroupSize.x;
    const uint first = logits_offset + row * row_stride;
    float best = uintBitsToFloat(0xFF800000u);  // -inf
    uint best_index = 0xFFFFFFFFu;
    for (uint base = tid; base < vocab; base += threads * IN_FLIGHT) {
        float values[IN_FLIGHT];
        [[unroll]] for (uint u = 0; u < IN_FLIGHT; ++u)
            values[u] = load_elem(logits[first + min(base + u * threads, vocab - 1)]);
        [[unroll]] for (uint u = 0; u < IN_FLIGHT; ++u) {
            uint i = base + u * threads;
            if (i < vocab && better(values[u], i, best, best_index)) { best = values[u]; best_index = i; }
        }
    }
    best_values[tid] = best;
    best_indices[tid] = best_index;
    barrier();
    for (uint half_size = threads / 2; half_size > 0; half_size /= 2) {
        if (tid < half_size && better(best_values[tid + half_size], best_indices[tid + half_size],
                                      best_values[tid], best_indices[tid])) {
            best_values[tid] = best_values[tid + half_size];
            best_indices[tid] = best_indices[tid + half_size];
        }
        barrier();
    }
    if (tid != 0u) return;
    int token = int(best_indices[0] == 0xFFFFFFFFu ? 0u : best_indices[0]);  // all NaN: token 0
    ids[ids_offset + row] = token;
    history[history_offset + row] = token;
    if (has_positions != 0u) positions[positions_offset + row] += 1;
    if (row == 0u) {
        bounds[bounds_offset] += 1u;
        bounds[bounds_offset + 1u] += 1u;
    }
}
