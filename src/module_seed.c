/* memviz._core's bindings that record what memviz did not see happen: the
 * allocations PyTorch held when tracking started (seed), frees seen late
 * (retire), and PyTorch's allocator settings by which the store sizes its
 * blocks (block_rules). With the GIL; never on the capture path. The store
 * takes its own lock for each call; nothing here holds it while calling
 * Python.
 *
 * Calls down only: store (and blocks.h's settings type). module.c adds the
 * table at the end to the module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bind.h"
#include "blocks.h"
#include "store.h"

/* seed(rows, flags) -> count: record allocations that already exist, as
 * live, dated now: each row (address, size, requested, stream, device, kind,
 * frames), with requested 0 when not known and frames None or a sequence of
 * (filename, lineno, name, None) tuples, innermost first (PyTorch's own,
 * when its memory history was on; the same tuple objects for the same
 * frames, so that the same stacks are interned once). With the GIL, never on the capture path: the store takes
 * a reference to each frame tuple it keeps (resolved frames, store.h). */
static PyObject *core_seed(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *rows;
    int flags;
    if (!PyArg_ParseTuple(args, "Oi", &rows, &flags) || mvz_module_store_ensure())
        return NULL;
    PyObject *seq = PySequence_Fast(rows, "seed() takes a sequence of rows");
    if (!seq)
        return NULL;
    mvz_frame frames[MVZ_MAX_DEPTH];
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), done = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        unsigned long long address, size, requested, stream;
        int device, kind;
        PyObject *fr;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "KKKKiiO", &address, &size,
                              &requested, &stream, &device, &kind, &fr))
            goto fail;
        int depth = 0;
        if (fr != Py_None) {
            PyObject *fs = PySequence_Fast(fr, "frames must be a sequence");
            if (!fs)
                goto fail;
            Py_ssize_t m = PySequence_Fast_GET_SIZE(fs);
            for (Py_ssize_t j = 0; j < m && depth < MVZ_MAX_DEPTH; j++) {
                PyObject *f = PySequence_Fast_GET_ITEM(fs, j);
                if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) != 4)
                    continue; /* (filename, lineno, name, call): a resolved frame (store.h) */
                Py_INCREF(f); /* the store's, once a new stack keeps it */
                frames[depth].code = f;
                frames[depth].offset = 0;
                frames[depth].flags = MVZ_FRAME_RESOLVED;
                depth++;
            }
            Py_DECREF(fs);
        }
        int slot = device < 0 ? MVZ_HOST_SLOT : device;
        uint32_t stacks_before = depth ? mvz_store_stack_count() : 0;
        mvz_store_record_alloc(0, address, size, requested, stream, slot, kind, 0, flags, frames,
                               depth);
        if (depth && mvz_store_stack_count() == stacks_before)
            for (int j = 0; j < depth; j++) /* an existing stack: it holds its own references */
                Py_DECREF((PyObject *)frames[j].code);
        done++;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(done);
fail:
    Py_DECREF(seq);
    return NULL;
}

/* block_rules(max_split, divisions, expandable): PyTorch's caching
 * allocator settings (max_split_size in bytes, 0: none; a sequence of 16
 * roundup_power2_divisions; expandable_segments), by which the store sizes
 * its blocks from now on. */
static PyObject *core_block_rules(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long max_split;
    PyObject *divs;
    int expandable;
    if (!PyArg_ParseTuple(args, "KOp", &max_split, &divs, &expandable) || mvz_module_store_ensure())
        return NULL;
    mvz_rules r;
    mvz_blocks_rules_default(&r);
    if (max_split)
        r.max_split = max_split;
    r.expandable = expandable;
    PyObject *seq = PySequence_Fast(divs, "divisions: a sequence of 16 numbers");
    if (!seq)
        return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != MVZ_DIVISION_INTERVALS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "divisions: %d numbers, one per interval",
                            MVZ_DIVISION_INTERVALS);
    }
    for (int k = 0; k < MVZ_DIVISION_INTERVALS; k++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, k));
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        r.divisions[k] = (uint32_t)v;
    }
    Py_DECREF(seq);
    mvz_store_set_rules(&r);
    Py_RETURN_NONE;
}

/* retire(kind, [(address, timestamp_ns), ...]) -> count: frees seen late,
 * each of the allocation made at that time only (mvz_store_retire). */
static PyObject *core_retire(PyObject *self, PyObject *args)
{
    (void)self;
    int kind;
    PyObject *items;
    if (!PyArg_ParseTuple(args, "iO", &kind, &items) || mvz_module_store_ensure())
        return NULL;
    PyObject *seq = PySequence_Fast(items, "retire() takes a sequence of (address, timestamp_ns)");
    if (!seq)
        return NULL;
    long done = 0;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); k++) {
        unsigned long long address, made;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "KK", &address, &made)) {
            Py_DECREF(seq);
            return NULL;
        }
        done += mvz_store_retire(address, kind, made);
    }
    Py_DECREF(seq);
    return PyLong_FromLong(done);
}

PyMethodDef mvz_module_seed_bindings[] = {
    {"block_rules", core_block_rules, METH_VARARGS,
     "block_rules(max_split, divisions, expandable): PyTorch's allocator settings for sizing blocks."},
    {"retire", core_retire, METH_VARARGS,
     "retire(kind, [(address, timestamp_ns), ...]) -> count: frees seen late."},
    {"seed", core_seed, METH_VARARGS,
     "seed(rows, flags) -> count: record allocations that exist already (rows of address, size, "
     "requested, stream, device, kind, frames)."},
    {NULL, NULL, 0, NULL},
};
