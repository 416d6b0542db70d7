/* The bounded ring of trace events behind track(trace=...) and the flight
 * recorder: appended by the store, taken by the native writer's thread
 * (trace_writer.c) without the GIL, or drained by the Python writer with
 * it, and encoded into the .memviz file's records (mvz_event, record.h;
 * mvz_ring_encode touches no ring state, and the writer calls it itself).
 *
 * The ring (mvz_trace_ring) is the store's: store.c owns it and calls the
 * functions below that touch it with its lock held; this file takes no
 * lock. It calls region.c and clock.h only. */
#ifndef MEMVIZ_TRACE_RING_H
#define MEMVIZ_TRACE_RING_H

#include "record.h"
#include "region.h"

#include <stddef.h>
#include <stdint.h>

/* The ring's size in events, from the smallest to the largest asked for
 * (memviz._core.TRACE_RING_MIN and TRACE_RING_MAX). */
#define MVZ_RING_MIN_EVENTS 1024
#define MVZ_RING_MAX_EVENTS ((size_t)1 << 28)

/* A trace event as kept in the ring: the allocation record (record.h),
 * its `op` saying what happened. */
typedef mvz_alloc mvz_raw_event;

typedef struct {
    mvz_region r;
    mvz_raw_event *events;
    size_t cap, head, len; /* ring: oldest at head */
    uint64_t dropped;
    int on;
} mvz_trace_ring;

/* Store lock held (capture path, no GIL): one write into preallocated
 * memory, or a dropped-event count when the ring is full. */
void mvz_ring_record(mvz_trace_ring *t, const mvz_alloc *event);
/* Store lock held: forget the ring's contents and stop recording. */
void mvz_ring_reset(mvz_trace_ring *t);
/* Store lock held, with the GIL: start recording into a ring of `capacity`
 * events (reserved on the first call, mmap only); returns 0 or -1. */
int mvz_ring_enable(mvz_trace_ring *t, size_t capacity);
/* Events held now, read without the lock or the GIL (a relaxed load, to
 * size a buffer before taking them). */
size_t mvz_ring_pending(const mvz_trace_ring *t);
/* Store lock held, the GIL not needed: move at most `room` oldest events
 * into out[] and the dropped count into *dropped (both then forgotten);
 * returns how many. The native writer's thread takes them without the GIL
 * (store.h's mvz_store_trace_take), the Python writer with it
 * (mvz_store_trace_drain). */
size_t mvz_ring_take(mvz_trace_ring *t, mvz_raw_event *out, size_t room, uint64_t *dropped);
/* No lock, no Python: the one encoding of events into a .memviz file's
 * records (every EVENTS and LIVE chunk memviz writes, from the ring or from
 * Python's rows: _core.encode_events). Into a malloc'd buffer (the caller
 * frees): a TIME record of `start`, a GAP record of `dropped` when there are
 * any (both with `marker_flags`), then each event, after a TIME record of
 * its own time (also with `marker_flags`) where it goes back in time or its
 * delta would not fit 32 bits, so each event decodes to its own time.
 * Returns the buffer's length in bytes, or -1. Safe without the GIL and
 * without the store's lock: it reads only `raw` (a copy taken out of the
 * ring, or Python's rows copied by the binding) and writes only its own
 * buffer. */
long mvz_ring_encode_from(const mvz_raw_event *raw, size_t m, uint64_t dropped, uint64_t start,
                          int marker_flags, uint8_t **out);
/* The same for taken events: `start` is the first one's time (now where
 * there is none), the markers' flags 0. */
long mvz_ring_encode(const mvz_raw_event *raw, size_t m, uint64_t dropped, uint8_t **out);

#endif
