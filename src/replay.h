/* Replaying a loaded trace's events through the store's own rules: the live
 * table (livetab.c: one allocation per address and key space, an ALLOC at a
 * live address retires it, a FREE of an unknown address is ignored) and the
 * accounting of totals and peaks (accounting.c). PyTorch's blocks lie
 * inside segments, so they do not count in the device totals (as in the
 * store).
 *
 * A replayer keeps its state across calls, so a trace streams through it
 * one EVENTS chunk at a time and nothing per event is kept: only the live
 * allocations (full records), and, with `summary`, what a report reads of
 * the whole run: each device's totals and peak, the allocations live at
 * each peak (the store's peak-set idea, peakset.c: the live table plus a
 * graveyard of what was freed after the peak), the failures, a bounded
 * timeline of the totals (each bucket's highest point, buckets merged in
 * pairs when full; blocks are no change, as in the store's timeline) and
 * the addresses PyTorch's blocks ever had.
 *
 * With the GIL or without (it touches only its own state and the caller's
 * buffers); never on the capture path, so it mallocs. Calls livetab.c,
 * accounting.h and region.c. The bindings are module_replay.c's Replayer
 * and module_store.c's replay() (whole columns at once). */
#ifndef MEMVIZ_REPLAY_H
#define MEMVIZ_REPLAY_H

#include "livetab.h"
#include "record.h"
#include "types.h"

#include <stddef.h>
#include <stdint.h>

/* Slots of a replay: a trace's device byte as unsigned (-1, host, is 255). */
#define MVZ_REPLAY_SLOTS 256
/* Points of one slot's timeline (even). */
#define MVZ_REPLAY_POINTS 16384
/* Allocations after a peak looked through for the block its segment was made
 * for (another thread's events may come between a segment and its block). */
#define MVZ_REPLAY_LOOKAHEAD 64

/* Sums that a crafted file could push past 64 bits. */
#if defined(__SIZEOF_INT128__)
__extension__ typedef __int128 mvz_wide;
__extension__ typedef unsigned __int128 mvz_uwide;
#else
typedef int64_t mvz_wide;
typedef uint64_t mvz_uwide;
#endif

/* A replayed allocation is an mvz_alloc whose `timestamp` is the index of
 * its ALLOC event in the trace (the order the peak rules compare) and whose
 * `stream` is the event's time in ns: so a replay's rows carry no stream
 * (the events themselves do: feed_events() gives each one's). */
#define MVZ_REPLAY_INDEX(a) ((a)->timestamp)
#define MVZ_REPLAY_TIME(a) ((a)->stream)

typedef struct {
    uint64_t index, ts; /* the event that made the change, and when */
    mvz_wide level;     /* the slot's level after it */
} mvz_replay_point;

/* A timeline of at most MVZ_REPLAY_POINTS points: each is the highest of a
 * bucket of `stride` consecutive changes. */
typedef struct {
    mvz_replay_point *points;
    size_t n;
    uint64_t stride, fill, changes;
    mvz_replay_point open; /* the highest point of the bucket being filled */
} mvz_replay_series;

typedef struct {
    mvz_totals t;           /* the store's rules; t.peak_timestamp is an event index */
    int64_t peak_index;     /* the ALLOC that made the peak, -1: none */
    uint64_t peak_ts;       /* its time */
    uint64_t live_all;      /* live allocations of the slot, blocks too */
    uint64_t peak_all;      /* live_all at the peak (the graveyard's bound) */
    mvz_totals bt;          /* PyTorch's blocks alone: the tensor peak (bt.peak) */
    int64_t tpeak_index;    /* the block ALLOC that made the tensor peak, -1: none */
    uint64_t tpeak_ts;      /* its time */
    uint64_t tpeak_all;     /* live_all then */
    uint64_t allocs, frees, failed; /* events of each op, every kind */
    mvz_uwide alloc_bytes;  /* sizes of the ALLOC events, every kind */
    int present;            /* an ALLOC or FAILED event named the slot */
    mvz_wide level;         /* the timeline's level: t.current, without wrapping */
    mvz_replay_series series;
    /* The block the thread of the peak's segment asked for, looked for among
     * the MVZ_REPLAY_LOOKAHEAD allocations after the peak. */
    int look_left, has_block;
    uint32_t look_thread;
    uint64_t look_lo, look_size;
    mvz_alloc block;
} mvz_replay_slot;

typedef struct {
    mvz_alloc a;
    uint64_t freed; /* the index of the event that ended it */
} mvz_replay_grave;

typedef struct {
    mvz_livetab live;
    uint64_t n;  /* events replayed */
    uint64_t ts; /* the time of the last one */
    int summary;
    /* With summary: */
    mvz_replay_slot *slots; /* MVZ_REPLAY_SLOTS */
    mvz_replay_grave *graves;
    size_t ngraves, capgraves;
    uint64_t bound; /* sum of the slots' peak_all */
    mvz_alloc *fails;
    size_t nfails, capfails;
    uint64_t *baddr; /* the set of (slot, address) of every block: open addressing */
    uint16_t *bslot; /* 0: empty, else slot + 1 */
    size_t bn, bcap;
    mvz_uwide dropped; /* the GAP records' counts */
    uint64_t stream_frees; /* frees of blocks flagged MVZ_FLAG_STREAM */
    uint8_t looking[MVZ_REPLAY_SLOTS];
    int nlooking;
} mvz_replayer;

/* Called after each event of mvz_replay_chunk with the event, its index and
 * time, and the live allocation it ended (its FREE, or an ALLOC at its
 * address; NULL when none). Returns 0, or -1 to stop (out of memory). */
typedef int (*mvz_replay_visit)(void *ctx, const mvz_event *e, uint64_t index, uint64_t ts,
                                const mvz_alloc *ended);

/* A replayer whose first events count time from `start_ns` (until a TIME
 * record). 0, or -1 when memory cannot be had. */
int mvz_replay_init(mvz_replayer *r, uint64_t start_ns, int summary);
void mvz_replay_release(mvz_replayer *r);

/* One event. *ended receives the live allocation it ended, if any (returns
 * 1), else 0; -1: out of memory. */
int mvz_replay_event(mvz_replayer *r, const mvz_event *e, mvz_alloc *ended);

/* Events [start, stop) of an EVENTS chunk's `count` records of `width`
 * bytes (the file format's: record.h; layout 0: records one after another,
 * 1: byte planes), in order; `visit` (may be NULL) after each. 0, or -1
 * when out of memory or visit stopped. */
int mvz_replay_chunk(mvz_replayer *r, const uint8_t *records, size_t count, size_t width,
                     int layout, size_t start, size_t stop, mvz_replay_visit visit, void *ctx);

/* Summary reads. The allocations live at the peak of `slot` (-1: of every
 * slot, each at its own), into a malloc'd array (the caller frees), ordered
 * by their ALLOC events (a slot's block found after its peak last in its
 * slot's share). Returns the count or -1. */
long mvz_replay_peak_set_of(const mvz_replayer *r, int slot, int tensor, mvz_alloc **out);
/* The live allocations, ordered by their ALLOC events (malloc'd). */
long mvz_replay_live(const mvz_replayer *r, mvz_alloc **out);
/* Flush the open bucket of each timeline (once, when the events are over). */
void mvz_replay_finish(mvz_replayer *r);
/* The addresses PyTorch's blocks had on `slot`, ascending (malloc'd). */
long mvz_replay_block_addresses(const mvz_replayer *r, int slot, uint64_t **out);

/* ---- whole columns at once (module_store.c's replay()) ------------------------ */

typedef struct {
    /* end[i], for each ALLOC event i: the index of the event that ended it
     * (its FREE, or the ALLOC that retired it), 0 when it never ended.
     * Caller-owned, n entries, zeroed by mvz_replay_columns. */
    int64_t *end;
    /* The indices of the ALLOC events still live at the end, ascending
     * (malloc'd by mvz_replay_columns; the caller frees). */
    size_t *live;
    size_t nlive;
    uint64_t current[MVZ_REPLAY_SLOTS], peak[MVZ_REPLAY_SLOTS];
    int64_t peak_index[MVZ_REPLAY_SLOTS]; /* the ALLOC that made the peak, -1: none */
} mvz_replay_result;

/* n events as columns: op (MVZ_EV_*), address, size, kind and device,
 * through a replayer. -1 when memory cannot be had. */
int mvz_replay_columns(size_t n, const uint8_t *op, const uint64_t *address, const uint64_t *size,
               const uint8_t *kind, const int8_t *device, mvz_replay_result *out);

#endif
