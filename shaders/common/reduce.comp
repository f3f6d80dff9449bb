// out[o, c] = reduce_j x[o, j, c] for a contiguous x viewed as [outer, axis_len, inner].
// Ops (specialization constant OP, codes in the Python table reduce.REDUCE_OPS):
// 0 sum, 1 mean, 2 max, 3 min, 4 argmax, 5 argmin; fp32 accumulation.
// A workgroup of 256 computes `lanes` = 2^lane_bits neighbouring outputs q = o * inner + c,
// each with `parts` = 256 / lanes threads striding along the axis, then a shared-memory
// tree combines the parts. The launcher picks lanes so short axes do not leave threads
// idle: inner == 1 gives one long row a whole workgroup (parts side by side, reading
// the row contiguously), inner > 1 puts >= 32 lanes side by side (reading along c).
// max/min/arg* keep (value, index) pairs and prefer the lower index on ties, so
// arg* return the first occurrence; NaN counts as the extreme (torch semantics).
//! variant f32 -DDTYPE_F32
//! variant f16 -DDTYPE_F16
//! variant bf16 -DDTYPE_BF16
//! variant f32_index -DDTYPE_F32 -DINDEX_OUTPUT
//! variant f16_index -DDTYPE_F16 -DINDEX_OUTPUT
//! variant bf16_index -DDTYPE_BF16 -DINDEX_OUTPUT
#version 450
#extension GL_GOOGLE_include_directive : require
// Before common.glsl: its global_index() reads gl_WorkGroupSize, which is 1 until declared.
#define WORKGROUP 256
layout(local_size_x = WORKGROUP) in;
#include "common.glsl"
#include "elementwise_storage.glsl"
#include "elementwise_math.glsl"

#define REDUCE_SUM 0
#define REDUCE_MEAN 1
#define REDUCE_MAX 2
#define REDUCE_MIN 3
#define REDUCE_ARGMAX 4
#define REDUCE_ARGMIN 5
layout(constant_id = 0) const uint OP = REDUCE_SUM;
const bool ADDS = OP == REDUCE_SUM || OP == REDUCE_MEAN;
const bool GREATER = OP == REDUCE_MAX || OP == REDUCE_ARGMAX;

layout(binding = 0) readonly buffer X { STORAGE_T x[]; };
#ifdef INDEX_OUTPUT
layout(binding = 1) writeonly buffer Out { int out_index[]; };
#else
layout(binding = 1) writeonly buffer Out { STORAGE_T out_value[]; };
#endif

layout(push_constant) uniform Push {
    uint outer;
    uint axis_len;
    uint inner;
    uint x_offset;
    uint out_offset;
    uint lane_bits;      // log2(outputs per workgroup)
    uint parts_fastest;  // 1: thread t is part t % parts of lane t / parts; 0: lane t % lanes, part t / lanes
};

shared float partial_value[WORKGROUP];
shared uint partial_index[WORKGROUP];

const uint NO_INDEX = 0xFFFFFFFFu;  // an empty partial: loses every tie

// Whether (v2, i2) should replace (v, i) for max/min/arg*.
bool prefer(float v2, uint i2, float v, uint i) {
    if (isnan(v)) return isnan(v2) && i2 < i;
    if (isnan(v2)) return true;
    if (v2 == v) return i2 < i;
    return GREATER ? v2 > v : v2 < v;
}

void main() {
    uint group = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;
    uint t = gl_LocalInvocationID.x;
    uint lanes = 1u << lane_bits;
    uint parts = WORKGROUP >> lane_bits;
    uint lane = parts_fastest != 0u ? t / parts : t & (lanes - 1u);
    uint part = parts_fastest != 0u ? t & (parts - 1u) : t >> lane_bits;
    uint part_step = parts_fastest != 0u ? 1u : lanes;  // distance in t between neighbouring parts
    uint q = group * lanes + lane;
    bool valid = q < outer * inner;

    float value = ADDS ? 0.0 : (GREATER ? NEG_INF : POS_INF);
    uint index = NO_INDEX;
    if (valid) {
        uint o = q / inner;
        uint base = x_offset + o * axis_len * inner + (q - o * inner);
        for (uint j = part; j < axis_len; j += parts) {
            float v = LOAD(x[base + j * inner]);
            if (ADDS) value += v;
            else if (prefer(v, j, value, index)) { value = v; index = j; }
        }
    }
    partial_value[t] = value;
    partial_index[t] = index;
    barrier();
    for (uint stride = parts >> 1; stride > 0; stride >>= 1) {
        if (part < stride) {
            uint other = t + stride * part_step;
            if (ADDS) partial_value[t] += partial_value[other];
            else if (prefer(partial_value[other], partial_index[other], partial_value[t], partial_index[t])) {
                partial_value[t] = partial_value[other];
                partial_index[t] = partial_index[other];
            }
        }
        barrier();
    }
    if (part == 0 && valid) {
#ifdef INDEX_OUTPUT
        out_index[out_offset + q] = int(partial_index[t]);
#else
        float result = partial_value[t];
        if (OP == REDUCE_MEAN) result /= float(axis_len);
        out_value[out_offset + q] = STORE(result);
#endif
    }
}
