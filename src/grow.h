/* Growable arrays: the one doubling rule of the C core's heap arrays (the
 * replay's and the what-if pass's and models'). Header only, a leaf: calls
 * nothing of memviz's. Never on the capture path (it calls realloc). */
#ifndef MEMVIZ_GROW_H
#define MEMVIZ_GROW_H

#include <stdint.h>
#include <stdlib.h>

/* Make *p hold at least `need` items of `item` bytes (*cap: what it holds),
 * doubling from 64; 0, or -1 (nothing changed) when memory or size_t runs
 * out. */
static inline int mvz_grow(void **p, size_t *cap, size_t need, size_t item)
{
    if (need <= *cap)
        return 0;
    size_t ncap = *cap ? *cap : 64;
    while (ncap < need) {
        if (ncap > SIZE_MAX / 2 / item)
            return -1;
        ncap *= 2;
    }
    void *q = realloc(*p, ncap * item);
    if (!q)
        return -1;
    *p = q;
    *cap = ncap;
    return 0;
}

#endif
