// cos and sin of rotary angles, shared by the rope and fused decode kernels.
#ifndef VKFORMERS_ROPE_ANGLE_GLSL
#define VKFORMERS_ROPE_ANGLE_GLSL

// cos and sin of a float32 angle that may be ~1e5 rad. GPU sin/cos are accurate only
// near [-pi, pi], and reducing with k * 2pi in float32 loses the answer (without a fused
// multiply-add, which Vulkan does not promise), so the reduction is done exactly in
// integers: frac(|angle| / 2pi) as 32-bit fixed point = bits of mantissa * floor(2^64 / 2pi).
const uint INV_TWO_PI_HI = 0x28BE60DBu;  // floor(2^64 / (2 pi)), upper and lower words
const uint INV_TWO_PI_LO = 0x9391054Au;
const float TWO_PI_OVER_2_32 = 1.462918119976564e-09;

float reduce_angle(float a) {  // a >= 0; returns a - 2 pi k in [-pi, pi)
    if (a <= 3.14159265) return a;
    uint bits = floatBitsToUint(a);
    int e = int(bits >> 23) - 150;                  // a = m * 2^e, m a 24-bit integer
    uint m = (bits & 0x7FFFFFu) | 0x800000u;
    uint hh, hl, lh, ll;
    umulExtended(m, INV_TWO_PI_HI, hh, hl);
    umulExtended(m, INV_TWO_PI_LO, lh, ll);
    uint w0 = ll, w1 = hl + lh, w2 = hh + (w1 < hl ? 1u : 0u);  // the 88-bit product
    int shift = 32 - e;  // the fraction's 32 bits start here: in [24, 54] for pi < a < 2^32
    uint frac;
    if (shift >= 32) {
        int t = shift - 32;
        frac = t == 0 ? w1 : (w1 >> t) | (w2 << (32 - t));
    } else {
        int t = max(shift, 1);
        frac = (w0 >> t) | (w1 << (32 - t));
    }
    return float(int(frac)) * TWO_PI_OVER_2_32;  // signed: the fraction in [-1/2, 1/2) turns
}

vec2 cos_sin(float angle) {
    float r = reduce_angle(abs(angle));
    return vec2(cos(r), angle < 0.0 ? -sin(r) : sin(r));
}

// Pair i (i < head_dim / 2) of a head's dims that a rotary embedding turns together: (i, i + rot_dim/2) in
// the half-split layout (HF rotate_half), (2i, 2i + 1) interleaved (GPT-J); dims past rot_dim pass through in
// pairs (2i', 2i' + 1). Returns the two dims; freq is the inv_freq index, or -1 for a pass-through pair.
uvec2 rotary_pair(uint i, uint rot_dim, bool interleaved, out int freq) {
    freq = -1;
    if (interleaved) {
        if (2 * i < rot_dim) freq = int(i);
        return uvec2(2 * i, 2 * i + 1);
    }
    if (i < rot_dim / 2) {
        freq = int(i);
        return uvec2(i, i + rot_dim / 2);
    }
    uint d = rot_dim + 2 * (i - rot_dim / 2);
    return uvec2(d, d + 1);
}

// (x0, x1) of a pair rotated by angle, cos and sin scaled by attention_scaling (yarn / longrope), as HF.
vec2 rotate_pair(vec2 x, float angle, float attention_scaling) {
    vec2 cs = cos_sin(angle) * attention_scaling;
    return vec2(x.x * cs.x - x.y * cs.y, x.y * cs.x + x.x * cs.y);
}

#endif
