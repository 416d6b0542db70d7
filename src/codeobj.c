/* Code-object lifetimes: keeping the code objects of captured stacks alive,
 * or resolving their frames to plain tuples as they die.
 *
 * With the GIL, but for schedule_adopt (see there). Calls store.c (the
 * pending stacks), capture.c (its new-stack hook) and the Python API; the
 * bindings call it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "codeobj.h"
#include "capture.h"
#include "store.h"

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

void mvz_codeobj_adopt_pending(void) { mvz_store_adopt_pending(adopt_code); }

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
    mvz_codeobj_adopt_pending();
    return 0;
}

/* Capture path, no GIL: an atomic load, at most one compare-and-swap, and Py_AddPendingCall, which
 * CPython documents as safe to call without the GIL from any thread. */
static void schedule_adopt(void)
{
    if (__atomic_load_n(&adopt_scheduled, __ATOMIC_RELAXED))
        return; /* already asked: a read, not a compare-and-swap, on every event until it runs */
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

int mvz_codeobj_watch(void)
{
    if (watch_code_deaths() != 0)
        return -1;
#if PY_VERSION_HEX < 0x030C0000
    mvz_store_new_stack_hook = schedule_adopt;
#endif
    return 0;
}

PyMethodDef mvz_codeobj_methods[] = {
    {"set_call_namer", core_set_call_namer, METH_O, "What names the calls of dying code objects."},
    {NULL, NULL, 0, NULL},
};
