/* memviz._core: the module, and its bindings for capture control (CUPTI,
 * start/stop, clearing), labels, precise mode's wrappers, autograd nodes and
 * the forward-line map. The store's readers are in module_store.c, the
 * row types (struct sequences) in rows.c, code-object lifetimes in codeobj.c.
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
#include "clock.h"
#include "cupti.h"
#include "frames.h"
#include "allocator.h"
#include "bind.h"
#include "codeobj.h"
#include "interpose.h"
#include "labels.h"
#include "nodes.h"
#include "rows.h"
#include "seqmap.h"
#include "store.h"
#include "trace_ring.h"
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
    return Py_BuildValue("(sI)", mvz_cupti_api.path, mvz_cupti_api.version);
}

static PyObject *core_cupti_info(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (!mvz_cupti_api.handle)
        Py_RETURN_NONE;
    return Py_BuildValue("{s:s,s:I,s:O}", "path", mvz_cupti_api.path, "version", mvz_cupti_api.version,
                         "subscribe_v2", mvz_cupti_api.Subscribe_v2 ? Py_True : Py_False);
}

static PyObject *core_start(PyObject *self, PyObject *args, PyObject *kw)
{
    (void)self;
    static char *kwlist[] = {"depth", "activity", "cupti", "shared", NULL};
    int depth = 32, activity = 1, cupti = 1, shared = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|ippp", kwlist, &depth, &activity, &cupti, &shared))
        return NULL;
    if (mvz_module_store_ensure())
        return NULL;
    if (cupti && !mvz_cupti_api.handle) {
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
    Py_BEGIN_ALLOW_THREADS rc = mvz_capture_start(cupti, activity, shared, &st);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return mvz_rows_start(st.result, st.step ? st.step : "",
                                mvz_cupti_result_string(st.result), st.holder, 0, "", 0, "");
    return mvz_rows_start(0, "", "", "", st.activity, st.activity_error, st.cupti, st.shared_with);
}

static PyObject *core_release_cupti(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    int held;
    Py_BEGIN_ALLOW_THREADS held = mvz_capture_release_cupti();
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(held);
}

static PyObject *core_cupti_held(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyBool_FromLong(mvz_capture_cupti_held());
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
    if (mvz_module_store_ensure())
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
    /* No record holds a label id now, and nothing captures: free the ids no
     * label context holds, if the table fills (labels.h), and the node
     * labels cached with them. */
    if (mvz_labels_reclaim(0))
        mvz_nodes_forget_labels();
    for (size_t i = 0; i < n; i++)
        Py_XDECREF((PyObject *)refs[i]);
    free(refs);
    Py_RETURN_NONE;
}

/* A label's UTF-8 bytes (lone surrogates kept as they are: label_obj
 * decodes them back), or NULL with an exception set. A NUL would end the C
 * string early and merge labels: memviz.label() refuses it, and so does
 * this. */
static PyObject *label_bytes(PyObject *arg, const char *who)
{
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s() takes a str or None", who);
        return NULL;
    }
    PyObject *b = PyUnicode_AsEncodedString(arg, "utf-8", "surrogatepass");
    if (!b)
        return NULL;
    if (strlen(PyBytes_AS_STRING(b)) != (size_t)PyBytes_GET_SIZE(b)) {
        Py_DECREF(b);
        PyErr_Format(PyExc_ValueError, "%s(): a label cannot contain NUL characters", who);
        return NULL;
    }
    return b;
}

static PyObject *core_label_intern(PyObject *self, PyObject *arg)
{
    (void)self;
    if (arg == Py_None)
        return PyLong_FromLong(0);
    PyObject *b = label_bytes(arg, "label_intern");
    if (!b)
        return NULL;
    uint32_t id = mvz_labels_intern(PyBytes_AS_STRING(b)); /* never 0: full tables overflow */
    Py_DECREF(b);
    return PyLong_FromUnsignedLong(id);
}

/* label_enter(name, id, generation) -> (id, previous id, generation):
 * memviz.label's enter. `id` of `name`, got in label table generation
 * `generation` (the reclaims so far, labels.h), is still its id if no
 * reclaim ran since; else the name is interned again. The id is pinned while
 * the context holds it, and made this thread's label. */
static PyObject *core_label_enter(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *name;
    unsigned long id;
    unsigned long long gen;
    if (!PyArg_ParseTuple(args, "UkK", &name, &id, &gen))
        return NULL;
    uint64_t now = mvz_labels_reclaims(); /* reclaims run with the GIL: none meanwhile */
    if (gen != now || id == 0 || id > 0xffff) {
        PyObject *b = label_bytes(name, "label_enter");
        if (!b)
            return NULL;
        id = mvz_labels_intern(PyBytes_AS_STRING(b));
        Py_DECREF(b);
    }
    uint32_t prev = mvz_capture_label_get();
    mvz_labels_pin((uint32_t)id, 1);
    mvz_capture_label_set((uint32_t)id);
    return Py_BuildValue("(kkK)", id, (unsigned long)prev, (unsigned long long)now);
}

/* label_generation(): the label table's reclaims so far (label_enter). */
static PyObject *core_label_generation(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(mvz_labels_reclaims());
}

/* label_exit(id, previous id): memviz.label's exit (label_enter's pair). */
static PyObject *core_label_exit(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long id, prev;
    if (!PyArg_ParseTuple(args, "kk", &id, &prev))
        return NULL;
    if (id > 0xffff || prev > 0xffff) {
        PyErr_SetString(PyExc_ValueError, "label_exit() takes ids from label_enter()");
        return NULL;
    }
    mvz_capture_label_set((uint32_t)prev);
    mvz_labels_pin((uint32_t)id, -1);
    Py_RETURN_NONE;
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
    return PyLong_FromUnsignedLong(mvz_labels_high());
}

static PyObject *core_label_name(PyObject *self, PyObject *arg)
{
    (void)self;
    unsigned long id = PyLong_AsUnsignedLong(arg);
    if (PyErr_Occurred())
        return NULL;
    return mvz_rows_label((uint32_t)id);
}

/* ---- precise mode's wrappers (interpose.h) ------------------------------ */

static PyObject *core_interpose_attach(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *suffix = PyUnicode_AsUTF8(arg);
    if (!suffix)
        return NULL;
    char err[512] = "";
    int n = mvz_interpose_attach(suffix, MVZ_WRAP_ASYNC, err, sizeof err);
    return Py_BuildValue("(is)", n, err);
}

static PyObject *core_segments_attach(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *suffix = PyUnicode_AsUTF8(arg);
    if (!suffix)
        return NULL;
    char err[512] = "";
    int n = mvz_interpose_attach(suffix, MVZ_WRAP_SEGMENTS, err, sizeof err);
    if (n > 0)
        mvz_capture_prepare_wrappers(); /* their device: cuCtxGetCurrent */
    return Py_BuildValue("(is)", n, err);
}

static PyObject *core_segments_detach(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    mvz_interpose_detach(MVZ_WRAP_SEGMENTS);
    Py_RETURN_NONE;
}

static PyObject *core_interpose_commit(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (!mvz_interpose_attached(MVZ_WRAP_ASYNC))
        Py_RETURN_FALSE;
    if (mvz_capture_active() && !mvz_capture_cupti_held())
        Py_RETURN_TRUE; /* no CUPTI: the wrappers are the only route, nothing to switch off */
    if (mvz_capture_async_callbacks(0) != 0) { /* both routes would record: undo */
        mvz_interpose_detach(MVZ_WRAP_ASYNC);
        mvz_capture_async_callbacks(1);
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *core_interpose_detach(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    mvz_interpose_detach(MVZ_WRAP_ASYNC);
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
    const char *label = mvz_labels_name(mvz_nodes_label(node));
    return Py_BuildValue("(Kz)", (unsigned long long)mvz_nodes_seq(node), label);
}

/* ---- forward lines of autograd nodes (seqmap.h) ------------------------- */

/* seqmap_attach_counter(module id, offset): PyTorch's node counter read in
 * place (nodes.h) instead of through peek; then seqmap_counter() says what
 * the capture path reads. */
static PyObject *core_seqmap_attach_counter(PyObject *self, PyObject *args)
{
    (void)self;
    Py_ssize_t modid, offset;
    if (!PyArg_ParseTuple(args, "nn", &modid, &offset))
        return NULL;
    if (modid <= 0 || offset < 0 || offset & 7) {
        PyErr_SetString(PyExc_ValueError, "seqmap_attach_counter(): bad module id or offset");
        return NULL;
    }
    if (mvz_nodes_counter_at((size_t)modid, (size_t)offset) != 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "seqmap_attach_counter(): not supported here, or another place was set before");
        return NULL;
    }
    mvz_seqmap_attach(mvz_nodes_counter);
    Py_RETURN_NONE;
}

static PyObject *core_seqmap_counter(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLongLong(mvz_seqmap_counter());
}

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
    mvz_store_sync(); /* notes still in the capture queue are written first */
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
    if (mvz_module_store_ensure())
        return NULL;
    for (unsigned long long i = 0; i < count; i++)
        mvz_capture_synthetic(address + i * 256, size, free_it);
    mvz_codeobj_adopt_pending(); /* with the GIL, before any of these code objects can die */
    Py_RETURN_NONE;
}

/* _frame_rules([(kind, text), ...]): the frame filter's rules for the walk
 * (frames.h: MVZ_RULE_*), with the GIL. */
static PyObject *core_frame_rules(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "_frame_rules takes a sequence of (kind, text)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int *kinds = PyMem_Calloc((size_t)n + 1, sizeof(int));
    const char **texts = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    size_t *lens = PyMem_Calloc((size_t)n + 1, sizeof(size_t));
    PyObject *result = NULL;
    if (!kinds || !texts || !lens) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t len = 0;
        if (!PyArg_ParseTuple(item, "is#", &kinds[i], &texts[i], &len))
            goto done;
        lens[i] = (size_t)len;
    }
    if (mvz_frames_set_rules(kinds, texts, lens, (int)n)) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(kinds);
    PyMem_Free(texts);
    PyMem_Free(lens);
    Py_DECREF(seq);
    return result;
}

/* The walk from here, up to `arg` frames (0..MAX_DEPTH; others: MAX_DEPTH),
 * into f; -1 with an error set. For the two bindings below (tests, benchmarks). */
static int walk_here(PyObject *arg, mvz_frame *f)
{
    long max = PyLong_AsLong(arg);
    if (max == -1 && PyErr_Occurred())
        return -1;
    if (max < 0 || max > MVZ_MAX_DEPTH)
        max = MVZ_MAX_DEPTH;
    return mvz_frames_capture(f, (int)max);
}

static PyObject *core_capture_depth(PyObject *self, PyObject *arg)
{
    (void)self;
    mvz_frame f[MVZ_MAX_DEPTH];
    int n = walk_here(arg, f);
    return n < 0 ? NULL : PyLong_FromLong(n);
}

/* _drainer(on): the capture queue's drainer thread paused (False) or run
 * again (True) while capture runs, so tests can fill the queue (capq.h).
 * Joining it releases the GIL: the drain it ends with may wait for an
 * entry another thread is writing. */
static PyObject *core_drainer(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mvz_store_drainer(on);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return PyErr_Format(PyExc_RuntimeError, "the drainer thread could not start");
    Py_RETURN_NONE;
}

/* _share_frames(on): whether an allocation's entry leaves out the frames it
 * shares with its thread's previous stack (store.c; on by default). Tests
 * that must fill the queue with large entries turn it off. Returns the
 * setting before. */
static PyObject *core_share_frames(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    return PyBool_FromLong(mvz_store_share_frames(on));
}

/* _drain_period(ns) -> the period before: a benchmark's hook, never a
 * user's setting. The drainer applies the queue every `ns` nanoseconds
 * (0: the default, 4 ms) from its next wait. */
static PyObject *core_drain_period(PyObject *self, PyObject *arg)
{
    (void)self;
    long ns = PyLong_AsLong(arg);
    if (ns == -1 && PyErr_Occurred())
        return NULL;
    if (ns < 0 || ns > 10L * 1000 * 1000 * 1000)
        return PyErr_Format(PyExc_ValueError, "_drain_period: %ld ns is not between 0 (the default) and 10 s", ns);
    return PyLong_FromLong(mvz_store_drain_period(ns));
}

/* _prefetch(mode) -> the mode before: a benchmark's hook, never a user's
 * setting. Which of the capture path's prefetches run (store.h MVZ_PF_*:
 * 1 the walk's frames and stacks, 2 the queue's unit before a claim, 4 the
 * next unit after a publish, 8 an entry's lines demoted once published,
 * 16 entries written to the thread's own room and never queued: events
 * lost, for a benchmark only; 32 and 64, 32 more cold code or data lines an
 * event; in an ablation build, CFLAGS=-DMVZ_ABLATE, also 128 no autograd
 * node read and 256 no clock read); True is the default, False none. */
static PyObject *core_prefetch(PyObject *self, PyObject *arg)
{
    (void)self;
    long mode;
    if (PyBool_Check(arg))
        mode = arg == Py_True ? MVZ_PF_DEFAULT : 0;
    else if ((mode = PyLong_AsLong(arg)) == -1 && PyErr_Occurred())
        return NULL;
    if (mode < 0 || (mode & ~(long)MVZ_PF_MAX) != 0)
        return PyErr_Format(PyExc_ValueError,
                            "_prefetch: %ld is not True, False or a mode from 0 to %d%s", mode,
                            MVZ_PF_MAX, MVZ_PF_MAX == MVZ_PF_ALL ? "" : " (an ablation build)");
    return PyLong_FromLong(mvz_store_prefetch_on((int)mode));
}

/* _depth(n) -> the depth before: a benchmark's hook, never a user's
 * setting (track(depth=) is): the frames kept from the next event on,
 * while capture runs. */
static PyObject *core_depth(PyObject *self, PyObject *arg)
{
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > MVZ_MAX_DEPTH)
        return PyErr_Format(PyExc_ValueError, "_depth: %ld is not between 0 and %d", n, MVZ_MAX_DEPTH);
    return PyLong_FromLong(mvz_capture_depth((int)n));
}

/* _callback_profile(mode) -> the mode before: a benchmark's hook, never a
 * user's setting. From the next start, "time" times the CUPTI callback
 * (stats()'s profile_calls and profile_ns), "noop" returns from it at once
 * and records nothing (CUPTI's own dispatch cost, alone), "noasync" leaves
 * the stream-ordered cbids off; "off" (the default) records as always. */
static const char *const profile_names[] = {"off", "time", "noop", "noasync"};

static PyObject *core_callback_profile(PyObject *self, PyObject *arg)
{
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    for (int m = 0; m < (int)(sizeof profile_names / sizeof *profile_names); m++)
        if (!strcmp(name, profile_names[m]))
            return PyUnicode_FromString(profile_names[mvz_capture_set_profile(m)]);
    return PyErr_Format(PyExc_ValueError, "_callback_profile: %R is not off, time, noop or noasync", arg);
}

/* _capture_timings() -> [(thread id, allocations, ns, frees, ns), ...]: the
 * allocator route's capture path timed per thread under
 * _callback_profile("time") (benchmarks/bench_in_step.py). */
static PyObject *core_capture_timings(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    enum { MAX = 64 };
    long tid[MAX];
    uint64_t n[MAX][2], ticks[MAX][2];
    int k = mvz_capture_timings(tid, n, ticks, MAX);
    double per_tick = mvz_tick_is_tsc() ? mvz_clock_ns_per_tick() : 1.0;
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < k; i++) {
        PyObject *row = Py_BuildValue("(lKdKd)", tid[i], (unsigned long long)n[i][0],
                                      (double)ticks[i][0] * per_tick, (unsigned long long)n[i][1],
                                      (double)ticks[i][1] * per_tick);
        if (!row || PyList_Append(out, row) < 0) {
            Py_XDECREF(row);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(row);
    }
    return out;
}

/* _capture_noop(on) -> was it on: while capture is on, the allocator route's
 * capture path returns at once (benchmarks/bench_train_step.py memviz_noop:
 * the route's wrappers and the tracker's threads, with nothing recorded). */
static PyObject *core_capture_noop(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    int was = mvz_capture_noop(on);
    if (was < 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "_capture_noop: no tracker is capturing, or its capture path is timed "
                        "(_callback_profile('time')): start a tracker with the profile off first");
        return NULL;
    }
    return PyBool_FromLong(was);
}

/* _stage_timings() -> None, or in a stage build (clock.h, -DMVZ_STAGES)
 * [(thread id, {stage: (points, ns)}), ...] (bench_in_step.py --stages). */
static PyObject *core_stage_timings(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
#ifdef MVZ_STAGES
    static const char *const names[] = {
        "null", "a_before", "a_wrap", "a_enter", "a_label", "a_note", "a_walk", "a_compare",
        "a_claim", "a_fill", "a_publish", "a_exit", "f_enter", "f_tick", "f_claim", "f_publish",
        "f_exit", "f_release"};
    _Static_assert(sizeof names / sizeof *names == MVZ_STAGES_N, "a name for every stage, in order");
    enum { MAX = 64 };
    static long tid[MAX];
    static uint64_t ticks[MAX][MVZ_STAGES_N], n[MAX][MVZ_STAGES_N];
    int k = mvz_stage_read(tid, ticks, n, MAX);
    double per_tick = mvz_clock_ns_per_tick();
    PyObject *out = PyList_New(0);
    for (int i = 0; out && i < k; i++) {
        PyObject *d = PyDict_New();
        for (int j = 0; d && j < MVZ_STAGES_N; j++) {
            PyObject *v = Py_BuildValue("(Kd)", (unsigned long long)n[i][j], (double)ticks[i][j] * per_tick);
            if (!v || PyDict_SetItemString(d, names[j], v) < 0)
                Py_CLEAR(d);
            Py_XDECREF(v);
        }
        PyObject *row = d ? Py_BuildValue("(lN)", tid[i], d) : NULL;
        if (!row || PyList_Append(out, row) < 0)
            Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
#else
    Py_RETURN_NONE;
#endif
}

/* _capture_stack(depth): what the walk keeps here (tests of deep stacks). */
static PyObject *core_capture_stack(PyObject *self, PyObject *arg)
{
    (void)self;
    mvz_frame f[MVZ_MAX_DEPTH];
    int n = walk_here(arg, f);
    if (n < 0)
        return NULL;
    PyObject *out = PyTuple_New(n);
    for (int i = 0; out && i < n; i++) {
        PyObject *t = Py_BuildValue("(Oi)", (PyObject *)f[i].code, f[i].offset);
        if (!t) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, i, t);
    }
    return out;
}

/* _clock(on=None) -> (tsc, ns_per_tick): whether the capture path reads
 * the TSC (clock.h), and the rate measured at import. With a bool: the TSC
 * on or off, for tests, refused while capturing; the queue's entries each
 * say which clock they hold, so those already queued convert as read. */
static PyObject *core_clock(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *on = Py_None;
    if (!PyArg_ParseTuple(args, "|O:_clock", &on))
        return NULL;
    if (on != Py_None) {
        int want = PyObject_IsTrue(on);
        if (want < 0)
            return NULL;
        if (mvz_capture_active())
            return PyErr_Format(PyExc_RuntimeError, "_clock(): stop capturing first");
        if (want && mvz_clock_ns_per_tick() == 0)
            return PyErr_Format(PyExc_RuntimeError, "_clock(): this machine's TSC is not usable");
        __atomic_store_n(&mvz_hot.clock_tsc, want, __ATOMIC_RELAXED);
    }
    return Py_BuildValue("(Od)", mvz_tick_is_tsc() ? Py_True : Py_False, mvz_clock_ns_per_tick());
}

/* own(on) -> bool: what this thread allocates while on is memviz's own. */
static PyObject *core_own(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    return PyBool_FromLong(mvz_capture_set_own(on));
}

static PyMethodDef core_methods[] = {
    {"own", core_own, METH_O,
     "own(on) -> previous: what this thread allocates while on is memviz's own (FLAG_MEMVIZ)."},
    {"init", (PyCFunction)(void (*)(void))core_init, METH_VARARGS | METH_KEYWORDS,
     "init(max_live=2**23, max_stacks=2**20, max_frames=2**24): reserve the store."},
    {"cupti_mapped", core_cupti_mapped, METH_NOARGS,
     "Path of a libcupti already mapped in the process, or None."},
    {"cupti_load", core_cupti_load, METH_O,
     "cupti_load(path or None) -> (file, version); OSError with the reason."},
    {"cupti_info", core_cupti_info, METH_NOARGS, "The loaded libcupti, or None."},
    {"start", (PyCFunction)(void (*)(void))core_start, METH_VARARGS | METH_KEYWORDS,
     "start(depth=32, activity=True, cupti=True, shared=True) -> StartResult(result, step, error, "
     "holder, activity, activity_error, cupti, shared_with). cupti=False: capture on the wrappers "
     "alone; shared: subscribe beside another tool where CUPTI allows it."},
    {"release_cupti", core_release_cupti, METH_NOARGS,
     "Give CUPTI up while capture goes on (the wrappers record); True if it was held."},
    {"cupti_held", core_cupti_held, METH_NOARGS, "Whether CUPTI's callbacks record now."},
    {"segments_attach", core_segments_attach, METH_O,
     "segments_attach(library path suffix) -> (GOT slots patched, reason when 0): wrap its "
     "cudaMalloc/cudaFree (recorded while CUPTI is not held)."},
    {"segments_detach", core_segments_detach, METH_NOARGS, "Put cudaMalloc/cudaFree's GOT slots back."},
    {"stop", core_stop, METH_NOARGS, "Stop capturing and unsubscribe from CUPTI."},
    {"flush", core_flush, METH_NOARGS, "Deliver pending CUPTI activity records."},
    {"active", core_active, METH_NOARGS, "Whether capture is running."},
    {"clear", core_clear, METH_NOARGS, "Forget everything recorded (not while capturing)."},
    {"label_intern", core_label_intern, METH_O, "Id of a label string (0 for None)."},
    {"label_get", core_label_get, METH_NOARGS, "The calling thread's label id."},
    {"label_set", core_label_set, METH_O, "Set the calling thread's label id."},
    {"label_name", core_label_name, METH_O, "The string of a label id."},
    {"label_count", core_label_count, METH_NOARGS,
     "The highest label id in use (ids handed out after it are higher, until the store is next cleared)."},
    {"label_enter", core_label_enter, METH_VARARGS,
     "label_enter(name, id, generation) -> (id, previous id, generation): hold and set this thread's label."},
    {"label_generation", core_label_generation, METH_NOARGS, "Reclaims of the label table so far."},
    {"label_exit", core_label_exit, METH_VARARGS, "label_exit(id, previous id): label_enter's pair."},
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
    {"seqmap_attach_counter", core_seqmap_attach_counter, METH_VARARGS,
     "seqmap_attach_counter(TLS module id, offset): read PyTorch's node counter in place."},
    {"seqmap_counter", core_seqmap_counter, METH_NOARGS,
     "seqmap_counter() -> the node counter as the capture path reads it now (0: not attached)."},
    {"seqmap_lookup", core_seqmap_lookup, METH_O,
     "seqmap_lookup(node numbers) -> stack ids of the lines that made them (0: unknown)."},
    {"_synthetic", core_synthetic, METH_VARARGS,
     "_synthetic(address, size, free=True, count=1): capture path without CUPTI."},
    {"_capture_depth", core_capture_depth, METH_O, "Frames the walker sees here."},
    {"_clock", core_clock, METH_VARARGS,
     "_clock(on=None) -> (tsc, ns_per_tick): the capture path's clock (tests may switch it)."},
    {"_drain_period", core_drain_period, METH_O, "A benchmark's: the drainer's period in ns (0: the default); returns the one before."},
    {"_depth", core_depth, METH_O, "A benchmark's: the frames kept from the next event on; returns the depth before."},
    {"_prefetch", core_prefetch, METH_O, "A benchmark's: the capture path's prefetch and queue switches (store.h MVZ_PF_*; True the default, False none); returns the mode before."},
    {"_drainer", core_drainer, METH_O, "Pause (False) or run (True) the capture queue's drainer thread."},
    {"_callback_profile", core_callback_profile, METH_O,
     "_callback_profile(mode) -> the mode before: benchmarks only; from the next start "
     "'time' times the CUPTI callback, 'noop' returns from it at once (recording nothing), "
     "'noasync' leaves the stream-ordered callbacks off, 'off' records as always."},
    {"_capture_noop", core_capture_noop, METH_O,
     "_capture_noop(on) -> bool: benchmarks only; while capture is on, the allocator route's "
     "capture path returns at once (on) or records again (off)."},
    {"_stage_timings", core_stage_timings, METH_NOARGS,
     "_stage_timings() -> None, or in a stage build (-DMVZ_STAGES) each thread's ticks per stage."},
    {"_capture_timings", core_capture_timings, METH_NOARGS,
     "_capture_timings() -> [(thread id, allocations, ns, frees, ns), ...]: the allocator "
     "route's capture path, timed per thread under _callback_profile('time') (benchmarks)."},
    {"_share_frames", core_share_frames, METH_O,
     "Whether queued allocations leave out the frames shared with the thread's previous stack."},
    {"_capture_stack", core_capture_stack, METH_O,
     "_capture_stack(depth) -> ((code, offset), ...) the walker keeps here, innermost first."},
    {"_frame_rules", core_frame_rules, METH_O,
     "_frame_rules([(kind, text), ...]): the frame filter's rules for deep stacks (frames.h)."},
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

/* The allocation record's schema (record.h), for Python's readers and
 * writers: EVENT_FIELDS (the file's field names), EVENT_FORMAT (its
 * struct format), EVENT_SIZE and EVENT_V1_SIZE (bytes of a file record, now
 * and in format 1), RAW_EVENT_SIZE (bytes of a record in the capture ring),
 * TIMELINE_POINTS, the OP_* codes and FLAG_* bits, INFLATE_SLACK; and of the
 * trace ring and writer (trace_ring.h, trace_writer.h): TRACE_RING_MIN and
 * _MAX, FLIGHT_MIN_BUDGET, CHUNK_KIND_EVENTS, CHUNK_COMPRESSED, LAYOUT_ROWS and
 * _PLANES; LABEL_OVERFLOW_ID (labels.h: the id of every label past the
 * table's room, the record's largest). */
static int add_record_schema(PyObject *m)
{
#define MVZ_F_NAME(mname, mtype, fname, ftype, code, rule) #fname,
#define MVZ_F_CODE(mname, mtype, fname, ftype, code, rule) code
    static const char *names[] = {MVZ_RECORD_FIELDS(MVZ_F_NAME)};
    static const char format[] = "<" MVZ_RECORD_FIELDS(MVZ_F_CODE);
    size_t n = sizeof names / sizeof names[0];
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    for (size_t k = 0; t && k < n; k++) {
        PyObject *s = PyUnicode_FromString(names[k]);
        if (!s) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)k, s);
    }
    if (!t || PyModule_AddObject(m, "EVENT_FIELDS", t) < 0) {
        Py_XDECREF(t);
        return -1;
    }
    return PyModule_AddStringConstant(m, "EVENT_FORMAT", format) ||
           PyModule_AddIntConstant(m, "EVENT_SIZE", MVZ_EVENT_SIZE) ||
           PyModule_AddIntConstant(m, "EVENT_V1_SIZE", MVZ_EVENT_V1_SIZE) ||
           PyModule_AddIntConstant(m, "RAW_EVENT_SIZE", sizeof(mvz_alloc)) ||
           PyModule_AddIntConstant(m, "TIMELINE_POINTS", MVZ_TIMELINE_POINTS) ||
           PyModule_AddIntConstant(m, "MAX_RATIO", MVZ_MAX_RATIO) ||
           PyModule_AddIntConstant(m, "INFLATE_SLACK", MVZ_INFLATE_SLACK) ||
           PyModule_AddIntConstant(m, "OP_ALLOC", MVZ_EV_ALLOC) ||
           PyModule_AddIntConstant(m, "OP_FREE", MVZ_EV_FREE) ||
           PyModule_AddIntConstant(m, "OP_FAILED", MVZ_EV_FAILED) ||
           PyModule_AddIntConstant(m, "OP_TIME", MVZ_EV_TIME) ||
           PyModule_AddIntConstant(m, "OP_GAP", MVZ_EV_GAP) ||
           PyModule_AddIntConstant(m, "TRACE_RING_MIN", (long)MVZ_RING_MIN_EVENTS) ||
           PyModule_AddIntConstant(m, "TRACE_RING_MAX", (long)MVZ_RING_MAX_EVENTS) ||
           PyModule_AddIntConstant(m, "FLIGHT_MIN_BUDGET", (long)MVZ_TW_FLIGHT_MIN_BUDGET) ||
           PyModule_AddIntConstant(m, "CHUNK_KIND_EVENTS", MVZ_TW_CHUNK_EVENTS) ||
           PyModule_AddIntConstant(m, "CHUNK_COMPRESSED", MVZ_TW_CHUNK_COMPRESSED) ||
           PyModule_AddIntConstant(m, "LAYOUT_ROWS", MVZ_TW_LAYOUT_ROWS) ||
           PyModule_AddIntConstant(m, "LAYOUT_PLANES", MVZ_TW_LAYOUT_PLANES) ||
           PyModule_AddIntConstant(m, "LABEL_OVERFLOW_ID", MVZ_MAX_LABELS - 1) ||
           PyModule_AddIntConstant(m, "FLAG_BEFORE", MVZ_FLAG_BEFORE) ||
           PyModule_AddIntConstant(m, "FLAG_ESTIMATED", MVZ_FLAG_ESTIMATED) ||
           PyModule_AddIntConstant(m, "FLAG_MEMVIZ", MVZ_FLAG_MEMVIZ) ||
           PyModule_AddIntConstant(m, "FLAG_SYNTHETIC", MVZ_FLAG_SYNTHETIC);
}

PyMODINIT_FUNC PyInit__core(void)
{
    PyObject *m = PyModule_Create(&core_module);
    if (!m)
        return NULL;
    mvz_clock_init(); /* before anything captures: the capture path's clock */
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
        PyModule_AddFunctions(m, mvz_module_store_bindings) || PyModule_AddFunctions(m, mvz_module_seed_bindings) ||
        PyModule_AddFunctions(m, mvz_module_heap_bindings) ||
        PyModule_AddFunctions(m, mvz_module_trace_bindings) || mvz_module_replay_init(m) || mvz_module_whatif_init(m) ||
        PyModule_AddFunctions(m, mvz_codeobj_methods) || mvz_rows_init(m) ||
        add_record_schema(m) ||
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
