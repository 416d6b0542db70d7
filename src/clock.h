/* The one clock of the C core: CLOCK_MONOTONIC in nanoseconds.
 *
 * The bottom layer: calls nothing of memviz's. Every timestamp the store,
 * the trace ring and the callback's self-measurement use is on this clock,
 * so they are comparable. Inline, because the capture path reads it on
 * every event.
 *
 * The capture path reads "ticks" (mvz_tick_as): the CPU's time-stamp counter
 * where it runs at one rate on every core, else this clock itself. The
 * store turns ticks into this clock's nanoseconds as it applies the
 * capture queue (mvz_tickmap, clock.c): a TSC read is one instruction,
 * the vDSO's clock read several times that (benchmarks/RESULTS.md). */
#ifndef MEMVIZ_CLOCK_H
#define MEMVIZ_CLOCK_H

#include "hot.h"

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

/* Whether the capture path's ticks are the TSC's: decided once, with the
 * GIL, at import (mvz_clock_init); changed only by a test, while nothing
 * captures (module.c). Read with a relaxed load: mvz_hot.clock_tsc
 * (types.h), on the capture path's read-mostly line. */

/* Any thread, no GIL: one instruction, no memory touched. */
static inline uint64_t mvz_rdtsc(void)
{
#if defined(__x86_64__) || defined(__i386__)
    return __builtin_ia32_rdtsc();
#else
    return 0;
#endif
}

/* Capture path, any thread, no GIL: whether the capture path's ticks
 * (mvz_tick_as) are the TSC's now (a relaxed load of a word written once). */
static inline int mvz_tick_is_tsc(void) { return __atomic_load_n(&mvz_hot.clock_tsc, __ATOMIC_RELAXED); }

/* Capture path, any thread, no GIL: a tick of the kind `tsc` says (see
 * mvz_tick_is_tsc): the TSC's, or mvz_now_ns(). Neither takes a lock. */
static inline uint64_t mvz_tick_as(int tsc) { return tsc ? mvz_rdtsc() : mvz_now_ns(); }

/* Stage timing, in a benchmark build only (CFLAGS=-DMVZ_STAGES;
 * benchmarks/bench_in_step.py --stages): the allocator route's path cut at
 * the points MVZ_STAGE names, each thread adding the TSC ticks since its
 * previous point into a slot of its own (relaxed stores); read as
 * nanoseconds where the capture path's ticks are the TSC's (x86 with an
 * invariant TSC: elsewhere every stage reads 0). Compiled out of every
 * other build: the points cost nothing there. */
enum {
    MVZ_ST_NULL,          /* a point right after begin: what one point costs */
    MVZ_ST_A_BEFORE,      /* allocate's wrapper, up to PyTorch's allocate */
    MVZ_ST_A_WRAP,        /* after it, the wrapper's own checks and count */
    MVZ_ST_A_ENTER,       /* the capture path's entry (capturing, the busy count) */
    MVZ_ST_A_LABEL,       /* the autograd node and the label */
    MVZ_ST_A_NOTE,        /* thread index, node counter, tick */
    MVZ_ST_A_WALK,        /* the frame walk */
    MVZ_ST_A_COMPARE,     /* the stack compared with the last */
    MVZ_ST_A_CLAIM,       /* room in the queue */
    MVZ_ST_A_FILL,        /* frames and header written */
    MVZ_ST_A_PUBLISH,     /* published, the drainer maybe kicked */
    MVZ_ST_A_EXIT,        /* back to the wrapper's end */
    MVZ_ST_F_ENTER,       /* the deleter's wrapper to the capture path's free */
    MVZ_ST_F_TICK,        /* the free's tick */
    MVZ_ST_F_CLAIM,       /* room in the queue */
    MVZ_ST_F_PUBLISH,     /* written and published */
    MVZ_ST_F_EXIT,        /* back to the wrapper, up to PyTorch's free */
    MVZ_ST_F_RELEASE,     /* after it, the wrapper's count */
    MVZ_STAGES_N
};
#ifdef MVZ_STAGES
/* Any thread, no GIL: this thread's slot (taken once with one atomic add)
 * and relaxed stores to it. begin: a point that adds to no stage. */
void mvz_stage_begin(void);
void mvz_stage(int stage);
/* With the GIL: up to `max` threads' sums; returns how many. */
int mvz_stage_read(long *tid, uint64_t (*ticks)[MVZ_STAGES_N], uint64_t (*n)[MVZ_STAGES_N], int max);
#define MVZ_STAGE_BEGIN() mvz_stage_begin()
#define MVZ_STAGE(k) mvz_stage(k)
#else
#define MVZ_STAGE_BEGIN() ((void)0)
#define MVZ_STAGE(k) ((void)0)
#endif

/* With the GIL, once, at import: whether the TSC is invariant (one rate on
 * every core, never stopped) and the kernel keeps time with it; if so, a
 * first rate (a 200 microsecond wait) and mvz_hot.clock_tsc on. */
void mvz_clock_init(void);

/* TSC ticks to this clock's nanoseconds, for one owner that serializes its
 * calls (the store: its lock). An anchor is a pair of readings of both
 * clocks taken together; ticks convert from the latest anchor at the rate
 * measured since the first, so a tick read a few milliseconds before the
 * latest anchor is off by nanoseconds, and the store's timestamps stay
 * strictly increasing (next_ts_from) whatever the rounding. */
typedef struct {
    uint64_t tick0, ns0; /* the first anchor, or the last re-base */
    uint64_t tick1, ns1; /* the latest anchor */
    double ns_per_tick;  /* 0: no anchor yet */
} mvz_tickmap;

/* The owner's serialization: take an anchor now (three paired reads, the
 * tightest kept). No-op where there is no TSC. */
void mvz_clock_tickmap_anchor(mvz_tickmap *m);
/* The owner's serialization: nanoseconds of a TSC tick, from the latest
 * anchor (the store anchors before it applies any entry: a TSC tick exists
 * only where mvz_clock_init measured a rate, so an anchor always lands). */
uint64_t mvz_clock_tickmap_ns(const mvz_tickmap *m, uint64_t tick);
/* The rate mvz_clock_init measured (nanoseconds a tick), 0 without a TSC. */
double mvz_clock_ns_per_tick(void);

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
