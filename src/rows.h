/* Python's rows: the named records the C core hands Python, as struct
 * sequence types (tuples whose fields also have names), made once at module init, and the builders
 * of the lists of them. Field order and count are the positional contract
 * older readers index by; new readers use the names.
 *
 * With the GIL. Calls labels.c (a label id's text) and the Python API only;
 * the bindings (module.c, module_store.c) call it. */
#ifndef MEMVIZ_ROWS_H
#define MEMVIZ_ROWS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "record.h"
#include "types.h"

/* Create the types and add them to the module (AllocationRow, ...).
 * Returns 0, or -1 with an exception set. */
int mvz_rows_init(PyObject *module);

/* A label id's text as str, or None (new reference, NULL on error). */
PyObject *mvz_rows_label(uint32_t id);

/* Lists of records. Each frees `rows` (malloc'd by the store); n < 0 means
 * the store ran out of memory (MemoryError). */
PyObject *mvz_rows_allocs(mvz_alloc *rows, long n);
PyObject *mvz_rows_failures(mvz_failure *rows, long n);
PyObject *mvz_rows_sites(mvz_site *rows, long n);
PyObject *mvz_rows_timeline(mvz_point *rows, long n);
PyObject *mvz_rows_step_changes(mvz_site_change *rows, long n);

/* Single records (new references; NULL on error). */
PyObject *mvz_rows_thread(const mvz_thread *t);
/* The row that threads registered past the table share. */
PyObject *mvz_rows_thread_overflow(const char *name);
PyObject *mvz_rows_step_totals(const mvz_totals *t);
/* filename and name are borrowed. */
PyObject *mvz_rows_frame(PyObject *filename, int lineno, PyObject *name);
PyObject *mvz_rows_frame_unknown(void);

/* Composite results; they steal the object arguments (which may be NULL
 * after an error: then NULL is returned and the others are released). */
PyObject *mvz_rows_copy(PyObject *live, PyObject *totals, PyObject *peaks, PyObject *timeline,
                          uint64_t when_ns, PyObject *tensor_peaks, PyObject *block_totals);
PyObject *mvz_rows_step_mark(PyObject *devices, PyObject *changes);
PyObject *mvz_rows_window_open(int id, uint64_t start_ns, PyObject *live);
PyObject *mvz_rows_start(int result, const char *step, const char *error, const char *holder,
                           int activity, const char *activity_error, int cupti, const char *shared_with);

#endif
