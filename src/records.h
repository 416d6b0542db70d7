/* The named records the C core hands Python: struct sequence types (tuples
 * whose fields also have names), made once at module init, and the builders
 * of the lists of them. Field order and count are the positional contract
 * older readers index by; new readers use the names.
 *
 * With the GIL. Calls labels.c (a label id's text) and the Python API only;
 * the bindings (module.c, module_store.c) call it. */
#ifndef MEMVIZ_RECORDS_H
#define MEMVIZ_RECORDS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "record.h"
#include "types.h"

/* Create the types and add them to the module (AllocationRow, ...).
 * Returns 0, or -1 with an exception set. */
int mvz_records_init(PyObject *module);

/* A label id's text as str, or None (new reference, NULL on error). */
PyObject *mvz_label_obj(uint32_t id);

/* Lists of records. Each frees `rows` (malloc'd by the store); n < 0 means
 * the store ran out of memory (MemoryError). */
PyObject *mvz_alloc_rows(mvz_alloc *rows, long n);
PyObject *mvz_failure_rows(mvz_failure *rows, long n);
PyObject *mvz_site_rows(mvz_site *rows, long n);
PyObject *mvz_timeline_rows(mvz_point *rows, long n);
PyObject *mvz_step_change_rows(mvz_site_change *rows, long n);

/* Single records (new references; NULL on error). */
PyObject *mvz_thread_row(const mvz_thread *t);
/* The row that threads registered past the table share. */
PyObject *mvz_thread_overflow_row(const char *name);
PyObject *mvz_step_totals_row(const mvz_totals *t);
/* filename and name are borrowed. */
PyObject *mvz_frame_row(PyObject *filename, int lineno, PyObject *name);
PyObject *mvz_frame_row_unknown(void);

/* Composite results; they steal the object arguments (which may be NULL
 * after an error: then NULL is returned and the others are released). */
PyObject *mvz_copy_result(PyObject *live, PyObject *totals, PyObject *peaks, PyObject *timeline,
                          uint64_t when_ns, PyObject *tensor_peaks, PyObject *block_totals);
PyObject *mvz_step_mark_result(PyObject *devices, PyObject *changes);
PyObject *mvz_window_open_result(int id, uint64_t start_ns, PyObject *live);
PyObject *mvz_start_result(int result, const char *step, const char *error, const char *holder,
                           int activity, const char *activity_error, int cupti, const char *shared_with);

#endif
