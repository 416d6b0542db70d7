/* The accounting rules: how one allocation or free changes a device slot's
 * totals and peak, and how a bounded timeline of those totals is kept.
 *
 * A leaf over plain structs (store.h's mvz_totals and mvz_point): it calls
 * nothing and locks nothing. The store applies the rules to its own totals
 * and to every open window's (window.c), always with the store lock held,
 * so the capture path (no GIL) runs them: field updates only, no allocation.
 */
#ifndef MEMVIZ_ACCOUNTING_H
#define MEMVIZ_ACCOUNTING_H

#include "record.h"
#include "types.h"

#include <stddef.h>
#include <stdint.h>

/* The rules the capture path runs on every event are inline here, so that a
 * store split into files pays no call per rule (benchmarks/RESULTS.md,
 * "One concern per C file"). */

/* An allocation of `size` bytes dated `ts`: current, counts, peak (dated
 * ts, with the live count then) and window peak. Returns 1 when it made a
 * new peak. Capture path, no GIL: field updates of the caller's struct,
 * under the store lock the caller holds. */
static inline int mvz_accounting_alloc(mvz_totals *t, uint64_t size, uint64_t ts)
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

/* A free of `size` bytes. Capture path, no GIL: as mvz_accounting_alloc. */
static inline void mvz_accounting_free(mvz_totals *t, uint64_t size)
{
    t->current -= size;
    t->live_count--;
    t->frees++;
}

/* A timeline of at most `cap` points (cap even) in caller-owned memory. Only
 * every `stride`-th change is kept; when full, the resolution halves,
 * keeping the larger point of each pair, so peaks survive. */
typedef struct {
    mvz_point *points;
    size_t n, cap;
    uint64_t stride, tick;
} mvz_series;

void mvz_accounting_series_init(mvz_series *s, mvz_point *points, size_t cap);
/* Forget the points; the stride restarts at 1. */
void mvz_accounting_series_reset(mvz_series *s);
/* Keeps one point (halving the series first when it is full). */
void mvz_accounting_series_keep(mvz_series *s, uint64_t ts, uint64_t total, int slot);

/* The next push is kept whatever the stride (a new peak). Capture path, no
 * GIL: one field write, under the store lock. */
static inline void mvz_accounting_series_force_next(mvz_series *s) { s->tick = s->stride; }

/* A change: slot's total is now `total` at `ts` (kept or skipped). Capture
 * path, no GIL: a counter, and every stride-th time one point written into
 * the caller's preallocated array, under the store lock. */
static inline void mvz_accounting_series_push(mvz_series *s, uint64_t ts, uint64_t total, int slot)
{
    if (++s->tick < s->stride)
        return;
    s->tick = 0;
    mvz_accounting_series_keep(s, ts, total, slot);
}

#endif
