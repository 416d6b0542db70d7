/* Reading the calling thread's Python stack without the GIL. */
#ifndef MEMVIZ_FRAMES_H
#define MEMVIZ_FRAMES_H

#include "store.h"

/* Copies up to `max_depth` (code, instruction offset) pairs of the calling
 * thread's Python frames, innermost first, into `out`; returns how many.
 * 0 when the thread has no Python thread state or no frames. */
int mvz_capture_frames(mvz_frame *out, int max_depth);

/* Python version the frame walker was compiled for, e.g. "3.12". */
extern const char mvz_frames_abi[];

#endif
