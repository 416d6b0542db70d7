/* What if: a recording's PyTorch requests replayed through a model of
 * PyTorch's native caching allocator under other settings
 * (c10/cuda/CUDACachingAllocator.cpp, as blocks.h's rules describe it).
 *
 * The model follows the allocator's own steps for each request, in the
 * recorded order, on the recorded stream: round the request
 * (mvz_blocks_rules_round), best fit in its pool (small: up to 1 MiB; large)
 * among the free blocks of its stream, refusing an oversize block (of
 * max_split_size or more) for a smaller request and one of the request plus
 * 20 MiB or more for an oversize request; else, with
 * set_per_process_memory_fraction and garbage_collection_threshold, free
 * the oldest whole free segments of the large pool first; else a new
 * segment (mvz_blocks_rules_segment), and when the card or the fraction refuses
 * it, free oversize cached segments, then every whole free segment
 * (empty_cache: a "flush", the allocator's retry), and try again; a request
 * still refused is the out-of-memory point. A block is split when
 * mvz_blocks_rules_split says so (the allocated part first, the rest free after
 * it), and a freed block merges with its free neighbours. A recorded free
 * of a whole PyTorch segment (empty_cache in the program) frees every whole
 * free segment then.
 *
 * Expandable segments follow PyTorch's ExpandableSegment: one address
 * range per device, pool and stream (unmapped blocks, by address), memory
 * mapped into it in 2 MiB (small pool) or 20 MiB (large pool) granules as a
 * request needs (the lowest unmapped block with room, after a free block
 * where there is one), and every whole free granule unmapped on a flush,
 * leaving holes that later requests map again.
 *
 * Not modelled (the caller says so): CUDA graph private pools, the
 * cudaMallocAsync backend, events of other streams delaying frees (a free
 * is taken at the time recorded), allocator settings changed at run time.
 *
 * Plain C, no Python, no lock: a model belongs to one thread at a time
 * (whatif_pass.h feeds several, GIL released). The free pools are indexed
 * by size class (whatif_pool.h), so a best fit costs the same however many
 * blocks are free. */
#ifndef MEMVIZ_WHATIF_H
#define MEMVIZ_WHATIF_H

#include "blocks.h"

#include <stddef.h>
#include <stdint.h>

#define MVZ_WHATIF_TOP 5 /* lines kept for an out-of-memory point */

/* One setting's allocator and limits. */
typedef struct {
    mvz_rules rules;
    double gc_threshold;     /* garbage_collection_threshold (0: none); only with a fraction */
    uint64_t fraction_limit; /* set_per_process_memory_fraction as bytes; UINT64_MAX: none */
    uint64_t card;           /* the card's memory (cudaMalloc fails past it); UINT64_MAX: none */
} mvz_whatif_settings;

/* What one setting gives on one device. The peak is the moment reserved
 * memory is at its highest and, of those, allocated memory is. */
typedef struct {
    uint64_t reserved_peak, allocated_at_peak, largest_free_at_peak, peak_ts;
    uint64_t allocated_peak, reserved_end, allocated_end;
    uint64_t mallocs, retries, flushes, requests;
    int64_t min_room; /* the card less what was held, at its least (INT64_MAX: no card) */
    int oom; /* 1: some request was refused */
    uint64_t oom_ts, oom_index, oom_requested, oom_rounded, oom_stream, oom_reserved, oom_allocated,
        oom_outside;
    uint32_t oom_stack, oom_label; /* the refused request's stack and label ids */
    /* With no stack (a backward's request, on the autograd engine's
     * thread): the stack of the last request before it that had Python
     * frames, which in a backward is the thread that called backward()
     * (PyTorch's first gradient is asked for there); Python checks it. */
    uint32_t oom_caller;
    uint32_t oom_top_stack[MVZ_WHATIF_TOP];
    uint64_t oom_top_bytes[MVZ_WHATIF_TOP];
} mvz_whatif_result;

typedef struct mvz_whatif mvz_whatif;

/* A model of the allocator with `s`; NULL when memory cannot be had. */
mvz_whatif *mvz_whatif_new(const mvz_whatif_settings *s);
void mvz_whatif_free(mvz_whatif *w);
/* A request of `requested` bytes, the block known as `handle` until its
 * free (the caller's number for it: small and dense, reused once freed),
 * with `outside` bytes held beyond PyTorch on the device then. `hint`,
 * `hint_size`: the segment the recording made or first used for it (0:
 * none);
 * `rec_made`, `rec_freed`: the segments the recording had made (this one
 * included) and freed on the device until then. While the model has made
 * and freed the same segments as the recording, a new one goes at the
 * recorded address: the driver, asked the same, answers the same, and
 * PyTorch's best fit breaks ties by address. 0, or -1 out of memory (of
 * the host). */
int mvz_whatif_alloc(mvz_whatif *w, int slot, uint32_t handle, uint64_t requested, uint64_t stream,
                     uint32_t stack, uint32_t label, uint32_t caller, uint64_t ts, uint64_t index,
                     uint64_t outside, uint64_t hint, uint64_t hint_size, uint32_t rec_made,
                     uint32_t rec_freed);
/* The free of the block known as `handle` (unknown: nothing). */
void mvz_whatif_release(mvz_whatif *w, uint32_t handle);
/* torch.cuda.empty_cache(): every whole free segment goes. */
void mvz_whatif_empty_cache(mvz_whatif *w, int slot);
/* The figures of `slot` (0 when it saw nothing). */
void mvz_whatif_result_of(const mvz_whatif *w, int slot, mvz_whatif_result *out);
/* Whether `slot` saw a request. */
int mvz_whatif_used(const mvz_whatif *w, int slot);
/* Whether the model ran out of host memory (its figures are then cut short). */
int mvz_whatif_failed(const mvz_whatif *w);

#endif
