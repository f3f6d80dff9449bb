// dst[i] = src[i] over n 16-byte vectors: the bandwidth kernel and a plain device copy.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(binding = 0) readonly buffer Src { uvec4 src[]; };
layout(binding = 1) writeonly buffer Dst { uvec4 dst[]; };
layout(push_constant) uniform Push { uint n; };

void main() {
    uint i = global_index();
    if (i < n) dst[i] = src[i];
}
