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

#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#define STR_(x) #x
#define STR(x) STR_(x)
const char mvz_frames_abi[] = STR(PY_MAJOR_VERSION) "." STR(PY_MINOR_VERSION);

/* ---- which frames are a library's: rules handed down by Python ----------
 *
 * Python (memviz/model/frame_filter.py) hands down, with the GIL, the rules
 * its frame filter follows, as plain bytes; the walk reads them without
 * the GIL. A rule set is never changed once published and never freed (a
 * new one replaces it by an atomic store; the old ones stay on a list,
 * a few hundred bytes per change of the filter's configuration), so a
 * walk that loaded the old pointer reads valid memory. */
typedef struct {
    uint32_t off, len;
    uint8_t kind;
} mvz_rule;

struct mvz_ruleset {
    struct mvz_ruleset *older; /* the ones it replaced: kept, never freed */
    uint64_t gen;              /* 1..7, the memo's tag of this set */
    int n;
    mvz_rule *rules;
    char *text;
};

static struct mvz_ruleset *rules_now; /* atomic: published with release, read with acquire */

int mvz_frames_set_rules(const int *kinds, const char *const *texts, const size_t *lens, int n)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += lens[i];
    struct mvz_ruleset *rs = calloc(1, sizeof *rs);
    mvz_rule *rules = calloc((size_t)(n > 0 ? n : 1), sizeof *rules);
    char *text = malloc(total ? total : 1);
    if (!rs || !rules || !text) {
        free(rs);
        free(rules);
        free(text);
        return -1;
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        memcpy(text + off, texts[i], lens[i]);
        rules[i] = (mvz_rule){(uint32_t)off, (uint32_t)lens[i], (uint8_t)kinds[i]};
        off += lens[i];
    }
    rs->n = n;
    rs->rules = rules;
    rs->text = text;
    rs->older = __atomic_load_n(&rules_now, __ATOMIC_ACQUIRE);
    rs->gen = rs->older ? rs->older->gen % 7 + 1 : 1;
    __atomic_store_n(&rules_now, rs, __ATOMIC_RELEASE);
    return 0;
}

/* Capture path, no GIL: compares bytes of the rule set (immutable once
 * published) with the file name of a code object the calling thread's own
 * frame holds a reference to (rule 2); str objects are immutable, and their
 * kind, length and characters are plain field reads. */
static int starts_with(const char *s, size_t n, const char *p, size_t m)
{
    return m <= n && memcmp(s, p, m) == 0;
}

/* Capture path, no GIL: byte comparisons only (see starts_with). */
static int under(const char *s, size_t n, const char *p, size_t m)
{
    if (!starts_with(s, n, p, m))
        return 0;
    return n == m || p[m - 1] == '/' || s[m] == '/';
}

/* Capture path, no GIL: byte comparisons only. Inductor's generated module:
 * ".../xy/cxy<49 more>.py" (memviz.model.frame_filter.is_generated). */
static int inductor_module(const char *s, size_t n)
{
    if (n < 59 || memcmp(s + n - 3, ".py", 3) != 0)
        return 0;
    const char *base = s + n - 55;
    if (base[-1] != '/' || base[0] != 'c' || base[-4] != '/')
        return 0;
    if (base[-3] != base[1] || base[-2] != base[2])
        return 0;
    for (int i = 1; i < 52; i++) {
        char c = base[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')))
            return 0;
    }
    return 1;
}

/* Capture path, no GIL: is this frame's file a library's, by the rules
 * (the same order as FrameFilter._classify): configured paths (longest
 * prefix; a user path wins a tie), then the default folders, then the
 * folder names anywhere in the path and Inductor's module shape. Only
 * compact ASCII names are read; any other name counts as the user's. */
static int frame_is_library(const struct mvz_ruleset *rs, void *code)
{
    PyObject *fn = ((PyCodeObject *)code)->co_filename;
    if (fn == NULL || !PyUnicode_Check(fn) || !PyUnicode_IS_COMPACT_ASCII(fn))
        return 0;
    const char *s = (const char *)PyUnicode_DATA(fn);
    size_t n = (size_t)PyUnicode_GET_LENGTH(fn);
    const char *text = rs->text;
    if (n > 0 && s[0] == '<') {
        for (int i = 0; i < rs->n; i++) {
            const mvz_rule *r = &rs->rules[i];
            if (r->kind == MVZ_RULE_PSEUDO && starts_with(s, n, text + r->off, r->len))
                return 1;
            if ((r->kind == MVZ_RULE_USER || r->kind == MVZ_RULE_LIBRARY) && r->len == n &&
                memcmp(s, text + r->off, n) == 0)
                return r->kind == MVZ_RULE_LIBRARY;
        }
        return 0;
    }
    long best = -1;
    int best_lib = 0;
    for (int i = 0; i < rs->n; i++) {
        const mvz_rule *r = &rs->rules[i];
        if ((r->kind == MVZ_RULE_USER || r->kind == MVZ_RULE_LIBRARY) &&
            under(s, n, text + r->off, r->len)) {
            int lib = r->kind == MVZ_RULE_LIBRARY;
            if ((long)r->len > best || ((long)r->len == best && !lib)) {
                best = (long)r->len;
                best_lib = lib;
            }
        }
    }
    if (best >= 0)
        return best_lib;
    for (int i = 0; i < rs->n; i++) {
        const mvz_rule *r = &rs->rules[i];
        if (r->kind == MVZ_RULE_DEFAULT && under(s, n, text + r->off, r->len))
            return 1;
    }
    /* markers ("/site-packages/"): each begins with '/', so only where s has one */
    for (const char *at = memchr(s, '/', n); at; at = memchr(at + 1, '/', n - (size_t)(at + 1 - s))) {
        size_t left = n - (size_t)(at - s);
        for (int i = 0; i < rs->n; i++) {
            const mvz_rule *r = &rs->rules[i];
            if (r->kind == MVZ_RULE_PART && starts_with(at, left, text + r->off, r->len))
                return 1;
        }
        if (left <= 1)
            break;
    }
    return inductor_module(s, n);
}

/* The answers by code object, shared by every thread: one word a slot,
 * (code address | rule set's tag << 1 | library), read and written with
 * relaxed atomics (no torn word, no lock). Code objects are 16-byte
 * aligned, which leaves the low bits free. A stale slot (a code object died
 * and another took its address) can only change which frames a deep stack
 * keeps, never a recorded byte. */
#define MEMO_SLOTS 4096
static uint64_t memo[MEMO_SLOTS];

/* Capture path, no GIL: one relaxed atomic load (and store) of the memo,
 * else frame_is_library (byte comparisons only). */
static int is_library(const struct mvz_ruleset *rs, void *code)
{
    uint64_t key = (uint64_t)(uintptr_t)code;
    if (key & 15)
        return frame_is_library(rs, code);
    uint64_t *slot = &memo[((key >> 4) * 0x9e3779b97f4a7c15ULL) >> 52];
    uint64_t v = __atomic_load_n(slot, __ATOMIC_RELAXED);
    if ((v & ~(uint64_t)15) == key && ((v >> 1) & 7) == rs->gen)
        return (int)(v & 1);
    int lib = frame_is_library(rs, code);
    __atomic_store_n(slot, key | (rs->gen << 1) | (uint64_t)lib, __ATOMIC_RELAXED);
    return lib;
}

/* ---- the walk, one version's frame layout at a time --------------------- */
#if PY_VERSION_HEX >= 0x030B0000
typedef _PyInterpreterFrame pyframe;
#else
typedef PyFrameObject pyframe;
#endif

/* Capture path, no GIL: field reads of the calling thread's own state (the
 * file's comment). NULL when the thread has none. */
static inline pyframe *innermost(PyThreadState *tstate)
{
#if PY_VERSION_HEX >= 0x030D0000
    return tstate->current_frame;
#elif PY_VERSION_HEX >= 0x030B0000
    return tstate->cframe ? tstate->cframe->current_frame : NULL;
#else
    return tstate->frame;
#endif
}

/* Capture path, no GIL: one field read of the thread's own frame. */
static inline pyframe *outer(pyframe *f)
{
#if PY_VERSION_HEX >= 0x030B0000
    return f->previous;
#else
    return f->f_back;
#endif
}

/* A frame pushed but not yet started (3.11, 3.12: its prev_instr is one
 * before its first instruction) is skipped, with no read of its code
 * object: its first address is computed from the pointer alone. CPython's
 * own test (_PyFrame_IsIncomplete) also counts a frame inside its prologue
 * (MAKE_CELL, COPY_FREE_VARS, RETURN_GENERATOR) as incomplete, which needs
 * the code object's _co_firsttraceable: one more cache line per frame,
 * cold inside a real step (issue 27). A GPU allocation
 * cannot happen in a prologue (those instructions call nothing that
 * allocates device memory), and an outer frame is always at a call, so the
 * walk leaves that read out: a frame in its prologue, were one ever met,
 * would show its def line. */

/* Capture path, no GIL: field reads of the thread's own frame and the code
 * object it holds (the file's comment). 1 and *out filled for a complete
 * frame of a code object, 0 for one to skip (an entry shim, a frame still
 * being set up). */
static inline int read_frame(pyframe *f, mvz_frame *out)
{
#if PY_VERSION_HEX >= 0x030D0000
    /* 3.13: f_executable, instr_ptr. */
    if (f->owner == FRAME_OWNED_BY_CSTACK)
        return 0;
    PyObject *exe = f->f_executable;
    if (exe == NULL || Py_TYPE(exe) != &PyCode_Type)
        return 0;
    PyCodeObject *co = (PyCodeObject *)exe;
    _Py_CODEUNIT *first = _PyCode_CODE(co); /* an address inside co: no read of it */
    if (f->owner != FRAME_OWNED_BY_GENERATOR && f->instr_ptr < first)
        return 0; /* not started (see above) */
    out->code = co;
    out->offset = (int32_t)((f->instr_ptr - first) * (int)sizeof(_Py_CODEUNIT));
#elif PY_VERSION_HEX >= 0x030B0000
    /* 3.11 and 3.12: f_code, prev_instr. */
#if PY_VERSION_HEX >= 0x030C0000
    if (f->owner == FRAME_OWNED_BY_CSTACK)
        return 0; /* 3.12 entry shim frame */
#endif
    PyCodeObject *co = f->f_code;
    if (co == NULL)
        return 0;
    _Py_CODEUNIT *first = _PyCode_CODE(co); /* an address inside co: no read of it */
    if (f->owner != FRAME_OWNED_BY_GENERATOR && f->prev_instr < first)
        return 0; /* not started (see above) */
    out->code = co;
    out->offset = (int32_t)((f->prev_instr - first) * (int)sizeof(_Py_CODEUNIT));
#else
    /* 3.10: PyFrameObject chain, f_lasti counts code units. */
    if (f->f_code == NULL)
        return 0;
    out->code = f->f_code;
    out->offset = f->f_lasti < 0 ? 0 : f->f_lasti * (int)sizeof(_Py_CODEUNIT);
#endif
    out->flags = 0;
    return 1;
}

/* Capture path, no GIL: the walk reads only the calling thread's own frames
 * and the rule set (see above); it writes only `out`. Up to max_depth
 * frames, innermost first. A stack deeper than that keeps its innermost
 * max_depth frames when one of them is the user's (a frame whose file is
 * not a library's: the first the walk meets ends the check); else it keeps
 * the innermost max_depth - max_depth/4 and gives the last quarter to the
 * first user frame beyond and the frames out from it (its callers), or,
 * when there is none, to the outermost quarter. So a compile, a deep
 * framework or a recursion below the user's line still yields the line.
 * Stacks no deeper than max_depth read as before, and no file name is read
 * for them. */
int mvz_frames_capture(mvz_frame *out, int max_depth)
{
    return mvz_frames_capture_at(out, max_depth, NULL, 0);
}

static int deep_stack(mvz_frame *out, int max_depth, int n, pyframe *f, int *kept_as_walked);

/* Capture path, no GIL: as mvz_frames_capture; `where` is this thread's
 * own row (store.c). */
MVZ_HOT int mvz_frames_capture_at(mvz_frame *out, int max_depth, const void **where, int nwhere)
{
    PyThreadState *tstate = PyGILState_GetThisThreadState();
    if (tstate == NULL)
        return 0; /* a thread Python never saw: no frames, only a label */
    int n = 0;
    pyframe *f = innermost(tstate);
    for (; f && n < max_depth; f = outer(f))
        if (read_frame(f, &out[n])) {
            if (n < nwhere)
                where[n] = f;
            n++;
        }
    if (f == NULL || n < max_depth)
        return n;
    int as_walked;
    return deep_stack(out, max_depth, n, f, &as_walked);
}

_Static_assert(sizeof(mvz_frame) == 16 && offsetof(mvz_frame, flags) == offsetof(mvz_frame, offset) + 4,
               "a frame is a code pointer and one word of offset and flags");

/* Capture path, no GIL: two words compared (a frame is 16 bytes). */
static inline int same_frame(const mvz_frame *a, const mvz_frame *b)
{
    return memcmp(a, b, sizeof *a) == 0;
}

/* Capture path, no GIL: the caller's own buffers only. The usual case,
 * the same depth and only the innermost frame moved, is one memcmp. */
int mvz_frames_shared_outer(const mvz_frame *f, int n, const mvz_frame *last, int m)
{
    if (n == m && n > 0 && memcmp(f + 1, last + 1, (size_t)(n - 1) * sizeof *f) == 0)
        return same_frame(f, last) ? n : n - 1;
    int k = 0, most = n < m ? n : m;
    const mvz_frame *a = f + n - 1, *b = last + m - 1;
    for (; k < most; k++, a--, b--)
        if (!same_frame(a, b))
            break;
    return k;
}

/* Capture path, no GIL: as mvz_frames_capture_at without `where`, the
 * comparison with the previous stack made in the same pass (the frame
 * just read is in a register; last[n] is this thread's own buffer): the
 * outermost frame that differs is noted, so that at the same depth the
 * frames out from it are the ones kept. */
MVZ_HOT int mvz_frames_capture_cmp(mvz_frame *out, int max_depth, const mvz_frame *last, int m,
                                   int *kept)
{
    *kept = -1;
    if (last == NULL || max_depth <= 0) /* nothing to compare with */
        return mvz_frames_capture_at(out, max_depth, NULL, 0);
    PyThreadState *tstate = PyGILState_GetThisThreadState();
    if (tstate == NULL)
        return 0; /* a thread Python never saw: no frames, only a label */
    int n = 0, differs = -1; /* the outermost index where out and last differ */
    pyframe *f = innermost(tstate);
    mvz_frame fr;
    while (f) {
        pyframe *next = outer(f);
        if (read_frame(f, &fr)) {
            /* compared as two words from registers (a word load of the
             * two 4-byte fields just stored would wait on the stores) */
            const mvz_frame *l = &last[n];
            uint64_t lw, fw;
            memcpy(&lw, &l->offset, sizeof lw); /* offset and flags, one load */
            memcpy(&fw, &fr.offset, sizeof fw); /* the same of a value in registers */
            if (((uintptr_t)fr.code ^ (uintptr_t)l->code) | (fw ^ lw))
                differs = n;
            out[n] = fr;
            if (++n == max_depth) {
                f = next;
                break;
            }
        }
        f = next;
    }
    int as_walked = 1;
    if (f != NULL && n == max_depth) /* deeper than max_depth */
        n = deep_stack(out, max_depth, n, f, &as_walked);
    if (as_walked && n == m) /* out[0..n) as compared */
        *kept = n - 1 - differs;
    return n;
}

/* Capture path, no GIL: a stack deeper than max_depth (the walk's comment
 * above): out[0..max_depth) read, f the next frame. */
static int deep_stack(mvz_frame *out, int max_depth, int n, pyframe *f, int *kept_as_walked)
{
    *kept_as_walked = 1; /* until the tail is rewritten */
    int tail = max_depth >= 8 ? max_depth / 4 : 0;
    const struct mvz_ruleset *rs = __atomic_load_n(&rules_now, __ATOMIC_ACQUIRE);
    if (tail == 0 || rs == NULL)
        return n;
    int head = max_depth - tail;
    for (int i = 0; i < max_depth; i++)
        if (!is_library(rs, out[i].code))
            return n; /* the user's frame is among those kept: as before */
    *kept_as_walked = 0;
    /* Walk on: out[head..max_depth) is a ring of the last `tail` frames seen
     * (pos: the next to overwrite, the oldest written) until a user frame. */
    int pos = 0, k = -1;
    mvz_frame fr;
    for (; f; f = outer(f)) {
        if (!read_frame(f, &fr))
            continue;
        if (k < 0) {
            if (is_library(rs, fr.code)) {
                out[head + pos] = fr;
                pos = pos + 1 == tail ? 0 : pos + 1;
                continue;
            }
            k = head;
        }
        out[k++] = fr;
        if (k == max_depth)
            break;
    }
    if (k >= 0)
        return k;
    /* No user frame: the ring holds the outermost frames; put them in order. */
    mvz_frame tmp[MVZ_MAX_DEPTH / 4];
    for (int i = 0; i < tail; i++)
        tmp[i] = out[head + (pos + i) % tail];
    memcpy(&out[head], tmp, (size_t)tail * sizeof(mvz_frame));
    return n;
}
