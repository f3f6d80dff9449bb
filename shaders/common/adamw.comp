// One fused AdamW step (torch.optim.AdamW, single-tensor, amsgrad=False) over a flat
// float32 parameter buffer, with float32 grad, exp_avg (m) and exp_avg_sq (v):
//   p *= 1 - lr * weight_decay                     (decoupled weight decay)
//   m += (1 - beta1) * (g - m)                      (torch's lerp)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p -= step_size * m / (sqrt(v) / sqrt(1 - beta2^step) + eps),  step_size = lr / (1 - beta1^step)
// The hyper-parameters live in a small buffer the host rewrites before each replay
// (adamw.py: adamw_scalars), so one recorded step serves every step; the bias
// corrections are computed there in float64 (1 - 0.999^t loses digits in float32).
// Variants copy_f16 / copy_bf16 also write the updated parameters to a 16-bit model copy.
//! variant f32
//! variant copy_f16 -DCOPY_F16
//! variant copy_bf16 -DCOPY_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;

// Word indices of the scalars buffer (float32 bits, except the step count).
const uint LR = 0, BETA1 = 1, BETA2 = 2, EPS = 3, WEIGHT_DECAY = 4, STEP = 5,
           ONE_MINUS_BETA1 = 6, ONE_MINUS_BETA2 = 7, STEP_SIZE = 8, BIAS_CORRECTION2_SQRT = 9,
           PARAM_DECAY = 10, GRAD_SCALE = 11;

layout(binding = 0) readonly buffer Scalars { uint scalars[]; };
layout(binding = 1) buffer Param { float param[]; };
layout(binding = 2) readonly buffer Grad { float grad[]; };
layout(binding = 3) buffer ExpAvg { float exp_avg[]; };
layout(binding = 4) buffer ExpAvgSq { float exp_avg_sq[]; };
#if defined(COPY_F16)
layout(binding = 5) writeonly buffer ModelCopy { float16_t model_copy[]; };
#elif defined(COPY_BF16)
layout(binding = 5) writeonly buffer ModelCopy { uint16_t model_copy[]; };
#endif
layout(push_constant) uniform Push {
    uint n; uint scalars_offset; uint param_offset; uint grad_offset; uint exp_avg_offset;
    uint exp_avg_sq_offset; uint copy_offset;
};

float scalar(uint word) { return uintBitsToFloat(scalars[scalars_offset + word]); }

void main() {
    uint i = global_index();
    if (i >= n) return;
    float g = grad[grad_offset + i] * scalar(GRAD_SCALE);
    float p = param[param_offset + i] * scalar(PARAM_DECAY);
    float m = exp_avg[exp_avg_offset + i];
    m = m + scalar(ONE_MINUS_BETA1) * (g - m);
    float v = exp_avg_sq[exp_avg_sq_offset + i] * scalar(BETA2) + scalar(ONE_MINUS_BETA2) * g * g;
    float denom = sqrt(v) / scalar(BIAS_CORRECTION2_SQRT) + scalar(EPS);
    p -= scalar(STEP_SIZE) * (m / denom);
    param[param_offset + i] = p;
    exp_avg[exp_avg_offset + i] = m;
    exp_avg_sq[exp_avg_sq_offset + i] = v;
#if defined(COPY_F16)
    model_copy[copy_offset + i] = float16_t(p);
#elif defined(COPY_BF16)
    model_copy[copy_offset + i] = f32_to_bf16(p);
#endif
}
