// The decay matrices of Mamba-2's chunked scan, float32: for each row r of running sums of log-decays cs
// [rows, n] (a chunk of one head), out[r, l, s] = exp(cs[r, l] - cs[r, s]) for s <= l, and 0 above the diagonal,
// where no exp is taken (cs[r, l] - cs[r, s] > 0 there, and may overflow). One invocation per output element;
// the backward is composed from engine ops (vkformers_ssm/ssd.py).
//! variant forward -DFORWARD
#version 450
layout(local_size_x = 256) in;

layout(binding = 0) readonly buffer Sums { float cs[]; };
layout(binding = 1) writeonly buffer Decays { float decays[]; };
layout(push_constant) uniform Push { uint rows; uint n; uint cs_off; uint out_off; };

void main() {
    // a 2-D grid of workgroups (x fastest): more elements than maxComputeWorkGroupCount.x * 256
    uint index = gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    if (index >= rows * n * n) return;
    uint s = index % n, l = (index / n) % n, row = cs_off + (index / (n * n)) * n;
    decays[out_off + index] = s <= l ? exp(cs[row + l] - cs[row + s]) : 0.0;
}
