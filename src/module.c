/* memviz._core: the module, and its bindings for capture control (CUPTI,
 * start/stop, clearing), labels, precise mode's wrappers, autograd nodes and
 * the forward-line map. The store's readers are in module_store.c, the
 * record types in records.c, code-object lifetimes in codeobj.c.
 *
 * Every function here runs with the GIL; none of them holds the store lock
 * while calling Python, so a garbage collection or a finalizer that
 * allocates GPU memory cannot deadlock against the capture callback.
 *
 * The top of the C core: it may call every file below it; nothing calls it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "capture.h"
#include "cupti.h"
#include "frames.h"
#include "allocator.h"
#include "bind.h"
#include "codeobj.h"
#include "interpose.h"
#include "labels.h"
#include "nodes.h"
#include "records.h"
#include "seqmap.h"
#include "store.h"
#include "trace_writer.h"

/* ---- module functions ------------------------------------------------- */

static PyObject *core_init(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"max_live", "max_stacks", "max_frames", NULL};
    Py_ssize_t max_live = 1 << 23, max_stacks = 1 << 20, max_frames = 1 << 24;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|nnn", kwlist, &max_live, &max_stacks,
                                     &max_frames))
        return NULL;
    if (max_live < 1024 || max_stacks < 1024 || max_frames < 1024 || max_live > (1L << 30)) {
        PyErr_SetString(PyExc_ValueError, "capacities must be between 1024 and 2**30");
        return NULL;
    }
    if (!mvz_store_ready() &&
        mvz_store_init((size_t)max_live, (size_t)max_stacks, (size_t)max_frames) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *core_cupti_mapped(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    char path[4096];
    if (mvz_cupti_find_mapped(path, sizeof path))
        return PyUnicode_DecodeFSDefault(path);
    Py_RETURN_NONE;
}

static PyObject *core_cupti_load(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *path = NULL;
    PyObject *bytes = NULL;
    if (arg != Py_None) {
        if (!PyUnicode_FSConverter(arg, &bytes))
            return NULL;
        path = PyBytes_AS_STRING(bytes);
    }
    char err[512];
    int rc;
    Py_BEGIN_ALLOW_THREADS /* dlopen runs library constructors */
    rc = mvz_cupti_load(path, err, sizeof err);
    Py_END_ALLOW_THREADS
    Py_XDECREF(bytes);
    if (rc != 0) {
        PyErr_SetString(PyExc_OSError, err);
        return NULL;
    }
    return Py_BuildValue("(sI)", mvz_api.path, mvz_api.version);
}

static PyObject *core_cupti_info(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (!mvz_api.handle)
        Py_RETURN_NONE;
    return Py_BuildValue("{s:s,s:I,s:O}", "path", mvz_api.path, "version", mvz_api.version,
                         "subscribe_v2", mvz_api.Subscribe_v2 ? Py_True : Py_False);
}

static PyObject *core_start(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"depth", "activity", NULL};
    int depth = 32, activity = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ip", kwlist, &depth, &activity))
        return NULL;
    if (mvz_ensure_store())
        return NULL;
    if (!mvz_api.handle) {
        PyErr_SetString(PyExc_RuntimeError, "libcupti is not loaded");
        return NULL;
    }
    if (mvz_capture_active()) {
        PyErr_SetString(PyExc_RuntimeError, "capture is already running");
        return NULL;
    }
    mvz_capture_configure(depth);
    if (mvz_codeobj_watch() != 0)
        return NULL;
    mvz_start_status st;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = mvz_capture_start(activity, &st);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return mvz_start_result(st.result, st.step ? st.step : "",
                                mvz_cupti_result_string(st.result), st.holder, 0, "");
    return mvz_start_result(0, "", "", "", st.activity, st.activity_error);
}

static PyObject *core_stop(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS mvz_capture_stop();
    Py_END_ALLOW_THREADS
    if (mvz_store_ready())
        mvz_codeobj_adopt_pending(); /* code deaths stay watched: a late callback may add stacks */
    Py_RETURN_NONE;
}

static PyObject *core_flush(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS mvz_capture_flush();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *core_active(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(mvz_capture_active());
}

static PyObject *core_clear(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (mvz_ensure_store())
        return NULL;
    if (mvz_capture_active()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot clear while capturing");
        return NULL;
    }
    void **refs;
    size_t n;
    mvz_codeobj_adopt_pending(); /* so every reference the store holds is listed */
    mvz_store_clear(&refs, &n);
    mvz_capture_forget_counts();
    for (size_t i = 0; i < n; i++)
        Py_XDECREF((PyObject *)refs[i]);
    free(refs);
    Py_RETURN_NONE;
}

static PyObject *core_label_intern(PyObject *self, PyObject *arg)
{
    (void)self;
    if (arg == Py_None)
        return PyLong_FromLong(0);
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "label_intern() takes a str or None");
        return NULL;
    }
    /* Lone surrogates (file names that are not UTF-8) are kept as they are:
     * label_obj decodes them back. A NUL would end the C string early and
     * merge labels: memviz.label() refuses it, and so does this. */
    PyObject *b = PyUnicode_AsEncodedString(arg, "utf-8", "surrogatepass");
    if (!b)
        return NULL;
    if (strlen(PyBytes_AS_STRING(b)) != (size_t)PyBytes_GET_SIZE(b)) {
        Py_DECREF(b);
        PyErr_SetString(PyExc_ValueError, "label_intern(): a label cannot contain NUL characters");
        return NULL;
    }
    uint32_t id = mvz_label_intern(PyBytes_AS_STRING(b)); /* never 0: full tables overflow */
    Py_DECREF(b);
    return PyLong_FromUnsignedLong(id);
}

static PyObject *core_label_get(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLong(mvz_capture_label_get());
}

static PyObject *core_label_set(PyObject *self, PyObject *arg)
{
    (void)self;
    unsigned long id = PyLong_AsUnsignedLong(arg);
    if (PyErr_Occurred())
        return NULL;
    if (id > 0xffff) { /* trace events keep 16 bits: label_intern never gives more */
        PyErr_SetString(PyExc_ValueError, "label_set() takes an id from label_intern()");
        return NULL;
    }
    mvz_capture_label_set((uint32_t)id);
    Py_RETURN_NONE;
}

static PyObject *core_label_count(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    uint32_t count;
    uint64_t overflowed, bytes;
    mvz_label_stats(&count, &overflowed, &bytes);
    return PyLong_FromUnsignedLong(count);
}

static PyObject *core_label_name(PyObject *self, PyObject *arg)
{
    (void)self;
    unsigned long id = PyLong_AsUnsignedLong(arg);
    if (PyErr_Occurred())
        return NULL;
    return mvz_label_obj((uint32_t)id);
}

/* ---- precise mode's wrappers (interpose.h) ------------------------------ */

static PyObject *core_interpose_attach(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *suffix = PyUnicode_AsUTF8(arg);
    if (!suffix)
        return NULL;
    char err[512] = "";
    int n = mvz_interpose_attach(suffix, err, sizeof err);
    return Py_BuildValue("(is)", n, err);
}

static PyObject *core_interpose_commit(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (!mvz_interpose_attached())
        Py_RETURN_FALSE;
    if (mvz_capture_async_callbacks(0) != 0) { /* both routes would record: undo */
        mvz_interpose_detach();
        mvz_capture_async_callbacks(1);
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *core_interpose_detach(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    mvz_interpose_detach();
    mvz_capture_async_callbacks(1); /* no-op once CUPTI is unsubscribed */
    Py_RETURN_NONE;
}

/* ---- the autograd node of this thread (nodes.h) ------------------------- */

static PyObject *core_nodes_supported(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(mvz_nodes_supported());
}

static PyObject *core_nodes_module(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *suffix = PyUnicode_AsUTF8(arg);
    if (!suffix)
        return NULL;
    size_t modid, memsz;
    if (!mvz_nodes_module(suffix, &modid, &memsz))
        Py_RETURN_NONE;
    return Py_BuildValue("(nn)", (Py_ssize_t)modid, (Py_ssize_t)memsz);
}

static PyObject *core_nodes_block(PyObject *self, PyObject *args)
{
    (void)self;
    Py_ssize_t modid, memsz;
    if (!PyArg_ParseTuple(args, "nn", &modid, &memsz))
        return NULL;
    if (modid <= 0 || memsz < 0 || memsz > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "nodes_block(): bad module id or size");
        return NULL;
    }
    const void *base = mvz_nodes_block((size_t)modid);
    if (!base)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(base, memsz);
}

static PyObject *core_nodes_inspect(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *addr_obj;
    int nwords;
    if (!PyArg_ParseTuple(args, "Oi", &addr_obj, &nwords))
        return NULL;
    const void *addr = PyLong_AsVoidPtr(addr_obj);
    if (PyErr_Occurred())
        return NULL;
    if (nwords < 1 || nwords > 512) {
        PyErr_SetString(PyExc_ValueError, "nodes_inspect(): 1 to 512 words");
        return NULL;
    }
    uint64_t words[512];
    char name[256];
    if (!addr || mvz_nodes_safe_read(addr, words, (size_t)nwords * sizeof *words))
        Py_RETURN_NONE;
    PyObject *tup = PyTuple_New(nwords);
    for (int i = 0; tup && i < nwords; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(words[i]);
        if (!v) {
            Py_CLEAR(tup);
            break;
        }
        PyTuple_SET_ITEM(tup, i, v);
    }
    if (!tup)
        return NULL;
    if (mvz_nodes_class_name(addr, name, sizeof name))
        return Py_BuildValue("(ON)", Py_None, tup);
    return Py_BuildValue("(sN)", name, tup);
}

static PyObject *core_nodes_attach(PyObject *self, PyObject *args)
{
    (void)self;
    if (PyTuple_GET_SIZE(args) == 1 && PyTuple_GET_ITEM(args, 0) == Py_None) {
        mvz_nodes_attach(NULL);
        Py_RETURN_NONE;
    }
    Py_ssize_t modid, tls_off, seq_off, pyobj_off;
    PyObject *vptr_obj;
    if (!PyArg_ParseTuple(args, "nnnOn", &modid, &tls_off, &seq_off, &vptr_obj, &pyobj_off))
        return NULL;
    const void *vptr = PyLong_AsVoidPtr(vptr_obj);
    if (PyErr_Occurred())
        return NULL;
    if (modid <= 0 || tls_off < 0 || seq_off <= 0 || pyobj_off <= 0 || (tls_off | seq_off | pyobj_off) & 7) {
        PyErr_SetString(PyExc_ValueError, "nodes_attach(): bad layout");
        return NULL;
    }
    if (!mvz_nodes_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "nodes_attach(): not supported on this platform");
        return NULL;
    }
    mvz_node_layout l = {(size_t)modid, (size_t)tls_off, (size_t)seq_off, vptr, (size_t)pyobj_off};
    mvz_nodes_attach(&l);
    Py_RETURN_NONE;
}

static PyObject *core_nodes_current(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    const void *node = mvz_nodes_current();
    if (!node)
        Py_RETURN_NONE;
    const char *label = mvz_label_name(mvz_nodes_label(node));
    return Py_BuildValue("(Kz)", (unsigned long long)mvz_nodes_seq(node), label);
}

/* ---- forward lines of autograd nodes (seqmap.h) ------------------------- */

static PyObject *core_seqmap_attach(PyObject *self, PyObject *arg)
{
    (void)self;
    void *p = PyLong_AsVoidPtr(arg);
    if (PyErr_Occurred())
        return NULL;
    mvz_seq_fn fn = NULL;
    if (p)
        memcpy(&fn, &p, sizeof fn); /* ctypes hands over an address */
    mvz_seqmap_attach(fn);
    Py_RETURN_NONE;
}

static PyObject *core_seqmap_lookup(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "seqmap_lookup() takes a sequence of node numbers");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *in = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *in);
    uint32_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *out);
    PyObject *res = NULL;
    if (!in || !out) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        in[i] = PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred())
            goto done;
    }
    mvz_seqmap_lookup(in, out, n);
    res = PyList_New(n);
    for (Py_ssize_t i = 0; res && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(out[i]);
        if (!v) {
            Py_CLEAR(res);
            break;
        }
        PyList_SET_ITEM(res, i, v);
    }
done:
    PyMem_Free(in);
    PyMem_Free(out);
    Py_DECREF(seq);
    return res;
}

/* Benchmarks and tests: the capture path without CUPTI. */
static PyObject *core_synthetic(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long address, size, count = 1;
    int free_it = 1;
    if (!PyArg_ParseTuple(args, "KK|pK", &address, &size, &free_it, &count))
        return NULL;
    if (mvz_ensure_store())
        return NULL;
    for (unsigned long long i = 0; i < count; i++)
        mvz_capture_synthetic(address + i * 256, size, free_it);
    mvz_codeobj_adopt_pending(); /* with the GIL, before any of these code objects can die */
    Py_RETURN_NONE;
}

static PyObject *core_capture_depth(PyObject *self, PyObject *arg)
{
    (void)self;
    long max = PyLong_AsLong(arg);
    if (max == -1 && PyErr_Occurred())
        return NULL;
    if (max < 0 || max > MVZ_MAX_DEPTH)
        max = MVZ_MAX_DEPTH;
    mvz_frame f[MVZ_MAX_DEPTH];
    return PyLong_FromLong(mvz_capture_frames(f, (int)max));
}


static PyMethodDef core_methods[] = {
    {"init", (PyCFunction)(void (*)(void))core_init, METH_VARARGS | METH_KEYWORDS,
     "init(max_live=2**23, max_stacks=2**20, max_frames=2**24): reserve the store."},
    {"cupti_mapped", core_cupti_mapped, METH_NOARGS,
     "Path of a libcupti already mapped in the process, or None."},
    {"cupti_load", core_cupti_load, METH_O,
     "cupti_load(path or None) -> (file, version); OSError with the reason."},
    {"cupti_info", core_cupti_info, METH_NOARGS, "The loaded libcupti, or None."},
    {"start", (PyCFunction)(void (*)(void))core_start, METH_VARARGS | METH_KEYWORDS,
     "start(depth=32, activity=True) -> StartResult(result, step, error, holder, activity, "
     "activity_error)."},
    {"stop", core_stop, METH_NOARGS, "Stop capturing and unsubscribe from CUPTI."},
    {"flush", core_flush, METH_NOARGS, "Deliver pending CUPTI activity records."},
    {"active", core_active, METH_NOARGS, "Whether capture is running."},
    {"clear", core_clear, METH_NOARGS, "Forget everything recorded (not while capturing)."},
    {"label_intern", core_label_intern, METH_O, "Id of a label string (0 for None)."},
    {"label_get", core_label_get, METH_NOARGS, "The calling thread's label id."},
    {"label_set", core_label_set, METH_O, "Set the calling thread's label id."},
    {"label_name", core_label_name, METH_O, "The string of a label id."},
    {"label_count", core_label_count, METH_NOARGS, "Label ids handed out so far (ids are below it + 1)."},
    {"interpose_attach", core_interpose_attach, METH_O,
     "interpose_attach(library path suffix) -> (GOT slots patched, reason when 0)."},
    {"interpose_commit", core_interpose_commit, METH_NOARGS,
     "Switch CUPTI's stream-ordered callbacks off once libraries are wrapped; False undoes all."},
    {"interpose_detach", core_interpose_detach, METH_NOARGS,
     "Put the patched GOT slots back and CUPTI's stream-ordered callbacks on."},
    {"nodes_supported", core_nodes_supported, METH_NOARGS,
     "Whether the callback can read PyTorch's current autograd node here."},
    {"nodes_module", core_nodes_module, METH_O,
     "nodes_module(path suffix) -> (TLS module id, TLS size) of a loaded library, or None."},
    {"nodes_block", core_nodes_block, METH_VARARGS,
     "nodes_block(module id, size) -> a copy of this thread's TLS block of that module."},
    {"nodes_inspect", core_nodes_inspect, METH_VARARGS,
     "nodes_inspect(address, nwords) -> (C++ class name or None, words) read safely, or None."},
    {"nodes_attach", core_nodes_attach, METH_VARARGS,
     "nodes_attach(modid, tls_offset, seq_offset, pynode_vptr, pyobj_offset), or nodes_attach(None)."},
    {"nodes_current", core_nodes_current, METH_NOARGS,
     "(sequence number, label) of the autograd node this thread evaluates, or None."},
    {"seqmap_attach", core_seqmap_attach, METH_O,
     "seqmap_attach(address of at::sequence_number::peek, or 0 to detach)."},
    {"seqmap_lookup", core_seqmap_lookup, METH_O,
     "seqmap_lookup(node numbers) -> stack ids of the lines that made them (0: unknown)."},
    {"_synthetic", core_synthetic, METH_VARARGS,
     "_synthetic(address, size, free=True, count=1): capture path without CUPTI."},
    {"_capture_depth", core_capture_depth, METH_O, "Frames the walker sees here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "memviz._core",
    "GPU memory capture through CUPTI (the C core of memviz).", -1, core_methods,
    NULL, NULL, NULL, NULL,
};

static void atfork_child(void)
{
    mvz_store_atfork_child();
    mvz_capture_atfork_child();
    mvz_tw_atfork_child();
}

PyMODINIT_FUNC PyInit__core(void)
{
    PyObject *m = PyModule_Create(&core_module);
    if (!m)
        return NULL;
    static int atfork_done;
    if (!atfork_done) {
        pthread_atfork(mvz_store_atfork_prepare, mvz_store_atfork_parent, atfork_child);
        atfork_done = 1;
    }
    if (PyModule_AddIntConstant(m, "KIND_DEVICE", MVZ_KIND_DEVICE) ||
        PyModule_AddIntConstant(m, "KIND_HOST", MVZ_KIND_HOST) ||
        PyModule_AddIntConstant(m, "KIND_MANAGED", MVZ_KIND_MANAGED) ||
        PyModule_AddIntConstant(m, "KIND_STATIC", MVZ_KIND_STATIC) ||
        PyModule_AddIntConstant(m, "KIND_PHYSICAL", MVZ_KIND_PHYSICAL) ||
        PyModule_AddIntConstant(m, "KIND_BLOCK", MVZ_KIND_BLOCK) ||
        PyModule_AddFunctions(m, mvz_allocator_methods) ||
        PyModule_AddFunctions(m, mvz_store_bindings) ||
        PyModule_AddFunctions(m, mvz_trace_bindings) || mvz_replay_bindings_init(m) ||
        PyModule_AddFunctions(m, mvz_codeobj_methods) || mvz_records_init(m) ||
        PyModule_AddIntConstant(m, "MAX_DEPTH", MVZ_MAX_DEPTH) ||
        PyModule_AddIntConstant(m, "MAX_WINDOWS", MVZ_MAX_WINDOWS) ||
        PyModule_AddIntConstant(m, "MAX_THREADS", MVZ_MAX_THREADS) ||
        PyModule_AddStringConstant(m, "LABEL_OVERFLOW", MVZ_LABEL_OVERFLOW_NAME) ||
        PyModule_AddIntConstant(m, "ERROR_MULTIPLE_SUBSCRIBERS",
                                MVZ_CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED) ||
        PyModule_AddStringConstant(m, "FRAMES_ABI", mvz_frames_abi)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
