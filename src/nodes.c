/* See nodes.h. Calls down into labels.c, libfind.c and seqmap.c only. */
#define _GNU_SOURCE 1 /* as pyconfig.h spells it: no redefinition warning */
#include "nodes.h"
#include "hot.h"

#include <Python.h>
#include <errno.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "labels.h"
#include "types.h"
#include "libfind.h"
#include "seqmap.h"

#if defined(__x86_64__) && defined(__GLIBC__)
#define HAVE_TLS_READ 1
typedef struct {
    unsigned long ti_module;
    unsigned long ti_offset;
} tls_index_t;
extern void *__tls_get_addr(tls_index_t *ti); /* glibc's x86-64 TLS ABI */
#else
#define HAVE_TLS_READ 0
#endif

/* Layouts are never freed or rewritten once published, so a callback that
 * loaded the pointer just before a detach still reads valid numbers. */
#define MAX_LAYOUTS 8
static mvz_node_layout layouts[MAX_LAYOUTS];
static int nlayouts;

int mvz_nodes_supported(void) { return HAVE_TLS_READ; }

void mvz_nodes_attach(const mvz_node_layout *layout)
{
    if (!layout || !HAVE_TLS_READ) {
        __atomic_store_n(&mvz_hot.node_layout, NULL, __ATOMIC_RELEASE);
        return;
    }
    const mvz_node_layout *use = NULL;
    for (int i = 0; i < nlayouts && !use; i++)
        if (memcmp(&layouts[i], layout, sizeof *layout) == 0)
            use = &layouts[i];
    if (!use && nlayouts < MAX_LAYOUTS) {
        layouts[nlayouts] = *layout;
        use = &layouts[nlayouts++];
    }
    __atomic_store_n(&mvz_hot.node_layout, use, __ATOMIC_RELEASE);
}

/* This thread's address of libtorch's slot (mvz_tl.slot, hot.h), and the
 * layout it was found by (mvz_tl.slot_layout): a module's TLS block never
 * moves for the life of a thread, and a layout is never rewritten (see
 * above), so the address stays good. */

/* Hot path, no GIL: this thread's own TLS and one load of this thread's own
 * slot of libtorch's. Once per thread and layout, one TLS lookup (glibc's
 * fast path: libtorch's block on this thread already exists because
 * PyTorch wrote the slot; on a thread PyTorch never ran on, glibc
 * allocates the block once, as PyTorch's own first access would). */
const void *mvz_nodes_slot_find(const void *layout)
{
#if HAVE_TLS_READ
    const mvz_node_layout *L = layout;
    tls_index_t ti = {L->modid, L->tls_offset};
    mvz_tl.slot = (const void *const *)__tls_get_addr(&ti);
    mvz_tl.slot_layout = L;
    return *mvz_tl.slot;
#else
    (void)layout;
    return NULL; /* never attached here (mvz_nodes_attach) */
#endif
}

/* PyTorch's node counter, in place: set once (the GIL), never moved. */
static size_t counter_modid, counter_offset;
static int counter_set; /* atomic: 1 once the two above are written */
#if HAVE_TLS_READ
static __thread const uint64_t *tl_counter __attribute__((tls_model("initial-exec")));
#endif

int mvz_nodes_counter_at(size_t modid, size_t offset)
{
#if HAVE_TLS_READ
    if (__atomic_load_n(&counter_set, __ATOMIC_ACQUIRE))
        return counter_modid == modid && counter_offset == offset ? 0 : -1;
    counter_modid = modid;
    counter_offset = offset;
    __atomic_store_n(&counter_set, 1, __ATOMIC_RELEASE);
    return 0;
#else
    (void)modid;
    (void)offset;
    return -1;
#endif
}

/* Hot path, no GIL: one load of this thread's own slot of libtorch's TLS
 * (the address looked up once per thread, as in mvz_nodes_current; the
 * place never changes once set). No call into libtorch, no lock. */
MVZ_HOT uint64_t mvz_nodes_counter(void)
{
#if HAVE_TLS_READ
    const uint64_t *p = tl_counter;
    if (__builtin_expect(p == NULL, 0)) {
        if (!__atomic_load_n(&counter_set, __ATOMIC_ACQUIRE))
            return 0;
        tls_index_t ti = {counter_modid, counter_offset};
        p = tl_counter = (const uint64_t *)__tls_get_addr(&ti);
    }
    return *p;
#else
    return 0;
#endif
}

/* Hot path, no GIL: `node` is the one this thread is evaluating, so the
 * engine holds a reference to it for as long as we can be here. */
MVZ_HOT uint64_t mvz_nodes_seq(const void *node)
{
    const mvz_node_layout *L = __atomic_load_n(&mvz_hot.node_layout, __ATOMIC_ACQUIRE);
    if (!L || !node)
        return 0;
    return *(const uint64_t *)((const char *)node + L->seq_offset);
}

/* ---- class names ------------------------------------------------------- */

/* "N5torch8autograd9generated12MmBackward0E" -> "MmBackward0";
 * "N5torch8autograd14AccumulateGradE" -> "torch::autograd::AccumulateGrad"
 * (PyTorch's own Node::name() for both). Anything else (templates, such as
 * a C++ extension's CppNode<T>) stays mangled: demangling would allocate,
 * and this runs in the driver callback. No allocation, bounded loops. */
static void pretty_class(const char *m, char *out, size_t n)
{
    if (m[0] == '*') /* GCC marks local-linkage type names so */
        m++;
    char tmp[256];
    size_t len = 0;
    int parts = 0, ok = 1;
    const char *p = m;
    int nested = *p == 'N';
    if (nested)
        p++;
    while (ok && *p && *p != 'E') {
        if (*p < '0' || *p > '9') {
            ok = 0;
            break;
        }
        size_t k = 0;
        while (*p >= '0' && *p <= '9' && k < 100000)
            k = k * 10 + (size_t)(*p++ - '0');
        if (k == 0 || strnlen(p, k) < k || len + k + 3 >= sizeof tmp) {
            ok = 0;
            break;
        }
        if (parts++)
            tmp[len++] = ':', tmp[len++] = ':';
        memcpy(tmp + len, p, k);
        len += k;
        p += k;
        if (!nested)
            break;
    }
    if (ok && parts && (nested ? *p == 'E' && p[1] == 0 : *p == 0)) {
        tmp[len] = 0;
        const char *s = tmp;
        static const char gen[] = "torch::autograd::generated::";
        if (strncmp(s, gen, sizeof gen - 1) == 0)
            s += sizeof gen - 1;
        snprintf(out, n, "%s", s);
        return;
    }
    snprintf(out, n, "%s", m);
}

/* With a live node (hot path) or after safe reads (probe). */
static const char *mangled_of(const void *obj)
{
    const void *const *vptr = *(const void *const *const *)obj;
    const void *const *ti = (const void *const *)vptr[-1];
    return (const char *)ti[1];
}

int mvz_nodes_safe_read(const void *addr, void *buf, size_t n)
{
    int fds[2];
    if (n == 0 || n > 4096 || pipe(fds) != 0)
        return -1;
    /* The kernel copies (EFAULT, not a fault, if unreadable). A raw syscall,
     * so that sanitizers do not take a probe's deliberate read past a small
     * object for a bug. */
    ssize_t w = syscall(SYS_write, fds[1], addr, n);
    ssize_t r = w == (ssize_t)n ? read(fds[0], buf, n) : -1;
    close(fds[0]);
    close(fds[1]);
    return r == (ssize_t)n ? 0 : -1;
}

int mvz_nodes_class_name(const void *addr, char *buf, size_t n)
{
    const void *vptr, *ti, *name;
    char mangled[256];
    if (mvz_nodes_safe_read(addr, &vptr, sizeof vptr) || (uintptr_t)vptr < 4096 ||
        mvz_nodes_safe_read((const char *)vptr - sizeof(void *), &ti, sizeof ti) || !ti ||
        mvz_nodes_safe_read((const char *)ti + sizeof(void *), &name, sizeof name) || !name)
        return -1;
    size_t len = 0;
    while (len < sizeof mangled - 1) { /* byte by byte: the name may end near a page end */
        if (mvz_nodes_safe_read((const char *)name + len, mangled + len, 1))
            return -1;
        if (!mangled[len])
            break;
        len++;
    }
    mangled[len] = 0;
    pretty_class(mangled, buf, n);
    return 0;
}

/* ---- labels ------------------------------------------------------------ */

/* (class or ctx type name, forward stack) -> label id. Entries are written
 * once under `cache_lock` with the key published last, and never change, so
 * readers need no lock. The lock is a leaf except for the label table's
 * lock taken inside it (never the other way round). */
#define CACHE (1u << 12)
#define PROBES 16
typedef struct {
    const void *key; /* vtable, or the ctx type's name for a Python Function */
    uint32_t stack;
    uint32_t label;
    const char *name; /* a Python name: the interned label's copy, to catch a reused address */
} entry;
static entry cache[CACHE];
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

static uint32_t slot_of(const void *key, uint32_t stack)
{
    uint64_t h = ((uint64_t)(uintptr_t)key >> 3) * 0x9E3779B97F4A7C15ull ^ (uint64_t)stack * 0xC2B2AE3D27D4EB4Full;
    return (uint32_t)(h >> 40) & (CACHE - 1);
}

/* `label_name` is "<name>\x1f..." (the interned label past its marker). */
static int same_name(const char *label_name, const char *name)
{
    size_t n = strlen(name);
    return strncmp(label_name, name, n) == 0 && label_name[n] == '\x1f';
}

MVZ_HOT static uint32_t cached(const void *key, uint32_t stack, const char *pyname)
{
    uint32_t s = slot_of(key, stack);
    for (uint32_t i = 0; i < PROBES; i++) {
        entry *e = &cache[(s + i) & (CACHE - 1)];
        const void *k = __atomic_load_n(&e->key, __ATOMIC_ACQUIRE);
        if (!k)
            return 0;
        if (k == key && e->stack == stack && (!pyname || same_name(e->name, pyname)))
            return e->label;
    }
    return 0;
}

/* Hot path, no GIL. Reads the live node this thread evaluates (see
 * mvz_nodes_seq) and, for a Python Function, its ctx object's type name:
 * the node holds a reference to the ctx, and a type's tp_name is a plain C
 * string, so no Python API runs. A miss (once per class and forward line)
 * takes cache_lock and the label table's lock, both leaf locks, and
 * allocates nothing. */
static uint32_t label_with(const mvz_node_layout *L, const void *node, uint32_t stack);

uint32_t mvz_nodes_label(const void *node)
{
    const mvz_node_layout *L = __atomic_load_n(&mvz_hot.node_layout, __ATOMIC_ACQUIRE);
    if (!L || !node)
        return 0;
    return label_with(L, node, mvz_seqmap_stack(*(const uint64_t *)((const char *)node + L->seq_offset)));
}

/* Hot path, no GIL: as mvz_nodes_label, the forward line left out (the
 * store adds it): no read of the seqmap's ring, and one cache entry per
 * class rather than per class and line. */
MVZ_HOT uint32_t mvz_nodes_class_label(const void *node)
{
    const mvz_node_layout *L = __atomic_load_n(&mvz_hot.node_layout, __ATOMIC_ACQUIRE);
    if (!L || !node)
        return 0;
    return label_with(L, node, 0);
}

/* Hot path, no GIL: the node's label with the forward line `stack` (0:
 * none), from the lock-free cache, else formatted and interned once under
 * cache_lock (and the label table's). */
MVZ_HOT static uint32_t label_with(const mvz_node_layout *L, const void *node, uint32_t stack)
{
    const void *vptr = *(const void *const *)node;
    const void *key = vptr;
    const char *pyname = NULL;
    if (vptr == L->pynode_vptr) {
        PyObject *ctx = *(PyObject *const *)((const char *)node + L->pyobj_offset);
        if (ctx) {
            pyname = Py_TYPE(ctx)->tp_name;
            key = pyname;
        }
    }
    uint32_t id = cached(key, stack, pyname);
    if (id)
        return id;
    /* Miss: once per class (or Function) and forward line. Formats on the
     * stack, interns into the label table's static arena: no allocation. */

    char name[256], label[300];
    if (pyname)
        snprintf(name, sizeof name, "%s", pyname);
    else
        pretty_class(mangled_of(node), name, sizeof name);
    if (stack)
        snprintf(label, sizeof label, "\x01%s\x1f#%u", name, stack);
    else
        snprintf(label, sizeof label, "\x01%s\x1f", name);

    pthread_mutex_lock(&cache_lock);
    id = cached(key, stack, pyname);
    if (!id) {
        id = mvz_labels_intern(label);
        const char *interned = id ? mvz_labels_name(id) : NULL; /* never freed */
        uint32_t s = slot_of(key, stack);
        for (uint32_t i = 0; interned && i < PROBES; i++) {
            entry *e = &cache[(s + i) & (CACHE - 1)];
            if (e->key)
                continue;
            e->stack = stack;
            e->label = id;
            e->name = interned + 1;
            __atomic_store_n(&e->key, key, __ATOMIC_RELEASE);
            break;
        } /* table full: not cached, the next call interns again */
    }
    pthread_mutex_unlock(&cache_lock);
    return id;
}

/* With the GIL, while nothing captures (after the label table's reclaim,
 * labels.h): the cache's lock-free readers run only on the capture path,
 * which is off, so clearing the entries races with no reader. */
void mvz_nodes_forget_labels(void)
{
    pthread_mutex_lock(&cache_lock);
    memset(cache, 0, sizeof cache);
    pthread_mutex_unlock(&cache_lock);
}

void mvz_nodes_atfork_child(void) { pthread_mutex_init(&cache_lock, NULL); }

/* ---- probing ----------------------------------------------------------- */

int mvz_nodes_module(const char *suffix, size_t *modid, size_t *memsz)
{
    struct dl_phdr_info info;
    *modid = *memsz = 0;
    if (!mvz_libfind_loaded(suffix, &info) || !info.dlpi_tls_modid)
        return 0;
    for (int i = 0; i < info.dlpi_phnum; i++)
        if (info.dlpi_phdr[i].p_type == PT_TLS) {
            *modid = info.dlpi_tls_modid;
            *memsz = info.dlpi_phdr[i].p_memsz;
            return 1;
        }
    return 0;
}

void *mvz_nodes_block(size_t modid)
{
#if HAVE_TLS_READ
    tls_index_t ti = {modid, 0};
    return __tls_get_addr(&ti);
#else
    (void)modid;
    return NULL;
#endif
}
