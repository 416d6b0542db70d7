/* The trace event ring (trace_ring.h). The ring's state is the store's and
 * is guarded by the store's lock, which every caller of the functions that
 * touch it holds; nothing here takes a lock. Calls region.c and clock.h. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (clock.h) */
#include "trace_ring.h"
#include "clock.h"

#include <stdlib.h>
#include <string.h>

/* Capture path, no GIL, store lock held by the caller: one write into the
 * preallocated ring, or a counter increment. */
void mvz_ring_record(mvz_trace_ring *t, const mvz_alloc *event)
{
    if (!t->on)
        return;
    if (t->len == t->cap) {
        t->dropped++;
        return;
    }
    t->events[(t->head + t->len) % t->cap] = *event;
    MVZ_SET_PEEKED(t->len, t->len + 1); /* peeked by the writer thread (mvz_ring_pending) */
}

void mvz_ring_reset(mvz_trace_ring *t)
{
    t->head = 0;
    MVZ_SET_PEEKED(t->len, 0);
    t->dropped = 0;
    t->on = 0;
}

int mvz_ring_enable(mvz_trace_ring *t, size_t capacity)
{
    /* Each trace or flight recorder gets the ring it asked for: a larger one
     * is reserved anew, a smaller one gives back the pages of the last. The
     * store's lock is held, so nothing writes the ring meanwhile. */
    size_t bytes = capacity * sizeof(mvz_raw_event);
    if (t->r.base != NULL && bytes > t->r.reserved)
        mvz_region_release(&t->r);
    if (t->r.base == NULL) {
        if (mvz_region_reserve(&t->r, bytes, 1 << 20))
            return -1;
    } else {
        mvz_region_discard(&t->r);
    }
    t->cap = capacity;
    mvz_region_ensure(&t->r, bytes);
    t->events = (mvz_raw_event *)t->r.base;
    t->head = 0;
    MVZ_SET_PEEKED(t->len, 0);
    t->dropped = 0;
    t->on = 1;
    return 0;
}

size_t mvz_ring_pending(const mvz_trace_ring *t) { return __atomic_load_n(&t->len, __ATOMIC_RELAXED); }

size_t mvz_ring_take(mvz_trace_ring *t, mvz_raw_event *out, size_t room, uint64_t *dropped)
{
    size_t m = t->len < room ? t->len : room;
    for (size_t k = 0; k < m; k++)
        out[k] = t->events[(t->head + k) % t->cap];
    t->head = t->cap ? (t->head + m) % t->cap : 0;
    MVZ_SET_PEEKED(t->len, t->len - m);
    *dropped = t->dropped;
    t->dropped = 0;
    return m;
}

long mvz_ring_encode_from(const mvz_raw_event *raw, size_t m, uint64_t dropped, uint64_t start,
                          int marker_flags, uint8_t **out)
{
    *out = NULL;
    /* Every run starts with a TIME record, so each chunk decodes alone. */
    size_t cap = 2 * m + 2;
    mvz_event *ev = malloc(cap * sizeof *ev);
    if (!ev)
        return -1;
    size_t k = 0;
    uint64_t prev = start;
    mvz_event_marker(&ev[k++], MVZ_EV_TIME, prev, marker_flags);
    if (dropped)
        mvz_event_marker(&ev[k++], MVZ_EV_GAP, dropped, marker_flags);
    for (size_t i = 0; i < m; i++) {
        uint64_t ts = raw[i].timestamp;
        if (ts < prev || ts - prev > 0xffffffffULL) {
            mvz_event_marker(&ev[k++], MVZ_EV_TIME, ts, marker_flags);
            prev = ts;
        }
        mvz_event_encode(&ev[k++], &raw[i], &prev);
    }
    *out = (uint8_t *)ev;
    return (long)(k * sizeof *ev);
}

long mvz_ring_encode(const mvz_raw_event *raw, size_t m, uint64_t dropped, uint8_t **out)
{
    return mvz_ring_encode_from(raw, m, dropped, m ? raw[0].timestamp : mvz_now_ns(), 0, out);
}
