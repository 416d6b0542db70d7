/* The one clock of the C core: CLOCK_MONOTONIC in nanoseconds.
 *
 * The bottom layer, header only: calls nothing of memviz's. Every timestamp
 * the store, the trace ring and the callback's self-measurement use comes
 * from here, so they are comparable. Inline, because the capture path reads
 * it on every event. */
#ifndef MEMVIZ_CLOCK_H
#define MEMVIZ_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Any thread, no GIL (the capture path too): clock_gettime is a vDSO read of
 * the kernel's time page: no lock, no allocation. */
static inline uint64_t mvz_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

#endif
