/* Live bytes per category over a loaded trace's events
 * (replay_categories.h). Not on the capture path: it mallocs; it touches
 * only its own state, so it may run without the GIL. Calls nothing of
 * memviz. */
#include "replay_categories.h"
#include "hash.h"

#include <stdlib.h>
#include <string.h>

/* How far back a change that comes out of time order is moved into place
 * before the window is instead sorted as a whole when it is summed. */
#define SHIFT_MAX 64

/* ---- two small open-addressing tables ----------------------------------------- */

static int grow_runs(mvz_replay_categories_segments *s, size_t need)
{
    if (need <= s->cap)
        return 0;
    size_t ncap = s->cap ? 2 * s->cap : 8;
    mvz_replay_categories_run **q = realloc(s->runs, ncap * sizeof *q);
    if (!q)
        return -1;
    s->runs = q;
    s->cap = ncap;
    return 0;
}

/* Linear probing over a power-of-two table of `cap` entries. */
static size_t home(uint32_t key, uint64_t address, uint64_t value, size_t mask)
{
    return (size_t)(mvz_mix64(address ^ mvz_mix64(value ^ (uint64_t)key << 40)) & mask);
}

/* Room for one more entry in a table kept at most half full (rehashed into
 * one twice the size). `by_value`: the value is part of the key (known). */
static int table_room(mvz_replay_categories_entry **t, size_t *n, size_t *cap, int by_value)
{
    if (2 * (*n + 1) <= *cap)
        return 0;
    size_t ncap = *cap ? 2 * *cap : 1024;
    mvz_replay_categories_entry *nt = calloc(ncap, sizeof *nt);
    if (!nt)
        return -1;
    for (size_t k = 0; k < *cap; k++) {
        const mvz_replay_categories_entry *e = &(*t)[k];
        if (!e->key)
            continue;
        size_t i = home(e->key, e->address, by_value ? e->value : 0, ncap - 1);
        while (nt[i].key)
            i = (i + 1) & (ncap - 1);
        nt[i] = *e;
    }
    free(*t);
    *t = nt;
    *cap = ncap;
    return 0;
}

int mvz_replay_categories_known(mvz_replay_categories *c, int slot, int kind, uint64_t address, uint64_t ts,
                                int cat)
{
    if (table_room(&c->known, &c->k_n, &c->k_cap, 1))
        return -1;
    uint32_t key = (uint32_t)(slot << 8 | (kind & 0xFF)) + 1;
    size_t mask = c->k_cap - 1, i = home(key, address, ts, mask);
    for (; c->known[i].key; i = (i + 1) & mask) {
        mvz_replay_categories_entry *e = &c->known[i];
        if (e->key == key && e->address == address && e->value == ts) {
            e->cat = cat; /* the later one, as a dict keeps it */
            return 0;
        }
    }
    c->known[i] = (mvz_replay_categories_entry){address, ts, key, cat};
    c->k_n++;
    return 0;
}

static int known_get(const mvz_replay_categories *c, int slot, int kind, uint64_t address, uint64_t ts)
{
    if (!c->k_n)
        return MVZ_REPLAY_CATEGORIES_UNKNOWN;
    uint32_t key = (uint32_t)(slot << 8 | (kind & 0xFF)) + 1;
    size_t mask = c->k_cap - 1, i = home(key, address, ts, mask);
    for (; c->known[i].key; i = (i + 1) & mask) {
        const mvz_replay_categories_entry *e = &c->known[i];
        if (e->key == key && e->address == address && e->value == ts)
            return e->cat;
    }
    return MVZ_REPLAY_CATEGORIES_UNKNOWN;
}

static int live_put(mvz_replay_categories *c, int slot, int kind, uint64_t address, int cat, uint64_t size)
{
    if (table_room(&c->live, &c->l_n, &c->l_cap, 0))
        return -1;
    uint32_t key = (uint32_t)(slot << 8 | kind) + 1;
    size_t mask = c->l_cap - 1, i = home(key, address, 0, mask);
    for (; c->live[i].key; i = (i + 1) & mask)
        if (c->live[i].key == key && c->live[i].address == address)
            break;
    if (!c->live[i].key)
        c->l_n++;
    c->live[i] = (mvz_replay_categories_entry){address, size, key, cat};
    return 0;
}

/* Take (slot, kind, address) out of the live table: 1 with its category and
 * size, 0 when it is not there. Deletes by shifting back (no tombstones). */
static int live_pop(mvz_replay_categories *c, int slot, int kind, uint64_t address, int *cat, uint64_t *size)
{
    if (!c->l_cap)
        return 0;
    uint32_t key = (uint32_t)(slot << 8 | kind) + 1;
    size_t mask = c->l_cap - 1, i = home(key, address, 0, mask);
    for (; c->live[i].key; i = (i + 1) & mask)
        if (c->live[i].key == key && c->live[i].address == address)
            break;
    if (!c->live[i].key)
        return 0;
    *cat = c->live[i].cat;
    *size = c->live[i].value;
    c->live[i].key = 0;
    c->l_n--;
    for (size_t j = (i + 1) & mask; c->live[j].key; j = (j + 1) & mask) {
        size_t h = home(c->live[j].key, c->live[j].address, 0, mask);
        int in_range = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (!in_range) {
            c->live[i] = c->live[j];
            c->live[j].key = 0;
            i = j;
        }
    }
    return 1;
}

/* ---- live device allocations by address: sorted runs per slot ----------------- */

/* a before b: by address, and among equal addresses the newest first (a
 * new one goes before the others at its address) */
static int seg_before(const mvz_replay_categories_segment *a, const mvz_replay_categories_segment *b)
{
    return a->address < b->address || (a->address == b->address && a->seq > b->seq);
}

static int seg_insert(mvz_replay_categories *c, int slot, uint64_t address, uint64_t size, uint64_t ts,
                      int cat, uint32_t thread)
{
    mvz_replay_categories_segments *s = &c->segs[slot];
    mvz_replay_categories_segment x = {address, size, ts, c->seg_seq++, c->allocs, thread, cat, 0, 1};
    if (!s->n) {
        if (grow_runs(s, 1))
            return -1;
        s->runs[0] = calloc(1, sizeof **s->runs);
        if (!s->runs[0])
            return -1;
        s->n = 1;
    }
    /* the run: the last whose first entry comes before x (else the first) */
    size_t lo = 0, hi = s->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (seg_before(&s->runs[mid]->v[0], &x))
            lo = mid + 1;
        else
            hi = mid;
    }
    size_t r = lo ? lo - 1 : 0;
    mvz_replay_categories_run *run = s->runs[r];
    if (run->n == MVZ_REPLAY_CATEGORIES_RUN) { /* full: split in halves */
        if (grow_runs(s, s->n + 1))
            return -1;
        mvz_replay_categories_run *half = calloc(1, sizeof *half);
        if (!half)
            return -1;
        half->n = MVZ_REPLAY_CATEGORIES_RUN / 2;
        memcpy(half->v, run->v + MVZ_REPLAY_CATEGORIES_RUN / 2,
               (MVZ_REPLAY_CATEGORIES_RUN / 2) * sizeof *half->v);
        run->n = MVZ_REPLAY_CATEGORIES_RUN / 2;
        memmove(&s->runs[r + 2], &s->runs[r + 1], (s->n - r - 1) * sizeof *s->runs);
        s->runs[r + 1] = half;
        s->n++;
        if (!seg_before(&x, &half->v[0]))
            run = half;
    }
    size_t i = 0, top = run->n; /* the first entry not before x */
    while (i < top) {
        size_t mid = i + (top - i) / 2;
        if (seg_before(&run->v[mid], &x))
            i = mid + 1;
        else
            top = mid;
    }
    memmove(&run->v[i + 1], &run->v[i], (run->n - i) * sizeof *run->v);
    run->v[i] = x;
    run->n++;
    return 0;
}

/* The first entry at `address` or after it (bisect_left): its run and place;
 * 0 when there is none. */
static int seg_lower(const mvz_replay_categories *c, int slot, uint64_t address, size_t *r, size_t *i)
{
    const mvz_replay_categories_segments *s = &c->segs[slot];
    size_t lo = 0, hi = s->n; /* the first run whose last entry is at address or after */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->runs[mid]->v[s->runs[mid]->n - 1].address < address)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == s->n)
        return 0;
    const mvz_replay_categories_run *run = s->runs[lo];
    size_t k = 0, top = run->n - 1; /* the first entry at address or after */
    while (k < top) {
        size_t mid = k + (top - k) / 2;
        if (run->v[mid].address < address)
            k = mid + 1;
        else
            top = mid;
    }
    *r = lo;
    *i = k;
    return 1;
}

static void seg_remove(mvz_replay_categories *c, int slot, size_t r, size_t i)
{
    mvz_replay_categories_segments *s = &c->segs[slot];
    mvz_replay_categories_run *run = s->runs[r];
    memmove(&run->v[i], &run->v[i + 1], (run->n - i - 1) * sizeof *run->v);
    if (--run->n)
        return;
    free(run);
    memmove(&s->runs[r], &s->runs[r + 1], (s->n - r - 1) * sizeof *s->runs);
    s->n--;
}

/* The live device allocation holding `address`: the last one starting at or
 * before it (bisect_right - 1), if it reaches that far. */
static mvz_replay_categories_segment *segment_of(mvz_replay_categories *c, int slot, uint64_t address)
{
    mvz_replay_categories_segments *s = &c->segs[slot];
    size_t lo = 0, hi = s->n; /* the first run whose first entry is after address */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->runs[mid]->v[0].address <= address)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (!lo)
        return NULL;
    mvz_replay_categories_run *run = s->runs[lo - 1];
    size_t k = 1, top = run->n; /* the first entry after address (the run's first is not) */
    while (k < top) {
        size_t mid = k + (top - k) / 2;
        if (run->v[mid].address <= address)
            k = mid + 1;
        else
            top = mid;
    }
    mvz_replay_categories_segment *g = &run->v[k - 1];
    return address - g->address < g->size ? g : NULL;
}

/* ---- series ------------------------------------------------------------------ */

static void emit(mvz_replay_categories_series *s, mvz_replay_categories_point p, size_t limit)
{
    if (!limit) {
        s->points[s->n++] = p; /* room made by the caller */
        return;
    }
    if (s->fill == 0 || p.level > s->open.level)
        s->open = p;
    if (++s->fill < s->stride)
        return;
    if (s->n == limit) {
        for (size_t k = 0; k < limit / 2; k++) {
            const mvz_replay_categories_point *a = &s->points[2 * k], *b = &s->points[2 * k + 1];
            s->points[k] = b->level > a->level ? *b : *a;
        }
        s->n = limit / 2;
        s->stride *= 2;
        return;
    }
    s->points[s->n++] = s->open;
    s->fill = 0;
}

static int emit_point(mvz_replay_categories *c, mvz_replay_categories_series *s, mvz_replay_categories_point p)
{
    if (!c->limit && s->n == s->cap) {
        size_t ncap = s->cap ? 2 * s->cap : 64;
        mvz_replay_categories_point *q = realloc(s->points, ncap * sizeof *q);
        if (!q)
            return -1;
        s->points = q;
        s->cap = ncap;
    }
    emit(s, p, c->limit);
    return 0;
}

static int by_time(const void *x, const void *y)
{
    const mvz_replay_categories_change *a = x, *b = y;
    if (a->ts != b->ts)
        return a->ts < b->ts ? -1 : 1;
    return a->seq < b->seq ? -1 : a->seq > b->seq;
}

/* Sum the window, in time order, into the series. */
static int sum_window(mvz_replay_categories *c)
{
    if (c->unsorted)
        qsort(c->window, c->nwin, sizeof *c->window, by_time);
    for (size_t k = 0; k < c->nwin; k++) {
        const mvz_replay_categories_change *ch = &c->window[k];
        mvz_replay_categories_series *s = c->series[ch->series / c->ncat][ch->series % c->ncat];
        s->cur += ch->delta;
        if (s->has_pending && s->pending.ts == ch->ts) {
            s->pending.level = s->cur;
            continue;
        }
        if (s->has_pending && emit_point(c, s, s->pending))
            return -1;
        s->pending.ts = ch->ts;
        s->pending.level = s->cur;
        s->has_pending = 1;
    }
    if (c->nwin) {
        c->summed_to = c->window[c->nwin - 1].ts;
        c->summed = 1;
    }
    c->nwin = 0;
    c->unsorted = 0;
    return 0;
}

static int add(mvz_replay_categories *c, int slot, int cat, uint64_t ts, mvz_wide delta)
{
    uint32_t id = (uint32_t)(slot * c->ncat + cat);
    if (!c->series[slot]) {
        c->series[slot] = calloc((size_t)c->ncat, sizeof *c->series[slot]);
        if (!c->series[slot])
            return -1;
    }
    if (!c->series[slot][cat]) {
        mvz_replay_categories_series *s = calloc(1, sizeof *s);
        if (!s)
            return -1;
        s->order = c->nseries++;
        s->slot = slot;
        s->cat = cat;
        s->stride = 1;
        if (c->limit) {
            s->points = malloc(c->limit * sizeof *s->points);
            if (!s->points) {
                free(s);
                return -1;
            }
            s->cap = c->limit;
        }
        c->series[slot][cat] = s;
    }
    if (c->nwin == MVZ_REPLAY_CATEGORIES_WINDOW && sum_window(c))
        return -1;
    if (c->summed && ts < c->summed_to)
        ts = c->summed_to; /* older than the window: counts at the time summed last */
    size_t at = c->nwin;
    if (at && c->window[at - 1].ts > ts && !c->unsorted) {
        /* out of order: moved back into place if it is near, else the window is sorted */
        size_t stop = at > SHIFT_MAX ? at - SHIFT_MAX : 0;
        while (at > stop && c->window[at - 1].ts > ts)
            at--;
        if (at > 0 && c->window[at - 1].ts > ts) {
            c->unsorted = 1;
            at = c->nwin;
        } else {
            memmove(&c->window[at + 1], &c->window[at], (c->nwin - at) * sizeof *c->window);
        }
    }
    mvz_replay_categories_change *ch = &c->window[at];
    ch->ts = ts;
    ch->delta = delta;
    ch->seq = c->seq++;
    ch->series = id;
    c->nwin++;
    return 0;
}

/* ---- the rules ------------------------------------------------------------------ */

/* The end of a live allocation at `ts` (its FREE, or an ALLOC at its
 * address whose free was not seen). */
static int end_one(mvz_replay_categories *c, int slot, int kind, uint64_t address, uint64_t ts)
{
    int cat;
    uint64_t size;
    if (!live_pop(c, slot, kind, address, &cat, &size))
        return 0;
    if (kind == MVZ_KIND_DEVICE) {
        size_t r, i;
        if (seg_lower(c, slot, address, &r, &i) && c->segs[slot].runs[r]->v[i].address == address) {
            if (c->segs[slot].runs[r]->v[i].pool) /* what is left of a pool segment is unused pool */
                cat = MVZ_REPLAY_CATEGORIES_POOL;
            seg_remove(c, slot, r, i);
        }
    } else if (kind == MVZ_KIND_BLOCK) {
        mvz_replay_categories_segment *g = segment_of(c, slot, address);
        if (g && g->pool && add(c, slot, MVZ_REPLAY_CATEGORIES_POOL, ts, (mvz_wide)size))
            return -1;
        if (add(c, slot, MVZ_REPLAY_CATEGORIES_TENSORS, ts, -(mvz_wide)size))
            return -1;
    }
    return add(c, slot, cat, ts, -(mvz_wide)size);
}

int mvz_replay_categories_visit(void *ctx, const mvz_event *e, uint64_t index, uint64_t ts,
                      const mvz_alloc *ended)
{
    (void)index;
    mvz_replay_categories *c = ctx;
    if (e->op == MVZ_EV_ALLOC) {
        int slot = (uint8_t)e->device, kind = e->kind;
        c->allocs++;
        /* an earlier allocation at its address, whose free was not seen */
        if (ended && end_one(c, (uint8_t)ended->slot, ended->kind, ended->address, ts))
            return c->failed = -1;
        int cat = known_get(c, slot, kind, e->address, ts);
        uint64_t at = ts;
        if (kind == MVZ_KIND_BLOCK) {
            mvz_replay_categories_segment *g = segment_of(c, slot, e->address);
            if (g) {
                if (g->waiting && e->thread_idx == g->thread &&
                    c->allocs - g->allocs <= MVZ_REPLAY_LOOKAHEAD) {
                    at = g->ts; /* the block the segment was made for */
                    g->waiting = 0;
                } else if (g->ts > ts) {
                    at = g->ts;
                }
                if (!g->pool) { /* its first block: the segment is the pool's since it was made */
                    if (add(c, slot, g->cat, g->ts, -(mvz_wide)g->size) ||
                        add(c, slot, MVZ_REPLAY_CATEGORIES_POOL, g->ts, (mvz_wide)g->size))
                        return c->failed = -1;
                    g->cat = MVZ_REPLAY_CATEGORIES_POOL;
                    g->pool = 1;
                }
                if (add(c, slot, MVZ_REPLAY_CATEGORIES_POOL, at, -(mvz_wide)e->size))
                    return c->failed = -1;
            }
            if (add(c, slot, MVZ_REPLAY_CATEGORIES_TENSORS, at, (mvz_wide)e->size))
                return c->failed = -1;
        } else if (kind == MVZ_KIND_DEVICE &&
                   seg_insert(c, slot, e->address, e->size, ts, cat, e->thread_idx)) {
            return c->failed = -1;
        }
        if (live_put(c, slot, kind, e->address, cat, e->size) ||
            add(c, slot, cat, at, (mvz_wide)e->size))
            return c->failed = -1;
    } else if (e->op == MVZ_EV_FREE) {
        /* what it freed, as it was made (a free of nothing known: its own record) */
        int slot = ended ? (uint8_t)ended->slot : (uint8_t)e->device;
        int kind = ended ? ended->kind : e->kind;
        uint64_t address = ended ? ended->address : e->address;
        if (end_one(c, slot, kind, address, ts))
            return c->failed = -1;
    }
    return 0;
}

int mvz_replay_categories_finish(mvz_replay_categories *c)
{
    if (c->failed || sum_window(c))
        return c->failed = -1;
    for (size_t k = 0; k < (size_t)MVZ_REPLAY_SLOTS * (size_t)c->ncat; k++) {
        mvz_replay_categories_series *s =
            c->series[k / c->ncat] ? c->series[k / c->ncat][k % c->ncat] : NULL;
        if (!s || !s->has_pending)
            continue;
        if (emit_point(c, s, s->pending))
            return c->failed = -1;
        s->has_pending = 0;
        if (c->limit && s->fill) { /* the open bucket, however full */
            if (s->n == c->limit) {
                for (size_t j = 0; j < c->limit / 2; j++) {
                    const mvz_replay_categories_point *a = &s->points[2 * j], *b = &s->points[2 * j + 1];
                    s->points[j] = b->level > a->level ? *b : *a;
                }
                s->n = c->limit / 2;
            }
            s->points[s->n++] = s->open;
            s->fill = 0;
        }
    }
    return 0;
}

const mvz_replay_categories_series *mvz_replay_categories_series_of(const mvz_replay_categories *c, int slot,
                                                                    int cat)
{
    return c->series[slot] ? c->series[slot][cat] : NULL;
}

int mvz_replay_categories_init(mvz_replay_categories *c, int ncat, size_t limit)
{
    memset(c, 0, sizeof *c);
    c->ncat = ncat < 3 ? 3 : ncat;
    c->limit = limit & ~(size_t)1;
    c->window = malloc(MVZ_REPLAY_CATEGORIES_WINDOW * sizeof *c->window);
    if (!c->window) {
        mvz_replay_categories_release(c);
        return -1;
    }
    return 0;
}

void mvz_replay_categories_release(mvz_replay_categories *c)
{
    for (int d = 0; d < MVZ_REPLAY_SLOTS; d++) {
        for (int k = 0; c->series[d] && k < c->ncat; k++)
            if (c->series[d][k]) {
                free(c->series[d][k]->points);
                free(c->series[d][k]);
            }
        free(c->series[d]);
    }
    free(c->window);
    free(c->known);
    free(c->live);
    for (int d = 0; d < MVZ_REPLAY_SLOTS; d++) {
        for (size_t k = 0; k < c->segs[d].n; k++)
            free(c->segs[d].runs[k]);
        free(c->segs[d].runs);
    }
    memset(c, 0, sizeof *c);
}
