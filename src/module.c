/* memviz._core: the Python face of the C core. Every function here runs with
 * the GIL; none of them holds the store lock while calling Python (the store
 * copies out, then objects are built), so a garbage collection or a
 * finalizer that allocates GPU memory cannot deadlock against the capture
 * callback.
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
#include "interpose.h"
#include "labels.h"
#include "nodes.h"
#include "seqmap.h"
#include "store.h"

static int store_ready;

/* ---- keeping code objects alive ------------------------------------- */

/* A stack's frames point at code objects that the capture path, running
 * without the GIL, cannot take references to. They are safe to read while
 * the capturing thread is inside the driver call (its frames hold them), and
 * afterwards only once memviz holds a reference ("adopts" them, with the
 * GIL) or has resolved them to plain tuples.
 *
 * Adoption alone cannot close the gap: the capturing thread may pop its
 * frames and drop the last reference before any thread adopts (on Python <
 * 3.12 a pending call runs on the main thread only, which may be waiting in
 * join() meanwhile). So memviz is told of every code object's death, before
 * its memory is freed: PyCode_AddWatcher on 3.12+, and on older versions a
 * wrapper around the code type's tp_dealloc (the same event, from the same
 * place: the code type is final and every deallocation goes through that
 * slot). At that point, with the GIL, the store's not-yet-adopted frames of
 * that code object are resolved to (filename, lineno, name, call). Why that
 * is complete: a frame can only enter the pending list while its code
 * object is alive in the capturing thread's frame chain, so it was interned
 * (under the store lock) before that frame was popped, and the pop, the last
 * decref and the death event all come after it on threads that took the GIL
 * in between (the GIL hand-off orders them); the pending list is therefore
 * seen whole when the event comes. Nothing else ever reads a pending frame's
 * code object, so no dead one is dereferenced. Adoption then remains a way
 * to keep the pending list short and line numbers exact. The hook stays
 * installed once tracking first starts, so a callback still in flight when
 * tracking stops is covered too; with nothing pending it costs one load. */

static void adopt_code(void *code) { Py_INCREF((PyObject *)code); }

static void adopt_pending(void) { mvz_store_adopt_pending(adopt_code); }

static PyObject *call_namer; /* memviz._callsite._name_dying, or NULL */
static void *last_code;      /* one death event's last (code, offset) and tuple */
static int32_t last_offset;
static PyObject *last_tuple;

/* `call` is what memviz._callsite names the instruction's call (None if it
 * cannot), so Allocation.op survives the code object (a notebook cell's). */
static PyObject *frame_tuple(PyCodeObject *co, int offset)
{
    int line = PyCode_Addr2Line(co, offset);
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *name = co->co_qualname ? co->co_qualname : co->co_name;
#else
    PyObject *name = co->co_name;
#endif
#if PY_VERSION_HEX >= 0x030D0000
    int finalizing = Py_IsFinalizing();
#else
    int finalizing = _Py_IsFinalizing();
#endif
    /* no Python naming while the interpreter tears its modules down */
    PyObject *call = call_namer && !finalizing
                         ? PyObject_CallFunction(call_namer, "Oi", (PyObject *)co, offset)
                         : NULL;
    if (!call) {
        PyErr_Clear(); /* naming is best effort: the frame itself must resolve */
        call = Py_NewRef(Py_None);
    }
    return Py_BuildValue("(OiON)", co->co_filename, line, name, call);
}

static void *resolve_dying(void *code, int32_t offset)
{
    if (last_tuple && last_code == code && last_offset == offset)
        return Py_NewRef(last_tuple); /* the same frame in another stack */
    PyObject *t = frame_tuple((PyCodeObject *)code, offset);
    if (!t) {
        PyErr_Clear();
        return NULL;
    }
    Py_XSETREF(last_tuple, Py_NewRef(t));
    last_code = code;
    last_offset = offset;
    return t;
}

/* With the GIL, as `co` is destroyed (its fields still intact). */
static void on_code_death(PyCodeObject *co)
{
    if (!mvz_store_has_pending())
        return;
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
#endif
    if (mvz_store_mark_dying(co))
        mvz_store_resolve_dying(co, resolve_dying);
    Py_CLEAR(last_tuple);
    last_code = NULL;
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(et, ev, tb);
#endif
}

#if PY_VERSION_HEX >= 0x030C0000
static int code_watcher_id = -1;

static int on_code_event(PyCodeEvent event, PyCodeObject *co)
{
    if (event == PY_CODE_EVENT_DESTROY)
        on_code_death(co);
    return 0;
}

static int watch_code_deaths(void)
{
    if (code_watcher_id < 0)
        code_watcher_id = PyCode_AddWatcher(on_code_event);
    return code_watcher_id < 0 ? -1 : 0;
}
#else
static destructor code_dealloc; /* the code type's own */

static void code_dealloc_watched(PyObject *co)
{
    if (mvz_store_has_pending()) {
        /* As 3.12's code_dealloc does around its watchers: resolving runs
         * Python (the call namer), so the object holds a reference
         * meanwhile, and one that is still referenced afterwards lives on. */
        Py_SET_REFCNT(co, 1);
        on_code_death((PyCodeObject *)co);
        if (Py_REFCNT(co) > 1) {
            Py_SET_REFCNT(co, Py_REFCNT(co) - 1);
            return;
        }
        Py_SET_REFCNT(co, 0);
    }
    code_dealloc(co);
}

static int watch_code_deaths(void)
{
    if (!code_dealloc) {
        code_dealloc = PyCode_Type.tp_dealloc;
        PyCode_Type.tp_dealloc = code_dealloc_watched;
    }
    return 0;
}

/* New stacks are also adopted at the next pending-call check of the main
 * thread (Python < 3.12 runs pending calls there only). */
static int adopt_scheduled;

static int adopt_pending_call(void *arg)
{
    (void)arg;
    __atomic_store_n(&adopt_scheduled, 0, __ATOMIC_RELEASE);
    adopt_pending();
    return 0;
}

/* Capture path, no GIL: one compare-and-swap, and Py_AddPendingCall, which
 * CPython documents as safe to call without the GIL from any thread. */
static void schedule_adopt(void)
{
    int expected = 0;
    if (__atomic_compare_exchange_n(&adopt_scheduled, &expected, 1, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED)) {
        if (Py_AddPendingCall(adopt_pending_call, NULL) != 0)
            __atomic_store_n(&adopt_scheduled, 0, __ATOMIC_RELEASE);
    }
}
#endif

/* set_call_namer(fn or None): what names a dying code object's calls. */
static PyObject *core_set_call_namer(PyObject *self, PyObject *fn)
{
    (void)self;
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_SetString(PyExc_TypeError, "set_call_namer() takes a callable or None");
        return NULL;
    }
    Py_XSETREF(call_namer, fn == Py_None ? NULL : Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* ---- helpers ---------------------------------------------------------- */

static int ensure_store(void)
{
    if (store_ready)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "memviz._core.init() was not called");
    return -1;
}

static PyObject *label_obj(uint32_t id)
{
    const char *s = mvz_label_name(id);
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

static PyObject *alloc_rows(mvz_alloc *rows, long n)
{
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *list = PyList_New(n);
    for (long i = 0; list && i < n; i++) {
        const mvz_alloc *a = &rows[i];
        PyObject *label = label_obj(a->label_id);
        PyObject *row = label ? Py_BuildValue("(KKiiKINKIK)", (unsigned long long)a->address,
                                               (unsigned long long)a->size,
                                               a->slot == MVZ_HOST_SLOT ? -1 : (int)a->slot,
                                               (int)a->kind, (unsigned long long)a->stream,
                                               a->thread_idx, label,
                                               (unsigned long long)a->timestamp, a->stack_id,
                                               (unsigned long long)a->timestamp)
                              : NULL;
        if (!row) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, row);
    }
    free(rows);
    return list;
}

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
    if (!store_ready) {
        if (mvz_store_init((size_t)max_live, (size_t)max_stacks, (size_t)max_frames) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        store_ready = 1;
    }
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
    if (ensure_store())
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
    if (watch_code_deaths() != 0)
        return NULL;
#if PY_VERSION_HEX < 0x030C0000
    mvz_new_stack_hook = schedule_adopt;
#endif
    mvz_start_status st;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = mvz_capture_start(activity, &st);
    Py_END_ALLOW_THREADS
    if (rc != 0)
        return Py_BuildValue("(isssOs)", st.result, st.step ? st.step : "",
                             mvz_cupti_result_string(st.result), st.holder, Py_False, "");
    return Py_BuildValue("(isssOs)", 0, "", "", "", st.activity ? Py_True : Py_False,
                         st.activity_error);
}

static PyObject *core_stop(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS mvz_capture_stop();
    Py_END_ALLOW_THREADS
    if (store_ready)
        adopt_pending(); /* code deaths stay watched: a late callback may add stacks */
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
    if (ensure_store())
        return NULL;
    if (mvz_capture_active()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot clear while capturing");
        return NULL;
    }
    void **refs;
    size_t n;
    adopt_pending(); /* so every reference the store holds is listed */
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

static PyObject *core_label_name(PyObject *self, PyObject *arg)
{
    (void)self;
    unsigned long id = PyLong_AsUnsignedLong(arg);
    if (PyErr_Occurred())
        return NULL;
    return label_obj((uint32_t)id);
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

static PyObject *core_live(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (ensure_store())
        return NULL;
    mvz_alloc *rows = NULL;
    long n = mvz_store_live(&rows);
    return alloc_rows(rows, n);
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
    return ensure_store();
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

static PyObject *core_peak_live(PyObject *self, PyObject *args)
{
    (void)self;
    long dev;
    int window;
    if (parse_window(args, "l|i", &dev, &window))
        return NULL;
    if (window_check(window))
        return NULL;
    int slot = dev < 0 ? MVZ_HOST_SLOT : (int)dev;
    mvz_alloc *rows = NULL;
    long n = window < 0 ? mvz_store_peak_live(slot, &rows)
                        : mvz_store_window_peak_live(window, slot, &rows);
    return alloc_rows(rows, n);
}

static PyObject *totals_dict(const mvz_totals *t);

static PyObject *core_block_totals(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (ensure_store())
        return NULL;
    mvz_totals t[MVZ_NSLOTS];
    mvz_store_block_totals(t);
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
    if (ensure_store())
        return NULL;
    mvz_site *rows = NULL;
    long n = mvz_store_sites(&rows);
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *list = PyList_New(n);
    for (long i = 0; list && i < n; i++) {
        PyObject *row = Py_BuildValue("(IKIKKK)", rows[i].stack_id,
                                      (unsigned long long)rows[i].live_bytes, rows[i].live_count,
                                      (unsigned long long)rows[i].peak_bytes,
                                      (unsigned long long)rows[i].alloc_count,
                                      (unsigned long long)rows[i].alloc_bytes);
        if (!row) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, row);
    }
    free(rows);
    return list;
}

static PyObject *core_failures(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (ensure_store())
        return NULL;
    mvz_failure *rows = NULL;
    long n = mvz_store_failures(&rows);
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *list = PyList_New(n);
    for (long i = 0; list && i < n; i++) {
        const mvz_failure *f = &rows[i];
        PyObject *label = label_obj(f->label_id);
        PyObject *row = label ? Py_BuildValue("(KiiKINKIi)", (unsigned long long)f->size,
                                               f->slot == MVZ_HOST_SLOT ? -1 : (int)f->slot,
                                               (int)f->kind, (unsigned long long)f->stream,
                                               f->thread_idx, label,
                                               (unsigned long long)f->timestamp, f->stack_id,
                                               f->result)
                              : NULL;
        if (!row) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, row);
    }
    free(rows);
    return list;
}

static PyObject *timeline_list(mvz_point *rows, long n);

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
    return timeline_list(rows, n);
}

/* Rows of (timestamp_ns, device, bytes); frees `rows`. */
static PyObject *timeline_list(mvz_point *rows, long n)
{
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *list = PyList_New(n);
    for (long i = 0; list && i < n; i++) {
        PyObject *row = Py_BuildValue("(KiK)", (unsigned long long)rows[i].timestamp,
                                      rows[i].slot == MVZ_HOST_SLOT ? -1 : rows[i].slot,
                                      (unsigned long long)rows[i].total);
        if (!row) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, row);
    }
    free(rows);
    return list;
}

static PyObject *core_threads(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (ensure_store())
        return NULL;
    mvz_thread *rows = NULL;
    long n = mvz_store_threads(&rows);
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *d = PyDict_New();
    for (long i = 0; d && i < n; i++) {
        PyObject *k = PyLong_FromLong(i);
        PyObject *v = Py_BuildValue("(LKsK)", (long long)rows[i].native_id,
                                    (unsigned long long)rows[i].ident, rows[i].name,
                                    (unsigned long long)rows[i].serial);
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
        PyObject *v = Py_BuildValue("(OOsO)", Py_None, Py_None, "<threads past the first "
                                    Py_STRINGIFY(MVZ_MAX_THREADS) ">", Py_None);
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
    if (ensure_store())
        return NULL;
    mvz_store_stats s;
    mvz_store_get_stats(&s);
    uint32_t nlabels;
    uint64_t labels_overflowed, label_bytes;
    mvz_label_stats(&nlabels, &labels_overflowed, &label_bytes);
    uint64_t c[MVZ_OP_COUNT];
    mvz_capture_counts(c);
    PyObject *calls = PyDict_New();
    for (int i = 0; calls && i < MVZ_OP_COUNT; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c[i]);
        if (!v || PyDict_SetItemString(calls, mvz_op_names[i], v) < 0)
            Py_CLEAR(calls);
        Py_XDECREF(v);
    }
    if (!calls)
        return NULL;
    uint64_t prof_calls, prof_ns;
    mvz_capture_profile(&prof_calls, &prof_ns);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:I,s:N,s:s,s:K,s:K,"
                         "s:I,s:K,s:K}", "live", s.live, "stacks", s.stacks, "frames", s.frames, "threads", s.threads,
                         "unmatched_frees", s.unmatched_frees, "dropped_allocs", s.dropped_allocs,
                         "dropped_stacks", s.dropped_stacks, "dropped_threads", s.dropped_threads,
                         "timeline_points", s.timeline_points,
                         "bytes_used", s.bytes_used, "bytes_reserved", s.bytes_reserved,
                         "max_live", s.max_live, "calls", calls, "frames_abi", mvz_frames_abi,
                         "profile_calls", prof_calls, "profile_ns", prof_ns, "labels", nlabels,
                         "labels_overflowed", labels_overflowed, "label_bytes", label_bytes);
}

/* resolve(ids) -> {id: ((filename, lineno, name), ...)} innermost first. */
static PyObject *core_resolve(PyObject *self, PyObject *ids)
{
    (void)self;
    if (ensure_store())
        return NULL;
    adopt_pending(); /* every code object we are about to read is kept alive */
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
        PyObject *stack = PyTuple_New(depth);
        if (!stack) {
            Py_DECREF(item);
            goto error;
        }
        for (int i = 0; i < depth; i++) {
            PyObject *fr;
            if (buf[i].flags & MVZ_FRAME_RESOLVED) {
                fr = buf[i].code ? (PyObject *)buf[i].code : Py_None;
                if (fr == Py_None)
                    fr = Py_BuildValue("(sis)", "<unknown>", 0, "<unknown>");
                else /* (filename, lineno, name[, call]): frames are the first three */
                    fr = PyTuple_GetSlice(fr, 0, 3);
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
                    fr = Py_BuildValue("(OiO)", co->co_filename, line, name);
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
 * making (memviz/_callsite.py); where that code object was already destroyed,
 * the name made then. Stacks with no frames, or no name, are left out. */
static PyObject *core_call_sites(PyObject *self, PyObject *ids)
{
    (void)self;
    if (ensure_store())
        return NULL;
    adopt_pending(); /* every code object we are about to hand out is kept alive */
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

/* step_mark() -> ({device: (current, window_peak, live_count)},
 *                [(stack_id, live_bytes, live_count, delta_bytes, delta_count)])
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
        PyObject *v = Py_BuildValue("(KKI)", (unsigned long long)t[s].current,
                                    (unsigned long long)t[s].window_peak, t[s].live_count);
        if (!k || !v || PyDict_SetItem(dev, k, v) < 0)
            Py_CLEAR(dev);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    PyObject *list = dev ? PyList_New(n) : NULL;
    for (long i = 0; list && i < n; i++) {
        PyObject *row = Py_BuildValue("(IKILL)", ch[i].stack_id, (unsigned long long)ch[i].live_bytes,
                                      ch[i].live_count, (long long)ch[i].delta_bytes,
                                      (long long)ch[i].delta_count);
        if (!row) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, row);
    }
    free(ch);
    if (!list) {
        Py_XDECREF(dev);
        return NULL;
    }
    return Py_BuildValue("(NN)", dev, list);
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

/* copy(window=-1, close=False) -> (live rows, totals, peak rows, timeline,
 * when_ns): what a tracker reads, at one instant (mvz_store_copy). */
static PyObject *core_copy(PyObject *self, PyObject *args)
{
    (void)self;
    int window = -1, close = 0;
    if (!PyArg_ParseTuple(args, "|ip", &window, &close) || ensure_store())
        return NULL;
    if (window < -1 || window >= MVZ_MAX_WINDOWS)
        return window_closed();
    if (window_check(window))
        return NULL;
    mvz_store_copy_t c;
    if (mvz_store_copy(window, close, &c))
        return PyErr_NoMemory();
    PyObject *live = alloc_rows(c.live, (long)c.nlive);
    PyObject *peaks = alloc_rows(c.peaks, (long)c.npeaks);
    PyObject *points = timeline_list(c.timeline, (long)c.ntimeline);
    PyObject *tot = totals_dict(c.totals);
    if (!live || !peaks || !points || !tot) {
        Py_XDECREF(live);
        Py_XDECREF(peaks);
        Py_XDECREF(points);
        Py_XDECREF(tot);
        return NULL;
    }
    return Py_BuildValue("(NNNNK)", live, tot, peaks, points, (unsigned long long)c.when);
}

/* window_open() -> (id, start_ns, {device: current bytes}) or None when all
 * MAX_WINDOWS are open. */
static PyObject *core_window_open(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (ensure_store())
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
    return Py_BuildValue("(iKN)", w, (unsigned long long)start, live);
}

static PyObject *core_window_close(PyObject *self, PyObject *arg)
{
    (void)self;
    long w = PyLong_AsLong(arg);
    if (w == -1 && PyErr_Occurred())
        return NULL;
    if (store_ready)
        mvz_store_window_close((int)w);
    Py_RETURN_NONE;
}

static PyObject *core_trace_enable(PyObject *self, PyObject *arg)
{
    (void)self;
    if (ensure_store())
        return NULL;
    Py_ssize_t cap = PyLong_AsSsize_t(arg);
    if (cap == -1 && PyErr_Occurred())
        return NULL;
    if (cap < 1024 || cap > (1L << 28)) {
        PyErr_SetString(PyExc_ValueError, "trace capacity must be between 1024 and 2**28 events");
        return NULL;
    }
    if (mvz_store_trace_enable((size_t)cap) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *core_trace_disable(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (store_ready)
        mvz_store_trace_disable();
    Py_RETURN_NONE;
}

static PyObject *core_trace_drain(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (ensure_store())
        return NULL;
    uint8_t *buf = NULL;
    long n = mvz_store_trace_drain(&buf);
    if (n < 0)
        return PyErr_NoMemory();
    PyObject *b = PyBytes_FromStringAndSize((const char *)buf, n);
    free(buf);
    return b;
}

static PyObject *core_stack_count(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (ensure_store())
        return NULL;
    return PyLong_FromUnsignedLong(mvz_store_stack_count());
}

/* Benchmarks and tests: the capture path without CUPTI. */
static PyObject *core_synthetic(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long address, size, count = 1;
    int free_it = 1;
    if (!PyArg_ParseTuple(args, "KK|pK", &address, &size, &free_it, &count))
        return NULL;
    if (ensure_store())
        return NULL;
    for (unsigned long long i = 0; i < count; i++)
        mvz_capture_synthetic(address + i * 256, size, free_it);
    adopt_pending(); /* with the GIL, before any of these code objects can die */
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
     "start(depth=32, activity=True) -> (result, step, error, holder, activity, activity_error)."},
    {"stop", core_stop, METH_NOARGS, "Stop capturing and unsubscribe from CUPTI."},
    {"flush", core_flush, METH_NOARGS, "Deliver pending CUPTI activity records."},
    {"active", core_active, METH_NOARGS, "Whether capture is running."},
    {"clear", core_clear, METH_NOARGS, "Forget everything recorded (not while capturing)."},
    {"label_intern", core_label_intern, METH_O, "Id of a label string (0 for None)."},
    {"label_get", core_label_get, METH_NOARGS, "The calling thread's label id."},
    {"label_set", core_label_set, METH_O, "Set the calling thread's label id."},
    {"label_name", core_label_name, METH_O, "The string of a label id."},
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
    {"live", core_live, METH_NOARGS, "Rows of the live allocations."},
    {"peak_live", core_peak_live, METH_VARARGS,
     "peak_live(device, window=-1): rows live at the peak of a device (-1: host)."},
    {"totals", core_totals, METH_VARARGS, "totals(window=-1): per-device totals."},
    {"block_totals", core_block_totals, METH_NOARGS,
     "Per-device totals of PyTorch's caching-allocator blocks (inside the device's)."},
    {"sites", core_sites, METH_NOARGS, "Per-stack aggregates."},
    {"failures", core_failures, METH_NOARGS, "The last failed allocations, oldest first."},
    {"timeline", core_timeline, METH_VARARGS,
     "timeline(window=-1): (timestamp_ns, device, bytes) points."},
    {"threads", core_threads, METH_NOARGS, "{thread index: (native id, ident, name, serial)}."},
    {"thread_serial", core_thread_serial, METH_NOARGS,
     "The calling thread's serial (unique in the process, unlike its ident)."},
    {"stats", core_stats, METH_NOARGS, "Counters and memviz's own memory."},
    {"resolve", core_resolve, METH_O, "Frames of stacks by id, innermost first."},
    {"call_sites", core_call_sites, METH_O,
     "(code, offset) of each stack's innermost frame, or the call name made when its code died."},
    {"set_call_namer", core_set_call_namer, METH_O, "What names the calls of dying code objects."},
    {"step_mark", core_step_mark, METH_VARARGS,
     "Per-device (current, window peak, live count) and stacks changed since the last mark."},
    {"reset_peak", core_reset_peak, METH_VARARGS,
     "reset_peak(window=-1): peaks restart at the current figures (peak sets: what is live now)."},
    {"copy", core_copy, METH_VARARGS,
     "copy(window=-1, close=False) -> (live, totals, peak rows, timeline, when_ns) at one instant."},
    {"window_open", core_window_open, METH_NOARGS,
     "Open a window (a nested tracker's figures): (id, start_ns, {device: live bytes}) or None."},
    {"window_close", core_window_close, METH_O, "Close a window opened by window_open()."},
    {"trace_enable", core_trace_enable, METH_O, "Log events into a ring of this many entries."},
    {"trace_disable", core_trace_disable, METH_NOARGS, "Stop logging trace events."},
    {"trace_drain", core_trace_drain, METH_NOARGS,
     "Logged events since the last drain, as 32-byte records (bytes)."},
    {"stack_count", core_stack_count, METH_NOARGS, "Stacks interned so far (ids are below it)."},
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
