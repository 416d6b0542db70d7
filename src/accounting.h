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

#include "store.h"

#include <stddef.h>
#include <stdint.h>

/* An allocation of `size` bytes dated `ts`: current, counts, peak (dated
 * ts, with the live count then) and window peak. Returns 1 when it made a
 * new peak. */
int mvz_totals_alloc(mvz_totals *t, uint64_t size, uint64_t ts);
/* A free of `size` bytes. */
void mvz_totals_free(mvz_totals *t, uint64_t size);

/* A timeline of at most `cap` points (cap even) in caller-owned memory. Only
 * every `stride`-th change is kept; when full, the resolution halves,
 * keeping the larger point of each pair, so peaks survive. */
typedef struct {
    mvz_point *points;
    size_t n, cap;
    uint64_t stride, tick;
} mvz_series;

void mvz_series_init(mvz_series *s, mvz_point *points, size_t cap);
/* Forget the points; the stride restarts at 1. */
void mvz_series_reset(mvz_series *s);
/* The next push is kept whatever the stride (a new peak). */
void mvz_series_force_next(mvz_series *s);
/* A change: slot's total is now `total` at `ts` (kept or skipped). */
void mvz_series_push(mvz_series *s, uint64_t ts, uint64_t total, int slot);

#endif
