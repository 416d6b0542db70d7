/* Replaying a loaded trace's events through the store's own rules: the live
 * table (livetab.c: one allocation per address and key space, an ALLOC at a
 * live address retires it, a FREE of an unknown address is ignored) and the
 * accounting of totals and peaks (accounting.c). PyTorch's blocks lie
 * inside segments, so they do not count in the device totals (as in the
 * store).
 *
 * With the GIL or without (it touches only its arguments and a private
 * live table); never on the capture path. Calls livetab.c, accounting.c and
 * region.c. The binding is module_store.c's replay(). */
#ifndef MEMVIZ_REPLAY_H
#define MEMVIZ_REPLAY_H

#include <stddef.h>
#include <stdint.h>

/* Slots of a replay: a trace's device byte as unsigned (-1, host, is 255). */
#define MVZ_REPLAY_SLOTS 256

typedef struct {
    /* end[i], for each ALLOC event i: the index of the event that ended it
     * (its FREE, or the ALLOC that retired it), 0 when it never ended.
     * Caller-owned, n entries, zeroed by mvz_replay. */
    int64_t *end;
    /* The indices of the ALLOC events still live at the end, ascending
     * (malloc'd by mvz_replay; the caller frees). */
    size_t *live;
    size_t nlive;
    uint64_t current[MVZ_REPLAY_SLOTS], peak[MVZ_REPLAY_SLOTS];
    int64_t peak_index[MVZ_REPLAY_SLOTS]; /* the ALLOC that made the peak, -1: none */
} mvz_replay_result;

/* n events as columns: op (MVZ_EV_*), address, size, kind and device. An
 * ALLOC event that finds no room in the live table (more than `n` live
 * allocations cannot happen) or a failed reservation returns -1. */
int mvz_replay(size_t n, const uint8_t *op, const uint64_t *address, const uint64_t *size,
               const uint8_t *kind, const int8_t *device, mvz_replay_result *out);

#endif
