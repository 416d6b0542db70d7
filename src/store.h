/* The store: what memviz knows about memory, kept in C.
 *
 * Live allocations by address, interned stacks with per-stack aggregates,
 * per-device totals and peaks, the allocations live at each device's peak,
 * a bounded timeline of totals and the last failed allocations.
 *
 * Writers are the CUPTI callbacks (any thread, no GIL) and the activity
 * buffer callback; readers are the module's functions (with the GIL). All of
 * them take one mutex, `store lock`, for a bounded time: nothing that holds
 * it calls Python, CUDA, CUPTI or malloc, or takes another lock but the
 * label table's (a leaf: a backward allocation's label, interned as the
 * queue is applied), so it cannot take part in a deadlock
 * (docs/architecture.md, rule 1).
 *
 * Its functions only: the types its readers fill are store_types.h's, at
 * the bottom floor, for a file that needs them but calls nothing here.
 */
#ifndef MEMVIZ_STORE_H
#define MEMVIZ_STORE_H

#include "blocks.h"
#include "capq.h"
#include "clock.h"
#include "frames.h"
#include "hot.h"
#include "store_types.h"

#include <string.h>

/* Lifetime (with the GIL). */
int mvz_store_init(size_t max_live, size_t max_stacks, size_t max_frames);
/* Whether mvz_store_init succeeded. */
int mvz_store_ready(void);
/* Forget everything recorded. Python references the store held (code
 * objects, resolved tuples) are returned through *refs / *nrefs (malloc'd)
 * for the caller to release after the lock is dropped. */
void mvz_store_clear(void ***refs, size_t *nrefs);

/* Hot path (any thread, no GIL): this thread's index in the store's thread
 * table (inline below: two TLS words and the generation, read from the
 * capture path's lines); registered on its first call, out of line. */
static inline uint32_t mvz_store_thread_index(void);
uint32_t mvz_store_thread_register(void);
/* This thread's serial: 1, 2, ... in the order threads first ask, never
 * reused within the process (glibc reuses pthread_self() values, and the
 * kernel thread ids, of threads that ended). */
uint64_t mvz_store_thread_serial(void);
/* Returns the allocation's stack id (0: no frames, or not recorded). */
uint32_t mvz_store_alloc(uint64_t address, uint64_t size, uint64_t stream, int slot,
                         int kind, uint32_t label_id, const mvz_frame *frames, int depth);
/* The whole form, which mvz_store_alloc calls: dated `stamp` (a value
 * tick, clock.h's mvz_tick_as, read earlier on this thread; 0: now). A
 * block is dated when it was asked for, so that the segment the allocator
 * created for it, recorded in between, never makes a peak the block is
 * missing from. Such dates are not unique (store timestamps otherwise are):
 * a block may share its nanosecond with the segment made for it, which
 * only keeps it in that peak's set, where it belongs.
 * `requested`, when not 0, says the
 * allocation's size is known and what was asked for (a block read from
 * PyTorch at attach); else a block's `size` is the request, and its size is
 * worked out by PyTorch's rules (blocks.h). `flags`: MVZ_FLAG_* (record.h). */
uint32_t mvz_store_record_alloc(uint64_t stamp, uint64_t address, uint64_t size,
                                uint64_t requested, uint64_t stream, int slot, int kind,
                                uint32_t label_id, int flags, const mvz_frame *frames, int depth);
void mvz_store_free(uint64_t address, int kind);
/* Any thread, no GIL: the block at `address` had another stream's use
 * recorded on it (MVZ_FLAG_STREAM). */
void mvz_store_mark_stream(uint64_t address);
/* The capture queue (capq.h), the capture path's way into the store since
 * issue 27: no lock taken. Capture path, no GIL: an entry claimed by
 * mvz_store_enqueue_alloc or _free (applying the queue itself when it is
 * full, never dropping) is published, once filled in, here. */
static inline void mvz_store_publish(mvz_capq_entry *e, uint64_t pos);
/* Capture path, no GIL: an allocation's stack goes into the queue as far as
 * it changed since the calling thread's previous one (capq.h,
 * MVZ_CAPQ_KEPT). mvz_store_walk_begin says where the thread walks its
 * stack: `buf` (also returned; NULL: a thread past the thread table, which
 * walks into its own and writes every frame), the stack to compare it
 * with (`last`, `m` frames; NULL when none will be kept), and where the
 * walk notes its frames' addresses (`where`, `nwhere`: only under the
 * walk's prefetch, a benchmark's). Then mvz_store_enqueue_alloc claims the
 * entry, writes its frames, depth, kept and thread_idx; the caller fills
 * the rest in and publishes it. */
typedef struct {
    mvz_frame *buf;
    const mvz_frame *last;
    int m, nwhere;
    const void **where;
} mvz_walk;
static inline mvz_frame *mvz_store_walk_begin(uint32_t thread_idx, mvz_walk *w);
/* The walk's prefetch (a benchmark's): where thread_idx's walk notes its
 * frames' addresses. */
const void **mvz_store_walk_where(uint32_t thread_idx);
/* Capture path, no GIL, no lock, ahead of an allocation (allocator.c,
 * while PyTorch allocates): hints only. The queue's next unit, for writing
 * (the producers' line is read); the frames this thread's last walk read
 * (mvz_walk's `where`), its last stack, and the buffer its next walk
 * writes. */
static inline void mvz_store_prefetch(void);
/* `walked_kept`: the frames the walk found shared with *last (-1: not
 * known; compared here). */
static inline mvz_capq_entry *mvz_store_enqueue_alloc(uint32_t thread_idx, const mvz_frame *f,
                                                      int depth, int walked_kept, uint64_t *pos);
/* Any thread: whether entries leave shared frames out (tests turn it off
 * to fill the queue); returns the setting before. */
int mvz_store_share_frames(int on);
/* Capture path, no GIL: a free, queued; `op` is counted when it is
 * applied (mvz_store_op_counts). */
static inline void mvz_store_enqueue_free(uint64_t address, int kind, int op);
/* Operations the queue has applied, by the capture path's numbers
 * (capture.h, under MVZ_STORE_OPS, store_types.h): the capture path counts
 * them without a locked add. Any thread, no store lock held (it applies the
 * queue). */
void mvz_store_op_counts(uint64_t out[MVZ_STORE_OPS]);
void mvz_store_forget_op_counts(void);
/* Any thread, no store lock held: apply the queue now (every reader below
 * does so itself). */
void mvz_store_sync(void);
/* With the GIL: the thread that applies the queue between reads, while
 * capture runs (on) or not; joined when off. 0, or -1 when it could not
 * start (the capture path then applies the queue when it is full). */
int mvz_store_drainer(int on);
/* A benchmark's: the drainer's period from its next wait (ns <= 0: the
 * default); returns the one before. With the GIL. */
long mvz_store_drain_period(long ns);
/* Which of the capture path's prefetches run: the frames and stacks the
 * walk will read (WALK, in mvz_store_prefetch), the queue's next unit before
 * a claim (QUEUE), and the next unit again after a publish (NEXT). A
 * benchmark's: mvz_store_prefetch_on sets the bits and returns those before. */
#define MVZ_PF_WALK 1
#define MVZ_PF_QUEUE 2
#define MVZ_PF_NEXT 4
#define MVZ_PF_DEMOTE 8 /* not a prefetch: an entry's lines pushed out to the shared cache once published */
#define MVZ_PF_DISCARD 16 /* not a prefetch: entries written to the thread's own room, never queued */
/* Not prefetches: a benchmark's weights, to learn what one more cold line
 * costs an event inside a real step. Each event (at its publish) runs 32
 * more code lines (a chain of jumps, one a line, away from the capture
 * path's code) or reads 32 more data lines (the same ones each time). */
#define MVZ_PF_PAD_CODE 32
#define MVZ_PF_PAD_DATA 64
#define MVZ_PF_ALL 127
/* An ablation build's only (CFLAGS=-DMVZ_ABLATE, benchmarks/bench_toggle.py
 * on a copy of the tree, as the stage build): pieces of the capture path
 * left out, to learn what each costs inside a real step. NO_NODE: an
 * allocation reads no autograd node, node label or sequence number (it
 * keeps the thread's label); NO_TICK: no event reads the clock (its tick is
 * 0). Events then lose what the piece gives: never a user's build. In every
 * other build mvz_ablated() is the constant 0 and these bits are refused. */
#define MVZ_PF_NO_NODE 128
#define MVZ_PF_NO_TICK 256
#ifdef MVZ_ABLATE
#define MVZ_PF_MAX (MVZ_PF_ALL | MVZ_PF_NO_NODE | MVZ_PF_NO_TICK)
#else
#define MVZ_PF_MAX MVZ_PF_ALL
#endif
/* Capture path, any thread, no GIL: whether an ablation build leaves the
 * piece `bit` out now (a relaxed load of the read-mostly line's hints);
 * the constant 0 elsewhere, so a user's build compiles no check at all. */
static inline int mvz_ablated(int bit)
{
#ifdef MVZ_ABLATE
    return (__atomic_load_n(&mvz_hot.hints, __ATOMIC_RELAXED) & bit) != 0;
#else
    (void)bit;
    return 0;
#endif
}
/* The queue's unit only: the walk's prefetch (c44c366) moved time out of
 * the capture path's timer but gained no wall time in the step, while it
 * adds ~300 instructions an allocation (benchmarks/RESULTS.md, 2026-12-04). */
#define MVZ_PF_DEFAULT MVZ_PF_QUEUE
/* Frame addresses a walk notes under MVZ_PF_WALK. */
#define MVZ_STORE_WHERE_N 32
int mvz_store_prefetch_on(int mode);
/* Called after the store's lock is released when the queue interned new
 * stacks, when set: codeobj.c uses it on Python < 3.12 to schedule keeping
 * their code objects alive (Py_AddPendingCall, which CPython documents as
 * callable without the GIL from any thread). */
extern void (*mvz_store_new_stack_hook)(void);

/* With the GIL: PyTorch's allocator settings, for sizing its blocks (blocks.h). */
void mvz_store_set_rules(const mvz_rules *r);
/* With the GIL: a free seen late, of the allocation made at `made` only
 * (store timestamp). 1 when it was live. */
int mvz_store_retire(uint64_t address, int kind, uint64_t made);
void mvz_store_failure(uint64_t size, uint64_t stream, int slot, int kind, uint32_t label_id,
                       int result, const mvz_frame *frames, int depth);

/* Readers (with the GIL). Each copies under the lock into a malloc'd array
 * the caller frees; they return the count, or -1 when out of memory. */
long mvz_store_live(mvz_alloc **out);
long mvz_store_sites(mvz_site **out);
long mvz_store_failures(mvz_failure **out);
long mvz_store_timeline(mvz_point **out);
long mvz_store_threads(mvz_thread **out);
void mvz_store_totals(mvz_totals out[MVZ_NSLOTS]);
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
 * (records as the ring keeps them) with the dropped count, under the
 * lock for one copy. */
size_t mvz_store_trace_pending(void);
size_t mvz_store_trace_capacity(void);
size_t mvz_store_trace_take(mvz_alloc *out, size_t room, uint64_t *dropped);
uint32_t mvz_store_stack_count(void);

/* Windows: trackers nested in a running one (with the GIL). A window counts
 * what the store records after it opened as if the store had been cleared
 * then: its own totals, peak, peak set and timeline. Allocations live when it
 * opened are not the window's, so their frees do not count in it. At most
 * MVZ_MAX_WINDOWS are open at once; the capture path pays a few additions per
 * open window. */
/* MVZ_MAX_WINDOWS, MVZ_WINDOW_POINTS: types.h. */
/* Returns the id of a newly opened window, or -1 when all are open. *start is
 * its opening timestamp (it holds the allocations made strictly after it) and
 * at_open[] the store's totals at that moment. */
int mvz_store_window_open(uint64_t *start, mvz_totals at_open[MVZ_NSLOTS]);
void mvz_store_window_close(int w);
/* As mvz_store_totals / _timeline / _step_mark, for window w; _peak_live
 * (the allocations live at a peak) and _block_totals also take -1, the
 * store itself. They return -1 for a window that is not open (or when out of memory). The
 * step mark's per-stack changes are the store's, shared by all windows. */
int mvz_store_window_totals(int w, mvz_totals out[MVZ_NSLOTS]);
/* PyTorch's blocks' totals of window w (-1: the store's). */
int mvz_store_window_block_totals(int w, mvz_totals out[MVZ_NSLOTS]);
/* With `tensor`: live at the peak of PyTorch's blocks (the tensor peak). */
long mvz_store_window_peak_live(int w, int slot, int tensor, mvz_alloc **out);
long mvz_store_window_timeline(int w, mvz_point **out);
long mvz_store_window_step_mark(int w, mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes);
/* Everything a tracker reads, copied at one instant (so the copy adds up
 * while other threads go on allocating): of window w, or of the store with
 * w = -1. With `close`, window w closes in the same instant. The buffers are
 * malloc'd (the caller frees them); returns 0, or -1 when out of memory or w
 * is not open. */
/* mvz_store_copy_t: store_types.h. */
int mvz_store_copy(int w, int close, mvz_store_copy_t *out);

/* Fork support: the child starts with the lock free and the store empty of
 * in-flight state. */
void mvz_store_atfork_prepare(void);
void mvz_store_atfork_parent(void);
void mvz_store_atfork_child(void);

/* ---- the capture path's inline parts (no GIL, no lock: this thread's
 * TLS and the capture path's read-mostly line, hot.h) ------------------- */

static inline uint32_t mvz_store_thread_index(void)
{
    uint32_t gen = __atomic_load_n(&mvz_hot.generation, __ATOMIC_ACQUIRE);
    if (__builtin_expect(mvz_tl.thread_plus1 && mvz_tl.generation == gen, 1))
        return mvz_tl.thread_plus1 - 1;
    return mvz_store_thread_register();
}

/* Thread idx's walk buffer `which` (mvz_tl.walk_last: the one holding its
 * last stack). Arithmetic only. */
static inline mvz_frame *mvz_store_walk_row(uint32_t idx, int which)
{
    return (mvz_frame *)mvz_hot.walked_base + ((size_t)idx * 2 + (size_t)(which != 0)) * MVZ_MAX_DEPTH;
}

/* Whether this thread's next allocation may leave out the frames it shares
 * with its last stack: that stack is in this thread's buffers under this
 * registration `gen`, it was queued (after a discarded one the next writes
 * every frame, unless this one is discarded too), and sharing is on. */
static inline int mvz_store_keeps_frames(uint32_t thread_idx, uint32_t gen, int discarding)
{
    return mvz_tl.walk_gen == gen && mvz_tl.walk_idx == thread_idx &&
           (discarding || !mvz_tl.discarded) && __atomic_load_n(&mvz_hot.share_frames, __ATOMIC_RELAXED);
}

/* See mvz_walk above. Reads this thread's TLS and writes only *w and this
 * thread's TLS. */
static inline mvz_frame *mvz_store_walk_begin(uint32_t thread_idx, mvz_walk *w)
{
    w->last = NULL;
    w->m = 0;
    w->where = NULL;
    w->nwhere = 0;
    if (thread_idx >= MVZ_MAX_THREADS)
        return w->buf = NULL;
    int hints = __atomic_load_n(&mvz_hot.hints, __ATOMIC_RELAXED) & (MVZ_PF_WALK | MVZ_PF_DISCARD);
    mvz_tl.where_n = 0; /* until this walk's are written (mvz_store_enqueue_alloc) */
    mvz_tl.where_asked = (hints & MVZ_PF_WALK) != 0;
    if (__builtin_expect(hints & MVZ_PF_WALK, 0)) { /* the walk's prefetch: its row of addresses */
        w->where = mvz_store_walk_where(thread_idx);
        w->nwhere = MVZ_STORE_WHERE_N;
    }
    if (mvz_store_keeps_frames(thread_idx, mvz_tl.generation, (hints & MVZ_PF_DISCARD) != 0)) {
        w->last = mvz_store_walk_row(thread_idx, mvz_tl.walk_last);
        w->m = mvz_tl.walk_n;
    }
    return w->buf = mvz_store_walk_row(thread_idx, !mvz_tl.walk_last);
}

/* The capture queue itself, which the inline parts below claim from and
 * publish to; the rest of the store reaches it only with its lock held. */
extern mvz_capq mvz_store_capq __attribute__((visibility("hidden")));
/* Out of line, each rare: the queue full (applied here if the lock is
 * free, else waited for: nothing is dropped); a benchmark's switches at a
 * publish; the drain thread woken (the queue over a quarter full); a
 * benchmark's discarded entry's room (MVZ_PF_DISCARD; NULL where it does
 * not apply); the walk's prefetch (MVZ_PF_WALK). */
mvz_capq_entry *mvz_store_enqueue_full(unsigned units, uint64_t *pos);
void mvz_store_publish_slow(mvz_capq_entry *e, uint64_t pos, int hints);
void mvz_store_kick(void);
mvz_capq_entry *mvz_store_discard_room(uint64_t *pos);
void mvz_store_prefetch_walk(void);
/* Between two stores of constant bytes that lie side by side in an entry:
 * else the compiler merges them into one 16-bit store and, to avoid a
 * 16-bit immediate, loads the value from read-only data, one more cold
 * line an event. */
#define MVZ_STORE_BYTES_APART() __asm__("" ::: "memory")
/* A discarded entry's place: never published. */
#define MVZ_STORE_DISCARDED UINT64_MAX

/* The frames an entry writes (a few, most often none: those that changed),
 * copied in a loop here instead of by a call to the C library's memcpy,
 * which would cost the event its code lines and its jump slot's. The
 * empty asm keeps the compiler from turning the loop back into that call. */
static inline void mvz_store_copy_frames(mvz_frame *dst, const mvz_frame *src, int n)
{
    for (int i = 0; i < n; i++) {
        __asm__("" : "+r"(i));
        dst[i] = src[i];
    }
}

/* Room in the queue for `units` units: the claim (a compare-and-swap on
 * the producers' line, capq.h), or, the queue full, out of line. */
static inline mvz_capq_entry *mvz_store_claim(unsigned units, uint64_t *pos)
{
    mvz_capq_entry *e = mvz_capq_claim(&mvz_store_capq, units, pos);
    return __builtin_expect(e != NULL, 1) ? e : mvz_store_enqueue_full(units, pos);
}

/* The drain thread is woken early in an allocation storm (thousands of
 * events within its 4 ms period), so the allocating thread seldom finds
 * the queue full and applies it itself. Kicked already: a plain load,
 * nothing else (in a storm the queue stays over a quarter full until the
 * drainer runs, and every event would else read the consumer's line). */
static inline void mvz_store_kick_if_over(uint64_t pos)
{
    if (!__atomic_load_n(&mvz_hot.drainer_kicked, __ATOMIC_RELAXED) &&
        mvz_capq_over(&mvz_store_capq, pos, mvz_store_capq.cap / 4))
        mvz_store_kick();
}

/* The entry is whole: one release store, and the drainer's check. */
static inline void mvz_store_publish(mvz_capq_entry *e, uint64_t pos)
{
    int hints = __atomic_load_n(&mvz_hot.hints, __ATOMIC_RELAXED);
    if (__builtin_expect((hints & (MVZ_PF_ALL & ~(MVZ_PF_QUEUE | MVZ_PF_WALK))) != 0 ||
                             pos == MVZ_STORE_DISCARDED, 0)) {
        mvz_store_publish_slow(e, pos, hints);
        return;
    }
    mvz_capq_publish(e, pos);
    mvz_store_kick_if_over(pos);
}

/* Ahead of an allocation (allocator.c, while PyTorch allocates): the
 * queue's next unit asked for, for writing, so that its line (cold: it
 * comes round once a lap) arrives while the caller walks the stack, not
 * while it writes (a hint: whichever unit the claim then gets, nothing
 * depends on it; it reads the producers' line, which the claim reads
 * next); and under the walk's prefetch (a benchmark's) the frames this
 * thread's last walk read, out of line. mvz_store_publish_slow asks for
 * the next unit the same way (MVZ_PF_NEXT). */
static inline void mvz_store_prefetch_unit(void)
{
    uint64_t h = __atomic_load_n(&mvz_store_capq.head, __ATOMIC_RELAXED);
    __builtin_prefetch(&mvz_store_capq.units[h & mvz_store_capq.mask], 1, 3);
}

static inline void mvz_store_prefetch(void)
{
    int hints = __atomic_load_n(&mvz_hot.hints, __ATOMIC_RELAXED);
    if (hints & MVZ_PF_QUEUE)
        mvz_store_prefetch_unit();
    if (__builtin_expect(hints & MVZ_PF_WALK, 0))
        mvz_store_prefetch_walk();
}

/* Capture path, no GIL, no lock held: an allocation's entry, claimed, with
 * its stack f[0..depth) written in as far as it differs from the previous
 * stack this thread queued (MVZ_CAPQ_KEPT): inside a step most allocations
 * come from the same few lines, and their callers' frames, a cold cache
 * line per four frames written into the queue, are the ones the thread
 * queued just before. `f` is the buffer mvz_store_walk_begin gave this
 * thread (or the caller's own, for a thread with no index: then every
 * frame is written). Only this thread's buffers and TLS are read. The
 * caller fills the rest in and publishes it. */
static inline __attribute__((always_inline)) mvz_capq_entry *
mvz_store_enqueue_alloc(uint32_t thread_idx, const mvz_frame *f, int depth, int walked_kept, uint64_t *pos)
{
    int kept = 0;
    uint32_t gen = mvz_tl.generation; /* the registration thread_idx comes from */
    int mine = thread_idx < MVZ_MAX_THREADS && f == mvz_store_walk_row(thread_idx, !mvz_tl.walk_last);
    mvz_capq_entry *e = NULL;
    if (__builtin_expect(__atomic_load_n(&mvz_hot.hints, __ATOMIC_RELAXED) & MVZ_PF_DISCARD, 0))
        e = mvz_store_discard_room(pos);
    if (mine && mvz_store_keeps_frames(thread_idx, gen, e != NULL)) {
        kept = walked_kept >= 0 ? walked_kept /* compared by the walk (mvz_frames_capture_cmp) */
                                : mvz_frames_shared_outer(f, depth, mvz_store_walk_row(thread_idx, mvz_tl.walk_last),
                                                          mvz_tl.walk_n);
    }
    int written = depth - kept;
    MVZ_STAGE(MVZ_ST_A_COMPARE);
    if (e)
        mvz_tl.discarded = 1;
    else {
        mvz_tl.discarded = 0;
        e = mvz_store_claim(MVZ_CAPQ_UNITS(written), pos);
    }
    MVZ_STAGE(MVZ_ST_A_CLAIM);
    mvz_store_copy_frames(mvz_capq_frames(e), f, written);
    e->depth = (uint16_t)written;
    e->kept = (uint16_t)((unsigned)kept | (gen & 127u) << MVZ_CAPQ_KEPT_SHIFT);
    e->thread_idx = (uint16_t)(thread_idx < MVZ_MAX_THREADS ? thread_idx : MVZ_THREAD_OVERFLOW);
    if (mine) { /* f is this thread's last stack now */
        mvz_tl.where_n = mvz_tl.where_asked ? (uint8_t)(depth < MVZ_STORE_WHERE_N ? depth : MVZ_STORE_WHERE_N) : 0;
        mvz_tl.walk_last = !mvz_tl.walk_last;
        mvz_tl.walk_n = (uint16_t)depth;
        mvz_tl.walk_gen = gen;
        mvz_tl.walk_idx = thread_idx;
    } else {
        mvz_tl.walk_gen = 0; /* the store's last stack of this thread is not in its buffers */
    }
    return e;
}

/* Capture path, no GIL: a free, queued (its tick read before the claim). */
static inline __attribute__((always_inline)) void mvz_store_enqueue_free(uint64_t address, int kind,
                                                                      int op)
{
    int tsc = mvz_tick_is_tsc();
    uint64_t clock = mvz_ablated(MVZ_PF_NO_TICK) ? 0 : mvz_tick_as(tsc);
    MVZ_STAGE(MVZ_ST_F_TICK);
    uint64_t pos;
    mvz_capq_entry *e = NULL;
    if (__builtin_expect(__atomic_load_n(&mvz_hot.hints, __ATOMIC_RELAXED) & MVZ_PF_DISCARD, 0))
        e = mvz_store_discard_room(&pos);
    if (!e)
        e = mvz_store_claim(1, &pos);
    MVZ_STAGE(MVZ_ST_F_CLAIM);
    e->what = (uint8_t)(MVZ_CAPQ_FREE | (tsc ? MVZ_CAPQ_TSC : 0));
    e->address = address;
    e->kind = (uint8_t)kind;
    MVZ_STORE_BYTES_APART(); /* its definition says why */
    e->op = (uint8_t)op;
    e->clock = clock;
    e->seq_note = 0;
    mvz_store_publish(e, pos);
    MVZ_STAGE(MVZ_ST_F_PUBLISH);
}

#endif
