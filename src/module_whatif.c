/* memviz._core.WhatIf: a trace's events, one EVENTS chunk at a time,
 * through the what-if pass (whatif_pass.h) to the models of PyTorch's
 * caching allocator under several settings at once (whatif.h). Every method
 * runs with the GIL; feed() lets it go while it replays (one call at a
 * time: a call made while another runs is refused).
 *
 * Calls down only: whatif_pass, whatif. module.c adds the type
 * (mvz_module_whatif_init). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "whatif_pass.h"

typedef struct {
    PyObject_HEAD
    mvz_whatif_pass pass;
    int ready, busy;
    int threads; /* models run side by side on up to this many threads */
    size_t width;
} WhatIf;

/* A setting: (max_split or 0, [16 divisions], expandable, gc_threshold,
 * fraction_limit or 0, card or 0). */
static int settings_of(PyObject *item, mvz_whatif_settings *s)
{
    unsigned long long max_split, fraction, card;
    PyObject *divs;
    int expandable;
    double gc;
    if (!PyArg_ParseTuple(item, "KOpdKK", &max_split, &divs, &expandable, &gc, &fraction, &card))
        return -1;
    mvz_blocks_rules_default(&s->rules);
    if (max_split)
        s->rules.max_split = max_split;
    PyObject *seq = PySequence_Fast(divs, "WhatIf: divisions must be a sequence");
    if (!seq)
        return -1;
    if (PySequence_Fast_GET_SIZE(seq) != MVZ_DIVISION_INTERVALS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "WhatIf: %d divisions, one per size interval", MVZ_DIVISION_INTERVALS);
        return -1;
    }
    for (int i = 0; i < MVZ_DIVISION_INTERVALS; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v < 0 || v > (1L << 20)) {
            Py_DECREF(seq);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "WhatIf: a division out of range");
            return -1;
        }
        s->rules.divisions[i] = (uint32_t)v;
    }
    Py_DECREF(seq);
    s->rules.expandable = expandable;
    if (!(gc >= 0.0 && gc < 1.0)) {
        PyErr_SetString(PyExc_ValueError, "WhatIf: garbage_collection_threshold is in [0, 1)");
        return -1;
    }
    s->gc_threshold = gc;
    s->fraction_limit = fraction ? fraction : UINT64_MAX;
    s->card = card ? card : UINT64_MAX;
    return 0;
}

static int whatif_init(WhatIf *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"start_ns", "width", "settings", "threads", NULL};
    unsigned long long start = 0;
    Py_ssize_t width = MVZ_EVENT_SIZE;
    PyObject *list;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KnO|i:WhatIf", kw, &start, &width, &list, &threads))
        return -1;
    self->threads = threads < 1 ? 1 : threads;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "WhatIf: already initialised");
        return -1;
    }
    if (width < MVZ_EVENT_V1_SIZE || width > 4096) {
        PyErr_Format(PyExc_ValueError, "WhatIf: records of %zd bytes are not a trace's", width);
        return -1;
    }
    PyObject *seq = PySequence_Fast(list, "WhatIf: settings must be a sequence");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > 64) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "WhatIf: 1 to 64 settings");
        return -1;
    }
    mvz_whatif_settings *s = calloc((size_t)n, sizeof *s);
    if (!s) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (settings_of(PySequence_Fast_GET_ITEM(seq, i), &s[i])) {
            free(s);
            Py_DECREF(seq);
            return -1;
        }
    Py_DECREF(seq);
    int rc = mvz_whatif_pass_init(&self->pass, s, (size_t)n, start);
    free(s);
    if (rc) {
        PyErr_NoMemory();
        return -1;
    }
    self->width = (size_t)width;
    self->ready = 1;
    return 0;
}

static void whatif_dealloc(WhatIf *self)
{
    if (self->ready)
        mvz_whatif_pass_release(&self->pass);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int usable(WhatIf *self)
{
    if (!self->ready || self->busy) {
        PyErr_SetString(PyExc_RuntimeError, self->ready ? "WhatIf: another call is replaying"
                                                        : "WhatIf: not initialised");
        return -1;
    }
    return 0;
}

/* feed(buf, offset, count, layout): the next EVENTS chunk's records. */
static PyObject *whatif_feed(WhatIf *self, PyObject *args)
{
    PyObject *buf;
    Py_ssize_t offset, count;
    int layout;
    if (usable(self) || !PyArg_ParseTuple(args, "Onni", &buf, &offset, &count, &layout))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (offset < 0 || count < 0 || (layout != 0 && layout != 1) || offset > view.len ||
        (size_t)count > (size_t)(view.len - offset) / self->width) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "WhatIf.feed: the records do not fit the buffer");
        return NULL;
    }
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = mvz_whatif_pass_feed(&self->pass, (const uint8_t *)view.buf + offset,
                                                     (size_t)count, self->width, layout);
    if (!rc)
        rc = mvz_whatif_pass_run(&self->pass, self->threads);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&view);
    if (rc || self->pass.failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

#define U64(v) PyLong_FromUnsignedLongLong((unsigned long long)(v))

/* results() -> {"recorded": {slot: {...}}, "settings": [{slot: {...}}, ...], "events": n}. */
static PyObject *whatif_results(WhatIf *self, PyObject *unused)
{
    (void)unused;
    if (usable(self))
        return NULL;
    mvz_whatif_pass *p = &self->pass;
    PyObject *out = PyDict_New(), *rec = PyDict_New(), *all = PyList_New(0);
    if (!out || !rec || !all)
        goto fail;
    for (int slot = 0; slot < MVZ_NSLOTS; slot++) {
        if (!p->rec_reserved_peak[slot] && !p->rec_allocated_peak[slot])
            continue;
        PyObject *d = Py_BuildValue("{sKsKsKsKsKsK}", "reserved_peak", (unsigned long long)p->rec_reserved_peak[slot],
                                    "reserved_peak_expandable", (unsigned long long)p->rec_vmm_peak[slot],
                                    "allocated_peak", (unsigned long long)p->rec_allocated_peak[slot],
                                    "segments", (unsigned long long)p->rec_segments[slot],
                                    "outside_peak", (unsigned long long)p->outside_peak[slot],
                                    "outside_end", (unsigned long long)p->outside[slot]);
        PyObject *k = PyLong_FromLong(slot);
        int bad = !d || !k || PyDict_SetItem(rec, k, d);
        Py_XDECREF(d);
        Py_XDECREF(k);
        if (bad)
            goto fail;
    }
    for (size_t i = 0; i < p->n; i++) {
        PyObject *per = PyDict_New();
        if (!per || PyList_Append(all, per)) {
            Py_XDECREF(per);
            goto fail;
        }
        Py_DECREF(per);
        for (int slot = 0; slot < MVZ_NSLOTS; slot++) {
            if (!mvz_whatif_used(p->models[i], slot))
                continue;
            mvz_whatif_result r;
            mvz_whatif_result_of(p->models[i], slot, &r);
            PyObject *top = PyList_New(0);
            for (int k = 0; top && k < MVZ_WHATIF_TOP; k++) {
                if (!r.oom_top_bytes[k])
                    continue;
                PyObject *t = Py_BuildValue("(IK)", r.oom_top_stack[k], (unsigned long long)r.oom_top_bytes[k]);
                if (!t || PyList_Append(top, t)) {
                    Py_XDECREF(t);
                    Py_CLEAR(top);
                    break;
                }
                Py_DECREF(t);
            }
            if (!top)
                goto fail;
            PyObject *oom = Py_None;
            Py_INCREF(oom);
            if (r.oom) {
                Py_DECREF(oom);
                oom = Py_BuildValue("{sKsKsKsKsKsIsIsIsKsKsKsO}", "ts", (unsigned long long)r.oom_ts, "index",
                                    (unsigned long long)r.oom_index, "requested",
                                    (unsigned long long)r.oom_requested, "rounded",
                                    (unsigned long long)r.oom_rounded, "stream", (unsigned long long)r.oom_stream,
                                    "stack", r.oom_stack, "label", r.oom_label, "caller", r.oom_caller,
                                    "reserved",
                                    (unsigned long long)r.oom_reserved, "allocated",
                                    (unsigned long long)r.oom_allocated, "outside",
                                    (unsigned long long)r.oom_outside, "top", top);
            }
            Py_DECREF(top);
            if (!oom)
                goto fail;
            PyObject *d = Py_BuildValue(
                "{sKsKsKsKsKsKsKsKsKsKsKsLsN}", "reserved_peak", (unsigned long long)r.reserved_peak,
                "allocated_at_peak", (unsigned long long)r.allocated_at_peak, "largest_free_at_peak",
                (unsigned long long)r.largest_free_at_peak, "peak_ts", (unsigned long long)r.peak_ts,
                "allocated_peak", (unsigned long long)r.allocated_peak, "reserved_end",
                (unsigned long long)r.reserved_end, "allocated_end", (unsigned long long)r.allocated_end,
                "mallocs", (unsigned long long)r.mallocs, "retries", (unsigned long long)r.retries, "flushes",
                (unsigned long long)r.flushes, "requests", (unsigned long long)r.requests, "min_room",
                (long long)r.min_room, "oom", oom);
            PyObject *k = PyLong_FromLong(slot);
            int bad = !d || !k || PyDict_SetItem(per, k, d);
            Py_XDECREF(d);
            Py_XDECREF(k);
            if (bad)
                goto fail;
        }
    }
    if (PyDict_SetItemString(out, "recorded", rec) || PyDict_SetItemString(out, "settings", all))
        goto fail;
    PyObject *ev = U64(p->events);
    if (!ev || PyDict_SetItemString(out, "events", ev)) {
        Py_XDECREF(ev);
        goto fail;
    }
    Py_DECREF(ev);
    Py_DECREF(rec);
    Py_DECREF(all);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(rec);
    Py_XDECREF(all);
    return NULL;
}

static PyMethodDef whatif_methods[] = {
    {"feed", (PyCFunction)whatif_feed, METH_VARARGS,
     "feed(buf, offset, count, layout): the next EVENTS chunk (GIL released while it replays)."},
    {"results", (PyCFunction)whatif_results, METH_NOARGS,
     "results() -> {'recorded': {device: ...}, 'settings': [{device: ...}, ...], 'events': n}."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WhatIfType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "memviz._core.WhatIf",
    .tp_basicsize = sizeof(WhatIf),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "WhatIf(start_ns, width, settings, threads=1): a trace's PyTorch requests through models of "
              "its caching allocator (src/whatif_pass.h, src/whatif.h), side by side on up to `threads` threads. settings: "
              "[(max_split or 0, [16 divisions], expandable, gc_threshold, fraction_limit or 0, card or 0), "
              "...].",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)whatif_init,
    .tp_dealloc = (destructor)whatif_dealloc,
    .tp_methods = whatif_methods,
};

int mvz_module_whatif_init(PyObject *m)
{
    if (PyType_Ready(&WhatIfType) < 0)
        return -1;
    Py_INCREF(&WhatIfType);
    if (PyModule_AddObject(m, "WhatIf", (PyObject *)&WhatIfType) < 0) {
        Py_DECREF(&WhatIfType);
        return -1;
    }
    return 0;
}
