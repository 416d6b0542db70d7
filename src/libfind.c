/* Library lookup (libfind.h). Calls nothing of memviz's; with the GIL or at
 * least never on the capture path (dl_iterate_phdr takes the loader's lock). */
#define _GNU_SOURCE
#include "libfind.h"

#include <string.h>

typedef struct {
    const char *suffix;
    struct dl_phdr_info *out;
    int found;
} lookup;

static int match(struct dl_phdr_info *info, size_t size, void *data)
{
    lookup *l = data;
    size_t nl = strlen(info->dlpi_name), sl = strlen(l->suffix);
    if (nl < sl || strcmp(info->dlpi_name + nl - sl, l->suffix) != 0)
        return 0;
    memset(l->out, 0, sizeof *l->out);
    memcpy(l->out, info, size < sizeof *l->out ? size : sizeof *l->out);
    l->found = 1;
    return 1;
}

int mvz_libfind_loaded(const char *suffix, struct dl_phdr_info *out)
{
    lookup l = {suffix, out, 0};
    dl_iterate_phdr(match, &l);
    return l.found;
}
