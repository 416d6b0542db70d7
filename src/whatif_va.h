/* What if: where the driver puts a segment, modelled (whatif.c asks it for
 * the address of each segment the model makes once its segments are no
 * longer the recording's).
 *
 * The address matters because PyTorch's best fit breaks ties between free
 * blocks of one size by address. On the H200 (driver 580, CUDA 13), the
 * recordings show cudaMalloc placing memory top down: a request that fits
 * no hole gets a new region below all before it, of its size rounded up to
 * 32 MiB, and sits at the region's start; a later request takes the hole at
 * the lowest address that holds it (the rest of such a region, or memory
 * given back). That is the rule here. Memory outside PyTorch and what was
 * mapped before the recording are not seen, so it stays a model.
 *
 * Plain C, no lock, no Python: a model's, used by one thread at a time
 * (whatif.c). Calls nothing but libc. */
#ifndef MEMVIZ_WHATIF_VA_H
#define MEMVIZ_WHATIF_VA_H

#include <stddef.h>
#include <stdint.h>

#define MVZ_WHATIF_VA_REGION ((uint64_t)32 << 20) /* the driver's new regions: multiples of this */

typedef struct {
    uint64_t base, end;
} mvz_whatif_va_hole;

typedef struct {
    mvz_whatif_va_hole *holes; /* free, by address, none touching */
    size_t n, cap;
    uint64_t bottom; /* the lowest address handed out (0: none yet) */
} mvz_whatif_va;

void mvz_whatif_va_free(mvz_whatif_va *v);
/* In n ranges sorted by address, none overlapping: the first that ends
 * after `addr` (n: none). */
size_t mvz_whatif_va_first_after(const mvz_whatif_va_hole *r, size_t n, uint64_t addr);
/* The driver put `size` bytes at `base` (a recorded segment): from a hole,
 * or as the start of a new region below. 0, or -1 out of memory. */
int mvz_whatif_va_take(mvz_whatif_va *v, uint64_t base, uint64_t size);
/* Where the driver would put `size` bytes (taken). 0: out of host memory. */
uint64_t mvz_whatif_va_place(mvz_whatif_va *v, uint64_t size);
/* `size` bytes at `base` given back. 0, or -1 out of memory. */
int mvz_whatif_va_give(mvz_whatif_va *v, uint64_t base, uint64_t size);

#endif
