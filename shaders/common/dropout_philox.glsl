// Philox-2x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC11):
// a counter-based generator, so element i's random bits depend only on (counter, key)
// and any pass can regenerate them. 32-bit products via umulExtended (no 64-bit ints).
#ifndef VKFORMERS_DROPOUT_PHILOX_GLSL
#define VKFORMERS_DROPOUT_PHILOX_GLSL

uvec2 philox2x32(uvec2 counter, uint key) {
    for (int round = 0; round < 10; ++round) {
        uint hi, lo;
        umulExtended(0xD256D193u, counter.x, hi, lo);
        counter = uvec2(hi ^ key ^ counter.y, lo);
        key += 0x9E3779B9u;
    }
    return counter;
}

#endif
