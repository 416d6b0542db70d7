/* What if: one pool's free blocks (a device's small or large pool in the
 * model of PyTorch's caching allocator, whatif.h), in PyTorch's order:
 * by stream, then size, then address (BlockComparatorSize; streams are
 * only ever compared for equality, so their order is the pool's own).
 *
 * Each stream's blocks are kept in size classes as TLSF keeps them: sizes
 * (multiples of 512 bytes: rounding keeps them so, and segments are) fall
 * in a group per power of two of size / 512 and, in it, one of 16 equal
 * steps (below 16, one class per size); each class is a small array sorted
 * by (size, address), and bitmaps say which groups, and which classes of
 * each group, hold a block. So the best fit (the first block not before a
 * size) is a search in one class or the first block of the next class that
 * holds any: two bit scans, whatever the number of free blocks. Memory:
 * the classes' arrays, and a stream's bitmaps while it has a free block
 * (one stream stays made when it empties).
 *
 * Plain C, no lock, no Python: a pool is its model's, and a model is one
 * thread's at a time (whatif_pass.c). Calls nothing but libc. */
#ifndef MEMVIZ_WHATIF_POOL_H
#define MEMVIZ_WHATIF_POOL_H

#include <stddef.h>
#include <stdint.h>

typedef struct mvz_whatif_pool_stream mvz_whatif_pool_stream;

typedef struct {
    mvz_whatif_pool_stream **s; /* the streams with free blocks */
    size_t ns, caps, last;      /* last: the stream found last */
    size_t n;                   /* free blocks */
} mvz_whatif_pool;

/* A free block: what the pool orders it by, and the caller's id for it. */
typedef struct {
    uint64_t size, addr;
    int32_t id;
} mvz_whatif_pool_entry;

/* Frees what the pool holds (it is empty and usable again after). */
void mvz_whatif_pool_free(mvz_whatif_pool *p);
/* Block `id` of (stream, size, addr) is free. 0, or -1 out of memory. */
int mvz_whatif_pool_insert(mvz_whatif_pool *p, uint64_t stream, uint64_t size, uint64_t addr, int32_t id);
/* Block `id` of (stream, size, addr) is free no more (not there: nothing). */
void mvz_whatif_pool_remove(mvz_whatif_pool *p, uint64_t stream, uint64_t size, uint64_t addr, int32_t id);
/* The stream's free block first not before (size, addr) (addr 0: before
 * every block of that size: the best fit), or last before it; NULL: none.
 * Good until the pool next changes. */
const mvz_whatif_pool_entry *mvz_whatif_pool_first_from(mvz_whatif_pool *p, uint64_t stream, uint64_t size,
                                                        uint64_t addr);
const mvz_whatif_pool_entry *mvz_whatif_pool_last_before(mvz_whatif_pool *p, uint64_t stream, uint64_t size,
                                                         uint64_t addr);
/* The ids of every free block into ids[] (room for p->n), stream by stream
 * in size order; returns how many. */
size_t mvz_whatif_pool_list(const mvz_whatif_pool *p, int32_t *ids);
/* The size of the largest free block (0: none). */
uint64_t mvz_whatif_pool_largest(const mvz_whatif_pool *p);

#endif
