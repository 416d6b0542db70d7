/* Python's rows: the named records, struct sequences (rows.h). With the GIL; calls labels.c and the
 * Python API only. The types are made once, in PyInit__core (the module is
 * single-phase, so that runs once per process; the GIL orders it before any
 * use), and kept for the process's life. */
#include "rows.h"
#include "labels.h"

#include <stdlib.h>
#include <string.h>

enum {
    R_ALLOC,
    R_FAILURE,
    R_SITE,
    R_POINT,
    R_THREAD,
    R_STEP_TOTALS,
    R_STEP_CHANGE,
    R_FRAME,
    R_COPY,
    R_STEP_MARK,
    R_WINDOW_OPEN,
    R_START,
    R_COUNT
};

static PyStructSequence_Field alloc_fields[] = {
    {"address", "device or host pointer (the handle, for physical memory)"},
    {"size", "bytes"},
    {"device", "device number, -1 for pinned host memory"},
    {"kind", "KIND_DEVICE, KIND_HOST, KIND_MANAGED, KIND_STATIC, KIND_PHYSICAL or KIND_BLOCK"},
    {"stream", "the stream of a stream-ordered allocation, else 0"},
    {"thread", "index into threads()"},
    {"label", "the thread's label when it allocated, or None"},
    {"timestamp_ns", "when it was allocated (the store's monotonic clock)"},
    {"stack_id", "the Python stack that allocated it (resolve()); 0: no Python frames"},
    {"seq", "ordering key: the same value as timestamp_ns for a live tracker (store "
            "timestamps are strictly increasing, but a block's may equal its segment's); "
            "kept at this position for readers that index rows"},
    {"requested", "bytes asked for (size, less a block's rounding and unsplit remainder)"},
    {"flags", "FLAG_BEFORE, FLAG_ESTIMATED, FLAG_MEMVIZ bits"},
    {NULL, NULL},
};
static PyStructSequence_Field failure_fields[] = {
    {"size", "bytes asked for"},
    {"device", "device number, -1 for pinned host memory"},
    {"kind", "as AllocationRow.kind"},
    {"stream", "the stream, for a stream-ordered allocation, else 0"},
    {"thread", "index into threads()"},
    {"label", "the thread's label, or None"},
    {"timestamp_ns", "when it failed"},
    {"stack_id", "the Python stack that asked (resolve()); 0: none"},
    {"result", "the CUresult the driver returned"},
    {NULL, NULL},
};
static PyStructSequence_Field site_fields[] = {
    {"stack_id", "the Python stack (resolve())"},
    {"live_bytes", "bytes it holds now"},
    {"live_count", "allocations it holds now"},
    {"peak_bytes", "the most bytes it ever held at once"},
    {"alloc_count", "allocations it ever made"},
    {"alloc_bytes", "bytes it ever allocated"},
    {NULL, NULL},
};
static PyStructSequence_Field point_fields[] = {
    {"timestamp_ns", "when"},
    {"device", "device number, -1 for pinned host memory"},
    {"bytes", "the device's total then"},
    {NULL, NULL},
};
static PyStructSequence_Field thread_fields[] = {
    {"native_id", "the kernel's thread id (None for the overflow row)"},
    {"ident", "pthread_self(), which is threading.get_ident() (None for the overflow row)"},
    {"name", "the thread's kernel name when it first allocated"},
    {"serial", "thread_serial() of that thread, unique in the process (None for the "
               "overflow row)"},
    {NULL, NULL},
};
static PyStructSequence_Field step_totals_fields[] = {
    {"current", "bytes live now"},
    {"window_peak", "the most bytes live since the previous step mark"},
    {"live_count", "allocations live now"},
    {NULL, NULL},
};
static PyStructSequence_Field step_change_fields[] = {
    {"stack_id", "the Python stack (resolve())"},
    {"live_bytes", "bytes it holds now"},
    {"live_count", "allocations it holds now"},
    {"delta_bytes", "change of live_bytes since the previous step mark"},
    {"delta_count", "change of live_count since the previous step mark"},
    {"block_bytes", "of live_bytes, PyTorch's blocks (the allocator route)"},
    {"block_delta", "change of block_bytes since the previous step mark"},
    {NULL, NULL},
};
static PyStructSequence_Field frame_fields[] = {
    {"filename", "the code object's co_filename"},
    {"lineno", "the line of the instruction"},
    {"name", "the code object's qualified name"},
    {NULL, NULL},
};
static PyStructSequence_Field copy_fields[] = {
    {"live", "AllocationRow list: what is live"},
    {"totals", "{device: totals dict}, as totals() returns"},
    {"peaks", "AllocationRow list: what was live at each device's peak"},
    {"timeline", "TimelinePoint list"},
    {"when_ns", "the store timestamp of the copy"},
    {"tensor_peaks", "AllocationRow list: what was live at the peak of PyTorch's blocks on each "
                     "device (the tensor peak)"},
    {"block_totals", "{device: totals dict} of PyTorch's blocks alone"},
    {NULL, NULL},
};
static PyStructSequence_Field step_mark_fields[] = {
    {"devices", "{device: StepTotals}"},
    {"changes", "StepChange list: stacks whose live memory changed since the last mark"},
    {NULL, NULL},
};
static PyStructSequence_Field window_open_fields[] = {
    {"id", "the window's id (the window argument of the readers)"},
    {"start_ns", "its opening timestamp: it holds the allocations made after it"},
    {"live", "{device: bytes live} when it opened"},
    {NULL, NULL},
};
static PyStructSequence_Field start_fields[] = {
    {"result", "0, or the CUptiResult of the step that failed"},
    {"step", "the CUPTI call that failed, or ''"},
    {"error", "CUPTI's text for result, or ''"},
    {"holder", "with ERROR_MULTIPLE_SUBSCRIBERS: who holds CUPTI, when CUPTI says"},
    {"activity", "whether MEMORY2 activity records are on"},
    {"activity_error", "why activity records are off, or ''"},
    {"cupti", "whether memviz subscribed to CUPTI"},
    {"shared_with", "CUPTI's multi-subscriber mode: the other subscriber, or ''"},
    {NULL, NULL},
};

static PyStructSequence_Desc descs[R_COUNT] = {
    [R_ALLOC] = {"memviz._core.AllocationRow",
                 "An allocation: live(), peak_live(), copy().live and .peaks.", alloc_fields, 12},
    [R_FAILURE] = {"memviz._core.FailureRow", "A failed allocation: failures().", failure_fields,
                   9},
    [R_SITE] = {"memviz._core.SiteRow", "A stack's aggregates: sites().", site_fields, 6},
    [R_POINT] = {"memviz._core.TimelinePoint", "A point of timeline() and copy().timeline.",
                 point_fields, 3},
    [R_THREAD] = {"memviz._core.ThreadRow", "A thread that allocated: threads()' values.",
                  thread_fields, 4},
    [R_STEP_TOTALS] = {"memviz._core.StepTotals", "A device's figures at a step mark.",
                       step_totals_fields, 3},
    [R_STEP_CHANGE] = {"memviz._core.StepChange",
                       "A stack whose live memory changed since the last step mark.",
                       step_change_fields, 7},
    [R_FRAME] = {"memviz._core.Frame", "A frame of a stack: resolve()'s values, innermost first.",
                 frame_fields, 3},
    [R_COPY] = {"memviz._core.StoreCopy", "What a tracker reads, copied at one instant: copy().",
                copy_fields, 7},
    [R_STEP_MARK] = {"memviz._core.StepMark", "step_mark()'s result.", step_mark_fields, 2},
    [R_WINDOW_OPEN] = {"memviz._core.WindowOpen", "window_open()'s result.", window_open_fields,
                       3},
    [R_START] = {"memviz._core.StartResult", "start()'s result.", start_fields, 8},
};

static PyTypeObject *types[R_COUNT];

int mvz_rows_init(PyObject *module)
{
    for (int r = 0; r < R_COUNT; r++) {
        if (!types[r]) {
            types[r] = PyStructSequence_NewType(&descs[r]);
            if (!types[r])
                return -1;
        }
        const char *name = strrchr(descs[r].name, '.') + 1;
        if (PyModule_AddObject(module, name, Py_NewRef((PyObject *)types[r])) < 0) {
            Py_DECREF(types[r]);
            return -1;
        }
    }
    return 0;
}

/* A record of type r from n values it steals; NULL (and every value
 * released) when one is NULL or the record cannot be made. */
static PyObject *make(int r, PyObject **v, int n)
{
    PyObject *rec = NULL;
    int ok = 1;
    for (int i = 0; i < n; i++)
        ok &= v[i] != NULL;
    if (ok)
        rec = PyStructSequence_New(types[r]);
    if (!rec) {
        for (int i = 0; i < n; i++)
            Py_XDECREF(v[i]);
        return NULL;
    }
    for (int i = 0; i < n; i++)
        PyStructSequence_SetItem(rec, i, v[i]);
    return rec;
}

#define U64(x) PyLong_FromUnsignedLongLong((unsigned long long)(x))
#define I64(x) PyLong_FromLongLong((long long)(x))
#define DEVICE(slot) PyLong_FromLong((slot) == MVZ_HOST_SLOT ? -1 : (long)(slot))

PyObject *mvz_rows_label(uint32_t id)
{
    const char *s = mvz_labels_name(id);
    if (!s)
        Py_RETURN_NONE;
    /* label_intern's str exactly (surrogates included), else (a name made
     * in C from other libraries' bytes) with U+FFFD for what is not UTF-8 */
    PyObject *o = PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "surrogatepass");
    if (!o && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        o = PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "replace");
    }
    return o;
}

static PyObject *alloc_row(const void *p)
{
    const mvz_alloc *a = p;
    PyObject *v[12] = {U64(a->address),    U64(a->size),         DEVICE(a->slot),
                       PyLong_FromLong(a->kind), U64(a->stream), U64(a->thread_idx),
                       mvz_rows_label(a->label_id), U64(a->timestamp), U64(a->stack_id),
                       U64(a->timestamp), U64(a->size - a->slack), PyLong_FromLong(a->flags)};
    return make(R_ALLOC, v, 12);
}

static PyObject *failure_row(const void *p)
{
    const mvz_failure *f = p;
    PyObject *v[9] = {U64(f->size),        DEVICE(f->slot),     PyLong_FromLong(f->kind),
                      U64(f->stream),      U64(f->thread_idx),  mvz_rows_label(f->label_id),
                      U64(f->timestamp),   U64(f->stack_id),    PyLong_FromLong(f->result)};
    return make(R_FAILURE, v, 9);
}

static PyObject *site_row(const void *p)
{
    const mvz_site *s = p;
    PyObject *v[6] = {U64(s->stack_id),    U64(s->live_bytes),  U64(s->live_count),
                      U64(s->peak_bytes),  U64(s->alloc_count), U64(s->alloc_bytes)};
    return make(R_SITE, v, 6);
}

static PyObject *point_row(const void *p)
{
    const mvz_point *t = p;
    PyObject *v[3] = {U64(t->timestamp), DEVICE(t->slot), U64(t->total)};
    return make(R_POINT, v, 3);
}

static PyObject *step_change_row(const void *p)
{
    const mvz_site_change *c = p;
    PyObject *v[7] = {U64(c->stack_id),    U64(c->live_bytes),  U64(c->live_count),
                      I64(c->delta_bytes), I64(c->delta_count), U64(c->block_bytes),
                      I64(c->block_delta)};
    return make(R_STEP_CHANGE, v, 7);
}

/* A list of n records built by `row` from rows[] (elements of `size`
 * bytes); frees rows. */
static PyObject *row_list(void *rows, long n, size_t size, PyObject *(*row)(const void *))
{
    if (n < 0) {
        free(rows);
        return PyErr_NoMemory();
    }
    PyObject *list = PyList_New(n);
    for (long i = 0; list && i < n; i++) {
        PyObject *r = row((const char *)rows + (size_t)i * size);
        if (!r) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, r);
    }
    free(rows);
    return list;
}

PyObject *mvz_rows_allocs(mvz_alloc *rows, long n)
{
    return row_list(rows, n, sizeof *rows, alloc_row);
}
PyObject *mvz_rows_failures(mvz_failure *rows, long n)
{
    return row_list(rows, n, sizeof *rows, failure_row);
}
PyObject *mvz_rows_sites(mvz_site *rows, long n) { return row_list(rows, n, sizeof *rows, site_row); }
PyObject *mvz_rows_timeline(mvz_point *rows, long n)
{
    return row_list(rows, n, sizeof *rows, point_row);
}
PyObject *mvz_rows_step_changes(mvz_site_change *rows, long n)
{
    return row_list(rows, n, sizeof *rows, step_change_row);
}

PyObject *mvz_rows_thread(const mvz_thread *t)
{
    PyObject *v[4] = {I64(t->native_id), U64(t->ident), PyUnicode_FromString(t->name),
                      U64(t->serial)};
    return make(R_THREAD, v, 4);
}

PyObject *mvz_rows_thread_overflow(const char *name)
{
    PyObject *v[4] = {Py_NewRef(Py_None), Py_NewRef(Py_None), PyUnicode_FromString(name),
                      Py_NewRef(Py_None)};
    return make(R_THREAD, v, 4);
}

PyObject *mvz_rows_step_totals(const mvz_totals *t)
{
    PyObject *v[3] = {U64(t->current), U64(t->window_peak), U64(t->live_count)};
    return make(R_STEP_TOTALS, v, 3);
}

PyObject *mvz_rows_frame(PyObject *filename, int lineno, PyObject *name)
{
    PyObject *v[3] = {Py_NewRef(filename), PyLong_FromLong(lineno), Py_NewRef(name)};
    return make(R_FRAME, v, 3);
}

PyObject *mvz_rows_frame_unknown(void)
{
    PyObject *v[3] = {PyUnicode_FromString("<unknown>"), PyLong_FromLong(0),
                      PyUnicode_FromString("<unknown>")};
    return make(R_FRAME, v, 3);
}

PyObject *mvz_rows_copy(PyObject *live, PyObject *totals, PyObject *peaks, PyObject *timeline,
                          uint64_t when_ns, PyObject *tensor_peaks, PyObject *block_totals)
{
    PyObject *v[7] = {live, totals, peaks, timeline, U64(when_ns), tensor_peaks, block_totals};
    return make(R_COPY, v, 7);
}

PyObject *mvz_rows_step_mark(PyObject *devices, PyObject *changes)
{
    PyObject *v[2] = {devices, changes};
    return make(R_STEP_MARK, v, 2);
}

PyObject *mvz_rows_window_open(int id, uint64_t start_ns, PyObject *live)
{
    PyObject *v[3] = {PyLong_FromLong(id), U64(start_ns), live};
    return make(R_WINDOW_OPEN, v, 3);
}

PyObject *mvz_rows_start(int result, const char *step, const char *error, const char *holder,
                           int activity, const char *activity_error, int cupti, const char *shared_with)
{
    PyObject *v[8] = {PyLong_FromLong(result), PyUnicode_FromString(step),
                      PyUnicode_FromString(error), PyUnicode_FromString(holder),
                      PyBool_FromLong(activity), PyUnicode_FromString(activity_error),
                      PyBool_FromLong(cupti), PyUnicode_FromString(shared_with)};
    return make(R_START, v, 8);
}
