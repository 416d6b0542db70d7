/* What if, the pass over a recording: a trace's events, one EVENTS chunk at
 * a time, turned into the requests, frees and empty_cache calls of
 * PyTorch's caching allocator and handed to several models of it at once
 * (whatif.h, one per setting), with the recording's own figures.
 *
 * The pass keeps what it needs of the recording and nothing per event: the
 * live PyTorch blocks and device allocations, by (address, kind), as the
 * replay's rules have them (replay.h: an ALLOC at a live address ends what
 * was there, a FREE of an unknown address is nothing); the device
 * allocations of each device in address order (the one a block lies in
 * is PyTorch's: a segment); and the work of the current chunk, queued. A live block
 * is known to the models by a handle (a small number, reused once freed),
 * so a model needs no map of addresses.
 *
 * Plain C, no Python: the binding (module_whatif.c) keeps one call at a
 * time and lets the GIL go; the models run side by side, each on one thread
 * at a time, and share nothing. Calls whatif.c; record.h reads the fields
 * each record needs (a FREE: its op, kind, time and address). */
#ifndef MEMVIZ_WHATIF_PASS_H
#define MEMVIZ_WHATIF_PASS_H

#include "record.h"
#include "whatif.h"

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t base, size;
    uint8_t slot;
} mvz_whatif_pass_device;

/* A live block or device allocation of the recording (16 bytes: the table
 * is probed once an event). */
typedef struct {
    uint64_t address;
    uint32_t handle; /* a block's on a device the models see; a counted physical granule's size in MiB */
    uint8_t kind, slot, used;
} mvz_whatif_pass_live;

/* A request, free or empty_cache of the recording, queued for the models. */
typedef struct {
    uint64_t requested, stream, ts, index, outside;
    uint64_t hint, hint_size; /* the segment the recording made or first used for it (0: none) */
    uint32_t rec_made, rec_freed; /* the recording's segments made (this one's included) and freed so far */
    uint32_t stack, handle, label; /* label: the recording's label id (a backward's node) */
    uint32_t caller; /* a request with no Python frames: the last stack seen before it (whatif.h) */
    uint8_t op, slot; /* op: MVZ_WHATIF_ALLOC, _FREE, _EMPTY */
} mvz_whatif_pass_op;
enum { MVZ_WHATIF_ALLOC, MVZ_WHATIF_FREE, MVZ_WHATIF_EMPTY };

typedef struct {
    mvz_whatif **models;
    size_t n;
    /* what the chunk queued (the models take it in turn, or side by side) */
    mvz_whatif_pass_op *ops;
    size_t nops, capops;
    /* the recording's live blocks and device allocations: open addressing */
    mvz_whatif_pass_live *live;
    size_t nlive, caplive;
    /* handles freed, to be given again (the last freed first) */
    uint32_t *spare;
    size_t nspare, capspare;
    uint32_t handles; /* handles given so far */
    uint64_t *bytes;  /* a live block's size, by handle */
    size_t capbytes;
    /* the recording's own device allocations, live, by slot and address:
     * those no block was seen in yet (outside PyTorch), and PyTorch's
     * segments */
    mvz_whatif_pass_device *dev, *seg;
    size_t ndev, capdev, nseg, capseg;
    uint64_t outside[MVZ_NSLOTS];      /* live device bytes not (yet) PyTorch's */
    uint64_t reserved[MVZ_NSLOTS];     /* live PyTorch segments' bytes, as recorded */
    uint64_t allocated[MVZ_NSLOTS];    /* live blocks' bytes, as recorded */
    uint64_t rec_reserved_peak[MVZ_NSLOTS], rec_allocated_peak[MVZ_NSLOTS], rec_segments[MVZ_NSLOTS];
    uint64_t rec_freed[MVZ_NSLOTS]; /* the recording's segments freed so far */
    /* Under expandable segments PyTorch's memory is physical granules
     * (cuMemCreate of 2 or 20 MiB) mapped into address space it reserved:
     * reserved is the segments' bytes and those granules'. Granules made
     * before the first allocation read from PyTorch at attach (flagged
     * "before tracking", which holds them) are not counted again. */
    uint64_t granules[MVZ_NSLOTS], rec_vmm_peak[MVZ_NSLOTS];
    uint8_t seeded[MVZ_NSLOTS];
    int expandable; /* the recording ran with expandable segments (the first setting's) */
    uint64_t outside_peak[MVZ_NSLOTS];
    uint32_t last_stack; /* the stack of the last block asked for with Python frames */
    uint64_t events; /* events read (the next one's index) */
    uint64_t ts;     /* the stream's clock: the last event's time */
    int failed;
} mvz_whatif_pass;

/* A pass through models of the `n` settings, the recording's own first, its
 * first events counting time from `start_ns` (until a TIME record). 0, or -1
 * out of memory. */
int mvz_whatif_pass_init(mvz_whatif_pass *p, const mvz_whatif_settings *settings, size_t n, uint64_t start_ns);
void mvz_whatif_pass_release(mvz_whatif_pass *p);
/* An EVENTS chunk's `count` records of `width` bytes (record.h; layout 0:
 * one after another, 1: byte planes): the recording's figures, and the
 * models' work queued. 0, or -1 out of memory. */
int mvz_whatif_pass_feed(mvz_whatif_pass *p, const uint8_t *records, size_t count, size_t width, int layout);
/* The queued work through every model: on up to `threads` threads (the
 * models share nothing). 0, or -1 out of memory. */
int mvz_whatif_pass_run(mvz_whatif_pass *p, int threads);

#endif
