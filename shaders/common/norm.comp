// RMSNorm and LayerNorm over the last axis of x [rows, cols], forward and backward.
//   RMSNorm:   y = x * rstd * w',             rstd = 1 / sqrt(mean(x^2) + eps)
//   LayerNorm: y = (x - mean) * rstd * w' + b, rstd = 1 / sqrt(var(x) + eps) (biased var)
// w' is w, (1 + w) with UNIT_OFFSET (Gemma), or 1 without a weight. Math is float32;
// x, weight, bias, y, dy and dx are ELEM_T; mean/rstd/dw/db and the partial sums are float32.
//
// Stages (one variant per stage and element type):
//   FORWARD        one workgroup per row: y, and the row statistics (mean, rstd) for backward.
//   BACKWARD_DX    one workgroup per row: dx from dy, x, the weight and the saved statistics.
//   BACKWARD_PARAM partial column sums of dy * x_hat (for dw) and dy (for db) over chunks of
//                  rows: invocation = column, workgroup y = chunk; written to a float32 workspace.
//   REDUCE_PARAM   dw, db = sum of the partials over chunks, in chunk order (deterministic).
//! variant f32 -DFORWARD -DELEM_F32
//! variant f16 -DFORWARD -DELEM_F16
//! variant bf16 -DFORWARD -DELEM_BF16
//! variant backward_dx_f32 -DBACKWARD_DX -DELEM_F32
//! variant backward_dx_f16 -DBACKWARD_DX -DELEM_F16
//! variant backward_dx_bf16 -DBACKWARD_DX -DELEM_BF16
//! variant backward_param_f32 -DBACKWARD_PARAM -DELEM_F32
//! variant backward_param_f16 -DBACKWARD_PARAM -DELEM_F16
//! variant backward_param_bf16 -DBACKWARD_PARAM -DELEM_BF16
//! variant reduce_param -DREDUCE_PARAM
#version 450
#extension GL_GOOGLE_include_directive : require
#include "transformer_common.glsl"
layout(local_size_x = 256) in;

layout(constant_id = 0) const bool IS_LAYER_NORM = false;
layout(constant_id = 1) const bool HAS_WEIGHT = true;
layout(constant_id = 2) const bool HAS_BIAS = false;
layout(constant_id = 3) const bool UNIT_OFFSET = false;
// Round the normalized value to ELEM_T before the weight multiply (HF LlamaRMSNorm's
// order: normalize in fp32, cast to the input dtype, multiply by the weight).
layout(constant_id = 4) const bool ROUND_BEFORE_WEIGHT = false;
// REDUCE_PARAM: add into dw/db instead of overwriting them.
layout(constant_id = 5) const bool ACCUMULATE = false;

#if defined(FORWARD) || defined(BACKWARD_DX)
layout(binding = 1) readonly buffer Weight { ELEM_T weight[]; };

float effective_weight(uint index) {
    if (!HAS_WEIGHT) return 1.0;
    float w = load_elem(weight[index]);
    return UNIT_OFFSET ? 1.0 + w : w;
}
#endif

#ifdef FORWARD
layout(binding = 0) readonly buffer X { ELEM_T x[]; };
layout(binding = 2) readonly buffer Bias { ELEM_T bias[]; };
layout(binding = 3) writeonly buffer Y { ELEM_T y[]; };
layout(binding = 4) writeonly buffer Mean { float mean_out[]; };
layout(binding = 5) writeonly buffer Rstd { float rstd_out[]; };
layout(push_constant) uniform Push {
    uint rows; uint cols; float eps;
    uint x_offset; uint w_offset; uint b_offset; uint y_offset; uint mean_offset; uint rstd_offset;
};

void main() {
    uint row = workgroup_row();
    if (row >= rows) return;  // uniform over the workgroup: barriers stay safe
    uint base = x_offset + row * cols;
    uint tid = gl_LocalInvocationID.x, step = gl_WorkGroupSize.x;

    float mean = 0.0;
    if (IS_LAYER_NORM) {
        float s = 0.0;
        for (uint c = tid; c < cols; c += step) s += load_elem(x[base + c]);
        mean = workgroup_sum(s) / float(cols);
    }
    // Second pass over (x - mean): no cancellation from E[x^2] - E[x]^2.
    float sq = 0.0;
    for (uint c = tid; c < cols; c += step) {
        float d = load_elem(x[base + c]) - mean;
        sq += d * d;
    }
    float rstd = inversesqrt(workgroup_sum(sq) / float(cols) + eps);

    for (uint c = tid; c < cols; c += step) {
        float x_hat = (load_elem(x[base + c]) - mean) * rstd;
        if (ROUND_BEFORE_WEIGHT) x_hat = round_to_elem(x_hat);
        float v = x_hat * effective_weight(w_offset + c);
        if (HAS_BIAS) v += load_elem(bias[b_offset + c]);
        y[y_offset + row * cols + c] = store_elem(v);
    }
    if (tid == 0) {
        rstd_out[rstd_offset + row] = rstd;
        if (IS_LAYER_NORM) mean_out[mean_offset + row] = mean;
    }
}
#endif

#ifdef BACKWARD_DX
layout(binding = 0) readonly buffer X { ELEM_T x[]; };
layout(binding = 2) readonly buffer DY { ELEM_T dy[]; };
layout(binding = 3) readonly buffer Mean { float mean_in[]; };
layout(binding = 4) readonly buffer Rstd { float rstd_in[]; };
layout(binding = 5) writeonly buffer DX { ELEM_T dx[]; };
layout(push_constant) uniform Push {
    uint rows; uint cols;
    uint x_offset; uint w_offset; uint dy_offset; uint mean_offset; uint rstd_offset; uint dx_offset;
};

// With g = dy * w' and x_hat the normalized x:
//   RMSNorm:   dx = rstd * (g - x_hat * mean(g * x_hat))
//   LayerNorm: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
void main() {
    uint row = workgroup_row();
    if (row >= rows) return;
    uint tid = gl_LocalInvocationID.x, step = gl_WorkGroupSize.x;
    float mean = IS_LAYER_NORM ? mean_in[mean_offset + row] : 0.0;
    float rstd = rstd_in[rstd_offset + row];

    float sum_g = 0.0, sum_g_xhat = 0.0;
    for (uint c = tid; c < cols; c += step) {
        float g = load_elem(dy[dy_offset + row * cols + c]) * effective_weight(w_offset + c);
        float x_hat = (load_elem(x[x_offset + row * cols + c]) - mean) * rstd;
        sum_g += g;
        sum_g_xhat += g * x_hat;
    }
    float mean_g_xhat = workgroup_sum(sum_g_xhat) / float(cols);
    float mean_g = IS_LAYER_NORM ? workgroup_sum(sum_g) / float(cols) : 0.0;

    for (uint c = tid; c < cols; c += step) {
        float g = load_elem(dy[dy_offset + row * cols + c]) * effective_weight(w_offset + c);
        float x_hat = (load_elem(x[x_offset + row * cols + c]) - mean) * rstd;
        dx[dx_offset + row * cols + c] = store_elem(rstd * (g - mean_g - x_hat * mean_g_xhat));
    }
}
#endif

#ifdef BACKWARD_PARAM
layout(binding = 0) readonly buffer X { ELEM_T x[]; };
layout(binding = 1) readonly buffer DY { ELEM_T dy[]; };
layout(binding = 2) readonly buffer Mean { float mean_in[]; };
layout(binding = 3) readonly buffer Rstd { float rstd_in[]; };
// [chunks, cols] partial dw, then [chunks, cols] partial db.
layout(binding = 4) writeonly buffer Partials { float partials[]; };
layout(push_constant) uniform Push {
    uint rows; uint cols; uint rows_per_chunk;
    uint x_offset; uint dy_offset; uint mean_offset; uint rstd_offset;
};

void main() {
    uint c = gl_GlobalInvocationID.x;
    uint chunk = gl_WorkGroupID.y;
    if (c >= cols) return;
    uint first = chunk * rows_per_chunk;
    uint last = min(first + rows_per_chunk, rows);
    float dw = 0.0, db = 0.0;
    for (uint r = first; r < last; ++r) {
        float g = load_elem(dy[dy_offset + r * cols + c]);
        float mean = IS_LAYER_NORM ? mean_in[mean_offset + r] : 0.0;
        float x_hat = (load_elem(x[x_offset + r * cols + c]) - mean) * rstd_in[rstd_offset + r];
        if (ROUND_BEFORE_WEIGHT) x_hat = round_to_elem(x_hat);  // what the weight multiplied
        dw += g * x_hat;
        db += g;
    }
    if (HAS_WEIGHT) partials[chunk * cols + c] = dw;
    if (HAS_BIAS) partials[(gl_NumWorkGroups.y + chunk) * cols + c] = db;
}
#endif

#ifdef REDUCE_PARAM
layout(binding = 0) readonly buffer Partials { float partials[]; };
layout(binding = 1) buffer DW { float dw[]; };
layout(binding = 2) buffer DB { float db[]; };
layout(push_constant) uniform Push { uint cols; uint chunks; uint dw_offset; uint db_offset; };

void main() {
    uint c = global_index();
    if (c >= cols) return;
    if (HAS_WEIGHT) {
        float s = 0.0;
        for (uint k = 0; k < chunks; ++k) s += partials[k * cols + c];
        dw[dw_offset + c] = ACCUMULATE ? dw[dw_offset + c] + s : s;
    }
    if (HAS_BIAS) {
        float s = 0.0;
        for (uint k = 0; k < chunks; ++k) s += partials[(chunks + k) * cols + c];
        db[db_offset + c] = ACCUMULATE ? db[db_offset + c] + s : s;
    }
}
#endif
