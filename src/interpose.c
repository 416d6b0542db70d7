/* See interpose.h. Calls down into capture.c (the capture path and the
 * "inside a wrapper" flag) and libfind.c; nothing calls it but module.c. */
#define _GNU_SOURCE
#include "interpose.h"

#include <dlfcn.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "capture.h"
#include "libfind.h"

#if defined(__x86_64__) && defined(__GLIBC__)
#define HAVE_INTERPOSE 1
#else
#define HAVE_INTERPOSE 0
#endif

typedef int (*malloc_async_fn)(void **ptr, size_t size, void *stream);
typedef int (*free_async_fn)(void *ptr, void *stream);
typedef int (*malloc_fn)(void **ptr, size_t size);
typedef int (*free_fn)(void *ptr);

/* Set before any slot points at a wrapper and never cleared: a wrapper that
 * is still running after detach keeps calling the real function. */
static malloc_async_fn real_malloc_async;
static free_async_fn real_free_async;
static malloc_fn real_malloc;
static free_fn real_free;

#define MAX_PATCHES 64
#define MAX_MODULES 32
typedef struct {
    void **slot;
    void *original;
    int relro;
} patch;
/* Per set of wrapped functions (MVZ_WRAP_*): the libraries wrapped (load
 * bases) and the slots written. With the GIL only. */
static struct {
    uintptr_t modules[MAX_MODULES];
    int nmodules;
    patch patches[MAX_PATCHES];
    int npatches;
} sets[MVZ_WRAP_SETS];

int mvz_interpose_attached(int set) { return sets[set].npatches > 0; }

/* Hot path, any thread, no GIL: what PyTorch called, then the capture path
 * that the CUPTI callback uses (capture.c: mvz_capture_async), with the
 * same guarantees. The "inside a wrapper" flag is this thread's own TLS,
 * kept by capture.c (the layer below) so the callback reads it there. */
static int wrap_malloc_async(void **ptr, size_t size, void *stream)
{
    mvz_capture_set_inside(1);
    int r = real_malloc_async(ptr, size, stream);
    mvz_capture_set_inside(0);
    mvz_capture_async(0, r, r == 0 && ptr ? (uint64_t)(uintptr_t)*ptr : 0, size,
                      (uint64_t)(uintptr_t)stream);
    return r;
}

static int wrap_free_async(void *ptr, void *stream)
{
    mvz_capture_set_inside(1);
    int r = real_free_async(ptr, stream);
    mvz_capture_set_inside(0);
    mvz_capture_async(1, r, (uint64_t)(uintptr_t)ptr, 0, (uint64_t)(uintptr_t)stream);
    return r;
}

/* Hot path, any thread, no GIL (PyTorch's allocator mutex held): a segment
 * of PyTorch's caching allocator, recorded by capture.c's segment path only
 * while CUPTI is not held (mvz_capture_segment), with the same guarantees
 * as the CUPTI callback. */
static int wrap_malloc(void **ptr, size_t size)
{
    int r = real_malloc(ptr, size);
    mvz_capture_segment(0, r, r == 0 && ptr ? (uint64_t)(uintptr_t)*ptr : 0, size);
    return r;
}

static int wrap_free(void *ptr)
{
    int r = real_free(ptr);
    mvz_capture_segment(1, r, (uint64_t)(uintptr_t)ptr, 0);
    return r;
}

/* What each set wraps: the names PyTorch's library imports, the wrappers,
 * and where the real functions are kept. */
static const struct {
    const char *alloc_name, *free_name;
} names[MVZ_WRAP_SETS] = {
    [MVZ_WRAP_ASYNC] = {"cudaMallocAsync", "cudaFreeAsync"},
    [MVZ_WRAP_SEGMENTS] = {"cudaMalloc", "cudaFree"},
};

static void *wrapper_of(int set, int is_alloc)
{
    if (set == MVZ_WRAP_ASYNC)
        return is_alloc ? (void *)wrap_malloc_async : (void *)wrap_free_async;
    return is_alloc ? (void *)wrap_malloc : (void *)wrap_free;
}

/* With the GIL: the real pair of `set`, or NULL where none is kept yet. */
static void *real_of(int set, int is_alloc)
{
    void *f;
    if (set == MVZ_WRAP_ASYNC)
        memcpy(&f, is_alloc ? (void *)&real_malloc_async : (void *)&real_free_async, sizeof f);
    else
        memcpy(&f, is_alloc ? (void *)&real_malloc : (void *)&real_free, sizeof f);
    return f;
}

static void keep_real(int set, void *fm, void *ff)
{
    if (set == MVZ_WRAP_ASYNC) {
        memcpy(&real_malloc_async, &fm, sizeof fm);
        memcpy(&real_free_async, &ff, sizeof ff);
    } else {
        memcpy(&real_malloc, &fm, sizeof fm);
        memcpy(&real_free, &ff, sizeof ff);
    }
}

#if HAVE_INTERPOSE
typedef struct {
    ElfW(Addr) base;
    const ElfW(Phdr) *phdr;
    ElfW(Half) phnum;
    const char *name; /* the loader's string: valid while the library is loaded */
} module;

/* glibc rewrites the address entries of a loaded library's dynamic section
 * to absolute addresses; an entry still below the load base is relative. */
static uintptr_t absolute(const module *m, uintptr_t p) { return p < m->base ? p + m->base : p; }

static int write_slot(void **slot, void *value, int relro)
{
    long pg = sysconf(_SC_PAGESIZE);
    void *page = (void *)((uintptr_t)slot & ~(uintptr_t)(pg - 1));
    size_t len = (uintptr_t)(slot + 1) - (uintptr_t)page > (size_t)pg ? 2 * (size_t)pg : (size_t)pg;
    if (mprotect(page, len, PROT_READ | PROT_WRITE) != 0)
        return -1;
    __atomic_store_n(slot, value, __ATOMIC_RELEASE); /* one aligned word: callers see old or new */
    if (relro)
        mprotect(page, len, PROT_READ);
    return 0;
}
#endif

int mvz_interpose_attach(const char *suffix, int set, char *err, size_t errlen)
{
    if (set < 0 || set >= MVZ_WRAP_SETS) {
        snprintf(err, errlen, "no such set of functions to wrap");
        return 0;
    }
#if !HAVE_INTERPOSE
    (void)suffix;
    snprintf(err, errlen, "not supported on this platform (x86-64 glibc only)");
    return 0;
#else
    struct dl_phdr_info info;
    if (!mvz_libfind_loaded(suffix, &info)) {
        snprintf(err, errlen, "no loaded library ends with %s", suffix);
        return 0;
    }
    module m = {info.dlpi_addr, info.dlpi_phdr, info.dlpi_phnum, info.dlpi_name};
    uintptr_t *modules = sets[set].modules;
    patch *patches = sets[set].patches;
    int *nmodules = &sets[set].nmodules, *npatches = &sets[set].npatches;
    const char *alloc_name = names[set].alloc_name, *free_name = names[set].free_name;
    for (int i = 0; i < *nmodules; i++)
        if (modules[i] == m.base) {
            snprintf(err, errlen, "%s is already wrapped", m.name);
            return 0;
        }
    if (*nmodules == MAX_MODULES) {
        snprintf(err, errlen, "too many libraries wrapped");
        return 0;
    }
    const ElfW(Dyn) *dyn = NULL;
    uintptr_t relro_lo = 0, relro_hi = 0;
    for (int i = 0; i < m.phnum; i++) {
        if (m.phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(m.base + m.phdr[i].p_vaddr);
        else if (m.phdr[i].p_type == PT_GNU_RELRO) {
            relro_lo = m.base + m.phdr[i].p_vaddr;
            relro_hi = relro_lo + m.phdr[i].p_memsz;
        }
    }
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *tables[2] = {NULL, NULL};
    size_t sizes[2] = {0, 0};
    for (; dyn && dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)absolute(&m, dyn->d_un.d_ptr); break;
        case DT_STRTAB: strtab = (const char *)absolute(&m, dyn->d_un.d_ptr); break;
        case DT_JMPREL: tables[0] = (const ElfW(Rela) *)absolute(&m, dyn->d_un.d_ptr); break;
        case DT_PLTRELSZ: sizes[0] = dyn->d_un.d_val; break;
        case DT_RELA: tables[1] = (const ElfW(Rela) *)absolute(&m, dyn->d_un.d_ptr); break;
        case DT_RELASZ: sizes[1] = dyn->d_un.d_val; break;
        default: break;
        }
    }
    if (!symtab || !strtab) {
        snprintf(err, errlen, "%s has no dynamic symbol table", m.name);
        return 0;
    }
    patch found[MAX_PATCHES];
    void *wrappers[MAX_PATCHES];
    int n = 0, saw_malloc = 0, saw_free = 0;
    for (int t = 0; t < 2; t++) {
        for (size_t k = 0; tables[t] && k < sizes[t] / sizeof(ElfW(Rela)); k++) {
            const ElfW(Rela) *r = &tables[t][k];
            unsigned type = ELF64_R_TYPE(r->r_info);
            if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT)
                continue;
            const char *name = strtab + symtab[ELF64_R_SYM(r->r_info)].st_name;
            int is_malloc = strcmp(name, alloc_name) == 0;
            int is_free = strcmp(name, free_name) == 0;
            if ((!is_malloc && !is_free) || *npatches + n == MAX_PATCHES)
                continue;
            void **slot = (void **)(m.base + r->r_offset);
            found[n] = (patch){slot, *slot, (uintptr_t)slot >= relro_lo && (uintptr_t)slot < relro_hi};
            wrappers[n++] = wrapper_of(set, is_malloc);
            saw_malloc |= is_malloc;
            saw_free |= is_free;
        }
    }
    if (!saw_malloc && !saw_free) {
        snprintf(err, errlen, "%s imports neither %s nor %s", m.name, alloc_name, free_name);
        return 0;
    }
    /* The functions the library's own lookup would find (its dependencies);
     * both must be there, since wrapping one side only would lose frees or
     * allocations once CUPTI's callbacks for them are off. */
    void *h = dlopen(m.name, RTLD_NOLOAD | RTLD_LAZY);
    void *fm = h ? dlsym(h, alloc_name) : NULL;
    void *ff = h ? dlsym(h, free_name) : NULL;
    if (h)
        dlclose(h);
    if (!fm || !ff) {
        snprintf(err, errlen, "%s/%s not found from %s", alloc_name, free_name, m.name);
        return 0;
    }
    if (!real_of(set, 1)) {
        keep_real(set, fm, ff);
    } else if (real_of(set, 1) != fm || real_of(set, 0) != ff) {
        snprintf(err, errlen, "%s uses another CUDA runtime than the libraries already wrapped", m.name);
        return 0;
    }
    int first = *npatches;
    for (int i = 0; i < n; i++) {
        if (write_slot(found[i].slot, wrappers[i], found[i].relro) != 0) {
            snprintf(err, errlen, "cannot write %s's GOT", m.name);
            while (*npatches > first) { /* this library as it was */
                (*npatches)--;
                write_slot(patches[*npatches].slot, patches[*npatches].original, patches[*npatches].relro);
            }
            return 0;
        }
        patches[(*npatches)++] = found[i];
    }
    modules[(*nmodules)++] = m.base;
    return n;
#endif
}

void mvz_interpose_detach(int set)
{
    if (set < 0 || set >= MVZ_WRAP_SETS)
        return;
#if HAVE_INTERPOSE
    for (int i = sets[set].npatches - 1; i >= 0; i--)
        write_slot(sets[set].patches[i].slot, sets[set].patches[i].original, sets[set].patches[i].relro);
#endif
    sets[set].npatches = 0;
    sets[set].nmodules = 0;
}
