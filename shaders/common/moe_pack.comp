// Packed mixture-of-experts rows: the tokens' rows of all experts in one [tokens * top_k, width] matrix, expert
// after expert (each expert's rows one span, in its list's order), and the maps between packed rows, tokens,
// (token, choice) pairs and routing weights (vkformers_moe/routes.py PackedRoutes).
//   weights float32 [tokens, experts] (zero where not chosen); routes int32 [4, experts, tokens] and counts
//   float32 [experts] from moe_routes.comp (plane 1: a token's row in an expert's list).
//   spans       float32 [experts, 2]: (first packed row, row count) of each expert
//   token_of_row int32 [rows]: the token of packed row p; pair_of_row [rows]: its pair j * tokens + t (token
//                t's j-th chosen expert, in expert order); flat_of_row [rows]: its weight t * experts + e
//   row_of_pair  int32 [top_k, tokens] and row_of_flat [tokens, experts]: the inverse maps
// -1 wherever nothing maps (rows past the packed ones, fewer than top_k choices, experts not chosen). A row of
// weights must hold at most top_k nonzeros (the top-k choice's): the counts include any beyond, which would
// push later experts' rows past tokens * top_k (left out of every map, never written out of bounds).
// One invocation per token; every workgroup sums the counts into span starts in shared memory.
#version 450
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint MAX_EXPERTS = 1024;

layout(push_constant) uniform Push {
    uint tokens, experts, top_k;
    uint weights_off, routes_off, counts_off;
    uint spans_off, token_of_row_off, pair_of_row_off, row_of_pair_off, flat_of_row_off, row_of_flat_off;
};
layout(binding = 0) readonly buffer Weights { float weights[]; };
layout(binding = 1) readonly buffer Routes { int routes[]; };
layout(binding = 2) readonly buffer Counts { float counts[]; };
layout(binding = 3) writeonly buffer Spans { float spans[]; };
layout(binding = 4) writeonly buffer TokenOfRow { int token_of_row[]; };
layout(binding = 5) writeonly buffer PairOfRow { int pair_of_row[]; };
layout(binding = 6) writeonly buffer RowOfPair { int row_of_pair[]; };
layout(binding = 7) writeonly buffer FlatOfRow { int flat_of_row[]; };
layout(binding = 8) writeonly buffer RowOfFlat { int row_of_flat[]; };

shared uint starts[MAX_EXPERTS + 1];

void unmapped_row(uint p) {
    token_of_row[token_of_row_off + p] = -1;
    pair_of_row[pair_of_row_off + p] = -1;
    flat_of_row[flat_of_row_off + p] = -1;
}

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint t = gl_GlobalInvocationID.x, threads = gl_NumWorkGroups.x * 256;
    const uint rows = tokens * top_k;
    if (tid == 0) {  // a few hundred additions at most: not worth a parallel scan
        uint sum = 0;
        for (uint e = 0; e < experts; ++e) {
            starts[e] = sum;
            sum += uint(counts[counts_off + e]);
        }
        starts[experts] = sum;
    }
    barrier();
    if (gl_WorkGroupID.x == 0) {
        for (uint e = tid; e < experts; e += 256) {
            spans[spans_off + 2 * e] = float(starts[e]);
            spans[spans_off + 2 * e + 1] = counts[counts_off + e];
        }
    }
    for (uint p = min(starts[experts], rows) + t; p < rows; p += threads) unmapped_row(p);
    if (t >= tokens) return;
    uint j = 0;  // choices of token t so far
    for (uint e = 0; e < experts; ++e) {
        const uint f = t * experts + e;
        int mapped = -1;
        if (weights[weights_off + f] != 0.0) {
            const uint p = starts[e] + uint(routes[routes_off + experts * tokens + e * tokens + t]);
            const uint q = j * tokens + t;
            if (j < top_k && p < rows) {
                token_of_row[token_of_row_off + p] = int(t);
                pair_of_row[pair_of_row_off + p] = int(q);
                flat_of_row[flat_of_row_off + p] = int(f);
                row_of_pair[row_of_pair_off + q] = int(p);
                mapped = int(p);
            } else {  // more choices than top_k (or rows): left out
                if (p < rows) unmapped_row(p);
                if (j < top_k) row_of_pair[row_of_pair_off + q] = -1;
            }
            ++j;
        }
        row_of_flat[row_of_flat_off + f] = mapped;
    }
    for (; j < top_k; ++j) row_of_pair[row_of_pair_off + j * tokens + t] = -1;
}
