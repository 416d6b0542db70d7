/* The store's interned stacks: each distinct sequence of frames once, with
 * per-stack aggregates (live bytes and count, peak, allocations, step marks).
 *
 * The table (mvz_stacks) is the store's: store.c owns it and calls every
 * function here with its lock held; this file takes no lock and calls only
 * region.c. On the capture path (no GIL) only mvz_stacks_intern runs: a
 * hash probe and copies into preallocated regions. */
#ifndef MEMVIZ_STACKS_H
#define MEMVIZ_STACKS_H

#include "region.h"
#include "record.h"
#include "types.h"

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t hash;
    uint32_t first_frame;
    uint16_t depth;
    uint16_t adopted; /* its code objects are referenced by memviz */
    uint64_t live_bytes, peak_bytes, alloc_count, alloc_bytes;
    uint32_t live_count, mark_count;
    uint64_t mark_bytes; /* live bytes at the last step mark */
    /* Of those, PyTorch's blocks (MVZ_KIND_BLOCK): on the allocator route a
     * stack's segments hold blocks counted at their own lines, so a finding
     * about PyTorch's allocated memory reads these. */
    uint64_t block_bytes, block_mark;
} mvz_stack;

typedef struct {
    mvz_region stacks_r, frames_r, index_r, pending_r;
    mvz_stack *stacks;
    mvz_frame *frames;
    uint32_t *index;   /* slot -> stack id + 1 */
    uint32_t *pending; /* stack ids whose code objects are not yet adopted */
    size_t n, max, nframes, max_frames, index_cap, npending;
    uint64_t dropped; /* stacks not interned for want of room */
} mvz_stacks;

/* With the GIL, once: reserve the regions. Returns 0 or -1. */
int mvz_stacks_init(mvz_stacks *s, size_t max_stacks, size_t max_frames);
/* Forget every stack but the empty one (id 0). */
void mvz_stacks_reset(mvz_stacks *s);
/* The Python references the table holds (adopted code objects, resolved
 * tuples): with out NULL, how many; else stored into out[]. */
size_t mvz_stacks_refs(const mvz_stacks *s, void **out);

/* Capture path: the id of the stack `f[0..depth)`, interned when new; 0 when
 * there are no frames or no room (counted in s->dropped). */
uint32_t mvz_stacks_intern(mvz_stacks *s, const mvz_frame *f, int depth);
/* The stack's hash, with no lock (the capture path computes it before taking
 * the store's), and the intern that takes it. */
uint64_t mvz_stacks_hash(const mvz_frame *f, int depth);
uint32_t mvz_stacks_intern_hashed(mvz_stacks *s, const mvz_frame *f, int depth, uint64_t h);

/* Code-object lifetimes (module's codeobj.c, through store.h). */
void mvz_stacks_adopt_pending(mvz_stacks *s, void (*adopt)(void *code));
size_t mvz_stacks_mark_dying(mvz_stacks *s, void *code);
/* The first frame of `code` marked dying, or NULL. */
mvz_frame *mvz_stacks_find_dying(mvz_stacks *s, void *code);

/* Copy the frames of stack `id` (at most `cap`); returns the depth or -1. */
int mvz_stacks_frames(const mvz_stacks *s, uint32_t id, mvz_frame *out, int cap);
/* Copy-outs into out[] (room for s->n entries); return the count. */
size_t mvz_stacks_sites(const mvz_stacks *s, mvz_site *out);
/* The stacks whose live figures changed since the last mark; marks them. */
size_t mvz_stacks_step_changes(mvz_stacks *s, mvz_site_change *out);
/* Bytes the table uses and has reserved (stats). */
size_t mvz_stacks_bytes_used(const mvz_stacks *s);
size_t mvz_stacks_bytes_reserved(const mvz_stacks *s);

#endif
