/* The CUPTI driver callback: the only code that runs inside other
 * libraries' cudaMalloc. Everything it calls is within the budget of
 * docs/architecture.md, rule 1: field reads of this thread's frames,
 * thread-local reads, atomics and the store's leaf lock. No GIL, no Python
 * API, no malloc, no CUDA call.
 *
 * Calls down only: store, frames, nodes, labels, seqmap, cupti, clock. The
 * wrappers above it (interpose.c, allocator.c) call in through
 * mvz_capture_async / mvz_capture_block / mvz_capture_set_inside.
 */
#define _GNU_SOURCE
#include "capture.h"
#include "hot.h"
#include "cupti.h"
#include "frames.h"
#include "clock.h"
#include "labels.h"
#include "nodes.h"
#include "seqmap.h"
#include "store.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const mvz_capture_op_names[MVZ_OP_COUNT] = {
    "alloc",  "alloc_async", "alloc_managed", "alloc_host",   "create",
    "free",   "free_async",  "free_host",     "release",      "map",
    "unmap",  "reserve",     "address_free",  "pool_trim",    "failed",
    "static_alloc", "static_free", "activity_records", "block_alloc", "block_free",
};

static const uint32_t memory_cbids[] = {
    MVZ_CBID_cuMemAlloc_v2,          MVZ_CBID_cuMemAllocPitch_v2,
    MVZ_CBID_cuMemFree_v2,           MVZ_CBID_cuMemAllocAsync,
    MVZ_CBID_cuMemAllocAsync_ptsz,   MVZ_CBID_cuMemFreeAsync,
    MVZ_CBID_cuMemFreeAsync_ptsz,    MVZ_CBID_cuMemAllocFromPoolAsync,
    MVZ_CBID_cuMemAllocFromPoolAsync_ptsz, MVZ_CBID_cuMemCreate,
    MVZ_CBID_cuMemRelease,           MVZ_CBID_cuMemMap,
    MVZ_CBID_cuMemUnmap,             MVZ_CBID_cuMemAllocManaged,
    MVZ_CBID_cuMemHostAlloc,         MVZ_CBID_cuMemAllocHost_v2,
    MVZ_CBID_cuMemFreeHost,          MVZ_CBID_cuMemPoolTrimTo,
    MVZ_CBID_cuMemAddressReserve,    MVZ_CBID_cuMemAddressFree,
};
#define N_CBIDS (sizeof memory_cbids / sizeof memory_cbids[0])

/* On, with the allocator route's capture path timed (capture_block_timed). */
#define CAPTURING_TIMED 2
/* On, with the allocator route's capture path returning at once (a
 * benchmark's, mvz_capture_noop: the route's wrappers and everything around
 * them, without recording). */
#define CAPTURING_NOOP 3
/* Recordings under way (record()): stop waits for them, so that once it
 * returns nothing more reaches the store. Two ways of counting them:
 *  - per thread (busy[]), with no atomic read-modify-write and no fence on
 *    the capture path: stop() pays instead, with one membarrier() that runs
 *    a full memory barrier on every thread of the process, between its
 *    clearing `mvz_hot.capturing` and its reading the counters (an asymmetric
 *    Dekker: a recording either sees mvz_hot.capturing off, or its counter was set
 *    before that barrier and stop sees it). Used once membarrier's private
 *    expedited command is registered (`mvz_hot.fenced`, Linux 4.14 and later);
 *  - one shared counter (inflight), a locked add and a sequentially
 *    consistent load a recording: where membarrier is missing or refused
 *    (a seccomp filter), and for threads beyond BUSY_SLOTS.
 * stop() always waits for both. Each counter has its own cache line: the
 * shared one bounced between every recording thread's cores. */
static int inflight __attribute__((aligned(64)));
#define BUSY_SLOTS 1024
typedef struct {
    int n; /* written only by its thread (relaxed stores), read by stop() */
    char pad[60];
} busy_slot;
static busy_slot busy[BUSY_SLOTS] __attribute__((aligned(64)));
static int busy_used; /* slots handed out; atomic, never reset (threads keep theirs) */
/* This thread's slot + 1 is mvz_tl.busy (hot.h); 0: none yet; -1: none left. */
static mvz_CUpti_SubscriberHandle subscriber;
static uint64_t counts[MVZ_OP_COUNT];
static int activity_on;
/* 1 while CUPTI's callbacks record: the segment wrappers stay quiet then. */
static int cupti_held;

/* Benchmark-only self-measurement, asked for only through the test hook
 * _core._callback_profile (mvz_capture_set_profile; no environment variable
 * reaches it) and read at the next start: MVZ_PROFILE_TIME adds the
 * callback's own wall time to a counter, MVZ_PROFILE_NOOP returns at once so
 * that CUPTI's cost can be told from memviz's, and MVZ_PROFILE_NOASYNC
 * leaves the stream-ordered cbids off (precise-mode allocations go unseen)
 * to tell CUPTI's per-callback cost from its subscription's. Not on the
 * capture path: start subscribes the plain callback (on_driver_call) unless
 * a mode that times or skips it was asked for. */
static int profile_request; /* with the GIL: the hook's, for the next start */
static int profile_mode;    /* this capture's, set at start */
static uint64_t profile_calls, profile_ns;

/* ---- this thread's label (labels.h has the table) ---------------------- */

/* 1 while this thread runs a real call from interpose.c's wrappers. */
static __thread int tl_inside __attribute__((tls_model("initial-exec")));
/* mvz_tl.own: this thread is inside memviz's own work (the allocator route's
 * probe): what it allocates is memviz's (MVZ_FLAG_MEMVIZ), not the user's
 * line. mvz_tl.label: its label. */

/* Thread-local, initial-exec: reading it is one load from this thread's
 * own TLS block, safe in the callback. */
uint32_t mvz_capture_label_get(void) { return mvz_tl.label; }

/* A node label set from Python inside a node (a saved tensor's unpack hook
 * names its pack line) holds only while that same node runs: the callback
 * otherwise names the node it finds itself (nodes.h). */
static __thread const void *tl_label_node __attribute__((tls_model("initial-exec")));
static __thread uint64_t tl_label_seq __attribute__((tls_model("initial-exec")));

void mvz_capture_label_set(uint32_t id)
{
    mvz_tl.label = id;
    const void *node = mvz_labels_is_node(id) ? mvz_nodes_current() : NULL;
    tl_label_node = node;
    tl_label_seq = mvz_nodes_seq(node);
}

/* Hot path, no GIL: this thread's label for an allocation made now. Inside
 * an autograd node (when nodes.c is attached), the node's class label, with
 * *seq its number and *line 1: the store adds the node's forward line as it
 * applies the allocation (the seqmap's note for that number is applied
 * before it, in claim order), so this thread reads neither the seqmap nor
 * waits for the queue. A node label Python set during this very node is
 * taken as it is (*line 0). */
static inline __attribute__((always_inline)) uint32_t current_label(const void *node, int *line,
                                                                   uint64_t *seq)
{
    uint32_t lab = mvz_tl.label;
    *line = 0;
    if (!node)
        return lab;
    uint64_t s = mvz_nodes_seq(node);
    if (lab && mvz_labels_is_node(lab) && tl_label_node == node && tl_label_seq == s)
        return lab;
    uint32_t id = mvz_nodes_class_label(node);
    if (!id)
        return lab;
    *line = 1;
    *seq = s;
    return id;
}

/* ---- devices ---------------------------------------------------------- */

#define CTX_CACHE 64
static void *ctx_keys[CTX_CACHE];
static int ctx_devices[CTX_CACHE];
#define CTX_CLAIMED ((void *)1)

/* Hot path, no GIL: a lock-free lookup of context -> device. On a miss it
 * asks CUPTI (cuptiGetDeviceId, no driver call is traced) and publishes the
 * answer with a compare-and-swap; a lost race only repeats the question.
 * With more than CTX_CACHE contexts the rest are asked for every time. */
static int device_of(void *ctx)
{
    if (ctx == NULL)
        return 0;
    for (int i = 0; i < CTX_CACHE; i++) {
        void *k = __atomic_load_n(&ctx_keys[i], __ATOMIC_ACQUIRE);
        if (k == ctx)
            return __atomic_load_n(&ctx_devices[i], __ATOMIC_RELAXED);
        if (k == NULL)
            break;
    }
    uint32_t dev = 0;
    if (!mvz_cupti_api.GetDeviceId || mvz_cupti_api.GetDeviceId(ctx, &dev) != MVZ_CUPTI_SUCCESS)
        return 0;
    /* Claim an empty slot with a sentinel, fill in the device, then publish
     * the key, so a reader that sees the key also sees its device. */
    for (int i = 0; i < CTX_CACHE; i++) {
        void *expected = NULL;
        if (__atomic_compare_exchange_n(&ctx_keys[i], &expected, CTX_CLAIMED, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            __atomic_store_n(&ctx_devices[i], (int)dev, __ATOMIC_RELAXED);
            __atomic_store_n(&ctx_keys[i], ctx, __ATOMIC_RELEASE);
            break;
        }
        if (expected == ctx)
            break;
    }
    return (int)dev;
}

/* ---- the callback ----------------------------------------------------- */

static inline void count(int op) { __atomic_fetch_add(&counts[op], 1, __ATOMIC_RELAXED); }

typedef struct {
    int op;
    int kind;
    int is_free;
    uint64_t address, size, stream;
} decoded;

/* Hot path, no GIL: pure reads of CUPTI's parameter struct. Returns 0 for
 * calls that are not memory (reservations, maps, trims: counted only). */
static int decode(uint32_t cbid, const void *p, int ok, decoded *d)
{
    memset(d, 0, sizeof *d);
    d->kind = MVZ_KIND_DEVICE;
    switch (cbid) {
    case MVZ_CBID_cuMemAlloc_v2: {
        const mvz_cuMemAlloc_v2_params *q = p;
        d->op = MVZ_OP_ALLOC;
        d->size = q->bytesize;
        d->address = ok && q->dptr ? *q->dptr : 0;
        return 1;
    }
    case MVZ_CBID_cuMemAllocPitch_v2: {
        const mvz_cuMemAllocPitch_v2_params *q = p;
        d->op = MVZ_OP_ALLOC;
        size_t pitch = ok && q->pPitch ? *q->pPitch : q->WidthInBytes;
        d->size = (uint64_t)pitch * q->Height;
        d->address = ok && q->dptr ? *q->dptr : 0;
        return 1;
    }
    case MVZ_CBID_cuMemAllocAsync:
    case MVZ_CBID_cuMemAllocAsync_ptsz: {
        const mvz_cuMemAllocAsync_params *q = p;
        d->op = MVZ_OP_ALLOC_ASYNC;
        d->size = q->bytesize;
        d->stream = (uint64_t)(uintptr_t)q->hStream;
        d->address = ok && q->dptr ? *q->dptr : 0;
        return 1;
    }
    case MVZ_CBID_cuMemAllocFromPoolAsync:
    case MVZ_CBID_cuMemAllocFromPoolAsync_ptsz: {
        const mvz_cuMemAllocFromPoolAsync_params *q = p;
        d->op = MVZ_OP_ALLOC_ASYNC;
        d->size = q->bytesize;
        d->stream = (uint64_t)(uintptr_t)q->hStream;
        d->address = ok && q->dptr ? *q->dptr : 0;
        return 1;
    }
    case MVZ_CBID_cuMemAllocManaged: {
        const mvz_cuMemAllocManaged_params *q = p;
        d->op = MVZ_OP_ALLOC_MANAGED;
        d->kind = MVZ_KIND_MANAGED;
        d->size = q->bytesize;
        d->address = ok && q->dptr ? *q->dptr : 0;
        return 1;
    }
    case MVZ_CBID_cuMemHostAlloc: {
        const mvz_cuMemHostAlloc_params *q = p;
        d->op = MVZ_OP_ALLOC_HOST;
        d->kind = MVZ_KIND_HOST;
        d->size = q->bytesize;
        d->address = ok && q->pp ? (uint64_t)(uintptr_t)*q->pp : 0;
        return 1;
    }
    case MVZ_CBID_cuMemAllocHost_v2: {
        const mvz_cuMemAllocHost_v2_params *q = p;
        d->op = MVZ_OP_ALLOC_HOST;
        d->kind = MVZ_KIND_HOST;
        d->size = q->bytesize;
        d->address = ok && q->pp ? (uint64_t)(uintptr_t)*q->pp : 0;
        return 1;
    }
    case MVZ_CBID_cuMemCreate: {
        const mvz_cuMemCreate_params *q = p;
        d->op = MVZ_OP_CREATE;
        d->kind = MVZ_KIND_PHYSICAL;
        d->size = q->size;
        d->address = ok && q->handle ? *q->handle : 0;
        return 1;
    }
    case MVZ_CBID_cuMemFree_v2: {
        const mvz_cuMemFree_v2_params *q = p;
        d->op = MVZ_OP_FREE;
        d->is_free = 1;
        d->address = q->dptr;
        return 1;
    }
    case MVZ_CBID_cuMemFreeAsync:
    case MVZ_CBID_cuMemFreeAsync_ptsz: {
        const mvz_cuMemFreeAsync_params *q = p;
        d->op = MVZ_OP_FREE_ASYNC;
        d->is_free = 1;
        d->address = q->dptr;
        d->stream = (uint64_t)(uintptr_t)q->hStream;
        return 1;
    }
    case MVZ_CBID_cuMemFreeHost: {
        const mvz_cuMemFreeHost_params *q = p;
        d->op = MVZ_OP_FREE_HOST;
        d->kind = MVZ_KIND_HOST;
        d->is_free = 1;
        d->address = (uint64_t)(uintptr_t)q->p;
        return 1;
    }
    case MVZ_CBID_cuMemRelease: {
        const mvz_cuMemRelease_params *q = p;
        d->op = MVZ_OP_RELEASE;
        d->kind = MVZ_KIND_PHYSICAL;
        d->is_free = 1;
        d->address = q->handle;
        return 1;
    }
    case MVZ_CBID_cuMemMap: d->op = MVZ_OP_MAP; return 0;
    case MVZ_CBID_cuMemUnmap: d->op = MVZ_OP_UNMAP; return 0;
    case MVZ_CBID_cuMemAddressReserve: d->op = MVZ_OP_RESERVE; return 0;
    case MVZ_CBID_cuMemAddressFree: d->op = MVZ_OP_ADDRESS_FREE; return 0;
    case MVZ_CBID_cuMemPoolTrimTo: d->op = MVZ_OP_POOL_TRIM; return 0;
    default: d->op = -1; return 0;
    }
}

static void record_call(int domain, uint32_t cbid, const void *data);

/* The entry point CUPTI calls; see record_call for why it is GIL-free. */
static void on_driver_call(void *userdata, int domain, uint32_t cbid, const void *data)
{
    (void)userdata;
    record_call(domain, cbid, data);
}

/* The entry point under a benchmark's profile (MVZ_PROFILE_TIME or _NOOP,
 * subscribed instead of on_driver_call): GIL-free as record_call is, plus
 * relaxed atomic adds and a clock read (no lock, no allocation). */
static void on_driver_call_profiled(void *userdata, int domain, uint32_t cbid, const void *data)
{
    (void)userdata;
    __atomic_fetch_add(&profile_calls, 1, __ATOMIC_RELAXED);
    if (__atomic_load_n(&profile_mode, __ATOMIC_RELAXED) == MVZ_PROFILE_NOOP)
        return;
    uint64_t t0 = mvz_now_ns();
    record_call(domain, cbid, data);
    __atomic_fetch_add(&profile_ns, mvz_now_ns() - t0, __ATOMIC_RELAXED);
}

/* Runs on whichever thread made the driver call, possibly holding other
 * libraries' locks (PyTorch's allocator mutex), with or without the GIL.
 * Safe because it only reads this thread's frames (frames.c), reads
 * thread-local state (its own and, read-only, PyTorch's current autograd
 * node: nodes.c), takes the store's leaf lock (store.h) and, once per new
 * node label, nodes.c's and the label table's leaf locks, and notes the
 * autograd node counter lock-free (seqmap.c). */
static void record(const decoded *d, int result, int slot, uint64_t stamp);

static void record_call(int domain, uint32_t cbid, const void *data)
{
    const mvz_CUpti_CallbackData *cb = data;
    if (domain != MVZ_CUPTI_CB_DOMAIN_DRIVER_API || cb->callbackSite != MVZ_CUPTI_API_EXIT)
        return;
    if (!__atomic_load_n(&mvz_hot.capturing, __ATOMIC_ACQUIRE))
        return;
    int result = cb->functionReturnValue ? *(const int *)cb->functionReturnValue : 0;
    decoded d;
    int is_memory = decode(cbid, cb->functionParams, result == 0, &d);
    if (d.op < 0)
        return;
    if (!is_memory) {
        if (result == 0)
            count(d.op);
        return;
    }
    if ((d.op == MVZ_OP_ALLOC_ASYNC || d.op == MVZ_OP_FREE_ASYNC) && tl_inside)
        return; /* the wrapper around this very call records it (interpose.h) */
    record(&d, result, d.kind == MVZ_KIND_HOST ? MVZ_HOST_SLOT : device_of(cb->context), 0);
}

/* Hot path, no GIL, any thread: the common tail of the CUPTI callback and
 * the stream-ordered wrappers (interpose.c). Same guarantees as
 * record_call: this thread's frames and TLS, leaf locks only. */
static inline __attribute__((always_inline)) void record_body(const decoded *dp, int result,
                                                              int slot, uint64_t stamp);

/* Hot path, no GIL: this thread's recording counter (busy[] above), given
 * out once per thread by an atomic add; NULL when membarrier is not in use
 * or the slots are all taken (the shared counter then). Touches only this
 * thread's TLS and the slot it owns. */
static __attribute__((noinline, cold)) int *busy_claim(void);

static inline __attribute__((always_inline)) int *busy_counter(void)
{
    if (!__atomic_load_n(&mvz_hot.fenced, __ATOMIC_ACQUIRE))
        return NULL;
    int s = mvz_tl.busy;
    if (__builtin_expect(s > 0, 1))
        return &busy[s - 1].n;
    return s < 0 ? NULL : busy_claim();
}

/* Capture path, no GIL: this thread's first recording takes its slot (out
 * of line: once per thread). Sequentially consistent, so that a thread that
 * takes its slot after stop() read busy_used also reads capturing after it. */
static __attribute__((noinline, cold)) int *busy_claim(void)
{
    int i = __atomic_fetch_add(&busy_used, 1, __ATOMIC_SEQ_CST);
    if (i >= BUSY_SLOTS) {
        mvz_tl.busy = -1;
        return NULL;
    }
    mvz_tl.busy = i + 1;
    return &busy[i].n;
}

/* Hot path, no GIL: a free goes straight to the queue (the store knows
 * the device of what it frees); an allocation to record_body. Inlined into
 * each caller, so that a caller whose event is known (a block's free) keeps
 * only its own branch. */
static inline __attribute__((always_inline)) void record_event(const decoded *dp, int result,
                                                               int slot, uint64_t stamp)
{
    if (dp->is_free) {
        MVZ_STAGE(MVZ_ST_F_ENTER);
        if (result == 0) /* counted as the store applies it */
            mvz_store_enqueue_free(dp->address, dp->kind, dp->op);
        return;
    }
    record_body(dp, result, slot, stamp);
}

static void record_unfenced(int op, int kind, int is_free, uint64_t address, uint64_t size,
                            uint64_t stream, int result, int slot, uint64_t stamp);

static inline __attribute__((always_inline)) void record(const decoded *dp, int result, int slot,
                                                         uint64_t stamp)
{
    int *mine = busy_counter();
    if (mine) {
        /* Only this thread writes *mine; a count, not a flag, in case a
         * recording ever nests. The compiler fence keeps the store before
         * the load; stop()'s membarrier orders them for the CPU. */
        int was = __atomic_load_n(mine, __ATOMIC_RELAXED);
        __atomic_store_n(mine, was + 1, __ATOMIC_RELAXED);
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        if (__atomic_load_n(&mvz_hot.capturing, __ATOMIC_RELAXED))
            record_event(dp, result, slot, stamp);
        __atomic_store_n(mine, was, __ATOMIC_RELEASE);
        return;
    }
    record_unfenced(dp->op, dp->kind, dp->is_free, dp->address, dp->size, dp->stream, result, slot,
                    stamp);
}

/* Capture path, no GIL: record()'s fallback, out of line, where membarrier
 * is refused (a seccomp filter, a kernel before 4.14) or this thread found
 * no slot left. Sequentially consistent both here and in mvz_capture_stop:
 * either this sees capturing off and backs out, or stop sees this
 * recording and waits for it (no lock, no waiting on this side). */
static __attribute__((noinline)) void record_unfenced(int op, int kind, int is_free,
                                                           uint64_t address, uint64_t size,
                                                           uint64_t stream, int result, int slot,
                                                           uint64_t stamp)
{
    decoded d = {op, kind, is_free, address, size, stream}; /* passed in registers: see record */
    __atomic_fetch_add(&inflight, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&mvz_hot.capturing, __ATOMIC_SEQ_CST))
        record_event(&d, result, slot, stamp);
    __atomic_fetch_sub(&inflight, 1, __ATOMIC_RELEASE);
}

static inline void queue_alloc(const decoded *dp, int slot, uint32_t lab, uint32_t thread_idx,
                               uint64_t note, int line, int tsc, uint64_t clock, uint64_t stamp,
                               const mvz_frame *f, int depth, int kept);
static void queue_alloc_unbuffered(int op, int kind, uint64_t address, uint64_t size,
                                   uint64_t stream, int slot, uint32_t lab, uint32_t thread_idx,
                                   uint64_t note, int line, int tsc, uint64_t clock,
                                   uint64_t stamp, int limit);

/* Capture path, no GIL: a failed allocation (rare, and read at once):
 * recorded under the store's lock, out of the hot path's line. */
static __attribute__((noinline, cold)) void record_failure(uint64_t size, uint64_t stream, int kind,
                                                          int result, int slot, int limit,
                                                          const void *node, uint32_t lab, int line)
{
    if (line) { /* the forward line now: its note applied first */
        mvz_store_sync();
        uint32_t full = mvz_nodes_label(node);
        lab = full ? full : lab;
    }
    mvz_frame frames[MVZ_MAX_DEPTH];
    int depth = mvz_frames_capture(frames, limit);
    count(MVZ_OP_FAILED);
    mvz_store_failure(size, stream, slot, kind, lab, result, frames, depth);
}

/* Hot path, no GIL: an allocation (record_event). Inlined into each entry
 * point, so that the event's fields stay in registers (a block's kind and
 * operation are constants there) instead of a struct on the stack. */
static inline __attribute__((always_inline)) void record_body(const decoded *dp, int result,
                                                              int slot, uint64_t stamp)
{
    decoded d = *dp;
    MVZ_STAGE(MVZ_ST_A_ENTER);
    int limit = __atomic_load_n(&mvz_hot.depth_limit, __ATOMIC_RELAXED);
    /* (an ablation build may leave the node, its label and number out: store.h) */
    const void *node = mvz_ablated(MVZ_PF_NO_NODE) ? NULL : mvz_nodes_current();
    int line;
    uint64_t node_seq = 0;
    uint32_t lab = current_label(node, &line, &node_seq);
    MVZ_STAGE(MVZ_ST_A_LABEL);
    if (__builtin_expect(result != 0 || d.address == 0, 0)) {
        record_failure(d.size, d.stream, d.kind, result, slot, limit, node, lab, line);
        return;
    }
    uint32_t thread_idx = mvz_store_thread_index();
    /* not inside a backward node: the autograd node this line may have just
     * made (noted once the store has interned the stack, seqmap.h) */
    uint64_t note = !node && !mvz_labels_is_node(lab) && !mvz_ablated(MVZ_PF_NO_NODE)
                        ? mvz_seqmap_next() : 0;
    if (line) /* the node's own number, for the store's forward line (MVZ_CAPQ_NODE_LINE) */
        note = node_seq;
    int tsc = mvz_tick_is_tsc(); /* the stamp's kind too (clock.h) */
#ifdef MVZ_ABLATE /* no clock read: the tick stays 0 (an ablation build's, store.h) */
    uint64_t clock = stamp || mvz_ablated(MVZ_PF_NO_TICK) ? stamp : mvz_tick_as(tsc);
#else /* the same line folded would lay the clock's branch out otherwise */
    uint64_t clock = stamp ? stamp : mvz_tick_as(tsc);
#endif
    /* Everything that may take a lock is done. The stack is walked into
     * this thread's own buffer; the queue gets the frames that changed
     * since this thread's last allocation (store.c), and from the claim to
     * the publish only that copy is made (a reader that reaches this entry
     * waits for it meanwhile). The store joins, hashes and interns the
     * frames when it applies the entry. */
    MVZ_STAGE(MVZ_ST_A_NOTE);
    mvz_walk w;
    mvz_frame *walk = mvz_store_walk_begin(thread_idx, &w);
    if (walk == NULL) { /* a thread the store could not register: all its frames */
        queue_alloc_unbuffered(d.op, d.kind, d.address, d.size, d.stream, slot, lab, thread_idx, note,
                               line, tsc, clock, stamp, limit);
        return;
    }
    int kept = -1, depth;
    if (__builtin_expect(w.nwhere != 0, 0)) /* the walk's prefetch (a benchmark's) */
        depth = mvz_frames_capture_at(walk, limit, w.where, w.nwhere);
    else /* compared with the last stack as it walks */
        depth = mvz_frames_capture_cmp(walk, limit, w.last, w.m, &kept);
    MVZ_STAGE(MVZ_ST_A_WALK);
    queue_alloc(&d, slot, lab, thread_idx, note, line, tsc, clock, stamp, walk, depth, kept);
}

/* Capture path, no GIL: record_body's allocation, queued from the stack
 * f[0..depth) just walked (only this thread's buffers, the queue's room
 * and its own TLS are written). */
static inline __attribute__((always_inline)) void
queue_alloc(const decoded *dp, int slot, uint32_t lab, uint32_t thread_idx, uint64_t note, int line,
            int tsc, uint64_t clock, uint64_t stamp, const mvz_frame *f, int depth, int kept)
{
    const decoded d = *dp;
    uint64_t pos;
    mvz_capq_entry *e = mvz_store_enqueue_alloc(thread_idx, f, depth, kept, &pos);
    e->what = (uint8_t)(MVZ_CAPQ_ALLOC | (stamp ? MVZ_CAPQ_STAMPED : 0) | (tsc ? MVZ_CAPQ_TSC : 0) |
                        (line ? MVZ_CAPQ_NODE_LINE : 0));
    e->address = d.address;
    e->size = d.size;
    e->stream = d.stream;
    e->clock = clock;
    e->label_id = lab; /* thread_idx: set by the store with the frames */
    e->slot = (int8_t)(slot < 0 || slot >= MVZ_NSLOTS ? MVZ_HOST_SLOT : slot);
    e->op = (uint8_t)d.op; /* counted as the store applies it */
    MVZ_STORE_BYTES_APART();
    e->kind = (uint8_t)d.kind;
    e->flags = mvz_tl.own ? MVZ_FLAG_MEMVIZ : 0;
    e->seq_note = line || depth > 0 ? note : 0;
    MVZ_STAGE(MVZ_ST_A_FILL);
    mvz_store_publish(e, pos);
    MVZ_STAGE(MVZ_ST_A_PUBLISH);
}

/* Capture path, no GIL: as queue_alloc, for a thread past the store's
 * thread table (rare): walked on this stack. */
static __attribute__((noinline, cold)) void
queue_alloc_unbuffered(int op, int kind, uint64_t address, uint64_t size, uint64_t stream, int slot,
                       uint32_t lab, uint32_t thread_idx, uint64_t note, int line, int tsc,
                       uint64_t clock, uint64_t stamp, int limit)
{
    decoded d = {op, kind, 0, address, size, stream};
    mvz_frame frames[MVZ_MAX_DEPTH];
    int depth = mvz_frames_capture(frames, limit);
    queue_alloc(&d, slot, lab, thread_idx, note, line, tsc, clock, stamp, frames, depth, -1);
}

static int (*ctx_get_current)(void **ctx); /* libcuda's cuCtxGetCurrent, when loaded */

/* Hot path, no GIL, run after a driver call returned (the wrappers' paths):
 * the device of this thread's current context, the one the runtime just
 * allocated on: one cuCtxGetCurrent (a thread-local read) or, without
 * libcuda at hand, CUPTI's answer. Calling the driver here cannot re-enter
 * it, unlike inside a CUPTI callback. */
static int current_slot(void)
{
    void *ctx = NULL;
    uint32_t dev = 0;
    int (*get)(void **) = __atomic_load_n(&ctx_get_current, __ATOMIC_ACQUIRE);
    if (get && get(&ctx) == 0 && ctx)
        return device_of(ctx);
    if (mvz_cupti_api.GetDeviceId && mvz_cupti_api.GetDeviceId(NULL, &dev) == MVZ_CUPTI_SUCCESS)
        return (int)dev;
    return 0;
}

/* Hot path, no GIL: this thread's own TLS (interpose.c's wrappers set it
 * around the real call; record_call reads it). */
void mvz_capture_set_inside(int on) { tl_inside = on; }

/* With the GIL, this thread's own TLS: memviz's own work begins or ends. */
int mvz_capture_set_own(int on)
{
    int was = mvz_tl.own;
    mvz_tl.own = on;
    return was;
}

/* The wrappers' path (interpose.c): a cudaMallocAsync/cudaFreeAsync that
 * PyTorch just made on this thread, on the current context's device
 * (current_slot). Hot path, no GIL: as record(). */
void mvz_capture_async(int is_free, int result, uint64_t address, uint64_t size, uint64_t stream)
{
    if (!__atomic_load_n(&mvz_hot.capturing, __ATOMIC_ACQUIRE))
        return;
    decoded d = {is_free ? MVZ_OP_FREE_ASYNC : MVZ_OP_ALLOC_ASYNC, MVZ_KIND_DEVICE, is_free,
                 address, size, stream};
    if (is_free) {
        record(&d, result, 0, 0);
        return;
    }
    record(&d, result, current_slot(), 0);
}

/* The allocator route's path (allocator.c): a block PyTorch's caching
 * allocator handed out (or took back) on this thread, from inside its
 * allocate/raw_alloc/deleter. Hot path, no GIL: as record(); the device is
 * the DataPtr's, or (slot < 0) the current context's (current_slot). */
static inline __attribute__((always_inline)) void capture_block(int is_free, uint64_t address,
                                                                uint64_t size, uint64_t stream,
                                                                int slot, uint64_t stamp)
{
    decoded d = {is_free ? MVZ_OP_BLOCK_FREE : MVZ_OP_BLOCK_ALLOC, MVZ_KIND_BLOCK, is_free,
                 address, size, stream};
    if (slot < 0)
        slot = is_free ? 0 : current_slot(); /* a free: the store knows the device */
    record(&d, 0, slot, stamp);
}

static __attribute__((noinline)) void capture_block_timed(int is_free, uint64_t address,
                                                          uint64_t size, uint64_t stream,
                                                          int slot, uint64_t stamp);

/* Hot path, no GIL: the capture flag read once (an atomic load), then
 * capture_block, or its timed twin under a benchmark's profile. */
static inline __attribute__((always_inline)) void block_event(int is_free, uint64_t address,
                                                              uint64_t size, uint64_t stream,
                                                              int slot, uint64_t stamp)
{
    int on = __atomic_load_n(&mvz_hot.capturing, __ATOMIC_ACQUIRE);
    if (!on)
        return;
    if (__builtin_expect(on >= CAPTURING_TIMED, 0)) { /* benchmarks only: one branch for both */
        if (on == CAPTURING_TIMED)
            capture_block_timed(is_free, address, size, stream, slot, stamp);
        return;
    }
    capture_block(is_free, address, size, stream, slot, stamp);
}

MVZ_HOT void mvz_capture_block(int is_free, uint64_t address, uint64_t size, uint64_t stream, int slot,
                       uint64_t stamp)
{
    block_event(is_free, address, size, stream, slot, stamp);
}

/* As mvz_capture_block, each with only its own branch. Hot path, no GIL:
 * as capture_block (this thread's TLS and buffers, the queue's room). */
MVZ_HOT void mvz_capture_block_alloc(uint64_t address, uint64_t size, int slot, uint64_t stamp)
{
    block_event(0, address, size, 0, slot, stamp);
}

MVZ_HOT void mvz_capture_block_free(uint64_t address) { block_event(1, address, 0, 0, 0, 0); }

/* ---- the allocator route's capture path, timed (benchmarks only) --------
 * Under _core._callback_profile("time") the route's capture path runs
 * between two reads of the capture path's clock, and each thread adds the
 * ticks and the count, allocations and frees apart, into a slot of its own:
 * plain stores by the one thread that owns the slot (no locked instruction,
 * which would drain the store buffer and change what is measured). So a
 * benchmark reads memviz's own time inside a real step, per event and per
 * thread, without the noise of the step's wall time. Hot path, no GIL:
 * this thread's TLS and slot, and one atomic add per thread, once. */
#define TIMED_SLOTS 64
typedef struct {
    uint64_t n[2], ticks[2]; /* [0] allocations, [1] frees */
    long tid;
    char pad[64 - 5 * sizeof(uint64_t)];
} timed_slot;
static timed_slot timed[TIMED_SLOTS] __attribute__((aligned(64)));
static int timed_used; /* atomic */
static __thread int tl_timed __attribute__((tls_model("initial-exec"))); /* slot + 1; -1: none left */

static __attribute__((noinline)) void capture_block_timed(int is_free, uint64_t address,
                                                          uint64_t size, uint64_t stream,
                                                          int slot, uint64_t stamp)
{
    int tsc = mvz_tick_is_tsc();
    uint64_t t0 = mvz_tick_as(tsc);
    capture_block(is_free, address, size, stream, slot, stamp);
    uint64_t t1 = mvz_tick_as(tsc);
    int s = tl_timed;
    if (s == 0) {
        int i = __atomic_fetch_add(&timed_used, 1, __ATOMIC_RELAXED);
        s = tl_timed = i < TIMED_SLOTS ? i + 1 : -1;
        if (s > 0)
            __atomic_store_n(&timed[i].tid, (long)syscall(SYS_gettid), __ATOMIC_RELAXED);
    }
    if (s < 0)
        return;
    timed_slot *m = &timed[s - 1];
    int k = is_free ? 1 : 0;
    __atomic_store_n(&m->n[k], m->n[k] + 1, __ATOMIC_RELAXED);
    __atomic_store_n(&m->ticks[k], m->ticks[k] + (t1 - t0), __ATOMIC_RELAXED);
}

int mvz_capture_timings(long *tid, uint64_t (*n)[2], uint64_t (*ticks)[2], int max)
{
    int used = __atomic_load_n(&timed_used, __ATOMIC_RELAXED);
    if (used > TIMED_SLOTS)
        used = TIMED_SLOTS;
    int k = 0;
    for (int i = 0; i < used && k < max; i++, k++) {
        tid[k] = __atomic_load_n(&timed[i].tid, __ATOMIC_RELAXED);
        for (int j = 0; j < 2; j++) {
            n[k][j] = __atomic_load_n(&timed[i].n[j], __ATOMIC_RELAXED);
            ticks[k][j] = __atomic_load_n(&timed[i].ticks[j], __ATOMIC_RELAXED);
        }
    }
    return k;
}

/* The segment wrappers' path (interpose.c): cudaMalloc/cudaFree from
 * PyTorch's caching allocator, seen at its call site because CUPTI is not
 * held. Hot path, no GIL, any thread: as record(); while CUPTI's callback
 * sees the same call (cuMemAlloc) this returns at once. A free of NULL
 * (cudaFree(0), which only makes a context) is nothing. */
void mvz_capture_segment(int is_free, int result, uint64_t address, uint64_t size)
{
    if (!__atomic_load_n(&mvz_hot.capturing, __ATOMIC_ACQUIRE) || __atomic_load_n(&cupti_held, __ATOMIC_ACQUIRE))
        return;
    if (is_free && address == 0)
        return;
    decoded d = {is_free ? MVZ_OP_FREE : MVZ_OP_ALLOC, MVZ_KIND_DEVICE, is_free, address, size, 0};
    record(&d, result, is_free ? 0 : current_slot(), 0);
}

/* With the GIL: make sure the driver's cuCtxGetCurrent is at hand for the
 * paths that run after a driver call returned (wrappers). */
static void load_ctx_get_current(void)
{
    if (__atomic_load_n(&ctx_get_current, __ATOMIC_ACQUIRE))
        return;
    /* The driver library the runtime will load at CUDA's first use (it may
     * not be loaded yet: loading it initialises nothing). Kept open. Before
     * cuInit, cuCtxGetCurrent fails and CUPTI answers. */
    void *h = dlopen("libcuda.so.1", RTLD_LAZY);
    void *f = h ? dlsym(h, "cuCtxGetCurrent") : NULL;
    int (*fn)(void **) = NULL;
    if (f)
        memcpy(&fn, &f, sizeof f);
    __atomic_store_n(&ctx_get_current, fn, __ATOMIC_RELEASE); /* wrappers may run already */
}

void mvz_capture_prepare_wrappers(void) { load_ctx_get_current(); }

/* With the GIL: CUPTI callbacks for the plain stream-ordered calls on or off
 * (off while the wrappers record PyTorch's). Returns 0, or CUPTI's error. */
int mvz_capture_async_callbacks(int on)
{
    if (!subscriber || !mvz_cupti_api.EnableCallback)
        return -1;
    if (!on)
        load_ctx_get_current();
    static const uint32_t cbids[] = {MVZ_CBID_cuMemAllocAsync, MVZ_CBID_cuMemFreeAsync};
    for (size_t i = 0; i < 2; i++) {
        mvz_CUptiResult r = mvz_cupti_api.EnableCallback(on ? 1 : 0, subscriber, MVZ_CUPTI_CB_DOMAIN_DRIVER_API, cbids[i]);
        if (r != MVZ_CUPTI_SUCCESS)
            return (int)r;
    }
    return 0;
}

void mvz_capture_synthetic(uint64_t address, uint64_t size, int free_it)
{
    mvz_frame frames[MVZ_MAX_DEPTH];
    int depth = mvz_frames_capture(frames, __atomic_load_n(&mvz_hot.depth_limit, __ATOMIC_RELAXED));
    mvz_store_alloc(address, size, 0, 0, MVZ_KIND_DEVICE, mvz_tl.label, frames, depth);
    if (free_it)
        mvz_store_free(address, MVZ_KIND_DEVICE);
}

/* ---- activity records ------------------------------------------------- */

#define ACTIVITY_BUFFER (1u << 20)

/* Called by CUPTI (its worker thread or a flushing thread), never inside a
 * traced driver call of ours: allocating a buffer here is allowed. */
static void on_buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    void *p = NULL;
    if (posix_memalign(&p, 8, ACTIVITY_BUFFER) != 0)
        p = NULL;
    *buffer = p;
    *size = p ? ACTIVITY_BUFFER : 0;
    *max_records = 0;
}

static uint32_t static_label(const mvz_CUpti_ActivityMemory3 *r)
{
    const char *source = NULL;
    if (mvz_cupti_api.version >= MVZ_CUPTI_VERSION_13)
        source = ((const mvz_CUpti_ActivityMemory4 *)r)->source;
    char name[256];
    if (source && source[0]) {
        const char *base = strrchr(source, '/');
        snprintf(name, sizeof name, "CUDA module globals (%s)", base ? base + 1 : source);
    } else {
        snprintf(name, sizeof name, "CUDA module globals");
    }
    return mvz_labels_intern(name);
}

/* Called by CUPTI on its worker thread or inside cuptiActivityFlushAll;
 * takes the store's and the label table's leaf locks. */
static void on_buffer_completed(mvz_CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                size_t valid)
{
    (void)ctx;
    (void)stream;
    (void)size;
    void *rec = NULL;
    while (buffer && mvz_cupti_api.ActivityGetNextRecord &&
           mvz_cupti_api.ActivityGetNextRecord(buffer, valid, &rec) == MVZ_CUPTI_SUCCESS) {
        count(MVZ_OP_ACTIVITY_RECORDS);
        const mvz_CUpti_ActivityMemory3 *r = rec;
        if (r->kind != MVZ_CUPTI_ACTIVITY_KIND_MEMORY2 ||
            r->memoryKind != MVZ_CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC)
            continue;
        if (!__atomic_load_n(&mvz_hot.capturing, __ATOMIC_ACQUIRE) && !activity_on)
            continue;
        if (r->memoryOperationType == MVZ_CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION) {
            count(MVZ_OP_STATIC_ALLOC);
            mvz_store_alloc(r->address, r->bytes, 0, (int)r->deviceId, MVZ_KIND_STATIC,
                            static_label(r), NULL, 0);
        } else if (r->memoryOperationType == MVZ_CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE) {
            count(MVZ_OP_STATIC_FREE);
            mvz_store_free(r->address, MVZ_KIND_STATIC);
        }
    }
    free(buffer);
}

/* A benchmark's (_core._depth): the depth from the next event on; returns
 * the one before. With the GIL; the capture path reads it once an event. */
int mvz_capture_depth(int depth)
{
    return __atomic_exchange_n(&mvz_hot.depth_limit, depth, __ATOMIC_RELAXED);
}

/* ---- start / stop (with the GIL) -------------------------------------- */

void mvz_capture_configure(int depth)
{
    if (depth < 0)
        depth = 0;
    if (depth > MVZ_MAX_DEPTH)
        depth = MVZ_MAX_DEPTH;
    __atomic_store_n(&mvz_hot.depth_limit, depth, __ATOMIC_RELAXED);
}

/* With the GIL released: subscribe (beside another subscriber where the
 * library allows it and allow_shared asks), enable the memory callbacks. */
static int subscribe(int allow_shared, mvz_start_status *st)
{
    mvz_CUptiResult r;
    mvz_CUpti_CallbackFunc cb = profile_mode == MVZ_PROFILE_TIME || profile_mode == MVZ_PROFILE_NOOP
                                    ? on_driver_call_profiled
                                    : on_driver_call;
    if (mvz_cupti_api.Subscribe_v2) {
        char old[MVZ_CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN * 2] = {0};
        mvz_CUpti_SubscriberParams params = {sizeof params, "memviz", old, sizeof old, 0, {0}};
        /* allowMultipleSubscribers is only passed to a CUPTI that knows it:
         * an older one would be handed a struct size it has not seen. */
        uint32_t version = 0;
        int shared = allow_shared && mvz_cupti_api.GetVersion && mvz_cupti_api.GetVersion(&version) == MVZ_CUPTI_SUCCESS &&
                     version >= MVZ_CUPTI_MULTI_SUBSCRIBER_VERSION;
        if (shared) {
            params.allowMultipleSubscribers = 1;
        } else {
            params.structSize = MVZ_CUPTI_SUBSCRIBER_PARAMS_V1_SIZE;
        }
        r = mvz_cupti_api.Subscribe_v2(&subscriber, cb, NULL, &params);
        old[sizeof old - 1] = '\0';
        if (r != MVZ_CUPTI_SUCCESS)
            snprintf(st->holder, sizeof st->holder, "%s", old);
        else if (shared && old[0] && strstr(old, "memviz") == NULL)
            snprintf(st->shared_with, sizeof st->shared_with, "%s", old); /* the first subscriber */
    } else {
        r = mvz_cupti_api.Subscribe(&subscriber, cb, NULL);
    }
    if (r != MVZ_CUPTI_SUCCESS) {
        st->result = r;
        st->step = "cuptiSubscribe";
        subscriber = NULL;
        return -1;
    }
    int noasync = profile_mode == MVZ_PROFILE_NOASYNC;
    for (size_t i = 0; i < N_CBIDS; i++) {
        uint32_t cbid = memory_cbids[i];
        if (noasync && (cbid == MVZ_CBID_cuMemAllocAsync || cbid == MVZ_CBID_cuMemAllocAsync_ptsz ||
                        cbid == MVZ_CBID_cuMemFreeAsync || cbid == MVZ_CBID_cuMemFreeAsync_ptsz))
            continue;
        r = mvz_cupti_api.EnableCallback(1, subscriber, MVZ_CUPTI_CB_DOMAIN_DRIVER_API, memory_cbids[i]);
        if (r != MVZ_CUPTI_SUCCESS) {
            st->result = r;
            st->step = "cuptiEnableCallback";
            mvz_cupti_api.Unsubscribe(subscriber);
            subscriber = NULL;
            return -1;
        }
    }
    st->cupti = 1;
    return 0;
}

static void start_activity(mvz_start_status *st)
{
    if (!mvz_cupti_api.ActivityRegisterCallbacks || !mvz_cupti_api.ActivityEnable || !mvz_cupti_api.ActivityGetNextRecord) {
        snprintf(st->activity_error, sizeof st->activity_error, "this libcupti has no activity API");
        return;
    }
    if (st->shared_with[0]) {
        /* The activity API's buffer callbacks are one per process: taking
         * them would steal the other tool's records. */
        snprintf(st->activity_error, sizeof st->activity_error,
                 "CUPTI is shared with %.60s, whose activity buffers memviz leaves alone", st->shared_with);
        return;
    }
    /* Registered at every start: another tool (torch.profiler) may have put
     * its own buffer callbacks in place since. */
    mvz_CUptiResult r = mvz_cupti_api.ActivityRegisterCallbacks(on_buffer_requested, on_buffer_completed);
    if (r == MVZ_CUPTI_SUCCESS)
        r = mvz_cupti_api.ActivityEnable(MVZ_CUPTI_ACTIVITY_KIND_MEMORY2);
    if (r == MVZ_CUPTI_SUCCESS) {
        activity_on = 1;
        st->activity = 1;
        if (mvz_cupti_api.ActivityFlushPeriod)
            mvz_cupti_api.ActivityFlushPeriod(1000); /* static memory shows within 1 s */
    } else {
        snprintf(st->activity_error, sizeof st->activity_error, "MEMORY2 activity records are off: %s",
                 mvz_cupti_result_string(r));
    }
}

/* With the GIL (start and stop): membarrier's private expedited command,
 * registered once per process; the capture path then counts its
 * recordings per thread (busy[] above). */
static void register_barrier(void)
{
#if defined(__linux__) && defined(SYS_membarrier)
    if (__atomic_load_n(&mvz_hot.fenced, __ATOMIC_ACQUIRE))
        return;
    long cmds = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0);
    if (cmds > 0 && (cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) &&
        syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0) == 0)
        __atomic_store_n(&mvz_hot.fenced, 1, __ATOMIC_RELEASE);
#endif
}

/* With the GIL, in stop: a full memory barrier on every running thread of
 * the process. Registered, it cannot fail; if it ever did, every thread is
 * made to pass through the scheduler instead (a fallback that orders
 * memory on every thread only once each has been switched out). */
static void process_barrier(void)
{
#if defined(__linux__) && defined(SYS_membarrier)
    if (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0) == 0)
        return;
#endif
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    struct timespec pause = {0, 20 * 1000 * 1000};
    nanosleep(&pause, NULL);
}

int mvz_capture_start(int want_cupti, int want_activity, int allow_shared, mvz_start_status *st)
{
    memset(st, 0, sizeof *st);
    register_barrier();
    __atomic_store_n(&profile_mode, profile_request, __ATOMIC_RELAXED); /* before subscribing */
    if (want_cupti) {
        if (subscribe(allow_shared, st) != 0)
            return -1;
        if (want_activity)
            start_activity(st);
    } else {
        load_ctx_get_current(); /* the wrappers' device, without CUPTI's answer */
        snprintf(st->activity_error, sizeof st->activity_error, "CUPTI is not used");
    }
    __atomic_store_n(&cupti_held, st->cupti, __ATOMIC_SEQ_CST);
    mvz_store_drainer(1); /* could it not start, the capture path applies a full queue itself */
    __atomic_store_n(&mvz_hot.capturing, profile_mode == MVZ_PROFILE_TIME ? CAPTURING_TIMED : 1,
                     __ATOMIC_RELEASE);
    return 0;
}

int mvz_capture_per_thread_counters(void) { return __atomic_load_n(&mvz_hot.fenced, __ATOMIC_ACQUIRE); }

int mvz_capture_cupti_held(void) { return __atomic_load_n(&cupti_held, __ATOMIC_ACQUIRE); }

int mvz_capture_release_cupti(void)
{
    if (!subscriber)
        return 0;
    /* The segment wrappers record from here on; a cudaMalloc whose CUPTI
     * callback also records it in the moment between is the same address,
     * size and kind twice (the store keeps one). */
    __atomic_store_n(&cupti_held, 0, __ATOMIC_SEQ_CST);
    if (activity_on) {
        mvz_capture_flush();
        if (mvz_cupti_api.ActivityDisable)
            mvz_cupti_api.ActivityDisable(MVZ_CUPTI_ACTIVITY_KIND_MEMORY2);
        if (mvz_cupti_api.ActivityFlushPeriod)
            mvz_cupti_api.ActivityFlushPeriod(0);
        activity_on = 0;
    }
    mvz_cupti_api.Unsubscribe(subscriber);
    subscriber = NULL;
    return 1;
}

void mvz_capture_flush(void)
{
    if (activity_on && mvz_cupti_api.ActivityFlushAll)
        mvz_cupti_api.ActivityFlushAll(MVZ_CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
}

void mvz_capture_stop(void)
{
    if (activity_on) {
        mvz_capture_flush(); /* static records still count: mvz_hot.capturing is on */
        if (mvz_cupti_api.ActivityDisable)
            mvz_cupti_api.ActivityDisable(MVZ_CUPTI_ACTIVITY_KIND_MEMORY2);
        if (mvz_cupti_api.ActivityFlushPeriod)
            mvz_cupti_api.ActivityFlushPeriod(0);
        activity_on = 0;
    }
    __atomic_store_n(&mvz_hot.capturing, 0, __ATOMIC_SEQ_CST);
    /* Let recordings that passed their check finish (microseconds: they
     * never wait for anything this thread holds; the GIL is released). */
    if (__atomic_load_n(&mvz_hot.fenced, __ATOMIC_ACQUIRE))
        process_barrier(); /* every thread's counter store before it is seen after it */
    while (__atomic_load_n(&inflight, __ATOMIC_ACQUIRE))
        sched_yield();
    int used = __atomic_load_n(&busy_used, __ATOMIC_ACQUIRE);
    for (int i = 0; i < used && i < BUSY_SLOTS; i++)
        while (__atomic_load_n(&busy[i].n, __ATOMIC_ACQUIRE))
            sched_yield();
    mvz_store_drainer(0); /* and what the queue holds is applied */
    if (subscriber) {
        mvz_cupti_api.Unsubscribe(subscriber); /* lets torch.profiler subscribe later */
        subscriber = NULL;
    }
    __atomic_store_n(&cupti_held, 0, __ATOMIC_RELEASE);
}

MVZ_HOT int mvz_capture_active(void) { return __atomic_load_n(&mvz_hot.capturing, __ATOMIC_ACQUIRE); }

_Static_assert(MVZ_OP_COUNT <= MVZ_STORE_OPS, "the store counts the queue's operations");
_Static_assert(MVZ_NSLOTS <= 127, "a queue entry's slot is one signed byte");

/* Any thread, no store lock held: what the capture path counted itself
 * (failures, calls that are not allocations) plus what the queue applied. */
void mvz_capture_counts(uint64_t out[MVZ_OP_COUNT])
{
    uint64_t applied[MVZ_STORE_OPS];
    mvz_store_op_counts(applied);
    for (int i = 0; i < MVZ_OP_COUNT; i++)
        out[i] = __atomic_load_n(&counts[i], __ATOMIC_RELAXED) + applied[i];
}

/* With the GIL, benchmarks only: while capture is on (plainly, not timed),
 * the allocator route's capture path returns at once (on) or records again
 * (off). Only this nonzero word changes, so stop's protocol is as ever.
 * Returns 1 if it was returning at once, 0 if not, -1 if capture is off or
 * timed. */
int mvz_capture_noop(int on)
{
    int from = on ? 1 : CAPTURING_NOOP, to = on ? CAPTURING_NOOP : 1;
    int cur = __atomic_load_n(&mvz_hot.capturing, __ATOMIC_ACQUIRE);
    if (cur != 1 && cur != CAPTURING_NOOP)
        return -1;
    __atomic_compare_exchange_n(&mvz_hot.capturing, &from, to, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return cur == CAPTURING_NOOP;
}

int mvz_capture_set_profile(int mode)
{
    int before = profile_request;
    profile_request = mode;
    return before;
}

void mvz_capture_profile(uint64_t *calls, uint64_t *ns)
{
    *calls = __atomic_load_n(&profile_calls, __ATOMIC_RELAXED);
    *ns = __atomic_load_n(&profile_ns, __ATOMIC_RELAXED);
}

void mvz_capture_forget_counts(void)
{
    for (int i = 0; i < MVZ_OP_COUNT; i++)
        __atomic_store_n(&counts[i], 0, __ATOMIC_RELAXED);
    mvz_store_forget_op_counts();
}

void mvz_capture_atfork_child(void)
{
    /* CUDA cannot be used in a forked child; stop recording there without
     * calling into CUPTI (its state belongs to the parent). */
    __atomic_store_n(&mvz_hot.capturing, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&inflight, 0, __ATOMIC_RELEASE); /* the parent's threads are not here */
    int used = __atomic_load_n(&busy_used, __ATOMIC_RELAXED);
    for (int i = 0; i < used && i < BUSY_SLOTS; i++)
        __atomic_store_n(&busy[i].n, 0, __ATOMIC_RELAXED);
    /* a child's memory is not the registered parent's: register again at the next start */
    __atomic_store_n(&mvz_hot.fenced, 0, __ATOMIC_RELEASE);
    subscriber = NULL;
    activity_on = 0;
    cupti_held = 0;
    mvz_labels_atfork_child();
    mvz_nodes_atfork_child();
}
