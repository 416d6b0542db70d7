/* The store (see store.h). It owns one mutex, `store_lock` (under which
 * only the label table's leaf lock is taken), and all the
 * state it guards: the live table (livetab.c), the stacks (stacks.c), the
 * windows (window.c), the trace ring (trace_ring.c), the graveyard of peak
 * sets (peakset.c), the totals, timeline, failures and threads. Those files are called only from here,
 * with the lock held, and never take it; the accounting rules come from
 * accounting.c. Every function that runs on the capture path says why it is
 * safe without the GIL.
 *
 * The capture path hands its events over through the capture queue
 * (capq.h) without the lock; whoever takes the lock applies what the queue
 * holds first (LOCK below), so every reader sees every event published
 * before it asked, in the order the events were claimed, and the drainer
 * thread (at the end of this file) applies them between reads.
 *
 * Calls down only: livetab, stacks, peakset, window, trace_ring, blocks,
 * capq, seqmap, accounting, region, clock.
 *
 * Over 800 lines: it is one concern, the one lock and everything behind it
 * (docs/architecture.md, "Sizes"); what it owns lives in the files above.
 */
#define _GNU_SOURCE
#include "store.h"
#include "hot.h"
#include "accounting.h"
#include "blocks.h"
#include "capq.h"
#include "clock.h"
#include "frames.h"
#include "hash.h"
#include "labels.h"
#include "livetab.h"
#include "peakset.h"
#include "region.h"
#include "seqmap.h"
#include "stacks.h"
#include "trace_ring.h"
#include "window.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Everything below is protected by store_lock (but the thread-locals and
 * the atomics named as such). */
static pthread_mutex_t store_lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;

static mvz_livetab live;
static mvz_stacks stacks;
static mvz_windows windows;
static mvz_trace_ring ring;
static mvz_blocks blocks; /* PyTorch's block sizes (blocks.h) */
/* The capture queue: filled without the lock, applied with it (capq.h). */
mvz_capq mvz_store_capq; /* store.h: the capture path claims and publishes inline */
#define CAPQ_UNITS (1u << 16) /* 4 MiB: 7,281 allocations of 32 frames, 1,008 of 256 */
/* A backward node's label with its forward line ("\x01<name>\x1f#<stack>"),
 * by the class label the capture path queued and the stack its number's
 * seqmap note names (node_line; lock held). Cleared with the store, before
 * the label table may reclaim ids. */
#define NODE_LINES 4096
#define NODE_LINE_PROBES 8
static struct {
    uint64_t key; /* class label << 32 | stack; 0 empty */
    uint32_t label;
} node_lines[NODE_LINES];
static uint64_t queue_events; /* lock held */
static uint64_t queue_full;   /* atomic */
static uint64_t queue_kicks;  /* atomic */
/* Stacks interned while the queue was applied, not yet announced to
 * mvz_store_new_stack_hook (lock held to set; read at UNLOCK). */
static int new_stacks;
void (*mvz_store_new_stack_hook)(void);

static mvz_graveyard graves; /* peak sets' freed half (peakset.h) */

static mvz_totals totals[MVZ_NSLOTS];
/* PyTorch's blocks: inside segments `totals` already counts, so apart. Peak
 * sets stay those of the device's peak (totals[].peak_timestamp). */
static mvz_totals btotals[MVZ_NSLOTS];

static inline mvz_totals *totals_of(int kind, int slot)
{
    return kind == MVZ_KIND_BLOCK ? &btotals[slot] : &totals[slot];
}
static mvz_failure failures[MVZ_FAILURES];
static uint64_t nfailures;
static mvz_point timeline_points[MVZ_TIMELINE_POINTS];
static mvz_series timeline = {timeline_points, 0, MVZ_TIMELINE_POINTS, 1, 0};
static mvz_thread threads[MVZ_MAX_THREADS];
static uint32_t nthreads;
/* The queue's ticks to nanoseconds (clock.h), anchored at each drain. */
static mvz_tickmap ticks;
/* Operations applied from the queue (mvz_store_op_counts). */
static uint64_t op_counts[MVZ_STORE_OPS];
static uint64_t last_ts, unmatched_frees, dropped_allocs, dropped_threads;
static uint64_t stream_frees; /* frees of blocks flagged MVZ_FLAG_STREAM */
static uint64_t last_serial; /* atomic */

/* Per-thread registration, initial-exec so reading it never allocates (a
 * dynamically loaded module's general-dynamic TLS may call malloc). */
/* This thread discarded an allocation since it last queued one: the store's
 * last stack of this thread is not the one its buffers hold. */
static __thread uint64_t tl_serial __attribute__((tls_model("initial-exec")));

static void drain_locked(uint64_t limit);

/* An allocation's frames, as far as they changed (mvz_store_enqueue_alloc):
 * per registered thread, two buffers of MVZ_MAX_DEPTH frames that only that
 * thread writes (its last stack and the one it walks now), and the last
 * stack the store applied from it, which only the lock holder writes. Both
 * are reserved once, untouched until used: a thread that allocates keeps
 * 3 pages resident (12 KiB), and, with the walk's prefetch switched on,
 * 256 bytes of `walked_where` below. */
static mvz_region walked;  /* [MVZ_MAX_THREADS][2][MVZ_MAX_DEPTH] */
static mvz_region applied; /* [MVZ_MAX_THREADS][MVZ_MAX_DEPTH] */
/* The addresses of the frames each thread's last walk read (its innermost
 * MVZ_STORE_WHERE_N), which the next allocation on that thread prefetches,
 * with its last stack and the buffer it walks into, while PyTorch allocates
 * (mvz_store_prefetch): the walk that follows is a chain of dependent
 * loads, one frame after another, and inside a step those lines have left
 * the core's nearest cache (benchmarks/RESULTS.md, "Leave it on, seventh
 * session"). Off by default since the step's wall time showed no gain from
 * it ("eighth session"); a benchmark switches it on (MVZ_PF_WALK). Only that
 * thread writes its row. */
static mvz_region walked_where; /* [MVZ_MAX_THREADS][MVZ_STORE_WHERE_N] */
/* A benchmark's (MVZ_PF_DISCARD): where a registered thread writes the
 * entries it discards instead of queueing, [MVZ_MAX_THREADS][DISCARD_UNITS];
 * reserved, and resident only for threads that discarded. */
static mvz_region discarded;
#define DISCARD_UNITS MVZ_CAPQ_UNITS(MVZ_MAX_DEPTH)
/* The walk under way notes its frames' addresses (MVZ_PF_WALK was on). */
static uint16_t applied_n[MVZ_MAX_THREADS];
static uint8_t applied_reg[MVZ_MAX_THREADS]; /* the registration, as MVZ_CAPQ_KEPT's high bits */
/* The stack id that last stack was interned as, while no stack's frames
 * have changed since (stacks_changed: a code object found dying, a frame
 * resolved, the table cleared): an entry with the very same stack takes it without a hash and
 * a probe (entry_stack). 0: none. Lock held. */
static uint32_t applied_sid[MVZ_MAX_THREADS], applied_sid_at[MVZ_MAX_THREADS];
static uint32_t stacks_changed = 1;
/* Lock held: frames applied from entries, and those joined from the
 * thread's previous stack; entries whose kept frames could not be joined. */
static uint64_t frames_written, frames_kept, kept_mismatch;
/* This thread's side: which buffer holds its last stack, how deep, and
 * under which registration (generation) it was queued. */
_Static_assert(MVZ_THREAD_OVERFLOW <= UINT16_MAX, "a queue entry's thread index is 16 bits");
_Static_assert(MVZ_MAX_DEPTH <= MVZ_CAPQ_KEPT_MASK, "kept frames fit their bits");

/* Every holder of the lock applies the capture queue first: what the store
 * holds is then every event published before the lock was taken. */
static inline void lock_store(void)
{
    pthread_mutex_lock(&store_lock);
    if (initialized)
        drain_locked(UINT64_MAX);
}

/* The lock goes; stacks the queue interned meanwhile are announced after it
 * (mvz_store_new_stack_hook: Py_AddPendingCall on Python < 3.12, which CPython
 * documents as callable from any thread without the GIL). */
static inline void unlock_store(void)
{
    int fresh = new_stacks;
    new_stacks = 0;
    pthread_mutex_unlock(&store_lock);
    void (*hook)(void) = mvz_store_new_stack_hook;
    if (fresh && hook && __atomic_load_n(&stacks.npending, __ATOMIC_RELAXED))
        hook();
}

#define LOCK() lock_store()
#define UNLOCK() unlock_store()

/* Called with the lock held: a strictly increasing timestamp, so that
 * "made before the peak" and "freed after it" are never ambiguous. t is a
 * clock reading, which the capture path takes before the lock (so that the
 * lock is held for less): a thread that read the clock first but took the
 * lock second gets the next nanosecond after the other's. */
static uint64_t next_ts_from(uint64_t t)
{
    if (t <= last_ts)
        t = last_ts + 1;
    last_ts = t;
    return t;
}

/* Called with the lock held: next_ts_from the clock read now. */
static uint64_t next_ts(void) { return next_ts_from(mvz_now_ns()); }

int mvz_store_init(size_t max_live, size_t max_stacks, size_t max_frames)
{
    if (initialized)
        return 0;
    if (mvz_livetab_init(&live, max_live) || mvz_stacks_init(&stacks, max_stacks, max_frames) ||
        mvz_peakset_init(&graves, max_live) || mvz_blocks_init(&blocks) ||
        mvz_capq_init(&mvz_store_capq, CAPQ_UNITS) ||
        mvz_region_reserve(&walked, (size_t)MVZ_MAX_THREADS * 2 * MVZ_MAX_DEPTH * sizeof(mvz_frame), 0) ||
        mvz_region_reserve(&applied, (size_t)MVZ_MAX_THREADS * MVZ_MAX_DEPTH * sizeof(mvz_frame), 0) ||
        mvz_region_reserve(&walked_where, (size_t)MVZ_MAX_THREADS * MVZ_STORE_WHERE_N * sizeof(void *), 0) ||
        mvz_region_reserve(&discarded, (size_t)MVZ_MAX_THREADS * DISCARD_UNITS * sizeof(mvz_capq_entry), 0))
        return -1;
    __atomic_store_n(&mvz_hot.walked_base, walked.base, __ATOMIC_RELEASE); /* never moves */
    initialized = 1;
    return 0;
}

int mvz_store_ready(void) { return initialized; }

void mvz_store_clear(void ***refs, size_t *nrefs)
{
    *refs = NULL;
    *nrefs = 0;
    LOCK();
    size_t count = mvz_stacks_refs(&stacks, NULL);
    void **out = count ? malloc(count * sizeof(void *)) : NULL;
    size_t n = out ? mvz_stacks_refs(&stacks, out) : 0;
    /* Without memory for the list the references leak, which is safe. */
    mvz_livetab_reset(&live);
    memset(node_lines, 0, sizeof node_lines); /* before the label table may reclaim their ids */
    mvz_stacks_reset(&stacks);
    stacks_changed++;
    mvz_peakset_reset(&graves);
    mvz_window_reset(&windows);
    memset(totals, 0, sizeof totals);
    memset(btotals, 0, sizeof btotals);
    mvz_ring_reset(&ring);
    mvz_blocks_reset(&blocks);
    nfailures = 0;
    mvz_accounting_series_reset(&timeline);
    nthreads = 0;
    unmatched_frees = dropped_allocs = dropped_threads = stream_frees = 0;
    mvz_hot.generation++;
    UNLOCK();
    *refs = out;
    *nrefs = n;
}
/* ---- threads ---------------------------------------------------------- */

/* Any thread, no GIL: this thread's own TLS and one atomic add. */
uint64_t mvz_store_thread_serial(void)
{
    if (!tl_serial)
        tl_serial = __atomic_add_fetch(&last_serial, 1, __ATOMIC_RELAXED);
    return tl_serial;
}

/* Capture path, no GIL: mvz_store_thread_index's first call on a thread
 * (and its first after the store was cleared): registration takes the
 * store lock briefly and makes two system calls (gettid, PR_GET_NAME). */
uint32_t mvz_store_thread_register(void)
{
    uint32_t gen = __atomic_load_n(&mvz_hot.generation, __ATOMIC_ACQUIRE);
    if (mvz_tl.thread_plus1 && mvz_tl.generation == gen)
        return mvz_tl.thread_plus1 - 1;
    mvz_thread t;
    memset(&t, 0, sizeof t);
    t.native_id = (int64_t)syscall(SYS_gettid);
    t.ident = (uint64_t)pthread_self();
    t.serial = mvz_store_thread_serial();
    prctl(PR_GET_NAME, t.name, 0, 0, 0);
    t.name[15] = 0;
    LOCK();
    uint32_t idx;
    if (nthreads < MVZ_MAX_THREADS) {
        idx = nthreads++;
        threads[idx] = t;
    } else {
        idx = MVZ_THREAD_OVERFLOW; /* the table is full: counted, and named as such */
        dropped_threads++;
    }
    gen = mvz_hot.generation;
    UNLOCK();
    mvz_tl.thread_plus1 = idx + 1;
    mvz_tl.generation = gen;
    return idx;
}

/* ---- stacks (with the GIL; stacks.c holds the table) ------------------- */

/* Any thread, no lock: stacks not yet adopted, or events not yet applied
 * (their frames' code objects are held only by the threads that made them;
 * codeobj.c applies the queue, by taking the lock, before a code object
 * dies). */
int mvz_store_has_pending(void)
{
    return __atomic_load_n(&stacks.npending, __ATOMIC_RELAXED) != 0 || mvz_capq_busy(&mvz_store_capq);
}

void mvz_store_adopt_pending(void (*adopt)(void *code))
{
    LOCK();
    mvz_stacks_adopt_pending(&stacks, adopt);
    UNLOCK();
}

size_t mvz_store_mark_dying(void *code)
{
    LOCK();
    size_t n = mvz_stacks_mark_dying(&stacks, code);
    if (n)
        stacks_changed++; /* a stack's frames change: no thread's last id is taken as is */
    UNLOCK();
    return n;
}

void mvz_store_resolve_dying(void *code, void *(*resolve)(void *code, int32_t offset))
{
    /* `resolve` makes Python objects, which may run the garbage collector and
     * arbitrary code, so it is called with the lock released, one frame at a
     * time; frames marked DYING are skipped by adoption meanwhile, and only
     * this thread (holding the GIL) clears the mark. */
    for (;;) {
        LOCK();
        mvz_frame *target = mvz_stacks_find_dying(&stacks, code);
        int32_t offset = target ? target->offset : 0;
        UNLOCK();
        if (!target)
            return;
        void *tuple = resolve(code, offset);
        LOCK();
        /* The store may have been cleared meanwhile only by this thread. */
        if (target->code == code && (target->flags & MVZ_FRAME_DYING)) {
            stacks_changed++; /* as in mvz_store_mark_dying */
            if (tuple) {
                target->code = tuple;
                target->flags = MVZ_FRAME_RESOLVED;
                tuple = NULL;
            } else {
                target->code = NULL; /* unresolvable: shown as an unknown frame */
                target->flags = MVZ_FRAME_RESOLVED;
            }
        }
        UNLOCK();
        (void)tuple; /* a tuple not stored leaks rather than risk a decref here */
    }
}

int mvz_store_stack_frames(uint32_t id, mvz_frame *out, int cap)
{
    LOCK();
    int depth = mvz_stacks_frames(&stacks, id, out, cap);
    UNLOCK();
    return depth;
}

uint32_t mvz_store_stack_count(void)
{
    LOCK();
    uint32_t n = (uint32_t)stacks.n;
    UNLOCK();
    return n;
}

/* ---- writers (capture path) ---------------------------------------------- */

/* Capture path, no GIL: takes the store lock (a leaf lock, see store.h) and
 * touches only preallocated memory. */
uint32_t mvz_store_alloc(uint64_t address, uint64_t size, uint64_t stream, int slot, int kind,
                         uint32_t label_id, const mvz_frame *f, int depth)
{
    return mvz_store_record_alloc(0, address, size, 0, stream, slot, kind, label_id, 0, f, depth);
}


static int free_locked(uint64_t address, int kind, uint64_t ts);

/* Capture path, no GIL, lock held: what a new allocation does to PyTorch's
 * block rules (blocks.c: reserved memory only); returns the bytes it holds
 * (a block: PyTorch's block size). */
static uint64_t blocks_on_alloc(uint64_t address, uint64_t size, uint64_t *requested, int slot,
                                int kind, uint8_t *flags)
{
    if (kind == MVZ_KIND_BLOCK) {
        if (*requested) { /* its size is known (read from PyTorch) */
            mvz_blocks_known(&blocks, slot, address, size);
            return size;
        }
        *requested = size;
        return mvz_blocks_alloc(&blocks, slot, address, size, flags);
    }
    *requested = size;
    if (kind == MVZ_KIND_DEVICE)
        mvz_blocks_segment(&blocks, slot, address, size, 1);
    else if (kind == MVZ_KIND_PHYSICAL)
        mvz_blocks_inexact(&blocks, slot); /* expandable segments map pages as they go */
    return size;
}

/* Lock held (the capture queue's drain, or a synchronous caller below): the
 * allocation recorded, its clock read `clock_now` (a dated one's stamp)
 * and its stack hashed beforehand. Returns its stack id. Touches only
 * preallocated memory (livetab.c, stacks.c, window.c, trace_ring.c,
 * blocks.c, accounting.c). */
static uint32_t record_alloc_locked(uint64_t stamp, uint64_t clock_now, uint64_t address,
                                    uint64_t size, uint64_t requested, uint64_t stream, int slot,
                                    int kind, uint32_t label_id, int flags, const mvz_frame *f,
                                    int depth, uint64_t hash, uint32_t thread_idx,
                                    uint32_t same_id)
{
    /* Whatever this allocation shows was freed unseen is retired first, so
     * that nothing is live twice at any moment: an earlier allocation at
     * this address (made before tracking started, or its free lost), and,
     * for a block, blocks inside it (blocks.h). */
    uint64_t floor = 0;
    int found;
    size_t i = mvz_livetab_find(&live, address, kind, &found);
    if (found && free_locked(address, kind, next_ts()))
        floor = last_ts;
    uint8_t fl = (uint8_t)flags;
    size = blocks_on_alloc(address, size, &requested, slot, kind, &fl);
    int blocks_retired = blocks.nstale;
    for (int k = 0; k < blocks.nstale; k++)
        if (free_locked(blocks.stale[k], MVZ_KIND_BLOCK, next_ts()))
            floor = last_ts;
    blocks.nstale = 0;
    uint64_t now = next_ts_from(clock_now);
    /* dated when asked for (store.h), but never before a retirement above */
    uint64_t ts = stamp && stamp < now && stamp > floor ? stamp : now;
    int room = mvz_livetab_make_room(&live);
    if (room < 0) {
        dropped_allocs++;
        if (kind == MVZ_KIND_BLOCK) /* the rules forget it too */
            mvz_blocks_free(&blocks, slot, address, size);
        return 0;
    }
    if (found || blocks_retired || room > 0) /* the index moved since the probe above */
        i = mvz_livetab_find(&live, address, kind, &found);
    uint32_t stack_id = same_id     ? same_id /* f is that stack (entry_stack) */
                        : depth > 0 ? mvz_stacks_intern_hashed(&stacks, f, depth, hash)
                                    : 0;
    mvz_alloc *a = mvz_livetab_insert(&live, i);
    memset(a, 0, sizeof *a);
    a->op = MVZ_EV_ALLOC;
    a->address = address;
    a->size = size;
    a->slack = size - requested;
    a->stream = stream;
    a->timestamp = ts;
    a->stack_id = stack_id;
    a->thread_idx = thread_idx;
    a->label_id = label_id;
    a->slot = (int16_t)slot;
    a->kind = (uint8_t)kind;
    a->flags = fl;

    mvz_stack *s = &stacks.stacks[stack_id];
    s->live_bytes += size;
    if (kind == MVZ_KIND_BLOCK)
        s->block_bytes += size;
    s->live_count++;
    s->alloc_count++;
    s->alloc_bytes += size;
    if (s->live_bytes > s->peak_bytes)
        s->peak_bytes = s->live_bytes;

    /* A block's tensor peak is dated when it was recorded, not asked for:
     * the segment made for it (recorded in between) is live at that peak. */
    uint64_t peak_ts = kind == MVZ_KIND_BLOCK ? now : ts;
    if (mvz_accounting_alloc(totals_of(kind, slot), size, peak_ts))
        mvz_accounting_series_force_next(&timeline); /* always record a new peak */
    if (kind != MVZ_KIND_BLOCK) /* blocks lie inside segments the device totals hold */
        mvz_accounting_series_push(&timeline, ts, totals[slot].current, slot);
    if (windows.open) {
        mvz_alloc dated = *a;
        dated.timestamp = peak_ts;
        mvz_window_alloc(&windows, &dated);
    }
    mvz_alloc ev = *a;
    ev.timestamp = now;
    mvz_ring_record(&ring, &ev);
    return stack_id;
}

/* Not on the capture path since the capture queue (capture.c enqueues);
 * with or without the GIL (activity records, seeds, benchmarks): the
 * stack's hash and the clock before the lock, the rest under it. */
uint32_t mvz_store_record_alloc(uint64_t stamp, uint64_t address, uint64_t size,
                                uint64_t requested, uint64_t stream, int slot, int kind,
                                uint32_t label_id, int flags, const mvz_frame *f, int depth)
{
    uint32_t thread_idx = mvz_store_thread_index();
    if (slot < 0 || slot >= MVZ_NSLOTS)
        slot = MVZ_HOST_SLOT;
    uint64_t hash = depth > 0 ? mvz_stacks_hash(f, depth) : 0;
    uint64_t clock_now = stamp ? stamp : mvz_now_ns();
    LOCK();
    uint32_t id = record_alloc_locked(stamp, clock_now, address, size, requested, stream, slot,
                                      kind, label_id, flags, f, depth, hash, thread_idx, 0);
    UNLOCK();
    return id;
}


/* Capture path, no GIL, lock held: the free of the live allocation at
 * (address, kind) dated ts; 0 when there is none. */
static int free_locked(uint64_t address, int kind, uint64_t ts)
{
    int found;
    size_t i = mvz_livetab_find(&live, address, kind, &found);
    if (!found)
        return 0;
    mvz_alloc a = *mvz_livetab_at(&live, i);
    mvz_peakset_on_free(&graves, &a, ts, totals, btotals, &windows);
    mvz_livetab_remove(&live, i);
    if (a.kind == MVZ_KIND_BLOCK && (a.flags & (MVZ_FLAG_STREAM | MVZ_FLAG_MEMVIZ)) == MVZ_FLAG_STREAM)
        stream_frees++; /* PyTorch keeps it until that stream is done: a size nearby may differ */
    if (a.kind == MVZ_KIND_BLOCK)
        mvz_blocks_free(&blocks, a.slot, a.address, a.size);
    else if (a.kind == MVZ_KIND_DEVICE)
        mvz_blocks_segment(&blocks, a.slot, a.address, a.size, 0);

    mvz_stack *s = &stacks.stacks[a.stack_id];
    s->live_bytes -= a.size;
    if (a.kind == MVZ_KIND_BLOCK)
        s->block_bytes -= a.size;
    s->live_count--;
    mvz_totals *t = totals_of(a.kind, a.slot);
    mvz_accounting_free(t, a.size);
    if (a.kind != MVZ_KIND_BLOCK)
        mvz_accounting_series_push(&timeline, ts, totals[a.slot].current, a.slot);
    if (windows.open)
        mvz_window_free(&windows, &a, ts);
    a.op = MVZ_EV_FREE;
    a.timestamp = ts;
    mvz_ring_record(&ring, &a);
    return 1;
}

/* Any thread, no GIL (the allocator route's recordStream wrapper): the
 * store's leaf lock for one flag write, as the capture path. */
void mvz_store_mark_stream(uint64_t address)
{
    LOCK();
    int found;
    size_t i = mvz_livetab_find(&live, address, MVZ_KIND_BLOCK, &found);
    if (found)
        mvz_livetab_at(&live, i)->flags |= MVZ_FLAG_STREAM;
    UNLOCK();
}

void mvz_store_set_rules(const mvz_rules *r)
{
    LOCK();
    blocks.rules = *r;
    UNLOCK();
}

/* With the GIL, never on the capture path: the free of the allocation at
 * (address, kind) made at `made`, seen late (PyTorch no longer holds a
 * block read from it when tracking started); 0 when that allocation is not
 * live any more (its address may hold a newer one, which stays). */
int mvz_store_retire(uint64_t address, int kind, uint64_t made)
{
    LOCK();
    int found, done = 0;
    size_t i = mvz_livetab_find(&live, address, kind, &found);
    if (found && mvz_livetab_at(&live, i)->timestamp == made)
        done = free_locked(address, kind, next_ts());
    UNLOCK();
    return done;
}

/* Capture path, no GIL: takes the store lock (leaf) and touches only
 * preallocated memory. */
void mvz_store_free(uint64_t address, int kind)
{
    uint64_t clock_now = mvz_now_ns(); /* needs no lock */
    LOCK();
    if (!free_locked(address, kind, next_ts_from(clock_now)))
        unmatched_frees++; /* allocated before tracking started */
    UNLOCK();
}

/* ---- the capture queue (capq.h) ------------------------------------------ */


/* Capture path, no GIL, no lock held: room in the queue for an event of
 * `units` units. When the queue is full the caller applies it itself, if
 * the lock is free (a leaf lock, as the capture path always took), else
 * yields to whoever holds it: every holder applies the queue. Nothing is
 * dropped. */

__attribute__((noinline, cold)) mvz_capq_entry *mvz_store_enqueue_full(unsigned units, uint64_t *pos)
{
    for (;;) {
        mvz_capq_entry *e = mvz_capq_claim(&mvz_store_capq, units, pos);
        if (e)
            return e;
        __atomic_fetch_add(&queue_full, 1, __ATOMIC_RELAXED);
        if (pthread_mutex_trylock(&store_lock) == 0) {
            drain_locked(UINT64_MAX);
            UNLOCK();
            continue;
        }
        /* Whoever holds the lock is applying the queue and gives room back
         * every 256 units: look again for a while before giving the CPU up. */
        for (int k = 0; k < 256 && !mvz_capq_room(&mvz_store_capq, units); k++)
            mvz_cpu_relax();
        if (!mvz_capq_room(&mvz_store_capq, units))
            sched_yield();
    }
}

/* Which prefetches run (MVZ_PF_*; a benchmark's switch, mvz_store_prefetch_on):
 * mvz_hot.hints, on the capture path's read-mostly line (hot.h). */
#define PF(bit) (__atomic_load_n(&mvz_hot.hints, __ATOMIC_RELAXED) & (bit))
_Static_assert(MVZ_PF_DEFAULT == 2, "hot.c starts mvz_hot.hints at MVZ_PF_DEFAULT");

int mvz_store_prefetch_on(int mode)
{
    return __atomic_exchange_n(&mvz_hot.hints, mode, __ATOMIC_RELAXED);
}


/* Capture path, no GIL, no lock: a hint that the `units` lines from e on,
 * just written, go to the shared cache (CLDEMOTE, a no-op where the CPU
 * lacks it), out of this core's, where the drain thread reads them from.
 * Only this entry's own units, which its producer reads no more. */
static inline void demote(mvz_capq_entry *e, unsigned units)
{
#if defined(__x86_64__)
    mvz_capq_entry *end = mvz_store_capq.units + mvz_store_capq.mask + 1;
    for (unsigned u = 0; u < units && e + u < end; u++)
        __asm__ volatile(".byte 0x0f, 0x1c, 0x00" ::"a"(e + u) : "memory"); /* cldemote (%rax) */
#else
    (void)e;
    (void)units;
#endif
}

/* A benchmark's weights (MVZ_PF_PAD_CODE, _DATA): 32 code lines, each a
 * jump to the next (the last returns), in a section of their own away from
 * the capture path's code; and 32 data lines a page and a line apart. */
#define PAD_LINES 32
#if defined(__x86_64__) && defined(__ELF__)
#define PAD_CODE 1
#define PAD_ONE ".p2align 6\n1:\n  jmp 1f\n"
#define PAD_EIGHT PAD_ONE PAD_ONE PAD_ONE PAD_ONE PAD_ONE PAD_ONE PAD_ONE PAD_ONE
__asm__(".pushsection .text.mvz_pad,\"ax\",@progbits\n"
        ".p2align 6\n"
        "mvz_store_pad_code:\n"
        PAD_EIGHT PAD_EIGHT PAD_EIGHT PAD_EIGHT
        ".p2align 6\n1:\n  ret\n"
        ".popsection\n");
void mvz_store_pad_code(void) __attribute__((visibility("hidden")));
#endif
static char pad_data[PAD_LINES * (4096 + 64)] __attribute__((aligned(64)));

/* Capture path, no GIL, benchmarks only: the weights the hints ask for. */
static __attribute__((noinline)) void pad(int hints)
{
#if defined(PAD_CODE)
    if (hints & MVZ_PF_PAD_CODE)
        mvz_store_pad_code();
#endif
    if (hints & MVZ_PF_PAD_DATA) {
        unsigned sum = 0;
        for (int i = 0; i < PAD_LINES; i++)
            sum += (unsigned char)__atomic_load_n(&pad_data[(size_t)i * (4096 + 64)], __ATOMIC_RELAXED);
        __asm__ volatile("" ::"r"(sum));
    }
}

/* Capture path, no GIL, no lock: mvz_store_publish (store.h) under a
 * benchmark's switches (`hints`: weights, a discarded entry, the lines
 * demoted, the next unit asked for), out of line. */
void mvz_store_publish_slow(mvz_capq_entry *e, uint64_t pos, int hints)
{
    if (__builtin_expect(hints & (MVZ_PF_PAD_CODE | MVZ_PF_PAD_DATA), 0))
        pad(hints & (MVZ_PF_PAD_CODE | MVZ_PF_PAD_DATA));
    if (pos == MVZ_STORE_DISCARDED)
        return;
    unsigned units = e->units;
    mvz_capq_publish(e, pos);
    if (__builtin_expect(hints & (MVZ_PF_DEMOTE | MVZ_PF_NEXT), 0)) {
        if (hints & MVZ_PF_DEMOTE)
            demote(e, units);
        if (hints & MVZ_PF_NEXT)
            mvz_store_prefetch_unit();
    }
    mvz_store_kick_if_over(pos);
}

/* Capture path, no GIL, no lock: see store.h. Reads this thread's TLS and
 * its own rows; a prefetch neither faults nor writes, so an address that
 * no longer holds a frame (its thread's stack moved on) costs nothing. */
void mvz_store_prefetch_walk(void)
{
    int n = mvz_tl.where_n;
    if (n == 0 || mvz_tl.generation != __atomic_load_n(&mvz_hot.generation, __ATOMIC_RELAXED) || !mvz_tl.thread_plus1)
        return;
    uint32_t idx = mvz_tl.thread_plus1 - 1;
    const void *const *w = (const void *const *)walked_where.base + (size_t)idx * MVZ_STORE_WHERE_N;
    for (int i = 0; i < n; i++) {
        __builtin_prefetch(w[i], 0, 3);
        __builtin_prefetch((const char *)w[i] + 64, 0, 3);
    }
    if (mvz_tl.walk_gen != mvz_tl.generation || mvz_tl.walk_idx != idx)
        return;
    /* the last stack, which the store compares the walk with, and the
     * buffer the walk writes */
    const char *last = (const char *)mvz_store_walk_row(idx, mvz_tl.walk_last);
    const char *next = (const char *)mvz_store_walk_row(idx, !mvz_tl.walk_last);
    size_t bytes = (size_t)(mvz_tl.walk_n < 2 * MVZ_STORE_WHERE_N ? mvz_tl.walk_n : 2 * MVZ_STORE_WHERE_N) * sizeof(mvz_frame);
    for (size_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(last + b, 0, 3);
        __builtin_prefetch(next + b, 1, 3);
    }
}


/* Capture path, no GIL: the row of addresses a walk notes under the walk's
 * prefetch (MVZ_PF_WALK, a benchmark's), for mvz_store_walk_begin. */
const void **mvz_store_walk_where(uint32_t thread_idx)
{
    return (const void **)walked_where.base + (size_t)thread_idx * MVZ_STORE_WHERE_N;
}

int mvz_store_share_frames(int on)
{
    return __atomic_exchange_n(&mvz_hot.share_frames, on ? 1 : 0, __ATOMIC_RELAXED);
}

/* Capture path, no GIL: under MVZ_PF_DISCARD (a benchmark's), this
 * registered thread's own room for an entry it writes and never queues
 * (*pos MVZ_STORE_DISCARDED), so that a benchmark sees the capture path
 * without the shared queue and the drain; NULL otherwise, or for a thread
 * with no index. */
mvz_capq_entry *mvz_store_discard_room(uint64_t *pos)
{
    if (__builtin_expect(!PF(MVZ_PF_DISCARD), 1) || !mvz_tl.thread_plus1 ||
        mvz_tl.generation != __atomic_load_n(&mvz_hot.generation, __ATOMIC_RELAXED) ||
        mvz_tl.thread_plus1 > MVZ_MAX_THREADS)
        return NULL;
    *pos = MVZ_STORE_DISCARDED;
    return (mvz_capq_entry *)discarded.base + (size_t)(mvz_tl.thread_plus1 - 1) * DISCARD_UNITS;
}

/* Lock held: the whole stack of an allocation entry, joined from its frames
 * and the kept ones of its thread's previous stack (in `applied`, where it
 * stays as that thread's last). *depth: its depth. An entry whose kept
 * frames cannot be joined (never, unless threads were registered anew
 * while an allocation was being queued) keeps the frames it carries. */
static const mvz_frame *entry_stack(const mvz_capq_entry *e, int *depth, uint32_t *same_id)
{
    const mvz_frame *f = mvz_capq_frames((mvz_capq_entry *)e);
    unsigned idx = e->thread_idx, kept = e->kept & MVZ_CAPQ_KEPT_MASK;
    unsigned reg = (unsigned)e->kept >> MVZ_CAPQ_KEPT_SHIFT, written = e->depth;
    *depth = (int)written;
    *same_id = 0;
    if (idx >= MVZ_MAX_THREADS) {
        frames_written += written;
        return f;
    }
    mvz_frame *last = (mvz_frame *)applied.base + (size_t)idx * MVZ_MAX_DEPTH;
    unsigned m = applied_n[idx];
    if (kept && (applied_reg[idx] != reg || kept > m || written + kept > MVZ_MAX_DEPTH)) {
        kept_mismatch++;
        kept = 0;
    }
    if (written == 0 && kept == m && applied_sid_at[idx] == stacks_changed)
        *same_id = applied_sid[idx]; /* the thread's last stack again: its id, if it had one */
    applied_sid[idx] = 0; /* until the caller says what this stack was interned as */
    /* last[] becomes this stack: its outermost `kept` frames move to follow
     * the `written` new ones (memmove: the ranges may overlap). */
    memmove(last + written, last + (m - kept), (size_t)kept * sizeof *last);
    memcpy(last, f, (size_t)written * sizeof *f);
    applied_n[idx] = (uint16_t)(written + kept);
    frames_written += written;
    frames_kept += kept;
    applied_reg[idx] = (uint8_t)reg;
    *depth = (int)(written + kept);
    return last;
}


/* Lock held: the label of a backward node's allocation, its class label
 * `cls` (the capture path's) with the forward line of the node numbered
 * `seq`: the stack the seqmap noted for it, as the forward allocation that
 * made the node was applied (earlier in claim order, so before this entry).
 * Interned once per class and line (the label table's lock, a leaf, taken
 * under the store's); `cls` when the node has no line or the table is full. */
static uint32_t node_line(uint32_t cls, uint64_t seq)
{
    uint32_t stack = mvz_seqmap_stack(seq);
    if (!cls || !stack)
        return cls;
    uint64_t key = (uint64_t)cls << 32 | stack;
    uint32_t at = (uint32_t)(mvz_mix64(key) & (NODE_LINES - 1));
    for (int i = 0; i < NODE_LINE_PROBES; i++) {
        uint32_t k = (at + (uint32_t)i) & (NODE_LINES - 1);
        if (node_lines[k].key == key)
            return node_lines[k].label;
        if (node_lines[k].key == 0)
            break;
    }
    const char *name = mvz_labels_name(cls); /* "\x01<name>\x1f", never freed while capturing */
    char text[300];
    if (!name || snprintf(text, sizeof text, "%s#%u", name, stack) >= (int)sizeof text)
        return cls;
    uint32_t id = mvz_labels_intern(text);
    if (!id)
        return cls;
    /* The first free place of the probe, else the first place (a cache). */
    uint32_t put = at;
    for (int i = 0; i < NODE_LINE_PROBES; i++)
        if (node_lines[(at + (uint32_t)i) & (NODE_LINES - 1)].key == 0) {
            put = (at + (uint32_t)i) & (NODE_LINES - 1);
            break;
        }
    node_lines[put].key = key;
    node_lines[put].label = id;
    return id;
}

/* Lock held: apply every entry claimed before `limit`, in claim order. An
 * allocation's stack is hashed and interned here, off the capture path, and
 * a backward node's allocation gets its forward line (node_line). */
static void drain_locked(uint64_t limit)
{
    mvz_capq_entry *e;
    if (mvz_capq_busy(&mvz_store_capq))
        mvz_clock_tickmap_anchor(&ticks); /* the entries' ticks convert from now */
    while ((e = mvz_capq_peek(&mvz_store_capq, limit)) != NULL) {
        uint64_t clock = e->what & MVZ_CAPQ_TSC ? mvz_clock_tickmap_ns(&ticks, e->clock) : e->clock;
        op_counts[e->op % MVZ_STORE_OPS]++;
        if (e->what & MVZ_CAPQ_FREE) {
            if (!free_locked(e->address, e->kind, next_ts_from(clock)))
                unmatched_frees++; /* allocated before tracking started */
        } else {
            int depth;
            uint32_t same_id;
            const mvz_frame *f = entry_stack(e, &depth, &same_id);
            int slot = e->slot;
            if (slot < 0 || slot >= MVZ_NSLOTS)
                slot = MVZ_HOST_SLOT;
            size_t before = stacks.n;
            uint64_t hash = depth > 0 && !same_id ? mvz_stacks_hash(f, depth) : 0;
            uint64_t stamp = e->what & MVZ_CAPQ_STAMPED ? clock : 0;
            int node = (e->what & MVZ_CAPQ_NODE_LINE) != 0;
            uint32_t label = node ? node_line(e->label_id, e->seq_note) : e->label_id;
            uint32_t id = record_alloc_locked(stamp, clock, e->address, e->size, 0, e->stream,
                                              slot, e->kind, label, e->flags, f, depth, hash,
                                              e->thread_idx, same_id);
            if (e->thread_idx < MVZ_MAX_THREADS) {
                applied_sid[e->thread_idx] = id;
                applied_sid_at[e->thread_idx] = stacks_changed;
            }
            if (e->seq_note && !node)
                mvz_seqmap_put(e->seq_note, id);
            if (stacks.n != before)
                new_stacks = 1;
        }
        mvz_capq_pop(&mvz_store_capq, e);
        queue_events++;
    }
    mvz_capq_release(&mvz_store_capq);
}

void mvz_store_op_counts(uint64_t out[MVZ_STORE_OPS])
{
    LOCK();
    memcpy(out, op_counts, sizeof op_counts);
    UNLOCK();
}

void mvz_store_forget_op_counts(void)
{
    LOCK();
    memset(op_counts, 0, sizeof op_counts);
    UNLOCK();
}

/* Any thread, no GIL, no store lock held: apply the queue now. */
void mvz_store_sync(void)
{
    LOCK();
    UNLOCK();
}

/* Capture path, no GIL: a backward node's label reads the forward line
 * noted for it (seqmap.h); when that note may still be in the queue, the
 * queue is applied first (once per backward pass, in practice: forward
 * notes, backward reads). Two relaxed loads otherwise. */

/* ---- the drainer thread --------------------------------------------------- */

/* Applies the queue every 4 ms while capture runs (sooner when an
 * allocating thread finds it a quarter full: mvz_store_kick), so that the
 * allocating threads find room and readers little left to apply: at the 100,000
 * events a second of an allocation-bound step that is 400 events, 3% of
 * the queue at 32 frames (a wake-up costs a few microseconds; every
 * millisecond cost as much CPU time as the draining itself,
 * benchmarks/RESULTS.md). Niced below the program's threads, as the trace
 * writer is: where cores are short, it waits and the capture path applies
 * the queue itself when full. */
#define DRAIN_PERIOD_NS 4000000L
/* The period in force (atomic): DRAIN_PERIOD_NS but under a benchmark's
 * mvz_store_drain_period. */
static long drain_period_ns = DRAIN_PERIOD_NS;
static pthread_t drainer;
static int drainer_running; /* with the GIL (start/stop) */
static int drainer_stopping;
static pthread_mutex_t drainer_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t drainer_cond = PTHREAD_COND_INITIALIZER;
/* Capture path, no GIL, no lock: the queue found over a quarter full
 * (mvz_store_kick_if_over, store.h, in an allocation storm) wakes the
 * drainer, at most once until it has run. A signal that finds the drainer
 * between its check and its wait is lost: it then runs at its period, as
 * without the kick. pthread_cond_signal takes no lock of ours. */
void mvz_store_kick(void)
{
    if (__atomic_exchange_n(&mvz_hot.drainer_kicked, 1, __ATOMIC_RELAXED))
        return;
    __atomic_fetch_add(&queue_kicks, 1, __ATOMIC_RELAXED);
    pthread_cond_signal(&drainer_cond);
}

static void *drainer_main(void *unused)
{
    (void)unused;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals are for the program's threads */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
    prctl(PR_SET_NAME, "memviz-drain", 0, 0, 0);
    pthread_mutex_lock(&drainer_lock);
    while (!drainer_stopping) {
        if (!__atomic_load_n(&mvz_hot.drainer_kicked, __ATOMIC_RELAXED))
            mvz_cond_wait_ns(&drainer_cond, &drainer_lock,
                             __atomic_load_n(&drain_period_ns, __ATOMIC_RELAXED));
        if (drainer_stopping)
            break;
        pthread_mutex_unlock(&drainer_lock);
        __atomic_store_n(&mvz_hot.drainer_kicked, 0, __ATOMIC_RELAXED);
        if (mvz_capq_busy(&mvz_store_capq))
            mvz_store_sync();
        pthread_mutex_lock(&drainer_lock);
    }
    pthread_mutex_unlock(&drainer_lock);
    return NULL;
}

long mvz_store_drain_period(long ns)
{
    if (ns <= 0)
        ns = DRAIN_PERIOD_NS;
    return __atomic_exchange_n(&drain_period_ns, ns, __ATOMIC_RELAXED);
}

int mvz_store_drainer(int on)
{
    if (on == drainer_running)
        return 0;
    if (on) {
        drainer_stopping = 0;
        __atomic_store_n(&mvz_hot.drainer_kicked, 0, __ATOMIC_RELAXED);
        if (pthread_create(&drainer, NULL, drainer_main, NULL) != 0)
            return -1; /* the capture path then applies the queue itself when full */
        drainer_running = 1;
        return 0;
    }
    pthread_mutex_lock(&drainer_lock);
    drainer_stopping = 1;
    pthread_cond_signal(&drainer_cond);
    pthread_mutex_unlock(&drainer_lock);
    pthread_join(drainer, NULL);
    drainer_running = 0;
    mvz_store_sync();
    return 0;
}

/* Capture path, no GIL: as mvz_store_alloc. */
void mvz_store_failure(uint64_t size, uint64_t stream, int slot, int kind, uint32_t label_id,
                       int result, const mvz_frame *f, int depth)
{
    uint32_t thread_idx = mvz_store_thread_index();
    if (slot < 0 || slot >= MVZ_NSLOTS)
        slot = MVZ_HOST_SLOT;
    LOCK();
    mvz_failure *x = &failures[nfailures % MVZ_FAILURES];
    x->size = size;
    x->stream = stream;
    x->timestamp = next_ts();
    x->stack_id = mvz_stacks_intern(&stacks, f, depth);
    x->thread_idx = thread_idx;
    x->label_id = label_id;
    x->result = result;
    x->slot = (int16_t)slot;
    x->kind = (uint8_t)kind;
    nfailures++;
    totals[slot].failed++;
    if (windows.open)
        mvz_window_failure(&windows, slot);
    mvz_alloc ev;
    memset(&ev, 0, sizeof ev);
    ev.op = MVZ_EV_FAILED;
    ev.timestamp = x->timestamp;
    ev.address = (uint64_t)(int64_t)result;
    ev.size = size;
    ev.stream = stream;
    ev.stack_id = x->stack_id;
    ev.thread_idx = thread_idx;
    ev.label_id = label_id;
    ev.kind = (uint8_t)kind;
    ev.slot = (int16_t)slot;
    mvz_ring_record(&ring, &ev);
    UNLOCK();
}
/* ---- readers (with the GIL) ------------------------------------------------ */

/* How many entries a copy-out needs: read without the lock to size the
 * buffers (relaxed atomics), and again with it to check they still fit. */
static size_t room_live(void) { return __atomic_load_n(&live.count, __ATOMIC_RELAXED); }
static size_t room_live_graves(void)
{
    return __atomic_load_n(&live.count, __ATOMIC_RELAXED) +
           __atomic_load_n(&graves.n, __ATOMIC_RELAXED);
}
static size_t room_stacks(void) { return __atomic_load_n(&stacks.n, __ATOMIC_RELAXED); }

/* The one way every copy-out starts: `k` buffers of room()+64 entries of
 * `elem` bytes are malloc'd before the lock (nothing under it allocates),
 * then the lock is taken; when the tables grew past them meanwhile, the
 * buffers go and it starts again. Returns 0 with the lock held and bufs[]
 * set, or -1 without the lock (out of memory). */
static int lock_with_room(size_t (*room)(void), size_t elem, int k, void **bufs)
{
    for (;;) {
        size_t n = room() + 64;
        int ok = 1;
        for (int b = 0; b < k; b++)
            ok &= (bufs[b] = malloc(n * elem)) != NULL;
        if (ok) {
            LOCK();
            if (room() <= n)
                return 0;
            UNLOCK();
        }
        for (int b = 0; b < k; b++)
            free(bufs[b]);
        if (!ok)
            return -1;
    }
}

/* The totals a reader of window w (-1: the store) sees, and the timestamp
 * after which its allocations were made (store timestamps are > 0). Lock
 * held; NULL when w is not open. */
static mvz_totals *totals_of_window(int w, uint64_t *after)
{
    *after = w < 0 ? 0 : mvz_window_start(&windows, w);
    return w < 0 ? totals : mvz_window_totals(&windows, w);
}

/* As totals_of_window, for PyTorch's blocks (the tensor peak). */
static mvz_totals *block_totals_of_window(int w)
{
    return w < 0 ? btotals : mvz_window_block_totals(&windows, w);
}

/* Lock held: the live allocations made after `after`, into out. */
static size_t collect_live(uint64_t after, mvz_alloc *out)
{
    size_t m = 0;
    for (size_t k = 0; k < live.count; k++)
        if (live.allocs[k].timestamp > after)
            out[m++] = live.allocs[k];
    return m;
}

long mvz_store_live(mvz_alloc **out)
{
    void *buf;
    *out = NULL;
    if (lock_with_room(room_live, sizeof(mvz_alloc), 1, &buf))
        return -1;
    size_t m = collect_live(0, buf);
    UNLOCK();
    *out = buf;
    return (long)m;
}

/* The allocations live at the peak of `slot`, in window w (-1: the store):
 * the device's peak, or with `tensor` the peak of PyTorch's blocks. */
static long peak_live(int w, int slot, int tensor, mvz_alloc **out)
{
    void *buf;
    *out = NULL;
    if (slot < 0 || slot >= MVZ_NSLOTS)
        return 0;
    if (lock_with_room(room_live_graves, sizeof(mvz_alloc), 1, &buf))
        return -1;
    uint64_t after;
    const mvz_totals *t = totals_of_window(w, &after);
    if (t && tensor)
        t = block_totals_of_window(w);
    size_t m = t ? mvz_peakset_collect(&live, &graves, t, slot, after, buf) : 0;
    UNLOCK();
    if (!t) {
        free(buf);
        return -1;
    }
    *out = buf;
    return (long)m;
}

long mvz_store_window_peak_live(int w, int slot, int tensor, mvz_alloc **out)
{
    return peak_live(w, slot, tensor, out);
}

long mvz_store_sites(mvz_site **out)
{
    void *buf;
    *out = NULL;
    if (lock_with_room(room_stacks, sizeof(mvz_site), 1, &buf))
        return -1;
    size_t m = mvz_stacks_sites(&stacks, buf);
    UNLOCK();
    *out = buf;
    return (long)m;
}

long mvz_store_failures(mvz_failure **out)
{
    *out = NULL;
    mvz_failure *buf = malloc(sizeof failures);
    if (!buf)
        return -1;
    LOCK();
    size_t n = nfailures < MVZ_FAILURES ? (size_t)nfailures : MVZ_FAILURES;
    /* Oldest first. */
    for (size_t k = 0; k < n; k++)
        buf[k] = failures[(nfailures - n + k) % MVZ_FAILURES];
    UNLOCK();
    if (n == 0) {
        free(buf);
        return 0;
    }
    *out = buf;
    return (long)n;
}

long mvz_store_timeline(mvz_point **out)
{
    mvz_point *buf = malloc(sizeof timeline_points);
    if (!buf)
        return -1;
    LOCK();
    size_t n = timeline.n;
    memcpy(buf, timeline_points, n * sizeof(mvz_point));
    UNLOCK();
    *out = buf;
    return (long)n;
}

long mvz_store_threads(mvz_thread **out)
{
    mvz_thread *buf = malloc(sizeof threads);
    if (!buf)
        return -1;
    LOCK();
    size_t n = nthreads;
    memcpy(buf, threads, n * sizeof(mvz_thread));
    UNLOCK();
    *out = buf;
    return (long)n;
}

void mvz_store_totals(mvz_totals out[MVZ_NSLOTS])
{
    LOCK();
    memcpy(out, totals, sizeof totals);
    UNLOCK();
}

void mvz_store_get_stats(mvz_store_stats *o)
{
    memset(o, 0, sizeof *o);
    LOCK();
    o->live = live.count;
    o->stacks = stacks.n - 1;
    o->frames = stacks.nframes;
    o->threads = nthreads;
    o->unmatched_frees = unmatched_frees;
    o->stream_frees = stream_frees;
    o->queue_events = queue_events;
    o->queue_full = __atomic_load_n(&queue_full, __ATOMIC_RELAXED);
    o->queue_kicks = __atomic_load_n(&queue_kicks, __ATOMIC_RELAXED);
    o->queue_frames_written = frames_written;
    o->queue_frames_kept = frames_kept;
    o->queue_kept_mismatch = kept_mismatch;
    o->dropped_allocs = dropped_allocs;
    o->dropped_stacks = stacks.dropped;
    o->dropped_threads = dropped_threads;
    o->timeline_points = timeline.n;
    o->generation = mvz_hot.generation;
    o->max_live = (uint32_t)live.max;
    /* Bytes in use: what each region has handed out (an upper bound of its
     * resident pages) plus the fixed tables. */
    o->bytes_used = live.count * sizeof(mvz_alloc) + live.index_cap * sizeof(uint32_t) +
                    mvz_stacks_bytes_used(&stacks) + graves.n * sizeof(mvz_grave) +
                    sizeof totals + sizeof failures + sizeof timeline_points + sizeof threads +
                    mvz_capq_bytes_used(&mvz_store_capq);
    o->bytes_reserved = live.allocs_r.reserved + live.index_a_r.reserved +
                        live.index_b_r.reserved + mvz_stacks_bytes_reserved(&stacks) +
                        graves.r.reserved + mvz_capq_bytes_reserved(&mvz_store_capq);
    UNLOCK();
}

/* ---- step marks, peaks, windows (with the GIL) ----------------------------- */

/* The step mark of window w (-1: the store's): its window peaks restart at
 * the current value; the per-stack marks are the store's. */
static long step_mark(int w, mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes)
{
    void *buf;
    *changes = NULL;
    if (lock_with_room(room_stacks, sizeof(mvz_site_change), 1, &buf))
        return -1;
    uint64_t after;
    mvz_totals *t = totals_of_window(w, &after);
    if (!t) {
        UNLOCK();
        free(buf);
        return -1;
    }
    size_t m = mvz_stacks_step_changes(&stacks, buf);
    memcpy(out, t, sizeof totals);
    for (int d = 0; d < MVZ_NSLOTS; d++) {
        t[d].window_peak = t[d].current;
        if (w < 0)
            btotals[d].window_peak = btotals[d].current;
    }
    UNLOCK();
    *changes = buf;
    return (long)m;
}

long mvz_store_step_mark(mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes)
{
    return step_mark(-1, out, changes);
}

long mvz_store_window_step_mark(int w, mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes)
{
    if (w < 0) {
        *changes = NULL;
        return -1;
    }
    return step_mark(w, out, changes);
}

/* Under the store lock like every writer of the totals, so a callback never
 * sees a half-reset peak. The new peak is dated with next_ts(), later than
 * every allocation recorded so far: the peak set ("made before the peak and
 * live, or freed after it") is then exactly what is live now, and the
 * graveyard entries that only the old peak needed can go. */
int mvz_store_reset_peak(int w)
{
    LOCK();
    uint64_t after;
    mvz_totals *t = totals_of_window(w, &after);
    if (!t) {
        UNLOCK();
        return -1;
    }
    uint64_t now = next_ts();
    for (int d = 0; d < MVZ_NSLOTS; d++) {
        t[d].peak = t[d].current;
        t[d].peak_timestamp = now;
        t[d].peak_count = t[d].live_count;
        mvz_totals *b = &block_totals_of_window(w)[d];
        b->peak = b->current;
        b->peak_timestamp = now;
        b->peak_count = b->live_count;
    }
    mvz_peakset_compact(&graves, totals, btotals, &windows);
    UNLOCK();
    return 0;
}

int mvz_store_copy(int w, int close, mvz_store_copy_t *out)
{
    memset(out, 0, sizeof *out);
    _Static_assert(MVZ_TIMELINE_POINTS >= MVZ_WINDOW_POINTS, "one buffer serves both timelines");
    mvz_point *points = malloc(MVZ_TIMELINE_POINTS * sizeof(mvz_point));
    void *bufs[3]; /* live, peaks, tensor peaks */
    if (!points || lock_with_room(room_live_graves, sizeof(mvz_alloc), 3, bufs)) {
        free(points);
        return -1;
    }
    uint64_t after;
    const mvz_totals *t = totals_of_window(w, &after);
    if (!t) {
        UNLOCK();
        for (int b = 0; b < 3; b++)
            free(bufs[b]);
        free(points);
        return -1;
    }
    const mvz_totals *bt = block_totals_of_window(w);
    memcpy(out->totals, t, sizeof totals);
    memcpy(out->btotals, bt, sizeof btotals);
    out->nlive = collect_live(after, bufs[0]);
    out->npeaks = mvz_peakset_collect(&live, &graves, t, -1, after, bufs[1]);
    out->ntpeaks = mvz_peakset_collect(&live, &graves, bt, -1, after, bufs[2]);
    if (w < 0) {
        memcpy(points, timeline_points, timeline.n * sizeof(mvz_point));
        out->ntimeline = timeline.n;
    } else {
        out->ntimeline = (size_t)mvz_window_timeline(&windows, w, points);
    }
    out->when = next_ts();
    if (close && w >= 0)
        mvz_window_close(&windows, w);
    UNLOCK();
    out->live = bufs[0];
    out->peaks = bufs[1];
    out->tpeaks = bufs[2];
    out->timeline = points;
    return 0;
}

int mvz_store_window_open(uint64_t *start, mvz_totals at_open[MVZ_NSLOTS])
{
    LOCK();
    uint64_t ts = next_ts(); /* every later event has a larger timestamp */
    int w = mvz_window_open(&windows, ts);
    if (w >= 0) {
        *start = ts;
        memcpy(at_open, totals, sizeof totals);
    }
    UNLOCK();
    return w;
}

void mvz_store_window_close(int w)
{
    LOCK();
    mvz_window_close(&windows, w);
    UNLOCK();
}

int mvz_store_window_totals(int w, mvz_totals out[MVZ_NSLOTS])
{
    LOCK();
    const mvz_totals *t = mvz_window_totals(&windows, w);
    if (t)
        memcpy(out, t, sizeof totals);
    UNLOCK();
    return t ? 0 : -1;
}

int mvz_store_window_block_totals(int w, mvz_totals out[MVZ_NSLOTS])
{
    LOCK();
    const mvz_totals *t = block_totals_of_window(w);
    if (t)
        memcpy(out, t, sizeof btotals);
    UNLOCK();
    return t ? 0 : -1;
}

long mvz_store_window_timeline(int w, mvz_point **out)
{
    *out = NULL;
    mvz_point *buf = malloc(MVZ_WINDOW_POINTS * sizeof(mvz_point)); /* before the lock */
    if (!buf)
        return -1;
    LOCK();
    long n = mvz_window_timeline(&windows, w, buf);
    UNLOCK();
    if (n < 0) {
        free(buf);
        return -1;
    }
    *out = buf;
    return n;
}

/* ---- the trace ring (trace_ring.c holds it): enabled and drained by the
 * bindings with the GIL, taken by the native writer's thread without it --- */

int mvz_store_trace_enable(size_t capacity)
{
    LOCK();
    int rc = mvz_ring_enable(&ring, capacity);
    UNLOCK();
    return rc;
}

void mvz_store_trace_disable(void)
{
    LOCK();
    ring.on = 0;
    UNLOCK();
}

size_t mvz_store_trace_pending(void) { return mvz_ring_pending(&ring); }
size_t mvz_store_trace_capacity(void) { return ring.cap; }

size_t mvz_store_trace_take(mvz_alloc *out, size_t room, uint64_t *dropped)
{
    LOCK();
    size_t m = mvz_ring_take(&ring, out, room, dropped);
    UNLOCK();
    return m;
}

long mvz_store_trace_drain(uint8_t **out)
{
    *out = NULL;
    /* Copy the ring out under the lock, encode outside it. */
    size_t n = mvz_ring_pending(&ring) + 256;
    mvz_raw_event *raw = malloc(n * sizeof *raw);
    if (!raw)
        return -1;
    uint64_t dropped;
    LOCK();
    size_t m = mvz_ring_take(&ring, raw, n, &dropped);
    UNLOCK();
    long len = mvz_ring_encode(raw, m, dropped, out);
    free(raw);
    return len;
}

/* ---- fork ------------------------------------------------------------- */

/* The lock is taken around fork() so the child never inherits it held by a
 * thread that does not exist there. */
void mvz_store_atfork_prepare(void) { LOCK(); }
void mvz_store_atfork_parent(void) { UNLOCK(); }
void mvz_store_atfork_child(void)
{
    /* The queue's entries claimed since prepare applied it belong to threads
     * the child does not have (one may never be published here); the
     * drainer thread is the parent's. */
    if (initialized)
        mvz_capq_abandon(&mvz_store_capq);
    pthread_mutex_init(&drainer_lock, NULL);
    pthread_cond_init(&drainer_cond, NULL);
    drainer_running = drainer_stopping = mvz_hot.drainer_kicked = 0;
    new_stacks = 0;
    /* Only the forking thread exists in the child; the lock it took in
     * prepare is released and fresh, and threads registered in the parent
     * are forgotten by bumping the generation. */
    pthread_mutex_init(&store_lock, NULL);
    mvz_hot.generation++;
}
