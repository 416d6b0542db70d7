/* The accounting rules (accounting.h) that are not inline there. Calls
 * nothing; every function is a few field updates of memory its caller owns.
 * On the capture path (no GIL) they run under the store lock, which the
 * caller holds. */
#include "accounting.h"

void mvz_accounting_series_init(mvz_series *s, mvz_point *points, size_t cap)
{
    s->points = points;
    s->cap = cap;
    mvz_accounting_series_reset(s);
}

void mvz_accounting_series_reset(mvz_series *s)
{
    s->n = 0;
    s->stride = 1;
    s->tick = 0;
}

/* Capture path, no GIL: writes one point into the caller's preallocated
 * array (halving it in place when full), under the store lock. */
void mvz_accounting_series_keep(mvz_series *s, uint64_t ts, uint64_t total, int slot)
{
    if (s->n == s->cap) {
        for (size_t k = 0; k < s->cap / 2; k++) {
            mvz_point *a = &s->points[2 * k], *b = &s->points[2 * k + 1];
            s->points[k] = (b->total > a->total) ? *b : *a;
        }
        s->n = s->cap / 2;
        s->stride *= 2;
    }
    s->points[s->n].timestamp = ts;
    s->points[s->n].total = total;
    s->points[s->n].slot = slot;
    s->n++;
}
