/* What the binding files (module.c, module_store.c, module_seed.c, module_heap.c,
 * module_trace.c, module_replay.c)
 * share. Header only; with the GIL. */
#ifndef MEMVIZ_BIND_H
#define MEMVIZ_BIND_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* No store.h here: module_heap.c and module_replay.c read no store. */

/* 0 when the store is ready, else -1 with RuntimeError set (module_store.c). */
int mvz_module_store_ensure(void);

/* The store's readers and window bindings (module_store.c). */
extern PyMethodDef mvz_module_store_bindings[];
/* What memviz did not see happen: seed, retire, block_rules (module_seed.c). */
extern PyMethodDef mvz_module_seed_bindings[];
/* Python's tracked objects by kind, for the categories (module_heap.c). */
extern PyMethodDef mvz_module_heap_bindings[];
/* The trace ring's and the native trace writer's bindings (module_trace.c). */
extern PyMethodDef mvz_module_trace_bindings[];
/* Adds _core.Replayer, a loaded trace's streaming replay (module_replay.c). */
int mvz_module_replay_init(PyObject *m);
int mvz_module_whatif_init(PyObject *m); /* module_whatif.c: memviz._core.WhatIf */

#endif
