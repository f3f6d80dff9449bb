// out[i] = op(a, b, mask) over a shape of up to 6 dims, one element per invocation.
// The output is contiguous from out_offset; every input has its own offset and
// strides (0 broadcasts along a dim), so views and broadcasting cost no copies.
// The op is the specialization constant OP (codes in elementwise_ops.glsl); a
// spec-constant switch folds away, so each pipeline holds only its op's code.
// Float storage computes in fp32 with the accurate math of elementwise_math.glsl.
//! variant f32 -DDTYPE_F32
//! variant f16 -DDTYPE_F16
//! variant bf16 -DDTYPE_BF16
//! variant i32 -DDTYPE_I32
//! variant f32_cmp -DDTYPE_F32 -DCOMPARE
//! variant f16_cmp -DDTYPE_F16 -DCOMPARE
//! variant bf16_cmp -DDTYPE_BF16 -DCOMPARE
//! variant i32_cmp -DDTYPE_I32 -DCOMPARE
//! variant f32_inplace -DDTYPE_F32 -DINPLACE
//! variant f16_inplace -DDTYPE_F16 -DINPLACE
//! variant bf16_inplace -DDTYPE_BF16 -DINPLACE
//! variant i32_inplace -DDTYPE_I32 -DINPLACE
// The inplace variants write out over a (contiguous, from out_offset = a_offset: each invocation reads its
// element of a before writing it), bound once; b and mask are other buffers.
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_shader_8bit_storage : require
// Before common.glsl: its global_index() reads gl_WorkGroupSize, which is 1 until declared.
layout(local_size_x = 256) in;
#include "common.glsl"
#include "elementwise_storage.glsl"
#include "elementwise_math.glsl"
#include "elementwise_ops.glsl"

layout(constant_id = 0) const uint OP = OP_ADD;
layout(constant_id = 1) const uint NDIM = 1;  // dims after the launcher coalesced them, 1..MAX_DIMS
#define MAX_DIMS 6

#ifdef INPLACE
layout(binding = 0) buffer A { STORAGE_T a[]; };
#define out_value a
#else
layout(binding = 0) readonly buffer A { STORAGE_T a[]; };
#endif
layout(binding = 1) readonly buffer B { STORAGE_T b[]; };
layout(binding = 2) readonly buffer Mask { uint8_t mask[]; };  // read by `where` only
#ifdef COMPARE
layout(binding = 3) writeonly buffer Out { uint8_t out_mask[]; };
#elif !defined(INPLACE)
layout(binding = 3) writeonly buffer Out { STORAGE_T out_value[]; };
#endif

// 30 words: fits the 128 bytes that every Vulkan device offers.
layout(push_constant) uniform Push {
    uint shape[MAX_DIMS];
    uint a_stride[MAX_DIMS];
    uint b_stride[MAX_DIMS];
    uint mask_stride[MAX_DIMS];
    uint a_offset;
    uint b_offset;
    uint mask_offset;
    uint out_offset;
    uint scalar0_bits;  // float bits for float storage, int for int32 storage
    uint scalar1_bits;
};

#ifdef VALUE_IS_INT
#define SCALAR(bits) int(bits)
#else
#define SCALAR(bits) uintBitsToFloat(bits)
#endif

const bool READS_B = OP >= OP_FIRST_BINARY;

#ifdef VALUE_IS_INT

int apply(int x, int y, int s0, int s1) {
    switch (OP) {
    case OP_NEG: return -x;
    case OP_ABS: return abs(x);
    case OP_SQUARE: return x * x;
    case OP_ADD_SCALAR: return x + s0;
    case OP_MUL_SCALAR: return x * s0;
    case OP_CLAMP: return min(max(x, s0), s1);
    case OP_RSUB_SCALAR: return s0 - x;
    case OP_ADD: return x + y;
    case OP_SUB: return x - y;
    case OP_MUL: return x * y;
    case OP_MAXIMUM: return max(x, y);
    case OP_MINIMUM: return min(x, y);
    }
    return 0;  // the launcher allows no other op on int32
}

#else

// x < 0 and not NaN, decided on the bits: drivers may compile `x < 0.0 ? 0.0 : x` to max(x, 0.0),
// which turns NaN into 0 (the H200 does).
bool negative_not_nan(float x) {
    uint u = floatBitsToUint(x);
    return (u >> 31) != 0u && (u & 0x7FFFFFFFu) <= 0x7F800000u;
}

float pow_accurate(float base, float e) {
    // The exponents models use most, exactly (and fast).
    if (e == 0.0 || base == 1.0) return 1.0;
    if (e == 1.0) return base;
    if (e == 2.0) return base * base;
    if (e == 3.0) return base * base * base;
    if (e == 0.5) return sqrt(base);
    if (e == -0.5) return inversesqrt(base);
    if (e == -1.0) return 1.0 / base;
    bool e_is_int = floor(e) == e;
    if (base < 0.0 && !e_is_int) return QUIET_NAN;
    float m = abs(base);
    if (m == 0.0) return e < 0.0 ? POS_INF : 0.0;
    float r = exp_accurate(e * log_accurate(m));
    bool odd = e_is_int && abs(e) < 16777216.0 && (int(e) & 1) != 0;  // from 2^24 on, every float is even
    return (base < 0.0 && odd) ? -r : r;
}

// d/dx [x Phi(x)] = Phi(x) + x phi(x)
float gelu_grad(float x) {
    return 0.5 * erfc_accurate(-x * SQRT1_2) + x * INV_SQRT_2PI * exp_minus_square(x * SQRT1_2);
}

// 1 - sigmoid(z) is computed as sigmoid(-z): no cancellation where sigmoid(z) is near 1.
float gelu_tanh_grad(float x) {
    float u = gelu_tanh_inner(x);
    float s = sigmoid_accurate(2.0 * u);
    float du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
    return s + 2.0 * x * s * sigmoid_accurate(-2.0 * u) * du;
}

float apply(float x, float y, float s0, float s1) {
    switch (OP) {
    case OP_NEG: return -x;
    case OP_EXP: return exp_accurate(x);
    case OP_LOG: return log_accurate(x);
    case OP_SQRT: return sqrt(x);
    case OP_RSQRT: return inversesqrt(x);
    case OP_ABS: return abs(x);
    case OP_TANH: return tanh_accurate(x);
    case OP_SIGMOID: return sigmoid_accurate(x);
    case OP_RELU: return negative_not_nan(x) ? 0.0 : x;  // keeps NaN, as torch does
    case OP_GELU: return gelu(x);
    case OP_GELU_TANH: return gelu_tanh(x);
    case OP_SILU: return silu(x);
    case OP_RELU2: return negative_not_nan(x) ? 0.0 : x * x;
    case OP_QUICK_GELU: return x * sigmoid_accurate(1.702 * x);
    case OP_SIN: return sin_accurate(x);
    case OP_COS: return cos_accurate(x);
    case OP_RECIPROCAL: return 1.0 / x;
    case OP_SQUARE: return x * x;
    case OP_ERF: return erf_accurate(x);
    case OP_SOFTPLUS: return x > 20.0 ? x : max(x, 0.0) + log1p_accurate(exp_accurate(-abs(x)));

    case OP_ADD_SCALAR: return x + s0;
    case OP_MUL_SCALAR: return x * s0;
    case OP_POW_SCALAR: return pow_accurate(x, s0);
    case OP_CLAMP: return x < s0 ? s0 : (x > s1 ? s1 : x);  // keeps NaN
    case OP_RSUB_SCALAR: return s0 - x;

    case OP_ADD: return x + y;
    case OP_SUB: return x - y;
    case OP_MUL: return x * y;
    case OP_DIV: return x / y;
    case OP_POW: return pow_accurate(x, y);
    case OP_MAXIMUM: return (x > y || isnan(x)) ? x : y;  // NaN wins, as in torch.maximum
    case OP_MINIMUM: return (x < y || isnan(x)) ? x : y;

    // (x, dy) -> dx; sigmoid/tanh take (y, dy)
    case OP_RELU_BACKWARD: return x > 0.0 ? y : 0.0;
    case OP_GELU_BACKWARD: return y * gelu_grad(x);
    case OP_GELU_TANH_BACKWARD: return y * gelu_tanh_grad(x);
    case OP_SILU_BACKWARD: {
        float s = sigmoid_accurate(x);
        return y * s * (1.0 + x * sigmoid_accurate(-x));
    }
    case OP_SIGMOID_BACKWARD: return y * x * (1.0 - x);
    case OP_TANH_BACKWARD: return y * (1.0 - x * x);
    case OP_RELU2_BACKWARD: return x > 0.0 ? 2.0 * x * y : 0.0;
    case OP_SOFTPLUS_BACKWARD: return x > 20.0 ? y : y * sigmoid_accurate(x);
    case OP_QUICK_GELU_BACKWARD: {
        float s = sigmoid_accurate(1.702 * x);
        return y * (s + 1.702 * x * s * sigmoid_accurate(-1.702 * x));
    }
    }
    return 0.0;
}

#endif

bool compare(VALUE_T x, VALUE_T y) {
    switch (OP) {
    case OP_LT: return x < y;
    case OP_LE: return x <= y;
    case OP_GT: return x > y;
    case OP_GE: return x >= y;
    case OP_EQ: return x == y;
    case OP_NE: return !(x == y);  // true against NaN, as in numpy
    }
    return false;
}

void main() {
    uint count = 1;
    for (uint d = 0; d < NDIM; ++d) count *= shape[d];
    uint i = global_index();
    if (i >= count) return;

    // Row-major coordinates of i, innermost dim first; dim 0 needs no division.
    uint a_index = a_offset, b_index = b_offset, mask_index = mask_offset;
    uint rest = i;
    for (uint d = NDIM - 1; d > 0; --d) {
        uint coord = rest % shape[d];
        rest /= shape[d];
        a_index += coord * a_stride[d];
        b_index += coord * b_stride[d];
        mask_index += coord * mask_stride[d];
    }
    a_index += rest * a_stride[0];
    b_index += rest * b_stride[0];
    mask_index += rest * mask_stride[0];

#ifdef COMPARE
    out_mask[out_offset + i] = uint8_t(compare(LOAD(a[a_index]), LOAD(b[b_index])) ? 1u : 0u);
#else
    if (OP == OP_WHERE) {  // picks storage elements: no conversion, any dtype
        out_value[out_offset + i] = uint(mask[mask_index]) != 0u ? a[a_index] : b[b_index];
        return;
    }
    VALUE_T x = LOAD(a[a_index]);
    VALUE_T y = READS_B ? LOAD(b[b_index]) : VALUE_T(0);
    out_value[out_offset + i] = STORE(apply(x, y, SCALAR(scalar0_bits), SCALAR(scalar1_bits)));
#endif
}
