/* The core's plain types and limits: the bottom floor of src/ (no
 * functions, no state). Every file that needs a type but none of the store's
 * functions includes this, not store.h; the allocation record itself is
 * record.h's, the store's own figures store_types.h's. */
#ifndef MEMVIZ_TYPES_H
#define MEMVIZ_TYPES_H

#include <stddef.h>
#include <stdint.h>

/* A function of the capture path (what an allocation or a free runs on the
 * allocating thread): all of them in one stretch of the text, whichever file
 * they are in (the linker puts every .text.hot.* section together). Between
 * two events PyTorch runs microseconds of its own code, so an event finds
 * memviz's code out of the first-level instruction cache; spread over the
 * library it also spans a page per file (issue 27, RESULTS.md). */
#if defined(__ELF__)
#define MVZ_HOT __attribute__((section(".text.hot.mvz")))
#else
#define MVZ_HOT /* Mach-O and others: sections are named otherwise; left where they are */
#endif

/* A count some thread reads without the lock that guards its writes (to
 * size a buffer before taking the lock, or to decide whether to take it):
 * its writer, holding that lock, stores it as an atomic. Relaxed: on
 * x86-64 a plain store, but one the compiler may not tear or merge, and
 * one the C11 memory model (and ThreadSanitizer) sees as no data race. */
#define MVZ_SET_PEEKED(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)

#define MVZ_MAX_DEPTH 256
#define MVZ_MAX_DEVICES 64
#define MVZ_HOST_SLOT MVZ_MAX_DEVICES     /* pinned host memory */
#define MVZ_NSLOTS (MVZ_MAX_DEVICES + 1)
#define MVZ_MAX_THREADS 4096
#define MVZ_FAILURES 256
#define MVZ_TIMELINE_POINTS 16384
#define MVZ_MAX_WINDOWS 32     /* trackers nested in a running one (store.h) */
#define MVZ_WINDOW_POINTS 4096

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
    uint64_t block_bytes; /* of live_bytes, PyTorch's blocks */
    int64_t block_delta;  /* change of block_bytes since the last step mark */
} mvz_site_change;


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

#endif
