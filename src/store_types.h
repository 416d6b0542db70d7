/* The store's own figures, as its readers hand them out (store.h): the
 * bottom floor of src/ with types.h and record.h (no functions, no state),
 * so that a file that needs them but none of the store's functions includes
 * this, not store.h. */
#ifndef MEMVIZ_STORE_TYPES_H
#define MEMVIZ_STORE_TYPES_H

#include "record.h"
#include "types.h"

/* The capture path's operation numbers the store counts as it applies the
 * queue (capture.h's MVZ_OP_*, at most this many; mvz_store_op_counts). */
#define MVZ_STORE_OPS 32

typedef struct {
    uint64_t live, stacks, frames, threads, unmatched_frees, dropped_allocs,
        dropped_stacks, dropped_threads, timeline_points, bytes_used, bytes_reserved, generation;
    uint64_t stream_frees; /* blocks freed while another stream's use was recorded on them */
    uint64_t queue_events; /* events applied from the capture queue (capq.h) */
    uint64_t queue_full;   /* times an allocating thread found it full and applied it itself */
    uint64_t queue_kicks;  /* times an allocating thread woke the drainer early (a quarter full) */
    uint64_t queue_frames_written, queue_frames_kept; /* an allocation's frames: in the entry, or
                                                         its thread's previous stack's (capq.h) */
    uint64_t queue_kept_mismatch; /* entries whose kept frames could not be joined (never, but counted) */
    uint32_t max_live;
} mvz_store_stats;

/* Everything a tracker reads, copied at one instant (mvz_store_copy). */
typedef struct {
    mvz_alloc *live;     /* the window's live allocations */
    mvz_alloc *peaks;    /* the allocations live at their device's peak, every device */
    mvz_alloc *tpeaks;   /* ... at the peak of PyTorch's blocks there (the tensor peak) */
    mvz_point *timeline;
    size_t nlive, npeaks, ntpeaks, ntimeline;
    mvz_totals totals[MVZ_NSLOTS];
    mvz_totals btotals[MVZ_NSLOTS]; /* PyTorch's blocks */
    uint64_t when; /* the store timestamp of the copy */
} mvz_store_copy_t;

#endif
