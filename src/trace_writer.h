/* The native trace writer: a thread of its own that takes events from the
 * store's trace ring, encodes them as EVENTS chunks of the .memviz format
 * (memviz/trace/format.py: byte planes, zlib-compressed, CRC-framed) and
 * hands each chunk to a sink, without the GIL and without Python.
 *
 * Two sinks:
 *   - a file (track(trace=...)): each chunk is appended with write(2);
 *     Python appends its own chunks (strings, frames, stacks, labels,
 *     threads, steps) through mvz_tw_write, under the same lock, so chunks
 *     never interleave;
 *   - memory, the flight recorder (track(flight_recorder=...)): chunks are
 *     kept in a FIFO bounded by a byte budget. When a new chunk does not
 *     fit, the oldest is decoded and folded into the "base", the live set
 *     at the start of the chunks kept, and freed (once no frozen dump holds
 *     it). A dump (mvz_tw_freeze, mvz_tw_frozen_write) writes the base (as
 *     ALLOC events dated when they were made), then the chunks kept, then
 *     the events not yet taken: a normal trace's events.
 *
 * zlib is loaded at run time (dlopen of libz.so.1, which CPython's zlib
 * module links), so the package builds without it; without it the chunks
 * are written uncompressed (layout planes, 32 bytes an event).
 *
 * Locking: one mutex of its own (tw_lock), taken by the thread while it
 * drains and by the Python-facing calls, never on the capture path. The
 * store's lock is taken inside it (to take events), never the other way
 * round. Calls store.c, trace_ring.c, livetab.c. */
#ifndef MEMVIZ_TRACE_WRITER_H
#define MEMVIZ_TRACE_WRITER_H

#include "record.h"

#include <stddef.h>
#include <stdint.h>

/* What of the .memviz format the writer frames (memviz/trace/format.py
 * reads these from _core: CHUNK_KIND_EVENTS, CHUNK_COMPRESSED, LAYOUT_ROWS,
 * LAYOUT_PLANES): the EVENTS chunk's kind, the compressed bit of a chunk's
 * type, and its payload's two layouts (records one after another, or byte
 * planes). */
#define MVZ_TW_CHUNK_EVENTS 7
#define MVZ_TW_CHUNK_COMPRESSED 0x80
#define MVZ_TW_LAYOUT_ROWS 0
#define MVZ_TW_LAYOUT_PLANES 1

typedef struct {
    uint64_t events;        /* ALLOC/FREE/FAILED events taken from the ring */
    uint64_t chunks;        /* EVENTS chunks made */
    uint64_t bytes;         /* bytes written to the file (file sink) */
    uint64_t dropped;       /* events the ring had no room for (GAP records) */
    uint64_t evicted;       /* flight: events folded into the base, gone as events */
    uint64_t kept_events;   /* flight: events in the chunks kept */
    uint64_t kept_bytes;    /* flight: bytes of the chunks kept */
    uint64_t base_count;    /* flight: allocations in the base */
    uint64_t base_bytes;    /* flight: memory the base takes */
    uint64_t window_start;  /* flight: timestamp of the oldest event kept (0: none) */
    uint64_t window_end;    /* timestamp of the newest event taken (0: none) */
    uint64_t evicted_until; /* flight: timestamp of the newest event folded (0: none) */
    uint64_t budget;        /* flight: the byte budget (0: file sink) */
    int error;              /* errno of the first failed write (the writer then stops), or 0 */
    int compressed;         /* zlib was found */
    int running;
} mvz_tw_stats;

/* The framing of EVENTS chunks, every one memviz writes (the writer's
 * thread's, and Python's: _core.events_payload, _core.events_chunk). Any
 * thread, no lock. mvz_tw_events_payload: the EVENTS payload of `n`
 * records (count:u32, layout:u8, then the records one after another,
 * MVZ_TW_LAYOUT_ROWS, or in byte planes, MVZ_TW_LAYOUT_PLANES) into `out`
 * (5 + n records' bytes). mvz_tw_frame_events: `payload` (`len` bytes) as
 * a chunk of `kind` (EVENTS or LIVE, with its flag bits), malloc'd, *out_len
 * bytes: zlib-compressed at `level` (0: never) when that makes it smaller
 * and inflates no more than a reader allows (MVZ_MAX_RATIO), else, for a
 * payload in byte planes, the same records as rows, compressed by the same
 * rule (`payload` then holds those rows); else as it is. NULL out of
 * memory. Safe without the GIL (the binding lets it go while zlib runs):
 * it touches its arguments and memory of its own, and reads the CRC table
 * and zlib's entry points, each set once under pthread_once. */
void mvz_tw_events_payload(const mvz_event *ev, size_t n, int layout, uint8_t *out);
uint8_t *mvz_tw_frame_events(uint8_t kind, uint8_t *payload, size_t len, int level, size_t *out_len);
/* With the GIL (it waits for nothing): whether libz could be loaded. */
int mvz_tw_zlib(void);
/* Start the thread draining the store's ring (which the caller enabled,
 * mvz_store_trace_enable) every `interval_ms`. fd >= 0: the file sink (the caller keeps
 * the fd open until mvz_tw_stop returns); fd < 0: the flight recorder with
 * `budget` bytes. Returns 0, or -1 with errno set (EBUSY: already running). */
int mvz_tw_start(int fd, size_t capacity, int level, unsigned interval_ms, size_t budget);
/* Without the GIL: append bytes to the file sink, whole (0, or -1 with
 * errno; EINVAL for the memory sink). */
int mvz_tw_write(const uint8_t *data, size_t len);
/* The same, for chunks that name stacks and labels: once written, the file
 * names every stack id below `stacks` and every label id up to `labels`
 * (-1: no change), and the events that waited for those names follow. The
 * file sink writes no event before its stack's and label's names (at most
 * a few seconds late where Python cannot run, trace_writer.c). */
int mvz_tw_write_named(const uint8_t *data, size_t len, long stacks, long labels);
/* Without the GIL: take and write every event the ring holds now whose
 * names are written (`force`: every event, named or not). */
void mvz_tw_flush(int force);
/* Without the GIL: flush, stop the thread and the ring. The memory sink
 * keeps its chunks until mvz_tw_release. */
void mvz_tw_stop(void);
/* Free the flight recorder's chunks and base. */
void mvz_tw_release(void);
/* The flight recorder's dump: its events, for the caller to write between
 * the header and tables before and the end after: the base, the chunks
 * kept, and what the ring holds now. It comes in two halves, so that a
 * failing thread waits only for the first (issue 27): mvz_tw_freeze (any thread, no GIL needed; takes
 * tw_lock) drains the ring and takes a reference to every chunk kept and a
 * copy of the base, in milliseconds whatever the budget (NULL and errno:
 * the writer is a file's, or out of memory); mvz_tw_frozen_write (no lock:
 * the chunks it holds are immutable) writes them to fd while the recorder
 * goes on (eviction drops only the queue's reference), 0 or -1 with errno;
 * mvz_tw_frozen_free (takes tw_lock) lets them go. */
typedef struct mvz_tw_frozen mvz_tw_frozen;
mvz_tw_frozen *mvz_tw_freeze(void);
int mvz_tw_frozen_write(mvz_tw_frozen *f, int fd);
void mvz_tw_frozen_free(mvz_tw_frozen *f);
void mvz_tw_get_stats(mvz_tw_stats *out);
/* The flight recorder's budget, split (its one place): the capture ring
 * takes a fifth of `budget`, MVZ_TW_FLIGHT_RING_MIN to MVZ_TW_FLIGHT_RING_MAX
 * events of the ring's record; the writer's take buffer its chunk of
 * events; the chunks kept and the base the rest (`chunks`, mvz_tw_start's
 * `budget`, which the writer enforces). `fixed`: the ring's and the take
 * buffer's bytes. A budget below MVZ_TW_FLIGHT_MIN_BUDGET is refused: -1,
 * else 0. With the GIL: it reads the test sizes below, which are written
 * with it. */
#define MVZ_TW_FLIGHT_MIN_BUDGET ((size_t)16 << 20)
#define MVZ_TW_FLIGHT_RING_MIN ((size_t)16384)
#define MVZ_TW_FLIGHT_RING_MAX ((size_t)1 << 20)
typedef struct {
    size_t ring_events, chunks, fixed;
} mvz_tw_split;
int mvz_tw_flight_split(size_t budget, mvz_tw_split *out);
/* Tests only, with the GIL: splits from now on give a ring of `ring_events`
 * and chunks of `chunks` bytes, whatever the budget (0: the budget's). */
void mvz_tw_flight_test_sizes(size_t ring_events, size_t chunks);
/* After fork, in the child: the writer thread does not exist there. */
void mvz_tw_atfork_child(void);

#endif
