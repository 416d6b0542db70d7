/* See clock.h: the TSC as the capture path's clock, where it can be, and
 * its ticks turned into CLOCK_MONOTONIC's nanoseconds. A leaf: calls
 * nothing of memviz's. */
#define _GNU_SOURCE 1
#include "clock.h"

#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define HAVE_TSC 1
#else
#define HAVE_TSC 0
#endif

static uint64_t init_tick, init_ns; /* the anchor mvz_clock_init took */
static double init_rate;

/* Both clocks read together: the tightest of three tries, so that a
 * preemption between the reads does not skew an anchor. */
static void read_pair(uint64_t *tick, uint64_t *ns)
{
    uint64_t best = UINT64_MAX;
    for (int i = 0; i < 3; i++) {
        uint64_t a = mvz_rdtsc();
        uint64_t n = mvz_now_ns();
        uint64_t b = mvz_rdtsc();
        if (b - a < best) {
            best = b - a;
            *tick = a + (b - a) / 2;
            *ns = n;
        }
    }
}

/* The kernel's own verdict: it keeps time with the TSC ("tsc"), or with a
 * hypervisor's clock that the vDSO reads through the TSC, which the
 * hypervisor then keeps stable across virtual CPUs. An unreadable file
 * (no sysfs in a container) leaves the CPU's flag to decide. */
static int kernel_trusts_tsc(void)
{
    FILE *f = fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
    if (!f)
        return 1;
    char name[64] = {0};
    int ok = fgets(name, sizeof name, f) != NULL;
    fclose(f);
    if (!ok)
        return 1;
    name[strcspn(name, "\n")] = 0;
    return strcmp(name, "tsc") == 0 || strcmp(name, "kvm-clock") == 0 ||
           strcmp(name, "hyperv_clocksource_tsc_page") == 0;
}

static int tsc_invariant(void)
{
#if HAVE_TSC
    unsigned a, b, c, d;
    if (!__get_cpuid(0x80000000u, &a, &b, &c, &d) || a < 0x80000007u)
        return 0;
    if (!__get_cpuid(0x80000007u, &a, &b, &c, &d))
        return 0;
    return (d >> 8) & 1; /* invariant TSC: one rate, through every power state */
#else
    return 0;
#endif
}

void mvz_clock_init(void)
{
    static int done;
    if (done)
        return;
    done = 1;
    if (!tsc_invariant() || !kernel_trusts_tsc())
        return;
    uint64_t t0, n0, t1, n1;
    read_pair(&t0, &n0);
    do
        read_pair(&t1, &n1);
    while (n1 - n0 < 200000);
    if (t1 <= t0)
        return; /* a TSC that does not advance: keep the clock */
    init_tick = t1;
    init_ns = n1;
    init_rate = (double)(n1 - n0) / (double)(t1 - t0);
    __atomic_store_n(&mvz_hot.clock_tsc, 1, __ATOMIC_RELAXED);
}

double mvz_clock_ns_per_tick(void) { return init_rate; }

void mvz_clock_tickmap_anchor(mvz_tickmap *m)
{
    if (!HAVE_TSC || init_rate == 0)
        return;
    if (m->ns_per_tick == 0) {
        m->tick0 = m->tick1 = init_tick;
        m->ns0 = m->ns1 = init_ns;
        m->ns_per_tick = init_rate;
    }
    uint64_t t, n;
    read_pair(&t, &n);
    if (t <= m->tick0 || n <= m->ns0) { /* the TSC went back (a resume): start over */
        m->tick0 = t;
        m->ns0 = n;
    } else if (n - m->ns0 >= 1000000) { /* a millisecond or more: a better rate */
        double rate = (double)(n - m->ns0) / (double)(t - m->tick0);
        if (rate > m->ns_per_tick * 1.01 || rate < m->ns_per_tick * 0.99) {
            /* the TSC's rate changed under us (a suspend, a migration):
             * measure afresh from here, meanwhile at the old rate */
            m->tick0 = t;
            m->ns0 = n;
        } else {
            m->ns_per_tick = rate;
        }
    }
    m->tick1 = t;
    m->ns1 = n;
}

uint64_t mvz_clock_tickmap_ns(const mvz_tickmap *m, uint64_t tick)
{
    int64_t d = (int64_t)(tick - m->tick1);
    double ns = (double)d * m->ns_per_tick;
    int64_t dn = (int64_t)(ns < 0 ? ns - 0.5 : ns + 0.5);
    if (dn < 0 && (uint64_t)(-dn) > m->ns1)
        return 0;
    return m->ns1 + (uint64_t)dn;
}

#ifdef MVZ_STAGES
/* Stage timing (clock.h): a benchmark build's. */
#include <sys/syscall.h>
#include <unistd.h>
#define STAGE_SLOTS 64
typedef struct {
    uint64_t ticks[MVZ_STAGES_N], n[MVZ_STAGES_N];
    uint64_t last;
    long tid;
} stage_slot;
static stage_slot stage_slots[STAGE_SLOTS] __attribute__((aligned(64)));
static int stage_used; /* atomic */
static __thread stage_slot *tl_stage __attribute__((tls_model("initial-exec")));
static __thread int tl_stage_none __attribute__((tls_model("initial-exec")));

/* Any thread, no GIL: this thread's slot, taken once. */
static stage_slot *my_stage(void)
{
    if (tl_stage || tl_stage_none)
        return tl_stage;
    int i = __atomic_fetch_add(&stage_used, 1, __ATOMIC_RELAXED);
    if (i >= STAGE_SLOTS) {
        tl_stage_none = 1;
        return NULL;
    }
    __atomic_store_n(&stage_slots[i].tid, (long)syscall(SYS_gettid), __ATOMIC_RELAXED);
    tl_stage = &stage_slots[i];
    return tl_stage;
}

void mvz_stage_begin(void)
{
    stage_slot *s = my_stage();
    if (s)
        s->last = mvz_rdtsc();
}

void mvz_stage(int stage)
{
    stage_slot *s = my_stage();
    if (s) { /* relaxed stores, read while they are made (mvz_stage_read) */
        uint64_t t = mvz_rdtsc();
        __atomic_store_n(&s->ticks[stage], s->ticks[stage] + (t - s->last), __ATOMIC_RELAXED);
        __atomic_store_n(&s->n[stage], s->n[stage] + 1, __ATOMIC_RELAXED);
        s->last = t;
    }
}

int mvz_stage_read(long *tid, uint64_t (*ticks)[MVZ_STAGES_N], uint64_t (*n)[MVZ_STAGES_N], int max)
{
    int used = __atomic_load_n(&stage_used, __ATOMIC_RELAXED);
    if (used > STAGE_SLOTS)
        used = STAGE_SLOTS;
    int k = 0;
    for (; k < used && k < max; k++) {
        tid[k] = __atomic_load_n(&stage_slots[k].tid, __ATOMIC_RELAXED);
        for (int j = 0; j < MVZ_STAGES_N; j++) {
            ticks[k][j] = __atomic_load_n(&stage_slots[k].ticks[j], __ATOMIC_RELAXED);
            n[k][j] = __atomic_load_n(&stage_slots[k].n[j], __ATOMIC_RELAXED);
        }
    }
    return k;
}
#endif
