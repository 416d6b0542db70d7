/* See allocator.h. */
#define _GNU_SOURCE 1 /* as pyconfig.h spells it: no redefinition warning */
#define PY_SSIZE_T_CLEAN
#include "allocator.h"

#include <link.h>
#include <stddef.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "capture.h"
#include "clock.h"
#include "interpose.h"
#include "store.h"

#if defined(__x86_64__) && defined(__GLIBC__)
#define HAVE_ALLOCATOR 1
#else
#define HAVE_ALLOCATOR 0
#endif

#define MAX_SLOTS 128 /* more than any CUDAAllocator has (about 60 on torch 2.11) */
#define SLOT_ALLOCATE 2
#define SLOT_RAW_DELETER 4

typedef void *(*allocate_fn)(void *sret, void *self, size_t n);
typedef void *(*raw_deleter_fn)(const void *self);
typedef void (*record_stream_fn)(void *self, const uintptr_t *dataptr, uint64_t s0, uint64_t s1);
typedef void *(*raw_alloc_stream_fn)(void *self, size_t n, void *stream);
typedef void (*raw_delete_fn)(void *self, void *ptr);
typedef void (*deleter_fn)(void *ctx);

/* Everything the route knows, in one place. Written with the GIL; the
 * wrappers read it from any thread. `orig`, the layout and orig_deleter are
 * written before anything can call a wrapper that reads them (the vptr swap
 * and each slot write are release stores) and never change afterwards, so
 * a wrapper still running after detach reads what it always read. */
static struct {
    /* The wrappers' line: what every allocation and free reads (the state,
     * the layout, PyTorch's deleter and allocate entry: orig[SLOT_ALLOCATE]
     * is at byte 48), so that the route touches one line of A an event. */
    int state;               /* ST_*: whose vtable the object uses, and why */
    int committed;           /* the layout below is known: wrappers record */
    int data_w, deleter_w, ctx_w, device_w; /* DataPtr words */
    deleter_fn orig_deleter; /* PyTorch's deleter for its blocks */
    void *orig[MAX_SLOTS];   /* the original entries */
    void **object;           /* the allocator object: its first word is the vptr */
    void **vptr;             /* the original vptr (its slot 0) */
    int nslots;
    void *table[2 + MAX_SLOTS]; /* the copy: offset to top, typeinfo, slots */
    int attached;            /* state == ST_ATTACHED, for the GIL side */
    int rs_slot[2];          /* recordStream variants wrapped (-1: none) */
    int raw_alloc_slot, raw_delete_slot;
    uintptr_t sample[4];     /* the first DataPtr allocate returned since reset */
    int sampled;             /* 0 empty, 1 being written, 2 full */
    int bypassed;            /* benchmarks only: attached, with PyTorch's entries (allocator_bypass) */
} A __attribute__((aligned(64))) = {.rs_slot = {-1, -1}, .raw_alloc_slot = -1, .raw_delete_slot = -1};
_Static_assert(offsetof(__typeof__(A), orig) + (SLOT_ALLOCATE + 1) * sizeof(void *) <= 64,
               "the wrappers' words and PyTorch's allocate entry share A's first line");

/* Blocks alive that carry memviz's deleter: the one word of the route that
 * every allocation and free writes (a locked add), on a cache line of its
 * own, so that the wrappers' reads of A (the layout, the state, PyTorch's
 * deleter) on another thread do not miss each time it is written. */
static struct {
    long n;
    char pad[64 - sizeof(long)];
} outstanding __attribute__((aligned(64)));
#define OUTSTANDING (outstanding.n)

/* Whose vtable the allocator object points at. Detaching with blocks still
 * alive that carry memviz's deleter keeps the copy (DRAINING), with PyTorch's
 * own entries but recordStream's wrapper: PyTorch skips a stream use on a
 * DataPtr whose deleter is not its own, and a skipped stream use lets a
 * block be handed out again while another stream still uses it. The last
 * such block's free puts PyTorch's vtable back. */
enum { ST_PYTORCH, ST_ATTACHED, ST_DRAINING, ST_RESTORING };

/* Any thread, no GIL: PyTorch's vtable back once draining is over. Only
 * the thread that wins the state change writes the word. */
static void try_restore(void)
{
    int expected = ST_DRAINING;
    if (__atomic_compare_exchange_n(&A.state, &expected, ST_RESTORING, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_RELAXED)) {
        __atomic_store_n((void ***)A.object, A.vptr, __ATOMIC_SEQ_CST);
        __atomic_store_n(&A.state, ST_PYTORCH, __ATOMIC_SEQ_CST);
    }
}

/* Any thread, no GIL: one block with memviz's deleter fewer. */
static inline void release_one(void)
{
    if (__builtin_expect(__atomic_sub_fetch(&OUTSTANDING, 1, __ATOMIC_SEQ_CST) == 0, 0) &&
        __atomic_load_n(&A.state, __ATOMIC_SEQ_CST) == ST_DRAINING)
        try_restore();
}

/* The same, out of line: a block handed out while the route detaches. */
static __attribute__((noinline, cold)) void release_one_cold(void) { release_one(); }

/* ---- tripwires ----------------------------------------------------------
 * Slot i of the copy may point at trampoline i, which adds one to hits[i]
 * and jumps to targets[i] (the original entry) with every register and the
 * stack as the caller left them: whatever the function's signature, the
 * call is the same call. The trampoline has no frame, so an exception or a
 * profiler's unwinding passes it by. */
#if HAVE_ALLOCATOR
__attribute__((visibility("hidden"))) uint64_t mvz_allocator_trip_hits[MAX_SLOTS];
__attribute__((visibility("hidden"))) void *mvz_allocator_trip_targets[MAX_SLOTS];
extern void *const mvz_allocator_trip_table[MAX_SLOTS] __attribute__((visibility("hidden")));

#define TRIP_ONE(b, k)                                                                   \
    ".p2align 4\n"                                                                       \
    "mvz_trip_" #b "_" #k ":\n"                                                          \
    "  lock incq mvz_allocator_trip_hits+8*(8*" #b "+" #k ")(%rip)\n"                              \
    "  jmp *mvz_allocator_trip_targets+8*(8*" #b "+" #k ")(%rip)\n"
#define TRIP_EIGHT(b)                                                                    \
    TRIP_ONE(b, 0) TRIP_ONE(b, 1) TRIP_ONE(b, 2) TRIP_ONE(b, 3) TRIP_ONE(b, 4)           \
    TRIP_ONE(b, 5) TRIP_ONE(b, 6) TRIP_ONE(b, 7)
#define TRIP_ADDR_EIGHT(b)                                                               \
    " .quad mvz_trip_" #b "_0, mvz_trip_" #b "_1, mvz_trip_" #b "_2, mvz_trip_" #b "_3\n" \
    " .quad mvz_trip_" #b "_4, mvz_trip_" #b "_5, mvz_trip_" #b "_6, mvz_trip_" #b "_7\n"

__asm__(".text\n"
        TRIP_EIGHT(0) TRIP_EIGHT(1) TRIP_EIGHT(2) TRIP_EIGHT(3) TRIP_EIGHT(4) TRIP_EIGHT(5)
        TRIP_EIGHT(6) TRIP_EIGHT(7) TRIP_EIGHT(8) TRIP_EIGHT(9) TRIP_EIGHT(10) TRIP_EIGHT(11)
        TRIP_EIGHT(12) TRIP_EIGHT(13) TRIP_EIGHT(14) TRIP_EIGHT(15)
        ".section .data.rel.ro,\"aw\"\n"
        ".p2align 3\n"
        ".globl mvz_allocator_trip_table\n"
        ".hidden mvz_allocator_trip_table\n"
        "mvz_allocator_trip_table:\n"
        TRIP_ADDR_EIGHT(0) TRIP_ADDR_EIGHT(1) TRIP_ADDR_EIGHT(2) TRIP_ADDR_EIGHT(3)
        TRIP_ADDR_EIGHT(4) TRIP_ADDR_EIGHT(5) TRIP_ADDR_EIGHT(6) TRIP_ADDR_EIGHT(7)
        TRIP_ADDR_EIGHT(8) TRIP_ADDR_EIGHT(9) TRIP_ADDR_EIGHT(10) TRIP_ADDR_EIGHT(11)
        TRIP_ADDR_EIGHT(12) TRIP_ADDR_EIGHT(13) TRIP_ADDR_EIGHT(14) TRIP_ADDR_EIGHT(15)
        ".text\n");
#endif

/* ---- the wrappers (hot path: any thread, no GIL) -------------------------
 * Each calls PyTorch's own function, then mvz_capture_block (capture.c),
 * which reads only this thread's frames and thread-local state and takes
 * the store's leaf lock: nothing here takes the GIL, calls Python or
 * allocates. PyTorch may throw (out of memory) through a wrapper: nothing
 * is held across the call, so there is nothing to undo. */

static void wrap_delete(void *ctx);

/* A block is recorded with the bytes asked for; the store sizes it by
 * PyTorch's own rules (blocks.h): its rounding, and the remainder it does
 * not split off. */

static inline int device_of_word(uintptr_t w)
{
    /* c10::Device: DeviceType (int8) then DeviceIndex (int8). */
    return (int)(int8_t)((w >> 8) & 0xff);
}

/* The stamp, and what the capture path will touch asked for while PyTorch
 * allocates (mvz_store_prefetch: the queue's next unit, the frames of this
 * thread's last walk, its walk buffers): those lines, cold inside a step,
 * are then near when the capture path walks and writes. Prefetches only:
 * nothing is read or written. */
static inline uint64_t before_allocate(void)
{
    /* the capture flag and the clock's kind, read from the capture path's
     * read-mostly line (hot.h), without a call */
    if (__builtin_expect(!__atomic_load_n(&mvz_hot.capturing, __ATOMIC_ACQUIRE), 0))
        return 0; /* laid out as the rare case: the route is attached for tracking */
    mvz_store_prefetch();
    if (mvz_ablated(MVZ_PF_NO_TICK))
        return 0; /* an ablation build's: the capture path then reads no clock either */
    return mvz_tick_as(mvz_tick_is_tsc());
}

MVZ_HOT static void *wrap_allocate(void *sret, void *self, size_t n)
{
    MVZ_STAGE_BEGIN();
    MVZ_STAGE(MVZ_ST_NULL);
    uint64_t stamp = before_allocate();
    MVZ_STAGE(MVZ_ST_A_BEFORE);
    void *r = ((allocate_fn)A.orig[SLOT_ALLOCATE])(sret, self, n);
    MVZ_STAGE_BEGIN();
    uintptr_t *w = sret;
    if (__builtin_expect(!__atomic_load_n(&A.committed, __ATOMIC_ACQUIRE), 0)) {
        int expected = 0; /* probing: keep the first non-empty DataPtr */
        if ((w[0] | w[1] | w[2]) != 0 &&
            __atomic_compare_exchange_n(&A.sampled, &expected, 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED)) {
            memcpy(A.sample, w, sizeof A.sample);
            __atomic_store_n(&A.sampled, 2, __ATOMIC_RELEASE);
        }
        return r;
    }
    if (__builtin_expect(w[A.data_w] && w[A.deleter_w] == (uintptr_t)A.orig_deleter, 1)) {
        /* Counted before the state is read (both sequentially consistent, as
         * in detach): either detach sees this block, or this sees the detach
         * and hands the block out as PyTorch would. */
        __atomic_fetch_add(&OUTSTANDING, 1, __ATOMIC_SEQ_CST);
        if (__builtin_expect(__atomic_load_n(&A.state, __ATOMIC_SEQ_CST) != ST_ATTACHED, 0)) {
            release_one_cold();
            return r;
        }
        w[A.deleter_w] = (uintptr_t)wrap_delete;
        MVZ_STAGE(MVZ_ST_A_WRAP);
        mvz_capture_block_alloc(w[A.data_w], n, device_of_word(w[A.device_w]), stamp);
        MVZ_STAGE(MVZ_ST_A_EXIT);
    }
    return r;
}

/* The deleter of every block handed out while attached. The free is
 * recorded before PyTorch takes the block back: once it has, another
 * thread may be handed the same address, and its allocation must come
 * after this free in the store. */
MVZ_HOT static void wrap_delete(void *ctx)
{
    MVZ_STAGE_BEGIN();
    mvz_capture_block_free((uint64_t)(uintptr_t)ctx);
    MVZ_STAGE(MVZ_ST_F_EXIT);
    A.orig_deleter(ctx);
    MVZ_STAGE_BEGIN();
    release_one();
    MVZ_STAGE(MVZ_ST_F_RELEASE);
}

static void *wrap_raw_deleter(const void *self)
{
    void *d = ((raw_deleter_fn)A.orig[SLOT_RAW_DELETER])(self);
    return d == (void *)A.orig_deleter ? (void *)wrap_delete : d;
}

/* recordStream(const DataPtr&, stream): PyTorch skips DataPtrs whose
 * deleter is not its own; it only reads the DataPtr, so a copy on this
 * stack with PyTorch's deleter is the same question. */
static inline void record_stream(int which, void *self, const uintptr_t *dp, uint64_t s0,
                                 uint64_t s1)
{
    record_stream_fn f = (record_stream_fn)A.orig[A.rs_slot[which]];
    if (dp && dp[A.deleter_w] == (uintptr_t)wrap_delete) {
        uintptr_t copy[4];
        memcpy(copy, dp, sizeof copy);
        copy[A.deleter_w] = (uintptr_t)A.orig_deleter;
        f(self, copy, s0, s1);
        mvz_store_mark_stream((uint64_t)dp[A.data_w]); /* its free will wait on that stream */
        return;
    }
    f(self, dp, s0, s1);
}

static void wrap_record_stream0(void *self, const uintptr_t *dp, uint64_t s0, uint64_t s1)
{
    record_stream(0, self, dp, s0, s1);
}

static void wrap_record_stream1(void *self, const uintptr_t *dp, uint64_t s0, uint64_t s1)
{
    record_stream(1, self, dp, s0, s1);
}

static void *wrap_raw_alloc_stream(void *self, size_t n, void *stream)
{
    uint64_t stamp = before_allocate();
    void *p = ((raw_alloc_stream_fn)A.orig[A.raw_alloc_slot])(self, n, stream);
    if (p)
        mvz_capture_block(0, (uint64_t)(uintptr_t)p, n, (uint64_t)(uintptr_t)stream, -1,
                          stamp);
    return p;
}

static void wrap_raw_delete(void *self, void *ptr)
{
    if (ptr) /* recorded first, as in wrap_delete */
        mvz_capture_block_free((uint64_t)(uintptr_t)ptr);
    ((raw_delete_fn)A.orig[A.raw_delete_slot])(self, ptr);
}

/* ---- attach / probe / detach (with the GIL) ------------------------------ */

static void set_slot(int slot, void *value)
{
    __atomic_store_n(&A.table[2 + slot], value, __ATOMIC_RELEASE);
}

/* The entry slot `slot` of the copy has when no tripwire is on it. */
static void *slot_entry(int slot)
{
    if (A.bypassed && slot != A.rs_slot[0] && slot != A.rs_slot[1])
        return A.orig[slot]; /* allocator_bypass: PyTorch's own, but recordStream's wrappers */
    if (slot == SLOT_ALLOCATE)
        return (void *)wrap_allocate;
    if (A.committed && slot == SLOT_RAW_DELETER && A.orig_deleter &&
        __atomic_load_n(&A.state, __ATOMIC_SEQ_CST) == ST_ATTACHED)
        return (void *)wrap_raw_deleter; /* draining: new blocks are PyTorch's, and say so */
    if (slot == A.rs_slot[0])
        return (void *)wrap_record_stream0;
    if (slot == A.rs_slot[1])
        return (void *)wrap_record_stream1;
    if (slot == A.raw_alloc_slot)
        return (void *)wrap_raw_alloc_stream;
    if (slot == A.raw_delete_slot)
        return (void *)wrap_raw_delete;
    return A.orig[slot];
}

#if HAVE_ALLOCATOR
typedef struct {
    uintptr_t addr;
    uintptr_t lo, hi; /* the loaded segment holding addr */
    int exec;
    int found;
} segment_lookup;

static int find_segment(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    segment_lookup *l = data;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD)
            continue;
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr, hi = lo + ph->p_memsz;
        if (l->addr >= lo && l->addr < hi) {
            l->lo = lo;
            l->hi = hi;
            l->exec = (ph->p_flags & PF_X) != 0;
            l->found = 1;
            return 1;
        }
    }
    return 0;
}

static int segment_of(const void *p, segment_lookup *out)
{
    memset(out, 0, sizeof *out);
    out->addr = (uintptr_t)p;
    dl_iterate_phdr(find_segment, out);
    return out->found;
}
#endif

/* allocator_attach(holder address) -> {"slots": n, "vptr": int, ...}
 * Copies the vtable of the object `holder` points at and swaps its vptr to
 * the copy, with only allocate wrapped (sampling, not recording). */
static PyObject *allocator_attach(PyObject *self, PyObject *arg)
{
    (void)self;
#if !HAVE_ALLOCATOR
    (void)arg;
    PyErr_SetString(PyExc_RuntimeError, "the allocator route needs x86-64 Linux with glibc");
    return NULL;
#else
    void **holder = PyLong_AsVoidPtr(arg);
    if (!holder && PyErr_Occurred())
        return NULL;
    if (!holder) {
        PyErr_SetString(PyExc_ValueError, "allocator_attach(): null holder");
        return NULL;
    }
    void **object = __atomic_load_n((void ***)holder, __ATOMIC_ACQUIRE);
    if (!object) {
        PyErr_SetString(PyExc_RuntimeError, "PyTorch's CUDA allocator is not set up yet");
        return NULL;
    }
    if (A.attached) {
        PyErr_SetString(PyExc_RuntimeError, "memviz is attached to this allocator already");
        return NULL;
    }
    for (;;) { /* still draining from the last time: take the copy over as it is */
        int st = __atomic_load_n(&A.state, __ATOMIC_SEQ_CST);
        if (st == ST_RESTORING) {
            sched_yield(); /* another thread is putting PyTorch's vtable back: two stores */
            continue;
        }
        if (st == ST_DRAINING) {
            int expected = ST_DRAINING;
            if (!__atomic_compare_exchange_n(&A.state, &expected, ST_ATTACHED, 0, __ATOMIC_SEQ_CST,
                                             __ATOMIC_RELAXED))
                continue;
            __atomic_store_n(&A.sampled, 0, __ATOMIC_RELEASE);
            for (int i = 0; i < A.nslots; i++)
                set_slot(i, slot_entry(i));
            A.attached = 1;
            return Py_BuildValue("{s:i,s:K,s:K}", "slots", A.nslots, "vptr",
                                 (unsigned long long)(uintptr_t)A.vptr, "object",
                                 (unsigned long long)(uintptr_t)A.object);
        }
        break;
    }
    void **vptr = __atomic_load_n((void ***)object, __ATOMIC_ACQUIRE);
    if (vptr == (void **)&A.table[2]) {
        PyErr_SetString(PyExc_RuntimeError, "memviz is attached to this allocator already");
        return NULL;
    }
    if (A.vptr && (A.vptr != vptr || A.object != object)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "PyTorch's allocator object changed since memviz last attached to it");
        return NULL;
    }
    segment_lookup table_seg, code_seg;
    if (!segment_of(vptr, &table_seg) || table_seg.exec) {
        PyErr_SetString(PyExc_RuntimeError, "the allocator's vtable is not in a loaded library");
        return NULL;
    }
    if (!A.vptr) {
        size_t room = (table_seg.hi - (uintptr_t)vptr) / sizeof(void *);
        int n = room < MAX_SLOTS ? (int)room : MAX_SLOTS;
        /* The vtable ends where its entries stop being code: what follows
         * (the next vtable's offset to top, a typeinfo object) is data. Each
         * word is read only once the one before it was an entry. */
        for (int i = 0; i < n; i++) {
            segment_lookup entry;
            if (!segment_of(vptr[i], &entry) || !entry.exec) {
                n = i;
                break;
            }
        }
        if (n <= SLOT_RAW_DELETER || (uintptr_t)(vptr - 2) < table_seg.lo) {
            PyErr_SetString(PyExc_RuntimeError, "the allocator's vtable is cut short");
            return NULL;
        }
        A.table[0] = vptr[-2]; /* offset to top and typeinfo: typeid, dynamic_cast */
        A.table[1] = vptr[-1];
        for (int i = 0; i < n; i++) {
            A.orig[i] = vptr[i];
            A.table[2 + i] = vptr[i];
            mvz_allocator_trip_targets[i] = vptr[i];
        }
        A.nslots = n;
        A.object = object;
        A.vptr = vptr;
    }
    if (!segment_of(A.orig[SLOT_ALLOCATE], &code_seg) || !code_seg.exec) {
        PyErr_SetString(PyExc_RuntimeError, "the allocator's allocate() is not code of a loaded library");
        return NULL;
    }
    mvz_capture_prepare_wrappers();
    __atomic_store_n(&A.sampled, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&A.state, ST_ATTACHED, __ATOMIC_SEQ_CST);
    for (int i = 0; i < A.nslots; i++)
        set_slot(i, slot_entry(i));
    __atomic_store_n((void ***)object, (void **)&A.table[2], __ATOMIC_RELEASE);
    A.attached = 1;
    return Py_BuildValue("{s:i,s:K,s:K}", "slots", A.nslots, "vptr",
                         (unsigned long long)(uintptr_t)vptr, "object",
                         (unsigned long long)(uintptr_t)object);
#endif
}

/* allocator_entry(slot) -> (original entry, start of its library segment):
 * what a probe needs to tell which library defines a slot. */
static PyObject *allocator_entry(PyObject *self, PyObject *arg)
{
    (void)self;
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    if (!A.vptr || slot < 0 || slot >= A.nslots) {
        PyErr_SetString(PyExc_IndexError, "allocator_entry(): no such slot");
        return NULL;
    }
    return PyLong_FromVoidPtr(A.orig[slot]);
}

/* allocator_trip(lo, hi, on): tripwires on (or off) for slots [lo, hi);
 * allocate and the slots already wrapped are left alone. */
static PyObject *allocator_trip(PyObject *self, PyObject *args)
{
    (void)self;
    int lo, hi, on;
    if (!PyArg_ParseTuple(args, "iip", &lo, &hi, &on))
        return NULL;
#if HAVE_ALLOCATOR
    if (!A.attached) {
        PyErr_SetString(PyExc_RuntimeError, "allocator_trip(): not attached");
        return NULL;
    }
    if (lo < 0)
        lo = 0;
    if (hi > A.nslots)
        hi = A.nslots;
    for (int i = lo; i < hi; i++) {
        if (i == SLOT_ALLOCATE || slot_entry(i) != A.orig[i])
            continue;
        set_slot(i, on ? mvz_allocator_trip_table[i] : A.orig[i]);
    }
#else
    (void)lo, (void)hi, (void)on;
#endif
    Py_RETURN_NONE;
}

/* allocator_hits() -> [calls through each slot's tripwire so far] */
static PyObject *allocator_hits(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    PyObject *out = PyList_New(A.nslots);
    for (int i = 0; out && i < A.nslots; i++) {
#if HAVE_ALLOCATOR
        uint64_t h = __atomic_load_n(&mvz_allocator_trip_hits[i], __ATOMIC_RELAXED);
#else
        uint64_t h = 0;
#endif
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (!v) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* allocator_sample(reset=False) -> the 4 words of the first DataPtr allocate
 * returned since the last reset, or None. */
static PyObject *allocator_sample(PyObject *self, PyObject *arg)
{
    (void)self;
    int reset = PyObject_IsTrue(arg);
    if (reset < 0)
        return NULL;
    if (reset) {
        __atomic_store_n(&A.sampled, 0, __ATOMIC_RELEASE);
        Py_RETURN_NONE;
    }
    if (__atomic_load_n(&A.sampled, __ATOMIC_ACQUIRE) != 2)
        Py_RETURN_NONE;
    return Py_BuildValue("(KKKK)", (unsigned long long)A.sample[0], (unsigned long long)A.sample[1],
                         (unsigned long long)A.sample[2], (unsigned long long)A.sample[3]);
}

/* allocator_call_raw_deleter() -> what PyTorch's raw_deleter() answers. */
static PyObject *allocator_call_raw_deleter(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (!A.attached) {
        PyErr_SetString(PyExc_RuntimeError, "allocator_call_raw_deleter(): not attached");
        return NULL;
    }
    return PyLong_FromVoidPtr(((raw_deleter_fn)A.orig[SLOT_RAW_DELETER])(A.object));
}

/* allocator_commit(data, deleter, ctx, device, record_streams, raw_alloc,
 * raw_delete): the DataPtr words and the slots the probe found (-1: none);
 * from now on the wrappers record. */
static PyObject *allocator_commit(PyObject *self, PyObject *args)
{
    (void)self;
    int dw, lw, cw, vw, rs0, rs1, ra, rd;
    if (!PyArg_ParseTuple(args, "iiii(ii)ii", &dw, &lw, &cw, &vw, &rs0, &rs1, &ra, &rd))
        return NULL;
    int words[4] = {dw, lw, cw, vw};
    for (int i = 0; i < 4; i++)
        if (words[i] < 0 || words[i] > 3) {
            PyErr_SetString(PyExc_ValueError, "allocator_commit(): DataPtr words are 0 to 3");
            return NULL;
        }
    int slots[4] = {rs0, rs1, ra, rd};
    for (int i = 0; i < 4; i++)
        if (slots[i] >= A.nslots || (slots[i] >= 0 && slots[i] <= SLOT_RAW_DELETER)) {
            PyErr_SetString(PyExc_ValueError, "allocator_commit(): bad slot");
            return NULL;
        }
    if (!A.attached || __atomic_load_n(&A.sampled, __ATOMIC_ACQUIRE) != 2) {
        PyErr_SetString(PyExc_RuntimeError, "allocator_commit(): nothing sampled");
        return NULL;
    }
    deleter_fn d = (deleter_fn)A.sample[lw];
    if (A.orig_deleter && A.orig_deleter != d) {
        PyErr_SetString(PyExc_RuntimeError, "allocator_commit(): PyTorch's deleter changed");
        return NULL;
    }
    if (A.committed) { /* a later session: same layout or nothing */
        if (A.data_w != dw || A.deleter_w != lw || A.ctx_w != cw || A.device_w != vw ||
            A.rs_slot[0] != rs0 || A.rs_slot[1] != rs1 || A.raw_alloc_slot != ra ||
            A.raw_delete_slot != rd) {
            PyErr_SetString(PyExc_RuntimeError, "allocator_commit(): another layout than before");
            return NULL;
        }
    } else {
        A.data_w = dw, A.deleter_w = lw, A.ctx_w = cw, A.device_w = vw;
        A.orig_deleter = d;
        A.rs_slot[0] = rs0, A.rs_slot[1] = rs1;
        A.raw_alloc_slot = ra, A.raw_delete_slot = rd;
        __atomic_store_n(&A.committed, 1, __ATOMIC_RELEASE);
    }
    for (int i = 0; i < A.nslots; i++)
        set_slot(i, slot_entry(i));
    Py_RETURN_NONE;
}

/* allocator_detach(): stop recording; PyTorch's own vtable back now, or,
 * while blocks with memviz's deleter are alive, once the last is freed
 * (ST_DRAINING: meanwhile the copy holds PyTorch's entries but for
 * recordStream's wrapper). */
static PyObject *allocator_detach(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (A.attached) {
        A.attached = 0;
        A.bypassed = 0;
        __atomic_store_n(&A.state, ST_DRAINING, __ATOMIC_SEQ_CST);
        for (int i = 0; i < A.nslots; i++)
            if (i != A.rs_slot[0] && i != A.rs_slot[1])
                set_slot(i, i == SLOT_ALLOCATE ? (void *)wrap_allocate : A.orig[i]);
        if (__atomic_load_n(&OUTSTANDING, __ATOMIC_SEQ_CST) == 0)
            try_restore();
    }
    Py_RETURN_NONE;
}

/* allocator_reset(): forget everything (tests only, which attach to several
 * stand-in allocators in one process). Refused while attached; the caller
 * must have freed every block made while attached (their deleter is
 * memviz's and reads what this clears). */
static PyObject *allocator_reset(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    if (A.attached || __atomic_load_n(&A.state, __ATOMIC_SEQ_CST) != ST_PYTORCH) {
        PyErr_SetString(PyExc_RuntimeError,
                        "allocator_reset(): detach and free every block made while attached first");
        return NULL;
    }
    memset(&A, 0, sizeof A);
    __atomic_store_n(&OUTSTANDING, 0, __ATOMIC_SEQ_CST);
    A.rs_slot[0] = A.rs_slot[1] = A.raw_alloc_slot = A.raw_delete_slot = -1;
    Py_RETURN_NONE;
}

/* allocator_bypass(on) -> whether it was on. Benchmarks only
 * (benchmarks/bench_toggle.py's "off" mode, switched between two steps):
 * while attached and committed, the copy's slots hold PyTorch's own
 * entries, as while draining (recordStream's wrappers stay, so a block
 * made before keeps its stream uses): nothing of memviz runs for a block
 * PyTorch hands out meanwhile, and none is recorded, nor its free; a block
 * made before is still recorded as it is freed (its deleter is memviz's).
 * So one tracking session can time a step with the route and without it.
 * Off again, the route records as before. Refused unless attached and
 * committed; detach ends it. */
static PyObject *allocator_bypass(PyObject *self, PyObject *arg)
{
    (void)self;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    if (!A.attached || !A.committed) {
        PyErr_SetString(PyExc_RuntimeError,
                        "allocator_bypass(): the route is not attached and committed (track() first)");
        return NULL;
    }
    int was = A.bypassed;
#if HAVE_ALLOCATOR
    A.bypassed = on;
    for (int i = 0; i < A.nslots; i++)
        set_slot(i, slot_entry(i));
#endif
    return PyBool_FromLong(was);
}

/* allocator_state() -> dict, for capture_info and tests. */
static PyObject *allocator_state(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    static const char *const states[] = {"pytorch", "memviz", "draining", "restoring"};
    int st = __atomic_load_n(&A.state, __ATOMIC_SEQ_CST);
    return Py_BuildValue("{s:O,s:O,s:s,s:l,s:O,s:i,s:(ii),s:i,s:i,s:(iiii),s:K,s:K}", "supported",
                         HAVE_ALLOCATOR ? Py_True : Py_False, "attached",
                         A.attached ? Py_True : Py_False, "vtable", states[st & 3], "outstanding",
                         __atomic_load_n(&OUTSTANDING, __ATOMIC_SEQ_CST), "committed",
                         A.committed ? Py_True : Py_False, "slots", A.nslots, "record_stream",
                         A.rs_slot[0], A.rs_slot[1], "raw_alloc_with_stream", A.raw_alloc_slot,
                         "raw_delete", A.raw_delete_slot, "words", A.data_w, A.deleter_w,
                         A.ctx_w, A.device_w, "deleter",
                         (unsigned long long)(uintptr_t)A.orig_deleter, "memviz_deleter",
                         (unsigned long long)(uintptr_t)wrap_delete);
}

PyMethodDef mvz_allocator_methods[] = {
    {"allocator_attach", allocator_attach, METH_O,
     "allocator_attach(holder address): copy the allocator's vtable and swap its vptr."},
    {"allocator_entry", allocator_entry, METH_O, "The original entry of a vtable slot."},
    {"allocator_trip", allocator_trip, METH_VARARGS,
     "allocator_trip(lo, hi, on): counting tripwires on vtable slots [lo, hi)."},
    {"allocator_hits", allocator_hits, METH_NOARGS, "Calls through each slot's tripwire."},
    {"allocator_sample", allocator_sample, METH_O,
     "allocator_sample(reset): the first DataPtr allocate returned, as 4 words."},
    {"allocator_call_raw_deleter", allocator_call_raw_deleter, METH_NOARGS,
     "PyTorch's raw_deleter() answer."},
    {"allocator_commit", allocator_commit, METH_VARARGS,
     "allocator_commit(data, deleter, ctx, device, (rs0, rs1), raw_alloc, raw_delete)."},
    {"allocator_detach", allocator_detach, METH_NOARGS, "Put PyTorch's vtable back."},
    {"allocator_state", allocator_state, METH_NOARGS, "What the allocator route knows."},
    {"allocator_bypass", allocator_bypass, METH_O,
     "allocator_bypass(on): benchmarks only; PyTorch's entries while attached. Returns the old setting."},
    {"allocator_reset", allocator_reset, METH_NOARGS, "Forget the route (tests only)."},
    {NULL, NULL, 0, NULL},
};
