/* The store's stack table (stacks.h). Every function runs with the store
 * lock held by its caller (store.c) and touches only the mvz_stacks it is
 * given, in preallocated regions; it calls region.c and nothing else. */
#include "stacks.h"
#include "hash.h"

#include <string.h>

int mvz_stacks_init(mvz_stacks *s, size_t max_stacks, size_t max_frames)
{
    s->max = max_stacks;
    s->max_frames = max_frames;
    size_t scap = 1024;
    while (scap < 2 * max_stacks)
        scap <<= 1;
    if (mvz_region_reserve(&s->stacks_r, max_stacks * sizeof(mvz_stack), 1 << 16) ||
        mvz_region_reserve(&s->frames_r, max_frames * sizeof(mvz_frame), 1 << 18) ||
        mvz_region_reserve(&s->index_r, scap * sizeof(uint32_t), 1 << 16) ||
        mvz_region_reserve(&s->pending_r, max_stacks * sizeof(uint32_t), 1 << 14))
        return -1;
    s->stacks = (mvz_stack *)s->stacks_r.base;
    s->frames = (mvz_frame *)s->frames_r.base;
    s->index = (uint32_t *)s->index_r.base;
    s->pending = (uint32_t *)s->pending_r.base;
    s->index_cap = 1024;
    mvz_region_ensure(&s->index_r, s->index_cap * sizeof(uint32_t));
    /* Stack 0 is the empty stack: allocations made with no Python frames. */
    MVZ_SET_PEEKED(s->n, 1); /* n and npending: peeked by the store's readers */
    memset(&s->stacks[0], 0, sizeof s->stacks[0]);
    s->stacks[0].adopted = 1;
    mvz_region_ensure(&s->stacks_r, sizeof(mvz_stack));
    return 0;
}

size_t mvz_stacks_refs(const mvz_stacks *s, void **out)
{
    size_t n = 0;
    for (size_t id = 1; id < s->n; id++) {
        const mvz_stack *st = &s->stacks[id];
        for (uint32_t f = 0; f < st->depth; f++) {
            const mvz_frame *fr = &s->frames[st->first_frame + f];
            /* resolved tuples are owned even when pending */
            if (st->adopted || (fr->flags & MVZ_FRAME_RESOLVED)) {
                if (out)
                    out[n] = fr->code;
                n++;
            }
        }
    }
    return n;
}

void mvz_stacks_reset(mvz_stacks *s)
{
    MVZ_SET_PEEKED(s->n, 1); /* n and npending: peeked by the store's readers */
    memset(&s->stacks[0], 0, sizeof s->stacks[0]);
    s->stacks[0].adopted = 1;
    s->nframes = 0;
    MVZ_SET_PEEKED(s->npending, 0);
    s->dropped = 0;
    memset(s->index, 0, s->index_cap * sizeof(uint32_t));
    mvz_region_discard(&s->frames_r);
}

/* Capture path, no GIL, no lock: reads only the frames it is given (the
 * caller's own array). Four independent multiply-xorshift chains, frame i
 * feeding chain i % 4, joined by one full mix: a chain's multiply latency,
 * not the number of multiplies, bounds the time, so a 32-frame stack costs 8
 * dependent steps instead of 32 (about 60 ns down to 15 on the machines
 * measured; benchmarks/RESULTS.md, issue 27). Order is kept: a frame's
 * chain and its place in that chain both count. */
uint64_t mvz_stacks_hash(const mvz_frame *f, int depth)
{
#define MVZ_HASH_STEP(h, fr)                                                                   \
    do {                                                                                    \
        uint64_t w_ = (uint64_t)(uintptr_t)(fr).code ^ ((uint64_t)(uint32_t)(fr).offset << 40); \
        h = (h ^ w_) * 0x9e3779b97f4a7c15ULL;                                               \
        h ^= h >> 29;                                                                       \
    } while (0)
    uint64_t h0 = 0x84222325cbf29ce4ULL ^ (uint64_t)depth, h1 = 0x243f6a8885a308d3ULL,
             h2 = 0x13198a2e03707344ULL, h3 = 0xa4093822299f31d0ULL;
    int i = 0;
    for (; i + 4 <= depth; i += 4) {
        MVZ_HASH_STEP(h0, f[i]);
        MVZ_HASH_STEP(h1, f[i + 1]);
        MVZ_HASH_STEP(h2, f[i + 2]);
        MVZ_HASH_STEP(h3, f[i + 3]);
    }
    for (; i < depth; i++)
        MVZ_HASH_STEP(h0, f[i]);
#undef MVZ_HASH_STEP
    /* rotated apart, so that chains holding the same frames do not cancel */
    h1 = h1 << 17 | h1 >> 47;
    h2 = h2 << 31 | h2 >> 33;
    h3 = h3 << 47 | h3 >> 17;
    return mvz_mix64(h0 ^ h1 ^ h2 ^ h3);
}

static int stack_eq(const mvz_stacks *s, const mvz_stack *st, uint64_t h, const mvz_frame *f,
                    int depth)
{
    if (st->hash != h || st->depth != depth)
        return 0;
    const mvz_frame *g = &s->frames[st->first_frame];
    for (int i = 0; i < depth; i++)
        if (g[i].code != f[i].code || g[i].offset != f[i].offset)
            return 0;
    return 1;
}

/* Capture path, no GIL, store lock held: rehash into the region's
 * preallocated room. */
static int index_grow(mvz_stacks *s)
{
    size_t ncap = s->index_cap * 2;
    if (mvz_region_ensure(&s->index_r, ncap * sizeof(uint32_t)))
        return -1;
    memset(s->index, 0, ncap * sizeof(uint32_t));
    s->index_cap = ncap;
    for (uint32_t id = 1; id < s->n; id++) {
        size_t i = s->stacks[id].hash & (ncap - 1);
        while (s->index[i])
            i = (i + 1) & (ncap - 1);
        s->index[i] = id + 1;
    }
    return 0;
}

/* Capture path, no GIL, store lock held: as mvz_stacks_intern_hashed. */
uint32_t mvz_stacks_intern(mvz_stacks *s, const mvz_frame *f, int depth)
{
    return depth <= 0 ? 0 : mvz_stacks_intern_hashed(s, f, depth, mvz_stacks_hash(f, depth));
}

/* Capture path, no GIL, store lock held: a probe sequence in a table kept at
 * most half full and copies into preallocated regions; no allocation. h is
 * mvz_stacks_hash(f, depth), computed by the caller before it took the lock. */
uint32_t mvz_stacks_intern_hashed(mvz_stacks *s, const mvz_frame *f, int depth, uint64_t h)
{
    if (depth <= 0)
        return 0;
    size_t mask = s->index_cap - 1;
    size_t i = h & mask;
    for (; s->index[i]; i = (i + 1) & mask) {
        uint32_t id = s->index[i] - 1;
        if (stack_eq(s, &s->stacks[id], h, f, depth))
            return id;
    }
    if (s->n >= s->max || s->nframes + (size_t)depth > s->max_frames ||
        mvz_region_ensure(&s->frames_r, (s->nframes + depth) * sizeof(mvz_frame)) ||
        mvz_region_ensure(&s->stacks_r, (s->n + 1) * sizeof(mvz_stack))) {
        s->dropped++;
        return 0;
    }
    if (2 * (s->n + 1) > s->index_cap) {
        if (index_grow(s)) {
            s->dropped++;
            return 0;
        }
        mask = s->index_cap - 1;
        for (i = h & mask; s->index[i]; i = (i + 1) & mask)
            ;
    }
    uint32_t id = (uint32_t)s->n;
    MVZ_SET_PEEKED(s->n, s->n + 1);
    mvz_stack *st = &s->stacks[id];
    memset(st, 0, sizeof *st);
    st->hash = h;
    st->depth = (uint16_t)depth;
    st->first_frame = (uint32_t)s->nframes;
    memcpy(&s->frames[s->nframes], f, (size_t)depth * sizeof(mvz_frame));
    for (int k = 0; k < depth; k++) /* a frame given resolved (seeded) stays so; no other mark */
        s->frames[s->nframes + k].flags &= MVZ_FRAME_RESOLVED;
    s->nframes += (size_t)depth;
    s->index[i] = id + 1;
    mvz_region_ensure(&s->pending_r, (s->npending + 1) * sizeof(uint32_t));
    s->pending[s->npending] = id;
    MVZ_SET_PEEKED(s->npending, s->npending + 1);
    return id;
}

void mvz_stacks_adopt_pending(mvz_stacks *s, void (*adopt)(void *code))
{
    for (size_t p = 0; p < s->npending; p++) {
        mvz_stack *st = &s->stacks[s->pending[p]];
        for (uint32_t f = 0; f < st->depth; f++) {
            mvz_frame *fr = &s->frames[st->first_frame + f];
            /* A DYING frame is being resolved by the death event (which may
             * run Python, and so this, meanwhile): its code object must not
             * be referenced, and only the resolver clears the mark. */
            if (!(fr->flags & (MVZ_FRAME_DYING | MVZ_FRAME_RESOLVED)))
                adopt(fr->code);
        }
        st->adopted = 1;
    }
    MVZ_SET_PEEKED(s->npending, 0);
}

size_t mvz_stacks_mark_dying(mvz_stacks *s, void *code)
{
    size_t n = 0;
    for (size_t p = 0; p < s->npending; p++) {
        mvz_stack *st = &s->stacks[s->pending[p]];
        for (uint32_t f = 0; f < st->depth; f++) {
            mvz_frame *fr = &s->frames[st->first_frame + f];
            if (fr->code == code && !(fr->flags & MVZ_FRAME_RESOLVED)) {
                fr->flags |= MVZ_FRAME_DYING;
                n++;
            }
        }
    }
    return n;
}

mvz_frame *mvz_stacks_find_dying(mvz_stacks *s, void *code)
{
    for (size_t id = 1; id < s->n; id++) {
        mvz_stack *st = &s->stacks[id];
        for (uint32_t f = 0; f < st->depth; f++) {
            mvz_frame *fr = &s->frames[st->first_frame + f];
            if (fr->code == code && (fr->flags & MVZ_FRAME_DYING))
                return fr;
        }
    }
    return NULL;
}

int mvz_stacks_frames(const mvz_stacks *s, uint32_t id, mvz_frame *out, int cap)
{
    if (id >= s->n)
        return -1;
    int depth = s->stacks[id].depth;
    if (depth > cap)
        depth = cap;
    memcpy(out, &s->frames[s->stacks[id].first_frame], (size_t)depth * sizeof(mvz_frame));
    return depth;
}

size_t mvz_stacks_sites(const mvz_stacks *s, mvz_site *out)
{
    size_t m = 0;
    for (size_t id = 0; id < s->n; id++) {
        const mvz_stack *st = &s->stacks[id];
        if (!st->alloc_count)
            continue;
        out[m].stack_id = (uint32_t)id;
        out[m].live_count = st->live_count;
        out[m].live_bytes = st->live_bytes;
        out[m].peak_bytes = st->peak_bytes;
        out[m].alloc_count = st->alloc_count;
        out[m].alloc_bytes = st->alloc_bytes;
        m++;
    }
    return m;
}

size_t mvz_stacks_step_changes(mvz_stacks *s, mvz_site_change *out)
{
    size_t m = 0;
    for (size_t id = 0; id < s->n; id++) {
        mvz_stack *st = &s->stacks[id];
        if (st->live_bytes == st->mark_bytes && st->live_count == st->mark_count &&
            st->block_bytes == st->block_mark)
            continue;
        out[m].stack_id = (uint32_t)id;
        out[m].live_count = st->live_count;
        out[m].live_bytes = st->live_bytes;
        out[m].delta_bytes = (int64_t)st->live_bytes - (int64_t)st->mark_bytes;
        out[m].delta_count = (int64_t)st->live_count - (int64_t)st->mark_count;
        out[m].block_bytes = st->block_bytes;
        out[m].block_delta = (int64_t)st->block_bytes - (int64_t)st->block_mark;
        st->mark_bytes = st->live_bytes;
        st->mark_count = st->live_count;
        st->block_mark = st->block_bytes;
        m++;
    }
    return m;
}

size_t mvz_stacks_bytes_used(const mvz_stacks *s)
{
    return s->n * sizeof(mvz_stack) + s->nframes * sizeof(mvz_frame) +
           s->index_cap * sizeof(uint32_t) + s->npending * sizeof(uint32_t);
}

size_t mvz_stacks_bytes_reserved(const mvz_stacks *s)
{
    return s->stacks_r.reserved + s->frames_r.reserved + s->index_r.reserved +
           s->pending_r.reserved;
}
