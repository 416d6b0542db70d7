/* Reading the calling thread's Python stack without the GIL. */
#ifndef MEMVIZ_FRAMES_H
#define MEMVIZ_FRAMES_H

#include "record.h"
#include "types.h"

#include <stddef.h>

/* Copies up to `max_depth` (code, instruction offset) pairs of the calling
 * thread's Python frames, innermost first, into `out`; returns how many.
 * 0 when the thread has no Python thread state or no frames. A deeper
 * stack keeps its innermost frames and, in the last quarter, the first
 * frame beyond them whose file is not a library's with its callers (the
 * rules below; frames.c says how). */
int mvz_frames_capture(mvz_frame *out, int max_depth);
/* As mvz_frames_capture, also noting in where[0..nwhere) (NULL, 0: not
 * at all) the addresses of the first frames it reads, for the next walk's
 * prefetch (store.c, mvz_store_prefetch). */
int mvz_frames_capture_at(mvz_frame *out, int max_depth, const void **where, int nwhere);
/* As mvz_frames_capture, comparing as it walks: `last` (m frames, room for
 * max_depth; NULL: nothing to compare with) is the thread's previous
 * stack. *kept: how many outermost frames the walk shares with it, when
 * the depths are the same; -1 when they are not, when there was nothing to
 * compare with, or when a stack deeper than max_depth had its last quarter
 * rewritten (the caller compares: mvz_frames_shared_outer). */
int mvz_frames_capture_cmp(mvz_frame *out, int max_depth, const mvz_frame *last, int m, int *kept);
/* How many outermost frames f[0..n) (innermost first) shares with
 * last[0..m), compared from the outer end. */
int mvz_frames_shared_outer(const mvz_frame *f, int n, const mvz_frame *last, int m);

/* Kinds of the rules Python hands down (memviz/model/frame_filter.py). */
enum {
    MVZ_RULE_USER = 0,    /* a configured user path (a prefix) */
    MVZ_RULE_LIBRARY = 1, /* a configured library path (a prefix) */
    MVZ_RULE_DEFAULT = 2, /* a default library folder (a prefix) */
    MVZ_RULE_PART = 3,    /* a library marker anywhere in the path ("/site-packages/") */
    MVZ_RULE_PSEUDO = 4   /* a library pseudo-file's prefix ("<frozen ") */
};

/* With the GIL: replace the rule set (copied); returns 0 or -1 (no memory). */
int mvz_frames_set_rules(const int *kinds, const char *const *texts, const size_t *lens, int n);

/* Python version the frame walker was compiled for, e.g. "3.12". */
extern const char mvz_frames_abi[];

#endif
