/* The trace event ring (trace_ring.h). The ring's state is the store's and
 * is guarded by the store's lock, which every caller of the functions that
 * touch it holds; nothing here takes a lock. Calls region.c and clock.h. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime (clock.h) */
#include "trace_ring.h"
#include "clock.h"
#include "store.h"

#include <stdlib.h>
#include <string.h>

/* Capture path, no GIL, store lock held by the caller: one write into the
 * preallocated ring, or a counter increment. */
void mvz_ring_record(mvz_trace_ring *t, int op, uint64_t ts, uint64_t address, uint64_t size,
                     uint32_t stack_id, uint32_t thread_idx, uint32_t label_id, int kind, int slot)
{
    if (!t->on)
        return;
    if (t->len == t->cap) {
        t->dropped++;
        return;
    }
    mvz_raw_event *e = &t->events[(t->head + t->len) % t->cap];
    e->timestamp = ts;
    e->address = address;
    e->size = size;
    e->stack_id = stack_id;
    e->thread_idx = thread_idx;
    e->label_id = label_id;
    e->op = (uint8_t)op;
    e->kind = (uint8_t)kind;
    e->slot = (int16_t)slot;
    t->len++;
}

void mvz_ring_reset(mvz_trace_ring *t)
{
    t->head = t->len = 0;
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
    t->head = t->len = 0;
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
    t->len -= m;
    *dropped = t->dropped;
    t->dropped = 0;
    return m;
}

static void put_event(mvz_event *e, uint64_t *prev_ts, const mvz_raw_event *r)
{
    memset(e, 0, sizeof *e);
    uint64_t d = r->timestamp >= *prev_ts ? r->timestamp - *prev_ts : 0;
    e->ts_delta = (uint32_t)d;
    *prev_ts += d;
    e->op = r->op;
    e->kind = r->kind;
    e->device = (int8_t)(r->slot == MVZ_HOST_SLOT ? -1 : r->slot);
    e->stack_id = r->stack_id;
    e->thread_idx = (uint16_t)(r->thread_idx > 0xffff ? 0xffff : r->thread_idx);
    e->label_id = (uint16_t)(r->label_id > 0xffff ? 0xffff : r->label_id);
    e->address = r->address;
    e->size = r->size;
}

long mvz_ring_encode(const mvz_raw_event *raw, size_t m, uint64_t dropped, uint8_t **out)
{
    *out = NULL;
    /* Every drain starts with a TIME record, so each chunk decodes alone; a
     * new TIME record follows any gap longer than a u32 of nanoseconds. */
    size_t cap = 2 * m + 2;
    mvz_event *ev = malloc(cap * sizeof *ev);
    if (!ev)
        return -1;
    size_t k = 0;
    uint64_t prev = m ? raw[0].timestamp : mvz_now_ns();
    memset(&ev[k], 0, sizeof ev[k]);
    ev[k].op = MVZ_EV_TIME;
    ev[k].address = prev;
    k++;
    if (dropped) {
        memset(&ev[k], 0, sizeof ev[k]);
        ev[k].op = MVZ_EV_GAP;
        ev[k].address = dropped;
        k++;
    }
    for (size_t i = 0; i < m; i++) {
        if (raw[i].timestamp - prev > 0xffffffffULL && raw[i].timestamp > prev) {
            memset(&ev[k], 0, sizeof ev[k]);
            ev[k].op = MVZ_EV_TIME;
            ev[k].address = raw[i].timestamp;
            prev = raw[i].timestamp;
            k++;
        }
        put_event(&ev[k++], &prev, &raw[i]);
    }
    *out = (uint8_t *)ev;
    return (long)(k * sizeof *ev);
}
