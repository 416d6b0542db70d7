/* The bounded ring of trace events behind track(trace=...): appended by the
 * store while it holds its lock, drained with the GIL into 32-byte records
 * (mvz_event, store.h) for the .memviz file. */
#ifndef MEMVIZ_TRACE_RING_H
#define MEMVIZ_TRACE_RING_H

#include <stdint.h>

/* Store lock held (capture path, no GIL): one write into preallocated
 * memory, or a dropped-event count when the ring is full. */
void mvz_trace_record(int op, uint64_t ts, uint64_t address, uint64_t size, uint32_t stack_id,
                      uint32_t thread_idx, uint32_t label_id, int kind, int slot);
/* Store lock held: forget the ring's contents and stop recording. */
void mvz_trace_reset_locked(void);

/* The store's leaf lock, for the ring's own entry points. */
void mvz_store_lock(void);
void mvz_store_unlock(void);

#endif
