// 16-byte vectors of float32, float16 or bfloat16 values, read as raw words (uvec4) and widened to float32
// (matmul_small_m.comp, decode_matvec.comp). Define VECTOR_F32, VECTOR_F16 or VECTOR_BF16 before including.
#ifndef VKFORMERS_VECTOR16_GLSL
#define VKFORMERS_VECTOR16_GLSL

#if defined(VECTOR_F32)
#define PER_VECTOR 4
#define VECS 1
#else
#define PER_VECTOR 8
#define VECS 2
#endif
struct Vector { vec4 v[VECS]; };  // VECS vec4s

Vector decode(uvec4 w) {
    Vector x;
#if defined(VECTOR_F32)
    x.v[0] = uintBitsToFloat(w);
#elif defined(VECTOR_F16)
    x.v[0] = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
    x.v[1] = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
#else  // bfloat16: element 2j in the low half of word j, 2j+1 in the high half
    x.v[0] = uintBitsToFloat(uvec4(w.x << 16, w.x & 0xFFFF0000u, w.y << 16, w.y & 0xFFFF0000u));
    x.v[1] = uintBitsToFloat(uvec4(w.z << 16, w.z & 0xFFFF0000u, w.w << 16, w.w & 0xFFFF0000u));
#endif
    return x;
}

float vector_dot(Vector x, Vector y) {
    float s = dot(x.v[0], y.v[0]);
    for (uint j = 1; j < VECS; ++j) s += dot(x.v[j], y.v[j]);
    return s;
}

#endif
