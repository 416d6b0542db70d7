/* The one clock of the C core: CLOCK_MONOTONIC in nanoseconds.
 *
 * The bottom layer: calls nothing of memviz's. Every timestamp the store,
 * the trace ring and the callback's self-measurement use comes from here,
 * so they are comparable. */
#ifndef MEMVIZ_CLOCK_H
#define MEMVIZ_CLOCK_H

#include <stdint.h>

/* Any thread, no GIL (the capture path too): one vDSO clock read, no lock,
 * no allocation. */
uint64_t mvz_now_ns(void);

#endif
