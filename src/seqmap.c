/* See seqmap.h. */
#include "seqmap.h"

#include <stdlib.h>
#include <string.h>

#define RING (1u << 15) /* about 30 training steps of forward ops */

typedef struct {
    uint64_t seq;   /* counter value + 1; 0 = empty */
    uint64_t stack; /* stack id */
} note;

static mvz_seq_fn seq_fn;
static note ring[RING];
static uint64_t head;
static __thread uint64_t tl_last __attribute__((tls_model("initial-exec")));

void mvz_seqmap_attach(mvz_seq_fn fn)
{
    __atomic_store_n(&seq_fn, NULL, __ATOMIC_RELEASE);
    for (size_t i = 0; i < RING; i++) {
        __atomic_store_n(&ring[i].seq, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&ring[i].stack, 0, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&seq_fn, fn, __ATOMIC_RELEASE);
}

/* Hot path, no GIL: calls PyTorch's sequence_number::peek (it reads a C++
 * thread-local counter: no lock, no Python, no CUDA; a thread's first call
 * may let the C library set up that library's thread-local block), reads
 * this thread's TLS, and claims a ring slot with one atomic add. Entries are
 * two relaxed 64-bit stores; a reader racing a writer 32,768 notes later can
 * only see a stale pair, which names a wrong line, never a bad pointer. */
void mvz_seqmap_note(uint32_t stack_id)
{
    mvz_seq_fn fn = __atomic_load_n(&seq_fn, __ATOMIC_ACQUIRE);
    if (!fn || !stack_id)
        return;
    uint64_t v = fn() + 1;
    if (v == tl_last)
        return;
    tl_last = v;
    uint64_t i = __atomic_fetch_add(&head, 1, __ATOMIC_RELAXED) % RING;
    __atomic_store_n(&ring[i].seq, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&ring[i].stack, stack_id, __ATOMIC_RELAXED);
    __atomic_store_n(&ring[i].seq, v, __ATOMIC_RELEASE);
}

/* With the GIL. The wanted numbers go into a small open-addressing table;
 * one pass over the ring, oldest to newest, fills in their stacks (a number
 * noted twice, by two threads, keeps the newer note). */
void mvz_seqmap_lookup(const uint64_t *seqs, uint32_t *stacks, long n)
{
    memset(stacks, 0, (size_t)n * sizeof *stacks);
    if (n <= 0)
        return;
    size_t cap = 16;
    while (cap < (size_t)n * 2)
        cap *= 2;
    long *slot = malloc(cap * sizeof *slot); /* index into seqs, -1 = empty */
    if (!slot)
        return;
    for (size_t i = 0; i < cap; i++)
        slot[i] = -1;
    for (long i = 0; i < n; i++) {
        if (seqs[i] >> 63)
            continue; /* no number (AccumulateGrad: UINT64_MAX) */
        uint64_t want = seqs[i] + 2; /* stored as counter + 1; node k -> counter k + 1 */
        size_t j = (size_t)(want * 0x9E3779B97F4A7C15ull >> 32) & (cap - 1);
        while (slot[j] >= 0 && seqs[slot[j]] + 2 != want)
            j = (j + 1) & (cap - 1);
        if (slot[j] < 0)
            slot[j] = i;
    }
    uint64_t h = __atomic_load_n(&head, __ATOMIC_RELAXED);
    for (uint64_t k = 0; k < RING; k++) {
        const note *e = &ring[(h + k) % RING];
        uint64_t s = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);
        if (!s)
            continue;
        size_t j = (size_t)(s * 0x9E3779B97F4A7C15ull >> 32) & (cap - 1);
        while (slot[j] >= 0 && seqs[slot[j]] + 2 != s)
            j = (j + 1) & (cap - 1);
        if (slot[j] >= 0)
            stacks[slot[j]] = (uint32_t)__atomic_load_n(&e->stack, __ATOMIC_RELAXED);
    }
    /* Duplicates in seqs share the first one's answer. */
    for (long i = 0; i < n; i++) {
        if (seqs[i] >> 63)
            continue;
        uint64_t want = seqs[i] + 2;
        size_t j = (size_t)(want * 0x9E3779B97F4A7C15ull >> 32) & (cap - 1);
        while (seqs[slot[j]] + 2 != want)
            j = (j + 1) & (cap - 1);
        stacks[i] = stacks[slot[j]];
    }
    free(slot);
}
