/* Windows: the figures of trackers nested in a running one (store.h has the
 * readers). Updated by the store while it holds its lock; each open window
 * keeps totals, a peak and a timeline of what was allocated after it opened. */
#ifndef MEMVIZ_WINDOW_H
#define MEMVIZ_WINDOW_H

#include "store.h"

#include <stddef.h>
#include <stdint.h>

/* Bit w set: window w is open. Read and written with the store lock held. */
extern uint32_t mvz_windows_open;

/* Store lock held (capture path, no GIL): field updates of static memory. */
void mvz_windows_alloc(const mvz_alloc *a);
void mvz_windows_free(const mvz_alloc *a, uint64_t ts);
void mvz_windows_failure(int slot);
/* Whether an allocation freed at `freed` is in an open window's peak set
 * (so the store's graveyard must keep it). */
int mvz_windows_want_grave(const mvz_alloc *a, uint64_t freed);
/* How many allocations the open windows' peak sets hold. */
size_t mvz_windows_peak_count(void);

/* Store lock held, with the GIL. */
/* Open a free window starting at `start` (a store timestamp); -1 if none is free. */
int mvz_window_open_locked(uint64_t start);
/* The totals of open window w, or NULL. */
mvz_totals *mvz_window_totals_locked(int w);
/* The opening timestamp of open window w, or 0 when it is not open. */
uint64_t mvz_window_start_locked(int w);
/* Copy open window w's timeline into out (MVZ_WINDOW_POINTS room); returns the count. */
size_t mvz_window_timeline_locked(int w, mvz_point *out);
void mvz_window_close_locked(int w);

#endif
