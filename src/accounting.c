/* The accounting rules (accounting.h). Calls nothing; every function is a
 * few field updates of memory its caller owns. On the capture path (no GIL)
 * they run under the store lock, which the caller holds. */
#include "accounting.h"

/* Capture path, no GIL: field updates of the caller's struct. */
int mvz_totals_alloc(mvz_totals *t, uint64_t size, uint64_t ts)
{
    int peak = 0;
    t->current += size;
    t->live_count++;
    t->allocs++;
    t->alloc_bytes += size;
    if (t->current > t->peak) {
        t->peak = t->current;
        t->peak_timestamp = ts;
        t->peak_count = t->live_count;
        peak = 1;
    }
    if (t->current > t->window_peak)
        t->window_peak = t->current;
    return peak;
}

/* Capture path, no GIL: as mvz_totals_alloc. */
void mvz_totals_free(mvz_totals *t, uint64_t size)
{
    t->current -= size;
    t->live_count--;
    t->frees++;
}

void mvz_series_init(mvz_series *s, mvz_point *points, size_t cap)
{
    s->points = points;
    s->cap = cap;
    mvz_series_reset(s);
}

void mvz_series_reset(mvz_series *s)
{
    s->n = 0;
    s->stride = 1;
    s->tick = 0;
}

/* Capture path, no GIL: one field write. */
void mvz_series_force_next(mvz_series *s) { s->tick = s->stride; }

/* Capture path, no GIL: writes one point into the caller's preallocated
 * array (halving it in place when full). */
void mvz_series_push(mvz_series *s, uint64_t ts, uint64_t total, int slot)
{
    if (++s->tick < s->stride)
        return;
    s->tick = 0;
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
