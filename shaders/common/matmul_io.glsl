// Interface shared by the matmul kernels: bindings, push constants and the
// epilogue (alpha, bias, beta, conversion to C's storage type).
// Defines: IN_F32 | IN_F16 | IN_BF16 (storage of A and B), OUT_F32 | OUT_F16 | OUT_BF16
// (storage of C and bias). MATMUL_INPUTS_AS_WORDS: A and B are declared as uvec4
// arrays of raw bits (the cooperative-matrix kernel stages 8 halves at a time).
#ifndef VKFORMERS_MATMUL_IO_GLSL
#define VKFORMERS_MATMUL_IO_GLSL

#if defined(MATMUL_INPUTS_AS_WORDS)
#define IN_T uvec4
#elif defined(IN_F32)
#define IN_T float
#define LOAD_IN(v) (v)
#elif defined(IN_F16)
#define IN_T float16_t
#define LOAD_IN(v) float(v)
#else
#define IN_T uint16_t
#define LOAD_IN(v) bf16_to_f32(v)
#endif

// The output side never declares a float16_t value when OUT_F16_AS_BITS is set
// (packHalf2x16 instead), so the bfloat16 rewrite of the cooperative-matrix
// kernel (tools/spirv_bf16.py) finds 16-bit floats only in its matrix types.
#if defined(OUT_F32)
#define OUT_T float
#define TO_OUT(v) (v)
#define FROM_OUT(v) (v)
#elif defined(OUT_F16) && defined(OUT_F16_AS_BITS)
#define OUT_T uint16_t
#define TO_OUT(v) uint16_t(packHalf2x16(vec2(v, 0.0)) & 0xFFFFu)
#define FROM_OUT(v) unpackHalf2x16(uint(v)).x
#elif defined(OUT_F16)
#define OUT_T float16_t
#define TO_OUT(v) float16_t(v)
#define FROM_OUT(v) float(v)
#else
#define OUT_T uint16_t
#define TO_OUT(v) f32_to_bf16(v)
#define FROM_OUT(v) bf16_to_f32(v)
#endif

layout(binding = 0) readonly buffer MatA { IN_T a_data[]; };
layout(binding = 1) readonly buffer MatB { IN_T b_data[]; };
layout(binding = 2) buffer MatC { OUT_T c_data[]; };
layout(binding = 3) readonly buffer Bias { OUT_T bias_data[]; };  // bound to C when there is no bias

// Gated products (engine/kernels/matmul.py ``gate``): each kernel's GATE_MODE specialization constant
// reads gate[b] = gate_data[gate_off + b] as a count g for product b. GATE_ROWS: rows of A and C at or past g
// are padding, whose results nobody uses, so a block of rows that starts there is not multiplied (it stores
// the epilogue of a zero product). GATE_DEPTH: the K entries at or past g are left out (not read: the tile
// kernels stop their K loop there and load zeros past it). The gate is bound to C when unused.
// Span gates read a pair (start s, count g) = gate_data[gate_off + 2b], [gate_off + 2b + 1] for product b: the
// product is on g rows (or K entries) from row s of matrices packed for many products (a mixture of experts'
// token rows, each expert's rows one span). GATE_SPAN_ROWS: C rows s.. s+g-1 = A rows s.. s+g-1 (A not
// transposed) @ B; no other row of C is written. GATE_SPAN_DEPTH: K entries s.. s+g-1 only, A transposed
// ([K, M] storage) and B not ([K, N]): the weight gradient of a span-rows product. Not in the small-m kernel,
// nor split over K (the launcher sees to both).
#define GATE_NONE 0
#define GATE_ROWS 1
#define GATE_DEPTH 2
#define GATE_SPAN_ROWS 3
#define GATE_SPAN_DEPTH 4
layout(binding = 4) readonly buffer Gate { float gate_data[]; };

// Offsets and batch strides are in elements.
layout(push_constant) uniform Push {
    uint m, n, k;
    uint off_a, off_b, off_c, off_bias;
    uint stride_a, stride_b, stride_c;
    float alpha, beta;
    uint gate_off;
};

// The (column, row) of the tile of C this workgroup computes; x and y of the grid only enumerate the tiles.
// group_rows > 1: the tiles are visited in bands of group_rows tile rows, column by column within a band, so
// that the workgroups in flight together read a few rows of A and a few columns of B (cache reuse), instead of
// one row of A's tiles against all of B.
uvec2 tile_of_workgroup(uint group_rows) {
    if (group_rows <= 1) return gl_WorkGroupID.xy;
    const uint cols = gl_NumWorkGroups.x, rows = gl_NumWorkGroups.y;
    const uint id = gl_WorkGroupID.y * cols + gl_WorkGroupID.x;
    const uint band = id / (group_rows * cols), first = band * group_rows;
    const uint height = min(group_rows, rows - first), in_band = id - first * cols;
    return uvec2(in_band / height, first + in_band % height);
}

// Product b's gate as a count (uniform over a workgroup).
uint gate_count(uint b) { return uint(max(gate_data[gate_off + b], 0.0)); }
// Product b's span gate: its first row (or K entry) and its count, the count cut to what fits in `size`.
uint span_start(uint b) { return uint(max(gate_data[gate_off + 2 * b], 0.0)); }
uint span_count(uint b, uint size) { return min(uint(max(gate_data[gate_off + 2 * b + 1], 0.0)), size - min(span_start(b), size)); }

#if !defined(MATMUL_INPUTS_AS_WORDS)
float load_a(uint i) { return LOAD_IN(a_data[i]); }
float load_b(uint i) { return LOAD_IN(b_data[i]); }
#endif

// C[index] = alpha * acc + bias[col] + beta * C[index]; C is not read when beta == 0,
// so it may hold garbage (NaN) then.
void store_c(uint index, uint col, float acc) {
    float v = alpha * acc;
    if (HAS_BIAS != 0) v += FROM_OUT(bias_data[off_bias + col]);
    if (beta != 0.0) v += beta * FROM_OUT(c_data[index]);
    c_data[index] = TO_OUT(v);
}

#endif
