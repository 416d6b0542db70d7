/* The calling thread's Python frames, read with field loads only.
 *
 * Why this is safe without the GIL (docs/architecture.md, rule 2): a thread that is
 * inside a CUDA driver call is not running Python, so it cannot push or pop
 * its own frames while we walk them, and each frame holds a strong reference
 * to its code object, so neither can go away during the walk. Other threads
 * never modify this thread's frame chain. We read nothing that belongs to
 * another thread, call no Python API (PyGILState_GetThisThreadState only
 * reads a thread-specific key), and change no reference count.
 *
 * The per-version layouts live here and nowhere else.
 */
#define Py_BUILD_CORE 1
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000
#include <internal/pycore_frame.h>
#else
#include <frameobject.h>
#endif

#include "frames.h"

#define STR_(x) #x
#define STR(x) STR_(x)
const char mvz_frames_abi[] = STR(PY_MAJOR_VERSION) "." STR(PY_MINOR_VERSION);

int mvz_capture_frames(mvz_frame *out, int max_depth)
{
    PyThreadState *tstate = PyGILState_GetThisThreadState();
    if (tstate == NULL)
        return 0; /* a thread Python never saw: no frames, only a label */
    int n = 0;

#if PY_VERSION_HEX >= 0x030D0000
    /* 3.13: tstate->current_frame, f_executable, instr_ptr. */
    for (_PyInterpreterFrame *f = tstate->current_frame; f && n < max_depth; f = f->previous) {
        if (f->owner == FRAME_OWNED_BY_CSTACK)
            continue;
        PyObject *exe = f->f_executable;
        if (exe == NULL || Py_TYPE(exe) != &PyCode_Type)
            continue;
        PyCodeObject *co = (PyCodeObject *)exe;
        _Py_CODEUNIT *first = _PyCode_CODE(co);
        if (f->owner != FRAME_OWNED_BY_GENERATOR && f->instr_ptr < first + co->_co_firsttraceable)
            continue; /* incomplete: still setting up */
        out[n].code = co;
        out[n].offset = (int32_t)((f->instr_ptr - first) * (int)sizeof(_Py_CODEUNIT));
        out[n].flags = 0;
        n++;
    }
#elif PY_VERSION_HEX >= 0x030B0000
    /* 3.11 and 3.12: tstate->cframe->current_frame, f_code, prev_instr. */
    _PyCFrame *cframe = tstate->cframe;
    if (cframe == NULL)
        return 0;
    for (_PyInterpreterFrame *f = cframe->current_frame; f && n < max_depth; f = f->previous) {
#if PY_VERSION_HEX >= 0x030C0000
        if (f->owner == FRAME_OWNED_BY_CSTACK)
            continue; /* 3.12 entry shim frame */
#endif
        PyCodeObject *co = f->f_code;
        if (co == NULL)
            continue;
        _Py_CODEUNIT *first = _PyCode_CODE(co);
        if (f->owner != FRAME_OWNED_BY_GENERATOR && f->prev_instr < first + co->_co_firsttraceable)
            continue; /* incomplete: still setting up */
        out[n].code = co;
        out[n].offset = (int32_t)((f->prev_instr - first) * (int)sizeof(_Py_CODEUNIT));
        out[n].flags = 0;
        n++;
    }
#else
    /* 3.10: PyFrameObject chain, f_lasti counts code units. */
    for (PyFrameObject *f = tstate->frame; f && n < max_depth; f = f->f_back) {
        if (f->f_code == NULL)
            continue;
        out[n].code = f->f_code;
        out[n].offset = f->f_lasti < 0 ? 0 : f->f_lasti * (int)sizeof(_Py_CODEUNIT);
        out[n].flags = 0;
        n++;
    }
#endif
    return n;
}
