/* The capture queue: what the capture path hands the store without taking
 * its lock (issue 27). A thread that allocates claims room in one bounded
 * multi-producer ring with a compare-and-swap, writes its event there (the
 * header below and, after it, the frames that changed since the thread's
 * previous allocation: MVZ_CAPQ_KEPT) and publishes it with one release
 * store; the store applies events in
 * the order they were claimed, with its lock held, whenever anything reads
 * it (every reader drains first, so it sees every event published before
 * it asked) and from its drainer thread between reads.
 *
 * The queue (mvz_capq) is the store's: store.c owns it. The producer half
 * (claim, publish) runs without any lock, from store.c's enqueue functions
 * on the capture path; the consumer half (peek, pop, reset) runs with the
 * store's lock held, which makes it single-consumer. This file takes no
 * lock and calls only region.c. */
#ifndef MEMVIZ_CAPQ_H
#define MEMVIZ_CAPQ_H

#include "region.h"
#include "types.h"

#include <stddef.h>
#include <stdint.h>

/* What an entry says happened. */
enum {
    MVZ_CAPQ_ALLOC = 1,
    MVZ_CAPQ_FREE = 2,
    MVZ_CAPQ_STAMPED = 4, /* with ALLOC: `clock` is a stamp */
    MVZ_CAPQ_TSC = 8,     /* `clock` is a TSC tick, not nanoseconds (clock.h) */
    MVZ_CAPQ_NODE_LINE = 16 /* with ALLOC: `seq_note` is the autograd node's own number and
                             * `label_id` names its class; the store adds the node's forward
                             * line as it applies the entry (store.c, node_line) */
};

/* One unit of the ring, and the header of an entry: 64 bytes, one cache
 * line. An allocation's frames follow its header, 4 to a unit. */
typedef struct {
    uint64_t pos;      /* MVZ_CAPQ_MARK(its place), stored last (release) */
    uint64_t address, size, stream;
    uint64_t clock;    /* the tick read (or the allocator route's stamp), clock.h */
    uint64_t seq_note; /* autograd's node counter + 1 to note with this stack (seqmap.h), or 0;
                        * with MVZ_CAPQ_NODE_LINE, the number of the node allocating */
    uint32_t label_id;
    uint16_t thread_idx; /* the store's thread index (at most MVZ_THREAD_OVERFLOW) */
    uint16_t kept;       /* MVZ_CAPQ_KEPT: frames shared with the thread's previous stack */
    int8_t slot;         /* the device's, or MVZ_HOST_SLOT */
    uint8_t op;          /* the capture path's operation (capture.h), counted as applied */
    uint8_t kind, flags; /* MVZ_KIND_*, MVZ_FLAG_* */
    uint8_t what;        /* MVZ_CAPQ_FREE or MVZ_CAPQ_ALLOC (with MVZ_CAPQ_STAMPED), and MVZ_CAPQ_TSC */
    uint8_t units;       /* units claimed, this header included */
    uint16_t depth;      /* frames written after the header */
} mvz_capq_entry;

/* An allocation's stack is its `depth` frames written after the header
 * (innermost first), then the outermost `kept & MVZ_CAPQ_KEPT_MASK` frames
 * of the previous allocation's stack that the same thread queued: the
 * frames that did not change, which the capture path does not write again
 * (store.c, mvz_store_enqueue_alloc). The bits above name the thread
 * registration (the store's generation, modulo 128) those frames were
 * compared under, so that the store never joins two threads' stacks. */
#define MVZ_CAPQ_KEPT_MASK 0x1ffu
#define MVZ_CAPQ_KEPT_SHIFT 9

#define MVZ_CAPQ_FRAMES_PER_UNIT (sizeof(mvz_capq_entry) / sizeof(mvz_frame))
/* Units of an allocation with up to `depth` frames. */
#define MVZ_CAPQ_UNITS(depth) (1u + ((unsigned)(depth) + MVZ_CAPQ_FRAMES_PER_UNIT - 1) / MVZ_CAPQ_FRAMES_PER_UNIT)

typedef struct {
    mvz_region r;
    mvz_capq_entry *units; /* cap units, then room for one whole entry past the end */
    uint64_t cap, mask;
    /* The producers' line: the place claimed up to (compare-and-swap), and
     * the tail as a producer last read it (so that a claim reads the
     * consumer's line only when the queue looks full). */
    uint64_t head __attribute__((aligned(64)));
    uint64_t tail_seen;
    /* The consumer's line: room given back up to here (release), at the end
     * of each drain and every few dozen entries within one. */
    uint64_t tail __attribute__((aligned(64)));
    uint64_t next; /* the consumer's place: applied up to here (lock held) */
} mvz_capq;

/* A header's `pos`: its place + 1 with the top bit set. A unit that held
 * frames starts with a code object's address, whose top bit is never set
 * (user-space addresses), and a header of an earlier lap names another
 * place: so no unit can pass for the header expected there, and the room
 * needs no clearing between laps. */
#define MVZ_CAPQ_MARK(pos) (((pos) + 1) | (1ull << 63))

/* With the GIL, once: reserve the ring (cap_units, a power of two). 0 or -1. */
int mvz_capq_init(mvz_capq *q, uint64_t cap_units);

/* Capture path, no GIL, no lock: room for `units` units, or NULL when the
 * queue is full. The caller fills the entry and its frames in, then
 * publishes it; *pos is its place. A compare-and-swap on the head, retried
 * only when another thread claimed in between. The room is checked against
 * the tail a producer last saw; only when that says full is the consumer's
 * tail read (acquire, and handed on with release through tail_seen, so a
 * producer writes into room only after the consumer has read it). Inline:
 * the capture path claims without a call. */
static inline mvz_capq_entry *mvz_capq_claim(mvz_capq *q, unsigned units, uint64_t *pos)
{
    uint64_t h = __atomic_load_n(&q->head, __ATOMIC_RELAXED);
    uint64_t t = __atomic_load_n(&q->tail_seen, __ATOMIC_ACQUIRE);
    for (;;) {
        if (h + units - t > q->cap) {
            t = __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE);
            __atomic_store_n(&q->tail_seen, t, __ATOMIC_RELEASE);
            if (h + units - t > q->cap)
                return NULL;
        }
        if (__atomic_compare_exchange_n(&q->head, &h, h + units, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            break;
    }
    *pos = h;
    mvz_capq_entry *e = &q->units[h & q->mask];
    e->units = (uint8_t)units;
    return e;
}

/* Capture path, no GIL, no lock: the entry is complete (one release store). */
static inline void mvz_capq_publish(mvz_capq_entry *e, uint64_t pos)
{
    __atomic_store_n(&e->pos, MVZ_CAPQ_MARK(pos), __ATOMIC_RELEASE);
}
/* Where an entry's frames go. */
static inline mvz_frame *mvz_capq_frames(mvz_capq_entry *e) { return (mvz_frame *)(e + 1); }

/* Store lock held: the oldest entry not yet applied, once published
 * (waiting, yielding the CPU, while its producer is between claim and
 * publish: a few dozen nanoseconds of field reads, with no lock held), or
 * NULL when the queue holds nothing claimed before `limit` (UINT64_MAX: no
 * limit). */
mvz_capq_entry *mvz_capq_peek(mvz_capq *q, uint64_t limit);
/* Store lock held: the entry peek returned is applied. Its room goes back
 * every few dozen entries and at mvz_capq_release. */
void mvz_capq_pop(mvz_capq *q, mvz_capq_entry *e);
/* Store lock held: give back the room of every entry applied (release). */
static inline void mvz_capq_release(mvz_capq *q)
{
    if (q->tail != q->next)
        __atomic_store_n(&q->tail, q->next, __ATOMIC_RELEASE);
}
/* Capture path, no lock: whether more than `units` units are claimed and
 * not given back, as of place `pos`. Reads the producers' own line; the
 * consumer's tail (acquire, handed on through tail_seen as a claim does)
 * only when that line's older view says so. */
static inline int mvz_capq_over(mvz_capq *q, uint64_t pos, uint64_t units)
{
    if (pos - __atomic_load_n(&q->tail_seen, __ATOMIC_RELAXED) <= units)
        return 0;
    uint64_t t = __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE);
    __atomic_store_n(&q->tail_seen, t, __ATOMIC_RELEASE);
    return pos - t > units;
}
/* No lock: whether `units` would fit now (the consumer's tail, acquire). */
static inline int mvz_capq_room(const mvz_capq *q, unsigned units)
{
    return __atomic_load_n(&q->head, __ATOMIC_RELAXED) + units -
               __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE) <= q->cap;
}
/* A spin-wait's pause (lets the other hyperthread run). */
static inline void mvz_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}
/* No lock: whether anything is claimed and not yet applied (relaxed reads). */
static inline int mvz_capq_busy(const mvz_capq *q)
{
    return __atomic_load_n(&q->head, __ATOMIC_RELAXED) != __atomic_load_n(&q->tail, __ATOMIC_RELAXED);
}
/* Store lock held, in a fork child only: entries claimed in the parent by
 * threads the child does not have are dropped (they may never be published
 * there). Returns how many units were dropped. */
uint64_t mvz_capq_abandon(mvz_capq *q);
/* Bytes reserved and used (stats). */
size_t mvz_capq_bytes_reserved(const mvz_capq *q);
size_t mvz_capq_bytes_used(const mvz_capq *q);

#endif
