/* Tensor capture under PyTorch's native CUDA caching allocator.
 *
 * libc10_cuda.so exports `c10::cuda::CUDACachingAllocator::allocator`, an
 * std::atomic<CUDAAllocator*> that every CUDA allocation PyTorch makes reads
 * and then calls through the object's C++ vtable. memviz copies that vtable
 * into memory of its own, points a few of its slots at wrappers, and swaps
 * the object's vptr (one aligned word) to the copy; putting the word back
 * detaches. The wrappers call the real functions, then record with the same
 * capture path as the CUPTI callback (capture.h: mvz_capture_block):
 *
 *   allocate(n)          slot 2 (Itanium ABI: 0 and 1 are the destructors;
 *                        c10::Allocator declares allocate first). Returns a
 *                        DataPtr through a hidden pointer: [data, deleter,
 *                        ctx, device] in some order, found by probing. The
 *                        wrapper records the block and replaces the deleter
 *                        word by memviz's, which records the free and calls
 *                        PyTorch's deleter.
 *   raw_deleter()        slot 4: answers memviz's deleter where PyTorch's
 *                        would answer its own, so code that compares
 *                        deleters (Allocator::raw_deallocate, CUDA-graph
 *                        trees) agrees with the DataPtrs it sees.
 *   recordStream(dp, s)  found by probing: PyTorch ignores a DataPtr whose
 *                        deleter is not its own, so the wrapper hands it a
 *                        copy with PyTorch's deleter (a stream use skipped
 *                        would let a block be reused too early).
 *   raw_alloc_with_stream(n, s), raw_delete(p)
 *                        found by probing: caching_allocator_alloc/delete,
 *                        cuDNN/cuBLAS users of raw memory.
 *
 * Nothing of the layout is assumed: memviz/torch/allocator.py probes every
 * slot and word once per process with tripwires (each slot of the copy can
 * point at a trampoline that counts its calls and jumps to the real entry,
 * leaving every register as it was) and checks the result against PyTorch's
 * own answers before recording anything; where a check fails it detaches
 * and memviz falls back to segments, saying why.
 *
 * Only on x86-64 glibc. The copy and the wrappers live for the process: a
 * thread still inside a wrapper after detach finishes normally.
 */
#ifndef MEMVIZ_ALLOCATOR_H
#define MEMVIZ_ALLOCATOR_H

#include <Python.h>

/* The module's functions for the allocator route (added by module.c). */
extern PyMethodDef mvz_allocator_methods[];

#endif
