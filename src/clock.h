/* The one clock of the C core: CLOCK_MONOTONIC in nanoseconds.
 *
 * The bottom layer, header only: calls nothing of memviz's. Every timestamp
 * the store, the trace ring and the callback's self-measurement use comes
 * from here, so they are comparable. Inline, because the capture path reads
 * it on every event. */
#ifndef MEMVIZ_CLOCK_H
#define MEMVIZ_CLOCK_H

#include <pthread.h>
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

/* A background thread's nap (the drainer's, the trace writer's): wait on
 * `cond`, `lock` held, at most `ns` nanoseconds. The condition variables
 * are the default kind, whose deadline is on CLOCK_REALTIME. */
static inline int mvz_cond_wait_ns(pthread_cond_t *cond, pthread_mutex_t *lock, long ns)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += ns / 1000000000L;
    t.tv_nsec += ns % 1000000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return pthread_cond_timedwait(cond, lock, &t);
}

#endif
