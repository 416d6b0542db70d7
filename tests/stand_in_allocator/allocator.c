/* A stand-in for PyTorch's libc10_cuda.so caching allocator, for the CPU
 * tests of the allocator route (src/allocator.h).
 *
 * It has what memviz relies on, laid out as the C++ ABI lays out PyTorch's:
 * an exported holder `c10::cuda::CUDACachingAllocator::allocator` pointing
 * at an object whose first word is a vtable pointer; slot 2 allocate(n)
 * returning a 4-word DataPtr through a hidden pointer; slot 3 defined in
 * another library (c10::Allocator::is_simple_data_ptr in libc10.so); slot 4
 * raw_deleter(); recordStream(dp, stream), which, like PyTorch's, ignores a
 * DataPtr whose deleter is not its own; raw_alloc_with_stream and
 * raw_delete. Where those slots and words sit is chosen at compile time
 * (-D...), so tests can check that memviz finds them rather than assumes.
 *
 * Segments come from the "driver" (the libcupti test double's fake_alloc),
 * so CUPTI sees them as it sees PyTorch's cudaMalloc calls. Blocks are
 * rounded to 512 bytes and counted as PyTorch counts memory_allocated().
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef DATA_W
#define DATA_W 0
#endif
#ifndef DELETER_W
#define DELETER_W 1
#endif
#ifndef CTX_W
#define CTX_W 2
#endif
#ifndef DEVICE_W
#define DEVICE_W 3
#endif
#ifndef SLOT_RS      /* recordStream(const DataPtr&, CUDAStream) */
#define SLOT_RS 17
#endif
#ifndef SLOT_RS_GENERIC /* recordStream(const DataPtr&, c10::Stream): calls SLOT_RS; -1: none */
#define SLOT_RS_GENERIC 9
#endif
#ifndef SLOT_RAW_ALLOC
#define SLOT_RAW_ALLOC 6
#endif
#ifndef SLOT_RAW_DELETE
#define SLOT_RAW_DELETE 7
#endif
#ifndef SLOT_COMMON /* a virtual both raw calls ask first (PyTorch's initialized()) */
#define SLOT_COMMON 21
#endif
#ifndef NSLOTS
#define NSLOTS 40
#endif
#ifndef DEVICE
#define DEVICE 0
#endif
/* Ways to be unlike PyTorch, for the tests of the probe's checks. */
#ifndef STAND_IN_CTX_OFFSET /* the context is not the data pointer */
#define STAND_IN_CTX_OFFSET 0
#endif
#ifndef STAND_IN_IGNORE_RECORD_STREAM /* tensor.record_stream() never reaches the allocator */
#define STAND_IN_IGNORE_RECORD_STREAM 0
#endif
#ifndef STAND_IN_MISCOUNT /* memory_allocated() counts 512 bytes more per block */
#define STAND_IN_MISCOUNT 0
#endif

#define SEGMENT (2u << 20)
#define MAX_BLOCKS 65536
#define MAX_SEGMENTS 1024
#define CBID_cuMemAlloc_v2 243
#define CBID_cuMemFree_v2 245

typedef uint64_t (*driver_alloc_fn)(int cbid, uint64_t size, uint64_t stream, int result);

int c10_is_simple_data_ptr(void *self, const uintptr_t *dp); /* the stand-in libc10.so */

typedef struct {
    uintptr_t addr;
    size_t size;
    int state; /* 0 free, 1 allocated, 2 freed but waiting for a recorded stream */
    int stream_used;
} block;

typedef struct {
    uintptr_t base;
    size_t size, used;
} segment;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static block blocks[MAX_BLOCKS];
static int nblocks;
static segment segments[MAX_SEGMENTS];
static int nsegments;
static size_t allocated;
static driver_alloc_fn driver_alloc;

typedef struct {
    void *const *vptr;
} allocator_object;

/* As in a C++ library, something that is not code follows the vtable (the
 * next vtable's offset to top): memviz reads up to it. */
static void *vtable[2 + NSLOTS + 1];
static allocator_object the_allocator = {&vtable[2]};
/* std::atomic<CUDAAllocator*> c10::cuda::CUDACachingAllocator::allocator */
allocator_object *_ZN3c104cuda20CUDACachingAllocator9allocatorE = &the_allocator;

static size_t round_size(size_t n) { return n < 512 ? 512 : (n + 511) / 512 * 512; }

/* The caching allocator's malloc: first fit at the end of a segment. */
static uintptr_t take(size_t n)
{
    size_t size = round_size(n);
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nblocks; i++) /* reuse a free block of exactly this size */
        if (blocks[i].state == 0 && blocks[i].size == size) {
            blocks[i].state = 1;
            blocks[i].stream_used = 0;
            allocated += size + 512 * STAND_IN_MISCOUNT;
            pthread_mutex_unlock(&lock);
            return blocks[i].addr;
        }
    segment *seg = NULL;
    for (int i = 0; i < nsegments && !seg; i++)
        if (segments[i].size - segments[i].used >= size)
            seg = &segments[i];
    if (!seg && nsegments < MAX_SEGMENTS && driver_alloc) {
        size_t ssize = size <= SEGMENT ? SEGMENT : (size + SEGMENT - 1) / SEGMENT * SEGMENT;
        uintptr_t base = (uintptr_t)driver_alloc(CBID_cuMemAlloc_v2, ssize, 0, 0);
        if (base) {
            seg = &segments[nsegments++];
            seg->base = base;
            seg->size = ssize;
            seg->used = 0;
        }
    }
    if (!seg || nblocks == MAX_BLOCKS) {
        pthread_mutex_unlock(&lock);
        return 0;
    }
    block *b = &blocks[nblocks++];
    b->addr = seg->base + seg->used;
    b->size = size;
    b->state = 1;
    b->stream_used = 0;
    seg->used += size;
    allocated += size + 512 * STAND_IN_MISCOUNT;
    pthread_mutex_unlock(&lock);
    return b->addr;
}

static block *find(uintptr_t addr)
{
    for (int i = 0; i < nblocks; i++)
        if (blocks[i].addr == addr && blocks[i].state)
            return &blocks[i];
    return NULL;
}

static void give_back(uintptr_t addr)
{
    pthread_mutex_lock(&lock);
    block *b = find(addr);
    if (b && b->state == 1) {
        b->state = b->stream_used ? 2 : 0;
        allocated -= b->size + 512 * STAND_IN_MISCOUNT;
    }
    pthread_mutex_unlock(&lock);
}

/* local_raw_delete: the deleter of every DataPtr allocate() hands out. */
static void local_raw_delete(void *ctx) { give_back((uintptr_t)ctx - STAND_IN_CTX_OFFSET); }

static void dtor(void *self) { (void)self; }

static void *allocate(void *sret, void *self, size_t n)
{
    (void)self;
    uintptr_t *w = sret;
    uintptr_t p = n ? take(n) : 0;
    w[DATA_W] = p;
    w[CTX_W] = p ? p + STAND_IN_CTX_OFFSET : 0;
    w[DELETER_W] = (uintptr_t)local_raw_delete;
    w[DEVICE_W] = 1 | ((uintptr_t)DEVICE << 8); /* Device(DeviceType::CUDA, DEVICE) */
    return sret;
}

static void *raw_deleter(const void *self)
{
    (void)self;
    return (void *)local_raw_delete;
}

static void record_stream(void *self, const uintptr_t *dp, uint64_t s0, uint64_t s1)
{
    (void)self;
    (void)s0;
    (void)s1;
    if (!dp[DATA_W] || dp[DELETER_W] != (uintptr_t)local_raw_delete)
        return; /* not allocated by this instance: PyTorch skips it too */
    pthread_mutex_lock(&lock);
    block *b = find(dp[DATA_W]);
    if (b)
        b->stream_used = 1;
    pthread_mutex_unlock(&lock);
}

#if SLOT_RS_GENERIC >= 0
static void record_stream_generic(void *self, const uintptr_t *dp, uint64_t s0, uint64_t s1)
{
    /* CUDAAllocator's c10::Stream overload: a virtual call to the other. */
    allocator_object *o = self;
    ((void (*)(void *, const uintptr_t *, uint64_t, uint64_t))o->vptr[SLOT_RS])(self, dp, s0, s1);
}
#endif

static void *raw_alloc_with_stream(void *self, size_t n, void *stream)
{
    (void)self;
    (void)stream;
    return n ? (void *)take(n) : NULL;
}

static void raw_delete(void *self, void *p)
{
    (void)self;
    give_back((uintptr_t)p);
}

static uintptr_t noop(void) { return 0; }

__attribute__((constructor)) static void build_vtable(void)
{
    for (int i = 0; i < NSLOTS; i++)
        vtable[2 + i] = (void *)noop;
    vtable[2 + 0] = (void *)dtor;
    vtable[2 + 1] = (void *)dtor;
    vtable[2 + 2] = (void *)allocate;
    vtable[2 + 3] = (void *)c10_is_simple_data_ptr;
    vtable[2 + 4] = (void *)raw_deleter;
    vtable[2 + SLOT_RS] = (void *)record_stream;
#if SLOT_RS_GENERIC >= 0
    vtable[2 + SLOT_RS_GENERIC] = (void *)record_stream_generic;
#endif
    vtable[2 + SLOT_RAW_ALLOC] = (void *)raw_alloc_with_stream;
    vtable[2 + SLOT_RAW_DELETE] = (void *)raw_delete;
}

/* ---- what PyTorch's own code does, for the tests (called via ctypes) ---- */

typedef struct {
    uintptr_t w[4]; /* the tensor's DataPtr */
} tensor;

static allocator_object *current(void) { return __atomic_load_n(&_ZN3c104cuda20CUDACachingAllocator9allocatorE, __ATOMIC_ACQUIRE); }

void sa_init(driver_alloc_fn f) { driver_alloc = f; }

typedef void (*driver_free_fn)(int cbid, uint64_t address, uint64_t stream, int result);

/* torch.cuda.empty_cache(): segments none of whose blocks is in use go back
 * to the driver (cuMemFree through the test double), with their blocks.
 * Returns how many went. */
int sa_empty_cache(driver_free_fn driver_free)
{
    int released = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nsegments;) {
        segment *seg = &segments[i];
        int busy = 0;
        for (int j = 0; j < nblocks; j++)
            if (blocks[j].addr >= seg->base && blocks[j].addr < seg->base + seg->size && blocks[j].state)
                busy = 1;
        if (busy) {
            i++;
            continue;
        }
        int kept = 0;
        for (int j = 0; j < nblocks; j++)
            if (!(blocks[j].addr >= seg->base && blocks[j].addr < seg->base + seg->size))
                blocks[kept++] = blocks[j];
        nblocks = kept;
        driver_free(CBID_cuMemFree_v2, seg->base, 0, 0);
        segments[i] = segments[--nsegments];
        released++;
    }
    pthread_mutex_unlock(&lock);
    return released;
}

/* torch.empty(n, device="cuda"): the caller holds the DataPtr. */
tensor *sa_tensor_new(size_t n)
{
    tensor *t = calloc(1, sizeof *t);
    allocator_object *o = current();
    ((void *(*)(void *, void *, size_t))o->vptr[2])(t->w, o, n);
    return t;
}

uintptr_t sa_tensor_data(const tensor *t) { return t->w[DATA_W]; }
uintptr_t sa_tensor_deleter(const tensor *t) { return t->w[DELETER_W]; }

/* The tensor's last reference goes: its DataPtr's deleter runs. */
void sa_tensor_free(tensor *t)
{
    if (t->w[DATA_W])
        ((void (*)(void *))t->w[DELETER_W])((void *)t->w[CTX_W]);
    free(t);
}

/* tensor.record_stream(s): through the generic overload when there is one. */
void sa_tensor_record_stream(const tensor *t)
{
    if (STAND_IN_IGNORE_RECORD_STREAM)
        return;
    allocator_object *o = current();
    int slot = SLOT_RS_GENERIC >= 0 ? SLOT_RS_GENERIC : SLOT_RS;
    ((void (*)(void *, const uintptr_t *, uint64_t, uint64_t))o->vptr[slot])(o, t->w, 0x101, 7);
}

/* Allocator::raw_deallocate(p): raw_deleter()(p). */
void sa_raw_deallocate(void *p)
{
    allocator_object *o = current();
    ((void (*)(void *))((void *(*)(const void *))o->vptr[4])(o))(p);
}

/* DataPtr::compare_exchange_deleter(raw_deleter(), nothing) as CUDA-graph
 * trees do it: 1 when the tensor's deleter is what raw_deleter() says. */
int sa_has_standard_deleter(const tensor *t)
{
    allocator_object *o = current();
    return t->w[DELETER_W] == (uintptr_t)((void *(*)(const void *))o->vptr[4])(o);
}

void *sa_raw_alloc(size_t n)
{
    allocator_object *o = current();
    ((uintptr_t(*)(void *))o->vptr[SLOT_COMMON])(o);
    return ((void *(*)(void *, size_t, void *))o->vptr[SLOT_RAW_ALLOC])(o, n, (void *)7);
}

void sa_raw_free(void *p)
{
    allocator_object *o = current();
    ((uintptr_t(*)(void *))o->vptr[SLOT_COMMON])(o);
    ((void (*)(void *, void *))o->vptr[SLOT_RAW_DELETE])(o, p);
}

size_t sa_allocated(void)
{
    pthread_mutex_lock(&lock);
    size_t n = allocated;
    pthread_mutex_unlock(&lock);
    return n;
}

/* 0: not a block, 1 allocated, 2 freed, waiting for its recorded stream. */
int sa_state(uintptr_t addr)
{
    pthread_mutex_lock(&lock);
    block *b = find(addr);
    int s = b ? b->state : 0;
    pthread_mutex_unlock(&lock);
    return s;
}

/* The recorded streams' work is done: pending blocks become free. */
void sa_process_events(void)
{
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nblocks; i++)
        if (blocks[i].state == 2)
            blocks[i].state = 0;
    pthread_mutex_unlock(&lock);
}

/* memory_snapshot(): (address, size, state) of each block, and segments. */
int sa_blocks(uintptr_t *out, int cap)
{
    pthread_mutex_lock(&lock);
    int n = 0;
    for (int i = 0; i < nblocks && n < cap; i++, n++) {
        out[3 * n] = blocks[i].addr;
        out[3 * n + 1] = blocks[i].size;
        out[3 * n + 2] = (uintptr_t)blocks[i].state;
    }
    pthread_mutex_unlock(&lock);
    return n;
}

int sa_segments(uintptr_t *out, int cap)
{
    pthread_mutex_lock(&lock);
    int n = 0;
    for (int i = 0; i < nsegments && n < cap; i++, n++) {
        out[2 * n] = segments[i].base;
        out[2 * n + 1] = segments[i].size;
    }
    pthread_mutex_unlock(&lock);
    return n;
}

/* Backward on an engine thread, or a C++ library: a thread with no Python
 * frames allocates `count` tensors of `size` bytes and frees all but `keep`. */
typedef struct {
    int count, keep;
    size_t size;
} work;

static tensor *kept[4096];
static int nkept;

static void *worker(void *arg)
{
    work *w = arg;
    for (int i = 0; i < w->count; i++) {
        tensor *t = sa_tensor_new(w->size);
        if (i >= w->keep || nkept == 4096)
            sa_tensor_free(t);
        else
            kept[nkept++] = t;
    }
    return NULL;
}

/* The tensors sa_native_thread kept go (from the calling thread). */
void sa_native_free_kept(void)
{
    while (nkept > 0)
        sa_tensor_free(kept[--nkept]);
}

void sa_native_thread(int count, int keep, size_t size)
{
    work w = {count, keep, size};
    pthread_t th;
    if (pthread_create(&th, NULL, worker, &w) == 0)
        pthread_join(th, NULL);
}

/* A tight loop of `count` tensor allocations and frees of `size` bytes from
 * the calling thread (benchmarks/bench_allocator_route.py); returns ns. */
uint64_t sa_loop(int count, size_t size)
{
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < count; i++)
        sa_tensor_free(sa_tensor_new(size));
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (uint64_t)(b.tv_sec - a.tv_sec) * 1000000000u + (uint64_t)(b.tv_nsec - a.tv_nsec);
}
