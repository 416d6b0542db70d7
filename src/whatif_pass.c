/* What if, the pass over a recording (whatif_pass.h). It runs with the GIL
 * released and needs no lock of its own: it touches only the pass and the
 * caller's buffer (the binding keeps one call at a time), and while the
 * models run, each is one worker's alone and the queue is read only (the
 * workers share a mutex only to pick their next share). Calls whatif.c;
 * hash.h and record.h are headers. */
#include "whatif_pass.h"
#include "grow.h"
#include "hash.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define SLICE 4096        /* ops a worker takes through one model at a time */
#define MAX_THREADS 16

/* ---- life ------------------------------------------------------------------------ */

int mvz_whatif_pass_init(mvz_whatif_pass *p, const mvz_whatif_settings *settings, size_t n, uint64_t start_ns)
{
    memset(p, 0, sizeof *p);
    p->ts = start_ns;
    p->expandable = n > 0 && settings[0].rules.expandable;
    p->models = calloc(n ? n : 1, sizeof *p->models);
    p->caplive = 1024;
    p->live = calloc(p->caplive, sizeof *p->live);
    if (!p->models || !p->live) {
        mvz_whatif_pass_release(p);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        p->models[i] = mvz_whatif_new(&settings[i]);
        p->n = i + 1;
        if (!p->models[i]) {
            mvz_whatif_pass_release(p);
            return -1;
        }
    }
    return 0;
}

void mvz_whatif_pass_release(mvz_whatif_pass *p)
{
    for (size_t i = 0; i < p->n; i++)
        mvz_whatif_free(p->models[i]);
    free(p->models);
    free(p->ops);
    free(p->live);
    free(p->spare);
    free(p->bytes);
    free(p->dev);
    free(p->seg);
    memset(p, 0, sizeof *p);
}

/* ---- the recording's live allocations: (address, kind) -> what it was ------------ */

static size_t live_home(uint64_t address, uint8_t kind, size_t mask)
{
    return (size_t)mvz_mix64(address ^ (uint64_t)kind << 56) & mask;
}

/* The place of (address, kind), or the empty place where it would go. */
static size_t live_find(const mvz_whatif_pass *p, uint64_t address, uint8_t kind)
{
    size_t mask = p->caplive - 1, i = live_home(address, kind, mask);
    while (p->live[i].used && (p->live[i].address != address || p->live[i].kind != kind))
        i = (i + 1) & mask;
    return i;
}

/* Room for one more (at most half full); places found before are stale. */
static int live_room(mvz_whatif_pass *p)
{
    if ((p->nlive + 1) * 2 <= p->caplive)
        return 0;
    size_t cap = p->caplive * 2, mask = cap - 1;
    mvz_whatif_pass_live *t = calloc(cap, sizeof *t);
    if (!t)
        return -1;
    for (size_t k = 0; k < p->caplive; k++) {
        if (!p->live[k].used)
            continue;
        size_t i = live_home(p->live[k].address, p->live[k].kind, mask);
        while (t[i].used)
            i = (i + 1) & mask;
        t[i] = p->live[k];
    }
    free(p->live);
    p->live = t;
    p->caplive = cap;
    return 0;
}

/* Backward-shift deletion: no tombstones, so probes stay short. */
static void live_remove(mvz_whatif_pass *p, size_t i)
{
    size_t mask = p->caplive - 1, hole = i;
    for (size_t j = (i + 1) & mask; p->live[j].used; j = (j + 1) & mask) {
        size_t home = live_home(p->live[j].address, p->live[j].kind, mask);
        if (((j - home) & mask) >= ((j - hole) & mask)) { /* the hole lies between its home and j */
            p->live[hole] = p->live[j];
            hole = j;
        }
    }
    p->live[hole].used = 0;
    p->nlive--;
}

/* ---- the recording's device allocations, by (slot, base) -------------------------- */

/* In a list of device allocations, the first not before (slot, addr). */
static size_t dev_find(const mvz_whatif_pass_device *v, size_t n, int slot, uint64_t addr)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (v[mid].slot < slot || (v[mid].slot == slot && v[mid].base < addr))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int queue(mvz_whatif_pass *p, mvz_whatif_pass_op op)
{
    if (p->nops == p->capops && mvz_grow((void **)&p->ops, &p->capops, p->nops + 1, sizeof *p->ops))
        return p->failed = -1;
    p->ops[p->nops++] = op;
    return 0;
}

static void note_peaks(mvz_whatif_pass *p, int slot)
{
    if (p->reserved[slot] > p->rec_reserved_peak[slot])
        p->rec_reserved_peak[slot] = p->reserved[slot];
    if (p->reserved[slot] + p->granules[slot] > p->rec_vmm_peak[slot])
        p->rec_vmm_peak[slot] = p->reserved[slot] + p->granules[slot];
    if (p->allocated[slot] > p->rec_allocated_peak[slot])
        p->rec_allocated_peak[slot] = p->allocated[slot];
    if (p->outside[slot] > p->outside_peak[slot])
        p->outside_peak[slot] = p->outside[slot];
}

static int dev_end(mvz_whatif_pass *p, int slot, uint64_t addr)
{
    size_t at = dev_find(p->dev, p->ndev, slot, addr);
    if (at < p->ndev && p->dev[at].slot == slot && p->dev[at].base == addr) {
        p->outside[slot] -= p->dev[at].size;
        memmove(p->dev + at, p->dev + at + 1, (p->ndev - at - 1) * sizeof *p->dev);
        p->ndev--;
        return 0;
    }
    at = dev_find(p->seg, p->nseg, slot, addr);
    if (at == p->nseg || p->seg[at].slot != slot || p->seg[at].base != addr)
        return 0;
    p->reserved[slot] -= p->seg[at].size;
    memmove(p->seg + at, p->seg + at + 1, (p->nseg - at - 1) * sizeof *p->seg);
    p->nseg--;
    p->rec_freed[slot]++;
    /* empty_cache() in the program (or its retry) */
    return queue(p, (mvz_whatif_pass_op){.op = MVZ_WHATIF_EMPTY, .slot = (uint8_t)slot});
}

/* A block at `address`: the device allocation it lies in, if not yet
 * PyTorch's, becomes a segment. Only allocations still outside PyTorch are
 * searched (a handful), and one is taken only when it is the allocation
 * nearest below the block of all, as when every one was searched. */
static int dev_claim(mvz_whatif_pass *p, int slot, uint64_t address, mvz_whatif_pass_device *made)
{
    size_t at = dev_find(p->dev, p->ndev, slot, address + 1);
    if (at == 0)
        return 0;
    mvz_whatif_pass_device d = p->dev[at - 1];
    if (d.slot != slot || address < d.base || address >= d.base + d.size)
        return 0;
    size_t s = dev_find(p->seg, p->nseg, slot, address + 1);
    if (s > 0 && p->seg[s - 1].slot == slot && p->seg[s - 1].base > d.base)
        return 0; /* a segment starts between them: the block is taken as its */
    if (p->nseg == p->capseg && mvz_grow((void **)&p->seg, &p->capseg, p->nseg + 1, sizeof *p->seg))
        return p->failed = -1;
    memmove(p->dev + at - 1, p->dev + at, (p->ndev - at) * sizeof *p->dev);
    p->ndev--;
    s = dev_find(p->seg, p->nseg, slot, d.base);
    memmove(p->seg + s + 1, p->seg + s, (p->nseg - s) * sizeof *p->seg);
    p->seg[s] = d;
    p->nseg++;
    p->outside[slot] -= d.size;
    p->reserved[slot] += d.size;
    p->rec_segments[slot]++;
    *made = d; /* made for this block, or made before it was seen (the route's probe, say) */
    return 0;
}

/* ---- events ------------------------------------------------------------------------ */

/* What ended (its FREE, or an ALLOC at its address). */
static int ended(mvz_whatif_pass *p, const mvz_whatif_pass_live *a)
{
    int slot = a->slot;
    if (slot >= MVZ_NSLOTS)
        return 0;
    if (a->kind == MVZ_KIND_DEVICE)
        return dev_end(p, slot, a->address);
    if (a->kind == MVZ_KIND_PHYSICAL) { /* a granule unmapped: PyTorch released cached memory */
        if (!a->handle)
            return 0;
        p->granules[slot] -= (uint64_t)a->handle << 20;
        return queue(p, (mvz_whatif_pass_op){.op = MVZ_WHATIF_EMPTY, .slot = (uint8_t)slot});
    }
    p->allocated[slot] -= p->bytes[a->handle];
    if (p->nspare == p->capspare && mvz_grow((void **)&p->spare, &p->capspare, p->nspare + 1, sizeof *p->spare))
        return p->failed = -1;
    p->spare[p->nspare++] = a->handle;
    return queue(p, (mvz_whatif_pass_op){.handle = a->handle, .op = MVZ_WHATIF_FREE, .slot = (uint8_t)slot});
}

/* A device allocation: held outside PyTorch until a block is seen in it. */
static int device_alloc(mvz_whatif_pass *p, int slot, uint64_t address, uint64_t size)
{
    if (p->ndev == p->capdev && mvz_grow((void **)&p->dev, &p->capdev, p->ndev + 1, sizeof *p->dev))
        return p->failed = -1;
    size_t at = dev_find(p->dev, p->ndev, slot, address);
    memmove(p->dev + at + 1, p->dev + at, (p->ndev - at) * sizeof *p->dev);
    p->dev[at] = (mvz_whatif_pass_device){address, size, (uint8_t)slot};
    p->ndev++;
    p->outside[slot] += size;
    note_peaks(p, slot);
    return 0;
}

typedef struct {
    const uint8_t *records;
    size_t count, width;
} chunk;

/* Field f of record i (record.h). */
#define FIELD(c, layout, i, f) MVZ_EVENT_FIELD((c)->records, (c)->count, (c)->width, (layout), (i), f)

/* Record i, by the replay's rules (replay.c: a TIME record sets the clock,
 * every other record moves it on; what an ALLOC or FREE ends, then what an
 * ALLOC starts). Only blocks and device allocations matter here, and only
 * the fields each needs are read. */
static inline int event(mvz_whatif_pass *p, const chunk *c, int layout, size_t i)
{
    uint64_t index = p->events++;
    unsigned op = (unsigned)FIELD(c, layout, i, op);
    if (op == MVZ_EV_TIME) {
        p->ts = FIELD(c, layout, i, address);
        return 0;
    }
    p->ts += FIELD(c, layout, i, ts_delta);
    if (op != MVZ_EV_ALLOC && op != MVZ_EV_FREE)
        return 0;
    uint8_t kind = (uint8_t)FIELD(c, layout, i, kind);
    if (kind != MVZ_KIND_BLOCK && kind != MVZ_KIND_DEVICE && kind != MVZ_KIND_PHYSICAL)
        return 0;
    uint64_t address = FIELD(c, layout, i, address);
    if (live_room(p))
        return p->failed = -1;
    size_t at = live_find(p, address, kind);
    if (p->live[at].used) {
        mvz_whatif_pass_live was = p->live[at];
        live_remove(p, at);
        if (ended(p, &was))
            return -1;
        if (op == MVZ_EV_ALLOC)
            at = live_find(p, address, kind);
    }
    if (op != MVZ_EV_ALLOC)
        return 0;
    int slot = (uint8_t)FIELD(c, layout, i, device);
    uint64_t size = FIELD(c, layout, i, size);
    mvz_whatif_pass_live *a = &p->live[at];
    *a = (mvz_whatif_pass_live){address, 0, kind, (uint8_t)slot, 1};
    p->nlive++;
    if (slot >= MVZ_NSLOTS)
        return 0;
    if (kind == MVZ_KIND_PHYSICAL) { /* a granule of an expandable segment's, by its size */
        if (p->expandable && (size == MVZ_SMALL_BUFFER || size == MVZ_LARGE_BUFFER)) {
            a->handle = (uint32_t)(size >> 20);
            p->granules[slot] += size;
            note_peaks(p, slot);
        }
        return 0;
    }
    if (kind == MVZ_KIND_DEVICE && (FIELD(c, layout, i, flags) & MVZ_FLAG_BEFORE) && !p->seeded[slot]) {
        /* PyTorch's memory at attach: it holds the granules seen before it */
        p->seeded[slot] = 1;
        p->granules[slot] = 0;
        for (size_t k = 0; k < p->caplive; k++)
            if (p->live[k].used && p->live[k].kind == MVZ_KIND_PHYSICAL && p->live[k].slot == slot)
                p->live[k].handle = 0;
    }
    if (kind == MVZ_KIND_DEVICE)
        return device_alloc(p, slot, address, size);
    /* a block: a request for the models, as the recording made it */
    mvz_whatif_pass_device made = {0, 0, 0};
    if (p->ndev && dev_claim(p, slot, address, &made))
        return -1;
    p->allocated[slot] += size;
    note_peaks(p, slot);
    uint32_t handle = p->nspare ? p->spare[--p->nspare] : p->handles;
    if (handle >= p->capbytes && mvz_grow((void **)&p->bytes, &p->capbytes, (size_t)handle + 1, sizeof *p->bytes))
        return p->failed = -1;
    if (handle == p->handles)
        p->handles++;
    p->bytes[handle] = size;
    a->handle = handle;
    uint64_t slack = FIELD(c, layout, i, slack);
    uint64_t requested = size - (slack <= size ? slack : 0);
    uint32_t stack = (uint32_t)FIELD(c, layout, i, stack_id);
    uint32_t caller = stack ? 0 : p->last_stack; /* a backward's: the thread that called backward() */
    if (stack)
        p->last_stack = stack;
    return queue(p, (mvz_whatif_pass_op){requested, FIELD(c, layout, i, stream), p->ts, index, p->outside[slot],
                                         made.base, made.size, (uint32_t)p->rec_segments[slot],
                                         (uint32_t)p->rec_freed[slot], stack, handle,
                                         (uint32_t)FIELD(c, layout, i, label_id), caller, MVZ_WHATIF_ALLOC,
                                         (uint8_t)slot});
}

/* With the GIL released (module_whatif.c): it reads the caller's records,
 * whose buffer the binding holds until the call returns, and writes only
 * the pass, which one call at a time may use. */
int mvz_whatif_pass_feed(mvz_whatif_pass *p, const uint8_t *records, size_t count, size_t width, int layout)
{
    chunk c = {records, count, width};
    if (layout == 0) {
        for (size_t i = 0; i < count; i++)
            if (event(p, &c, 0, i))
                return -1;
    } else { /* byte planes */
        for (size_t i = 0; i < count; i++)
            if (event(p, &c, 1, i))
                return -1;
    }
    return p->failed ? -1 : 0;
}

/* ---- the models through the queue -------------------------------------------------- */

/* Ops [first, stop) through one model. No lock: the model is this worker's
 * alone while it runs, the queue is read only. */
static int run_model(mvz_whatif *w, const mvz_whatif_pass_op *ops, size_t first, size_t stop)
{
    for (size_t i = first; i < stop; i++) {
        const mvz_whatif_pass_op *o = &ops[i];
        if (o->op == MVZ_WHATIF_ALLOC) {
            if (mvz_whatif_alloc(w, o->slot, o->handle, o->requested, o->stream, o->stack, o->label, o->caller, o->ts,
                                 o->index, o->outside, o->hint, o->hint_size, o->rec_made,
                                 o->rec_freed))
                return -1;
        } else if (o->op == MVZ_WHATIF_FREE) {
            mvz_whatif_release(w, o->handle);
        } else {
            mvz_whatif_empty_cache(w, o->slot);
        }
    }
    return 0;
}

/* The workers share the models: each takes the model that is furthest
 * behind and free, through its next slice of the queue, so that all end
 * near together whatever the number of models and threads. */
typedef struct {
    mvz_whatif_pass *p;
    pthread_mutex_t mu;
    size_t slices;
    size_t done[64];
    uint8_t busy[64];
    int rc;
} sched;

/* A worker, the GIL released: the mutex guards only done[] and busy[]; a
 * model runs on the worker that marked it busy, alone, and the mutex orders
 * one slice of a model before its next, whichever worker takes it. */
static void *work(void *arg)
{
    sched *s = arg;
    size_t n = s->p->n, nops = s->p->nops;
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        size_t m = n;
        for (size_t i = 0; i < n; i++)
            if (!s->busy[i] && s->done[i] < s->slices && (m == n || s->done[i] < s->done[m]))
                m = i;
        if (m == n) /* the models left are each another worker's, to their end */
            break;
        s->busy[m] = 1;
        size_t first = s->done[m] * SLICE, stop = first + SLICE < nops ? first + SLICE : nops;
        pthread_mutex_unlock(&s->mu);
        if (run_model(s->p->models[m], s->p->ops, first, stop))
            rc = -1;
        pthread_mutex_lock(&s->mu);
        s->busy[m] = 0;
        s->done[m]++;
    }
    s->rc |= rc;
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* With the GIL released (module_whatif.c), after the chunk's feed: the
 * queue is read only until every worker is joined. */
int mvz_whatif_pass_run(mvz_whatif_pass *p, int threads)
{
    if (p->failed)
        return -1;
    size_t t = threads < 1 ? 1 : (size_t)threads;
    if (t > p->n)
        t = p->n;
    if (t > MAX_THREADS)
        t = MAX_THREADS;
    int rc = 0;
    if (t <= 1 || p->n > 64) {
        for (size_t i = 0; i < p->n; i++)
            rc |= run_model(p->models[i], p->ops, 0, p->nops);
    } else {
        sched s;
        memset(&s, 0, sizeof s);
        s.p = p;
        s.slices = (p->nops + SLICE - 1) / SLICE;
        if (pthread_mutex_init(&s.mu, NULL)) {
            for (size_t i = 0; i < p->n; i++)
                rc |= run_model(p->models[i], p->ops, 0, p->nops);
        } else {
            pthread_t th[MAX_THREADS];
            int started[MAX_THREADS] = {0};
            for (size_t k = 1; k < t; k++)
                started[k] = pthread_create(&th[k], NULL, work, &s) == 0;
            work(&s); /* this thread too; it ends only when every model is done or another's */
            for (size_t k = 1; k < t; k++)
                if (started[k])
                    pthread_join(th[k], NULL);
            pthread_mutex_destroy(&s.mu);
            rc = s.rc;
        }
    }
    for (size_t i = 0; i < p->n; i++)
        if (mvz_whatif_failed(p->models[i]))
            rc = -1;
    p->nops = 0;
    return rc || p->failed ? -1 : 0;
}
