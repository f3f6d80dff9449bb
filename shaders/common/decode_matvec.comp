// Fused products of a decode step (one new token per sequence, ROWS <= 8 rows of x):
//   y = epilogue(rms_norm(x) @ W^T), W row-major [n, k] (a Linear's weight), float32 accumulation.
// Folding the steps around a product into it saves the dependent dispatches (and barriers)
// that dominate a decode step on a GPU; the product itself is bound by reading W.
//
// Prologue, HAS_NORM: rms_norm(x) @ W^T = rstd * ((x * g) @ W^T) per row, rstd = 1/sqrt(mean(x^2) + eps),
// so the norm costs one extra sum of squares in the same pass over x (g: the norm weight, 1 + g for
// NORM_OFFSET; no weight when NORM_WEIGHT is 0).
//
// A subgroup computes two output columns at a time (a "pair") for every row; what a pair is and
// where it goes depends on MODE:
//   MODE_PLAIN: columns (2u, 2u + 1) of W0; out0 = y (+ bias) (or residual + residual_scale * y).
//   MODE_GATED: column u of W0 (gate) and of W1 (up); out0[u] = act(gate) * up (SwiGLU, GeGLU).
//   MODE_QKV:   W0, W1, W2 are the q, k and v projections of one attention layer. q and k pairs are
//               the two dims a rotary embedding turns together (half-split (i, i + rot/2) or
//               interleaved (2i, 2i + 1); dims past rot_dim pass through), rotated by
//               position * inv_freq[i]; q goes to out0 ([rows, heads, 1, head_dim]), k and v are
//               written into the KV caches out1 / out2 ([rows, kv_heads, capacity, head_dim]) at the
//               slot cache_start[0], read on the GPU so that one recorded step serves every position.
//               PAGE_SIZE > 0: the caches are pools of blocks [blocks, kv_heads, PAGE_SIZE, head_dim] and row r's
//               slot goes through its block table (capacity / PAGE_SIZE entries at cache_start[2 + r * ...]:
//               the paged cache's step tensor [start, end, tables]); block 0 (scratch) is never written.
// Lanes stride over k in 16-byte vectors (4 float32 or 8 16-bit values): x, g and W are bound as
// raw 16-byte words, so k and the offsets must be whole numbers of vectors (the launcher checks).
// QUANT_W (the q_* variants): W0, W1, W2 are quantized weights, each in its own block format (quant_block.glsl;
// FORMAT0..2: a Q4_K_M file keeps attn_v in Q6_K beside Q4_K q and k), read from their packed bytes (w_offset0..2
// in bytes, rows of k / block whole blocks): lanes stride over units of 32 weights instead of vectors, and x, g follow
// each unit's four octets (runs of 8 elements); each run of octets sharing a scale takes it once
// (scale * dot(x, codes) + offset * sum(x)), not once per weight. PAIRS_PER_SUBGROUP pairs are computed together, so
// that each octet of x (and of g, and its squares for the norm) is read and decoded once for all their columns
// (columns of another format than the first read their own); with SPLIT_K the workgroup's subgroups share them, all
// its lanes taking units in turn and adding up in shared memory once at the end (else each subgroup has its own).
// A step of the lanes loads the packed words of UNROLL units of every column before it decodes any (quant_fetch_unit:
// the loads in flight), then decodes each octet where it is multiplied, with codes turned to floats by placing
// their bits in a float's mantissa (no conversion, no subtraction per weight).
//! variant f32 -DELEM_F32
//! variant f16 -DELEM_F16
//! variant bf16 -DELEM_BF16
//! variant q_f32 -DELEM_F32 -DQUANT_W
//! variant q_f16 -DELEM_F16 -DQUANT_W
//! variant q_bf16 -DELEM_BF16 -DQUANT_W
#version 450
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "transformer_common.glsl"
#include "elementwise_math.glsl"
#include "rope_angle.glsl"

#define MODE_PLAIN 0
#define MODE_GATED 1
#define MODE_QKV 2
#define ACT_SILU 0
#define ACT_GELU 1
#define ACT_GELU_TANH 2
#define ACT_RELU 3

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint ROWS = 1;
layout(constant_id = 2) const uint MODE = MODE_PLAIN;
layout(constant_id = 3) const uint HAS_NORM = 0;
layout(constant_id = 4) const uint NORM_WEIGHT = 1;
layout(constant_id = 5) const uint NORM_OFFSET = 0;
layout(constant_id = 6) const uint HAS_BIAS = 0;  // bit i: W_i has a bias
layout(constant_id = 7) const uint HAS_RESIDUAL = 0;
layout(constant_id = 8) const uint ACT = ACT_SILU;
layout(constant_id = 9) const uint INTERLEAVED = 0;
layout(constant_id = 10) const uint UNROLL = 4;  // vectors of each W row a lane has in flight
// more on a CPU: fewer, longer workgroups (QUANT_W: computed together)
layout(constant_id = 11) const uint PAIRS_PER_SUBGROUP = 1;
// SPLIT_K: the workgroup's subgroups share each pair, subgroup s taking the s-th slice of k (QUANT_W: the lanes of
// all of them taking units in turn), and add up their sums in shared memory: more loads in flight for a narrow
// product (few pairs) with a long k.
layout(constant_id = 12) const uint SPLIT_K = 0;
layout(constant_id = 13) const uint PAGE_SIZE = 0;  // MODE_QKV into a paged cache (see above)
// bit i: W_i's bias is one per row ([rows, n_i]: an update computed beside the step, as served LoRA adapters'
// low-rank products), not one per column
layout(constant_id = 14) const uint BIAS_ROWS = 0;

// [subgroup][row][acc0, acc1, squares] (QUANT_W: [subgroup][row][2 * PAIRS_PER_SUBGROUP columns, squares])
shared float split_sums[SPLIT_K != 0 ? (2 * PAIRS_PER_SUBGROUP + 1) * ROWS * 32 : 1];

layout(binding = 0) readonly buffer X { uvec4 x_words[]; };
layout(binding = 1) readonly buffer NormW { uvec4 g_words[]; };
layout(binding = 2) readonly buffer W0 { uvec4 w0[]; };
layout(binding = 3) readonly buffer W1 { uvec4 w1[]; };
layout(binding = 4) readonly buffer W2 { uvec4 w2[]; };
layout(binding = 5) readonly buffer Bias0 { ELEM_T bias0[]; };
layout(binding = 6) readonly buffer Bias1 { ELEM_T bias1[]; };
layout(binding = 7) readonly buffer Bias2 { ELEM_T bias2[]; };
layout(binding = 8) readonly buffer Residual { ELEM_T residual[]; };
layout(binding = 9) buffer Out0 { ELEM_T out0[]; };
layout(binding = 10) buffer Out1 { ELEM_T out1[]; };
layout(binding = 11) buffer Out2 { ELEM_T out2[]; };
layout(binding = 12) readonly buffer Positions { int positions[]; };
layout(binding = 13) readonly buffer CacheStart { uint cache_start[]; };
layout(binding = 14) readonly buffer InvFreq { float inv_freq[]; };

layout(push_constant) uniform Push {
    uint k;                       // inner size (elements)
    uint n0; uint n1; uint n2;    // output columns of W0, W1, W2 (0 where unused)
    float eps;
    float residual_scale;
    uint head_dim; uint rot_dim; uint kv_heads; uint capacity;
    float attention_scaling;
    uint bias_offset0; uint bias_offset1; uint bias_offset2;
    uint residual_offset; uint out_offset; uint positions_offset; uint start_offset; uint inv_freq_offset;
    uint x_offset;                // in 16-byte vectors
    uint w_offset0; uint w_offset1; uint w_offset2;  // in 16-byte vectors: rows of one fused weight ([q | k | v])
    uint g_offset;                // in 16-byte vectors
};

#if defined(ELEM_F32)
#define VECTOR_F32
#elif defined(ELEM_F16)
#define VECTOR_F16
#endif
#include "vector16.glsl"

#if defined(QUANT_W)
layout(constant_id = 15) const uint FORMAT0 = 0;  // quant_block.glsl QUANT_* of W0
layout(constant_id = 16) const uint W_VEC = 0;    // every weight's byte offset is a multiple of 16
layout(constant_id = 17) const uint FORMAT1 = 0;  // of W1
layout(constant_id = 18) const uint FORMAT2 = 0;  // of W2
// Units side by side in a lane (1 or 2, dividing k / 32): units 2m and 2m + 1 of a block share the decoding of their
// scales (and its load), and a lane's loads cover 32 bytes of codes.
layout(constant_id = 19) const uint ADJACENT = 1;
layout(binding = 2) readonly buffer W0Words { uint w0_words[]; };
layout(binding = 3) readonly buffer W1Words { uint w1_words[]; };
layout(binding = 4) readonly buffer W2Words { uint w2_words[]; };
uint quant_source;  // the weight quant_unit reads (uniform over a subgroup)
uint format_of(uint which) { return which == 0u ? FORMAT0 : (which == 1u ? FORMAT1 : FORMAT2); }
// quant_block.glsl's functions take the format of the weight being read. When all three agree (every product but a
// Q4_K_M file's q/k/v) it is the specialization constant itself, so that each format's pipeline holds its own
// decoding alone whatever the compiler makes of quant_source; else the weight's, a uniform choice.
const bool ONE_FORMAT = FORMAT0 == FORMAT1 && FORMAT0 == FORMAT2;
#define FORMAT (ONE_FORMAT ? FORMAT0 : format_of(quant_source))
// W1 and W2 only where the mode reads them (a plain product reads W0 alone).
uint quant_word(uint i) {
    if (MODE == MODE_PLAIN) return w0_words[i];
    return quant_source == 0u ? w0_words[i] : (quant_source == 1u ? w1_words[i] : w2_words[i]);
}
uvec4 quant_vec(uint i) {
    if (MODE == MODE_PLAIN) return w0[i];
    return quant_source == 0u ? w0[i] : (quant_source == 1u ? w1[i] : w2[i]);
}
#define QUANT_WORD(i) quant_word(i)
#define QUANT_VEC(i) quant_vec(i)
#define QUANT_PACKED_VECTORS
#include "quant_block.glsl"

uint weight_byte_offset(uint which) { return which == 0u ? w_offset0 : (which == 1u ? w_offset1 : w_offset2); }

// Elements e .. e + 7 (e a multiple of 8) of row r of x, and of the norm weight.
void x_octet(uint r, uint e, out vec4 lo, out vec4 hi) {
    Vector a = decode(x_words[x_offset + (r * k + e) / PER_VECTOR]);
#if defined(VECTOR_F32)
    Vector b = decode(x_words[x_offset + (r * k + e) / PER_VECTOR + 1u]);
    lo = a.v[0]; hi = b.v[0];
#else
    lo = a.v[0]; hi = a.v[1];
#endif
}
void g_octet(uint e, out vec4 lo, out vec4 hi) {
    Vector a = decode(g_words[g_offset + e / PER_VECTOR]);
#if defined(VECTOR_F32)
    Vector b = decode(g_words[g_offset + e / PER_VECTOR + 1u]);
    lo = a.v[0]; hi = b.v[0];
#else
    lo = a.v[0]; hi = a.v[1];
#endif
    if (NORM_OFFSET != 0) { lo += 1.0; hi += 1.0; }
}
#endif

uvec4 weight_word(uint which, uint index) {
    if (which == 0) return w0[w_offset0 + index];
    if (which == 1) return w1[w_offset1 + index];
    return w2[w_offset2 + index];
}

float bias_of(uint which, uint column, uint row) {
    if (((HAS_BIAS >> which) & 1u) == 0u) return 0.0;
    uint at = column + (((BIAS_ROWS >> which) & 1u) != 0u ? row * (which == 0 ? n0 : (which == 1 ? n1 : n2)) : 0u);
    if (which == 0) return load_elem(bias0[bias_offset0 + at]);
    if (which == 1) return load_elem(bias1[bias_offset1 + at]);
    return load_elem(bias2[bias_offset2 + at]);
}

float activation(float x) {
    if (ACT == ACT_GELU) return gelu(x);
    if (ACT == ACT_GELU_TANH) return gelu_tanh(x);
    if (ACT == ACT_RELU) return x > 0.0 ? x : 0.0;
    return silu(x);
}

// Which matrix and rows of it pair p is, and whether (and by which frequency) the pair rotates.
struct Pair { uint which; uint col0; uint col1; int freq; uint head; uint dim0; uint dim1; };

Pair pair_of(uint p) {
    Pair r;
    r.freq = -1;
    if (MODE == MODE_PLAIN) {
        r.which = 0; r.col0 = 2 * p; r.col1 = 2 * p + 1;
        return r;
    }
    if (MODE == MODE_GATED) {
        r.which = 0; r.col0 = p; r.col1 = p;  // gate column p of W0, up column p of W1
        return r;
    }
    uint half_head = head_dim / 2, q_pairs = n0 / 2, k_pairs = n1 / 2;
    r.which = p < q_pairs ? 0 : (p < q_pairs + k_pairs ? 1 : 2);
    uint local = p - (r.which == 0 ? 0 : (r.which == 1 ? q_pairs : q_pairs + k_pairs));
    r.head = local / half_head;
    uint i = local % half_head;
    uvec2 dims = rotary_pair(i, r.which == 2 ? 0 : rot_dim, INTERLEAVED != 0, r.freq);  // v: never rotated
    r.dim0 = dims.x; r.dim1 = dims.y;
    r.col0 = r.head * head_dim + r.dim0;
    r.col1 = r.head * head_dim + r.dim1;
    return r;
}

void store(uint row, Pair pr, float y0, float y1) {
    if (MODE == MODE_GATED) {
        out0[out_offset + row * n0 + pr.col0] = store_elem(activation(y0) * y1);
        return;
    }
    if (MODE == MODE_PLAIN) {
        [[unroll]] for (uint c = 0; c < 2; ++c) {
            uint col = c == 0 ? pr.col0 : pr.col1;
            if (col >= n0) break;
            float y = c == 0 ? y0 : y1;
            if (HAS_RESIDUAL != 0) y = load_elem(residual[residual_offset + row * n0 + col]) + residual_scale * y;
            out0[out_offset + row * n0 + col] = store_elem(y);
        }
        return;
    }
    if (pr.which == 0) {
        out0[out_offset + row * n0 + pr.col0] = store_elem(y0);
        out0[out_offset + row * n0 + pr.col1] = store_elem(y1);
        return;
    }
    uint slot = ((row * kv_heads + pr.head) * capacity + cache_start[start_offset]) * head_dim;
    if (PAGE_SIZE > 0u) {
        uint position = cache_start[start_offset];
        uint block = cache_start[start_offset + 2u + row * (capacity / PAGE_SIZE) + position / PAGE_SIZE];
        if (block == 0u) return;
        slot = ((block * kv_heads + pr.head) * PAGE_SIZE + position % PAGE_SIZE) * head_dim;
    }
    if (pr.which == 1) {
        out1[slot + pr.dim0] = store_elem(y0);
        out1[slot + pr.dim1] = store_elem(y1);
    } else {
        out2[slot + pr.dim0] = store_elem(y0);
        out2[slot + pr.dim1] = store_elem(y1);
    }
}

// The end of pair pr for every row: the norm's 1/rms, bias, rotation and the store (one lane per row).
void finish_pair(Pair pr, uint second, uint col1, float sums0[ROWS], float sums1[ROWS], float sumsq[ROWS]) {
    const uint lane = gl_SubgroupInvocationID, step = gl_SubgroupSize;
    [[unroll]] for (uint r = 0; r < ROWS; ++r) {
        if (lane != r % step) continue;  // one lane stores each row
        float y0 = sums0[r], y1 = sums1[r];
        if (HAS_NORM != 0) {
            float rstd = inversesqrt(sumsq[r] / float(k) + eps);
            y0 *= rstd;
            y1 *= rstd;
        }
        if (HAS_BIAS != 0) {
            y0 += bias_of(pr.which, pr.col0, r);
            y1 += bias_of(second, col1, r);
        }
        if (pr.freq >= 0) {
            float angle = float(positions[positions_offset + r]) * inv_freq[inv_freq_offset + pr.freq];
            vec2 y = rotate_pair(vec2(y0, y1), angle, attention_scaling);
            y0 = y.x;
            y1 = y.y;
        }
        store(r, pr, y0, y1);
    }
}

// The matrix of pair pr's second column, and that column (plain: an odd n0 repeats the last row).
uint second_of(Pair pr) { return MODE == MODE_GATED ? 1 : pr.which; }
uint col1_of(Pair pr) { return min(pr.col1, (MODE == MODE_PLAIN ? n0 : pr.col1 + 1) - 1); }

#if defined(QUANT_W)
#define QUANT_COLS (2u * PAIRS_PER_SUBGROUP)
uint quant_row_bytes(uint which) {
    quant_source = which;
    return k / quant_block_size() * quant_block_bytes();
}

// acc + dot(q, x) over an octet, as a chain of fused multiply-adds.
float dot8(vec4 q_lo, vec4 q_hi, vec4 x_lo, vec4 x_hi, float acc) {
    acc = fma(q_lo.x, x_lo.x, acc); acc = fma(q_lo.y, x_lo.y, acc);
    acc = fma(q_lo.z, x_lo.z, acc); acc = fma(q_lo.w, x_lo.w, acc);
    acc = fma(q_hi.x, x_hi.x, acc); acc = fma(q_hi.y, x_hi.y, acc);
    acc = fma(q_hi.z, x_hi.z, acc); acc = fma(q_hi.w, x_hi.w, acc);
    return acc;
}
float sum8(vec4 lo, vec4 hi) { return ((lo.x + lo.y) + (lo.z + lo.w)) + ((hi.x + hi.y) + (hi.z + hi.w)); }

// Unit u of the block at byte `block` of weight `which`, whose format quant_source names: in MODE_QKV a uniform choice
// around the unit's loads (a constant elsewhere), not one around each load.
QuantRaw quant_fetch_of(uint which, uint block, uint u, bool with_scales) {
    if (MODE != MODE_QKV) return quant_fetch_unit(block, u, with_scales);
    QuantRaw r;
    if (which == 0u) { quant_source = 0u; r = quant_fetch_unit(block, u, with_scales); }
    else if (which == 1u) { quant_source = 1u; r = quant_fetch_unit(block, u, with_scales); }
    else { quant_source = 2u; r = quant_fetch_unit(block, u, with_scales); }
    quant_source = which;
    return r;
}

// Columns 2i, 2i + 1 are pair first + i's (past the last pair: the last again, never stored): source[c] is the weight
// column c reads and row_at[c] the byte where its row starts. The lanes that share the columns (one subgroup, or with
// SPLIT_K the whole workgroup) take units of k in turn, all of them with the same number of steps, UNROLL units each
// step: every unit's packed words (of every column) are loaded before any is decoded, then each octet of x is read
// once (the lead format's: the first column's) for all columns and rows.
Pair prs[PAIRS_PER_SUBGROUP];
uint source[QUANT_COLS], row_at[QUANT_COLS];
// source[c] as a constant but in MODE_QKV (W0 for plain products, gate and up in turn for gated ones).
uint source_of(uint c) { return MODE == MODE_PLAIN ? 0u : (MODE == MODE_GATED ? c & 1u : source[c]); }
void quant_pairs_product(uint first, uint pairs) {
    [[unroll]] for (uint i = 0u; i < PAIRS_PER_SUBGROUP; ++i) {
        prs[i] = pair_of(min(first + i, pairs - 1u));
        uint second = second_of(prs[i]);
        source[2u * i] = prs[i].which;
        source[2u * i + 1u] = second;
        row_at[2u * i] = weight_byte_offset(prs[i].which) + prs[i].col0 * quant_row_bytes(prs[i].which);
        row_at[2u * i + 1u] = weight_byte_offset(second) + col1_of(prs[i]) * quant_row_bytes(second);
    }
    const uint units = k / 32u, lane = gl_SubgroupInvocationID;
    const uint lanes = SPLIT_K != 0 ? gl_NumSubgroups * gl_SubgroupSize : gl_SubgroupSize;
    const uint me = SPLIT_K != 0 ? gl_SubgroupID * gl_SubgroupSize + lane : lane;
    quant_source = source_of(0u);
    const uint lead = FORMAT;
    float acc[QUANT_COLS * ROWS], squares[ROWS];
    [[unroll]] for (uint i = 0u; i < QUANT_COLS * ROWS; ++i) acc[i] = 0.0;
    [[unroll]] for (uint r = 0u; r < ROWS; ++r) squares[r] = 0.0;
    const uint items = units / ADJACENT;
    for (uint base = 0u; base < items; base += lanes * UNROLL) {  // the same steps for every lane
        QuantRaw raw[UNROLL * ADJACENT * QUANT_COLS];
        [[unroll]] for (uint i = 0u; i < UNROLL; ++i) {
            if (base + i * lanes >= items) break;  // uniform
            // a lane past the end reads the last units again, and counts them 0 times
            const uint item = min(base + i * lanes + me, items - 1u);
            [[unroll]] for (uint v = 0u; v < ADJACENT; ++v) {
                const uint t = item * ADJACENT + v;
                [[unroll]] for (uint c = 0u; c < QUANT_COLS; ++c) {
                    quant_source = source_of(c);
                    const uint per_block = quant_block_size() / 32u;
                    raw[(i * ADJACENT + v) * QUANT_COLS + c] = quant_fetch_of(
                        source_of(c), row_at[c] + t / per_block * quant_block_bytes(), t % per_block,
                        v == 0u || per_block == 1u || !quant_pair_shares_scales());
                }
            }
        }
        vec4 scale[QUANT_COLS], offset[QUANT_COLS];  // unit 2m's, kept for unit 2m + 1 when they share them
        [[unroll]] for (uint n = 0u; n < UNROLL * ADJACENT; ++n) {
            const uint i = n / ADJACENT, v = n % ADJACENT;
            if (base + i * lanes >= items) break;
            const float valid = base + i * lanes + me < items ? 1.0 : 0.0;
            const uint t = min(base + i * lanes + me, items - 1u) * ADJACENT + v;
            uint block_at[QUANT_COLS], unit_of[QUANT_COLS];
            // per column, row and run of octets sharing a scale: the codes' dot products with x, and (for columns of
            // another format than the lead) the sums of their own x
            float part[QUANT_COLS * ROWS * 4u], own_sum[QUANT_COLS * ROWS * 4u], x_sum[ROWS * 4u], unit_sq[ROWS];
            [[unroll]] for (uint c = 0u; c < QUANT_COLS; ++c) {
                quant_source = source_of(c);
                const uint per_block = quant_block_size() / 32u;
                unit_of[c] = t % per_block;
                block_at[c] = row_at[c] + t / per_block * quant_block_bytes();
                if (v == 0u || per_block == 1u || !quant_pair_shares_scales())  // else unit 2m's serve
                    quant_raw_scales(raw[n * QUANT_COLS + c], block_at[c], unit_of[c], scale[c], offset[c]);
            }
            [[unroll]] for (uint j = 0u; j < QUANT_COLS * ROWS * 4u; ++j) { part[j] = 0.0; own_sum[j] = 0.0; }
            [[unroll]] for (uint j = 0u; j < ROWS * 4u; ++j) x_sum[j] = 0.0;
            [[unroll]] for (uint r = 0u; r < ROWS; ++r) unit_sq[r] = 0.0;
            [[unroll]] for (uint o = 0u; o < 4u; ++o) {
                quant_source = source_of(0u);
                const uint e = t / (quant_block_size() / 32u) * quant_block_size() + quant_octet_start(unit_of[0], o);
                const uint run = o * quant_runs() / 4u;
                vec4 g_lo, g_hi, x_lo[ROWS], x_hi[ROWS];
                if (HAS_NORM != 0 && NORM_WEIGHT != 0) g_octet(e, g_lo, g_hi);
                [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
                    x_octet(r, e, x_lo[r], x_hi[r]);
                    if (HAS_NORM != 0) {
                        unit_sq[r] = dot8(x_lo[r], x_hi[r], x_lo[r], x_hi[r], unit_sq[r]);
                        if (NORM_WEIGHT != 0) { x_lo[r] *= g_lo; x_hi[r] *= g_hi; }
                    }
                    x_sum[r * 4u + run] += sum8(x_lo[r], x_hi[r]);
                }
                [[unroll]] for (uint c = 0u; c < QUANT_COLS; ++c) {
                    quant_source = source_of(c);
                    vec4 q_lo, q_hi;
                    quant_raw_octet(raw[n * QUANT_COLS + c], block_at[c], unit_of[c], o, q_lo, q_hi);
                    const uint at = c * ROWS * 4u + o * quant_runs() / 4u;
                    if (FORMAT == lead) {  // uniform; a constant unless the weights' formats differ
                        [[unroll]] for (uint r = 0u; r < ROWS; ++r)
                            part[at + 4u * r] = dot8(q_lo, q_hi, x_lo[r], x_hi[r], part[at + 4u * r]);
                    } else {  // the x of this column's own octet
                        const uint ec = t / (quant_block_size() / 32u) * quant_block_size()
                                        + quant_octet_start(unit_of[c], o);
                        vec4 gc_lo, gc_hi;
                        if (HAS_NORM != 0 && NORM_WEIGHT != 0) g_octet(ec, gc_lo, gc_hi);
                        [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
                            vec4 c_lo, c_hi;
                            x_octet(r, ec, c_lo, c_hi);
                            if (HAS_NORM != 0 && NORM_WEIGHT != 0) { c_lo *= gc_lo; c_hi *= gc_hi; }
                            part[at + 4u * r] = dot8(q_lo, q_hi, c_lo, c_hi, part[at + 4u * r]);
                            own_sum[at + 4u * r] += sum8(c_lo, c_hi);
                        }
                    }
                }
            }
            [[unroll]] for (uint c = 0u; c < QUANT_COLS; ++c) {
                quant_source = source_of(c);
                const bool own = FORMAT != lead;
                const uint runs = quant_runs();
                [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
                    float sum = 0.0;
                    [[unroll]] for (uint q = 0u; q < 4u; ++q) {
                        if (q >= runs) break;
                        const uint at = (c * ROWS + r) * 4u + q, o = q * 4u / runs;
                        sum = fma(scale[c][o], part[at], sum);
                        sum = fma(offset[c][o], own ? own_sum[at] : x_sum[r * 4u + q], sum);
                    }
                    acc[c * ROWS + r] = fma(valid, sum, acc[c * ROWS + r]);
                }
            }
            [[unroll]] for (uint r = 0u; r < ROWS; ++r) squares[r] = fma(valid, unit_sq[r], squares[r]);
        }
    }
    const uint values = QUANT_COLS + 1u;  // per row: the columns' sums, then the squares
    float sums[QUANT_COLS * ROWS], sumsq[ROWS];
    [[unroll]] for (uint i = 0u; i < QUANT_COLS * ROWS; ++i) sums[i] = subgroupAdd(acc[i]);
    [[unroll]] for (uint r = 0u; r < ROWS; ++r) sumsq[r] = HAS_NORM != 0 ? subgroupAdd(squares[r]) : 0.0;
    if (SPLIT_K != 0) {  // one lane of each subgroup leaves its sums in shared memory; subgroup 0 adds them up
        if (subgroupElect()) [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
            const uint at = (gl_SubgroupID * ROWS + r) * values;
            [[unroll]] for (uint c = 0u; c < QUANT_COLS; ++c) split_sums[at + c] = sums[c * ROWS + r];
            split_sums[at + QUANT_COLS] = sumsq[r];
        }
        barrier();
        if (gl_SubgroupID != 0) return;
        [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
            [[unroll]] for (uint c = 0u; c < QUANT_COLS; ++c) sums[c * ROWS + r] = 0.0;
            sumsq[r] = 0.0;
            for (uint s = 0u; s < gl_NumSubgroups; ++s) {
                const uint at = (s * ROWS + r) * values;
                [[unroll]] for (uint c = 0u; c < QUANT_COLS; ++c) sums[c * ROWS + r] += split_sums[at + c];
                sumsq[r] += split_sums[at + QUANT_COLS];
            }
        }
    }
    [[unroll]] for (uint i = 0u; i < PAIRS_PER_SUBGROUP; ++i) {
        if (first + i >= pairs) break;  // uniform
        float s0[ROWS], s1[ROWS];
        [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
            s0[r] = sums[2u * i * ROWS + r];
            s1[r] = sums[(2u * i + 1u) * ROWS + r];
        }
        finish_pair(prs[i], second_of(prs[i]), col1_of(prs[i]), s0, s1, sumsq);
    }
}

#else

// Pair p for every row of x: one subgroup, or with SPLIT_K the whole workgroup.
void pair_product(uint p) {
    Pair pr = pair_of(p);
    uint second = second_of(pr), col1 = col1_of(pr);
    uint vectors = k / PER_VECTOR, lane = gl_SubgroupInvocationID, step = gl_SubgroupSize;
    uint begin = 0, end = vectors;
    if (SPLIT_K != 0) {
        uint slice = (vectors + gl_NumSubgroups - 1) / gl_NumSubgroups;
        begin = min(vectors, gl_SubgroupID * slice);
        end = min(vectors, begin + slice);
    }

    float acc0[ROWS], acc1[ROWS], squares[ROWS];
    [[unroll]] for (uint r = 0; r < ROWS; ++r) { acc0[r] = 0.0; acc1[r] = 0.0; squares[r] = 0.0; }
    for (uint base = begin + lane; base < end; base += step * UNROLL) {
        uvec4 a[UNROLL], b[UNROLL];
        [[unroll]] for (uint u = 0; u < UNROLL; ++u) {  // every load issued before any is used
            uint v = min(base + u * step, end - 1);
            a[u] = weight_word(pr.which, pr.col0 * vectors + v);
            b[u] = weight_word(second, col1 * vectors + v);
        }
        [[unroll]] for (uint u = 0; u < UNROLL; ++u) {
            uint v = base + u * step;
            if (v >= end) break;
            Vector wa = decode(a[u]), wb = decode(b[u]);
            Vector g;
            if (HAS_NORM != 0 && NORM_WEIGHT != 0) {
                g = decode(g_words[g_offset + v]);
                if (NORM_OFFSET != 0) [[unroll]] for (uint j = 0; j < VECS; ++j) g.v[j] += 1.0;
            }
            [[unroll]] for (uint r = 0; r < ROWS; ++r) {
                Vector xv = decode(x_words[x_offset + r * vectors + v]);
                if (HAS_NORM != 0) {
                    squares[r] += vector_dot(xv, xv);
                    if (NORM_WEIGHT != 0) [[unroll]] for (uint j = 0; j < VECS; ++j) xv.v[j] *= g.v[j];
                }
                acc0[r] += vector_dot(xv, wa);
                acc1[r] += vector_dot(xv, wb);
            }
        }
    }
    float sums0[ROWS], sums1[ROWS], sumsq[ROWS];
    [[unroll]] for (uint r = 0; r < ROWS; ++r) {  // in uniform control flow: every lane takes part
        sums0[r] = subgroupAdd(acc0[r]);
        sums1[r] = subgroupAdd(acc1[r]);
        sumsq[r] = HAS_NORM != 0 ? subgroupAdd(squares[r]) : 0.0;
    }
    if (SPLIT_K != 0) {  // subgroup 0 adds up every subgroup's slice
        if (subgroupElect()) [[unroll]] for (uint r = 0; r < ROWS; ++r) {
            uint at = (gl_SubgroupID * ROWS + r) * 3;
            split_sums[at] = sums0[r]; split_sums[at + 1] = sums1[r]; split_sums[at + 2] = sumsq[r];
        }
        barrier();
        [[unroll]] for (uint r = 0; r < ROWS; ++r) {
            sums0[r] = 0.0; sums1[r] = 0.0; sumsq[r] = 0.0;
            for (uint s = 0; s < gl_NumSubgroups; ++s) {
                uint at = (s * ROWS + r) * 3;
                sums0[r] += split_sums[at]; sums1[r] += split_sums[at + 1]; sumsq[r] += split_sums[at + 2];
            }
        }
        barrier();  // read before the next pair overwrites them
        if (gl_SubgroupID != 0) return;
    }
    finish_pair(pr, second, col1, sums0, sums1, sumsq);
}
#endif

void main() {
    uint pairs = MODE == MODE_PLAIN ? (n0 + 1) / 2 : (MODE == MODE_GATED ? n0 : (n0 + n1 + n2) / 2);
    uint first = (SPLIT_K != 0 ? gl_WorkGroupID.x : gl_WorkGroupID.x * gl_NumSubgroups + gl_SubgroupID)
               * PAIRS_PER_SUBGROUP;
#if defined(QUANT_W)
    if (first >= pairs) return;  // uniform: a whole subgroup (SPLIT_K: workgroup) leaves together
    quant_pairs_product(first, pairs);
#else
    for (uint i = 0; i < PAIRS_PER_SUBGROUP; ++i) {
        if (first + i >= pairs) return;  // uniform: a whole subgroup (SPLIT_K: workgroup) leaves together
        pair_product(first + i);
    }
#endif
}
