// y[i] = alpha * x[i] + beta * y[i]. The u32 variant wraps modulo 2^32, so tests
// can compare long chains bit-exactly against numpy.
//! variant f32 -DT=float
//! variant u32 -DT=uint
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer X { T x[]; };
layout(binding = 1) buffer Y { T y[]; };
layout(push_constant) uniform Push { uint n; T alpha; T beta; };

void main() {
    uint i = global_index();
    if (i < n) y[i] = alpha * x[i] + beta * y[i];
}
