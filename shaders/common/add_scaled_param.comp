// y[i] += params[slot] * x[i], with params read from a small buffer that the host
// rewrites before each replay: how per-replay scalars (step, position, learning
// rate) reach a recorded sequence without re-recording it.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer Params { uint params[]; };
layout(binding = 1) readonly buffer X { uint x[]; };
layout(binding = 2) buffer Y { uint y[]; };
layout(push_constant) uniform Push { uint n; uint slot; };

void main() {
    uint i = global_index();
    if (i < n) y[i] += params[slot] * x[i];
}
