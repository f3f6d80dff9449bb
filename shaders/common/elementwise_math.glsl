// Accurate fp32 math for vkformers kernels: exp, log, tanh, erf/erfc, sin/cos.
//
// GLSL's built-ins only promise a few ULP near 0 (exp: 3 + 2|x| ULP, sin/cos: an
// absolute 2^-11) and differ between drivers; these give ~1-3 ULP everywhere so
// that a model computes the same numbers on every GPU and matches numpy tightly.
// Each is a standard range reduction plus a polynomial whose coefficients were
// fitted (weighted minimax, float64) for this file. `precise` keeps the range
// reductions exactly as written (no reassociation).
#ifndef VKFORMERS_ELEMENTWISE_MATH_GLSL
#define VKFORMERS_ELEMENTWISE_MATH_GLSL

#define POS_INF uintBitsToFloat(0x7F800000u)
#define NEG_INF uintBitsToFloat(0xFF800000u)
#define QUIET_NAN uintBitsToFloat(0x7FC00000u)
const float LOG2E = 1.44269502;
// ln 2 = LN2_HI + LN2_LO, LN2_HI with 16 significant bits so n * LN2_HI is exact for |n| < 256.
const float LN2_HI = 0.693145751953125;
const float LN2_LO = 1.42860677e-06;
const float SQRT1_2 = 0.707106769;
const float SQRT_2_OVER_PI = 0.797884583;
const float INV_SQRT_2PI = 0.398942292;

// 2^k for integer k in [-126, 127], built from its exponent bits.
float exp2_int(int k) { return intBitsToFloat((k + 127) << 23); }

float exp_accurate(float x) {
    if (x > 88.7228394) return POS_INF;
    if (x < -103.972084) return 0.0;  // below the smallest subnormal
    // x = n ln2 + r, |r| <= ln2 / 2; exp(r) = 1 + r + r^2 Q(r).
    precise float n = roundEven(x * LOG2E);
    precise float r = (x - n * LN2_HI) - n * LN2_LO;
    float q = 0.000197903442;
    q = q * r + 0.00139446568;
    q = q * r + 0.00833349675;
    q = q * r + 0.0416662954;
    q = q * r + 0.166666657;
    q = q * r + 0.5;
    float p = 1.0 + (r + r * r * q);
    // Scale by 2^n in two halves: n reaches 128 (overflow edge) and -150 (subnormals).
    int e = int(n);
    int half_e = e / 2;
    return p * exp2_int(half_e) * exp2_int(e - half_e);
}

float log_accurate(float x) {
    if (!(x > 0.0)) return x == 0.0 ? NEG_INF : QUIET_NAN;  // log(<0), log(NaN) = NaN
    if (isinf(x)) return x;
    int e_adjust = 0;
    if (x < 1.17549435e-38) { x *= 8388608.0; e_adjust = -23; }  // subnormal input: normalise first
    uint bits = floatBitsToUint(x);
    int e = int(bits >> 23) - 127 + e_adjust;
    float m = uintBitsToFloat((bits & 0x007FFFFFu) | 0x3F800000u);  // [1, 2)
    if (m > 1.41421354) { m *= 0.5; e += 1; }                        // [sqrt(1/2), sqrt(2))
    // log(1 + f) = 2 atanh(s), s = f / (2 + f); written as f - s (f - 2 s^2 P(s^2)) so the
    // exact f carries the leading term and the rounding of s only touches the correction.
    precise float f = m - 1.0;
    float s = f / (2.0 + f);
    float s2 = s * s;
    float p = 0.117911346;
    p = p * s2 + 0.142686516;
    p = p * s2 + 0.200001672;
    p = p * s2 + 0.333333313;
    precise float log1p_f = f - s * (f - 2.0 * s2 * p);
    float fe = float(e);
    return fe * LN2_HI + (log1p_f + fe * LN2_LO);
}

// log(1 + x) for small x too: u = 1 + x rounds, and x / (u - 1) undoes that rounding (Goldberg).
float log1p_accurate(float x) {
    precise float u = 1.0 + x;
    precise float rounded = u - 1.0;  // precise: a compiler may not fold (1 + x) - 1 into x
    if (u == 1.0 || isinf(u)) return u == 1.0 ? x : log_accurate(u);
    return log_accurate(u) * (x / rounded);
}

float sigmoid_accurate(float x) { return 1.0 / (1.0 + exp_accurate(-x)); }

float tanh_accurate(float x) {
    float a = abs(x);
    if (a < 0.55) {  // tanh(x) = x + x^3 P(x^2)
        float x2 = x * x;
        float p = 0.00239582243;
        p = p * x2 - 0.00841395743;
        p = p * x2 + 0.0217828266;
        p = p * x2 - 0.0539596491;
        p = p * x2 + 0.133332938;
        p = p * x2 - 0.333333313;
        return x + x * x2 * p;
    }
    if (a > 9.1) return sign(x);  // tanh rounds to +-1 in fp32
    float t = 1.0 - 2.0 / (exp_accurate(2.0 * a) + 1.0);
    return x < 0.0 ? -t : t;
}

// exp(-z^2) without the error of rounding z^2: z = hi + lo with hi of 12 bits, so hi^2 is exact.
float exp_minus_square(float z) {
    float hi = uintBitsToFloat(floatBitsToUint(z) & 0xFFFFF000u);
    precise float lo = z - hi;
    return exp_accurate(-hi * hi) * exp_accurate(-lo * (z + hi));
}

// erf(x) for |x| < 0.8: x P(x^2).
float erf_small(float x) {
    float x2 = x * x;
    float p = 9.15290948e-05;
    p = p * x2 - 0.000830405101;
    p = p * x2 + 0.00521350512;
    p = p * x2 - 0.0268638376;
    p = p * x2 + 0.112837665;
    p = p * x2 - 0.376126379;
    p = p * x2 + 1.12837923;
    return x * p;
}

// erfc(z) for z >= 0.8 (or NaN): exp(-z^2) erfcx(z), erfcx a polynomial in t = 1 / (1 + z/2).
float erfc_large(float z) {
    if (z > 10.1) return 0.0;
    float t = 1.0 / (1.0 + 0.5 * z);
    float p = 0.0672969222;
    p = p * t - 0.142080426;
    p = p * t - 0.032614056;
    p = p * t + 0.148226246;
    p = p * t + 0.138757527;
    p = p * t + 0.258330405;
    p = p * t + 0.280090749;
    p = p * t + 0.28228271;
    p = p * t - 7.3606343e-06;
    return exp_minus_square(z) * p;
}

float erf_accurate(float x) {
    float a = abs(x);
    if (a < 0.8) return erf_small(x);
    float r = 1.0 - erfc_large(a);
    return x < 0.0 ? -r : r;
}

// erfc with full relative accuracy in the right tail (what gelu needs for x < 0).
float erfc_accurate(float x) {
    if (x >= 0.8) return erfc_large(x);
    if (x <= -0.8) return 2.0 - erfc_large(-x);
    return 1.0 - erf_small(x);  // NaN lands here and stays NaN
}

// sin(x + quadrant * pi/2). Cody-Waite reduction with pi/2 in four parts (the first three
// of 8 significant bits, so j * part is exact): accurate for |x| up to ~1e5 (RoPE angles).
float sin_quadrant(float x, uint quadrant) {
    precise float j = roundEven(x * 0.636619747);
    precise float r = (((x - j * 1.5703125) - j * 0.0004825592041015625) - j * 1.2665987014770508e-06)
                      - j * 9.92093629e-10;
    uint q = uint(int(j)) + quadrant;
    float r2 = r * r;
    float v;
    if ((q & 1u) == 0u) {
        float p = 2.71802583e-06;
        p = p * r2 - 0.000198393027;
        p = p * r2 + 0.00833332911;
        p = p * r2 - 0.166666672;
        v = r + r * r2 * p;
    } else {
        float p = -2.7204851e-07;
        p = p * r2 + 2.47994485e-05;
        p = p * r2 - 0.00138888834;
        p = p * r2 + 0.0416666679;
        v = (1.0 - 0.5 * r2) + r2 * r2 * p;
    }
    return (q & 2u) != 0u ? -v : v;
}

float sin_accurate(float x) { return sin_quadrant(x, 0u); }
float cos_accurate(float x) { return sin_quadrant(x, 1u); }

// Activations shared by the elementwise and fused decode kernels.
float gelu(float x) { return 0.5 * x * erfc_accurate(-x * SQRT1_2); }
// 0.5 x (1 + tanh(u)) = x sigmoid(2u): no cancellation for negative x.
float gelu_tanh_inner(float x) { return SQRT_2_OVER_PI * (x + 0.044715 * x * x * x); }
float gelu_tanh(float x) { return x * sigmoid_accurate(2.0 * gelu_tanh_inner(x)); }
float silu(float x) { return x * sigmoid_accurate(x); }


#endif
