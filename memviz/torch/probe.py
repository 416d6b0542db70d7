"""Probes of this PyTorch build, run once per process before the capture
path trusts it: PyTorch's node counter (at::sequence_number::peek, which
src/seqmap.h reads to tie a backward node to the line that made it) and the
layout of its autograd Node (where libtorch keeps the node being evaluated,
which src/nodes.h reads to name backward nodes with no hooks). Each is
checked end to end on a tiny CPU graph; where a check fails, the callers
fall back to pre-hooks (memviz.torch.hooks).

May import: memviz._core, memviz.model, memviz.torch.hooks (floors:
docs/architecture.md); torch only inside functions, given by the caller.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import memviz._core as _core
from memviz.model.snapshot import decode_label
from memviz.torch.hooks import graph_nodes

__all__ = ["attach_node_numbers", "attach_nodes"]


_PEEK = "_ZN2at15sequence_number4peekEv"  # uint64_t at::sequence_number::peek()


def attach_node_numbers(torch) -> bool:
    """Hand the capture path PyTorch's node counter (see src/seqmap.h).

    Found with ctypes in the libtorch already loaded, and checked on a tiny
    graph before use: the node made next must take the number peek() gives.
    Returns False (forward lines then come only from graph=True) when this
    build of PyTorch does not export it or numbers nodes differently."""
    import ctypes

    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch.so"):
        path = os.path.join(libdir, name)
        if not os.path.exists(path):
            continue
        try:
            peek = getattr(ctypes.CDLL(path), _PEEK)
        except (OSError, AttributeError):
            continue
        peek.restype, peek.argtypes = ctypes.c_uint64, []
        try:
            with torch.inference_mode(False), torch.enable_grad():  # tracking may start under no_grad
                x = torch.zeros(1, requires_grad=True)
                before = peek()
                node = (x * 2).grad_fn
                ok = node is not None and node._sequence_nr() == before and peek() == before + 1
        except Exception:  # noqa: BLE001 - a check, never an error for the user
            ok = False
        if ok:
            _core.seqmap_attach(ctypes.cast(peek, ctypes.c_void_p).value)
            _read_counter_in_place(torch, peek, name)
            return True
    return False


#: Where PyTorch's node counter lives in its library's TLS block, as found
#: by _counter_place: None (not looked for yet), False (not found), or
#: (TLS module id, offset).
_COUNTER_PLACE: Any = None


def _read_counter_in_place(torch, peek, libname: str) -> bool:
    """Let the capture path read PyTorch's node counter where libtorch
    keeps it (one load of the thread's own TLS, src/nodes.h) rather than
    call peek() for every allocation (a call into libtorch and a TLS lookup
    there). The place is found once per process and checked then against
    peek() on this thread and on a new one; each later attach checks it again
    on the attaching thread. Where anything does not agree, peek() stays."""
    global _COUNTER_PLACE
    if not _core.nodes_supported():
        return False
    with _NODE_LOCK:
        first = _COUNTER_PLACE is None
        if first:
            try:
                _COUNTER_PLACE = _counter_place(torch, peek, libname) or False
            except Exception:  # noqa: BLE001 - a probe, never an error for the user
                _COUNTER_PLACE = False
        place = _COUNTER_PLACE
    if not place:
        return False
    try:
        _core.seqmap_attach_counter(*place)
        ok = _counter_agrees(torch, peek, other_thread=first)
    except Exception:  # noqa: BLE001
        ok = False
    if not ok:
        import ctypes

        _core.seqmap_attach(ctypes.cast(peek, ctypes.c_void_p).value)
    return ok


def _counter_place(torch, peek, libname: str):
    """The one 8-byte slot of this thread's TLS block of ``libname`` that
    holds peek()'s value at four different counts, or None."""
    import struct

    found = _core.nodes_module("/" + libname)
    if found is None:
        return None
    modid, memsz = found
    n = memsz // 8
    places = None
    with torch.inference_mode(False), torch.enable_grad():
        x = torch.zeros(1, requires_grad=True)
        for round_ in range(4):
            value = peek()
            words = struct.unpack_from(f"{n}Q", _core.nodes_block(modid, memsz))
            here = {i for i, w in enumerate(words) if w == value}
            places = here if places is None else places & here
            for _ in range(round_ + 1):  # nodes made: the counter moves on
                x * 2
    if not places or len(places) != 1:
        return None
    return modid, places.pop() * 8


def _counter_agrees(torch, peek, other_thread: bool = True) -> bool:
    """The attached reader gives peek()'s value before and after nodes are
    made, here and (other_thread) on a thread that starts after the attach."""

    def check() -> bool:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.zeros(1, requires_grad=True)
            for _ in range(3):
                if _core.seqmap_counter() != peek():
                    return False
                x * 2
        return _core.seqmap_counter() == peek()

    if not other_thread:
        return check()
    result = []
    t = threading.Thread(target=lambda: result.append(check()), name="memviz-probe")
    t.start()
    t.join()
    return check() and result == [True]


#: PyTorch's node layout as found by _probe_node_layout: None (not probed
#: yet), False (not usable here), or the arguments of _core.nodes_attach.
_NODE_LAYOUT: Any = None
_NODE_LOCK = threading.Lock()


def attach_nodes(torch) -> bool:
    """Let the capture path name the autograd node it runs in by itself
    (src/nodes.h): no pre-hooks and no graph walk before each backward.

    The layout of PyTorch's node is probed once per process and checked end
    to end; where any check fails (or MEMVIZ_AUTOGRAD_LABELS=hooks), returns
    False and memviz uses per-node pre-hooks instead."""
    global _NODE_LAYOUT
    if os.environ.get("MEMVIZ_AUTOGRAD_LABELS", "").strip().lower() == "hooks":
        return False
    if not _core.nodes_supported():
        return False
    with _NODE_LOCK:
        if _NODE_LAYOUT is None:
            try:
                layout = _probe_node_layout(torch)
                if layout is not None:
                    _core.nodes_attach(*layout)
                    if not _nodes_agree_with_torch(torch):
                        layout = None
            except Exception:  # noqa: BLE001 - a probe, never an error for the user
                layout = None
            finally:
                _core.nodes_attach(None)
            _NODE_LAYOUT = layout or False
        if not _NODE_LAYOUT:
            return False
        _core.nodes_attach(*_NODE_LAYOUT)
        return True


def _probe_graph(torch):
    """A tiny CPU graph with a generated node, a Python Function and an
    AccumulateGrad: (loss, nodes)."""

    class _MemvizProbe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.ones(2, requires_grad=True)
    loss = _MemvizProbe.apply(x * 2).sin().sum()
    return loss, graph_nodes([loss.grad_fn])


def _run_with_prehooks(torch, on_node):
    """Backward of a fresh probe graph with ``on_node(node)`` run inside
    each node; the graph's nodes."""
    saved = _core.label_get()  # an unpack hook may label this thread meanwhile
    with torch.inference_mode(False), torch.enable_grad():
        loss, nodes = _probe_graph(torch)
        handles = [n.register_prehook(lambda g, _n=n: on_node(_n)) for n in nodes]
        try:
            loss.backward()
        finally:
            for h in handles:
                h.remove()
            _core.label_set(saved)
    return nodes


def _probe_node_layout(torch):
    """Find where libtorch keeps the node being evaluated and what a node
    holds: inside each node of a probe backward, look at every slot of this
    thread's TLS block that is set only there (while what it points to is
    alive), and keep the slot whose targets match PyTorch's own answers for
    every node (node.name(), node._sequence_nr(), the Function's ctx)."""
    import struct

    found = _core.nodes_module("/libtorch_cpu.so")
    if found is None:
        return None
    modid, memsz = found
    n = memsz // 8
    words = lambda block: struct.unpack_from(f"{n}Q", block)  # noqa: E731
    outside = words(_core.nodes_block(modid, memsz))
    inside = []  # per node: (node, {slot: (class name, fields)})

    def look(node):
        now = words(_core.nodes_block(modid, memsz))
        seen = {}
        for i in range(n):
            if now[i] and not outside[i]:
                got = _core.nodes_inspect(now[i], 64)
                if got is not None and got[0] is not None:
                    seen[i] = got
        inside.append((node, seen))

    nodes = _run_with_prehooks(torch, look)
    after = words(_core.nodes_block(modid, memsz))
    if len(inside) != len(nodes) or len(nodes) < 4:
        return None
    function_type = torch.autograd.function.BackwardCFunction
    for i in sorted(set.intersection(*(set(seen) for _, seen in inside))):
        if after[i]:
            continue
        seq_offsets, pynode_vptr, pyobj_offset = None, None, None
        for node, seen in inside:
            cls, fields = seen[i]
            if isinstance(node, function_type):
                matches = [k * 8 for k, f in enumerate(fields) if k and f == id(node)]
                if cls != "torch::autograd::PyNode" or not matches:
                    break
                # PyNode::obj comes after Node's own fields
                pynode_vptr, pyobj_offset = fields[0], matches[-1]
            else:
                seq = node._sequence_nr() & 0xFFFFFFFFFFFFFFFF
                here = {k * 8 for k, f in enumerate(fields) if k and f == seq}
                if cls != node.name() or not here:
                    break
                seq_offsets = here if seq_offsets is None else seq_offsets & here
        else:
            if seq_offsets and pynode_vptr:
                return (modid, i * 8, min(seq_offsets), pynode_vptr, pyobj_offset)
    return None


def _nodes_agree_with_torch(torch) -> bool:
    """With the layout attached: inside every node of a fresh probe backward
    the capture path names that node and its number, and outside none."""
    if _core.nodes_current() is not None:
        return False
    seen = []
    nodes = _run_with_prehooks(torch, lambda node: seen.append((node, _core.nodes_current())))
    if len(seen) != len(nodes) or _core.nodes_current() is not None:
        return False
    for node, got in seen:
        if got is None:
            return False
        seq, label = got
        if seq != node._sequence_nr() & 0xFFFFFFFFFFFFFFFF or decode_label(label)[1] != node.name():
            return False
    return True

