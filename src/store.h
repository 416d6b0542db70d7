/* The store: what memviz knows about memory, kept in C.
 *
 * Live allocations by address, interned stacks with per-stack aggregates,
 * per-device totals and peaks, the allocations live at each device's peak,
 * a bounded timeline of totals and the last failed allocations.
 *
 * Writers are the CUPTI callbacks (any thread, no GIL) and the activity
 * buffer callback; readers are the module's functions (with the GIL). All of
 * them take one leaf mutex, `store lock`, for a bounded time: nothing that
 * holds it calls Python, CUDA, CUPTI or malloc, or takes another lock, so it
 * cannot take part in a deadlock (docs/architecture.md, rule 1).
 */
#ifndef MEMVIZ_STORE_H
#define MEMVIZ_STORE_H

#include <stddef.h>
#include <stdint.h>

#define MVZ_MAX_DEPTH 256
#define MVZ_MAX_DEVICES 64
#define MVZ_HOST_SLOT MVZ_MAX_DEVICES     /* pinned host memory */
#define MVZ_NSLOTS (MVZ_MAX_DEVICES + 1)
#define MVZ_MAX_THREADS 4096
#define MVZ_FAILURES 256
#define MVZ_TIMELINE_POINTS 16384

enum mvz_kind {
    MVZ_KIND_DEVICE = 0,   /* cuMemAlloc and friends, stream-ordered pools */
    MVZ_KIND_HOST = 1,     /* pinned host memory */
    MVZ_KIND_MANAGED = 2,  /* cuMemAllocManaged */
    MVZ_KIND_STATIC = 3,   /* module globals (activity records) */
    MVZ_KIND_PHYSICAL = 4, /* cuMemCreate handles (virtual memory management) */
    MVZ_KIND_BLOCK = 5,    /* a block of PyTorch's caching allocator (allocator.h): it
                            * lies inside a segment the driver handed out, so it
                            * counts in the block totals, not the device's */
};

/* One Python frame as captured: the code object and the byte offset of the
 * instruction. With MVZ_FRAME_RESOLVED, `code` is instead a tuple
 * (filename, lineno, name, call) that memviz owns (made when the code object
 * died before it could be kept alive; `call` is a str or None). */
#define MVZ_FRAME_RESOLVED 1u
#define MVZ_FRAME_DYING 2u
typedef struct {
    void *code;
    int32_t offset;
    uint32_t flags;
} mvz_frame;

/* A live (or peak-time) allocation: 48 bytes. */
typedef struct {
    uint64_t address; /* device/host pointer, or the handle for PHYSICAL */
    uint64_t size;
    uint64_t stream;
    uint64_t timestamp; /* ns, strictly increasing across the store */
    uint32_t stack_id;  /* 0: no Python frames */
    uint32_t thread_idx;
    uint32_t label_id; /* 0: no label */
    int16_t slot;      /* device number, or MVZ_HOST_SLOT */
    uint8_t kind;
    uint8_t flags;
} mvz_alloc;

typedef struct {
    uint64_t current, peak, peak_timestamp;
    uint64_t allocs, frees, failed;
    uint64_t alloc_bytes; /* total bytes ever allocated */
    uint32_t live_count, peak_count;
    uint64_t window_peak; /* highest `current` since the last step mark */
} mvz_totals;

/* A stack whose live bytes or count changed since the last step mark. */
typedef struct {
    uint32_t stack_id;
    uint32_t live_count;
    uint64_t live_bytes;
    int64_t delta_bytes;
    int64_t delta_count;
} mvz_site_change;

/* Trace events, as written to a .memviz file: 32 bytes, little-endian. */
enum mvz_event_op {
    MVZ_EV_ALLOC = 1,
    MVZ_EV_FREE = 2,
    MVZ_EV_FAILED = 3, /* address holds the CUresult */
    MVZ_EV_TIME = 4,   /* address holds the absolute timestamp (ns) */
    MVZ_EV_GAP = 5,    /* address holds how many events were dropped */
};
#pragma pack(push, 1)
typedef struct {
    uint32_t ts_delta; /* ns since the previous event of the stream */
    uint8_t op;
    uint8_t kind;
    int8_t device; /* -1: pinned host memory */
    uint8_t flags;
    uint32_t stack_id;
    uint16_t thread_idx;
    uint16_t label_id;
    uint64_t address;
    uint64_t size;
} mvz_event;
#pragma pack(pop)
_Static_assert(sizeof(mvz_event) == 32, "trace events are 32 bytes");

typedef struct {
    uint32_t stack_id;
    uint32_t live_count;
    uint64_t live_bytes, peak_bytes, alloc_count, alloc_bytes;
} mvz_site;

typedef struct {
    uint64_t size, stream, timestamp;
    uint32_t stack_id, thread_idx, label_id;
    int32_t result;
    int16_t slot;
    uint8_t kind;
} mvz_failure;

typedef struct {
    uint64_t timestamp, total;
    int32_t slot;
} mvz_point;

typedef struct {
    int64_t native_id;
    uint64_t ident;  /* pthread_self(), which is threading.get_ident() */
    uint64_t serial; /* mvz_store_thread_serial() of that thread */
    char name[16];
} mvz_thread;

/* The thread index of every thread registered after the table filled up:
 * one row past it, which threads() names as such (counted in
 * dropped_threads), so that they are never taken for the table's last. */
#define MVZ_THREAD_OVERFLOW MVZ_MAX_THREADS

typedef struct {
    uint64_t live, stacks, frames, threads, unmatched_frees, dropped_allocs,
        dropped_stacks, dropped_threads, timeline_points, bytes_used, bytes_reserved, generation;
    uint32_t max_live;
} mvz_store_stats;

/* Lifetime (with the GIL). */
int mvz_store_init(size_t max_live, size_t max_stacks, size_t max_frames);
/* Whether mvz_store_init succeeded. */
int mvz_store_ready(void);
/* Forget everything recorded. Python references the store held (code
 * objects, resolved tuples) are returned through *refs / *nrefs (malloc'd)
 * for the caller to release after the lock is dropped. */
void mvz_store_clear(void ***refs, size_t *nrefs);

/* Hot path (any thread, no GIL). */
uint32_t mvz_store_thread_index(void);
/* This thread's serial: 1, 2, ... in the order threads first ask, never
 * reused within the process (glibc reuses pthread_self() values, and the
 * kernel thread ids, of threads that ended). */
uint64_t mvz_store_thread_serial(void);
/* Returns the allocation's stack id (0: no frames, or not recorded). */
uint32_t mvz_store_alloc(uint64_t address, uint64_t size, uint64_t stream, int slot,
                         int kind, uint32_t label_id, const mvz_frame *frames, int depth);
/* As mvz_store_alloc, dated `stamp` (a value mvz_store_stamp returned
 * earlier on this thread; 0: now). A block is dated when it was asked for,
 * so that the segment the allocator created for it, recorded in between,
 * never makes a peak the block is missing from. Such dates are not unique
 * (store timestamps otherwise are). */
uint32_t mvz_store_alloc_at(uint64_t stamp, uint64_t address, uint64_t size, uint64_t stream,
                            int slot, int kind, uint32_t label_id, const mvz_frame *frames,
                            int depth);
/* The store's clock now (no lock, no allocation). */
uint64_t mvz_store_stamp(void);
void mvz_store_free(uint64_t address, int kind);
void mvz_store_failure(uint64_t size, uint64_t stream, int slot, int kind, uint32_t label_id,
                       int result, const mvz_frame *frames, int depth);

/* Readers (with the GIL). Each copies under the lock into a malloc'd array
 * the caller frees; they return the count, or -1 when out of memory. */
long mvz_store_live(mvz_alloc **out);
long mvz_store_peak_live(int slot, mvz_alloc **out);
long mvz_store_sites(mvz_site **out);
long mvz_store_failures(mvz_failure **out);
long mvz_store_timeline(mvz_point **out);
long mvz_store_threads(mvz_thread **out);
void mvz_store_totals(mvz_totals out[MVZ_NSLOTS]);
/* The same figures for PyTorch's blocks alone (kind MVZ_KIND_BLOCK). */
void mvz_store_block_totals(mvz_totals out[MVZ_NSLOTS]);
void mvz_store_get_stats(mvz_store_stats *out);

/* Stacks (with the GIL). `adopt` receives each code object of stacks seen
 * since the last call so the caller can take a reference (Py_INCREF only; it
 * runs under the store lock). */
void mvz_store_adopt_pending(void (*adopt)(void *code));
int mvz_store_has_pending(void);
/* Copy the frames of stack `id` (at most `cap`); returns the depth or -1. */
int mvz_store_stack_frames(uint32_t id, mvz_frame *out, int cap);
/* Code-object death (module.c's watcher): mark pending frames of `code` as
 * dying and return how many there are. */
size_t mvz_store_mark_dying(void *code);
/* Replace each dying frame of `code` at `offset` by `resolved(offset)`. */
void mvz_store_resolve_dying(void *code, void *(*resolve)(void *code, int32_t offset));

/* Step marks (with the GIL): per-device window peaks restart at the current
 * value and the stacks whose live memory changed since the previous mark are
 * copied out (malloc'd; the caller frees). Returns the count or -1. */
long mvz_store_step_mark(mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes);

/* With the GIL, never on the capture path: the peaks of window w (-1: the
 * store's, PyTorch's blocks' too) restart at the current figures, as if
 * every device had peaked now; the peak sets become what is live now.
 * Returns 0, or -1 for a window that is not open. */
int mvz_store_reset_peak(int w);

/* Trace events: while on, every alloc/free/failure is also appended to a
 * bounded ring (preallocated; when full, events are counted as dropped and a
 * GAP record marks the hole). Drain encodes them as mvz_event records into a
 * malloc'd buffer (the caller frees) and returns its length, or -1. */
int mvz_store_trace_enable(size_t capacity);
void mvz_store_trace_disable(void);
long mvz_store_trace_drain(uint8_t **out);
/* The native writer's calls (trace_writer.c, no GIL): events held now
 * (relaxed read), the ring's size, and taking at most `room` of the oldest
 * (raw, mvz_raw_event of trace_ring.h) with the dropped count, under the
 * lock for one copy. */
size_t mvz_store_trace_pending(void);
size_t mvz_store_trace_capacity(void);
struct mvz_raw_event_s;
size_t mvz_store_trace_take(struct mvz_raw_event_s *out, size_t room, uint64_t *dropped);
uint32_t mvz_store_stack_count(void);

/* Windows: trackers nested in a running one (with the GIL). A window counts
 * what the store records after it opened as if the store had been cleared
 * then: its own totals, peak, peak set and timeline. Allocations live when it
 * opened are not the window's, so their frees do not count in it. At most
 * MVZ_MAX_WINDOWS are open at once; the capture path pays a few additions per
 * open window. */
#define MVZ_MAX_WINDOWS 32
#define MVZ_WINDOW_POINTS 4096
/* Returns the id of a newly opened window, or -1 when all are open. *start is
 * its opening timestamp (it holds the allocations made strictly after it) and
 * at_open[] the store's totals at that moment. */
int mvz_store_window_open(uint64_t *start, mvz_totals at_open[MVZ_NSLOTS]);
void mvz_store_window_close(int w);
/* As mvz_store_totals / _peak_live / _timeline / _step_mark, for window w.
 * They return -1 for a window that is not open (or when out of memory). The
 * step mark's per-stack changes are the store's, shared by all windows. */
int mvz_store_window_totals(int w, mvz_totals out[MVZ_NSLOTS]);
long mvz_store_window_peak_live(int w, int slot, mvz_alloc **out);
long mvz_store_window_timeline(int w, mvz_point **out);
long mvz_store_window_step_mark(int w, mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes);
/* Everything a tracker reads, copied at one instant (so the copy adds up
 * while other threads go on allocating): of window w, or of the store with
 * w = -1. With `close`, window w closes in the same instant. The buffers are
 * malloc'd (the caller frees them); returns 0, or -1 when out of memory or w
 * is not open. */
typedef struct {
    mvz_alloc *live;     /* the window's live allocations */
    mvz_alloc *peaks;    /* the allocations live at their device's peak, every device */
    mvz_point *timeline;
    size_t nlive, npeaks, ntimeline;
    mvz_totals totals[MVZ_NSLOTS];
    uint64_t when; /* the store timestamp of the copy */
} mvz_store_copy_t;
int mvz_store_copy(int w, int close, mvz_store_copy_t *out);

/* Fork support: the child starts with the lock free and the store empty of
 * in-flight state. */
void mvz_store_atfork_prepare(void);
void mvz_store_atfork_parent(void);
void mvz_store_atfork_child(void);

#endif
