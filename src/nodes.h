/* The autograd node running on this thread, read in the driver callback.
 *
 * PyTorch's engine keeps the node it is evaluating in a C++ thread-local of
 * libtorch_cpu (`current_evaluating_node`, set around every node, on every
 * engine thread and on the caller's thread for CPU backward). memviz reads
 * that pointer straight out of the thread's TLS block (__tls_get_addr with
 * libtorch's module id and the slot's offset), then reads the node's vtable
 * (Itanium C++ ABI: vptr -> typeinfo -> mangled class name), its
 * sequence_nr_ field and, for a Python autograd.Function (PyNode), the type
 * name of its ctx object. No PyTorch function is called, no refcount is
 * touched, no Python is run, so it is safe in the callback.
 *
 * Nothing of that layout is assumed: Python probes it once per process on a
 * tiny CPU graph (memviz/torch/integration.py: _probe_node_layout) using the
 * helpers below, checks every field against what PyTorch's own Python API
 * says about the same nodes, and only then attaches. If anything does not
 * match (another PyTorch, another C++ ABI, another platform), memviz falls
 * back to per-node pre-hooks set from Python before each backward.
 *
 * Why not call torch::autograd::get_current_node()? It returns a counted
 * pointer by value: the copy bumps the node's refcount, and on recent
 * PyTorch that bump may incref the node's Python object, which needs the
 * GIL the callback must never take. */
#ifndef MEMVIZ_NODES_H
#define MEMVIZ_NODES_H

#include <stddef.h>
#include <stdint.h>

#include "hot.h"

typedef struct {
    size_t modid;            /* libtorch's TLS module id */
    size_t tls_offset;       /* offset of the current-node pointer in its block */
    size_t seq_offset;       /* offset of Node::sequence_nr_ */
    const void *pynode_vptr; /* vtable of torch::autograd::PyNode */
    size_t pyobj_offset;     /* offset of PyNode::obj (the ctx object) */
} mvz_node_layout;

/* 1 where this build can read another module's TLS (x86-64 glibc). */
int mvz_nodes_supported(void);

/* With the GIL. NULL detaches. */
void mvz_nodes_attach(const mvz_node_layout *layout);

/* Hot path (any thread, no GIL): the node this thread is evaluating, or NULL
 * when not attached or not inside a node. Inline: the attached layout (the
 * capture path's read-mostly line) and this thread's slot of libtorch's,
 * whose address is in this thread's TLS line (hot.h); found out of line
 * (mvz_nodes_slot_find) once per thread and layout. */
const void *mvz_nodes_slot_find(const void *layout);
static inline const void *mvz_nodes_current(void)
{
    const void *L = __atomic_load_n(&mvz_hot.node_layout, __ATOMIC_ACQUIRE);
    if (!L)
        return NULL;
    if (__builtin_expect(L != mvz_tl.slot_layout, 0))
        return mvz_nodes_slot_find(L);
    return *mvz_tl.slot;
}

/* PyTorch's node counter (the value at::sequence_number::peek returns),
 * read in place: a thread-local of libtorch at `offset` in the TLS block of
 * the module `modid` (found and checked by memviz/torch/probe.py). With the
 * GIL; returns 0, or -1 where TLS cannot be read so (then peek is called).
 * A place once set stays readable: later calls may only name the same one. */
int mvz_nodes_counter_at(size_t modid, size_t offset);
/* Hot path, no GIL: this thread's node counter, read in place (one load of
 * this thread's slot of libtorch's; once per thread a TLS lookup, as
 * mvz_nodes_current's). Only once mvz_nodes_counter_at returned 0. */
uint64_t mvz_nodes_counter(void);

/* Hot path: the node's sequence number (0 when not attached). */
uint64_t mvz_nodes_seq(const void *node);

/* Hot path: the label id naming `node` and the forward stack of its number
 * ("\x01<name>\x1f#<stack id>"), interned; 0 if the label table is full. */
uint32_t mvz_nodes_label(const void *node);
/* Hot path: the label id naming `node`'s class alone ("\x01<name>\x1f"):
 * the capture path's, whose forward line the store adds as it applies the
 * allocation (store.h, mvz_store_node_line), off the allocating thread. */
uint32_t mvz_nodes_class_label(const void *node);
/* With the GIL, nothing capturing: forget the cached node labels (their
 * ids and texts), after mvz_labels_reclaim freed ids. */
void mvz_nodes_forget_labels(void);
/* After fork, in the child: the cache's lock is fresh (a parent's thread
 * may have held it on a miss). */
void mvz_nodes_atfork_child(void);

/* Probing, with the GIL ------------------------------------------------- */

/* TLS module id and TLS size of the loaded library whose path ends with
 * `suffix`; returns 0 when not found or without TLS. */
int mvz_nodes_module(const char *suffix, size_t *modid, size_t *memsz);

/* This thread's TLS block of module `modid`. */
void *mvz_nodes_block(size_t modid);

/* Copies n bytes at addr into buf; returns 0, or -1 where addr is not
 * readable (checked by the kernel, no fault). */
int mvz_nodes_safe_read(const void *addr, void *buf, size_t n);

/* The C++ class name of a polymorphic object at addr, as labels show it
 * (torch::autograd::generated::X -> X), into buf; -1 when unreadable. */
int mvz_nodes_class_name(const void *addr, char *buf, size_t n);

#endif
