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
#include "labels.h"
#include "livetab.h"
#include "store.h"
#include "trace_ring.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The .memviz framing (memviz/trace/format.py). */
#define KIND_EVENTS MVZ_TW_CHUNK_EVENTS
#define COMPRESSED MVZ_TW_CHUNK_COMPRESSED
#define LAYOUT_ROWS MVZ_TW_LAYOUT_ROWS
#define LAYOUT_PLANES MVZ_TW_LAYOUT_PLANES
#define FLAG_SYNTHETIC MVZ_FLAG_SYNTHETIC
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
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

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
    uint32_t refs;    /* the queue's, and a frozen dump's each (tw_lock) */
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
static mvz_raw_event *tw_raw; /* CHUNK_EVENTS taken at a time; more while held (below) */
static size_t tw_cap;         /* events tw_raw has room for */
static mvz_tw_stats st;
static tw_chunk *q_head, *q_tail; /* flight: oldest first */
static mvz_livetab base;
static int base_ready;

static size_t base_bytes(void) { return base.count * (sizeof(mvz_alloc) + 2 * sizeof(uint32_t)); }

/* tw_lock held: one holder of chunk c fewer (the queue, or a frozen dump);
 * the last frees it. */
static void chunk_drop(tw_chunk *c)
{
    if (--c->refs == 0)
        free(c);
}

/* ---- encoding ------------------------------------------------------------ */

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int k = 0; k < 4; k++)
        p[k] = (uint8_t)(v >> (8 * k));
}

/* The zlib-compressed payload of `raw`, when that is smaller and inflates
 * no more than a reader allows (MVZ_MAX_RATIO): a malloc'd buffer and its
 * length in *plen, else NULL. */
static uint8_t *pack(const uint8_t *raw, size_t raw_len, size_t *plen, int level)
{
    if (level <= 0 || !mvz_tw_zlib())
        return NULL;
    unsigned long cap = z_bound(raw_len);
    uint8_t *packed = malloc(cap);
    if (packed && z_compress2(packed, &cap, raw, raw_len, level) == 0 && cap < raw_len &&
        raw_len <= (size_t)cap * MVZ_MAX_RATIO + MVZ_INFLATE_SLACK) {
        *plen = cap;
        return packed;
    }
    free(packed);
    return NULL;
}

void mvz_tw_events_payload(const mvz_event *ev, size_t n, int layout, uint8_t *out)
{
    put_u32(out, (uint32_t)n);
    out[4] = (uint8_t)layout;
    const uint8_t *src = (const uint8_t *)ev;
    if (layout != LAYOUT_PLANES) {
        memcpy(out + EVENTS_HEAD, src, n * sizeof(mvz_event));
        return;
    }
    for (size_t k = 0; k < sizeof(mvz_event); k++) {
        uint8_t *plane = out + EVENTS_HEAD + k * n;
        for (size_t i = 0; i < n; i++)
            plane[i] = src[i * sizeof(mvz_event) + k];
    }
}

/* An EVENTS payload in byte planes, rewritten in place as rows (the same
 * records); 0, or -1 out of memory. */
static int planes_to_rows(uint8_t *raw, size_t raw_len)
{
    size_t n = (raw_len - EVENTS_HEAD) / sizeof(mvz_event);
    uint8_t *rows = malloc(n * sizeof(mvz_event) + 1);
    if (!rows)
        return -1;
    for (size_t k = 0; k < sizeof(mvz_event); k++)
        for (size_t i = 0; i < n; i++)
            rows[i * sizeof(mvz_event) + k] = raw[EVENTS_HEAD + k * n + i];
    memcpy(raw + EVENTS_HEAD, rows, n * sizeof(mvz_event));
    raw[4] = LAYOUT_ROWS;
    free(rows);
    return 0;
}

/* Frame `raw` (a chunk's payload) as a chunk of `kind` after `head` bytes of
 * a malloc'd block: compressed when zlib is there, `level` > 0, and that
 * makes it smaller and inflates no more than a reader allows; an EVENTS
 * payload in byte planes that does not is tried as rows (as regular as
 * that: rows compress less), which `raw` then holds; else as it is. *len:
 * the chunk's bytes. NULL out of memory. */
static uint8_t *frame(uint8_t kind, uint8_t *raw, size_t raw_len, int level, size_t head, size_t *len)
{
    size_t plen = raw_len;
    uint8_t *packed = pack(raw, raw_len, &plen, level);
    if (!packed && level > 0 && z_compress2 != NULL && raw_len >= EVENTS_HEAD &&
        raw[4] == LAYOUT_PLANES && (raw_len - EVENTS_HEAD) % sizeof(mvz_event) == 0 &&
        planes_to_rows(raw, raw_len) == 0)
        packed = pack(raw, raw_len, &plen, level);
    const uint8_t *payload = packed ? packed : raw;
    if (packed)
        kind |= COMPRESSED;
    uint8_t *out = malloc(head + 5 + plen + 4);
    if (out) {
        uint8_t *c = out + head;
        c[0] = kind;
        put_u32(c + 1, (uint32_t)plen);
        memcpy(c + 5, payload, plen);
        put_u32(c + 5 + plen, crc32_of(0, c, 5 + plen));
        *len = 5 + plen + 4;
    }
    free(packed);
    return out;
}

uint8_t *mvz_tw_frame_events(uint8_t kind, uint8_t *payload, size_t len, int level, size_t *out_len)
{
    pthread_once(&crc_once, crc_init);
    return frame(kind, payload, len, level, 0, out_len);
}

/* Frame `nrec` records as an EVENTS chunk (byte planes, by frame()'s rule):
 * a malloc'd tw_chunk, or NULL. */
static tw_chunk *frame_events(const mvz_event *ev, size_t nrec, uint32_t events, uint64_t first_ts,
                              uint64_t last_ts, int level)
{
    size_t raw_len = EVENTS_HEAD + nrec * sizeof(mvz_event);
    uint8_t *raw = malloc(raw_len);
    if (!raw)
        return NULL;
    mvz_tw_events_payload(ev, nrec, LAYOUT_PLANES, raw);
    size_t len = 0;
    tw_chunk *c = (tw_chunk *)frame(KIND_EVENTS, raw, raw_len, level, offsetof(tw_chunk, data), &len);
    if (c) {
        c->next = NULL;
        c->refs = 1;
        c->len = len;
        c->records = (uint32_t)nrec;
        c->events = events;
        c->first_ts = first_ts;
        c->last_ts = last_ts;
    }
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
        const uint8_t *records = raw + EVENTS_HEAD;
        uint64_t ts = 0, f[64];
        mvz_event ev[64];
        int planes = raw[4] == LAYOUT_PLANES; /* else rows (frame_events) */
        for (size_t k = 0; k < n; k += 64) {
            size_t m = n - k < 64 ? n - k : 64;
            if (planes)
                mvz_event_read_planes(records, n, MVZ_EVENT_SIZE, k, m, ev, f);
            else
                for (size_t i = 0; i < m; i++)
                    mvz_event_read(records + (k + i) * MVZ_EVENT_SIZE, MVZ_EVENT_SIZE, &ev[i]);
            for (size_t i = 0; i < m; i++) {
                const mvz_event *e = &ev[i];
                if (e->op == MVZ_EV_TIME) {
                    ts = e->address;
                    continue;
                }
                ts += e->ts_delta;
                if (e->op != MVZ_EV_ALLOC && e->op != MVZ_EV_FREE)
                    continue;
                int found;
                size_t at = mvz_livetab_find(&base, e->address, e->kind, &found);
                if (found)
                    mvz_livetab_remove(&base, at);
                if (e->op == MVZ_EV_FREE)
                    continue;
                int room = mvz_livetab_make_room(&base);
                if (room < 0)
                    continue; /* more live allocations than the store itself keeps */
                if (room > 0 || found)
                    at = mvz_livetab_find(&base, e->address, e->kind, &found);
                mvz_event_decode(mvz_livetab_insert(&base, at), e, ts);
            }
        }
    }
    free(raw);
    chunk_drop(c);
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

/* The file sink writes an event only once the file names its stack and its
 * label (Python appends those chunks, mvz_tw_write_named, and says how far
 * they go), so a process killed at any moment leaves no event without its
 * names: an event that needs a name not yet written waits in tw_raw, with
 * every event after it, until Python's next chunks of names (every
 * interval), or at most HOLD_MS (Python cannot run: its names come after
 * its events then), or until tw_raw is full of them. tw_raw grows a chunk's
 * worth at a time to HOLD_MAX while events wait (a program making new
 * stacks faster than Python names them: 8 chunks, 20 MB of records), so
 * that a slow naming pass is waited for, not written around. */
#define HOLD_MS 3000
#define HOLD_MAX (8 * CHUNK_EVENTS)
static uint32_t named_stacks = 1; /* stack ids below this are named in the file */
static uint32_t named_labels;     /* label ids 1..this are named in the file */
static size_t held;               /* events kept at the start of tw_raw */
static uint64_t held_dropped;     /* the ring's drops taken with them */
static uint64_t held_since;       /* when the oldest of them was taken (0: none) */

/* Writer thread, or a binding with the GIL released; tw_lock held: reads
 * an event copied out of the ring and the two watermarks, nothing else. */
static int named(const mvz_raw_event *e)
{
    uint32_t label = e->label_id;
    return (e->stack_id == 0 || e->stack_id < named_stacks) &&
           (label == 0 || label <= named_labels ||
            (label >= MVZ_MAX_LABELS - 1 && named_labels >= MVZ_MAX_LABELS - 2));
}

/* Encode, frame and hand to the sink events ev[0, n) (ALLOC, FREE, FAILED;
 * the TIME and GAP markers are made here), n at most CHUNK_EVENTS. Writer
 * thread or a binding without the GIL, tw_lock held: malloc, zlib and
 * write(2) only, never the capture path's locks or Python. */
static void emit(const mvz_raw_event *ev, size_t n, uint64_t dropped)
{
    uint8_t *buf = NULL;
    long len = mvz_ring_encode(ev, n, dropped, &buf);
    if (len >= 0) {
        uint64_t first = n ? ev[0].timestamp : mvz_now_ns();
        uint64_t last = n ? ev[n - 1].timestamp : first;
        tw_chunk *c = frame_events((const mvz_event *)buf, (size_t)len / sizeof(mvz_event),
                                   (uint32_t)n, first, last, tw_level);
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
                    st.events += n;
                }
                free(c);
            } else {
                st.events += n;
                keep(c);
            }
        }
    }
    free(buf);
}

/* Take the ring's events, CHUNK_EVENTS at a time, into chunks for the sink.
 * Writer thread or a binding without the GIL; tw_lock held, the store's
 * lock taken only inside mvz_store_trace_take (the order trace_writer.h
 * gives); no Python. With `only` non-zero, stop after that many takes; with
 * `force`, write the events waiting for their names too. */
static void drain(int only, int force)
{
    for (int takes = 0; !only || takes < only; takes++) {
        uint64_t dropped = 0;
        if (held + CHUNK_EVENTS > tw_cap && tw_cap < HOLD_MAX && tw_fd >= 0 && !force) {
            /* events wait for their names: room for a chunk more (else they go out as they are) */
            mvz_raw_event *more = realloc(tw_raw, (tw_cap + CHUNK_EVENTS) * sizeof *tw_raw);
            if (more) {
                tw_raw = more;
                tw_cap += CHUNK_EVENTS;
            }
        }
        size_t room = held + CHUNK_EVENTS <= tw_cap ? CHUNK_EVENTS : tw_cap - held;
        size_t m = room ? mvz_store_trace_take(tw_raw + held, room, &dropped) : 0;
        st.dropped += dropped;
        dropped += held_dropped; /* a GAP says where it was seen: at most a chunk early */
        size_t n = held + m;
        if (n == 0 && dropped == 0)
            return;
        size_t ok = n;
        if (tw_fd >= 0 && !force && (n < tw_cap || tw_cap < HOLD_MAX) &&
            !(held_since && mvz_now_ns() - held_since >= HOLD_MS * 1000000ull)) {
            ok = 0;
            while (ok < n && named(&tw_raw[ok]))
                ok++;
        }
        for (size_t lo = 0; lo < ok || (lo == 0 && dropped); lo += CHUNK_EVENTS) {
            size_t k = ok - lo < CHUNK_EVENTS ? ok - lo : CHUNK_EVENTS;
            emit(tw_raw + lo, k, lo == 0 ? dropped : 0);
        }
        held = n - ok;
        held_dropped = 0;
        if (held) {
            memmove(tw_raw, tw_raw + ok, held * sizeof *tw_raw);
            if (!held_since || ok)
                held_since = mvz_now_ns();
        } else {
            held_since = 0;
        }
        if (m < room || (held && ok == 0))
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
        /* Look at the ring 50 times a second; 500 times while it fills fast. */
        mvz_cond_wait_ns(&tw_cond, &tw_lock, wait_ns);
        if (!tw_stopping && due(since)) {
            uint64_t before = st.events;
            drain(0, 0);
            since = mvz_now_ns();
            wait_ns = st.events - before >= mvz_store_trace_capacity() / 8 ? 2 * 1000000L : 20 * 1000000L;
        }
    }
    pthread_mutex_unlock(&tw_lock);
    return NULL;
}

/* ---- the calls ----------------------------------------------------------- */

static size_t test_ring_events, test_chunks; /* mvz_tw_flight_test_sizes */

int mvz_tw_flight_split(size_t budget, mvz_tw_split *out)
{
    if (budget < MVZ_TW_FLIGHT_MIN_BUDGET)
        return -1;
    size_t ring = budget / 5 / sizeof(mvz_raw_event);
    ring = ring < MVZ_TW_FLIGHT_RING_MIN ? MVZ_TW_FLIGHT_RING_MIN
         : ring > MVZ_TW_FLIGHT_RING_MAX ? MVZ_TW_FLIGHT_RING_MAX
                                         : ring;
    if (test_ring_events)
        ring = test_ring_events;
    out->ring_events = ring;
    out->fixed = ring * sizeof(mvz_raw_event) + CHUNK_EVENTS * sizeof(mvz_raw_event);
    out->chunks = test_chunks ? test_chunks : budget > out->fixed ? budget - out->fixed : 0;
    return 0;
}

void mvz_tw_flight_test_sizes(size_t ring_events, size_t chunks)
{
    test_ring_events = ring_events;
    test_chunks = chunks;
}

int mvz_tw_start(int fd, size_t capacity, int level, unsigned interval_ms, size_t budget)
{
    pthread_mutex_lock(&tw_lock);
    int rc = -1;
    if (tw_running) {
        errno = EBUSY;
        goto out;
    }
    pthread_once(&crc_once, crc_init);
    mvz_tw_zlib();
    if (!tw_raw) {
        if (!(tw_raw = malloc(CHUNK_EVENTS * sizeof *tw_raw)))
            goto out;
        tw_cap = CHUNK_EVENTS;
    }
    if (fd < 0 && !base_ready) {
        if (mvz_livetab_init(&base, 1 << 22))
            goto out;
        base_ready = 1;
    }
    while (q_head) { /* an earlier recorder's chunks */
        tw_chunk *c = q_head;
        q_head = c->next;
        chunk_drop(c);
    }
    q_tail = NULL;
    if (base_ready)
        mvz_livetab_reset(&base);
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
            size_t at = mvz_livetab_find(&base, rows[i].address, rows[i].kind, &found);
            if (found || mvz_livetab_make_room(&base) < 0)
                continue;
            at = mvz_livetab_find(&base, rows[i].address, rows[i].kind, &found);
            *mvz_livetab_insert(&base, at) = rows[i];
        }
        free(rows);
        st.base_count = base.count;
        st.base_bytes = base_bytes();
    }
    tw_stopping = 0;
    named_stacks = 1;
    named_labels = 0;
    held = 0;
    held_dropped = held_since = 0;
    if ((errno = pthread_create(&tw_thread, NULL, writer_main, NULL)) != 0)
        goto out;
    tw_running = st.running = 1;
    rc = 0;
out:
    pthread_mutex_unlock(&tw_lock);
    return rc;
}

/* A binding, the GIL released: takes tw_lock (never held by the capture
 * path), writes, and drains what waited for these names. */
int mvz_tw_write_named(const uint8_t *data, size_t len, long stacks, long labels)
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
        if (stacks >= 0 && (uint64_t)stacks > named_stacks)
            named_stacks = stacks > 0xFFFFFFFFL ? 0xFFFFFFFFu : (uint32_t)stacks;
        if (labels >= 0 && (uint64_t)labels > named_labels)
            named_labels = labels > 0xFFFFFFFFL ? 0xFFFFFFFFu : (uint32_t)labels;
        if (held && tw_running)
            drain(0, 0); /* what waited for these names */
    }
    pthread_mutex_unlock(&tw_lock);
    return rc;
}

int mvz_tw_write(const uint8_t *data, size_t len) { return mvz_tw_write_named(data, len, -1, -1); }

void mvz_tw_flush(int force)
{
    pthread_mutex_lock(&tw_lock);
    if (tw_running)
        drain(0, force);
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
    drain(0, 1); /* what came before the ring stopped, named or not (names follow) */
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
            chunk_drop(c);
        }
        q_tail = NULL;
        if (base_ready)
            mvz_livetab_reset(&base);
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
 * record first, and wherever a delta would not fit 32 bits): sorted[0, n),
 * a copy of the base's (the caller's; sorted here in place), framed and
 * written to fd. No lock: touches only its arguments (and zlib). */
static int write_base(int fd, mvz_alloc *sorted, size_t n, int level)
{
    mvz_event *ev = malloc((2 * n + 1) * sizeof *ev);
    int rc = -1;
    if (!ev)
        goto out;
    qsort(sorted, n, sizeof *sorted, by_time);
    size_t k = 0;
    uint64_t prev = sorted[0].timestamp;
    for (size_t i = 0; i < n; i++) {
        const mvz_alloc *a = &sorted[i];
        if (i == 0 || a->timestamp - prev > 0xffffffffULL) {
            mvz_event_marker(&ev[k++], MVZ_EV_TIME, a->timestamp, FLAG_SYNTHETIC);
            prev = a->timestamp;
        }
        mvz_alloc rec = *a;
        rec.op = MVZ_EV_ALLOC;
        rec.flags |= FLAG_SYNTHETIC;
        mvz_event_encode(&ev[k++], &rec, &prev);
    }
    for (size_t lo = 0; lo < k; lo += CHUNK_EVENTS) {
        size_t m = k - lo < CHUNK_EVENTS ? k - lo : CHUNK_EVENTS;
        tw_chunk *c = frame_events(ev + lo, m, 0, 0, 0, level);
        if (!c)
            goto out;
        int w = write_all(fd, c->data, c->len);
        free(c);
        if (w)
            goto out;
    }
    rc = 0;
out:
    free(ev);
    return rc;
}

/* ---- a dump: frozen under the lock, written without it ------------------ */

struct mvz_tw_frozen {
    tw_chunk **chunks; /* the chunks kept at the freeze, a reference each */
    size_t n;
    mvz_alloc *base; /* a copy of the base at the freeze */
    size_t nbase;
    int level;
};

mvz_tw_frozen *mvz_tw_freeze(void)
{
    mvz_tw_frozen *f = calloc(1, sizeof *f);
    if (!f)
        return NULL;
    pthread_mutex_lock(&tw_lock);
    if (tw_fd >= 0) {
        pthread_mutex_unlock(&tw_lock);
        free(f);
        errno = EINVAL;
        return NULL;
    }
    if (tw_running)
        drain(0, 1);
    size_t n = 0;
    for (tw_chunk *c = q_head; c; c = c->next)
        n++;
    f->level = tw_level;
    f->chunks = malloc((n ? n : 1) * sizeof *f->chunks);
    f->nbase = base_ready ? base.count : 0;
    f->base = malloc((f->nbase ? f->nbase : 1) * sizeof *f->base);
    if (!f->chunks || !f->base) {
        pthread_mutex_unlock(&tw_lock);
        free(f->chunks);
        free(f->base);
        free(f);
        errno = ENOMEM;
        return NULL;
    }
    if (f->nbase)
        memcpy(f->base, base.allocs, f->nbase * sizeof *f->base);
    for (tw_chunk *c = q_head; c; c = c->next) {
        c->refs++;
        f->chunks[f->n++] = c;
    }
    pthread_mutex_unlock(&tw_lock);
    return f;
}

int mvz_tw_frozen_write(mvz_tw_frozen *f, int fd)
{
    if (f->nbase && write_base(fd, f->base, f->nbase, f->level))
        return -1;
    for (size_t i = 0; i < f->n; i++) /* immutable while this dump holds them */
        if (write_all(fd, f->chunks[i]->data, f->chunks[i]->len))
            return -1;
    return 0;
}

void mvz_tw_frozen_free(mvz_tw_frozen *f)
{
    if (!f)
        return;
    pthread_mutex_lock(&tw_lock);
    for (size_t i = 0; i < f->n; i++)
        chunk_drop(f->chunks[i]);
    pthread_mutex_unlock(&tw_lock);
    free(f->chunks);
    free(f->base);
    free(f);
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
