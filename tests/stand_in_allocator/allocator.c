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
 * Segments come from cudaMalloc/cudaFree, imported from the stand-in
 * runtime (cudart.c), which hands them to the "driver" (the libcupti test
 * double's fake_alloc), so CUPTI sees them as it sees PyTorch's cudaMalloc
 * calls, and memviz can wrap the imports as it wraps PyTorch's. Inside them the
 * blocks follow the rules of PyTorch's native caching allocator
 * (c10/cuda/CUDACachingAllocator.cpp, expandable segments off, no CUDA
 * graph pools), so tests can hold memviz's model of block sizes against it:
 *
 * - round_size: below 512 bytes 512, else a multiple of 512; with
 *   roundup_power2_divisions d > 1 and a size over 512 * d, the next of d
 *   equal steps between the powers of two around it (a power of two stays);
 * - a rounded size up to 1 MiB (kSmallSize) comes from the small pool, a
 *   larger one from the large pool; each pool is per stream (a block is
 *   reused only on the stream it was allocated on);
 * - best fit: the smallest free block of the pool and stream that holds the
 *   rounded size (ties: the lowest address); with max_split_size set, a
 *   request below it takes no free block of max_split_size or more, and a
 *   request at or above it takes one only if it is smaller than the request
 *   plus 20 MiB (max_non_split_rounding_size); no fit: a new segment of
 *   2 MiB (small pool), 20 MiB (a rounded size under 10 MiB), else the
 *   rounded size up to a multiple of 2 MiB;
 * - should_split: the remainder (block - rounded) becomes a free block of
 *   its own when it is 512 bytes or more (small pool), or when it is over
 *   1 MiB and the rounded size is under max_split_size (large pool);
 *   otherwise the whole block is handed out, larger than asked;
 * - memory_allocated() (sa_allocated) counts block sizes;
 * - a freed block merges with its free neighbours in the segment; one with a
 *   recorded stream use stays "active_pending_free" until
 *   sa_process_events(), then is freed and merged;
 * - empty_cache() first waits for the recorded streams (as PyTorch's
 *   synchronize_and_free_events), then hands back every segment that is one
 *   free block.
 * What it leaves out: retrying after a failed driver call (PyTorch frees
 * cached blocks and tries again; here the allocation fails), the
 * garbage-collection threshold, per-size-interval roundup divisions (one
 * value for all sizes), a configurable large segment size.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The stand-in runtime (cudart.c). */
int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
void standin_rt_init(uint64_t (*a)(int, uint64_t, uint64_t, int), void (*f)(int, uint64_t, uint64_t, int));

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

#define MAX_BLOCKS 65536
#define MAX_SEGMENTS 4096
#define CBID_cuMemAlloc_v2 243
#define CBID_cuMemFree_v2 245

/* PyTorch's constants (c10/core/AllocatorConfig.h, CUDACachingAllocator.cpp) */
#define kMinBlockSize ((size_t)512)
#define kSmallSize ((size_t)1 << 20)
#define kSmallBuffer ((size_t)2 << 20)
#define kLargeBuffer ((size_t)20 << 20)
#define kMinLargeAlloc ((size_t)10 << 20)
#define kRoundLarge ((size_t)2 << 20)

typedef uint64_t (*driver_alloc_fn)(int cbid, uint64_t size, uint64_t stream, int result);

int c10_is_simple_data_ptr(void *self, const uintptr_t *dp); /* the stand-in libc10.so */

enum { UNUSED = -1, FREE = 0, ALLOCATED = 1, PENDING = 2 }; /* PENDING: freed, stream use recorded */

typedef struct {
    uintptr_t addr;
    size_t size, requested;
    int state, stream_used;
    int seg, prev, next; /* its segment; its neighbours in it (-1: none) */
} block;

typedef struct {
    uintptr_t base;
    size_t size;
    uint64_t stream;
    int small, first; /* first: the lowest block; -1: this slot holds no segment */
} segment;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static block blocks[MAX_BLOCKS];
static int nblocks; /* slots ever used; free slots below it are UNUSED, stacked in spare */
static int spare[MAX_BLOCKS], nspare;
static segment segments[MAX_SEGMENTS];
static int nsegments;
static size_t allocated;
static driver_alloc_fn driver_alloc;
/* settings (sa_configure) and the current stream (sa_set_stream) */
static size_t max_split_size = SIZE_MAX;
static size_t roundup_divisions;
static uint64_t current_stream;

typedef struct {
    void *const *vptr;
} allocator_object;

/* As in a C++ library, something that is not code follows the vtable (the
 * next vtable's offset to top): memviz reads up to it. */
static void *vtable[2 + NSLOTS + 1];
static allocator_object the_allocator = {&vtable[2]};
/* std::atomic<CUDAAllocator*> c10::cuda::CUDACachingAllocator::allocator */
allocator_object *_ZN3c104cuda20CUDACachingAllocator9allocatorE = &the_allocator;

static size_t floor_log2(size_t n) { return 63 - (size_t)__builtin_clzll((unsigned long long)n); }

/* roundup_power2_next_division: `divisions` equal steps between the power of
 * two at or below size and the next one. */
static size_t next_division(size_t size, size_t divisions)
{
    if ((size & (size - 1)) == 0)
        return size;
    size_t floor = (size_t)1 << floor_log2(size);
    size_t step = floor >> floor_log2(divisions);
    if (step == 0)
        return floor << 1;
    size_t down = size & ~(step - 1);
    return down == size ? size : down + step;
}

static size_t round_size(size_t n)
{
    if (n < kMinBlockSize)
        return kMinBlockSize;
    if (roundup_divisions > 1 && n > kMinBlockSize * roundup_divisions)
        return next_division(n, roundup_divisions);
    return kMinBlockSize * ((n + kMinBlockSize - 1) / kMinBlockSize);
}

static size_t allocation_size(size_t size)
{
    if (size <= kSmallSize)
        return kSmallBuffer;
    if (size < kMinLargeAlloc)
        return kLargeBuffer;
    return kRoundLarge * ((size + kRoundLarge - 1) / kRoundLarge);
}

static int new_block(void)
{
    if (nspare > 0)
        return spare[--nspare];
    return nblocks < MAX_BLOCKS ? nblocks++ : -1;
}

static void drop_block(int i)
{
    blocks[i].state = UNUSED;
    spare[nspare++] = i;
}

/* A segment from the driver: one free block over all of it; -1 on failure. */
static int new_segment(size_t size, int small, uint64_t stream)
{
    int s = 0;
    while (s < nsegments && segments[s].first >= 0)
        s++;
    if (s == MAX_SEGMENTS || !driver_alloc)
        return -1;
    int b = new_block();
    if (b < 0)
        return -1;
    void *p = NULL;
    uintptr_t base = cudaMalloc(&p, size) == 0 ? (uintptr_t)p : 0;
    if (!base) {
        drop_block(b);
        return -1;
    }
    if (s == nsegments)
        nsegments++;
    segments[s] = (segment){base, size, stream, small, b};
    blocks[b] = (block){base, size, 0, FREE, 0, s, -1, -1};
    return b;
}

/* get_free_block: best fit in the pool, with max_split_size's limits. */
static int free_block_for(size_t size, int small, uint64_t stream)
{
    int best = -1;
    for (int i = 0; i < nblocks; i++) {
        const block *b = &blocks[i];
        if (b->state != FREE || b->size < size)
            continue;
        const segment *s = &segments[b->seg];
        if (s->small != small || s->stream != stream)
            continue;
        if (best < 0 || b->size < blocks[best].size ||
            (b->size == blocks[best].size && b->addr < blocks[best].addr))
            best = i;
    }
    if (best < 0)
        return -1;
    size_t have = blocks[best].size;
    if (size < max_split_size && have >= max_split_size)
        return -1; /* no oversize block for a request below max_split_size */
    if (size >= max_split_size && have >= size + kLargeBuffer)
        return -1; /* an oversize one only within max_non_split_rounding_size */
    return best;
}

/* The caching allocator's malloc. */
static uintptr_t take(size_t n, uint64_t stream)
{
    size_t size = round_size(n);
    int small = size <= kSmallSize;
    pthread_mutex_lock(&lock);
    int i = free_block_for(size, small, stream);
    if (i < 0)
        i = new_segment(allocation_size(size), small, stream);
    if (i < 0) {
        pthread_mutex_unlock(&lock);
        return 0;
    }
    block *b = &blocks[i];
    size_t remaining = b->size - size;
    int split = small ? remaining >= kMinBlockSize : (size < max_split_size && remaining > kSmallSize);
    int r = split ? new_block() : -1;
    if (r >= 0) { /* the block keeps the low addresses; the rest stays free after it */
        blocks[r] = (block){b->addr + size, remaining, 0, FREE, 0, b->seg, i, b->next};
        if (b->next >= 0)
            blocks[b->next].prev = r;
        b->next = r;
        b->size = size;
    }
    b->state = ALLOCATED;
    b->stream_used = 0;
    b->requested = n;
    allocated += b->size + 512 * STAND_IN_MISCOUNT;
    pthread_mutex_unlock(&lock);
    return b->addr;
}

static block *find(uintptr_t addr)
{
    for (int i = 0; i < nblocks; i++)
        if (blocks[i].addr == addr && (blocks[i].state == ALLOCATED || blocks[i].state == PENDING))
            return &blocks[i];
    return NULL;
}

/* free_block: free, merged with the free neighbours of its segment. */
static void free_and_merge(int i)
{
    block *b = &blocks[i];
    b->state = FREE;
    b->requested = 0;
    int p = b->prev;
    if (p >= 0 && blocks[p].state == FREE) {
        b->addr = blocks[p].addr;
        b->size += blocks[p].size;
        b->prev = blocks[p].prev;
        if (b->prev >= 0)
            blocks[b->prev].next = i;
        else
            segments[b->seg].first = i;
        drop_block(p);
    }
    int x = b->next;
    if (x >= 0 && blocks[x].state == FREE) {
        b->size += blocks[x].size;
        b->next = blocks[x].next;
        if (b->next >= 0)
            blocks[b->next].prev = i;
        drop_block(x);
    }
}

static void give_back(uintptr_t addr)
{
    pthread_mutex_lock(&lock);
    block *b = find(addr);
    if (b && b->state == ALLOCATED) {
        allocated -= b->size + 512 * STAND_IN_MISCOUNT;
        if (b->stream_used)
            b->state = PENDING;
        else
            free_and_merge((int)(b - blocks));
    }
    pthread_mutex_unlock(&lock);
}

/* The recorded streams' work is done: pending blocks are freed (lock held). */
static void process_events(void)
{
    for (int i = 0; i < nblocks; i++)
        if (blocks[i].state == PENDING)
            free_and_merge(i);
}

/* local_raw_delete: the deleter of every DataPtr allocate() hands out. */
static void local_raw_delete(void *ctx) { give_back((uintptr_t)ctx - STAND_IN_CTX_OFFSET); }

static void dtor(void *self) { (void)self; }

static void *allocate(void *sret, void *self, size_t n)
{
    (void)self;
    uintptr_t *w = sret;
    uintptr_t p = n ? take(n, __atomic_load_n(&current_stream, __ATOMIC_RELAXED)) : 0;
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
    return n ? (void *)take(n, (uint64_t)(uintptr_t)stream) : NULL;
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

void sa_init(driver_alloc_fn f)
{
    driver_alloc = f;
    standin_rt_init(f, NULL);
}

/* PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb and roundup_power2_divisions
 * (one value for every size): max_split_size in bytes, 0 for none (PyTorch
 * wants over 20 MiB); divisions 0 (off) or a power of two. 0, or -1 for a
 * value PyTorch refuses (nothing changes then). */
int sa_configure(size_t max_split, size_t divisions)
{
    if ((max_split && max_split <= kLargeBuffer) || (divisions & (divisions - 1)))
        return -1;
    pthread_mutex_lock(&lock);
    max_split_size = max_split ? max_split : SIZE_MAX;
    roundup_divisions = divisions;
    pthread_mutex_unlock(&lock);
    return 0;
}

/* torch.cuda.set_stream(s): the stream allocate() and sa_raw_alloc() use
 * from now on (0, the default stream, at first). */
void sa_set_stream(uint64_t stream) { __atomic_store_n(&current_stream, stream, __ATOMIC_RELAXED); }

/* The rounding rule alone (PyTorch's round_size), for tests. */
size_t sa_round_size(size_t n)
{
    pthread_mutex_lock(&lock);
    size_t r = round_size(n);
    pthread_mutex_unlock(&lock);
    return r;
}

/* Forget every block and segment (nothing goes back to the driver) and the
 * settings: a fresh allocator, for tests that drive many sequences through
 * one library. Only with no tensor or raw block of it left in use. */
void sa_reset(void)
{
    pthread_mutex_lock(&lock);
    nblocks = nspare = nsegments = 0;
    allocated = 0;
    max_split_size = SIZE_MAX;
    roundup_divisions = 0;
    current_stream = 0;
    pthread_mutex_unlock(&lock);
}

typedef void (*driver_free_fn)(int cbid, uint64_t address, uint64_t stream, int result);

/* torch.cuda.empty_cache(): the recorded streams are waited for, then each
 * segment that is one free block goes back to the driver (cuMemFree through
 * the test double). Returns how many went. */
int sa_empty_cache(driver_free_fn driver_free)
{
    standin_rt_init(NULL, driver_free);
    int released = 0;
    pthread_mutex_lock(&lock);
    process_events();
    for (int s = 0; s < nsegments; s++) {
        int b = segments[s].first;
        if (b < 0 || blocks[b].state != FREE || blocks[b].next >= 0)
            continue;
        cudaFree((void *)segments[s].base);
        drop_block(b);
        segments[s].first = -1;
        released++;
    }
    while (nsegments > 0 && segments[nsegments - 1].first < 0)
        nsegments--;
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
    /* torch.cuda.caching_allocator_alloc(n): on the current stream */
    void *stream = (void *)(uintptr_t)__atomic_load_n(&current_stream, __ATOMIC_RELAXED);
    return ((void *(*)(void *, size_t, void *))o->vptr[SLOT_RAW_ALLOC])(o, n, stream);
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

/* The recorded streams' work is done: pending blocks are freed and merged. */
void sa_process_events(void)
{
    pthread_mutex_lock(&lock);
    process_events();
    pthread_mutex_unlock(&lock);
}

size_t sa_reserved(void)
{
    pthread_mutex_lock(&lock);
    size_t n = 0;
    for (int s = 0; s < nsegments; s++)
        if (segments[s].first >= 0)
            n += segments[s].size;
    pthread_mutex_unlock(&lock);
    return n;
}

/* The segments' slots in address order (as memory_snapshot() sorts them);
 * returns how many (lock held). */
static int by_address(int *order)
{
    int n = 0;
    for (int s = 0; s < nsegments; s++) {
        if (segments[s].first < 0)
            continue;
        int j = n++;
        while (j > 0 && segments[order[j - 1]].base > segments[s].base) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = s;
    }
    return n;
}

static int order[MAX_SEGMENTS];

/* memory_snapshot()'s blocks, `words` words each: (address, size, state) or
 * (address, size, requested size, state), segment by segment in address
 * order, each segment's blocks in address order; requested size 0 for a
 * free block. Returns how many were written (at most cap); out NULL: how
 * many there are. */
static int write_blocks(uintptr_t *out, int cap, int words)
{
    pthread_mutex_lock(&lock);
    int n = 0, nseg = by_address(order);
    for (int k = 0; k < nseg; k++)
        for (int i = segments[order[k]].first; i >= 0 && (!out || n < cap); i = blocks[i].next, n++) {
            if (!out)
                continue;
            uintptr_t *w = out + (size_t)words * n;
            w[0] = blocks[i].addr;
            w[1] = blocks[i].size;
            if (words == 4)
                w[2] = blocks[i].requested;
            w[words - 1] = (uintptr_t)blocks[i].state;
        }
    pthread_mutex_unlock(&lock);
    return n;
}

/* state: 0 free ("inactive"), 1 "active_allocated", 2 "active_pending_free" */
int sa_blocks(uintptr_t *out, int cap) { return write_blocks(out, cap, 3); }
int sa_blocks2(uintptr_t *out, int cap) { return write_blocks(out, cap, 4); }

/* memory_snapshot()'s segments in address order: (address, size) or
 * (address, size, stream, 1 for the small pool); out NULL: how many. */
static int write_segments(uintptr_t *out, int cap, int words)
{
    pthread_mutex_lock(&lock);
    int n = by_address(order);
    if (out && n > cap)
        n = cap;
    for (int k = 0; out && k < n; k++) {
        const segment *s = &segments[order[k]];
        uintptr_t *w = out + (size_t)words * k;
        w[0] = s->base;
        w[1] = s->size;
        if (words == 4) {
            w[2] = (uintptr_t)s->stream;
            w[3] = (uintptr_t)s->small;
        }
    }
    pthread_mutex_unlock(&lock);
    return n;
}

int sa_segments(uintptr_t *out, int cap) { return write_segments(out, cap, 2); }
int sa_segments2(uintptr_t *out, int cap) { return write_segments(out, cap, 4); }

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

/* As sa_loop, timing allocations and frees apart: `count` tensors made and
 * freed in batches of 32, each batch's allocations timed, then its frees
 * (out[0]: nanoseconds in allocations, out[1]: in frees; the clock reads,
 * one per 32 events, are in both the untracked and the tracked loop). */
void sa_loop_split(int count, size_t size, uint64_t out[2])
{
    enum { BATCH = 32 };
    tensor *held[BATCH];
    struct timespec a, b, c;
    out[0] = out[1] = 0;
    for (int i = 0; i < count; i += BATCH) {
        int k = count - i < BATCH ? count - i : BATCH;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (int j = 0; j < k; j++)
            held[j] = sa_tensor_new(size);
        clock_gettime(CLOCK_MONOTONIC, &b);
        for (int j = 0; j < k; j++)
            sa_tensor_free(held[j]);
        clock_gettime(CLOCK_MONOTONIC, &c);
        out[0] += (uint64_t)(b.tv_sec - a.tv_sec) * 1000000000u + (uint64_t)(b.tv_nsec - a.tv_nsec);
        out[1] += (uint64_t)(c.tv_sec - b.tv_sec) * 1000000000u + (uint64_t)(c.tv_nsec - b.tv_nsec);
    }
}

/* As sa_loop, with `gap` bytes of a buffer of its own written between one
 * tensor's free and the next allocation (a cache line every 64 bytes), as
 * an operation's work would: what the capture path reads is cold, as
 * inside a training step. The calling thread's CPU time (benchmarks on a
 * shared machine), the writes included. */
uint64_t sa_loop_gap(int count, size_t size, size_t gap)
{
    static volatile char *buf;
    static size_t have;
    if (gap > have) {
        free((void *)buf);
        buf = malloc(gap);
        have = buf ? gap : 0;
        if (!buf)
            return 0;
    }
    struct timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    for (int i = 0; i < count; i++) {
        for (size_t k = 0; k < gap; k += 64)
            buf[k] = (char)i;
        sa_tensor_free(sa_tensor_new(size));
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    return (uint64_t)(b.tv_sec - a.tv_sec) * 1000000000u + (uint64_t)(b.tv_nsec - a.tv_nsec);
}

/* A churn of `count` tensor allocations of mixed sizes (a training step's
 * shape: many small, some of a few MiB, a few large), each freed when
 * `live` newer ones exist (a random one of the older half), from the
 * calling thread, for benchmarks/bench_whatif.py. Deterministic for a seed. */
void sa_churn(int count, int live, unsigned seed)
{
    static const size_t sizes[] = {512, 4096, 65536, 300000, 1 << 20, 3 << 20, 6 << 20, 24 << 20, 90 << 20};
    tensor **ring = calloc((size_t)live + 1, sizeof *ring);
    if (!ring)
        return;
    uint64_t x = seed ? seed : 1;
    int n = 0;
    for (int i = 0; i < count; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        unsigned pick = (unsigned)(x % 100);
        size_t base = sizes[pick < 40 ? pick % 3 : pick < 75 ? 3 + pick % 2 : pick < 95 ? 5 + pick % 2 : 7 + pick % 2];
        size_t size = base / 2 + (size_t)((x >> 20) % (base + 1));
        if (n == live) {
            int k = (int)((x >> 40) % (unsigned)(live / 2 + 1));
            sa_tensor_free(ring[k]);
            ring[k] = ring[--n];
        }
        ring[n++] = sa_tensor_new(size);
    }
    while (n > 0)
        sa_tensor_free(ring[--n]);
    free(ring);
}