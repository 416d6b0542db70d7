"""What each allocation of a snapshot is for (its category): parameters,
gradients, optimizer state, activations, PyTorch's pool, cuBLAS
workspaces, other libraries' memory; and PyTorch's own figures per device
(torch_stats).

May import: memviz._core, memviz.model, memviz.torch.precise,
memviz.torch.hooks (floors: docs/architecture.md); torch only inside
functions.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Dict, Optional

import memviz._core as _core
from memviz.model import segments as _segments
from memviz.model.snapshot import Snapshot
from memviz.model.traceback import innermost_first
from memviz.torch import precise as _precise
from memviz.torch.hooks import BACKWARD, saved_by_graphs

__all__ = ["Categories", "torch_stats"]

_CHECKPOINT_FILE = "torch/utils/checkpoint.py"


class Categories:
    """The categorising side of the PyTorch integration, mixed into
    memviz.torch.integration.TorchIntegration. Its state is set by
    ``_init_categories``; it reads the integration's ``graph`` (graph
    residency) and allocator route (``route``, ``route_from``, ``_answers``,
    ``_pool_segments``)."""

    graph: Any
    route: Any
    route_from: Any
    _answers: Any
    _pool_segments: set

    def _init_categories(self) -> None:
        self._optimizers: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._saved_ptrs: set = set()  # what autograd graphs kept at the last scan
        #: the last snapshot left gradients and saved tensors unread: another
        #: thread trains (see memviz.torch.hooks.BACKWARD)
        self.categories_partial = False

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._optimizers.add(optimizer)

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
            self._saved_ptrs = saved_by_graphs(roots) if ok else set()
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

        for ptr in self._saved_ptrs:
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
        current = None if live_now else {r.address for r in _core.live()}
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

