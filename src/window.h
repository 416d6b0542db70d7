/* Windows: the figures of trackers nested in a running one (store.h has the
 * readers). Each open window keeps totals, a peak and a timeline of what was
 * allocated after it opened.
 *
 * The state (mvz_windows) is the store's: store.c owns it and calls every
 * function here with its lock held. This file takes no lock and calls only
 * accounting.c. */
#ifndef MEMVIZ_WINDOW_H
#define MEMVIZ_WINDOW_H

#include "accounting.h"
#include "record.h"
#include "types.h"

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t start; /* allocations made after this timestamp are the window's */
    mvz_totals totals[MVZ_NSLOTS];
    mvz_totals btotals[MVZ_NSLOTS]; /* PyTorch's blocks (the tensor peak) */
    mvz_point points[MVZ_WINDOW_POINTS];
    mvz_series timeline; /* over points[] */
} mvz_window;

typedef struct {
    mvz_window w[MVZ_MAX_WINDOWS];
    uint32_t open; /* bit w set: window w is open */
} mvz_windows;

/* Capture path (no GIL, store lock held): field updates of *ws only. */
void mvz_window_alloc(mvz_windows *ws, const mvz_alloc *a);
void mvz_window_free(mvz_windows *ws, const mvz_alloc *a, uint64_t ts);
void mvz_window_failure(mvz_windows *ws, int slot);
/* Whether an allocation freed at `freed` is in an open window's peak set
 * (so the store's graveyard must keep it). */
int mvz_window_want_grave(const mvz_windows *ws, const mvz_alloc *a, uint64_t freed);
/* How many allocations the open windows' peak sets hold. */
size_t mvz_window_peak_count(const mvz_windows *ws);

/* Store lock held, with the GIL. */
/* Open a free window starting at `start` (a store timestamp); -1 if none is free. */
int mvz_window_open(mvz_windows *ws, uint64_t start);
/* The totals of open window w, or NULL; its blocks' with `blocks`. */
mvz_totals *mvz_window_totals(mvz_windows *ws, int w);
mvz_totals *mvz_window_block_totals(mvz_windows *ws, int w);
/* The opening timestamp of open window w, or 0 when it is not open. */
uint64_t mvz_window_start(const mvz_windows *ws, int w);
/* Copy open window w's timeline into out (MVZ_WINDOW_POINTS room); returns
 * the count, or -1 when w is not open. */
long mvz_window_timeline(const mvz_windows *ws, int w, mvz_point *out);
void mvz_window_close(mvz_windows *ws, int w);
/* Close every window. */
void mvz_window_reset(mvz_windows *ws);

#endif
