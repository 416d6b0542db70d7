"""What memviz puts on PyTorch's autograd graphs, and what it reads from
them: backward-node labels through pre-hooks, the gate that counts running
backward passes, and the tensors a graph keeps saved.

Autograd attribution. Backward nodes run on the autograd engine's threads,
which have no Python frames. Where PyTorch's node layout checks out (probed
once per process, see memviz.torch.probe and src/nodes.h), the C capture
path reads the node the allocating thread is evaluating straight from
PyTorch's thread-local and names it itself: no hooks, no graph walk, nothing
per backward. Elsewhere, before the engine runs, memviz puts a pre-hook on
each node of the graph (AutogradLabels._hook_graph) that sets the running
thread's memviz label to the node's name and forward line; the capture path
reads that label from thread-local storage with no lock.

The forward line comes from PyTorch's node numbers (src/seqmap.h): the
capture path notes which line allocated while the per-thread node counter
stood at each value, and a node numbered k was made by the line that
allocated with the counter at k+1 (an op creates its node, then allocates
its output). This needs no saved-tensor hooks, which cost several
microseconds per saved tensor. When graph residency is recorded
(``graph=True``), the unpack hook also refines the label with the line that
saved what the node reads.

May import: memviz._core, memviz.model (floors: docs/architecture.md); torch
only inside functions.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import memviz._core as _core
from memviz.model.snapshot import encode_node_label
from memviz.model.traceback import Frame

__all__ = ["AutogradLabels", "BACKWARD", "graph_nodes", "listed", "saved_by_graphs"]


def listed(view, tries: int = 8) -> Optional[list]:
    """``list(view)`` of a dict's or set's contents that another thread may be
    changing (an optimizer's first step filling ``opt.state`` while a
    snapshot reads it; a global assigned while a leak's holder is looked
    for). A Python loop over the container gives the GIL away between items
    and raises "dictionary changed size during iteration" when the other
    thread adds one; ``list()`` of a dict or set view copies it in C, where
    the GIL is kept (unless a garbage collection that it triggers runs a
    finaliser: then the copy is taken again). None after ``tries`` changed
    copies: the caller says what it left unread."""
    for _ in range(tries):
        try:
            return list(view)
        except RuntimeError:
            continue
    return None


def graph_nodes(roots) -> list:
    """Every autograd node reachable from ``roots`` (None skipped), once each."""
    nodes, seen = [], set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        try:
            nxt = node.next_functions
        except Exception:  # noqa: BLE001 - a node whose edges cannot be read ends its branch
            continue
        stack.extend(fn for fn, _ in nxt if fn is not None and fn not in seen)
    return nodes


class _BackwardGate:
    """Which threads train. Reading ``p.grad`` (or a node's saved tensors)
    makes a Python object for a tensor that PyTorch's C++ code may be using
    or releasing at that moment without the GIL (backward, the optimizer's
    kernels); PyTorch does not make that safe, and a snapshot taken on one
    thread while another trained crashed the process inside PyTorch (seen
    on the H200 and on the CPU, without memviz too). So a snapshot reads
    those only when no other thread has run a backward pass since tracking
    started (the usual case: the training thread takes its own snapshots),
    and holds the gate while it does, so that no backward can start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth: Dict[int, int] = {}
        self._trained: set = set()  # threads that entered backward while the counter was installed

    def reset(self) -> None:
        with self._lock:
            self._trained = set(self._depth)

    def enter(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            self._depth[ident] = self._depth.get(ident, 0) + 1
            self._trained.add(ident)

    def leave(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            d = self._depth.get(ident, 0) - 1
            if d > 0:
                self._depth[ident] = d
            else:
                self._depth.pop(ident, None)

    def quiet(self) -> "_Quiet":
        """``with BACKWARD.quiet() as ok:``: ok is True (and no backward can
        start until the block ends) when no other thread trains."""
        return _Quiet(self)


class _Quiet:
    def __init__(self, gate: _BackwardGate) -> None:
        self.gate, self.held = gate, False

    def __enter__(self) -> bool:
        self.gate._lock.acquire()
        me = threading.get_ident()
        if any(ident != me for ident in self.gate._depth) or any(i != me for i in self.gate._trained):
            self.gate._lock.release()
            return False
        self.held = True
        return True

    def __exit__(self, *exc) -> None:
        if self.held:
            self.held = False
            self.gate._lock.release()


BACKWARD = _BackwardGate()


#: the _raw_saved_* attributes of each node class
_SAVED_ATTRS: Dict[type, tuple] = {}


def saved_by_graphs(roots) -> set:
    """Storage addresses of the tensors that the autograd graphs reachable
    from ``roots`` keep for backward, read from the nodes themselves, with no
    saved-tensor hooks. Snapshot time only.

    Reads ``node._raw_saved_*`` (PyTorch's SavedTensor objects) and their
    ``.data``, which returns what is stored without calling any unpack hook:
    unpacking (``node._saved_*``) could run a user's hook, move offloaded
    tensors back to the GPU, or re-run a checkpointed forward. A packed
    object that is not a tensor (an offloading or checkpoint handle) is
    skipped; one that is a tensor is what the graph holds."""
    import torch

    tensor = torch.Tensor
    out = set()
    for node in graph_nodes(roots):
        names = _SAVED_ATTRS.get(type(node))
        if names is None:
            names = _SAVED_ATTRS[type(node)] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        for a in names:
            try:
                v = getattr(node, a)
                for sv in v if isinstance(v, (tuple, list)) else (v,):
                    t = sv.data
                    if isinstance(t, tensor):
                        out.add(t.untyped_storage().data_ptr())
            except Exception:  # noqa: BLE001 - freed by backward, or not a saved tensor
                continue
    return out


#: one graph walk at a time swaps torch.autograd.Function._register_hook (see _hook_graph)
_REGISTER_LOCK = threading.Lock()


class _NodeHooks(dict):
    """The pre-hook dict memviz gives a node: weak-referenceable, as
    PyTorch's RemovableHandle needs when the user adds a hook later."""

    __slots__ = ("__weakref__",)


class AutogradLabels:
    """The pre-hook side of autograd attribution, mixed into
    memviz.torch.integration.TorchIntegration. Its state is set by
    ``_init_labels``; the integration sets ``_seq_attached`` and
    ``_nodes_attached`` (memviz.torch.probe), ``_function_cls`` and
    ``_current_node`` when it installs, turns ``_hooks_on[0]`` on and off at
    start and stop, and gives ``graph`` (its GraphRecorder, whose frame
    filter picks forward lines)."""

    graph: Any

    def _init_labels(self) -> None:
        self._seq_attached = False  # PyTorch's node counter handed to the capture path
        self._nodes_attached = False  # the capture path names nodes itself (no pre-hooks)
        self._hooks_on = [False]  # read by every pre-hook: inert once tracking stops
        self._function_cls = None
        self._stack_lines: Dict[int, Optional[str]] = {0: None}
        self._node_hooks: Dict[Any, Any] = {}  # (node name, forward line) -> pre-hook
        self._label_ids: Dict[Any, int] = {}
        self._unpack_labels: Dict[Any, int] = {}
        self._current_node = None

    def _label(self, node_name: str, forward: Optional[str]) -> int:
        key = (node_name, forward)
        lid = self._label_ids.get(key)
        if lid is None:
            lid = self._label_ids[key] = _core.label_intern(encode_node_label(node_name, forward))
        return lid

    def _prehook_for(self, name: str, forward: Optional[str]):
        key = (name, forward)
        hook = self._node_hooks.get(key)
        if hook is None:
            lid = self._label(name, forward)
            label_set = _core.label_set

            def hook(grad_outputs, _lid=lid, _set=label_set, _on=self._hooks_on):
                if _on[0]:  # inert once tracking stops (a retained graph keeps it)
                    _set(_lid)

            hook._memviz_prehook = True  # found and replaced when the node is hooked again
            self._node_hooks[key] = hook
        return hook

    def _forward_lines(self, seqs) -> list:
        """The user line that made each node (by node number), or None."""
        if not self._seq_attached:
            return [None] * len(seqs)
        stacks = _core.seqmap_lookup(seqs)
        lines = self._stack_lines
        todo = {sid for sid in stacks if sid not in lines}
        if todo:
            pick = self.graph.frame_filter.pick  # the same choice as Traceback.user_frame
            for sid, frames in _core.resolve(todo).items():
                frame = pick([Frame(*f) for f in frames or ()])
                lines[sid] = f"{frame.filename}:{frame.lineno}" if frame else None
        return [lines.get(sid) for sid in stacks]

    def _on_unpack(self, packed) -> None:
        # Runs for every saved tensor read in backward, on the node's thread.
        node = self._current_node()
        if node is None or packed.code is None:
            return
        key = (node.name(), packed.code, packed.lineno)
        lid = self._unpack_labels.get(key)
        if lid is None:
            lid = self._unpack_labels[key] = self._label(
                key[0], f"{packed.code.co_filename}:{packed.lineno}")
        _core.label_set(lid)

    def _hook_graph(self, roots) -> None:
        """Pre-hook every node reachable from ``roots``.

        Runs before each backward, in Python, once per node (measured in
        benchmarks/RESULTS.md). A graph run again with retain_graph=True is
        walked again, and each node's memviz hook replaced: a node keeps one.

        PyTorch registers a node pre-hook through
        ``torch.autograd.Function._register_hook``, which builds a
        RemovableHandle per hook: over half of the walk. memviz never removes
        these hooks one by one (they go with the graph, and go inert when
        tracking stops), so during the walk, on this thread only, that
        function is replaced by one that gives a node a fresh dict holding
        the hook and no handle. The dict is weak-referenceable like PyTorch's
        own, so hooks the user adds later to the same node work as usual."""
        nodes = graph_nodes(roots)
        seqs = [n._sequence_nr() for n in nodes]  # AccumulateGrad's is 2**64-1: none
        forwards = self._forward_lines(seqs)
        hooks = self._node_hooks
        make = self._prehook_for

        def register_all():
            for node, forward in zip(nodes, forwards):
                name = node.name()
                node.register_prehook(hooks.get((name, forward)) or make(name, forward))

        cls = self._function_cls
        if cls is None:  # not installed through _install (no torch.autograd.Function at hand)
            register_all()
            return
        # Backwards on two threads walk one after the other, so that each
        # puts back exactly what it found.
        with _REGISTER_LOCK:
            own = cls.__dict__.get("_register_hook")
            original = cls._register_hook
            me = threading.get_ident()

            def register(d, hook, _original=original, _me=me, _ident=threading.get_ident):
                if _ident() != _me:
                    return _original(d, hook)
                if d is None:
                    return _NodeHooks(memviz=hook), None
                # A node hooked before (a retained graph run again): memviz's hook
                # replaced in place, none added (the dict keeps its size: an engine
                # running these hooks on another thread iterates it safely)
                if type(d) is _NodeHooks and "memviz" in d:
                    d["memviz"] = hook
                    return d, None
                for k, v in list(d.items()):  # the user's dict, made before memviz's hook
                    if getattr(v, "_memviz_prehook", False):
                        d[k] = hook
                        return d, None
                return _original(d, hook)

            cls._register_hook = staticmethod(register)
            try:
                register_all()
            finally:
                if own is not None:
                    cls._register_hook = own
                else:
                    del cls._register_hook
