/* Replay of a trace's events (replay.h): the store's live-table and
 * accounting rules over a private table. Not on the capture path: it
 * reserves (mmap) and releases its own regions, and mallocs its result. */
#include "replay.h"
#include "accounting.h"
#include "livetab.h"
#include "store.h"

#include <stdlib.h>
#include <string.h>

static int by_index(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return x < y ? -1 : x > y;
}

int mvz_replay(size_t n, const uint8_t *op, const uint64_t *address, const uint64_t *size,
               const uint8_t *kind, const int8_t *device, mvz_replay_result *out)
{
    mvz_totals totals[MVZ_REPLAY_SLOTS];
    memset(totals, 0, sizeof totals);
    memset(out->end, 0, n * sizeof *out->end);
    out->live = NULL;
    out->nlive = 0;
    for (int d = 0; d < MVZ_REPLAY_SLOTS; d++)
        out->peak_index[d] = -1;
    size_t nallocs = 0;
    for (size_t i = 0; i < n; i++)
        nallocs += op[i] == MVZ_EV_ALLOC;
    mvz_livetab live;
    memset(&live, 0, sizeof live);
    int rc = -1;
    if (mvz_live_init(&live, nallocs ? nallocs : 1))
        goto done;
    for (size_t i = 0; i < n; i++) {
        if (op[i] != MVZ_EV_ALLOC && op[i] != MVZ_EV_FREE)
            continue;
        int found, k = kind[i];
        size_t at = mvz_live_find(&live, address[i], k, &found);
        if (found) { /* its FREE (or, for an ALLOC, the free it was not seen to have) */
            const mvz_alloc *a = mvz_live_at(&live, at);
            size_t j = (size_t)a->timestamp; /* here: the index of its ALLOC event */
            out->end[j] = (int64_t)i;
            if (a->kind != MVZ_KIND_BLOCK)
                mvz_totals_free(&totals[(uint8_t)a->slot], a->size);
            mvz_live_remove(&live, at);
        }
        if (op[i] == MVZ_EV_FREE)
            continue;
        int room = mvz_live_make_room(&live);
        if (room < 0)
            goto done;
        if (room > 0 || found)
            at = mvz_live_find(&live, address[i], k, &found);
        mvz_alloc *a = mvz_live_insert(&live, at);
        memset(a, 0, sizeof *a);
        a->address = address[i];
        a->size = size[i];
        a->timestamp = i;
        a->kind = (uint8_t)k;
        a->slot = (int16_t)(uint8_t)device[i];
        if (k != MVZ_KIND_BLOCK && mvz_totals_alloc(&totals[(uint8_t)device[i]], size[i], i))
            out->peak_index[(uint8_t)device[i]] = (int64_t)i;
    }
    out->live = malloc((live.count ? live.count : 1) * sizeof *out->live);
    if (!out->live)
        goto done;
    for (size_t k = 0; k < live.count; k++)
        out->live[k] = (size_t)live.allocs[k].timestamp;
    out->nlive = live.count;
    qsort(out->live, out->nlive, sizeof *out->live, by_index);
    for (int d = 0; d < MVZ_REPLAY_SLOTS; d++) {
        out->current[d] = totals[d].current;
        out->peak[d] = totals[d].peak;
    }
    rc = 0;
done:
    mvz_live_release(&live);
    if (rc) {
        free(out->live);
        out->live = NULL;
        out->nlive = 0;
    }
    return rc;
}
