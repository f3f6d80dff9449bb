// Mixture-of-experts token lists: for each expert, the tokens that chose it, in token order, so that
// the expert runs on those rows only (vkformers_moe/routes.py).
//   weights float32 [tokens, experts]: routing weights, zero where a token did not choose the expert
//   routes  int32 [4, experts, tokens]:
//     [0] token_of_slot[e, s]: the token in row s of expert e's list (-1 past the list)
//     [1] slot_of_token[e, t]: token t's row in expert e's list (-1 where t did not choose e)
//     [2], [3]: the same as rows of the [experts * tokens] stack of all lists (e * tokens + ...)
//   counts  float32 [experts]: each list's length (the row gate of the experts' products)
// One workgroup per expert walks the tokens 256 at a time and numbers the chosen ones by a prefix sum
// in shared memory; no atomics, so the lists are the same on every run and device.
#version 450
layout(local_size_x = 256) in;

layout(push_constant) uniform Push { uint tokens; uint experts; uint weights_off; uint routes_off; uint counts_off; };
layout(binding = 0) readonly buffer Weights { float weights[]; };
layout(binding = 1) writeonly buffer Routes { int routes[]; };
layout(binding = 2) writeonly buffer Counts { float counts[]; };

shared uint scan[256];

void main() {
    const uint e = gl_WorkGroupID.x, tid = gl_LocalInvocationID.x;
    const uint plane = experts * tokens, list = routes_off + e * tokens, first = e * tokens;
    uint filled = 0;  // the list's length so far (uniform)
    for (uint t0 = 0; t0 < tokens; t0 += 256) {
        const uint t = t0 + tid;
        const uint chosen = (t < tokens && weights[weights_off + t * experts + e] != 0.0) ? 1u : 0u;
        scan[tid] = chosen;
        barrier();
        for (uint d = 1; d < 256; d <<= 1) {  // inclusive prefix sum (Hillis-Steele)
            uint before = tid >= d ? scan[tid - d] : 0u;
            barrier();
            scan[tid] += before;
            barrier();
        }
        const uint slot = filled + scan[tid] - chosen;
        if (t < tokens) {
            routes[list + plane + t] = chosen != 0 ? int(slot) : -1;
            routes[list + 3 * plane + t] = chosen != 0 ? int(first + slot) : -1;
            if (chosen != 0) {
                routes[list + slot] = int(t);
                routes[list + 2 * plane + slot] = int(first + t);
            }
        }
        filled += scan[255];
        barrier();  // everyone has read scan before the next chunk overwrites it
    }
    for (uint s = filled + tid; s < tokens; s += 256) {
        routes[list + s] = -1;
        routes[list + 2 * plane + s] = -1;
    }
    if (tid == 0) counts[counts_off + e] = float(filled);
}
