/* memviz._core's bindings for reading the store: rows and snapshots,
 * totals, timelines, threads, stacks, step marks, peaks and windows, and the
 * replay of a loaded trace's events through the same rules (the trace ring
 * and the native writer: module_trace.c). Every function here runs with the GIL; none of them holds the
 * store lock while calling Python (the store copies out, then objects are
 * built), so a garbage collection or a finalizer that allocates GPU memory
 * cannot deadlock against the capture callback.
 *
 * Calls down only: store, replay, rows, codeobj, capture and labels
 * (counters for stats), frames (its ABI name). module.c adds the table at the end to
 * the module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "bind.h"
#include "capture.h"
#include "codeobj.h"
#include "frames.h"
#include "labels.h"
#include "rows.h"
#include "replay.h"
#include "store.h"

int mvz_module_store_ensure(void)
{
    if (mvz_store_ready())
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "memviz._core.init() was not called");
    return -1;
}

static PyObject *core_live(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    mvz_alloc *rows = NULL;
    long n = mvz_store_live(&rows);
    return mvz_rows_allocs(rows, n);
}

/* live_groups() -> [(row, count)]: the live allocations grouped by what a
 * snapshot's statistics tell them by (device, kind, thread, label, stack,
 * flags), a row each in AllocationRow's field order (address, stream, times
 * 0; size and requested summed) with the allocations it stands for. Copied
 * out under the store's lock, sorted and summed in C after it: one Python
 * object per group, never one per allocation (Tracker.top). */
static int group_cmp(const void *pa, const void *pb)
{
    const mvz_alloc *a = pa, *b = pb;
#define CMP(f)                                                                                          \
    if (a->f != b->f)                                                                                   \
        return a->f < b->f ? -1 : 1;
    CMP(stack_id)
    CMP(label_id)
    CMP(slot)
    CMP(kind)
    CMP(thread_idx)
    CMP(flags)
#undef CMP
    return 0;
}

static PyObject *core_live_groups(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    mvz_alloc *rows = NULL;
    long n = mvz_store_live(&rows);
    if (n < 0)
        return PyErr_NoMemory();
    qsort(rows, (size_t)n, sizeof *rows, group_cmp);
    PyObject *out = PyList_New(0);
    for (long i = 0; out && i < n;) {
        long j = i;
        unsigned long long size = 0, requested = 0;
        for (; j < n && group_cmp(&rows[i], &rows[j]) == 0; j++) {
            size += rows[j].size;
            requested += rows[j].size - rows[j].slack;
        }
        const mvz_alloc *a = &rows[i];
        PyObject *g = Py_BuildValue(
            "((iKliiKNiKiKi)l)", 0, size, a->slot == MVZ_HOST_SLOT ? -1L : (long)a->slot, (int)a->kind, 0,
            (unsigned long long)a->thread_idx, mvz_rows_label(a->label_id), 0, (unsigned long long)a->stack_id,
            0, requested, (int)a->flags, j - i);
        if (!g || PyList_Append(out, g) < 0)
            Py_CLEAR(out);
        Py_XDECREF(g);
        i = j;
    }
    free(rows);
    return out;
}

/* The optional `window` argument of the readers: -1 (the store) or the id of
 * an open window (a nested tracker's figures, see store.h). */
static int parse_window(PyObject *args, const char *fmt, long *dev, int *window)
{
    *window = -1;
    if (dev ? !PyArg_ParseTuple(args, fmt, dev, window) : !PyArg_ParseTuple(args, fmt, window))
        return -1;
    if (*window < -1 || *window >= MVZ_MAX_WINDOWS) {
        PyErr_Format(PyExc_ValueError, "window must be -1 or below %d", MVZ_MAX_WINDOWS);
        return -1;
    }
    return mvz_module_store_ensure();
}

static PyObject *window_closed(void)
{
    PyErr_SetString(PyExc_ValueError, "this window is not open");
    return NULL;
}

/* With the GIL: windows open and close only with the GIL held, so a window
 * found open here stays open for the caller's read. */
static int window_check(int window)
{
    mvz_totals probe[MVZ_NSLOTS];
    if (window >= 0 && mvz_store_window_totals(window, probe)) {
        window_closed();
        return -1;
    }
    return 0;
}

/* AllocationRows live at a peak of a device, in a window (-1: the store's):
 * the device's, or with `tensor` its blocks' (the tensor peak). */
static PyObject *peak_rows(PyObject *args, int tensor)
{
    long dev;
    int window;
    if (parse_window(args, "l|i", &dev, &window))
        return NULL;
    if (window_check(window))
        return NULL;
    int slot = dev < 0 ? MVZ_HOST_SLOT : (int)dev;
    mvz_alloc *rows = NULL;
    long n = mvz_store_window_peak_live(window, slot, tensor, &rows);
    return mvz_rows_allocs(rows, n);
}

/* peak_live(device, window=-1): at the device's peak. */
static PyObject *core_peak_live(PyObject *self, PyObject *args)
{
    (void)self;
    return peak_rows(args, 0);
}

/* tensor_peak_live(device, window=-1): at the peak of PyTorch's blocks on a
 * device (the tensor peak). */
static PyObject *core_tensor_peak_live(PyObject *self, PyObject *args)
{
    (void)self;
    return peak_rows(args, 1);
}

static PyObject *totals_dict(const mvz_totals *t);

/* block_totals(window=-1): the totals of PyTorch's blocks alone (the
 * tensor peak), of the store or of an open window. */
static PyObject *core_block_totals(PyObject *self, PyObject *args)
{
    (void)self;
    int window = -1;
    if (!PyArg_ParseTuple(args, "|i", &window) || mvz_module_store_ensure())
        return NULL;
    mvz_totals t[MVZ_NSLOTS];
    if (mvz_store_window_block_totals(window, t))
        return window_closed();
    return totals_dict(t);
}

static PyObject *totals_dict(const mvz_totals *t)
{
    PyObject *d = PyDict_New();
    for (int s = 0; d && s < MVZ_NSLOTS; s++) {
        if (!t[s].allocs && !t[s].failed)
            continue;
        PyObject *v = Py_BuildValue(
            "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:I,s:I,s:K}", "current", (unsigned long long)t[s].current,
            "peak", (unsigned long long)t[s].peak, "peak_timestamp_ns",
            (unsigned long long)t[s].peak_timestamp, "allocs", (unsigned long long)t[s].allocs,
            "frees", (unsigned long long)t[s].frees, "failed", (unsigned long long)t[s].failed,
            "alloc_bytes", (unsigned long long)t[s].alloc_bytes, "live_count", t[s].live_count,
            "peak_count", t[s].peak_count, "window_peak", (unsigned long long)t[s].window_peak);
        PyObject *k = PyLong_FromLong(s == MVZ_HOST_SLOT ? -1 : s);
        if (!v || !k || PyDict_SetItem(d, k, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *core_totals(PyObject *self, PyObject *args)
{
    (void)self;
    int window;
    if (parse_window(args, "|i", NULL, &window))
        return NULL;
    mvz_totals t[MVZ_NSLOTS];
    if (window < 0)
        mvz_store_totals(t);
    else if (mvz_store_window_totals(window, t))
        return window_closed();
    return totals_dict(t);
}

static PyObject *core_sites(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    mvz_site *rows = NULL;
    long n = mvz_store_sites(&rows);
    return mvz_rows_sites(rows, n);
}

static PyObject *core_failures(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    mvz_failure *rows = NULL;
    long n = mvz_store_failures(&rows);
    return mvz_rows_failures(rows, n);
}

static PyObject *core_timeline(PyObject *self, PyObject *args)
{
    (void)self;
    int window;
    if (parse_window(args, "|i", NULL, &window))
        return NULL;
    if (window_check(window))
        return NULL;
    mvz_point *rows = NULL;
    long n = window < 0 ? mvz_store_timeline(&rows) : mvz_store_window_timeline(window, &rows);
    return mvz_rows_timeline(rows, n);
}

static PyObject *core_threads(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    mvz_thread *rows = NULL;
    long n = mvz_store_threads(&rows);
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *d = PyDict_New();
    for (long i = 0; d && i < n; i++) {
        PyObject *k = PyLong_FromLong(i);
        PyObject *v = mvz_rows_thread(&rows[i]);
        if (!k || !v || PyDict_SetItem(d, k, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    free(rows);
    mvz_store_stats st;
    mvz_store_get_stats(&st);
    if (d && st.dropped_threads) { /* the row that threads past the table share */
        PyObject *k = PyLong_FromLong(MVZ_THREAD_OVERFLOW);
        PyObject *v = mvz_rows_thread_overflow("<threads past the first "
                                              Py_STRINGIFY(MVZ_MAX_THREADS) ">");
        if (!k || !v || PyDict_SetItem(d, k, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *core_thread_serial(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(mvz_store_thread_serial());
}

static PyObject *core_stats(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    mvz_store_stats s;
    mvz_store_get_stats(&s);
    uint32_t nlabels;
    uint64_t labels_overflowed, label_bytes;
    mvz_labels_stats(&nlabels, &labels_overflowed, &label_bytes);
    uint64_t c[MVZ_OP_COUNT];
    mvz_capture_counts(c);
    PyObject *calls = PyDict_New();
    for (int i = 0; calls && i < MVZ_OP_COUNT; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c[i]);
        if (!v || PyDict_SetItemString(calls, mvz_capture_op_names[i], v) < 0)
            Py_CLEAR(calls);
        Py_XDECREF(v);
    }
    if (!calls)
        return NULL;
    uint64_t prof_calls, prof_ns;
    mvz_capture_profile(&prof_calls, &prof_ns);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:I,s:N,s:s,s:K,s:K,"
                         "s:I,s:K,s:K,s:K,s:K,s:i,s:K,s:K,s:K,s:K,s:K,s:K}", "live", s.live, "stacks", s.stacks, "frames", s.frames, "threads", s.threads,
                         "unmatched_frees", s.unmatched_frees, "dropped_allocs", s.dropped_allocs,
                         "dropped_stacks", s.dropped_stacks, "dropped_threads", s.dropped_threads,
                         "timeline_points", s.timeline_points,
                         "bytes_used", s.bytes_used, "bytes_reserved", s.bytes_reserved,
                         "max_live", s.max_live, "calls", calls, "frames_abi", mvz_frames_abi,
                         "profile_calls", prof_calls, "profile_ns", prof_ns, "labels", nlabels,
                         "labels_overflowed", labels_overflowed, "label_bytes", label_bytes,
                         "label_reclaims", mvz_labels_reclaims(), "stream_frees", s.stream_frees,
                         "per_thread_counters", mvz_capture_per_thread_counters(),
                         "queue_events", s.queue_events, "queue_full", s.queue_full,
                         "queue_kicks", s.queue_kicks, "queue_frames_written", s.queue_frames_written,
                         "queue_frames_kept", s.queue_frames_kept, "queue_kept_mismatch",
                         s.queue_kept_mismatch);
}

/* A frame resolved when its code object died: (filename, lineno, name, call)
 * as codeobj.c made it, as a Frame record. */
static PyObject *resolved_frame(PyObject *t)
{
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 3) {
        PyErr_SetString(PyExc_SystemError, "memviz: a resolved frame is not a tuple");
        return NULL;
    }
    int line = PyLong_AsLong(PyTuple_GET_ITEM(t, 1));
    if (line == -1 && PyErr_Occurred())
        return NULL;
    return mvz_rows_frame(PyTuple_GET_ITEM(t, 0), line, PyTuple_GET_ITEM(t, 2));
}

/* resolve(ids, limit=0) -> {id: (Frame(filename, lineno, name), ...)}
 * innermost first; with a limit, that many innermost frames at most (a
 * stack's user frame is near its innermost end: Tracker.top reads no more). */
static PyObject *core_resolve(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *ids;
    int limit = 0;
    if (!PyArg_ParseTuple(args, "O|i", &ids, &limit))
        return NULL;
    if (mvz_module_store_ensure())
        return NULL;
    mvz_codeobj_adopt_pending(); /* every code object we are about to read is kept alive */
    PyObject *it = PyObject_GetIter(ids);
    if (!it)
        return NULL;
    PyObject *out = PyDict_New();
    PyObject *cache = PyDict_New(); /* (code id, offset) -> frame tuple */
    mvz_frame *buf = malloc(MVZ_MAX_DEPTH * sizeof(mvz_frame));
    PyObject *item;
    if (!out || !cache || !buf)
        goto error;
    while ((item = PyIter_Next(it))) {
        unsigned long id = PyLong_AsUnsignedLong(item);
        if (PyErr_Occurred()) {
            Py_DECREF(item);
            goto error;
        }
        int depth = mvz_store_stack_frames((uint32_t)id, buf, MVZ_MAX_DEPTH);
        if (depth < 0)
            depth = 0;
        if (limit > 0 && depth > limit)
            depth = limit;
        PyObject *stack = PyTuple_New(depth);
        if (!stack) {
            Py_DECREF(item);
            goto error;
        }
        for (int i = 0; i < depth; i++) {
            PyObject *fr;
            if (buf[i].flags & MVZ_FRAME_RESOLVED) {
                PyObject *t = (PyObject *)buf[i].code;
                if (!t || t == Py_None)
                    fr = mvz_rows_frame_unknown();
                else /* (filename, lineno, name[, call]): frames are the first three */
                    fr = resolved_frame(t);
            } else {
                PyObject *key = Py_BuildValue("(ni)", (Py_ssize_t)buf[i].code, buf[i].offset);
                fr = key ? PyDict_GetItemWithError(cache, key) : NULL;
                if (fr) {
                    Py_INCREF(fr);
                } else if (key && !PyErr_Occurred()) {
                    PyCodeObject *co = (PyCodeObject *)buf[i].code;
                    int line = PyCode_Addr2Line(co, buf[i].offset);
#if PY_VERSION_HEX >= 0x030B0000
                    PyObject *name = co->co_qualname;
#else
                    PyObject *name = co->co_name;
#endif
                    fr = mvz_rows_frame(co->co_filename, line, name);
                    if (fr && PyDict_SetItem(cache, key, fr) < 0)
                        Py_CLEAR(fr);
                }
                Py_XDECREF(key);
            }
            if (!fr) {
                Py_DECREF(stack);
                Py_DECREF(item);
                goto error;
            }
            PyTuple_SET_ITEM(stack, i, fr);
        }
        int rc = PyDict_SetItem(out, item, stack);
        Py_DECREF(stack);
        Py_DECREF(item);
        if (rc < 0)
            goto error;
    }
    if (PyErr_Occurred())
        goto error;
    Py_DECREF(it);
    Py_DECREF(cache);
    free(buf);
    return out;
error:
    Py_DECREF(it);
    Py_XDECREF(out);
    Py_XDECREF(cache);
    free(buf);
    return NULL;
}

/* call_sites(ids) -> {id: (code, offset) or name}: the code object and byte
 * offset of each stack's innermost frame, for naming the call that frame was
 * making (memviz/capture/callsite.py); where that code object was already destroyed,
 * the name made then. Stacks with no frames, or no name, are left out. */
static PyObject *core_call_sites(PyObject *self, PyObject *ids)
{
    (void)self;
    if (mvz_module_store_ensure())
        return NULL;
    mvz_codeobj_adopt_pending(); /* every code object we are about to hand out is kept alive */
    PyObject *it = PyObject_GetIter(ids);
    if (!it)
        return NULL;
    PyObject *out = PyDict_New();
    PyObject *item;
    if (!out)
        goto error;
    while ((item = PyIter_Next(it))) {
        unsigned long id = PyLong_AsUnsignedLong(item);
        mvz_frame top;
        if (PyErr_Occurred() || mvz_store_stack_frames((uint32_t)id, &top, 1) < 1 || !top.code) {
            Py_DECREF(item);
            if (PyErr_Occurred())
                goto error;
            continue;
        }
        PyObject *site;
        if (top.flags & MVZ_FRAME_RESOLVED) {
            /* its code object died: the name made then, if any (3.12+) */
            PyObject *t = (PyObject *)top.code;
            if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 4 || !PyUnicode_Check(PyTuple_GET_ITEM(t, 3))) {
                Py_DECREF(item);
                continue;
            }
            site = Py_NewRef(PyTuple_GET_ITEM(t, 3));
        } else {
            site = Py_BuildValue("(Oi)", (PyObject *)top.code, top.offset);
        }
        int rc = site ? PyDict_SetItem(out, item, site) : -1;
        Py_XDECREF(site);
        Py_DECREF(item);
        if (rc < 0)
            goto error;
    }
    if (PyErr_Occurred())
        goto error;
    Py_DECREF(it);
    return out;
error:
    Py_DECREF(it);
    Py_XDECREF(out);
    return NULL;
}

/* step_mark() -> StepMark({device: StepTotals(current, window_peak, live_count)},
 *      [StepChange(stack_id, live_bytes, live_count, delta_bytes, delta_count, block_bytes,
 *                  block_delta)])
 * Costs O(stacks), not O(live allocations): the per-step hook's budget. */
static PyObject *core_step_mark(PyObject *self, PyObject *args)
{
    (void)self;
    int window;
    if (parse_window(args, "|i", NULL, &window))
        return NULL;
    mvz_totals t[MVZ_NSLOTS];
    mvz_site_change *ch = NULL;
    if (window_check(window))
        return NULL;
    long n = window < 0 ? mvz_store_step_mark(t, &ch) : mvz_store_window_step_mark(window, t, &ch);
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *dev = PyDict_New();
    for (int s = 0; dev && s < MVZ_NSLOTS; s++) {
        if (!t[s].allocs)
            continue;
        PyObject *k = PyLong_FromLong(s == MVZ_HOST_SLOT ? -1 : s);
        PyObject *v = mvz_rows_step_totals(&t[s]);
        if (!k || !v || PyDict_SetItem(dev, k, v) < 0)
            Py_CLEAR(dev);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    PyObject *list = mvz_rows_step_changes(ch, n); /* frees ch */
    if (!dev || !list) {
        Py_XDECREF(dev);
        Py_XDECREF(list);
        return NULL;
    }
    return mvz_rows_step_mark(dev, list);
}

/* reset_peak(window=-1): the peaks (and peak sets) of the store or of an
 * open window restart at the current figures. */
static PyObject *core_reset_peak(PyObject *self, PyObject *args)
{
    (void)self;
    int window;
    if (parse_window(args, "|i", NULL, &window))
        return NULL;
    if (mvz_store_reset_peak(window))
        return window_closed();
    Py_RETURN_NONE;
}

/* copy(window=-1, close=False) -> StoreCopy(live rows, totals, peak rows,
 * timeline, when_ns): what a tracker reads, at one instant (mvz_store_copy). */
static PyObject *core_copy(PyObject *self, PyObject *args)
{
    (void)self;
    int window = -1, close = 0;
    if (!PyArg_ParseTuple(args, "|ip", &window, &close) || mvz_module_store_ensure())
        return NULL;
    if (window < -1 || window >= MVZ_MAX_WINDOWS)
        return window_closed();
    if (window_check(window))
        return NULL;
    mvz_store_copy_t c;
    if (mvz_store_copy(window, close, &c))
        return PyErr_NoMemory();
    PyObject *live = mvz_rows_allocs(c.live, (long)c.nlive);
    PyObject *peaks = mvz_rows_allocs(c.peaks, (long)c.npeaks);
    PyObject *tpeaks = mvz_rows_allocs(c.tpeaks, (long)c.ntpeaks);
    PyObject *points = mvz_rows_timeline(c.timeline, (long)c.ntimeline);
    PyObject *tot = totals_dict(c.totals);
    PyObject *btot = totals_dict(c.btotals);
    return mvz_rows_copy(live, tot, peaks, points, c.when, tpeaks, btot); /* NULLs: released, NULL */
}

/* window_open() -> WindowOpen(id, start_ns, {device: current bytes}) or None when all
 * MAX_WINDOWS are open. */
static PyObject *core_window_open(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    uint64_t start = 0;
    mvz_totals t[MVZ_NSLOTS];
    int w = mvz_store_window_open(&start, t);
    if (w < 0)
        Py_RETURN_NONE;
    PyObject *live = PyDict_New();
    for (int s = 0; live && s < MVZ_NSLOTS; s++) {
        if (!t[s].current)
            continue;
        PyObject *k = PyLong_FromLong(s == MVZ_HOST_SLOT ? -1 : s);
        PyObject *v = PyLong_FromUnsignedLongLong(t[s].current);
        if (!k || !v || PyDict_SetItem(live, k, v) < 0)
            Py_CLEAR(live);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    if (!live) {
        mvz_store_window_close(w);
        return NULL;
    }
    return mvz_rows_window_open(w, start, live);
}

static PyObject *core_window_close(PyObject *self, PyObject *arg)
{
    (void)self;
    long w = PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    if (mvz_store_ready())
        mvz_store_window_close((int)w);
    Py_RETURN_NONE;
}

static PyObject *core_stack_count(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_module_store_ensure())
        return NULL;
    return PyLong_FromUnsignedLong(mvz_store_stack_count());
}

/* ---- replay of a loaded trace (replay.h) ---------------------------------- */

/* A column of a trace's events: a buffer of n items of `width` bytes (bytes,
 * bytearray, array), copied when it is not aligned for them. */
typedef struct {
    Py_buffer view;
    const void *data;
    void *copy;
    Py_ssize_t n;
} column;

static int column_get(PyObject *obj, Py_ssize_t width, const char *name, column *c)
{
    memset(c, 0, sizeof *c);
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_SIMPLE) < 0)
        return -1;
    if (c->view.len % width) {
        PyErr_Format(PyExc_ValueError, "replay(): %s holds %zd bytes, not a whole number of "
                     "%zd-byte items", name, c->view.len, width);
        return -1;
    }
    c->n = c->view.len / width;
    c->data = c->view.buf;
    if ((uintptr_t)c->view.buf % (uintptr_t)width) {
        c->copy = malloc(c->view.len ? (size_t)c->view.len : 1);
        if (!c->copy) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(c->copy, c->view.buf, (size_t)c->view.len);
        c->data = c->copy;
    }
    return 0;
}

static void column_release(column *c)
{
    if (c->view.obj)
        PyBuffer_Release(&c->view);
    free(c->copy);
}

/* {device: values[slot]} for the devices of ALLOC and FAILED events. */
static PyObject *per_device(const int present[MVZ_REPLAY_SLOTS], const uint64_t *u,
                            const int64_t *s)
{
    PyObject *d = PyDict_New();
    for (int dev = -128; d && dev < 128; dev++) {
        int slot = (uint8_t)(int8_t)dev;
        if (!present[slot])
            continue;
        PyObject *k = PyLong_FromLong(dev);
        PyObject *v = u ? PyLong_FromUnsignedLongLong(u[slot]) : PyLong_FromLongLong(s[slot]);
        if (!k || !v || PyDict_SetItem(d, k, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return d;
}

/* Indices i with op[i] == want, as a list. */
static PyObject *indices_of(const uint8_t *op, Py_ssize_t n, uint8_t want)
{
    PyObject *list = PyList_New(0);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        if (op[i] != want)
            continue;
        PyObject *v = PyLong_FromSsize_t(i);
        if (!v || PyList_Append(list, v) < 0)
            Py_CLEAR(list);
        Py_XDECREF(v);
    }
    return list;
}

/* replay(op, address, size, kind, device) -> dict: a loaded trace's event
 * columns (op, kind: 1 byte each; device: signed bytes; address, size: u64
 * in native order) replayed through the store's rules (replay.h). The keys
 * are LoadedTrace._replay's: end (array 'q': for each ALLOC, the event that
 * ended it, 0: never), live (ALLOC indices live at the end), alloc_idx,
 * fail_idx, and per device of ALLOC/FAILED events cur, peak and peak_i (the
 * ALLOC that made the peak, -1: none). */
static PyObject *core_replay(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[5];
    if (!PyArg_ParseTuple(args, "OOOOO:replay", &o[0], &o[1], &o[2], &o[3], &o[4]))
        return NULL;
    static const char *names[5] = {"op", "address", "size", "kind", "device"};
    static const Py_ssize_t widths[5] = {1, 8, 8, 1, 1};
    column c[5];
    memset(c, 0, sizeof c);
    PyObject *result = NULL, *end = NULL;
    mvz_replay_result r;
    memset(&r, 0, sizeof r);
    for (int k = 0; k < 5; k++)
        if (column_get(o[k], widths[k], names[k], &c[k]) < 0)
            goto done;
    Py_ssize_t n = c[0].n;
    for (int k = 1; k < 5; k++)
        if (c[k].n != n) {
            PyErr_Format(PyExc_ValueError, "replay(): %s has %zd events, op has %zd", names[k],
                         c[k].n, n);
            goto done;
        }
    end = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (!end)
        goto done;
    r.end = (int64_t *)PyBytes_AS_STRING(end);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = mvz_replay_columns((size_t)n, c[0].data, c[1].data, c[2].data, c[3].data,
                                           c[4].data, &r);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *op = c[0].data;
    const int8_t *dev = c[4].data;
    int present[MVZ_REPLAY_SLOTS] = {0};
    for (Py_ssize_t i = 0; i < n; i++)
        if (op[i] == MVZ_EV_ALLOC || op[i] == MVZ_EV_FAILED)
            present[(uint8_t)dev[i]] = 1;
    PyObject *live = PyList_New((Py_ssize_t)r.nlive);
    for (size_t k = 0; live && k < r.nlive; k++) {
        PyObject *v = PyLong_FromSize_t(r.live[k]);
        if (!v)
            Py_CLEAR(live);
        else
            PyList_SET_ITEM(live, (Py_ssize_t)k, v);
    }
    PyObject *array_mod = PyImport_ImportModule("array");
    PyObject *end_array = array_mod ? PyObject_CallMethod(array_mod, "array", "sO", "q", end) : NULL;
    Py_XDECREF(array_mod);
    PyObject *alloc_idx = indices_of(op, n, MVZ_EV_ALLOC);
    PyObject *fail_idx = indices_of(op, n, MVZ_EV_FAILED);
    PyObject *cur = per_device(present, r.current, NULL);
    PyObject *peak = per_device(present, r.peak, NULL);
    PyObject *peak_i = per_device(present, NULL, r.peak_index);
    if (live && end_array && alloc_idx && fail_idx && cur && peak && peak_i)
        result = Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:O,s:O}", "end", end_array, "live", live,
                               "alloc_idx", alloc_idx, "fail_idx", fail_idx, "cur", cur, "peak",
                               peak, "peak_i", peak_i);
    Py_XDECREF(live);
    Py_XDECREF(end_array);
    Py_XDECREF(alloc_idx);
    Py_XDECREF(fail_idx);
    Py_XDECREF(cur);
    Py_XDECREF(peak);
    Py_XDECREF(peak_i);
done:
    Py_XDECREF(end);
    free(r.live);
    for (int k = 0; k < 5; k++)
        column_release(&c[k]);
    return result;
}

PyMethodDef mvz_module_store_bindings[] = {
    {"live", core_live, METH_NOARGS, "AllocationRow list: the live allocations."},
    {"peak_live", core_peak_live, METH_VARARGS,
     "peak_live(device, window=-1): AllocationRows live at the peak of a device (-1: host)."},
    {"totals", core_totals, METH_VARARGS, "totals(window=-1): per-device totals."},
    {"tensor_peak_live", core_tensor_peak_live, METH_VARARGS,
     "tensor_peak_live(device, window=-1): AllocationRows live at the peak of PyTorch's blocks."},
    {"block_totals", core_block_totals, METH_VARARGS,
     "Per-device totals of PyTorch's caching-allocator blocks (inside the device's)."},
    {"sites", core_sites, METH_NOARGS, "SiteRow list: per-stack aggregates."},
    {"failures", core_failures, METH_NOARGS, "FailureRow list: the last failed allocations, oldest first."},
    {"timeline", core_timeline, METH_VARARGS,
     "timeline(window=-1): TimelinePoint(timestamp_ns, device, bytes) list."},
    {"thread_serial", core_thread_serial, METH_NOARGS,
     "The calling thread's serial (unique in the process, unlike its ident)."},
    {"stats", core_stats, METH_NOARGS, "Counters and memviz's own memory."},
    {"live_groups", core_live_groups, METH_NOARGS,
     "[(row, count)]: live allocations grouped by device, kind, thread, label, stack and flags (Tracker.top)."},
    {"resolve", core_resolve, METH_VARARGS,
     "resolve(ids, limit=0) -> {stack id: (Frame(filename, lineno, name), ...)}, innermost first "
     "(the innermost `limit` frames only, if given)."},
    {"call_sites", core_call_sites, METH_O,
     "(code, offset) of each stack's innermost frame, or the call name made when its code died."},
    {"step_mark", core_step_mark, METH_VARARGS,
     "StepMark({device: StepTotals}, [StepChange]): figures and stacks changed since the last "
     "mark."},
    {"reset_peak", core_reset_peak, METH_VARARGS,
     "reset_peak(window=-1): peaks restart at the current figures (peak sets: what is live now)."},
    {"copy", core_copy, METH_VARARGS,
     "copy(window=-1, close=False) -> StoreCopy(live, totals, peaks, timeline, when_ns), at one "
     "instant."},
    {"window_close", core_window_close, METH_O, "Close a window opened by window_open()."},
    {"stack_count", core_stack_count, METH_NOARGS, "Stacks interned so far (ids are below it)."},
    {"threads", core_threads, METH_NOARGS,
     "{thread index: ThreadRow(native_id, ident, name, serial)}."},
    {"window_open", core_window_open, METH_NOARGS,
     "Open a window (a nested tracker's figures): WindowOpen(id, start_ns, {device: live bytes}) "
     "or None."},
    {"replay", core_replay, METH_VARARGS,
     "replay(op, address, size, kind, device) -> LoadedTrace._replay's dict, from the store's "
     "own live-table and accounting rules."},
    {NULL, NULL, 0, NULL},
};
