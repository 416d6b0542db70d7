"""The PyTorch integration: autograd op labels, categories, graph residency
and out-of-memory reports, installed when tracking starts and removed when it
stops (nothing is left on the user's graph, modules or optimizers).

Autograd attribution. Backward nodes run on the autograd engine's threads,
which have no Python frames. Where PyTorch's node layout checks out (probed
once per process, see _probe_node_layout and src/nodes.h), the C capture
path reads the node the allocating thread is evaluating straight from
PyTorch's thread-local and names it itself: no hooks, no graph walk, nothing
per backward. Elsewhere, before the engine runs, memviz puts a pre-hook on
each node of the graph that sets the running thread's memviz label to the
node's name and forward line; the capture path reads that label from
thread-local storage with no lock.

The forward line comes from PyTorch's node numbers (src/seqmap.h): the
capture path notes which line allocated while the per-thread node counter
stood at each value, and a node numbered k was made by the line that
allocated with the counter at k+1 (an op creates its node, then allocates
its output). This needs no saved-tensor hooks, which cost several
microseconds per saved tensor. When graph residency is recorded
(``graph=True``), the unpack hook also refines the label with the line that
saved what the node reads.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any, Dict, Optional

from memviz import _core
from memviz.model.traceback import Frame, innermost_first
from memviz.model.snapshot import Snapshot, decode_label, encode_node_label
from memviz.torch import allocator as _alloc
from memviz.torch import precise as _precise
from memviz.model import segments as _segments
from memviz.torch.graph import GraphRecorder

__all__ = ["attach", "TorchIntegration"]

_CHECKPOINT_FILE = "torch/utils/checkpoint.py"


_PEEK = "_ZN2at15sequence_number4peekEv"  # uint64_t at::sequence_number::peek()


def _attach_node_numbers(torch) -> bool:
    """Hand the capture path PyTorch's node counter (see src/seqmap.h).

    Found with ctypes in the libtorch already loaded, and checked on a tiny
    graph before use: the node made next must take the number peek() gives.
    Returns False (forward lines then come only from graph=True) when this
    build of PyTorch does not export it or numbers nodes differently."""
    import ctypes
    import os

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
            return True
    return False


#: PyTorch's node layout as found by _probe_node_layout: None (not probed
#: yet), False (not usable here), or the arguments of _core.nodes_attach.
_NODE_LAYOUT: Any = None
_NODE_LOCK = threading.Lock()


def _attach_nodes(torch) -> bool:
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
    nodes, stack = [], [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.append(node)
            stack.extend(fn for fn, _ in node.next_functions)
    return loss, nodes


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
                pynode_vptr, pyobj_offset = fields[0], matches[-1]  # PyNode::obj comes after Node's own fields
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


_REGISTER_LOCK = threading.Lock()


class _NodeHooks(dict):
    """The pre-hook dict memviz gives a node: weak-referenceable, as
    PyTorch's RemovableHandle needs when the user adds a hook later."""

    __slots__ = ("__weakref__",)


_SAVED_ATTRS: Dict[type, tuple] = {}


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


def _saved_by_graphs(roots) -> set:
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
    out, seen, stack = set(), set(), list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
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
        try:
            nxt = node.next_functions
        except Exception:  # noqa: BLE001
            continue
        stack.extend(fn for fn, _ in nxt if fn is not None and fn not in seen)
    return out


def attach(tracker) -> "TorchIntegration":
    """Add the integration to ``tracker``'s plugins (precise mode acts now)."""
    integ = TorchIntegration(tracker)
    tracker._plugins.insert(0, integ)
    tracker.torch = integ
    return integ


class TorchIntegration:
    def __init__(self, tracker) -> None:
        self.autograd = tracker.autograd
        self._hooks_allowed = getattr(tracker, "autograd_requested", True)
        self.record_graph = tracker.record_graph
        self.graph = GraphRecorder(on_unpack=self._on_unpack, frame_filter=tracker.frame_filter)
        if self.record_graph:
            tracker.graph = self.graph
        self._seq_attached = False
        self._nodes_attached = False
        self._precise = tracker.precise
        self._wrapped = False
        #: How precise mode captures PyTorch's allocations (None outside it).
        self.precise_capture: Optional[str] = None
        self._hooks_on = [False]
        self._function_cls = None
        self._stack_lines: Dict[int, Optional[str]] = {0: None}
        self._tracker = weakref.ref(tracker)
        self._node_hooks: Dict[Any, Any] = {}  # (node name, forward line) -> pre-hook
        self._label_ids: Dict[Any, int] = {}
        self._unpack_labels: Dict[Any, int] = {}
        self._current_node = None
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._handles: list = []
        self._patched = []
        self._active = False
        self.oom_report = None
        #: how PyTorch's memory is seen (memviz.torch.allocator.Route)
        self.route: Optional[_alloc.Route] = None
        self._answers = None  # the allocator route's answers while attached by this tracker
        #: the running tracker's integration whose allocator route this nested one reads
        self.route_from: Optional["TorchIntegration"] = None
        self._pool_segments: set = set()  # (device, address) of segments PyTorch showed
        #: the last snapshot left gradients and saved tensors unread: another
        #: thread trains (see _BackwardGate)
        self.categories_partial = False

    # -- lifecycle ---------------------------------------------------------

    def on_start(self, tracker) -> None:
        self._active = True
        self._hooks_on[0] = True
        if "torch" in sys.modules:
            self._install()
        else:  # e.g. `python -m memviz run`: hook in once the script imports torch
            self._watcher = _PostImport("torch", self._install)
            sys.meta_path.insert(0, self._watcher)

    def _install(self) -> None:
        if not self._active:
            return
        import torch

        self._current_node = torch._C._current_autograd_node
        if self._precise and _precise.active():
            self.precise_capture = _precise.attach_wrappers()
            self._wrapped = self.precise_capture.startswith("wrappers")
        self._choose_route(torch)
        if self.autograd:  # before the graph hooks: the probes run a tiny backward
            self._function_cls = torch.autograd.Function
            self._seq_attached = _attach_node_numbers(torch)
            self._nodes_attached = _attach_nodes(torch)
        import torch.autograd.graph as agraph
        if getattr(agraph._engine_run_backward, "__module__", None) != __name__:
            # Counts the backward passes running (BACKWARD), so that a snapshot on another
            # thread never reads what the engine writes without the GIL; and, with
            # autograd=True where the callback cannot name nodes, the pre-hooks.
            BACKWARD.reset()
            self._patch_backward(torch)
        if self.record_graph:
            self.graph.start()
        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._handles.append(register_optimizer_step_pre_hook(self._on_optimizer_step))
        except ImportError:  # very old torch
            pass
        observer = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if observer is not None and torch.cuda.is_available():
            ref = weakref.ref(self)

            def on_oom(device, alloc, device_total, device_free):
                me = ref()
                if me is not None and me._active:
                    me._on_oom(device, alloc, device_total, device_free)

            try:
                observer(on_oom)  # torch offers no detach: the closure goes inert at stop
            except Exception:  # noqa: BLE001 - e.g. an allocator without observers
                pass

    # -- how PyTorch's memory is seen ----------------------------------------

    def _choose_route(self, torch) -> None:
        """The allocator route where it can be had (memviz.torch.allocator),
        else why not."""
        if self.route_from is not None:  # nested: the outer tracker's route, read not owned
            self.route = self.route_from.route
            return
        if _precise.active():
            self.route = _alloc.Route(
                "cudaMallocAsync", "PyTorch runs its cudaMallocAsync backend: every tensor is a "
                "driver call memviz sees" + (f" ({self.precise_capture})" if self.precise_capture else ""))
            return
        try:
            available = torch.cuda.is_available()
            backend = torch.cuda.get_allocator_backend() if available else None
        except Exception as e:  # noqa: BLE001 - a CPU build
            available, backend = False, f"{type(e).__name__}: {e}"
        if not available:
            self.route = _alloc.Route("segments", "this PyTorch sees no CUDA device")
        elif backend != "native":
            self.route = _alloc.Route("segments", f"PyTorch runs the {backend!r} allocator backend, "
                                      "which memviz cannot see block by block")
        elif not torch.cuda.is_initialized():
            # Probing allocates; let the user's first CUDA use initialise CUDA.
            self.route = _alloc.Route("segments", "waiting for PyTorch to initialise CUDA "
                                      "(memviz attaches to its allocator then)")
            ref = weakref.ref(self)

            def attach_later(_ref=ref, _torch=torch):
                me = _ref()
                if me is not None and me._active and me._answers is None:
                    me._attach_route(_torch)

            torch.cuda._lazy_call(attach_later)
        else:
            self._attach_route(torch)

    def _attach_route(self, torch) -> None:
        try:
            answers = _alloc.TorchAnswers(torch)
        except Exception as e:  # noqa: BLE001
            self.route = _alloc.Route("segments", f"cannot find PyTorch's allocator: {e}")
            return
        self.use_answers(answers)

    def use_answers(self, answers) -> "_alloc.Route":
        """Attach the allocator route through ``answers`` (PyTorch's, or a
        stand-in's in the tests)."""
        self.route = _alloc.attach(answers)
        if self.route.route == "allocator":
            self._answers = answers
            self._remember_segments()  # e.g. the probe's: emptied before a report reads the peak
        return self.route

    def _remember_segments(self) -> None:
        """Note the segments PyTorch holds now, so that a past snapshot (the
        peak) counts them as PyTorch's even if they are gone by the time it is
        read (torch.cuda.empty_cache())."""
        try:
            self._pool_segments.update((seg.device, seg.address) for seg in self._answers.view())
        except Exception:  # noqa: BLE001 - a figure for later reports, never the user's error
            pass

    def on_stop(self, tracker) -> None:
        self._active = False
        self._hooks_on[0] = False
        if self._answers is not None:
            self._remember_segments()
            _alloc.detach()
            self._answers = None
        watcher = getattr(self, "_watcher", None)
        if watcher is not None and watcher in sys.meta_path:
            sys.meta_path.remove(watcher)
        self.graph.stop()
        if self._wrapped:
            _precise.detach_wrappers()
            self._wrapped = False
        if self._nodes_attached:
            _core.nodes_attach(None)
            self._nodes_attached = False
        if self._seq_attached:
            _core.seqmap_attach(0)
            self._seq_attached = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()

    # -- autograd labels ---------------------------------------------------

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
        hooked again; the hooks set the same label, so that only costs time.

        PyTorch registers a node pre-hook through
        ``torch.autograd.Function._register_hook``, which builds a
        RemovableHandle per hook: over half of the walk. memviz never removes
        these hooks one by one (they go with the graph, and go inert when
        tracking stops), so during the walk, on this thread only, that
        function is replaced by one that gives a node a fresh dict holding
        the hook and no handle. The dict is weak-referenceable like PyTorch's
        own, so hooks the user adds later to the same node work as usual."""
        seen = set()
        stack = [r for r in roots if r is not None]
        nodes, seqs = [], []
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            nodes.append(node)
            seqs.append(node._sequence_nr())  # AccumulateGrad's is 2**64-1: none
            for fn, _ in node.next_functions:
                if fn is not None and fn not in seen:
                    stack.append(fn)
        hooks = self._node_hooks
        make = self._prehook_for
        forwards = self._forward_lines(seqs)
        cls = self._function_cls
        if cls is None:  # not installed through _install (no torch.autograd.Function at hand)
            for node, forward in zip(nodes, forwards):
                name = node.name()
                node.register_prehook(hooks.get((name, forward)) or make(name, forward))
            return
        # Backwards on two threads walk one after the other, so that each
        # puts back exactly what it found.
        with _REGISTER_LOCK:
            own = cls.__dict__.get("_register_hook")
            original = cls._register_hook
            me = threading.get_ident()

            def register(d, hook, _original=original, _me=me, _ident=threading.get_ident):
                if d is None and _ident() == _me:
                    return _NodeHooks(memviz=hook), None
                return _original(d, hook)

            cls._register_hook = staticmethod(register)
            try:
                for node, forward in zip(nodes, forwards):
                    name = node.name()
                    node.register_prehook(hooks.get((name, forward)) or make(name, forward))
            finally:
                if own is not None:
                    cls._register_hook = own
                else:
                    del cls._register_hook

    def _patch_backward(self, torch) -> None:
        import torch.autograd as autograd
        import torch.autograd.graph as agraph

        original = agraph._engine_run_backward
        integ = self

        def _engine_run_backward(t_outputs, *args, **kwargs):
            if integ._active and integ.autograd and not integ._nodes_attached and integ._hooks_allowed:
                # else the callback names nodes itself (or, by default, nobody pays for hooks)
                try:
                    roots = [agraph._get_grad_fn_or_grad_acc(t) for t in t_outputs]
                    integ._hook_graph(roots)
                except Exception:  # noqa: BLE001 - attribution must never break backward
                    pass
            saved = _core.label_get()  # CPU backward runs nodes on this thread
            BACKWARD.enter()
            try:
                return original(t_outputs, *args, **kwargs)
            finally:
                BACKWARD.leave()
                _core.label_set(saved)

        for module in (agraph, autograd):
            if getattr(module, "_engine_run_backward", None) is original:
                self._patched.append((module, "_engine_run_backward", original))
                setattr(module, "_engine_run_backward", _engine_run_backward)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._optimizers.add(optimizer)

    # -- out of memory -----------------------------------------------------

    def _on_oom(self, device, alloc, device_total, device_free) -> None:
        from memviz.torch.oom import capture_oom

        tracker = self._tracker()
        if tracker is not None:
            try:
                self.oom_report = capture_oom(tracker, self, device, alloc, device_total, device_free)
            except Exception as e:  # noqa: BLE001 - never change the user's exception
                self.oom_report = None
                tracker._oom_error = repr(e)

    # -- categories --------------------------------------------------------

    def _scan(self):
        """One pass over the objects Python tracks: parameters, optimizers,
        and the storage address of every reachable tensor."""
        import gc
        import warnings

        import torch

        tensor, param, optim = torch.Tensor, torch.nn.Parameter, torch.optim.Optimizer
        params, optimizers, ptrs, roots = [], set(self._optimizers), set(), []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance() on deprecated torch aliases warns
            for obj in gc.get_objects():
                try:
                    is_tensor = isinstance(obj, tensor)
                except ReferenceError:  # a weakref.proxy whose referent died (torch.compile makes them)
                    continue
                if is_tensor:
                    if isinstance(obj, param):
                        params.append(obj)
                    try:
                        ptrs.add(obj.untyped_storage().data_ptr())
                        fn = obj.grad_fn
                        if fn is not None:
                            roots.append(fn)
                    except Exception:  # noqa: BLE001 - sparse, meta, subclasses
                        pass
                else:
                    try:
                        if isinstance(obj, optim):
                            optimizers.add(obj)
                    except ReferenceError:
                        continue
        with BACKWARD.quiet() as ok:  # saved tensors are released by the engine without the GIL
            self._saved_ptrs = _saved_by_graphs(roots) if ok else set()
        self.categories_partial = not ok
        return params, optimizers, ptrs

    def tensor_categories(self, params, optimizers) -> Dict[int, str]:
        """{storage data_ptr: category}: parameters, gradients, optimizer
        state, activations. Keyed by address alone: with unified addressing,
        device and pinned host pointers never overlap (and CPU tensors can be
        matched too)."""
        import torch

        cats: Dict[int, str] = {}

        def put(t, cat):
            if isinstance(t, torch.Tensor):
                try:
                    cats[t.untyped_storage().data_ptr()] = cat
                except Exception:  # noqa: BLE001
                    pass

        for ptr in getattr(self, "_saved_ptrs", ()):
            cats[ptr] = "activation"
        for rec in self.graph.resident():
            if rec.data_ptr:
                cats[rec.data_ptr] = "activation"
        params = list(params)
        for opt in optimizers:
            for state in opt.state.values():
                for v in state.values():
                    put(v, "optimizer_state")
            for group in opt.param_groups:
                params.extend(group["params"])
        with BACKWARD.quiet() as ok:  # the engine writes .grad without the GIL
            for p in params:
                put(p, "parameter")
                if ok and p.grad is not None:
                    put(p.grad, "gradient")
        if not ok:
            self.categories_partial = True
        return cats

    def torch_segments(self) -> Dict[int, list]:
        """{device: [(address, size)]} of PyTorch's caching-allocator segments."""
        import torch

        out: Dict[int, list] = {}
        if not torch.cuda.is_initialized() or _precise.active():
            return out
        for seg in torch.cuda.memory.memory_snapshot():
            out.setdefault(seg["device"], []).append((seg["address"], seg["total_size"]))
        return out

    def categorize(self, snap: Snapshot, *, live_now: bool = True) -> Snapshot:
        """The same snapshot with each allocation's category (and recomputation
        marked on autograd labels)."""
        if "torch" not in sys.modules:
            return snap
        params, optimizers, live = self._scan()
        cats = self.tensor_categories(params, optimizers)
        allocations, pool = list(snap.allocations), None
        answers = self._answers
        if answers is None and self.route_from is not None:
            answers = self.route_from._answers
            self.route = self.route_from.route
        if answers is not None or self._pool_segments or any(a.kind == "block" for a in allocations):
            view = answers.view() if (live_now and answers is not None) else None
            allocations, pool = _segments.reconcile(allocations, view, self._pool_segments)
        segments = self.torch_segments()
        precise = _precise.active()
        current = None if live_now else {r[0] for r in _core.live()}
        out = []
        for a in allocations:
            cat = _category(a, cats, live, segments, precise, current)
            node, fwd = a.autograd_node, a.forward
            if node and a.traceback and any(_CHECKPOINT_FILE in f.filename for f in a.traceback):
                # Forward re-run by activation checkpointing: the line being
                # recomputed is the allocation's own user frame.
                node = f"{node} (recomputation)"
                uf = a.traceback.user_frame
                fwd = f"{uf.filename}:{uf.lineno}" if uf else fwd
            out.append(a._replace(category=cat, autograd_node=node, forward=fwd))
        new = Snapshot(out, timestamp_ns=snap.timestamp_ns, devices=snap.devices,
                       frame_filter=snap.frame_filter)
        new.torch_stats = torch_stats()
        new.segments = pool
        new.pytorch = self.route.as_dict() if self.route is not None else None
        return new


class _PostImport:
    """A meta-path finder that runs ``callback`` right after module ``name``
    finished importing, then removes itself."""

    def __init__(self, name, callback):
        self.name, self.callback, self._busy = name, callback, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._busy:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module
        finder = self

        def exec_module(module):
            original(module)
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
            finder.callback()

        spec.loader.exec_module = exec_module
        return spec


_LIBRARIES = (("cupy", "CuPy"), ("jax", "JAX"), ("jaxlib", "JAX"), ("nccl", "NCCL"),
              ("torch/distributed", "NCCL"), ("tensorflow", "TensorFlow"), ("numba", "Numba"))


def _library_of(a) -> Optional[str]:
    for f in innermost_first(a.traceback):  # the innermost library that asked
        fn = f.filename.replace("\\", "/")
        for needle, name in _LIBRARIES:
            if f"/{needle}/" in fn or fn.startswith(f"{needle}/"):
                return name
    return None


#: calls (Allocation.op) and backward nodes that take a cuBLAS/cuBLASLt
#: workspace from PyTorch's allocator the first time they run on a thread
#: and stream; the workspace then lives as long as the handle
_BLAS_CALLS = frozenset(("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "addbmm", "einsum",
                         "_scaled_mm", "tensordot", "scaled_dot_product_attention", "addmv", "mv"))
_BLAS_NODES = ("MmBackward", "AddmmBackward", "BmmBackward", "BaddbmmBackward", "LinearBackward",
               "MatmulBackward", "AddbmmBackward", "ScaledDotProduct")


def _is_blas_workspace(a) -> bool:
    op = a.op or ""
    name = op.rsplit(".", 1)[-1].lower()  # torch.nn.functional.linear -> linear, x.matmul -> matmul
    return op == "operator @" or name in _BLAS_CALLS or (a.autograd_node or "").startswith(_BLAS_NODES)


def _category(a, cats, live, segments, precise, current) -> str:
    if a.category:  # set when put together with its segment (unused_pool)
        return a.category
    if a.kind == "static":
        return "outside_pytorch/CUDA module globals"
    lib = _library_of(a)
    if lib is not None:
        return f"outside_pytorch/{lib}"
    key = a.address
    cat = cats.get(key)
    if cat is not None:
        return cat
    if a.kind == "host":
        return "pinned_host"
    if precise or a.kind == "block":
        if key in live:
            return "other_pytorch"
        now = current is None or key in current
        if precise and now and a.kind == "device" and _precise.from_stream_ordered_pool(key) is False:
            # Not from PyTorch's cudaMallocAsync pool: the driver call of a library,
            # such as cuBLAS's own workspace (not in memory_allocated()).
            return "outside_pytorch/cublas" if _is_blas_workspace(a) else "outside_pytorch"
        if now and _is_blas_workspace(a):
            return "workspace/cublas"  # live, reached by no Python object, made by a matmul
        if current is not None and key not in current:
            return "temporary"  # a past snapshot (the peak): freed since, not saved for backward
        if a.autograd_node or a.stream:
            return "temporary"
        return "other_pytorch"
    for base, size in segments.get(a.device, ()):
        if base <= a.address < base + size:
            return "pytorch_pool"
    if _is_blas_workspace(a):  # cuBLAS/cuBLASLt's own cudaMalloc inside a matrix multiply
        return "outside_pytorch/cublas"
    return "outside_pytorch"


def torch_stats() -> Dict[int, Dict[str, int]]:
    """PyTorch's own figures per device (allocated, reserved, active)."""
    torch = sys.modules.get("torch")
    out: Dict[int, Dict[str, int]] = {}
    if torch is None or not torch.cuda.is_initialized():
        return out
    for d in range(torch.cuda.device_count()):
        try:
            st = torch.cuda.memory_stats(d)
        except Exception:  # noqa: BLE001
            continue
        out[d] = {"allocated": st.get("allocated_bytes.all.current", 0),
                  "reserved": st.get("reserved_bytes.all.current", 0),
                  "active": st.get("active_bytes.all.current", 0),
                  "peak_allocated": st.get("allocated_bytes.all.peak", 0)}
    return out

