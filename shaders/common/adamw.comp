// One fused AdamW step (torch.optim.AdamW, single-tensor, amsgrad=False) over a flat
// float32 parameter buffer, with float32 exp_avg (m) and exp_avg_sq (v):
//   p *= 1 - lr * weight_decay                     (decoupled weight decay)
//   m += (1 - beta1) * (g - m)                      (torch's lerp)
//   v  = v * beta2 + (1 - beta2) * g * g
//   p -= step_size * m / (sqrt(v) / sqrt(1 - beta2^step) + eps),  step_size = lr / (1 - beta1^step)
// The hyper-parameters live in a small buffer the host rewrites before each replay
// (adamw.py: adamw_scalars), so one recorded step serves every step; the bias
// corrections are computed there in float64 (1 - 0.999^t loses digits in float32).
// The gradient is read in its own storage type (g_*: float32, float16, bfloat16; no
// float32 copy of a 16-bit gradient) and multiplied by GRAD_SCALE and, with HAS_FACTOR,
// by a float32 element computed on the GPU (gradient clipping and loss unscaling).
// c_*: also write the updated parameters to a 16-bit model copy (the master is float32).
//! variant g_f32
//! variant g_f16 -DGRAD_F16
//! variant g_bf16 -DGRAD_BF16
//! variant g_f32_c_f16 -DCOPY_F16
//! variant g_f32_c_bf16 -DCOPY_BF16
//! variant g_f16_c_f16 -DGRAD_F16 -DCOPY_F16
//! variant g_bf16_c_bf16 -DGRAD_BF16 -DCOPY_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint HAS_FACTOR = 0;

// Word indices of the scalars buffer (float32 bits, except the step count).
const uint LR = 0, BETA1 = 1, BETA2 = 2, EPS = 3, WEIGHT_DECAY = 4, STEP = 5,
           ONE_MINUS_BETA1 = 6, ONE_MINUS_BETA2 = 7, STEP_SIZE = 8, BIAS_CORRECTION2_SQRT = 9,
           PARAM_DECAY = 10, GRAD_SCALE = 11;

layout(binding = 0) readonly buffer Scalars { uint scalars[]; };
layout(binding = 1) buffer Param { float param[]; };
#if defined(GRAD_F16)
layout(binding = 2) readonly buffer Grad { float16_t grad[]; };
#define LOAD_GRAD(i) float(grad[i])
#elif defined(GRAD_BF16)
layout(binding = 2) readonly buffer Grad { uint16_t grad[]; };
#define LOAD_GRAD(i) bf16_to_f32(grad[i])
#else
layout(binding = 2) readonly buffer Grad { float grad[]; };
#define LOAD_GRAD(i) grad[i]
#endif
layout(binding = 3) buffer ExpAvg { float exp_avg[]; };
layout(binding = 4) buffer ExpAvgSq { float exp_avg_sq[]; };
layout(binding = 5) readonly buffer Factor { float factor[]; };  // bound to Param without HAS_FACTOR
#if defined(COPY_F16)
layout(binding = 6) writeonly buffer ModelCopy { float16_t model_copy[]; };
#elif defined(COPY_BF16)
layout(binding = 6) writeonly buffer ModelCopy { uint16_t model_copy[]; };
#endif
layout(push_constant) uniform Push {
    uint n; uint scalars_offset; uint param_offset; uint grad_offset; uint exp_avg_offset;
    uint exp_avg_sq_offset; uint copy_offset; uint factor_offset;
};

float scalar(uint word) { return uintBitsToFloat(scalars[scalars_offset + word]); }

void main() {
    uint i = global_index();
    if (i >= n) return;
    float g = LOAD_GRAD(grad_offset + i) * scalar(GRAD_SCALE);
    if (HAS_FACTOR != 0) g *= factor[factor_offset];
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
