/* The monotonic clock (clock.h). Calls nothing of memviz's. */
#define _POSIX_C_SOURCE 200809L
#include "clock.h"

#include <time.h>

/* Capture path, no GIL: clock_gettime is a vDSO read of the kernel's time
 * page: no lock, no allocation, safe on any thread. */
uint64_t mvz_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}
