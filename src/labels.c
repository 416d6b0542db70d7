/* The label table (labels.h). A leaf: calls only pthreads and libc string
 * functions. Guarded by label_lock, a leaf lock held for a bounded time. */
#include "labels.h"

#include <pthread.h>
#include <string.h>

/* Ids fit the trace's 16 bits; the last one is the overflow label, which
 * every label that finds no room (no id left, or no arena space) gets. */
#define MAX_LABELS MVZ_MAX_LABELS
#define LABEL_OVERFLOW (MAX_LABELS - 1)
#define LABEL_SLOTS (2 * MAX_LABELS) /* hash index, at most half full */
static const char overflow_name[] = MVZ_LABEL_OVERFLOW_NAME;
static const char *labels[MAX_LABELS] = {[LABEL_OVERFLOW] = overflow_name};
/* mvz_label_node[i] (labels.h): labels[i] names an autograd node ("\x01...");
 * written before the id is published to anyone, read lock-free in the
 * callback. */
uint8_t mvz_label_node[MVZ_MAX_LABELS];
static uint32_t nlabels = 1; /* 0 means "no label" */
static uint32_t label_slots[LABEL_SLOTS]; /* id, or 0 for an empty slot */
static uint64_t labels_overflowed;        /* requests answered with LABEL_OVERFLOW */
static pthread_mutex_t label_lock = PTHREAD_MUTEX_INITIALIZER;
/* Label strings, never freed: 4 MiB of zero pages until used. */
static char arena[4u << 20];
static size_t arena_used;

static uint32_t label_hash(const char *s, size_t len)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h;
}

/* Any thread, also the driver callback (nodes.c, once per new node label):
 * label_lock is a leaf lock, and whoever holds it does a bounded amount of
 * work (one hash probe sequence in a table kept at most half full, and a
 * copy into the static arena): no malloc, no Python, no other lock. */
uint32_t mvz_label_intern(const char *name)
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
        if (strcmp(name, overflow_name) == 0) {
            id = LABEL_OVERFLOW;
        } else if (nlabels < LABEL_OVERFLOW && len < sizeof arena - arena_used) {
            char *copy = arena + arena_used; /* the callback interns too: no malloc */
            memcpy(copy, name, len + 1);
            arena_used += len + 1;
            id = nlabels;
            labels[id] = copy;
            mvz_label_node[id] = name[0] == '\x01';
            label_slots[i] = id;
            nlabels++;
        } else {
            id = LABEL_OVERFLOW; /* the table is full: counted, never an error */
            labels_overflowed++;
        }
    }
    pthread_mutex_unlock(&label_lock);
    return id;
}

void mvz_label_stats(uint32_t *count, uint64_t *overflowed, uint64_t *bytes)
{
    pthread_mutex_lock(&label_lock);
    *count = nlabels - 1;
    *overflowed = labels_overflowed;
    *bytes = arena_used;
    pthread_mutex_unlock(&label_lock);
}

const char *mvz_label_name(uint32_t id)
{
    const char *s = NULL;
    pthread_mutex_lock(&label_lock);
    if ((id > 0 && id < nlabels) || id == LABEL_OVERFLOW)
        s = labels[id]; /* never freed, so the pointer stays valid */
    pthread_mutex_unlock(&label_lock);
    return s;
}

void mvz_labels_atfork_child(void) { pthread_mutex_init(&label_lock, NULL); }
