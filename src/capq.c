/* The capture queue (capq.h). Producers run without the GIL or any lock;
 * the consumer runs with the store's lock held. Calls region.c only. */
#include "capq.h"

#include <sched.h>
#include <string.h>

/* The longest entry: a header and MVZ_MAX_DEPTH frames. */
#define MAX_UNITS MVZ_CAPQ_UNITS(MVZ_MAX_DEPTH)

int mvz_capq_init(mvz_capq *q, uint64_t cap_units)
{
    memset(q, 0, sizeof *q);
    /* An entry is written in one piece: one that starts near the end runs
     * on into MAX_UNITS units kept past it, which no other place maps to. */
    size_t bytes = (size_t)(cap_units + MAX_UNITS) * sizeof(mvz_capq_entry);
    if (mvz_region_reserve(&q->r, bytes, 1 << 16))
        return -1;
    q->units = (mvz_capq_entry *)q->r.base;
    q->cap = cap_units;
    q->mask = cap_units - 1;
    return 0;
}

/* Store lock held (one consumer at a time). */
mvz_capq_entry *mvz_capq_peek(mvz_capq *q, uint64_t limit)
{
    uint64_t p = q->next; /* only the consumer writes it */
    if (p >= limit)
        return NULL;
    mvz_capq_entry *e = &q->units[p & q->mask];
    for (;;) {
        if (__atomic_load_n(&e->pos, __ATOMIC_ACQUIRE) == MVZ_CAPQ_MARK(p))
            return e;
        if (__atomic_load_n(&q->head, __ATOMIC_ACQUIRE) == p)
            return NULL; /* nothing claimed */
        sched_yield(); /* claimed, not yet published: its producer is writing it */
    }
}

/* Store lock held: the consumer's place moves on; the room goes back to the
 * producers every 256 units' worth of entries (one release store, on the
 * consumer's own line), the rest at mvz_capq_release. */
void mvz_capq_pop(mvz_capq *q, mvz_capq_entry *e)
{
    q->next += e->units;
    if (q->next - q->tail >= 256)
        mvz_capq_release(q);
}

uint64_t mvz_capq_abandon(mvz_capq *q)
{
    uint64_t h = __atomic_load_n(&q->head, __ATOMIC_ACQUIRE);
    uint64_t dropped = h - q->next;
    q->next = q->tail = q->tail_seen = h;
    return dropped;
}

size_t mvz_capq_bytes_reserved(const mvz_capq *q) { return q->r.reserved; }

size_t mvz_capq_bytes_used(const mvz_capq *q)
{
    uint64_t h = __atomic_load_n(&q->head, __ATOMIC_RELAXED);
    uint64_t seen = h < q->cap ? h + MAX_UNITS : q->cap + MAX_UNITS; /* units ever written, at most */
    return (size_t)seen * sizeof(mvz_capq_entry);
}
