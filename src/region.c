#define _GNU_SOURCE
#include "region.h"

#include <string.h>
#include <sys/mman.h>

int mvz_region_reserve(mvz_region *r, size_t bytes, size_t prefault)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return -1;
    r->base = p;
    r->reserved = bytes;
    r->touched = 0;
    if (prefault > bytes)
        prefault = bytes;
    memset(p, 0, prefault); /* fault the first pages in now, not on the hot path */
    return 0;
}

void mvz_region_discard(mvz_region *r)
{
    if (r->base && r->touched) {
        size_t page = 4096;
        size_t len = (r->touched + page - 1) & ~(page - 1);
        madvise(r->base, len, MADV_DONTNEED); /* pages read back as zeros */
    }
    r->touched = 0;
}

void mvz_region_release(mvz_region *r)
{
    if (r->base)
        munmap(r->base, r->reserved);
    r->base = NULL;
    r->reserved = r->touched = 0;
}
