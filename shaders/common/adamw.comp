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
// p_bf16: the parameters themselves are bfloat16, read widened and written back rounded to nearest even (no
// float32 master: pure bfloat16 training, as torch.optim.AdamW or bitsandbytes on bfloat16 weights).
// Moment storage (s_*; float32 without):
// - s_bf16: m and v stored as bfloat16 (rounded to nearest even after the update, which reads them widened).
// - s_q8: 8-bit blockwise states as bitsandbytes' 8-bit Adam: one workgroup per block of 256 * BLOCK_ITEMS
//   elements; m is stored as the index of the nearest value of a signed dynamic quantization map, v of an
//   unsigned one, both scaled by the block's absolute maximum (absmax_m / absmax_v, one float per block).
//   The parameter update uses the moments before they are rounded to 8 bits, as bitsandbytes does. The
//   nearest code is found by comparing with the map's midpoints times the absmax (products, which Vulkan
//   rounds correctly, not a division, which it need not), so a numpy reference reproduces every code.
//! variant g_f32
//! variant g_f16 -DGRAD_F16
//! variant g_bf16 -DGRAD_BF16
//! variant g_f32_c_f16 -DCOPY_F16
//! variant g_f32_c_bf16 -DCOPY_BF16
//! variant g_f16_c_f16 -DGRAD_F16 -DCOPY_F16
//! variant g_bf16_c_bf16 -DGRAD_BF16 -DCOPY_BF16
//! variant g_f32_s_bf16 -DSTATE_BF16
//! variant g_f16_s_bf16 -DGRAD_F16 -DSTATE_BF16
//! variant g_bf16_s_bf16 -DGRAD_BF16 -DSTATE_BF16
//! variant g_f32_c_f16_s_bf16 -DCOPY_F16 -DSTATE_BF16
//! variant g_f32_c_bf16_s_bf16 -DCOPY_BF16 -DSTATE_BF16
//! variant g_f16_c_f16_s_bf16 -DGRAD_F16 -DCOPY_F16 -DSTATE_BF16
//! variant g_bf16_c_bf16_s_bf16 -DGRAD_BF16 -DCOPY_BF16 -DSTATE_BF16
//! variant g_f32_s_q8 -DSTATE_Q8
//! variant g_f16_s_q8 -DGRAD_F16 -DSTATE_Q8
//! variant g_bf16_s_q8 -DGRAD_BF16 -DSTATE_Q8
//! variant g_f32_c_f16_s_q8 -DCOPY_F16 -DSTATE_Q8
//! variant g_f32_c_bf16_s_q8 -DCOPY_BF16 -DSTATE_Q8
//! variant g_f16_c_f16_s_q8 -DGRAD_F16 -DCOPY_F16 -DSTATE_Q8
//! variant g_bf16_c_bf16_s_q8 -DGRAD_BF16 -DCOPY_BF16 -DSTATE_Q8
//! variant g_f32_p_bf16 -DPARAM_BF16
//! variant g_bf16_p_bf16 -DGRAD_BF16 -DPARAM_BF16
//! variant g_f32_p_bf16_s_bf16 -DPARAM_BF16 -DSTATE_BF16
//! variant g_bf16_p_bf16_s_bf16 -DGRAD_BF16 -DPARAM_BF16 -DSTATE_BF16
//! variant g_f32_p_bf16_s_q8 -DPARAM_BF16 -DSTATE_Q8
//! variant g_bf16_p_bf16_s_q8 -DGRAD_BF16 -DPARAM_BF16 -DSTATE_Q8
#version 450
#extension GL_GOOGLE_include_directive : require
#if defined(STATE_Q8)
#extension GL_EXT_shader_8bit_storage : require
#endif
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint HAS_FACTOR = 0;
layout(constant_id = 1) const uint BLOCK_ITEMS = 1;  // s_q8: elements per invocation (block size / 256)

// Word indices of the scalars buffer (float32 bits, except the step count).
const uint LR = 0, BETA1 = 1, BETA2 = 2, EPS = 3, WEIGHT_DECAY = 4, STEP = 5,
           ONE_MINUS_BETA1 = 6, ONE_MINUS_BETA2 = 7, STEP_SIZE = 8, BIAS_CORRECTION2_SQRT = 9,
           PARAM_DECAY = 10, GRAD_SCALE = 11;

layout(binding = 0) readonly buffer Scalars { uint scalars[]; };
#if defined(PARAM_BF16)
layout(binding = 1) buffer Param { uint16_t param[]; };
#define LOAD_PARAM(i) bf16_to_f32(param[i])
#else
layout(binding = 1) buffer Param { float param[]; };
#define LOAD_PARAM(i) param[i]
#endif
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
#if defined(STATE_BF16)
layout(binding = 3) buffer ExpAvg { uint16_t exp_avg[]; };
layout(binding = 4) buffer ExpAvgSq { uint16_t exp_avg_sq[]; };
#define LOAD_STATE(buf, i) bf16_to_f32(buf[i])
#define STORE_STATE(buf, i, x) buf[i] = f32_to_bf16(x)
#elif defined(STATE_Q8)
layout(binding = 3) buffer ExpAvg { uint8_t exp_avg[]; };     // codes into the signed map
layout(binding = 4) buffer ExpAvgSq { uint8_t exp_avg_sq[]; };  // codes into the unsigned map
#else
layout(binding = 3) buffer ExpAvg { float exp_avg[]; };
layout(binding = 4) buffer ExpAvgSq { float exp_avg_sq[]; };
#define LOAD_STATE(buf, i) buf[i]
#define STORE_STATE(buf, i, x) buf[i] = x
#endif
layout(binding = 5) readonly buffer Factor { float factor[]; };  // bound to Param without HAS_FACTOR
#if defined(COPY_F16)
layout(binding = 6) writeonly buffer ModelCopy { float16_t model_copy[]; };
#elif defined(COPY_BF16)
layout(binding = 6) writeonly buffer ModelCopy { uint16_t model_copy[]; };
#endif
#if defined(STATE_Q8)  // bindings follow on without a gap
#if defined(COPY_F16) || defined(COPY_BF16)
layout(binding = 7) buffer AbsmaxM { float absmax_m[]; };
layout(binding = 8) buffer AbsmaxV { float absmax_v[]; };
layout(binding = 9) readonly buffer Qmap { float qmap[]; };  // 256 signed values, then 256 unsigned, ascending
#else
layout(binding = 6) buffer AbsmaxM { float absmax_m[]; };
layout(binding = 7) buffer AbsmaxV { float absmax_v[]; };
layout(binding = 8) readonly buffer Qmap { float qmap[]; };
#endif
#endif
layout(push_constant) uniform Push {
    uint n; uint scalars_offset; uint param_offset; uint grad_offset; uint exp_avg_offset;
    uint exp_avg_sq_offset; uint copy_offset; uint factor_offset;
#if defined(STATE_Q8)
    uint absmax_m_offset; uint absmax_v_offset; uint qmap_offset;
#endif
};

float scalar(uint word) { return uintBitsToFloat(scalars[scalars_offset + word]); }

// The update of one element; m and v come in as stored (widened) and go out unrounded. `precise`: no fused
// multiply-adds, so the moments are the same on every device (the 8-bit codes depend on them).
void adam(uint i, inout float p, inout float m, inout float v) {
    float g = LOAD_GRAD(grad_offset + i) * scalar(GRAD_SCALE);
    if (HAS_FACTOR != 0) g *= factor[factor_offset];
    p = p * scalar(PARAM_DECAY);
    precise float m_new = m + scalar(ONE_MINUS_BETA1) * (g - m);
    precise float v_new = v * scalar(BETA2) + scalar(ONE_MINUS_BETA2) * g * g;
    m = m_new;
    v = v_new;
    float denom = sqrt(v) / scalar(BIAS_CORRECTION2_SQRT) + scalar(EPS);
    p -= scalar(STEP_SIZE) * (m / denom);
}

void store_param(uint i, float p) {
#if defined(PARAM_BF16)
    param[param_offset + i] = f32_to_bf16(p);
#else
    param[param_offset + i] = p;
#endif
#if defined(COPY_F16)
    model_copy[copy_offset + i] = float16_t(p);
#elif defined(COPY_BF16)
    model_copy[copy_offset + i] = f32_to_bf16(p);
#endif
}

#if !defined(STATE_Q8)
void main() {
    uint i = global_index();
    if (i >= n) return;
    float p = LOAD_PARAM(param_offset + i);
    float m = LOAD_STATE(exp_avg, exp_avg_offset + i);
    float v = LOAD_STATE(exp_avg_sq, exp_avg_sq_offset + i);
    adam(i, p, m, v);
    store_param(i, p);
    STORE_STATE(exp_avg, exp_avg_offset + i, m);
    STORE_STATE(exp_avg_sq, exp_avg_sq_offset + i, v);
}
#else
shared float signed_map[256];
shared float unsigned_map[256];
shared float max_m[256];
shared float max_v[256];

// Index of the map value nearest to x / scale: the first whose upper midpoint times scale is >= x.
uint quantize(float x, float scale, bool is_signed) {
    uint lo = 0, hi = 255;
    while (lo < hi) {
        uint mid = (lo + hi) / 2;
        float a = is_signed ? signed_map[mid] : unsigned_map[mid];
        float b = is_signed ? signed_map[mid + 1] : unsigned_map[mid + 1];
        precise float bound = ((a + b) * 0.5) * scale;
        if (x > bound) lo = mid + 1; else hi = mid;
    }
    return lo;
}

void main() {
    uint local = gl_LocalInvocationID.x;
    uint block = global_index() / 256;  // one workgroup per block
    if (block * 256 * BLOCK_ITEMS >= n) return;  // a 2-D grid's spare workgroups (the whole group returns)
    signed_map[local] = qmap[qmap_offset + local];
    unsigned_map[local] = qmap[qmap_offset + 256 + local];
    float scale_m = absmax_m[absmax_m_offset + block];
    float scale_v = absmax_v[absmax_v_offset + block];
    barrier();
    float ms[BLOCK_ITEMS], vs[BLOCK_ITEMS];
    float top_m = 0.0, top_v = 0.0;
    for (uint k = 0; k < BLOCK_ITEMS; k++) {
        uint i = block * 256 * BLOCK_ITEMS + k * 256 + local;
        ms[k] = 0.0;
        vs[k] = 0.0;
        if (i < n) {
            float p = LOAD_PARAM(param_offset + i);
            float m = signed_map[uint(exp_avg[exp_avg_offset + i])] * scale_m;
            float v = unsigned_map[uint(exp_avg_sq[exp_avg_sq_offset + i])] * scale_v;
            adam(i, p, m, v);
            store_param(i, p);
            ms[k] = m;
            vs[k] = v;
            top_m = max(top_m, abs(m));
            top_v = max(top_v, v);
        }
    }
    max_m[local] = top_m;
    max_v[local] = top_v;
    barrier();
    for (uint stride = 128; stride > 0; stride >>= 1) {
        if (local < stride) {
            max_m[local] = max(max_m[local], max_m[local + stride]);
            max_v[local] = max(max_v[local], max_v[local + stride]);
        }
        barrier();
    }
    float new_m = max_m[0], new_v = max_v[0];
    for (uint k = 0; k < BLOCK_ITEMS; k++) {
        uint i = block * 256 * BLOCK_ITEMS + k * 256 + local;
        if (i < n) {
            exp_avg[exp_avg_offset + i] = uint8_t(quantize(ms[k], new_m, true));
            exp_avg_sq[exp_avg_sq_offset + i] = uint8_t(quantize(vs[k], new_v, false));
        }
    }
    if (local == 0) {
        absmax_m[absmax_m_offset + block] = new_m;
        absmax_v[absmax_v_offset + block] = new_v;
    }
}
#endif
