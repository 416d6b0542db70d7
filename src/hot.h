/* The capture path's shared words: the read-mostly globals on one cache
 * line (mvz_hot) and the thread-local ones on one line of each thread's
 * TLS (mvz_tl), which the files of the capture path (capture.c, store.c,
 * nodes.c, seqmap.c, clock.c) keep here instead of in their own data, so
 * that an event touches two lines for them instead of a dozen. Layer 1:
 * state only, no functions; hot.c defines both. */
#ifndef MEMVIZ_HOT_H
#define MEMVIZ_HOT_H

#include <stdint.h>

/* The capture path's read-mostly words, on one cache line. Inside a step
 * every line the capture path touches is a first-level cache miss of about
 * 3 ns (benchmarks/RESULTS.md, ninth session); spread over five files' data
 * these words were eight lines an allocation and its free. Each field is
 * its file's own (named beside it), which alone writes it, with the
 * atomics it always used: at start and stop, at an attach, and
 * drainer_kicked once per kick of the drain thread. */
typedef struct __attribute__((aligned(64))) {
    int capturing;            /* capture.c: 0 off, 1 on, or a benchmark's mode */
    int fenced;               /* capture.c: membarrier registered (0 again only in a fork child) */
    int depth_limit;          /* capture.c: frames an allocation keeps */
    int clock_tsc;            /* clock.c: the capture path's ticks are the TSC's */
    uint32_t generation;      /* store.c: thread registrations */
    int share_frames;         /* store.c: entries leave out frames kept from the last stack */
    int drainer_kicked;       /* store.c: the drain thread was woken; it clears it as it drains */
    int hints;                /* store.c: the benchmarks' cache switches (store.h MVZ_PF_*) */
    uint8_t *walked_base;     /* store.c: the walk buffers (its region `walked`) */
    const void *node_layout;  /* nodes.c: the attached layout (mvz_node_layout) */
    uint64_t (*seq_fn)(void); /* seqmap.c: PyTorch's sequence-number reader */
} mvz_hot_words;
_Static_assert(sizeof(mvz_hot_words) == 64, "the capture path's read-mostly words are one line");
extern mvz_hot_words mvz_hot __attribute__((visibility("hidden")));

/* The capture path's thread-local words, on one line of the thread's TLS
 * and behind one offset the code loads (each thread-local variable of a
 * shared library costs a load of its offset, from a line of its own once
 * they spread). Only the owning thread reads or writes its copy; each
 * field is its file's own. */
typedef struct __attribute__((aligned(64))) {
    int busy;                  /* capture.c: this thread's recording slot + 1; 0 none yet; -1 none left */
    uint32_t label;            /* capture.c: this thread's label (labels.h) */
    int own;                   /* capture.c: inside memviz's own work */
    uint32_t thread_plus1;     /* store.c: this thread's index + 1, 0 none */
    uint32_t generation;       /* store.c: the registration thread_plus1 is of */
    uint32_t walk_gen;         /* store.c: the registration its last stack was queued under; 0 none */
    uint32_t walk_idx;         /* store.c: the index it was queued under */
    uint16_t walk_n;           /* store.c: its last stack's depth */
    uint8_t walk_last;         /* store.c: which walk buffer holds it */
    uint8_t discarded;         /* store.c: an allocation discarded since one was queued */
    uint8_t where_n;           /* store.c: frame addresses noted (the walk's prefetch) */
    uint8_t where_asked;       /* store.c: the walk under way notes them */
    uint64_t seq_last;         /* seqmap.c: the sequence number last noted */
    const void *slot_layout;   /* nodes.c: the layout `slot` was found by */
    const void *const *slot;   /* nodes.c: this thread's slot of libtorch's */
} mvz_thread_words;
_Static_assert(sizeof(mvz_thread_words) == 64, "the capture path's thread-local words are one line");
extern __thread mvz_thread_words mvz_tl __attribute__((tls_model("initial-exec"), visibility("hidden")));

#endif
