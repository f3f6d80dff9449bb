// Token embedding lookup and its gradient.
//   forward:  out[n, :] = table[ids[n], :]          (table, out: ELEM_T; ids: int32)
//   backward: d_table[ids[n], :] += d_out[n, :]      (d_out: ELEM_T; d_table: float32)
//             except where ids[n] == padding_idx (nn.Embedding's padding_idx; -1: none): that row gets nothing
// An id outside [0, vocab) never reads or writes out of bounds: forward writes a zero
// row, backward skips it. The backward gives each invocation one column and walks the
// tokens in order, so rows that share an id are summed in token order: bit-reproducible
// (exact resume depends on it) and without float atomics, which not every GPU has. The launcher
// splits the tokens into dispatches run in order (llvmpipe's loop bound, LOOP_ITERATIONS).
//! variant f32 -DFORWARD -DELEM_F32
//! variant f16 -DFORWARD -DELEM_F16
//! variant bf16 -DFORWARD -DELEM_BF16
//! variant backward_f32 -DBACKWARD -DELEM_F32
//! variant backward_f16 -DBACKWARD -DELEM_F16
//! variant backward_bf16 -DBACKWARD -DELEM_BF16
//! variant quant_f32 -DFORWARD -DQUANT -DELEM_F32
//! variant quant_f16 -DFORWARD -DQUANT -DELEM_F16
//! variant quant_bf16 -DFORWARD -DQUANT -DELEM_BF16
// QUANT: the table is packed blocks of format FORMAT (quant_block.glsl; table_offset in bytes, rows of
// row_bytes): each invocation writes four elements of a row, dequantized as matmul_quant.comp does.
#version 450
#extension GL_GOOGLE_include_directive : require
#include "transformer_common.glsl"
layout(local_size_x = 256) in;

// count: tokens; dim: embedding width; *_offset: element offsets of the operands; padding_idx: the id whose
// lookups pass no gradient (backward only; -1: none).
layout(push_constant) uniform Push {
    uint count; uint dim; uint vocab; uint ids_offset; uint table_offset; uint out_offset; int padding_idx;
};
layout(binding = 0) readonly buffer Ids { int ids[]; };

#ifdef QUANT
layout(constant_id = 0) const uint FORMAT = 0;
layout(constant_id = 1) const uint ROW_BYTES = 0;
layout(binding = 1) readonly buffer Packed { uint packed_words[]; };
layout(binding = 2) writeonly buffer Out { ELEM_T out_rows[]; };
#include "quant_block.glsl"
#elif defined(FORWARD)
layout(binding = 1) readonly buffer Table { ELEM_T table[]; };
layout(binding = 2) writeonly buffer Out { ELEM_T out_rows[]; };
#else
layout(binding = 1) buffer DTable { float d_table[]; };
layout(binding = 2) readonly buffer DOut { ELEM_T d_out[]; };
#endif

void main() {
#ifdef QUANT
    uint i = 4u * global_index();  // dim is a whole number of blocks
    if (i >= count * dim) return;
    uint n = i / dim;
    uint col = i - n * dim;
    int id = ids[ids_offset + n];
    bool valid = id >= 0 && uint(id) < vocab;
    vec4 v = valid ? quant_row4(table_offset, ROW_BYTES, uint(id), col) : vec4(0.0);
    for (uint e = 0u; e < 4u; ++e) out_rows[out_offset + i + e] = store_elem(v[e]);
#elif defined(FORWARD)
    uint i = global_index();  // one invocation per output element
    if (i >= count * dim) return;
    uint n = i / dim;
    uint col = i - n * dim;
    int id = ids[ids_offset + n];
    bool valid = id >= 0 && uint(id) < vocab;
    out_rows[out_offset + i] = valid ? table[table_offset + uint(id) * dim + col] : store_elem(0.0);
#else
    uint col = global_index();  // one invocation per column, tokens in order
    if (col >= dim) return;
    for (uint n = 0; n < count; ++n) {
        int id = ids[ids_offset + n];
        if (id >= 0 && uint(id) < vocab && id != padding_idx)
            d_table[table_offset + uint(id) * dim + col] += load_elem(d_out[out_offset + n * dim + col]);
    }
#endif
}
