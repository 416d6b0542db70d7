/* Code-object lifetimes (codeobj.c): the code objects that captured stacks
 * point at are kept alive (adopted) with the GIL, or resolved to
 * (filename, lineno, name, call) tuples when they die first. */
#ifndef MEMVIZ_CODEOBJ_H
#define MEMVIZ_CODEOBJ_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* With the GIL: take references to the code objects of stacks interned
 * since the last call. */
void mvz_codeobj_adopt_pending(void);

/* With the GIL, before capture starts: watch code-object deaths (and, on
 * Python < 3.12, schedule adoption from the capture path). Stays on once
 * set. Returns 0, or -1 with an exception set. */
int mvz_codeobj_watch(void);

/* set_call_namer(fn or None), for the module's method table. */
extern PyMethodDef mvz_codeobj_methods[];

#endif
