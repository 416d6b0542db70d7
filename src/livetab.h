/* The store's table of live allocations: a dense array (so a copy-out is
 * one pass) and an open-addressing index by (address, key space).
 *
 * The table (mvz_livetab) is the store's: store.c owns it and calls every
 * function here with its lock held; this file takes no lock and calls only
 * region.c. All of it runs on the capture path (no GIL): probes and copies
 * in preallocated regions, no allocation. */
#ifndef MEMVIZ_LIVETAB_H
#define MEMVIZ_LIVETAB_H

#include "region.h"
#include "record.h"
#include "types.h"

#include <stddef.h>
#include <stdint.h>

typedef struct {
    mvz_region allocs_r, index_a_r, index_b_r;
    mvz_alloc *allocs;
    uint32_t *index; /* slot -> alloc index + 1; 0 empty */
    size_t count, max, index_cap;
    int index_in_a; /* the index lives in index_a_r (else index_b_r) */
} mvz_livetab;

/* With the GIL, once: reserve room for max_live allocations. 0 or -1. */
int mvz_livetab_init(mvz_livetab *t, size_t max_live);
/* Forget every allocation. */
void mvz_livetab_reset(mvz_livetab *t);
/* Give the reservations back (a table made for one job: replay.c). */
void mvz_livetab_release(mvz_livetab *t);
/* The index slot holding (address, kind), *found = 1; else the empty slot
 * where it would go, *found = 0. */
size_t mvz_livetab_find(const mvz_livetab *t, uint64_t address, int kind, int *found);
/* Room for one more allocation: -1 when the table is full, 1 when the index
 * was rebuilt (slots from mvz_livetab_find are stale), else 0. */
int mvz_livetab_make_room(mvz_livetab *t);
/* The entry for index slot i (empty, from mvz_livetab_find after room was
 * made), to be filled in by the caller. */
mvz_alloc *mvz_livetab_insert(mvz_livetab *t, size_t i);
/* Remove the allocation at index slot i (found); its entry's place is
 * taken by the last one. */
void mvz_livetab_remove(mvz_livetab *t, size_t i);
/* The allocation at index slot i (found). */
static inline mvz_alloc *mvz_livetab_at(const mvz_livetab *t, size_t i)
{
    return &t->allocs[t->index[i] - 1];
}

#endif
