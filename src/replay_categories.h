/* Live bytes per category over a replay's events: the one owner of the
 * rules memviz/report/_categories.py states (the HTML report's and the
 * Perfetto export's category series). A loaded trace's file and any
 * recording's events() (packed into records, memviz/trace/categories.py)
 * are summed here alike, so a trace of millions of events needs no Python
 * object per event.
 *
 * Every byte counts once, as snapshots count them: a PyTorch block (kind
 * "block") lies inside a segment (a "device" allocation); a segment that
 * gets a block counts, from when it was made, as unused_pool, less the
 * blocks it holds; the block the segment was made for (the first of the
 * segment's thread inside it, among the MVZ_REPLAY_LOOKAHEAD allocations
 * after it) counts from the segment's time, as a peak's set holds it
 * (replay.c). The blocks' bytes are also a series of their own
 * (MVZ_REPLAY_CATEGORIES_TENSORS, PyTorch's tensors), never added to the segments. An
 * allocation's category is the one the snapshots gave it (the "known"
 * ones: live at the end or at a peak, by device, kind, address and time),
 * else <unknown>.
 *
 * Changes come in the events' order and are summed in time order (a stable
 * order: at one time, the last level counts): a window of the last
 * MVZ_REPLAY_CATEGORIES_WINDOW changes is put in order before it is summed
 * (a change earlier than what was summed already counts at the time summed
 * last; traces that memviz writes are in order, or out of order by a few
 * events). Each series keeps every point,
 * or with a limit the highest of each bucket of consecutive points
 * (buckets merged in pairs when full).
 *
 * With or without the GIL: it touches only its own state. Calls nothing of
 * memviz (the replay calls it back, replay.h's mvz_replay_visit). The
 * binding is module_replay.c's Replayer.feed_categories. */
#ifndef MEMVIZ_REPLAY_CATEGORIES_H
#define MEMVIZ_REPLAY_CATEGORIES_H

#include "replay.h"

#include <stddef.h>
#include <stdint.h>

#define MVZ_REPLAY_CATEGORIES_UNKNOWN 0 /* "<unknown>" */
#define MVZ_REPLAY_CATEGORIES_POOL 1    /* "unused_pool" */
#define MVZ_REPLAY_CATEGORIES_TENSORS 2 /* PyTorch's tensors: its blocks' bytes (not a category) */
#define MVZ_REPLAY_CATEGORIES_WINDOW ((size_t)1 << 19)
/* At most this many categories (a slot's series are an array of them, made
 * on the slot's first change). */
#define MVZ_REPLAY_CATEGORIES_MAX 65536

typedef struct {
    uint64_t ts;
    mvz_wide level;
} mvz_replay_categories_point;

typedef struct {
    uint32_t order; /* the how-manieth series to change first */
    int slot;
    int cat;
    mvz_wide cur;
    int has_pending;
    mvz_replay_categories_point pending; /* the last time's point, while changes may come at that time */
    mvz_replay_categories_point *points;
    size_t n, cap;
    uint64_t stride, fill; /* with a limit: points per bucket, points in the open one */
    mvz_replay_categories_point open;
} mvz_replay_categories_series;

typedef struct {
    uint64_t ts;
    mvz_wide delta;
    uint32_t seq, series;
} mvz_replay_categories_change;

/* An entry of the two small hash tables: `key` 0 is an empty place. */
typedef struct {
    uint64_t address;
    uint64_t value; /* known: the time it was made; live: its size */
    uint32_t key;   /* (slot << 8 | kind) + 1 */
    int cat;
} mvz_replay_categories_entry;

/* A live device allocation. They are kept in address order (by address,
 * and among equal addresses the newest
 * first), in runs of at most MVZ_REPLAY_CATEGORIES_RUN (a sorted array of sorted arrays:
 * a change moves at most one run and the runs' pointers). */
typedef struct {
    uint64_t address, size, ts, seq;
    uint64_t allocs; /* ALLOC events seen when it was made */
    uint32_t thread; /* the thread that made it */
    int cat, pool;
    int waiting; /* for the block it was made for */
} mvz_replay_categories_segment;

#define MVZ_REPLAY_CATEGORIES_RUN 64

typedef struct {
    size_t n;
    mvz_replay_categories_segment v[MVZ_REPLAY_CATEGORIES_RUN];
} mvz_replay_categories_run;

typedef struct {
    mvz_replay_categories_run **runs;
    size_t n, cap;
} mvz_replay_categories_segments;

typedef struct {
    int ncat;
    size_t limit; /* points per series, 0: all (even) */
    /* known categories: (slot, address, ts) -> category */
    mvz_replay_categories_entry *known;
    size_t k_n, k_cap;
    /* live allocations: (slot, address, kind) -> (category, size) */
    mvz_replay_categories_entry *live;
    size_t l_n, l_cap;
    mvz_replay_categories_segments segs[MVZ_REPLAY_SLOTS]; /* live device allocations, by address */
    uint64_t seg_seq;
    uint64_t allocs; /* ALLOC events seen */
    /* [slot][cat]: a slot's array made on its first change, a series on its own */
    mvz_replay_categories_series **series[MVZ_REPLAY_SLOTS];
    uint32_t nseries;
    mvz_replay_categories_change *window;
    size_t nwin;
    int unsorted;
    uint32_t seq;
    uint64_t summed_to; /* the time of the last change summed */
    int summed;
    int failed; /* out of memory: the result is not to be read */
} mvz_replay_categories;

/* `ncat` categories, 3 to MVZ_REPLAY_CATEGORIES_MAX (0, 1 and 2 are
 * MVZ_REPLAY_CATEGORIES_UNKNOWN, _POOL and _TENSORS); `limit` points per
 * series (0: every point). 0, or -1 out of memory. */
int mvz_replay_categories_init(mvz_replay_categories *c, int ncat, size_t limit);
void mvz_replay_categories_release(mvz_replay_categories *c);
/* The category the snapshots gave the allocation of `slot` and `kind` at
 * `address` made at `ts`. 0 or -1. */
int mvz_replay_categories_known(mvz_replay_categories *c, int slot, int kind, uint64_t address, uint64_t ts,
                                int cat);
/* The replay's visitor (ctx: the mvz_replay_categories). */
int mvz_replay_categories_visit(void *ctx, const mvz_event *e, uint64_t index, uint64_t ts,
                      const mvz_alloc *ended);
/* Sum what is left (once, after the last event). 0 or -1. */
int mvz_replay_categories_finish(mvz_replay_categories *c);
/* The series of `slot` and `cat`; NULL while it has not changed. */
const mvz_replay_categories_series *mvz_replay_categories_series_of(const mvz_replay_categories *c, int slot,
                                                                    int cat);

#endif
