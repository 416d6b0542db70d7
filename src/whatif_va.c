/* What if: the driver's placement of segments (whatif_va.h). Plain C: a
 * model's alone, one thread at a time, so no lock and no GIL is needed. */
#include "whatif_va.h"
#include "grow.h"

#include <stdlib.h>
#include <string.h>

#define TOP ((uint64_t)0x7f0000000000) /* where a model with no recorded segment starts */

void mvz_whatif_va_free(mvz_whatif_va *v)
{
    free(v->holes);
    memset(v, 0, sizeof *v);
}

size_t mvz_whatif_va_first_after(const mvz_whatif_va_hole *r, size_t n, uint64_t addr)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r[mid].end <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The first hole that ends after `addr`. */
static size_t find(const mvz_whatif_va *v, uint64_t addr) { return mvz_whatif_va_first_after(v->holes, v->n, addr); }

static int insert(mvz_whatif_va *v, size_t at, uint64_t base, uint64_t end)
{
    if (v->n == v->cap && mvz_grow((void **)&v->holes, &v->cap, v->n + 1, sizeof *v->holes))
        return -1;
    memmove(v->holes + at + 1, v->holes + at, (v->n - at) * sizeof *v->holes);
    v->holes[at] = (mvz_whatif_va_hole){base, end};
    v->n++;
    return 0;
}

static void drop(mvz_whatif_va *v, size_t at)
{
    memmove(v->holes + at, v->holes + at + 1, (v->n - at - 1) * sizeof *v->holes);
    v->n--;
}

/* [base, end) is no longer free (where a hole covers it). */
static int cut(mvz_whatif_va *v, uint64_t base, uint64_t end)
{
    for (size_t i = find(v, base); i < v->n && v->holes[i].base < end;) {
        mvz_whatif_va_hole h = v->holes[i];
        if (h.base < base && h.end > end) { /* in the middle: two holes */
            v->holes[i].end = base;
            return insert(v, i + 1, end, h.end);
        }
        if (h.base < base) {
            v->holes[i++].end = base;
        } else if (h.end > end) {
            v->holes[i].base = end;
            i++;
        } else {
            drop(v, i);
        }
    }
    return 0;
}

/* A new region below every other, its start at `base`: the rest is a hole. */
static int region(mvz_whatif_va *v, uint64_t base, uint64_t size)
{
    uint64_t end = base + (size + MVZ_WHATIF_VA_REGION - 1) / MVZ_WHATIF_VA_REGION * MVZ_WHATIF_VA_REGION;
    if (v->bottom && end > v->bottom) /* what lies above is not known to be free */
        end = v->bottom > base + size ? v->bottom : base + size;
    v->bottom = base;
    return end > base + size ? insert(v, 0, base + size, end) : 0; /* every hole lies above it */
}

int mvz_whatif_va_take(mvz_whatif_va *v, uint64_t base, uint64_t size)
{
    if (!v->bottom || base < v->bottom)
        return region(v, base, size);
    return cut(v, base, base + size);
}

uint64_t mvz_whatif_va_place(mvz_whatif_va *v, uint64_t size)
{
    for (size_t i = 0; i < v->n; i++) {
        mvz_whatif_va_hole *h = &v->holes[i];
        if (h->end - h->base >= size) {
            uint64_t base = h->base;
            h->base += size;
            if (h->base == h->end)
                drop(v, i);
            return base;
        }
    }
    uint64_t top = v->bottom ? v->bottom / MVZ_WHATIF_VA_REGION * MVZ_WHATIF_VA_REGION : TOP;
    uint64_t span = (size + MVZ_WHATIF_VA_REGION - 1) / MVZ_WHATIF_VA_REGION * MVZ_WHATIF_VA_REGION;
    uint64_t base = top - span;
    return region(v, base, size) ? 0 : base;
}

int mvz_whatif_va_give(mvz_whatif_va *v, uint64_t base, uint64_t size)
{
    uint64_t end = base + size;
    size_t at = find(v, base);
    int left = at > 0 && v->holes[at - 1].end == base;
    int right = at < v->n && v->holes[at].base == end;
    if (left && right) {
        v->holes[at - 1].end = v->holes[at].end;
        drop(v, at);
    } else if (left) {
        v->holes[at - 1].end = end;
    } else if (right) {
        v->holes[at].base = base;
    } else {
        return insert(v, at, base, end);
    }
    return 0;
}
