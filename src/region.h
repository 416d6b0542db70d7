/* Growable memory regions backed by anonymous mmap.
 *
 * The capture path may not call malloc (docs/architecture.md, rule 1), and the store's
 * tables must never move while a reader holds a pointer into them. A region
 * reserves a large range of address space once (MAP_NORESERVE, so it costs no
 * memory until touched) and is used as a plain array from its start; only
 * the pages actually written become resident, which keeps memviz's own
 * memory proportional to what it stores.
 */
#ifndef MEMVIZ_REGION_H
#define MEMVIZ_REGION_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t *base;
    size_t reserved; /* bytes of address space */
    size_t touched;  /* high-water mark of bytes handed out, for reporting */
} mvz_region;

/* Reserve `bytes` of address space; prefault the first `prefault` bytes so
 * the first events do not pay page faults. Returns 0 or -1 (errno set). */
int mvz_region_reserve(mvz_region *r, size_t bytes, size_t prefault);

/* Give resident pages back to the OS; the reservation stays. */
void mvz_region_discard(mvz_region *r);

void mvz_region_release(mvz_region *r);

/* Ensure `bytes` from the start are usable; returns 0, or -1 when the
 * reservation is too small. Safe without the GIL: it only does arithmetic
 * (the pages are already mapped, the kernel fills them on first touch). */
static inline int mvz_region_ensure(mvz_region *r, size_t bytes)
{
    if (bytes > r->reserved)
        return -1;
    if (bytes > r->touched)
        r->touched = bytes;
    return 0;
}

#endif
