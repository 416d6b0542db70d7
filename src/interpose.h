/* Precise mode's fast path: PyTorch's stream-ordered allocator calls seen at
 * the call site instead of through CUPTI.
 *
 * In precise mode every tensor is a cudaMallocAsync/cudaFreeAsync call from
 * libc10_cuda.so. CUPTI calls a subscriber at the entry and the exit of each,
 * and that dispatch (about 1 us a callback on the H200 host, measured with
 * the callback a no-op: benchmarks/RESULTS.md) is most of precise mode's
 * cost. So memviz points that library's GOT slots for the two functions at
 * its own wrappers, which call the real function and record the result with
 * the same capture path as the CUPTI callback, and switches CUPTI's
 * callbacks for the plain cuMemAllocAsync/cuMemFreeAsync off. Everything
 * else (other cbids, other libraries' calls) still comes through CUPTI;
 * what is lost is the plain stream-ordered calls of *other* libraries while
 * precise mode runs (documented in the README).
 *
 * Only on x86-64 glibc; detach puts back exactly the values found. */
#ifndef MEMVIZ_INTERPOSE_H
#define MEMVIZ_INTERPOSE_H

#include <stddef.h>

/* The sets of functions wrapped, each attached and detached on its own:
 *   MVZ_WRAP_ASYNC     cudaMallocAsync/cudaFreeAsync (precise mode, above);
 *   MVZ_WRAP_SEGMENTS  cudaMalloc/cudaFree: the caching allocator's
 *                      segments, recorded only while CUPTI is not held
 *                      (track(cupti=False), or CUPTI held by another tool:
 *                      capture.h, mvz_capture_segment). */
enum { MVZ_WRAP_ASYNC, MVZ_WRAP_SEGMENTS, MVZ_WRAP_SETS };

/* With the GIL: patch the loaded library whose path ends with `suffix` (it
 * must import one of the set's two functions; several libraries may be
 * wrapped). Returns the number of GOT slots patched (0: nothing done, the
 * reason in err). */
int mvz_interpose_attach(const char *suffix, int set, char *err, size_t errlen);

/* Whether any library is wrapped for `set`. */
int mvz_interpose_attached(int set);

/* With the GIL: put every slot patched for `set` back. */
void mvz_interpose_detach(int set);

#endif
