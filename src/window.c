/* Windows (window.h). Every function runs with the store lock held by its
 * caller (store.c) and touches only the mvz_windows it is given; it calls
 * accounting.c and nothing else. */
#include "window.h"

#include <string.h>

static int is_open(const mvz_windows *ws, int w)
{
    return w >= 0 && w < MVZ_MAX_WINDOWS && (ws->open & (1u << w));
}

/* Capture path, no GIL, store lock held: additions into *ws only, and one
 * preallocated timeline point per window. */
void mvz_window_alloc(mvz_windows *ws, const mvz_alloc *a)
{
    for (uint32_t m = ws->open; m; m &= m - 1) {
        mvz_window *w = &ws->w[__builtin_ctz(m)];
        if (a->kind == MVZ_KIND_BLOCK) { /* inside segments: the tensor peak, no timeline */
            mvz_accounting_alloc(&w->btotals[a->slot], a->size, a->timestamp);
            continue;
        }
        mvz_totals *t = &w->totals[a->slot];
        if (mvz_accounting_alloc(t, a->size, a->timestamp))
            mvz_accounting_series_force_next(&w->timeline); /* always a point at a new peak */
        mvz_accounting_series_push(&w->timeline, a->timestamp, t->current, a->slot);
    }
}

/* Capture path, no GIL, store lock held: as mvz_window_alloc. */
void mvz_window_free(mvz_windows *ws, const mvz_alloc *a, uint64_t ts)
{
    for (uint32_t m = ws->open; m; m &= m - 1) {
        mvz_window *w = &ws->w[__builtin_ctz(m)];
        if (a->timestamp <= w->start)
            continue; /* live before the window opened: not its memory */
        if (a->kind == MVZ_KIND_BLOCK) {
            mvz_accounting_free(&w->btotals[a->slot], a->size);
            continue;
        }
        mvz_totals *t = &w->totals[a->slot];
        mvz_accounting_free(t, a->size);
        mvz_accounting_series_push(&w->timeline, ts, t->current, a->slot);
    }
}

/* Capture path, no GIL, store lock held: as mvz_window_alloc. */
void mvz_window_failure(mvz_windows *ws, int slot)
{
    for (uint32_t m = ws->open; m; m &= m - 1)
        ws->w[__builtin_ctz(m)].totals[slot].failed++;
}

/* Capture path, no GIL, store lock held: reads of *ws. */
int mvz_window_want_grave(const mvz_windows *ws, const mvz_alloc *a, uint64_t freed)
{
    for (uint32_t m = ws->open; m; m &= m - 1) {
        const mvz_window *w = &ws->w[__builtin_ctz(m)];
        for (int b = 0; b < 2; b++) {
            uint64_t peak_ts = (b ? w->btotals : w->totals)[a->slot].peak_timestamp;
            if (a->timestamp > w->start && a->timestamp <= peak_ts && freed > peak_ts)
                return 1;
        }
    }
    return 0;
}

/* Capture path, no GIL, store lock held: as mvz_window_want_grave. */
size_t mvz_window_peak_count(const mvz_windows *ws)
{
    size_t n = 0;
    for (uint32_t m = ws->open; m; m &= m - 1) {
        const mvz_window *w = &ws->w[__builtin_ctz(m)];
        for (int d = 0; d < MVZ_NSLOTS; d++)
            n += w->totals[d].peak_count + w->btotals[d].peak_count;
    }
    return n;
}

int mvz_window_open(mvz_windows *ws, uint64_t start)
{
    for (int k = 0; k < MVZ_MAX_WINDOWS; k++) {
        if (ws->open & (1u << k))
            continue;
        mvz_window *w = &ws->w[k];
        memset(w->totals, 0, sizeof w->totals);
        memset(w->btotals, 0, sizeof w->btotals);
        mvz_accounting_series_init(&w->timeline, w->points, MVZ_WINDOW_POINTS);
        w->start = start;
        ws->open |= 1u << k;
        return k;
    }
    return -1;
}

mvz_totals *mvz_window_totals(mvz_windows *ws, int w) { return is_open(ws, w) ? ws->w[w].totals : NULL; }

mvz_totals *mvz_window_block_totals(mvz_windows *ws, int w)
{
    return is_open(ws, w) ? ws->w[w].btotals : NULL;
}

uint64_t mvz_window_start(const mvz_windows *ws, int w) { return is_open(ws, w) ? ws->w[w].start : 0; }

long mvz_window_timeline(const mvz_windows *ws, int w, mvz_point *out)
{
    if (!is_open(ws, w))
        return -1;
    const mvz_window *win = &ws->w[w];
    memcpy(out, win->points, win->timeline.n * sizeof(mvz_point));
    return (long)win->timeline.n;
}

void mvz_window_close(mvz_windows *ws, int w)
{
    if (is_open(ws, w))
        ws->open &= ~(1u << w);
}

void mvz_window_reset(mvz_windows *ws) { ws->open = 0; }
