/* The label table: label strings interned to small ids.
 *
 * A leaf: calls only pthreads. Used by capture.c (thread labels, static
 * memory's names), nodes.c (autograd node labels) and the bindings.
 *
 * Ids come from mvz_labels_intern (any thread, the driver callback
 * included: a leaf lock, no allocation). Past 65,534 labels in use or
 * 4 MiB of their text, every new label gets the id of
 * MVZ_LABEL_OVERFLOW_NAME (counted in mvz_labels_stats), never 0.
 *
 * Ids are reused: when the store is cleared for a new outermost tracker
 * (module.c's clear, nothing capturing), mvz_labels_reclaim frees every id
 * that no label context holds now (mvz_labels_pin), if the table is half
 * full (ids or text) or overflowed; later mvz_labels_intern calls hand ids
 * out again from just above the highest id kept. So the table is, in
 * effect, per tracker: a long process never runs out (a tracker gets fewer
 * than 65,534 when a block holds a high id across its start). Who keeps an id across trackers re-interns its
 * name (memviz.label does at each enter). */
#ifndef MEMVIZ_LABELS_H
#define MEMVIZ_LABELS_H

#include <stdint.h>

#define MVZ_LABEL_OVERFLOW_NAME "<labels overflowed>"
/* Ids fit the trace's 16 bits; the last one is the overflow label. */
#define MVZ_MAX_LABELS 65536

uint32_t mvz_labels_intern(const char *name);
/* The text of `id` (valid until the next reclaim), or NULL for a free id. */
const char *mvz_labels_name(uint32_t id);
/* Labels in use, requests that got the overflow label since the last
 * reclaim call, bytes of text. */
void mvz_labels_stats(uint32_t *count, uint64_t *overflowed, uint64_t *bytes);
/* The highest id in use (0: none); ids handed out after a reclaim only grow
 * until the next one, so a reader that named ids up to it names the new
 * ones by reading from there on. */
uint32_t mvz_labels_high(void);
/* With the GIL: a label context holds `id` (delta 1) or lets it go (-1). */
void mvz_labels_pin(uint32_t id, int delta);
/* With the GIL, while nothing captures and the store holds no record (the
 * store's clear): frees the ids no context pins, when `force` or when the
 * table is half full or overflowed; 1 if it did (nodes.c's cache of node
 * labels must then be forgotten too). Resets the overflow count. */
int mvz_labels_reclaim(int force);
/* Reclaims that freed ids, over the process's life. */
uint64_t mvz_labels_reclaims(void);
/* mvz_labels_node[id]: 1 when label `id` names an autograd node (its text
 * starts with "\x01"). Written by mvz_labels_intern before `id` is handed to
 * anyone (under the table's lock, whose release orders it before the id's
 * use); only labels.c writes it. */
extern uint8_t mvz_labels_node[MVZ_MAX_LABELS];

/* Hot path (any thread, no GIL): whether `id` names an autograd node; 0 for
 * ids out of range. One byte read, inline: the callback asks on every event;
 * none for id 0 ("no label", the usual case), which is never a node's. */
static inline int mvz_labels_is_node(uint32_t id)
{
    return id != 0 && id < MVZ_MAX_LABELS && mvz_labels_node[id];
}
/* After fork, in the child: the table's lock is fresh. */
void mvz_labels_atfork_child(void);

#endif
