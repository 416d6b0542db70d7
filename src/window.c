/* Windows (see window.h and store.h): every function takes or holds the
 * store's leaf lock, and touches only the static table below. */
#include "window.h"
#include "trace_ring.h" /* mvz_store_lock */

#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t start; /* allocations made after this timestamp are the window's */
    mvz_totals totals[MVZ_NSLOTS];
    mvz_point timeline[MVZ_WINDOW_POINTS];
    size_t ntimeline;
    uint64_t stride, tick;
} mvz_window;

/* Protected by the store lock. */
static mvz_window windows[MVZ_MAX_WINDOWS];
uint32_t mvz_windows_open;

static int is_open(int w) { return w >= 0 && w < MVZ_MAX_WINDOWS && (mvz_windows_open & (1u << w)); }

/* Capture path, no GIL, lock held: writes one preallocated point, halving the
 * resolution when full and keeping the larger of each pair (as the store's
 * own timeline does, so peaks survive). */
static void window_point(mvz_window *w, uint64_t ts, int slot, int force)
{
    if (!force && ++w->tick < w->stride)
        return;
    w->tick = 0;
    if (w->ntimeline == MVZ_WINDOW_POINTS) {
        for (size_t k = 0; k < MVZ_WINDOW_POINTS / 2; k++) {
            mvz_point *a = &w->timeline[2 * k], *b = &w->timeline[2 * k + 1];
            w->timeline[k] = (b->total > a->total) ? *b : *a;
        }
        w->ntimeline = MVZ_WINDOW_POINTS / 2;
        w->stride *= 2;
    }
    w->timeline[w->ntimeline].timestamp = ts;
    w->timeline[w->ntimeline].total = w->totals[slot].current;
    w->timeline[w->ntimeline].slot = slot;
    w->ntimeline++;
}

/* Capture path, no GIL, lock held: additions into the static table only. */
void mvz_windows_alloc(const mvz_alloc *a)
{
    for (uint32_t m = mvz_windows_open; m; m &= m - 1) {
        mvz_window *w = &windows[__builtin_ctz(m)];
        mvz_totals *t = &w->totals[a->slot];
        int peak = 0;
        t->current += a->size;
        t->live_count++;
        t->allocs++;
        t->alloc_bytes += a->size;
        if (t->current > t->peak) {
            t->peak = t->current;
            t->peak_timestamp = a->timestamp;
            t->peak_count = t->live_count;
            peak = 1; /* always a point at a new peak */
        }
        if (t->current > t->window_peak)
            t->window_peak = t->current;
        window_point(w, a->timestamp, a->slot, peak);
    }
}

/* Capture path, no GIL, lock held: as mvz_windows_alloc. */
void mvz_windows_free(const mvz_alloc *a, uint64_t ts)
{
    for (uint32_t m = mvz_windows_open; m; m &= m - 1) {
        mvz_window *w = &windows[__builtin_ctz(m)];
        if (a->timestamp <= w->start)
            continue; /* live before the window opened: not its memory */
        mvz_totals *t = &w->totals[a->slot];
        t->current -= a->size;
        t->live_count--;
        t->frees++;
        window_point(w, ts, a->slot, 0);
    }
}

/* Capture path, no GIL, lock held: as mvz_windows_alloc. */
void mvz_windows_failure(int slot)
{
    for (uint32_t m = mvz_windows_open; m; m &= m - 1)
        windows[__builtin_ctz(m)].totals[slot].failed++;
}

/* Capture path, no GIL, lock held: reads of the static table. */
int mvz_windows_want_grave(const mvz_alloc *a, uint64_t freed)
{
    for (uint32_t m = mvz_windows_open; m; m &= m - 1) {
        const mvz_window *w = &windows[__builtin_ctz(m)];
        uint64_t peak_ts = w->totals[a->slot].peak_timestamp;
        if (a->timestamp > w->start && a->timestamp <= peak_ts && freed > peak_ts)
            return 1;
    }
    return 0;
}

/* Capture path, no GIL, lock held: as mvz_windows_want_grave. */
size_t mvz_windows_peak_count(void)
{
    size_t n = 0;
    for (uint32_t m = mvz_windows_open; m; m &= m - 1) {
        const mvz_window *w = &windows[__builtin_ctz(m)];
        for (int d = 0; d < MVZ_NSLOTS; d++)
            n += w->totals[d].peak_count;
    }
    return n;
}

int mvz_window_open_locked(uint64_t start)
{
    for (int k = 0; k < MVZ_MAX_WINDOWS; k++) {
        if (mvz_windows_open & (1u << k))
            continue;
        mvz_window *w = &windows[k];
        memset(w->totals, 0, sizeof w->totals);
        w->ntimeline = 0;
        w->stride = 1;
        w->tick = 0;
        w->start = start;
        mvz_windows_open |= 1u << k;
        return k;
    }
    return -1;
}

mvz_totals *mvz_window_totals_locked(int w) { return is_open(w) ? windows[w].totals : NULL; }

uint64_t mvz_window_start_locked(int w) { return is_open(w) ? windows[w].start : 0; }

size_t mvz_window_timeline_locked(int w, mvz_point *out)
{
    if (!is_open(w))
        return 0;
    memcpy(out, windows[w].timeline, windows[w].ntimeline * sizeof(mvz_point));
    return windows[w].ntimeline;
}

void mvz_window_close_locked(int w)
{
    if (is_open(w))
        mvz_windows_open &= ~(1u << w);
}

/* ---- readers (with the GIL; store.h) ------------------------------------ */

void mvz_store_window_close(int w)
{
    mvz_store_lock();
    mvz_window_close_locked(w);
    mvz_store_unlock();
}

int mvz_store_window_totals(int w, mvz_totals out[MVZ_NSLOTS])
{
    int rc = -1;
    mvz_store_lock();
    if (is_open(w)) {
        memcpy(out, windows[w].totals, sizeof windows[w].totals);
        rc = 0;
    }
    mvz_store_unlock();
    return rc;
}

long mvz_store_window_timeline(int w, mvz_point **out)
{
    *out = NULL;
    mvz_point *buf = malloc(sizeof windows[0].timeline); /* before the lock */
    if (!buf)
        return -1;
    mvz_store_lock();
    if (!is_open(w)) {
        mvz_store_unlock();
        free(buf);
        return -1;
    }
    size_t n = windows[w].ntimeline;
    memcpy(buf, windows[w].timeline, n * sizeof(mvz_point));
    mvz_store_unlock();
    *out = buf;
    return (long)n;
}
