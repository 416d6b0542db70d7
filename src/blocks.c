/* PyTorch's caching allocator, as rules (blocks.h). The table's functions
 * run with the store lock held by their caller (store.c), on the capture
 * path too (no GIL): probes and writes in the reserved regions, no malloc,
 * no lock of their own. Calls region.c only. */
#include "blocks.h"
#include "record.h"

#include <string.h>

#define INITIAL_CAP 1024
#define MAX_CAP ((size_t)1 << 24)
#define MIB_SHIFT 20
/* A boundary is kept tagged: a segment's end has its low bit set, a block's
 * start not (addresses are 512-byte aligned), so that a block starting
 * where the previous segment ends (the driver often places segments side by
 * side) and that end are two entries, each dropped on its own. */
#define END_TAG 1u
#define VALUE(at) ((at) & ~(uint64_t)END_TAG)

void mvz_blocks_rules_default(mvz_rules *r)
{
    memset(r, 0, sizeof *r);
    r->max_split = UINT64_MAX;
}

static inline int log2_floor(uint64_t v) { return 63 - __builtin_clzll(v); }

/* roundup_power2_next_division: the next of `divisions` equal steps between
 * two powers of two. */
static uint64_t next_division(uint64_t size, uint64_t divisions)
{
    if ((size & (size - 1)) == 0)
        return size;
    uint64_t floor2 = (uint64_t)1 << log2_floor(size);
    uint64_t step = floor2 >> log2_floor(divisions);
    if (step == 0)
        return floor2 << 1;
    uint64_t down = size & ~(step - 1);
    return down == size ? size : down + step;
}

uint64_t mvz_blocks_rules_round(const mvz_rules *r, uint64_t n)
{
    if (n < MVZ_MIN_BLOCK)
        return MVZ_MIN_BLOCK;
    int lg = log2_floor(n), start = log2_floor(MVZ_SMALL_SIZE);
    int index = lg > start ? lg - start : 0;
    if (index > MVZ_DIVISION_INTERVALS - 1)
        index = MVZ_DIVISION_INTERVALS - 1;
    uint64_t div = r->divisions[index];
    if (div > 1 && n > MVZ_MIN_BLOCK * div)
        return next_division(n, div);
    return (n + MVZ_MIN_BLOCK - 1) / MVZ_MIN_BLOCK * MVZ_MIN_BLOCK;
}

uint64_t mvz_blocks_rules_segment(uint64_t rounded)
{
    if (rounded <= MVZ_SMALL_SIZE)
        return MVZ_SMALL_BUFFER;
    if (rounded < MVZ_MIN_LARGE_ALLOC)
        return MVZ_LARGE_BUFFER;
    return (rounded + MVZ_ROUND_LARGE - 1) / MVZ_ROUND_LARGE * MVZ_ROUND_LARGE;
}

int mvz_blocks_rules_split(const mvz_rules *r, uint64_t rounded, uint64_t block)
{
    uint64_t remaining = block - rounded;
    if (rounded <= MVZ_SMALL_SIZE || r->expandable)
        return remaining >= MVZ_MIN_BLOCK;
    return rounded < r->max_split && remaining > MVZ_SMALL_SIZE;
}

/* ---- the boundary table ------------------------------------------------------------ */

static inline uint64_t key_of(int slot, uint64_t address)
{
    return ((uint64_t)(unsigned)slot << 44 | address >> MIB_SHIFT) + 1;
}

static inline size_t home(uint64_t key, size_t cap)
{
    key *= 0x9E3779B97F4A7C15ULL;
    return (size_t)(key >> 17) & (cap - 1);
}

int mvz_blocks_init(mvz_blocks *b)
{
    memset(b, 0, sizeof *b);
    mvz_blocks_rules_default(&b->rules);
    if (mvz_region_reserve(&b->a, MAX_CAP * sizeof(mvz_bucket), INITIAL_CAP * sizeof(mvz_bucket)) ||
        mvz_region_reserve(&b->b, MAX_CAP * sizeof(mvz_bucket), 0))
        return -1;
    b->in_a = 1;
    b->cap = INITIAL_CAP;
    mvz_region_ensure(&b->a, b->cap * sizeof(mvz_bucket));
    b->table = (mvz_bucket *)b->a.base;
    return 0;
}

void mvz_blocks_reset(mvz_blocks *b)
{
    if (!b->table)
        return;
    memset(b->table, 0, b->cap * sizeof(mvz_bucket));
    b->n = 0;
    memset(b->inexact, 0, sizeof b->inexact);
}

/* The bucket of `key`, or the empty one where it would go (*found 0). */
static size_t find(const mvz_blocks *b, uint64_t key, int *found)
{
    size_t mask = b->cap - 1, i = home(key, b->cap);
    for (;;) {
        if (b->table[i].key == key) {
            *found = 1;
            return i;
        }
        if (b->table[i].key == 0) {
            *found = 0;
            return i;
        }
        i = (i + 1) & mask;
    }
}

/* Twice the room, in the other region: a rehash in reserved memory. */
static int grow(mvz_blocks *b)
{
    size_t ncap = b->cap * 2;
    if (ncap > MAX_CAP)
        return -1;
    mvz_region *dst = b->in_a ? &b->b : &b->a, *src = b->in_a ? &b->a : &b->b;
    if (mvz_region_ensure(dst, ncap * sizeof(mvz_bucket)))
        return -1;
    mvz_bucket *nt = (mvz_bucket *)dst->base;
    memset(nt, 0, ncap * sizeof(mvz_bucket));
    for (size_t k = 0; k < b->cap; k++) {
        if (!b->table[k].key)
            continue;
        size_t i = home(b->table[k].key, ncap);
        while (nt[i].key)
            i = (i + 1) & (ncap - 1);
        nt[i] = b->table[k];
    }
    mvz_region_discard(src);
    b->table = nt;
    b->cap = ncap;
    b->in_a = !b->in_a;
    return 0;
}

/* Capture path, no GIL, store lock held: a probe, and at most one rehash
 * into the other reserved region (grow); no malloc. */
static void add(mvz_blocks *b, int slot, uint64_t at)
{
    uint64_t key = key_of(slot, VALUE(at));
    int found;
    size_t i = find(b, key, &found);
    if (!found) {
        if (2 * (b->n + 1) > b->cap) {
            if (grow(b)) {
                b->inexact[slot] = 1;
                return;
            }
            i = find(b, key, &found);
        }
        b->table[i].key = key;
        memset(b->table[i].at, 0, sizeof b->table[i].at);
        b->n++;
    }
    for (int j = 0; j < 3; j++)
        if (b->table[i].at[j] == at)
            return; /* there already (a drop may have left a hole before it) */
    for (int j = 0; j < 3; j++)
        if (b->table[i].at[j] == 0) {
            b->table[i].at[j] = at;
            return;
        }
    b->inexact[slot] = 1; /* more boundaries in one MiB than PyTorch's pools make */
}

/* Removal with backward shifting (no tombstones). Capture path, no GIL,
 * store lock held: writes in the reserved table only. */
static void drop(mvz_blocks *b, int slot, uint64_t at)
{
    uint64_t key = key_of(slot, VALUE(at));
    int found;
    size_t i = find(b, key, &found);
    if (!found)
        return;
    mvz_bucket *e = &b->table[i];
    int left = 0;
    for (int j = 0; j < 3; j++) {
        if (e->at[j] == at)
            e->at[j] = 0;
        left |= e->at[j] != 0;
    }
    if (left)
        return;
    size_t mask = b->cap - 1, hole = i;
    b->table[hole].key = 0;
    b->n--;
    for (size_t j = (hole + 1) & mask; b->table[j].key; j = (j + 1) & mask) {
        size_t h = home(b->table[j].key, b->cap);
        /* j's entry may move into the hole if its home is not in (hole, j]. */
        if ((j > hole && (h <= hole || h > j)) || (j < hole && h <= hole && h > j)) {
            b->table[hole] = b->table[j];
            b->table[j].key = 0;
            hole = j;
        }
    }
}

/* The lowest boundary of `slot` in [lo, hi], or 0. Capture path, no GIL,
 * store lock held: reads only. */
static uint64_t first_in(const mvz_blocks *b, int slot, uint64_t lo, uint64_t hi)
{
    uint64_t best = 0;
    for (uint64_t mib = lo >> MIB_SHIFT; mib <= hi >> MIB_SHIFT; mib++) {
        int found;
        size_t i = find(b, key_of(slot, mib << MIB_SHIFT), &found);
        if (found)
            for (int j = 0; j < 3; j++) {
                uint64_t at = VALUE(b->table[i].at[j]);
                if (b->table[i].at[j] && at >= lo && at <= hi && (!best || at < best))
                    best = at;
            }
        if (best)
            return best;
    }
    return 0;
}

/* Capture path, no GIL, store lock held: one add or drop in the reserved table. */
void mvz_blocks_segment(mvz_blocks *b, int slot, uint64_t base, uint64_t size, int made)
{
    if (size < MVZ_SMALL_BUFFER || slot < 0 || slot >= MVZ_NSLOTS)
        return; /* too small to hold PyTorch's blocks */
    if (made)
        add(b, slot, (base + size) | END_TAG);
    else
        drop(b, slot, (base + size) | END_TAG);
}

void mvz_blocks_inexact(mvz_blocks *b, int slot)
{
    if (slot >= 0 && slot < MVZ_NSLOTS)
        b->inexact[slot] = 1;
}

/* Capture path, no GIL, store lock held: arithmetic, a few probes of the
 * reserved table (two for most large blocks; one per MiB of the block to
 * find stale starts, at most 256) and one add; no allocation, no call out. */
uint64_t mvz_blocks_alloc(mvz_blocks *b, int slot, uint64_t address, uint64_t requested,
                          uint8_t *flags)
{
    uint64_t rounded = mvz_blocks_rules_round(&b->rules, requested);
    if (slot < 0 || slot >= MVZ_NSLOTS)
        return rounded;
    if (b->inexact[slot] || b->rules.expandable)
        *flags |= MVZ_FLAG_ESTIMATED;
    if (rounded <= MVZ_SMALL_SIZE)
        return rounded; /* the remainder, a multiple of 512, is split off unless it is 0 */
    uint64_t end = address + rounded, size = rounded;
    b->nstale = 0;
    for (uint64_t mib = address >> MIB_SHIFT, n = 0; mib <= (end - 1) >> MIB_SHIFT && n < 256;
         mib++, n++) {
        int found;
        size_t i = find(b, key_of(slot, mib << MIB_SHIFT), &found);
        for (int j = 0; found && j < 3; j++) {
            uint64_t at = b->table[i].at[j];
            if (!(at & END_TAG) && at > address && at < end) { /* inside the new block: gone unseen */
                if (b->nstale < 8)
                    b->stale[b->nstale++] = at;
                drop(b, slot, at);
                i = find(b, key_of(slot, mib << MIB_SHIFT), &found);
                j = -1; /* the bucket may have moved or emptied: look again */
            }
        }
    }
    if (rounded >= b->rules.max_split) {
        /* Never split: the whole free run, to the next boundary (a block of
         * max_split_size or more is at most 20 MiB above the request). */
        uint64_t next = first_in(b, slot, end, end + MVZ_LARGE_BUFFER);
        if (next)
            size = next - address;
        else
            *flags |= MVZ_FLAG_ESTIMATED;
    } else {
        uint64_t next = first_in(b, slot, end, end + MVZ_SMALL_SIZE);
        if (next && !mvz_blocks_rules_split(&b->rules, rounded, next - address))
            size = next - address;
    }
    add(b, slot, address);
    return size;
}

void mvz_blocks_known(mvz_blocks *b, int slot, uint64_t address, uint64_t size)
{
    if (size > MVZ_SMALL_SIZE && slot >= 0 && slot < MVZ_NSLOTS)
        add(b, slot, address);
}

/* Capture path, no GIL, store lock held: one drop in the reserved table. */
void mvz_blocks_free(mvz_blocks *b, int slot, uint64_t address, uint64_t size)
{
    if (size > MVZ_SMALL_SIZE && slot >= 0 && slot < MVZ_NSLOTS)
        drop(b, slot, address);
}
