/* Finding a loaded shared library by the end of its path.
 *
 * A leaf: calls only the C library's loader (dl_iterate_phdr). Used by the
 * wrappers (interpose.c) and the autograd-node reader's probing (nodes.c). */
#ifndef MEMVIZ_LIBFIND_H
#define MEMVIZ_LIBFIND_H

#include <link.h>

/* The loaded library whose path ends with `suffix` (the first one), copied
 * into *out (its pointers stay valid while the library is loaded); 0 when
 * none. Takes the loader's lock: never on the capture path. */
int mvz_libfind_loaded(const char *suffix, struct dl_phdr_info *out);

#endif
