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
    uint8_t unmapped; /* an expandable segment's address space with no memory behind it */
} wblock;

typedef struct {
    uint64_t base, size, stream; /* size: bytes mapped (an expandable segment spans EXPANDABLE_SPAN) */
    int32_t spare; /* a dead segment's next unused id */
    uint8_t slot, small, expandable, live, at_recorded;
} wseg;


typedef struct {
    mvz_whatif_pool free; /* its free blocks (whatif_pool.h) */
    uint64_t calls;       /* get_free_block calls: a free block's age is calls - w->freed_at[id] */
    int32_t *unm;         /* its unmapped blocks, by stream and address (PyTorch's pool.unmapped) */
    size_t nunm, capunm;
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
    mvz_whatif_va_hole *spans; /* the live segments at recorded addresses, [base, end), by address */
    size_t nspans, capspans;
    uint64_t reserved[MVZ_NSLOTS], allocated[MVZ_NSLOTS];
    mvz_whatif_result r[MVZ_NSLOTS];
    uint8_t used[MVZ_NSLOTS];
    int failed;
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

/* The place in p->unm of (stream, addr), or where it would go. */
static size_t unm_find(const mvz_whatif *w, const wpool *p, uint64_t stream, uint64_t addr)
{
    size_t lo = 0, hi = p->nunm;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const wblock *m = &w->b[p->unm[mid]];
        if (m->stream < stream || (m->stream == stream && m->addr < addr))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int unm_insert(mvz_whatif *w, int32_t id)
{
    wpool *p = pool_of(w, &w->b[id]);
    if (p->nunm == p->capunm && mvz_grow((void **)&p->unm, &p->capunm, p->nunm + 1, sizeof *p->unm))
        return w->failed = -1;
    size_t at = unm_find(w, p, w->b[id].stream, w->b[id].addr);
    memmove(p->unm + at + 1, p->unm + at, (p->nunm - at) * sizeof *p->unm);
    p->unm[at] = id;
    p->nunm++;
    return 0;
}

static void unm_remove(mvz_whatif *w, int32_t id)
{
    wpool *p = pool_of(w, &w->b[id]);
    size_t at = unm_find(w, p, w->b[id].stream, w->b[id].addr);
    if (at < p->nunm && p->unm[at] == id) {
        memmove(p->unm + at, p->unm + at + 1, (p->nunm - at - 1) * sizeof *p->unm);
        p->nunm--;
    }
}

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
    return mvz_whatif_va_first_after(w->spans, w->nspans, addr);
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

/* Whether set_per_process_memory_fraction lets PyTorch reserve `size` more. */
static int fraction_has(const mvz_whatif *w, int slot, uint64_t size)
{
    return w->s.fraction_limit == UINT64_MAX || w->reserved[slot] + size <= w->s.fraction_limit;
}

/* Whether the driver has `size` more bytes for the device (the card less
 * what is held outside PyTorch). */
static int card_has(const mvz_whatif *w, int slot, uint64_t size, uint64_t outside)
{
    uint64_t r = w->reserved[slot];
    return w->s.card == UINT64_MAX || (r + size + outside <= w->s.card && r + size + outside >= r);
}

/* Whether a new segment of `size` may be had: the fraction, then the card. */
static int room_for(const mvz_whatif *w, int slot, uint64_t size, uint64_t outside)
{
    return fraction_has(w, slot, size) && card_has(w, slot, size, outside);
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
            w->spans[i] = (mvz_whatif_va_hole){w->hint, w->hint + size};
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
    w->g[s] = (wseg){base, expandable ? 0 : size, stream, NONE, (uint8_t)slot, (uint8_t)small,
                     (uint8_t)expandable, 1, (uint8_t)at_recorded};
    wblock *x = &w->b[id];
    x->addr = base;
    x->size = expandable ? EXPANDABLE_SPAN : size;
    x->stream = stream;
    x->seg = s;
    x->slot = (uint8_t)slot;
    x->small = (uint8_t)small;
    if (expandable) { /* address space only: memory is mapped into it as needed (map_block) */
        x->unmapped = 1;
        if (unm_insert(w, id))
            return NONE;
        return id;
    }
    w->reserved[slot] += size;
    w->r[slot].mallocs++;
    return id;
}

/* Whether src, dst's neighbour, merges with it (PyTorch's try_merge_blocks:
 * free, and mapped as dst is). */
static int mergeable(const mvz_whatif *w, int32_t dst, int32_t src)
{
    return src != NONE && !w->b[src].allocated && w->b[src].unmapped == w->b[dst].unmapped;
}

static int32_t merge(mvz_whatif *w, int32_t dst, int32_t src)
{
    /* src is dst's free neighbour (either side): one block remains, at the
     * lower address; src leaves its pool or the unmapped set (dst is in neither) */
    wblock *a = &w->b[dst], *b = &w->b[src];
    if (b->in_pool)
        pool_remove(w, pool_of(w, b), src);
    if (b->unmapped)
        unm_remove(w, src);
    int32_t lo = a->addr < b->addr ? dst : src, hi = lo == dst ? src : dst;
    wblock *l = &w->b[lo], *h = &w->b[hi];
    l->size += h->size;
    l->next = h->next;
    if (h->next != NONE)
        w->b[h->next].prev = lo;
    l->allocated = 0;
    l->stream = a->stream;
    l->unmapped = a->unmapped;
    block_drop(w, hi);
    return lo;
}

/* ---- expandable segments (PyTorch's ExpandableSegment) ------------------------ */

/* map_block: memory behind the first `size` bytes of unmapped block `id`,
 * in whole granules from its start; the rest stays unmapped after it. The
 * mapped block merges with its free mapped neighbours and joins the pool.
 * Its id (merging may change it), or NONE when the card has no room. */
static int32_t map_block(mvz_whatif *w, int32_t id, uint64_t size, uint64_t outside, int force)
{
    wblock *x = &w->b[id];
    int slot = x->slot;
    uint64_t granule = x->small ? MVZ_SMALL_BUFFER : MVZ_LARGE_BUFFER;
    uint64_t mapped = (size + granule - 1) / granule * granule;
    if (mapped > x->size)
        mapped = x->size;
    if (!force && !card_has(w, slot, mapped, outside))
        return NONE;
    unm_remove(w, id);
    x->unmapped = 0;
    if (mapped < x->size) {
        int32_t rest = block_new(w);
        if (rest == NONE) {
            w->failed = 1;
            return NONE;
        }
        x = &w->b[id];
        wblock *y = &w->b[rest];
        *y = *x;
        y->addr = x->addr + mapped;
        y->size = x->size - mapped;
        y->unmapped = 1;
        y->in_pool = 0;
        y->prev = id;
        if (x->next != NONE)
            w->b[x->next].prev = rest;
        x->next = rest;
        x->size = mapped;
        if (unm_insert(w, rest))
            return NONE;
    }
    w->g[x->seg].size += mapped;
    w->reserved[slot] += mapped;
    w->r[slot].mallocs++;
    if (mergeable(w, id, w->b[id].prev))
        id = merge(w, id, w->b[id].prev);
    if (mergeable(w, id, w->b[id].next))
        id = merge(w, id, w->b[id].next);
    if (pool_insert(w, pool_of(w, &w->b[id]), id))
        return NONE;
    return id;
}

/* find_expandable_block: of the stream's unmapped blocks, lowest address
 * first, the first (or the free block just before it) from which free and
 * unmapped blocks run for `size` bytes; else a new expandable segment. */
static int32_t find_expandable(mvz_whatif *w, int slot, int small, uint64_t stream, uint64_t size)
{
    wpool *p = &w->pools[slot][small];
    for (size_t i = unm_find(w, p, stream, 0); i < p->nunm && w->b[p->unm[i]].stream == stream; i++) {
        int32_t c = p->unm[i];
        if (w->b[c].prev != NONE && !w->b[w->b[c].prev].allocated)
            c = w->b[c].prev;
        uint64_t bytes = 0;
        for (int32_t k = c; bytes < size && k != NONE && !w->b[k].allocated; k = w->b[k].next)
            bytes += w->b[k].size;
        if (bytes >= size)
            return c;
    }
    return segment_new(w, slot, small, stream, 0, 1);
}

/* try_allocate_expandable_block: map what the request needs, from the block
 * found, and take the block out of the pool. NONE: no room. */
static int32_t alloc_expandable(mvz_whatif *w, int slot, int small, uint64_t stream, uint64_t rounded,
                                uint64_t outside, int force)
{
    int32_t c = find_expandable(w, slot, small, stream, rounded);
    if (c == NONE)
        return NONE;
    if (w->b[c].unmapped) {
        uint64_t n = w->b[c].size < rounded ? w->b[c].size : rounded;
        if ((c = map_block(w, c, n, outside, force)) == NONE)
            return NONE;
    }
    while (w->b[c].size < rounded) { /* free, then unmapped after it: map some and merge */
        int32_t next = w->b[c].next;
        if (next == NONE || !w->b[next].unmapped)
            return NONE; /* not reached: find_expandable saw the room */
        uint64_t remaining = rounded - w->b[c].size;
        uint64_t n = w->b[next].size < remaining ? w->b[next].size : remaining;
        if ((c = map_block(w, next, n, outside, force)) == NONE)
            return NONE;
    }
    pool_remove(w, pool_of(w, &w->b[c]), c);
    return c;
}

/* alloc_block: a new segment (or, with expandable segments, memory mapped)
 * for a request, if the driver has room. The fraction is checked against
 * the segment the request would get, as PyTorch checks it before either. */
static int32_t alloc_block(mvz_whatif *w, int slot, int small, uint64_t stream, uint64_t rounded, uint64_t outside,
                           int force)
{
    uint64_t size = mvz_blocks_rules_segment(rounded);
    if (w->s.rules.expandable && rounded <= EXPANDABLE_SPAN) {
        if (!force && !fraction_has(w, slot, size))
            return NONE;
        return alloc_expandable(w, slot, small, stream, rounded, outside, force);
    }
    /* (a request no expandable segment could hold is refused by the card; past the
     * refusal, the model goes on with a segment of its own) */
    if (w->s.rules.expandable && !force)
        return NONE;
    if (!force && !room_for(w, slot, size, outside))
        return NONE;
    return segment_new(w, slot, small, stream, size, 0);
}

/* A free block's size for best fit under expandable segments: what it
 * could grow to, with the unmapped block after it. */
static uint64_t grow_size(const mvz_whatif *w, int32_t id)
{
    const wblock *x = &w->b[id];
    return x->size + (x->next != NONE && w->b[x->next].unmapped ? w->b[x->next].size : 0);
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

/* unmap_block: the whole granules inside free block `id` of an expandable
 * segment lose their memory; what is left on either side stays free and
 * mapped. The unmapped part merges with unmapped neighbours; a segment left
 * wholly unmapped goes (release_expandable_segment). */
static void unmap_block(mvz_whatif *w, int32_t id)
{
    wblock *x = &w->b[id];
    wseg *g = &w->g[x->seg];
    uint64_t granule = g->small ? MVZ_SMALL_BUFFER : MVZ_LARGE_BUFFER;
    uint64_t off = x->addr - g->base, end = off + x->size;
    uint64_t lo = (off + granule - 1) / granule * granule, hi = end / granule * granule;
    if (lo >= hi)
        return;
    pool_remove(w, pool_of(w, x), id);
    for (int side = 0; side < 2; side++) {
        uint64_t n = side == 0 ? lo - off : end - hi;
        if (!n)
            continue;
        int32_t k = block_new(w);
        if (k == NONE) {
            w->failed = 1;
            return;
        }
        x = &w->b[id];
        wblock *y = &w->b[k];
        *y = *x;
        y->in_pool = 0;
        y->size = n;
        if (side == 0) { /* before it */
            y->next = id;
            if (x->prev != NONE)
                w->b[x->prev].next = k;
            x->prev = k;
        } else {
            y->addr = g->base + hi;
            y->prev = id;
            if (x->next != NONE)
                w->b[x->next].prev = k;
            x->next = k;
        }
        if (pool_insert(w, pool_of(w, y), k))
            return;
    }
    x = &w->b[id];
    x->addr = g->base + lo;
    x->size = hi - lo;
    x->unmapped = 1;
    g->size -= hi - lo;
    w->reserved[x->slot] -= hi - lo;
    if (mergeable(w, id, x->prev))
        id = merge(w, id, w->b[id].prev);
    if (mergeable(w, id, w->b[id].next))
        id = merge(w, id, w->b[id].next);
    x = &w->b[id];
    if (whole(x)) {
        segment_drop(w, x->seg);
        block_drop(w, id);
        return;
    }
    unm_insert(w, id);
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
                unmap_block(w, id);
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
    uint64_t rounded = mvz_blocks_rules_round(&w->s.rules, requested);
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
    if (mvz_blocks_rules_split(&w->s.rules, rounded, x->size)) {
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

/* Without the GIL: touches only w (one worker's at a time). */
void mvz_whatif_release(mvz_whatif *w, uint32_t handle)
{
    int32_t id = handle_take(w, handle);
    if (id == NONE)
        return;
    wblock *x = &w->b[id];
    w->allocated[x->slot] -= x->size;
    x->allocated = 0;
    if (mergeable(w, id, x->prev))
        id = merge(w, id, x->prev);
    x = &w->b[id];
    if (mergeable(w, id, x->next))
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
    return w;
}

void mvz_whatif_free(mvz_whatif *w)
{
    if (!w)
        return;
    for (int i = 0; i < MVZ_NSLOTS; i++)
        for (int k = 0; k < 2; k++) {
            mvz_whatif_pool_free(&w->pools[i][k].free);
            free(w->pools[i][k].unm);
        }
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


int mvz_whatif_failed(const mvz_whatif *w) { return w->failed != 0; }
