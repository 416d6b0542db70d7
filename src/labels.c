/* The label table (labels.h). A leaf: calls only pthreads and libc string
 * functions. Guarded by label_lock, a leaf lock held for a bounded time. */
#include "labels.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Ids fit the trace's 16 bits; the last one is the overflow label, which
 * every label that finds no room (no id left, or no arena space) gets. */
#define MAX_LABELS MVZ_MAX_LABELS
#define LABEL_OVERFLOW (MAX_LABELS - 1)
#define LABEL_SLOTS (2 * MAX_LABELS) /* hash index, at most half full */
static const char overflow_name[] = MVZ_LABEL_OVERFLOW_NAME;
/* labels[id]: the text of label `id`, NULL for a free id. */
static const char *labels[MAX_LABELS] = {[LABEL_OVERFLOW] = overflow_name};
/* mvz_labels_node[i] (labels.h): labels[i] names an autograd node ("\x01...");
 * written before the id is published to anyone, read lock-free in the
 * callback. */
uint8_t mvz_labels_node[MVZ_MAX_LABELS];
/* pins[id]: label contexts that hold `id` on some thread now (mvz_labels_pin);
 * a pinned id outlives mvz_labels_reclaim. */
static uint32_t pins[MAX_LABELS];
static uint32_t next_id = 1;  /* the next id to try; 0 means "no label" */
static uint32_t high = 1;     /* every id in use is below it */
static uint32_t nlive;        /* ids in use (the overflow's not counted) */
static uint32_t label_slots[LABEL_SLOTS]; /* id, or 0 for an empty slot */
static uint64_t labels_overflowed;        /* requests answered with LABEL_OVERFLOW */
static uint64_t reclaims;                 /* mvz_labels_reclaim calls that freed ids */
static pthread_mutex_t label_lock = PTHREAD_MUTEX_INITIALIZER;
/* Label strings: 4 MiB of zero pages until used, compacted by a reclaim. */
static char arena[4u << 20];
static size_t arena_used;

static uint32_t label_hash(const char *s, size_t len)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h;
}

/* With label_lock held: a free id (next_id onwards: above every id in use),
 * or 0 when none is left. */
static uint32_t free_id(void)
{
    while (next_id < LABEL_OVERFLOW && labels[next_id])
        next_id++;
    return next_id < LABEL_OVERFLOW ? next_id : 0;
}

/* Any thread, also the driver callback (nodes.c, once per new node label):
 * label_lock is a leaf lock, and whoever holds it does a bounded amount of
 * work (one hash probe sequence in a table kept at most half full, a scan
 * for a free id that only moves forward, and a copy into the static arena):
 * no malloc, no Python, no other lock. */
uint32_t mvz_labels_intern(const char *name)
{
    if (name == NULL)
        return 0;
    size_t len = strlen(name);
    uint32_t mask = LABEL_SLOTS - 1, i = label_hash(name, len) & mask;
    pthread_mutex_lock(&label_lock);
    uint32_t id;
    for (; (id = label_slots[i]) != 0; i = (i + 1) & mask)
        if (strcmp(labels[id], name) == 0)
            break;
    if (!id) {
        uint32_t fresh = strcmp(name, overflow_name) == 0 ? 0 : free_id();
        if (strcmp(name, overflow_name) == 0) {
            id = LABEL_OVERFLOW;
        } else if (fresh && len < sizeof arena - arena_used) {
            char *copy = arena + arena_used; /* the callback interns too: no malloc */
            memcpy(copy, name, len + 1);
            arena_used += len + 1;
            id = fresh;
            labels[id] = copy;
            mvz_labels_node[id] = name[0] == '\x01';
            label_slots[i] = id;
            next_id = id + 1;
            if (high <= id)
                high = id + 1;
            nlive++;
        } else {
            id = LABEL_OVERFLOW; /* the table is full: counted, never an error */
            labels_overflowed++;
        }
    }
    pthread_mutex_unlock(&label_lock);
    return id;
}

/* With the GIL (memviz.label's enter and exit), never on the capture path. */
void mvz_labels_pin(uint32_t id, int delta)
{
    if (id == 0 || id >= LABEL_OVERFLOW)
        return;
    pthread_mutex_lock(&label_lock);
    if (delta > 0)
        pins[id]++;
    else if (pins[id])
        pins[id]--;
    pthread_mutex_unlock(&label_lock);
}

/* The ids a reclaim keeps, in arena order (static: a leaf allocates nothing). */
static uint32_t kept_ids[MAX_LABELS];

static int by_address(const void *a, const void *b)
{
    const char *x = labels[*(const uint32_t *)a], *y = labels[*(const uint32_t *)b];
    return x < y ? -1 : x > y;
}

/* With the GIL, while nothing captures (labels.h): the capture path and the
 * native writer read neither the table nor the arena then, and the GIL keeps
 * the bindings out. The arena is compacted in place: kept strings move
 * down only, in address order, so memmove never overwrites one not yet
 * moved. */
int mvz_labels_reclaim(int force)
{
    pthread_mutex_lock(&label_lock);
    int full = nlive >= (LABEL_OVERFLOW - 1) / 2 || arena_used >= sizeof arena / 2 || labels_overflowed;
    labels_overflowed = 0; /* counted per store, as the store's other drops */
    if (!(force || full) || nlive == 0) {
        pthread_mutex_unlock(&label_lock);
        return 0;
    }
    uint32_t n = 0;
    for (uint32_t id = 1; id < LABEL_OVERFLOW; id++) {
        if (!labels[id])
            continue;
        if (pins[id]) {
            kept_ids[n++] = id;
        } else {
            labels[id] = NULL;
            mvz_labels_node[id] = 0;
        }
    }
    qsort(kept_ids, n, sizeof kept_ids[0], by_address);
    memset(label_slots, 0, sizeof label_slots);
    size_t used = 0;
    uint32_t top = 1, mask = LABEL_SLOTS - 1;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t id = kept_ids[k];
        size_t len = strlen(labels[id]);
        memmove(arena + used, labels[id], len + 1);
        labels[id] = arena + used;
        uint32_t s = label_hash(arena + used, len) & mask;
        while (label_slots[s])
            s = (s + 1) & mask;
        label_slots[s] = id;
        used += len + 1;
        if (top <= id)
            top = id + 1;
    }
    memset(arena + used, 0, arena_used - used);
    arena_used = used;
    nlive = n;
    high = top;
    /* New ids start above the kept ones and only grow until the next
     * reclaim (labels.h: a reader names new ids from where it stopped). */
    next_id = top;
    reclaims++;
    pthread_mutex_unlock(&label_lock);
    return 1;
}

void mvz_labels_stats(uint32_t *count, uint64_t *overflowed, uint64_t *bytes)
{
    pthread_mutex_lock(&label_lock);
    *count = nlive;
    *overflowed = labels_overflowed;
    *bytes = arena_used;
    pthread_mutex_unlock(&label_lock);
}

uint32_t mvz_labels_high(void)
{
    pthread_mutex_lock(&label_lock);
    uint32_t h = high - 1;
    pthread_mutex_unlock(&label_lock);
    return h;
}

uint64_t mvz_labels_reclaims(void)
{
    pthread_mutex_lock(&label_lock);
    uint64_t n = reclaims;
    pthread_mutex_unlock(&label_lock);
    return n;
}

const char *mvz_labels_name(uint32_t id)
{
    const char *s = NULL;
    pthread_mutex_lock(&label_lock);
    if (id > 0 && id < MAX_LABELS)
        s = labels[id]; /* NULL for a free id; freed only by a reclaim, with the GIL */
    pthread_mutex_unlock(&label_lock);
    return s;
}

void mvz_labels_atfork_child(void) { pthread_mutex_init(&label_lock, NULL); }
