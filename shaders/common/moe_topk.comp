// Top-k along the last axis: mask[r, i] = 1.0 where values[r, i] is among the k largest of row r, else 0.0.
// Ties go to the lower index, so exactly k entries are chosen (torch.topk's order on a tie; NaN ranks above
// every number, as there). One workgroup per
// row stages it in shared memory; each invocation counts, for its entries, the entries ranked above them
// (n x n comparisons per row: rows are a router's experts or an indexer's blocks, at most MAX_N).
#version 450
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint MAX_N = 1024;

layout(push_constant) uniform Push { uint rows; uint n; uint k; uint values_off; uint mask_off; };
layout(binding = 0) readonly buffer Values { float values[]; };
layout(binding = 1) writeonly buffer Mask { float mask[]; };

shared float row_values[MAX_N];

void main() {
    const uint r = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x, tid = gl_LocalInvocationID.x;
    if (r >= rows) return;  // uniform over the workgroup
    for (uint i = tid; i < n; i += gl_WorkGroupSize.x) row_values[i] = values[values_off + r * n + i];
    barrier();
    for (uint i = tid; i < n; i += gl_WorkGroupSize.x) {
        const float v = row_values[i];
        const bool v_nan = isnan(v);
        uint above = 0;
        for (uint j = 0; j < n; ++j) {
            const float w = row_values[j];
            const bool w_nan = isnan(w);
            const bool greater = w_nan ? !v_nan : (!v_nan && w > v);
            const bool tie = w_nan ? v_nan : w == v;
            above += (greater || (tie && j < i)) ? 1u : 0u;
        }
        mask[mask_off + r * n + i] = above < k ? 1.0 : 0.0;
    }
}
