/* Replay of a trace's events (replay.h): the store's live-table and
 * accounting rules over a private table, one chunk at a time. Not on the
 * capture path: it reserves (mmap) and releases its own regions and
 * mallocs the rest; every function touches only the replayer and the
 * caller's buffers, so it may run without the GIL (the binding keeps one
 * caller at a time). */
#include "replay.h"
#include "grow.h"
#include "accounting.h"
#include "hash.h"
#include "livetab.h"

#include <stdlib.h>
#include <string.h>

#define FIRST_ROOM (1u << 16)

/* ---- the live table, grown by rebuilding ------------------------------------ */

/* Room for one more live allocation: a table four times the size when full
 * (the replay needs no stable pointers, unlike the store). 0, 1 when the
 * table or its index moved (slots are stale), -1 out of memory. */
static int live_room(mvz_replayer *r)
{
    int room = mvz_livetab_make_room(&r->live);
    if (room >= 0)
        return room;
    mvz_livetab bigger;
    memset(&bigger, 0, sizeof bigger);
    if (r->live.max > SIZE_MAX / 8 || mvz_livetab_init(&bigger, r->live.max * 4)) {
        mvz_livetab_release(&bigger);
        return -1;
    }
    for (size_t k = 0; k < r->live.count; k++) {
        const mvz_alloc *a = &r->live.allocs[k];
        int found;
        if (mvz_livetab_make_room(&bigger) < 0) {
            mvz_livetab_release(&bigger);
            return -1;
        }
        size_t at = mvz_livetab_find(&bigger, a->address, a->kind, &found);
        *mvz_livetab_insert(&bigger, at) = *a;
    }
    mvz_livetab_release(&r->live);
    r->live = bigger;
    return mvz_livetab_make_room(&r->live) < 0 ? -1 : 1;
}

/* ---- the timeline of a slot --------------------------------------------------- */

static int series_push(mvz_replay_series *s, uint64_t index, uint64_t ts, mvz_wide level)
{
    if (!s->points) {
        s->points = malloc(MVZ_REPLAY_POINTS * sizeof *s->points);
        if (!s->points)
            return -1;
        s->stride = 1;
    }
    s->changes++;
    if (s->fill == 0 || level > s->open.level) { /* the first of equal highs stays */
        s->open.index = index;
        s->open.ts = ts;
        s->open.level = level;
    }
    if (++s->fill < s->stride)
        return 0;
    if (s->n == MVZ_REPLAY_POINTS) {
        /* Full: pairs merge into buckets twice as long, and the open bucket
         * goes on until it is that long too. */
        for (size_t k = 0; k < MVZ_REPLAY_POINTS / 2; k++) {
            const mvz_replay_point *a = &s->points[2 * k], *b = &s->points[2 * k + 1];
            s->points[k] = b->level > a->level ? *b : *a;
        }
        s->n = MVZ_REPLAY_POINTS / 2;
        s->stride *= 2;
        return 0;
    }
    s->points[s->n++] = s->open;
    s->fill = 0;
    return 0;
}

void mvz_replay_finish(mvz_replayer *r)
{
    if (!r->summary)
        return;
    for (int d = 0; d < MVZ_REPLAY_SLOTS; d++) {
        mvz_replay_series *s = &r->slots[d].series;
        if (!s->fill)
            continue;
        if (s->n == MVZ_REPLAY_POINTS) {
            for (size_t k = 0; k < MVZ_REPLAY_POINTS / 2; k++) {
                const mvz_replay_point *a = &s->points[2 * k], *b = &s->points[2 * k + 1];
                s->points[k] = b->level > a->level ? *b : *a;
            }
            s->n = MVZ_REPLAY_POINTS / 2;
            s->stride *= 2;
        }
        s->points[s->n++] = s->open;
        s->fill = 0;
    }
}

/* ---- the set of block addresses ------------------------------------------------- */

static size_t block_home(uint64_t address, int slot, size_t mask)
{
    return (size_t)(mvz_mix64(address ^ ((uint64_t)slot << 56)) & mask);
}

static int block_add(mvz_replayer *r, uint64_t address, int slot)
{
    if (2 * (r->bn + 1) > r->bcap) {
        size_t ncap = r->bcap ? 2 * r->bcap : 1024;
        uint64_t *na = calloc(ncap, sizeof *na);
        uint16_t *ns = calloc(ncap, sizeof *ns);
        if (!na || !ns) {
            free(na);
            free(ns);
            return -1;
        }
        for (size_t k = 0; k < r->bcap; k++) {
            if (!r->bslot[k])
                continue;
            size_t i = block_home(r->baddr[k], r->bslot[k] - 1, ncap - 1);
            while (ns[i])
                i = (i + 1) & (ncap - 1);
            na[i] = r->baddr[k];
            ns[i] = r->bslot[k];
        }
        free(r->baddr);
        free(r->bslot);
        r->baddr = na;
        r->bslot = ns;
        r->bcap = ncap;
    }
    size_t mask = r->bcap - 1, i = block_home(address, slot, mask);
    for (; r->bslot[i]; i = (i + 1) & mask)
        if (r->baddr[i] == address && r->bslot[i] == slot + 1)
            return 0;
    r->baddr[i] = address;
    r->bslot[i] = (uint16_t)(slot + 1);
    r->bn++;
    return 0;
}

static int by_address(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

long mvz_replay_block_addresses(const mvz_replayer *r, int slot, uint64_t **out)
{
    *out = malloc((r->bn ? r->bn : 1) * sizeof **out);
    if (!*out)
        return -1;
    size_t m = 0;
    for (size_t k = 0; k < r->bcap; k++)
        if (r->bslot[k] == slot + 1)
            (*out)[m++] = r->baddr[k];
    qsort(*out, m, sizeof **out, by_address);
    return (long)m;
}

/* ---- peak sets: the graveyard ------------------------------------------------------ */

/* Drop the entries no peak set can need any more: a grave is in a peak's
 * set only while it was made at or before that peak and freed after it
 * (peaks only move later, past every free seen so far). Kept: those in the
 * set of their slot's device peak or of its tensor peak, at most `bound`.
 * (Keeping every grave freed after either peak kept those made after the
 * device peak for a tensor peak that had moved on: a run whose device peak
 * came early never shrank its graveyard, and compacted on nearly every free;
 * loading a 7 M-event trace took 90 s.) */
static void graves_compact(mvz_replayer *r)
{
    size_t keep = 0;
    for (size_t k = 0; k < r->ngraves; k++) {
        const mvz_replay_grave *g = &r->graves[k];
        const mvz_replay_slot *sl = &r->slots[(uint8_t)g->a.slot];
        int64_t made = (int64_t)MVZ_REPLAY_INDEX(&g->a), freed = (int64_t)g->freed;
        if ((made <= sl->peak_index && freed > sl->peak_index) ||
            (made <= sl->tpeak_index && freed > sl->tpeak_index))
            r->graves[keep++] = *g;
    }
    r->ngraves = keep;
}

/* `a` ended at event `freed`: keep it while its slot's peak set may hold it
 * (made before the peak: a later peak comes after this event, so then it
 * is not needed). Compacted when the graveyard holds more than twice what
 * the peak sets can need, so each end costs O(1) amortised. */
static int graves_on_end(mvz_replayer *r, const mvz_alloc *a, uint64_t freed)
{
    const mvz_replay_slot *sl = &r->slots[(uint8_t)a->slot];
    if ((int64_t)MVZ_REPLAY_INDEX(a) > sl->peak_index &&
        (int64_t)MVZ_REPLAY_INDEX(a) > sl->tpeak_index)
        return 0;
    if (r->ngraves >= 2 * r->bound + 1024)
        graves_compact(r);
    if (mvz_grow((void **)&r->graves, &r->capgraves, r->ngraves + 1, sizeof *r->graves))
        return -1;
    r->graves[r->ngraves].a = *a;
    r->graves[r->ngraves].freed = freed;
    r->ngraves++;
    return 0;
}

static int by_index(const void *a, const void *b)
{
    uint64_t x = MVZ_REPLAY_INDEX((const mvz_alloc *)a), y = MVZ_REPLAY_INDEX((const mvz_alloc *)b);
    return x < y ? -1 : x > y;
}

/* The peak set of one slot (with `tensor`, at the peak of its blocks),
 * appended at out[m]; returns the new count. */
static size_t peak_set_of(const mvz_replayer *r, int d, int tensor, mvz_alloc *out, size_t m)
{
    const mvz_replay_slot *s = &r->slots[d];
    int64_t pi = tensor ? s->tpeak_index : s->peak_index;
    if (pi < 0)
        return m;
    size_t first = m;
    uint64_t p = (uint64_t)pi;
    for (size_t k = 0; k < r->live.count; k++) {
        const mvz_alloc *a = &r->live.allocs[k];
        if ((uint8_t)a->slot == d && MVZ_REPLAY_INDEX(a) <= p)
            out[m++] = *a;
    }
    for (size_t k = 0; k < r->ngraves; k++) {
        const mvz_replay_grave *g = &r->graves[k];
        if ((uint8_t)g->a.slot == d && MVZ_REPLAY_INDEX(&g->a) <= p && g->freed > p)
            out[m++] = g->a;
    }
    qsort(out + first, m - first, sizeof *out, by_index);
    if (!tensor && s->has_block)
        out[m++] = s->block;
    return m;
}

long mvz_replay_peak_set_of(const mvz_replayer *r, int slot, int tensor, mvz_alloc **out)
{
    size_t room = r->live.count + r->ngraves + MVZ_REPLAY_SLOTS + 1;
    *out = malloc(room * sizeof **out);
    if (!*out)
        return -1;
    if (slot >= 0)
        return (long)peak_set_of(r, slot & 0xFF, tensor, *out, 0);
    size_t m = 0;
    for (int d = 0; d < MVZ_REPLAY_SLOTS; d++)
        m = peak_set_of(r, d, tensor, *out, m);
    /* Every slot at its own peak, in the order of the ALLOC events (two
     * entries of one index are one allocation: a slot's block found after
     * its peak may be in another slot's set too). */
    qsort(*out, m, sizeof **out, by_index);
    return (long)m;
}

long mvz_replay_live(const mvz_replayer *r, mvz_alloc **out)
{
    *out = malloc((r->live.count ? r->live.count : 1) * sizeof **out);
    if (!*out)
        return -1;
    memcpy(*out, r->live.allocs, r->live.count * sizeof **out);
    qsort(*out, r->live.count, sizeof **out, by_index);
    return (long)r->live.count;
}

/* ---- the replayer ---------------------------------------------------------------- */

int mvz_replay_init(mvz_replayer *r, uint64_t start_ns, int summary)
{
    memset(r, 0, sizeof *r);
    r->ts = start_ns;
    r->summary = summary;
    if (mvz_livetab_init(&r->live, FIRST_ROOM))
        goto fail;
    if (summary) {
        r->slots = calloc(MVZ_REPLAY_SLOTS, sizeof *r->slots);
        if (!r->slots)
            goto fail;
        for (int d = 0; d < MVZ_REPLAY_SLOTS; d++)
            r->slots[d].peak_index = r->slots[d].tpeak_index = -1;
    }
    return 0;
fail:
    mvz_replay_release(r);
    return -1;
}

void mvz_replay_release(mvz_replayer *r)
{
    mvz_livetab_release(&r->live);
    if (r->slots)
        for (int d = 0; d < MVZ_REPLAY_SLOTS; d++)
            free(r->slots[d].series.points);
    free(r->slots);
    free(r->graves);
    free(r->fails);
    free(r->baddr);
    free(r->bslot);
    memset(r, 0, sizeof *r);
}

/* The record of an event (record.h's decoding: every field the file has),
 * in the replay's terms (replay.h): dated by its index, its time where the
 * stream goes, its device as the replay's slot. */
static void fill(mvz_alloc *a, const mvz_event *e, uint64_t index, uint64_t ts)
{
    mvz_event_decode(a, e, ts);
    MVZ_REPLAY_TIME(a) = ts;
    MVZ_REPLAY_INDEX(a) = index;
    a->slot = (int16_t)(uint8_t)e->device;
    a->op = MVZ_EV_ALLOC;
}

/* An ALLOC: the lookahead of every slot whose peak is waiting for its block. */
static void look_at(mvz_replayer *r, const mvz_alloc *a)
{
    int keep = 0;
    for (int k = 0; k < r->nlooking; k++) {
        mvz_replay_slot *s = &r->slots[r->looking[k]];
        if (a->kind == MVZ_KIND_BLOCK && a->thread_idx == s->look_thread &&
            a->address - s->look_lo < s->look_size) {
            s->block = *a;
            s->has_block = 1;
            s->look_left = 0;
        } else if (--s->look_left > 0) {
            r->looking[keep++] = r->looking[k];
        }
    }
    r->nlooking = keep;
}

/* The store dates a block when it was asked for, before the segment made for
 * it, but the file has the block after that segment. So when a segment makes
 * the peak, the block its thread asked for, inside it, is live at the peak
 * (as in the live tracker's peak). */
static void look_for_block(mvz_replayer *r, int d, const mvz_alloc *peak)
{
    mvz_replay_slot *s = &r->slots[d];
    s->has_block = 0;
    if (peak->kind == MVZ_KIND_BLOCK)
        return;
    if (s->look_left <= 0)
        r->looking[r->nlooking++] = (uint8_t)d;
    s->look_left = MVZ_REPLAY_LOOKAHEAD;
    s->look_thread = peak->thread_idx;
    s->look_lo = peak->address;
    s->look_size = peak->size;
}

int mvz_replay_event(mvz_replayer *r, const mvz_event *e, mvz_alloc *ended)
{
    uint64_t i = r->n++;
    if (e->op == MVZ_EV_TIME) {
        r->ts = e->address;
        return 0;
    }
    r->ts += e->ts_delta;
    int d = (uint8_t)e->device;
    mvz_replay_slot *s = r->summary ? &r->slots[d] : NULL;
    if (e->op == MVZ_EV_GAP) {
        if (s)
            r->dropped += e->address;
        return 0;
    }
    if (e->op == MVZ_EV_FAILED) {
        if (s) {
            s->present = 1;
            s->failed++;
            if (mvz_grow((void **)&r->fails, &r->capfails, r->nfails + 1, sizeof *r->fails))
                return -1;
            fill(&r->fails[r->nfails++], e, i, r->ts);
        }
        return 0;
    }
    if (e->op != MVZ_EV_ALLOC && e->op != MVZ_EV_FREE)
        return 0;
    int is_alloc = e->op == MVZ_EV_ALLOC, k = e->kind, found, ret = 0;
    if (s) {
        if (is_alloc) {
            s->allocs++;
            s->alloc_bytes += e->size;
        } else {
            s->frees++;
        }
    }
    size_t at = mvz_livetab_find(&r->live, e->address, k, &found);
    if (found) { /* its FREE (or, for an ALLOC, the free it was not seen to have) */
        const mvz_alloc *a = mvz_livetab_at(&r->live, at);
        *ended = *a;
        ret = 1;
        if (r->summary) {
            mvz_replay_slot *o = &r->slots[(uint8_t)a->slot];
            if (a->kind == MVZ_KIND_BLOCK) {
                mvz_accounting_free(&o->bt, a->size); /* the tensor peak's totals */
                if (((a->flags | e->flags) & (MVZ_FLAG_STREAM | MVZ_FLAG_MEMVIZ)) == MVZ_FLAG_STREAM)
                    r->stream_frees++; /* not memviz's own probe's */
            } else {
                /* The timeline follows the totals, as the store's does: a
                 * block lies inside a segment the totals hold, so it is no
                 * change. */
                mvz_accounting_free(&o->t, a->size);
                o->level -= (mvz_wide)a->size;
                if (series_push(&o->series, i, r->ts, o->level))
                    return -1;
            }
            o->live_all--;
            if (graves_on_end(r, a, i))
                return -1;
        }
        mvz_livetab_remove(&r->live, at);
    }
    if (!is_alloc)
        return ret;
    int room = live_room(r);
    if (room < 0)
        return -1;
    if (room > 0 || found)
        at = mvz_livetab_find(&r->live, e->address, k, &found);
    mvz_alloc *a = mvz_livetab_insert(&r->live, at);
    fill(a, e, i, r->ts);
    if (!s)
        return ret;
    s->present = 1;
    s->live_all++;
    if (r->nlooking)
        look_at(r, a);
    if (k == MVZ_KIND_BLOCK) {
        if (block_add(r, e->address, d))
            return -1;
        if (mvz_accounting_alloc(&s->bt, e->size, i)) { /* the tensor peak */
            s->tpeak_index = (int64_t)i;
            s->tpeak_ts = r->ts;
            r->bound += s->live_all - s->tpeak_all;
            s->tpeak_all = s->live_all;
        }
        return ret;
    }
    if (mvz_accounting_alloc(&s->t, e->size, i)) {
        s->peak_index = (int64_t)i;
        s->peak_ts = r->ts;
        r->bound += s->live_all - s->peak_all;
        s->peak_all = s->live_all;
        look_for_block(r, d, a);
    }
    s->level += (mvz_wide)e->size;
    if (series_push(&s->series, i, r->ts, s->level))
        return -1;
    return ret;
}

#define BATCH 64

int mvz_replay_chunk(mvz_replayer *r, const uint8_t *records, size_t count, size_t width,
                     int layout, size_t start, size_t stop, mvz_replay_visit visit, void *ctx)
{
    mvz_event ev[BATCH];
    uint64_t f[BATCH];
    if (stop > count)
        stop = count;
    for (size_t k = start; k < stop; k += BATCH) {
        size_t m = stop - k < BATCH ? stop - k : BATCH;
        if (layout == 0) {
            for (size_t i = 0; i < m; i++)
                mvz_event_read(records + (k + i) * width, width, &ev[i]);
        } else { /* byte planes: field by field (record.h) */
            mvz_event_read_planes(records, count, width, k, m, ev, f);
        }
        for (size_t i = 0; i < m; i++) {
            mvz_alloc ended;
            int rc = mvz_replay_event(r, &ev[i], &ended);
            if (rc < 0 || (visit && visit(ctx, &ev[i], r->n - 1, r->ts, rc ? &ended : NULL)))
                return -1;
        }
    }
    return 0;
}

/* ---- whole columns at once --------------------------------------------------------- */

static int by_size_t(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return x < y ? -1 : x > y;
}

int mvz_replay_columns(size_t n, const uint8_t *op, const uint64_t *address, const uint64_t *size,
               const uint8_t *kind, const int8_t *device, mvz_replay_result *out)
{
    memset(out->end, 0, n * sizeof *out->end);
    out->live = NULL;
    out->nlive = 0;
    mvz_replayer r;
    if (mvz_replay_init(&r, 0, 1))
        return -1;
    int rc = -1;
    for (size_t i = 0; i < n; i++) {
        mvz_event e;
        memset(&e, 0, sizeof e);
        e.op = op[i];
        e.kind = kind[i];
        e.device = device[i];
        e.address = address[i];
        e.size = size[i];
        mvz_alloc ended;
        int got = mvz_replay_event(&r, &e, &ended);
        if (got < 0)
            goto done;
        if (got)
            out->end[MVZ_REPLAY_INDEX(&ended)] = (int64_t)i;
    }
    out->live = malloc((r.live.count ? r.live.count : 1) * sizeof *out->live);
    if (!out->live)
        goto done;
    for (size_t k = 0; k < r.live.count; k++)
        out->live[k] = (size_t)MVZ_REPLAY_INDEX(&r.live.allocs[k]);
    out->nlive = r.live.count;
    qsort(out->live, out->nlive, sizeof *out->live, by_size_t);
    for (int d = 0; d < MVZ_REPLAY_SLOTS; d++) {
        out->current[d] = r.slots[d].t.current;
        out->peak[d] = r.slots[d].t.peak;
        out->peak_index[d] = r.slots[d].peak_index;
    }
    rc = 0;
done:
    mvz_replay_release(&r);
    return rc;
}
