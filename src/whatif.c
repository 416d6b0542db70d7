/* What if (whatif.h): PyTorch's caching allocator, modelled. One model per
 * setting; no lock, no Python: a model belongs to one thread at a time
 * (whatif_pass.c hands it to one worker while the GIL is released). Every
 * function here touches only its model, so none needs the GIL or a lock.
 * Calls blocks.c's rules and whatif_pool.c (the free pools' index). */
#include "whatif.h"
#include "grow.h"
#include "whatif_pool.h"
#include "whatif_va.h"

#include <stdlib.h>
#include <string.h>

#define GAP (2u << 20)           /* between modelled segments' addresses */
#define NON_SPLIT_ROUNDING (20u << 20) /* max_non_split_rounding_size (kLargeBuffer) */
#define EXPANDABLE_SPAN ((uint64_t)1 << 40) /* an expandable segment's reservation */
#define NONE (-1)
#define MODEL_VA ((uint64_t)1 << 60) /* the model's own addresses start here, above any recorded one */

/* 48 bytes: merging a freed block reads its neighbours, anywhere. */
typedef struct {
    uint64_t addr, size, stream;
    int32_t prev, next, seg; /* an unused block's next: the next unused id */
    uint32_t stack;
    uint8_t allocated, small, slot, in_pool;
} wblock;

typedef struct {
    uint64_t base, size, stream;
    int32_t last;  /* an expandable segment's last block */
    int32_t spare; /* a dead segment's next unused id */
    uint8_t slot, small, expandable, live, at_recorded;
} wseg;

/* A live segment placed at the recording's address: [base, end). */
typedef struct {
    uint64_t base, end;
} wspan;

typedef struct {
    mvz_whatif_pool free; /* its free blocks (whatif_pool.h) */
    uint64_t calls;       /* get_free_block calls: a free block's age is calls - w->freed_at[id] */
} wpool;

struct mvz_whatif {
    mvz_whatif_settings s;
    wblock *b;
    size_t nb, capb;
    int32_t spare;
    uint64_t *freed_at; /* with garbage collection: calls of its pool when the block came in it */
    size_t capf;
    int gc;             /* garbage_collection_threshold acts (it needs a fraction) */
    wseg *g;
    size_t ng, capg;
    int32_t gspare;
    wpool pools[MVZ_NSLOTS][2];
    int32_t *h; /* the pass's handle of a live block -> its id (NONE) */
    size_t caph;
    int32_t *ids; /* scratch: a pool's free blocks, listed */
    size_t capids;
    uint64_t next_va;
    /* the driver's addresses (mvz_whatif_alloc): the request's */
    uint64_t hint, hint_size;
    uint32_t rec_made, rec_freed;
    uint32_t made[MVZ_NSLOTS], freed[MVZ_NSLOTS]; /* the model's segments made and freed */
    uint8_t diverged[MVZ_NSLOTS]; /* its segments were once not the recording's: addresses its own */
    mvz_whatif_va va[MVZ_NSLOTS]; /* the driver's placement of each device's segments */
    wspan *spans;   /* the live segments at recorded addresses, by address */
    size_t nspans, capspans;
    uint64_t reserved[MVZ_NSLOTS], allocated[MVZ_NSLOTS];
    mvz_whatif_result r[MVZ_NSLOTS];
    uint8_t used[MVZ_NSLOTS];
    int approximate, failed;
};

/* ---- blocks ---------------------------------------------------------------------- */

static int32_t block_new(mvz_whatif *w)
{
    int32_t id;
    if (w->spare != NONE) {
        id = w->spare;
        w->spare = w->b[id].next;
    } else {
        if (mvz_grow((void **)&w->b, &w->capb, w->nb + 1, sizeof *w->b) ||
            (w->gc && mvz_grow((void **)&w->freed_at, &w->capf, w->nb + 1, sizeof *w->freed_at)))
            return NONE;
        id = (int32_t)w->nb++;
    }
    memset(&w->b[id], 0, sizeof w->b[id]);
    w->b[id].prev = w->b[id].next = w->b[id].seg = NONE;
    return id;
}

static void block_drop(mvz_whatif *w, int32_t id)
{
    w->b[id].allocated = 0;
    w->b[id].next = w->spare;
    w->spare = id;
}

/* ---- the pools ------------------------------------------------------------------- */

static int pool_insert(mvz_whatif *w, wpool *p, int32_t id)
{
    wblock *x = &w->b[id];
    if (mvz_whatif_pool_insert(&p->free, x->stream, x->size, x->addr, id))
        return w->failed = -1;
    x->in_pool = 1;
    if (w->gc)
        w->freed_at[id] = p->calls;
    return 0;
}

static void pool_remove(mvz_whatif *w, wpool *p, int32_t id)
{
    wblock *x = &w->b[id];
    x->in_pool = 0;
    mvz_whatif_pool_remove(&p->free, x->stream, x->size, x->addr, id);
}

static wpool *pool_of(mvz_whatif *w, const wblock *x) { return &w->pools[x->slot][x->small]; }

/* The pool's free blocks into w->ids (the loops below free blocks as they
 * go; each block's fate does not depend on the others', so the order is
 * only for reading). -1: no memory. */
static long pool_list(mvz_whatif *w, const wpool *p)
{
    if (mvz_grow((void **)&w->ids, &w->capids, p->free.n + 1, sizeof *w->ids))
        return w->failed = -1;
    return (long)mvz_whatif_pool_list(&p->free, w->ids);
}

/* ---- the pass's handles of live blocks ------------------------------------------ */

static int handle_put(mvz_whatif *w, uint32_t handle, int32_t id)
{
    if (handle >= w->caph) {
        size_t old = w->caph;
        if (mvz_grow((void **)&w->h, &w->caph, (size_t)handle + 1, sizeof *w->h))
            return -1;
        for (size_t i = old; i < w->caph; i++)
            w->h[i] = NONE;
    }
    w->h[handle] = id;
    return 0;
}

static int32_t handle_take(mvz_whatif *w, uint32_t handle)
{
    if (handle >= w->caph)
        return NONE;
    int32_t id = w->h[handle];
    w->h[handle] = NONE;
    return id;
}

/* ---- segments ---------------------------------------------------------------------- */

/* The first span of w->spans that ends after `addr`. */
static size_t span_find(const mvz_whatif *w, uint64_t addr)
{
    size_t lo = 0, hi = w->nspans;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (w->spans[mid].end <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void segment_drop(mvz_whatif *w, int32_t s)
{
    w->freed[w->g[s].slot]++;
    if (!w->g[s].expandable && mvz_whatif_va_give(&w->va[w->g[s].slot], w->g[s].base, w->g[s].size))
        w->failed = 1;
    if (w->g[s].at_recorded) {
        size_t i = span_find(w, w->g[s].base);
        if (i < w->nspans && w->spans[i].base == w->g[s].base) {
            memmove(w->spans + i, w->spans + i + 1, (w->nspans - i - 1) * sizeof *w->spans);
            w->nspans--;
        }
    }
    w->g[s].live = 0;
    w->g[s].spare = w->gspare;
    w->gspare = s;
}

/* A whole segment's one free block goes back to the driver. */
static void release_block(mvz_whatif *w, int32_t id)
{
    wblock *x = &w->b[id];
    if (x->in_pool)
        pool_remove(w, pool_of(w, x), id);
    w->reserved[x->slot] -= w->g[x->seg].size;
    segment_drop(w, x->seg);
    block_drop(w, id);
}

static int whole(const wblock *x) { return x->prev == NONE && x->next == NONE; }

/* Whether the driver (the card, or the fraction) gives `size` more bytes. */
static int room_for(const mvz_whatif *w, int slot, uint64_t size, uint64_t outside)
{
    uint64_t r = w->reserved[slot];
    if (w->s.fraction_limit != UINT64_MAX && r + size > w->s.fraction_limit)
        return 0;
    if (w->s.card != UINT64_MAX && (r + size + outside > w->s.card || r + size + outside < r))
        return 0;
    return 1;
}

/* A new segment of `size` with one free block (not in its pool). NONE: out
 * of host memory (w->failed set). */
static int32_t segment_new(mvz_whatif *w, int slot, int small, uint64_t stream, uint64_t size, int expandable)
{
    int32_t s = w->gspare;
    if (s == NONE && mvz_grow((void **)&w->g, &w->capg, w->ng + 1, sizeof *w->g)) {
        w->failed = 1;
        return NONE;
    }
    int32_t id = block_new(w);
    if (id == NONE) {
        w->failed = 1;
        return NONE;
    }
    if (s != NONE)
        w->gspare = w->g[s].spare;
    else
        s = (int32_t)w->ng++;
    /* PyTorch's best fit breaks ties between free blocks of one size by
     * address, so the model's segments sit where the driver would put them.
     * While the model has made and freed the segments the recording did,
     * the driver, asked the same, answers the same: the recorded address.
     * Past that, whatif_va.h's model of the driver. An expandable segment:
     * a reservation of the model's own, each below the one before. */
    uint64_t base = w->next_va;
    int at_recorded = 0;
    w->made[slot]++;
    if (!w->diverged[slot] && (!w->hint || expandable || w->hint >= MODEL_VA || size != w->hint_size ||
                               w->made[slot] != w->rec_made || w->freed[slot] != w->rec_freed))
        w->diverged[slot] = 1;
    if (!w->diverged[slot]) {
        size_t i = span_find(w, w->hint);
        if (i == w->nspans || w->spans[i].base >= w->hint + size) {
            if (w->nspans == w->capspans &&
                mvz_grow((void **)&w->spans, &w->capspans, w->nspans + 1, sizeof *w->spans)) {
                w->failed = 1;
                block_drop(w, id);
                return NONE;
            }
            memmove(w->spans + i + 1, w->spans + i, (w->nspans - i) * sizeof *w->spans);
            w->spans[i] = (wspan){w->hint, w->hint + size};
            w->nspans++;
            base = w->hint;
            at_recorded = 1;
        } else {
            w->diverged[slot] = 1;
        }
    }
    if (at_recorded) {
        if (mvz_whatif_va_take(&w->va[slot], base, size))
            w->failed = 1;
    } else if (expandable) {
        w->next_va -= (EXPANDABLE_SPAN + GAP - 1) / GAP * GAP + GAP;
        base = w->next_va;
    } else if ((base = mvz_whatif_va_place(&w->va[slot], size)) == 0) {
        w->failed = 1;
    }
    w->g[s] = (wseg){base, size, stream, id, NONE, (uint8_t)slot, (uint8_t)small, (uint8_t)expandable, 1,
                     (uint8_t)at_recorded};
    wblock *x = &w->b[id];
    x->addr = base;
    x->size = size;
    x->stream = stream;
    x->seg = s;
    x->slot = (uint8_t)slot;
    x->small = (uint8_t)small;
    w->reserved[slot] += size;
    w->r[slot].mallocs++;
    return id;
}

/* alloc_block: a new segment for a request, if the driver has room. */
static int32_t alloc_block(mvz_whatif *w, int slot, int small, uint64_t stream, uint64_t rounded, uint64_t outside,
                           int force)
{
    if (w->s.rules.expandable) {
        /* the stream's expandable segment grows at its end by whole granules */
        uint64_t granule = small ? MVZ_SMALL_BUFFER : MVZ_LARGE_BUFFER;
        int32_t s = NONE;
        for (size_t i = 0; i < w->ng; i++)
            if (w->g[i].live && w->g[i].expandable && w->g[i].slot == slot && w->g[i].small == small &&
                w->g[i].stream == stream)
                s = (int32_t)i;
        int32_t tail = s != NONE ? w->g[s].last : NONE;
        uint64_t have = tail != NONE && !w->b[tail].allocated ? w->b[tail].size : 0;
        uint64_t need = rounded > have ? rounded - have : 0;
        uint64_t more = (need + granule - 1) / granule * granule;
        if (!force && !room_for(w, slot, more, outside))
            return NONE;
        if (s == NONE) {
            int32_t id = segment_new(w, slot, small, stream, more, 1);
            if (id != NONE)
                w->g[w->b[id].seg].last = id;
            return id;
        }
        w->g[s].size += more;
        w->reserved[slot] += more;
        w->r[slot].mallocs++;
        if (have) {
            wblock *t = &w->b[tail];
            pool_remove(w, pool_of(w, t), tail);
            t->size += more;
            return tail;
        }
        int32_t id = block_new(w);
        if (id == NONE) {
            w->failed = 1;
            return NONE;
        }
        wblock *t = &w->b[tail], *x = &w->b[id];
        x->addr = t->addr + t->size;
        x->size = more;
        x->stream = stream;
        x->seg = s;
        x->slot = (uint8_t)slot;
        x->small = (uint8_t)small;
        x->prev = tail;
        t->next = id;
        w->g[s].last = id;
        return id;
    }
    uint64_t size = mvz_rules_segment(rounded);
    if (!force && !room_for(w, slot, size, outside))
        return NONE;
    return segment_new(w, slot, small, stream, size, 0);
}

/* A free block's size for best fit under expandable segments: the block
 * that ends an expandable segment's mapped part can grow into the rest of
 * its reservation (EXPANDABLE_SPAN). */
static uint64_t grow_size(const mvz_whatif *w, int32_t id)
{
    const wblock *x = &w->b[id];
    const wseg *g = &w->g[x->seg];
    return g->expandable && g->last == id ? x->size + (EXPANDABLE_SPAN - g->size) : x->size;
}

/* get_free_block: best fit in the pool, on the stream, within
 * max_split_size's limits. */
static int32_t get_free_block(mvz_whatif *w, wpool *p, uint64_t stream, uint64_t rounded)
{
    if (w->gc)
        p->calls++;
    const mvz_whatif_pool_entry *e = mvz_whatif_pool_first_from(&p->free, stream, rounded, 0);
    if (!e)
        return NONE;
    if (w->s.rules.expandable) {
        /* With expandable segments PyTorch's best fit counts a block that
         * ends where its segment's mapped part ends as the size it could
         * grow to, so it takes the next larger block that cannot grow
         * instead, keeping the end of the segment free to grow. */
        uint64_t have = grow_size(w, e->id);
        while (w->g[w->b[e->id].seg].expandable) {
            const mvz_whatif_pool_entry *n = mvz_whatif_pool_first_from(&p->free, stream, e->size, e->addr + 1);
            if (!n)
                break;
            uint64_t next = grow_size(w, n->id);
            if (next >= have)
                break;
            e = n;
            have = next;
        }
    }
    uint64_t ms = w->s.rules.max_split;
    if (rounded < ms && e->size >= ms)
        return NONE;
    if (rounded >= ms && e->size >= rounded + NON_SPLIT_ROUNDING)
        return NONE;
    int32_t id = e->id;
    pool_remove(w, p, id);
    return id;
}

/* release_available_cached_blocks: oversize cached segments, for a request
 * that found no room. */
static int release_available(mvz_whatif *w, wpool *p, uint64_t stream, uint64_t rounded)
{
    uint64_t ms = w->s.rules.max_split;
    if (ms == UINT64_MAX)
        return 0;
    uint64_t key = rounded < ms ? ms : rounded;
    const mvz_whatif_pool_entry *e = mvz_whatif_pool_first_from(&p->free, stream, key, 0);
    if (e && !w->g[w->b[e->id].seg].expandable) {
        release_block(w, e->id);
        return 1;
    }
    /* down from there, the largest first, while they are oversize */
    uint64_t released = 0, size = key, addr = 0;
    while (released < key && (e = mvz_whatif_pool_last_before(&p->free, stream, size, addr)) != NULL &&
           e->size >= ms) {
        int32_t id = e->id;
        size = e->size;
        addr = e->addr;
        const wblock *x = &w->b[id];
        if (!w->g[x->seg].expandable && whole(x)) {
            released += x->size;
            release_block(w, id);
        }
    }
    return released >= key;
}

/* Give back the whole granules of an expandable segment's free tail. */
static void unmap_tail(mvz_whatif *w, int32_t id)
{
    wblock *x = &w->b[id];
    wseg *g = &w->g[x->seg];
    uint64_t granule = g->small ? MVZ_SMALL_BUFFER : MVZ_LARGE_BUFFER;
    uint64_t off = x->addr - g->base, end = off + x->size;
    uint64_t keep = (off + granule - 1) / granule * granule;
    if (keep >= end || end - keep < granule)
        return;
    uint64_t drop = (end - keep) / granule * granule;
    pool_remove(w, pool_of(w, x), id);
    g->size -= drop;
    w->reserved[x->slot] -= drop;
    x->size -= drop;
    if (x->size == 0) {
        if (x->prev != NONE)
            w->b[x->prev].next = NONE;
        g->last = x->prev;
        if (x->prev == NONE)
            segment_drop(w, x->seg);
        block_drop(w, id);
        return;
    }
    pool_insert(w, pool_of(w, x), id);
}

/* release_cached_blocks: every whole free segment of the device goes back. */
static void release_cached(mvz_whatif *w, int slot)
{
    for (int small = 0; small < 2; small++) {
        wpool *p = &w->pools[slot][small];
        long n = pool_list(w, p);
        for (long i = n; i-- > 0;) {
            int32_t id = w->ids[i];
            wblock *x = &w->b[id];
            if (!x->in_pool)
                continue;
            if (w->g[x->seg].expandable) {
                if (x->next == NONE)
                    unmap_tail(w, id);
            } else if (whole(x)) {
                release_block(w, id);
            }
        }
    }
}

/* garbage_collect_cached_blocks: the oldest whole free segments of the
 * large pool, until reserved is under the threshold. */
static void garbage_collect(mvz_whatif *w, int slot)
{
    uint64_t threshold = (uint64_t)(w->s.gc_threshold * (double)w->s.fraction_limit);
    uint64_t r = w->reserved[slot];
    if (r <= threshold)
        return;
    uint64_t target = r - threshold, reclaimed = 0;
    wpool *p = &w->pools[slot][0];
    /* ages are whole numbers far below 2^53: their sums are exact in any order */
    double total_age = 0;
    size_t freeable = 0;
    long n = pool_list(w, p);
    for (long i = 0; i < n; i++) {
        const wblock *x = &w->b[w->ids[i]];
        if (whole(x)) {
            total_age += (double)(p->calls - w->freed_at[w->ids[i]]);
            freeable++;
        }
    }
    int freed = 1;
    while (reclaimed < target && freed && freeable > 0) {
        double threshold_age = total_age / (double)freeable;
        freed = 0;
        n = pool_list(w, p);
        for (long i = 0; i < n; i++) {
            int32_t id = w->ids[i];
            const wblock *x = &w->b[id];
            double age = (double)(p->calls - w->freed_at[id]);
            if (whole(x) && !w->g[x->seg].expandable && age >= threshold_age) {
                freed = 1;
                reclaimed += x->size;
                total_age -= age;
                freeable--;
                release_block(w, id);
            }
        }
    }
}

static uint64_t largest_free(const mvz_whatif *w, int slot)
{
    uint64_t a = mvz_whatif_pool_largest(&w->pools[slot][0].free), b = mvz_whatif_pool_largest(&w->pools[slot][1].free);
    return a > b ? a : b;
}

/* The lines holding the most bytes on `slot` now (an out-of-memory point):
 * the live blocks' (stack, bytes), sorted by stack and summed; the largest
 * MVZ_WHATIF_TOP kept. Once per setting and device: not a hot path. */
typedef struct {
    uint32_t stack;
    uint64_t bytes;
} wsum;

static int by_stack(const void *a, const void *b)
{
    uint32_t x = ((const wsum *)a)->stack, y = ((const wsum *)b)->stack;
    return x < y ? -1 : x > y;
}

static void top_lines(mvz_whatif *w, int slot, mvz_whatif_result *r)
{
    wsum *v = malloc((w->nb ? w->nb : 1) * sizeof *v);
    if (!v)
        return;
    size_t n = 0;
    for (size_t i = 0; i < w->nb; i++) {
        const wblock *x = &w->b[i];
        if (x->allocated && x->slot == slot) /* an unused block is not */
            v[n++] = (wsum){x->stack, x->size};
    }
    qsort(v, n, sizeof *v, by_stack);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (m && v[m - 1].stack == v[i].stack)
            v[m - 1].bytes += v[i].bytes;
        else
            v[m++] = v[i];
    }
    for (size_t i = 0; i < m; i++) {
        int low = 0;
        for (int k = 1; k < MVZ_WHATIF_TOP; k++)
            if (r->oom_top_bytes[k] < r->oom_top_bytes[low])
                low = k;
        if (v[i].bytes > r->oom_top_bytes[low]) {
            r->oom_top_stack[low] = v[i].stack;
            r->oom_top_bytes[low] = v[i].bytes;
        }
    }
    free(v);
}

/* ---- requests ---------------------------------------------------------------------- */

/* Without the GIL (as every request below): it touches only w, which one
 * worker at a time holds (whatif_pass.c). */
int mvz_whatif_alloc(mvz_whatif *w, int slot, uint32_t handle, uint64_t requested, uint64_t stream,
                     uint32_t stack, uint32_t label, uint32_t caller, uint64_t ts, uint64_t index,
                     uint64_t outside, uint64_t hint, uint64_t hint_size, uint32_t rec_made,
                     uint32_t rec_freed)
{
    if (slot < 0 || slot >= MVZ_NSLOTS)
        return 0;
    if (handle < w->caph && w->h[handle] != NONE) /* its free was not seen: freed now */
        mvz_whatif_release(w, handle);
    mvz_whatif_result *r = &w->r[slot];
    if (!w->used[slot]) {
        w->used[slot] = 1;
        r->min_room = INT64_MAX;
    }
    r->requests++;
    uint64_t rounded = mvz_rules_round(&w->s.rules, requested);
    int small = rounded <= MVZ_SMALL_SIZE;
    wpool *p = &w->pools[slot][small];
    int32_t id = get_free_block(w, p, stream, rounded);
    w->hint = hint;
    w->hint_size = hint_size;
    w->rec_made = rec_made;
    w->rec_freed = rec_freed;
    if (id != NONE && hint)
        w->diverged[slot] = 1; /* the recording made a segment where the model found a block */
    if (id == NONE) {
        if (w->gc)
            garbage_collect(w, slot);
        id = alloc_block(w, slot, small, stream, rounded, outside, 0);
        if (id == NONE && !w->failed && release_available(w, p, stream, rounded))
            id = alloc_block(w, slot, small, stream, rounded, outside, 0);
        if (id == NONE && !w->failed) {
            r->flushes++;
            r->retries++;
            release_cached(w, slot);
            id = alloc_block(w, slot, small, stream, rounded, outside, 0);
        }
        if (id == NONE && !w->failed) {
            if (!r->oom) { /* the first refusal: where the run would stop */
                r->oom = 1;
                r->oom_ts = ts;
                r->oom_index = index;
                r->oom_requested = requested;
                r->oom_rounded = rounded;
                r->oom_stream = stream;
                r->oom_stack = stack;
                r->oom_label = label;
                r->oom_caller = caller;
                r->oom_reserved = w->reserved[slot];
                r->oom_allocated = w->allocated[slot];
                r->oom_outside = outside;
                top_lines(w, slot, r);
            }
            id = alloc_block(w, slot, small, stream, rounded, outside, 1); /* go on, past the card */
        }
        if (id == NONE)
            return -1;
    }
    w->hint = 0;
    wblock *x = &w->b[id];
    if (mvz_rules_split(&w->s.rules, rounded, x->size)) {
        int32_t rest = block_new(w);
        if (rest == NONE)
            return -1;
        x = &w->b[id];
        wblock *y = &w->b[rest];
        y->addr = x->addr + rounded;
        y->size = x->size - rounded;
        y->stream = x->stream;
        y->seg = x->seg;
        y->slot = x->slot;
        y->small = x->small;
        y->prev = id;
        y->next = x->next;
        if (x->next != NONE)
            w->b[x->next].prev = rest;
        else if (w->g[x->seg].expandable)
            w->g[x->seg].last = rest;
        x->next = rest;
        x->size = rounded;
        if (pool_insert(w, pool_of(w, y), rest))
            return -1;
    }
    x->allocated = 1;
    x->stack = stack;
    x->stream = stream;
    if (handle_put(w, handle, id))
        return -1;
    w->allocated[slot] += x->size;
    if (w->s.card != UINT64_MAX) {
        int64_t room = (int64_t)w->s.card - (int64_t)outside - (int64_t)w->reserved[slot];
        if (room < r->min_room)
            r->min_room = room;
    }
    if (w->allocated[slot] > r->allocated_peak)
        r->allocated_peak = w->allocated[slot];
    /* the peak: reserved at its highest and, of those moments, allocated at its highest */
    if (w->reserved[slot] > r->reserved_peak ||
        (w->reserved[slot] == r->reserved_peak && w->allocated[slot] > r->allocated_at_peak)) {
        r->reserved_peak = w->reserved[slot];
        r->allocated_at_peak = w->allocated[slot];
        r->largest_free_at_peak = largest_free(w, slot);
        r->peak_ts = ts;
    }
    return 0;
}

static int32_t merge(mvz_whatif *w, int32_t dst, int32_t src)
{
    /* src is dst's free neighbour (either side): one block remains, at the lower address */
    wblock *a = &w->b[dst], *b = &w->b[src];
    pool_remove(w, pool_of(w, b), src);
    int32_t lo = a->addr < b->addr ? dst : src, hi = lo == dst ? src : dst;
    wblock *l = &w->b[lo], *h = &w->b[hi];
    l->size += h->size;
    l->next = h->next;
    if (h->next != NONE)
        w->b[h->next].prev = lo;
    else if (w->g[l->seg].expandable)
        w->g[l->seg].last = lo;
    l->allocated = 0;
    l->stream = a->stream;
    block_drop(w, hi);
    return lo;
}

/* Without the GIL: touches only w (one worker's at a time). */
void mvz_whatif_release(mvz_whatif *w, uint32_t handle)
{
    int32_t id = handle_take(w, handle);
    if (id == NONE)
        return;
    wblock *x = &w->b[id];
    w->allocated[x->slot] -= x->size;
    x->allocated = 0;
    if (x->prev != NONE && !w->b[x->prev].allocated)
        id = merge(w, id, x->prev);
    x = &w->b[id];
    if (x->next != NONE && !w->b[x->next].allocated)
        id = merge(w, id, x->next);
    pool_insert(w, pool_of(w, &w->b[id]), id);
}

/* Without the GIL: touches only w (one worker's at a time). */
void mvz_whatif_empty_cache(mvz_whatif *w, int slot)
{
    if (slot >= 0 && slot < MVZ_NSLOTS)
        release_cached(w, slot);
}

/* ---- life ---------------------------------------------------------------------- */

mvz_whatif *mvz_whatif_new(const mvz_whatif_settings *s)
{
    mvz_whatif *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->s = *s;
    w->spare = w->gspare = NONE;
    w->gc = s->gc_threshold > 0 && s->fraction_limit != UINT64_MAX;
    w->next_va = MODEL_VA << 2; /* the model's own go downwards from here */
    w->approximate = s->rules.expandable;
    return w;
}

void mvz_whatif_free(mvz_whatif *w)
{
    if (!w)
        return;
    for (int i = 0; i < MVZ_NSLOTS; i++)
        for (int k = 0; k < 2; k++)
            mvz_whatif_pool_free(&w->pools[i][k].free);
    free(w->b);
    free(w->freed_at);
    free(w->g);
    free(w->spans);
    for (int i = 0; i < MVZ_NSLOTS; i++)
        mvz_whatif_va_free(&w->va[i]);
    free(w->h);
    free(w->ids);
    free(w);
}

void mvz_whatif_result_of(const mvz_whatif *w, int slot, mvz_whatif_result *out)
{
    memset(out, 0, sizeof *out);
    if (slot < 0 || slot >= MVZ_NSLOTS)
        return;
    *out = w->r[slot];
    out->reserved_end = w->reserved[slot];
    out->allocated_end = w->allocated[slot];
}

int mvz_whatif_used(const mvz_whatif *w, int slot) { return slot >= 0 && slot < MVZ_NSLOTS && w->used[slot]; }

int mvz_whatif_approximate(const mvz_whatif *w) { return w->approximate; }

int mvz_whatif_failed(const mvz_whatif *w) { return w->failed != 0; }
