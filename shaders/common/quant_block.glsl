// Dequantization of GGUF block formats (and QLoRA's NF4) read straight from the packed bytes.
//
// The including kernel declares, before this file:
//   layout(constant_id = N) const uint FORMAT = ...;          // one of the QUANT_* ids below
//   layout(binding = B) readonly buffer Packed { uint packed_words[]; };
// or defines QUANT_WORD(i), word i of the packed bytes, its own way (a choice among several buffers).
// Packed weights are the file's bytes unchanged (a row of W is its blocks one after another), read as 32-bit
// words: blocks of 18, 34 or 210 bytes do not start on a word, so every field is picked out by byte address.
// Layouts follow the GGUF spec (ggml-common.h); engine/quantized.py holds the same table for the host.
#ifndef VKFORMERS_QUANT_BLOCK_GLSL
#define VKFORMERS_QUANT_BLOCK_GLSL

#ifndef QUANT_WORD
#define QUANT_WORD(i) packed_words[i]
#endif
#ifndef QUANT_VEC
#define QUANT_VEC(i) packed_vec[i]
#endif

#define QUANT_Q4_0 0u  // 32 per block, 18 bytes: f16 d, 16 bytes of nibbles (low: 0..15, high: 16..31)
#define QUANT_Q4_1 1u  // 32 per block, 20 bytes: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m
#define QUANT_Q8_0 2u  // 32 per block, 34 bytes: f16 d, 32 int8
#define QUANT_Q4_K 3u  // 256 per block, 144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
#define QUANT_Q5_K 4u  // 256 per block, 176 bytes: as Q4_K plus 32 bytes of fifth bits (qh) before the nibbles
#define QUANT_Q6_K 5u  // 256 per block, 210 bytes: 128 low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d
#define QUANT_NF4 6u   // 64 per block, 36 bytes: f32 absmax, 32 bytes (element 2i in the high nibble of byte i)

uint quant_block_size() {
    return FORMAT >= QUANT_Q4_K && FORMAT <= QUANT_Q6_K ? 256u : (FORMAT == QUANT_NF4 ? 64u : 32u);
}

uint quant_block_bytes() {
    switch (FORMAT) {
        case QUANT_Q4_0: return 18u;
        case QUANT_Q4_1: return 20u;
        case QUANT_Q8_0: return 34u;
        case QUANT_Q4_K: return 144u;
        case QUANT_Q5_K: return 176u;
        case QUANT_Q6_K: return 210u;
        default: return 36u;
    }
}

uint q_byte(uint at) { return (QUANT_WORD(at >> 2) >> ((at & 3u) * 8u)) & 0xFFu; }
int q_int8(uint at) { return int(q_byte(at) << 24) >> 24; }
float q_half(uint at) {  // at is even: a half never straddles two words
    uint word = QUANT_WORD(at >> 2);
    return unpackHalf2x16((at & 2u) != 0u ? word >> 16 : word).x;
}
float q_float(uint at) { return uintBitsToFloat(QUANT_WORD(at >> 2)); }  // at is a multiple of 4

const float NF4_LEVELS[16] = float[16](
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0);

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 bytes at `at` (ggml's get_scale_min_k4).
uvec2 k_scale_min(uint at, uint j) {
    if (j < 4u) return uvec2(q_byte(at + j) & 63u, q_byte(at + j + 4u) & 63u);
    uint hi = q_byte(at + j + 4u);
    return uvec2((hi & 15u) | ((q_byte(at + j - 4u) >> 6) << 4), (hi >> 4) | ((q_byte(at + j) >> 6) << 4));
}

// The same from the block's first 16 bytes (d, dmin and the 12 bytes) already read, times d and dmin: both
// layouts computed and one selected, so that lanes on different sub-blocks do not diverge.
vec2 k_scale_min_of(uvec4 head, uint sub) {
    uint shift = 8u * (sub & 3u);
    uint s_low = (head.y >> shift) & 0xFFu, m_low = (head.z >> shift) & 0xFFu, hi = (head.w >> shift) & 0xFFu;
    bool upper = sub >= 4u;
    uint sc = upper ? (hi & 15u) | ((s_low >> 6) << 4) : s_low & 63u;
    uint mn = upper ? (hi >> 4) | ((m_low >> 6) << 4) : m_low & 63u;
    vec2 dm = unpackHalf2x16(head.x);
    return dm * (uintBitsToFloat(uvec2(sc, mn) | 0x4B000000u) - 8388608.0);  // as q_bytes
}

// The scales (.xy) and mins (.zw) of sub-blocks 2j and 2j + 1 together, times d and dmin, from the block's first 16
// bytes: both 6-bit fields of a pair sit in neighbouring bytes, so one pass over 16-bit halves decodes the two.
vec4 k_scale_min_pair(uvec4 head, uint j) {
    uint shift = 16u * (j & 1u);
    uint y = head.y >> shift, z = head.z >> shift, w = head.w >> shift;
    bool upper = j >= 2u;
    uint sc = upper ? (w & 0x0F0Fu) | ((y >> 2) & 0x3030u) : y & 0x3F3Fu;
    uint mn = upper ? ((w >> 4) & 0x0F0Fu) | ((z >> 2) & 0x3030u) : z & 0x3F3Fu;
    vec4 q = uintBitsToFloat(uvec4(sc & 0xFFu, (sc >> 8) & 0xFFu, mn & 0xFFu, (mn >> 8) & 0xFFu) | 0x4B000000u)
             - 8388608.0;  // as q_bytes
    vec2 dm = unpackHalf2x16(head.x);
    return q * dm.xxyy;
}

// Four bytes from byte `at` on, the first in the low 8 bits (at is even: at most two words; the second is read only
// when the bytes reach into it, so a read never passes the buffer's end).
uint q_word4(uint at) {
    uint shift = (at & 3u) * 8u, first = QUANT_WORD(at >> 2);
    return shift == 0u ? first : (first >> shift) | (QUANT_WORD((at >> 2) + 1u) << (32u - shift));
}
// The four bytes of v as floats without an integer-to-float conversion, a low-rate instruction on many GPUs that
// would bound every dequantizing loop: the float with bits 0x4B000000 | b is 2^23 + b, so less 2^23 it is b exactly.
vec4 q_bytes(uint v) {
    return uintBitsToFloat((uvec4(v, v >> 8, v >> 16, v >> 24) & 0xFFu) | 0x4B000000u) - 8388608.0;
}
vec4 q_int8s(uint v) {  // signed bytes: b ^ 0x80 is b + 128 as an unsigned byte
    uint u = v ^ 0x80808080u;
    return uintBitsToFloat((uvec4(u, u >> 8, u >> 16, u >> 24) & 0xFFu) | 0x4B000000u) - 8388736.0;
}

// Elements j .. j+3 (j a multiple of 4) of the block starting at byte `block`. Four consecutive elements
// always share one scale and sit in consecutive bytes, so each field is read once per four.
vec4 dequant4(uint block, uint j) {
    if (FORMAT == QUANT_Q4_0 || FORMAT == QUANT_Q4_1) {
        uint at = block + (FORMAT == QUANT_Q4_0 ? 2u : 4u) + (j & 15u);
        vec4 q = q_bytes((q_word4(at) >> (j < 16u ? 0u : 4u)) & 0x0F0F0F0Fu);
        float d = q_half(block);
        if (FORMAT == QUANT_Q4_0) return d * (q - 8.0);
        return d * q + q_half(block + 2u);
    }
    if (FORMAT == QUANT_Q8_0) return q_half(block) * q_int8s(q_word4(block + 2u + j));
    if (FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K) {
        uint sub = j / 32u, l = j % 32u;
        uint nibbles = block + (FORMAT == QUANT_Q4_K ? 16u : 48u) + 32u * (sub / 2u) + l;
        uint v = (q_word4(nibbles) >> ((sub & 1u) * 4u)) & 0x0F0F0F0Fu;
        if (FORMAT == QUANT_Q5_K) v |= ((q_word4(block + 16u + l) >> sub) & 0x01010101u) << 4;
        uvec2 sm = k_scale_min(block + 4u, sub);
        return (q_half(block) * float(sm.x)) * q_bytes(v) - q_half(block + 2u) * float(sm.y);
    }
    if (FORMAT == QUANT_Q6_K) {
        uint half_ = j / 128u, quarter = (j % 128u) / 32u, l = j % 32u;
        uint low = (q_word4(block + 64u * half_ + 32u * (quarter & 1u) + l) >> (quarter < 2u ? 0u : 4u)) & 0x0F0F0F0Fu;
        uint high = (q_word4(block + 128u + 32u * half_ + l) >> (2u * quarter)) & 0x03030303u;
        float scale = float(q_int8(block + 192u + 8u * half_ + l / 16u + 2u * quarter));
        return (q_half(block + 208u) * scale) * (q_bytes(low | (high << 4)) - 32.0);
    }
    // NF4
    uint packed_ = block + 4u + j / 2u;
    uint b0 = q_byte(packed_), b1 = q_byte(packed_ + 1u);
    return vec4(NF4_LEVELS[b0 >> 4], NF4_LEVELS[b0 & 15u], NF4_LEVELS[b1 >> 4], NF4_LEVELS[b1 & 15u]) * q_float(block);
}

// W[row, col .. col+3] of a packed matrix whose rows are `row_bytes` long from byte `base` (col a multiple of 4).
vec4 quant_row4(uint base, uint row_bytes, uint row, uint col) {
    uint size = quant_block_size();
    return dequant4(base + row * row_bytes + (col / size) * quant_block_bytes(), col % size);
}

// ---- Units: the matvec's work item, 32 weights of one block read with few wide loads and each scale once.
// A block of B elements holds B / 32 units; unit u's weights are four octets (8 consecutive elements each),
// octet o starting at element quant_octet_start(u, o) of the block.

// The funnel of two words from byte `shift` (0 or 16) of `lo` on, without a shift by 32.
uint q_funnel(uint lo, uint hi, uint shift) { return (lo >> shift) | ((hi << (31u - shift)) << 1u); }
// Whether every block (and every row) starts on a word: 20, 36, 144 and 176 bytes, rows of whole blocks.
bool q_word_aligned() {
    return FORMAT == QUANT_Q4_1 || FORMAT == QUANT_NF4 || FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K;
}
// 16 bytes from byte `at` (even) on, byte 0 lowest in .x; the fifth word is read only when the bytes reach it.
uvec4 q_16bytes(uint at) {
    uint i = at >> 2, s = q_word_aligned() ? 0u : (at & 3u) * 8u;
    uint w0 = QUANT_WORD(i), w1 = QUANT_WORD(i + 1u), w2 = QUANT_WORD(i + 2u), w3 = QUANT_WORD(i + 3u);
    uint w4 = s != 0u ? QUANT_WORD(i + 4u) : 0u;
    return uvec4(q_funnel(w0, w1, s), q_funnel(w1, w2, s), q_funnel(w2, w3, s), q_funnel(w3, w4, s));
}
// 16 bytes at `at`, which is a multiple of 16 when the packed buffer's offset is (W_VEC): one 16-byte load
// where the including kernel declares the buffer as uvec4s too (QUANT_PACKED_VECTORS: W_VEC, and packed_vec or
// QUANT_VEC(i), the 16 bytes i).
uvec4 q_16bytes_aligned(uint at) {
#if defined(QUANT_PACKED_VECTORS)
    if (W_VEC == 1u) return QUANT_VEC(at >> 4);
#endif
    return q_16bytes(at);
}
uvec2 q_8bytes(uint at) {  // at even
    uint i = at >> 2, s = q_word_aligned() ? 0u : (at & 3u) * 8u;
    uint w0 = QUANT_WORD(i), w1 = QUANT_WORD(i + 1u);
    uint w2 = s != 0u ? QUANT_WORD(i + 2u) : 0u;
    return uvec2(q_funnel(w0, w1, s), q_funnel(w1, w2, s));
}
vec4 nf4_levels(uint v) {  // v: four bytes, each two codes (the high nibble first)
    return vec4(NF4_LEVELS[(v >> 4) & 15u], NF4_LEVELS[v & 15u], NF4_LEVELS[(v >> 12) & 15u], NF4_LEVELS[(v >> 8) & 15u]);
}

uint quant_octet_start(uint u, uint o) {
    if (FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K)  // low nibbles: sub-block 2j, high: 2j + 1
        return 64u * (u >> 1) + 16u * (u & 1u) + 8u * (o & 1u) + 32u * (o >> 1);
    if (FORMAT == QUANT_Q6_K) return 128u * (u >> 2) + 32u * o + 8u * (u & 3u);  // octet o: quarter o
    return 32u * u + 8u * o;
}

// The 32 weights of unit u of the block at byte `block`, as codes and a scale and offset per octet: octet o's
// weights are scale[o] * q[2o] + offset[o] and scale[o] * q[2o + 1] + offset[o]. A product takes
// scale * dot(q, x) + offset * sum(x) per octet, so the scales cost nothing per weight and sum(x) serves every
// column of W.
void quant_unit(uint block, uint u, out vec4 q[8], out vec4 scale, out vec4 offset) {
    if (FORMAT == QUANT_Q4_0 || FORMAT == QUANT_Q4_1) {
        uvec4 v = q_16bytes(block + (FORMAT == QUANT_Q4_0 ? 2u : 4u));
        float d = q_half(block);
        scale = vec4(d);
        offset = vec4(FORMAT == QUANT_Q4_0 ? -8.0 * d : q_half(block + 2u));
        for (uint o = 0u; o < 4u; ++o) {
            uint shift = 4u * (o >> 1);
            q[2u * o] = q_bytes((v[2u * (o & 1u)] >> shift) & 0x0F0F0F0Fu);
            q[2u * o + 1u] = q_bytes((v[2u * (o & 1u) + 1u] >> shift) & 0x0F0F0F0Fu);
        }
    } else if (FORMAT == QUANT_Q8_0) {
        uvec4 lo = q_16bytes(block + 2u), hi = q_16bytes(block + 18u);
        scale = vec4(q_half(block));
        offset = vec4(0.0);
        q[0] = q_int8s(lo.x); q[1] = q_int8s(lo.y); q[2] = q_int8s(lo.z); q[3] = q_int8s(lo.w);
        q[4] = q_int8s(hi.x); q[5] = q_int8s(hi.y); q[6] = q_int8s(hi.z); q[7] = q_int8s(hi.w);
    } else if (FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K) {
        uint j = u >> 1, h = u & 1u;
        // Blocks of 144 and 176 bytes: every field below starts on 16 bytes when the block does.
        uvec4 v = q_16bytes_aligned(block + (FORMAT == QUANT_Q4_K ? 16u : 48u) + 32u * j + 16u * h);
        uvec4 vh = FORMAT == QUANT_Q5_K ? q_16bytes_aligned(block + 16u + 16u * h) : uvec4(0u);
        // d and dmin, then the scales and mins of sub-blocks 2j and 2j + 1 (k_scale_min_pair)
        vec4 sm = k_scale_min_pair(q_16bytes_aligned(block), j);
        scale = sm.xxyy;
        offset = -sm.zzww;
        for (uint o = 0u; o < 4u; ++o) {
            uint e = o >> 1, shift = 4u * e;
            uvec2 c = (uvec2(v[2u * (o & 1u)], v[2u * (o & 1u) + 1u]) >> shift) & 0x0F0F0F0Fu;
            if (FORMAT == QUANT_Q5_K)
                c |= ((uvec2(vh[2u * (o & 1u)], vh[2u * (o & 1u) + 1u]) >> (2u * j + e)) & 0x01010101u) << 4;
            q[2u * o] = q_bytes(c.x);
            q[2u * o + 1u] = q_bytes(c.y);
        }
    } else if (FORMAT == QUANT_Q6_K) {
        uint h = u >> 2, l = 8u * (u & 3u);
        uvec2 ql_a = q_8bytes(block + 64u * h + l), ql_b = q_8bytes(block + 64u * h + 32u + l);
        uvec2 qh = q_8bytes(block + 128u + 32u * h + l);
        uvec2 scales = q_8bytes(block + 192u + 8u * h);
        // octet o's scale is byte (u & 3) / 2 + 2o of the 8: bytes 0 and 2 of each word shifted by that, gathered into
        // one word and turned into floats at once (q_int8s: no integer-to-float conversions)
        uvec2 sw = scales >> (8u * ((u & 3u) / 2u));
        scale = q_half(block + 208u) * q_int8s((sw.x & 0xFFu) | ((sw.x >> 8) & 0xFF00u) | ((sw.y & 0xFFu) << 16)
                                                | ((sw.y << 8) & 0xFF000000u));
        offset = -32.0 * scale;
        for (uint o = 0u; o < 4u; ++o) {
            uvec2 low = (((o & 1u) == 0u ? ql_a : ql_b) >> (o < 2u ? 0u : 4u)) & 0x0F0F0F0Fu;
            uvec2 c = low | (((qh >> (2u * o)) & 0x03030303u) << 4);
            q[2u * o] = q_bytes(c.x);
            q[2u * o + 1u] = q_bytes(c.y);
        }
    } else {  // NF4: 16 bytes of unit u, element 2i in the high nibble of byte i; the codes are the levels
        uvec4 v = q_16bytes(block + 4u + 16u * u);
        scale = vec4(q_float(block));
        offset = vec4(0.0);
        q[0] = nf4_levels(v.x); q[1] = nf4_levels(v.x >> 16);
        q[2] = nf4_levels(v.y); q[3] = nf4_levels(v.y >> 16);
        q[4] = nf4_levels(v.z); q[5] = nf4_levels(v.z >> 16);
        q[6] = nf4_levels(v.w); q[7] = nf4_levels(v.w >> 16);
    }
}

// Elements j .. j+7 (j a multiple of 8) of the block starting at byte `block`, in two steps so that a tiled
// product can issue the loads of its next tile before multiplying the current one and decode them after, with
// the loads' latency hidden behind the multiply: quant_fetch8 only reads (every address from block and j, no
// arithmetic on what it reads, so nothing waits for the loads), quant_decode8 makes the weights. Eight
// consecutive elements share one scale and sit in eight consecutive bytes (four for NF4). What a run holds:
//   Q4_0, Q8_0 (blocks on 2 bytes): codes.xyz the words over the 8 code bytes, head.x the word with d.
//   Q4_1: codes.xy the 8 code bytes, head.x d and m.   NF4: codes.x the 4 code bytes, head.x absmax.
//   Q4_K, Q5_K: codes.xy the 8 bytes of nibbles, Q5_K codes.zw its 8 bytes of fifth bits; head the block's
//               first 16 bytes (d, dmin, the 12 bytes of scales and mins).
//   Q6_K (blocks on 2 bytes): codes.xyz the words over the 8 low-nibble bytes, codes.w and head.xy those over the
//               8 high-bit bytes, head.z the word with the scale byte, head.w the word with d.
struct QuantRun { uvec4 codes; uvec4 head; };

// The words over 8 bytes from byte `at` (even) on: the third only when the bytes reach into it.
uvec3 q_8byte_words(uint at) {
    uint i = at >> 2;
    return uvec3(QUANT_WORD(i), QUANT_WORD(i + 1u), (at & 3u) != 0u ? QUANT_WORD(i + 2u) : 0u);
}
uvec2 q_8bytes_of(uvec3 words, uint at) {  // the 8 bytes from `at` out of q_8byte_words(at)
    uint s = (at & 3u) * 8u;
    return uvec2(q_funnel(words.x, words.y, s), q_funnel(words.y, words.z, s));
}

QuantRun quant_fetch8(uint block, uint j) {
    QuantRun run;
    run.codes = uvec4(0u);
    run.head = uvec4(0u);
    if (FORMAT == QUANT_Q4_0 || FORMAT == QUANT_Q8_0) {
        run.codes.xyz = q_8byte_words(block + 2u + (FORMAT == QUANT_Q4_0 ? j & 15u : j));
        run.head.x = QUANT_WORD(block >> 2);
    } else if (FORMAT == QUANT_Q4_1) {
        uint i = (block + 4u + (j & 15u)) >> 2;
        run.codes.xy = uvec2(QUANT_WORD(i), QUANT_WORD(i + 1u));
        run.head.x = QUANT_WORD(block >> 2);
    } else if (FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K) {
        uint sub = j / 32u, l = j % 32u;
        uint i = (block + (FORMAT == QUANT_Q4_K ? 16u : 48u) + 32u * (sub / 2u) + l) >> 2;
        run.codes.xy = uvec2(QUANT_WORD(i), QUANT_WORD(i + 1u));
        if (FORMAT == QUANT_Q5_K) {
            uint ih = (block + 16u + l) >> 2;
            run.codes.zw = uvec2(QUANT_WORD(ih), QUANT_WORD(ih + 1u));
        }
        uint ib = block >> 2;
        run.head = uvec4(QUANT_WORD(ib), QUANT_WORD(ib + 1u), QUANT_WORD(ib + 2u), QUANT_WORD(ib + 3u));
    } else if (FORMAT == QUANT_Q6_K) {
        uint half_ = j / 128u, quarter = (j % 128u) / 32u, l = j % 32u;
        run.codes.xyz = q_8byte_words(block + 64u * half_ + 32u * (quarter & 1u) + l);
        uvec3 high = q_8byte_words(block + 128u + 32u * half_ + l);
        run.codes.w = high.x;
        run.head.xy = high.yz;
        run.head.z = QUANT_WORD((block + 192u + 8u * half_ + l / 16u + 2u * quarter) >> 2);
        run.head.w = QUANT_WORD((block + 208u) >> 2);
    } else {  // NF4: word-aligned (blocks of 36 bytes, the codes from byte 4)
        run.codes.x = QUANT_WORD((block + 4u + j / 2u) >> 2);
        run.head.x = QUANT_WORD(block >> 2);
    }
    return run;
}

float q_half_of(uint word, uint at) { return unpackHalf2x16((at & 2u) != 0u ? word >> 16 : word).x; }

void quant_decode8(QuantRun run, uint block, uint j, out vec4 lo, out vec4 hi) {
    if (FORMAT == QUANT_Q4_0 || FORMAT == QUANT_Q4_1) {
        uvec2 q = FORMAT == QUANT_Q4_0 ? q_8bytes_of(run.codes.xyz, block + 2u + (j & 15u)) : run.codes.xy;
        q = (q >> (j < 16u ? 0u : 4u)) & 0x0F0F0F0Fu;
        float d = q_half_of(run.head.x, block);
        float m = FORMAT == QUANT_Q4_0 ? -8.0 * d : unpackHalf2x16(run.head.x).y;
        lo = d * q_bytes(q.x) + m;
        hi = d * q_bytes(q.y) + m;
    } else if (FORMAT == QUANT_Q8_0) {
        uvec2 q = q_8bytes_of(run.codes.xyz, block + 2u + j);
        float d = q_half_of(run.head.x, block);
        lo = d * q_int8s(q.x);
        hi = d * q_int8s(q.y);
    } else if (FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K) {
        uint sub = j / 32u;
        uvec2 v = (run.codes.xy >> ((sub & 1u) * 4u)) & 0x0F0F0F0Fu;
        if (FORMAT == QUANT_Q5_K) v |= ((run.codes.zw >> sub) & 0x01010101u) << 4;
        vec2 sm = k_scale_min_of(run.head, sub);
        lo = sm.x * q_bytes(v.x) - sm.y;
        hi = sm.x * q_bytes(v.y) - sm.y;
    } else if (FORMAT == QUANT_Q6_K) {
        uint half_ = j / 128u, quarter = (j % 128u) / 32u, l = j % 32u;
        uvec2 low = (q_8bytes_of(run.codes.xyz, block + 64u * half_ + 32u * (quarter & 1u) + l)
                     >> (quarter < 2u ? 0u : 4u)) & 0x0F0F0F0Fu;
        uvec2 high = (q_8bytes_of(uvec3(run.codes.w, run.head.xy), block + 128u + 32u * half_ + l) >> (2u * quarter))
                     & 0x03030303u;
        uint at = block + 192u + 8u * half_ + l / 16u + 2u * quarter;
        float scale = q_half_of(run.head.w, block + 208u)
                      * float(bitfieldExtract(int(run.head.z), int((at & 3u) * 8u), 8));
        lo = scale * (q_bytes(low.x | (high.x << 4)) - 32.0);
        hi = scale * (q_bytes(low.y | (high.y << 4)) - 32.0);
    } else {  // NF4
        float absmax = uintBitsToFloat(run.head.x);
        lo = absmax * nf4_levels(run.codes.x);
        hi = absmax * nf4_levels(run.codes.x >> 16);
    }
}

void dequant8(uint block, uint j, out vec4 lo, out vec4 hi) { quant_decode8(quant_fetch8(block, j), block, j, lo, hi); }

// The byte address of the block holding W[row, col] and col's place in it (rows `row_bytes` long from byte `base`).
uvec2 quant_block_of(uint base, uint row_bytes, uint row, uint col) {
    uint size = quant_block_size();
    return uvec2(base + row * row_bytes + (col / size) * quant_block_bytes(), col % size);
}

// W[row, col .. col+7] (col a multiple of 8) of a packed matrix whose rows are `row_bytes` long from byte `base`.
void quant_row8(uint base, uint row_bytes, uint row, uint col, out vec4 lo, out vec4 hi) {
    uint size = quant_block_size();
    dequant8(base + row * row_bytes + (col / size) * quant_block_bytes(), col % size, lo, hi);
}

// ---- Raw units (decode_matvec.comp): a unit's packed words read apart from their decoding, so that a lane issues
// the loads of all its units (and columns) before it decodes any, and then decodes each octet right where it is
// multiplied, holding only the packed words in between (4 to 13 words a unit instead of quant_unit's 32 floats).
// The codes come out as floats without an integer conversion or a subtraction per weight: a code c of b bits, moved
// to the top of the mantissa of 0.5 (or of 1.0 for Q8_0's 8 bits), is the float (c + B) / A exactly, with A a power
// of two; the unit's scales absorb A and B, so octet o's weights are scale[o] * code + offset[o] as quant_unit's.
// Which words a unit holds:
//   Q4_K, Q5_K: a its 16 bytes of nibbles, b the block's first 16 bytes (d, dmin, scales and mins), Q5_K c its 16
//               bytes of fifth bits.
//   Q4_0 (blocks on 2 bytes): a, b.x the 5 words over the block; Q8_0: a, b, c.x the 9 words over it.
//   Q4_1: a.x d and m, b the 16 bytes of nibbles.  NF4: a.x absmax, b the unit's 16 bytes of nibbles.
//   Q6_K (blocks on 2 bytes): a.xyz, b.xyz, c.xyz and d.xyz the words over the 8 low-nibble bytes of quarters 0 and 2,
//               of quarters 1 and 3, the 8 high-bit bytes and the 8 scale bytes; a.w the word with d.
struct QuantRaw { uvec4 a; uvec4 b; uvec4 c; uvec4 d; };

// Octets that share one scale: a unit holds quant_runs() runs of 4 / quant_runs() octets.
uint quant_runs() {
    return FORMAT == QUANT_Q6_K ? 4u : (FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K ? 2u : 1u);
}

uvec4 q_words4(uint i) { return uvec4(QUANT_WORD(i), QUANT_WORD(i + 1u), QUANT_WORD(i + 2u), QUANT_WORD(i + 3u)); }

// Whether units 2m and 2m + 1 of a block share their scales (quant_raw_scales): the K formats' d, dmin and the scales
// of sub-blocks 2j and 2j + 1, Q6_K's d and scale bytes, NF4's absmax.
bool quant_pair_shares_scales() { return FORMAT >= QUANT_Q4_K; }

// with_scales false: the words of codes alone (unit 2m + 1 of a block whose unit 2m's scales serve it, when
// quant_pair_shares_scales).
QuantRaw quant_fetch_unit(uint block, uint u, bool with_scales) {
    QuantRaw r;
    r.a = uvec4(0u); r.b = uvec4(0u); r.c = uvec4(0u); r.d = uvec4(0u);
    if (FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K) {
        r.a = q_16bytes_aligned(block + (FORMAT == QUANT_Q4_K ? 16u : 48u) + 16u * u);  // 32 j + 16 h
        if (with_scales) r.b = q_16bytes_aligned(block);
        if (FORMAT == QUANT_Q5_K) r.c = q_16bytes_aligned(block + 16u + 16u * (u & 1u));
    } else if (FORMAT == QUANT_Q4_0 || FORMAT == QUANT_Q8_0) {
        uint i = block >> 2;  // the words over bytes block .. block + 17 (33): one more when block is on a word
        r.a = q_words4(i);
        r.b.x = QUANT_WORD(i + 4u);
        if (FORMAT == QUANT_Q8_0) {
            r.b.yzw = uvec3(QUANT_WORD(i + 5u), QUANT_WORD(i + 6u), QUANT_WORD(i + 7u));
            r.c.x = QUANT_WORD(i + 8u);
        }
    } else if (FORMAT == QUANT_Q4_1 || FORMAT == QUANT_NF4) {
        if (with_scales || FORMAT == QUANT_Q4_1) r.a.x = QUANT_WORD(block >> 2);
        r.b = q_words4((block + 4u + (FORMAT == QUANT_NF4 ? 16u * u : 0u)) >> 2);
    } else {  // Q6_K
        uint h = u >> 2, l = 8u * (u & 3u);
        r.a.xyz = q_8byte_words(block + 64u * h + l);
        r.b.xyz = q_8byte_words(block + 64u * h + 32u + l);
        r.c.xyz = q_8byte_words(block + 128u + 32u * h + l);
        if (with_scales) {
            r.d.xyz = q_8byte_words(block + 192u + 8u * h);
            r.a.w = QUANT_WORD((block + 208u) >> 2);
        }
    }
    return r;
}

// The bytes of m (each under 128) as 0.5 + byte / 256: each byte moved to bits 16..23 under 0.5's exponent.
vec4 q_mid4(uint m) { return uintBitsToFloat((uvec4(m << 16, m << 8, m, m >> 8) & 0x00FF0000u) | 0x3F000000u); }
// The bytes of m as 1 + byte / 256: bits 15..22 under 1.0's exponent.
vec4 q_wide4(uint m) { return uintBitsToFloat((uvec4(m << 15, m << 7, m >> 1, m >> 9) & 0x007F8000u) | 0x3F800000u); }
// The low (high false) or high nibbles of v's bytes as 0.5 + nibble / 32 (nibble * 8 as each byte).
vec4 q_nibbles_mid(uint v, bool high) { return q_mid4((high ? v >> 1 : v << 3) & 0x78787878u); }
uint q_funnel16(uint lo, uint hi) { return (lo >> 16) | (hi << 16); }
// Word i of a unit's words in order (a, then b, then c; i a constant where it is called).
uint q_raw_word(QuantRaw r, uint i) { return i < 4u ? r.a[i] : (i < 8u ? r.b[i - 4u] : r.c[i - 8u]); }
// Word i of a Q4_0 or Q8_0 block's codes: they start 2 bytes into the block, which starts at byte `lead` (0 or 2) of
// the unit's first word.
uint q_code_word(QuantRaw r, uint i, uint lead) {
    return lead == 0u ? q_funnel16(q_raw_word(r, i), q_raw_word(r, i + 1u)) : q_raw_word(r, i + 1u);
}

// Octet o of the unit as floats (see above) and each octet's scale and offset.
void quant_raw_octet(QuantRaw r, uint block, uint u, uint o, out vec4 lo, out vec4 hi) {
    const uint lead = block & 3u, pair = 2u * (o & 1u);
    if (FORMAT == QUANT_Q4_0) {  // (nibble + 16) / 32
        lo = q_nibbles_mid(q_code_word(r, pair, lead), o >= 2u);
        hi = q_nibbles_mid(q_code_word(r, pair + 1u, lead), o >= 2u);
    } else if (FORMAT == QUANT_Q4_1 || FORMAT == QUANT_Q4_K) {
        uvec4 v = FORMAT == QUANT_Q4_1 ? r.b : r.a;
        lo = q_nibbles_mid(v[pair], o >= 2u);
        hi = q_nibbles_mid(v[pair + 1u], o >= 2u);
    } else if (FORMAT == QUANT_Q5_K) {  // (code + 32) / 64: 4 * code as each byte
        uint e = o >> 1, bit = 2u * (u >> 1) + e;
        uvec2 v = (uvec2(r.a[pair], r.a[pair + 1u]) >> (4u * e)) & 0x0F0F0F0Fu;
        uvec2 h = (uvec2(r.c[pair], r.c[pair + 1u]) >> bit) & 0x01010101u;
        lo = q_mid4((v.x << 2) | (h.x << 6));
        hi = q_mid4((v.y << 2) | (h.y << 6));
    } else if (FORMAT == QUANT_Q8_0) {  // (code + 384) / 256: code + 128 as each byte
        lo = q_wide4(q_code_word(r, 2u * o, lead) ^ 0x80808080u);
        hi = q_wide4(q_code_word(r, 2u * o + 1u, lead) ^ 0x80808080u);
    } else if (FORMAT == QUANT_Q6_K) {  // (code + 64) / 128: 2 * code as each byte; octet o is quarter o
        uint s = 8u * lead;
        uvec3 ql = (o & 1u) == 0u ? r.a.xyz : r.b.xyz;
        uvec2 low = (uvec2(q_funnel(ql.x, ql.y, s), q_funnel(ql.y, ql.z, s)) >> (o < 2u ? 0u : 4u)) & 0x0F0F0F0Fu;
        uvec2 high = (uvec2(q_funnel(r.c.x, r.c.y, s), q_funnel(r.c.y, r.c.z, s)) >> (2u * o)) & 0x03030303u;
        lo = q_mid4((low.x << 1) | (high.x << 5));
        hi = q_mid4((low.y << 1) | (high.y << 5));
    } else {  // NF4: the levels themselves
        lo = nf4_levels(r.b[o]);
        hi = nf4_levels(r.b[o] >> 16);
    }
}

void quant_raw_scales(QuantRaw r, uint block, uint u, out vec4 scale, out vec4 offset) {
    const uint lead = block & 3u;
    if (FORMAT == QUANT_Q4_K || FORMAT == QUANT_Q5_K) {
        // d * scale and dmin * min of sub-blocks 2j and 2j + 1: weights d * scale * code - dmin * min
        const vec4 sm = k_scale_min_pair(r.b, u >> 1);
        const float a = FORMAT == QUANT_Q4_K ? 32.0 : 64.0;
        scale = a * sm.xxyy;
        offset = -(0.5 * a) * sm.xxyy - sm.zzww;
    } else if (FORMAT == QUANT_Q6_K) {  // d * scale * (code - 32)
        uint s = 8u * lead;
        // octet o's scale is byte (u & 3) / 2 + 2o of the 8 (quant_unit's gather)
        uvec2 sw = uvec2(q_funnel(r.d.x, r.d.y, s), q_funnel(r.d.y, r.d.z, s)) >> (8u * ((u & 3u) / 2u));
        vec4 ds = q_half_of(r.a.w, block + 208u) * q_int8s((sw.x & 0xFFu) | ((sw.x >> 8) & 0xFF00u)
                                                          | ((sw.y & 0xFFu) << 16) | ((sw.y << 8) & 0xFF000000u));
        scale = 128.0 * ds;
        offset = -96.0 * ds;
    } else if (FORMAT == QUANT_Q8_0 || FORMAT == QUANT_Q4_0) {  // d * code (Q4_0: d * (nibble - 8))
        float d = q_half_of(r.a.x, lead);
        scale = vec4(FORMAT == QUANT_Q8_0 ? 256.0 * d : 32.0 * d);
        offset = vec4(FORMAT == QUANT_Q8_0 ? -384.0 * d : -24.0 * d);
    } else if (FORMAT == QUANT_Q4_1) {  // d * nibble + m
        vec2 dm = unpackHalf2x16(r.a.x);
        scale = vec4(32.0 * dm.x);
        offset = vec4(dm.y - 16.0 * dm.x);
    } else {  // NF4
        scale = vec4(uintBitsToFloat(r.a.x));
        offset = vec4(0.0);
    }
}

#endif
