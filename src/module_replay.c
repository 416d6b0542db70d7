/* memviz._core.Replayer: a loaded trace's events streamed through the
 * store's rules (replay.h), one EVENTS chunk at a time, so a reader keeps
 * no per-event columns. Every method runs with the GIL; feed() lets it go
 * while it replays (the replayer is touched by one call at a time: a call
 * made while another runs is refused).
 *
 * Calls down only: replay, replay_categories (and the livetab and record
 * types they use).
 * module.c adds the type to the module (mvz_module_replay_init).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "bind.h"
#include "hash.h"
#include "replay.h"
#include "replay_categories.h"

typedef struct {
    PyObject_HEAD
    mvz_replayer r;
    int ready, busy, finished;
    /* feed_at(): the allocations that ended after at_ns, made at or before it */
    mvz_alloc *at_rows;
    size_t nat, capat;
    uint64_t at_ns;
    /* feed_categories(): live bytes per category (start_categories() makes it) */
    mvz_replay_categories *cats;
    int cats_done;
    size_t width; /* bytes of the file's records (record.h: older formats are shorter) */
    /* feed_columns(): the number of each live allocation, by the index of
     * its ALLOC event (open addressing, linear probing; key 0: empty) */
    uint64_t *idkeys;
    int64_t *idvals;
    size_t idcap, idcount;
    /* the numbers: (step marks before the event) << 32 | its order since the last one */
    uint64_t *marks; /* the step marks' times, sorted (number_by_steps) */
    size_t nmarks, marks_before;
    int64_t next_id; /* the number the next ALLOC or FAILED event gets */
} Replayer;

static int check(Replayer *self)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Replayer: not initialised");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Replayer: another call is replaying");
        return -1;
    }
    return 0;
}

static int replayer_init(Replayer *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"start_ns", "summary", "width", NULL};
    unsigned long long start = 0;
    int summary = 1;
    Py_ssize_t width = MVZ_EVENT_SIZE;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|Kpn:Replayer", kw, &start, &summary, &width))
        return -1;
    if (width < MVZ_EVENT_V1_SIZE || width > 4096) {
        PyErr_Format(PyExc_ValueError, "Replayer: records of %zd bytes are not a trace's", width);
        return -1;
    }
    self->width = (size_t)width;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Replayer: already initialised");
        return -1;
    }
    if (mvz_replay_init(&self->r, start, summary)) {
        PyErr_NoMemory();
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void replayer_dealloc(Replayer *self)
{
    if (self->ready)
        mvz_replay_release(&self->r);
    free(self->at_rows);
    free(self->idkeys);
    free(self->idvals);
    free(self->marks);
    if (self->cats) {
        mvz_replay_categories_release(self->cats);
        free(self->cats);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The records of a chunk: buffer `buf` holds `count` records of the
 * replayer's width from byte `offset`, in `layout` (0: one after another,
 * 1: byte planes). */
typedef struct {
    Py_buffer view;
    const uint8_t *records;
    size_t count, start, stop;
    int layout;
} chunk_args;

static int chunk_get(PyObject *args, chunk_args *c, size_t width)
{
    PyObject *buf;
    Py_ssize_t offset, count, start = 0, stop = -1;
    int layout;
    memset(c, 0, sizeof *c);
    if (!PyArg_ParseTuple(args, "Onni|nn", &buf, &offset, &count, &layout, &start, &stop))
        return -1;
    if (PyObject_GetBuffer(buf, &c->view, PyBUF_SIMPLE) < 0)
        return -1;
    if (offset < 0 || count < 0 || (layout != 0 && layout != 1) ||
        offset > c->view.len || (size_t)count > (size_t)(c->view.len - offset) / width) {
        PyErr_Format(PyExc_ValueError, "Replayer: %zd records of layout %d from byte %zd do not "
                     "fit a buffer of %zd bytes", count, layout, offset, c->view.len);
        PyBuffer_Release(&c->view);
        return -1;
    }
    c->records = (const uint8_t *)c->view.buf + offset;
    c->count = (size_t)count;
    c->layout = layout;
    c->start = start < 0 ? 0 : (size_t)start;
    c->stop = stop < 0 || stop > count ? (size_t)count : (size_t)stop;
    return 0;
}

/* feed(buf, offset, count, layout[, start, stop]): replay those records. */
static PyObject *replayer_feed(Replayer *self, PyObject *args)
{
    chunk_args c;
    if (check(self) || chunk_get(args, &c, self->width))
        return NULL;
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = mvz_replay_chunk(&self->r, c.records, c.count, self->width, c.layout, c.start,
                                                 c.stop, NULL, NULL);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&c.view);
    if (rc)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int at_visit(void *ctx, const mvz_event *e, uint64_t index, uint64_t ts,
                    const mvz_alloc *ended)
{
    (void)e;
    (void)index;
    Replayer *self = ctx;
    if (!ended || MVZ_REPLAY_TIME(ended) > self->at_ns || ts <= self->at_ns)
        return 0;
    if (self->nat == self->capat) {
        size_t ncap = self->capat ? 2 * self->capat : 256;
        mvz_alloc *p = realloc(self->at_rows, ncap * sizeof *p);
        if (!p)
            return -1;
        self->at_rows = p;
        self->capat = ncap;
    }
    self->at_rows[self->nat++] = *ended;
    return 0;
}

/* feed_at(buf, offset, count, layout, at_ns): replay, keeping what was live
 * at at_ns and ended later (at(at_ns) reads it with what is still live). */
static PyObject *replayer_feed_at(Replayer *self, PyObject *args)
{
    PyObject *buf;
    Py_ssize_t offset, count;
    int layout;
    unsigned long long at;
    if (!PyArg_ParseTuple(args, "OnniK", &buf, &offset, &count, &layout, &at))
        return NULL;
    PyObject *rest = Py_BuildValue("(Onni)", buf, offset, count, layout);
    if (!rest)
        return NULL;
    chunk_args c;
    int bad = check(self) || chunk_get(rest, &c, self->width);
    Py_DECREF(rest);
    if (bad)
        return NULL;
    if (self->nat && self->at_ns != at) {
        PyBuffer_Release(&c.view);
        PyErr_SetString(PyExc_ValueError, "Replayer.feed_at: one at_ns per replayer");
        return NULL;
    }
    self->at_ns = at;
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = mvz_replay_chunk(&self->r, c.records, c.count, self->width, c.layout, 0,
                                                 c.count, at_visit, self);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&c.view);
    if (rc)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *signed_wide(mvz_wide v)
{
    if (v >= INT64_MIN && v <= INT64_MAX)
        return PyLong_FromLongLong((long long)v);
#if defined(__SIZEOF_INT128__)
    /* (hi << 64) + lo, where hi is signed */
    PyObject *hi = PyLong_FromLongLong((long long)(v >> 64));
    PyObject *lo = PyLong_FromUnsignedLongLong((unsigned long long)(uint64_t)v);
    PyObject *shift = PyLong_FromLong(64);
    PyObject *up = hi && shift ? PyNumber_Lshift(hi, shift) : NULL;
    PyObject *out = up && lo ? PyNumber_Add(up, lo) : NULL;
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_XDECREF(shift);
    Py_XDECREF(up);
    return out;
#else
    return PyLong_FromLongLong((long long)v);
#endif
}

static PyObject *unsigned_wide(mvz_uwide v)
{
    if (v <= UINT64_MAX)
        return PyLong_FromUnsignedLongLong((unsigned long long)v);
#if defined(__SIZEOF_INT128__)
    PyObject *hi = PyLong_FromUnsignedLongLong((unsigned long long)(v >> 64));
    PyObject *lo = PyLong_FromUnsignedLongLong((unsigned long long)(uint64_t)v);
    PyObject *shift = PyLong_FromLong(64);
    PyObject *up = hi && shift ? PyNumber_Lshift(hi, shift) : NULL;
    PyObject *out = up && lo ? PyNumber_Add(up, lo) : NULL;
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_XDECREF(shift);
    Py_XDECREF(up);
    return out;
#else
    return PyLong_FromUnsignedLongLong((unsigned long long)v);
#endif
}

/* An allocation as a row of model/rows.py's ROW_FIELDS, with the label id
 * where the label goes (the reader names it) and the time as seq. */
static PyObject *row(const mvz_alloc *a)
{
    return Py_BuildValue("(KKiiiIIKIKKi)", (unsigned long long)a->address,
                         (unsigned long long)a->size, (int)(int8_t)(uint8_t)a->slot, (int)a->kind,
                         0, (unsigned)a->thread_idx, (unsigned)a->label_id,
                         (unsigned long long)MVZ_REPLAY_TIME(a), (unsigned)a->stack_id,
                         (unsigned long long)MVZ_REPLAY_TIME(a),
                         (unsigned long long)(a->size - a->slack), (int)a->flags);
}

static PyObject *rows(const mvz_alloc *a, long n)
{
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *list = PyList_New(n);
    for (long k = 0; list && k < n; k++) {
        PyObject *v = row(&a[k]);
        if (!v)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, k, v);
    }
    return list;
}

typedef struct {
    PyObject *list;
} events_ctx;

static int events_visit(void *ctx, const mvz_event *e, uint64_t index, uint64_t ts,
                        const mvz_alloc *ended)
{
    (void)index;
    if (e->op != MVZ_EV_ALLOC && e->op != MVZ_EV_FREE && e->op != MVZ_EV_FAILED)
        return 0;
    events_ctx *c = ctx;
    PyObject *item;
    if (e->op == MVZ_EV_FREE && ended) /* the allocation it ended, as it was made */
        item = Py_BuildValue("(iKKKKiiIIKIKiK)", e->op, (unsigned long long)ts,
                             (unsigned long long)MVZ_REPLAY_TIME(ended),
                             (unsigned long long)ended->address, (unsigned long long)ended->size,
                             (int)(int8_t)(uint8_t)ended->slot, (int)ended->kind,
                             (unsigned)ended->thread_idx, (unsigned)ended->label_id,
                             (unsigned long long)MVZ_REPLAY_TIME(ended), (unsigned)ended->stack_id,
                             (unsigned long long)(ended->size - ended->slack), (int)ended->flags,
                             (unsigned long long)e->stream);
    else {
        PyObject *seq = e->op == MVZ_EV_FREE ? Py_NewRef(Py_None)
                                              : PyLong_FromUnsignedLongLong((unsigned long long)ts);
        item = seq ? Py_BuildValue("(iKNKKiiIIKIKiK)", e->op, (unsigned long long)ts, seq,
                                   (unsigned long long)e->address, (unsigned long long)e->size,
                                   (int)e->device, (int)e->kind, (unsigned)e->thread_idx,
                                   (unsigned)e->label_id, (unsigned long long)ts,
                                   (unsigned)e->stack_id,
                                   (unsigned long long)(e->size - e->slack), (int)e->flags,
                                   (unsigned long long)e->stream)
                   : NULL;
    }
    if (!item || PyList_Append(c->list, item) < 0) {
        Py_XDECREF(item);
        return -1;
    }
    Py_DECREF(item);
    return 0;
}

/* feed_events(buf, offset, count, layout[, start, stop]) -> [(op, ts, seq,
 * address, size, device, kind, thread, label id, made ts, stack id, requested,
 * flags, stream)] of the
 * ALLOC, FREE and FAILED records among them; a FREE carries the allocation
 * it ended (seq None and its own fields when it ended none). With the GIL
 * throughout (it builds the list as it goes). */
static PyObject *replayer_feed_events(Replayer *self, PyObject *args)
{
    chunk_args c;
    if (check(self) || chunk_get(args, &c, self->width))
        return NULL;
    events_ctx ctx = {PyList_New(0)};
    if (!ctx.list) {
        PyBuffer_Release(&c.view);
        return NULL;
    }
    self->busy = 1;
    int rc = mvz_replay_chunk(&self->r, c.records, c.count, self->width, c.layout, c.start, c.stop,
                              events_visit, &ctx);
    self->busy = 0;
    PyBuffer_Release(&c.view);
    if (rc) {
        Py_DECREF(ctx.list);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    return ctx.list;
}

/* ---- feed_columns: the events as columns, for the Parquet export ---------------------- */

/* The numbers of the live allocations: ALLOC event index -> number. */
static size_t id_slot(const Replayer *self, uint64_t key)
{
    size_t mask = self->idcap - 1, i = (size_t)mvz_mix64(key) & mask;
    while (self->idkeys[i] && self->idkeys[i] != key)
        i = (i + 1) & mask;
    return i;
}

static int id_put(Replayer *self, uint64_t index, int64_t id)
{
    if ((self->idcount + 1) * 2 > self->idcap) { /* at most half full */
        size_t cap = self->idcap ? self->idcap * 2 : 1024;
        uint64_t *keys = self->idkeys, *nk = calloc(cap, sizeof *nk);
        int64_t *vals = self->idvals, *nv = malloc(cap * sizeof *nv);
        if (!nk || !nv) {
            free(nk);
            free(nv);
            return -1;
        }
        size_t old = self->idcap;
        self->idkeys = nk, self->idvals = nv, self->idcap = cap;
        for (size_t k = 0; k < old; k++)
            if (keys[k]) {
                size_t j = id_slot(self, keys[k]);
                nk[j] = keys[k], nv[j] = vals[k];
            }
        free(keys);
        free(vals);
    }
    size_t i = id_slot(self, index + 1);
    if (!self->idkeys[i])
        self->idcount++;
    self->idkeys[i] = index + 1, self->idvals[i] = id;
    return 0;
}

/* The number of the allocation whose ALLOC event was `index`, forgotten
 * (-1: none); backward-shift deletion keeps the probe runs whole. */
static int64_t id_take(Replayer *self, uint64_t index)
{
    if (!self->idcount)
        return -1;
    size_t mask = self->idcap - 1, i = id_slot(self, index + 1);
    if (!self->idkeys[i])
        return -1;
    int64_t id = self->idvals[i];
    self->idcount--;
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        if (!self->idkeys[j])
            break;
        size_t home = (size_t)mvz_mix64(self->idkeys[j]) & mask;
        /* j's entry may move to i when its home is not within (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            self->idkeys[i] = self->idkeys[j], self->idvals[i] = self->idvals[j];
            i = j;
        }
    }
    self->idkeys[i] = 0;
    return id;
}

enum { COL_OP, COL_TS, COL_ID, COL_VALID, COL_ADDR, COL_SIZE, COL_DEV, COL_KIND, COL_THREAD, COL_LABEL,
       COL_MADE, COL_STACK, COL_REQ, COL_FLAGS, COL_STREAM, NCOLS };
static const size_t col_width[NCOLS] = {1, 8, 8, 0, 8, 8, 2, 1, 4, 4, 8, 8, 8, 1, 8};

typedef struct {
    Replayer *self;
    uint8_t *col[NCOLS];
    size_t n, nulls;
    int failed; /* out of memory */
} columns_ctx;

#define PUT(c, k, type, v) (((type *)(c)->col[k])[(c)->n] = (type)(v))

static int columns_visit(void *ctx, const mvz_event *e, uint64_t index, uint64_t ts,
                         const mvz_alloc *ended)
{
    columns_ctx *c = ctx;
    Replayer *self = c->self;
    if (ended && e->op != MVZ_EV_FREE) /* an ALLOC at a live allocation's address ended it */
        (void)id_take(self, MVZ_REPLAY_INDEX(ended));
    if (e->op != MVZ_EV_ALLOC && e->op != MVZ_EV_FREE && e->op != MVZ_EV_FAILED)
        return 0;
    int64_t id;
    if (e->op == MVZ_EV_FREE)
        id = ended ? id_take(self, MVZ_REPLAY_INDEX(ended)) : -1;
    else {
        size_t before = self->marks_before;
        while (before < self->nmarks && self->marks[before] < ts)
            before++;
        if (before != self->marks_before) { /* a new step: its allocations counted from 0 */
            self->marks_before = before;
            self->next_id = (int64_t)((uint64_t)before << 32);
        }
        id = self->next_id++;
        if (e->op == MVZ_EV_ALLOC && id_put(self, index, id)) {
            c->failed = 1;
            return -1;
        }
    }
    /* a FREE that ended an allocation: the allocation's fields, as it was made */
    const int as_made = e->op == MVZ_EV_FREE && ended;
    PUT(c, COL_OP, uint8_t, e->op);
    PUT(c, COL_TS, int64_t, ts);
    PUT(c, COL_ID, int64_t, id < 0 ? 0 : id);
    if (id < 0)
        c->nulls++;
    else
        c->col[COL_VALID][c->n >> 3] |= (uint8_t)(1u << (c->n & 7));
    PUT(c, COL_STREAM, uint64_t, e->stream);
    if (as_made) {
        PUT(c, COL_ADDR, uint64_t, ended->address);
        PUT(c, COL_SIZE, int64_t, ended->size);
        PUT(c, COL_DEV, int16_t, (int8_t)(uint8_t)ended->slot);
        PUT(c, COL_KIND, uint8_t, ended->kind);
        PUT(c, COL_THREAD, int32_t, ended->thread_idx);
        PUT(c, COL_LABEL, uint32_t, ended->label_id);
        PUT(c, COL_MADE, uint64_t, MVZ_REPLAY_TIME(ended));
        PUT(c, COL_STACK, int64_t, ended->stack_id);
        PUT(c, COL_REQ, int64_t, ended->size - ended->slack);
        PUT(c, COL_FLAGS, uint8_t, ended->flags);
    } else {
        PUT(c, COL_ADDR, uint64_t, e->address);
        PUT(c, COL_SIZE, int64_t, e->size);
        PUT(c, COL_DEV, int16_t, e->device);
        PUT(c, COL_KIND, uint8_t, e->kind);
        PUT(c, COL_THREAD, int32_t, e->thread_idx);
        PUT(c, COL_LABEL, uint32_t, e->label_id);
        PUT(c, COL_MADE, uint64_t, e->op == MVZ_EV_FREE ? 0 : ts);
        PUT(c, COL_STACK, int64_t, e->stack_id);
        PUT(c, COL_REQ, int64_t, e->size - e->slack);
        PUT(c, COL_FLAGS, uint8_t, e->flags);
    }
    c->n++;
    return 0;
}

static int by_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* number_by_steps(marks): feed_columns numbers the allocations of each step
 * apart: marks, the step marks' times (uint64, native order, in a bytes-like
 * object). Before any event is fed. */
static PyObject *replayer_number_by_steps(Replayer *self, PyObject *args)
{
    Py_buffer view;
    if (check(self) || !PyArg_ParseTuple(args, "y*", &view))
        return NULL;
    if (self->r.n || view.len % 8) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, self->r.n ? "number_by_steps: events were fed already"
                                                    : "number_by_steps: 8 bytes a mark");
        return NULL;
    }
    size_t n = (size_t)view.len / 8;
    uint64_t *marks = malloc(n * 8 + 8);
    if (!marks) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    memcpy(marks, view.buf, n * 8);
    PyBuffer_Release(&view);
    qsort(marks, n, sizeof *marks, by_u64);
    free(self->marks);
    self->marks = marks, self->nmarks = n, self->marks_before = 0, self->next_id = 0;
    Py_RETURN_NONE;
}

/* feed_columns(buf, offset, count, layout[, start, stop]) -> (n, op, ts,
 * alloc id, its validity, address, size, device, kind, thread, label id,
 * made ts, stack id, requested, flags, stream): feed_events' rows as
 * columns, each a bytes object of n little-endian values (op, kind, flags:
 * uint8; ts, alloc id, size, stack id, requested: int64; address, made ts,
 * stream: uint64; device: int16; thread: int32; label id: uint32; the
 * validity: a bitmap, bit i of byte i/8 set when row i has an alloc id).
 * The alloc id numbers the ALLOC and FAILED events 0, 1, 2 ... through the
 * replayer's calls, each step's from (step marks before it) << 32 with
 * number_by_steps (so that a training loop's steps, alike, number their
 * allocations alike: their frees' numbers repeat and compress), and a FREE
 * carries its allocation's (none: not valid);
 * made ts: 0 for a FREE that ended nothing. */
static PyObject *replayer_feed_columns(Replayer *self, PyObject *args)
{
    chunk_args a;
    if (check(self) || chunk_get(args, &a, self->width))
        return NULL;
    size_t most = a.stop > a.start ? a.stop - a.start : 0;
    columns_ctx c;
    memset(&c, 0, sizeof c);
    c.self = self;
    PyObject *out = NULL;
    for (int k = 0; k < NCOLS; k++) {
        size_t bytes = k == COL_VALID ? most / 8 + 1 : most * col_width[k] + 1;
        if (!(c.col[k] = k == COL_VALID ? calloc(bytes, 1) : malloc(bytes))) {
            PyErr_NoMemory();
            goto done;
        }
    }
    self->busy = 1;
    int rc = mvz_replay_chunk(&self->r, a.records, a.count, self->width, a.layout, a.start, a.stop,
                              columns_visit, &c);
    self->busy = 0;
    if (rc) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    out = PyTuple_New(NCOLS + 2);
    if (!out)
        goto done;
    PyTuple_SET_ITEM(out, 0, PyLong_FromSize_t(c.n));
    for (int k = 0; k < NCOLS; k++) {
        size_t bytes = k == COL_VALID ? (c.n + 7) / 8 : c.n * col_width[k];
        PyObject *b = PyBytes_FromStringAndSize((const char *)c.col[k], (Py_ssize_t)bytes);
        if (!b) {
            Py_CLEAR(out);
            goto done;
        }
        PyTuple_SET_ITEM(out, k + 1, b);
    }
    PyTuple_SET_ITEM(out, NCOLS + 1, PyLong_FromSize_t(c.nulls));
    if (!PyTuple_GET_ITEM(out, 0) || !PyTuple_GET_ITEM(out, NCOLS + 1))
        Py_CLEAR(out);
done:
    for (int k = 0; k < NCOLS; k++)
        free(c.col[k]);
    PyBuffer_Release(&a.view);
    return out;
}

static PyObject *replayer_live(Replayer *self, PyObject *unused)
{
    (void)unused;
    if (check(self))
        return NULL;
    mvz_alloc *a = NULL;
    long n = mvz_replay_live(&self->r, &a);
    PyObject *out = rows(a, n);
    free(a);
    return out;
}

static int by_replay_index(const void *x, const void *y)
{
    uint64_t a = MVZ_REPLAY_INDEX((const mvz_alloc *)x), b = MVZ_REPLAY_INDEX((const mvz_alloc *)y);
    return a < b ? -1 : a > b;
}

/* at() -> rows live at feed_at's at_ns: made at or before it, ended after
 * it or never, in the order of their ALLOC events. */
static PyObject *replayer_at(Replayer *self, PyObject *unused)
{
    (void)unused;
    if (check(self))
        return NULL;
    mvz_alloc *a = malloc((self->nat + self->r.live.count + 1) * sizeof *a);
    if (!a)
        return PyErr_NoMemory();
    size_t m = self->nat;
    if (m)
        memcpy(a, self->at_rows, m * sizeof *a);
    for (size_t k = 0; k < self->r.live.count; k++)
        if (MVZ_REPLAY_TIME(&self->r.live.allocs[k]) <= self->at_ns)
            a[m++] = self->r.live.allocs[k];
    qsort(a, m, sizeof *a, by_replay_index);
    PyObject *out = rows(a, (long)m);
    free(a);
    return out;
}

static int summary_check(Replayer *self)
{
    if (check(self))
        return -1;
    if (!self->r.summary) {
        PyErr_SetString(PyExc_RuntimeError, "Replayer: made without summary=True");
        return -1;
    }
    if (!self->finished) {
        mvz_replay_finish(&self->r);
        self->finished = 1;
    }
    return 0;
}

/* peak(device=None, tensor=False) -> rows live at the device's peak (None:
 * each device at its own; with tensor, at the peak of PyTorch's blocks), in
 * the order of their ALLOC events. */
static PyObject *replayer_peak(Replayer *self, PyObject *args)
{
    PyObject *dev = Py_None;
    int tensor = 0;
    if (!PyArg_ParseTuple(args, "|Op", &dev, &tensor) || summary_check(self))
        return NULL;
    int slot = -1;
    if (dev != Py_None) {
        long d = PyLong_AsLong(dev);
        if (d == -1 && PyErr_Occurred())
            return NULL;
        if (d < -128 || d > 127)
            return PyList_New(0);
        slot = (uint8_t)(int8_t)d;
    }
    mvz_alloc *a = NULL;
    long n = mvz_replay_peak_set_of(&self->r, slot, tensor, &a);
    PyObject *out = rows(a, n);
    free(a);
    return out;
}

/* graves() -> (held, bound): the freed allocations kept for the peak sets,
 * and what the peak sets can need (tests of the graveyard's bound). */
static PyObject *replayer_graves(Replayer *self, PyObject *unused)
{
    (void)unused;
    if (summary_check(self))
        return NULL;
    return Py_BuildValue("(KK)", (unsigned long long)self->r.ngraves, (unsigned long long)self->r.bound);
}

/* failures() -> rows of the FAILED events (address: the driver's result). */
static PyObject *replayer_failures(Replayer *self, PyObject *unused)
{
    (void)unused;
    if (summary_check(self))
        return NULL;
    return rows(self->r.fails, (long)self->r.nfails);
}

static int set_item(PyObject *d, const char *key, PyObject *v)
{
    if (!v)
        return -1;
    int rc = PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
    return rc;
}

/* devices() -> {device: {...}} of the devices an ALLOC or FAILED event
 * named: current, peak (the store's rules), peak_index, peak_ts, allocs,
 * frees, failed, alloc_bytes (events of every kind), live (allocations
 * live at the end, blocks too), changes (timeline changes), and PyTorch's
 * blocks' own: tensor_current, tensor_peak, tensor_peak_index,
 * tensor_peak_ts. */
static PyObject *replayer_devices(Replayer *self, PyObject *unused)
{
    (void)unused;
    if (summary_check(self))
        return NULL;
    PyObject *out = PyDict_New();
    uint64_t live[MVZ_REPLAY_SLOTS] = {0};
    for (size_t k = 0; k < self->r.live.count; k++)
        live[(uint8_t)self->r.live.allocs[k].slot]++;
    for (int dev = -128; out && dev < 128; dev++) {
        const mvz_replay_slot *s = &self->r.slots[(uint8_t)(int8_t)dev];
        if (!s->present)
            continue;
        PyObject *d = PyDict_New(), *key = PyLong_FromLong(dev);
        if (!d || !key || set_item(d, "current", PyLong_FromUnsignedLongLong(s->t.current)) ||
            set_item(d, "peak", PyLong_FromUnsignedLongLong(s->t.peak)) ||
            set_item(d, "peak_index", PyLong_FromLongLong(s->peak_index)) ||
            set_item(d, "peak_ts", PyLong_FromUnsignedLongLong(s->peak_ts)) ||
            set_item(d, "allocs", PyLong_FromUnsignedLongLong(s->allocs)) ||
            set_item(d, "frees", PyLong_FromUnsignedLongLong(s->frees)) ||
            set_item(d, "failed", PyLong_FromUnsignedLongLong(s->failed)) ||
            set_item(d, "alloc_bytes", unsigned_wide(s->alloc_bytes)) ||
            set_item(d, "live", PyLong_FromUnsignedLongLong(live[(uint8_t)(int8_t)dev])) ||
            set_item(d, "changes", PyLong_FromUnsignedLongLong(s->series.changes)) ||
            set_item(d, "tensor_current", PyLong_FromUnsignedLongLong(s->bt.current)) ||
            set_item(d, "tensor_peak", PyLong_FromUnsignedLongLong(s->bt.peak)) ||
            set_item(d, "tensor_peak_index", PyLong_FromLongLong(s->tpeak_index)) ||
            set_item(d, "tensor_peak_ts", PyLong_FromUnsignedLongLong(s->tpeak_ts)) ||
            PyDict_SetItem(out, key, d) < 0)
            Py_CLEAR(out);
        Py_XDECREF(d);
        Py_XDECREF(key);
    }
    return out;
}

/* timeline() -> {device: (changes, [(event index, ts, level), ...])} of
 * every device an ALLOC or FREE event named: each point the highest of its
 * bucket of consecutive changes (all of them while they fit
 * MVZ_REPLAY_POINTS). */
static PyObject *replayer_timeline(Replayer *self, PyObject *unused)
{
    (void)unused;
    if (summary_check(self))
        return NULL;
    PyObject *out = PyDict_New();
    for (int dev = -128; out && dev < 128; dev++) {
        const mvz_replay_series *s = &self->r.slots[(uint8_t)(int8_t)dev].series;
        if (!s->changes)
            continue;
        PyObject *list = PyList_New((Py_ssize_t)s->n), *key = PyLong_FromLong(dev);
        for (size_t k = 0; list && k < s->n; k++) {
            const mvz_replay_point *p = &s->points[k];
            PyObject *lv = signed_wide(p->level);
            PyObject *v = lv ? Py_BuildValue("(KKN)", (unsigned long long)p->index,
                                             (unsigned long long)p->ts, lv) : NULL;
            if (!v)
                Py_CLEAR(list);
            else
                PyList_SET_ITEM(list, (Py_ssize_t)k, v);
        }
        PyObject *pair = list ? Py_BuildValue("(KO)", (unsigned long long)s->changes, list) : NULL;
        if (!pair || !key || PyDict_SetItem(out, key, pair) < 0)
            Py_CLEAR(out);
        Py_XDECREF(pair);
        Py_XDECREF(list);
        Py_XDECREF(key);
    }
    return out;
}

/* blocks() -> {device: [addresses of PyTorch's blocks, ascending]}. */
static PyObject *replayer_blocks(Replayer *self, PyObject *unused)
{
    (void)unused;
    if (summary_check(self))
        return NULL;
    PyObject *out = PyDict_New();
    int seen[MVZ_REPLAY_SLOTS] = {0};
    for (size_t k = 0; k < self->r.bcap; k++)
        if (self->r.bslot[k])
            seen[self->r.bslot[k] - 1] = 1;
    for (int dev = -128; out && dev < 128; dev++) {
        int slot = (uint8_t)(int8_t)dev;
        if (!seen[slot])
            continue;
        uint64_t *addrs = NULL;
        long n = mvz_replay_block_addresses(&self->r, slot, &addrs);
        PyObject *list = n >= 0 ? PyList_New(n) : PyErr_NoMemory();
        for (long k = 0; list && k < n; k++) {
            PyObject *v = PyLong_FromUnsignedLongLong(addrs[k]);
            if (!v)
                Py_CLEAR(list);
            else
                PyList_SET_ITEM(list, k, v);
        }
        free(addrs);
        PyObject *key = PyLong_FromLong(dev);
        if (!list || !key || PyDict_SetItem(out, key, list) < 0)
            Py_CLEAR(out);
        Py_XDECREF(list);
        Py_XDECREF(key);
    }
    return out;
}

/* start_categories(ncat, known, limit): live bytes per category from here on
 * (replay_categories.h), with `ncat` categories (0: <unknown>, 1:
 * unused_pool, 2: PyTorch's tensors), `known` an iterable of (device,
 * address, ts, kind, category) of the allocations the snapshots gave a
 * category, and `limit` points per series (0: all). */
static PyObject *replayer_start_categories(Replayer *self, PyObject *args)
{
    int ncat;
    PyObject *known;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "iOn", &ncat, &known, &limit) || check(self))
        return NULL;
    if (self->cats || self->r.n) {
        PyErr_SetString(PyExc_RuntimeError, "Replayer.start_categories: before any event, once");
        return NULL;
    }
    if (ncat < 3 || ncat > MVZ_REPLAY_CATEGORIES_MAX || limit < 0) {
        PyErr_SetString(PyExc_ValueError, "Replayer.start_categories: 3 to REPLAY_CATEGORIES_MAX "
                                          "categories, a limit >= 0");
        return NULL;
    }
    mvz_replay_categories *c = malloc(sizeof *c);
    if (!c || mvz_replay_categories_init(c, ncat, (size_t)limit)) {
        free(c);
        return PyErr_NoMemory();
    }
    PyObject *it = PyObject_GetIter(known), *item;
    while (it && (item = PyIter_Next(it))) {
        int dev, kind, cat;
        unsigned long long addr, ts;
        int ok = PyArg_ParseTuple(item, "iKKii", &dev, &addr, &ts, &kind, &cat);
        Py_DECREF(item);
        if (!ok)
            break;
        if (dev < -128 || dev > 127 || kind < 0 || kind > 255 || cat < 0 || cat >= ncat) {
            PyErr_SetString(PyExc_ValueError, "Replayer.start_categories: a known entry out of "
                                              "range");
            break;
        }
        if (mvz_replay_categories_known(c, (uint8_t)(int8_t)dev, kind, addr, ts, cat)) {
            PyErr_NoMemory();
            break;
        }
    }
    Py_XDECREF(it);
    if (PyErr_Occurred()) {
        mvz_replay_categories_release(c);
        free(c);
        return NULL;
    }
    self->cats = c;
    Py_RETURN_NONE;
}

/* feed_categories(buf, offset, count, layout): feed, summing live bytes per
 * category (after start_categories). */
static PyObject *replayer_feed_categories(Replayer *self, PyObject *args)
{
    chunk_args c;
    if (check(self))
        return NULL;
    if (!self->cats || self->cats_done) {
        PyErr_SetString(PyExc_RuntimeError, "Replayer.feed_categories: start_categories() first, "
                                            "categories() last");
        return NULL;
    }
    if (chunk_get(args, &c, self->width))
        return NULL;
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = mvz_replay_chunk(&self->r, c.records, c.count, self->width, c.layout, c.start,
                                                 c.stop, mvz_replay_categories_visit, self->cats);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&c.view);
    if (rc)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* categories() -> [(order, device, category, last level, [(ts, level), ...])]:
 * each series of live bytes per category, in time order (order: the
 * how-manieth series to change first). */
static PyObject *replayer_categories(Replayer *self, PyObject *unused)
{
    (void)unused;
    if (check(self))
        return NULL;
    if (!self->cats) {
        PyErr_SetString(PyExc_RuntimeError, "Replayer.categories: start_categories() first");
        return NULL;
    }
    mvz_replay_categories *c = self->cats;
    if (!self->cats_done) {
        self->cats_done = 1;
        mvz_replay_categories_finish(c);
    }
    if (c->failed)
        return PyErr_NoMemory();
    PyObject *out = PyList_New(0);
    for (size_t k = 0; out && k < (size_t)MVZ_REPLAY_SLOTS * (size_t)c->ncat; k++) {
        const mvz_replay_categories_series *s =
            mvz_replay_categories_series_of(c, (int)(k / (size_t)c->ncat), (int)(k % (size_t)c->ncat));
        if (!s)
            continue;
        PyObject *pts = PyList_New((Py_ssize_t)s->n);
        for (size_t j = 0; pts && j < s->n; j++) {
            PyObject *lv = signed_wide(s->points[j].level);
            PyObject *v = lv ? Py_BuildValue("(KN)", (unsigned long long)s->points[j].ts, lv) : NULL;
            if (!v)
                Py_CLEAR(pts);
            else
                PyList_SET_ITEM(pts, (Py_ssize_t)j, v);
        }
        PyObject *cur = pts ? signed_wide(s->cur) : NULL;
        PyObject *item = cur ? Py_BuildValue("(IiiNN)", (unsigned)s->order,
                                             (int)(int8_t)(uint8_t)s->slot, s->cat, cur, pts)
                             : NULL;
        if (!cur)
            Py_XDECREF(pts);
        if (!item || PyList_Append(out, item) < 0)
            Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

static PyObject *get_events(Replayer *self, void *unused)
{
    (void)unused;
    return PyLong_FromUnsignedLongLong(self->ready ? self->r.n : 0);
}

static PyObject *get_ts(Replayer *self, void *unused)
{
    (void)unused;
    return PyLong_FromUnsignedLongLong(self->ready ? self->r.ts : 0);
}

static PyObject *get_stream_frees(Replayer *self, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(self->ready ? self->r.stream_frees : 0);
}

static PyObject *get_dropped(Replayer *self, void *unused)
{
    (void)unused;
    return unsigned_wide(self->ready ? self->r.dropped : 0);
}

static PyMethodDef replayer_methods[] = {
    {"feed", (PyCFunction)replayer_feed, METH_VARARGS,
     "feed(buf, offset, count, layout[, start, stop]): replay records [start, stop) of an EVENTS "
     "chunk's count records at buf[offset:] (layout 0: one after another, 1: byte planes)."},
    {"feed_at", (PyCFunction)replayer_feed_at, METH_VARARGS,
     "feed_at(buf, offset, count, layout, at_ns): feed, keeping what was live at at_ns."},
    {"feed_events", (PyCFunction)replayer_feed_events, METH_VARARGS,
     "feed_events(buf, offset, count, layout[, start, stop]) -> [(op, ts, seq, address, size, "
     "device, kind, thread, label id, made ts, stack id, requested, flags, stream)] of the alloc, "
     "free and failed events."},
    {"feed_columns", (PyCFunction)replayer_feed_columns, METH_VARARGS,
     "feed_columns(buf, offset, count, layout[, start, stop]) -> (n, op, ts, alloc id, validity, "
     "address, size, device, kind, thread, label id, made ts, stack id, requested, flags, stream, "
     "nulls): feed_events' rows as columns of packed values (bytes), the allocations numbered."},
    {"number_by_steps", (PyCFunction)replayer_number_by_steps, METH_VARARGS,
     "number_by_steps(marks): feed_columns numbers each step's allocations from (marks before) << 32; "
     "marks: the step marks' times (uint64 values, native order)."},
    {"live", (PyCFunction)replayer_live, METH_NOARGS, "Rows of the live allocations."},
    {"at", (PyCFunction)replayer_at, METH_NOARGS, "Rows live at feed_at's at_ns."},
    {"peak", (PyCFunction)replayer_peak, METH_VARARGS,  /* peak(device=None, tensor=False) */
     "peak(device=None): rows live at the device's peak (None: each device at its own)."},
    {"failures", (PyCFunction)replayer_failures, METH_NOARGS, "Rows of the FAILED events."},
    {"graves", (PyCFunction)replayer_graves, METH_NOARGS,
     "(held, bound): freed allocations kept for the peak sets, and what those can need."},
    {"devices", (PyCFunction)replayer_devices, METH_NOARGS, "{device: figures}."},
    {"timeline", (PyCFunction)replayer_timeline, METH_NOARGS,
     "{device: (changes, [(event index, ts, level)])}: the bounded timeline."},
    {"blocks", (PyCFunction)replayer_blocks, METH_NOARGS,
     "{device: sorted addresses of every block allocated}."},
    {"start_categories", (PyCFunction)replayer_start_categories, METH_VARARGS,
     "start_categories(ncat, known, limit): sum live bytes per category (and of PyTorch's tensors) "
     "from here on; known: (device, address, ts, kind, category) tuples."},
    {"feed_categories", (PyCFunction)replayer_feed_categories, METH_VARARGS,
     "feed_categories(buf, offset, count, layout): feed, summing live bytes per category."},
    {"categories", (PyCFunction)replayer_categories, METH_NOARGS,
     "[(order, device, category, last level, [(ts, level)])]: the category series."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef replayer_getset[] = {
    {"events", (getter)get_events, NULL, "Events replayed.", NULL},
    {"ts", (getter)get_ts, NULL, "The time of the last event replayed (ns).", NULL},
    {"dropped", (getter)get_dropped, NULL, "Events the GAP records say were dropped.", NULL},
    {"stream_frees", (getter)get_stream_frees, NULL,
     "Frees of blocks another stream's use was recorded on (sizes nearby may differ).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReplayerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memviz._core.Replayer",
    .tp_basicsize = sizeof(Replayer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Replayer(start_ns=0, summary=True): a trace's events through the store's rules, "
              "a chunk at a time (src/replay.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)replayer_init,
    .tp_dealloc = (destructor)replayer_dealloc,
    .tp_methods = replayer_methods,
    .tp_getset = replayer_getset,
};

int mvz_module_replay_init(PyObject *m)
{
    if (PyType_Ready(&ReplayerType) < 0)
        return -1;
    Py_INCREF(&ReplayerType);
    if (PyModule_AddObject(m, "Replayer", (PyObject *)&ReplayerType) < 0) {
        Py_DECREF(&ReplayerType);
        return -1;
    }
    /* how far after a segment the block it was made for is looked for
     * (replay.h; memviz/report/_categories.py's rules read it) */
    if (PyModule_AddIntConstant(m, "REPLAY_CATEGORIES_MAX", MVZ_REPLAY_CATEGORIES_MAX))
        return -1;
    return PyModule_AddIntConstant(m, "REPLAY_LOOKAHEAD", MVZ_REPLAY_LOOKAHEAD);
}
