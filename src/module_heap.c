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

/* heap_kinds(objects, tensor, optimizer, graph) -> (tensors, optimizers,
 * graphs): the objects of a sequence (gc.get_objects()) sorted by kind,
 * in their order. */
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
    PyObject *seq = PySequence_Fast(objs, "heap_kinds() takes a sequence of objects");
    if (!seq)
        return NULL;
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
    return result;
}

PyMethodDef mvz_module_heap_bindings[] = {
    {"heap_kinds", core_heap_kinds, METH_VARARGS,
     "heap_kinds(objects, tensor, optimizer, graph) -> (tensors, optimizers, graphs): the objects "
     "whose type is a subclass of tensor, of optimizer, or exactly graph (each a type or None)."},
    {NULL, NULL, 0, NULL},
};
