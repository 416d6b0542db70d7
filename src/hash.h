/* A 64-bit finaliser (the murmur3 one) for the store's open-addressing
 * tables. Header only: a pure function, safe anywhere (no state). */
#ifndef MEMVIZ_HASH_H
#define MEMVIZ_HASH_H

#include <stdint.h>

static inline uint64_t mvz_mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

#endif
