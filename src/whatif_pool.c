/* What if: a pool's free blocks by size class (whatif_pool.h). No lock and
 * no GIL needed: a pool is touched only by the thread that holds its model
 * (whatif_pass.c hands each model to one worker at a time). */
#include "whatif_pool.h"

#include <stdlib.h>
#include <string.h>

#define SL_BITS 4
#define SL (1u << SL_BITS)
#define NGROUPS (64 - 9 - SL_BITS + 1)
#define NCLASSES (NGROUPS * SL)

typedef mvz_whatif_pool_entry entry;

typedef struct {
    entry *e;
    uint32_t n, cap;
} sclass;

struct mvz_whatif_pool_stream {
    uint64_t stream;
    size_t n;
    uint64_t groups;        /* bit g: group g has a class that holds a block */
    uint16_t mask[NGROUPS]; /* bit c: class c of the group holds a block */
    sclass *group[NGROUPS]; /* SL classes each, made on first use */
};
typedef mvz_whatif_pool_stream pstream;

/* A size's class: monotonic in the size, so classes in order are sizes in order. */
static unsigned class_of(uint64_t size)
{
    uint64_t s = size >> 9;
    if (s < SL)
        return (unsigned)s;
    unsigned fl = 63u - (unsigned)__builtin_clzll(s);
    return (fl - SL_BITS + 1) * SL + (unsigned)(s >> (fl - SL_BITS) & (SL - 1));
}

/* The first class from c on that holds a block (NCLASSES: none). */
static unsigned next_class(const pstream *s, unsigned c)
{
    unsigned g = c / SL;
    if (g >= NGROUPS)
        return NCLASSES;
    unsigned m = s->mask[g] & (0xFFFFu << (c % SL)) & 0xFFFFu;
    if (m)
        return g * SL + (unsigned)__builtin_ctz(m);
    uint64_t gs = s->groups & (~(uint64_t)0 << g << 1);
    if (!gs)
        return NCLASSES;
    g = (unsigned)__builtin_ctzll(gs);
    return g * SL + (unsigned)__builtin_ctz(s->mask[g]);
}

/* The last class before c that holds a block (NCLASSES: none). */
static unsigned prev_class(const pstream *s, unsigned c)
{
    if (c == 0)
        return NCLASSES;
    unsigned last = c - 1, g = last / SL;
    unsigned m = s->mask[g] & (0xFFFFu >> (SL - 1 - last % SL));
    if (m)
        return g * SL + 31u - (unsigned)__builtin_clz(m);
    uint64_t gs = s->groups & (((uint64_t)1 << g) - 1);
    if (!gs)
        return NCLASSES;
    g = 63u - (unsigned)__builtin_clzll(gs);
    return g * SL + 31u - (unsigned)__builtin_clz(s->mask[g]);
}

static sclass *class_at(const pstream *s, unsigned c)
{
    return s->group[c / SL] ? &s->group[c / SL][c % SL] : NULL;
}

/* The first entry of k not before (size, addr). */
static uint32_t class_lower(const sclass *k, uint64_t size, uint64_t addr)
{
    uint32_t lo = 0, hi = k->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        const entry *x = &k->e[mid];
        if (x->size < size || (x->size == size && x->addr < addr))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The pool's stream (made with `make`; NULL: none, or no memory). */
static pstream *stream_of(mvz_whatif_pool *p, uint64_t stream, int make)
{
    if (p->ns && p->s[p->last]->stream == stream)
        return p->s[p->last];
    for (size_t i = 0; i < p->ns; i++)
        if (p->s[i]->stream == stream) {
            p->last = i;
            return p->s[i];
        }
    if (!make)
        return NULL;
    if (p->ns == p->caps) {
        size_t cap = p->caps ? p->caps * 2 : 4;
        pstream **v = realloc(p->s, cap * sizeof *v);
        if (!v)
            return NULL;
        p->s = v;
        p->caps = cap;
    }
    pstream *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->stream = stream;
    p->last = p->ns;
    p->s[p->ns++] = s;
    return s;
}

static void stream_free(pstream *s)
{
    for (unsigned g = 0; g < NGROUPS; g++) {
        if (!s->group[g])
            continue;
        for (unsigned c = 0; c < SL; c++)
            free(s->group[g][c].e);
        free(s->group[g]);
    }
    free(s);
}

void mvz_whatif_pool_free(mvz_whatif_pool *p)
{
    for (size_t i = 0; i < p->ns; i++)
        stream_free(p->s[i]);
    free(p->s);
    memset(p, 0, sizeof *p);
}

int mvz_whatif_pool_insert(mvz_whatif_pool *p, uint64_t stream, uint64_t size, uint64_t addr, int32_t id)
{
    pstream *s = stream_of(p, stream, 1);
    unsigned c = class_of(size), g = c / SL;
    if (!s || (!s->group[g] && !(s->group[g] = calloc(SL, sizeof *s->group[g]))))
        return -1;
    sclass *k = &s->group[g][c % SL];
    if (k->n == k->cap) {
        uint32_t cap = k->cap ? k->cap * 2 : 4;
        entry *e = realloc(k->e, cap * sizeof *e);
        if (!e)
            return -1;
        k->e = e;
        k->cap = cap;
    }
    uint32_t at = class_lower(k, size, addr);
    memmove(k->e + at + 1, k->e + at, (k->n - at) * sizeof *k->e);
    k->e[at] = (entry){size, addr, id};
    k->n++;
    s->mask[g] |= (uint16_t)(1u << (c % SL));
    s->groups |= (uint64_t)1 << g;
    s->n++;
    p->n++;
    return 0;
}

void mvz_whatif_pool_remove(mvz_whatif_pool *p, uint64_t stream, uint64_t size, uint64_t addr, int32_t id)
{
    pstream *s = stream_of(p, stream, 0);
    unsigned c = class_of(size), g = c / SL;
    sclass *k = s ? class_at(s, c) : NULL;
    if (!k)
        return;
    uint32_t at = class_lower(k, size, addr);
    if (at >= k->n || k->e[at].id != id)
        return;
    memmove(k->e + at, k->e + at + 1, (k->n - at - 1) * sizeof *k->e);
    if (--k->n == 0) {
        s->mask[g] &= (uint16_t)~(1u << (c % SL));
        if (!s->mask[g])
            s->groups &= ~((uint64_t)1 << g);
    }
    p->n--;
    if (--s->n == 0 && p->ns > 1) { /* a stream of several with no free block left: forgotten */
        size_t i = p->last;
        stream_free(s);
        p->s[i] = p->s[--p->ns];
        p->last = 0;
    }
}

const mvz_whatif_pool_entry *mvz_whatif_pool_first_from(mvz_whatif_pool *p, uint64_t stream, uint64_t size,
                                                        uint64_t addr)
{
    const pstream *s = p->n ? stream_of(p, stream, 0) : NULL;
    if (!s)
        return NULL;
    unsigned c = class_of(size);
    const sclass *k = class_at(s, c);
    if (k) {
        uint32_t at = class_lower(k, size, addr);
        if (at < k->n)
            return &k->e[at];
    }
    c = next_class(s, c + 1);
    return c == NCLASSES ? NULL : &class_at(s, c)->e[0];
}

const mvz_whatif_pool_entry *mvz_whatif_pool_last_before(mvz_whatif_pool *p, uint64_t stream, uint64_t size,
                                                         uint64_t addr)
{
    const pstream *s = p->n ? stream_of(p, stream, 0) : NULL;
    if (!s)
        return NULL;
    unsigned c = class_of(size);
    const sclass *k = class_at(s, c);
    if (k) {
        uint32_t at = class_lower(k, size, addr);
        if (at > 0)
            return &k->e[at - 1];
    }
    c = prev_class(s, c);
    if (c == NCLASSES)
        return NULL;
    k = class_at(s, c);
    return &k->e[k->n - 1];
}

size_t mvz_whatif_pool_list(const mvz_whatif_pool *p, int32_t *ids)
{
    size_t n = 0;
    for (size_t i = 0; i < p->ns; i++) {
        const pstream *s = p->s[i];
        for (unsigned c = next_class(s, 0); c != NCLASSES; c = next_class(s, c + 1)) {
            const sclass *k = class_at(s, c);
            for (uint32_t j = 0; j < k->n; j++)
                ids[n++] = k->e[j].id;
        }
    }
    return n;
}

uint64_t mvz_whatif_pool_largest(const mvz_whatif_pool *p)
{
    uint64_t best = 0;
    for (size_t i = 0; i < p->ns; i++) {
        unsigned c = prev_class(p->s[i], NCLASSES);
        if (c == NCLASSES)
            continue;
        const sclass *k = class_at(p->s[i], c);
        if (k->e[k->n - 1].size > best)
            best = k->e[k->n - 1].size;
    }
    return best;
}
