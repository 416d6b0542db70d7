/* Peak sets: which allocations were live at a device's peak. That set is
 * "live now and made before the peak" plus "freed after the peak, made
 * before it", and the second half is kept here, in the graveyard.
 *
 * The graveyard (mvz_graveyard) is the store's: store.c owns it and calls
 * every function here with its lock held; this file takes no lock and calls
 * region.c and window.c (open windows' peaks) only. */
#ifndef MEMVIZ_PEAKSET_H
#define MEMVIZ_PEAKSET_H

#include "livetab.h"
#include "region.h"
#include "record.h"
#include "types.h"
#include "window.h"

#include <stddef.h>
#include <stdint.h>

/* A graveyard entry: an allocation freed after the peak of its device. */
typedef struct {
    mvz_alloc a;
    uint64_t freed;
} mvz_grave;

typedef struct {
    mvz_region r;
    mvz_grave *graves;
    size_t n, max;
} mvz_graveyard;

/* With the GIL, once: room for `max` entries. 0 or -1. */
int mvz_peakset_init(mvz_graveyard *g, size_t max);
void mvz_peakset_reset(mvz_graveyard *g);
/* Capture path: `a` was freed at `freed`; keep it while the peak of its
 * device (totals), the peak of PyTorch's blocks there (btotals: the tensor
 * peak) or an open window's may still need it. */
void mvz_peakset_on_free(mvz_graveyard *g, const mvz_alloc *a, uint64_t freed,
                        const mvz_totals totals[MVZ_NSLOTS], const mvz_totals btotals[MVZ_NSLOTS],
                        const mvz_windows *ws);
/* Drop the entries no peak set can need any more. */
void mvz_peakset_compact(mvz_graveyard *g, const mvz_totals totals[MVZ_NSLOTS],
                        const mvz_totals btotals[MVZ_NSLOTS], const mvz_windows *ws);
/* The allocations made after `after` that were live at the peak of their
 * device in `t` (device totals, or block totals for the tensor peak), into out (room for live->count + g->n); of one slot, or of
 * every slot with slot < 0. Returns the count. */
size_t mvz_peakset_collect(const mvz_livetab *live, const mvz_graveyard *g, const mvz_totals *t,
                    int slot, uint64_t after, mvz_alloc *out);

#endif
