"""What each allocation of a snapshot is for (its category): parameters,
gradients, optimizer state, activations, PyTorch's pool, cuBLAS
workspaces, collective (NCCL) buffers, other libraries' memory; and
PyTorch's own figures per device (torch_stats).

Distributed training: a DTensor (FSDP2's parameter and gradient shards,
tensor parallelism) is its local shard; FSDP1's FlatParameter brings its
padded, unsharded and low-precision copies and its gradient shards; the
unsharded parameters FSDP allocates before a layer runs are parameters even
once freed again. What a collective allocates, through PyTorch
(``pytorch/nccl``: its outputs and buffers, NCCL's tensors from PyTorch's
allocator, DDP's buckets) or by a driver call of NCCL itself
(``outside_pytorch/nccl``), is told by the innermost Python frame (in
c10d or the collectives of FSDP, DTensor and DDP), by the call that frame
was making (``.allreduce``, ``dist.Reducer``, ...) or, with no Python frame,
by the thread (PyTorch's ``pt_nccl_*`` threads, NCCL's own where
NCCL_SET_THREAD_NAME=1 names them). Only the innermost frame counts: an
activation made inside FSDP1's or DDP's forward, or a DTensor op, is not
collective memory.

``torch.compile``: what is allocated while compiling (dynamo's tracing,
AOTAutograd's, Inductor's lowering, its autotuning and padding benchmarks)
is ``compile``, told by a frame of the compiler's compile-time files in the
stack (the deep-stack walk keeps the user's line that called the compiled
model, src/frames.c). CUDA graphs: a block inside a segment of a CUDA
graph's private pool (its ``segment_pool_id`` is not the default pool's)
is ``cuda_graph_pool``; one in a ``torch.cuda.MemPool`` of the user's is
``private_pool``; ``torch_stats`` says how much graph pools reserve and
hold per device.

May import: memviz._core, memviz.model, memviz.torch.precise,
memviz.torch.hooks (floors: docs/architecture.md); torch only inside
functions.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Dict, Optional

import memviz._core as _core
from memviz.model import segments as _segments
from memviz.model.snapshot import Snapshot
from memviz.model.traceback import innermost_first
from memviz.torch import precise as _precise
from memviz.torch.hooks import BACKWARD, listed, saved_by_graphs

__all__ = ["Categories", "torch_stats"]

_CHECKPOINT_FILE = "torch/utils/checkpoint.py"



def _retire_gone(allocations, view) -> None:
    """Blocks read from PyTorch when tracking started whose tensors were
    freed since: their frees go through PyTorch's own deleter, which memviz
    does not see, so PyTorch's view now says they are gone; the store
    records their frees (late, each only if that very allocation is still
    there), so that the totals and every later peak stop counting them."""
    held = {b[0] for seg in view for b in seg.blocks if b[2] != "inactive"}
    gone = [(a.address, a.timestamp_ns) for a in allocations
            if a.kind == "block" and a.before_tracking and a.address not in held]
    if gone:
        _core.retire(_core.KIND_BLOCK, gone)

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
        #: thread trains (see memviz.torch.hooks.BACKWARD); or an optimizer's
        #: state, which another thread kept changing as it was read (listed)
        self.categories_partial = False
        self._shared_scan: Optional[Dict[str, Any]] = None  # one_scan()'s, while it runs

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._optimizers.add(optimizer)

    @contextlib.contextmanager
    def one_scan(self):
        """Within it, every categorize() shares one pass over the heap and
        one read of PyTorch's segments: a trace's END and a flight dump
        categorise three snapshots (the peak, the end, the tensor peak) of
        one moment, and the pass costs about half a second per million
        Python objects (benchmarks/bench_flight_dump.py)."""
        if self._shared_scan is not None:  # nested: the outer one's
            yield
            return
        self._shared_scan = {}
        try:
            yield
        finally:
            self._shared_scan = None

    def _once(self, key: str, make):
        """make(), or within one_scan() the value it gave the first time."""
        shared = self._shared_scan
        if shared is None:
            return make()
        if key not in shared:
            shared[key] = make()
        return shared[key]

    def _scan_shared(self):
        return self._once("scan", self._scan)

    def _segments_shared(self):
        """torch_segments(), with self._private_segments as that call left it."""
        segments, self._private_segments = self._once(
            "segments", lambda: (self.torch_segments(), getattr(self, "_private_segments", None)))
        return segments

    def _scan(self):
        """One pass over the objects Python tracks: parameters, optimizers,
        and the storage address of every reachable tensor."""
        import warnings

        import torch

        tensor, param, optim = torch.Tensor, torch.nn.Parameter, torch.optim.Optimizer
        # CUDA graphs alive (their pools): none before CUDA is initialised; an
        # exact type test, one pointer compare per object of the pass
        graph = getattr(torch.cuda, "CUDAGraph", None) if torch.cuda.is_initialized() else None
        # the optimizers whose step() ran: a training thread may add one while this reads
        refs = listed(self._optimizers.data) or []
        params, optimizers, ptrs, roots = [], {o for o in (r() for r in refs) if o is not None}, set(), []
        self._graph_pools = pools = set()  # the private pools of the CUDA graphs alive
        # By type, in C (memviz/_core heap_kinds): an isinstance() loop here cost
        # about a microsecond an object, seconds in a big process's out-of-memory dump.
        # It reads gc.get_objects() itself: that list, held while another thread ran,
        # broke the thread's tuple() (src/module_heap.c)
        tensors, optims, graphs = _core.heap_kinds(None, tensor, optim, graph)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance() on deprecated torch aliases warns
            for obj in tensors:
                if isinstance(obj, param):
                    params.append(obj)
                try:
                    ptrs.add(_storage_ptr(obj))
                    fn = obj.grad_fn
                    if fn is not None:
                        roots.append(fn)
                except Exception:  # noqa: BLE001 - sparse, meta, subclasses
                    pass
        optimizers.update(optims)
        for g in graphs:
            pools.add(_pool_id(g))
        del tensors, optims, graphs
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
                    cats[_storage_ptr(t)] = cat
                except Exception:  # noqa: BLE001
                    pass

        for ptr in self._saved_ptrs:
            cats[ptr] = "activation"
        for rec in self.graph.resident():
            if rec.data_ptr:
                cats[rec.data_ptr] = "activation"
        params, unread = list(params), False
        for opt in optimizers:
            # Another thread's step() fills opt.state (its first step) while this
            # reads it: copies taken in C (listed), never a Python loop over the dict
            states = listed(opt.state.values())
            unread |= states is None
            for state in states or ():
                values = listed(state.values())
                unread |= values is None
                for v in values or ():
                    put(v, "optimizer_state")
            for group in list(opt.param_groups):
                params.extend(group["params"])
        with BACKWARD.quiet() as ok:  # the engine writes .grad without the GIL
            for p in params:
                put(p, "parameter")
                if ok and p.grad is not None:
                    put(p.grad, "gradient")
                if hasattr(p, "_local_shard"):  # FSDP1's FlatParameter: its other copies
                    for name, cat in _FLAT_PARAMETER_COPIES:
                        put(getattr(p, name, None), cat)
        if unread or not ok:
            self.categories_partial = True
        return cats

    def torch_segments(self) -> Dict[int, list]:
        """{device: [(address, size)]} of PyTorch's caching-allocator segments
        (and, in ``self._private_segments``, those of private pools: see
        :func:`private_segments`)."""
        import torch

        out: Dict[int, list] = {}
        self._private_segments = {}
        if not torch.cuda.is_initialized() or _precise.active():
            return out
        raw = torch.cuda.memory.memory_snapshot()
        for seg in raw:
            out.setdefault(seg["device"], []).append((seg["address"], seg["total_size"]))
        self._private_segments = private_segments(raw, getattr(self, "_graph_pools", None))
        return out

    def categorize(self, snap: Snapshot, *, live_now: bool = True) -> Snapshot:
        """The same snapshot with each allocation's category (and recomputation
        marked on autograd labels)."""
        if "torch" not in sys.modules:
            return snap
        params, optimizers, live = self._scan_shared()
        cats = self.tensor_categories(params, optimizers)
        allocations, pool = list(snap.allocations), None
        answers = self._answers
        if answers is None and self.route_from is not None:
            answers = self.route_from._answers
            self.route = self.route_from.route
        if answers is not None or self._pool_segments or any(a.kind == "block" for a in allocations):
            view = answers.view() if (live_now and answers is not None) else None
            if view is not None:
                _retire_gone(allocations, view)
            allocations, pool = _segments.reconcile(allocations, view, self._pool_segments)
        segments = self._segments_shared()
        private = getattr(self, "_private_segments", None) or {}
        precise = _precise.active()
        current = None if live_now else {r.address for r in _core.live()}
        out, memo = [], {}
        for a in allocations:
            cat = _category(a, cats, live, segments, precise, current, memo, private)
            node, fwd = a.autograd_node, a.forward
            if node and a.traceback and _recomputing(a.traceback):
                # Forward re-run by activation checkpointing: the line being
                # recomputed is the allocation's own user frame.
                node = f"{node} (recomputation)"
                uf = a.traceback.user_frame
                fwd = f"{uf.filename}:{uf.lineno}" if uf else fwd
            out.append(a._replace(category=cat, autograd_node=node, forward=fwd))
        new = Snapshot(out, timestamp_ns=snap.timestamp_ns, devices=snap.devices,
                       frame_filter=snap.frame_filter)
        new.torch_stats = torch_stats(getattr(self, "_graph_pools", None))
        new.segments = pool
        new.pytorch = self.route.as_dict() if self.route is not None else None
        return new


def _recomputing(tb) -> bool:
    """Whether an allocation made during backward belongs to a forward re-run by
    activation checkpointing: under a frame of torch/utils/checkpoint.py, with
    no autograd engine entered since. checkpoint(use_reentrant=True) re-runs the
    forward and then runs a backward of its own from inside checkpoint.py: that
    backward's allocations are gradient work, not recomputation."""
    for i in range(len(tb) - 1, -1, -1):  # the most recent frame first
        fn = tb[i].filename
        if _CHECKPOINT_FILE in fn:
            return True
        if fn.endswith(_ENGINE_ENTRIES):
            return False
    return False


#: the files through which Python enters the autograd engine (backward(),
#: autograd.grad(), the engine's run)
_ENGINE_ENTRIES = ("torch/autograd/__init__.py", "torch/autograd/graph.py")


def _storage_ptr(t) -> int:
    """Where a tensor's storage starts; a DTensor's is its local shard's (a
    DTensor has no storage of its own)."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        t = local
    return t.untyped_storage().data_ptr()


#: FSDP1's FlatParameter: (attribute, category) of the tensors it keeps
#: beside its own (sharded) data and .grad
_FLAT_PARAMETER_COPIES = (("_local_shard", "parameter"), ("_full_param_padded", "parameter"),
                          ("_full_prec_full_param_padded", "parameter"), ("_mp_shard", "parameter"),
                          ("_saved_grad_shard", "gradient"), ("_cpu_grad", "gradient"))

_LIBRARIES = (("cupy", "CuPy"), ("jax", "JAX"), ("jaxlib", "JAX"), ("nccl", "nccl"),
              ("tensorflow", "TensorFlow"), ("numba", "Numba"))

#: frames that only pass a call on (an op's dispatch, a decorator): the
#: frame behind them says who allocated
_PLUMBING = ("torch/_ops.py", "torch/utils/_contextlib.py", "torch/_compile.py",
             "torch/_dynamo/eval_frame.py", "torch/distributed/c10d_logger.py", "contextlib.py",
             "functools.py")
#: files whose own allocations are collective memory: c10d, the functional
#: collectives, the collectives of FSDP2, DTensor's redistribution, DDP's
#: communication hooks, symmetric memory
_COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives",
                     "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
                     "torch/distributed/tensor/_collective_utils.py",
                     "torch/distributed/tensor/_redistribute.py", "torch/distributed/algorithms/",
                     "torch/distributed/_symmetric_memory/")
#: calls (the last part of Allocation.op) that are c10d's own: a process
#: group's collectives, DDP's Reducer (its buckets, made again after the
#: first step by _rebuild_buckets) and the broadcast of its parameters
_COLLECTIVE_CALLS = frozenset((
    "allreduce", "all_reduce", "allreduce_coalesced", "all_reduce_coalesced", "allgather", "all_gather",
    "all_gather_into_tensor", "allgather_into_tensor_coalesced", "_allgather_base", "allgather_coalesced",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "_reduce_scatter_base",
    "alltoall", "alltoall_base", "all_to_all", "all_to_all_single", "batch_isend_irecv",
    "_broadcast_coalesced", "Reducer", "_rebuild_buckets", "_get_zeros_like_grad_buckets", "_run_comm_hook",
    "_verify_params_across_processes", "monitored_barrier", "eager_connect_single_device",
    "_set_default_backend"))
#: (file, function) of the innermost frame where FSDP allocates a layer's
#: unsharded parameters (before it runs; freed after): FSDP2's alloc_storage,
#: FSDP1's _alloc_storage
_FSDP_UNSHARD = (("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "alloc_storage"),
                 ("torch/distributed/utils.py", "_alloc_storage"))
#: thread names of NCCL's and c10d's threads (allocations without Python frames)
_NCCL_THREADS = ("pt_nccl", "NCCL ")


def _library_of(a) -> Optional[str]:
    for f in innermost_first(a.traceback):  # the innermost library that asked
        fn = f.filename.replace("\\", "/")
        for needle, name in _LIBRARIES:
            if f"/{needle}/" in fn or fn.startswith(f"{needle}/"):
                return name
    return None


def _innermost_torch_frame(a) -> Optional[Any]:
    """The innermost frame that is not plumbing (None without Python frames)."""
    for f in innermost_first(a.traceback or ()):
        fn = f.filename.replace("\\", "/")
        if not fn.endswith(_PLUMBING):
            return f
    return None


def _in(filename: str, needle: str) -> bool:
    fn = filename.replace("\\", "/")
    return f"/{needle}" in fn or fn.startswith(needle)


def _fsdp_unshard(a) -> bool:
    """Made where FSDP allocates a layer's unsharded parameters."""
    f = _innermost_torch_frame(a)
    return f is not None and any(f.name == name and _in(f.filename, file) for file, name in _FSDP_UNSHARD)


def _is_collective(a) -> bool:
    """Made by a collective: c10d, FSDP's or DTensor's collectives, DDP's
    Reducer, or a thread of NCCL's or c10d's (see the module docstring)."""
    if not a.traceback:
        name = getattr(a.thread, "name", "") or ""
        return name.startswith(_NCCL_THREADS)
    op = (a.op or "").rsplit(".", 1)[-1]
    if op in _COLLECTIVE_CALLS:
        return True
    f = _innermost_torch_frame(a)
    return f is not None and any(_in(f.filename, needle) for needle in _COLLECTIVE_FILES)


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


#: files only a compile runs: dynamo's tracing, AOTAutograd's, Inductor's
#: lowering, code generation, autotuning and padding benchmarks (never the
#: runtime of compiled code: eval_frame.py, aot_autograd.py's forward,
#: runtime_wrappers.py, output_code.py and the generated modules are not
#: here; a backward compiled at its first call is told by compile_fx.py)
_COMPILE_FILES = ("torch/_dynamo/convert_frame.py", "torch/_dynamo/symbolic_convert.py",
                  "torch/_dynamo/output_graph.py", "torch/_dynamo/variables/",
                  "torch/_functorch/_aot_autograd/graph_compile.py", "torch/_functorch/_aot_autograd/graph_capture.py",
                  "torch/_functorch/_aot_autograd/collect_metadata_analysis.py",
                  "torch/_functorch/_aot_autograd/jit_compile_runtime_wrappers.py", "torch/_functorch/partitioners.py",
                  "torch/_inductor/compile_fx.py", "torch/_inductor/graph.py", "torch/_inductor/lowering.py",
                  "torch/_inductor/scheduler.py", "torch/_inductor/select_algorithm.py",
                  "torch/_inductor/fx_passes/", "torch/_inductor/autotune_process.py",
                  "torch/_inductor/runtime/benchmarking.py", "torch/_inductor/codegen/",
                  "torch/_inductor/kernel/", "torch/_inductor/compile_worker/", "torch/_inductor/async_compile.py",
                  "torch/_inductor/freezing.py", "torch/_inductor/constant_folding.py")


#: functions of compile-time files that run compiled code, not the compiler:
#: Inductor's CUDA-graph wrapper (``mode="reduce-overhead"``: every call of
#: the compiled model goes through compile_fx.cudagraphify's ``run``)
_RUNTIME_FUNCTIONS = {"torch/_inductor/compile_fx.py": frozenset((
    "run", "cudagraphify", "cudagraphify_impl", "static_input", "index_expanded_dims_and_copy_"))}


def is_compile(a) -> bool:
    """Allocated while ``torch.compile`` compiled: a frame of a compile-time
    file of the compiler (``_COMPILE_FILES``) in its stack, other than one of
    the functions of those files that run the compiled code
    (``_RUNTIME_FUNCTIONS``)."""
    for f in a.traceback or ():
        if _compile_file(f.filename) and not _runtime_function(f):
            return True
    return False


def _runtime_function(f) -> bool:
    fn = f.filename.replace("\\", "/")
    for needle, names in _RUNTIME_FUNCTIONS.items():
        # the name is a qualified one where Python records it so ("cudagraphify.<locals>.run")
        if (f"/{needle}" in fn or fn.startswith(needle)) and f.name.rsplit(".", 1)[-1] in names:
            return True
    return False


def _compile_file(filename: str, _memo: Dict[str, bool] = {}) -> bool:  # noqa: B006 - a memo
    hit = _memo.get(filename)
    if hit is None:
        fn = filename.replace("\\", "/")
        hit = _memo[filename] = any(f"/{needle}" in fn or fn.startswith(needle) for needle in _COMPILE_FILES)
    return hit


def _pool_id(graph) -> Optional[tuple]:
    """A CUDA graph's pool id (after its capture), or None."""
    try:
        return tuple(graph.pool())
    except Exception:  # noqa: BLE001 - not captured yet, or reset
        return None


def private_segments(raw, graph_pools=None) -> Dict[int, list]:
    """{device: [(address, size, category)]} of the segments of private pools
    in ``torch.cuda.memory_snapshot()``'s list: a CUDA graph's pool
    (``cuda_graph_pool``: the pool of a ``torch.cuda.CUDAGraph`` alive,
    ``graph_pools``, as CUDA-graph trees and ``torch.cuda.graph`` hold them;
    else told by its id: (n, 0), as ``graph_pool_handle()`` and a capture
    make them) or a ``torch.cuda.MemPool`` made by the user
    (``private_pool``: (0, n))."""
    out: Dict[int, list] = {}
    graph_pools = graph_pools or ()
    for seg in raw:
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        if len(pool) != 2 or pool == (0, 0):
            continue
        cat = "cuda_graph_pool" if pool in graph_pools or pool[0] != 0 else "private_pool"
        out.setdefault(seg["device"], []).append((seg["address"], seg["total_size"], cat))
    return out


def _private_of(a, private) -> Optional[str]:
    for base, size, cat in private.get(a.device, ()):
        if base <= a.address < base + size:
            return cat
    return None


def _stack_facts(a, memo: Optional[dict]) -> tuple:
    """(library, collective?, FSDP unshard?, compile?) of an allocation's
    stack, call and thread: worked out once per stack in a snapshot
    (``memo``, keyed by the Traceback object the snapshot's allocations of
    one stack share)."""
    if memo is None:
        return _library_of(a), _is_collective(a), _fsdp_unshard(a), is_compile(a)
    key = (id(a.traceback), a.op, None if a.traceback else getattr(a.thread, "name", None))
    facts = memo.get(key)
    if facts is None:
        facts = memo[key] = (_library_of(a), _is_collective(a), _fsdp_unshard(a), is_compile(a), a.traceback)
    return facts[:4]


def _category(a, cats, live, segments, precise, current, memo: Optional[dict] = None,
              private: Optional[dict] = None) -> str:
    if a.category:  # set when put together with its segment (unused_pool)
        if private and a.kind == "device" and a.category == "unused_pool":
            # The rest of a private pool's segment is that pool's: a CUDA graph's
            # (the trees keep their outputs there without a block of the
            # allocator's), or a MemPool's; empty_cache() does not give it back.
            return _private_of(a, private) or a.category
        return a.category
    if a.kind == "static":
        return "outside_pytorch/CUDA module globals"
    lib, collective, unshard, compiling = _stack_facts(a, memo)
    if lib is not None:
        return f"outside_pytorch/{lib}"
    if compiling:
        return "compile"
    if private and a.kind == "block":
        pool = _private_of(a, private)
        if pool is not None:
            return pool
    key = a.address
    cat = cats.get(key)
    if cat is not None:
        return cat
    if a.kind == "host":
        return "pinned_host"
    if precise or a.kind == "block":
        now = current is None or key in current

        def foreign() -> bool:
            # Not from PyTorch's cudaMallocAsync pool: the driver call of a library,
            # such as NCCL's buffers or cuBLAS's own workspace (not in memory_allocated()).
            return precise and now and a.kind == "device" and _precise.from_stream_ordered_pool(key) is False

        if collective:
            return "outside_pytorch/nccl" if foreign() else "pytorch/nccl"
        if unshard:  # a layer's unsharded parameters, maybe freed since
            return "parameter"
        if key in live:
            return "other_pytorch"
        if foreign():
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
    if collective:  # NCCL's own driver call (its buffers, made inside a c10d call)
        return "outside_pytorch/nccl"
    if _is_blas_workspace(a):  # cuBLAS/cuBLASLt's own cudaMalloc inside a matrix multiply
        return "outside_pytorch/cublas"
    return "outside_pytorch"


def torch_stats(graph_pools=None) -> Dict[int, Dict[str, int]]:
    """PyTorch's own figures per device (allocated, reserved, active), and
    what CUDA graphs' private pools hold: a pool made by a capture ((n, 0))
    or one of ``graph_pools`` (the pools of the CUDA graphs alive, as
    CUDA-graph trees make them with ``graph_pool_handle()``: (0, n))."""
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
    try:
        raw = torch.cuda.memory.memory_snapshot()
    except Exception:  # noqa: BLE001
        return out
    for seg in raw:
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        if len(pool) == 2 and (pool[0] != 0 or pool in (graph_pools or ())):  # a CUDA graph's private pool
            d = out.get(seg["device"])
            if d is None:
                continue
            d["graph_pools_reserved"] = d.get("graph_pools_reserved", 0) + seg.get("total_size", 0)
            d["graph_pools_allocated"] = d.get("graph_pools_allocated", 0) + seg.get("allocated_size", 0)
    return out

