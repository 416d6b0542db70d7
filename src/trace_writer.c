/* The native trace writer (trace_writer.h): a thread that moves the store's
 * trace ring into EVENTS chunks, for a file or for the flight recorder's
 * bounded memory. Nothing here runs on the capture path or touches Python:
 * the thread and the calls below (made by the bindings with the GIL
 * released) take tw_lock, and take the store's lock only inside
 * mvz_store_trace_take, for one copy. Calls store.c, trace_ring.c,
 * livetab.c and region.c (docs/architecture.md, "The C core"). */
#define _GNU_SOURCE
#include "trace_writer.h"
#include "clock.h"
#include "livetab.h"
#include "store.h"
#include "trace_ring.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The .memviz framing (memviz/trace/format.py). */
#define KIND_EVENTS 7
#define COMPRESSED 0x80
#define LAYOUT_PLANES 1
#define FLAG_SYNTHETIC 0x80
#define EVENTS_HEAD 5 /* count:u32, layout:u8 */
/* Events per chunk: 2 MiB of records before compression. */
#define CHUNK_EVENTS 65536

/* ---- zlib, loaded at run time ------------------------------------------- */

typedef int (*compress2_fn)(uint8_t *, unsigned long *, const uint8_t *, unsigned long, int);
typedef unsigned long (*bound_fn)(unsigned long);
typedef int (*uncompress_fn)(uint8_t *, unsigned long *, const uint8_t *, unsigned long);
static compress2_fn z_compress2;
static bound_fn z_bound;
static uncompress_fn z_uncompress;
static pthread_once_t z_once = PTHREAD_ONCE_INIT;

static void z_load(void)
{
    {
        /* The copy CPython's zlib module already mapped, else the system's. */
        void *h = dlopen("libz.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (!h)
            h = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
        if (h) {
            z_compress2 = (compress2_fn)dlsym(h, "compress2");
            z_bound = (bound_fn)dlsym(h, "compressBound");
            z_uncompress = (uncompress_fn)dlsym(h, "uncompress");
            if (!z_compress2 || !z_bound || !z_uncompress)
                z_compress2 = NULL;
        }
    }
}

/* Any thread: loads libz once (pthread_once orders the pointers' writes
 * before every reader's use). */
int mvz_tw_zlib(void)
{
    pthread_once(&z_once, z_load);
    return z_compress2 != NULL;
}

/* ---- CRC-32 (IEEE 802.3, as zlib.crc32), table built at start ---------- */

static uint32_t crc_table[256];

static void crc_init(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

static uint32_t crc32_of(uint32_t crc, const uint8_t *p, size_t n)
{
    crc = ~crc;
    while (n--)
        crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

/* ---- state (all under tw_lock) ------------------------------------------ */

typedef struct tw_chunk {
    struct tw_chunk *next;
    size_t len;       /* bytes of data[] (a framed chunk) */
    uint32_t records; /* records in it (TIME and GAP included) */
    uint32_t events;  /* ALLOC/FREE/FAILED among them */
    uint64_t first_ts, last_ts;
    uint8_t data[];
} tw_chunk;

static pthread_mutex_t tw_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t tw_cond = PTHREAD_COND_INITIALIZER;
static pthread_t tw_thread;
static int tw_running, tw_stopping, tw_fd = -1, tw_level;
static unsigned tw_interval_ms;
static size_t tw_budget;
static mvz_raw_event *tw_raw; /* CHUNK_EVENTS taken at a time */
static mvz_tw_stats st;
static tw_chunk *q_head, *q_tail; /* flight: oldest first */
static mvz_livetab base;
static int base_ready;

static size_t base_bytes(void) { return base.count * (sizeof(mvz_alloc) + 2 * sizeof(uint32_t)); }

/* ---- encoding ------------------------------------------------------------ */

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int k = 0; k < 4; k++)
        p[k] = (uint8_t)(v >> (8 * k));
}

/* Frame `nrec` records as an EVENTS chunk (byte planes, compressed when
 * zlib is there and it helps): a malloc'd tw_chunk, or NULL. */
static tw_chunk *frame_events(const mvz_event *ev, size_t nrec, uint32_t events, uint64_t first_ts,
                              uint64_t last_ts)
{
    size_t raw_len = EVENTS_HEAD + nrec * sizeof(mvz_event);
    uint8_t *raw = malloc(raw_len);
    if (!raw)
        return NULL;
    put_u32(raw, (uint32_t)nrec);
    raw[4] = LAYOUT_PLANES;
    const uint8_t *src = (const uint8_t *)ev;
    for (size_t k = 0; k < sizeof(mvz_event); k++) {
        uint8_t *plane = raw + EVENTS_HEAD + k * nrec;
        for (size_t i = 0; i < nrec; i++)
            plane[i] = src[i * sizeof(mvz_event) + k];
    }
    uint8_t type = KIND_EVENTS;
    const uint8_t *payload = raw;
    size_t plen = raw_len;
    uint8_t *packed = NULL;
    if (tw_level > 0 && mvz_tw_zlib()) {
        unsigned long cap = z_bound(raw_len);
        packed = malloc(cap);
        if (packed && z_compress2(packed, &cap, raw, raw_len, tw_level) == 0 && cap < raw_len) {
            payload = packed;
            plen = cap;
            type |= COMPRESSED;
        }
    }
    tw_chunk *c = malloc(sizeof *c + 5 + plen + 4);
    if (c) {
        c->next = NULL;
        c->len = 5 + plen + 4;
        c->records = (uint32_t)nrec;
        c->events = events;
        c->first_ts = first_ts;
        c->last_ts = last_ts;
        c->data[0] = type;
        put_u32(c->data + 1, (uint32_t)plen);
        memcpy(c->data + 5, payload, plen);
        put_u32(c->data + 5 + plen, crc32_of(0, c->data, 5 + plen));
    }
    free(packed);
    free(raw);
    return c;
}

static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* ---- the flight recorder's base ----------------------------------------- */

static uint64_t get_le(const uint8_t *const *planes, size_t lo, size_t width, size_t i)
{
    uint64_t v = 0;
    for (size_t k = 0; k < width; k++)
        v |= (uint64_t)planes[lo + k][i] << (8 * k);
    return v;
}

/* Fold the oldest chunk's events into the base (the live set before the
 * chunks kept), then free it. tw_lock held. */
static void evict_oldest(void)
{
    tw_chunk *c = q_head;
    q_head = c->next;
    if (!q_head)
        q_tail = NULL;
    st.kept_bytes -= c->len;
    st.kept_events -= c->events;
    st.evicted += c->events;
    st.evicted_until = c->last_ts;
    st.window_start = q_head ? q_head->first_ts : 0;
    size_t raw_len = EVENTS_HEAD + (size_t)c->records * sizeof(mvz_event);
    uint32_t plen = (uint32_t)c->data[1] | (uint32_t)c->data[2] << 8 | (uint32_t)c->data[3] << 16 |
                    (uint32_t)c->data[4] << 24;
    uint8_t *raw = malloc(raw_len);
    int ok = raw != NULL;
    if (ok && c->data[0] & COMPRESSED) {
        unsigned long out_len = raw_len;
        ok = z_uncompress(raw, &out_len, c->data + 5, plen) == 0 && out_len == raw_len;
    } else if (ok) {
        memcpy(raw, c->data + 5, raw_len);
    }
    if (ok && base_ready) {
        size_t n = c->records;
        const uint8_t *planes[sizeof(mvz_event)];
        for (size_t k = 0; k < sizeof(mvz_event); k++)
            planes[k] = raw + EVENTS_HEAD + k * n;
        uint64_t ts = 0;
        for (size_t i = 0; i < n; i++) {
            int op = planes[4][i];
            uint64_t addr = get_le(planes, 16, 8, i);
            if (op == MVZ_EV_TIME) {
                ts = addr;
                continue;
            }
            ts += get_le(planes, 0, 4, i);
            if (op != MVZ_EV_ALLOC && op != MVZ_EV_FREE)
                continue;
            int kind = planes[5][i], found;
            size_t at = mvz_live_find(&base, addr, kind, &found);
            if (found)
                mvz_live_remove(&base, at);
            if (op == MVZ_EV_FREE)
                continue;
            int room = mvz_live_make_room(&base);
            if (room < 0)
                continue; /* more live allocations than the store itself keeps */
            if (room > 0 || found)
                at = mvz_live_find(&base, addr, kind, &found);
            mvz_alloc *a = mvz_live_insert(&base, at);
            memset(a, 0, sizeof *a);
            a->address = addr;
            a->size = get_le(planes, 24, 8, i);
            a->timestamp = ts;
            a->stack_id = (uint32_t)get_le(planes, 8, 4, i);
            a->thread_idx = (uint32_t)get_le(planes, 12, 2, i);
            a->label_id = (uint32_t)get_le(planes, 14, 2, i);
            a->slot = (int16_t)(int8_t)planes[6][i];
            a->kind = (uint8_t)kind;
        }
    }
    free(raw);
    free(c);
    st.base_count = base.count;
    st.base_bytes = base_bytes();
}

/* Keep chunk c within the budget (the chunks and the base together); the
 * newest chunk always stays. tw_lock held. */
static void keep(tw_chunk *c)
{
    if (q_tail)
        q_tail->next = c;
    else
        q_head = c;
    q_tail = c;
    st.kept_bytes += c->len;
    st.kept_events += c->events;
    if (!st.window_start)
        st.window_start = c->first_ts;
    while (q_head != q_tail && st.kept_bytes + base_bytes() > tw_budget)
        evict_oldest();
}

/* ---- draining ------------------------------------------------------------ */

/* Take the ring's events, CHUNK_EVENTS at a time, into chunks for the sink.
 * tw_lock held. With `only` non-zero, stop after that many takes. */
static void drain(int only)
{
    for (int takes = 0; !only || takes < only; takes++) {
        uint64_t dropped = 0;
        size_t m = mvz_store_trace_take(tw_raw, CHUNK_EVENTS, &dropped);
        if (m == 0 && dropped == 0)
            return;
        st.dropped += dropped;
        uint8_t *buf = NULL;
        long len = mvz_ring_encode(tw_raw, m, dropped, &buf);
        if (len >= 0) {
            uint64_t first = m ? tw_raw[0].timestamp : mvz_now_ns();
            uint64_t last = m ? tw_raw[m - 1].timestamp : first;
            tw_chunk *c = frame_events((const mvz_event *)buf, (size_t)len / sizeof(mvz_event),
                                       (uint32_t)m, first, last);
            if (c) {
                st.chunks++;
                if (last > st.window_end)
                    st.window_end = last;
                if (tw_fd >= 0) {
                    /* Counted once written: an error says how far the file goes. */
                    if (!st.error && write_all(tw_fd, c->data, c->len) != 0)
                        st.error = errno ? errno : EIO;
                    if (!st.error) {
                        st.bytes += c->len;
                        st.events += m;
                    }
                    free(c);
                } else {
                    st.events += m;
                    keep(c);
                }
            }
        }
        free(buf);
        if (m < CHUNK_EVENTS)
            return;
    }
}

static int due(uint64_t since)
{
    size_t cap = mvz_store_trace_capacity();
    return mvz_now_ns() - since >= (uint64_t)tw_interval_ms * 1000000u ||
           mvz_store_trace_pending() >= cap / 4;
}

static void *writer_main(void *unused)
{
    (void)unused;
    /* Signals go to the program's threads (SIGUSR1 asks Python for a dump). */
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    /* Below the program's threads: where cores are short, compressing waits
     * for the training loop, never the other way round (Linux: per thread). */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
    pthread_mutex_lock(&tw_lock);
    uint64_t since = mvz_now_ns();
    long wait_ns = 20 * 1000000L;
    while (!tw_stopping) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        /* Look at the ring 50 times a second; 500 times while it fills fast. */
        t.tv_nsec += wait_ns;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&tw_cond, &tw_lock, &t);
        if (!tw_stopping && due(since)) {
            uint64_t before = st.events;
            drain(0);
            since = mvz_now_ns();
            wait_ns = st.events - before >= mvz_store_trace_capacity() / 8 ? 2 * 1000000L : 20 * 1000000L;
        }
    }
    pthread_mutex_unlock(&tw_lock);
    return NULL;
}

/* ---- the calls ----------------------------------------------------------- */

int mvz_tw_start(int fd, size_t capacity, int level, unsigned interval_ms, size_t budget)
{
    pthread_mutex_lock(&tw_lock);
    int rc = -1;
    if (tw_running) {
        errno = EBUSY;
        goto out;
    }
    if (!crc_table[1])
        crc_init();
    mvz_tw_zlib();
    if (!tw_raw && !(tw_raw = malloc(CHUNK_EVENTS * sizeof *tw_raw)))
        goto out;
    if (fd < 0 && !base_ready) {
        if (mvz_live_init(&base, 1 << 22))
            goto out;
        base_ready = 1;
    }
    while (q_head) { /* an earlier recorder's chunks */
        tw_chunk *c = q_head;
        q_head = c->next;
        free(c);
    }
    q_tail = NULL;
    if (base_ready)
        mvz_live_reset(&base);
    memset(&st, 0, sizeof st);
    st.compressed = level > 0 && z_compress2 != NULL;
    st.budget = fd < 0 ? budget : 0;
    tw_fd = fd;
    tw_level = level;
    tw_interval_ms = interval_ms ? interval_ms : 1;
    tw_budget = budget;
    (void)capacity; /* the caller enabled the ring (mvz_store_trace_enable) */
    if (fd < 0) {
        /* The base starts as what is live now: allocations made before the
         * recorder, whose frees it will see. The ring is already on, so an
         * event of the ring that repeats one of these agrees with it. */
        mvz_alloc *rows = NULL;
        long n = mvz_store_live(&rows);
        for (long i = 0; i < n; i++) {
            int found;
            size_t at = mvz_live_find(&base, rows[i].address, rows[i].kind, &found);
            if (found || mvz_live_make_room(&base) < 0)
                continue;
            at = mvz_live_find(&base, rows[i].address, rows[i].kind, &found);
            *mvz_live_insert(&base, at) = rows[i];
        }
        free(rows);
        st.base_count = base.count;
        st.base_bytes = base_bytes();
    }
    tw_stopping = 0;
    if ((errno = pthread_create(&tw_thread, NULL, writer_main, NULL)) != 0)
        goto out;
    tw_running = st.running = 1;
    rc = 0;
out:
    pthread_mutex_unlock(&tw_lock);
    return rc;
}

int mvz_tw_write(const uint8_t *data, size_t len)
{
    pthread_mutex_lock(&tw_lock);
    int rc = -1;
    if (tw_fd < 0) {
        errno = EINVAL;
    } else if (st.error) {
        errno = st.error;
    } else if (write_all(tw_fd, data, len) != 0) {
        st.error = errno ? errno : EIO;
    } else {
        st.bytes += len;
        rc = 0;
    }
    pthread_mutex_unlock(&tw_lock);
    return rc;
}

void mvz_tw_flush(void)
{
    pthread_mutex_lock(&tw_lock);
    if (tw_running)
        drain(0);
    pthread_mutex_unlock(&tw_lock);
}

void mvz_tw_stop(void)
{
    pthread_mutex_lock(&tw_lock);
    if (!tw_running) {
        pthread_mutex_unlock(&tw_lock);
        return;
    }
    tw_stopping = 1;
    pthread_cond_broadcast(&tw_cond);
    pthread_mutex_unlock(&tw_lock);
    pthread_join(tw_thread, NULL);
    pthread_mutex_lock(&tw_lock);
    mvz_store_trace_disable();
    drain(0); /* what came before the ring stopped */
    tw_running = st.running = 0;
    tw_fd = -1;
    pthread_mutex_unlock(&tw_lock);
}

void mvz_tw_release(void)
{
    pthread_mutex_lock(&tw_lock);
    if (!tw_running) {
        while (q_head) {
            tw_chunk *c = q_head;
            q_head = c->next;
            free(c);
        }
        q_tail = NULL;
        if (base_ready)
            mvz_live_reset(&base);
        st.kept_bytes = st.kept_events = st.base_count = st.base_bytes = 0;
    }
    pthread_mutex_unlock(&tw_lock);
}

static int by_time(const void *a, const void *b)
{
    uint64_t x = ((const mvz_alloc *)a)->timestamp, y = ((const mvz_alloc *)b)->timestamp;
    return x < y ? -1 : x > y;
}

/* The base as ALLOC records dated when each was made, oldest first (a TIME
 * record first, and wherever a delta would not fit 32 bits). */
static int dump_base(int fd)
{
    size_t n = base.count;
    if (!n)
        return 0;
    mvz_alloc *sorted = malloc(n * sizeof *sorted);
    mvz_event *ev = malloc((2 * n + 1) * sizeof *ev);
    int rc = -1;
    if (!sorted || !ev)
        goto out;
    memcpy(sorted, base.allocs, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, by_time);
    size_t k = 0;
    uint64_t prev = sorted[0].timestamp;
    for (size_t i = 0; i < n; i++) {
        const mvz_alloc *a = &sorted[i];
        if (i == 0 || a->timestamp - prev > 0xffffffffULL) {
            memset(&ev[k], 0, sizeof ev[k]);
            ev[k].op = MVZ_EV_TIME;
            ev[k].flags = FLAG_SYNTHETIC;
            ev[k].address = prev = a->timestamp;
            k++;
        }
        mvz_event *e = &ev[k++];
        memset(e, 0, sizeof *e);
        e->ts_delta = (uint32_t)(a->timestamp - prev);
        prev = a->timestamp;
        e->op = MVZ_EV_ALLOC;
        e->kind = a->kind;
        e->device = (int8_t)a->slot;
        e->flags = FLAG_SYNTHETIC;
        e->stack_id = a->stack_id;
        e->thread_idx = (uint16_t)(a->thread_idx > 0xffff ? 0xffff : a->thread_idx);
        e->label_id = (uint16_t)(a->label_id > 0xffff ? 0xffff : a->label_id);
        e->address = a->address;
        e->size = a->size;
    }
    for (size_t lo = 0; lo < k; lo += CHUNK_EVENTS) {
        size_t m = k - lo < CHUNK_EVENTS ? k - lo : CHUNK_EVENTS;
        tw_chunk *c = frame_events(ev + lo, m, 0, 0, 0);
        if (!c)
            goto out;
        int w = write_all(fd, c->data, c->len);
        free(c);
        if (w)
            goto out;
    }
    rc = 0;
out:
    free(sorted);
    free(ev);
    return rc;
}

int mvz_tw_dump(int fd)
{
    pthread_mutex_lock(&tw_lock);
    int rc = -1;
    if (tw_fd >= 0) {
        errno = EINVAL;
        goto out;
    }
    if (tw_running)
        drain(0);
    if (base_ready && dump_base(fd))
        goto out;
    for (tw_chunk *c = q_head; c; c = c->next)
        if (write_all(fd, c->data, c->len))
            goto out;
    rc = 0;
out:
    pthread_mutex_unlock(&tw_lock);
    return rc;
}

void mvz_tw_get_stats(mvz_tw_stats *out)
{
    pthread_mutex_lock(&tw_lock);
    *out = st;
    pthread_mutex_unlock(&tw_lock);
}

void mvz_tw_atfork_child(void)
{
    /* The thread and the file are the parent's: forget both (never join,
     * never write, never close). The flight recorder's memory stays. */
    pthread_mutex_init(&tw_lock, NULL);
    pthread_cond_init(&tw_cond, NULL);
    tw_running = st.running = 0;
    tw_stopping = 0;
    tw_fd = -1;
}
