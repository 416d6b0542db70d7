/* Forward lines for autograd nodes, without saved-tensor hooks.
 *
 * PyTorch numbers autograd nodes from a per-thread counter as forward creates
 * them (`at::sequence_number`, exported as a plain `uint64_t peek(void)`), and
 * an op allocates its output right after creating its node. So when an
 * allocation seen in the callback finds the counter at k+1, node k was made
 * by the Python line of that allocation. The callback notes (counter, stack)
 * once per counter value in a table indexed by the counter (modulo its
 * size); before a backward, Python asks for the
 * stacks of its nodes' numbers (node._sequence_nr()). Python hands the
 * address of `peek` over (ctypes), or, where its probe found where libtorch
 * keeps the counter, nodes.c's reader of it in place (mvz_nodes_counter);
 * memviz is not linked against libtorch. A backward allocation's forward
 * line is looked up by the store as it applies the allocation (store.c,
 * node_line), after the note, which was queued before it. */
#ifndef MEMVIZ_SEQMAP_H
#define MEMVIZ_SEQMAP_H

#include <stdint.h>

#include "hot.h"

typedef uint64_t (*mvz_seq_fn)(void);

/* With the GIL; NULL detaches. Forgets what was noted. */
void mvz_seqmap_attach(mvz_seq_fn fn);

/* Driver callback, no GIL: the counter + 1 to note with the allocation
 * this thread is recording, or 0 when this thread noted that value already
 * (or nothing is attached). The note is written once the allocation's
 * stack is interned, by the store (capq.h): mvz_seqmap_put. */
static inline uint64_t mvz_seqmap_next(void)
{
    /* Inline, no GIL: calls PyTorch's sequence_number::peek through the
     * attached reader (a C++ thread-local counter: no lock, no Python, no
     * CUDA; a thread's first call may let the C library set up that
     * library's thread-local block) and reads and writes this thread's TLS
     * line (hot.h). Two threads whose counters meet in a slot of the note
     * ring, or a reader racing a writer, can only see a stale or the other
     * thread's pair, which names a wrong line, never a bad pointer (the
     * reader checks the value). */
    mvz_seq_fn fn = __atomic_load_n(&mvz_hot.seq_fn, __ATOMIC_ACQUIRE);
    if (!fn)
        return 0;
    uint64_t v = fn() + 1;
    if (v == mvz_tl.seq_last)
        return 0;
    mvz_tl.seq_last = v;
    return v;
}
/* Any thread: the attached counter's value now (0 when none is attached):
 * the probe checks a reader against PyTorch's peek with it. */
uint64_t mvz_seqmap_counter(void);
/* Store lock held: note `stack_id` (not 0) for counter value + 1 `v`. */
void mvz_seqmap_put(uint64_t v, uint32_t stack_id);

/* Any thread, no GIL: the stack of the first allocation made with the
 * counter at seq+1 (node seq's forward line), or 0. */
uint32_t mvz_seqmap_stack(uint64_t seq);

/* With the GIL: for each seqs[i] (a node's number k), the stack of the first
 * allocation made with the counter at k+1, or 0. */
void mvz_seqmap_lookup(const uint64_t *seqs, uint32_t *stacks, long n);

#endif
