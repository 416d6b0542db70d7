/* CUPTI subscription, the driver callback and activity records. */
/* capture.c calls down into store, frames, nodes, labels, seqmap, cupti and
 * clock; interpose.c, allocator.c and the bindings call it. */
#ifndef MEMVIZ_CAPTURE_H
#define MEMVIZ_CAPTURE_H

#include <stddef.h>
#include <stdint.h>

/* The driver calls memviz counts, in the order capture_info reports them. */
enum mvz_op {
    MVZ_OP_ALLOC,          /* cuMemAlloc_v2, cuMemAllocPitch_v2 */
    MVZ_OP_ALLOC_ASYNC,    /* cuMemAllocAsync, cuMemAllocFromPoolAsync (+_ptsz) */
    MVZ_OP_ALLOC_MANAGED,  /* cuMemAllocManaged */
    MVZ_OP_ALLOC_HOST,     /* cuMemHostAlloc, cuMemAllocHost_v2 */
    MVZ_OP_CREATE,         /* cuMemCreate */
    MVZ_OP_FREE,           /* cuMemFree_v2 */
    MVZ_OP_FREE_ASYNC,     /* cuMemFreeAsync (+_ptsz) */
    MVZ_OP_FREE_HOST,      /* cuMemFreeHost */
    MVZ_OP_RELEASE,        /* cuMemRelease */
    MVZ_OP_MAP,            /* cuMemMap */
    MVZ_OP_UNMAP,          /* cuMemUnmap */
    MVZ_OP_RESERVE,        /* cuMemAddressReserve: address space, not memory */
    MVZ_OP_ADDRESS_FREE,   /* cuMemAddressFree */
    MVZ_OP_POOL_TRIM,      /* cuMemPoolTrimTo */
    MVZ_OP_FAILED,         /* any allocation that returned an error */
    MVZ_OP_STATIC_ALLOC,   /* MEMORY2 activity records, DEVICE_STATIC */
    MVZ_OP_STATIC_FREE,
    MVZ_OP_ACTIVITY_RECORDS,
    MVZ_OP_BLOCK_ALLOC,    /* PyTorch caching-allocator blocks (allocator.h) */
    MVZ_OP_BLOCK_FREE,
    MVZ_OP_COUNT
};
extern const char *const mvz_capture_op_names[MVZ_OP_COUNT];

/* Each call below is made with the GIL by the module. */
typedef struct {
    int result;          /* CUptiResult of the step that failed, 0 on success */
    const char *step;    /* which call failed */
    char holder[128];    /* with 39: who holds CUPTI, when CUPTI says */
    int activity;        /* 1 when MEMORY2 records are on */
    char activity_error[160];
    int cupti;           /* 1 when subscribed to CUPTI (0: started without it) */
    char shared_with[128]; /* multi-subscriber mode: the other subscriber, or '' */
} mvz_start_status;

/* Whether to subscribe to CUPTI at start (want_cupti) and, where the
 * library allows it (MVZ_CUPTI_MULTI_SUBSCRIBER_VERSION and newer), beside
 * another subscriber (allow_shared). Without CUPTI, capture runs on the
 * wrappers alone (allocator.c's blocks, interpose.c's segments). */
void mvz_capture_configure(int depth);
int mvz_capture_depth(int depth); /* a benchmark's: see capture.c */
int mvz_capture_start(int want_cupti, int want_activity, int allow_shared, mvz_start_status *st);
/* With the GIL released: give CUPTI up while capture goes on (another
 * tool, torch.profiler, is about to subscribe): activity records are
 * flushed and disabled, the subscription ends; the wrappers keep
 * recording. Returns 1 if CUPTI was held, 0 if not. */
int mvz_capture_release_cupti(void);
/* Whether CUPTI's callbacks currently record (subscribed and capturing). */
int mvz_capture_cupti_held(void);
/* 1 when recordings in flight are counted per thread (membarrier registered),
 * 0 when by one shared counter. */
int mvz_capture_per_thread_counters(void);
/* The segment wrappers' path (interpose.c): a cudaMalloc/cudaFree PyTorch's
 * caching allocator just made on this thread; recorded only while CUPTI is
 * not held (it sees the same call as cuMemAlloc). Hot path, no GIL. */
void mvz_capture_segment(int is_free, int result, uint64_t address, uint64_t size);
/* Stops callbacks and unsubscribes; flushes activity records first. The
 * caller releases the GIL around it (CUPTI may call back on this thread). */
void mvz_capture_stop(void);
void mvz_capture_flush(void);
int mvz_capture_active(void);
void mvz_capture_counts(uint64_t out[MVZ_OP_COUNT]);
/* Benchmarks only (capture.c), through the test hook _core._callback_profile:
 * from the next start, time the CUPTI callback (TIME), return from it at
 * once, recording nothing (NOOP), or leave the stream-ordered cbids off
 * (NOASYNC). With the GIL, while nothing captures; returns the mode before. */
enum { MVZ_PROFILE_OFF, MVZ_PROFILE_TIME, MVZ_PROFILE_NOOP, MVZ_PROFILE_NOASYNC };
int mvz_capture_set_profile(int mode);
/* With the GIL, benchmarks only (_core._capture_noop): see capture.c. */
int mvz_capture_noop(int on);
/* The profile's counters: callbacks seen and ns spent in them. */
void mvz_capture_profile(uint64_t *calls, uint64_t *ns);
/* Under TIME, the allocator route's capture path (mvz_capture_block) per
 * thread that recorded: its OS thread id, allocations and frees, and the
 * capture path's ticks spent on each (clock.h). Fills up to `max` threads
 * and returns how many; counts since the process started. Any thread. */
int mvz_capture_timings(long *tid, uint64_t (*n)[2], uint64_t (*ticks)[2], int max);
void mvz_capture_forget_counts(void);
/* After fork, in the child: capture is off and CUPTI is not touched. */
void mvz_capture_atfork_child(void);

/* This thread's label id (labels.h interns them): read in the callback,
 * set by Python with the GIL. Thread-local, no lock. */
uint32_t mvz_capture_label_get(void);
void mvz_capture_label_set(uint32_t id);

/* Fires the same path as a driver allocation, from the calling thread: used
 * by the benchmarks to time capture without CUPTI in the loop. */
/* interpose.h's wrappers: a stream-ordered allocation (is_free 0) or free
 * that PyTorch just made on this thread; result is the runtime's. */
void mvz_capture_async(int is_free, int result, uint64_t address, uint64_t size, uint64_t stream);

/* allocator.h's wrappers: a block of PyTorch's caching allocator handed out
 * (is_free 0) or taken back on this thread. slot: the device, or -1 for the
 * current context's; stamp: a tick (clock.h's mvz_tick_as) read before the
 * allocator ran (0: now). */
void mvz_capture_block(int is_free, uint64_t address, uint64_t size, uint64_t stream, int slot,
                       uint64_t stamp);
/* The same, for an allocation on no stream, and for a free. */
void mvz_capture_block_alloc(uint64_t address, uint64_t size, int slot, uint64_t stamp);
void mvz_capture_block_free(uint64_t address);
/* Hot path (interpose.c's wrappers, no GIL): 1 while this thread runs the
 * real call from a wrapper, 0 after; the CUPTI callback then ignores that
 * call's own stream-ordered event. This thread's TLS only. */
void mvz_capture_set_inside(int on);
/* With the GIL: what this thread allocates from now on is memviz's own
 * (flagged MVZ_FLAG_MEMVIZ) while `on`; returns the previous setting. */
int mvz_capture_set_own(int on);

/* With the GIL, before wrappers that run after driver calls are installed. */
void mvz_capture_prepare_wrappers(void);

/* With the GIL: CUPTI callbacks of cuMemAllocAsync/cuMemFreeAsync on or off. */
int mvz_capture_async_callbacks(int on);

void mvz_capture_synthetic(uint64_t address, uint64_t size, int free_it);

#endif
