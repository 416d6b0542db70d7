/* See seqmap.h. */
#include "seqmap.h"
#include "hot.h"

#include <stddef.h>
#include "types.h"

#define RING (1u << 15) /* a slot per counter value, modulo: 32,768 nodes back */

typedef struct {
    uint64_t seq;   /* counter value + 1; 0 = empty */
    uint64_t stack; /* stack id */
} note;

static note ring[RING];

void mvz_seqmap_attach(mvz_seq_fn fn)
{
    __atomic_store_n(&mvz_hot.seq_fn, NULL, __ATOMIC_RELEASE);
    for (size_t i = 0; i < RING; i++) {
        __atomic_store_n(&ring[i].seq, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&ring[i].stack, 0, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&mvz_hot.seq_fn, fn, __ATOMIC_RELEASE);
}

/* Any thread, no GIL: one call of the attached reader. */
uint64_t mvz_seqmap_counter(void)
{
    mvz_seq_fn fn = __atomic_load_n(&mvz_hot.seq_fn, __ATOMIC_ACQUIRE);
    return fn ? fn() : 0;
}

/* Store lock held (the capture queue's drain), no GIL: three relaxed or
 * release stores into the counter's slot. */
void mvz_seqmap_put(uint64_t v, uint32_t stack_id)
{
    if (!v || !stack_id || !__atomic_load_n(&mvz_hot.seq_fn, __ATOMIC_ACQUIRE))
        return;
    note *e = &ring[v % RING];
    __atomic_store_n(&e->seq, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&e->stack, stack_id, __ATOMIC_RELAXED);
    __atomic_store_n(&e->seq, v, __ATOMIC_RELEASE);
}

/* Any thread, no GIL (the driver callback reads it for the node it is in):
 * two acquire loads around one relaxed load of the counter's slot. */
uint32_t mvz_seqmap_stack(uint64_t seq)
{
    if (seq >> 63)
        return 0; /* no number (AccumulateGrad: UINT64_MAX) */
    uint64_t want = seq + 2; /* stored as counter + 1; node k -> counter k + 1 */
    const note *e = &ring[want % RING];
    if (__atomic_load_n(&e->seq, __ATOMIC_ACQUIRE) != want)
        return 0;
    uint64_t stack = __atomic_load_n(&e->stack, __ATOMIC_RELAXED);
    if (__atomic_load_n(&e->seq, __ATOMIC_ACQUIRE) != want) /* rewritten meanwhile */
        return 0;
    return (uint32_t)stack;
}

/* With the GIL: one slot read per node. */
void mvz_seqmap_lookup(const uint64_t *seqs, uint32_t *stacks, long n)
{
    for (long i = 0; i < n; i++)
        stacks[i] = mvz_seqmap_stack(seqs[i]);
}
