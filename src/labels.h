/* The label table: label strings interned to small ids.
 *
 * A leaf: calls only pthreads. Used by capture.c (thread labels, static
 * memory's names), nodes.c (autograd node labels) and the bindings.
 *
 * Ids come from mvz_label_intern (any thread, the driver callback
 * included: a leaf lock, no allocation). Past 65,534 distinct labels or
 * 4 MiB of their text, every new label gets the id of
 * MVZ_LABEL_OVERFLOW_NAME (counted in mvz_label_stats), never 0. */
#ifndef MEMVIZ_LABELS_H
#define MEMVIZ_LABELS_H

#include <stdint.h>

#define MVZ_LABEL_OVERFLOW_NAME "<labels overflowed>"
/* Ids fit the trace's 16 bits; the last one is the overflow label. */
#define MVZ_MAX_LABELS 65536

uint32_t mvz_label_intern(const char *name);
const char *mvz_label_name(uint32_t id);
/* Labels interned, requests that got the overflow label, bytes of text. */
void mvz_label_stats(uint32_t *count, uint64_t *overflowed, uint64_t *bytes);
/* mvz_label_node[id]: 1 when label `id` names an autograd node (its text
 * starts with "\x01"). Written by mvz_label_intern before `id` is handed to
 * anyone (under the table's lock, whose release orders it before the id's
 * use); only labels.c writes it. */
extern uint8_t mvz_label_node[MVZ_MAX_LABELS];

/* Hot path (any thread, no GIL): whether `id` names an autograd node; 0 for
 * ids out of range. One byte read, inline: the callback asks on every event. */
static inline int mvz_label_is_node(uint32_t id) { return id < MVZ_MAX_LABELS && mvz_label_node[id]; }
/* After fork, in the child: the table's lock is fresh. */
void mvz_labels_atfork_child(void);

#endif
