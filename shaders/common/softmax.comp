// Softmax and log-softmax over the last axis of contiguous [rows, cols], forward and
// backward, in fp32. A row gets `parts` = 2^part_bits neighbouring threads (the launcher
// matches it to cols, up to the whole workgroup), so short rows share a workgroup.
// MODE (specialization constant):
//   0 softmax:               out = exp(x - max) / sum(exp(x - max))
//   1 log_softmax:           out = (x - max) - log(sum(exp(x - max)))
//   2 softmax backward:      out = y * (dy - sum(dy * y))       (x binding holds y)
//   3 log_softmax backward:  out = dy - exp(y) * sum(dy)
// The forward pass keeps a running (max, sum of exp(x - max)) per thread (one read of
// the row), merges them in shared memory, then writes. -inf entries give 0 (softmax)
// or -inf (log-softmax); a row that is all -inf gives NaN, like torch.
//! variant f32 -DDTYPE_F32
//! variant f16 -DDTYPE_F16
//! variant bf16 -DDTYPE_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
// Before common.glsl: its global_index() reads gl_WorkGroupSize, which is 1 until declared.
#define WORKGROUP 256
layout(local_size_x = WORKGROUP) in;
#include "common.glsl"
#include "elementwise_storage.glsl"
#include "elementwise_math.glsl"

#define MODE_SOFTMAX 0
#define MODE_LOG_SOFTMAX 1
#define MODE_SOFTMAX_BACKWARD 2
#define MODE_LOG_SOFTMAX_BACKWARD 3
layout(constant_id = 0) const uint MODE = MODE_SOFTMAX;
const bool FORWARD = MODE == MODE_SOFTMAX || MODE == MODE_LOG_SOFTMAX;

layout(binding = 0) readonly buffer X { STORAGE_T x[]; };    // x (forward) or y (backward)
layout(binding = 1) readonly buffer DY { STORAGE_T dy[]; };  // backward only
layout(binding = 2) writeonly buffer Out { STORAGE_T out_value[]; };

layout(push_constant) uniform Push {
    uint rows;
    uint cols;
    uint x_offset;
    uint dy_offset;
    uint out_offset;
    uint part_bits;  // log2(threads per row)
};

shared float shared_max[WORKGROUP];
shared float shared_sum[WORKGROUP];

// sum * exp(m - new_max), with an empty part (m = -inf) contributing 0 (not NaN).
float rescaled(float sum, float m, float new_max) {
    return m == NEG_INF ? 0.0 : sum * exp_accurate(m - new_max);
}

void main() {
    uint t = gl_LocalInvocationID.x;
    uint parts = 1u << part_bits;
    uint part = t & (parts - 1u);
    uint row = (gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x) * (WORKGROUP >> part_bits)
               + (t >> part_bits);
    bool valid = row < rows;  // no early return: every thread takes part in the barriers
    uint x_row = x_offset + row * cols;
    uint dy_row = dy_offset + row * cols;
    uint out_row = out_offset + row * cols;

    // Per-thread partials: (running max, sum of exp(x - max)) forward; sum(dy * y) or sum(dy) backward.
    float m = NEG_INF, sum = 0.0;
    for (uint j = part; valid && j < cols; j += parts) {
        float v = LOAD(x[x_row + j]);
        if (FORWARD) {
            if (v > m) { sum = rescaled(sum, m, v) + 1.0; m = v; }
            else if (v != NEG_INF) sum += exp_accurate(v - m);  // NaN lands here and poisons sum
        } else {
            float g = LOAD(dy[dy_row + j]);
            sum += MODE == MODE_SOFTMAX_BACKWARD ? g * v : g;
        }
    }
    shared_max[t] = m;
    shared_sum[t] = sum;
    barrier();
    for (uint stride = parts >> 1; stride > 0; stride >>= 1) {
        if (part < stride) {
            if (FORWARD) {
                float m1 = shared_max[t], m2 = shared_max[t + stride];
                float new_max = max(m1, m2);
                shared_sum[t] = rescaled(shared_sum[t], m1, new_max) + rescaled(shared_sum[t + stride], m2, new_max);
                shared_max[t] = new_max;
            } else {
                shared_sum[t] += shared_sum[t + stride];
            }
        }
        barrier();
    }
    if (!valid) return;
    uint first = t - part;  // the row's reduced values sit at its first thread
    float row_max = shared_max[first], row_sum = shared_sum[first];
    float inv_sum = 1.0 / row_sum, log_sum = log_accurate(row_sum);

    for (uint j = part; j < cols; j += parts) {
        float v = LOAD(x[x_row + j]);
        float result;
        if (MODE == MODE_SOFTMAX) result = exp_accurate(v - row_max) * inv_sum;
        else if (MODE == MODE_LOG_SOFTMAX) result = (v - row_max) - log_sum;
        else if (MODE == MODE_SOFTMAX_BACKWARD) result = v * (LOAD(dy[dy_row + j]) - row_sum);
        else result = LOAD(dy[dy_row + j]) - exp_accurate(v) * row_sum;
        out_value[out_row + j] = STORE(result);
    }
}
