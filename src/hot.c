/* The capture path's shared words (hot.h): defined here, at the bottom of
 * the C layers, so that each file that owns a field can reach it without
 * calling up. Initial values are their owners': capture.c's depth limit,
 * store.c's first registration and its sharing of frames. */
#include "hot.h"

mvz_hot_words mvz_hot = {.depth_limit = 32, .generation = 1, .share_frames = 1, .hints = 2 /* MVZ_PF_DEFAULT */};
__thread mvz_thread_words mvz_tl __attribute__((tls_model("initial-exec")));
