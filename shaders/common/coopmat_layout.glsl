// The measured layout of a 16 x 16 float32 accumulator (engine/kernels/coopmat_layout.py), for kernels that work
// on their accumulators' elements row by row without shared memory. Declare before including:
//   SUBGROUP_SIZE; ROW_SLOTS (rows each lane holds), ROW_LANE_MASK (lanes lane ^ m, m made of these bits,
//   share them), SLOT_WORD0..3 (the slot of element i: 4 bits at 4 * (i % 8) of word i / 8; the same in every
//   lane, so that after unrolling a slot is a constant and per-row values stay in registers).
#ifndef VKFORMERS_COOPMAT_LAYOUT_GLSL
#define VKFORMERS_COOPMAT_LAYOUT_GLSL

const uint ACC_ELEMS = 256 / SUBGROUP_SIZE;  // elements of a 16 x 16 accumulator per lane
const uint COL_WORDS = (ACC_ELEMS + 7) / 8;  // a lane's element columns, 4 bits each

uint slot_of(uint i) {
    const uint word = i < 8u ? SLOT_WORD0 : i < 16u ? SLOT_WORD1 : i < 24u ? SLOT_WORD2 : SLOT_WORD3;
    return (word >> (4u * (i % 8u))) & 15u;
}

// Reductions over the lanes that share a row (each holds a part of it).
float row_lanes_max(float x) {
    [[unroll]] for (uint b = 1; b < SUBGROUP_SIZE; b *= 2)
        if ((ROW_LANE_MASK & b) != 0u) x = max(x, subgroupShuffleXor(x, b));
    return x;
}
float row_lanes_sum(float x) {
    [[unroll]] for (uint b = 1; b < SUBGROUP_SIZE; b *= 2)
        if ((ROW_LANE_MASK & b) != 0u) x += subgroupShuffleXor(x, b);
    return x;
}
// Whether this lane writes its rows' values (one lane of those sharing them).
bool row_lanes_leader() { return (gl_SubgroupInvocationID & ROW_LANE_MASK) == 0u; }

// The row (of 16) of each of this lane's slots and the column of each of its elements, from an accumulator loaded
// from the matrix whose element (r, c) is r * 16 + c.
#define COOPMAT_LAYOUT_DECODE(index_matrix, slot_row, col_word)                                   \
    [[unroll]] for (uint w = 0; w < COL_WORDS; ++w) col_word[w] = 0u;                             \
    [[unroll]] for (uint i = 0; i < ACC_ELEMS; ++i) {                                             \
        const uint rc = uint(index_matrix[i]);                                                    \
        slot_row[slot_of(i)] = rc / 16u;                                                          \
        col_word[i / 8u] |= (rc % 16u) << (4u * (i % 8u));                                       \
    }
#define COOPMAT_COL(col_word, i) ((col_word[(i) / 8u] >> (4u * ((i) % 8u))) & 15u)

#endif
