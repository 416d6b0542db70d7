/* memviz._core's bindings for traces: the store's trace ring (turned on and
 * off, and drained for the Python writer) and the native trace writer
 * (trace_writer.h: its thread, its file or flight-recorder memory, dumps).
 * Every function here runs with the GIL; the ones that wait for the
 * writer's lock or for write(2) release it first.
 *
 * Calls down only: store and trace_writer. module.c adds the table at the
 * end to the module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "bind.h"
#include "store.h"
#include "trace_ring.h"
#include "trace_writer.h"

/* ---- the trace ring (store.h) ---------------------------------------------- */

static PyObject *core_trace_enable(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_ssize_t cap = PyLong_AsSsize_t(arg);
    if (cap == -1 && PyErr_Occurred())
        return NULL;
    if (cap < (Py_ssize_t)MVZ_RING_MIN_EVENTS || cap > (Py_ssize_t)MVZ_RING_MAX_EVENTS) {
        PyErr_Format(PyExc_ValueError, "trace capacity must be between %zu and %zu events, not %zd",
                     (size_t)MVZ_RING_MIN_EVENTS, (size_t)MVZ_RING_MAX_EVENTS, cap);
        return NULL;
    }
    if (mvz_module_store_ensure())
        return NULL;
    if (mvz_store_trace_enable((size_t)cap) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *core_trace_disable(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_store_ready())
        mvz_store_trace_disable();
    Py_RETURN_NONE;
}

static PyObject *core_trace_drain(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    uint8_t *buf = NULL;
    long n = mvz_store_trace_drain(&buf);
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *b = PyBytes_FromStringAndSize((const char *)buf, n);
    free(buf);
    return b;
}

/* ---- the native trace writer (trace_writer.h) ------------------------------ */

/* trace_writer_start(fd, capacity, level, interval_s, budget): the writer
 * thread over the ring trace_enable() turned on (of `capacity` events); fd -1
 * is the flight recorder with `budget` bytes. */
static PyObject *core_trace_writer_start(PyObject *self, PyObject *args)
{
    (void)self;
    int fd, level;
    Py_ssize_t cap, budget;
    double interval;
    if (!PyArg_ParseTuple(args, "inidn:trace_writer_start", &fd, &cap, &level, &interval, &budget))
        return NULL;
    if (mvz_module_store_ensure())
        return NULL;
    if (cap < (Py_ssize_t)MVZ_RING_MIN_EVENTS || cap > (Py_ssize_t)MVZ_RING_MAX_EVENTS || level < 0 ||
        level > 9 || !(interval > 0) ||
        interval > 3600 || budget < 0) {
        PyErr_SetString(PyExc_ValueError, "trace_writer_start(): a value is out of range");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mvz_tw_start(fd, (size_t)cap, level, (unsigned)(interval * 1000.0 + 0.5), (size_t)budget);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* trace_writer_write(data, stacks=-1, labels=-1): append chunks to the file;
 * for chunks of names, how far the file names stacks and labels now
 * (mvz_tw_write_named). */
static PyObject *core_trace_writer_write(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b;
    long stacks = -1, labels = -1;
    if (!PyArg_ParseTuple(args, "y*|ll:trace_writer_write", &b, &stacks, &labels))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mvz_tw_write_named((const uint8_t *)b.buf, (size_t)b.len, stacks, labels);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (rc != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* trace_writer_flush(force=False): write what the ring holds (force: the
 * events whose names are not written yet too). */
static PyObject *core_trace_writer_flush(PyObject *self, PyObject *args)
{
    (void)self;
    int force = 0;
    if (!PyArg_ParseTuple(args, "|p:trace_writer_flush", &force))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    mvz_tw_flush(force);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *core_trace_writer_stop(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    mvz_tw_stop();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *core_trace_writer_release(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    mvz_tw_release();
    Py_RETURN_NONE;
}

/* A frozen dump (trace_writer.h) in a capsule; freed when the capsule goes
 * or by trace_writer_frozen_free, whichever comes first. */
#define FROZEN_NAME "memviz._core.frozen_dump"

typedef struct {
    mvz_tw_frozen *f;
} frozen_box;

static void frozen_capsule_free(PyObject *capsule)
{
    frozen_box *b = PyCapsule_GetPointer(capsule, FROZEN_NAME);
    if (b) {
        mvz_tw_frozen_free(b->f);
        PyMem_Free(b);
    }
}

static frozen_box *frozen_of(PyObject *capsule)
{
    frozen_box *b = PyCapsule_GetPointer(capsule, FROZEN_NAME);
    if (b && !b->f) {
        PyErr_SetString(PyExc_ValueError, "this frozen dump was freed already");
        return NULL;
    }
    return b;
}

static PyObject *core_trace_writer_freeze(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    frozen_box *b = PyMem_Malloc(sizeof *b);
    if (!b)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    b->f = mvz_tw_freeze();
    Py_END_ALLOW_THREADS
    if (!b->f) {
        PyMem_Free(b);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *c = PyCapsule_New(b, FROZEN_NAME, frozen_capsule_free);
    if (!c) {
        mvz_tw_frozen_free(b->f);
        PyMem_Free(b);
    }
    return c;
}

static PyObject *core_trace_writer_frozen_write(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *capsule;
    int fd;
    if (!PyArg_ParseTuple(args, "Oi:trace_writer_frozen_write", &capsule, &fd))
        return NULL;
    frozen_box *b = frozen_of(capsule);
    if (!b)
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "trace_writer_frozen_write(): not a file descriptor");
        return NULL;
    }
    int rc;
    mvz_tw_frozen *f = b->f;
    Py_BEGIN_ALLOW_THREADS
    rc = mvz_tw_frozen_write(f, fd); /* the capsule is the caller's until this returns */
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *core_trace_writer_frozen_free(PyObject *self, PyObject *capsule)
{
    (void)self;
    frozen_box *b = PyCapsule_GetPointer(capsule, FROZEN_NAME);
    if (!b)
        return NULL;
    mvz_tw_frozen *f = b->f;
    b->f = NULL;
    if (f) {
        Py_BEGIN_ALLOW_THREADS
        mvz_tw_frozen_free(f);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *core_trace_writer_stats(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    mvz_tw_stats s;
    mvz_tw_get_stats(&s);
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsisOsO}", "events", (unsigned long long)s.events, "chunks",
        (unsigned long long)s.chunks, "bytes", (unsigned long long)s.bytes, "dropped",
        (unsigned long long)s.dropped, "evicted", (unsigned long long)s.evicted, "kept_events",
        (unsigned long long)s.kept_events, "kept_bytes", (unsigned long long)s.kept_bytes,
        "base_count", (unsigned long long)s.base_count, "base_bytes", (unsigned long long)s.base_bytes,
        "window_start", (unsigned long long)s.window_start, "window_end",
        (unsigned long long)s.window_end, "evicted_until", (unsigned long long)s.evicted_until,
        "budget", (unsigned long long)s.budget, "error", s.error, "compressed",
        s.compressed ? Py_True : Py_False, "running", s.running ? Py_True : Py_False);
}

/* flight_split(budget) -> (ring events, chunk bytes, fixed bytes): the
 * flight recorder's budget split (trace_writer.h, mvz_tw_flight_split). */
static PyObject *core_flight_split(PyObject *self, PyObject *arg)
{
    (void)self;
    size_t budget = PyLong_AsSize_t(arg);
    if (budget == (size_t)-1 && PyErr_Occurred())
        return NULL;
    mvz_tw_split sp;
    if (mvz_tw_flight_split(budget, &sp)) {
        PyErr_Format(PyExc_ValueError, "flight_split: the budget must be at least %zu bytes, not %zu",
                     (size_t)MVZ_TW_FLIGHT_MIN_BUDGET, budget);
        return NULL;
    }
    return Py_BuildValue("(nnn)", (Py_ssize_t)sp.ring_events, (Py_ssize_t)sp.chunks, (Py_ssize_t)sp.fixed);
}

/* _flight_test_sizes(ring_events, chunk_bytes): tests only (0: the budget's). */
static PyObject *core_flight_test_sizes(PyObject *self, PyObject *args)
{
    (void)self;
    Py_ssize_t ring, chunks;
    if (!PyArg_ParseTuple(args, "nn:_flight_test_sizes", &ring, &chunks))
        return NULL;
    if (ring < 0 || chunks < 0) {
        PyErr_SetString(PyExc_ValueError, "_flight_test_sizes: sizes >= 0");
        return NULL;
    }
    mvz_tw_flight_test_sizes((size_t)ring, (size_t)chunks);
    Py_RETURN_NONE;
}

/* ---- the encoding of records and EVENTS chunks (trace_ring.h, trace_writer.h) ---- */

/* A field of a row: its value in 64 bits (an int's low bits, as a mask). */
static int row_u64(PyObject *row, Py_ssize_t k, uint64_t *v)
{
    unsigned long long x = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(row, k));
    if (x == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *v = x;
    return 0;
}

/* A field of a row, held to [lo, hi]. */
static int row_clamped(PyObject *row, Py_ssize_t k, long long lo, long long hi, long long *v)
{
    int over = 0;
    long long x = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(row, k), &over);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *v = over > 0 ? hi : over < 0 ? lo : x < lo ? lo : x > hi ? hi : x;
    return 0;
}

/* encode_events(rows, start, marker_flags) -> bytes: .memviz records of
 * `rows`, tuples (op, ts, kind, device, flags, stack id, thread, label id,
 * address, size, slack, stream), by the one encoding (trace_ring.h,
 * mvz_ring_encode_from): a TIME record of `start` first, another before an
 * event that goes back in time or more than 32 bits of ns on. A device is
 * held to the record's (-1: pinned host memory), a time to >= 0, thread and
 * label ids to the record's largest; other fields keep their low bits. */
static PyObject *core_encode_events(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *rows;
    long long start;
    int marker_flags;
    if (!PyArg_ParseTuple(args, "OLi:encode_events", &rows, &start, &marker_flags))
        return NULL;
    PyObject *seq = PySequence_Fast(rows, "encode_events: rows is a sequence of tuples");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    mvz_raw_event *raw = calloc(n ? (size_t)n : 1, sizeof *raw);
    if (!raw) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 12) {
            PyErr_SetString(PyExc_TypeError, "encode_events: each row is a tuple of 12 ints");
            break;
        }
        long long ts, dev, thread, label;
        uint64_t op, kind, flags, sid;
        mvz_raw_event *e = &raw[i];
        if (row_u64(r, 0, &op) || row_clamped(r, 1, 0, LLONG_MAX, &ts) || row_u64(r, 2, &kind) ||
            row_clamped(r, 3, -128, 127, &dev) || row_u64(r, 4, &flags) || row_u64(r, 5, &sid) ||
            row_clamped(r, 6, 0, UINT32_MAX, &thread) || row_clamped(r, 7, 0, UINT32_MAX, &label) ||
            row_u64(r, 8, &e->address) || row_u64(r, 9, &e->size) || row_u64(r, 10, &e->slack) ||
            row_u64(r, 11, &e->stream))
            break;
        e->op = (uint8_t)op;
        e->timestamp = (uint64_t)ts;
        e->kind = (uint8_t)kind;
        e->slot = (int16_t)(dev == -1 ? MVZ_HOST_SLOT : dev);
        e->flags = (uint8_t)flags;
        e->stack_id = (uint32_t)sid;
        e->thread_idx = (uint32_t)thread;
        e->label_id = (uint32_t)label;
    }
    Py_DECREF(seq);
    uint8_t *out = NULL;
    long len = PyErr_Occurred() ? -2
                                : mvz_ring_encode_from(raw, (size_t)n, 0, (uint64_t)(start < 0 ? 0 : start),
                                                       marker_flags & 0xFF, &out);
    free(raw);
    if (len == -2)
        return NULL;
    if (len < 0)
        return PyErr_NoMemory();
    PyObject *b = PyBytes_FromStringAndSize((const char *)out, len);
    free(out);
    return b;
}

/* events_payload(records, layout) -> bytes: the EVENTS payload of packed
 * records (trace_writer.h, mvz_tw_events_payload). */
static PyObject *core_events_payload(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer view;
    int layout;
    if (!PyArg_ParseTuple(args, "y*i:events_payload", &view, &layout))
        return NULL;
    if (view.len % (Py_ssize_t)sizeof(mvz_event) ||
        (layout != MVZ_TW_LAYOUT_ROWS && layout != MVZ_TW_LAYOUT_PLANES) ||
        (size_t)view.len / sizeof(mvz_event) > UINT32_MAX) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "events_payload: whole records (EVENT_SIZE bytes each), layout "
                                          "LAYOUT_ROWS or LAYOUT_PLANES");
        return NULL;
    }
    size_t n = (size_t)view.len / sizeof(mvz_event);
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(5 + n * sizeof(mvz_event)));
    if (b)
        mvz_tw_events_payload((const mvz_event *)view.buf, n, layout, (uint8_t *)PyBytes_AS_STRING(b));
    PyBuffer_Release(&view);
    return b;
}

/* events_chunk(kind, payload, level) -> bytes: an EVENTS (or LIVE) payload
 * framed as a chunk of `kind` (trace_writer.h, mvz_tw_frame_events); the
 * compression runs without the GIL. */
static PyObject *core_events_chunk(PyObject *self, PyObject *args)
{
    (void)self;
    int kind, level;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "iy*i:events_chunk", &kind, &view, &level))
        return NULL;
    if (kind < 0 || kind > 0xFF || level < 0 || level > 9 || (size_t)view.len > UINT32_MAX) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "events_chunk: a kind of one byte, a level 0-9, a payload "
                                          "under 4 GiB");
        return NULL;
    }
    size_t len = (size_t)view.len, out_len = 0;
    uint8_t *copy = malloc(len ? len : 1), *out = NULL;
    if (copy) {
        memcpy(copy, view.buf, len);
        Py_BEGIN_ALLOW_THREADS
        out = mvz_tw_frame_events((uint8_t)kind, copy, len, level, &out_len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    free(copy);
    if (!out)
        return PyErr_NoMemory();
    PyObject *b = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)out_len);
    free(out);
    return b;
}

static PyObject *core_zlib_available(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(mvz_tw_zlib());
}

PyMethodDef mvz_module_trace_bindings[] = {
    {"trace_enable", core_trace_enable, METH_O, "Log events into a ring of this many entries."},
    {"trace_disable", core_trace_disable, METH_NOARGS, "Stop logging trace events."},
    {"trace_drain", core_trace_drain, METH_NOARGS,
     "Logged events since the last drain, as 32-byte records (bytes)."},
    {"trace_writer_start", core_trace_writer_start, METH_VARARGS,
     "trace_writer_start(fd, capacity, level, interval_s, budget): the native writer (fd -1: the "
     "flight recorder's memory, `budget` bytes)."},
    {"trace_writer_write", core_trace_writer_write, METH_VARARGS,
     "trace_writer_write(data, stacks=-1, labels=-1): append bytes to the writer's file, between "
     "its chunks (GIL released); for chunks of names, the file names stacks below `stacks` and "
     "labels up to `labels` now, and the events that waited for them follow."},
    {"trace_writer_flush", core_trace_writer_flush, METH_VARARGS,
     "trace_writer_flush(force=False): write every event the ring holds now whose stack and "
     "label are named in the file (force: every event)."},
    {"trace_writer_stop", core_trace_writer_stop, METH_NOARGS,
     "Write the rest and stop the writer thread and the ring."},
    {"trace_writer_release", core_trace_writer_release, METH_NOARGS,
     "Free a stopped flight recorder's memory."},
    {"trace_writer_freeze", core_trace_writer_freeze, METH_NOARGS,
     "The flight recorder's dump as it stands, frozen for writing later (a capsule): every chunk kept "
     "and the base, in milliseconds whatever the budget; the recorder goes on."},
    {"trace_writer_frozen_write", core_trace_writer_frozen_write, METH_VARARGS,
     "trace_writer_frozen_write(frozen, fd): write a frozen dump's events to fd (GIL released)."},
    {"trace_writer_frozen_free", core_trace_writer_frozen_free, METH_O,
     "Let a frozen dump's chunks go now (else when the capsule goes)."},
    {"trace_writer_stats", core_trace_writer_stats, METH_NOARGS, "The writer's counters (a dict)."},
    {"zlib_available", core_zlib_available, METH_NOARGS, "Whether the native writer can compress."},
    {"encode_events", core_encode_events, METH_VARARGS,
     "encode_events(rows, start, marker_flags) -> bytes: .memviz records of rows (op, ts, kind, device, "
     "flags, stack id, thread, label id, address, size, slack, stream), TIME records where needed."},
    {"events_payload", core_events_payload, METH_VARARGS,
     "events_payload(records, layout) -> bytes: the EVENTS payload of packed records."},
    {"events_chunk", core_events_chunk, METH_VARARGS,
     "events_chunk(kind, payload, level) -> bytes: an EVENTS or LIVE payload framed as a chunk "
     "(compressed where that helps and a reader allows it; planes as rows where those compress)."},
    {"flight_split", core_flight_split, METH_O,
     "flight_split(budget) -> (ring events, chunk bytes, fixed bytes): the flight recorder's budget "
     "split between the capture ring, the writer's take buffer (fixed: both) and its chunks."},
    {"_flight_test_sizes", core_flight_test_sizes, METH_VARARGS,
     "_flight_test_sizes(ring_events, chunk_bytes): tests only; flight_split gives these from now "
     "on, whatever the budget (0: the budget's)."},
    {NULL, NULL, 0, NULL},
};
