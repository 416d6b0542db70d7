/* The store (see store.h). One leaf mutex guards everything here; every
 * function that runs on the capture path says why it is safe without the GIL.
 */
#define _GNU_SOURCE
#include "store.h"
#include "clock.h"
#include "region.h"
#include "trace_ring.h"
#include "window.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

/* A graveyard entry: an allocation freed after the peak of its device. The
 * set live at a peak is "live now and made before the peak" plus "in the
 * graveyard, made before the peak and freed after it". */
typedef struct {
    mvz_alloc a;
    uint64_t freed;
} mvz_grave;

typedef struct {
    uint64_t hash;
    uint32_t first_frame;
    uint16_t depth;
    uint16_t adopted; /* its code objects are referenced by memviz */
    uint64_t live_bytes, peak_bytes, alloc_count, alloc_bytes;
    uint32_t live_count, mark_count;
    uint64_t mark_bytes; /* live bytes at the last step mark */
} mvz_stack;


static pthread_mutex_t store_lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;

static mvz_region allocs_r, index_a_r, index_b_r, stacks_r, frames_r, stack_index_r, pending_r,
    graves_r;
static mvz_alloc *allocs;
static uint32_t *live_index; /* slot -> alloc index + 1; 0 empty */
static size_t live_count, max_live, live_index_cap;
static int live_index_in_a;

static mvz_stack *stacks;
static mvz_frame *frames;
static uint32_t *stack_index; /* slot -> stack id + 1 */
static uint32_t *pending;    /* stack ids whose code objects are not yet adopted */
static size_t nstacks, max_stacks, nframes, max_frames, stack_index_cap, npending;

static mvz_grave *graves;
static size_t ngraves;

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
static mvz_point timeline[MVZ_TIMELINE_POINTS];
static size_t ntimeline;
static uint64_t timeline_stride = 1, timeline_tick;
static mvz_thread threads[MVZ_MAX_THREADS];
static uint32_t nthreads;
static uint64_t last_ts, unmatched_frees, dropped_allocs, dropped_stacks, dropped_threads;
static uint64_t last_serial; /* atomic */
static uint32_t generation = 1;

/* Per-thread registration, initial-exec so reading it never allocates (a
 * dynamically loaded module's general-dynamic TLS may call malloc). */
static __thread uint32_t tl_thread_plus1 __attribute__((tls_model("initial-exec")));
static __thread uint32_t tl_generation __attribute__((tls_model("initial-exec")));
static __thread uint64_t tl_serial __attribute__((tls_model("initial-exec")));

#define LOCK() pthread_mutex_lock(&store_lock)
#define UNLOCK() pthread_mutex_unlock(&store_lock)

void mvz_store_lock(void) { LOCK(); }
void mvz_store_unlock(void) { UNLOCK(); }

static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Keys: an address lives once per key space. Physical handles are not
 * addresses, and a PyTorch block may start where its segment starts. */
static inline int key_space(int kind)
{
    return kind == MVZ_KIND_PHYSICAL ? 1 : kind == MVZ_KIND_BLOCK ? 2 : 0;
}

static inline uint64_t key_hash(uint64_t address, int kind)
{
    static const uint64_t salt[3] = {0, 0x9e3779b97f4a7c15ULL, 0xc2b2ae3d27d4eb4fULL};
    return mix64(address ^ salt[key_space(kind)]);
}

static inline int key_eq(const mvz_alloc *a, uint64_t address, int kind)
{
    return a->address == address && key_space(a->kind) == key_space(kind);
}

/* Called with the lock held: a strictly increasing timestamp, so that
 * "made before the peak" and "freed after it" are never ambiguous. */
static uint64_t next_ts(void)
{
    uint64_t t = mvz_now_ns();
    if (t <= last_ts)
        t = last_ts + 1;
    last_ts = t;
    return t;
}

int mvz_store_init(size_t max_live_, size_t max_stacks_, size_t max_frames_)
{
    if (initialized)
        return 0;
    max_live = max_live_;
    max_stacks = max_stacks_;
    max_frames = max_frames_;
    /* The live index holds at most half-full max_live entries. */
    size_t cap = 1024;
    while (cap < 2 * max_live)
        cap <<= 1;
    size_t scap = 1024;
    while (scap < 2 * max_stacks)
        scap <<= 1;
    if (mvz_region_reserve(&allocs_r, max_live * sizeof(mvz_alloc), 1 << 20) ||
        mvz_region_reserve(&index_a_r, cap * sizeof(uint32_t), 1 << 16) ||
        mvz_region_reserve(&index_b_r, cap * sizeof(uint32_t), 0) ||
        mvz_region_reserve(&stacks_r, max_stacks * sizeof(mvz_stack), 1 << 16) ||
        mvz_region_reserve(&frames_r, max_frames * sizeof(mvz_frame), 1 << 18) ||
        mvz_region_reserve(&stack_index_r, scap * sizeof(uint32_t), 1 << 16) ||
        mvz_region_reserve(&pending_r, max_stacks * sizeof(uint32_t), 1 << 14) ||
        mvz_region_reserve(&graves_r, max_live * sizeof(mvz_grave), 1 << 16))
        return -1;
    allocs = (mvz_alloc *)allocs_r.base;
    live_index = (uint32_t *)index_a_r.base;
    live_index_in_a = 1;
    live_index_cap = 1024;
    stacks = (mvz_stack *)stacks_r.base;
    frames = (mvz_frame *)frames_r.base;
    stack_index = (uint32_t *)stack_index_r.base;
    stack_index_cap = 1024;
    pending = (uint32_t *)pending_r.base;
    graves = (mvz_grave *)graves_r.base;
    mvz_region_ensure(&index_a_r, live_index_cap * sizeof(uint32_t));
    mvz_region_ensure(&stack_index_r, stack_index_cap * sizeof(uint32_t));
    /* Stack 0 is the empty stack: allocations made with no Python frames. */
    nstacks = 1;
    memset(&stacks[0], 0, sizeof stacks[0]);
    stacks[0].adopted = 1;
    mvz_region_ensure(&stacks_r, sizeof(mvz_stack));
    initialized = 1;
    return 0;
}

void mvz_store_clear(void ***refs, size_t *nrefs)
{
    *refs = NULL;
    *nrefs = 0;
    LOCK();
    size_t count = 0;
    for (size_t s = 1; s < nstacks; s++)
        if (stacks[s].adopted)
            count += stacks[s].depth;
    for (size_t s = 1; s < nstacks; s++) /* resolved tuples are owned even when pending */
        if (!stacks[s].adopted)
            for (uint32_t f = 0; f < stacks[s].depth; f++)
                if (frames[stacks[s].first_frame + f].flags & MVZ_FRAME_RESOLVED)
                    count++;
    void **out = count ? malloc(count * sizeof(void *)) : NULL;
    size_t n = 0;
    if (out) {
        for (size_t s = 1; s < nstacks; s++)
            for (uint32_t f = 0; f < stacks[s].depth; f++) {
                mvz_frame *fr = &frames[stacks[s].first_frame + f];
                if (stacks[s].adopted || (fr->flags & MVZ_FRAME_RESOLVED))
                    out[n++] = fr->code;
            }
    }
    /* Without memory for the list the references leak, which is safe. */
    live_count = 0;
    memset(live_index, 0, live_index_cap * sizeof(uint32_t));
    nstacks = 1;
    memset(&stacks[0], 0, sizeof stacks[0]);
    stacks[0].adopted = 1;
    nframes = 0;
    npending = 0;
    memset(stack_index, 0, stack_index_cap * sizeof(uint32_t));
    ngraves = 0;
    mvz_windows_open = 0;
    memset(totals, 0, sizeof totals);
    memset(btotals, 0, sizeof btotals);
    mvz_trace_reset_locked();
    nfailures = 0;
    ntimeline = 0;
    timeline_stride = 1;
    timeline_tick = 0;
    nthreads = 0;
    unmatched_frees = dropped_allocs = dropped_stacks = dropped_threads = 0;
    generation++;
    mvz_region_discard(&allocs_r);
    mvz_region_discard(&graves_r);
    mvz_region_discard(&frames_r);
    mvz_region_ensure(&index_a_r, live_index_in_a ? live_index_cap * 4 : 0);
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

/* Capture path, no GIL: reads this thread's own TLS; registration takes the
 * store lock briefly and makes two system calls (gettid, PR_GET_NAME). */
uint32_t mvz_store_thread_index(void)
{
    uint32_t gen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
    if (tl_thread_plus1 && tl_generation == gen)
        return tl_thread_plus1 - 1;
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
    gen = generation;
    UNLOCK();
    tl_thread_plus1 = idx + 1;
    tl_generation = gen;
    return idx;
}

/* ---- stacks ----------------------------------------------------------- */

static uint64_t stack_hash(const mvz_frame *f, int depth)
{
    /* One multiply per frame (the multiply-xorshift chain keeps order and
     * mixes well enough for a table keyed on pointers), one full mix at the
     * end: hashing a 32-frame stack costs tens of nanoseconds. */
    uint64_t h = 0x84222325cbf29ce4ULL ^ (uint64_t)depth;
    for (int i = 0; i < depth; i++) {
        uint64_t w = (uint64_t)(uintptr_t)f[i].code ^ ((uint64_t)(uint32_t)f[i].offset << 40);
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
        h ^= h >> 29;
    }
    return mix64(h);
}

static int stack_eq(const mvz_stack *s, uint64_t h, const mvz_frame *f, int depth)
{
    if (s->hash != h || s->depth != depth)
        return 0;
    const mvz_frame *g = &frames[s->first_frame];
    for (int i = 0; i < depth; i++)
        if (g[i].code != f[i].code || g[i].offset != f[i].offset)
            return 0;
    return 1;
}

static int stack_index_grow(void)
{
    size_t ncap = stack_index_cap * 2;
    if (mvz_region_ensure(&stack_index_r, ncap * sizeof(uint32_t)))
        return -1;
    memset(stack_index, 0, ncap * sizeof(uint32_t));
    stack_index_cap = ncap;
    for (uint32_t id = 1; id < nstacks; id++) {
        size_t i = stacks[id].hash & (ncap - 1);
        while (stack_index[i])
            i = (i + 1) & (ncap - 1);
        stack_index[i] = id + 1;
    }
    return 0;
}

/* Lock held. Returns the id of the stack, interning it when new; 0 when
 * there are no frames or no room (counted in dropped_stacks). */
static uint32_t intern_stack(const mvz_frame *f, int depth)
{
    if (depth <= 0)
        return 0;
    uint64_t h = stack_hash(f, depth);
    size_t mask = stack_index_cap - 1;
    size_t i = h & mask;
    for (; stack_index[i]; i = (i + 1) & mask) {
        uint32_t id = stack_index[i] - 1;
        if (stack_eq(&stacks[id], h, f, depth))
            return id;
    }
    if (nstacks >= max_stacks || nframes + (size_t)depth > max_frames ||
        mvz_region_ensure(&frames_r, (nframes + depth) * sizeof(mvz_frame)) ||
        mvz_region_ensure(&stacks_r, (nstacks + 1) * sizeof(mvz_stack))) {
        dropped_stacks++;
        return 0;
    }
    if (2 * (nstacks + 1) > stack_index_cap) {
        if (stack_index_grow()) {
            dropped_stacks++;
            return 0;
        }
        mask = stack_index_cap - 1;
        for (i = h & mask; stack_index[i]; i = (i + 1) & mask)
            ;
    }
    uint32_t id = (uint32_t)nstacks++;
    mvz_stack *s = &stacks[id];
    memset(s, 0, sizeof *s);
    s->hash = h;
    s->depth = (uint16_t)depth;
    s->first_frame = (uint32_t)nframes;
    memcpy(&frames[nframes], f, (size_t)depth * sizeof(mvz_frame));
    for (int k = 0; k < depth; k++)
        frames[nframes + k].flags = 0;
    nframes += (size_t)depth;
    stack_index[i] = id + 1;
    mvz_region_ensure(&pending_r, (npending + 1) * sizeof(uint32_t));
    pending[npending++] = id;
    return id;
}

int mvz_store_has_pending(void)
{
    return __atomic_load_n(&npending, __ATOMIC_RELAXED) != 0;
}

void mvz_store_adopt_pending(void (*adopt)(void *code))
{
    LOCK();
    for (size_t p = 0; p < npending; p++) {
        mvz_stack *s = &stacks[pending[p]];
        for (uint32_t f = 0; f < s->depth; f++) {
            mvz_frame *fr = &frames[s->first_frame + f];
            /* A DYING frame is being resolved by the death event (which may
             * run Python, and so this, meanwhile): its code object must not
             * be referenced, and only the resolver clears the mark. */
            if (!(fr->flags & (MVZ_FRAME_DYING | MVZ_FRAME_RESOLVED)))
                adopt(fr->code);
        }
        s->adopted = 1;
    }
    npending = 0;
    UNLOCK();
}

size_t mvz_store_mark_dying(void *code)
{
    size_t n = 0;
    LOCK();
    for (size_t p = 0; p < npending; p++) {
        mvz_stack *s = &stacks[pending[p]];
        for (uint32_t f = 0; f < s->depth; f++) {
            mvz_frame *fr = &frames[s->first_frame + f];
            if (fr->code == code && !(fr->flags & MVZ_FRAME_RESOLVED)) {
                fr->flags |= MVZ_FRAME_DYING;
                n++;
            }
        }
    }
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
        mvz_frame *target = NULL;
        int32_t offset = 0;
        LOCK();
        for (size_t s = 1; s < nstacks && !target; s++) {
            mvz_stack *st = &stacks[s];
            for (uint32_t f = 0; f < st->depth; f++) {
                mvz_frame *fr = &frames[st->first_frame + f];
                if (fr->code == code && (fr->flags & MVZ_FRAME_DYING)) {
                    target = fr;
                    offset = fr->offset;
                    break;
                }
            }
        }
        UNLOCK();
        if (!target)
            return;
        void *tuple = resolve(code, offset);
        LOCK();
        /* The store may have been cleared meanwhile only by this thread. */
        if (target->code == code && (target->flags & MVZ_FRAME_DYING)) {
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
    int depth = -1;
    LOCK();
    if (id < nstacks) {
        depth = stacks[id].depth;
        if (depth > cap)
            depth = cap;
        memcpy(out, &frames[stacks[id].first_frame], (size_t)depth * sizeof(mvz_frame));
    }
    UNLOCK();
    return depth;
}

/* ---- live table ------------------------------------------------------- */

/* Lock held. Index of the slot holding `address`, or of the empty slot
 * where it would go. */
static size_t live_find(uint64_t address, int kind, int *found)
{
    size_t mask = live_index_cap - 1;
    size_t i = key_hash(address, kind) & mask;
    for (; live_index[i]; i = (i + 1) & mask) {
        if (key_eq(&allocs[live_index[i] - 1], address, kind)) {
            *found = 1;
            return i;
        }
    }
    *found = 0;
    return i;
}

static int live_index_grow(void)
{
    size_t ncap = live_index_cap * 2;
    mvz_region *dst = live_index_in_a ? &index_b_r : &index_a_r;
    mvz_region *src = live_index_in_a ? &index_a_r : &index_b_r;
    if (mvz_region_ensure(dst, ncap * sizeof(uint32_t)))
        return -1;
    uint32_t *ni = (uint32_t *)dst->base;
    memset(ni, 0, ncap * sizeof(uint32_t));
    for (size_t k = 0; k < live_count; k++) {
        size_t i = key_hash(allocs[k].address, allocs[k].kind) & (ncap - 1);
        while (ni[i])
            i = (i + 1) & (ncap - 1);
        ni[i] = (uint32_t)k + 1;
    }
    mvz_region_discard(src);
    live_index = ni;
    live_index_cap = ncap;
    live_index_in_a = !live_index_in_a;
    return 0;
}

/* Lock held. Deletes slot i with backward shifting (no tombstones). */
static void live_index_delete(size_t i)
{
    size_t mask = live_index_cap - 1;
    size_t j = i;
    live_index[i] = 0;
    for (;;) {
        j = (j + 1) & mask;
        if (!live_index[j])
            return;
        const mvz_alloc *a = &allocs[live_index[j] - 1];
        size_t home = key_hash(a->address, a->kind) & mask;
        /* Move j back into the hole unless its home lies cyclically in (i, j]. */
        int home_in_range = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!home_in_range) {
            live_index[i] = live_index[j];
            live_index[j] = 0;
            i = j;
        }
    }
}

static void timeline_push(uint64_t ts, int slot)
{
    if (++timeline_tick < timeline_stride)
        return;
    timeline_tick = 0;
    if (ntimeline == MVZ_TIMELINE_POINTS) {
        /* Halve the resolution, keeping the larger point of each pair so
         * peaks survive. */
        for (size_t k = 0; k < MVZ_TIMELINE_POINTS / 2; k++) {
            mvz_point *a = &timeline[2 * k], *b = &timeline[2 * k + 1];
            timeline[k] = (b->total > a->total) ? *b : *a;
        }
        ntimeline = MVZ_TIMELINE_POINTS / 2;
        timeline_stride *= 2;
    }
    timeline[ntimeline].timestamp = ts;
    timeline[ntimeline].total = totals[slot].current;
    timeline[ntimeline].slot = slot;
    ntimeline++;
}

/* Lock held. Drop graveyard entries that can no longer belong to a peak
 * set; amortised O(1) per free. */
static void graves_compact(void)
{
    size_t keep = 0;
    for (size_t k = 0; k < ngraves; k++) {
        const mvz_grave *g = &graves[k];
        if (g->freed > totals[g->a.slot].peak_timestamp ||
            (mvz_windows_open && mvz_windows_want_grave(&g->a, g->freed)))
            graves[keep++] = *g;
    }
    ngraves = keep;
}

/* Capture path, no GIL: takes the store lock (a leaf lock, see store.h) and
 * touches only preallocated memory. */
uint32_t mvz_store_alloc(uint64_t address, uint64_t size, uint64_t stream, int slot, int kind,
                     uint32_t label_id, const mvz_frame *f, int depth)
{
    return mvz_store_alloc_at(0, address, size, stream, slot, kind, label_id, f, depth);
}

/* Capture path, no GIL: one vDSO clock read, no lock. Not unique: a block
 * dated with it may share its nanosecond with the segment made for it,
 * which only keeps it in that peak's set, where it belongs. */
uint64_t mvz_store_stamp(void) { return mvz_now_ns(); }

/* Capture path, no GIL: takes the store lock (a leaf lock, see store.h) and
 * touches only preallocated memory. */
uint32_t mvz_store_alloc_at(uint64_t stamp, uint64_t address, uint64_t size, uint64_t stream,
                            int slot, int kind, uint32_t label_id, const mvz_frame *f, int depth)
{
    uint32_t thread_idx = mvz_store_thread_index();
    if (slot < 0 || slot >= MVZ_NSLOTS)
        slot = MVZ_HOST_SLOT;
    LOCK();
    uint64_t now = next_ts();
    uint64_t ts = stamp && stamp < now ? stamp : now; /* dated when asked for (store.h) */
    int found;
    size_t i = live_find(address, kind, &found);
    if (found) {
        /* The free of an earlier allocation at this address was not seen
         * (made before tracking started, or lost): retire it first. */
        UNLOCK();
        mvz_store_free(address, kind);
        LOCK();
        i = live_find(address, kind, &found);
    }
    if (live_count >= max_live ||
        mvz_region_ensure(&allocs_r, (live_count + 1) * sizeof(mvz_alloc))) {
        dropped_allocs++;
        UNLOCK();
        return 0;
    }
    if (2 * (live_count + 1) > live_index_cap) {
        if (live_index_grow()) {
            dropped_allocs++;
            UNLOCK();
            return 0;
        }
        i = live_find(address, kind, &found);
    }
    uint32_t stack_id = intern_stack(f, depth);
    mvz_alloc *a = &allocs[live_count];
    a->address = address;
    a->size = size;
    a->stream = stream;
    a->timestamp = ts;
    a->stack_id = stack_id;
    a->thread_idx = thread_idx;
    a->label_id = label_id;
    a->slot = (int16_t)slot;
    a->kind = (uint8_t)kind;
    a->flags = 0;
    live_index[i] = (uint32_t)live_count + 1;
    live_count++;

    mvz_stack *s = &stacks[stack_id];
    s->live_bytes += size;
    s->live_count++;
    s->alloc_count++;
    s->alloc_bytes += size;
    if (s->live_bytes > s->peak_bytes)
        s->peak_bytes = s->live_bytes;

    mvz_totals *t = totals_of(kind, slot);
    t->current += size;
    t->live_count++;
    t->allocs++;
    t->alloc_bytes += size;
    if (t->current > t->peak) {
        t->peak = t->current;
        t->peak_timestamp = ts;
        t->peak_count = t->live_count;
        timeline_tick = timeline_stride; /* always record a new peak */
    }
    if (t->current > t->window_peak)
        t->window_peak = t->current;
    if (kind != MVZ_KIND_BLOCK) { /* blocks lie inside segments the device totals hold */
        timeline_push(ts, slot);
        if (mvz_windows_open)
            mvz_windows_alloc(a);
    }
    mvz_trace_record(MVZ_EV_ALLOC, now, address, size, stack_id, thread_idx, label_id, kind, slot);
    UNLOCK();
    return stack_id;
}

/* Capture path, no GIL: takes the store lock (leaf) and touches only
 * preallocated memory. */
void mvz_store_free(uint64_t address, int kind)
{
    LOCK();
    uint64_t ts = next_ts();
    int found;
    size_t i = live_find(address, kind, &found);
    if (!found) {
        unmatched_frees++; /* allocated before tracking started */
        UNLOCK();
        return;
    }
    uint32_t k = live_index[i] - 1;
    mvz_alloc a = allocs[k];
    mvz_totals *t = totals_of(a.kind, a.slot);
    if (a.timestamp <= totals[a.slot].peak_timestamp ||
        (mvz_windows_open && mvz_windows_want_grave(&a, ts))) {
        if (ngraves >= max_live) {
            graves_compact();
        }
        if (ngraves < max_live &&
            mvz_region_ensure(&graves_r, (ngraves + 1) * sizeof(mvz_grave)) == 0) {
            graves[ngraves].a = a;
            graves[ngraves].freed = ts;
            ngraves++;
        }
        size_t bound = 0;
        for (int d = 0; d < MVZ_NSLOTS; d++)
            bound += totals[d].peak_count;
        if (mvz_windows_open)
            bound += mvz_windows_peak_count();
        if (ngraves > 2 * bound + 1024)
            graves_compact();
    }
    live_index_delete(i);
    size_t last = live_count - 1;
    if (k != last) {
        /* Move the last entry into the hole and repoint its index slot. */
        int f2;
        size_t j = live_find(allocs[last].address, allocs[last].kind, &f2);
        allocs[k] = allocs[last];
        live_index[j] = k + 1;
    }
    live_count--;

    mvz_stack *s = &stacks[a.stack_id];
    s->live_bytes -= a.size;
    s->live_count--;
    t->current -= a.size;
    t->live_count--;
    t->frees++;
    if (a.kind != MVZ_KIND_BLOCK) {
        timeline_push(ts, a.slot);
        if (mvz_windows_open)
            mvz_windows_free(&a, ts);
    }
    mvz_trace_record(MVZ_EV_FREE, ts, a.address, a.size, a.stack_id, a.thread_idx, a.label_id, a.kind,
                 a.slot);
    UNLOCK();
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
    x->stack_id = intern_stack(f, depth);
    x->thread_idx = thread_idx;
    x->label_id = label_id;
    x->result = result;
    x->slot = (int16_t)slot;
    x->kind = (uint8_t)kind;
    nfailures++;
    totals[slot].failed++;
    if (mvz_windows_open)
        mvz_windows_failure(slot);
    mvz_trace_record(MVZ_EV_FAILED, x->timestamp, (uint64_t)(int64_t)result, size, x->stack_id,
                 thread_idx, label_id, kind, slot);
    UNLOCK();
}

/* ---- readers ---------------------------------------------------------- */

#define COPY_OUT(type, src, n, out)                                                        \
    do {                                                                                   \
        *(out) = NULL;                                                                     \
        if ((n) == 0)                                                                      \
            return 0;                                                                      \
        type *buf_ = malloc((n) * sizeof(type));                                           \
        if (!buf_)                                                                         \
            return -1;                                                                     \
        memcpy(buf_, (src), (n) * sizeof(type));                                           \
        *(out) = buf_;                                                                     \
        return (long)(n);                                                                  \
    } while (0)

long mvz_store_live(mvz_alloc **out)
{
    /* Copy with the lock held; malloc happens before taking it. */
    for (;;) {
        size_t n = __atomic_load_n(&live_count, __ATOMIC_RELAXED) + 64;
        mvz_alloc *buf = malloc(n * sizeof(mvz_alloc));
        if (!buf)
            return -1;
        LOCK();
        if (live_count <= n) {
            size_t m = live_count;
            memcpy(buf, allocs, m * sizeof(mvz_alloc));
            UNLOCK();
            *out = buf;
            return (long)m;
        }
        UNLOCK();
        free(buf);
    }
}

/* The allocations live at the peak of `slot`, in window w (-1: the store). */
static long peak_live(int w, int slot, mvz_alloc **out)
{
    *out = NULL;
    if (slot < 0 || slot >= MVZ_NSLOTS)
        return 0;
    for (;;) {
        size_t n = __atomic_load_n(&live_count, __ATOMIC_RELAXED) +
                   __atomic_load_n(&ngraves, __ATOMIC_RELAXED) + 64;
        mvz_alloc *buf = malloc(n * sizeof(mvz_alloc));
        if (!buf)
            return -1;
        LOCK();
        if (live_count + ngraves > n) {
            UNLOCK();
            free(buf);
            continue;
        }
        const mvz_totals *t = w < 0 ? totals : mvz_window_totals_locked(w);
        if (!t) {
            UNLOCK();
            free(buf);
            return -1;
        }
        uint64_t after = w < 0 ? 0 : mvz_window_start_locked(w); /* store timestamps are > 0 */
        uint64_t peak_ts = t[slot].peak_timestamp;
        size_t m = 0;
        for (size_t k = 0; k < live_count; k++)
            if (allocs[k].slot == slot && allocs[k].timestamp <= peak_ts &&
                allocs[k].timestamp > after)
                buf[m++] = allocs[k];
        for (size_t k = 0; k < ngraves; k++)
            if (graves[k].a.slot == slot && graves[k].a.timestamp <= peak_ts &&
                graves[k].a.timestamp > after && graves[k].freed > peak_ts)
                buf[m++] = graves[k].a;
        UNLOCK();
        *out = buf;
        return (long)m;
    }
}

long mvz_store_peak_live(int slot, mvz_alloc **out) { return peak_live(-1, slot, out); }

long mvz_store_window_peak_live(int w, int slot, mvz_alloc **out)
{
    if (w < 0) {
        *out = NULL;
        return -1;
    }
    return peak_live(w, slot, out);
}

long mvz_store_sites(mvz_site **out)
{
    for (;;) {
        size_t n = __atomic_load_n(&nstacks, __ATOMIC_RELAXED) + 64;
        mvz_site *buf = malloc(n * sizeof(mvz_site));
        if (!buf)
            return -1;
        LOCK();
        if (nstacks > n) {
            UNLOCK();
            free(buf);
            continue;
        }
        size_t m = 0;
        for (size_t s = 0; s < nstacks; s++) {
            if (!stacks[s].alloc_count)
                continue;
            buf[m].stack_id = (uint32_t)s;
            buf[m].live_count = stacks[s].live_count;
            buf[m].live_bytes = stacks[s].live_bytes;
            buf[m].peak_bytes = stacks[s].peak_bytes;
            buf[m].alloc_count = stacks[s].alloc_count;
            buf[m].alloc_bytes = stacks[s].alloc_bytes;
            m++;
        }
        UNLOCK();
        *out = buf;
        return (long)m;
    }
}

long mvz_store_failures(mvz_failure **out)
{
    mvz_failure tmp[MVZ_FAILURES];
    size_t n;
    LOCK();
    n = nfailures < MVZ_FAILURES ? (size_t)nfailures : MVZ_FAILURES;
    /* Oldest first. */
    for (size_t k = 0; k < n; k++)
        tmp[k] = failures[(nfailures - n + k) % MVZ_FAILURES];
    UNLOCK();
    COPY_OUT(mvz_failure, tmp, n, out);
}

long mvz_store_timeline(mvz_point **out)
{
    mvz_point *buf = malloc(sizeof timeline);
    if (!buf)
        return -1;
    LOCK();
    size_t n = ntimeline;
    memcpy(buf, timeline, n * sizeof(mvz_point));
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

void mvz_store_block_totals(mvz_totals out[MVZ_NSLOTS])
{
    LOCK();
    memcpy(out, btotals, sizeof btotals);
    UNLOCK();
}

void mvz_store_get_stats(mvz_store_stats *o)
{
    memset(o, 0, sizeof *o);
    LOCK();
    o->live = live_count;
    o->stacks = nstacks - 1;
    o->frames = nframes;
    o->threads = nthreads;
    o->unmatched_frees = unmatched_frees;
    o->dropped_allocs = dropped_allocs;
    o->dropped_stacks = dropped_stacks;
    o->dropped_threads = dropped_threads;
    o->timeline_points = ntimeline;
    o->generation = generation;
    o->max_live = (uint32_t)max_live;
    /* Bytes in use: what each region has handed out (an upper bound of its
     * resident pages) plus the fixed tables. */
    o->bytes_used = live_count * sizeof(mvz_alloc) + live_index_cap * sizeof(uint32_t) +
                    nstacks * sizeof(mvz_stack) + nframes * sizeof(mvz_frame) +
                    stack_index_cap * sizeof(uint32_t) + npending * sizeof(uint32_t) +
                    ngraves * sizeof(mvz_grave) + sizeof totals + sizeof failures +
                    sizeof timeline + sizeof threads;
    o->bytes_reserved = allocs_r.reserved + index_a_r.reserved + index_b_r.reserved +
                        stacks_r.reserved + frames_r.reserved + stack_index_r.reserved +
                        pending_r.reserved + graves_r.reserved;
    UNLOCK();
}

/* ---- step marks --------------------------------------------------------- */

/* The step mark of window w (-1: the store's): its window peaks restart at
 * the current value; the per-stack marks are the store's. */
static long step_mark(int w, mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes)
{
    *changes = NULL;
    for (;;) {
        size_t n = __atomic_load_n(&nstacks, __ATOMIC_RELAXED) + 64;
        mvz_site_change *buf = malloc(n * sizeof *buf);
        if (!buf)
            return -1;
        LOCK();
        if (nstacks > n) {
            UNLOCK();
            free(buf);
            continue;
        }
        mvz_totals *t = w < 0 ? totals : mvz_window_totals_locked(w);
        if (!t) {
            UNLOCK();
            free(buf);
            return -1;
        }
        size_t m = 0;
        for (size_t s = 0; s < nstacks; s++) {
            mvz_stack *st = &stacks[s];
            if (st->live_bytes == st->mark_bytes && st->live_count == st->mark_count)
                continue;
            buf[m].stack_id = (uint32_t)s;
            buf[m].live_count = st->live_count;
            buf[m].live_bytes = st->live_bytes;
            buf[m].delta_bytes = (int64_t)st->live_bytes - (int64_t)st->mark_bytes;
            buf[m].delta_count = (int64_t)st->live_count - (int64_t)st->mark_count;
            st->mark_bytes = st->live_bytes;
            st->mark_count = st->live_count;
            m++;
        }
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
}

long mvz_store_step_mark(mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes)
{
    return step_mark(-1, out, changes);
}

/* Under the store lock like every writer of the totals, so a callback never
 * sees a half-reset peak. The new peak is dated with next_ts(), later than
 * every allocation recorded so far: the peak set ("made before the peak and
 * live, or freed after it") is then exactly what is live now, and the
 * graveyard entries that only the old peak needed can go. */
int mvz_store_reset_peak(int w)
{
    LOCK();
    mvz_totals *t = w < 0 ? totals : mvz_window_totals_locked(w);
    if (!t) {
        UNLOCK();
        return -1;
    }
    uint64_t now = next_ts();
    for (int d = 0; d < MVZ_NSLOTS; d++) {
        t[d].peak = t[d].current;
        t[d].peak_timestamp = now;
        t[d].peak_count = t[d].live_count;
        if (w < 0) {
            btotals[d].peak = btotals[d].current;
            btotals[d].peak_timestamp = now;
            btotals[d].peak_count = btotals[d].live_count;
        }
    }
    graves_compact();
    UNLOCK();
    return 0;
}

long mvz_store_window_step_mark(int w, mvz_totals out[MVZ_NSLOTS], mvz_site_change **changes)
{
    if (w < 0) {
        *changes = NULL;
        return -1;
    }
    return step_mark(w, out, changes);
}

int mvz_store_copy(int w, int close, mvz_store_copy_t *out)
{
    memset(out, 0, sizeof *out);
    _Static_assert(MVZ_TIMELINE_POINTS >= MVZ_WINDOW_POINTS, "one buffer serves both timelines");
    for (;;) {
        /* Buffers before the lock (nothing under it allocates); retry if the
         * tables grew meanwhile. */
        size_t n = __atomic_load_n(&live_count, __ATOMIC_RELAXED) +
                   __atomic_load_n(&ngraves, __ATOMIC_RELAXED) + 64;
        mvz_alloc *live = malloc(n * sizeof(mvz_alloc));
        mvz_alloc *peaks = malloc(n * sizeof(mvz_alloc));
        mvz_point *points = malloc(MVZ_TIMELINE_POINTS * sizeof(mvz_point));
        if (!live || !peaks || !points) {
            free(live);
            free(peaks);
            free(points);
            return -1;
        }
        LOCK();
        if (live_count + ngraves > n) {
            UNLOCK();
            free(live);
            free(peaks);
            free(points);
            continue;
        }
        const mvz_totals *t = w < 0 ? totals : mvz_window_totals_locked(w);
        if (!t) {
            UNLOCK();
            free(live);
            free(peaks);
            free(points);
            return -1;
        }
        uint64_t after = w < 0 ? 0 : mvz_window_start_locked(w); /* store timestamps are > 0 */
        memcpy(out->totals, t, sizeof totals);
        for (size_t k = 0; k < live_count; k++) {
            const mvz_alloc *a = &allocs[k];
            if (a->timestamp <= after)
                continue;
            live[out->nlive++] = *a;
            if (a->timestamp <= t[a->slot].peak_timestamp)
                peaks[out->npeaks++] = *a;
        }
        for (size_t k = 0; k < ngraves; k++) {
            const mvz_grave *g = &graves[k];
            uint64_t peak_ts = t[g->a.slot].peak_timestamp;
            if (g->a.timestamp > after && g->a.timestamp <= peak_ts && g->freed > peak_ts)
                peaks[out->npeaks++] = g->a;
        }
        if (w < 0) {
            memcpy(points, timeline, ntimeline * sizeof(mvz_point));
            out->ntimeline = ntimeline;
        } else {
            out->ntimeline = mvz_window_timeline_locked(w, points);
        }
        out->when = next_ts();
        if (close && w >= 0)
            mvz_window_close_locked(w);
        UNLOCK();
        out->live = live;
        out->peaks = peaks;
        out->timeline = points;
        return 0;
    }
}

int mvz_store_window_open(uint64_t *start, mvz_totals at_open[MVZ_NSLOTS])
{
    LOCK();
    uint64_t ts = next_ts(); /* every later event has a larger timestamp */
    int w = mvz_window_open_locked(ts);
    if (w >= 0) {
        *start = ts;
        memcpy(at_open, totals, sizeof totals);
    }
    UNLOCK();
    return w;
}

uint32_t mvz_store_stack_count(void)
{
    LOCK();
    uint32_t n = (uint32_t)nstacks;
    UNLOCK();
    return n;
}

/* ---- fork ------------------------------------------------------------- */

void mvz_store_atfork_prepare(void) { LOCK(); }
void mvz_store_atfork_parent(void) { UNLOCK(); }
void mvz_store_atfork_child(void)
{
    /* Only the forking thread exists in the child; the lock it took in
     * prepare is released and fresh, and threads registered in the parent
     * are forgotten by bumping the generation. */
    pthread_mutex_init(&store_lock, NULL);
    generation++;
}
