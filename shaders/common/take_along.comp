// Picks along the last axis with one index table shared by every leading slice, and its gradient.
//   forward:  out[p, r, j] = x[p, r, index[r, j]]              (x [P, R, C], index int32 [R, J], out [P, R, J])
//   backward: d_x[p, r, c] = sum over j with index[r, j] == c of d_out[p, r, j]
// An index outside [0, C) reads a zero (forward) and passes no gradient. The backward is two kernels: ZERO zeroes
// d_x, one invocation per element; then each invocation of the backward adds one row's (p, r) picks j in
// [pick_begin, pick_end) in j order, so several picks of one element (clamped relative positions) sum in a fixed
// order, bit-reproducible and without float atomics. The launcher runs the picks in dispatches of at most
// LOOP_ITERATIONS (llvmpipe ends an invocation's loops after 65535 iterations).
//! variant f32 -DFORWARD -DELEM_F32
//! variant f16 -DFORWARD -DELEM_F16
//! variant bf16 -DFORWARD -DELEM_BF16
//! variant backward_f32 -DELEM_F32
//! variant backward_f16 -DELEM_F16
//! variant backward_bf16 -DELEM_BF16
//! variant zero_f32 -DZERO -DELEM_F32
//! variant zero_f16 -DZERO -DELEM_F16
//! variant zero_bf16 -DZERO -DELEM_BF16
#version 450
#extension GL_GOOGLE_include_directive : require
#include "transformer_common.glsl"
layout(local_size_x = 256) in;

// planes: P; rows: R; cols: C (x's last axis); picks: J (out's last axis); *_offset: element offsets;
// [pick_begin, pick_end): the picks this dispatch adds (backward only).
layout(push_constant) uniform Push {
    uint planes; uint rows; uint cols; uint picks; uint index_offset; uint src_offset; uint dst_offset;
    uint pick_begin; uint pick_end;
};
layout(binding = 0) readonly buffer Index { int index[]; };
layout(binding = 1) readonly buffer Src { ELEM_T src[]; };    // forward: x; backward: d_out
#if defined(FORWARD) || defined(ZERO)
layout(binding = 2) writeonly buffer Dst { ELEM_T dst[]; };   // out; ZERO: d_x
#else
layout(binding = 2) buffer Dst { ELEM_T dst[]; };             // d_x (accumulated)
#endif

void main() {
    uint i = global_index();
#ifdef FORWARD
    if (i >= planes * rows * picks) return;
    uint j = i % picks;
    uint pr = i / picks;  // p * rows + r
    uint r = pr % rows;
    int c = index[index_offset + r * picks + j];
    bool valid = c >= 0 && uint(c) < cols;
    dst[dst_offset + i] = valid ? src[src_offset + pr * cols + uint(c)] : store_elem(0.0);
#elif defined(ZERO)
    if (i < planes * rows * cols) dst[dst_offset + i] = store_elem(0.0);
#else
    uint pr = i;  // p * rows + r
    if (pr >= planes * rows) return;
    uint r = pr % rows;
    uint row = dst_offset + pr * cols;
    for (uint j = pick_begin; j < pick_end; ++j) {
        int c = index[index_offset + r * picks + j];
        if (c >= 0 && uint(c) < cols)
            dst[row + uint(c)] = store_elem(load_elem(dst[row + uint(c)]) + load_elem(src[src_offset + pr * picks + j]));
    }
#endif
}
