// Causal depthwise conv1d over time, channels last: x [batch, length, channels], weight [channels, kernel],
// optional bias [channels] and history [batch, kernel - 1, channels] (the inputs before x: a recurrent cache).
//   y[b, t, c] = bias[c] + sum_j weight[c, j] * full[b, t + j, c],   full = [history | x] over time
// (zeros in place of a missing history), as torch's Conv1d(groups=channels, padding=kernel - 1) cut to length.
// Math is float32; x, history, weight, bias, y, dy and dx are ELEM_T; the weight-gradient partials float32.
//
// Stages (one variant per stage and element type):
//   FORWARD      one invocation per output element.
//   BACKWARD_DX  one invocation per element of dx: dx[b, s, c] = sum_j weight[c, j] dy[b, s + kernel - 1 - j, c].
//   BACKWARD_DW  one invocation per (b, block of `span` steps, c): dw_partial[b, block, c, j] = the sum over the
//                block's t of dy[b, t, c] full[b, t + j, c] (the launcher's caller sums over b and block). Blocks
//                keep an invocation's loops within llvmpipe's bound on iterations (kernels/__init__.py).
//! variant f32 -DFORWARD -DELEM_F32
//! variant f16 -DFORWARD -DELEM_F16
//! variant bf16 -DFORWARD -DELEM_BF16
//! variant backward_dx_f32 -DBACKWARD_DX -DELEM_F32
//! variant backward_dx_f16 -DBACKWARD_DX -DELEM_F16
//! variant backward_dx_bf16 -DBACKWARD_DX -DELEM_BF16
//! variant backward_dw_f32 -DBACKWARD_DW -DELEM_F32
//! variant backward_dw_f16 -DBACKWARD_DW -DELEM_F16
//! variant backward_dw_bf16 -DBACKWARD_DW -DELEM_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "transformer_common.glsl"
layout(local_size_x = 256) in;

layout(constant_id = 0) const bool HAS_HISTORY = false;
layout(constant_id = 1) const bool HAS_BIAS = false;

layout(push_constant) uniform Push {
    uint batch; uint length; uint channels; uint kernel_size;
    uint x_offset; uint h_offset; uint w_offset; uint b_offset; uint y_offset;
};

#if defined(FORWARD) || defined(BACKWARD_DW)
layout(binding = 0) readonly buffer X { ELEM_T x[]; };
layout(binding = 1) readonly buffer History { ELEM_T history[]; };

// full[b, s, c]: history for s < kernel - 1, else x[b, s - kernel + 1, c]
float full_at(uint b, uint s, uint c) {
    uint past = kernel_size - 1;
    if (s < past) return HAS_HISTORY ? load_elem(history[h_offset + (b * past + s) * channels + c]) : 0.0;
    return load_elem(x[x_offset + (b * length + s - past) * channels + c]);
}
#endif

#ifdef FORWARD
layout(binding = 2) readonly buffer Weight { ELEM_T weight[]; };
layout(binding = 3) readonly buffer Bias { ELEM_T bias[]; };
layout(binding = 4) writeonly buffer Y { ELEM_T y[]; };

void main() {
    uint index = global_index();
    if (index >= batch * length * channels) return;
    uint c = index % channels, t = (index / channels) % length, b = index / (channels * length);
    float acc = HAS_BIAS ? load_elem(bias[b_offset + c]) : 0.0;
    for (uint j = 0; j < kernel_size; ++j)
        acc += load_elem(weight[w_offset + c * kernel_size + j]) * full_at(b, t + j, c);
    y[y_offset + index] = store_elem(acc);
}
#endif

#ifdef BACKWARD_DX
// push offsets: dy at x_offset, dx at y_offset
layout(binding = 0) readonly buffer DY { ELEM_T dy[]; };
layout(binding = 1) readonly buffer Weight { ELEM_T weight[]; };
layout(binding = 2) writeonly buffer DX { ELEM_T dx[]; };

void main() {
    uint index = global_index();
    if (index >= batch * length * channels) return;
    uint c = index % channels, s = (index / channels) % length, b = index / (channels * length);
    float acc = 0.0;
    for (uint j = 0; j < kernel_size; ++j) {
        uint t = s + kernel_size - 1 - j;  // the output that reads x[s] through tap j
        if (t < length) acc += load_elem(weight[w_offset + c * kernel_size + j]) * load_elem(dy[x_offset + (b * length + t) * channels + c]);
    }
    dx[y_offset + index] = store_elem(acc);
}
#endif

#ifdef BACKWARD_DW
// push offsets: dy at w_offset, the float32 partials [batch, blocks, channels, kernel] at y_offset; b_offset: span
layout(binding = 2) readonly buffer DY { ELEM_T dy[]; };
layout(binding = 3) writeonly buffer DW { float dw[]; };

void main() {
    uint index = global_index(), span = b_offset, blocks = (length + span - 1) / span;
    if (index >= batch * blocks * channels) return;
    uint c = index % channels, block = (index / channels) % blocks, b = index / (channels * blocks);
    uint start = block * span, end = min(start + span, length);
    for (uint j = 0; j < kernel_size; ++j) {
        float acc = 0.0;
        for (uint t = start; t < end; ++t)
            acc += load_elem(dy[w_offset + (b * length + t) * channels + c]) * full_at(b, t + j, c);
        dw[y_offset + index * kernel_size + j] = acc;
    }
}
#endif
