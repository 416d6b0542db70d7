/* The live allocation table (livetab.h). Every function runs with the store
 * lock held by its caller (store.c), on the capture path too (no GIL):
 * probes and copies inside preallocated regions, no allocation, no lock.
 * Calls region.c only. */
#include "livetab.h"
#include "hash.h"

#include <string.h>

/* Keys: an address lives once per key space. Physical handles are not
 * addresses, and a PyTorch block may start where its segment starts. */
static inline int key_space(int kind)
{
    return kind == MVZ_KIND_PHYSICAL ? 1 : kind == MVZ_KIND_BLOCK ? 2 : 0;
}

static inline uint64_t key_hash(uint64_t address, int kind)
{
    static const uint64_t salt[3] = {0, 0x9e3779b97f4a7c15ULL, 0xc2b2ae3d27d4eb4fULL};
    return mvz_mix64(address ^ salt[key_space(kind)]);
}

static inline int key_eq(const mvz_alloc *a, uint64_t address, int kind)
{
    return a->address == address && key_space(a->kind) == key_space(kind);
}

int mvz_livetab_init(mvz_livetab *t, size_t max_live)
{
    t->max = max_live;
    /* The index holds at most half-full max_live entries. */
    size_t cap = 1024;
    while (cap < 2 * max_live)
        cap <<= 1;
    if (mvz_region_reserve(&t->allocs_r, max_live * sizeof(mvz_alloc), 1 << 20) ||
        mvz_region_reserve(&t->index_a_r, cap * sizeof(uint32_t), 1 << 16) ||
        mvz_region_reserve(&t->index_b_r, cap * sizeof(uint32_t), 0))
        return -1;
    t->allocs = (mvz_alloc *)t->allocs_r.base;
    t->index = (uint32_t *)t->index_a_r.base;
    t->index_in_a = 1;
    t->index_cap = 1024;
    mvz_region_ensure(&t->index_a_r, t->index_cap * sizeof(uint32_t));
    return 0;
}

void mvz_livetab_reset(mvz_livetab *t)
{
    MVZ_SET_PEEKED(t->count, 0);
    memset(t->index, 0, t->index_cap * sizeof(uint32_t));
    mvz_region_discard(&t->allocs_r);
    mvz_region_ensure(&t->index_a_r, t->index_in_a ? t->index_cap * 4 : 0);
}

void mvz_livetab_release(mvz_livetab *t)
{
    mvz_region_release(&t->allocs_r);
    mvz_region_release(&t->index_a_r);
    mvz_region_release(&t->index_b_r);
    memset(t, 0, sizeof *t);
}

/* Capture path, no GIL, store lock held: a probe sequence in an index kept
 * at most half full; reads only. */
size_t mvz_livetab_find(const mvz_livetab *t, uint64_t address, int kind, int *found)
{
    size_t mask = t->index_cap - 1;
    size_t i = key_hash(address, kind) & mask;
    for (; t->index[i]; i = (i + 1) & mask) {
        if (key_eq(&t->allocs[t->index[i] - 1], address, kind)) {
            *found = 1;
            return i;
        }
    }
    *found = 0;
    return i;
}

/* Capture path, no GIL, store lock held: rebuild the index at twice the
 * size in the other region (both reserved up front: no allocation). */
static int index_grow(mvz_livetab *t)
{
    size_t ncap = t->index_cap * 2;
    mvz_region *dst = t->index_in_a ? &t->index_b_r : &t->index_a_r;
    mvz_region *src = t->index_in_a ? &t->index_a_r : &t->index_b_r;
    if (mvz_region_ensure(dst, ncap * sizeof(uint32_t)))
        return -1;
    uint32_t *ni = (uint32_t *)dst->base;
    memset(ni, 0, ncap * sizeof(uint32_t));
    for (size_t k = 0; k < t->count; k++) {
        size_t i = key_hash(t->allocs[k].address, t->allocs[k].kind) & (ncap - 1);
        while (ni[i])
            i = (i + 1) & (ncap - 1);
        ni[i] = (uint32_t)k + 1;
    }
    mvz_region_discard(src);
    t->index = ni;
    t->index_cap = ncap;
    t->index_in_a = !t->index_in_a;
    return 0;
}

/* Capture path, no GIL, store lock held: arithmetic on the reservations,
 * and at most one index rebuild (index_grow). */
int mvz_livetab_make_room(mvz_livetab *t)
{
    if (t->count >= t->max || mvz_region_ensure(&t->allocs_r, (t->count + 1) * sizeof(mvz_alloc)))
        return -1;
    if (2 * (t->count + 1) > t->index_cap)
        return index_grow(t) ? -1 : 1;
    return 0;
}

/* Capture path, no GIL, store lock held: two writes into preallocated
 * memory. */
mvz_alloc *mvz_livetab_insert(mvz_livetab *t, size_t i)
{
    mvz_alloc *a = &t->allocs[t->count];
    t->index[i] = (uint32_t)t->count + 1;
    MVZ_SET_PEEKED(t->count, t->count + 1); /* peeked by the store's readers */
    return a;
}

/* Capture path, no GIL, store lock held: deletes index slot i with backward
 * shifting (no tombstones), in place. */
static void index_delete(mvz_livetab *t, size_t i)
{
    size_t mask = t->index_cap - 1;
    size_t j = i;
    t->index[i] = 0;
    for (;;) {
        j = (j + 1) & mask;
        if (!t->index[j])
            return;
        const mvz_alloc *a = &t->allocs[t->index[j] - 1];
        size_t home = key_hash(a->address, a->kind) & mask;
        /* Move j back into the hole unless its home lies cyclically in (i, j]. */
        int home_in_range = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
        if (!home_in_range) {
            t->index[i] = t->index[j];
            t->index[j] = 0;
            i = j;
        }
    }
}

/* Capture path, no GIL, store lock held: in-place moves only. */
void mvz_livetab_remove(mvz_livetab *t, size_t i)
{
    uint32_t k = t->index[i] - 1;
    index_delete(t, i);
    size_t last = t->count - 1;
    if (k != last) {
        /* Move the last entry into the hole and repoint its index slot. */
        int f2;
        size_t j = mvz_livetab_find(t, t->allocs[last].address, t->allocs[last].kind, &f2);
        t->allocs[k] = t->allocs[last];
        t->index[j] = k + 1;
    }
    MVZ_SET_PEEKED(t->count, t->count - 1);
}
