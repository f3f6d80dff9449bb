// Cross-entropy of logits [rows, vocab] (ELEM_T) against int32 labels [rows], torch/HF
// semantics: rows whose label is ignore_index contribute nothing; the mean divides by
// the number of the other rows (0 such rows: 0/0 = NaN, like torch). A label outside
// [0, vocab) that is not ignore_index gives a NaN loss and NaN gradients (torch raises).
//   FORWARD   one workgroup per row: lse = log(sum(exp(logits))), loss = lse - logit[label]
//             (0 for ignored rows); both float32 [rows].
//   MEAN      one workgroup: mean = sum(loss) / count, count = rows not ignored (float32).
//   BACKWARD  one invocation per logit: d_logits = (exp(logit - lse) - onehot) * d_loss / count,
//             0 on ignored rows; d_loss and count are 1-element float32 buffers (GPU values).
//             Nothing vocab-sized is kept from the forward pass. The inplace variants write d_logits
//             over logits, one binding for both (each invocation reads its logit before writing it).
//! variant f32 -DFORWARD -DELEM_F32
//! variant f16 -DFORWARD -DELEM_F16
//! variant bf16 -DFORWARD -DELEM_BF16
//! variant mean -DMEAN
//! variant backward_f32 -DBACKWARD -DELEM_F32
//! variant backward_f16 -DBACKWARD -DELEM_F16
//! variant backward_bf16 -DBACKWARD -DELEM_BF16
//! variant backward_inplace_f32 -DBACKWARD -DINPLACE -DELEM_F32
//! variant backward_inplace_f16 -DBACKWARD -DINPLACE -DELEM_F16
//! variant backward_inplace_bf16 -DBACKWARD -DINPLACE -DELEM_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "transformer_common.glsl"
layout(local_size_x = 256) in;

float quiet_nan() { return uintBitsToFloat(0x7FC00000u); }

#ifdef FORWARD
layout(binding = 0) readonly buffer Logits { ELEM_T logits[]; };
layout(binding = 1) readonly buffer Labels { int labels[]; };
layout(binding = 2) writeonly buffer Loss { float loss[]; };
layout(binding = 3) writeonly buffer Lse { float lse_out[]; };
layout(push_constant) uniform Push {
    uint rows; uint vocab; int ignore_index;
    uint logits_offset; uint labels_offset; uint loss_offset; uint lse_offset;
};

void main() {
    uint row = workgroup_row();
    if (row >= rows) return;
    uint base = logits_offset + row * vocab;
    // Each invocation keeps a running max m and sum s of exp(x - m) over its strided
    // share of the row (online softmax): one pass over the logits.
    float m = -3.402823466e38, s = 0.0;  // finite start: -inf logits then add exp(-inf) = 0
    for (uint c = gl_LocalInvocationID.x; c < vocab; c += gl_WorkGroupSize.x) {
        float v = load_elem(logits[base + c]);
        if (v > m) { s = s * exp(m - v) + 1.0; m = v; }
        else s += exp(v - m);
    }
    float row_max = workgroup_max(m);
    float lse = row_max + log(workgroup_sum(s * exp(m - row_max)));
    if (gl_LocalInvocationID.x == 0) {
        int label = labels[labels_offset + row];
        float row_loss = 0.0;
        if (label != ignore_index)
            row_loss = (label >= 0 && uint(label) < vocab) ? lse - load_elem(logits[base + uint(label)]) : quiet_nan();
        loss[loss_offset + row] = row_loss;
        lse_out[lse_offset + row] = lse;
    }
}
#endif

#ifdef MEAN
layout(binding = 0) readonly buffer Loss { float loss[]; };
layout(binding = 1) readonly buffer Labels { int labels[]; };
layout(binding = 2) writeonly buffer Mean { float mean_out[]; };
layout(binding = 3) writeonly buffer Count { float count_out[]; };
layout(push_constant) uniform Push {
    uint rows; int ignore_index; uint loss_offset; uint labels_offset; uint mean_offset; uint count_offset;
};

void main() {  // dispatched as one workgroup
    float total = 0.0, count = 0.0;
    for (uint r = gl_LocalInvocationID.x; r < rows; r += gl_WorkGroupSize.x) {
        if (labels[labels_offset + r] != ignore_index) {
            total += loss[loss_offset + r];
            count += 1.0;
        }
    }
    total = workgroup_sum(total);
    count = workgroup_sum(count);
    if (gl_LocalInvocationID.x == 0) {
        mean_out[mean_offset] = total / count;
        count_out[count_offset] = count;
    }
}
#endif

#ifdef BACKWARD
#ifdef INPLACE
layout(binding = 0) buffer Logits { ELEM_T logits[]; };
#define d_logits logits
#else
layout(binding = 0) readonly buffer Logits { ELEM_T logits[]; };
#endif
layout(binding = 1) readonly buffer Labels { int labels[]; };
layout(binding = 2) readonly buffer Lse { float lse_in[]; };
layout(binding = 3) readonly buffer DLoss { float d_loss[]; };
layout(binding = 4) readonly buffer Count { float count_in[]; };
#ifndef INPLACE
layout(binding = 5) writeonly buffer DLogits { ELEM_T d_logits[]; };
#endif
layout(push_constant) uniform Push {
    uint rows; uint vocab; int ignore_index;
    uint logits_offset; uint labels_offset; uint lse_offset; uint d_loss_offset; uint count_offset;
    uint d_logits_offset;
};

void main() {
    uint i = global_index();
    if (i >= rows * vocab) return;
    uint row = i / vocab;
    uint c = i - row * vocab;
    int label = labels[labels_offset + row];
    float grad = 0.0;
    if (label != ignore_index) {
        if (label >= 0 && uint(label) < vocab) {
            float p = exp(load_elem(logits[logits_offset + i]) - lse_in[lse_offset + row]);
            grad = (p - (uint(label) == c ? 1.0 : 0.0)) * (d_loss[d_loss_offset] / count_in[count_offset]);
        } else {
            grad = quiet_nan();
        }
    }
    d_logits[d_logits_offset + i] = store_elem(grad);
}
#endif
