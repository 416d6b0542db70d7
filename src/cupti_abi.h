/* The part of the CUPTI ABI that memviz uses, written out by hand.
 *
 * memviz builds with no CUDA headers and loads libcupti at run time, so the
 * constants, parameter structs and record layouts it relies on are declared
 * here. Values and layouts follow NVIDIA's published cupti_callbacks.h,
 * cupti_driver_cbid.h, cupti_activity.h and generated_cuda_meta.h; the test
 * suite checks them against the real headers with static asserts wherever a
 * CUDA toolkit is installed (tests/unit/test_abi.py).
 *
 * The same file is used by the libcupti test double (tests/fake_cupti), so a
 * mistake here would show up against real CUPTI on the GPU test run, not in
 * the CPU tests alone.
 */
#ifndef MEMVIZ_CUPTI_ABI_H
#define MEMVIZ_CUPTI_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef int mvz_CUptiResult;
typedef int mvz_CUresult;
typedef void *mvz_CUcontext;
typedef void *mvz_CUstream;
typedef void *mvz_CUmemoryPool;
typedef void *mvz_CUpti_SubscriberHandle;
typedef uint64_t mvz_CUdeviceptr;
typedef uint64_t mvz_CUmemGenericAllocationHandle;

/* CUptiResult values memviz distinguishes. */
enum {
    MVZ_CUPTI_SUCCESS = 0,
    MVZ_CUPTI_ERROR_INVALID_PARAMETER = 1,
    MVZ_CUPTI_ERROR_NOT_COMPATIBLE = 14,
    MVZ_CUPTI_ERROR_NOT_INITIALIZED = 15,
    MVZ_CUPTI_ERROR_QUEUE_EMPTY = 18,
    MVZ_CUPTI_ERROR_MAX_LIMIT_REACHED = 12,
    MVZ_CUPTI_ERROR_NOT_SUPPORTED = 27,
    MVZ_CUPTI_ERROR_INSUFFICIENT_PRIVILEGES = 35,
    MVZ_CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39,
    MVZ_CUPTI_ERROR_UNKNOWN = 999,
};

/* CUresult values memviz distinguishes. */
enum {
    MVZ_CUDA_SUCCESS = 0,
    MVZ_CUDA_ERROR_OUT_OF_MEMORY = 2,
};

/* CUpti_ApiCallbackSite */
enum { MVZ_CUPTI_API_ENTER = 0, MVZ_CUPTI_API_EXIT = 1 };

/* CUpti_CallbackDomain */
enum { MVZ_CUPTI_CB_DOMAIN_DRIVER_API = 1, MVZ_CUPTI_CB_DOMAIN_RUNTIME_API = 2 };

/* CUpti_driver_api_trace_cbid: only the memory calls memviz subscribes to. */
enum {
    MVZ_CBID_cuMemFreeHost = 38,
    MVZ_CBID_cuMemHostAlloc = 39,
    MVZ_CBID_cuMemAlloc_v2 = 243,
    MVZ_CBID_cuMemAllocPitch_v2 = 244,
    MVZ_CBID_cuMemFree_v2 = 245,
    MVZ_CBID_cuMemAllocHost_v2 = 294,
    MVZ_CBID_cuMemAllocManaged = 371,
    MVZ_CBID_cuMemAddressReserve = 547,
    MVZ_CBID_cuMemAddressFree = 548,
    MVZ_CBID_cuMemCreate = 549,
    MVZ_CBID_cuMemRelease = 550,
    MVZ_CBID_cuMemMap = 551,
    MVZ_CBID_cuMemUnmap = 552,
    MVZ_CBID_cuMemAllocAsync = 598,
    MVZ_CBID_cuMemAllocAsync_ptsz = 599,
    MVZ_CBID_cuMemFreeAsync = 600,
    MVZ_CBID_cuMemFreeAsync_ptsz = 601,
    MVZ_CBID_cuMemPoolTrimTo = 602,
    MVZ_CBID_cuMemAllocFromPoolAsync = 611,
    MVZ_CBID_cuMemAllocFromPoolAsync_ptsz = 612,
};

/* CUpti_CallbackData (driver and runtime API domains). */
typedef struct {
    int callbackSite; /* CUpti_ApiCallbackSite */
    const char *functionName;
    const void *functionParams;
    void *functionReturnValue; /* CUresult* for the driver domain */
    const char *symbolName;
    mvz_CUcontext context;
    uint32_t contextUid;
    uint64_t *correlationData;
    uint32_t correlationId;
} mvz_CUpti_CallbackData;

typedef void (*mvz_CUpti_CallbackFunc)(void *userdata, int domain, uint32_t cbid,
                                       const void *cbdata);

/* CUpti_SubscriberParams (cuptiSubscribe_v2, CUPTI 13.0 and newer). CUPTI
 * reads the fields that structSize covers: the first four in 13.0 and 13.1
 * (MVZ_CUPTI_SUBSCRIBER_PARAMS_V1_SIZE); allowMultipleSubscribers after
 * them in newer releases, honoured for the callback and activity APIs from
 * CUPTI 13.5 (MVZ_CUPTI_MULTI_SUBSCRIBER_VERSION, cuptiGetVersion's number)
 * on recent drivers. memviz passes the longer struct only to a CUPTI of that
 * version or newer. */
typedef struct {
    size_t structSize;
    const char *subscriberName;
    char *oldSubscriberName;
    size_t oldSubscriberSize;
    uint8_t allowMultipleSubscribers;
    uint8_t reserved_[7];
} mvz_CUpti_SubscriberParams;
#define MVZ_CUPTI_SUBSCRIBER_PARAMS_V1_SIZE (offsetof(mvz_CUpti_SubscriberParams, oldSubscriberSize) + sizeof(size_t))
#define MVZ_CUPTI_MULTI_SUBSCRIBER_VERSION 130500u
#define MVZ_CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN 64

/* Driver API parameter structs (generated_cuda_meta.h). */
typedef struct { mvz_CUdeviceptr *dptr; size_t bytesize; } mvz_cuMemAlloc_v2_params;
typedef struct {
    mvz_CUdeviceptr *dptr;
    size_t *pPitch;
    size_t WidthInBytes;
    size_t Height;
    unsigned int ElementSizeBytes;
} mvz_cuMemAllocPitch_v2_params;
typedef struct { mvz_CUdeviceptr dptr; } mvz_cuMemFree_v2_params;
typedef struct { void **pp; size_t bytesize; } mvz_cuMemAllocHost_v2_params;
typedef struct { void *p; } mvz_cuMemFreeHost_params;
typedef struct { void **pp; size_t bytesize; unsigned int Flags; } mvz_cuMemHostAlloc_params;
typedef struct { mvz_CUdeviceptr *dptr; size_t bytesize; unsigned int flags; } mvz_cuMemAllocManaged_params;
typedef struct {
    mvz_CUdeviceptr *ptr;
    size_t size;
    size_t alignment;
    mvz_CUdeviceptr addr;
    unsigned long long flags;
} mvz_cuMemAddressReserve_params;
typedef struct { mvz_CUdeviceptr ptr; size_t size; } mvz_cuMemAddressFree_params;
typedef struct {
    mvz_CUmemGenericAllocationHandle *handle;
    size_t size;
    const void *prop; /* const CUmemAllocationProp* */
    unsigned long long flags;
} mvz_cuMemCreate_params;
typedef struct { mvz_CUmemGenericAllocationHandle handle; } mvz_cuMemRelease_params;
typedef struct {
    mvz_CUdeviceptr ptr;
    size_t size;
    size_t offset;
    mvz_CUmemGenericAllocationHandle handle;
    unsigned long long flags;
} mvz_cuMemMap_params;
typedef struct { mvz_CUdeviceptr ptr; size_t size; } mvz_cuMemUnmap_params;
/* Same layout for the _ptsz forms. */
typedef struct { mvz_CUdeviceptr *dptr; size_t bytesize; mvz_CUstream hStream; } mvz_cuMemAllocAsync_params;
typedef struct { mvz_CUdeviceptr dptr; mvz_CUstream hStream; } mvz_cuMemFreeAsync_params;
typedef struct {
    mvz_CUdeviceptr *dptr;
    size_t bytesize;
    mvz_CUmemoryPool pool;
    mvz_CUstream hStream;
} mvz_cuMemAllocFromPoolAsync_params;
typedef struct { mvz_CUmemoryPool pool; size_t minBytesToKeep; } mvz_cuMemPoolTrimTo_params;

/* Activity API. */
enum {
    MVZ_CUPTI_ACTIVITY_KIND_MEMORY2 = 49,
    MVZ_CUPTI_ACTIVITY_KIND_MEMORY_POOL = 50,
};
enum {
    MVZ_CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_ALLOCATION = 1,
    MVZ_CUPTI_ACTIVITY_MEMORY_OPERATION_TYPE_RELEASE = 2,
};
enum {
    MVZ_CUPTI_ACTIVITY_MEMORY_KIND_UNKNOWN = 0,
    MVZ_CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE = 1,
    MVZ_CUPTI_ACTIVITY_MEMORY_KIND_PINNED = 2,
    MVZ_CUPTI_ACTIVITY_MEMORY_KIND_DEVICE = 3,
    MVZ_CUPTI_ACTIVITY_MEMORY_KIND_ARRAY = 4,
    MVZ_CUPTI_ACTIVITY_MEMORY_KIND_MANAGED = 5,
    MVZ_CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC = 6,
    MVZ_CUPTI_ACTIVITY_MEMORY_KIND_MANAGED_STATIC = 7,
};
#define MVZ_CUPTI_ACTIVITY_FLAG_FLUSH_FORCED 1u

/* The common header of every activity record. */
typedef struct { int kind; } mvz_CUpti_Activity;

/* CUpti_ActivityMemory3 (CUPTI 12.x, MEMORY2 records). CUPTI declares its
 * records with 8-byte packing; on LP64 the natural layout below is the same
 * (the pad fields are the ones CUPTI declares under CUPTILP64). */
typedef struct {
    int kind;                /* CUPTI_ACTIVITY_KIND_MEMORY2 */
    int memoryOperationType; /* CUpti_ActivityMemoryOperationType */
    int memoryKind;          /* CUpti_ActivityMemoryKind */
    uint32_t correlationId;
    uint64_t address;
    uint64_t bytes;
    uint64_t timestamp;
    uint64_t PC;
    uint32_t processId;
    uint32_t deviceId;
    uint32_t contextId;
    uint32_t streamId;
    const char *name;
    uint32_t isAsync;
    uint32_t pad1;
    struct {
        int memoryPoolType;
        uint32_t pad2;
        uint64_t address;
        uint64_t releaseThreshold;
        uint64_t size_or_pid;
        uint64_t utilizedSize;
    } memoryPoolConfig;
} mvz_CUpti_ActivityMemory3;

/* CUpti_ActivityMemory4 (CUPTI 13.0 and newer): Memory3 plus the shared
 * object the allocation came from. */
typedef struct {
    mvz_CUpti_ActivityMemory3 base;
    const char *source;
} mvz_CUpti_ActivityMemory4;

/* cuptiGetVersion values from CUDA 13.0 on have the form 13xxyy. */
#define MVZ_CUPTI_VERSION_13 130000u

typedef void (*mvz_BuffersCallbackRequestFunc)(uint8_t **buffer, size_t *size,
                                               size_t *maxNumRecords);
typedef void (*mvz_BuffersCallbackCompleteFunc)(mvz_CUcontext context, uint32_t streamId,
                                                uint8_t *buffer, size_t size,
                                                size_t validSize);

#endif /* MEMVIZ_CUPTI_ABI_H */
