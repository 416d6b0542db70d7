/* The stand-in CUDA runtime: the cudaMalloc/cudaFree that the stand-in
 * libc10_cuda.so imports, as PyTorch's caching allocator imports the real
 * runtime's for its segments. Each goes to the "driver" (the libcupti test
 * double's fake_alloc/fake_free, so a subscriber sees cuMemAlloc/cuMemFree
 * as it sees PyTorch's). Its symbols carry a version of their own
 * (cudart.map), so the stand-in binds to them even where a real libcudart
 * is in the global scope. memviz wraps the imports without CUPTI
 * (src/interpose.h, MVZ_WRAP_SEGMENTS). */
#include <stddef.h>
#include <stdint.h>

#define CBID_cuMemAlloc_v2 243
#define CBID_cuMemFree_v2 245

typedef uint64_t (*driver_alloc_fn)(int cbid, uint64_t size, uint64_t stream, int result);
typedef void (*driver_free_fn)(int cbid, uint64_t address, uint64_t stream, int result);

static driver_alloc_fn driver_alloc;
static driver_free_fn driver_free;

void standin_rt_init(driver_alloc_fn a, driver_free_fn f)
{
    if (a)
        driver_alloc = a;
    if (f)
        driver_free = f;
}

/* cudaErrorMemoryAllocation (2) when the driver has nothing; 3
 * (cudaErrorInitializationError) before standin_rt_init. */
int cudaMalloc(void **ptr, size_t size)
{
    if (!driver_alloc)
        return 3;
    uint64_t a = driver_alloc(CBID_cuMemAlloc_v2, size, 0, 0);
    *ptr = (void *)(uintptr_t)a;
    return a ? 0 : 2;
}

int cudaFree(void *ptr)
{
    if (!ptr)
        return 0;
    if (!driver_free)
        return 3;
    driver_free(CBID_cuMemFree_v2, (uint64_t)(uintptr_t)ptr, 0, 0);
    return 0;
}
