/* The trace event ring (see trace_ring.h). Its state is guarded by the
 * store's lock: writers already hold it, readers take it. */
#include "trace_ring.h"
#include "region.h"
#include "store.h"
#include "clock.h"

#include <stdlib.h>
#include <string.h>

/* A trace event as kept in the ring (encoded into mvz_event on drain). */
typedef struct {
    uint64_t timestamp, address, size;
    uint32_t stack_id, thread_idx, label_id;
    uint8_t op, kind;
    int16_t slot;
} mvz_raw_event;

static mvz_region trace_r;
static mvz_raw_event *trace_ring;
static size_t trace_cap, trace_head, trace_len; /* ring: oldest at head */
static uint64_t trace_dropped;
static int trace_on;

void mvz_trace_record(int op, uint64_t ts, uint64_t address, uint64_t size, uint32_t stack_id,
                      uint32_t thread_idx, uint32_t label_id, int kind, int slot)
{
    if (!trace_on)
        return;
    if (trace_len == trace_cap) {
        trace_dropped++;
        return;
    }
    mvz_raw_event *e = &trace_ring[(trace_head + trace_len) % trace_cap];
    e->timestamp = ts;
    e->address = address;
    e->size = size;
    e->stack_id = stack_id;
    e->thread_idx = thread_idx;
    e->label_id = label_id;
    e->op = (uint8_t)op;
    e->kind = (uint8_t)kind;
    e->slot = (int16_t)slot;
    trace_len++;
}

void mvz_trace_reset_locked(void)
{
    trace_head = trace_len = 0;
    trace_dropped = 0;
    trace_on = 0;
}

int mvz_store_trace_enable(size_t capacity)
{
    mvz_store_lock();
    if (trace_r.base == NULL) {
        if (mvz_region_reserve(&trace_r, capacity * sizeof(mvz_raw_event), 1 << 20)) {
            mvz_store_unlock();
            return -1;
        }
        trace_cap = capacity;
        mvz_region_ensure(&trace_r, capacity * sizeof(mvz_raw_event));
        trace_ring = (mvz_raw_event *)trace_r.base;
    }
    trace_head = trace_len = 0;
    trace_dropped = 0;
    trace_on = 1;
    mvz_store_unlock();
    return 0;
}

void mvz_store_trace_disable(void)
{
    mvz_store_lock();
    trace_on = 0;
    mvz_store_unlock();
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

long mvz_store_trace_drain(uint8_t **out)
{
    *out = NULL;
    /* Copy the ring out under the lock, encode outside it. */
    size_t n = __atomic_load_n(&trace_len, __ATOMIC_RELAXED) + 256;
    mvz_raw_event *raw = malloc(n * sizeof *raw);
    if (!raw)
        return -1;
    mvz_store_lock();
    size_t m = trace_len < n ? trace_len : n;
    for (size_t k = 0; k < m; k++)
        raw[k] = trace_ring[(trace_head + k) % trace_cap];
    trace_head = trace_cap ? (trace_head + m) % trace_cap : 0;
    trace_len -= m;
    uint64_t dropped = trace_dropped;
    trace_dropped = 0;
    mvz_store_unlock();
    /* Every drain starts with a TIME record, so each chunk decodes alone; a
     * new TIME record follows any gap longer than a u32 of nanoseconds. */
    size_t cap = 2 * m + 2;
    mvz_event *ev = malloc(cap * sizeof *ev);
    if (!ev) {
        free(raw);
        return -1;
    }
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
    free(raw);
    *out = (uint8_t *)ev;
    return (long)(k * sizeof *ev);
}

