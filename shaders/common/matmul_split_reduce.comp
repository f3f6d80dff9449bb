// Second pass of a split-K matmul (matmul_coopmat.comp with SPLITS > 1): C = epilogue(sum of the
// float32 partial products of every K slice). A holds the partials as [batch, splits, m, n];
// k carries the number of splits; stride_a is m * n. One invocation per element of C.
//! variant f32 -DIN_F32 -DOUT_F32
//! variant f16 -DIN_F32 -DOUT_F16
//! variant bf16 -DIN_F32 -DOUT_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint HAS_BIAS = 0;
#include "matmul_io.glsl"

void main() {
    const uint e = gl_GlobalInvocationID.x, batch = gl_WorkGroupID.y;
    if (e >= m * n) return;
    const uint first = off_a + batch * k * stride_a + e;
    float sum = 0.0;
    for (uint s = 0; s < k; ++s) sum += a_data[first + s * stride_a];  // slices in order: deterministic
    store_c(off_c + batch * stride_c + e, e % n, sum);
}
