/* libcupti test double for memviz's CPU test suite (CI has no GPU).
 *
 * Exports the subset of the CUPTI C API that memviz resolves with dlsym,
 * using the real callback IDs, parameter structs and activity record layouts
 * from src/cupti_abi.h, plus fake_* control functions that tests call through
 * ctypes to play the part of the CUDA driver.
 *
 * Threading: like real CUPTI, callbacks run on whichever thread made the
 * "driver" call, concurrently, and no lock of ours is held while a subscriber
 * or buffer callback runs (so callbacks may call back into this library).
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../src/cupti_abi.h"

#define API __attribute__((visibility("default")))

enum {
    DEFAULT_VERSION = 130001,
    MAX_DOMAIN = 8,   /* CUPTI_CB_DOMAIN_SIZE is 7 */
    MAX_CBID = 1024,  /* CUPTI_DRIVER_TRACE_CBID_SIZE is 807 in 13.0 */
    MAX_KIND = 128,   /* CUpti_ActivityKind values stay well below this */
    MAX_DEVICE = 1024,
    /* CUptiResult codes used here but not by memviz (not in cupti_abi.h). */
    ERR_INVALID_DEVICE = 2,
    ERR_INVALID_OPERATION = 7,
    ERR_INVALID_KIND = 21,
};
#define CTX_BASE 0x1000u             /* fake CUcontext = CTX_BASE + device */
#define FAKE_POOL ((void *)0x5000)   /* the pool cuMemAllocFromPoolAsync names */
#define ADDR_BASE 0x7f0000000000ull  /* looks like a UVA device address */

/* ---- state ------------------------------------------------------------ */

/* g_mu guards the subscriber identity, activity callbacks, the record queue
 * and the string pool. Hot-path flags are atomics so firing needs no lock
 * beyond a short snapshot of the subscriber. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

/* A fork while another thread holds g_mu (fire()'s snapshot, for instance)
 * left the child's copy locked for ever: the child's next driver call hung
 * (tests/integration/test_stress.py's fork test, once in a few hundred forks). The
 * child has only the forking thread: g_mu starts unlocked there. No callback
 * runs under g_mu, so nothing it guards is left half-made by a client. */
static void g_mu_child(void) { pthread_mutex_init(&g_mu, NULL); }
__attribute__((constructor)) static void g_mu_atfork(void) { pthread_atfork(NULL, NULL, g_mu_child); }

static atomic_int g_subscribed;      /* written under g_mu */
static mvz_CUpti_CallbackFunc g_cb;
static void *g_userdata;
static char g_sub_name[MVZ_CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN];
static unsigned g_sub_gen;            /* picks the handle, so stale ones fail */
static char g_handles[16];            /* handle = &g_handles[gen % 16] */
static char *g_conflict;              /* holder reported by subscribe_v2 */
static int g_conflict_shares;         /* the holder subscribed allowing others (CUPTI >= 13.5) */
static atomic_int g_subscribe_error;

static atomic_uchar g_enabled[MAX_DOMAIN][MAX_CBID];
static atomic_uchar g_activity[MAX_KIND];
static atomic_uint g_version = DEFAULT_VERSION;
static atomic_int g_callback_count;
static atomic_int g_domain_calls;
static atomic_uint g_correlation;     /* never reset: ids stay unique */
static atomic_ullong g_next_addr = ADDR_BASE; /* never reset: no aliasing */
static atomic_uint g_epoch;           /* bumped by fake_reset */

/* Per-thread current device; a stale epoch means "reset since, so 0". */
static _Thread_local int tl_device;
static _Thread_local unsigned tl_device_epoch;
static _Thread_local uint32_t tl_last_corr;

static mvz_BuffersCallbackRequestFunc g_req;
static mvz_BuffersCallbackCompleteFunc g_done;
static size_t g_dropped;

/* Queued MEMORY2 records are kept as fields and laid out at delivery, so the
 * layout always matches what cuptiGetVersion reports to the reader. */
typedef struct {
    int op, memkind;
    uint32_t corr, device;
    uint64_t address, bytes, timestamp;
    const char *name, *source;
} pending_t;
static pending_t *g_queue;
static size_t g_queue_len, g_queue_cap;
/* Whether records are queued and whether buffer callbacks are registered,
 * readable without g_mu: a flush with nothing to hand over returns at once,
 * as CUPTI's does, instead of queueing on g_mu behind every driver call
 * (its waiters are not served in turn: a snapshot of a tracker whose threads
 * allocate in a tight loop could wait seconds). */
static atomic_int g_queued_any, g_req_set;
static char **g_strings;              /* strdup'd names, freed by fake_reset */
static size_t g_strings_len, g_strings_cap;

static int current_device(void) {
    return tl_device_epoch == atomic_load(&g_epoch) ? tl_device : 0;
}

static int grow(void **arr, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap * 2 : 16;
    while (n < need) n *= 2;
    void *p = realloc(*arr, n * elem);
    if (!p) return -1;
    *arr = p;
    *cap = n;
    return 0;
}

/* ---- versions, results, misc ------------------------------------------- */

API int cuptiGetVersion(uint32_t *version) {
    if (!version) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    *version = atomic_load(&g_version);
    return MVZ_CUPTI_SUCCESS;
}

static const char *const k_results[] = {
    "CUPTI_SUCCESS", "CUPTI_ERROR_INVALID_PARAMETER", "CUPTI_ERROR_INVALID_DEVICE",
    "CUPTI_ERROR_INVALID_CONTEXT", "CUPTI_ERROR_INVALID_EVENT_DOMAIN_ID",
    "CUPTI_ERROR_INVALID_EVENT_ID", "CUPTI_ERROR_INVALID_EVENT_NAME",
    "CUPTI_ERROR_INVALID_OPERATION", "CUPTI_ERROR_OUT_OF_MEMORY", "CUPTI_ERROR_HARDWARE",
    "CUPTI_ERROR_PARAMETER_SIZE_NOT_SUFFICIENT", "CUPTI_ERROR_API_NOT_IMPLEMENTED",
    "CUPTI_ERROR_MAX_LIMIT_REACHED", "CUPTI_ERROR_NOT_READY", "CUPTI_ERROR_NOT_COMPATIBLE",
    "CUPTI_ERROR_NOT_INITIALIZED", "CUPTI_ERROR_INVALID_METRIC_ID",
    "CUPTI_ERROR_INVALID_METRIC_NAME", "CUPTI_ERROR_QUEUE_EMPTY", "CUPTI_ERROR_INVALID_HANDLE",
    "CUPTI_ERROR_INVALID_STREAM", "CUPTI_ERROR_INVALID_KIND", "CUPTI_ERROR_INVALID_EVENT_VALUE",
    "CUPTI_ERROR_DISABLED", "CUPTI_ERROR_INVALID_MODULE", "CUPTI_ERROR_INVALID_METRIC_VALUE",
    "CUPTI_ERROR_HARDWARE_BUSY", "CUPTI_ERROR_NOT_SUPPORTED",
    "CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED", "CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_ON_DEVICE",
    "CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_ON_NON_P2P_DEVICES",
    "CUPTI_ERROR_UM_PROFILING_NOT_SUPPORTED_WITH_MPS", "CUPTI_ERROR_CDP_TRACING_NOT_SUPPORTED",
    "CUPTI_ERROR_VIRTUALIZED_DEVICE_NOT_SUPPORTED", "CUPTI_ERROR_CUDA_COMPILER_NOT_COMPATIBLE",
    "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES", "CUPTI_ERROR_OLD_PROFILER_API_INITIALIZED",
    "CUPTI_ERROR_OPENACC_UNDEFINED_ROUTINE", "CUPTI_ERROR_LEGACY_PROFILER_NOT_SUPPORTED",
    "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED",
    "CUPTI_ERROR_VIRTUALIZED_DEVICE_INSUFFICIENT_PRIVILEGES",
    "CUPTI_ERROR_CONFIDENTIAL_COMPUTING_NOT_SUPPORTED", "CUPTI_ERROR_CMP_DEVICE_NOT_SUPPORTED",
    "CUPTI_ERROR_MIG_DEVICE_NOT_SUPPORTED", "CUPTI_ERROR_SLI_DEVICE_NOT_SUPPORTED",
    "CUPTI_ERROR_WSL_DEVICE_NOT_SUPPORTED", "CUPTI_ERROR_INVALID_CHIP_NAME",
};

API int cuptiGetResultString(int result, const char **str) {
    if (!str) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    if (result == MVZ_CUPTI_ERROR_UNKNOWN) {
        *str = "CUPTI_ERROR_UNKNOWN";
        return MVZ_CUPTI_SUCCESS;
    }
    if (result < 0 || (size_t)result >= sizeof k_results / sizeof k_results[0])
        return MVZ_CUPTI_ERROR_INVALID_PARAMETER; /* as real CUPTI: not a CUptiResult */
    *str = k_results[result];
    return MVZ_CUPTI_SUCCESS;
}

API int cuptiGetDeviceId(mvz_CUcontext context, uint32_t *deviceId) {
    if (!deviceId) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    if (!context) { /* NULL means the calling thread's current context */
        *deviceId = (uint32_t)current_device();
        return MVZ_CUPTI_SUCCESS;
    }
    uintptr_t c = (uintptr_t)context;
    if (c < CTX_BASE || c >= CTX_BASE + MAX_DEVICE) return ERR_INVALID_DEVICE;
    *deviceId = (uint32_t)(c - CTX_BASE);
    return MVZ_CUPTI_SUCCESS;
}

API int cuptiGetTimestamp(uint64_t *timestamp) {
    if (!timestamp) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    *timestamp = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    return MVZ_CUPTI_SUCCESS;
}

/* ---- subscription ------------------------------------------------------ */

static void clear_enabled(void) {
    for (int d = 0; d < MAX_DOMAIN; d++)
        for (int c = 0; c < MAX_CBID; c++) atomic_store(&g_enabled[d][c], 0);
}

/* Bounded, always NUL-terminated copy into the caller's buffer. */
static void write_holder(mvz_CUpti_SubscriberParams *p, const char *holder) {
    size_t end = offsetof(mvz_CUpti_SubscriberParams, oldSubscriberSize) + sizeof(size_t);
    if (!p || p->structSize < end || !p->oldSubscriberName || p->oldSubscriberSize == 0) return;
    snprintf(p->oldSubscriberName, p->oldSubscriberSize, "%s", holder);
}

/* Multi-subscriber mode, as CUPTI 13.5 has it: asked for with
 * allowMultipleSubscribers, which only a CUPTI of that version reads (an
 * older one takes the struct's first four fields). */
static int wants_to_share(const mvz_CUpti_SubscriberParams *p) {
    size_t end = offsetof(mvz_CUpti_SubscriberParams, allowMultipleSubscribers) + 1;
    return p && p->structSize >= end && p->allowMultipleSubscribers &&
           atomic_load(&g_version) >= MVZ_CUPTI_MULTI_SUBSCRIBER_VERSION;
}

API int cuptiSubscribe_v2(mvz_CUpti_SubscriberHandle *subscriber, mvz_CUpti_CallbackFunc callback,
                          void *userdata, mvz_CUpti_SubscriberParams *params) {
    if (!subscriber) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    if (params && params->structSize == 0) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    int rc = MVZ_CUPTI_SUCCESS;
    pthread_mutex_lock(&g_mu);
    if (g_subscribe_error) {
        rc = g_subscribe_error;
    } else if (g_conflict && !(g_conflict_shares && wants_to_share(params))) {
        /* e.g. launched under Nsight Systems */
        rc = MVZ_CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
        write_holder(params, g_conflict);
    } else if (g_subscribed) { /* CUPTI allows one subscriber per process */
        rc = MVZ_CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED;
        write_holder(params, g_sub_name);
    } else {
        g_subscribed = 1;
        g_cb = callback;
        g_userdata = userdata;
        g_sub_gen++;
        /* Real CUPTI names a subscriber "CUPTI for <name>" (name <= 53 bytes). */
        const char *n = params && params->subscriberName ? params->subscriberName : NULL;
        if (n) snprintf(g_sub_name, sizeof g_sub_name, "CUPTI for %.53s", n);
        else snprintf(g_sub_name, sizeof g_sub_name, "CUPTI");
        *subscriber = &g_handles[g_sub_gen % sizeof g_handles];
        if (g_conflict) /* multi-subscriber mode: the first subscriber's name */
            write_holder(params, g_conflict);
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

API int cuptiSubscribe(mvz_CUpti_SubscriberHandle *subscriber, mvz_CUpti_CallbackFunc callback,
                       void *userdata) {
    return cuptiSubscribe_v2(subscriber, callback, userdata, NULL);
}

/* Caller holds g_mu. */
static int valid_handle(mvz_CUpti_SubscriberHandle h) {
    return g_subscribed && h == (void *)&g_handles[g_sub_gen % sizeof g_handles];
}

/* Caller holds g_mu. Enable state belongs to the subscriber, so it goes too. */
static void drop_subscriber(void) {
    g_subscribed = 0;
    g_cb = NULL;
    g_userdata = NULL;
    clear_enabled();
}

API int cuptiUnsubscribe(mvz_CUpti_SubscriberHandle subscriber) {
    pthread_mutex_lock(&g_mu);
    int ok = valid_handle(subscriber);
    if (ok) drop_subscriber();
    pthread_mutex_unlock(&g_mu);
    return ok ? MVZ_CUPTI_SUCCESS : MVZ_CUPTI_ERROR_INVALID_PARAMETER;
}

static int set_enabled(uint32_t enable, mvz_CUpti_SubscriberHandle sub, int domain, int lo,
                       int hi) {
    if (domain <= 0 || domain >= MAX_DOMAIN) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&g_mu);
    int ok = valid_handle(sub);
    if (ok)
        for (int c = lo; c < hi; c++) atomic_store(&g_enabled[domain][c], enable ? 1 : 0);
    pthread_mutex_unlock(&g_mu);
    return ok ? MVZ_CUPTI_SUCCESS : MVZ_CUPTI_ERROR_INVALID_PARAMETER;
}

API int cuptiEnableCallback(uint32_t enable, mvz_CUpti_SubscriberHandle subscriber, int domain,
                            uint32_t cbid) {
    if (cbid == 0 || cbid >= MAX_CBID) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    return set_enabled(enable, subscriber, domain, (int)cbid, (int)cbid + 1);
}

/* memviz must enable individual memory callbacks only; these two are counted
 * so tests can assert that, but otherwise behave like the real thing. */
API int cuptiEnableDomain(uint32_t enable, mvz_CUpti_SubscriberHandle subscriber, int domain) {
    atomic_fetch_add(&g_domain_calls, 1);
    return set_enabled(enable, subscriber, domain, 1, MAX_CBID);
}

API int cuptiEnableAllDomains(uint32_t enable, mvz_CUpti_SubscriberHandle subscriber) {
    atomic_fetch_add(&g_domain_calls, 1);
    int rc = MVZ_CUPTI_SUCCESS;
    for (int d = 1; d < MAX_DOMAIN && rc == MVZ_CUPTI_SUCCESS; d++)
        rc = set_enabled(enable, subscriber, d, 1, MAX_CBID);
    return rc;
}

/* ---- firing driver callbacks ------------------------------------------- */

typedef struct {
    uint32_t cbid;
    int device;
    mvz_CUresult ret;
    uint64_t corr_data; /* the same object at ENTER and EXIT, as in CUPTI */
    mvz_CUpti_CallbackData cbd;
} call_t;

static void fire(call_t *c, int site) {
    if (!atomic_load(&g_enabled[MVZ_CUPTI_CB_DOMAIN_DRIVER_API][c->cbid])) return;
    pthread_mutex_lock(&g_mu); /* snapshot only; the callback runs unlocked */
    mvz_CUpti_CallbackFunc cb = g_subscribed ? g_cb : NULL;
    void *ud = g_userdata;
    pthread_mutex_unlock(&g_mu);
    if (!cb) return;
    c->cbd.callbackSite = site;
    atomic_fetch_add(&g_callback_count, 1);
    cb(ud, MVZ_CUPTI_CB_DOMAIN_DRIVER_API, c->cbid, &c->cbd);
}

static void call_enter(call_t *c, int cbid, const char *name, const void *params) {
    memset(c, 0, sizeof *c);
    c->cbid = (uint32_t)cbid;
    c->device = current_device();
    c->cbd.functionName = name;
    c->cbd.functionParams = params;
    c->cbd.functionReturnValue = &c->ret;
    c->cbd.context = (mvz_CUcontext)(uintptr_t)(CTX_BASE + (unsigned)c->device);
    c->cbd.contextUid = (uint32_t)c->device + 1;
    c->cbd.correlationData = &c->corr_data;
    c->cbd.correlationId = atomic_fetch_add(&g_correlation, 1) + 1;
    tl_last_corr = c->cbd.correlationId;
    fire(c, MVZ_CUPTI_API_ENTER);
}

static void call_exit(call_t *c, int result) {
    c->ret = result;
    fire(c, MVZ_CUPTI_API_EXIT);
}

/* fake_addresses_like_driver(1), until fake_reset: cuMemAlloc_v2 places
 * memory as the H200's driver was seen to (the what-if tests; whatif_va.h):
 * a request that fits no hole starts a new region below all others, its
 * size rounded up to 32 MiB; else it takes the hole at the lowest address
 * that holds it; cuMemFree_v2 gives the range back. Below ADDR_BASE, so it
 * never meets the default's addresses (which are never reused). */
#define DRV_REGION (32ull << 20)
#define DRV_MAX 4096
static atomic_int g_like_driver;
static pthread_mutex_t g_drv_mu = PTHREAD_MUTEX_INITIALIZER;
static struct { uint64_t base, end; } g_holes[DRV_MAX], g_taken[DRV_MAX];
static size_t g_nholes, g_ntaken;
#define DRV_TOP (ADDR_BASE - (1ull << 40))
static uint64_t g_drv_bottom = DRV_TOP;

/* Each call starts the driver afresh. */
API void fake_addresses_like_driver(int on) {
    pthread_mutex_lock(&g_drv_mu);
    g_nholes = g_ntaken = 0;
    g_drv_bottom = DRV_TOP;
    atomic_store(&g_like_driver, on);
    pthread_mutex_unlock(&g_drv_mu);
}

static void drv_hole(uint64_t base, uint64_t end) { /* kept by address; neighbours merged */
    size_t i = 0;
    while (i < g_nholes && g_holes[i].base < base) i++;
    if (i > 0 && g_holes[i - 1].end == base) {
        g_holes[i - 1].end = end;
        if (i < g_nholes && g_holes[i].base == end) {
            g_holes[i - 1].end = g_holes[i].end;
            memmove(g_holes + i, g_holes + i + 1, (g_nholes - i - 1) * sizeof g_holes[0]);
            g_nholes--;
        }
        return;
    }
    if (i < g_nholes && g_holes[i].base == end) {
        g_holes[i].base = base;
        return;
    }
    if (g_nholes == DRV_MAX) abort();
    memmove(g_holes + i + 1, g_holes + i, (g_nholes - i) * sizeof g_holes[0]);
    g_holes[i].base = base;
    g_holes[i].end = end;
    g_nholes++;
}

static uint64_t drv_alloc(uint64_t size) {
    pthread_mutex_lock(&g_drv_mu);
    uint64_t base = 0;
    for (size_t i = 0; i < g_nholes && !base; i++)
        if (g_holes[i].end - g_holes[i].base >= size) {
            base = g_holes[i].base;
            g_holes[i].base += size;
            if (g_holes[i].base == g_holes[i].end) {
                memmove(g_holes + i, g_holes + i + 1, (g_nholes - i - 1) * sizeof g_holes[0]);
                g_nholes--;
            }
        }
    if (!base) {
        uint64_t span = (size + DRV_REGION - 1) / DRV_REGION * DRV_REGION;
        g_drv_bottom = g_drv_bottom / DRV_REGION * DRV_REGION - span;
        base = g_drv_bottom;
        if (span > size) drv_hole(base + size, base + span);
    }
    if (g_ntaken == DRV_MAX) abort();
    g_taken[g_ntaken].base = base;
    g_taken[g_ntaken++].end = base + size;
    pthread_mutex_unlock(&g_drv_mu);
    return base;
}

static void drv_free(uint64_t address) {
    pthread_mutex_lock(&g_drv_mu);
    for (size_t i = 0; i < g_ntaken; i++)
        if (g_taken[i].base == address) {
            drv_hole(address, g_taken[i].end);
            g_taken[i] = g_taken[--g_ntaken];
            break;
        }
    pthread_mutex_unlock(&g_drv_mu);
}

/* Unique, 256-byte aligned, and spaced so fake ranges never touch. */
static uint64_t next_addr(int cbid, uint64_t size) {
    if (cbid == MVZ_CBID_cuMemAlloc_v2 && atomic_load(&g_like_driver))
        return drv_alloc(size);
    uint64_t step = ((size + 255) & ~(uint64_t)255) + 256;
    return atomic_fetch_add(&g_next_addr, step);
}

/* functionName as real CUPTI reports it: the driver entry point's name. */
static const char *cbid_name(int cbid) {
#define N(x) case MVZ_CBID_##x: return #x;
    switch (cbid) {
    N(cuMemAlloc_v2) N(cuMemAllocPitch_v2) N(cuMemAllocAsync) N(cuMemAllocAsync_ptsz)
    N(cuMemAllocFromPoolAsync) N(cuMemAllocFromPoolAsync_ptsz) N(cuMemAllocManaged)
    N(cuMemHostAlloc) N(cuMemAllocHost_v2) N(cuMemCreate) N(cuMemAddressReserve)
    N(cuMemFree_v2) N(cuMemFreeAsync) N(cuMemFreeAsync_ptsz) N(cuMemFreeHost) N(cuMemRelease)
    N(cuMemAddressFree) N(cuMemMap) N(cuMemUnmap) N(cuMemPoolTrimTo)
    default: return NULL;
    }
#undef N
}

static void bad_cbid(const char *fn, int cbid) {
    fprintf(stderr, "fake_cupti: %s: unsupported cbid %d\n", fn, cbid);
}

/* Minimal CUmemAllocationProp (cuda.h 13.0) so cuMemCreate's prop is real. */
typedef struct {
    int type, requestedHandleTypes, locationType, locationId;
    void *win32HandleMetaData;
    unsigned char compressionType, gpuDirectRDMACapable, usage[2], reserved[4];
} fake_alloc_prop;

API void fake_set_device(int device) {
    tl_device = device;
    tl_device_epoch = atomic_load(&g_epoch);
}

static _Thread_local uint64_t tl_forced_addr; /* fake_alloc_at: next address to hand out */

API uint64_t fake_alloc(int cbid, uint64_t size, uint64_t stream, int result) {
    union {
        mvz_cuMemAlloc_v2_params alloc;
        mvz_cuMemAllocPitch_v2_params pitch;
        mvz_cuMemAllocAsync_params async;
        mvz_cuMemAllocFromPoolAsync_params pool;
        mvz_cuMemAllocManaged_params managed;
        mvz_cuMemHostAlloc_params host_alloc;
        mvz_cuMemAllocHost_v2_params host;
        mvz_cuMemCreate_params create;
        mvz_cuMemAddressReserve_params reserve;
    } p;
    memset(&p, 0, sizeof p);
    uint64_t out = 0;  /* CUdeviceptr / handle out-parameter */
    void *host = NULL; /* void* out-parameter of the host allocators */
    size_t pitch = 0;
    void *hs = (void *)(uintptr_t)stream;
    fake_alloc_prop prop = {1 /* PINNED */, 0, 1 /* LOCATION_DEVICE */, current_device(), NULL,
                            0, 0, {0}, {0}};
    switch (cbid) {
    case MVZ_CBID_cuMemAlloc_v2: p.alloc = (mvz_cuMemAlloc_v2_params){&out, size}; break;
    case MVZ_CBID_cuMemAllocPitch_v2:
        p.pitch = (mvz_cuMemAllocPitch_v2_params){&out, &pitch, size, 1, 4};
        break;
    case MVZ_CBID_cuMemAllocAsync:
    case MVZ_CBID_cuMemAllocAsync_ptsz:
        p.async = (mvz_cuMemAllocAsync_params){&out, size, hs};
        break;
    case MVZ_CBID_cuMemAllocFromPoolAsync:
    case MVZ_CBID_cuMemAllocFromPoolAsync_ptsz:
        p.pool = (mvz_cuMemAllocFromPoolAsync_params){&out, size, FAKE_POOL, hs};
        break;
    case MVZ_CBID_cuMemAllocManaged: /* flags: CU_MEM_ATTACH_GLOBAL */
        p.managed = (mvz_cuMemAllocManaged_params){&out, size, 1};
        break;
    case MVZ_CBID_cuMemHostAlloc: p.host_alloc = (mvz_cuMemHostAlloc_params){&host, size, 0}; break;
    case MVZ_CBID_cuMemAllocHost_v2: p.host = (mvz_cuMemAllocHost_v2_params){&host, size}; break;
    case MVZ_CBID_cuMemCreate: p.create = (mvz_cuMemCreate_params){&out, size, &prop, 0}; break;
    case MVZ_CBID_cuMemAddressReserve:
        p.reserve = (mvz_cuMemAddressReserve_params){&out, size, 0, 0, 0};
        break;
    default: bad_cbid("fake_alloc", cbid); return 0;
    }
    call_t c;
    call_enter(&c, cbid, cbid_name(cbid), &p);
    uint64_t addr = 0;
    if (result == 0) { /* the driver writes its outputs only on success */
        addr = tl_forced_addr ? tl_forced_addr : next_addr(cbid, size);
        tl_forced_addr = 0;
        out = addr;
        host = (void *)(uintptr_t)addr;
        pitch = (size_t)size;
    }
    call_exit(&c, result);
    return addr;
}

/* Like fake_alloc, but the "driver" returns `address` (e.g. a CPU tensor's
 * storage pointer, so tests can tie fake allocations to real tensors). */
API uint64_t fake_alloc_at(int cbid, uint64_t address, uint64_t size) {
    tl_forced_addr = address;
    uint64_t got = fake_alloc(cbid, size, 0, 0);
    tl_forced_addr = 0;
    return got;
}

API void fake_free(int cbid, uint64_t address, uint64_t stream, int result) {
    union {
        mvz_cuMemFree_v2_params free;
        mvz_cuMemFreeAsync_params async;
        mvz_cuMemFreeHost_params host;
        mvz_cuMemRelease_params release;
        mvz_cuMemAddressFree_params addr;
    } p;
    memset(&p, 0, sizeof p);
    void *hs = (void *)(uintptr_t)stream;
    switch (cbid) {
    case MVZ_CBID_cuMemFree_v2: p.free.dptr = address; break;
    case MVZ_CBID_cuMemFreeAsync:
    case MVZ_CBID_cuMemFreeAsync_ptsz: p.async = (mvz_cuMemFreeAsync_params){address, hs}; break;
    case MVZ_CBID_cuMemFreeHost: p.host.p = (void *)(uintptr_t)address; break;
    case MVZ_CBID_cuMemRelease: p.release.handle = address; break;
    case MVZ_CBID_cuMemAddressFree: p.addr = (mvz_cuMemAddressFree_params){address, 0}; break;
    default: bad_cbid("fake_free", cbid); return;
    }
    call_t c;
    call_enter(&c, cbid, cbid_name(cbid), &p);
    if (cbid == MVZ_CBID_cuMemFree_v2 && result == 0 && atomic_load(&g_like_driver))
        drv_free(address);
    call_exit(&c, result);
}

API void fake_map(int cbid, uint64_t ptr, uint64_t size, uint64_t handle) {
    mvz_cuMemMap_params map = {ptr, (size_t)size, 0, handle, 0};
    mvz_cuMemUnmap_params unmap = {ptr, (size_t)size};
    if (cbid != MVZ_CBID_cuMemMap && cbid != MVZ_CBID_cuMemUnmap) {
        bad_cbid("fake_map", cbid);
        return;
    }
    call_t c;
    call_enter(&c, cbid, cbid_name(cbid), cbid == MVZ_CBID_cuMemMap ? (void *)&map : &unmap);
    call_exit(&c, 0);
}

API void fake_pool_trim(uint64_t pool, uint64_t min_keep) {
    mvz_cuMemPoolTrimTo_params p = {(void *)(uintptr_t)pool, (size_t)min_keep};
    call_t c;
    call_enter(&c, MVZ_CBID_cuMemPoolTrimTo, cbid_name(MVZ_CBID_cuMemPoolTrimTo), &p);
    call_exit(&c, 0);
}

/* ---- native threads ---------------------------------------------------- */

typedef struct {
    int cbid, device, per_thread;
    uint64_t size, result;
    const char *name;
    void (*before)(void); /* runs on the new thread first (e.g. Python via ctypes) */
} thread_arg;

static void *one_alloc_thread(void *a) {
    thread_arg *t = a;
    if (t->name && *t->name) {
        char n[16]; /* Linux thread names are limited to 15 bytes */
        snprintf(n, sizeof n, "%s", t->name);
        pthread_setname_np(pthread_self(), n);
    }
    if (t->before)
        t->before();
    fake_set_device(t->device);
    t->result = fake_alloc(t->cbid, t->size, 0, 0);
    return NULL;
}

API uint64_t fake_alloc_in_native_thread(int cbid, uint64_t size, int device,
                                         const char *thread_name) {
    thread_arg t = {cbid, device, 1, size, 0, thread_name, NULL};
    pthread_t th;
    if (pthread_create(&th, NULL, one_alloc_thread, &t) != 0) return 0;
    pthread_join(th, NULL);
    return t.result;
}

/* Like fake_alloc_in_native_thread, but the thread first calls `before`
 * (a ctypes callback: Python runs on that thread, then leaves it with no
 * frames), as autograd's engine thread runs Python hooks between C++ work. */
API uint64_t fake_alloc_in_native_thread_after(void (*before)(void), int cbid, uint64_t size,
                                               int device, const char *thread_name) {
    thread_arg t = {cbid, device, 1, size, 0, thread_name, before};
    pthread_t th;
    if (pthread_create(&th, NULL, one_alloc_thread, &t) != 0) return 0;
    pthread_join(th, NULL);
    return t.result;
}

/* n alloc+free pairs from the calling thread, timed inside C: the capture
 * cost per event without ctypes in the loop (benchmarks). Returns ns. */
static uint64_t alloc_free_loop_on(clockid_t clock, int cbid_alloc, int cbid_free, uint64_t n,
                                   uint64_t size) {
    struct timespec a, b;
    clock_gettime(clock, &a);
    for (uint64_t i = 0; i < n; i++)
        fake_free(cbid_free, fake_alloc(cbid_alloc, size, 0, 0), 0, 0);
    clock_gettime(clock, &b);
    return (uint64_t)(b.tv_sec - a.tv_sec) * 1000000000ull + (uint64_t)(b.tv_nsec - a.tv_nsec);
}

API uint64_t fake_alloc_free_loop(int cbid_alloc, int cbid_free, uint64_t n, uint64_t size) {
    return alloc_free_loop_on(CLOCK_MONOTONIC, cbid_alloc, cbid_free, n, size);
}

/* As fake_alloc_free_loop, timed in the calling thread's CPU time: on a
 * shared machine, time spent descheduled does not count (benchmarks). */
API uint64_t fake_alloc_free_loop_cpu(int cbid_alloc, int cbid_free, uint64_t n, uint64_t size) {
    return alloc_free_loop_on(CLOCK_THREAD_CPUTIME_ID, cbid_alloc, cbid_free, n, size);
}

/* As fake_alloc_free_loop_cpu, with `gap` bytes of a buffer of the double's
 * own written between one event and the next (a line of every 64 bytes),
 * as a real operation's work between two allocations would: the capture
 * path then finds its own lines evicted, as inside a step (benchmarks). The
 * writes are timed too; the caller subtracts the untracked loop's time. */
static volatile unsigned char *gap_buf;
static uint64_t gap_len;
static inline void gap_touch(uint64_t gap, uint64_t i) {
    for (uint64_t k = 0; k < gap; k += 64)
        gap_buf[k] = (unsigned char)(i + k);
}
API uint64_t fake_alloc_free_loop_gap_cpu(int cbid_alloc, int cbid_free, uint64_t n,
                                          uint64_t size, uint64_t gap) {
    if (gap > gap_len) {
        free((void *)gap_buf);
        gap_buf = calloc(1, gap);
        gap_len = gap_buf ? gap : 0;
        if (!gap_buf) return 0;
    }
    struct timespec a, b;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t addr = fake_alloc(cbid_alloc, size, 0, 0);
        gap_touch(gap, i);
        fake_free(cbid_free, addr, 0, 0);
        gap_touch(gap, i + 1);
    }
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    return (uint64_t)(b.tv_sec - a.tv_sec) * 1000000000ull + (uint64_t)(b.tv_nsec - a.tv_nsec);
}

/* n allocations kept live, from the caller's one Python line: a store of
 * millions of live allocations in seconds (benchmarks/bench_scale.py). */
API uint64_t fake_alloc_loop(int cbid, uint64_t n, uint64_t size) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (uint64_t i = 0; i < n; i++)
        fake_alloc(cbid, size, 0, 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (uint64_t)(b.tv_sec - a.tv_sec) * 1000000000ull + (uint64_t)(b.tv_nsec - a.tv_nsec);
}

static void *stress_thread(void *a) {
    thread_arg *t = a;
    fake_set_device(t->device);
    for (int i = 0; i < t->per_thread; i++) {
        uint64_t addr = fake_alloc(MVZ_CBID_cuMemAlloc_v2, t->size, 0, 0);
        if (!addr) t->result = 1;
        fake_free(MVZ_CBID_cuMemFree_v2, addr, 0, 0);
    }
    return NULL;
}

API int fake_alloc_many_in_native_threads(int nthreads, int per_thread, uint64_t size) {
    if (nthreads <= 0 || per_thread < 0) return -1;
    pthread_t *th = calloc((size_t)nthreads, sizeof *th);
    thread_arg *args = calloc((size_t)nthreads, sizeof *args);
    int rc = (th && args) ? 0 : -1, started = 0;
    for (; rc == 0 && started < nthreads; started++) {
        args[started] = (thread_arg){MVZ_CBID_cuMemAlloc_v2, 0, per_thread, size, 0, NULL, NULL};
        if (pthread_create(&th[started], NULL, stress_thread, &args[started]) != 0) {
            rc = -1;
            break;
        }
    }
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        if (args[i].result) rc = -1;
    }
    free(th);
    free(args);
    return rc;
}

/* ---- activity API ------------------------------------------------------ */

static size_t record_size(int kind) {
    if (kind != MVZ_CUPTI_ACTIVITY_KIND_MEMORY2) return 0;
    return atomic_load(&g_version) < MVZ_CUPTI_VERSION_13 ? sizeof(mvz_CUpti_ActivityMemory3)
                                                          : sizeof(mvz_CUpti_ActivityMemory4);
}

API int cuptiActivityRegisterCallbacks(mvz_BuffersCallbackRequestFunc request,
                                       mvz_BuffersCallbackCompleteFunc complete) {
    if (!request || !complete) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&g_mu);
    g_req = request;
    atomic_store(&g_req_set, request != NULL);
    g_done = complete;
    pthread_mutex_unlock(&g_mu);
    return MVZ_CUPTI_SUCCESS;
}

static int set_activity(int kind, int on) {
    if (kind <= 0 || kind >= MAX_KIND) return ERR_INVALID_KIND;
    atomic_store(&g_activity[kind], (unsigned char)on);
    return MVZ_CUPTI_SUCCESS;
}
API int cuptiActivityEnable(int kind) { return set_activity(kind, 1); }
API int cuptiActivityDisable(int kind) { return set_activity(kind, 0); }

API int cuptiActivityGetNumDroppedRecords(mvz_CUcontext ctx, uint32_t stream, size_t *dropped) {
    (void)ctx, (void)stream; /* the fake has one global count */
    if (!dropped) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    pthread_mutex_lock(&g_mu);
    *dropped = g_dropped;
    pthread_mutex_unlock(&g_mu);
    return MVZ_CUPTI_SUCCESS;
}

static void layout(const pending_t *r, uint8_t *dst, size_t size) {
    mvz_CUpti_ActivityMemory4 m;
    memset(&m, 0, sizeof m);
    m.base.kind = MVZ_CUPTI_ACTIVITY_KIND_MEMORY2;
    m.base.memoryOperationType = r->op;
    m.base.memoryKind = r->memkind;
    m.base.correlationId = r->corr;
    m.base.address = r->address;
    m.base.bytes = r->bytes;
    m.base.timestamp = r->timestamp;
    m.base.processId = (uint32_t)getpid();
    m.base.deviceId = r->device;
    m.base.contextId = r->device + 1;
    m.base.name = r->name;
    m.source = r->source; /* cut off below for the 12.x (Memory3) layout */
    memcpy(dst, &m, size);
}

/* Hands every queued record to the client's buffers, as many per buffer as
 * fit; the buffer callbacks run with no lock held. */
API int cuptiActivityFlushAll(uint32_t flag) {
    (void)flag; /* every fake record is complete, so forced == default */
    if (atomic_load(&g_req_set) && !atomic_load(&g_queued_any))
        return MVZ_CUPTI_SUCCESS; /* nothing queued */
    pthread_mutex_lock(&g_mu);
    mvz_BuffersCallbackRequestFunc req = g_req;
    mvz_BuffersCallbackCompleteFunc done = g_done;
    pending_t *q = g_queue;
    size_t n = g_queue_len;
    if (req) {
        g_queue = NULL;
        g_queue_len = g_queue_cap = 0;
        atomic_store(&g_queued_any, 0);
    }
    pthread_mutex_unlock(&g_mu);
    if (!req) return ERR_INVALID_OPERATION; /* documented: needs RegisterCallbacks */
    size_t rsize = record_size(MVZ_CUPTI_ACTIVITY_KIND_MEMORY2), i = 0;
    while (i < n) {
        uint8_t *buf = NULL;
        size_t size = 0, max_records = 0;
        req(&buf, &size, &max_records);
        size_t fit = buf ? size / rsize : 0;
        if (max_records && fit > max_records) fit = max_records;
        if (fit == 0) { /* no usable buffer: CUPTI drops the records */
            pthread_mutex_lock(&g_mu);
            g_dropped += n - i;
            pthread_mutex_unlock(&g_mu);
            if (buf) done(NULL, 0, buf, size, 0);
            break;
        }
        size_t k = 0;
        for (; k < fit && i < n; k++, i++) layout(&q[i], buf + k * rsize, rsize);
        done(NULL, 0, buf, size, k * rsize); /* context NULL: global buffers */
    }
    free(q);
    return MVZ_CUPTI_SUCCESS;
}

/* Real CUPTI ends iteration with MAX_LIMIT_REACHED (not QUEUE_EMPTY). */
API int cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, mvz_CUpti_Activity **record) {
    if (!buffer || !record) return MVZ_CUPTI_ERROR_INVALID_PARAMETER;
    size_t off = 0;
    if (*record) {
        size_t cur = record_size((*record)->kind);
        if (!cur) return ERR_INVALID_KIND;
        off = (size_t)((uint8_t *)*record - buffer) + cur;
    }
    if (off + sizeof(mvz_CUpti_Activity) > valid) return MVZ_CUPTI_ERROR_MAX_LIMIT_REACHED;
    mvz_CUpti_Activity *next = (mvz_CUpti_Activity *)(buffer + off);
    size_t size = record_size(next->kind);
    if (!size || off + size > valid) return ERR_INVALID_KIND; /* invalid or incomplete */
    *record = next;
    return MVZ_CUPTI_SUCCESS;
}

/* Caller holds g_mu. Returns a copy that lives until fake_reset. */
static const char *keep_string(const char *s) {
    if (!s) return NULL;
    char *d = strdup(s);
    if (!d || grow((void **)&g_strings, &g_strings_cap, g_strings_len + 1, sizeof *g_strings)) {
        free(d);
        return NULL;
    }
    g_strings[g_strings_len++] = d;
    return d;
}

API void fake_emit_memory2(int op, int memkind, uint64_t address, uint64_t bytes, uint32_t device,
                           uint64_t timestamp, const char *name, const char *source) {
    if (!atomic_load(&g_activity[MVZ_CUPTI_ACTIVITY_KIND_MEMORY2])) return;
    if (timestamp == 0) cuptiGetTimestamp(&timestamp); /* 0 = "now" */
    pthread_mutex_lock(&g_mu);
    if (grow((void **)&g_queue, &g_queue_cap, g_queue_len + 1, sizeof *g_queue) == 0) {
        /* correlate with the last fake driver call on this thread, if any */
        g_queue[g_queue_len++] = (pending_t){op, memkind, tl_last_corr, device, address, bytes,
                                             timestamp, keep_string(name), keep_string(source)};
        atomic_store(&g_queued_any, 1);
    }
    pthread_mutex_unlock(&g_mu);
}

/* ---- control API ------------------------------------------------------- */

API void fake_reset(void) {
    pthread_mutex_lock(&g_mu);
    fake_addresses_like_driver(0);
    drop_subscriber();
    g_sub_name[0] = '\0';
    free(g_conflict);
    g_conflict = NULL;
    g_conflict_shares = 0;
    g_subscribe_error = 0;
    g_req = NULL;
    atomic_store(&g_req_set, 0);
    g_done = NULL;
    g_dropped = 0;
    free(g_queue);
    g_queue = NULL;
    g_queue_len = g_queue_cap = 0;
    for (size_t i = 0; i < g_strings_len; i++) free(g_strings[i]);
    free(g_strings);
    g_strings = NULL;
    g_strings_len = g_strings_cap = 0;
    for (int k = 0; k < MAX_KIND; k++) atomic_store(&g_activity[k], 0);
    atomic_store(&g_version, DEFAULT_VERSION);
    atomic_store(&g_callback_count, 0);
    atomic_store(&g_domain_calls, 0);
    atomic_fetch_add(&g_epoch, 1); /* every thread's device reads as 0 again */
    pthread_mutex_unlock(&g_mu);
    tl_last_corr = 0;
}

API void fake_set_version(uint32_t v) { atomic_store(&g_version, v); }

API void fake_set_conflict_sharing(const char *holder, int shares) {
    char *copy = holder ? strdup(holder) : NULL;
    pthread_mutex_lock(&g_mu);
    free(g_conflict);
    g_conflict = copy;
    g_conflict_shares = shares;
    pthread_mutex_unlock(&g_mu);
}

API void fake_set_conflict(const char *holder) { fake_set_conflict_sharing(holder, 0); }

/* Another tool subscribes now (torch.profiler after memviz): as CUPTI, it
 * is refused while a subscriber holds CUPTI, unless both share. Returns 1
 * when it got CUPTI (it then holds it, as fake_set_conflict's holder). */
API int fake_other_tool_subscribes(const char *name, int shares) {
    pthread_mutex_lock(&g_mu);
    int ok = !g_conflict && (!g_subscribed || (shares && atomic_load(&g_version) >= MVZ_CUPTI_MULTI_SUBSCRIBER_VERSION));
    pthread_mutex_unlock(&g_mu);
    if (ok) fake_set_conflict_sharing(name, shares);
    return ok;
}

API void fake_set_subscribe_error(int code) { atomic_store(&g_subscribe_error, code); }

API int fake_is_subscribed(void) { return atomic_load(&g_subscribed); }

API int fake_is_enabled(int domain, int cbid) {
    if (domain < 0 || domain >= MAX_DOMAIN || cbid < 0 || cbid >= MAX_CBID) return 0;
    return atomic_load(&g_enabled[domain][cbid]);
}

API int fake_enabled_count(void) {
    int n = 0;
    for (int d = 0; d < MAX_DOMAIN; d++)
        for (int c = 0; c < MAX_CBID; c++) n += atomic_load(&g_enabled[d][c]);
    return n;
}

API int fake_domain_enable_calls(void) { return atomic_load(&g_domain_calls); }

API int fake_activity_enabled(int kind) {
    return kind > 0 && kind < MAX_KIND && atomic_load(&g_activity[kind]);
}

API int fake_callback_count(void) { return atomic_load(&g_callback_count); }
