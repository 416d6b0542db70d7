/* PyTorch's caching allocator, as rules: the size of the block it hands
 * out for a request, from what memviz already records.
 *
 * PyTorch's native allocator (c10/cuda/CUDACachingAllocator.cpp) rounds a
 * request (to 512 bytes, or to a power-of-two division), takes a free block
 * of the small pool (requests up to 1 MiB, in 2 MiB segments) or the large
 * pool, and splits it only when the remainder is worth keeping: at least
 * 512 bytes in the small pool; more than 1 MiB in the large pool, and never
 * a block of max_split_size or more (with expandable segments, 512 bytes
 * for both). Free blocks are always merged with free neighbours, so the
 * free block a request lands on runs from its address to the next block
 * still allocated, or to the end of its segment. memviz sees the address
 * PyTorch chose, the request, the segments and every block; so a block's
 * size is:
 *   - the rounded request, when the remainder would be split off;
 *   - else the whole free run: up to the next boundary (a large block's
 *     start or a segment's end).
 * A small block is always its rounded request (the run's remainder is a
 * multiple of 512 bytes, so it is split unless it is 0). A large block needs
 * only the boundaries within 1 MiB past its rounded end, so the boundaries
 * are kept in a hash by MiB (large blocks are over 1 MiB apart, segments at
 * least 2 MiB long: a bucket holds at most a start and an end).
 *
 * Where the rules cannot be followed (expandable segments map and unmap
 * pages; a bucket overflowed), the block is flagged MVZ_FLAG_ESTIMATED.
 * Frees that wait on another stream's events (recordStream) are taken as
 * done at once, as are blocks freed in a CUDA graph's private pool.
 *
 * mvz_blocks_rules_* are pure functions of the settings, shared with any replay of
 * a recording under other settings. The table (mvz_blocks) is the store's:
 * store.c calls every mvz_blocks_* function with its lock held; this file
 * takes no lock, calls region.c only and never allocates but through its
 * two reserved regions (capture path: no GIL, no malloc). */
#ifndef MEMVIZ_BLOCKS_H
#define MEMVIZ_BLOCKS_H

#include "region.h"
#include "types.h"

#include <stddef.h>
#include <stdint.h>

#define MVZ_MIN_BLOCK 512u                   /* kMinBlockSize */
#define MVZ_SMALL_SIZE (1u << 20)            /* kSmallSize: the small pool's largest request */
#define MVZ_SMALL_BUFFER (2u << 20)          /* kSmallBuffer: a small pool's segment */
#define MVZ_LARGE_BUFFER (20u << 20)         /* kLargeBuffer */
#define MVZ_MIN_LARGE_ALLOC (10u << 20)      /* kMinLargeAlloc */
#define MVZ_ROUND_LARGE (2u << 20)           /* kRoundLarge */
#define MVZ_DIVISION_INTERVALS 16            /* roundup_power2_divisions' intervals (1 MiB..64 GiB) */

/* The allocator's settings (PYTORCH_CUDA_ALLOC_CONF). */
typedef struct {
    uint64_t max_split; /* max_split_size in bytes; UINT64_MAX: not set */
    uint32_t divisions[MVZ_DIVISION_INTERVALS]; /* roundup_power2_divisions; 0, 1: none */
    int expandable;     /* expandable_segments:True */
} mvz_rules;

/* The default settings. */
void mvz_blocks_rules_default(mvz_rules *r);
/* A request of n bytes, rounded as PyTorch rounds it. */
uint64_t mvz_blocks_rules_round(const mvz_rules *r, uint64_t n);
/* The segment PyTorch asks the driver for when no free block fits. */
uint64_t mvz_blocks_rules_segment(uint64_t rounded);
/* Whether a free block of `block` bytes is split for a rounded request. */
int mvz_blocks_rules_split(const mvz_rules *r, uint64_t rounded, uint64_t block);

typedef struct {
    uint64_t key;   /* slot and MiB number, plus one (0: empty) */
    uint64_t at[3]; /* boundaries in this MiB (0: none) */
} mvz_bucket;

typedef struct {
    mvz_region a, b;    /* the table lives in one, grows into the other */
    mvz_bucket *table;
    size_t cap, n;
    int in_a;
    mvz_rules rules;
    uint8_t inexact[MVZ_NSLOTS]; /* the rules cannot be followed on this device any more */
    /* Boundaries the last mvz_blocks_alloc found inside the new block: the
     * starts of blocks freed unseen (made before tracking; their tensors
     * carried PyTorch's deleter), for the store to retire. */
    uint64_t stale[8];
    int nstale;
} mvz_blocks;

/* With the GIL, once. 0 or -1. */
int mvz_blocks_init(mvz_blocks *b);
/* Forget every boundary (the settings stay). */
void mvz_blocks_reset(mvz_blocks *b);
/* A driver allocation of `size` bytes at `base` on `slot`: one that may be a
 * segment of PyTorch's (2 MiB or more) is a boundary at its end. */
void mvz_blocks_segment(mvz_blocks *b, int slot, uint64_t base, uint64_t size, int made);
/* A physical allocation (expandable segments): blocks on `slot` can no
 * longer be sized exactly. */
void mvz_blocks_inexact(mvz_blocks *b, int slot);
/* A block at `address` for a request of `requested` bytes: the size PyTorch
 * gave it. Sets MVZ_FLAG_ESTIMATED in *flags when it cannot be exact.
 * Boundaries inside the new block (up to 256 MiB of it) are stale: they are
 * dropped and listed in b->stale. */
uint64_t mvz_blocks_alloc(mvz_blocks *b, int slot, uint64_t address, uint64_t requested,
                          uint8_t *flags);
/* A block whose size is known (read from PyTorch at attach). */
void mvz_blocks_known(mvz_blocks *b, int slot, uint64_t address, uint64_t size);
/* The block at `address` of `size` bytes went back to PyTorch. */
void mvz_blocks_free(mvz_blocks *b, int slot, uint64_t address, uint64_t size);

#endif
