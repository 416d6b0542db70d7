/* memviz._core's pass over the objects Python's collector tracks, for the
 * PyTorch integration's categories (memviz/torch/categories.py): which of
 * them are tensors, optimizers and CUDA graphs, by type. With the GIL;
 * never on the capture path; touches no memviz state.
 *
 * A Python loop of isinstance() calls costs about a microsecond an object
 * (torch.Tensor's metaclass is consulted on every call), and a training
 * process holds millions of objects: a flight recorder's out-of-memory dump
 * waited seconds for it (benchmarks/bench_flight_dump.py). Here each
 * object costs a type read and, for a type not seen before in this pass, a
 * walk of its MRO (PyType_IsSubtype).
 *
 * The collector's lists are read here, never handed to Python code. A
 * tuple that another thread is still building (tuple() of a generator,
 * suspended in the generator's code) is a tracked object with one owner:
 * while a list from gc.get_objects() or gc.get_referrers() holds a second
 * reference, that thread's next resize of it fails ("SystemError: bad
 * argument to internal function", raised in the user's code: seen with a
 * snapshot taken on one thread while another built tuples), and reading
 * its unfilled slots would crash. So heap_kinds(None, ...) takes
 * gc.get_objects() and lets go of it inside one call, with the collector
 * off, where no Python code runs and no other thread can take the GIL;
 * referrers() hands Python only objects that are not such tuples.
 *
 * Calls nothing of memviz's. module.c adds the table to the module. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bind.h"

/* The answers for the types seen in one pass: open addressing on the type
 * pointer, 0: not yet seen. */
enum { HEAP_OTHER = 1, HEAP_TENSOR, HEAP_OPTIMIZER, HEAP_GRAPH };

typedef struct {
    PyTypeObject **keys;
    unsigned char *kinds;
    size_t cap, n;
} type_memo;

static int memo_grow(type_memo *m)
{
    size_t cap = m->cap ? m->cap * 2 : 1024;
    PyTypeObject **keys = PyMem_Calloc(cap, sizeof *keys);
    unsigned char *kinds = PyMem_Calloc(cap, 1);
    if (!keys || !kinds) {
        PyMem_Free(keys);
        PyMem_Free(kinds);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->keys[i])
            continue;
        size_t j = ((uintptr_t)m->keys[i] >> 4) & (cap - 1);
        while (keys[j])
            j = (j + 1) & (cap - 1);
        keys[j] = m->keys[i];
        kinds[j] = m->kinds[i];
    }
    PyMem_Free(m->keys);
    PyMem_Free(m->kinds);
    m->keys = keys;
    m->kinds = kinds;
    m->cap = cap;
    return 0;
}

/* The kind of objects of type tp: a tensor (a subclass of `tensor`, by its
 * MRO: an __instancecheck__ or a __class__ that lies is not consulted; a
 * weakref.proxy to a tensor is not one, its referent is tracked itself), an
 * optimizer, a CUDA graph (exactly `graph`), or other. 0 with an error set
 * when the memo cannot grow. */
static int kind_of(type_memo *m, PyTypeObject *tp, PyTypeObject *tensor, PyTypeObject *optim,
                   PyTypeObject *graph)
{
    if (2 * (m->n + 1) > m->cap && memo_grow(m))
        return 0;
    size_t j = ((uintptr_t)tp >> 4) & (m->cap - 1);
    for (; m->keys[j]; j = (j + 1) & (m->cap - 1))
        if (m->keys[j] == tp)
            return m->kinds[j];
    int k = HEAP_OTHER;
    if (tensor && PyType_IsSubtype(tp, tensor))
        k = HEAP_TENSOR;
    else if (optim && PyType_IsSubtype(tp, optim))
        k = HEAP_OPTIMIZER;
    else if (graph && tp == graph)
        k = HEAP_GRAPH;
    m->keys[j] = tp;
    m->kinds[j] = (unsigned char)k;
    m->n++;
    return k;
}

static PyTypeObject *type_or_none(PyObject *o, const char *what)
{
    if (o == Py_None)
        return NULL;
    if (!PyType_Check(o)) {
        PyErr_Format(PyExc_TypeError, "heap_kinds(): %s must be a type or None", what);
        return (PyTypeObject *)-1;
    }
    return (PyTypeObject *)o;
}

/* gc.<name>, looked up before any list of the collector's exists: an
 * import may run Python code. */
static PyObject *gc_function(const char *name)
{
    PyObject *gc = PyImport_ImportModule("gc");
    if (!gc)
        return NULL;
    PyObject *fn = PyObject_GetAttrString(gc, name);
    Py_DECREF(gc);
    return fn;
}

/* fn(arg) (no argument where arg is NULL), a list. The caller has turned
 * the collector off (PyGC_Disable): an allocation while the list is held
 * must not start a collection, whose finalisers would run Python code and
 * could hand the GIL to another thread. */
static PyObject *gc_list(PyObject *fn, PyObject *arg)
{
    PyObject *r = arg ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
    if (r && !PyList_CheckExact(r)) {
        PyErr_SetString(PyExc_TypeError, "the collector's function did not return a list");
        Py_CLEAR(r);
    }
    return r;
}

/* heap_kinds(objects, tensor, optimizer, graph) -> (tensors, optimizers,
 * graphs): the objects of a sequence sorted by kind, in their order; with
 * objects None, those of gc.get_objects(), read within this call (see the
 * top of this file). Nothing between that call and the list's release runs
 * Python code: a type's kind is a walk of its MRO, the lists grow with
 * PyMem, and releasing the list gives each object back the count it had. */

static PyObject *core_heap_kinds(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *objs, *to, *oo, *go;
    if (!PyArg_ParseTuple(args, "OOOO", &objs, &to, &oo, &go))
        return NULL;
    PyTypeObject *tensor = type_or_none(to, "tensor"), *optim = type_or_none(oo, "optimizer"),
                 *graph = type_or_none(go, "graph");
    if (tensor == (PyTypeObject *)-1 || optim == (PyTypeObject *)-1 || graph == (PyTypeObject *)-1)
        return NULL;
    PyObject *fn = objs == Py_None ? gc_function("get_objects") : NULL;
    if (objs == Py_None && !fn)
        return NULL;
    int gc_was = PyGC_Disable();
    PyObject *seq = fn ? gc_list(fn, NULL)
                       : PySequence_Fast(objs, "heap_kinds() takes a sequence of objects or None");
    Py_XDECREF(fn);
    if (!seq) {
        if (gc_was)
            PyGC_Enable();
        return NULL;
    }
    PyObject *out[3] = {PyList_New(0), PyList_New(0), PyList_New(0)};
    type_memo memo = {0};
    PyObject *result = NULL;
    if (!out[0] || !out[1] || !out[2])
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        int k = kind_of(&memo, Py_TYPE(items[i]), tensor, optim, graph);
        if (k == 0)
            goto done;
        if (k != HEAP_OTHER && PyList_Append(out[k - HEAP_TENSOR], items[i]) < 0)
            goto done;
    }
    result = PyTuple_Pack(3, out[0], out[1], out[2]);
done:
    PyMem_Free(memo.keys);
    PyMem_Free(memo.kinds);
    Py_XDECREF(out[0]);
    Py_XDECREF(out[1]);
    Py_XDECREF(out[2]);
    Py_DECREF(seq);
    if (gc_was)
        PyGC_Enable();
    return result;
}

/* A tuple another thread may still be building: an unfilled slot, or a
 * single owner besides `held` (the caller's list) that is no tracked object,
 * as a builder's C local is not. A complete tuple with one owner (a list's
 * item: `history.append((loss, out))`) has that owner among its referrers.
 * 1: maybe building; 0: complete; -1: error. */
static int tuple_maybe_building(PyObject *t, PyObject *held, PyObject *get_referrers)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++)
        if (!PyTuple_GET_ITEM(t, i))
            return 1;
    if (Py_REFCNT(t) > 2)
        return 0;
    PyObject *owners = gc_list(get_referrers, t);
    if (!owners)
        return -1;
    int building = 1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(owners); i++)
        if (PyList_GET_ITEM(owners, i) != held) {
            building = 0;
            break;
        }
    Py_DECREF(owners);
    return building;
}

/* referrers(obj) -> list: gc.get_referrers(obj) without the tuples that
 * another thread may still be building (tuple_maybe_building); taken and
 * filtered within this call (see the top of this file). */
static PyObject *core_referrers(PyObject *self, PyObject *obj)
{
    (void)self;
    PyObject *fn = gc_function("get_referrers");
    if (!fn)
        return NULL;
    int gc_was = PyGC_Disable();
    PyObject *all = gc_list(fn, obj), *out = all ? PyList_New(0) : NULL;
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(all); i++) {
        PyObject *r = PyList_GET_ITEM(all, i);
        int skip = PyTuple_Check(r) ? tuple_maybe_building(r, all, fn) : 0;
        if (skip < 0 || (!skip && PyList_Append(out, r) < 0))
            Py_CLEAR(out);
    }
    Py_XDECREF(all);
    Py_DECREF(fn);
    if (gc_was)
        PyGC_Enable();
    return out;
}

PyMethodDef mvz_module_heap_bindings[] = {
    {"heap_kinds", core_heap_kinds, METH_VARARGS,
     "heap_kinds(objects, tensor, optimizer, graph) -> (tensors, optimizers, graphs): the objects "
     "whose type is a subclass of tensor, of optimizer, or exactly graph (each a type or None); "
     "objects None: gc.get_objects(), read within the call."},
    {"referrers", core_referrers, METH_O,
     "referrers(obj) -> list: gc.get_referrers(obj) without tuples another thread may still be "
     "building (holding one breaks that thread's tuple())."},
    {NULL, NULL, 0, NULL},
};
