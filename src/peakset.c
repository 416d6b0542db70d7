/* Peak sets and the graveyard (peakset.h). Every function runs with the
 * store lock held by its caller (store.c); calls region.c and window.c. */
#include "peakset.h"

int mvz_peakset_init(mvz_graveyard *g, size_t max)
{
    g->max = max;
    if (mvz_region_reserve(&g->r, max * sizeof(mvz_grave), 1 << 16))
        return -1;
    g->graves = (mvz_grave *)g->r.base;
    return 0;
}

void mvz_peakset_reset(mvz_graveyard *g)
{
    MVZ_SET_PEEKED(g->n, 0);
    mvz_region_discard(&g->r);
}

/* Capture path, no GIL, store lock held: a pass over the preallocated
 * graveyard, in place. Amortised O(1) per free (see mvz_peakset_on_free). */
void mvz_peakset_compact(mvz_graveyard *g, const mvz_totals totals[MVZ_NSLOTS],
                        const mvz_totals btotals[MVZ_NSLOTS], const mvz_windows *ws)
{
    size_t keep = 0;
    for (size_t k = 0; k < g->n; k++) {
        const mvz_grave *e = &g->graves[k];
        if (e->freed > totals[e->a.slot].peak_timestamp ||
            e->freed > btotals[e->a.slot].peak_timestamp ||
            (ws->open && mvz_window_want_grave(ws, &e->a, e->freed)))
            g->graves[keep++] = *e;
    }
    MVZ_SET_PEEKED(g->n, keep);
}

/* Capture path, no GIL, store lock held: one copy into the preallocated
 * region, and a compaction once the graveyard holds more than twice what
 * the peak sets can need. */
void mvz_peakset_on_free(mvz_graveyard *g, const mvz_alloc *a, uint64_t freed,
                        const mvz_totals totals[MVZ_NSLOTS], const mvz_totals btotals[MVZ_NSLOTS],
                        const mvz_windows *ws)
{
    if (!(a->timestamp <= totals[a->slot].peak_timestamp ||
          a->timestamp <= btotals[a->slot].peak_timestamp ||
          (ws->open && mvz_window_want_grave(ws, a, freed))))
        return;
    if (g->n >= g->max)
        mvz_peakset_compact(g, totals, btotals, ws);
    if (g->n < g->max && mvz_region_ensure(&g->r, (g->n + 1) * sizeof(mvz_grave)) == 0) {
        g->graves[g->n].a = *a;
        g->graves[g->n].freed = freed;
        MVZ_SET_PEEKED(g->n, g->n + 1); /* peeked by the store's readers */
    }
    size_t bound = 0;
    for (int d = 0; d < MVZ_NSLOTS; d++)
        bound += totals[d].peak_count + btotals[d].peak_count;
    if (ws->open)
        bound += mvz_window_peak_count(ws);
    if (g->n > 2 * bound + 1024)
        mvz_peakset_compact(g, totals, btotals, ws);
}

/* With the GIL (readers), store lock held: reads, and copies into the
 * caller's buffer malloc'd before the lock. */
size_t mvz_peakset_collect(const mvz_livetab *live, const mvz_graveyard *g, const mvz_totals *t,
                    int slot, uint64_t after, mvz_alloc *out)
{
    size_t m = 0;
    for (size_t k = 0; k < live->count; k++) {
        const mvz_alloc *a = &live->allocs[k];
        if ((slot < 0 || a->slot == slot) && a->timestamp > after &&
            a->timestamp <= t[a->slot].peak_timestamp)
            out[m++] = *a;
    }
    for (size_t k = 0; k < g->n; k++) {
        const mvz_grave *e = &g->graves[k];
        uint64_t peak_ts = t[e->a.slot].peak_timestamp;
        if ((slot < 0 || e->a.slot == slot) && e->a.timestamp > after &&
            e->a.timestamp <= peak_ts && e->freed > peak_ts)
            out[m++] = e->a;
    }
    return m;
}
